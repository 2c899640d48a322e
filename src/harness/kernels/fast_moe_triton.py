"""Triton fused-MoE kernels (vLLM fused_moe style, written for this harness; triton >= 3.0).

The routed experts of T tokens (k slots each, E experts, hidden H, expert width I) with no host
sync: the rows sorted and padded per expert (``moe_blocks.align_rows_to_blocks``), a gate/up + SwiGLU
kernel and a down kernel that weights each row by its gate weight into an fp32 [T*k, H] buffer, summed
over k by PyTorch in the vendor's order (deterministic); each program reads its expert's weight tile
once, so a decode step (T=1) reads exactly the k touched experts' weights. At decode sizes the
per-row kernels (``routed_experts_rows``, ``RowsConfig``) run instead, optionally with the layer's
shared expert as extra rows; above decode size the blocked kernels take it as pseudo-experts. Importing this module imports triton and defines the kernels; with
``TRITON_INTERPRET=1`` set before the first import they run in Triton's numpy interpreter on CPU
tensors (tests only).

Design notes (the four steps of the blocked path, how the per-row tiles were chosen):
``docs/kernels/fast_moe_triton.md``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..errors import HarnessError
from .common import INTERPRETED, check_runnable, emulates_bf16_rne, rounded, row_times_tile, swiglu
from .moe_align_triton import align_rows
from .moe_blocks import (ALIGN_KERNEL_MAX_ROWS, ROWS_KERNEL_MAX, TritonMoEConfig, align_rows_to_blocks,  # noqa: F401
                         counts_in_alignment, default_triton_config)



@triton.jit
def _mma(a, b, acc, DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """acc + a @ b in fp32. DOT_IN_FP32 upcasts the operands first (exact for bf16/fp16 products):
    Triton's interpreter multiplies bf16 operands as raw uint16 bits (triton 3.9), so interpreted
    bf16 runs need it; compiled kernels leave it off and use the tensor cores."""
    if DOT_IN_FP32:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _block_rows(sorted_rows_ptr, block_expert_ptr, pid_m, num_rows, BLOCK_M: tl.constexpr):
    """(padded row offsets, flat rows t*k + j, row mask, expert) of padded block ``pid_m``."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_rows_ptr + offs_m)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    return offs_m, rows, rows < num_rows, expert


