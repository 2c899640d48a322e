"""Turn one request's ranges (and kernels) into stage rows; aggregate repeats.

Units: ms for times, bytes for memory, tokens/s for throughput. ``gpu_ms`` comes from CUDA
events on the stream (the stage's GPU span); ``host_ms`` from the host clock (its host span);
``busy_ms`` is the union of the stage's kernel intervals; ``idle_ms`` = span - ``busy_ms``
(launch/host-bound signal). In a profiled request both come from that request; in the
``mean``/``median`` aggregate rows the runner fills ``busy_ms`` from the profiled request and
``idle_ms`` = max(aggregate span - busy, 0) (see ``harness.measure.runner``).

Request row: ``ttft_ms`` from the request's start to the end of prefill (the first token);
``prep_ms`` (building the request on the host: pages, preprocessing, token layout) and ``h2d_ms``
(copying it to the device) when the caller timed them, and ``ttft_e2e_ms`` = prep + h2d + TTFT.
Decode: ``tpot_p50/p90/p99_ms`` and ``tpot_mean_ms`` of the per-step times (``decode_step``
ranges), and ``decode_tok_s`` = batch x 1000 / ``tpot_mean_ms``: the same per-step distribution.

Aggregate rows (``AGGREGATES``) over the timed repeats: mean, std (ddof 1), median (the
lower-middle observed value, ``harness.measure.stats.median_low``), cv (std / mean), min, max,
and the seeded bootstrap 95% interval of the median (ci95_lo, ci95_hi).
A ``preprocess`` range (the vendor's ``infer()`` preprocessing) gets a row of its own; it is in the
request but not in ``stage_sum_ms`` (the five stages). ``step_rows`` keeps every decode step
(``STEP_COLUMNS``: TPOT against the KV length).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..stages import DECODE_STEP, RECORDED_STAGES, STAGES
from ..floats import finite as _f
from . import stats

STAGE_COLUMNS = [
    "case", "mode", "grid", "batch", "repeat", "stage", "call", "calls", "timer",
    "gpu_ms", "host_ms", "kernels", "busy_ms", "idle_ms", "launches_per_step", "peak_mem_bytes",
    "ttft_ms", "prep_ms", "h2d_ms", "ttft_e2e_ms", "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms", "tpot_mean_ms",
    "decode_tok_s", "e2e_ms",
    "stage_sum_ms", "unattributed_kernel_ms", "attributed_fraction", "weight_bytes", "kv_cache_bytes", "note",
    "host_syncs", "syncs_per_step",
]
NUMERIC = [c for c in STAGE_COLUMNS if c.endswith(("_ms", "_bytes", "_s", "kernels", "_step", "_fraction"))]
#: steps.csv: one row per decode step of a timed repeat; kv_len = positions its attention reads
STEP_COLUMNS = ["case", "repeat", "step", "kv_len", "gpu_ms", "host_ms"]
AGGREGATES = ("mean", "std", "median", "cv", "min", "max", "ci95_lo", "ci95_hi")


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
        stage_sum = float(ranges[ranges["range"].isin(STAGES)][tcol].sum())
        row = {"stage": "request", "call": "all", "calls": 1, "timer": timer,
               "gpu_ms": t_req if tcol == "gpu_ms" else None, "host_ms": float(req["host_ms"].iloc[0]),
               "e2e_ms": t_req, "ttft_ms": ttft, "stage_sum_ms": stage_sum,
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


def aggregate(df: pd.DataFrame, repeats_label: str = "repeat") -> pd.DataFrame:
    """``AGGREGATES`` rows over the timed repeats of each case x stage x call."""
    timed = df[pd.to_numeric(df["repeat"], errors="coerce").notna()]
    if not len(timed):
        return pd.DataFrame(columns=df.columns)
    keys = ["case", "stage", "call"]
    out = []
    for key, g in timed.groupby(keys, sort=False, dropna=False):
        base = g.iloc[0].to_dict()
        rows = {stat: dict(base, repeat=stat) for stat in AGGREGATES}
        for c in NUMERIC:
            if c not in g:
                continue
            vals = pd.to_numeric(g[c], errors="coerce").dropna()
            if not len(vals):
                for stat in AGGREGATES:
                    rows[stat][c] = None
                continue
            sp = stats.spread(vals)
            mean = float(vals.mean())
            std = float(vals.std(ddof=1)) if len(vals) > 1 else 0.0
            got = {"mean": mean, "std": std, "median": sp["median"], "cv": sp["cv"], "min": sp["min"],
                   "max": sp["max"], "ci95_lo": sp["ci_lo"], "ci95_hi": sp["ci_hi"]}
            for stat in AGGREGATES:
                rows[stat][c] = got[stat]
        out += rows.values()
    return pd.DataFrame(out, columns=df.columns)


# ------------------------------------------------------------------------------- headline

#: request metrics of the headline (their min/max over the timed repeats come as ``<col>_min``/``_max``)
HEADLINE_METRICS = ["e2e_ms", "ttft_ms", "prep_ms", "h2d_ms", "ttft_e2e_ms", "tpot_p50_ms", "tpot_p90_ms",
                    "tpot_p99_ms", "tpot_mean_ms", "decode_tok_s", "pages_s"]
HEADLINE_COLUMNS = (["case", "mode", "grid", "batch", "timer", "repeat", "repeats", "warmup"] + HEADLINE_METRICS
                    + [f"{s}_ms" for s in STAGES] + ["stage_sum_ms", "ttft_stage_sum_ms", "e2e_ms_ci_lo", "e2e_ms_ci_hi"]
                    + [f"{c}_{x}" for c in HEADLINE_METRICS + [f"{s}_ms" for s in STAGES] for x in ("min", "max")])


def headline(stages: pd.DataFrame, warmups: dict | None = None) -> pd.DataFrame:
    """One row per case (``HEADLINE_COLUMNS``): the **median request** (``stats.median_request``:
    the timed repeat whose end-to-end time is the lower-middle one) with every time from that one
    request, so its stage times add up (``stage_sum_ms`` vs ``e2e_ms``, ``ttft_stage_sum_ms`` =
    sam + clip + projector + prefill vs ``ttft_ms``); ``pages_s`` = batch x 1000 / e2e_ms. Beside
    each value its min and max over the timed repeats, and the seeded bootstrap 95% interval of
    the median end-to-end time. ``repeats``: timed repeats; ``warmup``: untimed requests before
    them ({case: count}, from the manifest)."""
    rows = []
    if stages is None or not len(stages):
        return pd.DataFrame(columns=HEADLINE_COLUMNS)
    allc = stages[stages["call"].astype(str).isin(("all", "nan", "None"))]
    tm = stats.timed(allc).copy()
    tm["repeat"] = tm["repeat"].astype(str)
    for case, g in tm.groupby("case", sort=False):
        req = g[g["stage"] == "request"].copy()
        label = stats.median_request(req)
        if label is None:
            continue
        req["pages_s"] = pd.to_numeric(req["batch"], errors="coerce") * 1e3 / pd.to_numeric(req["e2e_ms"],
                                                                                            errors="coerce")
        span = "gpu_ms" if pd.to_numeric(g["gpu_ms"], errors="coerce").notna().any() else "host_ms"
        per_stage = g[g["stage"].isin(STAGES)].pivot_table(index="repeat", columns="stage", values=span,
                                                           aggfunc="first")
        per_stage.columns = [f"{c}_ms" for c in per_stage.columns]
        wide = req.set_index("repeat")[[c for c in HEADLINE_METRICS if c in req]].join(per_stage)
        pick = wide.loc[label]
        r0 = req.iloc[0]
        row = {"case": case, "mode": r0.get("mode"), "grid": r0.get("grid"), "batch": r0.get("batch"),
               "timer": "cuda_event" if span == "gpu_ms" else "host", "repeat": label, "repeats": len(req),
               "warmup": (warmups or {}).get(case)}
        for c in wide.columns:
            row[c] = _f(pick[c])
            col = pd.to_numeric(wide[c], errors="coerce").dropna()
            row[f"{c}_min"], row[f"{c}_max"] = (float(col.min()), float(col.max())) if len(col) else (None, None)
        stage_ms = [row.get(f"{s}_ms") for s in STAGES]
        row["stage_sum_ms"] = sum(v for v in stage_ms if v is not None)
        row["ttft_stage_sum_ms"] = sum(v for v in stage_ms[:4] if v is not None)
        row["e2e_ms_ci_lo"], row["e2e_ms_ci_hi"] = stats.bootstrap_ci(req["e2e_ms"])
        rows.append(row)
    return pd.DataFrame(rows, columns=HEADLINE_COLUMNS)

