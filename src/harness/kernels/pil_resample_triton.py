"""One pass of PIL's 8-bit resampling along one axis of [B, C, H, W] pages, in int32 (Triton).

PIL resizes 8-bit images one axis at a time (``ImagingResampleHorizontal_8bpc`` /
``ImagingResampleVertical_8bpc``): output pixel i of a line is

    clip8(sum_t k[i, t] * x[xmin[i] + t] + 2^(bits - 1)),   clip8(s) = min(max(s >> bits, 0), 255)

with k the filter's weights in ``bits``-bit fixed point (22 in PIL; ``preprocess_device.pil_taps``
computes xmin and k) and ``>>`` an arithmetic shift. The kernel computes exactly that, in int32:
the sum is an integer, exact as long as it cannot overflow, i.e. 255 * max_i sum_t |k[i, t]| +
2^(bits - 1) < 2^31 (``int32_exact``; about 1.2 x 2^22 x 255 + 2^21 ~ 1.3e9 for bicubic). Pixels
in are 8-bit values (uint8, or float32 holding integers 0..255), any strides; pixels out are the
same values, float32 (or uint8), a new contiguous [B, C, H', W'] tensor. One launch for the whole
batch.

Tiling: each program computes a tile of BLOCK_I outputs x BLOCK_M lines of one (page, channel);
the lines run along the other axis (rows for the horizontal pass, columns for the vertical one).
The tile's fast dimension follows memory: along i for the horizontal pass (a warp reads about
``scale`` x 32 consecutive pixels of a row per tap), along the columns for the vertical one (each
tap a coalesced row segment); consecutive taps and outputs re-read neighbouring lines from cache.

Importing this module imports triton; ``TRITON_INTERPRET=1`` before the first import of
``common`` runs the kernel on CPU tensors (tests).
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ..errors import HarnessError
from .common import check_runnable

#: (BLOCK_I, BLOCK_M) per axis: 64 outputs x 16 rows (horizontal), 16 outputs x 64 columns (vertical)
TILES = {"h": (64, 16), "v": (16, 64)}


@triton.jit
def _pil_pass(X, XMIN, K, OUT, C, L, M, O, n_iblocks, n_mblocks,
              s_xb, s_xc, s_xl, s_xm, s_ob, s_oc, s_oi, s_om,
              KSIZE: tl.constexpr, BITS: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_M: tl.constexpr,
              I_FAST: tl.constexpr):
    pid = tl.program_id(0)
    mb = pid % n_mblocks
    ib = (pid // n_mblocks) % n_iblocks
    bc = pid // (n_mblocks * n_iblocks)
    b = (bc // C).to(tl.int64)
    c = (bc % C).to(tl.int64)
    offs_i = ib * BLOCK_I + tl.arange(0, BLOCK_I)
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    if I_FAST:          # tile [BLOCK_M, BLOCK_I]: outputs along the fast dimension
        i = offs_i[None, :]
        m = offs_m[:, None]
    else:               # tile [BLOCK_I, BLOCK_M]: lines (columns) along the fast dimension
        i = offs_i[:, None]
        m = offs_m[None, :]
    i_ok = i < O
    ok = i_ok & (m < M)
    start = tl.load(XMIN + i, mask=i_ok, other=0)
    src = X + b * s_xb + c * s_xc + m * s_xm
    acc = tl.zeros(ok.shape, dtype=tl.int32)
    for t in tl.static_range(KSIZE):
        k = tl.load(K + i * KSIZE + t, mask=i_ok, other=0)
        at = start + t
        px = tl.load(src + at * s_xl, mask=ok & (at < L), other=0)
        acc += k * px.to(tl.int32)
    acc += 1 << (BITS - 1)
    val = tl.minimum(tl.maximum(acc >> BITS, 0), 255)
    tl.store(OUT + b * s_ob + c * s_oc + i * s_oi + m * s_om, val.to(OUT.dtype.element_ty), mask=ok)


def int32_exact(k: np.ndarray, bits: int) -> bool:
    """Whether the int32 sums of ``k`` (integer [out, ksize] weights in ``bits``-bit fixed point)
    over 8-bit pixels cannot overflow: 255 * max_i sum_t |k[i, t]| + 2^(bits - 1) < 2^31."""
    return 255 * int(np.abs(np.asarray(k, dtype=np.int64)).sum(axis=1).max(initial=0)) + (1 << (bits - 1)) < 1 << 31


def pil_pass(x: torch.Tensor, axis: str, xmin: torch.Tensor, k: torch.Tensor, bits: int,
             out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One PIL 8-bit pass of ``x`` [B, C, H, W] (8-bit values, uint8 or float32, any strides) along
    ``axis`` ("h": the width, "v": the height) to ``xmin.shape[0]`` pixels: xmin int32 [out] (first
    input pixel of each output), k int32 [out, ksize] (``bits``-bit fixed-point weights, zero beyond
    each output's window); the caller checks ``int32_exact``. Returns a contiguous [B, C, H', W']
    ``out_dtype`` (float32 or uint8) tensor of values 0..255 on x's device."""
    if x.dim() != 4 or axis not in TILES or x.dtype not in (torch.uint8, torch.float32):
        raise HarnessError(f"pil_pass needs [B, C, H, W] uint8 or float32 pixels and axis 'h' or 'v'; "
                           f"got {x.dtype} {tuple(x.shape)}, axis {axis!r}")
    if (xmin.dtype, k.dtype) != (torch.int32, torch.int32) or k.dim() != 2 or xmin.shape[0] != k.shape[0]:
        raise HarnessError(f"pil_pass needs int32 xmin [out] and k [out, ksize]; got {xmin.dtype} "
                           f"{tuple(xmin.shape)}, {k.dtype} {tuple(k.shape)}")
    check_runnable(x)
    B, C, H, W = x.shape
    size, ksize = k.shape
    xmin, k = xmin.contiguous(), k.contiguous()
    if axis == "h":
        out = torch.empty((B, C, H, size), dtype=out_dtype, device=x.device)
        L, M, s_xl, s_xm, s_oi, s_om = W, H, x.stride(3), x.stride(2), out.stride(3), out.stride(2)
    else:
        out = torch.empty((B, C, size, W), dtype=out_dtype, device=x.device)
        L, M, s_xl, s_xm, s_oi, s_om = H, W, x.stride(2), x.stride(3), out.stride(2), out.stride(3)
    if out.numel() == 0:
        return out
    block_i, block_m = TILES[axis]
    n_i, n_m = triton.cdiv(size, block_i), triton.cdiv(M, block_m)
    _pil_pass[(B * C * n_i * n_m,)](
        x, xmin, k, out, C, L, M, size, n_i, n_m,
        x.stride(0), x.stride(1), s_xl, s_xm, out.stride(0), out.stride(1), s_oi, s_om,
        KSIZE=ksize, BITS=bits, BLOCK_I=block_i, BLOCK_M=block_m, I_FAST=axis == "h", num_warps=4)
    return out


__all__ = ["TILES", "int32_exact", "pil_pass"]
