"""``harness.measure.step_clock``: the fused decode step's in-kernel stamps turned into per-launch and
per-module times, on stamps written by hand (the kernels' own stamps: ``tests/test_decode_step.py``)."""
from __future__ import annotations

import math

import pytest

from harness.measure import step_clock

#: a two-layer step: layer 0 dense, layer 1 MoE, then lm_head; each launch's work in ns
PLAN = [("qkv", 0, 3000), ("attention", 0, 5000), ("o_proj", 0, 2000), ("gate_up", 0, 4000), ("down", 0, 4000),
        ("qkv", 1, 3000), ("attention", 1, 5000), ("o_proj", 1, 2000), ("router", 1, None), ("gate_up", 1, 4000),
        ("down", 1, 4000), ("lm_head", 2, 10000)]
WAIT, LEAD = 2000, 1000
ROUTER = {5: 1000, 6: 3000, 7: 5000}                     # the router's work at each row (position)


def stamps():
    """Rows 5, 6, 7 back to back: each launch enters LEAD before the previous one ends, is released
    WAIT after it and ends its work later."""
    out, prev_end = [], 1_000_000
    for row in (5, 6, 7):
        for i, (label, layer, work) in enumerate(PLAN):
            release = prev_end + WAIT
            end = release + (ROUTER[row] if work is None else work)
            out.append((row, i, label, layer, prev_end - LEAD, release, end))
            prev_end = end
    return out


def test_intervals_work_hand_off_and_lead_per_launch_and_the_last_step_without_a_next_one():
    df = step_clock.launches(stamps(), moe_layers={1})
    assert len(df) == 36
    assert df["handoff_us"].iloc[:35].tolist() == [2.0] * 35 and math.isnan(df["handoff_us"].iloc[35])
    assert df["lead_us"].tolist() == [3.0] * 36            # release - entry = WAIT + LEAD
    assert df[df["label"] == "router"]["work_us"].tolist() == [1.0, 3.0, 5.0]
    assert (df["interval_us"] - df["work_us"] - 2.0).abs().max() < 1e-12
    # rows 5 and 6 (row 7 has no next step): 12 hand-offs of 2 µs + work 3+5+2+4+4+3+5+2+r+4+4+10 = 46 + r µs
    assert step_clock.steps(df).to_dict() == {5: 24 + 46 + 1.0, 6: 24 + 46 + 3.0}


def test_only_first_program_stamps_give_intervals_without_work():
    light = [(r, i, lb, ly, entry, release, None) for r, i, lb, ly, entry, release, _ in stamps()]
    df = step_clock.launches(light, moe_layers={1})
    assert df["work_us"].isna().all() and df["handoff_us"].isna().all()
    assert step_clock.steps(df).to_dict() == {5: 71.0, 6: 73.0}
    rows = {r["module_group"]: r for r in step_clock.modules(df)}
    assert rows["router"]["interval_us"] == 3.0 and math.isnan(rows["router"]["work_us"])
    assert rows["step"]["interval_us"] == 71.0


def test_a_gap_in_the_rows_leaves_the_step_after_it_unknown():
    rows = [s for s in stamps() if s[0] != 6]
    df = step_clock.launches(rows, moe_layers={1})
    assert step_clock.steps(df).empty


def test_modules_medians_shares_and_bandwidth_floor_by_hand():
    """Steps 5 and 6 (step 7 has no next step): medians of the two steps' per-module sums, the lower
    middle of two (step 5's: router 1 µs of work, the step 71 µs); bytes at 4,800 GB/s: 4.8 MB per µs."""
    df = step_clock.launches(stamps(), moe_layers={1})
    nbytes = {"embedding row": 0, "attention": 9.6e6, "dense mlp": 4.8e6, "router": 0.48e6,
              "routed experts": 9.6e6, "shared experts": 4.8e6, "final norm + lm_head": 14.4e6}
    nbytes["total"] = sum(nbytes.values())
    rows = {r["module_group"]: r for r in step_clock.modules(df, nbytes, kv_bytes=4.8e6, bandwidth_gbs=4800.0)}
    attention, dense, router, experts, head = (m for m, _, _ in step_clock.MODULES)
    want = {  # module: (launches per step, interval, work, hand-off, floor µs)
        attention: (6, 32.0, 20.0, 12.0, 3.0), dense: (2, 12.0, 8.0, 4.0, 1.0), router: (1, 3.0, 1.0, 2.0, 0.1),
        experts: (2, 12.0, 8.0, 4.0, 3.0), head: (1, 12.0, 10.0, 2.0, 3.0), "step": (12, 71.0, 47.0, 24.0, 10.1)}
    assert list(rows) == [attention, dense, router, experts, head, "step"]
    for name, (n, interval, work, handoff, floor) in want.items():
        r = rows[name]
        assert (r["clock_launches"], r["interval_us"], r["work_us"], r["handoff_us"]) == (n, interval, work, handoff), name
        assert r["step_share"] == pytest.approx(interval / 71.0) and r["bw_floor_us"] == pytest.approx(floor)
        assert r["floor_interval"] == pytest.approx(floor / interval)


