"""The pages of a batch (issue 22 item 1, issue 26 item 10): a batch of B holds B distinct pages,
each timed repeat gets new ones, copies only with ``workload.repeat_pages=true`` (and then the
manifest and the warnings say so), and every inconsistent pages / batch / folder combination is one
``error:`` line with exit 2 before any model is built."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from conftest import cli_env
from harness import setup
from harness.config import WorkloadConfig
from harness.errors import HarnessError

ROOT = Path(__file__).resolve().parents[1]
TINY_MODE = "{name: t, base_size: 128, image_size: 64, crop: true}"


def _compose(overrides: list):
    from hydra import compose, initialize_config_dir

    from harness.config import to_config

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return to_config(compose("config", overrides=overrides))


def _error(call) -> str:
    with pytest.raises(HarnessError) as err:
        call()
    return str(err.value)


# ------------------------------------------------------------------------ the synthetic rule

def test_synthetic_pages_rule():
    """Request r takes pages r*d .. r*d+d-1 of the stream (d distinct pages per request), modulo
    workload.pages when set; warm-ups (r < 0) draw from their own stream unless a page set is given."""
    names = lambda w, r: [p.name for p in setup.synthetic_pages(w, r)]   # noqa: E731
    small = [64, 96]
    b4 = WorkloadConfig(batch=4, page_size=small)
    assert names(b4, 0) == ["synthetic-0000", "synthetic-0001", "synthetic-0002", "synthetic-0003"]
    assert names(b4, 1) == ["synthetic-0004", "synthetic-0005", "synthetic-0006", "synthetic-0007"]
    assert names(b4, -1) == ["synthetic-w0000", "synthetic-w0001", "synthetic-w0002", "synthetic-w0003"]
    # a set of 6 pages, batch 4: request 1 = pages 4, 5 and then 0, 1 (6 wraps to 0); warm-up 0 = (-4..-1) mod 6
    six = WorkloadConfig(batch=4, pages=6, page_size=small)
    assert names(six, 1) == ["synthetic-0004", "synthetic-0005", "synthetic-0000", "synthetic-0001"]
    assert names(six, -1) == ["synthetic-0002", "synthetic-0003", "synthetic-0004", "synthetic-0005"]
    # pages=3, batch 1 (issue 26 item 10): one page per request, cycling through the three
    three = WorkloadConfig(pages=3, page_size=small)
    assert [names(three, r) for r in range(4)] == [["synthetic-0000"], ["synthetic-0001"], ["synthetic-0002"],
                                                   ["synthetic-0000"]]
    # copies only when asked: one page copied (pages unset), or a set of 2 cycled over 4 rows
    assert names(WorkloadConfig(batch=4, repeat_pages=True, page_size=small), 1) == ["synthetic-0001"] * 4
    two = WorkloadConfig(batch=4, pages=2, repeat_pages=True, page_size=small)
    assert names(two, 0) == ["synthetic-0000", "synthetic-0001", "synthetic-0000", "synthetic-0001"]
    # one size for every page of a batch (one tile grid); the default is A4 portrait at 150 dpi
    assert {p.image.size for p in setup.synthetic_pages(WorkloadConfig(batch=3), 0)} == {(1240, 1754)}


def test_inconsistent_pages_and_batch_are_one_line_errors():
    assert _error(lambda: setup.check_pages(WorkloadConfig(pages=2, batch=4), "best-b4")) == (
        "case best-b4: workload.pages=2 distinct page(s) cannot fill workload.batch=4 without repeating pages; "
        "fix: drop workload.pages (each request then draws 4 new pages) or set it to 4 or more, or set "
        "workload.repeat_pages=true to measure a batch of copies")
    assert _error(lambda: setup.check_pages(WorkloadConfig(pages=1, images="pages/"), None)) == (
        "workload.pages=1 counts synthetic pages, but workload.images=pages/ gives the pages; fix: drop "
        "workload.pages (the pages of workload.images are its files)")
    for ok in (WorkloadConfig(pages=3), WorkloadConfig(pages=4, batch=4), WorkloadConfig(pages=6, batch=4),
               WorkloadConfig(pages=2, batch=4, repeat_pages=True), WorkloadConfig(batch=64)):
        setup.check_pages(ok, None)     # each fix the messages name is accepted


def test_one_image_file_is_one_distinct_page(tmp_path):
    Image.new("RGB", (50, 50), (255, 255, 255)).save(tmp_path / "a.png")
    w = WorkloadConfig(mode=dict(name="t", base_size=128, image_size=64, crop=True), images=str(tmp_path / "a.png"),
                       batch=2)
    assert _error(lambda: setup.request_pages(w)) == (
        f"workload.images={tmp_path / 'a.png'} has fewer than workload.batch=2 distinct pages of one layout (no "
        "tiles: 1 page(s), a.png); fix: set workload.repeat_pages=true to fill each batch by repeating pages "
        "(measured as copies), or use workload.batch=1, or add pages of that layout")
    [(label, pages)] = setup.request_pages(dataclasses.replace(w, repeat_pages=True))
    assert label == "" and [p.name for p in pages] == ["a.png", "a.png"]


def test_optimize_batched_cases_hold_distinct_pages():
    """conf/experiment/optimize.yaml's best-b8 needs no change: 8 distinct pages by default."""
    cases, _ = setup.prepare_cases(_compose(["+experiment=optimize", "run.only=[best-b8]"]))
    [b8] = cases
    entry = b8.pages_entry()
    assert entry["pages"] == [f"synthetic-{k:04d}" for k in range(8)]
    assert (entry["distinct_pages"], entry["copies"], entry["pages_label"]) == (8, False, "batch of 8 distinct pages")
    assert b8.notes == []


