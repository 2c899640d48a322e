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
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys

import numpy as np
import torch
from torch import nn

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


def _dynamic_cache(keys, values):
    from transformers.cache_utils import DynamicCache

    c = DynamicCache()
    c.key_cache, c.value_cache = list(keys), list(values)
    if hasattr(c, "_seen_tokens"):
        c._seen_tokens = int(keys[0].shape[-2]) if keys else 0
    return c


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

        cache = VendorCache(past=_dynamic_cache(keys, values), attention_mask=attention_mask)
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
