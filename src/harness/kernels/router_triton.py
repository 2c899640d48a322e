"""The MoE router of a decode step (a few tokens) in two Triton kernels.

``route`` runs the gate as the fp32-output GEMV of ``gemv_triton``, then one small kernel, one
program per token: softmax of the fp32 logits, top-k (descending; ties go to the lowest expert
index: the set ``torch.topk`` picks, perhaps in another order), or with ``forced``
(``workload.routing=balanced``) the token's k experts from the forced table [batch, positions,
layers, k] (a runtime flag ``on`` [1] applies it only where it holds); with ``norm`` and k > 1 the
weights renormalised, then times ``scale`` (as ``MoEGate``); idx (int64) and weights (fp32) stored;
with ``counts`` (one token) the routing count of the step at row min(step_index, steps) of the
counts buffer [steps + 1, layers, experts]. No host sync and outputs from ``torch.empty``: callable
inside torch.compile and CUDA-graph capture. Importing this module imports triton;
``TRITON_INTERPRET=1`` before the first import of ``common`` runs the kernels on CPU tensors (tests).

Design notes (each step, what torch's router and a first version cost, why the float constants are
compile-time): ``docs/kernels/router_triton.md``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import HarnessError
from .common import check_counts, check_runnable, counts_row


@triton.jit
def choose_store(logits_ptr, stride_lt, toks, t_ok, idx_ptr, wt_ptr, counts_ptr, step_ptr, steps, n_layers, layer,
                  table_ptr, pos_ptr, on_ptr, n_pos, stride_it, stride_ik, stride_ot, stride_ok, n_exp,
                  TOP_K: tl.constexpr, NORM: tl.constexpr, SCALE: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_TOPK: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_FORCED: tl.constexpr,
                  FORCED_SWITCH: tl.constexpr):
    """The routing of the tokens ``toks`` [BT] (int64; ``t_ok`` masks padding) from their fp32 logits (row
    t at ``logits_ptr + t * stride_lt``): steps 1-5 of the module docstring on a [BT, BLOCK_E] tile, one
    row per token; idx and weights stored (and counted: one token only)."""
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < n_exp
    row_ptrs = logits_ptr + toks[:, None] * stride_lt
    logits = tl.load(row_ptrs + offs_e[None, :], mask=t_ok[:, None] & e_ok[None, :], other=float("-inf"))
    logits = tl.where(t_ok[:, None], logits, 0.0)                    # padding tokens: finite, never stored
    # 1. softmax of the fp32 logits (padding lanes: -inf logits, probability 0)
    top = tl.max(logits, axis=1)
    total = tl.sum(tl.exp(logits - top[:, None]), axis=1)
    probs = tl.exp(logits - top[:, None]) / total[:, None]
    # 2. top-k: k rounds of (max, lowest index holding it, mask it out); probabilities are >= 0, so
    #    -1 marks padding and chosen lanes
    cand = tl.where(e_ok[None, :], probs, -1.0)
    offs_k = tl.arange(0, BLOCK_TOPK)
    k_ok = offs_k < TOP_K
    sel_w = tl.zeros((toks.shape[0], BLOCK_TOPK), dtype=tl.float32)
    sel_i = tl.zeros((toks.shape[0], BLOCK_TOPK), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(cand, axis=1)
        at = tl.min(tl.where(cand == best[:, None], offs_e[None, :], BLOCK_E), axis=1)
        sel_w = tl.where(offs_k[None, :] == j, best[:, None], sel_w)
        sel_i = tl.where(offs_k[None, :] == j, at[:, None].to(tl.int64), sel_i)
        cand = tl.where(offs_e[None, :] == at[:, None], -1.0, cand)
    # 3. forced experts of each row at its (device) position, at their softmax probabilities (the same
    #    arithmetic on the logit read back at the forced expert)
    if HAS_FORCED:
        pos = tl.minimum(tl.load(pos_ptr), n_pos - 1)
        tk_ok = t_ok[:, None] & k_ok[None, :]
        f_i = tl.load(table_ptr + ((toks[:, None] * n_pos + pos) * n_layers + layer) * TOP_K + offs_k[None, :],
                      mask=tk_ok, other=0)
        f_logit = tl.load(row_ptrs + f_i, mask=tk_ok, other=0.0)
        f_w = tl.exp(f_logit - top[:, None]) / total[:, None]
        if FORCED_SWITCH:
            on = tl.load(on_ptr) != 0
            sel_i = tl.where(on, f_i, sel_i)
            sel_w = tl.where(on, f_w, sel_w)
        else:
            sel_i = f_i
            sel_w = f_w
    # 4. renormalise (as MoEGate: w / (sum + 1e-20)), then scale
    if NORM:
        sel_w = tl.where(k_ok[None, :], sel_w, 0.0)
        sel_w = sel_w / (tl.sum(sel_w, axis=1)[:, None] + 1e-20)
    sel_w = sel_w * SCALE
    out_ok = t_ok[:, None] & k_ok[None, :]
    tl.store(idx_ptr + toks[:, None] * stride_it + offs_k[None, :] * stride_ik, sel_i, mask=out_ok)
    tl.store(wt_ptr + toks[:, None] * stride_ot + offs_k[None, :] * stride_ok, sel_w, mask=out_ok)
    if HAS_COUNTS:                              # 5. one token (BT = 1), k distinct experts
        tl.static_assert(toks.shape[0] == 1, "the routing count in the router: one token per program")
        at = counts_row(counts_ptr, step_ptr, steps, n_layers, layer, n_exp) + sel_i
        tl.store(at, tl.load(at, mask=out_ok, other=0) + 1, mask=out_ok)


@triton.jit
def _topk_kernel(logits_ptr, idx_ptr, wt_ptr, counts_ptr, step_ptr, steps, n_layers, layer,
                 table_ptr, pos_ptr, on_ptr, n_pos, n_exp,
                 stride_lt, stride_it, stride_ik, stride_ot, stride_ok,
                 TOP_K: tl.constexpr, NORM: tl.constexpr, SCALE: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_TOPK: tl.constexpr, HAS_COUNTS: tl.constexpr, HAS_FORCED: tl.constexpr,
                 FORCED_SWITCH: tl.constexpr):
    toks = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)             # one token per program
    choose_store(logits_ptr, stride_lt, toks, toks >= 0, idx_ptr, wt_ptr, counts_ptr, step_ptr, steps, n_layers,
                  layer, table_ptr, pos_ptr, on_ptr, n_pos, stride_it, stride_ik, stride_ot, stride_ok, n_exp,
                  TOP_K, NORM, SCALE, BLOCK_E, BLOCK_TOPK, HAS_COUNTS, HAS_FORCED, FORCED_SWITCH)


def _check_counts(counts: tuple, x: torch.Tensor, E: int, layer: int) -> None:
    if x.shape[0] != 1:
        raise HarnessError(f"route: the routing counts in the kernel at one token only; got T={x.shape[0]}")
    check_counts("route", *counts, layer, E, x.device)


def check_forced(forced: tuple, x: torch.Tensor, top_k: int, layer: int) -> None:
    """Refuse ``forced`` = (table, position, on) that ``choose_store`` cannot read for the T = x.shape[0]
    tokens of MoE ``layer`` on x's device (``route``'s docstring has the layout)."""
    table, pos, on = forced
    T = x.shape[0]
    if (table.dim() != 4 or table.shape[0] != T or table.shape[3] != top_k or not 0 <= layer < table.shape[2]
            or table.dtype != torch.int64 or not table.is_contiguous() or table.device != x.device
            or pos.dtype != torch.int64 or pos.numel() != 1 or pos.device != x.device
            or (on is not None and (on.dtype != torch.bool or on.numel() != 1 or on.device != x.device))):
        raise HarnessError(f"route: forced needs a contiguous int64 table [{T}, positions, layers, {top_k}] with "
                           f"layer {layer}, an int64 position [1] and a bool flag [1] or None on {x.device}; got "
                           f"{table.dtype} {tuple(table.shape)}, position {pos.dtype} {tuple(pos.shape)}")


def router_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The router's fp32 logits, contiguous [T, E], of x [T, H] and the gate weight w [E, H]: the Triton GEMV
    (``gemv_triton.gemv``, fp32 accumulation and output), step 0 of ``route``."""
    from .gemv_triton import gemv

    return gemv(x, w, torch.float32)


