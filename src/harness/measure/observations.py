"""The table of observations: one typed row per case x request x stage (x call), raw values only.

``stages.csv`` holds these rows and nothing else (``OBSERVATION_COLUMNS``, types in ``DTYPES``):

* ``repeat`` (int): the request's index: 0 .. repeats-1 for the timed repeats, ``repeats`` for
  the one profiled request; ``profiled`` (bool): True for the profiled request (kernel capture,
  module hooks, sync counting: its own spans are stretched by the profiler);
* ``call`` (int): which call of a stage that ran more than once (Gundam: 0 = tiles, 1 = global
  view); ``CALL_ALL`` (-1) for the row over all calls; ``calls``: how many calls the stage made.

Units: ms for times, bytes for memory, tokens/s for throughput. ``gpu_ms`` comes from CUDA
events on the stream (the stage's GPU span); ``host_ms`` from the host clock (its host span);
``busy_ms`` is the union of the stage's kernel intervals, ``idle_ms`` = span - ``busy_ms``
(profiled request only: the summary pairs busy time with the timed spans,
``harness.measure.summary``).

Request row (``stage = request``): ``ttft_ms`` from the request's start to the end of prefill
(the first token); ``prep_ms`` (building the request on the host: pages, preprocessing, token
layout) and ``h2d_ms`` (copying it to the device) when the caller timed them, ``raster_ms``
(rasterising its PDF pages before that; empty for other pages), and ``ttft_e2e_ms`` = raster +
prep + h2d + TTFT; ``call_ms`` (the wall time of the whole ``generate()`` call,
host clock, the device synchronised before and after: what the caller waits for) and
``setup_collect_ms`` = ``call_ms`` - ``e2e_ms`` (the call's set-up before the request range opens
and its collection after it closes: caches, routing counts, the tokens) in the timed repeats.
``decode_steps`` (request and decode rows): the decode steps the request ran (a profiled request
may run fewer, ``measure.profile_steps``). Decode: ``tpot_p50/p90/p99_ms`` and ``tpot_mean_ms`` of the
per-step times (``decode_step`` ranges), and ``decode_tok_s`` = batch x 1000 / ``tpot_mean_ms``:
the same per-step distribution. A ``preprocess`` range (the vendor's ``infer()`` preprocessing)
gets a row of its own; it is in the request but not in ``stage_sum_ms`` (the five stages).
``step_rows`` keeps every decode step (``STEP_COLUMNS``: TPOT against the KV length).

Run directories written before this table was typed also held aggregate rows (``repeat`` =
mean, median, ...) and text labels (``repeat = profiled``, ``call = all``); ``typed`` converts
such a table on read (``LEGACY_AGGREGATES`` rows dropped, the labels mapped): the one place that
knows the old layout.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ..anatomy.stages import DECODE_STEP, RECORDED_STAGES, STAGES
from . import stats

#: ``call`` of the row over every call of a stage
CALL_ALL = -1
OBSERVATION_COLUMNS = [
    "case", "mode", "grid", "batch", "repeat", "profiled", "stage", "call", "calls", "timer",
    "gpu_ms", "host_ms", "kernels", "busy_ms", "idle_ms", "launches_per_step", "decode_steps", "peak_mem_bytes",
    "ttft_ms", "raster_ms", "prep_ms", "h2d_ms", "ttft_e2e_ms", "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms",
    "tpot_mean_ms", "decode_tok_s", "e2e_ms", "call_ms", "setup_collect_ms",
    "stage_sum_ms", "unattributed_kernel_ms", "attributed_fraction", "weight_bytes", "kv_cache_bytes", "note",
    "host_syncs", "syncs_per_step",
]
TEXT = ("case", "mode", "grid", "stage", "timer", "note")
INTEGER = ("batch", "repeat", "call", "calls")
#: the measured values (float; NaN where a request did not measure it)
NUMERIC = [c for c in OBSERVATION_COLUMNS if c not in TEXT + INTEGER + ("profiled",)]
DTYPES = {**{c: object for c in TEXT}, **{c: "int64" for c in INTEGER}, "profiled": bool,
          **{c: "float64" for c in NUMERIC}}
#: steps.csv: one row per decode step of a timed repeat; kv_len = positions its attention reads
STEP_COLUMNS = ["case", "repeat", "step", "kv_len", "gpu_ms", "host_ms"]
#: columns every stages.csv has (new or old layout), and one of TIME_COLUMNS
REQUIRED_COLUMNS = ("case", "stage", "repeat", "call")
TIME_COLUMNS = ("gpu_ms", "host_ms")
#: ``repeat`` labels of the aggregate rows older run directories kept in stages.csv
LEGACY_AGGREGATES = ("mean", "std", "median", "cv", "min", "max", "ci95_lo", "ci95_hi")


def busy_ms(kern: pd.DataFrame | None) -> float:
    """Length of the union of [start, start + dur) intervals, ms (vectorised)."""
    if kern is None or not len(kern):
        return 0.0
    s = kern["start_ms"].to_numpy(dtype=float)
    e = s + kern["dur_ms"].to_numpy(dtype=float)
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    reach = np.maximum.accumulate(e)
    new = np.empty(len(s), dtype=bool)
    new[0] = True
    new[1:] = s[1:] > reach[:-1]
    idx = np.flatnonzero(new)
    return float((np.maximum.reduceat(e, idx) - s[idx]).sum())   # segment = chain of overlapping intervals


def _time_col(ranges: pd.DataFrame) -> str:
    return "gpu_ms" if ranges["gpu_ms"].notna().any() else "host_ms"


def stage_rows(ranges: pd.DataFrame, kernels: pd.DataFrame | None, batch: int) -> list[dict]:
    """Rows for one request: one per stage (all calls, ``call = CALL_ALL``), one per call where a
    stage ran more than once, and one ``request`` row with TTFT/TPOT/throughput and
    reconciliation columns."""
    tcol = _time_col(ranges)
    timer = "cuda_event" if tcol == "gpu_ms" else "host"
    rows = []
    have_k = kernels is not None and len(kernels) > 0
    n_steps = int((ranges["range"] == "decode_step").sum())
    for st in RECORDED_STAGES:
        r = ranges[ranges["range"] == st]
        if not len(r):
            continue
        calls = sorted({int(c) for c in r["call"].dropna()})
        groups = [(CALL_ALL, r)] + ([(c, r[r["call"] == c]) for c in calls] if len(calls) > 1 else [])
        for call, rr in groups:
            row = {"stage": st, "call": call, "calls": max(len(calls), 1), "timer": timer,
                   "gpu_ms": rr["gpu_ms"].sum() if tcol == "gpu_ms" else None,
                   "host_ms": rr["host_ms"].sum(),
                   "peak_mem_bytes": rr["peak_mem_bytes"].max() if rr["peak_mem_bytes"].notna().any() else None}
            if st == "decode":
                row["decode_steps"] = n_steps
            if have_k:
                k = kernels[kernels["stage"] == st]
                if call != CALL_ALL:
                    k = k[k["call"] == call]
                row["kernels"] = len(k)
                row["busy_ms"] = busy_ms(k)
                span = row["gpu_ms"] if row["gpu_ms"] is not None else row["host_ms"]
                row["idle_ms"] = span - row["busy_ms"]
                if st == "decode" and n_steps:
                    row["launches_per_step"] = len(k) / n_steps
            rows.append(row)
    req = ranges[ranges["range"] == "request"]
    if len(req):
        t_req = float(req[tcol].iloc[0])
        pre = ranges[ranges["range"] == "prefill"]
        start_col = "gpu_start_ms" if tcol == "gpu_ms" else "host_start_ms"
        # the first token exists when the last prefill range ends (the vendor opens two)
        ttft = float((pre[start_col] + pre[tcol]).max() - req[start_col].iloc[0]) if len(pre) else None
        steps = ranges[ranges["range"] == "decode_step"][tcol].to_numpy(dtype=float)
        stage_sum = float(ranges[ranges["range"].isin(STAGES)][tcol].sum())
        row = {"stage": "request", "call": CALL_ALL, "calls": 1, "timer": timer,
               "gpu_ms": t_req if tcol == "gpu_ms" else None, "host_ms": float(req["host_ms"].iloc[0]),
               "e2e_ms": t_req, "ttft_ms": ttft, "stage_sum_ms": stage_sum, "decode_steps": n_steps,
               "peak_mem_bytes": ranges["peak_mem_bytes"].max() if ranges["peak_mem_bytes"].notna().any() else None}
        if len(steps):
            pct = stats.percentiles(steps)
            row.update(tpot_p50_ms=pct[50], tpot_p90_ms=pct[90], tpot_p99_ms=pct[99], tpot_mean_ms=float(steps.mean()))
            row["decode_tok_s"] = batch * 1e3 / row["tpot_mean_ms"] if row["tpot_mean_ms"] > 0 else None
        if have_k:
            un = kernels[kernels["stage"].isna()]
            total = kernels["dur_ms"].sum()
            row["kernels"] = len(kernels)
            row["busy_ms"] = busy_ms(kernels)
            row["idle_ms"] = t_req - row["busy_ms"]
            row["unattributed_kernel_ms"] = float(un["dur_ms"].sum())
            row["attributed_fraction"] = float(1 - un["dur_ms"].sum() / total) if total else None
        rows.append(row)
    return rows


def step_rows(ranges: pd.DataFrame, prefill_tokens: int) -> list[dict]:
    """One row per ``decode_step`` range of a request: ``step``, ``kv_len`` = ``prefill_tokens`` +
    step + 1 (the positions the step's attention reads: the prompt, the first token and one per
    earlier step), ``gpu_ms`` (CUDA events, None without) and ``host_ms``."""
    steps = ranges[ranges["range"] == DECODE_STEP]
    return [{"step": int(r.step), "kv_len": int(prefill_tokens) + int(r.step) + 1,
             "gpu_ms": None if pd.isna(r.gpu_ms) else float(r.gpu_ms), "host_ms": float(r.host_ms)}
            for r in steps.itertuples(index=False)]


# ----------------------------------------------------------------------------- the typed table

class NotObservations(ValueError):
    """A table that lacks columns every stages.csv has (``missing``: their names, the time
    columns as one entry 'gpu_ms or host_ms')."""

    def __init__(self, missing: list):
        self.missing = list(missing)
        super().__init__(f"lacks the column(s) {', '.join(self.missing)} a run writes")


def missing_columns(columns) -> list:
    """``REQUIRED_COLUMNS`` (and 'gpu_ms or host_ms') that ``columns`` lacks."""
    cols = set(columns)
    return [c for c in REQUIRED_COLUMNS if c not in cols] + ([] if cols & set(TIME_COLUMNS)
                                                               else [" or ".join(TIME_COLUMNS)])


def frame(rows: list[dict]) -> pd.DataFrame:
    """Observation rows (dicts with any subset of the columns) as the typed table."""
    return typed(pd.DataFrame(rows, columns=OBSERVATION_COLUMNS))


def _legacy(df: pd.DataFrame) -> pd.DataFrame:
    """A stages.csv of the old layout (no ``profiled`` column) as observations: aggregate rows
    dropped, ``repeat = profiled`` -> ``profiled`` True with the next repeat index of its case,
    ``call`` all / empty -> ``CALL_ALL``."""
    rep = df["repeat"].map(lambda v: str(v).strip())
    df = df[~rep.isin(LEGACY_AGGREGATES)].copy()
    rep = rep[df.index]
    prof = rep == "profiled"
    index = rep.map(lambda v: -1 if v == "profiled" else int(float(v)))
    n_timed = index.groupby(df["case"]).max() + 1           # the profiled request follows the timed ones
    df["profiled"] = prof
    df["repeat"] = index.where(~prof, df["case"].map(n_timed)).astype("int64")
    df["call"] = df["call"].map(lambda v: CALL_ALL if str(v).strip() in ("all", "nan", "None", "") else int(float(v)))
    return df


def typed(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` as the typed observation table (``OBSERVATION_COLUMNS`` in order, ``DTYPES``); a
    table of the old layout is converted first (module docstring); columns a request did not
    measure are empty. A table without ``REQUIRED_COLUMNS`` raises ``NotObservations``."""
    if df is None or not len(df.columns):
        return pd.DataFrame({c: pd.Series(dtype=t) for c, t in DTYPES.items()})[OBSERVATION_COLUMNS]
    missing = missing_columns(df.columns)
    if missing:
        raise NotObservations(missing)
    if "profiled" not in df.columns and "repeat" in df.columns:
        df = _legacy(df)
    out = df.reindex(columns=OBSERVATION_COLUMNS).reset_index(drop=True)
    for c in INTEGER:
        out[c] = out[c].fillna(CALL_ALL if c == "call" else 0).astype("int64")
    out["profiled"] = out["profiled"].map(lambda v: str(v).strip().lower() in ("true", "1")).astype(bool)
    for c in NUMERIC:
        out[c] = out[c].astype("float64")
    for c in TEXT:
        out[c] = out[c].astype(object).where(out[c].notna(), None)
    return out


def read_observations(path) -> pd.DataFrame:
    """``stages.csv`` of a run directory as the typed table (an empty one for a missing or empty
    file; the old layout converted)."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        return typed(None)
    return typed(pd.read_csv(path, dtype={c: str for c in TEXT + ("repeat", "call", "profiled")}))


__all__ = ["CALL_ALL", "OBSERVATION_COLUMNS", "NUMERIC", "DTYPES", "STEP_COLUMNS", "REQUIRED_COLUMNS", "TIME_COLUMNS",
           "LEGACY_AGGREGATES", "NotObservations", "missing_columns", "busy_ms", "stage_rows", "step_rows", "frame",
           "typed", "read_observations"]
