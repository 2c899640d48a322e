"""``python -m harness merge RUN_DIR RUN_DIR... --out DIR``: one run directory, and one report, from
runs that split one experiment across several processes on one machine.

A long ladder (``+experiment=optimize``) run as several ``run.only=[...]`` runs back to back (one
device call each) leaves each run's report without the ratios between its cases and another run's
(a batched row's throughput and time per token against the best batch-1 row). The merged directory
holds the sources' observations, and the report the one report writer
(``harness.report.report.write_report``) derives from them, as if one process had measured every case.

Written into ``--out`` (a new directory; built in a temporary directory beside it and renamed into
place at the end, so a failure leaves nothing):

* the observation files (``harness.schema.CASE_FILES``: stages.csv, kernels.csv, steps.csv,
  routing_steps.csv, routing.csv, step_clock.csv): each source's rows, in the order the runs are given, as the
  source wrote them (one header: the sources' headers must agree), and each case's trace directory
  (``traces/<case>/``);
* manifest.json: the first run's, with ``cases`` (each entry gains ``source_run``), ``skipped_cases``
  (each gains ``run``) and ``warnings`` (each prefixed ``<run>: ``; a source's "report not written"
  warning is about its own report, which the merge rewrites, and is left out) concatenated;
  ``attention`` (the kernels that ran) their union; ``host_steadiness``: the probe of the earliest
  run before its cases and of the latest after its cases; ``started`` the earliest, ``finished`` the
  latest; ``timing`` {run: its own timing}; ``argv`` and ``cwd`` of the merge; ``status``
  ``complete`` only when every source is, else the first other status, with ``error`` (each such
  run's error after its name) and ``stopped_at`` of the first (a case a signal cut short keeps its
  ``partial`` and ``repeats_done``); ``merged_from``: per source its directory name and path,
  status, error, git revision and dirty flag, started, finished, cases and command;
* the report (``write_report(out, strict=True)``): report.md (with the "Merged from N runs" line
  under its title), headline.csv, stages_summary.csv, analytic.csv, roofline.csv and the charts.

Refused with one line (exit 2), everything checked before anything is written: fewer than two runs;
a path that is not a run directory (no manifest.json) or cannot be read; a run without stages.csv
(it measured no case); a run still ``starting`` or ``running`` (its files are still growing, or
its process was killed before it closed them); two runs of the same directory name; ``--out``
missing, existing, or inside a source; a symbolic link among what the merge reads or copies (a
source's manifest.json, observation files, trace directories and what they hold:
``harness.containment``), or a trace a manifest places outside its run; a case name (or trace
directory) in two runs; observation files whose columns differ; and runs whose numbers are not
comparable: a leaf of ``SAME`` that differs (device identity, the GPU pinning, package versions,
git revision and dirty flag, dtype, the model's adapter, weights and config, the ``hardware``
settings, the resolved ``measure`` settings; ``VOLATILE`` leaves aside) or another calibration
record (``calibration_record``: the same cached record, its ``measured`` time and values, proves
one machine session; a run with a record and one without are refused too). The error names the
field and both values.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from ..containment import copy_tree, refuse_links, refuse_links_under
from ..errors import HarnessError
from ..floats import finite as _f
from ..roofline.calibrate import MANIFEST_KEYS
from ..rundir import RunData, open_run
from ..schema.manifest import Manifest
from ..schema import CASE_FILES
from .report import write_report

USAGE = "python -m harness merge RUN_A RUN_B [...] --out DIR"
NOT_A_RUN = "give run directories written by `python -m harness run` (each holds manifest.json)"
#: manifest fields whose every leaf must agree between the runs (dotted paths into manifest.json)
SAME = ("device", "launch.CUDA_VISIBLE_DEVICES", "versions", "git.revision", "git.dirty", "dtype", "model.adapter",
        "model.weights", "config.model", "config.hardware", "measure")
#: leaves of ``SAME`` read at one instant that say nothing of the machine: the clocks nvidia-smi saw
VOLATILE = ("device.nvidia_smi.clocks.sm", "device.nvidia_smi.clocks.mem")
#: the fix for a field that differs, by its first part
FIXES = {"device": "merge runs measured on the same GPU of one machine",
         "launch": "merge runs measured on the same GPU of one machine (the same CUDA_VISIBLE_DEVICES)",
         "versions": "merge runs of one environment (rerun the odd one out in the others' environment)",
         "git": "merge runs of one harness revision (rerun the odd one out from the others' checkout)",
         "calibration": "merge runs of one machine session: back-to-back runs find the same cached calibration "
                        "record (rerun the odd one out there, without clearing the calibration cache)"}
SETTINGS_FIX = "rerun the odd one out with the others' settings (only the cases, run.only, may differ)"
#: the statuses of a run whose files are still growing (or whose process died before it closed them)
OPEN = ("starting", "running")
#: the fields a closed run's manifest gets when it ends early; the merge keeps them per source
STOP_FIELDS = ("error", "stopped_at", "traceback", "report_error", "rename_error")
_ABSENT = object()


def _leaves(value, at: str) -> dict:
    """{dotted path: value} of every leaf under ``value`` (a non-empty dict is walked; anything else is a leaf)."""
    if isinstance(value, dict) and value:
        return {k: v for key, item in value.items() for k, v in _leaves(item, f"{at}.{key}").items()}
    return {at: value}


def _get(manifest: dict, dotted: str):
    """The value at a dotted path of a manifest (None where a part is missing)."""
    for part in dotted.split("."):
        manifest = manifest.get(part) if isinstance(manifest, dict) else None
    return manifest


def calibration_record(manifest: dict) -> Optional[dict]:
    """The calibration record a run's ceilings came from (``roofline.calibrate.MANIFEST_KEYS`` but
    its cache path: ``measured`` time, device, values, settings), or None when it used none (not
    calibrated, rejected). Measured on first use by one run and found cached by the next, it is the
    same record."""
    entry = Manifest.of(manifest).calibration
    if _f(entry.get("gemm_tflops")) is None:
        return None
    return {k: entry.get(k) for k in MANIFEST_KEYS if k != "path"}


def _shown(value) -> str:
    text = "absent" if value is _ABSENT else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def first_difference(a: dict, b: dict) -> Optional[tuple]:
    """(field, its value in ``a``, in ``b``, as text) of the first leaf of ``SAME`` (``VOLATILE`` aside) or of
    the calibration record where the manifests ``a`` and ``b`` differ; None when they agree."""
    ra, rb = calibration_record(a), calibration_record(b)
    if (ra is None) != (rb is None):
        def used(record, manifest):
            if record is not None:
                return f"the record measured {record.get('measured') or 'at a time it does not say'}"
            return f"no record: {Manifest.of(manifest).calibration.get('status') or 'not recorded'}"
        return "calibration", used(ra, a), used(rb, b)
    pairs = [(field, _get(a, field), _get(b, field)) for field in SAME] + [("calibration", ra, rb)]
    for field, va, vb in pairs:
        la, lb = _leaves(va, field), _leaves(vb, field)
        for key in dict.fromkeys([*la, *lb]):
            x, y = la.get(key, _ABSENT), lb.get(key, _ABSENT)
            if key not in VOLATILE and x != y and not (x != x and y != y):   # NaN (JSON's NaN) is NaN
                return key, _shown(x), _shown(y)
    return None


def _header(path: Path) -> Optional[str]:
    """The first line of a CSV, None for a missing or empty file."""
    if not path.is_file() or path.stat().st_size == 0:
        return None
    with open(path) as f:
        return f.readline().rstrip("\n")


def _trace_dirs(run: RunData) -> list:
    """The trace directories (relative, e.g. ``traces/best``) of the run's cases that exist."""
    dirs = [Path(Manifest.trace_file(c)).parent for c in run.manifest["cases"] if Manifest.trace_file(c)]
    return [d for d in dirs if (run.path / d).is_dir()]