@triton.jit
def _gate_up_silu_kernel(
    x_ptr, w_ptr, sw_ptr, h_ptr, sorted_rows_ptr, block_expert_ptr, num_padded_ptr,
    num_rows, slots, hidden, inter, n_routed, s_inter,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_hm, stride_hi,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, EMULATE_BF16_RNE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    num_padded = tl.load(num_padded_ptr)
    if pid_m * BLOCK_M >= num_padded:
        return
    offs_m, rows, row_ok, expert = _block_rows(sorted_rows_ptr, block_expert_ptr, pid_m, num_rows, BLOCK_M)
    tokens = (rows // slots).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xh
    if expert < n_routed:           # a routed expert: gate rows [0, I), up rows [I, 2I) of its [2I, H]
        w0 = w_ptr + expert * stride_we
        up = inter
    else:                           # shared part p: gate rows [pI, (p+1)I), up rows S + those of [2S, H]
        w0 = sw_ptr + (expert - n_routed) * inter * stride_wn
        up = s_inter
    wg_ptrs = w0 + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wh
    wu_ptrs = wg_ptrs + up * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(hidden, BLOCK_K)):
        k_ok = offs_k < hidden - kb * BLOCK_K
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        b_gate = tl.load(wg_ptrs, mask=w_mask, other=0.0)
        b_up = tl.load(wu_ptrs, mask=w_mask, other=0.0)
        acc_gate = _mma(a, b_gate, acc_gate, DOT_PRECISION, DOT_IN_FP32)
        acc_up = _mma(a, b_up, acc_up, DOT_PRECISION, DOT_IN_FP32)
        x_ptrs += BLOCK_K * stride_xh
        wg_ptrs += BLOCK_K * stride_wh
        wu_ptrs += BLOCK_K * stride_wh
    h = swiglu(acc_gate, acc_up, h_ptr, EMULATE_BF16_RNE)
    h_ptrs = h_ptr + offs_m[:, None].to(tl.int64) * stride_hm + offs_n[None, :] * stride_hi
    tl.store(h_ptrs, h, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_weighted_kernel(
    h_ptr, w_ptr, sw_ptr, out_ptr, topk_w_ptr, sorted_rows_ptr, block_expert_ptr, num_padded_ptr,
    num_rows, hidden, inter, n_routed, top_k, slots,
    stride_hm, stride_hi, stride_we, stride_wn, stride_wi, stride_sn, stride_om, stride_oh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, EMULATE_BF16_RNE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    num_padded = tl.load(num_padded_ptr)
    if pid_m * BLOCK_M >= num_padded:
        return
    offs_m, rows, row_ok, expert = _block_rows(sorted_rows_ptr, block_expert_ptr, pid_m, num_rows, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + offs_m[:, None].to(tl.int64) * stride_hm + offs_k[None, :] * stride_hi
    routed = expert < n_routed
    if routed:                      # a routed expert's down_proj [H, I]
        w0 = w_ptr + expert * stride_we
        sn = stride_wn
    else:                           # shared part p: columns [pI, (p+1)I) of the shared down_proj [H, S]
        w0 = sw_ptr + (expert - n_routed) * inter * stride_wi
        sn = stride_sn
    w_ptrs = w0 + offs_n[None, :] * sn + offs_k[:, None] * stride_wi
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(inter, BLOCK_K)):
        k_ok = offs_k < inter - kb * BLOCK_K
        a = tl.load(h_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = _mma(a, b, acc, DOT_PRECISION, DOT_IN_FP32)
        h_ptrs += BLOCK_K * stride_hi
        w_ptrs += BLOCK_K * stride_wi
    if routed:
        # row t*slots + j's gate weight is topk_w[t, j]; down_proj's rounding to the activation dtype,
        # then the vendor's fp32 weighting
        gate_w = tl.load(topk_w_ptr + (rows // slots) * top_k + rows % slots, mask=row_ok, other=0.0).to(tl.float32)
        y = rounded(acc, h_ptr.dtype.element_ty, EMULATE_BF16_RNE) * gate_w[:, None]
    else:                           # a shared part: its fp32 partial, summed over the parts and rounded once
        y = acc
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_oh
    tl.store(out_ptrs, y, mask=row_ok[:, None] & n_ok[None, :])


def routed_experts_triton(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor,
                          weights, config: TritonMoEConfig | None = None, shared: tuple | None = None,
                          counts: tuple | None = None) -> torch.Tensor:
    """Routed-expert output [T, H] in x's dtype; see the module docstring. Inputs as ``fast_moe``.
    ``shared`` = (gate_up [2S, H], down [H, S]) adds the shared expert's output: at decode size as extra
    rows of ``routed_experts_rows``; above it as P = S / I pseudo-experts E .. E + P - 1 of the blocked
    kernels (``docs/kernels/fast_moe_triton.md``, "The shared expert in the blocked kernels"), every token a row of each (T*(k + P) <= ALIGN_KERNEL_MAX_ROWS), their down
    rows fp32 partials summed and rounded once, as the rows path does (one GEMM over S rounds once).
    ``counts`` (only where ``counts_in_alignment``): (buffer, step index, layer) of
    ``moe_align_triton.align_rows``, which adds the routing count in the alignment's launch. Step 1
    is that kernel up to ALIGN_KERNEL_MAX_ROWS rows, torch beyond."""
    check_runnable(x)
    if topk_w.dtype != torch.float32:
        raise HarnessError(f"triton MoE multiplies by fp32 gate weights (as the vendor does); topk_w is {topk_w.dtype}")
    T, k = topk_ids.shape
    if counts is not None and not counts_in_alignment(T * k):
        raise HarnessError(f"routed_experts_triton: the routing counts in the alignment kernel only from "
                           f"{ROWS_KERNEL_MAX + 1} to {ALIGN_KERNEL_MAX_ROWS} routed rows; got {T * k}")
    if config is None and T * k <= ROWS_KERNEL_MAX:
        return routed_experts_rows(x, topk_ids, topk_w, weights, shared=shared)
    cfg, parts, sgu, sdn = _blocked_plan(T, k, weights, config, shared)
    al = align_rows(topk_ids, weights.num_experts, cfg.block_m, counts, parts) if T * (k + parts) <= \
        ALIGN_KERNEL_MAX_ROWS else align_rows_to_blocks(topk_ids, weights.num_experts, cfg.block_m)
    return _blocked_launches(x, topk_w, al, weights, cfg, k, parts, sgu, sdn, shared is not None)


def routed_experts_routing(x: torch.Tensor, logits: torch.Tensor, gate: tuple, weights,
                           forced: tuple | None = None, counts: tuple | None = None,
                           shared: tuple | None = None) -> torch.Tensor:
    """``routed_experts_triton``'s blocked path from the router's fp32 ``logits`` [T, E] instead of its
    choice: ``gate`` = (top_k, norm, scale, layer) and ``forced`` as ``router_triton.route``'s; the
    choice and the rows' alignment (``counts``, ``shared`` as there) are one launch
    (``moe_align_triton.route_and_align``), before the gate/up and down launches. T*k above
    ``ROWS_KERNEL_MAX`` and T*(k + shared parts) up to ``ALIGN_KERNEL_MAX_ROWS`` only."""
    from .moe_align_triton import route_and_align

    check_runnable(x)
    top_k, norm, scale, layer = gate
    T = x.shape[0]
    if logits.shape != (T, weights.num_experts) or not counts_in_alignment(T * top_k):
        raise HarnessError(f"routed_experts_routing: logits [{T}, {weights.num_experts}] and {ROWS_KERNEL_MAX + 1} to "
                           f"{ALIGN_KERNEL_MAX_ROWS} routed rows expected; got {tuple(logits.shape)}, {T} x {top_k}")
    cfg, parts, sgu, sdn = _blocked_plan(T, top_k, weights, None, shared)
    _, w, al = route_and_align(logits, top_k, norm, scale, layer, cfg.block_m, forced, counts, parts)
    return _blocked_launches(x, w, al, weights, cfg, top_k, parts, sgu, sdn, shared is not None)


def _blocked_plan(T: int, k: int, weights, config: TritonMoEConfig | None, shared: tuple | None) -> tuple:
    """(config, shared parts P, shared gate_up, shared down) of the blocked kernels for T tokens of k routed
    rows: ``default_triton_config`` unless given, its tiles checked; the routed weights stand in for the
    shared ones without ``shared``."""
    E, gu, dn = weights.num_experts, weights.gate_up, weights.down
    parts = _shared_parts(shared, gu, dn) if shared is not None else 0
    if shared is not None and T * (k + parts) > ALIGN_KERNEL_MAX_ROWS:
        raise HarnessError(f"the shared expert folds into impl=triton's kernels up to {ALIGN_KERNEL_MAX_ROWS} rows "
                           f"with its parts; got {T} tokens x ({k} + {parts}) = {T * (k + parts)}")
    sgu, sdn = shared if shared is not None else (gu, dn)
    cfg = config or default_triton_config(T * k, E)
    for name in ("block_m", "block_n", "block_k"):
        size = getattr(cfg, name)
        if size < 16 or size & (size - 1):
            raise HarnessError(f"TritonMoEConfig.{name}={size}: tl.dot needs a power of two >= 16")
    return cfg, parts, sgu, sdn


def _blocked_launches(x: torch.Tensor, topk_w: torch.Tensor, al, weights, cfg: TritonMoEConfig, k: int, parts: int,
                      sgu: torch.Tensor, sdn: torch.Tensor, shared: bool) -> torch.Tensor:
    """The gate/up and down launches over the aligned rows ``al``, then the sum over k (and the shared
    expert's parts): steps 2-4 of the blocked path. -> [T, H] in x's dtype."""
    E, H, inter = weights.num_experts, weights.hidden, weights.inter
    gu, dn = weights.gate_up, weights.down
    T, slots = x.shape[0], k + parts
    x = x.contiguous()
    topk_w32 = topk_w.contiguous()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"   # fp32 inputs: no TF32 rounding
    dot_in_fp32 = INTERPRETED and x.dtype != torch.float32
    emulate_rne = emulates_bf16_rne(x.dtype)
    h = torch.empty(al.max_blocks * cfg.block_m, inter, dtype=x.dtype, device=x.device)
    out_rows = torch.empty(T * slots, H, dtype=torch.float32, device=x.device)
    grid_gate_up = (al.max_blocks, triton.cdiv(inter, cfg.block_n))
    _gate_up_silu_kernel[grid_gate_up](
        x, gu, sgu, h, al.sorted_rows, al.block_expert, al.num_padded,
        al.num_rows, slots, H, inter, E, parts * inter,
        x.stride(0), x.stride(1), gu.stride(0), gu.stride(1), gu.stride(2), h.stride(0), h.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_PRECISION=precision,
        DOT_IN_FP32=dot_in_fp32, EMULATE_BF16_RNE=emulate_rne, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    grid_down = (al.max_blocks, triton.cdiv(H, cfg.block_n))
    _down_weighted_kernel[grid_down](
        h, dn, sdn, out_rows, topk_w32, al.sorted_rows, al.block_expert, al.num_padded,
        al.num_rows, H, inter, E, k, slots,
        h.stride(0), h.stride(1), dn.stride(0), dn.stride(1), dn.stride(2), sdn.stride(0), out_rows.stride(0),
        out_rows.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_PRECISION=precision,
        DOT_IN_FP32=dot_in_fp32, EMULATE_BF16_RNE=emulate_rne, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return _routed_plus_shared(out_rows.view(T, slots, H), k, x.dtype, shared)


def _routed_plus_shared(out: torch.Tensor, k: int, dtype: torch.dtype, shared: bool) -> torch.Tensor:
    """[T, H] from the fp32 rows [T, slots, H]: the k weighted routed rows summed and rounded; with
    ``shared``, plus the shared expert's fp32 partials (slots k ..) summed and rounded once (an fp32
    GEMM's rounding), each rounded to ``dtype`` before the add, as ``MoE.forward`` adds them."""
    routed = out[:, :k].sum(dim=1).to(dtype)
    return routed + out[:, k:].sum(dim=1).to(dtype) if shared else routed


def _shared_parts(shared: tuple, gu: torch.Tensor, dn: torch.Tensor) -> int:
    """P = S / I of the shared expert (gate_up [2S, H], down [H, S]) over experts of width I (``gu``
    [E, 2I, H], ``dn`` [E, H, I]), refused unless S is a multiple of I with the experts' dtype and the
    experts' strides along H (gate/up) and I (down)."""
    sgu, sdn = shared
    inter, H = dn.shape[2], dn.shape[1]
    s_inter = sdn.shape[1] if sdn.dim() == 2 else 0
    if (not s_inter or s_inter % inter or tuple(sgu.shape) != (2 * s_inter, H) or sdn.shape[0] != H
            or sgu.dtype != gu.dtype or sdn.dtype != gu.dtype or sgu.stride() != (gu.stride(1), gu.stride(2))
            or sdn.stride(1) != dn.stride(2)):
        raise HarnessError(f"shared weights {tuple(sgu.shape)}, {tuple(sdn.shape)} {sgu.dtype} do not fit experts of "
                           f"width {inter}, hidden {H}, {gu.dtype} (need [2S, H], [H, S], S a multiple of the width, "
                           "the experts' strides)")
    return s_inter // inter


# ------------------------------------------------------------------------------ decode-size batches
#
# For a few routed rows (T*k <= ROWS_KERNEL_MAX, a decode step at small batch) sorting and padding
# rows per expert costs more than it saves: a dozen small launches per layer around two GEMMs whose
# tiles are mostly padding. ``routed_experts_rows`` instead gives every (token, slot) row its own
# programs: each reads its expert id from ``topk_ids`` on the device and streams BLOCK_N rows of that
# expert's weights once (a GEMV on the CUDA cores, fp32 accumulation), so a batch-1 step reads exactly
# the k touched experts, in 2 launches plus the sum over k. The reduction length (H for gate/up, I
# for down) is a compile-time constant and the loop over it is unrolled, so a program issues all its
# weight loads before the first multiply: a memory-bound GEMV needs many bytes in flight per SM, which
# a rolled loop of dependent iterations does not give. Rows that share an expert read it again (from
# L2 when close in time), so the blocked kernels above serve larger batches.
#
# With ``shared`` (the layer's shared expert, width S = P*I) the same two launches also run it: each
# token gets P more rows. Part p's gate/up row computes the shared h columns [p*I, (p+1)*I) (gate
# and up rows [p*I, (p+1)*I) of the shared weight); its down row multiplies them by the shared
# down_proj's columns [p*I, (p+1)*I) into an fp32 partial, unrounded. The P partials are summed and
# rounded once afterwards, as one fp32-accumulating GEMM over S rounds. Every program has the same
# reduction length, a batch-1 MoE layer is 2 launches and the sum instead of 4 and the sum, and the
# shared weights stream alongside the routed ones.


@dataclass(frozen=True)
class RowsConfig:
    """Tile sizes of the per-row kernels: BLOCK_N output columns per program, BLOCK_K reduction
    elements per load, num_warps; ``gate_up`` for the first kernel, ``down`` for the second. How the
    defaults were measured: ``docs/kernels/fast_moe_triton.md``."""
    gate_up: tuple[int, int, int] = (4, 256, 4)
    down: tuple[int, int, int] = (8, 256, 4)

    def check(self) -> None:
        for name, (bn, bk, warps) in (("gate_up", self.gate_up), ("down", self.down)):
            if min(bn, bk) < 1 or bn & (bn - 1) or bk & (bk - 1) or warps not in (1, 2, 4, 8):
                raise HarnessError(f"RowsConfig.{name}={(bn, bk, warps)}: block sizes must be powers of two, "
                                   "num_warps one of 1, 2, 4, 8")


@triton.jit
def _rows_gate_up_silu_kernel(
    x_ptr, w_ptr, sw_ptr, h_ptr, ids_ptr, top_k, slots, inter, shared_inter,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_sn, stride_sh, stride_hr, stride_hi,
    HIDDEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE_BF16_RNE: tl.constexpr,
):
    row = tl.program_id(0)                  # h row t*slots + j: j < top_k routed, else shared part j - top_k
    token = (row // slots).to(tl.int64)
    slot = row % slots
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    xp = x_ptr + token * stride_xt
    if slot < top_k:
        expert = tl.load(ids_ptr + token * top_k + slot).to(tl.int64)
        wg = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn
        acc_gate = row_times_tile(xp, wg, stride_xh, stride_wh, n_ok, HIDDEN, BLOCK_N, BLOCK_K)
        acc_up = row_times_tile(xp, wg + inter * stride_wn, stride_xh, stride_wh, n_ok, HIDDEN, BLOCK_N, BLOCK_K)
    else:
        wg = sw_ptr + ((slot - top_k) * inter + offs_n[:, None]).to(tl.int64) * stride_sn
        acc_gate = row_times_tile(xp, wg, stride_xh, stride_sh, n_ok, HIDDEN, BLOCK_N, BLOCK_K)
        acc_up = row_times_tile(xp, wg + shared_inter * stride_sn, stride_xh, stride_sh, n_ok, HIDDEN, BLOCK_N,
                                 BLOCK_K)
    h = swiglu(acc_gate, acc_up, h_ptr, EMULATE_BF16_RNE)
    tl.store(h_ptr + row.to(tl.int64) * stride_hr + offs_n * stride_hi, h, mask=n_ok)


@triton.jit
def _rows_down_weighted_kernel(
    h_ptr, w_ptr, sw_ptr, out_ptr, ids_ptr, topk_w_ptr, top_k, slots, hidden,
    stride_hr, stride_hi, stride_we, stride_wn, stride_wi, stride_sn, stride_si, stride_or, stride_oh,
    INTER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE_BF16_RNE: tl.constexpr,
):
    row = tl.program_id(0)                  # row t*slots + j (h and out alike): j < top_k routed, else shared part
    token = (row // slots).to(tl.int64)
    slot = row % slots
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    hp = h_ptr + row.to(tl.int64) * stride_hr
    if slot < top_k:
        flat = token * top_k + slot
        expert = tl.load(ids_ptr + flat).to(tl.int64)
        acc = row_times_tile(hp, w_ptr + expert * stride_we + offs_n[:, None] * stride_wn, stride_hi, stride_wi,
                              n_ok, INTER, BLOCK_N, BLOCK_K)
        gate_w = tl.load(topk_w_ptr + flat).to(tl.float32)
        # down_proj's rounding to the activation dtype, then the vendor's fp32 weighting
        y = rounded(acc, h_ptr.dtype.element_ty, EMULATE_BF16_RNE) * gate_w
    else:                                   # shared part p: columns [p*I, (p+1)*I) of its down_proj, fp32 partial
        wp = sw_ptr + offs_n[:, None] * stride_sn + ((slot - top_k) * INTER) * stride_si
        y = row_times_tile(hp, wp, stride_hi, stride_si, n_ok, INTER, BLOCK_N, BLOCK_K)
    tl.store(out_ptr + row.to(tl.int64) * stride_or + offs_n * stride_oh, y, mask=n_ok)


def routed_experts_rows(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, weights,
                        config: RowsConfig = RowsConfig(), shared: tuple | None = None) -> torch.Tensor:
    """Routed-expert output [T, H] for a few rows (decode): one program column per (token, slot) row,
    no sorting (see the section comment). Same rounding points as the blocked kernels.

    ``shared``: (gate_up [2S, H] = gate rows then up rows, down [H, S]) of the layer's shared expert,
    S a multiple of the expert width I; the result is then routed + shared(x), each rounded to x's
    dtype before the add, as ``MoE.forward`` adds them."""
    check_runnable(x)
    config.check()
    T, k = topk_ids.shape
    H, inter = weights.hidden, weights.inter
    gu, dn = weights.gate_up, weights.down
    sgu, sdn = shared if shared is not None else (gu, dn)
    s_inter = _shared_parts(shared, gu, dn) * inter if shared is not None else 0
    slots = k + s_inter // inter                # routed rows, then the shared expert's P parts
    x = x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    w32 = topk_w.reshape(-1).contiguous()
    emulate_rne = emulates_bf16_rne(x.dtype)
    h = torch.empty(T * slots, inter, dtype=x.dtype, device=x.device)
    out_rows = torch.empty(T * slots, H, dtype=torch.float32, device=x.device)
    (bn, bk, warps), (bn_d, bk_d, warps_d) = config.gate_up, config.down
    _rows_gate_up_silu_kernel[(T * slots, triton.cdiv(inter, bn))](
        x, gu, sgu, h, ids, k, slots, inter, s_inter, x.stride(0), x.stride(1), gu.stride(0), gu.stride(1),
        gu.stride(2), sgu.stride(0), sgu.stride(1), h.stride(0), h.stride(1), HIDDEN=H, BLOCK_N=bn, BLOCK_K=bk,
        EMULATE_BF16_RNE=emulate_rne, num_warps=warps)
    _rows_down_weighted_kernel[(T * slots, triton.cdiv(H, bn_d))](
        h, dn, sdn, out_rows, ids, w32, k, slots, H, h.stride(0), h.stride(1), dn.stride(0),
        dn.stride(1), dn.stride(2), sdn.stride(0), sdn.stride(1), out_rows.stride(0), out_rows.stride(1),
        INTER=inter, BLOCK_N=bn_d, BLOCK_K=bk_d, EMULATE_BF16_RNE=emulate_rne, num_warps=warps_d)
    return _routed_plus_shared(out_rows.view(T, slots, H), k, x.dtype, shared is not None)
