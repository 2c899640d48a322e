"""The run directory's schema: one module per file kind, each holding its columns (name, unit,
provenance: ``table.Field``), its writer and its reader (``table.Table``); torch-free, below every
reader and writer of a run directory.

* ``stages``: stages.csv, the typed observations (one row per case x request x stage x call);
* ``steps``: steps.csv, every decode step of the timed repeats;
* ``kernels``: kernels.csv, every kernel of the profiled request;
* ``routing``: routing.csv and routing_steps.csv, the measured MoE routing;
* ``step_clock``: step_clock.csv, the fused decode step's in-kernel stamps (``execution.step_clock``);
* ``throughput``: throughput.csv and its raw tables (throughput_batches/_spans/_prep.csv);
* ``headline``: headline.csv and stages_summary.csv, what the report derives from stages.csv;
* ``roofline``: roofline.csv, the roofline join;
* ``analytic``: analytic.csv, the cost model's FLOPs and bytes of the measured cases;
* ``manifest``: manifest.json read once into a typed ``Manifest``.
"""
from __future__ import annotations

from .kernels import KERNELS_CSV
from .routing import ROUTING_CSV, ROUTING_STEPS_CSV
from .stages import STAGES_CSV
from .step_clock import STEP_CLOCK_CSV
from .steps import STEPS_CSV

#: the observation files a run appends each finished case's rows to (``harness.run.CaseTables``),
#: read back by ``harness.rundir.load_run``, by their name in ``RunData`` (every other file of a run
#: directory is derived from them and the manifest)
CASE_TABLES = {"stages": STAGES_CSV, "kernels": KERNELS_CSV, "steps": STEPS_CSV, "routing_steps": ROUTING_STEPS_CSV,
               "routing": ROUTING_CSV, "step_clock": STEP_CLOCK_CSV}
CASE_FILES = tuple(t.file for t in CASE_TABLES.values())

__all__ = ["CASE_TABLES", "CASE_FILES"]
