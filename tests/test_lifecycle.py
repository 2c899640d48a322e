"""The run lifecycle (``harness.lifecycle``) that every experiment shares, and "a new experiment is
a config plus at most one module":

* a tiny experiment written here (``SQUARES``: two cases, a CSV row each) as one module and one
  YAML in a copy of the config tree (``HARNESS_CONF``) runs through ``python -m harness run
  +experiment=squares``: a complete run directory that ``summarize`` reads; SIGINT while its second
  case starts keeps the first (exit 130, the one line);
* in this process: the report pacer and the rewrites between cases, a case a signal stopped kept
  whole, an error closing the run as failed, and the one-line refusals of a module that is not
  there or defines no experiment.

The subprocesses start with the session's background runs (tests/conftest.py).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from conftest import cli_env, main_lines
from harness.config import HarnessConfig, ThroughputConfig
from harness.errors import HarnessError, RunStopped
from harness.lifecycle import Experiment, ReportPacer, experiment_class, run_experiment

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240
ENV = cli_env("HARNESS_FAULT")

#: the whole of a new experiment's module: two cases, case k writes the row (k, k^2) to squares.csv
SQUARES = '''
import pandas as pd

from harness.lifecycle import Experiment


class Squares(Experiment):
    def measure(self, run):
        names = ["one", "two"]
        run.where.cases = len(names)
        run.begin_cases()
        for k, name in enumerate(names, 1):
            run.where.at("case", name, k)
            with run.case_written(k, len(names)):
                run.rd.append_csv("squares.csv", pd.DataFrame({"case": [name], "k": [k], "k2": [k * k]}))
                run.rd.manifest["cases"].append({"name": name})
                run.rd.save()

    def write(self, run, plot=True, final=True):
        return {"report": run.rd.write_text("report.md", f"# squares: {len(run.rd.manifest['cases'])} case(s)\\n")}


EXPERIMENT = Squares
'''
SQUARES_YAML = "# @package _global_\nexperiment_name: squares\nexperiment_module: squares_experiment\n"


def squares_run(tmp: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    """``python -m harness run +experiment=squares`` with the experiment's YAML in a copy of the
    config tree and its module on the path (``HARNESS_FAULT=fault`` when given)."""
    from harness.conf_tree import CONF_DIR

    conf, code = tmp / "conf", tmp / "code"
    shutil.copytree(CONF_DIR, conf)
    (conf / "experiment" / "squares.yaml").write_text(SQUARES_YAML)
    code.mkdir()
    (code / "squares_experiment.py").write_text(SQUARES)
    env = {**ENV, "HARNESS_CONF": str(conf),
           "PYTHONPATH": os.pathsep.join(p for p in (str(code), ENV.get("PYTHONPATH")) if p)}
    if fault:
        env["HARNESS_FAULT"] = fault
    cmd = [sys.executable, "-m", "harness", "run", "+experiment=squares", "model=tiny", f"run.root={tmp / 'runs'}"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)


def start_runs(tmp_path_factory, submit) -> dict:
    tmp = tmp_path_factory.mktemp("lifecycle")
    return {"complete": submit(squares_run, tmp / "complete"),
            "sigint": submit(squares_run, tmp / "sigint", "signal:SIGINT@case=2")}


def _only_dir(root: Path) -> Path:
    dirs = [p for p in root.iterdir() if p.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


def test_a_new_experiment_is_a_config_and_one_module(runs, tmp_path, capsys):
    proc = runs["complete"].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    d = _only_dir(Path(proc.args[-1].split("=", 1)[1]))
    man = json.loads((d / "manifest.json").read_text())
    assert man["status"] == "complete" and [c["name"] for c in man["cases"]] == ["one", "two"]
    assert man["config"]["experiment_module"] == "squares_experiment" and d.name.endswith("-squares")
    assert pd.read_csv(d / "squares.csv").to_dict("list") == {"case": ["one", "two"], "k": [1, 2], "k2": [1, 4]}
    assert (d / "report.md").read_text() == "# squares: 2 case(s)\n"
    # the lifecycle's own parts: the launch, the timing phases, the three closing lines
    assert man["launch"]["pid"] > 0 and {"set-up", "report"} <= set(man["timing"]["phases_s"])
    said = [ln for ln in proc.stdout.splitlines() if ln.startswith("[harness] ")]
    assert said[0] == f"[harness] report: {d / 'report.md'}" and said[1].startswith("[harness] time ")
    assert said[2] == f"[harness] wrote {d}"
    # summarize reads it: one row, status complete, no cases of stages.csv
    from harness.report.summarize import summarize_main

    assert summarize_main([str(d), "--out", str(tmp_path / "summary")]) == 0
    row = pd.read_csv(tmp_path / "summary" / "summary.csv").iloc[0]
    assert row["status"] == "complete" and Path(row["run_dir"]).name == d.name


def test_sigint_in_a_new_experiment_keeps_its_finished_case(runs):
    proc = runs["sigint"].result()
    assert proc.returncode == 130, proc.stderr[-3000:]
    d = _only_dir(Path(proc.args[-1].split("=", 1)[1]))
    assert d.name.endswith("-squares-interrupted")
    assert [ln for ln in proc.stderr.splitlines() if ln.strip()] == [
        f"interrupted: SIGINT during case two (2 of 2); 1 finished case(s) kept in {d}"]
    man = json.loads((d / "manifest.json").read_text())
    assert man["status"] == "interrupted" and [c["name"] for c in man["cases"]] == ["one"]
    assert list(pd.read_csv(d / "squares.csv")["case"]) == ["one"]
    assert (d / "report.md").read_text() == "# squares: 1 case(s)\n" and (d / "INTERRUPTED").is_file()


# ------------------------------------------------------------------------------ in this process

class Recorded(Experiment):
    """Three cases; ``write`` calls recorded as (cases kept, plot, final); ``pace``: the report pacer's
    interval; ``stop``: (case, exception) raised by the case's write block after its row is kept
    (``stopped``), or before it (``fail``)."""

    pace, stop, fail = 1e9, None, None

    def data(self, rd):
        self.writes = []
        return super().data(rd)

    def measure(self, run):
        run.reports = ReportPacer(every_s=self.pace)
        run.where.cases = 3
        run.begin_cases()
        for k in (1, 2, 3):
            run.where.at("case", f"c{k}", k)
            if self.fail and self.fail[0] == k:
                raise self.fail[1]
            stopped = self.stop[1] if self.stop and self.stop[0] == k else None
            with run.case_written(k, 3, stopped=stopped):
                run.rd.manifest["cases"].append({"name": f"c{k}"})
                run.rd.save()

    def write(self, run, plot=True, final=True):
        self.writes.append((len(run.rd.manifest["cases"]), plot, final))
        return {}


def _run(tmp_path, **kind) -> tuple:
    """(run_experiment's RunDir or RunStopped, the experiment) of a ``Recorded`` with ``kind``'s settings."""
    made = []

    def experiment(cfg):
        made.append(type("R", (Recorded,), kind)(cfg))
        return made[0]

    try:
        out = run_experiment(HarnessConfig(), tmp_path / "run", progress=lambda m: None, experiment=experiment)
    except RunStopped as exc:
        out = exc
    return out, made[0]


def test_the_report_pacer_counts_from_the_last_rewrite():
    now = [100.0]
    pace = ReportPacer(every_s=60.0, clock=lambda: now[0])
    now[0] = 159.0
    assert not pace.due()              # 59 s after the cases started
    now[0] = 160.0
    assert pace.due()                  # 60 s
    pace.written()
    now[0] = 219.5
    assert not pace.due()              # 59.5 s after that rewrite


@pytest.mark.parametrize("pace, writes", [
    (0.0, [(1, False, False), (2, False, False), (3, True, True)]),   # due after every case but the last
    (1e9, [(3, True, True)]),                                         # never due: the final report alone
])
def test_report_rewrites_between_cases_are_paced(tmp_path, pace, writes):
    rd, exp = _run(tmp_path, pace=pace)
    assert exp.writes == writes
    assert json.loads((rd.path / "manifest.json").read_text())["status"] == "complete"


def test_a_case_stopped_by_a_signal_is_kept_and_closes_the_run(tmp_path):
    stopped, exp = _run(tmp_path, stop=(2, KeyboardInterrupt()))
    assert stopped.exit_code == 130 and stopped.run_dir.name == "run-interrupted"
    assert stopped.line == f"interrupted: SIGINT during case c2 (2 of 3); 2 finished case(s) kept in {stopped.run_dir}"
    assert exp.writes == [(2, True, True)]     # the close rewrites the report from the kept cases
    man = json.loads((stopped.run_dir / "manifest.json").read_text())
    assert man["status"] == "interrupted" and len(man["cases"]) == 2 and "total_s" in man["timing"]


@pytest.mark.parametrize("exc, code, line", [
    (HarnessError("a page is missing", "add it"), 2, "error: a page is missing; fix: add it"),
    (RuntimeError("boom"), 1, "error: internal error: RuntimeError: boom (during case c2 (2 of 3)); fix: report it "
                              "as a harness bug with {d}/manifest.json (its traceback field) (1 finished case(s) "
                              "kept in {d})"),
])
def test_an_error_closes_the_run_as_failed(tmp_path, exc, code, line):
    stopped, exp = _run(tmp_path, fail=(2, exc))
    d = stopped.run_dir
    assert (stopped.exit_code, d.name, stopped.line) == (code, "run-failed", line.format(d=d))
    man = json.loads((d / "manifest.json").read_text())
    assert man["status"] == "failed" and [c["name"] for c in man["cases"]] == ["c1"]
    assert ("traceback" in man) == (code == 1) and exp.writes == [(1, True, True)]


def test_the_experiment_module_is_checked():
    with pytest.raises(HarnessError) as err:
        experiment_class(HarnessConfig(experiment_module="harness.no_such_experiment"))
    assert str(err.value) == ("experiment_module=harness.no_such_experiment: no module of that name here; fix: name "
                              "a module that defines EXPERIMENT, a harness.lifecycle.Experiment (e.g. harness.run), "
                              "or drop it")
    with pytest.raises(HarnessError, match=r"^experiment_module=harness.timeline defines no EXPERIMENT"):
        experiment_class(HarnessConfig(experiment_module="harness.timeline"))
    from harness.run import Stages
    from harness.throughput.pipeline import Throughput

    assert experiment_class(HarnessConfig()) is Stages
    assert experiment_class(HarnessConfig(experiment_module="harness.throughput.pipeline",
                                          throughput=ThroughputConfig())) is Throughput
    with pytest.raises(HarnessError, match=r"needs the throughput settings.*fix: run \+experiment=throughput$"):
        experiment_class(HarnessConfig(experiment_module="harness.throughput.pipeline"))
    with pytest.raises(HarnessError, match=r"^throughput\.\* is set, and experiment_module=harness.run"):
        experiment_class(HarnessConfig(throughput=ThroughputConfig()))


def test_a_module_that_is_not_there_ends_before_any_run_directory(capsys, tmp_path):
    rc, lines = main_lines(capsys, ["run", "experiment_module=harness.nope", "model=tiny", f"run.root={tmp_path}"])
    assert rc == 2 and lines == ["error: experiment_module=harness.nope: no module of that name here; fix: name a "
                                 "module that defines EXPERIMENT, a harness.lifecycle.Experiment (e.g. harness.run), "
                                 "or drop it"]
    assert not any(tmp_path.iterdir())
