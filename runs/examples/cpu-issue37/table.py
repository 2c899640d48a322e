"""Issue 37's acceptance table: run each item's command on this machine (CPU) and tabulate its exit
code, first line, what it left on disk and whether the item holds.

    .venv/bin/python runs/examples/cpu-issue37/table.py [--transformers DIR] [--only ID ...] [--keep]

The code under test is a fresh ``git clone`` of this checkout's HEAD (``$CHECKOUT``; every child
runs with ``PYTHONPATH=$CHECKOUT/src``), so uncommitted edits in the working tree take no part; the
header line printed to stderr names the commit. Each row runs its command as a subprocess of this
interpreter (``python``), in a fresh temporary directory (``$TMP``: its calibration cache
``HARNESS_CACHE_DIR=$TMP/cache`` seeded with a copy of the user's default CPU record, so no row
measures the machine unasked), with a timeout (seconds). Rows that read the repository (P1-P3) run
in ``$CHECKOUT``. ``--transformers DIR``: a ``pip install --target DIR transformers==4.46.3`` (with
its tokenizers), put on ``PYTHONPATH`` as ``$TF`` for the S1 rows marked so, so that transformers
really follows the directory's ``auto_map``; without it those rows run without transformers.

Columns: **first line** is the first line of stderr when the exit code is not 0 (of stdout when
stderr is empty), else the first line of stdout; **shows** is what the row's check read (a line of
the output, of a report, a manifest field), where the first line does not show it; **files left**
lists what the command added under ``$TMP`` (a run directory by its file count, status and cases);
**holds** is the row's own check of the issue's acceptance (``check`` of each row). An exit 2 also
needs stderr to be exactly one ``error:`` line and no traceback anywhere.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "runs" / "examples" / "cpu-cli-retries"))   # cli_retries.py lives with its evidence
from cli_retries import seed_cache  # noqa: E402  ($TMP/cache seeded with the user's default calibration record)

MODE = "workload.mode={name: t, base_size: 128, image_size: 64, crop: true}"
TINY = ["model=tiny", MODE, "workload.decode_tokens=2", "measure.repeats=1", "measure.warmup=0"]
RUNS = "run.root={tmp}/runs"
MARKER = "RAN"                      # written by a directory's Python code when it is imported
AS_LIMIT_BYTES = 2_500_000 * 1024   # ulimit -v 2500000 (KiB): the address space of the R1 rows
TIME = re.compile(r"\d{8}-\d{6}")


@dataclass
class Result:
    """What a row's command did: exit code, stdout, stderr, wall seconds, its temp dir and set-up notes."""

    rc: int
    out: str
    err: str
    wall_s: float
    tmp: Path
    ctx: dict
    before: set = field(default_factory=set)
    left: str = ""

    @property
    def lines(self) -> list:
        return [ln for ln in (self.out + "\n" + self.err).splitlines() if ln.strip()]

    def run_dirs(self) -> list:
        """Directories the command added under the temp dir holding a manifest.json, by name (oldest first)."""
        return sorted((p.parent for p in self.tmp.rglob("manifest.json") if p not in self.before),
                      key=lambda p: p.name)

    def manifest(self, run: Optional[Path] = None) -> dict:
        runs = self.run_dirs()
        run = run or (runs[-1] if runs else None)
        return json.loads((run / "manifest.json").read_text()) if run else {}


@dataclass
class Row:
    id: str
    item: str
    argv: list                     # "harness" -> python -m harness; "python" -> this interpreter
    check: Callable[[Result], tuple]   # -> (holds, what it read)
    setup: Optional[Callable[[Path, dict], None]] = None
    env: dict = field(default_factory=dict)
    in_checkout: bool = False      # run in $CHECKOUT (rows that read the repository)
    as_limit: bool = False         # under ulimit -v (AS_LIMIT_BYTES)
    same_as: Optional[str] = None  # the result of an earlier row whose command is this one
    timeout_s: int = 300


# ------------------------------------------------------------------------------------ set-ups

