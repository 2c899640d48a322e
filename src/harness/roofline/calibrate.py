"""Measured ceilings of this device: GEMM TFLOP/s, copy GB/s and read GB/s, cached per device and settings.

``python -m harness calibrate`` (``calibrate_from_config``):

* GPU: bf16 ``torch.mm`` of 8192 x 8192 x 8192 (2*8192^3 FLOP), ``warmup`` untimed calls, then
  ``iters`` calls each timed with its own pair of CUDA events; the **median** (the harness's one
  median rule, ``harness.measure.stats.median_low``: the lower middle) gives TFLOP/s.
  Device-to-device copy: ``dst.copy_(src)`` of a 1 GiB buffer, bytes = read + write = 2 x 1 GiB
  per copy; median GB/s (1e9 B/s). Read stream: ``torch.sum`` over an fp32 buffer of ``read_mib``
  MiB (default 8 x the GPU's L2 cache, at least 256 MiB, so it is read from DRAM), bytes = the
  buffer once per sum (the result is one number); median GB/s. Clocks are left as found (the
  harness never locks them).
* CPU (no GPU): fp32 GEMM (2048^3 by default), a 256 MiB memcpy and a 256 MiB sum, host clock, median.

Which ceiling is the roof of what (``harness.roofline.specs.Peaks``): GEMM TFLOP/s for FLOPs,
copy GB/s (read + write) for traffic that reads and writes alike, read GB/s for traffic that is
nearly all reads: a decode step reads the weights and the KV cache and writes little, so its MBU
is judged against the read stream where one was measured.

Every calibration passes ``harness.roofline.calibration_rules`` (within 30-105% of the dense
datasheet figure, iterations within the spread limit); one that fails is measured once more, and
rejected if it fails again (not cached, not used; the record says why).

Cache: ``<cache>/calibration-<device-slug>.json`` for the default settings (``DEFAULTS``), and
``calibration-<device-slug>--<settings>.json`` for any other (``hardware.gemm_size``,
``gemm_dtype``, ``copy_mib``, ``read_mib``, ``warmup``, ``iters``), so a small or unusual
``calibrate`` never replaces the default record (cache = ``hardware.cache_dir``, else
``$HARNESS_CACHE_DIR``, else ``~/.cache/dsocr-harness``). A run looks up the record of its own
settings (the defaults unless it sets ``hardware.*``); a record at the default path that was
measured with other settings (written by an older harness) is not used. The verb also writes
``calibration.json`` into its output directory and prints a summary. ``python -m harness run``
calibrates on first use (``ensure_calibration``) unless ``hardware.calibrate=false``; the
manifest's ``calibration`` entry says what happened.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
from pathlib import Path
from typing import Optional

from ..dtypes import torch_dtype
from ..measure.stats import median_low
from ..errors import HarnessError
from . import calibration_rules as rules
from .specs import cpu_name, hardware_config, norm_dtype, resolve_peaks, slug

CACHE_ENV = "HARNESS_CACHE_DIR"
#: default measurement settings per device type (``read_mib`` None: 8 x L2, at least 256 MiB)
DEFAULTS = {"cuda": {"gemm_size": 8192, "gemm_dtype": "bf16", "copy_mib": 1024, "read_mib": None, "warmup": 5,
                     "iters": 20},
            "cpu": {"gemm_size": 2048, "gemm_dtype": "fp32", "copy_mib": 256, "read_mib": 256, "warmup": 1,
                    "iters": 5}}
SETTINGS = tuple(DEFAULTS["cpu"])
#: the read stream's buffer on a GPU: this many times the L2 cache, and at least READ_MIN_MIB
READ_L2_MULTIPLE, READ_MIN_MIB, READ_UNKNOWN_L2_MIB = 8, 256, 1024


def device_type(device_name: str) -> str:
    """'cpu' for the CPU's calibration name ('CPU <model>'), else 'cuda'."""
    return "cpu" if str(device_name).lower().startswith("cpu") else "cuda"


def settings(hardware, kind: str) -> dict:
    """The measurement settings of ``hardware`` (``hardware.*``; unset = ``DEFAULTS[kind]``)."""
    hw = hardware_config(hardware)
    out = {k: (getattr(hw, k) if getattr(hw, k) is not None else v) for k, v in DEFAULTS[kind].items()}
    out["gemm_dtype"] = norm_dtype(out["gemm_dtype"])
    return out


