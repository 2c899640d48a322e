"""Roofline: device ceilings, calibration, the measured x analytic join, and the plot.

* ``specs``: dense datasheet peaks per dtype and memory bandwidth, device-name matching,
  config overrides -> ``Peaks`` (datasheet + calibrated ceilings of one run).
* ``calibrate``: ``python -m harness calibrate`` (measured GEMM TFLOP/s, copy GB/s, cached per device).
* ``join``: stages.csv / kernels.csv / routing.csv x ``harness.analytic`` -> roofline rows
  (achieved rates, intensity, ridge, floor, efficiency vs both ceilings, bound, MFU / MBU).
* ``plot``: roofline.png.
"""
from .specs import SPECS, DeviceSpec, Peaks, match_device, resolve_peaks
from .join import OP_GROUPS, ROOFLINE_COLUMNS, load_run, roofline_point, roofline_table

__all__ = ["SPECS", "DeviceSpec", "Peaks", "match_device", "resolve_peaks", "OP_GROUPS", "ROOFLINE_COLUMNS",
           "load_run", "roofline_point", "roofline_table"]
