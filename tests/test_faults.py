"""Faults a run must survive, end to end (issue 15): ``python -m harness run`` as a subprocess on
the tiny model, with a fault injected through ``HARNESS_FAULT`` (``harness.faults``).

* two runs started together into one directory name: both kept, in distinct directories, both
  complete, neither holding the other's files (these two runs are also the page-folder runs:
  mixed tile grids at batch 1 and 2, every page measured, names carrying batch and pages);
* SIGINT / SIGTERM / SIGHUP during a warm-up, a timed repeat, between cases and during the final
  report: exit 128 + signal, one ``interrupted: ...`` line, status ``interrupted`` naming the case
  and request, finished cases kept in the CSVs and the manifest, ``-interrupted`` suffix;
* SIGINT inside a case of 100,000 repeats (injected before repeat 5, and sent from outside once a
  few repeats finished): the finished repeats kept (observations, steps, routing), the case marked
  ``partial`` with ``repeats_done`` in the manifest and the report, exit 130, the line counting it;
* a full disk (ENOSPC) while a case's stages.csv and while report.md are written: exit 1, one
  ``error: ...`` line, status ``failed``, no ``*.tmp`` / ``*.tmp.png`` left, ``-failed`` suffix;
* a REAL full disk (a tmpfs of a few hundred KB in a user and mount namespace, filled to leave 0,
  12 and 120 KB): the same line and status wherever the disk fills (Hydra's own files included),
  and the line's count of kept cases equal to the manifest's and the CSVs' (skipped with the
  reason where the machine allows no such mount);
* a vendor config whose ``auto_map`` points at the hub: exit 2 before any model is built;
* ``compare`` on garbage, a folder without a manifest, a failed and an empty run.

All subprocesses start with the session's background runs (tests/conftest.py), 3 at a time.
"""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from conftest import cli_env

ROOT = Path(__file__).resolve().parents[1]
TINY_MODE = "workload.mode={name: t, base_size: 128, image_size: 64, crop: true}"
FAST = ["model=tiny", TINY_MODE, "workload.decode_tokens=3", "measure.repeats=1", "measure.warmup=0"]
TWO_CASES = "cases=[{name: a}, {name: b}]"
#: a case that would run for days: 100,000 timed repeats (2 decode steps each), then a profiled request
MANY = ["model=tiny", TINY_MODE, "workload.decode_tokens=3", "measure.repeats=100000", "measure.warmup=0",
        "measure.kernels=true"]
TIMEOUT_S = 240
ENV = cli_env("HARNESS_FAULT")

#: the page folder: name -> (width, height) in pixels and its tile grid in the tiny mode
PAGES = {"p001.png": ((120, 180), "2x3"), "p002.png": ((200, 100), "4x2"), "p003.png": ((120, 180), "2x3"),
         "p004.png": ((200, 100), "4x2"), "p005.png": ((50, 50), None)}
BATCH1 = ["t-2x3-p001", "t-4x2-p002", "t-2x3-p003", "t-4x2-p004", "t-p005"]
BATCH2 = ["t-2x3-b2-p001+p003", "t-4x2-b2-p002+p004", "t-b2-p005"]


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str
    root: Path

    def dirs(self) -> list:
        return sorted(p for p in self.root.iterdir() if p.is_dir()) if self.root.exists() else []

    def only_dir(self) -> Path:
        dirs = self.dirs()
        assert len(dirs) == 1, (dirs, self.describe())
        return dirs[0]

    def line(self) -> str:
        """The one stderr line (asserted to be the only one)."""
        lines = [ln for ln in self.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1, self.describe()
        assert "Traceback" not in self.stdout, self.describe()
        return lines[0]

    def describe(self) -> str:
        return f"rc={self.rc}\n--- stderr ---\n{self.stderr[-3000:]}\n--- stdout ---\n{self.stdout[-2000:]}"


def harness(root: Path, overrides: list, fault: str | None = None, ignore_sighup: bool = False) -> Result:
    """``python -m harness run`` with ``fault`` injected; ``ignore_sighup``: started as ``nohup`` does
    (SIGHUP ignored before the process starts)."""
    env = dict(ENV)
    if fault:
        env["HARNESS_FAULT"] = fault
    cmd = [sys.executable, "-m", "harness", "run", *overrides, f"run.root={root}"]
    nohup = (lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)) if ignore_sighup else None
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, env=env,
                          preexec_fn=nohup)
    return Result(proc.returncode, proc.stdout, proc.stderr, root)