# ------------------------------------------------------------- a tiny run, batch 4, on the CPU

def test_batch_of_four_runs_four_distinct_pages_and_copies_only_when_asked(tmp_path, monkeypatch):
    from harness.run import run

    built = []      # the page names of every request the run builds, in order
    real_build = setup.CaseInputs.build

    def spy(self, pages):
        built.append((self.name, [p.name for p in pages]))
        return real_build(self, pages)

    monkeypatch.setattr(setup.CaseInputs, "build", spy)
    cfg = _compose(["model=tiny", f"workload.mode={TINY_MODE}", "workload.decode_tokens=2", "measure.repeats=2",
                    "measure.warmup=0", "workload.page_size=[120,180]",
                    "cases=[{name: b4, batch: 4}, {name: b4-copies, batch: 4, repeat_pages: true}]"])
    cases, _ = setup.prepare_cases(cfg)
    # distinct pixel content: 4 different page images, and 4 different rows of the request's global views
    b4 = cases[0]
    assert len({p.image.tobytes() for p in b4.pages}) == 4
    views = b4.request.global_views
    assert views.shape[0] == 4 and all(not torch.equal(views[i], views[j]) for i in range(4) for j in range(i))
    # each timed repeat new pages: repeat 1's four images share none with repeat 0's
    assert not {p.image.tobytes() for p in b4.pages_of(1)} & {p.image.tobytes() for p in b4.pages}

    built.clear()
    rd = run(cfg, tmp_path / "run", progress=lambda *_: None)
    man = json.loads((rd.path / "manifest.json").read_text())
    assert man["status"] == "complete"
    entries = {c["name"]: {k: c[k] for k in ("batch", "pages", "distinct_pages", "copies", "pages_label")}
               for c in man["cases"]}
    assert entries == {
        "b4": {"batch": 4, "pages": ["synthetic-0000", "synthetic-0001", "synthetic-0002", "synthetic-0003"],
               "distinct_pages": 4, "copies": False, "pages_label": "batch of 4 distinct pages"},
        "b4-copies": {"batch": 4, "pages": ["synthetic-0000"] * 4, "distinct_pages": 1, "copies": True,
                      "pages_label": "batch of 4 copies of 1 page"}}
    assert [c["page_source"] for c in man["cases"]] == [
        "synthetic pages of 120x180 px, new ones for every request (seed 0)"] * 2
    # the timed repeats: b4 pages 0-3 then 4-7; the copies case one new page per repeat, copied 4 times
    assert built == [("b4", [f"synthetic-{k:04d}" for k in range(4)]),
                     ("b4", [f"synthetic-{k:04d}" for k in range(4, 8)]),
                     ("b4-copies", ["synthetic-0000"] * 4), ("b4-copies", ["synthetic-0001"] * 4)]
    assert ("b4-copies: batch of 4 copies of 1 page (workload.repeat_pages=true): identical rows route identically, "
            "so its tok/s and MBU do not describe a batch of distinct pages") in man["warnings"]
    assert not [w for w in man["warnings"] if w.startswith("b4:")]


# --------------------------------------------------- a folder too small for the batch: the CLI

#: runs the CLI with the model build replaced by a tripwire: reaching it ends the run with its own line
TRIPWIRE = """
import sys
import harness.models.build as build
import harness.setup as setup
from harness.errors import HarnessError

def tripwire(*args, **kwargs):
    raise HarnessError("MODEL BUILD REACHED", "-")

build.build_model = setup.load_adapter = tripwire
from harness.cli import main
sys.exit(main(sys.argv[1:]))
"""


ENV = cli_env()
ENV["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), ENV.get("PYTHONPATH", "")])


def _cli(root: Path, *overrides) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", TRIPWIRE, "run", "model=tiny", f"workload.mode={TINY_MODE}",
           "workload.decode_tokens=2", "measure.repeats=1", *overrides, f"run.root={root / 'runs'}"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, env=ENV)


def start_runs(tmp_path_factory, submit) -> dict:
    """A folder of two 2x3 pages run at batch 4, refused and with the fix, started with the session's
    background runs (tests/conftest.py); id -> Future[process], and "folder" -> the folder."""
    tmp = tmp_path_factory.mktemp("pages")
    folder = tmp / "two"
    folder.mkdir()
    for name, grey in (("a.png", 255), ("b.png", 0)):      # 120x180 in the tiny mode: tile grid 2x3
        Image.new("RGB", (120, 180), (grey, grey, grey)).save(folder / name)
    return {"folder": folder,
            "refused": submit(_cli, tmp / "refused", f"workload.images={folder}", "workload.batch=4"),
            "fixed": submit(_cli, tmp / "fixed", f"workload.images={folder}", "workload.batch=4",
                            "workload.repeat_pages=true")}


def test_folder_with_fewer_pages_than_the_batch_is_refused_before_the_model_is_built(runs):
    folder, res, res_fixed = runs["folder"], runs["refused"].result(), runs["fixed"].result()
    assert res.returncode == 2, res.stderr
    assert [ln for ln in res.stderr.splitlines() if ln.strip()] == [
        f"error: workload.images={folder} has fewer than workload.batch=4 distinct pages of one layout (tile grid "
        "2x3: 2 page(s), a.png, b.png); fix: set workload.repeat_pages=true to fill each batch by repeating pages "
        "(measured as copies), or use workload.batch=2, or add pages of that layout"]
    # with the fix the run gets past the page check and reaches the (tripwired) model build
    assert res_fixed.returncode == 2 and res_fixed.stderr.startswith("error: MODEL BUILD REACHED; fix: -"), \
        res_fixed.stderr
