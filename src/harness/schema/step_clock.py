"""``step_clock.csv``: the fused decode step timed from inside its kernels (``execution.step_clock``):
each launch of each decode step of a case's median request, with the %globaltimer stamps its first
program stored (written by ``harness.run``, read by ``harness.report.step_clock`` through
``harness.measure.step_clock``)."""
from __future__ import annotations

from .table import table

STEP_CLOCK_CSV = table("step_clock.csv", """
case | | label | case name
repeat | | label | the timed repeat (from 0) whose stamps these are: the case's median request
row | | label | the step's clock row: its KV position (the position it writes)
launch | | label | the launch's index within the step (FusedDecodeStep.calls)
label | | label | what the launch runs: qkv, attention, o_proj, router, gate_up, down or lm_head
layer | | label | its decoder layer (the layer count for lm_head)
kind | | label | moe or dense: the kind of its layer (empty for lm_head)
entry | ns | measured | %globaltimer when the launch's first program started (a CPU run: Triton's interpreter's \
logical tick, not time)
release | ns | measured | %globaltimer when that program passed its wait (the previous launch had completed)
end | ns | measured | %globaltimer when the launch's last program ended (every program's clock only; empty here)
""")
__all__ = ["STEP_CLOCK_CSV"]
