"""Roofline: device ceilings, calibration, the measured x analytic join, and the plot.

* ``specs``: dense datasheet peaks per dtype and memory bandwidth, device-name matching,
  config overrides -> ``Peaks`` (datasheet + calibrated ceilings of one run).
* ``calibrate``: ``python -m harness calibrate`` (measured GEMM TFLOP/s, copy GB/s, cached per device).
* ``ceilings``: the datasheet and calibrated ceilings of one run (``Peaks``), from its manifest.
* ``flags``: an efficiency above its ceiling is flagged (what to check), never stored as a figure.
* ``point``: the math of one row (floor, efficiencies against span and busy time, the bound rule).
* ``join``: stages.csv / routing csvs x ``harness.analytic`` -> stage roofline rows
  (achieved rates, intensity, ridge, floor, efficiency vs both ceilings, bound, MFU / MBU).
* ``ops``: kernels.csv (op group of the launching module) x analytic families -> op-family rows.
* ``table``: ``roofline_table``, both together.
* ``plot``: roofline.png.
"""
from .ceilings import ceilings
from .specs import SPECS, DeviceSpec, Peaks, match_device, resolve_peaks
from ..schema.roofline import ROOFLINE_COLUMNS
from .join import OP_GROUPS, roofline_point
from .table import roofline_table

__all__ = ["ceilings", "SPECS", "DeviceSpec", "Peaks", "match_device", "resolve_peaks", "OP_GROUPS", "ROOFLINE_COLUMNS",
           "roofline_point", "roofline_table"]
