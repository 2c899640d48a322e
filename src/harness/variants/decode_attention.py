"""``decode_attention=triton``: the static cache's decode attention as a split-KV Triton kernel.

``TritonDecodeAttention`` is a ``StaticAttention`` whose decode step runs
``kernels.decode_attention_triton.decode_attention``: it reads only positions 0..``cache.pos``
(the step's position, int64 [1] on the device), needs no mask (none is built) and combines its
splits in the last one to finish (``cache.split_sem``). ``DECODE_ATTENTION`` is the converter
(``sdpa``, the default, keeps SDPA over the whole buffer with a mask).
"""
from __future__ import annotations

import torch

from .. import knobs
from ..errors import HarnessError
from ..kernels.availability import triton_available
from ..models import attn_probe
from .base import Converter, swap
from .static_cache import StaticAttention


class TritonDecodeAttention(StaticAttention):
    """``StaticAttention`` with the split-KV Triton kernel for a decode step (see the module docstring)."""

    def attend_decode(self, q, k, v, cache) -> torch.Tensor:
        if self.layer_idx == 0 and attn_probe.first_time("llm_decode", "triton"):
            attn_probe.note("llm_decode", "triton:decode_attention_triton (split-KV, positions 0..pos only)")
        if cache.pos is None:
            raise HarnessError("decode_attention=triton needs the step's position", "pass cache.pos")
        from ..kernels.decode_attention_triton import decode_attention

        return decode_attention(q, k, v, cache.pos, sem=cache.split_sem)


class DecodeAttention(Converter):
    """Every static-cache attention's decode step by the Triton kernel."""

    spec = knobs.DECODE_ATTENTION

    def check(self, ex, device, dtype, model=None, positions=None) -> None:
        if not self.active(ex):
            return
        self.refuse(ex.kv_cache == "static", "needs kv_cache=static (the kernel reads a preallocated cache up to "
                    "the step's device-side position)", "add execution.kv_cache=static, or use execution.decode_attention=sdpa")
        ok, why = triton_available(device)
        self.refuse(ok, f"cannot run here: {why}", "use execution.decode_attention=sdpa", here=True)

    def convert(self, model, ex, device, dtype) -> dict:
        if not self.active(ex):
            return {self.manifest_key: "sdpa: attn_implementation (torch SDPA by default) over the whole static "
                    "buffer with a mask" if ex.kv_cache == "static"
                    else "growing cache: attn_implementation over the positions so far"}
        for layer in model.model.layers:
            swap(layer.self_attn, TritonDecodeAttention)
        from ..kernels import decode_attention_triton as dat

        return {self.manifest_key: "triton: split-KV kernel (decode_attention_triton) over positions 0..pos only, "
                f"{dat.DEFAULT_CONFIG}; " + triton_available(device)[1]}


DECODE_ATTENTION = DecodeAttention()