def tokenizer_dir(tmp: Path, ctx: dict) -> None:
    """$TMP/model: a tokenizer whose tokenizer_config.json maps AutoTokenizer to the directory's own
    tokenization_x.py (a PreTrainedTokenizerFast subclass); importing that file writes $TMP/model/RAN."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    d = tmp / "model"
    d.mkdir()
    tok = Tokenizer(WordLevel({"[UNK]": 0, "page": 1, "text": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "XTokenizerFast", "auto_map": {"AutoTokenizer": [None, "tokenization_x.XTokenizerFast"]}}))
    (d / "tokenization_x.py").write_text(
        f"from pathlib import Path\nPath({str(d / MARKER)!r}).write_text('tokenization_x.py ran')\n"
        "from transformers import PreTrainedTokenizerFast\n\n\nclass XTokenizerFast(PreTrainedTokenizerFast):\n"
        "    pass\n")


def vendor_dir(tmp: Path, ctx: dict) -> None:
    """$TMP/vendor: a stand-in vendor snapshot (the five code files the harness looks for) whose
    config.json maps AutoConfig to its configuration_deepseek_v2.py; every .py file writes
    $TMP/vendor/RAN (its own name) when imported."""
    d = tmp / "vendor"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "standin", "auto_map": {
        "AutoConfig": "configuration_deepseek_v2.StandinConfig"}}))
    for name in ("configuration_deepseek_v2.py", "conversation.py", "deepencoder.py", "modeling_deepseekocr.py",
                 "modeling_deepseekv2.py"):
        (d / name).write_text(f"from pathlib import Path\nPath({str(d / MARKER)!r}).write_text({name!r})\n")
    with (d / "configuration_deepseek_v2.py").open("a") as f:
        f.write("from transformers import PretrainedConfig\n\n\nclass StandinConfig(PretrainedConfig):\n"
                "    model_type = 'standin'\n")


def fixture(name: str, *runs: str) -> Callable[[Path, dict], None]:
    """Copy the run directories ``runs`` (by name suffix) of fixture ``name`` into $TMP/runs."""
    def put(tmp: Path, ctx: dict) -> None:
        src = FIXTURES.build(name)
        (tmp / "runs").mkdir()
        for suffix in runs:
            d = next(p for p in sorted(src.iterdir()) if p.name.endswith(suffix))
            shutil.copytree(d, tmp / "runs" / d.name, symlinks=True)
    return put


def linked_trace(tmp: Path, ctx: dict) -> None:
    """Runs -t and -u (each with its profiled trace); -t's trace replaced by a link to $TMP/secret.txt."""
    fixture("pair", "-t", "-u")(tmp, ctx)
    (tmp / "secret.txt").write_text("SECRET: a file outside every run\n")
    trace = next((tmp / "runs").glob("*-t/traces/*/trace.json.gz"))
    trace.unlink()
    trace.symlink_to(tmp / "secret.txt")


def linked_summary(tmp: Path, ctx: dict) -> None:
    """The two-job sweep, its summary/ a link to $TMP/outside/."""
    src = FIXTURES.build("sweep")
    sweep = tmp / "runs" / src.name
    shutil.copytree(src, sweep, symlinks=True)
    (tmp / "outside").mkdir()
    (sweep / "summary").symlink_to(tmp / "outside", target_is_directory=True)


