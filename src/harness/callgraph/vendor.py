"""torchlens capture of the vendor model (``harness.models.vendor.loader.VendorOCR``), vendor files untouched.

Tracer-hostile spots of the vendor code and what is done about them (for the capture only,
restored afterwards):

* ``deepencoder.quick_gelu`` is ``@torch.jit.script``: a TorchScript function runs its ops in
  the TorchScript interpreter, invisible to torchlens' Python-level wrappers (CLIP's MLP would
  show ``fc1 -> fc2`` with no activation). The module attribute is replaced by the same formula
  as a plain Python function (``x * sigmoid(1.702 x)``) while capturing.
* The prefill reads the request's tensors and the decode step the ``DynamicCache`` and the
  attention mask; all are passed as forward arguments and the cache is rebuilt inside the
  wrapper, so torchlens never sees outer tensors (which would make it re-run the forward).
* Routing is read from forward hooks on each ``MoEGate`` with ``Tensor.tolist()`` (no tensor op,
  so nothing extra enters the graph).

Addresses are the vendor's own module names, which equal the reference model's; class names are
the vendor's (``Block``, ``NoTPTransformerBlock``, ``DeepseekV2DecoderLayer``, ...).

Under ``model.vendor_entry=infer`` the request itself comes from the vendor's ``infer()``
(``infer_request``): infer() runs unmodified on the page file, its call of ``generate`` records the
inputs it built and returns at once, and ``capture_vendor`` traces exactly those inputs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import time

import numpy as np
import torch
from torch import nn

from ..layout import BOS_TOKENS, Case, grid_text
from .capture import _Step, trace_step
from .tree import module_tree


def _py_quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


@contextlib.contextmanager
def plain_quick_gelu(model: nn.Module):
    """Replace the vendor's jit-scripted ``quick_gelu`` by a Python function in every vendor module
    that has one (``deepencoder``), restoring the original afterwards."""
    patched = []
    names = {type(m).__module__ for m in model.modules()}
    for name in names:
        mod = sys.modules.get(name)
        fn = getattr(mod, "quick_gelu", None) if mod is not None else None
        if fn is not None and fn is not _py_quick_gelu and isinstance(fn, torch.jit.ScriptFunction):
            patched.append((mod, fn))
            mod.quick_gelu = _py_quick_gelu
    try:
        yield [m.__name__ for m, _ in patched]
    finally:
        for mod, fn in patched:
            mod.quick_gelu = fn


@contextlib.contextmanager
def gate_routing(vmodel, layers: int, experts: int):
    """[layers, experts] routed-token counts from forward hooks on every MoE gate."""
    arr = np.zeros((layers, experts), dtype=np.int64)
    handles = []

    def make(layer):
        def hook(module, args, output):
            idx = output[0].tolist()
            flat = np.asarray(idx, dtype=np.int64).reshape(-1)
            arr[layer] += np.bincount(flat, minlength=experts)[:experts]
        return hook

    for i, layer in enumerate(vmodel.hf.model.layers):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and hasattr(layer.mlp, "experts"):
            handles.append(gate.register_forward_hook(make(i)))
    try:
        yield arr
    finally:
        for h in handles:
            h.remove()


def vendor_tree(vmodel) -> list:
    """Module tree of the vendor model (its class names; ``vendor_cls`` equals ``cls``)."""
    return module_tree(vmodel, vendor_of=lambda c: c)


def _filled_cache(vmodel, keys, values):
    """The vendor's own empty cache (``vmodel.new_cache().past``, an HF ``DynamicCache``) holding
    ``keys`` / ``values`` (one tensor per layer)."""
    past = vmodel.new_cache().past
    past.key_cache[:] = list(keys)
    past.value_cache[:] = list(values)
    if hasattr(past, "_seen_tokens"):
        past._seen_tokens = int(keys[0].shape[-2]) if keys else 0
    return past


def capture_vendor(vmodel, request, count_flops: bool = True, progress=print) -> dict:
    """{"prefill": Capture, "decode": Capture} for a ``VendorOCR`` (see the module docstring)."""
    hf = vmodel.hf
    cfg = hf.config
    shape = (len(hf.model.layers), int(cfg.n_routed_experts))
    state: dict = {}

    def class_of(addr: str) -> str:
        return type(vmodel.get_submodule(addr)).__name__

    def run_prefill(input_ids, images_seq_mask, global_views, tiles):
        req = dataclasses.replace(request, input_ids=input_ids, images_seq_mask=images_seq_mask,
                                  global_views=global_views, tiles=tiles)
        cache = vmodel.new_cache()
        logits = vmodel.prefill(req, cache)
        state["cache"], state["logits"] = cache, logits
        return logits

    def run_decode(token, keys, values, attention_mask):
        from ..models.vendor.loader import VendorCache

        cache = VendorCache(past=_filled_cache(vmodel, keys, values), attention_mask=attention_mask)
        logits = vmodel.decode_step(token, cache)
        state["decode_cache"] = cache
        return logits

    with plain_quick_gelu(vmodel) as patched:
        progress(f"[graph] vendor: tracing prefill ({request.prefill_tokens} tokens); quick_gelu made plain "
                 f"Python in {patched or 'no module'}")
        with gate_routing(vmodel, *shape) as routing:
            pre = trace_step("prefill", _Step(vmodel, run_prefill),
                             [request.input_ids, request.images_seq_mask, request.global_views, request.tiles],
                             class_of, None, None, count_flops)
        pre.routing = routing.copy()
        token = state["logits"][:, -1].argmax(-1, keepdim=True)
        cache = state["cache"]
        past = cache.past
        keys, values = list(past.key_cache), list(past.value_cache)
        pre.info.update(cache_len_after=cache.length, next_token=token.flatten().tolist(),
                        quick_gelu_patched=patched)
        progress(f"[graph] vendor prefill traced: {pre.info['ops']} ops; tracing one decode step")
        with gate_routing(vmodel, *shape) as routing:
            dec = trace_step("decode", _Step(vmodel, run_decode), [token, keys, values, cache.attention_mask],
                             class_of, None, None, count_flops)
        dec.routing = routing.copy()
        dec.info.update(cache_len_before=cache.length, cache_len_after=state["decode_cache"].length,
                        token_in=token.flatten().tolist(), quick_gelu_patched=patched)
    return {"prefill": pre, "decode": dec}


#: the arguments of infer()'s ``generate`` call that the captured forwards read; the others
#: (temperature, eos_token_id, streamer, max_new_tokens, no_repeat_ngram_size, use_cache) steer
#: decoding, which one prefill and one greedy step do not use
FORWARD_INPUTS = ("input_ids", "images", "images_seq_mask", "images_spatial_crop")
INFER_BUILT = "the vendor's infer() (model.vendor_entry=infer)"


def infer_request(vmodel, request) -> tuple:
    """(Request, record): the request the vendor's ``infer()`` builds for ``request``'s one page.

    ``vmodel.generate_own`` is the ``InferEntry`` of ``model.vendor_entry=infer``. infer() runs
    unmodified (``InferEntry.call_infer``) on the page file (``InferEntry.page_file``) with
    ``request``'s prompt and crop mode; the ``generate`` it calls records its arguments and returns
    the prompt at once (with ``save_results=False`` and ``eval_mode=False`` infer() reads nothing of
    it): no token is generated. The Request holds infer()'s tensors: ``input_ids`` [1, S],
    ``images_seq_mask`` [1, S], the global view ``images[0][1]`` and, when ``images_spatial_crop``
    is more than 1x1, the tiles ``images[0][0]`` (else infer()'s all-zero placeholder, which the
    vendor forward skips, as it skips the zeros ``VendorOCR`` passes). Its Case: the request's mode,
    infer()'s grid, S - BOS - image placeholders text tokens. ``record`` (the manifest's
    ``graph.request``): who built it, prompt, page file, the counts, every argument given to
    ``generate`` (``describe_value``), where infer()'s printout is, and the harness's own layout for
    the same page (``harness_request``) for comparison.
    """
    from ..errors import HarnessError
    from ..models.vendor.infer import InferEntry, describe_value, not_called, one_page

    entry = getattr(vmodel, "generate_own", None)
    if not isinstance(entry, InferEntry):
        raise TypeError(f"infer_request needs a VendorOCR driven by InferEntry (model.vendor_entry=infer), "
                        f"not by {type(entry).__name__}")
    page = one_page(request)
    image_file = entry.page_file(page)
    seen: dict = {}

    def record(input_ids, **kwargs):
        seen.update(input_ids=input_ids, kwargs=kwargs)
        return input_ids

    t0 = time.perf_counter()
    entry.call_infer(image_file, request, record)
    seconds = time.perf_counter() - t0
    stdout_file = entry.save_stdout()
    if not seen:
        raise not_called()
    ids, kw = seen["input_ids"], seen["kwargs"]
    missing = [k for k in FORWARD_INPUTS[1:] if k not in kw]
    if missing:
        raise HarnessError(f"the vendor's infer() called generate without {', '.join(missing)}",
                           "use the snapshot's unmodified modeling_deepseekocr.py")
    patches, view = kw["images"][0]
    cols, rows = (int(v) for v in kw["images_spatial_crop"][0])
    grid = None if (cols, rows) == (1, 1) else (cols, rows)
    mask = kw["images_seq_mask"]
    image_tokens = int(mask.sum())
    where = mask[0].nonzero().flatten()
    text_tokens = max(int(ids.shape[1]) - BOS_TOKENS - image_tokens, 0)
    case = Case(request.mode, grid, 1, text_tokens, request.decode_tokens)
    built = dataclasses.replace(request, case=case, input_ids=ids, images_seq_mask=mask, global_views=view,
                                tiles=patches if grid is not None else None,
                                image_start=int(where[0]) if len(where) else BOS_TOKENS)
    own = request.case
    out = {"built_by": INFER_BUILT, "prompt": request.prompt, "page": str(image_file), "page_source": page.source,
           "prompt_tokens": int(ids.shape[1]), "image_tokens": image_tokens, "text_tokens": text_tokens,
           "grid": grid_text(grid),
           "generate_kwargs": {k: describe_value(v) for k, v in kw.items()},
           "forward_inputs": list(FORWARD_INPUTS), "generated_tokens": 0,
           "infer_s": round(seconds, 3), "infer_stdout": str(stdout_file),
           "harness_request": {"prompt_tokens": request.prefill_tokens, "image_tokens": own.image_tokens,
                               "text_tokens": own.text_tokens, "grid": grid_text(own.grid)}}
    if case.image_tokens != image_tokens:
        out["warning"] = (f"infer() placed {image_tokens} image tokens; the harness's layout of mode "
                          f"{request.mode.name} grid {grid_text(grid) or 'none'} has {case.image_tokens}: "
                          "the analytic columns cost the harness's layout")
    return built, out