def harness_interrupted(root: Path, overrides: list, after: int) -> Result:
    """``python -m harness run`` sent SIGINT from outside once its ``after``-th timed repeat printed
    its line (progress lines go to stdout, flushed)."""
    cmd = [sys.executable, "-m", "harness", "run", *overrides, f"run.root={root}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    out = []
    try:
        for line in proc.stdout:
            out.append(line)
            if f": repeat={after - 1} (" in line:
                proc.send_signal(signal.SIGINT)
                break
        out += proc.stdout.readlines()
        err = proc.stderr.read()
        proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    return Result(proc.returncode, "".join(out), err, root)


def write_pages(folder: Path) -> Path:
    """PAGES as PNG files; p004 is 16-bit grayscale with values 0..4000."""
    from PIL import Image

    folder.mkdir(parents=True)
    for name, ((w, h), _) in PAGES.items():
        if name == "p004.png":
            Image.fromarray((np.arange(w * h).reshape(h, w) % 4001).astype(np.uint16)).save(folder / name)
        else:
            Image.new("RGB", (w, h), (250, 250, 250)).save(folder / name)
    return folder


def hub_vendor_dir(path: Path) -> Path:
    """A vendor directory with every code file, whose config.json maps AutoModel to hub code."""
    from harness.models.vendor.loader import VENDOR_CODE_FILES

    path.mkdir(parents=True)
    for f in VENDOR_CODE_FILES:
        (path / f).write_text("")
    (path / "config.json").write_text(json.dumps({
        "model_type": "deepseek_vl_v2",
        "auto_map": {"AutoConfig": "configuration_deepseek_v2.DeepseekV2Config",
                     "AutoModel": "someone/elsewhere--modeling_deepseekocr.DeepseekOCRForCausalLM"}}))
    return path


#: a real tiny disk: a tmpfs of TMPFS_KB, filled to leave each of these free (KB): nothing (the run
#: directory cannot be made), about the run directory's first files (Hydra's own files fail), and
#: room for part of the run (a case's files or the report fail)
TMPFS_KB, REAL_FREE_KB = 400, (0, 12, 120)


def _tmpfs_reason():
    """None when a tmpfs can be mounted in a user and mount namespace here, else why not."""
    import tempfile

    if not shutil.which("unshare"):
        return "no unshare(1) on this machine"
    with tempfile.TemporaryDirectory() as d:
        for flags in (["-rm"], ["-m"]):
            probe = subprocess.run(["unshare", *flags, "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {d}"],
                                   capture_output=True, text=True, timeout=30)
            if probe.returncode == 0:
                return None
    return f"cannot mount a tmpfs in a namespace here ({probe.stderr.strip()[:120]})"


TMPFS_REASON = _tmpfs_reason()


def harness_on_tmpfs(tmp: Path, free_kb: int) -> Result:
    """Two cases run into a fresh tmpfs with ``free_kb`` KB left free; the tmpfs exists only in
    the namespace, so what the run left there is copied to ``tmp/runs`` before it ends."""
    mnt, out = tmp / "mnt", tmp / "runs"
    mnt.mkdir(parents=True)
    fill_kb = TMPFS_KB - free_kb
    args = " ".join(f"'{a}'" for a in [*FAST, TWO_CASES, f"run.root={mnt}/runs"])
    script = (f"mount -t tmpfs -o size={TMPFS_KB}k tmpfs {mnt} || exit 99\n"
              f"head -c {fill_kb * 1024} /dev/zero > {mnt}/filler 2>/dev/null\n"
              f"'{sys.executable}' -m harness run {args}\nrc=$?\n"
              f"mkdir -p {out} && cp -a {mnt}/runs/. {out}/ 2>/dev/null\nexit $rc\n")
    for flags in (["-rm"], ["-m"]):
        proc = subprocess.run(["unshare", *flags, "sh", "-c", script], cwd=ROOT, capture_output=True, text=True,
                              timeout=TIMEOUT_S, env=ENV)
        if proc.returncode != 99:
            break
    out.mkdir(parents=True, exist_ok=True)
    return Result(proc.returncode, proc.stdout, proc.stderr, out)


def start_runs(tmp_path_factory, submit) -> dict:
    """Every faulty run, started with the session's background runs (tests/conftest.py); id -> Future[Result]."""
    tmp = tmp_path_factory.mktemp("faults")
    pages = write_pages(tmp / "pages")
    same = tmp / "runs" / "same"
    jobs = {
        # the first two run into the same directory name, started together
        "pages-b1": ([*FAST, f"workload.images={pages}", f"hydra.run.dir={same / 'shared'}"], None),
        "pages-b2": ([*FAST, f"workload.images={pages}", "workload.batch=2", "workload.repeat_pages=true",
                      f"hydra.run.dir={same / 'shared'}"], None),
        "sigint-repeat": (FAST, "signal:SIGINT@case=1,repeat=0"),
        "sigint-partial": (MANY, "signal:SIGINT@case=1,repeat=5"),
        "sigterm-warmup": ([*FAST, "measure.warmup=1"], "signal:SIGTERM@case=1,warmup=0"),
        "sigterm-between": ([*FAST, TWO_CASES], "signal:SIGTERM@case=1,done"),
        "sighup-report": (FAST, "signal:SIGHUP@report"),
        "sigterm-start": (FAST, "signal:SIGTERM@start"),
        "enospc-stages": ([*FAST, TWO_CASES], "enospc:stages.csv#2"),
        "enospc-report": (FAST, "enospc:report.md"),
        "hub-auto-map": (["model=vendor", f"model.path={hub_vendor_dir(tmp / 'vendor-hub')}", TINY_MODE], None),
    }
    futures = {name: submit(harness, same if name.startswith("pages") else tmp / "runs" / name, ov, fault)
               for name, (ov, fault) in jobs.items()}
    futures["nohup"] = submit(harness, tmp / "runs" / "nohup", FAST, "signal:SIGHUP@case=1,repeat=0", True)
    futures["sigint-live"] = submit(harness_interrupted, tmp / "runs" / "sigint-live", MANY, 3)
    if TMPFS_REASON is None:
        for free_kb in REAL_FREE_KB:
            futures[f"real-{free_kb}"] = submit(harness_on_tmpfs, tmp / f"real-{free_kb}", free_kb)
    return futures


def _manifest(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())


def _stages(d: Path) -> pd.DataFrame:
    return pd.read_csv(d / "stages.csv")


def _no_tmp(d: Path) -> None:
    """No temporary file (``*.tmp``, ``*.tmp.png``, ...) and no prepared failed manifest left."""
    from harness.rundir import SPARE

    left = [p for p in d.rglob("*") if ".tmp" in p.name or p.name == SPARE]
    assert not left, sorted(p.name for p in d.iterdir())


# ---------------------------------------------------------- simultaneous runs, folders of pages

def test_two_runs_into_one_name_keep_both(runs):
    b1, b2 = runs["pages-b1"].result(), runs["pages-b2"].result()
    assert b1.rc == 0, b1.describe()
    assert b2.rc == 0, b2.describe()
    dirs = b1.dirs()
    assert [d.name for d in dirs] == ["shared", "shared-2"]
    by_cases = {}
    for d in dirs:
        man = _manifest(d)
        assert man["status"] == "complete", man.get("error")
        assert (d / ".hydra" / "config.yaml").is_file() and (d / "report.md").is_file()
        names = [c["name"] for c in man["cases"]]
        assert list(dict.fromkeys(_stages(d)["case"])) == names     # this run's cases only, in order
        by_cases[tuple(names)] = d
    assert set(by_cases) == {tuple(BATCH1), tuple(BATCH2)}
    for res in (b1, b2):                                           # each says where it wrote
        wrote = [ln for ln in res.stdout.splitlines() if ln.startswith("[harness] wrote ")]
        assert len(wrote) == 1
    assert {b1.stdout.split("[harness] wrote ")[1].split()[0], b2.stdout.split("[harness] wrote ")[1].split()[0]} \
        == {str(d) for d in dirs}


def test_page_folder_every_page_measured_in_batches_of_one_layout(runs):
    runs["pages-b1"].result(), runs["pages-b2"].result()
    root = runs["pages-b1"].result().root
    for d in root.iterdir():
        man = _manifest(d)
        cases = {c["name"]: c for c in man["cases"]}
        if "t-p005" in cases:                                       # batch 1: one case per page
            assert {n: (c["batch"], c["grid"], c["pages"]) for n, c in cases.items()} == {
                "t-2x3-p001": (1, "2x3", ["p001.png"]), "t-4x2-p002": (1, "4x2", ["p002.png"]),
                "t-2x3-p003": (1, "2x3", ["p003.png"]), "t-4x2-p004": (1, "4x2", ["p004.png"]),
                "t-p005": (1, None, ["p005.png"])}
        else:                                                       # batch 2: pages grouped by grid
            assert {n: (c["batch"], c["grid"], c["pages"]) for n, c in cases.items()} == {
                "t-2x3-b2-p001+p003": (2, "2x3", ["p001.png", "p003.png"]),
                "t-4x2-b2-p002+p004": (2, "4x2", ["p002.png", "p004.png"]),
                "t-b2-p005": (2, None, ["p005.png", "p005.png"])}
            assert ("t-b2-p005: batch of 2 copies of 1 page (workload.repeat_pages=true): identical rows route "
                    "identically, so its tok/s and MBU do not describe a batch of distinct pages") in man["warnings"]
            assert [c["pages_label"] for c in cases.values()] == ["batch of 2 distinct pages"] * 2 + [
                "batch of 2 copies of 1 page"]
        assert "p004.png: I;16 pixels (values 0..4000) scaled linearly to 8 bits" in man["warnings"]
        st = _stages(d)
        req = st[(st["stage"] == "request") & (st["repeat"] == 0)]
        assert sorted(req["case"]) == sorted(cases) and (req["batch"].astype(int) == [cases[c]["batch"]
                                                                                     for c in req["case"]]).all()


# ----------------------------------------------------------------------------------- signals

def _interrupted(res: Result, signame: str, code: int, where: str, kept: int) -> Path:
    assert res.rc == code, res.describe()
    d = res.only_dir()
    assert d.name.endswith("-default-interrupted"), d
    assert res.line() == (f"interrupted: {signame} during {where}; {kept} finished case(s) kept in {d}")
    man = _manifest(d)
    assert man["status"] == "interrupted" and man["finished"]
    assert man["error"] == f"interrupted by {signame} during {where}"
    assert (d / "INTERRUPTED").read_text() == man["error"] + "\n"
    assert len(man["cases"]) == kept
    md = (d / "report.md").read_text()
    assert "Status **interrupted**" in md and f"Partial: the run interrupted after {kept} finished case(s)" in md
    _no_tmp(d)
    return d


def test_sigint_during_a_timed_repeat(runs):
    d = _interrupted(runs["sigint-repeat"].result(), "SIGINT", 130, "case t-2x3 (1 of 1), repeat=0", 0)
    assert not (d / "stages.csv").exists()
    assert _manifest(d)["stopped_at"] == {"phase": "case", "case": "t-2x3", "case_index": 1, "cases": 1,
                                          "request": "repeat=0"}


def _partial(res: Result, where: str, done: int) -> Path:
    """A run SIGINT stopped inside its one case after ``done`` timed repeats (2 decode steps each)."""
    assert res.rc == 130, res.describe()
    d = res.only_dir()
    assert d.name.endswith("-default-interrupted"), d
    assert res.line() == (f"interrupted: SIGINT during case t-2x3 (1 of 1), {where}; 0 finished case(s) and 1 partial "
                          f"case (t-2x3: {done} of 100000 timed repeats, no profiled request) kept in {d}")
    man = _manifest(d)
    assert man["status"] == "interrupted" and man["error"] == f"interrupted by SIGINT during case t-2x3 (1 of 1), {where}"
    case = man["cases"][0]
    assert len(man["cases"]) == 1 and (case["name"], case["partial"], case["repeats_done"], case["repeats_planned"],
                                       case["profiled"], case["timed_wall_ms"]) == ("t-2x3", True, done, 100000,
                                                                                    False, None)
    st = _stages(d)
    assert sorted(set(st["repeat"])) == list(range(done)) and not st["profiled"].any()
    assert len(st[st["stage"] == "request"]) == done
    steps = pd.read_csv(d / "steps.csv")
    assert len(steps) == 2 * done and sorted(set(steps["repeat"])) == list(range(done))
    assert set(pd.read_csv(d / "routing.csv")["case"]) == {"t-2x3"} and (d / "routing_steps.csv").is_file()
    assert not (d / "kernels.csv").exists()
    md = (d / "report.md").read_text()
    assert "Status **interrupted**" in md and f"| t-2x3 | t | 2x3 | 1 | 16 / 29 / 3 | 0 + {done} |" in md
    assert (f"- **Partial case t-2x3**: interrupted after {done} of 100000 timed repeats, no profiled request (no "
            "kernels, busy or idle); its medians and spreads are over those repeats.") in md
    assert (f"Partial: the run interrupted after 0 finished case(s) and 1 partial case (t-2x3: {done} of 100000 "
            "timed repeats, no profiled request)") in md
    _no_tmp(d)
    return d


def test_sigint_inside_a_long_case_keeps_its_finished_repeats(runs):
    """Injected right before repeat 5: exactly repeats 0-4 kept."""
    _partial(runs["sigint-partial"].result(), "repeat=5", 5)


def test_sigint_from_outside_keeps_what_finished(runs):
    """A real SIGINT once repeat 3 printed its line: it lands wherever the run is (inside a request, or
    between two); what the files hold is whole repeats, as many as the manifest and the line say."""
    res = runs["sigint-live"].result()
    man = _manifest(res.only_dir())
    done = man["cases"][0]["repeats_done"]
    # inside request `done` (unfinished, not kept), or after request done - 1 finished and before the next began
    where = man["stopped_at"]["request"]
    assert done >= 3 and where in (f"repeat={done}", f"repeat={done - 1}"), (done, where)
    _partial(res, where, done)


def test_sigterm_during_a_warmup(runs):
    d = _interrupted(runs["sigterm-warmup"].result(), "SIGTERM", 143, "case t-2x3 (1 of 1), warmup=0", 0)
    assert not (d / "stages.csv").exists()


def test_sigterm_between_cases_keeps_the_first(runs):
    d = _interrupted(runs["sigterm-between"].result(), "SIGTERM", 143,
                     "case a (1 of 2), after its results were written", 1)
    assert [c["name"] for c in _manifest(d)["cases"]] == ["a"]
    assert set(_stages(d)["case"]) == {"a"} and set(pd.read_csv(d / "routing.csv")["case"]) == {"a"}
    assert "| a |" in (d / "report.md").read_text()


def test_sighup_during_the_report_keeps_everything(runs):
    d = _interrupted(runs["sighup-report"].result(), "SIGHUP", 129, "the final report", 1)
    assert set(_stages(d)["case"]) == {"t-2x3"}
    for f in ("analytic.csv", "roofline.csv", "roofline.png", "routing.csv"):
        assert (d / f).is_file(), f


def test_a_signal_while_the_harness_starts_marks_the_directory(runs):
    res = runs["sigterm-start"].result()
    assert res.rc == 143, res.describe()
    d = res.only_dir()
    assert d.name.endswith("-default-interrupted"), d
    error = "interrupted by SIGTERM while the harness was starting (no case started)"
    assert res.line() == f"interrupted: {error.removeprefix('interrupted by ')}; 0 finished case(s) kept in {d}"
    man = _manifest(d)
    assert (man["status"], man["error"], man["cases"]) == ("interrupted", error, [])
    assert (d / "INTERRUPTED").read_text() == error + "\n"
    assert sorted(p.name for p in d.iterdir()) == ["INTERRUPTED", "manifest.json"]   # Hydra never started


def test_nohup_protects_a_run_from_sighup(runs):
    """SIGHUP ignored when the process starts (``nohup``) stays ignored: the hang-up during a timed
    repeat does nothing, and the run completes."""
    res = runs["nohup"].result()
    assert res.rc == 0, res.describe()
    d = res.only_dir()
    assert _manifest(d)["status"] == "complete" and not d.name.endswith("-interrupted")
    assert set(_stages(d)["case"]) == {"t-2x3"}


# --------------------------------------------------------------------------------- full disk

def test_full_disk_while_writing_the_second_case(runs):
    res = runs["enospc-stages"].result()
    assert res.rc == 1, res.describe()
    d = res.only_dir()
    assert d.name.endswith("-default-failed") and (d / "FAILED").is_file()
    error = "cannot write stages.csv (No space left on device) during case b (2 of 2), while writing its results"
    assert res.line() == (f"error: {error}; fix: free space on that disk or point run.root at another one, then "
                          f"run again (1 finished case(s) kept in {d})")
    man = _manifest(d)
    assert man["status"] == "failed" and man["error"] == error and "traceback" in man
    assert [c["name"] for c in man["cases"]] == ["a"] and set(_stages(d)["case"]) == {"a"}
    assert "Status **failed**" in (d / "report.md").read_text()
    _no_tmp(d)


def test_full_disk_while_writing_the_report(runs):
    res = runs["enospc-report"].result()
    assert res.rc == 1, res.describe()
    d = res.only_dir()
    assert d.name.endswith("-default-failed") and (d / "FAILED").is_file()
    man = _manifest(d)
    assert man["status"] == "failed"
    assert man["error"] == "cannot write report.md (No space left on device) during the final report"
    assert man["report_error"].startswith("OSError: [Errno 28] No space left on device")
    line = res.line()
    assert line.startswith(f"error: {man['error']}; fix: free space") and "report.md not rewritten" in line
    assert not (d / "report.md").exists() and set(_stages(d)["case"]) == {"t-2x3"}
    _no_tmp(d)


@pytest.mark.skipif(TMPFS_REASON is not None, reason=str(TMPFS_REASON))
@pytest.mark.parametrize("free_kb", REAL_FREE_KB)
def test_a_real_full_disk_ends_failed_with_what_the_files_hold(runs, free_kb):
    import re

    res = runs[f"real-{free_kb}"].result()
    assert res.rc == 1, res.describe()
    line = res.line()
    assert line.startswith("error: ") and "(No space left on device" in line, line
    assert "; fix: free space on that disk or point run.root at another one" in line, line
    dirs = res.dirs()
    if not dirs:      # not even the run directory could be made: nothing is left behind
        assert line.startswith("error: cannot create the run directory"), line
        return
    assert len(dirs) == 1 and dirs[0].name.endswith("-default-failed"), dirs
    d = dirs[0]
    man = _manifest(d)
    assert man["status"] == "failed" and (d / "FAILED").is_file()
    _no_tmp(d)
    kept = int(re.search(r"(\d+) finished case\(s\) kept in ", line).group(1))
    names = [c["name"] for c in man["cases"]]
    assert len(names) == kept and names == ["a", "b"][:kept]
    for table in ("stages.csv", "routing.csv", "routing_steps.csv", "steps.csv"):
        cases = set(pd.read_csv(d / table)["case"]) if (d / table).is_file() else set()
        assert cases == set(names), (table, cases, names)
    if free_kb == 120:     # room for the start: Hydra's snapshot is whole
        assert (d / ".hydra" / "config.yaml").stat().st_size > 0


# -------------------------------------------------------------------------------- hub code

def test_hub_auto_map_is_refused_before_anything_runs(runs):
    res = runs["hub-auto-map"].result()
    assert res.rc == 2, res.describe()
    line = res.line()
    assert line.startswith("error: ") and "config.json has an auto_map that points at code on the Hugging Face " \
        "hub (AutoModel: someone/elsewhere--modeling_deepseekocr.DeepseekOCRForCausalLM)" in line, line
    assert "; fix: put that repository's *.py files in the model directory" in line
    d = res.only_dir()
    assert d.name.endswith("-failed") and _manifest(d)["model"] is None


# ----------------------------------------------------------------------------------- compare

def _compare(capsys, *args) -> tuple:
    from harness.cli import main

    try:
        rc = main(["compare", *map(str, args)])
    except SystemExit as exc:
        rc = exc.code
    out = capsys.readouterr()
    return rc, out.out, [ln for ln in out.err.splitlines() if ln.strip()]


def test_compare_refuses_garbage(runs, tmp_path, capsys):
    good = runs["sighup-report"].result().only_dir()
    garbage = tmp_path / "garbage"
    shutil.copytree(good, garbage)
    (garbage / "stages.csv").write_text("hello,world\n1,2\n")
    rc, _, err = _compare(capsys, good, garbage)
    assert rc == 2 and err == [f"error: {garbage / 'stages.csv'} lacks the column(s) case, stage, repeat, call, "
                               "gpu_ms or host_ms a run writes; fix: compare run directories written by "
                               "`python -m harness run`"]
    (garbage / "stages.csv").write_bytes(b"\xff\xfe\x00garbage\x00" * 50)
    rc, _, err = _compare(capsys, good, garbage)
    assert rc == 2 and len(err) == 1 and "unreadable manifest.json or stages.csv" in err[0]
    (garbage / "manifest.json").unlink()
    rc, _, err = _compare(capsys, garbage, good)
    assert rc == 2 and err == [f"error: {garbage} has no manifest.json, so it is not a run directory; fix: compare "
                               "run directories written by `python -m harness run`"]


def test_compare_flags_failed_and_empty_runs(runs, tmp_path, capsys):
    failed = runs["enospc-stages"].result().only_dir()
    good = runs["sighup-report"].result().only_dir()
    empty = tmp_path / "empty"
    shutil.copytree(good, empty)
    (empty / "stages.csv").write_text("")
    rc, out, err = _compare(capsys, failed, empty, "--out", tmp_path / "cmp")
    assert rc == 0 and err == []
    fail_note = (f"A ({failed.name}) is failed: cannot write stages.csv (No space left on device) during case b "
                 "(2 of 2), while writing its results; only its finished cases are compared")
    empty_note = ("B (empty) is interrupted: interrupted by SIGHUP during the final report; only its finished cases "
                  "are compared")
    for note in (fail_note, empty_note, "B (empty) measured nothing (stages.csv is empty)"):
        assert f"- {note}" in out and f"- {note}" in (tmp_path / "cmp" / "compare.md").read_text()
