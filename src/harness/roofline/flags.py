"""Efficiencies above their ceiling: never a number, always a flag that says what to check.

An MFU, MBU or efficiency is a fraction of a ceiling (the datasheet or the calibrated peak); above
1.0 it means the analytic work (FLOPs or bytes), the measured time or the ceiling is wrong, so it
is never shown or stored as a figure:

* ``flag_rows(table)`` fills the roofline table's ``above_ceiling`` column: per row, each column
  above 1.0 as ``column=value`` with what to check (``what_to_check``);
* ``for_csv(table)`` blanks those values for roofline.csv (the note keeps them), so no committed
  or written efficiency exceeds 1.0; ``value_of(row, column)`` reads a value back from either;
* ``caveats(table)`` gives one report caveat per flagged row, naming the case, stage (or op family)
  and which of bytes, FLOPs or ceiling to check;
* the report's formatter (``harness.report.columns.efficiency``) writes such a cell as
  ``ABOVE_CEILING``.
"""
from __future__ import annotations

import re
from typing import Mapping, Optional

import pandas as pd

from ..floats import finite as _f

#: fractions of a ceiling: efficiency = floor / span (or busy), MFU = useful FLOPs, MBU = bytes needed
EFFICIENCY_COLUMNS = ("efficiency", "efficiency_busy", "efficiency_cal", "efficiency_busy_cal", "mfu", "mfu_cal",
                      "mbu", "mbu_cal")
FLAG_COLUMN = "above_ceiling"
ABOVE_CEILING = "above the ceiling ({pct:.1f}%): bytes, FLOPs or ceiling wrong"
_NOTE = re.compile(r"\b([a-z_]+)=([0-9.]+(?:e[+-]?\d+)?)")


def above(value) -> bool:
    """True for a fraction of a ceiling above 1.0."""
    x = _f(value)
    return x is not None and x > 1.0


def what_to_check(row: Mapping, column: str) -> str:
    """Which of bytes, FLOPs or ceiling to check for ``column`` of a roofline row: the side of the
    roofline that set its floor (compute: tensor FLOPs and the compute peak; memory: bytes and the
    bandwidth), or for MFU the useful FLOPs and for MBU the MBU bytes (experts touched, routing)."""
    cal = column.endswith("_cal")
    peak = "calibrated GEMM peak" if cal else "datasheet compute peak"
    bw = "calibrated copy bandwidth" if cal else "datasheet bandwidth"
    routing = f"; routing: {row.get('routing')}" if row.get("routing") else ""
    if column.startswith("mfu"):
        return f"the analytic useful FLOPs ({_num(row.get('flops_useful'), 1e9, 'GFLOP')}) or the {peak}"
    if column.startswith("mbu"):
        return (f"the analytic MBU bytes ({_num(row.get('mbu_bytes'), 1e6, 'MB')}: weights of the experts touched "
                f"+ KV read{routing}) or the {bw}")
    flops, nbytes = _f(row.get("tensor_flops")) or 0.0, _f(row.get("bytes")) or 0.0
    tf = _f(row.get("cal_tflops" if cal else "peak_tflops"))
    gbs = _f(row.get("cal_gbs" if cal else "mem_bw_gbs"))
    compute = tf and gbs and flops / (tf * 1e12) >= nbytes / (gbs * 1e9)
    what = (f"the analytic tensor FLOPs ({_num(flops, 1e9, 'GFLOP')}) or the {peak}" if compute else
            f"the analytic bytes ({_num(nbytes, 1e6, 'MB')}{routing}) or the {bw}")
    if "busy" in column:
        what += f", or the kernels counted as busy ({_num(row.get('kernels'), 1, 'kernel(s)')})"
    return what


def _num(v, scale: float, unit: str) -> str:
    x = _f(v)
    if x is None:
        return "?"
    x /= scale
    return f"{x:,.0f} {unit}" if abs(x) >= 1000 else f"{x:.4g} {unit}"


def flag_rows(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with ``FLAG_COLUMN``: for each row '' or '; '-joined ``column=value (check ...)``."""
    out = table.copy()
    cols = [c for c in EFFICIENCY_COLUMNS if c in out]
    out[FLAG_COLUMN] = ["; ".join(f"{c}={float(r[c]):.4g} (check {what_to_check(r, c)})" for c in cols if above(r[c]))
                        for r in out.to_dict("records")]
    return out


def for_csv(table: pd.DataFrame, columns=EFFICIENCY_COLUMNS) -> pd.DataFrame:
    """A table as a CSV stores it: every value of ``columns`` above 1.0 blank, the row's
    ``FLAG_COLUMN`` note keeping it (the roofline table's note from ``flag_rows``; else
    ``column=value``)."""
    out = table.copy()
    cols = [c for c in columns if c in out]
    if FLAG_COLUMN not in out:
        out[FLAG_COLUMN] = ["; ".join(f"{c}={float(r[c]):.4g}" for c in cols if above(r[c]))
                            for r in out.to_dict("records")]
    for c in cols:
        out[c] = out[c].where(~out[c].map(above))
    return out


def value_of(row: Mapping, column: str) -> Optional[float]:
    """The value of ``column`` of a roofline row: the number, or (a roofline.csv written by
    ``for_csv``) the value its ``FLAG_COLUMN`` note keeps; None when neither has one."""
    x = _f(row.get(column))
    if x is not None:
        return x
    for name, value in _NOTE.findall(str(row.get(FLAG_COLUMN) or "")):
        if name == column:
            return float(value)
    return None


def caveats(table: pd.DataFrame) -> list:
    """One caveat per row with a value above its ceiling, naming the row and what to check."""
    out = []
    for r in table.to_dict("records"):
        over = [c for c in EFFICIENCY_COLUMNS if above(value_of(r, c))]
        if not over:
            continue
        row = f"{r['case']}/{r['stage']}" + (f" ({r['op_family']} op family)" if r.get("level") == "op_family" else "")
        parts = "; ".join(f"{c} {100 * value_of(r, c):.1f}%: check {what_to_check(r, c)}" for c in over)
        out.append(f"Above the ceiling, shown flagged instead of as a figure: {row}: {parts}.")
    return out


__all__ = ["EFFICIENCY_COLUMNS", "FLAG_COLUMN", "ABOVE_CEILING", "above", "what_to_check", "flag_rows", "for_csv",
           "value_of", "caveats"]
