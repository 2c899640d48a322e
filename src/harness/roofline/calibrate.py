"""Measured ceilings of this device: GEMM TFLOP/s and copy GB/s, cached per device.

``python -m harness calibrate`` (``calibrate_from_config``):

* GPU: bf16 ``torch.mm`` of 8192 x 8192 x 8192 (2*8192^3 FLOP), ``warmup`` untimed calls, then
  ``iters`` calls each timed with its own pair of CUDA events; the **median** (the harness's one
  median rule, ``harness.measure.stats.median_low``: the lower middle) gives TFLOP/s.
  Device-to-device copy: ``dst.copy_(src)`` of a 1 GiB buffer, bytes = read + write = 2 x 1 GiB
  per copy; median GB/s (1e9 B/s). Clocks are left as found (the harness never locks them).
* CPU (no GPU): fp32 GEMM (2048^3 by default) and a 256 MiB memcpy, host clock, median.

The record is cached as ``<cache>/calibration-<device-slug>.json`` (cache = ``hardware.cache_dir``,
else ``$HARNESS_CACHE_DIR``, else ``~/.cache/dsocr-harness``), copied into the verb's output
directory as ``calibration.json`` and printed. ``python -m harness run`` loads the cached record
of its device (``hardware.calibration: auto``) and uses it as the second ceiling; when there is
none it calibrates first (``ensure_calibration``: a few seconds, cached for later runs) unless
``hardware.calibrate=false``, and the manifest's ``calibration`` entry says which happened.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
from pathlib import Path
from typing import Optional

from ..dtypes import torch_dtype
from ..measure.host import time_ms
from ..measure.stats import median_low
from .specs import cpu_name, hardware_config, match_device, norm_dtype, resolve_peaks, slug

CACHE_ENV = "HARNESS_CACHE_DIR"
DEFAULTS = {"cuda": {"gemm_size": 8192, "gemm_dtype": "bf16", "copy_mib": 1024, "warmup": 5, "iters": 20},
            "cpu": {"gemm_size": 2048, "gemm_dtype": "fp32", "copy_mib": 256, "warmup": 1, "iters": 5}}


def cache_dir(hardware=None) -> Path:
    hw = hardware_config(hardware)
    if hw.cache_dir:
        return Path(str(hw.cache_dir)).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path.home() / ".cache" / "dsocr-harness"


def cache_path(device_name: str, hardware=None) -> Path:
    return cache_dir(hardware) / f"calibration-{slug(device_name)}.json"


def load_calibration(device_name: str, hardware=None) -> Optional[dict]:
    """The calibration record for ``device_name``, or None.

    ``hardware.calibration``: 'auto' (default: the per-device cache), 'none'/'off' (ignore), or a
    path to a calibration JSON. The record gets a ``path`` key naming its file.
    """
    hw = hardware_config(hardware)
    how = str(hw.calibration or "auto")
    if how.lower() in ("none", "off", "false", "no"):
        return None
    path = cache_path(device_name, hw) if how.lower() == "auto" else Path(how).expanduser()
    if not path.is_file():
        return None
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if how.lower() == "auto" and rec.get("device_name") not in (None, device_name):
        return None
    rec["path"] = str(path)
    return rec


def _median_cuda(fn, warmup: int, iters: int) -> float:
    """Median ms of ``fn`` over ``iters`` calls, each between its own CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return median_low([s.elapsed_time(e) for s, e in zip(starts, ends)])


def _median_host(fn, warmup: int, iters: int) -> float:
    """Median host wall ms of ``fn`` over ``iters`` calls (CPU devices)."""
    for _ in range(warmup):
        fn()
    return median_low(time_ms(fn, iters, cuda=False))


