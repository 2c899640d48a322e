"""When a measured calibration may stand for a device's ceilings: the datasheet band and the spread limit.

One place for both rules (``python -m harness calibrate`` and a run's calibration on first use
apply them, and a cached record is checked again when it is loaded):

* **Datasheet band**: each measured ceiling divided by its dense datasheet figure must lie within
  ``BAND`` = [30%, 105%]: GEMM TFLOP/s against the peak of the GEMM's dtype (fp32 GEMMs against
  the TF32 rate when TF32 matmuls are allowed), copy GB/s (read + write bytes) and read GB/s
  against the memory bandwidth. Below 30% the device was busy, throttled or the measurement too
  small to reach the roof; above 105% the timer or the byte count is wrong. A device without a
  datasheet figure (the CPU, an unknown GPU) skips this rule, unless ``hardware.peak_tflops`` /
  ``hardware.mem_bw_gbs`` give one.
* **Spread**: the coefficient of variation (standard deviation / mean, population) of each
  measurement's timed iterations must stay within ``CV_LIMIT``: 5% with CUDA events (a GPU that
  varies more was shared or changing clocks), 25% with the host clock (CPU timings carry the
  scheduler's noise). Fewer than ``MIN_SPREAD_ITERS`` iterations are not checked.

A calibration that fails either rule is measured once more; if it fails again it is rejected: not
cached, not used as a ceiling, and the run's manifest and report say why.
"""
from __future__ import annotations

import statistics
from typing import Optional

#: measured / datasheet: the range a calibrated ceiling must fall in
BAND = (0.30, 1.05)
#: largest coefficient of variation of the timed iterations, per timer
CV_LIMIT = {"cuda_event": 0.05, "host": 0.25}
#: fewer timed iterations than this: no spread is computed
MIN_SPREAD_ITERS = 3

#: (record key of the ceiling, record key of its spread, words, unit, which datasheet figure)
CEILINGS = (("gemm_tflops", "gemm_cv", "GEMM", "TFLOP/s", "compute"),
            ("copy_gbs", "copy_cv", "copy", "GB/s", "memory"),
            ("read_gbs", "read_cv", "read", "GB/s", "memory"))


def spread(times_ms: list) -> Optional[float]:
    """Coefficient of variation of ``times_ms`` (None below ``MIN_SPREAD_ITERS`` values)."""
    if len(times_ms) < MIN_SPREAD_ITERS:
        return None
    mean = statistics.fmean(times_ms)
    return statistics.pstdev(times_ms) / mean if mean > 0 else None


def problems(rec: dict, peak_tflops: Optional[float], mem_bw_gbs: Optional[float]) -> list:
    """Why ``rec`` (a calibration record) may not stand for the device's ceilings; [] when it may.
    ``peak_tflops``: the datasheet (or configured) dense TFLOP/s of the GEMM's dtype; ``mem_bw_gbs``
    the memory bandwidth; None where there is no figure (that rule is skipped)."""
    out = []
    limit = CV_LIMIT.get(str(rec.get("timer")), CV_LIMIT["host"])
    lo, hi = BAND
    for key, cv_key, words, unit, kind in CEILINGS:
        value = rec.get(key)
        if value is None:
            continue
        sheet = peak_tflops if kind == "compute" else mem_bw_gbs
        if sheet:
            share = value / sheet
            if not lo <= share <= hi:
                side = f"below the {lo:.0%} floor" if share < lo else f"above the {hi:.0%} ceiling"
                out.append(f"{words} {value:,.4g} {unit} is {share:.1%} of the datasheet's {sheet:,.4g} {unit}, {side}")
        cv = rec.get(cv_key)
        if cv is not None and cv > limit:
            out.append(f"{words} iterations vary by {cv:.1%} (CV), over the {limit:.0%} limit")
    return out


__all__ = ["BAND", "CV_LIMIT", "MIN_SPREAD_ITERS", "CEILINGS", "spread", "problems"]
