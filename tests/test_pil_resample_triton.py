"""The Triton PIL resampling pass (kernels.pil_resample_triton) equals the float64 reference pass of
harness.preprocess_device and PIL itself, bit for bit (TRITON_INTERPRET=1 on the CPU, else the GPU).

Sizes are small: the interpreter runs each program of the grid in numpy.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("triton")

from conftest import DEV, needs_triton  # noqa: E402
from harness import preprocess_device as pd  # noqa: E402
from harness import workload as wl  # noqa: E402
from harness.kernels import pil_resample_triton as pr  # noqa: E402

pytestmark = needs_triton


def _pixels(shape, seed):
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


@pytest.mark.parametrize("axis", ["h", "v"])
@pytest.mark.parametrize("n_in,n_out", [(37, 16), (50, 23), (16, 37)])
def test_pass_equals_the_float64_pass(axis, n_in, n_out):
    """Downscales by non-integer ratios and an upscale, 2 pages x 3 channels, along either axis."""
    shape = (2, 3, 11, n_in) if axis == "h" else (2, 3, n_in, 13)
    x = _pixels(shape, seed=n_in * 10 + n_out)
    want = pd._pass(x.double(), axis, n_out).float()
    xmin, k = pd._taps(n_in, n_out, DEV)
    got = pr.pil_pass(x.to(DEV), axis, xmin, k, pd.PRECISION_BITS).cpu()
    assert got.dtype == torch.float32 and got.is_contiguous() and torch.equal(got, want)


def test_pass_reads_float32_and_strided_pixels():
    """float32 pixels, and the RGB of RGB + unused byte pages ([B, H, W, 4] seen as [B, 3, H, W]), give
    the same bytes; uint8 out holds the same values."""
    rgbx = _pixels((2, 14, 37, 4), seed=3)
    x = rgbx.permute(0, 3, 1, 2)[:, :3]
    for axis, n_in in (("h", 37), ("v", 14)):
        want = pd._pass(x.double(), axis, 16).float()
        xmin, k = pd._taps(n_in, 16, DEV)
        assert torch.equal(pr.pil_pass(x.to(DEV), axis, xmin, k, pd.PRECISION_BITS).cpu(), want)
        assert torch.equal(pr.pil_pass(x.float().to(DEV), axis, xmin, k, pd.PRECISION_BITS).cpu(), want)
        small = pr.pil_pass(x.to(DEV), axis, xmin, k, pd.PRECISION_BITS, torch.uint8).cpu()
        assert small.dtype == torch.uint8 and torch.equal(small.float(), want)


@pytest.mark.parametrize("size", [(40, 56), (70, 50)])
def test_resize_through_triton_is_pil_bit_for_bit(size):
    """Both pass orders on Pillow 13 (96 x 130 -> 40 x 56: horizontal first; -> 70 x 50: the height
    shrinks by 80 > 2 x 26, vertical first), two pages in one launch per pass."""
    pages = [wl.synthetic_page(i, seed=0, size=(96, 130)) for i in (1, 2)]
    want = torch.stack([torch.from_numpy(np.asarray(p.resize(size, Image.Resampling.BICUBIC)).astype(np.float32))
                        for p in pages]).permute(0, 3, 1, 2)
    x = torch.stack([torch.from_numpy(np.asarray(p).copy()) for p in pages]).permute(0, 3, 1, 2).float()
    got = pd.resize_triton(x.to(DEV), size).cpu()
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_taps_by_hand():
    """Halving 4 pixels to 2 (``test_coefficients_by_hand``): ksize = 2 ceil(2 x 2) + 1 = 9 taps, both
    outputs start at pixel 0 and read 4 (the window clipped to the page), zero beyond."""
    xmin, k = pd.pil_taps(4, 2)
    assert list(xmin) == [0, 0] and k.shape == (2, 9) and not k[:, 4:].any()
    assert np.array_equal(pd.pil_coefficients(4, 2), k[:, :4])


def test_int32_bound():
    """255 x sum |k| + 2^21 < 2^31 holds while sum |k| <= (2^31 - 2^21) / 255 = 8413280.4. For the
    halving of ``test_taps_by_hand`` sum |k| = (2 x 0.8671875 + 0.2265625 + 0.0703125) / 1.890625 x 2^22
    = 1.074 x 2^22; a 2x bicubic reduction lies between 1.0 and 1.2 x 2^22 (the negative lobes), so
    255 x 1.2 x 2^22 + 2^21 = 1.29e9 < 2^31 = 2.15e9. (Over other size pairs the largest sum a review
    found is about 1.27 x 2^22, still far below the limit of 2.0 x 2^22: for bicubic the fallback below
    cannot trigger; its test forces it.)"""
    for n_in, n_out in ((4, 2), (1754, 877), (1240, 620)):
        share = np.abs(pd.pil_taps(n_in, n_out)[1]).sum(axis=1) / 2 ** 22
        assert 1.0 <= share.min() and share.max() <= 1.2 and pr.int32_exact(pd.pil_taps(n_in, n_out)[1], 22)
    assert round(float(np.abs(pd.pil_taps(4, 2)[1][0]).sum()) / 2 ** 22, 3) == 1.074
    assert pr.int32_exact(np.array([[8413280]]), 22) and not pr.int32_exact(np.array([[8413281]]), 22)
    assert not pr.int32_exact(np.array([[-4206640, 4206641]]), 22)     # |k| counts the negative lobes


def test_resize_falls_back_when_int32_could_overflow(monkeypatch):
    x = _pixels((1, 3, 8, 9), seed=5).float()
    monkeypatch.setattr(pr, "int32_exact", lambda k, bits: False)
    pd._MATRICES.clear()
    try:
        assert pd.resize_triton(x.to(DEV), (4, 4)) is None
    finally:
        pd._MATRICES.clear()
