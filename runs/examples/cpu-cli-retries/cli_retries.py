"""Retry, from the command line, the commands issues 26, 25 and 22 list as failing, and tabulate
what each does now: exit code, its one line, wall seconds and what it left on disk.

    PYTHONPATH=src python runs/examples/cpu-cli-retries/cli_retries.py --out FILE [--only ID ...]

Each retry runs ``python -m harness ARGS`` as a subprocess (``PYTHONPATH`` = this tree's src) in a
fresh temporary directory (its run root ``runs/`` and calibration cache inside it; the cache starts
as a copy of the user's default record when there is one, so no retry measures the machine
unasked), with a timeout. A retry may prepare inputs (``setup``), send a signal once a text shows
up in the output (``signal``), inherit SIGHUP as ignored (``nohup``) or run on a tiny tmpfs
mounted in a user namespace (``fs_kib``: a real full disk, no root). ``holds`` is the retry's own
check of what the issue's acceptance asks for; the table says yes/no from it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal as sig
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[3]   # runs/examples/cpu-cli-retries/ -> the checkout
TINY = ["model=tiny", "workload.mode={name: t, base_size: 128, image_size: 64, crop: true}",
        "workload.decode_tokens=4", "measure.repeats=1"]
#: the line a run reports by: the first that starts with one of these, else the last line
LINE_RE = re.compile(r"^(error:|interrupted:|failed)")


@dataclass
class Result:
    """What one retry did: exit code, its one line, the whole output, wall seconds, the temp dir."""

    rc: int
    line: str
    output: str
    wall_s: float
    tmp: Path

    def runs(self) -> list[Path]:
        """Run directories (those with a manifest) under the temp dir, oldest first."""
        return sorted(p.parent for p in self.tmp.rglob("manifest.json"))

    def manifest(self) -> dict:
        """The last run's manifest ({} when there is none)."""
        runs = self.runs()
        return json.loads((runs[-1] / "manifest.json").read_text()) if runs else {}

    def file(self, name: str) -> Optional[Path]:
        """``name`` in the last run directory, if it is there."""
        runs = self.runs()
        return runs[-1] / name if runs and (runs[-1] / name).exists() else None


@dataclass
class Retry:
    id: str
    item: str                      # issue and item, e.g. "26.2"
    args: list                     # after ``python -m harness``; "{tmp}" is the retry's temp dir
    expected: str                  # what the issue asks for
    holds: Callable[[Result], bool]
    setup: Optional[Callable[[Path], None]] = None
    env: dict = field(default_factory=dict)
    signal: Optional[tuple] = None  # (signal, text in the output after which it is sent)
    nohup: bool = False            # the child starts with SIGHUP ignored (what ``nohup`` does)
    fs_kib: Optional[int] = None   # run root on a tmpfs of this size (user namespace)
    timeout_s: int = 300


# ------------------------------------------------------------------------------------ set-ups

def images(n: int, name: str = "pages") -> Callable[[Path], None]:
    """A folder ``name`` of ``n`` distinct 320 x 400 pages."""
    def make(tmp: Path) -> None:
        from PIL import Image
        d = tmp / name
        d.mkdir()
        for i in range(n):
            Image.new("RGB", (320, 400), (40 * i % 256, 255 - 30 * i % 256, 128)).save(d / f"p{i}.png")
    return make


def a_file(name: str) -> Callable[[Path], None]:
    def make(tmp: Path) -> None:
        (tmp / name).write_text("a file where a directory is expected\n")
    return make


def tiny_run(tmp: Path) -> None:
    """One finished tiny run under {tmp}/runs (for ``compare``) and a file ``out.txt``."""
    subprocess.run([sys.executable, "-m", "harness", "run", *TINY, f"run.root={tmp}/runs"], cwd=tmp,
                   env=child_env(tmp, {}), capture_output=True, timeout=300, check=True)
    (tmp / "out.txt").write_text("an existing file\n")


# ------------------------------------------------------------------------------------- checks

def code(rc: int, *words: str) -> Callable[[Result], bool]:
    """Exit ``rc`` with a line holding every word (for exit 2: the output is that one ``error:`` line)."""
    return lambda r: (r.rc == rc and all(w in r.line for w in words) and "Traceback" not in r.output
                      and (rc != 2 or r.line.startswith("error:") and len(r.output.strip().splitlines()) == 1))


def no_model(r: Result) -> bool:
    """No model was built: no run directory, or one marked failed with no case and no model build phase."""
    m = r.manifest()
    return not m or (m.get("status") == "failed" and not m.get("cases")
                     and "model build" not in (m.get("timing") or {}).get("phases_s", {}))


