"""RunDir status handling (guard, fail, append, stop), one directory per run, failed writes,
signals during a run, and the run progress printer."""
import io
import json
from pathlib import Path

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


# ------------------------------------------------------------- one directory per run (issue 15)

def test_claim_gives_each_caller_its_own_directory(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from harness.rundir import claim

    with ThreadPoolExecutor(max_workers=8) as pool:
        got = list(pool.map(lambda _: claim(tmp_path / "runs" / "20260101-000000-default"), range(8)))
    assert sorted(p.name for p in got) == sorted(["20260101-000000-default"] +
                                                 [f"20260101-000000-default-{n}" for n in range(2, 9)])


def test_a_directory_holding_a_run_is_never_reused(tmp_path):
    RunDir(tmp_path / "r", {}, argv=["t"])
    with pytest.raises(HarnessError, match="already holds a run"):
        RunDir(tmp_path / "r", {"other": 1}, argv=["t"])
    assert json.loads((tmp_path / "r" / "manifest.json").read_text())["config"] == {}


def test_claim_output_dir_hands_hydra_a_fresh_directory(tmp_path):
    from harness.cli import _compose_checked, claim_output_dir

    _, dirs = _compose_checked([f"run.root={tmp_path}", "run.name=x"])
    stamp = Path(dirs["hydra.run.dir"]).name
    assert Path(dirs["hydra.run.dir"]).parent == tmp_path and len(stamp) == len("20260101-000000-x") \
        and stamp.endswith("-x")
    first = claim_output_dir(["model=tiny", "hydra.run.dir=elsewhere"], dirs)   # the same second, twice
    second = claim_output_dir(["model=tiny"], dirs)
    assert first == (["model=tiny", f"hydra.run.dir='{tmp_path / stamp}'"], tmp_path / stamp)
    assert second == (["model=tiny", f"hydra.run.dir='{tmp_path / stamp}-2'"], tmp_path / f"{stamp}-2")
    assert claim_output_dir(["-m", "workload.batch=1,2"], dirs)[0][-1] == \
        f"hydra.sweep.dir='{dirs['hydra.sweep.dir']}'"
    assert claim_output_dir(["--cfg", "job"], dirs) == (["--cfg", "job"], None)   # prints only: nothing claimed
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([stamp, f"{stamp}-2",
                                                                 Path(dirs["hydra.sweep.dir"]).name])


# ---------------------------------------------------------------- failed writes (issue 15)

@pytest.fixture
def full_disk(monkeypatch):
    """HARNESS_FAULT=enospc:<file>[#K] for one test (harness.faults)."""
    from harness import faults

    monkeypatch.setattr(faults, "_writes", {})

    def set_fault(spec: str):
        monkeypatch.setenv("HARNESS_FAULT", spec)
    return set_fault


def test_failed_atomic_write_keeps_the_old_file_and_no_tmp(tmp_path, full_disk):
    rd = RunDir(tmp_path / "r", {}, argv=["t"])
    rd.write_csv("stages.csv", pd.DataFrame({"a": [1]}))
    full_disk("enospc:stages.csv")                          # from the next write on
    with pytest.raises(OSError) as exc:
        rd.write_csv("stages.csv", pd.DataFrame({"a": [1, 2]}))
    assert exc.value.errno == 28 and exc.value.filename == str(rd.path / "stages.csv")
    assert pd.read_csv(rd.path / "stages.csv")["a"].tolist() == [1]
    assert sorted(p.name for p in rd.path.iterdir()) == [".manifest-failed.json", "manifest.json", "stages.csv"]


def test_failed_append_is_cut_back(tmp_path, full_disk):
    rd = RunDir(tmp_path / "r", {}, argv=["t"])
    full_disk("enospc:kernels.csv#2")
    rd.append_csv("kernels.csv", pd.DataFrame({"a": [1]}))
    with pytest.raises(OSError):
        rd.append_csv("kernels.csv", pd.DataFrame({"a": [2, 3]}))
    assert (rd.path / "kernels.csv").read_text() == "a\n1\n"


def test_stop_renames_marks_and_saves_the_manifest_last(tmp_path):
    (tmp_path / "r-interrupted").mkdir()                      # the name is taken: the next one
    rd = RunDir(tmp_path / "r", {}, argv=["t"])
    rd.stop("interrupted", "interrupted by SIGTERM during the final report", stopped_at={"phase": "report"})
    assert rd.path.name == "r-interrupted-2" and not (tmp_path / "r").exists()
    assert json.loads((rd.path / "manifest.json").read_text())["status"] == "running"   # not yet saved
    assert rd.seal() is None
    man = json.loads((rd.path / "manifest.json").read_text())
    assert (man["status"], man["stopped_at"]) == ("interrupted", {"phase": "report"})
    assert (rd.path / "INTERRUPTED").read_text() == "interrupted by SIGTERM during the final report\n"
    assert (rd.path / "manifest.json").stat().st_mtime_ns >= (rd.path / "INTERRUPTED").stat().st_mtime_ns


def test_signal_guard_defers_inside_a_block_and_ignores_repeats():
    import os
    import signal

    from harness.interrupts import RunInterrupted, catch_signals

    before = signal.getsignal(signal.SIGTERM)
    written = []
    with pytest.raises(RunInterrupted) as exc:
        with catch_signals() as guard:
            with guard.deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGHUP)          # a repeat while stopping: ignored
                written.append("case")                       # the block completes first
    assert written == ["case"] and exc.value.name == "SIGTERM" and exc.value.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_report_that_cannot_be_rewritten_is_retried_without_charts_then_removed(tmp_path):
    import errno

    from harness.stopping import _rewrite_report

    rd = RunDir(tmp_path / "r", {}, argv=["t"])
    (rd.path / "report.md").write_text("Status **running** (written after the first case)\n")
    calls = []

    def charts_do_not_fit(r, d, plot=True):
        calls.append(plot)
        if plot:
            raise OSError(errno.ENOSPC, "No space left on device", str(r.path / "roofline.png"))
    assert _rewrite_report(rd, None, charts_do_not_fit) == [
        f"report.md rewritten without its charts (OSError: [Errno 28] No space left on device: "
        f"'{rd.path / 'roofline.png'}')"]
    assert calls == [True, False]

    def nothing_fits(r, d, plot=True):
        raise OSError(errno.ENOSPC, "No space left on device", str(r.path / "report.md"))
    said = _rewrite_report(rd, None, nothing_fits)
    assert said == [f"report.md not rewritten (OSError: [Errno 28] No space left on device: '{rd.path / 'report.md'}'); "
                    "the report.md written while the run went on was removed"]
    assert not (rd.path / "report.md").exists()


