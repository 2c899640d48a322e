"""The data side needs no torch (DESIGN.md, "Two sides"): with torch and triton unimportable, a
process imports every reader of a run directory (every module of ``harness.report``,
``harness.roofline``, ``harness.schema`` and ``harness.analytic``, the cost model, but ``analytic.check``, which counts
the model's FLOPs under torch, and the CLI that dispatches the verbs) and runs ``report``, ``compare``,
``merge`` and ``summarize`` on copies of committed H200 run directories, and the README's table
writer on one of them; a second process, with the running side loaded (``harness.run``: torch,
triton, the model, the variants), does the same on its own copies. Both write the same bytes.

The inputs: ``runs/examples/h200-decode-pairs`` (two cases, ``best`` and ``best-fused``, with steps
and routing) and ``h200-decode-residual`` (the same two case names, measured later). The merge
takes the pairs run cut into one run per case, as a ladder split across device calls would be.
Each process runs in its own folder with relative paths, so the one difference is the merged
manifest's ``cwd`` (where the merge ran).
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

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "runs" / "examples"
#: what a reader of a run directory must not load
RUNNING_SIDE = ("torch", "triton", "harness.models", "harness.variants", "harness.kernels", "harness.setup",
                "harness.workload")
#: the files of a run directory the readers read (logs, charts and earlier reports left behind)
RUN_FILES = ("manifest.json", "stages.csv", "steps.csv", "routing.csv", "routing_steps.csv", "kernels.csv")
REPORT_FILES = {"report.md", "headline.csv", "stages_summary.csv", "analytic.csv", "roofline.csv", "roofline.png",
                "time_breakdown.png", "tpot_vs_position.png", "ladder.png"}

CHILD = r'''
import contextlib, io, json, sys
from pathlib import Path

if sys.argv[1] == "blocked":
    class Blocked:
        """torch and triton (and their submodules) cannot be imported."""
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "triton"):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
    sys.meta_path.insert(0, Blocked())
else:
    import harness.run   # the running side, as in the process that writes a run's report
import importlib, pkgutil
import harness.analytic, harness.report, harness.roofline, harness.schema
for package in (harness.analytic, harness.report, harness.roofline, harness.schema):   # every reader module
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if module.name != "harness.analytic.check" and not module.name.endswith(".__main__"):
            importlib.import_module(module.name)
from harness.cli import main
from harness.report.report import write_report

sys.path.insert(0, sys.argv[2] + "/scripts")
import readme_tables

with contextlib.redirect_stdout(io.StringIO()):
    write_report("pairs", strict=True)
    rc = [main(["compare", "pairs", "residual", "--out", "compare"]),
          main(["merge", "best", "best-fused", "--out", "merged"]),
          main(["summarize", "best", "best-fused", "--out", "summary"])]
Path("readme_ladder.md").write_text(readme_tables.render("ladder h200-decode-pairs", Path(sys.argv[2]) / "runs/examples"))
try:
    import torch  # noqa: F401
    importable = True
except ImportError:
    importable = False
print(json.dumps({"rc": rc, "torch_importable": importable, "loaded": sorted(sys.modules)}))
'''


def _copy_run(src: Path, dst: Path, case: str | None = None) -> None:
    """``RUN_FILES`` of ``src`` into the new folder ``dst``; with ``case``, that case's rows and manifest entry only."""
    dst.mkdir(parents=True)
    for name in RUN_FILES:
        if not (src / name).exists():
            continue
        if case is None:
            shutil.copy2(src / name, dst / name)
        elif name == "manifest.json":
            manifest = json.loads((src / name).read_text())
            manifest["cases"] = [c for c in manifest["cases"] if c["name"] == case]
            (dst / name).write_text(json.dumps(manifest, indent=2))
        else:
            rows = pd.read_csv(src / name, dtype=str, keep_default_na=False)
            rows[rows["case"] == case].to_csv(dst / name, index=False)


def _inputs(work: Path) -> None:
    pairs = EXAMPLES / "h200-decode-pairs"
    _copy_run(pairs, work / "pairs")
    _copy_run(EXAMPLES / "h200-decode-residual", work / "residual")
    for case in ("best", "best-fused"):
        _copy_run(pairs, work / case, case)


def _files(folder: Path) -> dict:
    """{path relative to ``folder``: bytes} of every file under it."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """{mode: (folder, the child's JSON line)} for ``blocked`` (no torch, no triton) and ``loaded``
    (the running side imported), run at the same time."""
    root = tmp_path_factory.mktemp("torch_free")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               MPLBACKEND="Agg")
    procs = {}
    for mode in ("blocked", "loaded"):
        _inputs(root / mode)
        procs[mode] = subprocess.Popen([sys.executable, "-c", CHILD, mode, str(ROOT)], cwd=root / mode, env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    for mode, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        out[mode] = (root / mode, json.loads(stdout.strip().splitlines()[-1]))
    return out


def test_the_readers_load_nothing_of_the_running_side(runs):
    """With torch blocked every verb exits 0 and no module of the running side was loaded; the other
    process had torch, triton and the model loaded (so the two conditions differ)."""
    _, blocked = runs["blocked"]
    _, loaded = runs["loaded"]
    assert blocked["rc"] == loaded["rc"] == [0, 0, 0]
    assert not blocked["torch_importable"] and loaded["torch_importable"]
    assert [m for m in blocked["loaded"] if m.split(".")[0] in ("torch", "triton") or m.startswith(RUNNING_SIDE)] == []
    assert {"torch", "triton", "harness.models", "harness.variants", "harness.kernels", "harness.setup",
            "harness.workload"} <= set(loaded["loaded"])
    assert {"harness.layout", "harness.knobs", "harness.report.ladder", "harness.analytic.docs", "harness.roofline.calibrate",
            "matplotlib"} <= set(blocked["loaded"])


def test_report_compare_merge_summarize_write_the_same_files_without_torch(runs):
    """Every file written (and the inputs the report updated) is byte-identical, but the merged
    manifest's ``cwd``: the folder each merge ran in."""
    (a_dir, _), (b_dir, _) = runs["blocked"], runs["loaded"]
    a, b = _files(a_dir), _files(b_dir)
    assert sorted(a) == sorted(b)
    written = {Path(p).parts[0]: set() for p in a}
    for p in a:
        written[Path(p).parts[0]].add(str(Path(*Path(p).parts[1:])) if len(Path(p).parts) > 1 else p)
    assert REPORT_FILES <= written["pairs"] and REPORT_FILES <= written["merged"]
    assert written["compare"] == {"compare.csv", "compare.md"}
    assert written["summary"] == {"summary.csv", "summary.md", "summary.png"}
    assert {"stages.csv", "steps.csv", "routing.csv", "manifest.json"} <= written["merged"]
    assert a["readme_ladder.md"].count(b"\n| ") >= 2                 # the two cases' rows
    differ = sorted(p for p in a if a[p] != b[p])
    assert differ == ["merged/manifest.json"]
    ma, mb = (json.loads(x[differ[0]]) for x in (a, b))
    assert (ma.pop("cwd"), mb.pop("cwd")) == (str(a_dir), str(b_dir))
    assert ma == mb
    assert a[differ[0]].replace(json.dumps(str(a_dir)).encode(), b"CWD") == \
        b[differ[0]].replace(json.dumps(str(b_dir)).encode(), b"CWD")
