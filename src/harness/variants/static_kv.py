"""Preallocated KV cache, attention mask and RoPE from device positions: fixed shapes, no host sync.

The growing ``llm.KVCache`` concatenates each step, so every decode step has new shapes and new
allocations. ``StaticKVCache`` allocates [B, kv_heads, max_len, head_dim] per layer once and writes
each step's K/V in place at positions held in a device tensor; attention then runs over the whole
buffer with a mask that hides positions after the query's own, so a decode step has the same
shapes every time and can be captured in a CUDA graph (the positions tensor is the graph's input).

Positions: ``pos`` is an int64 tensor [S] on the cache's device, the absolute positions of the S
tokens of this step (prefill: 0..S-1, decode: [p]). The same positions feed RoPE
(``rope_cos_sin`` / ``RopeTable``) as ``position_ids = pos.expand(B, S)``.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import HarnessError


class StaticKVCache:
    """Per-layer K/V buffers [B, kv_heads, max_len, head_dim], written in place by ``index_copy_``.

    - ``update(layer, k, v, pos=None)`` writes k, v [B, kv_heads, S, head_dim] at positions ``pos``
      (or the ones given to ``begin_step``) and returns the whole buffers; same call as
      ``llm.KVCache.update`` plus the positions.
    - ``begin_step(pos)`` stores the step's positions; ``mask`` [S, max_len] bool (True = attend) is
      built from them at its first use in the step, once for all layers (a step whose attention
      reads ``pos`` itself, the Triton decode kernel, builds none). Inside a CUDA graph, call
      ``begin_step`` within the captured step so the mask is recomputed at every replay.
    - ``rope``: (cos, sin) [B, S, head_dim] of the step's positions, set once per step for all
      layers (``engine.Engine.decoder``); ``begin_step`` clears it (a layer without it computes its own).
    - ``split_sem`` [batch * query_heads] int32 zeros: the split-KV decode kernel's per-head
      counters (``decode_attention_triton``), back at zero after every call; one for all layers.
    - ``length`` is host bookkeeping: the number of positions 0..length-1 the caller has filled, as
      told through ``advance(n)`` after each step (prefill S, decode 1). The cache never reads it
      from the device and ``update`` never changes it (a graph replay does not run Python).
    - ``nbytes()`` counts the preallocated buffers (what the allocator holds for the whole run),
      not ``length``; ``nbytes_filled()`` counts positions 0..length-1.

    Buffers start zeroed and ``reset()`` zeroes them again: masked positions get attention weight
    exactly 0, which must multiply finite values (0 * NaN from uninitialised memory is NaN).
    """

    def __init__(self, num_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, query_heads: Optional[int] = None):
        shape = (batch, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.split_sem = torch.zeros(batch * (query_heads or kv_heads), dtype=torch.int32, device=device)
        self.max_len = max_len
        self.length = 0
        self.pos: Optional[torch.Tensor] = None
        self.rope: Optional[tuple] = None
        self._mask: Optional[torch.Tensor] = None

    def begin_step(self, pos: torch.Tensor) -> None:
        """Positions [S] (int64, device) of the step about to run (``mask`` follows them)."""
        self.pos = pos
        self.rope = None
        self._mask = None

    @property
    def mask(self) -> Optional[torch.Tensor]:
        """[S, max_len] bool for the current step's positions (None before ``begin_step``)."""
        if self._mask is None and self.pos is not None:
            self._mask = attention_mask(self.pos, self.max_len)
        return self._mask

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: Optional[torch.Tensor] = None):
        """Write k, v [B, kv_heads, S, head_dim] at positions ``pos`` [S]; return the full K, V buffers."""
        pos = self.pos if pos is None else pos
        if pos is None:
            raise HarnessError("StaticKVCache.update needs positions", "call begin_step(pos) or pass pos")
        if pos.dtype != torch.int64 or pos.dim() != 1 or pos.shape[0] != k.shape[2]:
            raise HarnessError(f"StaticKVCache.update: pos must be int64 [{k.shape[2]}], got "
                               f"{pos.dtype} {tuple(pos.shape)}")
        self.k[layer].index_copy_(2, pos, k)
        self.v[layer].index_copy_(2, pos, v)
        return self.k[layer], self.v[layer]

    def advance(self, n: int) -> None:
        """Host bookkeeping: ``n`` more positions are filled (call once per step, not per layer)."""
        if self.length + n > self.max_len:
            raise HarnessError(f"StaticKVCache holds {self.max_len} positions; {self.length} + {n} do not fit",
                               "build the cache with a larger max_len (prompt + decode budget)")
        self.length += n

    def reset(self) -> None:
        """Zero the buffers and forget positions and length (a new request)."""
        for t in self.k + self.v + [self.split_sem]:
            t.zero_()
        self.length = 0
        self.pos = None
        self.rope = None
        self._mask = None

    def nbytes(self) -> int:
        """Bytes of the preallocated K and V buffers of all layers."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def nbytes_filled(self) -> int:
        """Bytes of positions 0..length-1 (what ``llm.KVCache.nbytes`` would report)."""
        return self.nbytes() * self.length // self.max_len


def attention_mask(pos: torch.Tensor, max_len: int) -> torch.Tensor:
    """Boolean mask [S, max_len], True where key position j <= the query's position ``pos[i]``.

    For prefill (pos = 0..S-1) it is the causal mask over the first S keys; for decode (pos = [p])
    it admits keys 0..p. Broadcasts as SDPA's ``attn_mask`` against [B, heads, S, max_len].
    """
    keys = torch.arange(max_len, device=pos.device)
    return keys.unsqueeze(0) <= pos.unsqueeze(1)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean mask -> additive mask in ``dtype``: 0 where True, finfo(dtype).min where False
    (the eager path's convention in ``llm.Attention.attend``)."""
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.finfo(dtype).min)


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype):
    """cos, sin [B, S, head_dim] in ``dtype`` from ``position_ids`` [B, S] (int64, any device).

    The same operations as ``llm.RotaryEmbedding.forward`` (fp32 outer product by bmm, cat, cos/sin,
    cast), so the values are bitwise identical; ``inv_freq`` [head_dim / 2] is the module's buffer.
    """
    inv = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
    freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class RopeTable:
    """cos/sin for positions 0..max_len-1, precomputed once; a step looks its positions up with one
    gather each instead of recomputing (bmm, cat, cos, sin, casts).

    ``cos``, ``sin``: [max_len, head_dim] in ``dtype``, computed by ``rope_cos_sin`` over all
    positions at once; ``lookup(position_ids [B, S])`` -> cos, sin [B, S, head_dim].
    """

    def __init__(self, inv_freq: torch.Tensor, max_len: int, dtype: torch.dtype):
        positions = torch.arange(max_len, device=inv_freq.device)[None]
        cos, sin = rope_cos_sin(inv_freq, positions, dtype)
        self.cos, self.sin = cos[0], sin[0]
        self.max_len = max_len

    def lookup(self, position_ids: torch.Tensor):
        flat = position_ids.reshape(-1)
        shape = (*position_ids.shape, self.cos.shape[-1])
        return self.cos.index_select(0, flat).view(shape), self.sin.index_select(0, flat).view(shape)

