"""TPOT against position: the decode steps of a run (``steps.csv``) per 128-step window.

``steps`` is a run's ``RunData.steps`` (``harness.schema.steps.STEP_COLUMNS``: case,
repeat, step, kv_len, gpu_ms, host_ms; one row per decode step of every timed repeat). A step's
time is ``gpu_ms`` (CUDA events) where the run has them, else ``host_ms``. Window statistics pool
the repeats: the median of every (repeat, step) time in the window, ms, by the harness's one
median rule (``harness.measure.stats.median_low``: an observed value, the lower middle).

* ``tpot_edges``: per case, TPOT p50 over all steps, the first ``WINDOW`` and the last ``WINDOW``
  steps, and last / first (how much a step slows as the cache grows);
* ``tpot_windows``: TPOT p50 per window of ``WINDOW`` steps, one column per case;
* ``plot_tpot_vs_position``: ``tpot_vs_position.png``, per-step median over repeats against kv_len;
* ``section``: the report's "TPOT against position" lines (columns from ``harness.report.columns``).
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from ..markdown import LEFT
from ..measure.stats import median_low
from .columns import Column, fixed, table

WINDOW = 128   # decode steps per window


def step_time(steps: pd.DataFrame) -> tuple:
    """(column, label): ``gpu_ms`` where the steps have CUDA-event times, else ``host_ms``."""
    if "gpu_ms" in steps and steps["gpu_ms"].notna().any():
        return "gpu_ms", "GPU ms (CUDA events)"
    return "host_ms", "host ms (no CUDA events)"


def _timed(steps: pd.DataFrame) -> pd.DataFrame:
    col, _ = step_time(steps)
    out = steps[["case", "repeat", "step", "kv_len"]].copy()
    out["ms"] = steps[col].astype(float)
    out["step"] = out["step"].astype(int)
    return out.dropna(subset=["ms"])


def tpot_edges(steps: pd.DataFrame, window: int = WINDOW) -> pd.DataFrame:
    """Per case: steps, tpot_p50_ms (all), first_p50_ms / first_kv (steps < window), last_p50_ms /
    last_kv (the last ``window`` steps), last_over_first. kv ranges as "lo-hi" positions."""
    cols = ["case", "steps", "tpot_p50_ms", "first_kv", "first_p50_ms", "last_kv", "last_p50_ms", "last_over_first"]
    if steps is None or not len(steps):
        return pd.DataFrame(columns=cols)
    rows = []
    for case, g in _timed(steps).groupby("case", sort=False):
        n = int(g["step"].max()) + 1
        first, last = g[g["step"] < window], g[g["step"] >= n - window]
        f, la = median_low(first["ms"]), median_low(last["ms"])
        rows.append({"case": case, "steps": n, "tpot_p50_ms": median_low(g["ms"]),
                     "first_kv": f"{int(first['kv_len'].min())}-{int(first['kv_len'].max())}", "first_p50_ms": f,
                     "last_kv": f"{int(last['kv_len'].min())}-{int(last['kv_len'].max())}", "last_p50_ms": la,
                     "last_over_first": la / f if f else None})
    return pd.DataFrame(rows, columns=cols)


def tpot_windows(steps: pd.DataFrame, window: int = WINDOW) -> pd.DataFrame:
    """TPOT p50 (ms) per window of ``window`` decode steps: index "a-b" (steps), one column per case."""
    if steps is None or not len(steps):
        return pd.DataFrame()
    t = _timed(steps)
    t["window"] = t["step"] // window
    table = t.pivot_table(index="window", columns="case", values="ms", aggfunc=median_low, sort=False)
    table = table[list(dict.fromkeys(t["case"]))]
    table.index = [f"{w * window}-{w * window + window - 1}" for w in table.index]
    return table


def plot_tpot_vs_position(steps: pd.DataFrame, path, title: str = "") -> Path:
    """Per-step TPOT (median over repeats) against kv_len, one line per case (matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    path = Path(path)
    _, label = step_time(steps)
    per_step = _timed(steps).groupby(["case", "step"], sort=False).agg(kv_len=("kv_len", "first"),
                                                                       ms=("ms", median_low)).reset_index()
    fig, ax = plt.subplots(figsize=(8.5, 4.5), dpi=110)
    for case, g in per_step.groupby("case", sort=False):
        ax.plot(g["kv_len"], g["ms"], lw=0.8, label=str(case))
    ax.set_xlabel("KV length (positions the step attends over)")
    ax.set_ylabel(f"decode step, {label}")
    ax.set_title(title or "TPOT against position (median over timed repeats)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


#: the columns of the edges table that depend on the window size (the others are in ``columns.COLUMNS``)
WINDOW_COLUMNS = {"first_kv": Column("first_kv", f"first {WINDOW}: kv", align=LEFT),
                  "last_kv": Column("last_kv", f"last {WINDOW}: kv", align=LEFT)}


def section(steps: pd.DataFrame) -> list:
    """The report's "TPOT against position" lines; empty when the run kept no decode steps."""
    edges = tpot_edges(steps)
    if not len(edges):
        return []
    _, label = step_time(steps)
    L = ["## TPOT against position", "",
         f"Decode steps of the timed repeats (`steps.csv`), {label}, median over repeats and steps; "
         f"kv = positions a step attends over (prompt + tokens so far).", ""]
    L += table(["case", "steps", "tpot_p50_all", "first_kv", "first_p50", "last_kv", "last_p50", "last_over_first"],
               [{**r, "tpot_p50_all": r["tpot_p50_ms"], "first_p50": r["first_p50_ms"], "last_p50": r["last_p50_ms"]}
                for r in edges.to_dict("records")], WINDOW_COLUMNS)
    windows = tpot_windows(steps)
    if len(windows) > 1:
        cases = {str(c): Column(str(c), str(c), "", "measured", fmt=fixed()) for c in windows.columns}
        L += ["", f"TPOT p50 ms per window of {WINDOW} steps:", ""]
        L += table(["window", *cases], [{"window": idx, **dict(zip(cases, row))}
                                        for idx, row in zip(windows.index, windows.to_numpy())], cases)
    return L + ["", "Per step: `tpot_vs_position.png`.", ""]


__all__ = ["WINDOW", "step_time", "tpot_edges", "tpot_windows", "plot_tpot_vs_position", "section"]
