"""What both profiler sessions share: the child ``python -m harness run`` command (and its portable
form for another machine), finding a profiler binary, and running a command into a log file.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from .nsys import find_nsys


def child_command(cfg, root: Path, overrides: list[str], warmup: int = 0) -> list[str]:
    """``python -m harness run`` with the user's overrides: ``warmup`` untimed requests (they emit
    no NVTX ranges), then one timed request; torch.profiler off."""
    keep = [o for o in overrides if not o.split("=", 1)[0].lstrip("+~") in ("tool", "stage", "run.root")]
    extra = ["measure.kernels=false", f"measure.warmup={int(warmup)}", "measure.repeats=1", "measure.nvtx=true",
             f"run.root={root}"]
    if not any(o.startswith("workload.decode_tokens=") for o in keep):
        extra.append(f"workload.decode_tokens={cfg.profile.decode_tokens}")
    return [sys.executable, "-m", "harness", "run", *keep, *extra]


def portable_command(child: list[str]) -> list[str]:
    """``child`` (``child_command``) as a command to run on another machine: ``python -m harness
    run`` with the same overrides, without this machine's interpreter path and run folder (no
    ``run.root``: it writes under ``runs/`` there)."""
    return ["python", "-m", "harness", "run", *[a for a in child[4:] if not a.startswith("run.root=")]]


def find_tool(name: str) -> str | None:
    """``name`` on PATH, else the newest under /opt/nvidia or the CUDA install (nsys: see
    ``nsys.find_nsys``, which also knows the copy inside Nsight Compute)."""
    if name == "nsys":
        hit = find_nsys()
        return str(hit) if hit else None
    path = shutil.which(name)
    if path:
        return path
    for pattern in (f"/opt/nvidia/nsight-compute/*/{name}", f"/usr/local/cuda/bin/{name}"):
        hits = sorted(Path("/").glob(pattern.lstrip("/")), key=lambda p: [int(n) for n in re.findall(r"\d+", str(p))])
        if hits:
            return str(hits[-1])
    return None


def run_logged(cmd: list[str], log: Path, timeout: float | None = None, env: dict | None = None) -> int:
    """Run ``cmd`` (environment ``env``, default this process's) with stdout+stderr to ``log``,
    whose first line is the command; returns the exit code."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        fh.write("$ " + " ".join(str(c) for c in cmd) + "\n")
        fh.flush()
        proc = subprocess.run([str(c) for c in cmd], stdout=fh, stderr=subprocess.STDOUT, timeout=timeout, env=env)
    return proc.returncode


__all__ = ["child_command", "portable_command", "find_tool", "run_logged"]
