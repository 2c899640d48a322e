"""The MoE router of a decode step (a few tokens) as one Triton kernel.

``MoEGate`` in torch is five small kernels per MoE layer at batch 1: the gate GEMV (fp32 logits),
softmax, ``torch.topk``, the multiply by the scale, and the routing counter's ``scatter_add_``
(~11 µs together on an H200, topk alone 4.75 µs). ``route`` does all of it in one launch, one
program per token:

1. logits[e] = sum_h float(x[h]) * float(w[e, h]) in fp32 for all E experts at once (E padded to a
   power-of-two block and masked); H is a compile-time constant and the loop over its BLOCK_K chunks
   is unrolled, so every weight load is in flight together;
2. softmax in fp32 (max subtracted, exp, divided by the sum);
3. top-k as k rounds of (max, lowest index holding it, mask it out): descending order, ties go to
   the lowest expert index. ``torch.topk(sorted=False)`` may order a token's k experts differently;
   the set is the same (for untied scores) and consumers sum over k;
4. with ``norm`` and k > 1 the k weights are divided by (their sum + 1e-20), then multiplied by
   ``scale`` (both as in ``MoEGate``);
5. idx (int64) and weights (fp32) stored; with ``counts`` given, each chosen expert's counter is
   incremented by one with an atomic add (the routing count of ``routing.DeviceCounts``).

The float constants (``scale``, 1e-20) are compile-time constants: under torch.compile a Python
float runtime argument reaches a user Triton kernel as fp64, which changes the arithmetic. No host
sync and outputs from ``torch.empty``: callable inside torch.compile and CUDA-graph capture.
Importing this module imports triton; ``TRITON_INTERPRET=1`` before the first import of
``fast_moe_triton`` runs the kernel on CPU tensors (tests).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ..errors import HarnessError
from .fast_moe_triton import _check_runnable
from .gemv_triton import _row_times_tile


@dataclass(frozen=True)
class RouterConfig:
    """Weight elements per unrolled load (BLOCK_E x BLOCK_K, BLOCK_K at least 16) and num_warps."""
    tile_elems: int = 8192
    num_warps: int = 4

    def block_k(self, block_e: int, hidden: int) -> int:
        return max(16, min(triton.next_power_of_2(hidden), self.tile_elems // block_e))

    def check(self) -> None:
        t, w = self.tile_elems, self.num_warps
        if t < 16 or t & (t - 1) or w not in (1, 2, 4, 8):
            raise HarnessError(f"RouterConfig{(t, w)}: tile_elems must be a power of two >= 16, "
                               "num_warps one of 1, 2, 4, 8")


@triton.jit
def _route_kernel(x_ptr, w_ptr, idx_ptr, wt_ptr, counts_ptr, n_exp,
                  stride_xt, stride_xh, stride_we, stride_wh, stride_it, stride_ik, stride_ot, stride_ok,
                  stride_c,
                  H: tl.constexpr, TOP_K: tl.constexpr, NORM: tl.constexpr, SCALE: tl.constexpr,
                  HAS_COUNTS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_TOPK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < n_exp
    # 1. fp32 logits: exact products of the upcast inputs, fp32 sums (per chunk, then across
    #    chunks), the unrolled loop of the GEMV kernels
    logits = _row_times_tile(x_ptr + tok * stride_xt, w_ptr + offs_e[:, None].to(tl.int64) * stride_we,
                             stride_xh, stride_wh, e_ok, H, BLOCK_E, BLOCK_K)
    # 2. softmax (padding lanes: -inf logits, probability 0)
    logits = tl.where(e_ok, logits, float("-inf"))
    ex = tl.exp(logits - tl.max(logits, axis=0))
    probs = ex / tl.sum(ex, axis=0)
    # 3. top-k: k rounds of (max, lowest index holding it, mask it out); probabilities are >= 0, so
    #    -1 marks padding and chosen lanes
    cand = tl.where(e_ok, probs, -1.0)
    offs_k = tl.arange(0, BLOCK_TOPK)
    sel_w = tl.zeros((BLOCK_TOPK,), dtype=tl.float32)
    sel_i = tl.zeros((BLOCK_TOPK,), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(cand, axis=0)
        at = tl.min(tl.where(cand == best, offs_e, BLOCK_E), axis=0)
        sel_w = tl.where(offs_k == j, best, sel_w)
        sel_i = tl.where(offs_k == j, at.to(tl.int64), sel_i)
        cand = tl.where(offs_e == at, -1.0, cand)
        if HAS_COUNTS:
            tl.atomic_add(counts_ptr + at.to(tl.int64) * stride_c, tl.full((), 1, tl.int64))
    # 4. renormalise (as MoEGate: w / (sum + 1e-20)), then scale
    if NORM:
        sel_w = sel_w / (tl.sum(sel_w, axis=0) + 1e-20)
    sel_w = sel_w * SCALE
    # 5. store
    k_ok = offs_k < TOP_K
    tl.store(idx_ptr + tok * stride_it + offs_k * stride_ik, sel_i, mask=k_ok)
    tl.store(wt_ptr + tok * stride_ot + offs_k * stride_ok, sel_w, mask=k_ok)


def route(x: torch.Tensor, w: torch.Tensor, top_k: int, norm: bool, scale: float,
          counts: Optional[torch.Tensor] = None, config: RouterConfig = RouterConfig()):
    """x [T, H], gate weight w [E, H] -> (idx int64 [T, k], weights fp32 [T, k]); see the module
    docstring. ``counts`` (int64 [E], optional): each chosen expert's entry gets +1 per token."""
    _check_runnable(x)
    config.check()
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise HarnessError(f"route: x [T, H] and w [E, H] expected, got {tuple(x.shape)} and {tuple(w.shape)}")
    T, H = x.shape
    E = w.shape[0]
    if not 1 <= top_k <= E:
        raise HarnessError(f"route: top_k={top_k} needs 1 <= top_k <= E={E}")
    if counts is not None and (counts.dim() != 1 or counts.shape[0] != E or counts.dtype != torch.int64
                               or counts.device != x.device):
        raise HarnessError(f"route: counts must be int64 [E={E}] on {x.device}, got "
                           f"{counts.dtype} {tuple(counts.shape)} on {counts.device}")
    idx = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    block_e = triton.next_power_of_2(E)
    _route_kernel[(T,)](
        x, w, idx, weights, counts if counts is not None else idx, E,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), idx.stride(0), idx.stride(1),
        weights.stride(0), weights.stride(1), counts.stride(0) if counts is not None else 0,
        H=H, TOP_K=top_k, NORM=bool(norm and top_k > 1), SCALE=float(scale), HAS_COUNTS=counts is not None,
        BLOCK_E=block_e, BLOCK_K=config.block_k(block_e, H), BLOCK_TOPK=triton.next_power_of_2(top_k),
        num_warps=config.num_warps)
    return idx, weights