def check_out(out, runs: list, verb: str) -> Path:
    """``--out`` of ``verb`` (merge, compare) as a Path once it is ruled out as anything that exists (a
    file, a folder, a link: the verb never writes into one) and as a path inside one of the run
    directories ``runs`` (run directories are never written into); raises HarnessError."""
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise HarnessError(f"--out {out} already exists",
                           f"give --out a new directory ({verb} never writes into an existing one)")
    for run in map(Path, runs):
        if out.resolve().is_relative_to(run.resolve()):
            raise HarnessError(f"--out {out} is inside the run directory {run}",
                               "give --out a new directory outside the run directories")
    return out


def check(paths: list, out) -> list:
    """The sources (``RunData``, in the order given) once every refusal of the module docstring is
    ruled out; raises HarnessError. Reads, writes nothing."""
    if len(paths) < 2:
        raise HarnessError(f"merge needs at least two run directories, got {len(paths)}",
                           f"name two or more: {USAGE}")
    if out is None:
        raise HarnessError("--out is missing", "name the new directory for the merged run: --out runs/<name>")
    check_out(out, [], "merge")
    runs = []
    for p in map(Path, paths):
        if p.is_dir():
            refuse_links(p, "manifest.json", *CASE_FILES, what="merge")
        if p.is_dir() and not (p / "manifest.json").is_file():
            raise HarnessError(f"{p} has no manifest.json, so it is not a run directory", NOT_A_RUN)
        if p.is_dir() and not (p / "stages.csv").is_file():
            raise HarnessError(f"{p} has no stages.csv: it measured no case", f"merge only runs that measured a case "
                                                                             f"(leave {p} out)")
        # manifest and stages.csv only (the cases): the tables are concatenated as text, read once by the report
        runs.append(open_run(p, NOT_A_RUN, "give existing run directories", tables=False))
        _check_traces(runs[-1])
    for r in runs:
        status = r.manifest.get("status")
        if status in OPEN:
            raise HarnessError(f"{r.path} has status {status}: it is still going, or its process was killed before "
                               "it closed it", "merge it once it has ended (complete, failed or interrupted)")
    check_out(out, [r.path for r in runs], "merge")
    names = [r.path.name for r in runs]
    for i, r in enumerate(runs):
        if r.path.name in names[:i]:
            raise HarnessError(f"two runs are named {r.path.name} ({runs[names.index(r.path.name)].path} and {r.path})",
                               "give each run directory its own name (rename one)")
    base = runs[0]
    for r in runs[1:]:
        diff = first_difference(base.manifest, r.manifest)
        if diff is not None:
            field, va, vb = diff
            raise HarnessError(f"{base.path.name} and {r.path.name} differ in {field} ({va} vs {vb}), so their numbers "
                               "are not comparable", FIXES.get(field.split(".")[0], SETTINGS_FIX))
    _check_unique(runs)
    for name in CASE_FILES:
        heads = [(r, _header(r.path / name)) for r in runs]
        heads = [(r, h) for r, h in heads if h is not None]
        for r, h in heads[1:]:
            if h != heads[0][1]:
                raise HarnessError(f"{r.path / name} has other columns than {heads[0][0].path / name}",
                                   "merge runs written by one harness revision")
    return runs


