"""The nsys session of ``python -m harness profile tool=nsys stage=<stage>``: find nsys, check its
importer can run, profile the child run's first timed request, convert a left-over .qdstrm,
export the two stats reports and compare nsys's projected GPU time per stage with the child's
CUDA-event stage times.

Writes ``nsys/`` in the profile run directory: ``report.nsys-rep``, ``nvtx_gpu_proj_sum.csv``,
``cuda_gpu_kern_sum.csv``, ``compare.csv`` (columns ``nsys.COMPARE_COLUMNS``), ``report.md``,
``command.txt`` (portable commands: no local paths), ``session.json`` (what ran here: nsys,
importer, library folders, options dropped for this nsys version) and the logs.

Settings (``profile.*``): ``nsys_range`` request (default: every stage in one capture) | stage
(only the ``stage`` range); ``nsys_warmup`` untimed requests before the captured one (default 1:
lazy CUDA/cuBLAS set-up stays outside it); ``cuda_graph_trace`` graph | node | null (null: node
when ``execution.cuda_graphs`` is set, else nsys's default).
"""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd

from ..errors import HarnessError
from ..schema.stages import read_observations
from .ncu import shell
from .tools import run_logged
from .nsys import (IMPORTER_LIBS, LIBS_DEFAULT, LIBS_ENV, PROFILE_OPTIONS, REPORTS, compare_stages, find_importer,
                   find_nsys, harness_stage_ms, import_command, missing_libs, nsys_command, nsys_libs,
                   parse_stats_csv, pick_report, projected_by_stage, render, stats_command, supported_options,
                   with_libs)

FETCH_FIX = (f"run scripts/fetch_nsys_libs.sh where apt works and carry {Path(LIBS_DEFAULT).parent}/ here "
             f"(or set {LIBS_ENV}=DIR with libdw.so.1 and libelf.so.1)")


@dataclass
class NsysSettings:
    """The nsys knobs of ``profile.*`` (module docstring)."""

    range: str = "request"
    warmup: int = 1
    cuda_graph_trace: str | None = None

    @classmethod
    def from_config(cls, cfg) -> "NsysSettings":
        """From the typed config (``profile.*``, validated by the schema; ``execution.cuda_graphs`` or
        ``execution.prefill_graphs`` / ``vision_impl=fused`` on turn node-level graph tracing on)."""
        prof, m = cfg.profile, cfg.execution
        cgt = prof.cuda_graph_trace
        if cgt is None and (m.cuda_graphs != "none" or m.prefill_graphs or m.vision_impl == "fused"):
            cgt = "node"
        return cls(prof.nsys_range, prof.nsys_warmup, cgt)


def portable_commands(stage: str, overrides: list[str], child: list[str], settings: NsysSettings) -> dict:
    """The same session as commands for another machine: no interpreter path, no run folder."""
    keep = [o for o in overrides if not o.split("=", 1)[0].lstrip("+~") == "run.root"]
    args = [a for a in child[4:] if not a.startswith("run.root=")]
    capture = "request" if settings.range == "request" else stage
    nsys = nsys_command(capture, ["python", "-m", "harness", "run", *args], Path("nsys-report"),
                        cuda_graph_trace=settings.cuda_graph_trace)
    return {"harness": shell(["python", "-m", "harness", "profile", *keep]), "nsys": shell(nsys),
            "stats": shell(["nsys", "stats", "--report", ",".join(REPORTS), "--format", "csv", "--output",
                            "nsys-report", "nsys-report.nsys-rep"])}


