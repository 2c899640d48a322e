"""``linear_impl=fused``: fewer, fuller weight reads for the LLM's linears (same function).

- ``fuse_rows(linears)``: one weight [sum N_i, K] holding the Linears' weights one after the other;
  each Linear's weight becomes a view of it (state_dict names and values unchanged, no second copy).
  q/k/v become one GEMM and each SwiGLU's gate/up one GEMM.
- ``linear(x, w)`` / ``swiglu(x, w_gate_up)``: at one row (a batch-1 decode step) with K <= GEMV_MAX_K
  the Triton GEMV kernels of ``gemv_triton`` (a cuBLAS GEMM tile grid leaves most SMs idle at M=1);
  otherwise F.linear on the fused weight. ``scripts/bench_decode_linear.py`` (H200, graph-replayed,
  µs per call): q/k/v/o 5.15 cuBLAS vs 3.48 GEMV; fused qkv 5.76 vs 4.88 (three separate GEMMs:
  15.5); shared gate/up/silu*mul 13.6 vs 5.04; router (fp32) 8.41 vs 2.13; dense down (K=6848) 10.0
  cuBLAS vs 15.2 GEMV, so K > GEMV_MAX_K stays on cuBLAS; at 8 rows cuBLAS was faster everywhere.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import HarnessError

#: rows (tokens) up to which the GEMV kernels run; more rows go to cuBLAS
GEMV_MAX_ROWS = 1
#: reduction length up to which the GEMV kernels run (their loop over K is unrolled)
GEMV_MAX_K = 2048


def fuse_rows(linears: list) -> torch.Tensor:
    """Concatenate the Linears' weights (no biases) along the output dim; re-point each to its view."""
    ref = linears[0].weight
    for lin in linears:
        w = lin.weight
        if lin.bias is not None or w.shape[1] != ref.shape[1] or w.dtype != ref.dtype or w.device != ref.device:
            raise HarnessError(f"fuse_rows: weights {[tuple(l.weight.shape) for l in linears]} cannot share one "
                               "tensor (same K, dtype, device and no bias needed)")
    fused = torch.empty(sum(l.weight.shape[0] for l in linears), ref.shape[1], dtype=ref.dtype, device=ref.device)
    start = 0
    with torch.no_grad():
        for lin in linears:
            n = lin.weight.shape[0]
            fused[start:start + n].copy_(lin.weight)
            lin.weight = nn.Parameter(fused[start:start + n], requires_grad=lin.weight.requires_grad)
            start += n
    return fused


def shares_rows(linears: list, fused: torch.Tensor) -> bool:
    """True while every Linear's weight is still its view of ``fused`` (a ``.to()`` breaks it)."""
    start = 0
    for lin in linears:
        n = lin.weight.shape[0]
        if lin.weight.data_ptr() != fused[start:start + n].data_ptr() or lin.weight.shape != fused[start:start + n].shape:
            return False
        start += n
    return start == fused.shape[0]


def gemv_fits(rows: int, k: int) -> bool:
    """Whether ``rows`` token rows against a reduction length ``k`` run the Triton GEMV kernels."""
    return rows <= GEMV_MAX_ROWS and k <= GEMV_MAX_K


def linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T -> [..., N] in ``out_dtype`` (x's by default). ``out_dtype=float32`` is
    the vendor gate's F.linear(x.float(), w.float()): exact products, fp32 sums."""
    x2 = x.reshape(-1, x.shape[-1])
    if gemv_fits(x2.shape[0], w.shape[1]):
        from ..kernels.gemv_triton import gemv
        y = gemv(x2, w, out_dtype)
    elif out_dtype == torch.float32:
        y = F.linear(x2.float(), w.float())
    else:
        y = F.linear(x2, w).to(out_dtype or x.dtype)
    return y.view(*x.shape[:-1], w.shape[0])


def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) with ``w_gate_up`` [2I, K] = gate rows then up rows -> [..., I]."""
    x2 = x.reshape(-1, x.shape[-1])
    inter = w_gate_up.shape[0] // 2
    if gemv_fits(x2.shape[0], w_gate_up.shape[1]):
        from ..kernels.gemv_triton import gemv_swiglu
        h = gemv_swiglu(x2, w_gate_up)
    else:
        gate, up = F.linear(x2, w_gate_up).split(inter, dim=-1)
        h = F.silu(gate) * up
    return h.view(*x.shape[:-1], inter)
