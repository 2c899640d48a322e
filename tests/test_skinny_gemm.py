"""The batched-decode linear on the tensor cores (``skinny_gemm_triton``; the interpreter on the CPU)
against F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import DEV, needs_triton
from harness.errors import HarnessError

pytestmark = needs_triton


def _rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.parametrize("M,N,K", [(2, 96, 256), (3, 40, 200), (17, 64, 128), (32, 48, 96)])
def test_skinny_linear_matches_linear(M, N, K):
    """fp32: F.linear within fp32 summation order. bf16: within 2^-8 of the exact (fp64) product of
    the same bf16 inputs, relative: half a bf16 step, so rounded to nearest once (a truncating cast
    would be off by up to a whole step); the fp32 sum's own error is far below it. Ragged M, N and
    K run the masked tails."""
    from harness.kernels.skinny_gemm_triton import SkinnyConfig, skinny_linear

    torch.manual_seed(M * N + K)
    x, w = torch.randn(M, K, device=DEV), torch.randn(N, K, device=DEV) * 0.05
    for unroll in (False, True):                                  # the pipelined loop and the unrolled one
        cfg = SkinnyConfig(block_n=16, block_k=64, num_warps=2, num_stages=2, unroll=unroll)
        y = skinny_linear(x, w, cfg)
        assert y.shape == (M, N) and y.dtype == torch.float32
        assert _rel(y, F.linear(x, w)) <= 1e-6
        xb, wb = x.bfloat16(), w.bfloat16()
        yb = skinny_linear(xb, wb, cfg)
        exact = xb.double() @ wb.double().T
        assert yb.dtype == torch.bfloat16
        half_step = exact.abs() * 2.0 ** -8                      # >= half a bf16 ulp of each value
        assert bool(((yb.double() - exact).abs() <= half_step).all())


def test_rows_tiles_and_shapes_are_refused():
    from harness.kernels.skinny_gemm_triton import MAX_ROWS, SkinnyConfig, skinny_linear

    w = torch.randn(32, 64, device=DEV)
    with pytest.raises(HarnessError, match="1 to 64 rows"):
        skinny_linear(torch.randn(MAX_ROWS + 1, 64, device=DEV), w)
    with pytest.raises(HarnessError, match="powers of two"):
        skinny_linear(torch.randn(2, 64, device=DEV), w, SkinnyConfig(block_n=8))
    with pytest.raises(HarnessError, match=r"x \[M, K\] and w \[N, K\]"):
        skinny_linear(torch.randn(2, 32, device=DEV), w)
    with pytest.raises(HarnessError, match="one dtype"):
        skinny_linear(torch.randn(2, 64, device=DEV).bfloat16(), w)