def stale_index(tmp: Path, ctx: dict) -> None:
    """$TMP/checkout: a clone of $CHECKOUT whose README.md's mtime is 5 s later than its index entry
    (``git status`` would refresh the index); the index's sha1 kept in ctx."""
    subprocess.run(["git", "clone", "-q", str(FIXTURES.checkout), str(tmp / "checkout")], check=True)
    st = (tmp / "checkout" / "README.md").stat()
    os.utime(tmp / "checkout" / "README.md", ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    ctx["index_before"] = hashlib.sha1((tmp / "checkout" / ".git" / "index").read_bytes()).hexdigest()


def existing_dir(tmp: Path, ctx: dict) -> None:
    fixture("same", "-a", "-b")(tmp, ctx)
    (tmp / "existing").mkdir()


# ------------------------------------------------------------------------------------- checks

def one_error(r: Result, *words: str) -> bool:
    """Exit 2, stderr exactly one ``error:`` line holding every word, no traceback anywhere."""
    err = [ln for ln in r.err.splitlines() if ln.strip()]
    return (r.rc == 2 and len(err) == 1 and err[0].startswith("error:") and all(w in err[0] for w in words)
            and "Traceback" not in r.out + r.err)


def refused(*words: str) -> Callable:
    """One ``error:`` line (``one_error``) and nothing left on disk."""
    return lambda r: (one_error(r, *words) and r.left == "none", "")


def no_model_built(r: Result) -> bool:
    """The run was refused before any model was built (and before any page: the memory check
    comes first): a -failed run directory with no case and no 'model build' phase."""
    m = r.manifest()
    return (m.get("status") == "failed" and not m.get("cases")
            and "model build" not in (m.get("timing") or {}).get("phases_s", {}))


def line_with(r: Result, text: str) -> str:
    return next((ln for ln in r.lines if text in ln), "")


def report_lines(r: Result) -> list:
    runs = r.run_dirs()
    return (runs[-1] / "report.md").read_text().splitlines() if runs and (runs[-1] / "report.md").exists() else []


def s1_tiny(r: Result) -> tuple:
    m = r.manifest()
    note = next((w for w in m.get("warnings", []) if "tokenization_x" in w), "")
    versions = " ".join(ln for ln in report_lines(r) if ln.startswith("| versions"))
    tf = "transformers 4.46.3" in versions
    ran = (r.tmp / "model" / MARKER).exists()
    return (r.rc == 0 and not ran and bool(note) and (tf or not r.ctx["tf"]),
            f"{MARKER} {'written' if ran else 'absent'}; transformers {'4.46.3 in the run' if tf else 'not importable'};"
            f" warning: {note}")


def s1_control(r: Result) -> tuple:
    ran = (r.tmp / "model" / MARKER).exists()
    return r.rc == 0 and ran, f"{MARKER} {'written: transformers imported tokenization_x.py' if ran else 'absent'}"


def marker_absent(d: str, *words: str) -> Callable:
    def check(r: Result) -> tuple:
        ran = (r.tmp / d / MARKER).exists()
        return one_error(r, *words) and r.left == "none" and not ran, f"{MARKER} {'written' if ran else 'absent'}"
    return check


def s1_allowed(r: Result) -> tuple:
    said = [ln for ln in r.lines if "model=vendor runs the Python code in" in ln]
    ran = (r.tmp / "vendor" / MARKER)
    what = ran.read_text() if ran.exists() else "nothing"
    return (len(said) == 1 and ran.exists() and "Traceback" not in r.out + r.err,
            f"{said[0] if said else '(no start-up line)'}; {MARKER}: {what} ran")


def s3_merge_link(r: Result) -> tuple:
    leaked = [p for p in r.tmp.rglob("*") if p.is_file() and not p.is_symlink() and p.name != "secret.txt"
              and p.suffix in ("", ".gz", ".txt", ".json") and b"SECRET" in p.read_bytes()]
    return one_error(r, "symbolic link", "secret.txt") and r.left == "none" and not leaked, ""


def s3_merge_control(r: Result) -> tuple:
    merged = r.tmp / "merged"
    man = json.loads((merged / "manifest.json").read_text()) if (merged / "manifest.json").exists() else {}
    return (r.rc == 0 and len(man.get("cases", [])) == 2,
            f"merged/manifest.json: {len(man.get('cases', []))} cases, status {man.get('status')}")


def s3_summary_link(r: Result) -> tuple:
    out = list((r.tmp / "outside").iterdir())
    return one_error(r, "symbolic link", "summary") and not out and r.left == "none", f"$TMP/outside/: {len(out)} files"


def r1_batch(r: Result) -> tuple:
    m = r.manifest()
    phases = list((m.get("timing") or {}).get("phases_s", {}))
    return (one_error(r, "fix: lower workload.batch") and no_model_built(r),
            f"manifest: status {m.get('status')}, {len(m.get('cases', []))} cases, phases {', '.join(phases)}")


def r2_progress(r: Result) -> tuple:
    said = [ln for ln in r.lines if re.search(r"decode step [\d,]+ of [\d,]+ done, [\d.]+ tok/s, about .* left", ln)]
    return r.rc == 0 and bool(said) and all(ln.startswith("[harness] ") for ln in said), \
        f"{len(said)} progress line(s), the first: {said[0] if said else '(none)'}"


def l1_cpu(r: Result) -> tuple:
    lines = report_lines(r)
    first = next((ln for ln in lines[1:] if ln.strip()), "")
    bound = [ln for ln in lines if ln.startswith("| t-2x3 |") and "device: cpu (host clocks):" in ln]
    gpu_words = [ln for ln in lines if "GPU pages/s" in ln or "bound by: gpu" in ln or "| gpu:" in ln]
    return (r.rc == 0 and first.startswith("> **device: cpu (host clocks).**") and bool(bound) and not gpu_words,
            f"report.md, the line under its title: {first[:150]}...; 'bound by' cells read 'device: cpu (host clocks): ...'"
            f" ({len(bound)} rows); 'GPU pages/s' / 'gpu:' nowhere: {not gpu_words}")


def l2_model(r: Result) -> tuple:
    lines = report_lines(r)
    model = next((ln for ln in lines if "model `" in ln), "")
    said = line_with(r, "[harness] model ")
    m = r.manifest().get("model", {})
    ok = "`tiny` (reference, 16,867,744 parameters)" in model and "tiny (reference, 16,867,744 parameters)" in said
    return r.rc == 0 and ok and m.get("params") == 16867744, f"report: {model}; run: {said}"


def compare_rows(r: Result) -> list:
    return [ln for ln in r.out.splitlines() if ln.startswith("| t-2x3")]


def l3_noise(r: Result) -> tuple:
    rows = compare_rows(r)
    ok = rows and all("| 1 / 1 | yes (too few repeats) |" in ln for ln in rows)
    return r.rc == 0 and bool(ok), f"{len(rows)} rows, e.g. {rows[0] if rows else '(none)'}"


def l3_interval(r: Result) -> tuple:
    rows = compare_rows(r)
    ok = rows and all(re.search(r"x \[[\d.]+–[\d.]+\] \| 3 / 3 \| (yes|no)\b", ln) for ln in rows)
    return r.rc == 0 and bool(ok), f"{len(rows)} rows, e.g. {rows[-1] if rows else '(none)'}"


def l4_partial(r: Result) -> tuple:
    rows = compare_rows(r)
    note = next((ln for ln in r.out.splitlines() if "marked partial" in ln), "")
    ok = rows and all(ln.startswith("| t-2x3 (partial in B) |") for ln in rows) and note
    return r.rc == 0 and bool(ok), f"{rows[0] if rows else '(no row)'}; note: {note}"


def l5_inside(r: Result) -> tuple:
    run = next((r.tmp / "runs").glob("*-a"))
    return one_error(r, "inside the run directory") and not (run / "sub").exists(), ""


def l6_multirun(r: Result) -> tuple:
    m0, m1 = (r.manifest(d) for d in r.run_dirs()[:2]) if len(r.run_dirs()) >= 2 else ({}, {})
    t0, t1 = (m.get("timing") or {} for m in (m0, m1))
    s0, s1 = (t.get("phases_s", {}).get("start-up") for t in (t0, t1))
    ok = r.rc == 0 and s0 is not None and s1 is not None and s1 < 1.0 and s1 < t0.get("total_s", 0)
    return ok, f"job 0: start-up {s0} s of {t0.get('total_s')} s; job 1: start-up {s1} s of {t1.get('total_s')} s"


def l7_fix(r: Result) -> tuple:
    return one_error(r, "'measure'", "takes an int", "measure.KEY=VALUE") and "'4 measure'" not in r.err \
        and r.left == "none", ""


def l8_note(r: Result) -> tuple:
    said = line_with(r, "[harness] note: mode 't' has crop: false")
    return r.rc == 0 and "base_size 128 is not used" in said and any("base_size 128 is not used" in w for w in
                                                                    r.manifest().get("warnings", [])), said


def l9_cache(r: Result) -> tuple:
    cal = next((ln for ln in report_lines(r) if ln.startswith("| calibration |")), "")
    ok = r.rc == 0 and "not cached: cannot write /dev/null/x/" in cal and "None" not in cal
    return ok and not any("cached at None" in ln for ln in r.lines), f"report: {cal}"


TITLES = """import json, sys
from pathlib import Path
import harness.report.breakdown as breakdown
from harness.report.report import write_report
titles, save = [], breakdown.save_figure
def record(fig, path):
    if Path(path).name == "time_breakdown.png":
        titles.extend(ax.get_title(loc="left") for ax in fig.axes)
    return save(fig, path)
breakdown.save_figure = record
write_report(sys.argv[1], strict=True)
print(json.dumps(titles))
"""


def l10_title(r: Result) -> tuple:
    """The panel titles time_breakdown.png draws: the report's own writer rerun on a copy of the run,
    the axes' titles read from the figure it saves as time_breakdown.png."""
    copy = r.tmp.parent / (r.tmp.name + "-title")
    shutil.copytree(r.run_dirs()[-1], copy)
    got = subprocess.run([sys.executable, "-c", TITLES, str(copy)], env=child_env(r.tmp, {}), capture_output=True,
                         text=True, timeout=120)
    shutil.rmtree(copy, ignore_errors=True)
    titles = json.loads(got.stdout.strip().splitlines()[-1]) if got.returncode == 0 else []
    title = titles[0] if titles else got.stderr.strip()[-200:]
    ok = (r.rc == 0 and len(titles) == 1 and title.startswith("t-2x3: each stage's median over 2 timed repeat(s);")
          and "the median request (repeat=" in title)
    return ok, "panel title: " + title.replace("\n", " / ")


def l11_index(r: Result) -> tuple:
    co = r.tmp / "checkout"
    after = hashlib.sha1((co / ".git" / "index").read_bytes()).hexdigest()
    subprocess.run(["git", "status", "--porcelain"], cwd=co, capture_output=True, check=True)
    control = hashlib.sha1((co / ".git" / "index").read_bytes()).hexdigest()
    git = r.manifest().get("git", {})
    ok = r.rc == 0 and after == r.ctx["index_before"] and control != after and git.get("dirty") is False
    return ok, (f"index sha1 {r.ctx['index_before'][:10]} before the run, {after[:10]} after; a plain `git status` "
                f"then rewrote it ({control[:10]}); manifest git: {str(git.get('revision'))[:7]}, dirty {git.get('dirty')}")


def l12_nits(r: Result) -> tuple:
    m = r.manifest()
    odd = [ln for ln in r.lines if not ln.startswith("[harness] ")]
    build_s = m.get("model", {}).get("build_s")
    counted = [ln for ln in r.lines if re.search(r"repeat=\d+ \(\d+ of \d+\)", ln)]
    median = next((ln for ln in report_lines(r) if ln.startswith("| t-2x3 |")), "")
    ok = (r.rc == 0 and not odd and build_s == round(build_s, 3) and counted and "| repeat=" in median)
    return ok, (f"lines not starting '[harness] ': {len(odd)}; build_s {build_s}; "
                f"{'; '.join(ln.split(': ', 1)[1].split(',')[0] for ln in counted)}; headline median request: "
                f"{'repeat=' + median.split('| repeat=')[1].split(' ')[0] if '| repeat=' in median else '?'}")


def l12_logged(r: Result) -> tuple:
    said = line_with(r, "model=vendor runs the Python code in")
    return said.startswith("[harness] "), "the start-up line: " + said[:60] + "..."


def pytest_passed(r: Result) -> tuple:
    last = r.out.strip().splitlines()[-1] if r.out.strip() else ""
    return r.rc == 0 and " passed" in last and "failed" not in last, last


def superseded(r: Result) -> tuple:
    ok, last = pytest_passed(r)
    tops = {d: FIXTURES.checkout / "runs" / "examples" / d / "report.md" for d in SUPERSEDED}
    marked = [d for d, p in tops.items() if "> **Superseded report**" in p.read_text().split("\n## ", 1)[0]]
    return ok and len(marked) == 3, f"{last}; marked superseded at the top: {', '.join(marked)}"


SUPERSEDED = ("h100-optimize", "h200-crop_mode", "h200-optimize-gundam-batch")
#: the README sentences P3 asked for (the outside timing, the old 'best', the Gundam decode length,
#: the batched rows that predate the batched router, the launch count)
P3 = ("runs/examples/h100-decode-choose/outside.log", "not today's `best`", "Gundam 2x3 page, 8 decode tokens",
      "ran before the batched Triton router", "a batch-1 decode step is 119 launches")


def p3_prose(r: Result) -> tuple:
    found = [s for s in P3 if s in r.out]
    return r.rc == 0 and len(found) == len(P3), f"{len(found)} of {len(P3)} sentences found"


def exit0(r: Result) -> tuple:
    return r.rc == 0 and "Traceback" not in r.out + r.err, ""


# ------------------------------------------------------------------------------------- the rows

def harness_run(*args: str) -> list:
    return ["harness", "run", *args, RUNS]


ROWS = [
    Row("s1-tiny", "S1", harness_run(*TINY, "model.path={tmp}/model"), s1_tiny, tokenizer_dir, env={"TF": True}),
    Row("s1-control", "S1 (control)", ["python", "-c", "from transformers import AutoTokenizer; "
                                       "AutoTokenizer.from_pretrained('{tmp}/model', trust_remote_code=True)"],
        s1_control, tokenizer_dir, env={"TF": True}),
    Row("s1-vendor", "S1", harness_run("model=vendor", "model.path=models/deepseek-ocr"),
        refused("model=vendor would import and run the Python code in", "model.trust_remote_code=true")),
    Row("s1-vendor-standin", "S1", harness_run("model=vendor", "model.path={tmp}/vendor"),
        marker_absent("vendor", "model=vendor would import and run the Python code in"), vendor_dir, env={"TF": True}),
    Row("s1-vendor-allowed", "S1", harness_run("model=vendor", "model.path={tmp}/vendor", "model.trust_remote_code=true"),
        s1_allowed, vendor_dir, env={"TF": True}),
    Row("s1-tiny-flag", "S1", harness_run("model=tiny", "model.trust_remote_code=true"),
        refused("model.trust_remote_code=true applies to model=vendor only")),
    Row("s2-dotdot", "S2", ["harness", "run", "model=tiny", "run.name=../../../OUTSIDE", "run.root={tmp}/x/a/b/runs"],
        refused("holds a path separator")),
    Row("s2-nested", "S2", ["harness", "run", "model=tiny", "run.name=a/b", "run.root={tmp}/x/a/b/runs"],
        refused("holds a path separator")),
    Row("s3-merge-link", "S3", ["harness", "merge", "{run:-t}", "{run:-u}", "--out", "{tmp}/merged"], s3_merge_link,
        linked_trace),
    Row("s3-merge-control", "S3 (control)", ["harness", "merge", "{run:-t}", "{run:-u}", "--out", "{tmp}/merged"],
        s3_merge_control, fixture("pair", "-t", "-u")),
    Row("s3-summarize-link", "S3", ["harness", "summarize", "{sweep}"], s3_summary_link, linked_summary),
    Row("r1-batch", "R1", harness_run("model=tiny", "workload.batch=2000"), r1_batch),
    Row("r1-memoryerror", "R1", harness_run("model=tiny", "workload.batch=2000", "run.memory_check=false",
                                            "workload.decode_tokens=2", "measure.repeats=1", "measure.warmup=0"),
        lambda r: (one_error(r, "out of memory (MemoryError)"), ""), as_limit=True),
    Row("r1-torch-oom", "R1", harness_run("model=tiny", "workload.batch=64", "workload.decode_tokens=2",
                                          "measure.repeats=1", "measure.warmup=0"),
        lambda r: (one_error(r, "out of memory"), ""), as_limit=True),
    Row("r2-positions", "R2", harness_run("model=tiny", "workload.decode_tokens=100000"),
        refused("exceed the 8,192 the model holds", "7,906")),
    Row("r2-progress", "R2", harness_run("model=tiny", MODE, "workload.decode_tokens=1000", "hardware.calibrate=false"),
        r2_progress),
    Row("l1", "L1", harness_run(*TINY[:3], "measure.repeats=2", "measure.warmup=0"), l1_cpu),
    Row("l2", "L2", [], l2_model, same_as="l1"),
    Row("l3", "L3", ["harness", "compare", "{run:-a}", "{run:-b}", "--out", "{tmp}/cmp"], l3_noise,
        fixture("same", "-a", "-b")),
    Row("l3-interval", "L3", ["harness", "compare", "{run:-a}", "{run:-b}", "--out", "{tmp}/cmp"], l3_interval,
        fixture("same3", "-a", "-b")),
    Row("l4", "L4", ["harness", "compare", "{run:-a}", "{run:-p-interrupted}", "--out", "{tmp}/cmp"], l4_partial,
        fixture("partial", "-a", "-p-interrupted")),
    Row("l5-existing", "L5", ["harness", "compare", "{run:-a}", "{run:-b}", "--out", "{tmp}/existing"],
        refused("already exists"), existing_dir),
    Row("l5-inside", "L5", ["harness", "compare", "{run:-a}", "{run:-b}", "--out", "{run:-a}/sub"], l5_inside,
        fixture("same", "-a", "-b")),
    Row("l6", "L6", ["harness", "run", "-m", "model=tiny", MODE, "workload.decode_tokens=2,3", "measure.repeats=1",
                     "measure.warmup=0", RUNS], l6_multirun),
    Row("l7", "L7", harness_run("model=tiny", "workload.decode_tokens=4", "measure"), l7_fix),
    Row("l8", "L8", harness_run("model=tiny", "workload.mode={name: t, base_size: 128, image_size: 64, crop: false}",
                                *TINY[2:]), l8_note),
    Row("l9", "L9", harness_run(*TINY, "hardware.cache_dir=/dev/null/x"), l9_cache),
    Row("l10", "L10", [], l10_title, same_as="l1"),
    Row("l11", "L11", ["harness", "run", *TINY, RUNS], l11_index, stale_index,
        env={"PYTHONPATH": "{tmp}/checkout/src"}),
    Row("l12", "L12", [], l12_nits, same_as="l1"),
    Row("l12-logged", "L12", [], l12_logged, same_as="s1-vendor-allowed"),
    Row("p1", "P1", ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp={tmp}/pytest",
                     "tests/test_evidence.py", "-k", "names_its_code or provenance"], pytest_passed, in_checkout=True),
    Row("p2", "P2", ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp={tmp}/pytest",
                     "tests/test_evidence.py", "-k", "above"], superseded, in_checkout=True),
    Row("p3-prose", "P3", ["grep", "-o", "-F", *[a for s in P3 for a in ("-e", s)], "README.md"], p3_prose,
        in_checkout=True),
    Row("p3-tables", "P3", ["python", "scripts/readme_tables.py", "--check"], exit0, in_checkout=True),
    Row("stale-check", "P1-P3 (stale check)", ["python", "scripts/provenance.py"], exit0, in_checkout=True),
    Row("stale-tests", "P1-P3 (stale check)", ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                               "--basetemp={tmp}/pytest", "tests/test_stale_evidence.py"],
        pytest_passed, in_checkout=True),
]