def measure(device, gemm_size: Optional[int] = None, gemm_dtype: Optional[str] = None,
            copy_mib: Optional[int] = None, warmup: Optional[int] = None, iters: Optional[int] = None,
            progress=print) -> dict:
    """Measure GEMM TFLOP/s and copy GB/s on ``device`` (torch.device). Returns the record."""
    import torch

    cuda = device.type == "cuda"
    d = DEFAULTS["cuda" if cuda else "cpu"]
    n = int(gemm_size or d["gemm_size"])
    gdt = norm_dtype(gemm_dtype or d["gemm_dtype"])
    mib = int(copy_mib or d["copy_mib"])
    warmup = int(d["warmup"] if warmup is None else warmup)
    iters = int(d["iters"] if iters is None else iters)
    timer = _median_cuda if cuda else _median_host
    if cuda and device.index is not None:
        torch.cuda.set_device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=torch_dtype(gdt), generator=gen)
    b = torch.randn(n, n, device=device, dtype=torch_dtype(gdt), generator=gen)
    c = torch.empty(n, n, device=device, dtype=torch_dtype(gdt))
    progress(f"[calibrate] GEMM {n}x{n}x{n} {gdt} on {device}: {warmup} warm-up + {iters} timed")
    gemm_ms = timer(lambda: torch.mm(a, b, out=c), warmup, iters)
    flops = 2 * n ** 3
    del a, b, c
    numel = mib * (1 << 20)
    src = torch.empty(numel, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    what = "device-to-device copy" if cuda else "host memcpy"
    progress(f"[calibrate] {what} of {mib} MiB: {warmup} warm-up + {iters} timed")
    copy_ms = timer(lambda: dst.copy_(src), warmup, iters)
    moved = 2 * numel
    del src, dst
    if cuda:
        torch.cuda.empty_cache()
    return {"gemm_tflops": flops / (gemm_ms * 1e-3) / 1e12, "gemm_ms": gemm_ms, "gemm_size": n,
            "gemm_dtype": gdt, "gemm_flops": flops,
            "copy_gbs": moved / (copy_ms * 1e-3) / 1e9, "copy_ms": copy_ms, "copy_bytes_moved": moved,
            "copy_convention": "read + write bytes (2 x buffer) per copy",
            "timer": "cuda_event" if cuda else "host", "statistic": "median", "warmup": warmup, "iters": iters,
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def calibrate(device, hardware=None, progress=print, write_cache: bool = True) -> dict:
    """Measure this device, cache the record, return it (with ``device_name``, ``path``)."""
    from ..setup import device_info

    hw = hardware_config(hardware)
    info = device_info(device)
    name = info.get("name") or cpu_name()
    rec = {"device_name": name, "device": info,
           "measured": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    rec.update(measure(device, hw.gemm_size, hw.gemm_dtype, hw.copy_mib, hw.warmup, hw.iters, progress=progress))
    if write_cache:
        path = cache_path(name, hw)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(rec, indent=2, default=str) + "\n")
        tmp.replace(path)
        rec["path"] = str(path)
    return rec


#: the calibration fields a run's manifest keeps (the report reads its ceilings from them)
MANIFEST_KEYS = ("device_name", "gemm_tflops", "gemm_dtype", "gemm_size", "copy_gbs", "copy_bytes_moved", "timer",
                 "statistic", "iters", "measured", "path")


def ensure_calibration(device, hardware=None, progress=print) -> dict:
    """The calibration entry of a run's manifest: ``status`` 'cached' (this device's record was
    found), 'measured' (none was: measured now and cached, ``seconds`` it took), or 'not
    calibrated' (with the ``reason``), plus the record's ``MANIFEST_KEYS``."""
    import time

    from ..setup import device_info

    hw = hardware_config(hardware)
    info = device_info(device)
    name = info.get("name") or cpu_name()
    how = str(hw.calibration or "auto").lower()
    rec = load_calibration(name, hw)
    if rec is not None:
        return {"status": "cached", **{k: rec.get(k) for k in MANIFEST_KEYS}}
    if how != "auto":
        return {"status": "not calibrated", "reason": f"hardware.calibration={hw.calibration} (no record used)"}
    if not hw.calibrate:
        return {"status": "not calibrated", "reason": "no cached record and hardware.calibrate=false"}
    progress(f"[harness] no calibration cached for {name}: measuring GEMM and copy ceilings "
             f"(hardware.calibrate=false skips this)")
    t0 = time.perf_counter()
    rec = calibrate(device, hw, progress=progress)
    seconds = time.perf_counter() - t0
    progress(f"[harness] calibrated in {seconds:.1f} s: GEMM {rec['gemm_tflops']:,.4g} TFLOP/s "
             f"({rec['gemm_dtype']}), copy {rec['copy_gbs']:,.4g} GB/s -> {rec.get('path')}")
    return {"status": "measured", "seconds": seconds, **{k: rec.get(k) for k in MANIFEST_KEYS}}


def summary_lines(rec: dict) -> list:
    """Human lines: measured ceilings and their fraction of the dense datasheet peak."""
    name = rec["device_name"]
    peaks = resolve_peaks(name, rec.get("gemm_dtype", "bf16"), None, rec)
    spec = match_device(name)
    lines = [f"device        {name} ({spec.name if spec else 'unknown: no datasheet peak'})",
             f"GEMM          {rec['gemm_tflops']:,.4g} TFLOP/s ({rec['gemm_dtype']}, {rec['gemm_size']}^3, median of "
             f"{rec['iters']}, {rec['timer']} timer)",
             f"copy          {rec['copy_gbs']:,.4g} GB/s ({'device-to-device' if rec.get('timer') == 'cuda_event' else 'memcpy'}, read + write bytes, median of {rec['iters']})"]
    if peaks.peak_tflops:
        lines.append(f"vs datasheet  GEMM {rec['gemm_tflops'] / peaks.peak_tflops:.1%} of {peaks.peak_tflops:g} "
                     f"TFLOP/s dense {peaks.dtype}; copy {rec['copy_gbs'] / peaks.mem_bw_gbs:.1%} of "
                     f"{peaks.mem_bw_gbs:g} GB/s")
    if peaks.cal_ridge:
        lines.append(f"ridge         {peaks.cal_ridge:,.1f} FLOP/B measured"
                     + (f", {peaks.ridge:,.1f} FLOP/B datasheet" if peaks.ridge else ""))
    if rec.get("path"):
        lines.append(f"cached        {rec['path']}")
    return lines


def calibrate_from_config(cfg, out_dir: Path) -> dict:
    """The ``calibrate`` verb: measure, cache, write ``out_dir/calibration.json``, print."""
    from ..setup import resolve_device

    device = resolve_device(cfg.device)
    rec = calibrate(device, cfg.hardware, progress=print)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps(rec, indent=2, default=str) + "\n")
    for line in summary_lines(rec):
        print(f"[calibrate] {line}")
    return rec


__all__ = ["calibrate", "calibrate_from_config", "load_calibration", "ensure_calibration", "measure", "cache_path",
           "cache_dir", "summary_lines", "MANIFEST_KEYS"]
