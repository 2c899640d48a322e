"""Nothing runs that the user did not ask for, nothing escapes the directories the harness owns
(issue 37: S1, S2, S3, L11).

- S1: a model directory's Python code is imported only by ``model=vendor`` with
  ``model.trust_remote_code=true``. A tokenizer whose ``auto_map`` names a ``tokenization_x.py``
  that writes a marker file when imported leaves no marker under ``model=tiny``: with a stand-in
  for transformers' ``AutoTokenizer`` (it imports the ``auto_map`` module when, and only when,
  ``trust_remote_code`` is true, as transformers 4.46.3 does), and with transformers itself where
  it is installed. ``model=vendor`` without the setting is one ``error:`` line naming the files,
  before any run directory; with it, one start-up line says whose code runs, from where.
- S2: ``run.name`` is one folder name: a separator, ``..``, a leading dot or an empty name is one
  ``error:`` line, exit 2, and nothing is created anywhere.
- S3: a symbolic link met by merge, summarize, compare or a run's own writes is refused with one
  line, and what it points to is neither read into nor written by the harness.
- L11: reading the checkout's revision leaves ``.git/index`` as it was (``git --no-optional-locks``).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pandas as pd
import pytest

from conftest import main_lines as _main
from harness.errors import HarnessError

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "tests" / "data" / "runs"
TINY_MODE = "workload.mode={name: t, base_size: 128, image_size: 64, crop: true}"
MARKER = "IMPORTED"


def _tree(root: Path) -> list:
    """Every path under ``root`` (relative, sorted): what a command created there."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# ----------------------------------------------------------------------------------------- S1

def code_tokenizer_dir(path: Path, tokenizer_class: str = "XTokenizerFast") -> Path:
    """A model directory whose tokenizer_config.json maps AutoTokenizer to its own
    tokenization_x.py; importing that file writes ``path / MARKER``."""
    path.mkdir(parents=True)
    (path / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2}, "unk_token": "[UNK]"}}))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": tokenizer_class, "auto_map": {"AutoTokenizer": [None, "tokenization_x.XTokenizerFast"]}}))
    (path / "tokenization_x.py").write_text(
        f"import pathlib\npathlib.Path({str(path / MARKER)!r}).write_text('the directory code ran')\n"
        "class XTokenizerFast:\n    def encode(self, text, add_special_tokens=False):\n        return [5]\n")
    return path


