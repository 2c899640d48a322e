"""Batched-decode linear layers (a few token rows times a weight) on the tensor cores, in Triton.

``skinny_linear(x, w)``: x [M, K] @ w[N, K]^T -> [M, N] in x's dtype for 2 <= M <= ``MAX_ROWS``: one
program per ``block_n`` output columns holds all M rows (padded to a power of two >= 16, as tl.dot
needs), so the weight is read once; the K loop streams through Triton's software pipeline
(``num_stages``); fp32 accumulation, one rounding at the end, as F.linear rounds (summation order
differs from cuBLAS's). At these sizes cuBLAS picks a 64-column tile and leaves most SMs idle (an
H200 at batch 32: q/k/v 5.8 µs for 9.8 MB, o_proj 5.1 µs for 3.3 MB, 35% and 13% of the
datasheet, ``runs/examples/h200-issue40-s7/kernels_ladder_67a00fe.txt``); narrower tiles spread the
weight over more SMs. Importing this module imports triton; ``TRITON_INTERPRET=1`` before the first
import of ``common`` runs the kernel on CPU tensors (tests).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..errors import HarnessError
from .common import INTERPRETED, check_runnable, emulates_bf16_rne, mma, rne

#: token rows up to which the kernel holds them in one tile (more: cuBLAS reads the weight once anyway)
MAX_ROWS = 64


@dataclass(frozen=True)
class SkinnyConfig:
    """``block_n`` output columns per program, ``block_k`` reduction elements per load (powers of two
    >= 16), ``num_warps`` (1-8), ``num_stages`` (software-pipeline depth, 1-12: stages - 1 loads in
    flight); ``unroll``: the K loop unrolled at compile time instead (every load may be issued at once,
    as the GEMV kernels do; ``num_stages`` then unused)."""
    block_n: int = 32
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    unroll: bool = False

    def check(self) -> None:
        bn, bk = self.block_n, self.block_k
        if min(bn, bk) < 16 or bn & (bn - 1) or bk & (bk - 1) or self.num_warps not in (1, 2, 4, 8) \
                or not 1 <= self.num_stages <= 12:
            raise HarnessError(f"SkinnyConfig{(bn, bk, self.num_warps, self.num_stages)}: block sizes powers of two "
                               ">= 16 (tl.dot), num_warps one of 1, 2, 4, 8, num_stages 1-12")


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
                   K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   UNROLL: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
                   EMULATE_BF16_RNE: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk    # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if UNROLL:
        for k0 in tl.static_range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            a = tl.load(x_ptrs + k0 * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs + k0 * stride_wk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = mma(a, b, acc, DOT_PRECISION, DOT_IN_FP32)
    else:
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k_ok = offs_k < K - kb * BLOCK_K
            a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = mma(a, b, acc, DOT_PRECISION, DOT_IN_FP32)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
    y = rne(acc, EMULATE_BF16_RNE).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn, y,
             mask=m_ok[:, None] & n_ok[None, :])


def skinny_linear(x: torch.Tensor, w: torch.Tensor, config: SkinnyConfig = SkinnyConfig()) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T -> [M, N] in x's dtype (module docstring), 1 <= M <= ``MAX_ROWS``."""
    check_runnable(x)
    config.check()
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or x.dtype != w.dtype:
        raise HarnessError(f"skinny_linear: x [M, K] and w [N, K] of one dtype expected, got {tuple(x.shape)} "
                           f"{x.dtype} and {tuple(w.shape)} {w.dtype}")
    M, K = x.shape
    N = w.shape[0]
    if not 1 <= M <= MAX_ROWS:
        raise HarnessError(f"skinny_linear: 1 to {MAX_ROWS} rows, got {M}")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_m = max(16, triton.next_power_of_2(M))
    _skinny_kernel[(triton.cdiv(N, config.block_n), triton.cdiv(M, block_m))](
        x, w, y, M, N, x.stride(0), x.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1),
        K=K, BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, UNROLL=config.unroll,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=INTERPRETED and x.dtype != torch.float32, EMULATE_BF16_RNE=emulates_bf16_rne(x.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages)
    return y
