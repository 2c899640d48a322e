"""Decode-size linear layers (a few rows times a weight) as Triton GEMV kernels.

At batch 1 a decode step multiplies one row by each weight: cuBLAS picks a GEMM tile whose grid
covers N with a few dozen programs (20 for N=1280 on an H200), so a 3 MB weight takes ~5 µs, a
third of the HBM bandwidth. Here each program owns BLOCK_N output columns of one row and streams
those weight rows once, with the reduction over K unrolled (K is a compile-time constant) so that
all its loads are in flight together; N/BLOCK_N programs per row fill the SMs. Rows of a small
batch are programs of their own and read the weight again (from L2 when close in time).

``gemv(x, w)``: x [M, K] @ w[N, K]^T -> [M, N] in ``out_dtype`` (x's by default), fp32 accumulation,
one rounding at the end, as F.linear rounds. ``gemv_swiglu(x, w_gate_up)``: w_gate_up [2I, K] holds
gate rows then up rows; returns silu(x @ gate^T) * (x @ up^T) [M, I] with the vendor SwiGLU's
roundings (``fast_moe_triton._swiglu``). Importing this module imports triton; ``TRITON_INTERPRET=1``
before the first import runs the kernels on CPU tensors (tests).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..errors import HarnessError
from .fast_moe_triton import INTERPRETED, _check_runnable, _rne, _swiglu


@dataclass(frozen=True)
class GemvConfig:
    """BLOCK_N output columns per program, BLOCK_K reduction elements per load, num_warps. Default:
    the fastest tile at one row for every decoder shape of ``scripts/bench_decode_linear.py --sweep``
    on an H200 (q/k/v/o 3.48 µs, fused qkv 4.88, shared down 4.54, shared gate_up+SwiGLU 5.04;
    (8, 256, 4) took 5.31, 6.26, 7.23 and 7.22)."""
    block_n: int = 4
    block_k: int = 256
    num_warps: int = 4

    def check(self) -> None:
        bn, bk, w = self.block_n, self.block_k, self.num_warps
        if min(bn, bk) < 1 or bn & (bn - 1) or bk & (bk - 1) or w not in (1, 2, 4, 8):
            raise HarnessError(f"GemvConfig{(bn, bk, w)}: block sizes must be powers of two, "
                               "num_warps one of 1, 2, 4, 8")


@triton.jit
def _row_times_tile(xp, wp, stride_xk, stride_wk, n_ok, K: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """sum_k x[k] * w[n, k] in fp32 for the BLOCK_N weight rows at ``wp`` (pointers [BLOCK_N, 1])."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        xv = tl.load(xp + (k0 + offs_k) * stride_xk, mask=k_ok, other=0.0).to(tl.float32)
        wv = tl.load(wp + (k0 + offs_k)[None, :] * stride_wk, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(wv.to(tl.float32) * xv[None, :], axis=1)
    return acc


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, n_out, stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
                 K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE_BF16_RNE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_out
    acc = _row_times_tile(x_ptr + row * stride_xm, w_ptr + offs_n[:, None] * stride_wn, stride_xk, stride_wk,
                          n_ok, K, BLOCK_N, BLOCK_K)
    y = _rne(acc, EMULATE_BF16_RNE).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_ym + offs_n * stride_yn, y, mask=n_ok)


@triton.jit
def _gemv_swiglu_kernel(x_ptr, w_ptr, h_ptr, inter, stride_xm, stride_xk, stride_wn, stride_wk, stride_hm, stride_hi,
                        K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EMULATE_BF16_RNE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    xp = x_ptr + row * stride_xm
    wg = w_ptr + offs_n[:, None] * stride_wn
    acc_gate = _row_times_tile(xp, wg, stride_xk, stride_wk, n_ok, K, BLOCK_N, BLOCK_K)
    acc_up = _row_times_tile(xp, wg + inter * stride_wn, stride_xk, stride_wk, n_ok, K, BLOCK_N, BLOCK_K)
    h = _swiglu(acc_gate, acc_up, h_ptr, EMULATE_BF16_RNE)
    tl.store(h_ptr + row * stride_hm + offs_n * stride_hi, h, mask=n_ok)


def _check(x: torch.Tensor, w: torch.Tensor, config: GemvConfig) -> None:
    _check_runnable(x)
    config.check()
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise HarnessError(f"gemv: x [M, K] and w [N, K] expected, got {tuple(x.shape)} and {tuple(w.shape)}")


def gemv(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
         config: GemvConfig = GemvConfig()) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T -> [M, N] (fp32 accumulation, rounded once to ``out_dtype``)."""
    _check(x, w, config)
    M, K = x.shape
    N = w.shape[0]
    out_dtype = out_dtype or x.dtype
    y = torch.empty(M, N, dtype=out_dtype, device=x.device)
    _gemv_kernel[(M, triton.cdiv(N, config.block_n))](
        x, w, y, N, x.stride(0), x.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1),
        K=K, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EMULATE_BF16_RNE=INTERPRETED and out_dtype == torch.bfloat16, num_warps=config.num_warps)
    return y


def gemv_swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, config: GemvConfig = GemvConfig()) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) -> [M, I] in x's dtype; ``w_gate_up`` [2I, K] = gate rows, up rows."""
    _check(x, w_gate_up, config)
    if w_gate_up.shape[0] % 2:
        raise HarnessError(f"gemv_swiglu: w_gate_up needs 2I rows, got {w_gate_up.shape[0]}")
    M, K = x.shape
    inter = w_gate_up.shape[0] // 2
    h = torch.empty(M, inter, dtype=x.dtype, device=x.device)
    _gemv_swiglu_kernel[(M, triton.cdiv(inter, config.block_n))](
        x, w_gate_up, h, inter, x.stride(0), x.stride(1), w_gate_up.stride(0), w_gate_up.stride(1),
        h.stride(0), h.stride(1), K=K, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EMULATE_BF16_RNE=INTERPRETED and x.dtype == torch.bfloat16, num_warps=config.num_warps)
    return h
