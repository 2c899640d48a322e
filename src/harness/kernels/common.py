"""What the Triton kernels of this package share: the interpreter flag, the CUDA check, and the
``@triton.jit`` helpers that round as PyTorch's eager ops round.

Importing this module imports triton. ``TRITON_INTERPRET=1`` set before its first import defines
every kernel of the package for Triton's numpy interpreter (CPU tensors, tests only): all kernel
modules import this one, so the flag is read once, here (``INTERPRETED``).

- ``check_runnable(x)``: refuse CUDA inputs when the kernels were defined for the interpreter.
- ``rne(x, EMULATE_BF16_RNE)``: fp32 nudged so a following cast to bf16 rounds to nearest-even
  (the interpreter truncates).
- ``rounded(x, act, EMULATE_BF16_RNE)``: fp32 rounded to the activation dtype and held in fp32 again.
- ``swiglu(acc_gate, acc_up, h_ptr, EMULATE_BF16_RNE)``: silu(gate) * up with the vendor SwiGLU's roundings.
- ``row_times_tile(...)``: one row times BLOCK_N weight rows, fp32, the reduction loop unrolled.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..errors import HarnessError

#: whether the kernels of this package were defined for Triton's interpreter (TRITON_INTERPRET=1 at import)
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_runnable(x: torch.Tensor) -> None:
    """Refuse CUDA inputs when the kernels were defined for the interpreter."""
    if x.device.type == "cuda" and INTERPRETED:
        raise HarnessError("the Triton kernels were imported with TRITON_INTERPRET=1; they cannot run on CUDA",
                           "unset TRITON_INTERPRET in the process that runs on the GPU")


@triton.jit
def rne(x, EMULATE_BF16_RNE: tl.constexpr):
    """x (fp32) nudged so that a following ``.to(tl.bfloat16)`` rounds to nearest-even.

    Compiled Triton already rounds to nearest-even; Triton's interpreter truncates fp32 -> bf16
    (triton 3.9), so interpreted bf16 runs turn this on to round as PyTorch does."""
    if EMULATE_BF16_RNE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        x = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return x


@triton.jit
def rounded(x, act: tl.constexpr, EMULATE_BF16_RNE: tl.constexpr):
    """x (fp32) rounded to the activation dtype ``act`` and held in fp32 again: one eager op's rounding."""
    return rne(x, EMULATE_BF16_RNE).to(act).to(tl.float32)


@triton.jit
def swiglu(acc_gate, acc_up, h_ptr, EMULATE_BF16_RNE: tl.constexpr):
    """silu(gate) * up in h's dtype: gate_proj, up_proj, silu and the product each round to that
    activation dtype, as the vendor's SwiGLU does."""
    act = h_ptr.dtype.element_ty
    gate = rounded(acc_gate, act, EMULATE_BF16_RNE)
    up = rounded(acc_up, act, EMULATE_BF16_RNE)
    silu = rounded(gate / (1.0 + tl.exp(-gate)), act, EMULATE_BF16_RNE)
    return rne(silu * up, EMULATE_BF16_RNE).to(act)


@triton.jit
def row_times_tile(xp, wp, stride_xk, stride_wk, n_ok, K: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """sum_k x[k] * w[n, k] in fp32 for the BLOCK_N weight rows at ``wp`` (pointers [BLOCK_N, 1]);
    the loop over K is unrolled (K a compile-time constant), so every load is in flight at once."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        xv = tl.load(xp + (k0 + offs_k) * stride_xk, mask=k_ok, other=0.0).to(tl.float32)
        wv = tl.load(wp + (k0 + offs_k)[None, :] * stride_wk, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(wv.to(tl.float32) * xv[None, :], axis=1)
    return acc


__all__ = ["INTERPRETED", "check_runnable", "rne", "rounded", "swiglu", "row_times_tile"]