def _version(nsys: Path, env: dict) -> str | None:
    try:
        res = subprocess.run([str(nsys), "--version"], capture_output=True, text=True, env=env, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip().splitlines()[-1] if res.returncode == 0 and res.stdout.strip() else None


def _help(nsys: Path, env: dict) -> str | None:
    try:
        res = subprocess.run([str(nsys), "profile", "--help"], capture_output=True, text=True, env=env, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return (res.stdout + res.stderr) if res.returncode == 0 else None


def _tail(path: Path, n: int = 400) -> str:
    return path.read_text(errors="replace")[-n:].replace("\n", " | ") if path.is_file() else ""


def run_nsys(cfg, stage: str, child: list[str], out_dir: Path, overrides: list[str]) -> dict:
    """Profile ``child`` (``python -m harness run ...``, one timed request after the warm-ups)
    under nsys and write ``out_dir/nsys/``; returns the written paths."""
    settings = NsysSettings.from_config(cfg)
    out = Path(out_dir) / "nsys"
    out.mkdir(parents=True, exist_ok=True)
    portable = portable_commands(stage, overrides, child, settings)
    (out / "command.txt").write_text("\n".join(f"# {k}\n{v}" for k, v in portable.items()) + "\n")
    nsys = find_nsys()
    if nsys is None:
        raise HarnessError("Nsight Systems (nsys) was not found on PATH, under /opt/nvidia/nsight-systems, "
                           "/opt/nvidia/nsight-compute/*/host/target-linux-x64 or the CUDA install",
                           f"install Nsight Systems (or put nsys on PATH) and run: {portable['harness']}")
    libs, libs_from = nsys_libs()
    env = with_libs(os.environ, libs)
    env["NSYS_NVTX_PROFILER_REGISTER_ONLY"] = "0"   # capture on any NVTX string (the harness registers its own)
    importer = find_importer(nsys)
    session = {"nsys": str(nsys), "nsys_version": _version(nsys, env), "importer": str(importer) if importer else None,
               "libs": [str(d) for d in libs], "libs_from": libs_from, "settings": asdict(settings)}
    if importer is not None:   # ldd as nsys runs it: its own folder on the library path too
        missing = missing_libs(importer, with_libs(env, [importer.parent]))
        session["importer_missing_libs"] = missing
        fatal = [m for m in missing or [] if m in IMPORTER_LIBS]
        if fatal:
            (out / "session.json").write_text(json.dumps(session, indent=2) + "\n")
            raise HarnessError(f"the nsys importer ({importer.name}) cannot load {', '.join(fatal)}, so nsys would "
                               "leave only a .qdstrm", FETCH_FIX)
        if missing:
            print(f"[harness] warning: ldd finds no {', '.join(missing)} for {importer.name}; trying anyway",
                  flush=True)
    options, dropped = supported_options(_help(nsys, env), PROFILE_OPTIONS)
    capture = "request" if settings.range == "request" else stage
    cmd = nsys_command(capture, child, out / "report", nsys, options, settings.cuda_graph_trace)
    session.update(options=options, options_dropped=dropped, capture=capture, command=cmd)
    (out / "session.json").write_text(json.dumps(session, indent=2) + "\n")
    if dropped:
        print(f"[harness] this nsys does not know {', '.join(dropped)}: left out", flush=True)
    print(f"[harness] nsys over `{capture}@harness` ({nsys}, libraries: {libs_from}): {shell(cmd)}", flush=True)
    rc = run_logged(cmd, out / "nsys.log", env=env)
    rep, imported_by = pick_report(out, "report", "nsys-rep"), None
    qdstrm = pick_report(out, "report", "qdstrm")
    if rep is None and qdstrm is not None and importer is not None:
        icmd = import_command(importer, qdstrm)
        print(f"[harness] converting the left-over {qdstrm.name}: {shell(icmd)}", flush=True)
        irc = run_logged(icmd, out / "import.log", env=env)
        rep = pick_report(out, "report", "nsys-rep")
        session["import"] = {"command": icmd, "exit": irc, "report": str(rep) if rep else None}
        if rep is not None:   # the .nsys-rep holds the same data; the .qdstrm can be GBs
            imported_by = importer.name
            qdstrm.unlink()
    session["exit"] = rc
    (out / "session.json").write_text(json.dumps(session, indent=2, default=str) + "\n")
    if rep is None:
        left = sorted(p.name for p in out.iterdir() if p.suffix in (".qdstrm", ".nsys-rep"))
        why = ("no importer found next to nsys" if qdstrm is not None and importer is None else
               f"import failed: {_tail(out / 'import.log', 200)}" if qdstrm is not None else _tail(out / "nsys.log"))
        raise HarnessError(f"nsys wrote no report (exit {rc}; left: {left or 'nothing'}; {why})",
                           f"see {out / 'nsys.log'}; on a machine with a full Nsight Systems install run: "
                           f"{portable['harness']}")
    return finish(out, rep, nsys, env, stage, capture, settings, session, imported_by, Path(out_dir) / "child")


def finish(out: Path, rep: Path, nsys: Path, env: dict, stage: str, capture: str, settings: NsysSettings,
           session: dict, imported_by: str | None, child_root: Path) -> dict:
    """Export the stats reports, compare with the child run's stages.csv, write report.md."""
    proc = subprocess.run(stats_command(rep, out / "stats", nsys), capture_output=True, text=True, env=env)
    (out / "stats.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise HarnessError(f"nsys stats failed: {proc.stderr.strip()[:300]}", f"see {out / 'stats.log'}")
    tables = {}
    for name in REPORTS:
        hits = sorted(out.glob(f"stats_{name}*.csv"))
        if not hits:
            raise HarnessError(f"nsys stats wrote no {name} table", f"see {out / 'stats.log'} (nsys 2023.2+ has it)")
        tables[name] = parse_stats_csv(hits[-1].read_text())
        tables[name].to_csv(out / f"{name}.csv", index=False)
    manifests = sorted(child_root.glob("*/manifest.json"))
    if not manifests:
        raise HarnessError("the profiled child run wrote no run directory", f"see {out / 'nsys.log'}")
    child_run = manifests[-1].parent
    man = json.loads(manifests[-1].read_text())
    if man.get("status") != "complete":
        raise HarnessError(f"the profiled child run ended {man.get('status')}: {man.get('error')}", f"see {child_run}")
    captured = ("request", "sam", "clip", "projector", "prefill", "decode") if capture == "request" else (capture,)
    harness = harness_stage_ms(read_observations(child_run / "stages.csv"))
    cmp = compare_stages(projected_by_stage(tables["nvtx_gpu_proj_sum"]), harness, captured)
    cmp.to_csv(out / "compare.csv", index=False)
    meta = {"case": (man.get("cases") or [{}])[0].get("name", ""), "capture": capture, "report": rep.name,
            "imported_by": imported_by, "warmup": settings.warmup, "cuda_graph_trace": settings.cuda_graph_trace,
            "nsys_version": session.get("nsys_version"), "options": session.get("options", [])}
    (out / "report.md").write_text(render(cmp, tables["cuda_gpu_kern_sum"], meta))
    print((out / "report.md").read_text())
    head = cmp[cmp["stage"] == stage].iloc[0]
    if head["within_2pct"] is not None and not head["within_2pct"]:
        print(f"[harness] {stage}: nsys projected {head['nsys_proj_ms']:.3f} ms vs CUDA events "
              f"{head['harness_ms']:.3f} ms (ratio {head['ratio']:.4f}): outside 2%", flush=True)
    return {"report": rep, "compare": out / "compare.csv", "report_md": out / "report.md",
            **{name: out / f"{name}.csv" for name in REPORTS}, "child_run": child_run}


def rerender(nsys_dir: Path, child_run: Path) -> pd.DataFrame:
    """compare.csv and report.md again from a saved ``nsys/`` folder and its child run."""
    nsys_dir = Path(nsys_dir)
    proj = pd.read_csv(nsys_dir / "nvtx_gpu_proj_sum.csv")
    cmp = compare_stages(projected_by_stage(proj), harness_stage_ms(read_observations(Path(child_run) / "stages.csv")))
    cmp.to_csv(nsys_dir / "compare.csv", index=False)
    kern_csv = nsys_dir / "cuda_gpu_kern_sum.csv"
    kern = pd.read_csv(kern_csv) if kern_csv.is_file() else pd.DataFrame()
    (nsys_dir / "report.md").write_text(render(cmp, kern, {"capture": "request", "report": "report.nsys-rep"}))
    return cmp
