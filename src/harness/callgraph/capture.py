"""torchlens capture of one prefill forward and one decode step, plus FlopCounterMode per module.

The model has no ``forward`` of its own (a request is ``image_embeddings`` + ``prefill`` +
``decode_step``), so each capture traces a small wrapper ``nn.Module`` whose forward runs one of
them. The wrapper registers the model's own top-level children (``model``, ``lm_head``) under
the same attribute names, so every module address torchlens records equals the model's
``named_modules()`` name (``model.sam_model.blocks.3.attn``); the model object itself is held
outside the module tree.

Every tensor the step reads is a forward argument (ids, image mask, pixels, the KV cache's K/V
tensors), never a captured outer tensor: torchlens re-runs a forward once when it finds tensor
arguments without provenance ("rescue re-run"), which would append to the KV cache twice and
double the routing counts. A capture that was re-run anyway is refused.

The MoE's per-expert loop (``.cpu().numpy()`` expert counts, Python ``for`` over experts with
tokens) needs no special handling: torchlens records the ops each called expert runs and the
host copy as one op; uncalled experts simply do not appear.

One forward per phase does both jobs: torchlens traces it while
``torch.utils.flop_counter.FlopCounterMode`` (a dispatch mode, independent of torchlens' Python
wrappers) counts matmul/conv/attention FLOPs per module (the ``flops_counted`` convention of
``harness.analytic``). Routing (tokens per routed expert per layer) comes from the MoE routing
sink during the same forward.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch
from torch import nn

OP_SKIP = ("input", "output", "buffer")


@dataclass
class Capture:
    """What one traced forward ran.

    ops      one dict per executed tensor op (torchlens compute ops, in execution order):
             ``i`` index, ``label`` torchlens label, ``func`` function name, ``stack`` module
             calls enclosing it outermost first as (address, call number), ``flops`` torchlens'
             FLOP estimate (2 per MAC, elementwise and bias included), ``parents`` indices of the
             ops whose outputs it reads.
    calls    {module address: number of calls}; ``classes`` {address: class name}
    counted  {module address: FlopCounterMode FLOPs of its calls, children included}; key ``""``
             is the whole forward
    routing  [layers, routed experts] tokens per expert in this forward (None without MoE)
    """

    phase: str
    ops: list
    calls: dict
    classes: dict
    counted: dict
    routing: Optional[np.ndarray]
    info: dict = field(default_factory=dict)


class _Step(nn.Module):
    """Wrapper whose children are the model's own top-level modules (same addresses)."""

    def __init__(self, model: nn.Module, run: Callable, children=("model", "lm_head")):
        super().__init__()
        for name in children:
            setattr(self, name, getattr(model, name))
        object.__setattr__(self, "_run", run)

    def forward(self, *args):
        return self._run(*args)


@contextlib.contextmanager
def routing_sink(model: nn.Module, layers: int, experts: int):
    """Collect [layers, experts] token counts from every reference MoE layer while the step runs
    (a ``RoutingCounter`` set on each ``MoE.routing``); yields the array, filled on exit."""
    from ..models.llm import MoE
    from ..models.routing import RoutingCounter

    arr = np.zeros((layers, experts), dtype=np.int64)
    counter = RoutingCounter(layers, experts)
    counter.phase("step")
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    saved = [m.routing for m in moes]
    for m in moes:
        m.routing = counter
    try:
        yield arr
    finally:
        for m, s in zip(moes, saved):
            m.routing = s
        arr += counter.result()["step"]


def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query_shape, key_shape, value_shape)


def flop_counter():
    """FlopCounterMode that also counts the CPU fused SDPA kernel.

    torch registers formulas for the CUDA SDPA kernels only; on the CPU,
    ``_scaled_dot_product_flash_attention_for_cpu`` would count 0. It gets the same formula
    (``sdpa_flop_count``: full S x T, 4 * B * H * S * T * d), which equals what the math backend's
    two ``bmm`` count, so the CPU run keeps its normal kernels and matches ``flops_counted``.
    """
    from torch.utils.flop_counter import FlopCounterMode

    custom = {}
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is not None:
        custom[op] = _cpu_sdpa_flop
    return FlopCounterMode(display=False, custom_mapping=custom)


def _flop_counts(fc) -> dict:
    """{module address: FLOPs}; ``""`` = the whole forward.

    FlopCounterMode names a module ``<Root>.<path>`` after the first root module it sees enter
    (our wrapper). A module object entered later as a root of its own (the vendor's
    ``DeepseekOCRForCausalLM``, which is not a child of the wrapper) renames its direct children
    (``DeepseekOCRForCausalLM.model``), so the first component is dropped whatever it is and
    counts landing on the same address are summed.
    """
    out: dict = {}
    for name, ops in fc.get_flop_counts().items():
        total = int(sum(ops.values()))
        if name == "Global":
            out[""] = total
            continue
        if "." not in name:
            continue
        key = name.split(".", 1)[1]
        out[key] = out.get(key, 0) + total
    return out


