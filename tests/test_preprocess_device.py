"""Preprocessing on the device (harness.preprocess_device) against the vendor's PIL path
(workload.preprocess): geometry by hand, pixels within PIL's fixed-point rounding, the request's
token layout unchanged, and the run verb's timing under execution.preprocess=device."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import main_lines
from harness import preprocess_device as pd
from harness import workload as wl

LEVEL = 2.0 / 255.0   # one 8-bit level after (x / 255 - 0.5) / 0.5


def _levels(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """(max difference in 8-bit levels, fraction of values that differ) of two normalised tensors."""
    d = (a - b).abs()
    return round(float(d.max()) / LEVEL, 3), float((d > 0).float().mean())


def _page(size, index=1):
    return wl.synthetic_page(index, seed=0, size=size)


def test_pass_order_follows_pillow_13_rule():
    # vertical first iff the height shrinks by more than twice as many pixels as the width
    assert pd.pass_order((1240, 1754), (1024, 1024), (13, 0)) == "vh"   # 730 > 2 * 216
    assert pd.pass_order((1240, 1754), (724, 1024), (13, 0)) == "hv"    # 730 <= 2 * 516
    assert pd.pass_order((400, 600), (400, 300), (13, 0)) == "vh"       # 300 > 0
    assert pd.pass_order((400, 300), (400, 600), (13, 0)) == "hv"       # the height grows
    assert pd.pass_order((1240, 1754), (1024, 1024), (12, 1)) == "hv"   # older Pillow: always horizontal first


def test_passes_skip_the_axes_that_keep_their_length(monkeypatch):
    monkeypatch.setattr(pd, "pass_order", lambda a, b, pillow=None: "vh")     # whatever the installed Pillow says
    assert pd.passes((400, 600), (400, 300)) == [("v", 600, 300)]            # the width stays: one pass
    assert pd.passes((400, 600), (200, 600)) == [("h", 400, 200)]
    assert pd.passes((400, 600), (200, 300)) == [("v", 600, 300), ("h", 400, 200)]
    assert pd.passes((400, 600), (400, 600)) == []
    monkeypatch.setattr(pd, "pass_order", lambda a, b, pillow=None: "hv")
    assert pd.passes((400, 600), (200, 300)) == [("h", 400, 200), ("v", 600, 300)]


def test_contain_size_by_hand():
    assert pd.contain_size((1240, 1754), (1024, 1024)) == (724, 1024)   # round(1240 / 1754 * 1024) = round(723.9)
    assert pd.contain_size((600, 400), (1024, 1024)) == (1024, 683)     # round(400 / 600 * 1024) = round(682.67)
    assert pd.contain_size((500, 500), (640, 640)) == (640, 640)


@pytest.mark.parametrize("size", [(1024, 1024), (724, 1024), (300, 500), (620, 300), (311, 877)])
def test_resize_is_pil_bit_for_bit(size):
    img = _page((620, 877))
    want = torch.from_numpy(np.asarray(img.resize(size, Image.Resampling.BICUBIC)).astype(np.float32))
    x = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1)[None].float()
    got = pd.resize(x, size)[0].permute(1, 2, 0)
    assert torch.equal(got, want)


def test_coefficients_by_hand():
    """Halving 4 pixels to 2: the filter stretched x2 (support 4), centres at 1.0 and 3.0; output 0 reads
    pixels 0..2 (window trunc(1 - 4 + 0.5) -> 0 .. trunc(1 + 4 + 0.5) = 5 -> 4): kernel at (x + 0.5 - 1) / 2
    = -0.25, 0.25, 0.75, 1.25 -> 0.8671875, 0.8671875, 0.2265625, -0.0703125 (a = -0.5: 1 - 2.5 x^2 + 1.5 x^3
    below 1, -0.5 (x^3 - 5 x^2 + 8 x - 4) below 2), normalised by their sum 1.890625, scaled by 2^22 and
    rounded half away from zero."""
    w = np.array([0.8671875, 0.8671875, 0.2265625, -0.0703125]) / 1.890625
    k = np.where(w < 0, np.trunc(-0.5 + w * 2 ** 22), np.trunc(0.5 + w * 2 ** 22)).astype(np.int64)
    got = pd.pil_coefficients(4, 2)
    assert got.shape == (2, 4) and list(got[0]) == list(k)
    assert list(got[1]) == list(k[::-1])       # output 1 mirrors output 0
    assert abs(int(got[0].sum()) - 2 ** 22) <= 2


def test_resize_in_the_wrong_order_is_not_pil():
    """The pass order matters (PIL rounds to 8 bits between passes): a test that catches a wrong order."""
    img = _page((620, 877))
    size = (512, 512)                       # 877 - 512 = 365 > 2 * (620 - 512): vertical first on Pillow 13
    if pd.pass_order(img.size, size) != "vh":
        pytest.skip("the installed Pillow resizes horizontally first")
    want = torch.from_numpy(np.asarray(img.resize(size, Image.Resampling.BICUBIC)).astype(np.float64))
    x = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).double()
    wrong = pd._pass(pd._pass(x, "h", 512), "v", 512).permute(1, 2, 0)
    assert not torch.equal(wrong, want)


@pytest.mark.parametrize("mode,size", [("base", (620, 877)), ("tiny", (600, 400)), ("gundam", (700, 500)),
                                       ("small", (877, 620))])
def test_views_and_tiles_equal_the_vendor_path(mode, size):
    pages = [_page(size, 1), _page(size, 2)]
    ref = [wl.preprocess(p, mode) for p in pages]
    views, tiles = pd.views_and_tiles([torch.from_numpy(np.asarray(p).copy()) for p in pages], mode)
    assert views.dtype == torch.float32 and torch.equal(views, torch.stack([r.global_view for r in ref]))
    if ref[0].tiles is None:
        assert tiles is None
    else:
        assert torch.equal(tiles, torch.cat([r.tiles for r in ref]))


def test_grey_padding_is_exact():
    """A flat page: every pixel of the view is the page's colour or the pad colour, exactly."""
    img = Image.new("RGB", (600, 400), (10, 200, 30))
    ref = wl.preprocess(img, "base").global_view
    got = pd.views_and_tiles([torch.from_numpy(np.asarray(img).copy())], "base")[0][0]
    assert torch.equal(got, ref)
    # pad rows: (1024 - 683) / 2 = 170.5 -> round = 170 rows above (Python's round: half to even)
    grey = (127 / 255 - 0.5) / 0.5
    assert torch.allclose(got[:, :170], torch.full_like(got[:, :170], grey))
    assert not torch.allclose(got[:, 170], torch.full_like(got[:, 170], grey))


