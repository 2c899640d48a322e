"""``kv_cache=static``: every decoder attention against a preallocated KV cache (``static_kv``).

``StaticAttention`` is the reference ``Attention`` against a ``StaticKVCache`` (RoPE cos/sin
computed once per step for all layers: ``cache.rope``); ``STATIC_CACHE`` is the converter that
swaps it in and hands the request loop to ``engine.Engine`` (``Plan.static``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import knobs
from ..models import attn_probe
from ..models.llm import Attention, apply_rope
from .base import Converter, Variant, need, swap
from .engine import attach
from .static_kv import StaticKVCache


class StaticAttention(Variant, Attention):
    """``Attention`` against a ``StaticKVCache``: K/V written in place at the step's positions;
    prefill attends over the first filled + S positions, a decode step over the whole buffer with
    the cache's mask (``attend_decode``; the same function as ``attend`` over the filled positions).
    RoPE cos/sin come from ``cache.rope`` (once per step for all layers)."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        B, S, _ = x.shape
        cos, sin = cache.rope if cache.rope is not None else self.rotary_emb(x, position_ids)
        q, k, v = self.project(x)
        q, k = apply_rope(q, k, cos, sin)
        filled = cache.length                      # host: positions already in the cache
        k, v = cache.update(self.layer_idx, k, v)
        if S == 1:                                 # decode: the whole buffer
            out = self.attend_decode(q, k, v, cache)
        else:                                      # prefill: the first filled + S positions
            k, v = self.repeat_kv(k, v)
            T = filled + S
            out = self.attend(q, k[:, :, :T], v[:, :, :T])
        return self.output(out.transpose(1, 2).reshape(B, S, -1))

    def attend_decode(self, q, k, v, cache: StaticKVCache) -> torch.Tensor:
        """One query [B, nh, 1, d] against a whole static buffer [B, nkv, L, d] with ``cache.mask``
        [1, L] (True = a filled position): SDPA (or the eager matmuls for ``impl == "eager"``).
        Masked keys get weight exactly 0. Fixed shapes, so it can be captured in a CUDA graph."""
        if self.layer_idx == 0 and attn_probe.first_time("llm_decode", f"masked-{self.impl}"):
            attn_probe.note("llm_decode", "eager:matmul+softmax (masked static cache)" if self.impl == "eager"
                            else attn_probe.sdpa_choice(q, *self.repeat_kv(k, v), cache.mask))
        mask = cache.mask
        k, v = self.repeat_kv(k, v)
        if self.impl == "eager":
            w = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
            w = w.masked_fill(~mask, torch.finfo(w.dtype).min)
            w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
            return torch.matmul(w, v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class StaticCache(Converter):
    """``kv_cache=static``: every decoder attention becomes a ``StaticAttention``; the request loop
    (``engine.Engine``) keeps one static cache per (batch, cache length)."""

    spec = knobs.STATIC_CACHE

    def check(self, ex, device, dtype, model=None, positions=None) -> None:
        if not self.active(ex):
            need(ex.static_cache_len is None, "static_cache_len", ex.static_cache_len,
                 "sizes the static cache, which runs only with kv_cache=static",
                 "add execution.kv_cache=static, or drop execution.static_cache_len")
            return
        self.refuse(model is None or model.attn_implementation != "flash_attention_2",
                    "attends over the whole buffer with a mask, which flash_attn_func cannot take",
                    "use model.attn_implementation=sdpa with the static cache")
        if positions is not None and ex.static_cache_len is not None:
            need(ex.static_cache_len >= positions, "static_cache_len", ex.static_cache_len,
                 f"holds {ex.static_cache_len} positions but the request needs {positions} (prompt + decode tokens)",
                 f"set execution.static_cache_len={positions} or more, or leave it unset (prompt + decode "
                 "tokens, rounded up to 64)")

    def convert(self, model, ex, device, dtype) -> dict:
        if not self.active(ex):
            model.__dict__.pop("static_decoders", None)         # their caches hold device memory
            model.__dict__.pop("static_for", None)
            return {self.manifest_key: "growing: torch.cat per step"}
        if model.__dict__.get("static_for") != ex.execution():  # another execution: decoders set up anew
            model.static_decoders, model.static_for = {}, ex.execution()
        attach(model).static = ex
        for layer in model.model.layers:
            swap(layer.self_attn, StaticAttention)
        return {self.manifest_key: "static: preallocated, written in place"}


STATIC_CACHE = StaticCache()
