"""The MoE router of a decode step (a few tokens) in two Triton kernels.

``MoEGate`` in torch is five small kernels per MoE layer at batch 1 after the gate GEMV: softmax,
``torch.topk`` (4.7 µs alone on an H200), the multiply by the scale and their glue. ``route`` runs
the gate as the fp32-output GEMV of ``gemv_triton`` (many programs: all SMs stream the weight) and
then one small kernel, one program per token:

1. softmax of the fp32 logits (max subtracted, exp, divided by the sum);
2. top-k as k rounds of (max, lowest index holding it, mask it out): descending order, ties go to
   the lowest expert index. ``torch.topk(sorted=False)`` may order a token's k experts differently;
   the set is the same (for untied scores) and consumers sum over k;
3. with ``norm`` and k > 1 the k weights are divided by (their sum + 1e-20), then multiplied by
   ``scale`` (both as in ``MoEGate``); idx (int64) and weights (fp32) stored.

4. with ``counts`` (one token only), the routing count: each chosen expert's counter + 1, a plain
   load and store (one program, k distinct experts: no race, no atomic), instead of the routing
   target's scatter-add launch.

A first version computed the logits in the same kernel, one program per token: 39 µs per layer on
an H200 (one SM streaming the 164 KB gate), so the GEMV stays apart. An atomic routing count in
that version miscounted under torch.compile + CUDA graphs on the GPU (cause not found; it took a
view of the counter buffer); ``counts`` here is the whole buffer and an offset. The float constants (``scale``, 1e-20) are compile-time
constants: under torch.compile a Python float runtime argument reaches a user Triton kernel as
fp64. No host sync and outputs from ``torch.empty``: callable inside torch.compile and CUDA-graph
capture. Importing this module imports triton; ``TRITON_INTERPRET=1`` before the first import of
``common`` runs the kernels on CPU tensors (tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import HarnessError
from .common import check_runnable


@triton.jit
def _topk_kernel(logits_ptr, idx_ptr, wt_ptr, counts_ptr, counts_offset, n_exp, stride_lt, stride_le, stride_it,
                 stride_ik, stride_ot, stride_ok,
                 TOP_K: tl.constexpr, NORM: tl.constexpr, SCALE: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_TOPK: tl.constexpr, HAS_COUNTS: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < n_exp
    # 1. softmax of the fp32 logits (padding lanes: -inf logits, probability 0)
    logits = tl.load(logits_ptr + tok * stride_lt + offs_e * stride_le, mask=e_ok, other=float("-inf"))
    ex = tl.exp(logits - tl.max(logits, axis=0))
    probs = ex / tl.sum(ex, axis=0)
    # 2. top-k: k rounds of (max, lowest index holding it, mask it out); probabilities are >= 0, so
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
    # 3. renormalise (as MoEGate: w / (sum + 1e-20)), then scale
    if NORM:
        sel_w = sel_w / (tl.sum(sel_w, axis=0) + 1e-20)
    sel_w = sel_w * SCALE
    k_ok = offs_k < TOP_K
    tl.store(idx_ptr + tok * stride_it + offs_k * stride_ik, sel_i, mask=k_ok)
    tl.store(wt_ptr + tok * stride_ot + offs_k * stride_ok, sel_w, mask=k_ok)
    if HAS_COUNTS:                              # 4. one program (one token), k distinct experts
        at = counts_ptr + counts_offset + sel_i
        tl.store(at, tl.load(at, mask=k_ok, other=0) + 1, mask=k_ok)


def route(x: torch.Tensor, w: torch.Tensor, top_k: int, norm: bool, scale: float, counts: tuple | None = None):
    """x [T, H], gate weight w [E, H] -> (idx int64 [T, k], weights fp32 [T, k]); see the module
    docstring. ``counts`` = (contiguous int64 buffer, offset), T = 1 only: the counters
    ``buffer.view(-1)[offset:offset + E]`` of the chosen experts + 1 (``RoutingCounter.device_target``)."""
    from .gemv_triton import gemv

    check_runnable(x)
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise HarnessError(f"route: x [T, H] and w [E, H] expected, got {tuple(x.shape)} and {tuple(w.shape)}")
    T = x.shape[0]
    E = w.shape[0]
    if not 1 <= top_k <= E:
        raise HarnessError(f"route: top_k={top_k} needs 1 <= top_k <= E={E}")
    if counts is not None:
        buf, offset = counts
        if (T != 1 or buf.dtype != torch.int64 or not buf.is_contiguous() or buf.device != x.device
                or not 0 <= offset <= buf.numel() - E):
            raise HarnessError(f"route: counts need one token and a contiguous int64 buffer on {x.device} holding "
                               f"[offset, offset + {E}); got T={T}, {buf.dtype} [{buf.numel()}] on {buf.device}, "
                               f"offset {offset}")
    logits = gemv(x, w, torch.float32)
    idx = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    _topk_kernel[(T,)](
        logits, idx, weights, counts[0] if counts else idx, counts[1] if counts else 0, E,
        logits.stride(0), logits.stride(1), idx.stride(0), idx.stride(1), weights.stride(0), weights.stride(1),
        TOP_K=top_k, NORM=bool(norm and top_k > 1), SCALE=float(scale),
        BLOCK_E=triton.next_power_of_2(E), BLOCK_TOPK=triton.next_power_of_2(top_k), HAS_COUNTS=counts is not None,
        num_warps=1)
    return idx, weights
