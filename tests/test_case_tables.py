"""``run.CaseTables``: a run's tables grown one case at a time. The CSVs and the in-memory tables hold
exactly the cases' rows in order; a case costs its own rows (no table is re-concatenated per case);
a case whose writing fails leaves files, manifest and memory as they were."""
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from harness import run as run_mod
from harness.rundir import RunDir


def _case(i: int, with_kernels: bool):
    """Case ``c{i}``: 2 stage rows, 1 kernel row (unless ``with_kernels`` is False), 1 decode step,
    prefill expert counts [[i+1, 0, 2], [0, 0, 0]] (layer 1 routed nothing) and one decode step
    [[0, i, 1], [0, 0, 0]]."""
    name = f"c{i}"
    stages = pd.DataFrame({"case": [name, name], "stage": ["sam", "decode"], "repeat": [0, 0], "gpu_ms": [1.5, 2.0 + i]})
    kernels = pd.DataFrame({"case": [name], "name": [f"k{i}"], "dur_ms": [0.01 * (i + 1)]}) if with_kernels \
        else pd.DataFrame()
    routing = {"prefill": np.array([[i + 1, 0, 2], [0, 0, 0]]), "decode_steps": np.array([[[0, i, 1], [0, 0, 0]]])}
    measured = SimpleNamespace(observations=stages, kernels=kernels, routing=routing,
                               steps=[(name, 0, 0, 100 + i, 0.5, 0.75)], warmup={}, trace=None, entry=lambda: {})
    inputs = SimpleNamespace(case=SimpleNamespace(name=name, to_dict=lambda: {"name": name}),
                             pages_entry=lambda: {}, routing_entry=lambda: {})
    analytic = (pd.DataFrame({"case": [name], "flops": [1000 * (i + 1)]}), 64 * (i + 1), [f"note {i}"])
    return inputs, measured, analytic


def _tables(tmp_path):
    rd = RunDir(tmp_path / "run", {}, argv=["t"])
    data = run_mod.LiveRunData(rd.path, rd.manifest, analytic=pd.DataFrame())
    return rd, data, run_mod.CaseTables(rd, data)


def test_n_cases_give_exactly_their_rows_in_order_and_no_table_is_rebuilt_per_case(tmp_path, monkeypatch):
    rd, data, tables = _tables(tmp_path)
    concats = []
    real_concat = pd.concat
    monkeypatch.setattr(run_mod.pd, "concat", lambda *a, **k: concats.append(1) or real_concat(*a, **k))
    cases = [_case(i, with_kernels=i != 1) for i in range(3)]
    for i, (inputs, measured, analytic) in enumerate(cases):
        tables.add(inputs, measured, analytic, {"label": "vendor"})
        if i == 0:   # a read between cases (report.md so far), then more cases
            assert len(data.stages) == 2 and concats == []
    assert concats == []   # adding cases 1 and 2 concatenated nothing: each case cost its own rows
    monkeypatch.setattr(run_mod.pd, "concat", real_concat)

    stages = pd.DataFrame({"case": ["c0", "c0", "c1", "c1", "c2", "c2"], "stage": ["sam", "decode"] * 3,
                           "repeat": [0] * 6, "gpu_ms": [1.5, 2.0, 1.5, 3.0, 1.5, 4.0]})
    kernels = pd.DataFrame({"case": ["c0", "c2"], "name": ["k0", "k2"], "dur_ms": [0.01, 0.03]})   # c1 had none
    steps = pd.DataFrame({"case": ["c0", "c1", "c2"], "repeat": [0, 0, 0], "step": [0, 0, 0],
                          "kv_len": [100, 101, 102], "gpu_ms": [0.5] * 3, "host_ms": [0.75] * 3})
    # one prefill row per case (layer 0; layer 1 routed nothing): e0 = i + 1, e1 = 0, e2 = 2
    routing = pd.DataFrame({"case": ["c0", "c1", "c2"], "phase": ["prefill"] * 3, "layer": [0, 0, 0],
                            "e0": [1, 2, 3], "e1": [0, 0, 0], "e2": [2, 2, 2]})
    # decode step 0, layer 0: counts [0, i, 1] -> experts touched 1 (c0) or 2
    routing_steps = pd.DataFrame({"case": ["c0", "c1", "c2"], "step": [0, 0, 0], "layer": [0, 0, 0],
                                  "experts": [1, 2, 2], "e0": [0, 0, 0], "e1": [0, 1, 2], "e2": [1, 1, 1]})
    analytic = pd.DataFrame({"case": ["c0", "c1", "c2"], "flops": [1000, 2000, 3000]})
    for name, want in (("stages", stages), ("kernels", kernels), ("steps", steps), ("routing", routing),
                       ("routing_steps", routing_steps)):
        pd.testing.assert_frame_equal(getattr(data, name), want, obj=name)
        pd.testing.assert_frame_equal(pd.read_csv(rd.path / f"{name}.csv"), want, obj=f"{name}.csv")
    pd.testing.assert_frame_equal(data.analytic, analytic)
    assert data.mbu_bytes == {"c0": 64, "c1": 128, "c2": 192}
    assert data.notes == ["note 0", "note 1", "note 2"]
    assert [c["name"] for c in rd.manifest["cases"]] == ["c0", "c1", "c2"]


def test_a_case_whose_manifest_write_fails_is_not_kept(tmp_path, monkeypatch):
    rd, data, tables = _tables(tmp_path)
    tables.add(*_case(0, True), {})
    before = {p.name: p.read_text() for p in rd.path.glob("*.csv")}
    real_save = rd.save
    monkeypatch.setattr(rd, "save", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        tables.add(*_case(1, True), {})
    monkeypatch.setattr(rd, "save", real_save)
    assert {p.name: p.read_text() for p in rd.path.glob("*.csv")} == before
    assert [c["name"] for c in rd.manifest["cases"]] == ["c0"]
    assert list(data.stages["case"]) == ["c0", "c0"] and list(data.kernels["name"]) == ["k0"]
    assert list(data.analytic["case"]) == ["c0"] and list(data.mbu_bytes) == ["c0"] and data.notes == ["note 0"]
