"""The one summarizer of a run's observations (``harness.measure.observations``).

``summarize(observations)`` returns a ``Summary``; every reader of measured stage times (the
report's headline and tables, the roofline join, ``compare``, the ``summarize`` verb, the
execution ladder's ratios) goes through it, so each rule below exists once:

* **median request** (``median_repeat``): per case, the timed repeat whose end-to-end time is
  ``stats.median_low`` of the timed repeats' (the lower middle for an even count; ties: the
  earliest repeat). The headline is that one request, so its stage times add up.
* **one median rule**: every median is ``stats.median_low`` (an observed value); its spread is
  the min-max over the timed repeats and the seeded bootstrap 95% interval (``stats.spread``).
* **busy and idle**: kernel busy time comes from the profiled request (union of its kernel
  intervals: robust to host noise; the profiler stretches that request's own spans); a timed
  span is paired with it as idle = max(span - busy, 0) (``idle_of``).

Outputs (DataFrames, built on first use):

* ``stages`` (``MEASURED_COLUMNS``): one row per case x stage (the five stages, ``preprocess``
  where recorded, and ``request``): the median span of the timed repeats (``time_ms``: GPU span
  from CUDA events, or the host span on a CPU run, ``timer`` says which; ``gpu_ms`` and
  ``host_ms`` both kept) with its min / max / bootstrap interval / CV, the profiled request's
  kernels, busy time, host syncs and attribution, idle from both (``idle_basis`` says so). The
  ``request`` row carries the median request's TTFT / TPOT / tok/s (``REQUEST_FIELDS``).
* ``headline`` (``HEADLINE_COLUMNS``): one row per case, every value from the median request,
  ``<column>_min`` / ``_max`` over the timed repeats, the bootstrap interval of its end-to-end
  time, ``pages_s`` = batch x 1000 / e2e ms, ``stage_sum_ms`` and ``ttft_stage_sum_ms``.
* ``aggregates`` (``SUMMARY_COLUMNS``, written as ``stages_summary.csv``): per case x stage x
  call and ``statistic`` (``STATISTICS``: mean, std (ddof 1), median, cv, min, max, ci95_lo,
  ci95_hi) every numeric column over the timed repeats; the mean and median rows carry the
  profiled request's kernel columns and idle = max(that statistic's span - busy, 0).
* ``values(case, stage, column)``: the per-repeat values of the timed repeats (for intervals of
  ratios, ``stats.ratio_ci``).
"""
from __future__ import annotations

from functools import cached_property
from typing import Optional

import numpy as np
import pandas as pd

from ..floats import finite as _f
from ..anatomy.stages import STAGES
from . import stats
from .observations import CALL_ALL, NUMERIC, typed

#: request metrics of the headline (their min/max over the timed repeats come as ``<col>_min``/``_max``)
HEADLINE_METRICS = ["e2e_ms", "ttft_ms", "prep_ms", "h2d_ms", "ttft_e2e_ms", "tpot_p50_ms", "tpot_p90_ms",
                    "tpot_p99_ms", "tpot_mean_ms", "decode_tok_s", "pages_s"]
HEADLINE_COLUMNS = (["case", "mode", "grid", "batch", "timer", "repeat", "repeats", "warmup"] + HEADLINE_METRICS
                    + [f"{s}_ms" for s in STAGES] + ["stage_sum_ms", "ttft_stage_sum_ms", "e2e_ms_ci_lo", "e2e_ms_ci_hi"]
                    + [f"{c}_{x}" for c in HEADLINE_METRICS + [f"{s}_ms" for s in STAGES] for x in ("min", "max")])
#: columns the profiled request gives a stage (kernel capture, sync counting)
PROFILED_FIELDS = ("kernels", "busy_ms", "launches_per_step", "unattributed_kernel_ms", "attributed_fraction",
                   "host_syncs", "syncs_per_step")
MEASURED_COLUMNS = [
    "case", "mode", "grid", "batch", "stage", "timer", "time_ms", "gpu_ms", "host_ms", "time_min_ms", "time_max_ms",
    "time_ci_lo_ms", "time_ci_hi_ms", "host_min_ms", "host_max_ms", "kernels", "busy_ms", "idle_ms", "idle_fraction",
    "idle_basis", "launches_per_step", "ttft_ms", "prep_ms", "h2d_ms", "ttft_e2e_ms", "tpot_p50_ms", "tpot_p90_ms",
    "tpot_p99_ms", "tpot_mean_ms", "decode_tok_s", "e2e_ms", "peak_mem_bytes", "weight_bytes", "kv_cache_bytes",
    "cv", "repeats", "statistic", "median_repeat", "host_syncs", "syncs_per_step", "unattributed_kernel_ms",
    "attributed_fraction"]