def refused_early(*words: str) -> Callable[[Result], bool]:
    """``code(2, ...)`` before any model is built (``no_model``)."""
    return lambda r: code(2, *words)(r) and no_model(r)


def complete(r: Result) -> bool:
    return r.rc == 0 and r.manifest().get("status") == "complete" and "Traceback" not in r.output


def routing_sums(r: Result, batch: int) -> bool:
    """Every (case, step, layer) row of routing_steps.csv counts batch x top-k token-expert picks."""
    import csv
    path, m = r.file("routing_steps.csv"), r.manifest()
    if path is None or not m:
        return False
    k = m["config"]["model"]["llm"]["num_experts_per_tok"]
    rows = list(csv.DictReader(path.open()))
    return bool(rows) and all(sum(int(v) for c, v in row.items() if re.fullmatch(r"e\d+", c)) == batch * k
                              for row in rows)


def same_routing(r: Result, a: str, b: str) -> bool:
    """Cases ``a`` and ``b`` have equal routing_steps.csv rows (step, layer, per-expert counts)."""
    import csv
    path = r.file("routing_steps.csv")
    rows = list(csv.DictReader(path.open())) if path else []
    of = lambda case: [{k: v for k, v in row.items() if k != "case"} for row in rows if row["case"] == case]  # noqa: E731
    return bool(of(a)) and of(a) == of(b)


def distinct_pages(r: Result, n: int) -> bool:
    cases = r.manifest().get("cases", [])
    return bool(cases) and all(c.get("distinct_pages") == n and c.get("batch") == n for c in cases)


def partial_kept(r: Result) -> bool:
    """SIGINT inside a case: exit 130, status interrupted, the case kept as partial with >= 1 repeat."""
    m = r.manifest()
    cases = m.get("cases", [])
    return (r.rc == 130 and m.get("status") == "interrupted" and len(cases) == 1 and cases[0].get("partial") is True
            and (cases[0].get("repeats_done") or 0) >= 1 and "1 partial case" in r.line)


def default_record_kept(r: Result) -> bool:
    """calibrate with small settings: the default record unchanged, and either exit 0 with a record of
    its own beside it, or exit 2 refusing a measurement that varied too much (nothing cached)."""
    cache = r.tmp / "cache"
    before = (r.tmp / "default-record.json").read_bytes() if (r.tmp / "default-record.json").exists() else None
    default = sorted(p for p in cache.glob("calibration-*.json") if "--" not in p.name)
    other = [p for p in cache.glob("calibration-*--*.json")]
    kept = before is None or (bool(default) and default[0].read_bytes() == before)
    return kept and (r.rc == 0 and bool(other) or code(2, "nothing was cached")(r) and not other)


def full_disk(r: Result) -> bool:
    """Exit 1 with one ``error:`` line, no temp files, a run dir (if any) marked failed with the
    number of cases the line says were kept."""
    tmps = [p for p in r.tmp.rglob("*") if ".tmp" in p.name]
    m = r.manifest()
    kept = re.search(r"(\d+) finished case", r.line)
    counts_agree = not m or not kept or int(kept.group(1)) == len(m.get("cases", []))
    return (r.rc == 1 and r.line.startswith("error:") and not tmps and counts_agree
            and (not m or m.get("status") == "failed") and "Traceback" not in r.output)


def throughput_ok(r: Result) -> bool:
    return complete(r) and r.file("throughput.csv") is not None and r.wall_s < 120


def optimize_cpu(r: Result) -> bool:
    """Runs the cases a CPU can run and names the rest (skipped_cases), or refuses up front with a run.only."""
    m = r.manifest()
    if r.rc == 2:
        return "run.only=[" in r.line and not r.runs()
    return complete(r) and bool(m.get("cases")) and bool(m.get("skipped_cases"))


def vision_compile_cpu(r: Result) -> bool:
    if r.rc == 2:
        return code(2, "vision_compile")(r)
    rep = r.file("report.md")
    return complete(r) and rep is not None and "compiled vision" not in rep.read_text()


# ------------------------------------------------------------------------------------ retries

