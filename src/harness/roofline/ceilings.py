"""The ceilings of one run: datasheet and calibrated peaks for its device and dtype (``Peaks``).

``ceilings(manifest)`` resolves them from a run's manifest: the datasheet entry of its device
(``specs``), the calibration the run recorded in its manifest (what it measured or found cached)
or else this machine's cached calibration of that device (``calibrate.load_calibration``), and the
run's ``hardware`` overrides. The run report, the ncu session and anything else that puts a
measured number against a ceiling read them here.
"""
from __future__ import annotations

from typing import Optional

from ..floats import finite as _f
from .calibrate import load_calibration
from .specs import Peaks, device_name_of, hardware_config, resolve_peaks
from ..schema.manifest import Manifest


def ceilings(manifest: dict, hardware: Optional[dict] = None) -> Peaks:
    """Datasheet + calibrated ceilings for the run's device and dtype (the run's ``hardware``
    section, with ``hardware`` overriding keys of it)."""
    man = Manifest.of(manifest)
    hw = hardware_config({**man.section_of_config("hardware"), **(hardware or {})})
    name = device_name_of(man.device)
    dtype = str(man.dtype or "bf16").replace("torch.", "")
    entry = man.calibration
    if _f(entry.get("gemm_tflops")) is not None and "calibration" not in (hardware or {}):
        cal = {**entry, "path": entry.get("path") or "run manifest"}
    elif entry.get("status") == "rejected" and "calibration" not in (hardware or {}):
        cal = None      # the run's own calibration failed its checks: no ceiling, never another record
    else:
        cal = load_calibration(name, hw)
    peaks = resolve_peaks(name, dtype, hw, cal)
    if cal is None:
        why = f" ({entry['reason']})" if entry.get("reason") else ""
        peaks.notes.append(f"not calibrated{why}: run `python -m harness calibrate` on this device for measured "
                           "ceilings (a run calibrates on first use unless hardware.calibrate=false)")
    return peaks


__all__ = ["ceilings"]