def cache_dir(hardware=None) -> Path:
    hw = hardware_config(hardware)
    if hw.cache_dir:
        return Path(str(hw.cache_dir)).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path.home() / ".cache" / "dsocr-harness"


def cache_path(device_name: str, hardware=None) -> Path:
    """The cache file of ``device_name`` measured with ``hardware``'s settings (see the module docstring)."""
    kind = device_type(device_name)
    s = settings(hardware, kind)
    name = f"calibration-{slug(device_name)}"
    if s != DEFAULTS[kind]:
        name += "--" + "-".join(f"{k.replace('_', '')}{'auto' if v is None else v}" for k, v in s.items())
    return cache_dir(hardware) / f"{name}.json"


def _settings_of(rec: dict) -> dict:
    """The settings a record was measured with (older records: the fields they carry)."""
    if isinstance(rec.get("settings"), dict):
        return rec["settings"]
    old = {k: rec.get(k) for k in ("gemm_size", "gemm_dtype", "warmup", "iters") if rec.get(k) is not None}
    if rec.get("copy_bytes_moved"):
        old["copy_mib"] = int(rec["copy_bytes_moved"]) // 2 // (1 << 20)
    return old


def _datasheet(device_name: str, rec: dict, hardware=None) -> tuple:
    """(dense TFLOP/s of the record's GEMM dtype, memory GB/s) to check ``rec`` against (None: no figure)."""
    gdt = rec.get("gemm_dtype") or "bf16"
    peaks = resolve_peaks(device_name, "tf32" if (gdt == "fp32" and rec.get("tf32")) else gdt, hardware)
    return peaks.peak_tflops, peaks.mem_bw_gbs


def find_calibration(device_name: str, hardware=None) -> tuple:
    """(record or None, why a record found is not used or None). ``hardware.calibration``: 'auto'
    (the cache entry of this device and settings), 'none'/'off' (none), or the path of a record.
    A record is not used when it was rejected, when it sits at the default path but was measured
    with other settings, or when it fails ``calibration_rules`` now. The record gets ``path``."""
    hw = hardware_config(hardware)
    how = str(hw.calibration or "auto")
    if how.lower() in ("none", "off", "false", "no"):
        return None, None
    auto = how.lower() == "auto"
    path = cache_path(device_name, hw) if auto else Path(how).expanduser()
    if not path.is_file():
        return None, None
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return None, f"the record {path} cannot be read ({exc.__class__.__name__})"
    if not isinstance(rec, dict) or (auto and rec.get("device_name") not in (None, device_name)):
        return None, None
    kind = device_type(device_name)
    if rec.get("status") == "rejected":
        return None, f"the record {path} was rejected when measured ({'; '.join(rec.get('problems') or [])})"
    if auto and settings(hw, kind) == DEFAULTS[kind]:
        other = {k: v for k, v in _settings_of(rec).items() if k in SETTINGS and v != DEFAULTS[kind][k]}
        if other:
            return None, (f"the record {path} was measured with other settings than the default ones "
                          f"({', '.join(f'{k}={v}' for k, v in other.items())})")
    found = rules.problems(rec, *_datasheet(device_name, rec, hw))
    if found:
        return None, f"the record {path} fails the calibration checks ({'; '.join(found)})"
    rec["path"] = str(path)
    return rec, None


def load_calibration(device_name: str, hardware=None) -> Optional[dict]:
    """The usable calibration record for ``device_name`` (``find_calibration``), or None."""
    return find_calibration(device_name, hardware)[0]


def _times_cuda(fn, warmup: int, iters: int) -> list:
    """ms of each of ``iters`` calls of ``fn``, each between its own CUDA events."""
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
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def _times_host(fn, warmup: int, iters: int) -> list:
    """Host wall ms of each of ``iters`` calls of ``fn`` (CPU devices)."""
    from ..measure.host import time_ms

    for _ in range(warmup):
        fn()
    return time_ms(fn, iters, cuda=False)