ONE = "a folder of one page"
RETRIES = [
    Retry("compile-growing", "26.1", ["run", *TINY, "execution.compile=true"],
          "refused: exit 2, one line naming execution.compile and the static cache",
          code(2, "execution.compile", "kv_cache")),
    Retry("vision-compile-cpu", "26.1", ["run", *TINY, "execution.vision_compile=true"],
          "refused (exit 2, naming execution.vision_compile), or run and not labelled 'compiled vision'",
          vision_compile_cpu),
    Retry("vision-compile-fused-cpu", "26.1", ["run", *TINY, "execution.vision_impl=fused",
                                               "execution.vision_compile=true"],
          "refused on a CPU (exit 2, naming execution.vision_compile), or run and not labelled 'compiled vision'",
          vision_compile_cpu),
    Retry("static-compile-loop", "26.2", ["run", *TINY, "execution.kv_cache=static", "execution.compile=true"],
          "refused: exit 2, one line naming execution.moe_impl=grouped", code(2, "moe_impl")),
    Retry("static-len-8", "26.2", ["run", *TINY, "execution.kv_cache=static", "execution.static_cache_len=8"],
          "refused: exit 2, one line naming execution.static_cache_len", code(2, "static_cache_len")),
    Retry("full-disk-start", "26.3", ["run", *TINY], "tmpfs of 16 KiB: exit 1, one error: line, no temp "
          "files, any run dir marked failed", full_disk, fs_kib=16),
    Retry("full-disk-mid", "26.3", ["run", *TINY], "tmpfs of 160 KiB: exit 1, one error: line, no temp "
          "files, run dir marked failed, kept count = manifest cases", full_disk, fs_kib=160),
    *[Retry(f"full-disk-{kib}k", "26.3", ["run", *TINY], f"tmpfs of {kib} KiB: as above", full_disk, fs_kib=kib)
      for kib in (48, 96)],
    Retry("only-unnamed", "26.4", ["run", "+experiment=crop_mode", "run.only=[tiny]", "model=tiny",
                                   "workload.decode_tokens=4", "measure.repeats=1", "measure.kernels=false"],
          "runs the case the run names tiny: exit 0, 1 case", lambda r: complete(r) and len(r.manifest()["cases"]) == 1),
    Retry("only-unknown", "26.4", ["run", "+experiment=crop_mode", "run.only=[nosuch]", "model=tiny"],
          "refused: exit 2, one line listing the case names (tiny, small, ...)", refused_early("tiny", "small")),
    Retry("optimize-cpu", "26.5", ["run", "+experiment=optimize", *TINY],
          "runs the cases a CPU can run and names the rest, or refuses with a run.only=[...] that works",
          optimize_cpu, timeout_s=580),
    Retry("nohup-sighup", "26.6", ["run", *TINY, "measure.repeats=6"],
          "SIGHUP ignored by the parent stays ignored: exit 0, status complete", complete,
          signal=(sig.SIGHUP, "repeat 2/6"), nohup=True),
    Retry("sigint-in-case", "26.7", ["run", *TINY, "measure.repeats=1000"],
          "exit 130, status interrupted, the case kept as partial with its finished repeats", partial_kept,
          signal=(sig.SIGINT, "repeat 5/1000")),
    Retry("calibrate-small", "26.8", ["calibrate", "hardware.gemm_size=256", "hardware.copy_mib=8"],
          "the default record unchanged; the small one cached under its own name (exit 0), or refused when its "
          "repeats vary too much (exit 2, nothing cached)", default_record_kept),
    Retry("compare-out-file", "26.9", ["compare", "{tmp}/runs/RUN", "{tmp}/runs/RUN", "--out", "{tmp}/out.txt"],
          "one error: line naming --out / the file, no traceback", code(2, "out.txt"), setup=tiny_run),
    Retry("cache-dir-file", "26.9", ["calibrate", "hardware.cache_dir={tmp}/afile"],
          "one error: line naming hardware.cache_dir, exit 2", code(2, "hardware.cache_dir"), setup=a_file("afile")),
    Retry("conf-nowhere", "26.9", ["run", *TINY], "one error: line naming HARNESS_CONF and the path, exit 2",
          code(2, "HARNESS_CONF", "/nowhere"), env={"HARNESS_CONF": "/nowhere"}),
    Retry("images-space", "26.9", ["run", *TINY, "workload.images={tmp}/my", "pages/"],
          "one error: line saying quote it, exit 2", refused_early("quote it"), setup=images(1, "my pages")),
    Retry("images-non-ascii", "26.9", ["run", *TINY, "workload.images={tmp}/pagés/"],
          "one error: line saying quote it, exit 2", refused_early("quote it"), setup=images(1, "pagés")),
    Retry("pages-3-b1", "26.10", ["run", *TINY, "workload.pages=3"],
          "runs: exit 0 (requests cycle through 3 distinct pages at batch 1)", complete),
    Retry("pages-2-b4", "26.10", ["run", *TINY, "workload.pages=2", "workload.batch=4"],
          "refused: exit 2, naming workload.repeat_pages=true (fewer distinct pages than the batch)",
          refused_early("repeat_pages")),
    Retry("old-kv-cache-knob", "23", ["run", *TINY, "model.kv_cache=static"],
          "refused: exit 2, one line naming execution.kv_cache", refused_early("execution.kv_cache")),
    Retry("tp-workers-0", "25", ["run", "+experiment=throughput", "model=tiny", "throughput.workers=0"],
          "refused before any model: exit 2, one error: line with a fix", refused_early("throughput.workers", "fix:")),
    Retry("tp-batch-gt-pages", "25", ["run", "+experiment=throughput", "model=tiny", "throughput.pages=2",
                                      "throughput.batches=[4]"],
          "refused before any model: exit 2, one error: line with a fix", refused_early("fix:")),
    Retry("tp-one-page", "25", ["run", "+experiment=throughput", "model=tiny", "workload.images={tmp}/pages"],
          "refused before any model: exit 2, one error: line with a fix", refused_early("fix:"), setup=images(1)),
    Retry("tp-cpu", "25", ["run", "+experiment=throughput", *TINY[:3]],
          "completes in under 120 s wall, writes throughput.csv", throughput_ok, timeout_s=300),
    Retry("folder-lt-batch", "22", ["run", *TINY, "workload.images={tmp}/pages", "workload.batch=4"],
          "refused before any model: exit 2, one error: line naming workload.repeat_pages=true",
          refused_early("workload.repeat_pages=true"), setup=images(2)),
    Retry("b4-static-grouped", "22", ["run", *TINY, "workload.batch=4", "execution.kv_cache=static",
                                      "execution.moe_impl=grouped"],
          "exit 0; 4 distinct pages in the manifest; routing_steps.csv rows, each layer's counts = 4 x top-k",
          lambda r: complete(r) and distinct_pages(r, 4) and routing_sums(r, 4)),
    Retry("b4-vs-vendor", "22", ["run", *TINY, "workload.batch=4", "cases=[{name: vendor-style}, {name: "
                                 "static-grouped, execution: {kv_cache: static, moe_impl: grouped}}]"],
          "exit 0; both cases 4 distinct pages, counts = 4 x top-k, static-grouped's per-step counts equal "
          "vendor-style's (fp32)", lambda r: (complete(r) and distinct_pages(r, 4) and routing_sums(r, 4)
                                              and same_routing(r, "vendor-style", "static-grouped"))),
]


