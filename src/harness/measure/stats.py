"""The statistics every reported number uses: one rule for "median", its spread, and which
timed repeat is the median request.

* ``median_low``: the median as an observed value. With an odd count it is the middle value;
  with an even count the **lower** of the two middle values (``statistics.median_low``), so a
  median is always a time some repeat really took, and the median request's end-to-end time
  equals the median end-to-end time.
* ``bootstrap_ci``: a 95% interval of ``median_low`` from 2,000 resamples with a fixed seed
  (deterministic: the same values give the same interval). With 5 repeats it spans the min to the
  max (a resample's median is the smallest value when 3 of its 5 draws are: probability 5.8%, more
  than the 2.5% tail); with 7, the 2nd to the 6th smallest value.
* ``median_request``: the timed repeat whose end-to-end time is ``median_low`` of all repeats'
  end-to-end times (ties: the earliest repeat). The headline shows that one request, so its stage
  times add up to its TTFT and end-to-end time.
* ``spread``: median, min, max, bootstrap interval, CV and count of one list of values.
* ``ratio_ci``: the ratio of two rows' medians with its seeded bootstrap interval (each row's
  values resampled on their own): what a speed-up between two measured cases is.

Pure functions on lists and DataFrames (the typed observations of ``harness.schema.stages``);
units are whatever the values carry (ms here).
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
    """The finite values of a list, Series or array of numbers (None and NaN left out)."""
    arr = pd.Series(list(values), dtype="float64").to_numpy()
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


def median_request(requests: pd.DataFrame, column: str = "e2e_ms") -> Optional[int]:
    """``repeat`` of the median request among one case's timed ``request`` observations: the
    repeat whose ``column`` equals ``median_low`` of them (ties: the earliest repeat)."""
    r = requests[np.isfinite(requests[column].to_numpy(dtype=float))]
    if not len(r):
        return None
    hit = r[r[column] == median_low(r[column])].sort_values("repeat")
    return int(hit["repeat"].iloc[0])


def ratio_ci(numerator, denominator, level: float = CI_LEVEL, resamples: int = BOOTSTRAP_RESAMPLES,
             seed: int = BOOTSTRAP_SEED) -> tuple:
    """(ratio, lo, hi): ``median_low(numerator) / median_low(denominator)`` and its percentile
    bootstrap interval, each side resampled on its own (``resamples`` draws, fixed ``seed``); the
    interval is (None, None) unless both sides have 2 or more values, all None without values."""
    a, b = _clean(numerator), _clean(denominator)
    if not len(a) or not len(b) or not median_low(b):
        return None, None, None
    ratio = median_low(a) / median_low(b)
    if len(a) < 2 or len(b) < 2:
        return ratio, None, None
    rng = np.random.default_rng(seed)
    ma = np.sort(a[rng.integers(0, len(a), size=(resamples, len(a)))], axis=1)[:, (len(a) - 1) // 2]
    mb = np.sort(b[rng.integers(0, len(b), size=(resamples, len(b)))], axis=1)[:, (len(b) - 1) // 2]
    draws = ma / mb
    tail = (1 - level) / 2 * 100
    return ratio, float(np.percentile(draws, tail, method="lower")), float(np.percentile(draws, 100 - tail,
                                                                                         method="higher"))


def percentiles(values: Sequence[float], qs=(50, 90, 99)) -> dict:
    """{q: percentile} (linear interpolation, numpy's default) of a per-step distribution."""
    v = _clean(values)
    return {q: (float(np.percentile(v, q)) if len(v) else None) for q in qs}


__all__ = ["median_low", "bootstrap_ci", "spread", "median_request", "ratio_ci", "percentiles", "BOOTSTRAP_RESAMPLES",
           "BOOTSTRAP_SEED", "CI_LEVEL"]