# ------------------------------------------------------------------------------------- fixtures

class Fixtures:
    """The clone under test and the runs several rows start from, each built once per table."""

    def __init__(self, work: Path, tf: Optional[Path]):
        self.work, self.tf = work, tf
        self.checkout = work / "co"
        self.built: dict = {}

    def clone(self) -> str:
        subprocess.run(["git", "clone", "-q", str(ROOT), str(self.checkout)], check=True)
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=self.checkout, capture_output=True,
                              text=True, check=True).stdout.strip()

    def _run(self, tmp: Path, args: list, until: Optional[str] = None) -> None:
        """``python -m harness run ARGS`` in ``tmp``; with ``until``, SIGINT once that text is printed."""
        log = tmp / f".{len(list(tmp.glob('.*')))}.out"
        with log.open("w") as out:
            p = subprocess.Popen([sys.executable, "-m", "harness", "run", *args], cwd=tmp, env=child_env(tmp, {}),
                                 stdout=out, stderr=subprocess.STDOUT)
            t0 = time.monotonic()
            while until and p.poll() is None and time.monotonic() - t0 < 300:
                if until in log.read_text():
                    p.send_signal(signal.SIGINT)
                    break
                time.sleep(0.2)
            p.wait(timeout=300)

    def build(self, name: str) -> Path:
        """The runs of fixture ``name`` (a folder of run directories, or the sweep's directory)."""
        if name in self.built:
            return self.built[name]
        tmp = self.work / "fixtures" / name
        tmp.mkdir(parents=True)
        seed_cache(tmp)
        root = f"run.root={tmp}/runs"
        if name == "pair":      # two cases of other names, each with its profiled trace (for merge)
            for n in ("t", "u"):
                self._run(tmp, ["model=tiny", MODE.replace("name: t", f"name: {n}"), *TINY[2:], "measure.kernels=true",
                                f"run.name={n}", root])
        elif name in ("same", "same3"):    # one config twice, 1 or 3 timed repeats each (for compare)
            for n in ("a", "b"):
                self._run(tmp, [*TINY[:3], f"measure.repeats={3 if name == 'same3' else 1}", "measure.warmup=0",
                                f"run.name={n}", root])
        elif name == "partial":  # a finished run and one stopped by SIGINT after 3 of 1000 repeats
            done = next(p for p in self.build("same").iterdir() if p.name.endswith("-a"))
            shutil.copytree(done, tmp / "runs" / done.name)
            self._run(tmp, [*TINY[:3], "measure.repeats=1000", "measure.warmup=0", "run.name=p", root],
                      until="(3 of 1000)")
        elif name == "sweep":   # a multirun of two jobs (for summarize)
            self._run(tmp, ["-m", "model=tiny", MODE, "workload.decode_tokens=2,3", "measure.repeats=1",
                            "measure.warmup=0", root])
            self.built[name] = next((tmp / "runs").glob("multirun-*"))
            return self.built[name]
        self.built[name] = tmp / "runs"
        return self.built[name]


