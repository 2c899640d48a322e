"""Where a page's host preprocessing goes, and what ``execution.preprocess=device`` leaves on the host.

    python -m harness bench preprocess [bench.preprocess.pages=16] [bench.preprocess.modes=[base,gundam]]

Per mode, ``pages`` distinct synthetic pages (``workload.synthetic_page``, the default A4 size),
each PNG-encoded in memory first (compress level 1, as the throughput experiment writes its pages).
Every step is timed once per page on the host clock (``time.perf_counter``), the medians over pages
in the table:

* the vendor's host path (``workload.preprocess`` / ``build_request`` taken apart): decode (PNG
  bytes -> RGB page), resize + pad (``ImageOps.pad`` to the global view), normalise the view
  (``to_tensor``), tiles (resize to the grid and cut, crop modes with tiles), normalise the tiles, and
  the whole request build (``build_request``: all of the above but decode, plus the token layout and
  stacking) whose median the other rows are a share of;
* ``preprocess=device``: the host part (PIL's pixels in place + token layout, ``preprocess_device.host_pages``),
  the copy of the 8-bit pixels (synchronised on CUDA) and the device part (resize, pad, normalise,
  tiles, synchronised on CUDA).

The parity table compares each page's device-made view and tiles with the host path's, after
normalisation, in 8-bit levels (one level = 2/255): the largest difference and the fraction of
values that differ. On a CPU the "device" is the CPU (the same torch operations).
"""
from __future__ import annotations

import io
import statistics
import time

import torch
from PIL import Image, ImageOps

from .. import preprocess_device as pd
from .. import workload as wl
from ..layout import get_mode, tile_grid_for
from .timing import quantile

TIME_COLUMNS = ["mode", "step", "timings", "ms_median", "ms_min", "ms_p90", "ms_max", "share_pct"]
PARITY_COLUMNS = ["mode", "workload", "timings", "levels_max", "differ_frac"]
WHOLE = "host path: whole request build (build_request)"
DECODE = "host path: decode (PNG -> RGB)"


def _timed(fn, sync=None) -> tuple:
    """(result, ms) of ``fn()`` on the host clock, ``sync()`` before the clock stops."""
    t0 = time.perf_counter()
    out = fn()
    if sync is not None:
        sync()
    return out, (time.perf_counter() - t0) * 1e3


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG", compress_level=1)
    return buf.getvalue()


def _decode(data: bytes) -> Image.Image:
    with Image.open(io.BytesIO(data)) as im:
        return im.convert("RGB")


def _diff(got: torch.Tensor, want: torch.Tensor) -> tuple:
    """(largest |difference| in 8-bit levels, values that differ, values) of two normalised tensors."""
    d = (got.float().cpu() - want).abs()
    return float(d.max()) * 255.0 / 2.0, int((d > 0).sum()), d.numel()


def page_steps(data: bytes, mode, device: torch.device, sync) -> tuple:
    """({step: ms}, {part: (max levels, differing, values)}) of one PNG page in ``mode``."""
    mode = get_mode(mode)
    ms = {}
    image, ms[DECODE] = _timed(lambda: _decode(data))
    side = mode.view_size
    view, ms["host path: resize + pad (ImageOps.pad)"] = _timed(lambda: ImageOps.pad(
        image.resize((side, side)) if mode.squares_first else image, (side, side), color=wl.PAD_COLOR))
    _, ms["host path: normalise the view (to_tensor)"] = _timed(lambda: wl.to_tensor(view))
    grid = tile_grid_for(*image.size, mode)
    if grid is not None:
        cut, ms["host path: tiles (resize to the grid, cut)"] = _timed(lambda: wl._tiles(image, grid, mode.image_size))
        _, ms["host path: normalise the tiles"] = _timed(lambda: torch.stack([wl.to_tensor(t) for t in cut]))
    page = wl.Page("p", image, "memory")
    ref, ms[WHOLE] = _timed(lambda: wl.build_request([page], mode, decode_tokens=0))
    host, ms["device path: host part (PIL's pixels in place, token layout)"] = _timed(
        lambda: pd.host_pages([page], mode, in_place=True))
    pixels, ms["device path: copy 8-bit pixels"] = _timed(lambda: pd.to_device(host, device), sync)
    (views, tiles), ms["device path: resize, pad, normalise, tiles"] = _timed(
        lambda: pd.views_and_tiles(pixels, mode), sync)
    parity = {"global view": _diff(views, ref.global_views)}
    if tiles is not None:
        parity["tiles"] = _diff(tiles, ref.tiles)
    return ms, parity


def run(cfg, opts, device, report) -> None:
    """The bench (module docstring) on ``device``."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    times = report.table("preprocess_times", "preprocessing one page, host clock (median over pages)", TIME_COLUMNS)
    parity = report.table("preprocess_parity", "device-made pixels against the host path's", PARITY_COLUMNS)
    pages = [_png(wl.synthetic_page(i, seed=cfg.workload.seed)) for i in range(opts.warmup + opts.pages)]
    for mode in opts.modes:
        steps, parts = {}, {}
        for k, data in enumerate(pages):
            ms, par = page_steps(data, mode, device, sync)
            if k < opts.warmup:
                continue
            for step, v in ms.items():
                steps.setdefault(step, []).append(v)
            for part, v in par.items():
                parts.setdefault(part, []).append(v)
        whole = statistics.median(steps[WHOLE])
        for step, xs in steps.items():
            med = statistics.median(xs)
            times.add(mode=mode, step=step, timings=len(xs), ms_median=med, ms_min=min(xs), ms_p90=quantile(xs, 0.9),
                      ms_max=max(xs), share_pct=100.0 * med / whole if step.startswith("host path") and DECODE not in step
                      else None)
        for part, vs in parts.items():
            parity.add(mode=mode, workload=part, timings=len(vs), levels_max=max(v[0] for v in vs),
                       differ_frac=sum(v[1] for v in vs) / sum(v[2] for v in vs))
    report.note("Decode is not part of the whole request build (a page arrives decoded), so it has no share. "
                f"Device: {device}; Pillow {Image.__version__} (its pass order: harness.preprocess_device.pass_order).")