def _check_traces(run: RunData) -> None:
    """Refuse a trace the manifest places outside the run, or a link in a trace directory to copy."""
    for d in _trace_dirs(run):
        if d.is_absolute() or ".." in d.parts:
            raise HarnessError(f"{run.path / 'manifest.json'} places a trace at {d}, outside the run directory",
                               "merge runs whose traces are under their own traces/ folder, as a run writes them")
        refuse_links_under(run.path, d, what="merge")


def _check_unique(runs: list) -> None:
    """Refuse a case name, or a trace directory, that two runs hold."""
    seen, traces = {}, {}
    for r in runs:
        cases = [c.get("name") for c in r.manifest["cases"]] + list(r.stages["case"].unique() if len(r.stages) else [])
        for case in dict.fromkeys(cases):
            if case in seen:
                raise HarnessError(f"case {case!r} is in both {seen[case].path} and {r.path}",
                                   "merge runs of different cases (run.only=[...] splits an experiment)")
            seen[case] = r
        for d in _trace_dirs(r):
            if d in traces:
                raise HarnessError(f"{d} is in both {traces[d].path} and {r.path}",
                                   "rename one of the cases whose names map to it")
            traces[d] = r


def _concat_csv(runs: list, name: str, out: Path) -> None:
    """``name`` of every run that has it, rows in order, one header (``check`` made sure the headers agree)."""
    parts = [r.path / name for r in runs if _header(r.path / name) is not None]
    if not parts:
        return
    with open(out / name, "w") as dst:
        for i, src in enumerate(parts):
            with open(src) as f:
                if i:
                    f.readline()
                text = f.read()
            dst.write(text if not text or text.endswith("\n") else text + "\n")


def _source(r: RunData) -> dict:
    m = r.manifest
    git = Manifest.of(m).git
    return {"run": r.path.name, "path": str(r.path), "status": m.get("status"),
            **{k: m[k] for k in STOP_FIELDS[:2] if m.get(k) is not None},
            "revision": git.get("revision"), "dirty": git.get("dirty"), "started": m.get("started"),
            "finished": m.get("finished"), "cases": [c.get("name") for c in m["cases"]], "argv": m.get("argv")}