def trace_step(phase: str, wrapper: nn.Module, args: list, class_of: Callable[[str], str],
               routing_shape: Optional[tuple] = None, routing_model: Optional[nn.Module] = None,
               count_flops: bool = True) -> Capture:
    """Trace ``wrapper(*args)`` once with torchlens (metadata only, no activations kept)."""
    import torchlens as tl

    opts = tl.options.CaptureOptions(layers_to_save=None, detach_saved_activations=True,
                                      compute_input_output_distances=False, random_seed=0,
                                      unwrap_when_done=True)
    t0 = time.perf_counter()
    fc = flop_counter() if count_flops else contextlib.nullcontext()
    sink = (routing_sink(routing_model, *routing_shape) if routing_shape and routing_model is not None
            else contextlib.nullcontext(None))
    with warnings.catch_warnings(record=True) as caught, torch.no_grad(), sink as routing, fc:
        warnings.simplefilter("always")
        tr = tl.trace(wrapper, list(args), capture=opts)
    seconds = time.perf_counter() - t0
    if getattr(tr, "rescue_rerun", None):
        raise RuntimeError(f"torchlens re-ran the {phase} forward (rescue re-run: "
                           f"{tr.capture_verification_reason}); the KV cache and routing counts would be "
                           "doubled. Pass every tensor the step reads as a forward argument.")
    t1 = time.perf_counter()
    raw = [o for o in tr.ops if not (o.is_input or o.is_output or o.is_buffer)]
    index = {}
    for i, o in enumerate(raw):
        index[o.label] = i
        if o.num_passes == 1:
            index.setdefault(o.layer_label, i)
    ops = []
    for i, o in enumerate(raw):
        stack = []
        for entry in o.module_call_stack or ():
            addr, _, num = str(entry).rpartition(":")
            stack.append((addr, int(num) if num.isdigit() else 1))
        fl = o.flops_forward
        ops.append({"i": i, "label": o.label, "func": o.func_name, "stack": tuple(stack),
                    "flops": int(fl) if fl is not None else 0,
                    "parents": tuple(index[p] for p in (o.parents or ()) if p in index)})
    calls: dict = {}
    for mc in tr.module_calls:
        addr = mc.address
        if addr in ("self", ""):
            continue
        calls[addr] = calls.get(addr, 0) + 1
    classes = {addr: class_of(addr) for addr in calls}
    counted = _flop_counts(fc) if count_flops else {}
    info = {"torchlens": tl.__version__, "trace_s": round(seconds, 2), "postprocess_s": 0.0,
            "ops": len(ops), "module_calls": sum(calls.values()),
            "capture_verified": getattr(tr, "capture_verified", None),
            "warnings": sorted({f"{w.category.__name__}: {str(w.message).splitlines()[0][:200]}"
                                for w in caught})}
    info["postprocess_s"] = round(time.perf_counter() - t1, 2)
    cap = Capture(phase, ops, calls, classes, counted, None if routing is None else routing.copy(), info)
    del tr
    return cap


# ------------------------------------------------------------------------------ reference model

class _RefPrefill(_Step):
    pass


class _RefDecode(_Step):
    pass


def capture_reference(model: nn.Module, request, count_flops: bool = True, progress=print) -> dict:
    """{"prefill": Capture, "decode": Capture} for the reference model on ``request``.

    The prefill capture runs vision (every view) + prefill with a fresh KV cache; its argmax
    token then drives one decode step against that populated cache (cache length =
    ``request.prefill_tokens``).
    """
    from ..models.llm import KVCache

    cfg = model.cfg
    L = cfg.llm
    state: dict = {}

    def class_of(addr: str) -> str:
        return type(model.get_submodule(addr)).__name__

    def run_prefill(input_ids, images_seq_mask, global_views, tiles, grid):
        cache = KVCache(L.num_layers)
        img = model.image_embeddings(global_views, tiles, grid)
        logits = model.prefill(input_ids, images_seq_mask, img, cache)
        state["cache"], state["logits"] = cache, logits
        return logits

    def run_decode(token, keys, values):
        cache = KVCache(L.num_layers)
        cache.k, cache.v = list(keys), list(values)
        logits = model.decode_step(token, cache)
        state["decode_cache"] = cache
        return logits

    shape = (L.num_layers, L.n_routed_experts)
    progress(f"[graph] tracing prefill ({request.prefill_tokens} tokens, views "
             f"{'tiles+global' if request.tiles is not None else 'global'})")
    pre = trace_step("prefill", _RefPrefill(model, run_prefill),
                     [request.input_ids, request.images_seq_mask, request.global_views, request.tiles,
                      request.grid], class_of, shape, model, count_flops)
    logits = state["logits"]
    token = logits[:, -1].argmax(-1, keepdim=True)
    cache = state["cache"]
    pre.info["cache_len_after"] = cache.length
    pre.info["next_token"] = token.flatten().tolist()
    progress(f"[graph] prefill traced: {pre.info['ops']} ops in {pre.info['trace_s']} s; "
             f"tracing one decode step (cache {cache.length} tokens)")
    dec = trace_step("decode", _RefDecode(model, run_decode), [token, list(cache.k), list(cache.v)],
                     class_of, shape, model, count_flops)
    dec.info["cache_len_before"] = cache.length
    dec.info["cache_len_after"] = state["decode_cache"].length
    dec.info["token_in"] = token.flatten().tolist()
    progress(f"[graph] decode traced: {dec.info['ops']} ops in {dec.info['trace_s']} s")
    return {"prefill": pre, "decode": dec}