# ------------------------------------------------------------------------------------- running

def child_env(tmp: Path, extra: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HARNESS_CACHE_DIR=str(tmp / "cache"), **extra)
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def seed_cache(tmp: Path) -> None:
    """{tmp}/cache with a copy of the user's default calibration record (kept as default-record.json)."""
    (tmp / "cache").mkdir()
    home = Path(os.environ.get("HARNESS_CACHE_DIR", Path.home() / ".cache" / "dsocr-harness"))
    for rec in home.glob("calibration-*.json"):
        if "--" not in rec.name:
            shutil.copy(rec, tmp / "cache" / rec.name)
            shutil.copy(rec, tmp / "default-record.json")


def argv_of(retry: Retry, tmp: Path) -> list[str]:
    runs = [p.parent.name for p in (tmp / "runs").glob("*/manifest.json")]
    args = [a.replace("{tmp}", str(tmp)).replace("RUN", runs[0] if runs else "RUN") for a in retry.args]
    if args[0] in ("run", "calibrate"):
        args.append(f"run.root={tmp}/fs/runs" if retry.fs_kib else f"run.root={tmp}/runs")
    cmd = [sys.executable, "-m", "harness", *args]
    if retry.fs_kib:   # a real full disk: a tmpfs of fs_kib KiB in a user namespace, copied out after the run
        script = (f'mount -t tmpfs -o size={retry.fs_kib}k tmpfs "$0" && "$@"; rc=$?; '
                  f'cp -a "$0"/. "$0.after"/ 2>/dev/null; exit $rc')
        (tmp / "fs").mkdir()
        (tmp / "fs.after").mkdir()
        cmd = ["unshare", "-Urm", "sh", "-c", script, str(tmp / "fs"), *cmd]
    return cmd


