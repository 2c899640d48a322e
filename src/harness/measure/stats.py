"""The statistics every reported number uses: one rule for "median", its spread, and which
timed repeat is the median request.

* ``median_low``: the median as an observed value. With an odd count it is the middle value;
  with an even count the **lower** of the two middle values (``statistics.median_low``), so a
  median is always a time some repeat really took, and the median request's end-to-end time
  equals the median end-to-end time.
* ``bootstrap_ci``: a 95% interval of ``median_low`` from 2,000 resamples with a fixed seed
  (deterministic: the same values give the same interval). With the usual 5 repeats it spans
  roughly the 2nd to the 4th smallest value; the min-max range is shown beside it.
* ``median_request``: the timed repeat whose end-to-end time is ``median_low`` of all repeats'
  end-to-end times (ties: the earliest repeat). The headline shows that one request, so its stage
  times add up to its TTFT and end-to-end time.
* ``spread``: median, min, max, bootstrap interval, CV and count of one list of values.

Pure functions on lists and DataFrames; units are whatever the values carry (ms here).
"""
from __future__ import annotations

import statistics
from typing import Optional, Sequence

import numpy as np
import pandas as pd

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
CI_LEVEL = 0.95


def _clean(values) -> np.ndarray:
    arr = pd.to_numeric(pd.Series(list(values), dtype=object), errors="coerce").to_numpy(dtype=float)
    return arr[np.isfinite(arr)]


def median_low(values) -> Optional[float]:
    """The median as an observed value (even count: the lower middle); None for no values."""
    v = _clean(values)
    return float(statistics.median_low(v.tolist())) if len(v) else None


def bootstrap_ci(values, level: float = CI_LEVEL, resamples: int = BOOTSTRAP_RESAMPLES,
                 seed: int = BOOTSTRAP_SEED) -> tuple:
    """(lo, hi): percentile bootstrap interval of ``median_low``; (None, None) for < 2 values.
    Seeded, so the interval is the same on every call with the same values."""
    v = _clean(values)
    n = len(v)
    if n < 2:
        return None, None
    rng = np.random.default_rng(seed)
    draws = np.sort(v[rng.integers(0, n, size=(resamples, n))], axis=1)[:, (n - 1) // 2]
    tail = (1 - level) / 2 * 100
    return (float(np.percentile(draws, tail, method="lower")),
            float(np.percentile(draws, 100 - tail, method="higher")))


def spread(values) -> dict:
    """{'median', 'min', 'max', 'ci_lo', 'ci_hi', 'cv', 'n'} of the finite values (None where
    undefined). cv = sample std / mean (ddof 1; 0 for one value)."""
    v = _clean(values)
    if not len(v):
        return {"median": None, "min": None, "max": None, "ci_lo": None, "ci_hi": None, "cv": None, "n": 0}
    lo, hi = bootstrap_ci(v)
    mean = float(v.mean())
    std = float(v.std(ddof=1)) if len(v) > 1 else 0.0
    return {"median": median_low(v), "min": float(v.min()), "max": float(v.max()), "ci_lo": lo, "ci_hi": hi,
            "cv": std / mean if mean else None, "n": int(len(v))}


def timed(stages: pd.DataFrame) -> pd.DataFrame:
    """The rows of timed repeats (numeric ``repeat``), not warm-ups, profiled or aggregate rows."""
    if stages is None or not len(stages) or "repeat" not in stages:
        return stages.iloc[:0] if stages is not None else pd.DataFrame()
    return stages[pd.to_numeric(stages["repeat"].astype(str), errors="coerce").notna()]


def median_request(requests: pd.DataFrame, column: str = "e2e_ms") -> Optional[str]:
    """``repeat`` label (text) of the median request among one case's timed ``request`` rows:
    the repeat whose ``column`` equals ``median_low`` of them (ties: the earliest repeat)."""
    r = requests.assign(_v=pd.to_numeric(requests[column], errors="coerce"),
                        _i=pd.to_numeric(requests["repeat"].astype(str), errors="coerce"))
    r = r[np.isfinite(r["_v"]) & r["_i"].notna()]
    if not len(r):
        return None
    target = median_low(r["_v"])
    hit = r[r["_v"] == target].sort_values("_i")
    return str(hit["repeat"].iloc[0])


def percentiles(values: Sequence[float], qs=(50, 90, 99)) -> dict:
    """{q: percentile} (linear interpolation, numpy's default) of a per-step distribution."""
    v = _clean(values)
    return {q: (float(np.percentile(v, q)) if len(v) else None) for q in qs}


__all__ = ["median_low", "bootstrap_ci", "spread", "timed", "median_request", "percentiles", "BOOTSTRAP_RESAMPLES",
           "BOOTSTRAP_SEED", "CI_LEVEL"]
