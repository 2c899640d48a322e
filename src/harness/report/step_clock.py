"""Inside the fused decode step, from its own kernels' clock (``execution.step_clock``).

For each case with step_clock.csv rows (its median request's stamps): one row per module of the
step (``harness.measure.step_clock.MODULES``): launches per step, the median per-step interval
(each launch from its release to the next launch's release: the module's share of the critical
path, hand-offs included) and its share of the step; then the step itself, beside the same
request's decode-step median by CUDA events (steps.csv), which reconciles the two clocks.
"""
from __future__ import annotations

import pandas as pd

from ..measure import step_clock
from ..measure.stats import median_low
from .columns import table
from .context import on_cpu

COLUMNS = ["case", "module_group", "clock_launches", "interval_us", "step_share"]


def section(run) -> list:
    """The report's lines (none without step_clock.csv rows)."""
    clock = run.step_clock
    if clock is None or not len(clock):
        return []
    rows, notes = [], []
    for case, g in clock.groupby("case", sort=False):
        df = step_clock.launches(g[step_clock.LAUNCH_COLUMNS])
        mods = step_clock.modules(df)
        rows += [{"case": case, **m} for m in mods]
        whole = step_clock.steps(df)
        events = _event_step_us(run.steps, case, int(g["repeat"].iloc[0]))
        if len(whole):
            notes.append(f"`{case}` (timed repeat {int(g['repeat'].iloc[0])}, the median request): median step "
                         f"{median_low(whole):.1f} µs by the in-kernel clock over {len(whole)} steps"
                         + (f", {events:.1f} µs by CUDA events over the same request's decode steps" if events else ""))
    if not rows:
        return []
    if on_cpu(getattr(run, "manifest", None) or {}, getattr(run, "stages", None)):
        notes.append("a CPU run: Triton's interpreter counts a logical tick per clock read, so these are not times")
    return ["## Inside the fused decode step (in-kernel clock)", "",
            "Each launch of the fused step (`execution.step_clock`) stores %globaltimer when its first program "
            "starts and when that program passes its wait (the previous launch has completed). A launch's interval "
            "runs from its release to the next launch's release: its own work and the hand-off to the next, so the "
            "intervals of a step add up to the step. Medians over the median request's steps "
            "(`step_clock.csv`; `harness.measure.step_clock`). The clock adds two timer reads and two stores per "
            "launch, and one read of the stamps after each request, outside its range but inside its `generate()` "
            "call (`docs/kernels/decode_step.md`).", "",
            *table(COLUMNS, rows), "", *[f"- {n}" for n in notes], ""]


def _event_step_us(steps: pd.DataFrame, case: str, repeat: int):
    """The median (``median_low``) GPU time of ``case``'s decode steps in timed repeat ``repeat`` (µs, CUDA
    events), or None."""
    if steps is None or not len(steps) or "gpu_ms" not in steps:
        return None
    m = median_low(steps[(steps["case"] == case) & (steps["repeat"] == repeat)]["gpu_ms"])
    return None if m is None else m * 1e3