def test_host_pages_keep_the_token_layout():
    pages = [wl.Page(f"p{i}", _page((1275, 1650), i), "memory") for i in range(2)]
    ref = wl.build_request(pages, "gundam", decode_tokens=7, text_tokens=5, seed=3, name="g")
    host = pd.host_pages(pages, "gundam", decode_tokens=7, text_tokens=5, seed=3, name="g")
    assert torch.equal(host.input_ids, ref.input_ids) and torch.equal(host.images_seq_mask, ref.images_seq_mask)
    assert host.case == ref.case and host.image_start == ref.image_start
    assert host.nbytes == 2 * 1275 * 1650 * 3


def test_host_pages_refuse_mixed_grids():
    pages = [wl.Page("a", _page((1275, 1650)), "memory"), wl.Page("b", _page((1754, 1240)), "memory")]
    with pytest.raises(Exception, match="different tile grids"):
        pd.host_pages(pages, "gundam")


def test_timed_request_builds_the_same_request_on_cpu():
    pages = [wl.Page("p", _page((620, 877)), "memory")]
    req, times = pd.timed_request(pages, "base", torch.device("cpu"), torch.bfloat16, decode_tokens=3, text_tokens=4,
                                  prompt=wl.DEFAULT_PROMPT, routing="balanced", routing_seed=5)
    ref = wl.build_request(pages, "base", decode_tokens=3, text_tokens=4, routing="balanced", routing_seed=5)
    assert set(times) == {"prep_ms", "h2d_ms"} and times["prep_ms"] > 0
    assert req.global_views.dtype == torch.bfloat16 and req.routing == "balanced" and req.routing_seed == 5
    assert torch.equal(req.input_ids, ref.input_ids) and req.case == ref.case
    assert torch.equal(req.global_views, ref.global_views.to(torch.bfloat16))


def test_run_verb_records_the_knob(tmp_path, capsys):
    import json

    rc, err = main_lines(capsys, ["run", "model=tiny", "execution.preprocess=device", "workload.decode_tokens=2",
                                  "measure.repeats=1", f"run.root={tmp_path}", "hardware.calibrate=false"])
    assert rc in (0, None), err
    run = next(tmp_path.iterdir())
    case = json.loads((run / "manifest.json").read_text())["cases"][0]
    assert case["execution"]["preprocess"] == "device"
    assert case["execution"]["preprocess_is"].startswith("device:")
    assert "device preprocessing" in (run / "report.md").read_text()


def test_bench_preprocess_on_cpu(tmp_path, capsys):
    import pandas as pd_

    rc, err = main_lines(capsys, ["bench", "preprocess", "bench.preprocess.pages=1", "bench.preprocess.warmup=0",
                                  "bench.preprocess.modes=[gundam]", f"run.root={tmp_path}"])
    assert rc in (0, None), err
    run = next(tmp_path.iterdir())
    times = pd_.read_csv(run / "preprocess_times.csv")
    steps = list(times["step"])
    # gundam on the A4 page cuts tiles: every host step, the build, and the device path's three parts
    assert len(steps) == 9 and sum(s.startswith("host path") for s in steps) == 6
    assert times.loc[times["step"].str.contains("whole request"), "share_pct"].item() == 100.0
    assert times.loc[times["step"].str.contains("decode"), "share_pct"].isna().all()
    parity = pd_.read_csv(run / "preprocess_parity.csv")
    assert list(parity["workload"]) == ["global view", "tiles"]
    assert (parity["levels_max"] == 0).all() and (parity["differ_frac"] == 0).all()


