"""Decode-size linear layers (a few rows times a weight) as Triton GEMV kernels.

``gemv(x, w)``: x [M, K] @ w[N, K]^T -> [M, N] in ``out_dtype`` (x's by default), fp32 accumulation,
one rounding at the end, as F.linear rounds. ``gemv_swiglu(x, w_gate_up)``: w_gate_up [2I, K] holds
gate rows then up rows; returns silu(x @ gate^T) * (x @ up^T) [M, I] with the vendor SwiGLU's
roundings (``common.swiglu``). Each program owns BLOCK_N output columns of one row (``GemvConfig``).
Importing this module imports triton; ``TRITON_INTERPRET=1`` before the first import runs the
kernels on CPU tensors (tests).

Why a GEMV beats cuBLAS at one row, and how the tiles were chosen: ``docs/kernels/gemv_triton.md``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..errors import HarnessError
from .common import check_runnable, emulates_bf16_rne, rne, rounded, row_times_tile, swiglu


@dataclass(frozen=True)
class GemvConfig:
    """BLOCK_N output columns per program, BLOCK_K reduction elements per load, num_warps (powers of
    two; warps 1-8). How the default was measured: ``docs/kernels/gemv_triton.md``."""
    block_n: int = 4
    block_k: int = 256
    num_warps: int = 4

    def check(self) -> None:
        bn, bk, w = self.block_n, self.block_k, self.num_warps
        if min(bn, bk) < 1 or bn & (bn - 1) or bk & (bk - 1) or w not in (1, 2, 4, 8):
            raise HarnessError(f"GemvConfig{(bn, bk, w)}: block sizes must be powers of two, "
                               "num_warps one of 1, 2, 4, 8")


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, n_out, stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
                 K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE_BF16_RNE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_out
    acc = row_times_tile(x_ptr + row * stride_xm, w_ptr + offs_n[:, None] * stride_wn, stride_xk, stride_wk,
                          n_ok, K, BLOCK_N, BLOCK_K)
    y = rne(acc, EMULATE_BF16_RNE).to(y_ptr.dtype.element_ty)
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
    acc_gate = row_times_tile(xp, wg, stride_xk, stride_wk, n_ok, K, BLOCK_N, BLOCK_K)
    acc_up = row_times_tile(xp, wg + inter * stride_wn, stride_xk, stride_wk, n_ok, K, BLOCK_N, BLOCK_K)
    h = swiglu(acc_gate, acc_up, h_ptr, EMULATE_BF16_RNE)
    tl.store(h_ptr + row * stride_hm + offs_n * stride_hi, h, mask=n_ok)


def _check(x: torch.Tensor, w: torch.Tensor, config: GemvConfig) -> None:
    check_runnable(x)
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
        EMULATE_BF16_RNE=emulates_bf16_rne(out_dtype), num_warps=config.num_warps)
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
        EMULATE_BF16_RNE=emulates_bf16_rne(x.dtype), num_warps=config.num_warps)
    return h


# ------------------------------------------------------------------ q/k/v, RoPE and the KV write
#
# A static-cache decode step of one token runs q/k/v as one GEMV, then RoPE on q and k and the
# write of k and v into the cache at the step's position: two more small kernels per layer. Here
# they are the GEMV's epilogue. RoPE (rotate_half) pairs dim i with i + d/2 of a head, so each
# program owns BLOCK_P such pairs (columns a and a + d/2) instead of consecutive columns; the pairs
# of all heads of q, k and v are numbered one after the other. Roundings are the eager vendor's:
# the linear's output, then q * cos, rotate_half(q) * sin and their sum each rounded to the
# activation dtype (a compiled vendor step rounds only the sum: within one rounding of this).


@triton.jit
def _pair_columns(offs_j, HALF: tl.constexpr):
    """(dim, column a) of column pairs ``offs_j``: pair j of the heads numbered one after the other is
    columns a and a + HALF of its head (``dim`` = a's place in the head's first half)."""
    dim = offs_j % HALF
    return dim, (offs_j // HALF) * (2 * HALF) + dim


@triton.jit
def _rope_store(ya, yb, dim, col_a, ok, cos_ptr, sin_ptr, pos_ptr, q_ptr, k_ptr, v_ptr, q_cols, kv_cols,
                stride_cd, stride_sd, stride_kh, stride_kn, stride_vh, stride_vn,
                HALF: tl.constexpr, EMULATE_BF16_RNE: tl.constexpr):
    """Column pairs (``dim``, ``col_a``: ``_pair_columns``) of one token's q/k/v, the linear's rounded
    output ``ya``, ``yb`` (fp32 holding activation-dtype values): RoPE on q and k (the step's
    ``cos``/``sin`` [2 * HALF]), q stored at ``q_ptr``, k and v written into one sequence's caches
    [nkv, L, d] at ``pos``."""
    act = q_ptr.dtype.element_ty
    col_b = col_a + HALF
    cos_a = tl.load(cos_ptr + dim * stride_cd).to(tl.float32)
    cos_b = tl.load(cos_ptr + (dim + HALF) * stride_cd).to(tl.float32)
    sin_a = tl.load(sin_ptr + dim * stride_sd).to(tl.float32)
    sin_b = tl.load(sin_ptr + (dim + HALF) * stride_sd).to(tl.float32)
    # q * cos + rotate_half(q) * sin, rotate_half(q) = (-q[a + HALF], q[a]) at (a, a + HALF)
    ra = rne(rounded(ya * cos_a, act, EMULATE_BF16_RNE) + rounded(-yb * sin_a, act, EMULATE_BF16_RNE),
              EMULATE_BF16_RNE).to(act)
    rb = rne(rounded(yb * cos_b, act, EMULATE_BF16_RNE) + rounded(ya * sin_b, act, EMULATE_BF16_RNE),
              EMULATE_BF16_RNE).to(act)
    pos = tl.load(pos_ptr)
    is_q = col_a < q_cols
    is_k = (col_a >= q_cols) & (col_a < q_cols + kv_cols)
    is_v = col_a >= q_cols + kv_cols
    tl.store(q_ptr + col_a, ra, mask=ok & is_q)
    tl.store(q_ptr + col_b, rb, mask=ok & is_q)
    kc = col_a - q_cols                                                   # k column: head * 2*HALF + dim
    k_at = k_ptr + (kc // (2 * HALF)) * stride_kh + pos * stride_kn + dim
    tl.store(k_at, ra, mask=ok & is_k)
    tl.store(k_at + HALF, rb, mask=ok & is_k)
    vc = col_a - q_cols - kv_cols
    v_at = v_ptr + (vc // (2 * HALF)) * stride_vh + pos * stride_vn + dim
    tl.store(v_at, ya.to(act), mask=ok & is_v)
    tl.store(v_at + HALF, yb.to(act), mask=ok & is_v)


@triton.jit
def _qkv_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, k_ptr, v_ptr, q_cols, kv_cols,
                     stride_xk, stride_wn, stride_wk, stride_cd, stride_sd, stride_kh, stride_kn, stride_vh, stride_vn,
                     K: tl.constexpr, HALF: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
                     EMULATE_BF16_RNE: tl.constexpr):
    offs_j = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)      # pair j: columns a, a + HALF
    ok = offs_j < (q_cols + 2 * kv_cols) // 2
    dim, col_a = _pair_columns(offs_j, HALF)
    acc_a = row_times_tile(x_ptr, w_ptr + col_a[:, None].to(tl.int64) * stride_wn, stride_xk, stride_wk, ok, K,
                            BLOCK_P, BLOCK_K)
    acc_b = row_times_tile(x_ptr, w_ptr + (col_a + HALF)[:, None].to(tl.int64) * stride_wn, stride_xk, stride_wk, ok,
                            K, BLOCK_P, BLOCK_K)
    act = q_ptr.dtype.element_ty
    ya = rounded(acc_a, act, EMULATE_BF16_RNE)                          # the linear's output
    yb = rounded(acc_b, act, EMULATE_BF16_RNE)
    _rope_store(ya, yb, dim, col_a, ok, cos_ptr, sin_ptr, pos_ptr, q_ptr, k_ptr, v_ptr, q_cols, kv_cols,
                stride_cd, stride_sd, stride_kh, stride_kn, stride_vh, stride_vn, HALF, EMULATE_BF16_RNE)


@triton.jit
def _rope_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, k_ptr, v_ptr, q_cols, kv_cols,
                    stride_tb, stride_tn, stride_cd, stride_sd, stride_qb, stride_kb, stride_kh, stride_kn,
                    stride_vb, stride_vh, stride_vn,
                    HALF: tl.constexpr, BLOCK_P: tl.constexpr, EMULATE_BF16_RNE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)                                   # the sequence
    offs_j = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)         # pair j: columns a, a + HALF
    ok = offs_j < (q_cols + 2 * kv_cols) // 2
    dim, col_a = _pair_columns(offs_j, HALF)
    row = qkv_ptr + b * stride_tb
    ya = tl.load(row + col_a * stride_tn, mask=ok, other=0.0).to(tl.float32)
    yb = tl.load(row + (col_a + HALF) * stride_tn, mask=ok, other=0.0).to(tl.float32)
    _rope_store(ya, yb, dim, col_a, ok, cos_ptr, sin_ptr, pos_ptr, q_ptr + b * stride_qb, k_ptr + b * stride_kb,
                v_ptr + b * stride_vb, q_cols, kv_cols, stride_cd, stride_sd, stride_kh, stride_kn, stride_vh,
                stride_vn, HALF, EMULATE_BF16_RNE)


def _rope_targets_fit(rows: int, cols: int, dtype: torch.dtype, cos: torch.Tensor, sin: torch.Tensor,
                      pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int) -> bool:
    """Whether ``rows`` tokens' ``cols`` q/k/v columns (``num_heads`` query heads, then the caches' k and
    v heads) can take RoPE (``cos``, ``sin`` [d]) and be written into ``k_cache`` / ``v_cache`` [rows,
    nkv, L, d] of ``dtype`` (unit stride along d) at ``pos`` (int64 [1]): host metadata only."""
    if k_cache.dim() != 4:
        return False
    d, nkv = k_cache.shape[-1], k_cache.shape[1]
    return (rows >= 1 and d >= 2 and d % 2 == 0 and cols == (num_heads + 2 * nkv) * d and k_cache.shape[0] == rows
            and v_cache.shape == k_cache.shape and cos.numel() == d and sin.numel() == d and k_cache.stride(-1) == 1
            and v_cache.stride(-1) == 1 and pos.dtype == torch.int64 and pos.numel() == 1
            and k_cache.dtype == dtype and v_cache.dtype == dtype)


def gemv_qkv_rope(x: torch.Tensor, w_qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                  config: GemvConfig = GemvConfig()) -> torch.Tensor:
    """One token's attention input: x [1, K] times ``w_qkv`` [(nh + 2 nkv) d, K] (q rows, k rows, v
    rows), RoPE (``cos``, ``sin`` [d], the step's) on q and k, k and v written into ``k_cache`` /
    ``v_cache`` [1, nkv, L, d] at position ``pos`` (int64 [1] on the device); returns q [1, nh, 1, d]
    in x's dtype. Same function as the static cache's linear, RoPE and ``update`` (section comment)."""
    _check(x, w_qkv, config)
    if x.shape[0] != 1 or not _rope_targets_fit(1, w_qkv.shape[0], x.dtype, cos, sin, pos, k_cache, v_cache,
                                                num_heads):
        raise HarnessError(f"gemv_qkv_rope: one token x [1, K], w [(nh + 2 nkv) d, K], cos/sin [d], pos int64 [1] "
                           f"and caches [1, nkv, L, d] of x's dtype expected; got x {tuple(x.shape)}, w "
                           f"{tuple(w_qkv.shape)}, nh {num_heads}, caches {tuple(k_cache.shape)} {k_cache.dtype}, "
                           f"cos {tuple(cos.shape)}, pos {pos.dtype} {tuple(pos.shape)}")
    d, nkv = k_cache.shape[-1], k_cache.shape[1]
    q_cols, kv_cols = num_heads * d, nkv * d
    block_p = config.block_n            # pairs per program: two [block_n, block_k] weight tiles, as the GEMV's one
    q = torch.empty(1, num_heads, 1, d, dtype=x.dtype, device=x.device)
    cos, sin = cos.reshape(d), sin.reshape(d)
    _qkv_rope_kernel[(triton.cdiv((q_cols + 2 * kv_cols) // 2, block_p),)](
        x, w_qkv, cos, sin, pos, q, k_cache, v_cache, q_cols, kv_cols, x.stride(1), w_qkv.stride(0), w_qkv.stride(1),
        cos.stride(0), sin.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        K=x.shape[1], HALF=d // 2, BLOCK_P=block_p, BLOCK_K=config.block_k,
        EMULATE_BF16_RNE=emulates_bf16_rne(x.dtype), num_warps=config.num_warps)
    return q


#: column pairs per program of ``rope_kv_write`` (a power of two)
ROPE_BLOCK_P = 64


def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int) -> torch.Tensor:
    """A batched decode step's attention input after its q/k/v linear: ``qkv`` [B, (nh + 2 nkv) d] (q
    columns, k columns, v columns; each row a sequence's one token), RoPE (``cos``, ``sin`` [d]: the
    step's, one position for every sequence) on q and k, k and v written into ``k_cache`` / ``v_cache``
    [B, nkv, L, d] at position ``pos`` (int64 [1] on the device); returns q [B, nh, 1, d]. One launch
    for what the static cache's RoPE and ``update`` do (``gemv_qkv_rope``'s epilogue, same roundings)."""
    check_runnable(qkv)
    if qkv.dim() != 2 or not _rope_targets_fit(qkv.shape[0], qkv.shape[1], qkv.dtype, cos, sin, pos, k_cache,
                                               v_cache, num_heads):
        raise HarnessError(f"rope_kv_write: qkv [B, (nh + 2 nkv) d], cos/sin [d], pos int64 [1] and caches "
                           f"[B, nkv, L, d] of qkv's dtype expected; got qkv {tuple(qkv.shape)} {qkv.dtype}, nh "
                           f"{num_heads}, caches {tuple(k_cache.shape)} {k_cache.dtype}, cos {tuple(cos.shape)}, "
                           f"pos {pos.dtype} {tuple(pos.shape)}")
    B, d, nkv = qkv.shape[0], k_cache.shape[-1], k_cache.shape[1]
    q_cols, kv_cols = num_heads * d, nkv * d
    q = torch.empty(B, num_heads, 1, d, dtype=qkv.dtype, device=qkv.device)
    cos, sin = cos.reshape(d), sin.reshape(d)
    _rope_kv_kernel[(B, triton.cdiv((q_cols + 2 * kv_cols) // 2, ROPE_BLOCK_P))](
        qkv, cos, sin, pos, q, k_cache, v_cache, q_cols, kv_cols, qkv.stride(0), qkv.stride(1), cos.stride(0),
        sin.stride(0), q.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
        v_cache.stride(1), v_cache.stride(2), HALF=d // 2, BLOCK_P=ROPE_BLOCK_P,
        EMULATE_BF16_RNE=emulates_bf16_rne(qkv.dtype), num_warps=4)
    return q