def _dirty_warning(mans: list) -> list:
    """The warning for runs of a checkout with uncommitted changes (``check`` made the flags agree)."""
    if not Manifest.of(mans[0][1]).git.get("dirty"):
        return []
    return ["the runs ran from a checkout with uncommitted changes (git dirty): their revision cannot show that "
            "they ran the same code"]


def merged_manifest(runs: list, argv: list) -> dict:
    """The merged run's manifest (module docstring) from the sources' (``check``ed)."""
    base = runs[0].manifest
    man = {k: v for k, v in base.items() if k not in STOP_FIELDS + ("roofline",)}
    mans = [(r.path.name, r.manifest) for r in runs]
    stopped = [(n, m) for n, m in mans if m.get("status") != "complete"]
    man.update(status=stopped[0][1].get("status") if stopped else "complete",
               error="; ".join(f"{n}: {m.get('error')}" for n, m in stopped) or None,
               argv=["harness-merge", *argv], cwd=os.getcwd(),
               cases=[{**c, "source_run": n} for n, m in mans for c in m["cases"]],
               skipped_cases=[{**s, "run": n} for n, m in mans for s in m.get("skipped_cases") or []],
               warnings=[f"{n}: {w}" for n, m in mans for w in m["warnings"]
                         if not str(w).startswith("report not written")] + _dirty_warning(mans),
               timing={n: m.get("timing") for n, m in mans},
               merged_from=[_source(r) for r in runs])
    if stopped and stopped[0][1].get("stopped_at") is not None:
        man["stopped_at"] = {"run": stopped[0][0], **stopped[0][1]["stopped_at"]}
    starts = [m.get("started") for _, m in mans if m.get("started")]
    ends = [m.get("finished") for _, m in mans]
    man["started"] = min(starts) if starts else None
    man["finished"] = max(ends) if all(ends) else None
    attention = {}
    for _, m in mans:
        for where, kinds in Manifest.of(m).attention.items():
            attention[where] = list(dict.fromkeys([*attention.get(where, []), *kinds]))
    man["attention"] = attention or base.get("attention")
    first = Manifest.of(min(mans, key=lambda nm: nm[1].get("started") or "")[1]).host_steadiness
    last = Manifest.of(max(mans, key=lambda nm: nm[1].get("finished") or "")[1]).host_steadiness
    steady = {k: s[k] for k, s in (("before", first), ("after", last)) if k in s}
    if steady or "host_steadiness" in man:
        man["host_steadiness"] = steady
    return man


def _write(runs: list, stage: Path, argv: list) -> None:
    """The merged observation files, traces and manifest into the (new, empty) directory ``stage``."""
    for name in CASE_FILES:
        _concat_csv(runs, name, stage)
    for r in runs:
        for d in _trace_dirs(r):
            copy_tree(r.path / d, stage / d)
    text = json.dumps(merged_manifest(runs, argv), indent=2, default=str)
    (stage / "manifest.json").write_text(text)


def merge_runs(paths: list, out, argv: Optional[list] = None) -> Path:
    """Merge the run directories ``paths`` into the new directory ``out`` and write its report
    (module docstring); returns ``out``. Raises HarnessError before anything is written."""
    runs = check(paths, out)
    out = Path(out)
    made = [p for p in [out.parent, *out.parent.parents] if not p.exists()]   # parents this merge creates
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.merging-", dir=out.parent))
    try:
        stage = tmp / out.name      # the report's title and charts name the directory: its final name
        stage.mkdir()
        _write(runs, stage, list(argv if argv is not None else [*map(str, paths), "--out", str(out)]))
        write_report(stage, strict=True)
        os.rename(stage, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in made:
            try:
                p.rmdir()
            except OSError:
                break
        raise
    tmp.rmdir()
    return out


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one HarnessError line (the CLI's exit 2) instead of a usage block."""

    def error(self, message):
        raise HarnessError(message, USAGE)


def merge_main(argv) -> int:
    p = _Parser(prog="python -m harness merge",
                description="One run directory and one report from runs split across processes on one machine.")
    p.add_argument("runs", nargs="*", help="run directories, in the order their cases are listed")
    p.add_argument("--out", default=None, help="the new directory of the merged run")
    args = p.parse_args(list(argv))
    out = merge_runs(args.runs, args.out, list(argv))
    cases = len(json.loads((out / "manifest.json").read_text())["cases"])
    print(f"[harness] merged {len(args.runs)} runs ({cases} cases) into {out}; report: {out / 'report.md'}")
    return 0


__all__ = ["merge_main", "merge_runs", "merged_manifest", "check", "check_out", "first_difference", "calibration_record", "SAME",
           "VOLATILE"]