def route(x: torch.Tensor, w: torch.Tensor, top_k: int, norm: bool, scale: float, layer: int = 0,
          counts: tuple | None = None, forced: tuple | None = None):
    """x [T, H], gate weight w [E, H] -> (idx int64 [T, k], weights fp32 [T, k]) of MoE ``layer``; see the
    module docstring. ``counts`` = (buffer int64 [steps + 1, layers, E] contiguous, step_index int64
    [1]), T = 1 only: the chosen experts' counters at row min(step_index, steps) + 1
    (``models.routing.DeviceRouting.device_counts``). ``forced`` = (table int64 [T, positions, layers,
    k], position int64 [1], on bool [1] or None): token t is row t of the table at that position
    (decode: one token per batch row; ``DeviceRouting.forced_inputs``). The GEMV (``router_logits``),
    then ``_topk_kernel``."""
    check_runnable(x)
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise HarnessError(f"route: x [T, H] and w [E, H] expected, got {tuple(x.shape)} and {tuple(w.shape)}")
    T = x.shape[0]
    E = w.shape[0]
    if not 1 <= top_k <= E:
        raise HarnessError(f"route: top_k={top_k} needs 1 <= top_k <= E={E}")
    if counts is not None:
        _check_counts(counts, x, E, layer)
    if forced is not None:
        check_forced(forced, x, top_k, layer)
        if counts is not None and counts[0].shape[1] != forced[0].shape[2]:
            raise HarnessError(f"route: the counts hold {counts[0].shape[1]} layers, the forced table "
                               f"{forced[0].shape[2]}")
    idx = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    buf, step = counts if counts is not None else (idx, idx)
    table, pos, on = forced if forced is not None else (idx, idx, None)
    routing_args = (buf, step, buf.shape[0] - 1 if counts is not None else 0,
                    table.shape[2] if forced is not None else (buf.shape[1] if counts is not None else 1), layer,
                    table, pos, on if on is not None else table, table.shape[1] if forced is not None else 1, E)
    flags = dict(TOP_K=top_k, NORM=bool(norm and top_k > 1), SCALE=float(scale), BLOCK_E=triton.next_power_of_2(E),
                 BLOCK_TOPK=triton.next_power_of_2(top_k), HAS_COUNTS=counts is not None,
                 HAS_FORCED=forced is not None, FORCED_SWITCH=on is not None)
    logits = router_logits(x, w)
    _topk_kernel[(T,)](
        logits, idx, weights, *routing_args, logits.stride(0), idx.stride(0), idx.stride(1),
        weights.stride(0), weights.stride(1), **flags, num_warps=1)
    return idx, weights