def test_per_launch_medians():
    rows = step_clock.by_launch(step_clock.launches(stamps(), moe_layers={1}))
    assert [(r["launch"], r["kernel"], r["layer"]) for r in rows] == [(i, lb, ly) for i, (lb, ly, _) in enumerate(PLAN)]
    assert rows[8]["work_us"] == 1.0 and rows[0]["handoff_us"] == 2.0 and rows[11]["interval_us"] == 12.0   # lower middle


def test_the_clock_bench_writes_these_records_into_registered_columns():
    """``bench decode_step clock=true`` (``harness.bench.decode_step_clock``) puts ``modules`` and
    ``by_launch`` records into tables of its declared columns: every column is registered
    (``harness.report.columns``) and every record key is one of them (``Table.add`` refuses others)."""
    from harness.bench import decode_step_clock as bench
    from harness.bench.verb import BenchReport

    report = BenchReport(progress=lambda _: None)
    df = step_clock.launches(stamps(), moe_layers={1})
    modules = report.table("m", "modules", bench.MODULE_TABLE)
    launches = report.table("l", "launches", bench.LAUNCH_TABLE)
    report.table("k", "kernels", bench.KERNEL_TABLE)
    nbytes = {"attention": 1.0, "total": 2.0}
    for rec in step_clock.modules(df, nbytes, 0.0, 4800.0):
        modules.add(**rec)
    for rec in step_clock.by_launch(df):
        launches.add(**rec)
    assert len(modules.rows) == 6 and len(launches.rows) == 12
    assert "release to next release" in report.markdown("clock")


def test_the_report_section_reads_step_clock_csv_and_reconciles_with_the_events():
    """A run's step_clock.csv (first-program stamps: no end) of one case: the module rows' medians (the
    lower middle of two steps) and the step beside the same request's decode steps by CUDA events
    (steps.csv: 71 and 73 µs: 71)."""
    from types import SimpleNamespace

    import pandas as pd

    from harness.report import step_clock as section
    from harness.schema.step_clock import STEP_CLOCK_CSV

    rows = [{"case": "c", "repeat": 3, "row": r, "launch": i, "label": lb, "layer": ly,
             "kind": "moe" if ly == 1 else "dense", "entry": entry, "release": release, "end": None}
            for r, i, lb, ly, entry, release, _ in stamps()]
    steps = pd.DataFrame({"case": ["c"] * 3, "repeat": [3] * 3, "step": [0, 1, 2], "gpu_ms": [0.071, 0.073, None]})
    run = SimpleNamespace(step_clock=STEP_CLOCK_CSV.frame(rows), steps=steps)
    text = "\n".join(section.section(run))
    assert text.startswith("## Inside the fused decode step (in-kernel clock)")
    assert "| c | router | 1.0 | 3.0 | 4.2% |" in text and "| c | step | 12.0 | 71.0 | 100.0% |" in text
    assert ("`c` (timed repeat 3, the median request): median step 71.0 µs by the in-kernel clock over 2 steps, "
            "71.0 µs by CUDA events over the same request's decode steps") in text
    assert section.section(SimpleNamespace(step_clock=STEP_CLOCK_CSV.frame([]), steps=steps)) == []


def test_real_globaltimer_magnitudes_keep_every_nanosecond():
    """Stamps near a real %globaltimer reading (1.8e18 ns, where a float64 steps by 256 ns): the same
    intervals, work and hand-offs as the small stamps, exactly (differences taken in int64 first)."""
    base = 1_795_916_159_231_224_640 + 32           # from h200-step-clock/best-fused-clock, + 32 ns
    small = step_clock.launches(stamps(), moe_layers={1})
    big = step_clock.launches([(r, i, lb, ly, e + base, rel + base, end + base)
                               for r, i, lb, ly, e, rel, end in stamps()], moe_layers={1})
    for c in ("interval_us", "work_us", "handoff_us", "lead_us"):
        assert big[c].equals(small[c]), c
    assert big["handoff_us"].iloc[:35].tolist() == [2.0] * 35


def test_an_even_count_of_steps_takes_the_lower_middle():
    """Two complete steps (rows 5 and 6: 71 and 73 µs): the median is 71, an observed step (stats.median_low)."""
    rows = {r["module_group"]: r for r in step_clock.modules(step_clock.launches(stamps(), moe_layers={1}))}
    assert rows["step"]["interval_us"] == 71.0 and rows["router"]["interval_us"] == 3.0