def read_mib_for(device, requested: Optional[int]) -> tuple:
    """(MiB of the read stream's buffer, how it was chosen): ``requested``, or on a GPU
    ``READ_L2_MULTIPLE`` x its L2 cache and at least ``READ_MIN_MIB``."""
    if device.type != "cuda" or requested:
        mib = int(requested or DEFAULTS["cpu"]["read_mib"])
        return mib, ("the CPU default" if device.type != "cuda" and mib == DEFAULTS["cpu"]["read_mib"]
                     else "hardware.read_mib")
    import torch

    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0
    if not l2:
        return READ_UNKNOWN_L2_MIB, "L2 size not reported: 1 GiB"
    mib = max(READ_MIN_MIB, math.ceil(READ_L2_MULTIPLE * l2 / (1 << 20)))
    return mib, f"{READ_L2_MULTIPLE} x L2 ({l2 / (1 << 20):g} MiB), at least {READ_MIN_MIB} MiB"


def measure(device, s: dict, progress=print) -> dict:
    """Measure GEMM TFLOP/s, copy GB/s and read GB/s on ``device`` with settings ``s``
    (``settings``); medians, with each measurement's spread (CV of its iterations)."""
    import torch

    cuda = device.type == "cuda"
    n, gdt, mib, warmup, iters = s["gemm_size"], s["gemm_dtype"], s["copy_mib"], s["warmup"], s["iters"]
    timer = _times_cuda if cuda else _times_host
    if cuda and device.index is not None:
        torch.cuda.set_device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=torch_dtype(gdt), generator=gen)
    b = torch.randn(n, n, device=device, dtype=torch_dtype(gdt), generator=gen)
    c = torch.empty(n, n, device=device, dtype=torch_dtype(gdt))
    progress(f"[harness] calibrate: GEMM {n}x{n}x{n} {gdt} on {device}: {warmup} warm-up + {iters} timed")
    gemm = timer(lambda: torch.mm(a, b, out=c), warmup, iters)
    flops = 2 * n ** 3
    del a, b, c
    numel = mib * (1 << 20)
    src = torch.empty(numel, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    what = "device-to-device copy" if cuda else "host memcpy"
    progress(f"[harness] calibrate: {what} of {mib} MiB: {warmup} warm-up + {iters} timed")
    copy = timer(lambda: dst.copy_(src), warmup, iters)
    del src, dst
    rmib, rwhy = read_mib_for(device, s.get("read_mib"))
    buf = torch.ones(rmib * (1 << 20) // 4, dtype=torch.float32, device=device)
    total = torch.empty((), dtype=torch.float32, device=device)
    progress(f"[harness] calibrate: read stream (sum) over {rmib} MiB ({rwhy}): {warmup} warm-up + {iters} timed")
    read = timer(lambda: torch.sum(buf, dim=0, out=total), warmup, iters)
    read_bytes = buf.numel() * buf.element_size()
    del buf, total
    if cuda:
        torch.cuda.empty_cache()
    ms = {k: median_low(v) for k, v in (("gemm", gemm), ("copy", copy), ("read", read))}
    return {"gemm_tflops": flops / (ms["gemm"] * 1e-3) / 1e12, "gemm_ms": ms["gemm"], "gemm_size": n,
            "gemm_dtype": gdt, "gemm_flops": flops, "gemm_cv": rules.spread(gemm),
            "copy_gbs": 2 * numel / (ms["copy"] * 1e-3) / 1e9, "copy_ms": ms["copy"], "copy_bytes_moved": 2 * numel,
            "copy_convention": "read + write bytes (2 x buffer) per copy", "copy_cv": rules.spread(copy),
            "read_gbs": read_bytes / (ms["read"] * 1e-3) / 1e9, "read_ms": ms["read"], "read_bytes": read_bytes,
            "read_mib": rmib, "read_convention": f"bytes read once per sum ({rwhy})", "read_cv": rules.spread(read),
            "tf32": bool(cuda and gdt == "fp32" and torch.backends.cuda.matmul.allow_tf32),
            "timer": "cuda_event" if cuda else "host", "statistic": "median", "warmup": warmup, "iters": iters,
            "settings": dict(s), "torch": torch.__version__, "threads": torch.get_num_threads()}


def calibrate(device, hardware=None, progress=print, write_cache: bool = True) -> dict:
    """Measure this device (again once when the first measurement fails the calibration checks),
    cache the record when it passes, and return it: ``device_name``, ``status`` (accepted or
    rejected), ``problems``, ``attempts``, ``path`` (when cached) or ``cache_error``."""
    from ..setup import device_info

    hw = hardware_config(hardware)
    info = device_info(device)
    name = info.get("name") or cpu_name()
    s = settings(hw, "cuda" if device.type == "cuda" else "cpu")
    for attempt in (1, 2):
        rec = {"device_name": name, "device": info,
               "measured": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               **measure(device, s, progress=progress)}
        found = rules.problems(rec, *_datasheet(name, rec, hw))
        rec.update(status="rejected" if found else "accepted", problems=found, attempts=attempt,
                   checks={"band": list(rules.BAND), "cv_limit": rules.CV_LIMIT[rec["timer"]]})
        if not found:
            break
        progress(f"[harness] calibrate: check failed ({'; '.join(found)})"
                 + (": measuring once more" if attempt == 1 else ": rejected, not cached and not used"))
    if write_cache and rec["status"] == "accepted":
        path = cache_path(name, hw)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".json.tmp")
            try:
                tmp.write_text(json.dumps(rec, indent=2, default=str) + "\n")
                tmp.replace(path)
            finally:
                tmp.unlink(missing_ok=True)
            rec["path"] = str(path)
        except OSError as exc:
            rec["cache_error"] = f"not cached: cannot write {path} ({exc.strerror or exc})"
            progress(f"[harness] calibrate: {rec['cache_error']}")
    return rec


#: the calibration fields a run's manifest keeps (the report reads its ceilings from them)
MANIFEST_KEYS = ("device_name", "gemm_tflops", "gemm_dtype", "gemm_size", "copy_gbs", "copy_bytes_moved", "read_gbs",
                 "read_bytes", "gemm_cv", "copy_cv", "read_cv", "timer", "statistic", "iters", "settings", "measured",
                 "path")


def ensure_calibration(device, hardware=None, progress=print) -> dict:
    """The calibration entry of a run's manifest: ``status`` 'cached' (this device's record for
    the run's settings was found and passes the checks), 'measured' (none was: measured now,
    cached, ``seconds`` it took), 'rejected' (measured twice, failed the checks both times: the
    ``reason`` and the ``rejected`` values; no ceiling is used), or 'not calibrated' (the
    ``reason``), plus the record's ``MANIFEST_KEYS`` where one is used."""
    import time

    from ..setup import device_info

    hw = hardware_config(hardware)
    name = device_info(device).get("name") or cpu_name()
    how = str(hw.calibration or "auto").lower()
    rec, why = find_calibration(name, hw)
    if rec is not None:
        return {"status": "cached", **{k: rec.get(k) for k in MANIFEST_KEYS}}
    unused = f"; {why}" if why else ""
    if how != "auto":
        return {"status": "not calibrated", "reason": f"hardware.calibration={hw.calibration} (no record used){unused}"}
    if not hw.calibrate:
        return {"status": "not calibrated", "reason": f"no cached record and hardware.calibrate=false{unused}"}
    progress(f"[harness] {why or 'no calibration cached for ' + name}: measuring GEMM, copy and read ceilings "
             f"(hardware.calibrate=false skips this)")
    t0 = time.perf_counter()
    rec = calibrate(device, hw, progress=progress)
    seconds = time.perf_counter() - t0
    if rec["status"] == "rejected":
        return {"status": "rejected", "seconds": seconds,
                "reason": f"measured twice, failed the calibration checks both times: {'; '.join(rec['problems'])}",
                "rejected": {k: rec.get(k) for k in MANIFEST_KEYS if k != "path"}}
    progress(f"[harness] calibrated in {seconds:.1f} s: GEMM {rec['gemm_tflops']:,.4g} TFLOP/s "
             f"({rec['gemm_dtype']}), copy {rec['copy_gbs']:,.4g} GB/s, read {rec['read_gbs']:,.4g} GB/s; "
             + (f"cached at {rec['path']}" if rec.get("path") else rec.get("cache_error") or "not cached"))
    extra = {"cache_error": rec["cache_error"]} if rec.get("cache_error") else {}
    return {"status": "measured", "seconds": seconds, **{k: rec.get(k) for k in MANIFEST_KEYS}, **extra}


def summary_lines(rec: dict) -> list:
    """Human lines: measured ceilings, their fraction of the dense datasheet peak, the checks."""
    name = rec["device_name"]
    peaks = resolve_peaks(name, rec.get("gemm_dtype", "bf16"), None, rec)
    timer = f"median of {rec['iters']}, {rec['timer']} timer"

    def cv(key):
        return f", CV {rec[key]:.1%}" if rec.get(key) is not None else ""
    lines = [f"device        {name} ({peaks.spec_name or 'unknown: no datasheet peak'})",
             f"GEMM          {rec['gemm_tflops']:,.4g} TFLOP/s ({rec['gemm_dtype']}, {rec['gemm_size']}^3, {timer}"
             f"{cv('gemm_cv')})",
             f"copy          {rec['copy_gbs']:,.4g} GB/s ({'device-to-device' if rec.get('timer') == 'cuda_event' else 'memcpy'}, "
             f"read + write bytes, {timer}{cv('copy_cv')})"]
    if rec.get("read_gbs") is not None:
        lines.append(f"read          {rec['read_gbs']:,.4g} GB/s (sum over {rec.get('read_mib')} MiB, bytes read, "
                     f"{timer}{cv('read_cv')})")
    if peaks.peak_tflops and peaks.mem_bw_gbs:
        lines.append(f"vs datasheet  GEMM {rec['gemm_tflops'] / peaks.peak_tflops:.1%} of {peaks.peak_tflops:g} "
                     f"TFLOP/s dense {peaks.dtype}; copy {rec['copy_gbs'] / peaks.mem_bw_gbs:.1%}"
                     + (f", read {rec['read_gbs'] / peaks.mem_bw_gbs:.1%}" if rec.get("read_gbs") else "")
                     + f" of {peaks.mem_bw_gbs:g} GB/s")
    if peaks.cal_ridge:
        lines.append(f"ridge         {peaks.cal_ridge:,.1f} FLOP/B measured"
                     + (f", {peaks.ridge:,.1f} FLOP/B datasheet" if peaks.ridge else ""))
    lo, hi = rules.BAND
    limit = rules.CV_LIMIT.get(str(rec.get("timer")), rules.CV_LIMIT["host"])
    verdict = "passed" if not rec.get("problems") else "REJECTED: " + "; ".join(rec["problems"])
    lines.append(f"checks        {verdict} (within {lo:.0%}-{hi:.0%} of the datasheet where there is one, "
                 f"CV <= {limit:.0%}; {rec.get('attempts', 1)} measurement(s))")
    if rec.get("path") or rec.get("cache_error"):
        lines.append(f"cache         {'cached at ' + rec['path'] if rec.get('path') else rec['cache_error']}")
    return lines


def check_cache_dir(hardware) -> None:
    """Refuse a ``hardware.cache_dir`` that is not a directory (one line, before measuring)."""
    d = cache_dir(hardware)
    if d.exists() and not d.is_dir():
        where = "hardware.cache_dir" if hardware_config(hardware).cache_dir else f"${CACHE_ENV}"
        raise HarnessError(f"{where}={d} is a file, not a directory",
                           f"point {where} at a directory (it is created when missing), or leave it unset")


def calibrate_from_config(cfg, out_dir: Path) -> dict:
    """The ``calibrate`` verb: measure, cache, write ``out_dir/calibration.json``, print; a
    calibration rejected twice is a one-line error (exit 2) after its record is written."""
    from ..setup import resolve_device

    device = resolve_device(cfg.device)
    check_cache_dir(cfg.hardware)
    rec = calibrate(device, cfg.hardware, progress=print)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps(rec, indent=2, default=str) + "\n")
    for line in summary_lines(rec):
        print(f"[harness] calibrate: {line}")
    if rec["status"] == "rejected":
        raise HarnessError(f"the calibration of {rec['device_name']} failed its checks twice "
                           f"({'; '.join(rec['problems'])}); nothing was cached (record: {out / 'calibration.json'})",
                           "calibrate again on an idle device (no other jobs, steady clocks), or with more "
                           "hardware.iters or a larger hardware.gemm_size / hardware.copy_mib")
    return rec


__all__ = ["calibrate", "calibrate_from_config", "load_calibration", "find_calibration", "ensure_calibration",
           "measure", "cache_path", "cache_dir", "settings", "summary_lines", "check_cache_dir", "read_mib_for",
           "MANIFEST_KEYS", "DEFAULTS"]
