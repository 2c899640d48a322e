"""``steps.csv``: every decode step of a run's timed repeats (TPOT against the KV length; written
by ``harness.run`` from ``harness.measure.observations.step_rows``, read by ``harness.report.steps``)."""
from __future__ import annotations

from .table import table

STEPS_CSV = table("steps.csv", """
case | | label | case name
repeat | | label | timed repeat (from 0)
step | | label | decode step (from 0)
kv_len | positions | derived | positions the step's attention reads: prompt + 1 + step
gpu_ms | ms | measured | the step's GPU span, CUDA events (empty on a CPU run)
host_ms | ms | measured | the step's host span, host clock
""")
#: steps.csv's columns, in order
STEP_COLUMNS = STEPS_CSV.columns

__all__ = ["STEPS_CSV", "STEP_COLUMNS"]
