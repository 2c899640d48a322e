"""Nsight Systems over one stage: ``nsys profile -t cuda,nvtx --capture-range=nvtx`` and the
``nsys stats`` reports ``nvtx_gpu_proj_sum`` and ``cuda_gpu_kern_sum`` parsed into tables.

Where nsys is missing or cannot write a report (some sandboxes leave only a ``.qdstrm``), it
says so and gives the exact command for a machine with a full Nsight Systems install.
"""
from __future__ import annotations

import io
import subprocess
from pathlib import Path

import pandas as pd

from ..errors import HarnessError
from . import find_tool, portable_command, run_logged
from .ncu import NVTX_DOMAIN, shell

REPORTS = ("nvtx_gpu_proj_sum", "cuda_gpu_kern_sum")


def nsys_command(stage: str, child: list[str], report: Path, nsys: str = "nsys") -> list[str]:
    return [nsys, "profile", "-t", "cuda,nvtx", "--capture-range=nvtx", f"--nvtx-capture={stage}@{NVTX_DOMAIN}",
            "--capture-range-end=stop", "-f", "true", "-o", str(report), *child]


def stats_command(rep: Path, out_base: Path, nsys: str = "nsys") -> list[str]:
    return [nsys, "stats", "--report", ",".join(REPORTS), "--format", "csv", "--force-export=true",
            "--output", str(out_base), str(rep)]


def parse_stats_csv(text: str) -> pd.DataFrame:
    """An ``nsys stats --format csv`` report (header line first) as a DataFrame; ns columns numeric."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if "," in ln and not ln.startswith(("NOTICE", "WARNING"))), None)
    if start is None:
        return pd.DataFrame()
    df = pd.read_csv(io.StringIO("\n".join(lines[start:])))
    for c in df.columns:
        if "(ns)" in c or c in ("Instances", "Range Instances", "Time (%)"):
            df[c] = pd.to_numeric(df[c], errors="coerce")
    return df


def run_nsys(stage: str, child: list[str], out_dir: Path) -> dict:
    nsys = find_tool("nsys")
    out = out_dir / "nsys"
    out.mkdir(parents=True, exist_ok=True)
    report = out / "report"
    cmd = nsys_command(stage, child, report, nsys or "nsys")
    portable = shell(nsys_command(stage, portable_command(child), Path(f"nsys-{stage}")))
    (out / "command.txt").write_text(portable + "\n")
    if nsys is None:
        raise HarnessError("Nsight Systems (nsys) was not found", f"on a machine with Nsight Systems run: {portable}")
    rc = run_logged(cmd, out / "nsys.log")
    rep = report.with_suffix(".nsys-rep")
    if rc != 0 or not rep.exists():
        left = [p.name for p in out.iterdir() if p.suffix in (".qdstrm", ".nsys-rep")]
        raise HarnessError(f"nsys could not write a report here (exit {rc}; left: {left or 'nothing'})",
                           f"run on a machine with a full Nsight Systems install: {portable}")
    proc = subprocess.run(stats_command(rep, out / "stats", nsys), capture_output=True, text=True)
    if proc.returncode != 0:
        raise HarnessError(f"nsys stats failed: {proc.stderr.strip()[:300]}", f"run it by hand: {portable}")
    paths = {"report": rep}
    for name in REPORTS:
        hits = sorted(out.glob(f"stats_{name}*.csv"))
        if hits:
            df = parse_stats_csv(hits[-1].read_text())
            df.to_csv(out / f"{name}.csv", index=False)
            paths[name] = out / f"{name}.csv"
    return paths