FIXTURES: Fixtures


# ------------------------------------------------------------------------------------- running

def child_env(tmp: Path, row_env: dict) -> dict:
    """This environment, the clone's src first on PYTHONPATH ($TF's packages after it for TF rows),
    the calibration cache and transformers' copies of a directory's code (``HF_MODULES_CACHE``) in
    ``tmp``, no bytecode written, no Hydra traceback mode."""
    path = [str(FIXTURES.checkout / "src")]
    if row_env.get("TF") and FIXTURES.tf:
        path.append(str(FIXTURES.tf))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), HARNESS_CACHE_DIR=str(tmp / "cache"),
               HF_MODULES_CACHE=str(tmp / "hf-modules"), PYTHONDONTWRITEBYTECODE="1")
    env.update({k: v.replace("{tmp}", str(tmp)) for k, v in row_env.items() if isinstance(v, str)})
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def argv_of(row: Row, tmp: Path) -> list:
    """The row's command with its placeholders filled: {tmp}, {run:SUFFIX} (the run directory under
    $TMP/runs whose name ends so), {sweep} (the multirun directory), models/ (this checkout's)."""
    def fill(a: str) -> str:
        for m in re.finditer(r"\{run:([^}]+)\}", a):
            a = a.replace(m.group(0), str(next(p for p in (tmp / "runs").iterdir() if p.name.endswith(m.group(1)))))
        if "{sweep}" in a:
            a = a.replace("{sweep}", str(next((tmp / "runs").glob("multirun-*"))))
        if a.startswith("model.path=models/"):
            a = "model.path=" + str(ROOT / a.split("=", 1)[1])
        return a.replace("{tmp}", str(tmp))
    head = {"harness": [sys.executable, "-m", "harness"], "python": [sys.executable]}
    return head.get(row.argv[0], [row.argv[0]]) + [fill(a) for a in row.argv[1:]]


