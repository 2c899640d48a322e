"""The throughput run over several GPUs of one host (``throughput.gpus``), on the CPU: the plan (the
cores split into workers per GPU, the refusals), the scaling arithmetic (efficiency, its interval, the
windows' overlap) on hand-made child run directories, and the parent's life with fake children
(a small script standing in for ``python -m harness run``, so no model runs): a complete run, a child
that fails, and SIGINT during phase 2.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness.config import HarnessConfig, ThroughputConfig
from harness.errors import HarnessError, RunStopped
from harness.throughput import barrier, scaling
from harness.throughput.gpus import GpuPlan, child_overrides, plan_gpus
from harness.lifecycle import run_experiment
from harness.throughput.pipeline import Throughput
from harness.schema.throughput import COLUMN_NAMES, SPAN_COLUMNS

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------- the plan

@pytest.mark.parametrize("gpus, workers, visible, cores, ids, expect_workers", [
    ("2", None, ["0", "1"], 32, ("0", "1"), 8),        # 16 cores a GPU: 14 left, capped at 8
    ("2", None, ["0", "1"], 10, ("0", "1"), 3),        # 5 cores a GPU, less the main process and its launch thread
    ("all", None, ["3", "5", "6", "7"], 16, ("3", "5", "6", "7"), 2),   # 4 cores a GPU
    ("2", None, ["3", "5", "6"], 16, ("3", "5"), 6),   # the first two visible; 8 cores a GPU
    ("2", 5, ["0", "1"], 4, ("0", "1"), 5),            # set: taken as given
])
def test_plan_splits_the_cores_between_the_gpus(gpus, workers, visible, cores, ids, expect_workers):
    plan = plan_gpus(gpus, workers, "auto", visible, "CUDA_VISIBLE_DEVICES", cores)
    assert plan.gpus == ids and plan.workers == expect_workers and plan.cores == cores


@pytest.mark.parametrize("gpus, visible", [("1", ["0", "1"]), ("all", ["0"])])
def test_one_gpu_is_the_plain_run(gpus, visible):
    assert plan_gpus(gpus, None, "auto", visible, "nvidia-smi", 8) is None


@pytest.mark.parametrize("gpus, device, visible, sweep, line", [
    ("3", "auto", ["0", "1"], None, "throughput.gpus=3: 3 GPUs asked for, 2 visible (nvidia-smi: 0,1); fix: set "
     "throughput.gpus=2 or less (or all), or widen CUDA_VISIBLE_DEVICES"),
    ("2", "cpu", ["0", "1"], None, "throughput.gpus=2 measures 2 GPUs at once, and device=cpu runs on the CPU; fix: "
     "leave throughput.gpus unset on the CPU (one process measures it)"),
    ("all", "auto", [], None, "throughput.gpus=all measures every visible GPU at once, and this host shows no GPU "
     "(nvidia-smi lists none): it would run on the CPU; fix: leave throughput.gpus unset on the CPU"),
    ("2", "cuda:1", ["0", "1"], None, "throughput.gpus=2 with device=cuda:1, which names one GPU; fix: use "
     "device=auto or device=cuda, and CUDA_VISIBLE_DEVICES to choose the GPUs"),
    ("2", "auto", ["0", "1"], "gpus", "throughput.gpus=2 in a sweep of hydra/launcher=gpus, which gives each job one "
     "GPU; fix: run it without -m, or sweep with throughput.gpus=1"),
    ("two", "auto", ["0", "1"], None, "throughput.gpus=two is not a count of GPUs; fix: set throughput.gpus to a "
     "count of GPUs (1, 2, ...) or all"),
])
def test_refusals(gpus, device, visible, sweep, line):
    with pytest.raises(HarnessError) as err:
        plan_gpus(gpus, None, device, visible, "nvidia-smi", 16, sweep)
    assert str(err.value) == line


def test_a_sweep_on_another_launcher_leaves_the_check_to_its_jobs():
    # a SLURM job sees the GPUs SLURM gives it; the login node that submits it may show none
    assert plan_gpus("2", None, "auto", [], "nvidia-smi", 4, "other") is None


def test_cli_refuses_before_any_run_directory(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT / "src")}
    res = subprocess.run([sys.executable, "-m", "harness", "run", "+experiment=throughput", "model=tiny",
                          "throughput.gpus=2", f"run.root={tmp_path / 'runs'}"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        "error: throughput.gpus=2 measures 2 GPUs at once, and this host shows no GPU (CUDA_VISIBLE_DEVICES is "
        "empty): it would run on the CPU; fix: leave throughput.gpus unset on the CPU")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_child_overrides_replace_the_parents_gpus_workers_and_directory():
    task = ["+experiment=throughput", "throughput.gpus=all", "++throughput.workers=12", "workload.routing=balanced"]
    assert child_overrides(task, 3, Path("/r/it's/alone-gpu0")) == [
        "+experiment=throughput", "workload.routing=balanced", "throughput.gpus=1", "throughput.workers=3",
        "hydra.run.dir='/r/it\\'s/alone-gpu0'"]


# ------------------------------------------------------------------------------ the arithmetic

def test_windows_overlap_by_hand():
    # windows [100, 110] and [100.5, 110.5]: 9.5 s in common of the longest 10 s
    assert scaling.windows_overlap([100.0, 100.5], [10.0, 10.0]) == pytest.approx(0.95)
    assert scaling.windows_overlap([0.0, 20.0], [10.0, 10.0]) == 0.0       # one after the other
    assert np.isnan(scaling.windows_overlap([], []))


def test_speedup_interval_by_hand():
    # phase 1's cycles 1 and 3 s: a resample's mean is 1, 2 or 3 with odds 1/4, 1/2, 1/4; one GPU in
    # phase 2 with cycles of 2 s: speed-up = mean / 2 in {0.5, 1, 1.5}; the 95% tails are the extremes
    assert scaling.speedup_interval(np.array([1.0, 3.0]), [np.array([2.0, 2.0])]) == (0.5, 1.5)
    # steady windows: the interval is the point, 2 s / 2.5 s + 2 s / 2 s = 0.8 + 1
    lo, hi = scaling.speedup_interval(np.full(4, 2.0), [np.full(3, 2.5), np.full(5, 2.0)])
    assert lo == pytest.approx(1.8) and hi == pytest.approx(1.8)
    assert scaling.speedup_interval(np.array([1.0]), [np.array([1.0, 1.0])]) == (None, None)


def test_batch_cycles_add_up_to_the_window():
    spans = pd.DataFrame([["b2", 1, "request", 0.1, 0.9], ["b2", 1, "sam", 0.1, 0.2], ["b2", 2, "request", 1.0, 1.8],
                          ["b2", 3, "request", 2.5, 3.2], ["b4", 1, "request", 0.0, 5.0]], columns=SPAN_COLUMNS)
    assert np.allclose(scaling.batch_cycles(spans, "b2", 3.5), [1.0, 1.5, 1.0])


def test_an_efficiency_above_one_is_a_flag_not_a_figure(tmp_path):
    # the GPU alone at 10 pages/s, the two of phase 2 at 11 and 10.2: 21.2 / 20 = 106%
    write_child(tmp_path, "alone-gpu0", [{"config": "b2", "batch": 2, "pages_s": 10.0, "window_s": 1.0, "bound": "decode"}],
                {"b2": [0.0]})
    for g, rate in (("0", 11.0), ("1", 10.2)):
        write_child(tmp_path, f"together-gpu{g}", [{"config": "b2", "batch": 2, "pages_s": rate, "window_s": 1.0,
                                                    "bound": "decode"}], {"b2": [0.0]})
    table = scaling.scaling_table(tmp_path, ["0", "1"], workers=1)
    r = table.iloc[0]
    assert r["speedup"] == pytest.approx(2.12) and pd.isna(r["efficiency"])
    assert r["above_ceiling"] == ("efficiency 106.0%: check that phase 1 had the host to itself (a GPU of phase 2 ran "
                                  "faster than the GPU alone)")
    assert pd.isna(r["speedup_lo"])                        # one batch a window: no interval
    md = "\n".join(scaling.scaling_section(table, scaling.gpu_rows(tmp_path, ["0", "1"]), {}))
    assert "| 2.12x | efficiency 106.0%: check that phase 1" in md
    from test_evidence import unflagged_above_100
    assert unflagged_above_100(md) == []


def write_child(root: Path, name: str, rows: list, starts: dict) -> Path:
    """A child run directory: throughput.csv rows {config, batch, pages_s, window_s, bound} and its
    spans (``starts``: config -> request start times [s])."""
    d = root / name
    d.mkdir(parents=True)
    table = pd.DataFrame([{c: r.get(c) for c in COLUMN_NAMES} for r in rows], columns=COLUMN_NAMES)
    table.to_csv(d / "throughput.csv", index=False)
    spans = [[cfg, i + 1, "request", t, t + 0.1] for cfg, ts in starts.items() for i, t in enumerate(ts)]
    pd.DataFrame(spans, columns=SPAN_COLUMNS).to_csv(d / "throughput_spans.csv", index=False)
    return d


def test_scaling_table_from_child_directories(tmp_path):
    # phase 1: b2 at 10 pages/s (5 batches of 2 in 1 s), b4 at 8; phase 2: b2 at 8 and 5 pages/s (8 and 5
    # batches in 2 s), b4 on GPU 0 only
    write_child(tmp_path, "alone-gpu0", [{"config": "b2", "batch": 2, "pages_s": 10.0, "window_s": 1.0, "bound": "decode"},
                                         {"config": "b4", "batch": 4, "pages_s": 8.0, "window_s": 1.0, "bound": "host"}],
                {"b2": [0.0, 0.2, 0.4, 0.6, 0.8], "b4": [0.0, 0.5]})
    write_child(tmp_path, "together-gpu0", [{"config": "b2", "batch": 2, "pages_s": 8.0, "window_s": 2.0, "bound": "decode"},
                                            {"config": "b4", "batch": 4, "pages_s": 7.0, "window_s": 1.0, "bound": "host"}],
                {"b2": [0.25 * i for i in range(8)], "b4": [0.0]})
    write_child(tmp_path, "together-gpu1-interrupted",
                [{"config": "b2", "batch": 2, "pages_s": 5.0, "window_s": 2.0, "bound": "vision"}],
                {"b2": [0.4 * i for i in range(5)]})
    folder = scaling.starts_folder(tmp_path, "together")
    folder.mkdir()
    for rank, t in ((0, 50.0), (1, 50.4)):
        barrier.record_path(folder, "b2", rank).write_text(json.dumps({"config": "b2", "rank": rank,
                                                                       "released_unix": t}))
    table = scaling.scaling_table(tmp_path, ["0", "1"], workers=3)
    assert list(table.columns) == scaling.SCALING_NAMES
    assert list(table["config"]) == ["b2"]                 # b4: GPU 1 of phase 2 did not finish it
    r = table.iloc[0]
    assert (r["batch"], r["gpus"], r["workers"], r["one_gpu_bound"]) == (2, 2, 3, "decode")
    assert r["aggregate_pages_s"] == pytest.approx(13.0)
    assert r["speedup"] == pytest.approx(1.3) and r["efficiency"] == pytest.approx(13.0 / 20.0)
    assert pd.isna(r["above_ceiling"])
    assert (r["gpu_pages_s_min"], r["gpu_pages_s_max"]) == (5.0, 8.0)
    assert r["bounds"] == "0: decode; 1: vision"
    assert r["windows_overlap"] == pytest.approx((52.0 - 50.4) / 2.0)
    # every window's cycles are equal (0.2 s; 0.25 s; 0.4 s): the interval is the point, 0.2 x (1/0.25 + 1/0.4)
    assert r["speedup_lo"] == pytest.approx(1.3) and r["speedup_hi"] == pytest.approx(1.3)
    rows = scaling.gpu_rows(tmp_path, ["0", "1"])
    assert list(zip(rows["phase"], rows["gpu"], rows["config"])) == [
        ("alone", "0", "b2"), ("alone", "0", "b4"), ("together", "0", "b2"), ("together", "0", "b4"),
        ("together", "1", "b2")]
    assert rows["run"].iloc[-1] == "together-gpu1-interrupted"


def test_the_report_side_needs_no_torch():
    blocked = ("import sys\nclass Blocked:\n    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in ('torch', 'triton'):\n            raise ModuleNotFoundError(name)\n"
               "sys.meta_path.insert(0, Blocked())\nimport harness.throughput.scaling, harness.throughput.barrier\n")
    res = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert res.returncode == 0, res.stderr


# ----------------------------------------------------------------------- the parent, fake children

FAKE_CHILD = textwrap.dedent('''
    """Stands in for ``python -m harness run``: writes a child run directory of one configuration (b2)
    at hydra.run.dir after the window barrier; pages/s 10 alone, 8 and 6 together on GPUs 0 and 1. The
    child that fails (FAKE_FAIL_GPU) or signals the parent (FAKE_SIGNAL_GPU) waits for its sibling at the
    barrier first."""
    import os, signal, sys, time
    from pathlib import Path
    import pandas as pd
    from harness.throughput import barrier
    from harness.schema.throughput import COLUMN_NAMES, SPAN_COLUMNS

    def stopped(signum, frame):
        print(f"interrupted: {signal.Signals(signum).name} during case b2 (1 of 1); 0 finished case(s) kept")
        sys.exit(128 + signum)
    signal.signal(signal.SIGINT, stopped)
    signal.signal(signal.SIGTERM, stopped)
    run_dir = Path(next(a for a in sys.argv if a.startswith("hydra.run.dir="))[len("hydra.run.dir="):].strip("'"))
    gpu, phase = os.environ["CUDA_VISIBLE_DEVICES"], Path(os.environ[barrier.ENV_DIR]).name.rsplit("-", 1)[1]
    workers = next(a for a in sys.argv if a.startswith("throughput.workers="))
    print(f"[harness] fake child on GPU {gpu}, {phase}, {workers}")
    def sibling_waits():
        other = barrier.record_path(os.environ[barrier.ENV_DIR], "b2", 1 - int(os.environ[barrier.ENV_RANK]))
        while not other.exists():
            time.sleep(0.01)
    if phase == "together" and gpu == os.environ.get("FAKE_FAIL_GPU"):
        sibling_waits()
        if os.environ.get("FAKE_CRASH"):
            os._exit(3)                     # no line: a crash
        print("error: a fake problem; fix: a fake fix")
        sys.exit(2)
    if phase == "together" and gpu == os.environ.get("FAKE_SIGNAL_GPU"):
        sibling_waits()
        os.kill(os.getppid(), signal.SIGINT)
        time.sleep(60)
    barrier.window_barrier("b2")
    run_dir.mkdir(parents=True)
    pages_s = 10.0 if phase == "alone" else {"0": 8.0, "1": 6.0}[gpu]
    row = {c: None for c in COLUMN_NAMES}
    row.update(config="b2", batch=2, pages_s=pages_s, window_s=1.0, bound="decode")
    pd.DataFrame([row], columns=COLUMN_NAMES).to_csv(run_dir / "throughput.csv", index=False)
    starts = [i * 2 / pages_s for i in range(int(pages_s / 2))]
    pd.DataFrame([["b2", i + 1, "request", t, t + 0.1] for i, t in enumerate(starts)],
                 columns=SPAN_COLUMNS).to_csv(run_dir / "throughput_spans.csv", index=False)
    (run_dir / "manifest.json").write_text('{"device": {"name": "Fake GPU"}, "throughput": {"mode": "base"}}')
''')


@pytest.fixture()
def fake(tmp_path, monkeypatch):
    script = tmp_path / "fake_child.py"
    script.write_text(FAKE_CHILD)
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "src"))
    cfg = HarnessConfig(throughput=ThroughputConfig(gpus="2"))
    plan = GpuPlan(("0", "1"), "CUDA_VISIBLE_DEVICES", 8, 2)
    lines: list = []

    class Hosts(Throughput):    # the throughput experiment over two fake GPUs, fake children
        def gpu_plan(self):
            return plan

        def task(self):
            return ["+experiment=throughput", "throughput.gpus=2"]

        def command(self, overrides):
            return [sys.executable, str(script), *overrides]

    def run():
        return run_experiment(cfg, tmp_path / "run", progress=lines.append, experiment=Hosts)
    return run, tmp_path, lines


def test_parent_adds_up_its_children(fake):
    run, tmp, lines = fake
    rd = run()
    man = json.loads((rd.path / "manifest.json").read_text())
    assert man["status"] == "complete" and man["device"] == {"name": "Fake GPU"}
    assert man["throughput_gpus"] == {"gpus": ["0", "1"], "source": "CUDA_VISIBLE_DEVICES", "cores": 8,
                                      "workers_per_gpu": 2}
    assert [c["name"] for c in man["cases"]] == ["b2"]
    table = pd.read_csv(rd.path / "scaling.csv")
    assert table["aggregate_pages_s"].tolist() == [14.0]
    assert table["speedup"].tolist() == pytest.approx([1.4]) and table["efficiency"].tolist() == pytest.approx([0.7])
    assert 0.0 < table["windows_overlap"].iloc[0] <= 1.0          # the barrier released both at once
    assert "[alone-gpu0] [harness] fake child on GPU 0, alone, throughput.workers=2" in lines
    assert (rd.path / "together-gpu1.log").read_text() == "[harness] fake child on GPU 1, together, throughput.workers=2\n"
    md = (rd.path / "report.md").read_text()
    assert "## Throughput over the GPUs of one host" in md and "| b2 | 2 | 10.00 (decode) | 14.00 | 1.40x [1.40x, 1.40x] | 70.0% |" in md


@pytest.mark.parametrize("crash, line, code", [
    ("", "error: GPU 1 (phase 2, all GPUs at once): a fake problem; fix: a fake fix", 2),
    ("1", "error: GPU 1 (phase 2, all GPUs at once) stopped: exit status 3; fix: read together-gpu1.log in the run "
     "directory", 1),
])
def test_a_failed_child_fails_the_parent_with_its_line(fake, monkeypatch, crash, line, code):
    run, tmp, _ = fake
    monkeypatch.setenv("FAKE_FAIL_GPU", "1")
    monkeypatch.setenv("FAKE_CRASH", crash)
    with pytest.raises(RunStopped) as err:
        run()
    assert err.value.line == line
    assert err.value.exit_code == code
    d = tmp / "run-failed"
    man = json.loads((d / "manifest.json").read_text())
    assert man["status"] == "failed" and man["cases"] == []
    assert pd.read_csv(d / "throughput_gpus.csv")["phase"].tolist() == ["alone"]   # phase 1 kept
    assert "interrupted: SIGTERM" in (d / "together-gpu0.log").read_text()         # its sibling was stopped


def test_sigint_stops_the_children_and_keeps_phase_1(fake, monkeypatch):
    run, tmp, _ = fake
    monkeypatch.setenv("FAKE_SIGNAL_GPU", "0")
    with pytest.raises(RunStopped) as err:
        run()
    d = tmp / "run-interrupted"
    assert err.value.exit_code == 130
    assert err.value.line == f"interrupted: SIGINT during case together (2 of 2); 0 finished case(s) kept in {d}"
    assert pd.read_csv(d / "throughput_gpus.csv")["phase"].tolist() == ["alone"]
    for gpu in ("0", "1"):
        assert "interrupted: SIGINT" in (d / f"together-gpu{gpu}.log").read_text()
    assert "Status **interrupted**" in (d / "report.md").read_text()
