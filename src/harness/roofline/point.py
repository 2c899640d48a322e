"""The roofline math of one measurement: achieved rates, floor, efficiencies, the bound label.

Units: FLOP, bytes (B), ms, TFLOP/s (1e12 FLOP/s), GB/s (1e9 B/s).

* ``floor_ms`` = max(tensor FLOPs / peak, bytes / bandwidth) (derived: analytic work over a ceiling).
* ``efficiency`` = floor / span (the measured stage time); ``efficiency_busy`` = floor / kernel
  busy time (the profiled request's kernels only: what the kernels achieve when they run).
* ``achieved_tflops`` / ``achieved_gbs``: **analytic** work over **measured** time, not measured
  traffic (ncu measures traffic: ``python -m harness profile tool=ncu``).
* ``classify`` is the one rule for the bound label: ``launch/host`` when the idle fraction
  (idle / span) is above ``LAUNCH_BOUND_IDLE``, else ``compute`` when intensity >= ridge, else
  ``memory``; ``unknown`` without a ridge. The caller passes the same idle fraction it shows.
"""
from __future__ import annotations

from typing import Optional

from ..floats import finite as _f
from .specs import Peaks

LAUNCH_BOUND_IDLE = 0.5


def floor_ms(flops, bytes_, peak_tflops, bw_gbs) -> Optional[float]:
    """max(flops / peak, bytes / bandwidth) in ms; None when a needed ceiling is missing."""
    flops, bytes_ = _f(flops) or 0.0, _f(bytes_) or 0.0
    parts = []
    if flops > 0:
        if not _f(peak_tflops):
            return None
        parts.append(flops / (peak_tflops * 1e12) * 1e3)
    if bytes_ > 0:
        if not _f(bw_gbs):
            return None
        parts.append(bytes_ / (bw_gbs * 1e9) * 1e3)
    return max(parts) if parts else 0.0


def classify(intensity, ridge, idle_fraction=None) -> str:
    """'launch/host' (idle > 50% of the span), 'compute' (intensity >= ridge), 'memory', or 'unknown'."""
    idle = _f(idle_fraction)
    if idle is not None and idle > LAUNCH_BOUND_IDLE:
        return "launch/host"
    i, r = _f(intensity), _f(ridge)
    if i is None or r is None:
        return "unknown"
    return "compute" if i >= r else "memory"


def bound_of(intensity, ridge, cal_ridge, idle_fraction) -> tuple:
    """(label, basis): ``classify`` against the datasheet ridge, else the calibrated one."""
    idle = _f(idle_fraction)
    if classify(None, None, idle) == "launch/host":
        return "launch/host", f"idle {idle:.0%} of the span"
    if _f(ridge) is not None:
        return classify(intensity, ridge, idle), "datasheet ridge"
    if _f(cal_ridge) is not None:
        return classify(intensity, cal_ridge, idle), "calibrated ridge"
    return "unknown", "no ceilings (unknown device, not calibrated)"


def _ratio(num, den) -> Optional[float]:
    n, d = _f(num), _f(den)
    return n / d if (n is not None and d) else None


def roofline_point(flops, bytes_, measured_ms, peak_tflops=None, bw_gbs=None, cal_tflops=None, cal_gbs=None,
                   idle_fraction=None, busy_ms=None) -> dict:
    """Achieved rates, intensity, ridges, floors, efficiencies (against the span ``measured_ms``
    and against ``busy_ms``) and bound of one measurement.

    flops [FLOP], bytes_ [B], measured_ms / busy_ms [ms], peaks [TFLOP/s], bandwidths [GB/s].
    """
    flops, bytes_, ms = _f(flops) or 0.0, _f(bytes_) or 0.0, _f(measured_ms)
    out = {"intensity": flops / bytes_ if bytes_ > 0 else None,
           "achieved_tflops": flops / ms / 1e9 if ms else None,
           "achieved_gbs": bytes_ / ms / 1e6 if ms else None,
           "peak_tflops": _f(peak_tflops), "mem_bw_gbs": _f(bw_gbs),
           "ridge": Peaks._ridge(_f(peak_tflops), _f(bw_gbs)),
           "cal_tflops": _f(cal_tflops), "cal_gbs": _f(cal_gbs),
           "cal_ridge": Peaks._ridge(_f(cal_tflops), _f(cal_gbs))}
    out["floor_ms"] = floor_ms(flops, bytes_, peak_tflops, bw_gbs) if (_f(peak_tflops) or _f(bw_gbs)) else None
    out["floor_ms_cal"] = floor_ms(flops, bytes_, cal_tflops, cal_gbs) if (_f(cal_tflops) or _f(cal_gbs)) else None
    out["efficiency"] = _ratio(out["floor_ms"], ms)
    out["efficiency_cal"] = _ratio(out["floor_ms_cal"], ms)
    out["efficiency_busy"] = _ratio(out["floor_ms"], busy_ms)
    out["efficiency_busy_cal"] = _ratio(out["floor_ms_cal"], busy_ms)
    out["bound"], out["bound_basis"] = bound_of(out["intensity"], out["ridge"], out["cal_ridge"], idle_fraction)
    return out


def mfu(flops_useful, measured_ms, peak_tflops) -> Optional[float]:
    """Model FLOP utilisation: flops_useful / time / peak."""
    f, ms, p = _f(flops_useful), _f(measured_ms), _f(peak_tflops)
    if not ms or not p or f is None:
        return None
    return f / (ms * 1e-3) / (p * 1e12)


def mbu(bytes_needed, measured_ms, bw_gbs) -> Optional[float]:
    """Model bandwidth utilisation: bytes that must move / time / bandwidth."""
    b, ms, bw = _f(bytes_needed), _f(measured_ms), _f(bw_gbs)
    if not ms or not bw or b is None:
        return None
    return b / (ms * 1e-3) / (bw * 1e9)


__all__ = ["LAUNCH_BOUND_IDLE", "floor_ms", "classify", "bound_of", "roofline_point", "mfu", "mbu"]