#: label columns of ``MEASURED_COLUMNS`` and ``HEADLINE_COLUMNS``; counts are integers, the rest floats
LABELS = ("case", "mode", "grid", "stage", "timer", "idle_basis", "statistic")
COUNTS = {"batch": "int64", "repeats": "int64", "repeat": "int64", "median_repeat": "Int64", "warmup": "Int64"}
REQUEST_FIELDS = ("ttft_ms", "prep_ms", "h2d_ms", "ttft_e2e_ms", "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms",
                  "tpot_mean_ms", "decode_tok_s", "e2e_ms", "peak_mem_bytes", "weight_bytes", "kv_cache_bytes")
STATISTICS = ("mean", "std", "median", "cv", "min", "max", "ci95_lo", "ci95_hi")
SUMMARY_COLUMNS = ["case", "mode", "grid", "batch", "stage", "call", "calls", "timer", "statistic", "repeats"] + NUMERIC


def idle_of(span_ms, busy_ms) -> tuple:
    """(idle_ms, idle_fraction) = (max(span - busy, 0), idle / span): a timed span paired with the
    profiled request's busy time; (None, None) without both."""
    span, b = _f(span_ms), _f(busy_ms)
    if span is None or b is None:
        return None, None
    idle = max(span - b, 0.0)
    return idle, (idle / span if span else None)


def _typed(rows: list, columns: list) -> pd.DataFrame:
    """Rows (dicts) as a table of ``columns``: ``LABELS`` as text, ``COUNTS`` as integers (nullable
    where they may be missing), every other column float."""
    df = pd.DataFrame(rows, columns=columns)
    return df.astype({c: COUNTS.get(c, "float64") for c in columns if c not in LABELS})


def _span_column(rows: pd.DataFrame) -> str:
    """``gpu_ms`` where the rows have CUDA-event spans, else ``host_ms``."""
    return "gpu_ms" if rows["gpu_ms"].notna().any() else "host_ms"