def _standin_transformers() -> types.ModuleType:
    """A stand-in for ``transformers`` whose ``AutoTokenizer.from_pretrained`` follows a tokenizer's
    ``auto_map`` as transformers does: with ``trust_remote_code`` true it imports the named module
    from the directory (running it); false, it refuses with transformers' ValueError."""
    def from_pretrained(path, trust_remote_code=None, **kwargs):
        conf = json.loads((Path(path) / "tokenizer_config.json").read_text())
        module, cls = conf["auto_map"]["AutoTokenizer"][1].split(".")
        if not trust_remote_code:
            raise ValueError(f"Loading {path} requires you to execute the configuration file in that repo on "
                             "your local machine")
        spec = importlib.util.spec_from_file_location(module, Path(path) / f"{module}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return getattr(mod, cls)()

    tf = types.ModuleType("transformers")
    tf.AutoTokenizer = types.SimpleNamespace(from_pretrained=from_pretrained)
    return tf


def test_standin_runs_directory_code_when_trusted(tmp_path):
    """The stand-in is a real test of the harness: trusted, it runs the directory's code."""
    d = code_tokenizer_dir(tmp_path / "model")
    _standin_transformers().AutoTokenizer.from_pretrained(str(d), trust_remote_code=True)
    assert (d / MARKER).read_text() == "the directory code ran"


def test_tiny_model_runs_no_tokenizer_code_of_its_model_path(tmp_path, monkeypatch):
    """``model=tiny model.path=DIR``: the run's set-up (``prepare_cases``, which loads the tokenizer)
    imports nothing from DIR, and the run's note names the code it did not run."""
    from harness.cli import check_overrides
    from harness.setup import prepare_cases

    d = code_tokenizer_dir(tmp_path / "model")
    monkeypatch.setitem(sys.modules, "transformers", _standin_transformers())
    cfg = check_overrides(["model=tiny", f"model.path={d}", TINY_MODE, "workload.decode_tokens=2"])
    cases, note = prepare_cases(cfg)
    assert not (d / MARKER).exists()
    assert note == (f"tokenizer in {d} needs code of its own (AutoTokenizer: tokenization_x.XTokenizerFast), which "
                    "the harness never runs: prompt uses 12 fixed text tokens")
    assert cases[0].case.text_tokens == 12


def test_real_transformers_imports_no_tokenizer_code(tmp_path):
    """The same with transformers itself (the `vendor` extra): a built-in tokenizer_class loads
    without the directory's code; a class only the code defines does not load."""
    pytest.importorskip("transformers")
    from harness.workload import tokenizer_or_reason

    builtin = code_tokenizer_dir(tmp_path / "builtin", tokenizer_class="PreTrainedTokenizerFast")
    tok, reason = tokenizer_or_reason(builtin)
    assert reason == f"tokenizer from {builtin}" and tok.encode("hello world", add_special_tokens=False) == [1, 2]
    own = code_tokenizer_dir(tmp_path / "own")
    assert tokenizer_or_reason(own) == (None, f"tokenizer in {own} needs code of its own (AutoTokenizer: "
                                              "tokenization_x.XTokenizerFast), which the harness never runs")
    assert not (builtin / MARKER).exists() and not (own / MARKER).exists()


VENDOR_PY = ("configuration_deepseek_v2.py", "conversation.py", "deepencoder.py", "modeling_deepseekocr.py",
             "modeling_deepseekv2.py")


def vendor_code_dir(path: Path) -> Path:
    """A vendor directory whose every .py file writes ``path / MARKER`` when imported."""
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    for f in VENDOR_PY:
        (path / f).write_text(f"import pathlib\npathlib.Path({str(path / MARKER)!r}).write_text({f!r})\n")
    return path


def test_vendor_code_is_refused_without_the_setting(tmp_path, monkeypatch):
    from harness.models.vendor import loader as V
    from harness.models.vendor import loops as L

    d = vendor_code_dir(tmp_path / "vendor")
    monkeypatch.setitem(sys.modules, "transformers", None)   # importing it would fail the test differently
    want = (f"model=vendor would import and run the Python code in {d} ({', '.join(VENDOR_PY)}) through "
            "transformers' trust_remote_code, and model.trust_remote_code is false; fix: read that code; if you "
            "trust it, add model.trust_remote_code=true (or run the reference model: model.weights=path "
            "model.path=DIR runs no code from the directory)")
    for load in (lambda: L.load(d), lambda: V.load_vendor(d, "cpu", "fp32"), lambda: V.vendor_reference_config(d)):
        with pytest.raises(HarnessError) as exc:
            load()
        assert str(exc.value) == want
    assert not (d / MARKER).exists()


def test_vendor_run_without_the_setting_is_one_line_before_any_run_directory(tmp_path, capsys):
    d = vendor_code_dir(tmp_path / "vendor")
    root = tmp_path / "runs"
    rc, err = _main(capsys, ["run", "model=vendor", f"model.path={d}", f"run.root={root}"])
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"error: model=vendor would import and run the Python "
                                                           f"code in {d} (configuration_deepseek_v2.py, ")
    assert err[0].endswith("add model.trust_remote_code=true (or run the reference model: model.weights=path "
                           "model.path=DIR runs no code from the directory)")
    assert not root.exists() and not (d / MARKER).exists()


