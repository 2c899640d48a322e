"""The rows of the observation table (``harness.schema.stages``: stages.csv, its columns, units,
types, reader and the old layout) and of steps.csv (``harness.schema.steps``), from one request's
recorded ranges and kernels.

``stage_rows``: one row per stage (and per call where a stage runs more than once) and one
``request`` row. ``gpu_ms`` comes from CUDA events on the stream (the stage's GPU span);
``host_ms`` from the host clock (its host span); ``busy_ms`` is the union of the stage's kernel
intervals, ``idle_ms`` = span - ``busy_ms`` (profiled request only: the summary pairs busy time
with the timed spans, ``harness.measure.summary``).

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
``step_rows`` keeps every decode step (TPOT against the KV length).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..anatomy.stages import DECODE_STEP, RECORDED_STAGES, STAGES
from ..schema.stages import CALL_ALL
from . import stats


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


__all__ = ["busy_ms", "stage_rows", "step_rows"]
