"""The one summarizer of a run's observations (``harness.schema.stages``).

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
* **busy per decode step** (``step_scale``): the profiled request may decode fewer steps than the
  timed ones (``measure.profile_steps`` = N: only its first N steps are captured). Its decode
  busy time and kernels pair with the timed spans per step: decode busy = profiled decode busy /
  N x the timed requests' steps (T, the median over the timed repeats: a fixed budget gives each
  the same), i.e. scaled by T / N; the request's busy = its busy outside decode + the scaled
  decode busy (kernels alike). Host syncs, per-step figures (kernels and syncs per step) and the
  other stages are not scaled. Runs without step counts (older ``stages.csv``) and equal counts
  get the factor 1. The first N steps attend over the shortest KV cache, so where attention
  grows with the position (``steps.csv``) the scaled busy time is a slight underestimate.
* **what a user waits for** (``headline``): ``call_ms`` (the whole ``generate()`` call,
  synchronised before and after) and ``setup_collect_ms`` = call - e2e of the median request;
  preprocessing and copy per page (``prep_page_ms`` = prep / batch, ``h2d_page_ms`` = h2d /
  batch) and, for PDF pages, rasterisation per page (``raster_page_ms`` = raster / batch: every
  row is rasterised); pages/s over the timed repeats back to back, serial: ``pages_s_gpu`` = batch
  x repeats x 1000 / sum of their ``call_ms`` (requests already built and on the device) and
  ``pages_s_e2e`` = batch x repeats x 1000 / sum of (raster + prep + h2d + call) (each rasterised,
  built, copied and generated in turn); each request is synchronised at both ends, so the sum is
  the wall time of those requests run back to back without overlap, the harness's own work
  between them (reading CUDA events, writing rows) left out. ``bound_by`` (``bound_by``):
  ``preprocessing`` (raster + prep, the host's part) or ``copy`` when that part of the median
  request took longer than its request range on the device (``e2e_ms``, the GPU time of the
  batch), else ``gpu``.

Outputs (DataFrames, built on first use):

* ``stages`` (``MEASURED_COLUMNS``): one row per case x stage (the five stages, ``preprocess``
  where recorded, and ``request``): the median span of the timed repeats (``time_ms``: GPU span
  from CUDA events, or the host span on a CPU run, ``timer`` says which; ``gpu_ms`` and
  ``host_ms`` both kept) with its min / max / bootstrap interval / CV, the profiled request's
  kernels, busy time, host syncs and attribution, idle from both (``idle_basis`` says so). The
  ``request`` row carries the median request's TTFT / TPOT / tok/s (``REQUEST_FIELDS``).
* ``headline`` (``HEADLINE_COLUMNS``, written as ``headline.csv``: ``harness.schema.headline``): one
  row per case, every value from the median request,
  ``<column>_min`` / ``_max`` over the timed repeats, the bootstrap interval of its end-to-end
  time, ``pages_s`` = batch x 1000 / e2e ms (the request range alone), ``stage_sum_ms``,
  ``ttft_stage_sum_ms`` and what a user waits for (above).
* ``aggregates`` (``SUMMARY_COLUMNS``, written as ``stages_summary.csv``: ``harness.schema.headline``):
  per case x stage x
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
from ..schema.headline import HEADLINE_COLUMNS, HEADLINE_METRICS, STATISTICS, SUMMARY_COLUMNS
from ..schema.stages import CALL_ALL, NUMERIC, typed

#: ``bound_by`` labels: the part of a batch that takes longest (``bound_by``)
BOUND_BY = ("preprocessing", "copy", "gpu")
#: columns the profiled request gives a stage (kernel capture, sync counting)
PROFILED_FIELDS = ("kernels", "busy_ms", "launches_per_step", "unattributed_kernel_ms", "attributed_fraction",
                   "host_syncs", "syncs_per_step")
MEASURED_COLUMNS = [
    "case", "mode", "grid", "batch", "stage", "timer", "time_ms", "gpu_ms", "host_ms", "time_min_ms", "time_max_ms",
    "time_ci_lo_ms", "time_ci_hi_ms", "host_min_ms", "host_max_ms", "kernels", "busy_ms", "idle_ms", "idle_fraction",
    "idle_basis", "launches_per_step", "ttft_ms", "raster_ms", "prep_ms", "h2d_ms", "ttft_e2e_ms", "tpot_p50_ms",
    "tpot_p90_ms", "tpot_p99_ms", "tpot_mean_ms", "decode_tok_s", "e2e_ms", "call_ms", "setup_collect_ms",
    "peak_mem_bytes", "weight_bytes", "kv_cache_bytes", "cv", "repeats", "statistic", "median_repeat", "host_syncs",
    "syncs_per_step", "unattributed_kernel_ms", "attributed_fraction", "step_scale"]
#: label columns of ``MEASURED_COLUMNS`` and ``HEADLINE_COLUMNS``; counts are integers, the rest floats
LABELS = ("case", "mode", "grid", "stage", "timer", "idle_basis", "statistic", "bound_by")
COUNTS = {"batch": "int64", "repeats": "int64", "repeat": "int64", "median_repeat": "Int64", "warmup": "Int64"}
REQUEST_FIELDS = ("ttft_ms", "raster_ms", "prep_ms", "h2d_ms", "ttft_e2e_ms", "tpot_p50_ms", "tpot_p90_ms",
                  "tpot_p99_ms", "tpot_mean_ms", "decode_tok_s", "e2e_ms", "call_ms", "setup_collect_ms",
                  "peak_mem_bytes", "weight_bytes", "kv_cache_bytes")
#: profiled fields that count the whole decode (scaled by ``step_scale``); per-step figures are not
STEP_SCALED = ("busy_ms", "kernels")


def idle_of(span_ms, busy_ms) -> tuple:
    """(idle_ms, idle_fraction) = (max(span - busy, 0), idle / span): a timed span paired with the
    profiled request's busy time; (None, None) without both."""
    span, b = _f(span_ms), _f(busy_ms)
    if span is None or b is None:
        return None, None
    idle = max(span - b, 0.0)
    return idle, (idle / span if span else None)