def run_one(retry: Retry) -> tuple[Result, list[str]]:
    tmp = Path(tempfile.mkdtemp(prefix=f"retry-{retry.id}-"))
    seed_cache(tmp)
    if retry.setup:
        retry.setup(tmp)
    before = {p for p in tmp.rglob("*")}
    cmd = argv_of(retry, tmp)
    log = (tmp / ".out").open("w+")
    pre = (lambda: sig.signal(sig.SIGHUP, sig.SIG_IGN)) if retry.nohup else None
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, cwd=tmp, env=child_env(tmp, retry.env), stdout=log, stderr=subprocess.STDOUT,
                         preexec_fn=pre)
    sent = retry.signal is None
    while p.poll() is None and time.monotonic() - t0 < retry.timeout_s:
        if not sent and retry.signal[1] in (tmp / ".out").read_text(errors="replace"):
            p.send_signal(retry.signal[0])
            sent = True
        time.sleep(0.2)
    if p.poll() is None:
        p.kill()
    rc = p.wait()
    wall = time.monotonic() - t0
    out = (tmp / ".out").read_text(errors="replace")
    lines = [ln for ln in out.splitlines() if ln.strip()]
    line = next((ln for ln in lines if LINE_RE.match(ln)), lines[-1] if lines else "")
    if not sent:
        line = f"(signal not sent: {retry.signal[1]!r} never printed) " + line
    if time.monotonic() - t0 >= retry.timeout_s:
        line = f"(killed after the {retry.timeout_s} s timeout) " + line
    if retry.fs_kib:   # read what the tmpfs held from its copy
        shutil.rmtree(tmp / "fs")
        (tmp / "fs.after").rename(tmp / "fs")
    res = Result(rc, line.replace(str(tmp), "$TMP"), out, wall, tmp)
    left = files_left(tmp, before)
    return res, left


def files_left(tmp: Path, before: set) -> list[str]:
    """What the retry left under its temp dir: each run dir with its file count, status and cases;
    other new files by name (the calibration cache by file name)."""
    out = []
    runs = sorted(p.parent for p in tmp.rglob("manifest.json") if p.parent not in before)
    bare = [d for d in (tmp / "runs").glob("*") if d.is_dir() and d not in runs and d not in before]
    for r in runs:
        m = json.loads((r / "manifest.json").read_text())
        n = sum(1 for p in r.rglob("*") if p.is_file())
        out.append(f"{r.relative_to(tmp).parent}/…{r.name[-18:]}/ ({n} files, status {m.get('status')}, "
                   f"{len(m.get('cases', []))} case(s))")
    for p in sorted(tmp.rglob("*")):
        if p in before or p.name == ".out" or any(r == p or r in p.parents for r in runs + bare) or p.is_dir():
            continue
        out.append(str(p.relative_to(tmp)))
    out += [f"runs/{d.name}/ (no manifest: {', '.join(sorted(p.name for p in d.iterdir()))})" for d in bare]
    return out or ["nothing"]


def shown(retry: Retry) -> str:
    """The command as a user types it ($TINY for the smoke knobs, $TMP for the temp dir)."""
    tiny = all(a in retry.args for a in TINY)
    args = shlex.join(a for a in retry.args if not (tiny and a in TINY))
    if tiny:
        args = args.replace(retry.args[0], retry.args[0] + " $TINY", 1)
    env = "".join(f"{k}={v} " for k, v in retry.env.items())
    pre = ("nohup " if retry.nohup else "") + (f"[tmpfs {retry.fs_kib} KiB] " if retry.fs_kib else "")
    post = f" + {sig.Signals(retry.signal[0]).name} after '{retry.signal[1]}'" if retry.signal else ""
    return f"{pre}{env}python -m harness {args}".replace("{tmp}", "$TMP") + post


HEADER = ["id", "issue item", "command", "expected", "exit", "first line", "files left", "wall s", "holds"]


def flat(text: str) -> str:
    """``text`` on one line (a table cell; ``harness.markdown`` escapes its ``|``)."""
    return text.replace("\n", " ")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="Markdown file for the table")
    ap.add_argument("--only", nargs="*", help="retry ids to run (default: all)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directories")
    a = ap.parse_args(argv)
    from harness.markdown import LEFT, table

    align = [LEFT] * len(HEADER)
    rows = []
    for retry in RETRIES:
        if a.only and retry.id not in a.only:
            continue
        res, left = run_one(retry)
        try:
            ok = retry.holds(res)
        except Exception as exc:  # noqa: BLE001 - a check that cannot read the files does not hold
            ok, left = False, left + [f"(check failed: {exc!r})"]
        row = [retry.id, retry.item, f"`{flat(shown(retry))}`", flat(retry.expected), res.rc,
               f"`{flat(res.line[:420])}`", flat("; ".join(left)), f"{res.wall_s:.1f}", "yes" if ok else "NO"]
        print(table(HEADER, [row], align)[-1], flush=True)
        rows.append(row)
        if not a.keep:
            shutil.rmtree(res.tmp, ignore_errors=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("\n".join(table(HEADER, rows, align)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