def shown(text: str, tmp: Path) -> str:
    """``text`` with this machine's paths as $TMP, $CHECKOUT, $TF and repository-relative, times as <time>."""
    for path, name in ((tmp, "$TMP"), (FIXTURES.checkout, "$CHECKOUT"), (FIXTURES.tf, "$TF"), (ROOT, ".")):
        if path is not None:
            text = text.replace(str(path) + "/", "" if name == "." else name + "/").replace(str(path), name)
    return TIME.sub("<time>", text).replace(sys.executable, "python")


def command(row: Row, cmd: list, tmp: Path) -> str:
    """The command as a user types it ($TINY for the smoke knobs)."""
    text = shlex.join(["python", *cmd[1:]] if cmd[0] == sys.executable else cmd)
    text = text.replace(shlex.join(TINY), "$TINY")
    pre = "PYTHONPATH=$TF " if row.env.get("TF") and FIXTURES.tf else ""
    pre += "".join(f"{k}={v.replace('{tmp}', str(tmp))} " for k, v in row.env.items() if isinstance(v, str))
    pre = ("(ulimit -v %d; " % (AS_LIMIT_BYTES // 1024) if row.as_limit else "") + pre
    return shown(pre + text + (")" if row.as_limit else ""), tmp)


def files_left(tmp: Path, before: set) -> str:
    """What a command added under ``tmp``: each new run directory with its file count, status and
    cases; other new folders by file count; new files by name; 'none'."""
    new = [p for p in tmp.rglob("*") if p not in before]
    tops = [p for p in new if p.parent not in new]
    units = []
    for p in sorted(tops):   # a new folder of run directories (runs/) is listed by its runs
        kids = sorted(p.iterdir()) if p.is_dir() and not p.is_symlink() and not (p / "manifest.json").exists() else []
        units += kids if kids and any(p.rglob("manifest.json")) else [p]
    out = []
    for p in units:
        rel = shown(str(p), tmp)
        if p.is_symlink() or not p.is_dir():
            out.append(rel)
            continue
        n = sum(1 for f in p.rglob("*") if f.is_file())
        mans = sorted(p.rglob("manifest.json"))
        states = [json.loads(m.read_text()) for m in mans]
        runs = "; ".join(f"status {m.get('status')}, {len(m.get('cases', []))} case(s)" for m in states)
        out.append(f"{rel}/ ({n} file(s)" + (f"; {runs})" if runs else ")"))
    return "; ".join(out) or "none"


def run_row(row: Row, work: Path) -> Result:
    tmp = work / "rows" / row.id
    tmp.mkdir(parents=True)
    seed_cache(tmp)
    ctx = {"tf": bool(row.env.get("TF") and FIXTURES.tf)}
    if row.setup:
        row.setup(tmp, ctx)
    before = set(tmp.rglob("*"))
    cmd = argv_of(row, tmp)
    cwd = FIXTURES.checkout if row.in_checkout else tmp
    limit = (lambda: resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT_BYTES, AS_LIMIT_BYTES))) if row.as_limit else None
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=cwd, env=child_env(tmp, row.env), capture_output=True, text=True,
                           timeout=row.timeout_s, preexec_fn=limit)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out, err = 124, exc.stdout or "", f"(killed after the {row.timeout_s} s timeout)"
        out, err = (out.decode(errors="replace") if isinstance(out, bytes) else out), err
    res = Result(rc, out, err, time.monotonic() - t0, tmp, ctx, before)
    res.left = files_left(tmp, before)
    res.ctx["command"] = command(row, cmd, tmp)
    return res


