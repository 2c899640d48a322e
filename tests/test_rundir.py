"""RunDir status handling (guard, fail, append) and the run progress printer."""
import io
import json

import pandas as pd
import pytest

from harness.errors import HarnessError
from harness.report.progress import RunProgress
from harness.rundir import RunDir


def test_guard_marks_failure_and_renames(tmp_path):
    rd = RunDir(tmp_path / "r1", {"x": 1}, argv=["t"])
    with pytest.raises(HarnessError):
        with rd.guard():
            raise HarnessError("bad page", "use another")
    assert rd.path.name == "r1-failed" and not (tmp_path / "r1").exists()
    man = json.loads((rd.path / "manifest.json").read_text())
    assert man["status"] == "failed" and man["error"] == "bad page; fix: use another"
    assert (rd.path / "FAILED").read_text().startswith("bad page")


def test_guard_leaves_success_running_until_complete(tmp_path):
    rd = RunDir(tmp_path / "r2", {}, argv=["t"])
    with rd.guard():
        rd.append_csv("k.csv", pd.DataFrame({"a": [1]}))
        rd.append_csv("k.csv", pd.DataFrame({"a": [2]}))
    assert json.loads((rd.path / "manifest.json").read_text())["status"] == "running"
    rd.complete()
    assert json.loads((rd.path / "manifest.json").read_text())["status"] == "complete"
    assert pd.read_csv(rd.path / "k.csv")["a"].tolist() == [1, 2]   # one header, both rows


def test_progress_prints_lines_without_a_terminal():
    out = io.StringIO()
    p = RunProgress(stream=out)
    p.start(3)
    p("base: repeat 1/3 request 10.0 ms (host)")
    p.stop()
    assert out.getvalue() == "base: repeat 1/3 request 10.0 ms (host)\n"


def test_load_run_reads_what_the_run_wrote(tmp_path):
    from harness.rundir import load_run

    rd = RunDir(tmp_path / "r3", {}, argv=["t"])
    a = pd.DataFrame({"case": ["a", "a"], "call": [0, 1], "step": [None, None], "stage": [None, None],
                      "dur_ms": [1.0, 2.0]})
    b = pd.DataFrame({"case": ["b"], "call": ["all"], "step": [3], "stage": ["sam"], "dur_ms": [4.0]})
    rd.append_csv("kernels.csv", a)
    rd.append_csv("kernels.csv", b)
    data = load_run(rd.path)
    assert data.kernels["call"].tolist() == ["0", "1", "all"] and data.kernels["case"].tolist() == ["a", "a", "b"]
    assert data.stages.empty and data.routing.empty and data.analytic is None
    assert data.manifest["status"] == "running"
