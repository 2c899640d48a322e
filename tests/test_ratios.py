"""The execution ladder's ratios on synthetic repeats with known ratios: the speed-up with its
bootstrap interval (derived by hand below), split into kernel-busy and span ratios; batched rows
against the best batch-1 row, never as a speed-up; an unstable base is said so."""
from pathlib import Path

import pandas as pd
import pytest

from harness.measure import stats
from harness.schema.stages import CALL_ALL, frame
from harness.measure.summary import summarize
from harness.report import ladder
from harness.roofline.join import roofline_frame
from harness.rundir import RunData

CASES = {   # case: (batch, execution, decode tok/s per repeat, TPOT p50 per repeat, decode GPU ms per repeat,
            #        profiled decode busy ms, kernels, launches per step)
    "vendor-style": (1, {}, [10, 11, 12, 13, 14], [100, 91, 83, 77, 71], [100, 110, 120, 130, 140], 40.0, 1000, 100),
    "best": (1, {"kv_cache": "static", "cuda_graphs": "decode"}, [40, 44, 48, 52, 56], [20, 21, 22, 23, 24],
             [25.0, 25.1, 25.2, 25.3, 25.4], 20.0, 100, 10),
    "best-b4": (4, {"kv_cache": "static", "cuda_graphs": "decode"}, [160, 170, 180, 190, 200],
                [30, 31, 32, 33, 34], [40.0, 40.1, 40.2, 40.3, 40.4], 30.0, 100, 10),
}


def _run(tmp_path: Path):
    rows, cases = [], []
    for case, (batch, ex, tok, tpot, dec, busy, kernels, per_step) in CASES.items():
        base = {"case": case, "mode": "base", "batch": batch, "call": CALL_ALL, "calls": 1, "timer": "cuda_event"}
        for r in range(5):
            rows.append({**base, "repeat": r, "profiled": False, "stage": "decode", "gpu_ms": dec[r]})
            rows.append({**base, "repeat": r, "profiled": False, "stage": "request", "gpu_ms": 100.0 + r,
                         "e2e_ms": 100.0 + r, "decode_tok_s": tok[r], "tpot_p50_ms": tpot[r]})
        rows.append({**base, "repeat": 5, "profiled": True, "stage": "decode", "gpu_ms": 3 * dec[2], "busy_ms": busy,
                     "kernels": kernels, "launches_per_step": per_step})
        cases.append({"name": case, "mode": "base", "batch": batch, "execution": ex})
    run = RunData(tmp_path, {"cases": cases, "warnings": []}, frame(rows))
    return run, summarize(run.stages)


def test_speedup_interval_and_split_by_hand(tmp_path):
    run, summary = _run(tmp_path)
    df = ladder.execution_rows(run, roofline_frame([]), summary).set_index("case")
    best = df.loc["best"]
    # medians (odd count: the middle): best 48 tok/s over vendor-style 12 = 4
    assert best["base"] == "vendor-style" and best["speedup"] == 4.0
    # the interval resamples each row's five repeats on its own. The median of five draws is the k-th
    # value with P(k) = P(at least 3 draws <= k-th) - P(at least 3 draws <= (k-1)-th):
    cdf = [sum(__import__("math").comb(5, j) * (k / 5) ** j * (1 - k / 5) ** (5 - j) for j in range(3, 6))
           for k in range(6)]
    p = [cdf[k] - cdf[k - 1] for k in range(1, 6)]                    # 0.058 0.260 0.365 0.260 0.058
    assert p[0] == pytest.approx(0.05792) and p[1] == pytest.approx(0.25952)
    # smallest ratios: 40/14 (p0 * p0 = 0.34%), 40/13 (p0 * p1 = 1.50%), 44/14 (1.50%): 3.34% >= 2.5% is
    # reached at 44/14; largest: 56/10, 52/10 and 56/11 the same way: the 97.5th percentile is 56/11
    assert p[0] * p[0] + p[0] * p[1] < 0.025 < p[0] * p[0] + 2 * p[0] * p[1]
    assert (best["speedup_lo"], best["speedup_hi"]) == (pytest.approx(44 / 14), pytest.approx(56 / 11))
    assert stats.ratio_ci(CASES["best"][2], CASES["vendor-style"][2]) == (4.0, best["speedup_lo"], best["speedup_hi"])
    # kernel busy per decode step: vendor-style 40 ms over 1000 / 100 = 10 steps = 4 ms; best 20 / (100 / 10) = 2
    assert best["busy_ratio"] == 2.0 and best["span_ratio"] == 4.0 / 2.0
    # vendor-style's decode spans 100..140 vary by CV sqrt(250) / 120 = 13% > 5%: unstable
    assert df.loc["vendor-style", "decode_cv"] == pytest.approx(250 ** 0.5 / 120) and best["unstable"]
    assert df.loc["vendor-style", "speedup"] == 1.0


def test_batched_rows_against_the_best_batch1_row(tmp_path):
    run, summary = _run(tmp_path)
    b4 = ladder.execution_rows(run, roofline_frame([]), summary).set_index("case").loc["best-b4"]
    assert pd.isna(b4["speedup"]) and pd.isna(b4["busy_ratio"]) and pd.isna(b4["base"])   # not a speed-up
    assert b4["best_b1"] == "best" and not b4["unstable"]
    assert b4["tput_ratio"] == 180 / 48 and b4["tpot_ratio"] == 32 / 22          # medians over medians
    assert b4["tput_lo"] <= 180 / 48 <= b4["tput_hi"] and b4["tpot_lo"] <= 32 / 22 <= b4["tpot_hi"]
    md = "\n".join(ladder.section(run, roofline_frame([]), summary))
    lines = {ln.split("|")[1].strip(): ln for ln in md.splitlines() if ln.startswith("| best")}
    assert "| 4.00x [3.14–5.09] unstable | 2.00x | 2.00x | – | – |" in lines["best"]
    assert f"| – | – | – | 3.75x [{b4['tput_lo']:.2f}–{b4['tput_hi']:.2f}] |" in lines["best-b4"]
    assert "speed-up (derived, decode tok/s / vendor-style batch-1 tok/s, 95% CI)" in md
    assert "- base of the speed-ups: `vendor-style` (decode CV 13.2% > 5%: unstable" in md
    assert "- best batch-1 row of the batched comparisons: `best`" in md