def first_line(r: Result) -> str:
    out, err = ([ln for ln in s.splitlines() if ln.strip()] for s in (r.out, r.err))
    lines = (err or out) if r.rc != 0 else (out or err)
    return lines[0] if lines else "(no output)"


HEADER = ["item", "id", "command", "exit", "first line", "shows", "files left", "wall s", "holds"]


def cell(text: str, limit: int = 420) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + " …"


def main(argv=None) -> int:
    global FIXTURES
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transformers", type=Path, help="a --target install of transformers 4.46.3 (the S1 rows)")
    ap.add_argument("--only", nargs="*", help="row ids to run (default: all)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directories")
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="issue37-"))
    FIXTURES = Fixtures(work, a.transformers.resolve() if a.transformers else None)
    rev = FIXTURES.clone()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.splitlines()
    print(f"code: {rev} (a clone of this checkout's HEAD); this working tree: {len(dirty)} modified tracked "
          f"file(s); transformers: {'$TF' if FIXTURES.tf else 'not on the path'}", file=sys.stderr)
    sys.path.insert(0, str(FIXTURES.checkout / "src"))
    from harness.markdown import LEFT, RIGHT, table

    align = [LEFT, LEFT, LEFT, RIGHT, LEFT, LEFT, LEFT, RIGHT, LEFT]
    print("\n".join(table(HEADER, [], align)), flush=True)
    done: dict = {}
    for row in ROWS:
        if a.only and row.id not in a.only and row.same_as not in a.only:
            continue
        if row.id == "s1-vendor" and not (ROOT / "models" / "deepseek-ocr").is_dir():
            continue
        res = done[row.same_as] if row.same_as else run_row(row, work)
        done[row.id] = res
        try:
            ok, what = row.check(res)
        except Exception as exc:  # noqa: BLE001 - a check that cannot read what it needs does not hold
            ok, what = False, f"(check failed: {exc!r})"
        cells = [row.item, row.id, f"`{res.ctx['command']}`", res.rc, f"`{cell(shown(first_line(res), res.tmp))}`",
                 cell(shown(what, res.tmp)), cell(res.left), f"{res.wall_s:.1f}", "yes" if ok else "no"]
        print(table(HEADER, [cells], align)[-1], flush=True)
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"kept {work}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