def test_vendor_code_allowed_says_whose_code_runs(tmp_path, monkeypatch, capsys):
    """Allowed, the gate lets the load go on (here to the missing transformers, which it names) and
    one warning line says whose code runs, from where."""
    from harness import hub
    from harness.models.vendor import loader as V

    d = vendor_code_dir(tmp_path / "vendor")
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setattr(hub, "_ANNOUNCED", set())
    with pytest.raises(HarnessError, match="transformers"):
        V.load_vendor(d, "cpu", "fp32", trust_remote_code=True)
    assert capsys.readouterr().err.splitlines() == [
        f"[harness] model=vendor runs the Python code in {d} ({', '.join(VENDOR_PY)}): the model directory's own "
        "code, not the harness's, allowed by model.trust_remote_code=true"]


def test_trust_remote_code_applies_to_the_vendor_model_only():
    from harness.cli import check_overrides

    with pytest.raises(HarnessError) as exc:
        check_overrides(["model=tiny", "model.trust_remote_code=true"])
    assert str(exc.value) == ("model.trust_remote_code=true applies to model=vendor only (model.name=reference runs "
                              "no code from a directory); fix: drop model.trust_remote_code")
    assert check_overrides(["model=vendor"]).model.trust_remote_code is False   # conf/model/vendor.yaml: the default


# ----------------------------------------------------------------------------------------- S2

@pytest.mark.parametrize("name, why", [
    ("../../../OUTSIDE", "holds a path separator"), ("a/b", "holds a path separator"),
    ("'..'", "starts with a dot"), ("'.hidden'", "starts with a dot"), ("''", "is empty")])
def test_run_name_is_one_folder_name(tmp_path, capsys, name, why):
    root = tmp_path / "x" / "y" / "runs"
    rc, err = _main(capsys, ["run", "model=tiny", TINY_MODE, f"run.name={name}", f"run.root={root}"])
    shown = name.strip("'")
    assert rc == 2 and err == [
        f"error: run.name={shown!r} {why}: it names one folder under run.root (<time>-<name>); fix: give run.name "
        "one folder name without '/' or '\\' that does not start with '.', e.g. run.name=my-run (run.root chooses "
        "the parent folder)"]
    assert _tree(tmp_path) == []   # nothing under run.root, nothing beside or above it


def test_a_swept_run_name_is_checked_too(tmp_path, capsys):
    rc, err = _main(capsys, ["run", "-m", "model=tiny", "run.name=ok,a/b", f"run.root={tmp_path / 'runs'}"])
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: run.name='a/b' holds a path separator")
    assert _tree(tmp_path) == []


def test_a_run_stays_under_run_root_with_its_time_and_name(tmp_path):
    """The directory a run gets: ``run.root/<time>-<name>``, one level below run.root."""
    from harness.cli import _compose_checked

    _, dirs = _compose_checked(["model=tiny", "run.name=my-run", f"run.root={tmp_path}"])
    run_dir = Path(dirs["hydra.run.dir"])
    assert run_dir.parent == tmp_path and re.fullmatch(r"\d{8}-\d{6}-my-run", run_dir.name), run_dir


# ----------------------------------------------------------------------------------------- S3

@pytest.fixture
def secret(tmp_path) -> Path:
    """A file outside every directory the harness owns."""
    f = tmp_path / "elsewhere" / "secret.txt"
    f.parent.mkdir()
    f.write_text("not the harness's\n")
    return f


def _with_trace(src: str, dst: Path, trace_target: Path) -> Path:
    """A copy of the fixture run ``src`` whose first case has a profiled trace that is a link to
    ``trace_target`` (as the issue found: a trace outside the run, linked in)."""
    shutil.copytree(RUNS / src, dst)
    man = json.loads((dst / "manifest.json").read_text())
    case = man["cases"][0]["name"]
    man["cases"][0]["trace"] = {"file": f"traces/{case}/trace.json.gz"}
    (dst / "manifest.json").write_text(json.dumps(man))
    (dst / "traces" / case).mkdir(parents=True)
    (dst / "traces" / case / "trace.json.gz").symlink_to(trace_target)
    return dst / "traces" / case / "trace.json.gz"


