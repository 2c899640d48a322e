"""The roofline table of a run: stage rows (``join``) and op-family rows (``ops``) together."""
from __future__ import annotations

import pandas as pd

from ..measure.summary import Summary, summarize
from ..rundir import RunData
from .flags import flag_rows
from .join import analytic_for_run, join_stages, roofline_frame
from .ops import join_op_families
from .specs import Peaks


def roofline_table(run: RunData, peaks: Peaks, summary: Summary | None = None) -> tuple:
    """(roofline DataFrame [ROOFLINE_COLUMNS], analytic DataFrame, measured stages, notes): the
    run's measured stages (``summary.stages``, the run's ``summarize`` when not given) joined with
    its analytic frames (derived here when ``run.analytic`` is None, i.e. for a run read back from
    disk)."""
    summary = summary or summarize(run.stages)
    measured = summary.stages
    if run.analytic is None:
        analytic, mbu_bytes, notes = analytic_for_run(run)
    else:
        analytic, mbu_bytes, notes = run.analytic, run.mbu_bytes, list(run.notes)
    st = join_stages(measured, analytic, peaks, mbu_bytes)
    timers = {c: g["timer"].iloc[0] for c, g in measured.groupby("case")} if len(measured) else {}
    op = join_op_families(run.kernels, analytic, peaks, timers, summary.step_scales)
    frames = [f for f in (st, op) if len(f)]
    table = pd.concat(frames, ignore_index=True) if frames else roofline_frame([])
    return flag_rows(table), analytic, measured, notes


__all__ = ["roofline_table"]
