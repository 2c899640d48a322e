"""``compare``: repeat counts, the interval of B / A and the "within noise" flag (issue 37 L3), partial
cases marked (L4), and ``--out`` refused where it exists or lies inside a run (L5). Run directories
are written here with chosen per-repeat times, so every expected figure follows from them."""
import json
from pathlib import Path

import pandas as pd
import pytest

from harness.cli import main
from harness.report.compare import compare_main, compare_runs, render


def _run(path: Path, decode_ms: list, status: str = "complete", partial: tuple = ()) -> Path:
    """A run directory of one case ``c``: timed repeat r decodes in ``decode_ms[r]`` GPU ms and its
    request takes 10 ms more; ``partial``: (repeats done, planned) of a case a signal stopped."""
    path.mkdir(parents=True)
    entry = {"name": "c", "mode": "base", "batch": 1}
    if partial:
        entry.update(partial=True, repeats_done=partial[0], repeats_planned=partial[1])
    (path / "manifest.json").write_text(json.dumps({"status": status, "device": {"name": "NVIDIA H100 80GB HBM3"},
                                                    "cases": [entry], "warnings": []}))
    rows = []
    for r, ms in enumerate(decode_ms):
        base = {"case": "c", "mode": "base", "grid": "", "batch": 1, "repeat": r, "profiled": False, "call": -1,
                "calls": 1, "timer": "cuda_event"}
        rows.append({**base, "stage": "decode", "gpu_ms": ms})
        rows.append({**base, "stage": "request", "gpu_ms": ms + 10, "e2e_ms": ms + 10})
    pd.DataFrame(rows).to_csv(path / "stages.csv", index=False)
    return path


def _decode(df: pd.DataFrame) -> pd.Series:
    return df[(df["stage"] == "decode") & (df["metric"] == "time")].iloc[0]


def test_one_repeat_each_is_within_noise(tmp_path, capsys):
    """The issue's case: two one-repeat runs of one config, prefill 0.59 of the other by chance."""
    a, b = _run(tmp_path / "a", [10.0]), _run(tmp_path / "b", [5.9])
    assert compare_main([str(a), str(b), "--out", str(tmp_path / "cmp")]) == 0
    row = _decode(pd.read_csv(tmp_path / "cmp" / "compare.csv"))
    assert row["ratio"] == pytest.approx(0.59) and pd.isna(row["ratio_lo"]) and pd.isna(row["ratio_hi"])
    assert (row["repeats_a"], row["repeats_b"], row["within_noise"]) == (1, 1, True)
    printed = capsys.readouterr().out
    assert "| c | decode | 10.000 | 5.900 | -4.100 | 0.59x | 1 / 1 | yes (too few repeats) | – | – |" in printed


def test_an_interval_that_holds_one_is_within_noise(tmp_path):
    """Three repeats a side: each side's bootstrap median is its min, middle or max value with
    probability 7/27, 13/27, 7/27, so the 95% interval of B / A runs from min B / max A to
    max B / min A (each corner has probability 49/729, above the 2.5% tail)."""
    a, b = _run(tmp_path / "a", [10.0, 11.0, 12.0]), _run(tmp_path / "b", [9.0, 11.5, 13.0])
    df, _ = compare_runs(a, b)
    row = _decode(df)
    assert row["ratio"] == pytest.approx(11.5 / 11.0)
    assert (row["ratio_lo"], row["ratio_hi"]) == (pytest.approx(9.0 / 12.0), pytest.approx(13.0 / 10.0))
    assert (row["repeats_a"], row["repeats_b"], row["within_noise"]) == (3, 3, True)


def test_a_difference_outside_the_noise_is_not_flagged(tmp_path):
    a = _run(tmp_path / "a", [10.0, 10.1, 10.2, 10.3, 10.4])
    b = _run(tmp_path / "b", [5.0, 5.1, 5.2, 5.3, 5.4])
    df, _ = compare_runs(a, b)
    row = _decode(df)
    assert row["ratio"] == pytest.approx(5.2 / 10.2)
    assert (row["repeats_a"], row["repeats_b"], row["within_noise"]) == (5, 5, False)
    # the interval lies between the most extreme ratios the repeats allow, both below 1
    assert 5.0 / 10.4 <= row["ratio_lo"] < row["ratio"] < row["ratio_hi"] <= 5.4 / 10.0
    req = df[(df["stage"] == "request") & (df["metric"] == "end-to-end")].iloc[0]
    assert req["ratio"] == pytest.approx(15.2 / 20.2) and [req["within_noise"]] == [False]
    assert "| c | decode | 10.200 | 5.200 | -5.000 | 0.51x [" in render(df, a, b, []) and "| 5 / 5 | no |" in \
        render(df, a, b, [])


def test_a_partial_case_is_marked(tmp_path, capsys):
    a = _run(tmp_path / "a", [10.0, 10.1, 10.2])
    b = _run(tmp_path / "b", [5.0], status="interrupted", partial=(1, 5))
    assert compare_main([str(a), str(b), "--out", str(tmp_path / "cmp")]) == 0
    df = pd.read_csv(tmp_path / "cmp" / "compare.csv")
    assert set(df["partial"]) == {"B"}
    printed = capsys.readouterr().out
    assert "| c (partial in B) | decode | 10.100 | 5.000 |" in printed
    assert "| c (partial in B) | end-to-end (ms) |" in printed
    assert ("- B (b) is interrupted; its finished cases are compared, and its partial case c (1 of 5 timed repeats) "
            "over the repeats kept, marked partial") in printed


def _refused(capsys, args) -> tuple:
    with pytest.raises(SystemExit) as exc:
        main(["compare", *map(str, args)])
    rc = exc.value.code
    return rc, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


def test_out_that_exists_or_lies_inside_a_run_is_refused(tmp_path, capsys):
    a, b = _run(tmp_path / "a", [10.0]), _run(tmp_path / "b", [5.9])
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine\n")
    assert _refused(capsys, [a, b, "--out", taken]) == (2, [
        f"error: --out {taken} already exists; fix: give --out a new directory (compare never writes into an "
        "existing one)"])
    assert [p.name for p in taken.iterdir()] == ["keep.txt"] and (taken / "keep.txt").read_text() == "mine\n"
    before = sorted(p.name for p in b.iterdir())
    inside = b / "cmp"
    assert _refused(capsys, [a, b, "--out", inside]) == (2, [
        f"error: --out {inside} is inside the run directory {b}; fix: give --out a new directory outside the run "
        "directories"])
    assert sorted(p.name for p in b.iterdir()) == before