class Summary:
    """The summaries of one table of observations (module docstring); ``warmups``: {case: untimed
    requests before the timed ones} for the headline."""

    def __init__(self, observations: Optional[pd.DataFrame], warmups: Optional[dict] = None):
        self.observations = typed(observations)
        self.warmups = warmups or {}
        obs = self.observations
        self.timed_all_calls = obs[~obs["profiled"]]
        whole = obs[obs["call"] == CALL_ALL]
        self.timed = whole[~whole["profiled"]]
        self.profiled = whole[whole["profiled"]]

    # ------------------------------------------------------------------------------ requests
    @cached_property
    def median_repeat(self) -> dict:
        """{case: repeat of the median request} (cases with timed request rows)."""
        req = self.timed[self.timed["stage"] == "request"]
        out = {}
        for case, g in req.groupby("case", sort=False):
            label = stats.median_request(g)
            if label is not None:
                out[case] = label
        return out

    def values(self, case: str, stage: str, column: str) -> np.ndarray:
        """``column`` of ``case`` x ``stage`` over the timed repeats (all calls), in repeat order."""
        t = self.timed
        g = t[(t["case"] == case) & (t["stage"] == stage)].sort_values("repeat")
        return g[column].to_numpy(dtype=float)

    def profiled_value(self, case: str, stage: str, column: str) -> Optional[float]:
        """``column`` of the profiled request's ``stage`` row (None without one)."""
        p = self.profiled
        g = p[(p["case"] == case) & (p["stage"] == stage)]
        return _f(g[column].iloc[0]) if len(g) else None

    # -------------------------------------------------------------------------------- stages
    @cached_property
    def stages(self) -> pd.DataFrame:
        """``MEASURED_COLUMNS``: one row per case x stage (module docstring)."""
        rows = []
        for (case, stage), g in self.timed.groupby(["case", "stage"], sort=False):
            gpu, host = stats.spread(g["gpu_ms"]), stats.spread(g["host_ms"])
            sp, timer = (gpu, "cuda_event") if gpu["n"] else (host, "host")
            r0 = g.iloc[0]
            out = {c: r0[c] for c in ("mode", "grid", "batch")}
            out.update(case=case, stage=stage, timer=timer, time_ms=sp["median"], gpu_ms=gpu["median"],
                       host_ms=host["median"], time_min_ms=sp["min"], time_max_ms=sp["max"], time_ci_lo_ms=sp["ci_lo"],
                       time_ci_hi_ms=sp["ci_hi"], host_min_ms=host["min"], host_max_ms=host["max"], cv=sp["cv"],
                       repeats=len(g), statistic=f"median of {len(g)} timed repeats")
            out.update({c: self.profiled_value(case, stage, c) for c in PROFILED_FIELDS})
            out["idle_ms"], out["idle_fraction"] = idle_of(out["time_ms"], out["busy_ms"])
            out["idle_basis"] = ("no kernel capture" if out["idle_ms"] is None else
                                 f"median span of {len(g)} timed repeats - kernel busy of the profiled request")
            if stage == "request" and case in self.median_repeat:
                pick = g[g["repeat"] == self.median_repeat[case]].iloc[0]
                out.update({c: _f(pick[c]) for c in REQUEST_FIELDS})
                out["median_repeat"] = self.median_repeat[case]
            else:
                out["peak_mem_bytes"] = stats.median_low(g["peak_mem_bytes"])
            rows.append(out)
        return _typed(rows, MEASURED_COLUMNS)

    # ------------------------------------------------------------------------------ headline
    @cached_property
    def headline(self) -> pd.DataFrame:
        """``HEADLINE_COLUMNS``: the median request of every case (module docstring)."""
        rows = []
        for case, g in self.timed.groupby("case", sort=False):
            if case not in self.median_repeat:
                continue
            req = g[g["stage"] == "request"].set_index("repeat")
            span = _span_column(g)
            wide = req[[c for c in HEADLINE_METRICS if c in req]].copy()
            wide["pages_s"] = req["batch"] * 1e3 / req["e2e_ms"]
            per_stage = g[g["stage"].isin(STAGES)].pivot_table(index="repeat", columns="stage", values=span,
                                                               aggfunc="first")
            wide = wide.join(per_stage.rename(columns=lambda s: f"{s}_ms"))
            label = self.median_repeat[case]
            pick = wide.loc[label]
            r0 = req.iloc[0]
            row = {"case": case, "mode": r0["mode"], "grid": r0["grid"], "batch": r0["batch"],
                   "timer": "cuda_event" if span == "gpu_ms" else "host", "repeat": label, "repeats": len(req),
                   "warmup": self.warmups.get(case)}
            for c in wide.columns:
                row[c] = _f(pick[c])
                col = wide[c].dropna()
                row[f"{c}_min"], row[f"{c}_max"] = (float(col.min()), float(col.max())) if len(col) else (None, None)
            stage_ms = [row.get(f"{s}_ms") for s in STAGES]
            row["stage_sum_ms"] = sum(v for v in stage_ms if v is not None)
            row["ttft_stage_sum_ms"] = sum(v for v in stage_ms[:4] if v is not None)
            row["e2e_ms_ci_lo"], row["e2e_ms_ci_hi"] = stats.bootstrap_ci(req["e2e_ms"])
            rows.append(row)
        return _typed(rows, HEADLINE_COLUMNS)

    # ---------------------------------------------------------------------------- aggregates
    @cached_property
    def aggregates(self) -> pd.DataFrame:
        """``SUMMARY_COLUMNS``: ``STATISTICS`` of every numeric column over the timed repeats, per
        case x stage x call (module docstring)."""
        out = []
        for (case, stage, call), g in self.timed_all_calls.groupby(["case", "stage", "call"], sort=False):
            r0 = g.iloc[0]
            rows = {s: {"case": case, "mode": r0["mode"], "grid": r0["grid"], "batch": r0["batch"], "stage": stage,
                        "call": call, "calls": r0["calls"], "timer": r0["timer"], "statistic": s, "repeats": len(g)}
                    for s in STATISTICS}
            for c in NUMERIC:
                vals = g[c].dropna()
                if not len(vals):
                    continue
                sp = stats.spread(vals)
                got = {"mean": float(vals.mean()), "std": float(vals.std(ddof=1)) if len(vals) > 1 else 0.0,
                       "median": sp["median"], "cv": sp["cv"], "min": sp["min"], "max": sp["max"],
                       "ci95_lo": sp["ci_lo"], "ci95_hi": sp["ci_hi"]}
                for s in STATISTICS:
                    rows[s][c] = got[s]
            prof = self.observations[self.observations["profiled"] & (self.observations["case"] == case)
                                     & (self.observations["stage"] == stage) & (self.observations["call"] == call)]
            if len(prof):
                span = _span_column(g)
                for s in ("mean", "median"):
                    rows[s].update({c: _f(prof[c].iloc[0]) for c in PROFILED_FIELDS})
                    rows[s]["idle_ms"] = idle_of(rows[s].get(span), rows[s]["busy_ms"])[0]
            out += rows.values()
        df = pd.DataFrame(out, columns=SUMMARY_COLUMNS)
        return df.astype({c: "float64" for c in NUMERIC}).astype({"call": "int64", "calls": "int64", "batch": "int64",
                                                                   "repeats": "int64"})


def summarize(observations: Optional[pd.DataFrame], warmups: Optional[dict] = None) -> Summary:
    """The ``Summary`` of a table of observations (typed or of the old layout: converted)."""
    return Summary(observations, warmups)


__all__ = ["Summary", "summarize", "idle_of", "HEADLINE_METRICS", "HEADLINE_COLUMNS", "MEASURED_COLUMNS",
           "REQUEST_FIELDS", "PROFILED_FIELDS", "STATISTICS", "SUMMARY_COLUMNS"]