@pytest.mark.gpu
def test_gpu_fp32_tokens_of_16_pages_equal_the_host_path():
    """16 distinct synthetic pages (the five A4/letter/landscape/narrow/small sizes in turn), base mode,
    the full-size reference model (random weights, fp32, TF32 off) on a GPU, one batch of 16: greedy
    tokens of 32 decode steps from device-made pixels equal those from the vendor's host path."""
    from harness.config import ModelConfig
    from harness.layout import SYNTHETIC_SIZES
    from harness.models.build import build_model
    from harness.models.generate import generate

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    model = build_model(ModelConfig(), dev, torch.float32, seed=0)
    pages = [wl.Page(f"p{i:02d}", _page(SYNTHETIC_SIZES[i % len(SYNTHETIC_SIZES)], i), "memory") for i in range(16)]
    host = wl.build_request(pages, "base", decode_tokens=32).to(dev, torch.float32)
    device, _ = pd.timed_request(pages, "base", dev, torch.float32, decode_tokens=32)
    top, frac = _levels(device.global_views.cpu(), host.global_views.cpu())
    assert frac == 0.0    # bit for bit (PIL arithmetic, the host normalisation table)
    with torch.inference_mode():
        want = generate(model, host).tokens.cpu()
        got = generate(model, device).tokens.cpu()
    print(f"device preprocessing, 16 pages: max {top} levels, {frac:.2e} of values differ; tokens equal "
          f"{int((got == want).all(dim=1).sum())} of 16 pages")
    assert torch.equal(got, want)


def test_normalise_is_the_host_arithmetic():
    v = torch.arange(256, dtype=torch.float32).view(1, 1, 16, 16)
    want = wl.to_tensor(Image.fromarray(np.repeat(np.arange(256, dtype=np.uint8).reshape(16, 16, 1), 3, axis=2)))
    assert torch.equal(pd.normalise(v.expand(1, 3, 16, 16))[0], want)
    assert float(pd.normalise(torch.tensor([0.0, 255.0]))[0]) == -1.0 and float(pd.normalise(torch.tensor([255.0]))[0]) == 1.0


def test_page_pixels_in_place_and_their_fallback(monkeypatch):
    img = _page((300, 200))
    got = pd.page_pixels(img)
    assert got.shape[:2] == (200, 300) and got.shape[2] in (3, 4)
    assert np.array_equal(got[..., :3], np.asarray(img))
    if got.shape[2] == 4:      # PIL's own memory: a write to the page shows in the view
        img.putpixel((0, 0), (1, 2, 3))
        assert tuple(got[0, 0, :3]) == (1, 2, 3)
    monkeypatch.setattr(type(img), "__arrow_c_array__", lambda self, *a: (_ for _ in ()).throw(ValueError("blocks")),
                        raising=False)
    fallback = pd.page_pixels(_page((300, 200)))
    assert fallback.shape == (200, 300, 3)


def test_rgbx_pages_give_the_same_views():
    pages = [_page((620, 877), 1), _page((620, 877), 2)]
    ref = torch.stack([wl.preprocess(p, "base").global_view for p in pages])
    px = [torch.from_numpy(np.ascontiguousarray(np.dstack([np.asarray(p), np.full((877, 620), 77, np.uint8)])))
          for p in pages]
    views, tiles = pd.views_and_tiles(px, "base")
    assert tiles is None and torch.equal(views, ref)


@pytest.mark.parametrize("mode", ["base", "gundam"])
def test_pages_of_two_sizes_keep_their_order_and_a_dtype_is_the_cast_of_the_float32_values(mode):
    """Pages of two sizes (two groups, gathered back in page order) give the vendor path's views and
    tiles; asked for bf16, the values are the float32 ones cast, value for value."""
    pages = [_page((700, 500), 1), _page((620, 877), 2), _page((700, 500), 3)]
    if mode == "gundam":                                  # one tile grid per request: one aspect here
        pages = [_page((700, 500), 1), _page((1400, 1000), 2), _page((700, 500), 3)]
    ref = [wl.preprocess(p, mode) for p in pages]
    px = [torch.from_numpy(np.asarray(p).copy()) for p in pages]
    views, tiles = pd.views_and_tiles(px, mode)
    assert torch.equal(views, torch.stack([r.global_view for r in ref]))
    if ref[0].tiles is not None:
        assert torch.equal(tiles, torch.cat([r.tiles for r in ref]))
    views16, tiles16 = pd.views_and_tiles(px, mode, torch.bfloat16)
    assert views16.dtype == torch.bfloat16 and torch.equal(views16, views.to(torch.bfloat16))
    assert (tiles16 is None) == (tiles is None) and (tiles is None or torch.equal(tiles16, tiles.to(torch.bfloat16)))
