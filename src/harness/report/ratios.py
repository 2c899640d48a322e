"""Honest ratios of the execution ladder: every ratio carries its interval and says what it divides.

Per row of the ladder (``ladder.execution_rows``), from the run's summary (``harness.measure.summary``):

* batch-1 rows against the **base**, the vendor-style batch-1 row of the same mode and routing
  (``workload.routing``; a row of another routing is never divided by it):
  ``speedup`` = median decode tok/s of this row's timed repeats / the base's, with the seeded
  bootstrap 95% interval resampling both rows' repeats (``stats.ratio_ci``); split into
  ``busy_ratio`` = the base's kernel busy time per decode step / this row's (faster GPU work; one
  profiled request each, no interval) and ``span_ratio`` = speed-up / busy ratio (the rest: launch
  and host gaps removed from the span). ``unstable`` when the base's decode CV exceeds
  ``UNSTABLE_CV``: a ratio over a host-bound row moves with the host.
* batched rows against the **best batch-1 row** of the same mode and routing (highest median-request tok/s),
  never as a speed-up over vendor-style batch 1: ``tput_ratio`` = decode tok/s / its tok/s
  (throughput gained by batching) and ``tpot_ratio`` = TPOT p50 / its TPOT p50 (time per token each
  request waits), both with intervals.

Kernel busy per decode step = the profiled request's decode busy ms / its decode steps (kernels /
launches per step).
"""
from __future__ import annotations

from typing import Optional

import pandas as pd

from ..floats import finite as _f
from ..measure import stats
from ..measure.summary import Summary

UNSTABLE_CV = 0.05
RATIO_COLUMNS = ["base", "best_b1", "speedup", "speedup_lo", "speedup_hi", "busy_ratio", "span_ratio", "unstable",
                 "tput_ratio", "tput_lo", "tput_hi", "tpot_ratio", "tpot_lo", "tpot_hi"]


def busy_per_step_ms(summary: Summary, case: str) -> Optional[float]:
    """Kernel busy ms per decode step of ``case``'s profiled request (None without kernel capture)."""
    busy, kernels, per_step = (summary.profiled_value(case, "decode", c)
                               for c in ("busy_ms", "kernels", "launches_per_step"))
    if busy is None or not kernels or not per_step:
        return None
    return busy / (kernels / per_step)


def _ratio(summary: Summary, case: str, other: str, column: str) -> tuple:
    return stats.ratio_ci(summary.values(case, "request", column), summary.values(other, "request", column))


def ladder_ratios(rows: pd.DataFrame, summary: Summary) -> pd.DataFrame:
    """``RATIO_COLUMNS`` for each row of ``rows`` (case, execution, batch, mode, tok_s, decode_cv and
    routing: 'weights' where absent), in the same order (module docstring); None where a ratio has no
    base row in the run."""
    rows = rows.assign(routing=rows["routing"].fillna("weights") if "routing" in rows else "weights")
    key = ["mode", "routing"]
    b1 = rows[rows["batch"] == 1]
    base = {m: g["case"].iloc[0] for m, g in b1[b1["execution"] == "vendor-style"].groupby(key, sort=False)}
    best = {m: g.loc[g["tok_s"].idxmax(), "case"] for m, g in b1[b1["tok_s"].notna()].groupby(key, sort=False)}
    cv = dict(zip(rows["case"], rows["decode_cv"]))
    out = []
    for r in rows.to_dict("records"):
        got = {c: None for c in RATIO_COLUMNS}
        at = (r["mode"], r["routing"])
        if r["batch"] == 1 and at in base:
            ref = got["base"] = base[at]
            got["speedup"], got["speedup_lo"], got["speedup_hi"] = _ratio(summary, r["case"], ref, "decode_tok_s")
            mine, theirs = busy_per_step_ms(summary, r["case"]), busy_per_step_ms(summary, ref)
            if mine and theirs:
                got["busy_ratio"] = theirs / mine
                got["span_ratio"] = got["speedup"] / got["busy_ratio"] if got["speedup"] is not None else None
            got["unstable"] = (_f(cv.get(ref)) or 0.0) > UNSTABLE_CV
        elif r["batch"] != 1 and at in best:
            ref = got["best_b1"] = best[at]
            got["tput_ratio"], got["tput_lo"], got["tput_hi"] = _ratio(summary, r["case"], ref, "decode_tok_s")
            got["tpot_ratio"], got["tpot_lo"], got["tpot_hi"] = _ratio(summary, r["case"], ref, "tpot_p50_ms")
        out.append(got)
    df = pd.DataFrame(out, columns=RATIO_COLUMNS, index=rows.index)
    return df.astype({c: "float64" for c in RATIO_COLUMNS if c not in ("base", "best_b1", "unstable")}
                     | {"unstable": bool})


__all__ = ["UNSTABLE_CV", "RATIO_COLUMNS", "busy_per_step_ms", "ladder_ratios"]
