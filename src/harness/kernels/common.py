"""What the Triton kernels of this package share: the interpreter flag, the CUDA check, and the
``@triton.jit`` helpers that round as PyTorch's eager ops round.

Importing this module imports triton. ``TRITON_INTERPRET=1`` set before its first import defines
every kernel of the package for Triton's numpy interpreter (CPU tensors, tests only): all kernel
modules import this one, so the flag is read once, here (``INTERPRETED``).

- ``check_runnable(x)``: refuse CUDA inputs when the kernels were defined for the interpreter.
- ``check_counts(...)``: refuse a routing-count buffer and step index a counting kernel cannot write.
- ``emulates_bf16_rne(dtype)``: the ``EMULATE_BF16_RNE`` flag a launch passes for that activation dtype.
- ``rne(x, EMULATE_BF16_RNE)``: fp32 nudged so a following cast to bf16 rounds to nearest-even
  (the interpreter truncates).
- ``rounded(x, act, EMULATE_BF16_RNE)``: fp32 rounded to the activation dtype and held in fp32 again.
- ``swiglu(acc_gate, acc_up, h_ptr, EMULATE_BF16_RNE)``: silu(gate) * up with the vendor SwiGLU's roundings.
- ``exp_f32(x)``, ``div_f32(a, b)``: exp and division as PyTorch's CUDA kernels compute them (CUDA's
  ``expf``, IEEE round-to-nearest division); ``fp32_rounded(x)``: x kept as a rounded fp32 value (no
  fused multiply-add may absorb its rounding, as when an eager op writes it out).
- ``row_times_tile(...)``: one row times BLOCK_N weight rows, fp32, the reduction loop unrolled.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..errors import HarnessError

#: whether the kernels of this package were defined for Triton's interpreter (TRITON_INTERPRET=1 at import)
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
#: compiled kernels (not the interpreter): CUDA's libdevice and inline PTX are available
_COMPILED = tl.constexpr(not INTERPRETED)
#: log2(e): softmaxes run in the exp2 domain (scores times it, then exp2). A constexpr, so kernels read
#: it as a global; host code multiplies by ``LOG2E.value``
LOG2E = tl.constexpr(1.4426950408889634)


def check_runnable(x: torch.Tensor) -> None:
    """Refuse CUDA inputs when the kernels were defined for the interpreter."""
    if x.device.type == "cuda" and INTERPRETED:
        raise HarnessError("the Triton kernels were imported with TRITON_INTERPRET=1; they cannot run on CUDA",
                           "unset TRITON_INTERPRET in the process that runs on the GPU")


def check_counts(who: str, buf: torch.Tensor, step: torch.Tensor, layer: int, experts: int, device) -> None:
    """Refuse a routing-count target a kernel cannot write: ``buf`` must be a contiguous int64
    [steps + 1, layers, experts] buffer holding ``layer``, ``step`` an int64 [1] index, both on
    ``device`` (``DeviceRouting.device_counts``; the kernels add at row min(step, steps))."""
    device = torch.device(device)
    if (buf.dim() != 3 or buf.dtype != torch.int64 or not buf.is_contiguous() or buf.device != device
            or buf.shape[0] < 1 or buf.shape[2] != experts or not 0 <= layer < buf.shape[1] or step.dtype != torch.int64
            or step.numel() != 1 or step.device != device):
        raise HarnessError(f"{who}: counts need a contiguous int64 buffer [steps + 1, layers, {experts}] holding "
                           f"layer {layer} and an int64 step index [1] on {device}; got {buf.dtype} "
                           f"{tuple(buf.shape)} on {buf.device}, step {step.dtype} {tuple(step.shape)}")


@triton.jit
def counts_row(counts_ptr, step_ptr, steps, n_layers, layer, n_exp):
    """Where the routing count of ``layer`` (a scalar or a vector of layers) starts in the contiguous
    [steps + 1, n_layers, n_exp] buffer of ``check_counts``: row min(step, steps), the step index read
    on the device (``.cg``: from L2, so a kernel may read it before its PDL wait)."""
    step = tl.minimum(tl.load(step_ptr, cache_modifier=".cg"), steps)
    return counts_ptr + (step * n_layers + layer) * n_exp


def emulates_bf16_rne(dtype: torch.dtype) -> bool:
    """The kernels' ``EMULATE_BF16_RNE`` for activations of ``dtype``: round fp32 -> bf16 to nearest-even
    by hand (``rne``) in interpreted bf16 runs only (the interpreter truncates)."""
    return INTERPRETED and dtype == torch.bfloat16


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
def exp_f32(x):
    """exp(x) in fp32 as PyTorch's CUDA kernels take it (``expf``: libdevice's ``__nv_expf``, within
    2 ulp), not ``tl.exp``'s single ``ex2.approx`` of x * log2(e), whose error grows with |x|.
    numpy's exp in the interpreter."""
    if _COMPILED:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def div_f32(a, b):
    """a / b rounded to nearest (``div.rn.f32``, as CUDA C's ``/``); Triton's ``/`` on fp32 is the
    approximate ``div.full.f32`` (up to 2 ulp)."""
    return tl.div_rn(a, b)


@triton.jit
def fp32_rounded(x):
    """x as a stored fp32 value: a multiply-add that follows cannot be fused with the operation that
    made x (Triton contracts a * b + c into one fma, rounding once where eager PyTorch, whose ops
    write their results out, rounds twice: ``mean + eps`` in RMSNorm)."""
    if _COMPILED:
        x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    return x


@triton.jit
def swiglu(acc_gate, acc_up, h_ptr, EMULATE_BF16_RNE: tl.constexpr):
    """silu(gate) * up in h's dtype: gate_proj, up_proj, silu and the product each round to that
    activation dtype, as the vendor's SwiGLU does; silu as ATen's CUDA kernel computes it,
    x / (1 + expf(-x)) with an IEEE division."""
    act = h_ptr.dtype.element_ty
    gate = rounded(acc_gate, act, EMULATE_BF16_RNE)
    up = rounded(acc_up, act, EMULATE_BF16_RNE)
    silu = rounded(div_f32(gate, 1.0 + exp_f32(-gate)), act, EMULATE_BF16_RNE)
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


__all__ = ["INTERPRETED", "check_runnable", "emulates_bf16_rne", "rne", "rounded", "swiglu", "row_times_tile",
           "exp_f32", "div_f32", "fp32_rounded"]