def test_merge_refuses_a_linked_trace(tmp_path, capsys, secret):
    link = _with_trace("gpu_tiny_a", tmp_path / "a", secret)
    shutil.copytree(RUNS / "gpu_tiny_b", tmp_path / "b")
    out = tmp_path / "merged"
    rc, err = _main(capsys, ["merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)])
    assert rc == 2 and err == [
        f"error: {link} is a symbolic link (to {secret}); merge reads, copies and writes only regular files inside "
        "the directories it owns; fix: replace the link with a copy of what it points to, or remove it"]
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".merged")] == []


def test_merge_refuses_a_linked_observation_file(tmp_path, capsys, secret):
    shutil.copytree(RUNS / "gpu_tiny_a", tmp_path / "a")
    shutil.copytree(RUNS / "gpu_tiny_b", tmp_path / "b")
    (tmp_path / "b" / "routing.csv").unlink()
    (tmp_path / "b" / "routing.csv").symlink_to(secret)
    rc, err = _main(capsys, ["merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "m")])
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"error: {tmp_path / 'b' / 'routing.csv'} is a symbolic "
                                                           f"link (to {secret}); merge ")
    assert not (tmp_path / "m").exists()


def test_merge_refuses_a_trace_placed_outside_its_run(tmp_path, capsys):
    shutil.copytree(RUNS / "gpu_tiny_a", tmp_path / "a")
    shutil.copytree(RUNS / "gpu_tiny_b", tmp_path / "b")
    (tmp_path / "outside").mkdir()
    man = json.loads((tmp_path / "a" / "manifest.json").read_text())
    man["cases"][0]["trace"] = {"file": "../outside/trace.json.gz"}
    (tmp_path / "a" / "manifest.json").write_text(json.dumps(man))
    rc, err = _main(capsys, ["merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "m")])
    assert rc == 2 and err == [f"error: {tmp_path / 'a' / 'manifest.json'} places a trace at ../outside, outside the "
                               "run directory; fix: merge runs whose traces are under their own traces/ folder, as a "
                               "run writes them"]
    assert not (tmp_path / "m").exists()


def _sweep(tmp_path: Path) -> Path:
    """A multirun directory with one finished job (the checked-in fixture run)."""
    sweep = tmp_path / "multirun-20261128-000000-default"
    shutil.copytree(RUNS / "gpu_tiny_a", sweep / "0")
    (sweep / "0" / ".hydra").mkdir()
    (sweep / "0" / ".hydra" / "overrides.yaml").write_text("- model=tiny\n")
    return sweep


def test_summarize_refuses_to_write_through_a_linked_summary_folder(tmp_path, capsys):
    sweep = _sweep(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (sweep / "summary").symlink_to(outside, target_is_directory=True)
    rc, err = _main(capsys, ["summarize", str(sweep)])
    assert rc == 2 and err == [
        f"error: {sweep / 'summary'} is a symbolic link (to {outside}); summarize reads, copies and writes only "
        "regular files inside the directories it owns; fix: remove the link, or give --out a folder that is not one"]
    assert list(outside.iterdir()) == []


def test_summarize_refuses_a_linked_job_file(tmp_path, capsys, secret):
    sweep = _sweep(tmp_path)
    (sweep / "0" / "stages.csv").unlink()
    (sweep / "0" / "stages.csv").symlink_to(secret)
    rc, err = _main(capsys, ["summarize", str(sweep)])
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"error: {sweep / '0' / 'stages.csv'} is a symbolic "
                                                           f"link (to {secret}); summarize ")
    assert not (sweep / "summary").exists()


def test_summarize_writes_a_real_summary_folder(tmp_path, capsys):
    """The guard passes what it should: the same sweep without a link is summarized."""
    sweep = _sweep(tmp_path)
    rc, _ = _main(capsys, ["summarize", str(sweep)])
    assert rc == 0 and not (sweep / "summary").is_symlink()
    assert sorted(p.name for p in (sweep / "summary").iterdir()) == ["summary.csv", "summary.md", "summary.png"]


def test_output_guard_refuses_links_on_the_way(tmp_path, secret):
    """``refuse_out_links`` (compare, summarize): the output folder, a file in it, or a folder it
    passes through below where the given path ends, when any is a link; nothing when none is."""
    from harness.containment import refuse_out_links

    real = tmp_path / "real"
    real.mkdir()
    refuse_out_links(real, ["compare.csv"], what="compare")              # a real folder: passes
    refuse_out_links(tmp_path / "new" / "x", ["compare.csv"], what="compare")   # not there yet: passes
    (tmp_path / "linked").symlink_to(real, target_is_directory=True)
    (real / "compare.md").symlink_to(secret)
    for out, name, link in ((tmp_path / "linked", "compare.csv", tmp_path / "linked"),
                            (real, "compare.md", real / "compare.md")):
        with pytest.raises(HarnessError) as exc:
            refuse_out_links(out, ["compare.csv", name], what="compare")
        assert exc.value.problem.startswith(f"{link} is a symbolic link (to ")
        assert exc.value.fix == "remove the link, or give --out a folder that is not one"
    assert secret.read_text() == "not the harness's\n"


def test_a_run_never_writes_through_a_link(tmp_path, secret):
    """A link where the run writes (an appended CSV, the temporary file of a rewrite) is refused;
    the file it points to is untouched. A link at the final name of a rewrite is replaced, not followed."""
    from harness.rundir import RunDir

    rd = RunDir(tmp_path / "run", {"model": "tiny"})
    (rd.path / "stages.csv").symlink_to(secret)
    with pytest.raises(HarnessError, match=r"stages.csv is a symbolic link .* the run reads, copies and writes"):
        rd.append_csv("stages.csv", pd.DataFrame({"a": [1]}))
    (rd.path / "report.md.tmp").symlink_to(secret)
    with pytest.raises(HarnessError, match=r"report.md.tmp is a symbolic link"):
        rd.write_text("report.md", "# report\n")
    (rd.path / "report.md.tmp").unlink()
    (rd.path / "notes.md").symlink_to(secret)
    rd.write_text("notes.md", "# notes\n")
    assert not (rd.path / "notes.md").is_symlink() and (rd.path / "notes.md").read_text() == "# notes\n"
    assert secret.read_text() == "not the harness's\n"


def test_copy_tree_copies_a_link_as_a_link(tmp_path, secret):
    from harness.containment import copy_tree

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "t.gz").symlink_to(secret)
    copy_tree(tmp_path / "src", tmp_path / "dst")
    assert (tmp_path / "dst" / "t.gz").is_symlink() and str((tmp_path / "dst" / "t.gz").readlink()) == str(secret)


# ---------------------------------------------------------------------------------------- L11

def test_reading_the_revision_leaves_the_index_alone(tmp_path):
    """``git status`` would refresh a stale index (a tracked file touched, content unchanged) and
    rewrite ``.git/index`` under ``index.lock``; the harness's read leaves it byte for byte."""
    from harness.rundir import checkout_revision

    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-m", "root")
    (tmp_path / "f.txt").write_text("x\n")
    git("add", "f.txt")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "f")
    index = tmp_path / ".git" / "index"
    before = index.read_bytes()
    st = (tmp_path / "f.txt").stat()
    os.utime(tmp_path / "f.txt", ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))   # stale stat data
    got = checkout_revision(tmp_path)
    assert got == {"revision": git("rev-parse", "HEAD").strip(), "dirty": False}
    assert index.read_bytes() == before
    git("status", "--porcelain")                      # what the harness used to run: it rewrites the index
    assert index.read_bytes() != before