def _script(repo_root, name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, repo_root / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_stamped_revision_is_recorded_only_where_the_copied_files_match_it(repo_root, tmp_path, monkeypatch,
                                                                            capsys):
    """A checkout stamps its revision (scripts/device_stamp.py); on a copy of its files the stamp
    gives the export lines of that revision, not dirty, and git_revision records them and says so;
    after a tracked file changes (or without the stamp) nothing is exported and the reason is on
    stderr; a dirty checkout's stamp says dirty."""
    import subprocess
    from harness.rundir import git_revision

    stamp = _script(repo_root, "device_stamp")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("x = 1\n")
    run = lambda *a: subprocess.run(["git", *a], cwd=src, check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    run("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-m", "0")
    run("add", "a.py")
    run("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "1")
    rev = run("rev-parse", "HEAD").stdout.decode().strip()
    entry = stamp.stamp(src)
    assert entry["revision"] == rev and entry["dirty"] is False and entry["files"] == ["a.py"]

    copy = tmp_path / "copy"                         # the files only, as a device copy may arrive
    (copy / ".devstamp").mkdir(parents=True)
    (copy / "a.py").write_text("x = 1\n")
    (copy / ".devstamp" / "git.json").write_text((src / ".devstamp" / "git.json").read_text())
    assert stamp.env(copy) == f"export HARNESS_GIT_REVISION={rev}\nexport HARNESS_GIT_DIRTY=0\n"
    monkeypatch.setenv("HARNESS_GIT_REVISION", rev)
    monkeypatch.setenv("HARNESS_GIT_DIRTY", "0")
    got = git_revision(copy)
    assert got["revision"] == rev and got["dirty"] is False and "device_stamp" in got["from"]

    (copy / "a.py").write_text("x = 2\n")
    capsys.readouterr()
    assert stamp.env(copy) == "" and "differ from the stamp" in capsys.readouterr().err
    (copy / ".devstamp" / "git.json").unlink()
    assert stamp.env(copy) == "" and "no .devstamp" in capsys.readouterr().err

    (src / "a.py").write_text("x = 3\n")
    assert stamp.stamp(src)["dirty"] is True
    monkeypatch.delenv("HARNESS_GIT_REVISION")
    assert git_revision(src) == {"revision": rev, "dirty": True}
