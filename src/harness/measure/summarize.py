"""Turn one request's ranges (and kernels) into stage rows; aggregate repeats.

Units: ms for times, bytes for memory, tokens/s for throughput. ``gpu_ms`` comes from CUDA
events on the stream; ``host_ms`` from the host clock; ``busy_ms`` is the union of the stage's
kernel intervals; ``idle_ms`` = ``gpu_ms`` - ``busy_ms`` (launch/host-bound signal).
A ``preprocess`` range (the vendor's ``infer()`` preprocessing) gets a row of its own; it is in the
request but not in ``stage_sum_ms`` (the five stages). ``step_rows`` keeps every decode step
(``STEP_COLUMNS``: TPOT against the KV length).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..stages import DECODE_STEP, RECORDED_STAGES, STAGES

STAGE_COLUMNS = [
    "case", "mode", "grid", "batch", "repeat", "stage", "call", "calls", "timer",
    "gpu_ms", "host_ms", "kernels", "busy_ms", "idle_ms", "launches_per_step", "peak_mem_bytes",
    "ttft_ms", "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms", "decode_tok_s", "e2e_ms",
    "stage_sum_ms", "unattributed_kernel_ms", "attributed_fraction", "weight_bytes", "kv_cache_bytes", "note",
    "host_syncs", "syncs_per_step",
]
NUMERIC = [c for c in STAGE_COLUMNS if c.endswith(("_ms", "_bytes", "_s", "kernels", "_step", "_fraction"))]
#: steps.csv: one row per decode step of a timed repeat; kv_len = positions its attention reads
STEP_COLUMNS = ["case", "repeat", "step", "kv_len", "gpu_ms", "host_ms"]


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
    """Rows for one request: one per stage (all calls), one per call where a stage ran more than
    once, and one ``request`` row with TTFT/TPOT/throughput and reconciliation columns."""
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
        groups = [("all", r)] + ([(c, r[r["call"] == c]) for c in calls] if len(calls) > 1 else [])
        for call, rr in groups:
            row = {"stage": st, "call": call, "calls": max(len(calls), 1), "timer": timer,
                   "gpu_ms": rr["gpu_ms"].sum() if tcol == "gpu_ms" else None,
                   "host_ms": rr["host_ms"].sum(),
                   "peak_mem_bytes": rr["peak_mem_bytes"].max() if rr["peak_mem_bytes"].notna().any() else None}
            if have_k:
                k = kernels[kernels["stage"] == st]
                if call != "all":
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
        dec = ranges[ranges["range"] == "decode"][tcol]
        stage_sum = float(ranges[ranges["range"].isin(STAGES)][tcol].sum())
        row = {"stage": "request", "call": "all", "calls": 1, "timer": timer,
               "gpu_ms": t_req if tcol == "gpu_ms" else None, "host_ms": float(req["host_ms"].iloc[0]),
               "e2e_ms": t_req, "ttft_ms": ttft, "stage_sum_ms": stage_sum,
               "peak_mem_bytes": ranges["peak_mem_bytes"].max() if ranges["peak_mem_bytes"].notna().any() else None}
        if len(steps):
            row.update(tpot_p50_ms=float(np.percentile(steps, 50)), tpot_p90_ms=float(np.percentile(steps, 90)),
                       tpot_p99_ms=float(np.percentile(steps, 99)))
            row["decode_tok_s"] = batch * len(steps) / (float(dec.iloc[0]) / 1e3) if len(dec) else None
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


def aggregate(df: pd.DataFrame, repeats_label: str = "repeat") -> pd.DataFrame:
    """mean, std, median and cv (std/mean) over timed repeats for each case x stage x call."""
    timed = df[pd.to_numeric(df["repeat"], errors="coerce").notna()]
    if not len(timed):
        return pd.DataFrame(columns=df.columns)
    keys = ["case", "stage", "call"]
    out = []
    for key, g in timed.groupby(keys, sort=False, dropna=False):
        base = g.iloc[0].to_dict()
        for stat in ("mean", "std", "median", "cv"):
            row = dict(base)
            row["repeat"] = stat
            for c in NUMERIC:
                if c not in g:
                    continue
                vals = pd.to_numeric(g[c], errors="coerce").dropna()
                if not len(vals):
                    row[c] = None
                    continue
                mean = vals.mean()
                std = vals.std(ddof=1) if len(vals) > 1 else 0.0
                row[c] = {"mean": mean, "std": std, "median": vals.median(),
                          "cv": (std / mean if mean else None)}[stat]
            out.append(row)
    return pd.DataFrame(out, columns=df.columns)
