"""``python -m harness profile tool=ncu|nsys stage=<stage>``: an external profiler over one
stage's NVTX range of a harness request, joined with the analytic model.

The child is ``python -m harness run`` with the same model/workload overrides, one request
(no warm-up, no torch.profiler: ncu/nsys are the only CUPTI users). Outputs go to ``ncu/`` or
``nsys/`` inside the profile run directory.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path



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
        from .nsys import find_nsys

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


def profile_from_config(cfg, out_dir: Path) -> dict:
    """Run the profile verb (``cfg.tool`` over ``cfg.stage``, both validated by the config schema);
    returns paths of what it wrote."""
    from hydra.core.hydra_config import HydraConfig

    tool, stage = cfg.tool, cfg.stage
    overrides = list(HydraConfig.get().overrides.task)
    out_dir = Path(out_dir)
    if tool == "ncu":
        from .ncu_session import run_ncu
        return run_ncu(cfg, stage, child_command(cfg, out_dir / "child", overrides), out_dir)
    from .nsys_session import NsysSettings, run_nsys
    warmup = NsysSettings.from_config(cfg).warmup
    return run_nsys(cfg, stage, child_command(cfg, out_dir / "child", overrides, warmup), out_dir, overrides)


def run_logged(cmd: list[str], log: Path, timeout: float | None = None, env: dict | None = None) -> int:
    """Run ``cmd`` (environment ``env``, default this process's) with stdout+stderr to ``log``,
    whose first line is the command; returns the exit code."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        fh.write("$ " + " ".join(str(c) for c in cmd) + "\n")
        fh.flush()
        proc = subprocess.run([str(c) for c in cmd], stdout=fh, stderr=subprocess.STDOUT, timeout=timeout, env=env)
    return proc.returncode