def bound_by(prep_ms, h2d_ms, gpu_ms) -> Optional[str]:
    """Which part of a batch bounds it: ``preprocessing`` (building the request on the host: with
    PDF pages, the caller adds their rasterisation) or ``copy`` (to the device) when it took longer
    than ``gpu_ms`` (the request range on the device: the GPU time of the batch) and than the other
    one, else ``gpu``; None without all three. A pipeline that overlaps the parts cannot run faster
    than its longest one."""
    prep, h2d, gpu = _f(prep_ms), _f(h2d_ms), _f(gpu_ms)
    if prep is None or h2d is None or gpu is None:
        return None
    if prep > gpu and prep >= h2d:
        return "preprocessing"
    if h2d > gpu and h2d > prep:
        return "copy"
    return "gpu"


def host_prep_ms(row: dict) -> Optional[float]:
    """The host's part of a request row (a headline row): prep ms + raster ms (PDF pages; 0 for
    other pages); None without prep ms."""
    prep = _f(row.get("prep_ms"))
    return None if prep is None else prep + (_f(row.get("raster_ms")) or 0.0)


def back_to_back_pages_s(batch: int, call_ms, prep_ms=None, h2d_ms=None, raster_ms=None) -> Optional[float]:
    """Pages/s of requests run back to back, serially: batch x n x 1000 / sum over the n requests
    of call ms (+ prep ms + h2d ms + raster ms when given); None when any of them is missing or the
    sum is 0."""
    parts = [np.asarray(call_ms, dtype=float)] + [np.asarray(p, dtype=float) for p in (prep_ms, h2d_ms, raster_ms)
                                                  if p is not None]
    if not len(parts[0]) or any(np.isnan(p).any() for p in parts):
        return None
    total = float(sum(p.sum() for p in parts))
    return batch * len(parts[0]) * 1e3 / total if total > 0 else None


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
        """``column`` of the profiled request's ``stage`` row as measured (None without one)."""
        p = self.profiled
        g = p[(p["case"] == case) & (p["stage"] == stage)]
        return _f(g[column].iloc[0]) if len(g) else None

    @cached_property
    def step_scales(self) -> dict:
        """{case: T / N}: the timed requests' decode steps T (median over the timed repeats) over
        the profiled request's N (module docstring); 1.0 where either is unknown."""
        out = {}
        dec = self.timed[self.timed["stage"] == "decode"]
        for case, g in dec.groupby("case", sort=False):
            timed, prof = stats.median_low(g["decode_steps"]), self.profiled_value(case, "decode", "decode_steps")
            out[case] = timed / prof if timed and prof else 1.0
        return out

    def step_scale(self, case: str) -> float:
        """The factor the profiled request's decode busy time and kernels are scaled by (module
        docstring: busy per decode step x the timed requests' steps)."""
        return self.step_scales.get(case, 1.0)

    def paired(self, case: str, stage: str, call: int = CALL_ALL) -> dict:
        """``PROFILED_FIELDS`` of the profiled request's ``stage`` x ``call`` row, paired with the
        timed requests per decode step (``step_scale``: decode busy and kernels scaled; the
        request's busy = its busy outside decode + the scaled decode busy); all None without a
        profiled row."""
        obs = self.observations
        mine = obs["profiled"] & (obs["case"] == case) & (obs["call"] == call)
        g = obs[mine & (obs["stage"] == stage)]
        out = {c: _f(g[c].iloc[0]) if len(g) else None for c in PROFILED_FIELDS}
        k = self.step_scale(case)
        if k == 1.0 or stage not in ("decode", "request"):
            return out
        dec = obs[mine & (obs["stage"] == "decode")] if stage == "request" else g
        for c in STEP_SCALED:
            d = _f(dec[c].iloc[0]) if len(dec) else None
            if out[c] is not None and d is not None:
                out[c] = out[c] + d * (k - 1.0)     # decode: d x k; request: the rest + d x k
        return out

    def _idle_basis(self, case: str, stage: str, n: int) -> str:
        """What the idle of a stage row pairs (module docstring)."""
        basis = f"median span of {n} timed repeats - kernel busy of the profiled request"
        k = self.step_scale(case)
        if k != 1.0 and stage in ("decode", "request"):
            steps = self.profiled_value(case, "decode", "decode_steps")
            basis += f" (its {steps:.0f} decode steps: busy per step x {k * steps:.0f} timed steps)"
        return basis

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
            out.update(self.paired(case, stage))
            out["idle_ms"], out["idle_fraction"] = idle_of(out["time_ms"], out["busy_ms"])
            out["idle_basis"] = "no kernel capture" if out["idle_ms"] is None else self._idle_basis(case, stage, len(g))
            out["step_scale"] = self.step_scale(case) if stage in ("decode", "request") else None
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
            wide["raster_page_ms"] = req["raster_ms"] / req["batch"]
            wide["prep_page_ms"] = req["prep_ms"] / req["batch"]
            wide["h2d_page_ms"] = req["h2d_ms"] / req["batch"]
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
            batch = int(r0["batch"])
            row["pages_s_gpu"] = back_to_back_pages_s(batch, req["call_ms"])
            raster = req["raster_ms"] if req["raster_ms"].notna().any() else None     # PDF pages only
            row["pages_s_e2e"] = back_to_back_pages_s(batch, req["call_ms"], req["prep_ms"], req["h2d_ms"], raster)
            row["bound_by"] = bound_by(host_prep_ms(row), row.get("h2d_ms"), row.get("e2e_ms"))
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
            prof = self.paired(case, stage, call)
            if any(v is not None for v in prof.values()):
                span = _span_column(g)
                for s in ("mean", "median"):
                    rows[s].update(prof)
                    rows[s]["idle_ms"] = idle_of(rows[s].get(span), rows[s]["busy_ms"])[0]
            out += rows.values()
        df = pd.DataFrame(out, columns=SUMMARY_COLUMNS)
        return df.astype({c: "float64" for c in NUMERIC}).astype({"call": "int64", "calls": "int64", "batch": "int64",
                                                                   "repeats": "int64"})


def summarize(observations: Optional[pd.DataFrame], warmups: Optional[dict] = None) -> Summary:
    """The ``Summary`` of a table of observations (typed or of the old layout: converted)."""
    return Summary(observations, warmups)


__all__ = ["Summary", "summarize", "idle_of", "bound_by", "host_prep_ms", "back_to_back_pages_s", "BOUND_BY",
           "MEASURED_COLUMNS", "REQUEST_FIELDS", "PROFILED_FIELDS", "STEP_SCALED"]
