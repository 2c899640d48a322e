"""The run directory's schema (``harness.schema``): every file kind written through its ``Table`` and
read back as written, the routing tables to and from the count arrays, and ``manifest.json`` read
into a ``Manifest`` with the defaults an older manifest needs. Expected values are written out by
hand from the rows put in."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness.report.columns import occupancy
from harness.rundir import RunDir, load_run
from harness.schema import CASE_FILES, CASE_TABLES
from harness.schema.analytic import ANALYTIC_CSV, COST_COLUMNS
from harness.schema.headline import HEADLINE_CSV, STAGES_SUMMARY_CSV
from harness.schema.kernels import KERNEL_COLUMNS, KERNELS_CSV
from harness.schema.manifest import Manifest
from harness.schema.roofline import ROOFLINE_CSV
from harness.schema.routing import (ROUTING_CSV, ROUTING_STEPS_CSV, routing_arrays, routing_rows, routing_step_array,
                                    routing_step_rows)
from harness.schema.stages import STAGES_CSV, frame, read_observations
from harness.schema.steps import STEPS_CSV
from harness.schema.table import PROVENANCES, Table, fields
from harness.schema.throughput import BATCHES_CSV, THROUGHPUT_CSV, read_throughput

ROOT = Path(__file__).resolve().parents[1]
TABLES = [STAGES_CSV, STEPS_CSV, KERNELS_CSV, ROUTING_CSV, ROUTING_STEPS_CSV, THROUGHPUT_CSV, BATCHES_CSV, HEADLINE_CSV,
          STAGES_SUMMARY_CSV, ROOFLINE_CSV, ANALYTIC_CSV]


@pytest.fixture
def rd(tmp_path) -> RunDir:
    return RunDir.attach(tmp_path, {"status": "running", "cases": [], "warnings": []})


def test_every_column_has_a_known_provenance_and_says_what_it_holds():
    for t in TABLES:
        assert len(set(t.columns)) == len(t.columns), t.file
        for f in t.fields:
            assert f.provenance in PROVENANCES and f.what, (t.file, f.name)
    assert STEPS_CSV.field("gpu_ms").unit == "ms" and STEPS_CSV.field("gpu_ms").provenance == "measured"
    assert THROUGHPUT_CSV.field("pages_s").unit == "pages/s" and THROUGHPUT_CSV.field("pages_s").provenance == "derived"
    assert CASE_FILES == ("stages.csv", "kernels.csv", "steps.csv", "routing_steps.csv", "routing.csv", "step_clock.csv")


def test_field_spec_parses_units_provenance_and_text_columns():
    got = fields("""
    grid:text | | label | a grid
    wait_ms | ms | measured | waiting \\
    time
    """)
    assert [(f.name, f.unit, f.provenance, f.what, f.text) for f in got] == [
        ("grid", "", "label", "a grid", True), ("wait_ms", "ms", "measured", "waiting     time", False)]
    with pytest.raises(ValueError, match="provenance"):
        fields("x | | guessed | no such provenance")


def test_stages_round_trip_keeps_types_and_labels_that_look_like_numbers(rd):
    rows = [{"case": "c1", "mode": "base", "grid": "1", "batch": 2, "repeat": 0, "profiled": False, "stage": "decode",
             "call": -1, "calls": 1, "timer": "host", "host_ms": 12.5, "decode_steps": 3},
            {"case": "c1", "mode": "base", "grid": "1", "batch": 2, "repeat": 1, "profiled": True, "stage": "decode",
             "call": -1, "calls": 1, "timer": "host", "host_ms": 14.0, "kernels": 30}]
    CASE_TABLES["stages"].append(rd, frame(rows[:1]))
    CASE_TABLES["stages"].append(rd, frame(rows[1:]))     # the second case's rows: no second header
    assert (rd.path / "stages.csv").read_text().count("case,mode,grid") == 1
    back = read_observations(rd.path / "stages.csv")
    assert list(back["grid"]) == ["1", "1"] and list(back["repeat"]) == [0, 1]
    assert list(back["profiled"]) == [False, True] and list(back["host_ms"]) == [12.5, 14.0]
    assert back["gpu_ms"].isna().all() and back.loc[1, "kernels"] == 30.0
    assert list(back.columns) == STAGES_CSV.columns


def test_steps_kernels_and_routing_round_trip_through_load_run(rd):
    STEPS_CSV.append(rd, [{"case": "a", "repeat": 0, "step": 0, "kv_len": 101, "gpu_ms": None, "host_ms": 2.5},
                          {"case": "a", "repeat": 0, "step": 1, "kv_len": 102, "gpu_ms": None, "host_ms": 2.25}])
    kern = {c: None for c in KERNEL_COLUMNS} | {"device": "cpu", "name": "aten::mm", "stage": "decode", "dur_ms": 0.5,
                                               "module": "0", "family": "lm_head", "op_group": "matmul"}
    KERNELS_CSV.append(rd, pd.DataFrame([{"case": "a", **kern}]))
    counts = {"prefill": np.array([[0, 0, 0], [2, 0, 1]]), "decode": np.array([[0, 0, 0], [0, 3, 0]])}
    ROUTING_CSV.append(rd, routing_rows("a", counts))
    (rd.path / "stages.csv").write_text("case,stage,repeat,call,host_ms\na,decode,0,-1,5.0\n")
    run = load_run(rd.path, {"cases": []})
    assert run.steps[["step", "kv_len", "host_ms"]].values.tolist() == [[0, 101, 2.5], [1, 102, 2.25]]
    assert run.kernels.loc[0, "module"] == "0" and list(run.kernels.columns) == KERNELS_CSV.columns
    # layer 0 routed nothing in either phase: left out; layer 1: prefill 2 + 1 tokens, decode 3
    assert run.routing[["phase", "layer", "e0", "e1", "e2"]].values.tolist() == [["prefill", 1, 2, 0, 1],
                                                                                 ["decode", 1, 0, 3, 0]]
    back = routing_arrays(run.routing, "a", num_layers=2)
    assert back["prefill"].tolist() == [[0, 0, 0], [2, 0, 1]] and back["decode"].tolist() == [[0, 0, 0], [0, 3, 0]]
    assert routing_arrays(run.routing, "other", 2) is None


def test_routing_steps_count_distinct_experts_and_read_back(rd):
    steps = np.zeros((2, 2, 4), dtype=np.int64)
    steps[0, 1] = [1, 1, 0, 2]      # step 0, layer 1: three experts
    steps[1, 0] = [0, 0, 4, 0]      # step 1, layer 0: one expert
    rows = routing_step_rows("b", steps)
    assert [(r["step"], r["layer"], r["experts"]) for r in rows] == [(0, 1, 3), (1, 0, 1)]
    ROUTING_STEPS_CSV.append(rd, rows)
    back = ROUTING_STEPS_CSV.read(rd.path)
    assert list(back.columns) == ["case", "step", "layer", "experts", "e0", "e1", "e2", "e3"]
    assert (routing_step_array(back, "b", steps=2, num_layers=2) == steps).all()


def test_throughput_round_trip_and_closed_tables_refuse_unknown_columns(rd):
    row = {"config": "b4", "batch": 4, "window_s": 10.0, "window_pages": 32, "pages_s": 3.2, "bound": "decode"}
    THROUGHPUT_CSV.write(rd, [row])
    back = read_throughput(rd.path)
    assert list(back.columns) == THROUGHPUT_CSV.columns
    assert back.loc[0, ["config", "batch", "pages_s", "bound"]].tolist() == ["b4", 4, 3.2, "decode"]
    assert back["gpu_busy"].isna().all()
    assert read_throughput(rd.path / "missing").empty
    with pytest.raises(ValueError, match="not in its schema"):
        THROUGHPUT_CSV.frame([{**row, "pages_per_hour": 1.0}])
    with pytest.raises(ValueError, match=r"\['kernel'\] are not in its schema"):
        KERNELS_CSV.append(rd, pd.DataFrame({"case": ["a"], "kernel": ["k"]}))
    assert not (rd.path / "kernels.csv").exists()
    assert isinstance(ROUTING_CSV, Table) and ROUTING_CSV.open_columns


def test_occupancy_cells():
    assert occupancy(0.5) == "50.0%"
    assert occupancy(1.2) == "**120.0%: over 100%, a bug (overlapping spans)**"
    assert occupancy(None) == "–" and occupancy(float("nan")) == "–"


def test_an_old_manifest_with_missing_or_null_keys_reads_with_defaults():
    m = Manifest.of({"status": "complete", "device": None, "config": {"model": None, "run": {"name": "old"}}})
    assert (m.status, m.started, m.error, m.dtype) == ("complete", None, None, None)
    assert m.device == {} and m.git == {} and m.calibration == {} and m.host_steadiness == {}
    assert m.cases == [] and m.warnings == [] and m.merged_from == [] and m.argv == []
    assert m.experiment == "old" and m.model_config == {} and m.top_k is None
    assert m.device_name is None and m.device_type is None and not m.kernels_captured
    assert Manifest.of(None).status is None and Manifest.of(m) is m
    assert Manifest.execution_of({"name": "c"}) == {} and Manifest.trace_file({"trace": None}) is None


def test_a_committed_manifest_reads_typed():
    """runs/examples/h100-issue3/acceptance: written before ``experiment_name`` and ``launch`` were recorded."""
    raw = json.loads((ROOT / "runs/examples/h100-issue3/acceptance/manifest.json").read_text())
    m = Manifest.of(raw)
    assert m.experiment == "acceptance" and m.launch == {} and m.merged_from == []
    assert m.device_name == "NVIDIA H100 80GB HBM3" and m.device_type == "cuda" and m.dtype == "bfloat16"
    assert m.top_k is None      # its model config has no llm section
    assert list(m.case_entries) == [c["name"] for c in raw["cases"]]


def test_rows_as_tuples_follow_the_fixed_columns():
    got = STEPS_CSV.frame([("c", 0, 2, 9, None, 1.5)])
    assert got.loc[0, ["case", "step", "kv_len", "host_ms"]].tolist() == ["c", 2, 9, 1.5]


def test_the_report_files_declare_units_from_what_they_derive_and_read_back(rd):
    assert [(f.unit, f.provenance) for f in map(HEADLINE_CSV.field, ("e2e_ms", "e2e_ms_min", "pages_s", "bound_by"))] \
        == [("ms", "measured"), ("ms", "measured"), ("pages/s", "derived"), ("", "derived")]
    assert (STAGES_SUMMARY_CSV.field("tpot_p50_ms").unit, STAGES_SUMMARY_CSV.field("tpot_p50_ms").provenance) == \
        ("ms", "derived")
    assert (ROOFLINE_CSV.field("mbu").unit, ROOFLINE_CSV.field("bytes").provenance) == ("fraction", "analytic")
    assert (ANALYTIC_CSV.field("tensor_flops").unit, ANALYTIC_CSV.field("bytes_kv_copy_read").unit) == ("FLOP", "B")
    assert COST_COLUMNS[-1] == "intensity" and ANALYTIC_CSV.columns[len(COST_COLUMNS):] == [
        "routing", "bytes_kv_copy_read", "bytes_kv_copy_write"]
    HEADLINE_CSV.write(rd, pd.DataFrame([{"case": "g", "grid": "2", "e2e_ms": 80.0, "pages_s": 25.0}]))
    back = HEADLINE_CSV.read(rd.path)
    assert back.loc[0, "grid"] == "2" and back.loc[0, ["e2e_ms", "pages_s"]].tolist() == [80.0, 25.0]
    with pytest.raises(ValueError, match="not in its schema"):
        ROOFLINE_CSV.write(rd, pd.DataFrame({"case": ["g"], "speed": [1.0]}))
