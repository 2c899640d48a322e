"""Analytic cost model of DeepSeek-OCR: FLOPs, bytes and parameters per module family and stage.

* ``families``: one cost class per module family (formulas in the docstrings).
* ``compose``: a workload case -> DataFrame, one row per stage x family (x decode step) + totals.
* ``check``: FlopCounterMode per stage vs the analytic ``flops_counted`` (exact).
* ``docs``: generated ``docs/module_catalog.md`` and ``docs/formulations/<family>.md``.

* ``static``: ``analyze(cases, out_dir)`` writes ``static_compute.json`` / ``.md`` / ``.csv`` and the
  sweep tables; ``python -m harness.analytic`` is its command line (the ``harness analyze`` verb
  calls ``analyze_from_config``). No GPU and no weights are needed.

Which modules each family describes is ``harness.anatomy.registry``.
"""
from .compose import (COLUMNS, STAGES, Case, activated_params_per_token, case_summary, component_params,
                      decode_step_costs, kv_bytes_per_token, stage_totals, useful_flops, workload_costs)
from .families import FAMILIES, Cost
from .static import DEFAULT_CASES, analyze, analyze_from_config

__all__ = ["analyze", "workload_costs", "case_summary", "stage_totals", "useful_flops", "component_params",
           "activated_params_per_token", "kv_bytes_per_token", "decode_step_costs", "Case", "Cost", "COLUMNS",
           "STAGES", "FAMILIES", "DEFAULT_CASES", "analyze_from_config"]
