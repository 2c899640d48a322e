"""The run directory: manifest.json (status, config, versions, device, git) and incremental CSVs.

``manifest.json`` is written with ``status: running`` first and rewritten as each case finishes;
it says ``complete`` only at the very end. A failed run is marked ``failed`` (with the error),
gets a ``FAILED`` file, and its directory is renamed with a ``-failed`` suffix, so no failed
directory looks complete.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pandas as pd

PACKAGES = ("torch", "transformers", "tokenizers", "hydra-core", "omegaconf", "nvtx", "torchlens", "pandas",
            "numpy", "pillow", "safetensors", "flash-attn", "triton", "matplotlib")


def package_versions() -> dict:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_revision(root: Path | None = None) -> dict:
    root = root or Path(__file__).resolve().parents[3]
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5)
        if rev.returncode != 0:
            return {"revision": None, "dirty": None, "reason": rev.stderr.strip()[:200]}
        return {"revision": rev.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError) as exc:
        return {"revision": None, "dirty": None, "reason": str(exc)}


def device_info(device) -> dict:
    """Device name, memory, capability, driver and the clocks setting (nvidia-smi when present)."""
    import torch

    info = {"type": device.type, "host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "cpu_threads": torch.get_num_threads()}
    if device.type != "cuda":
        return info
    idx = device.index or 0
    props = torch.cuda.get_device_properties(idx)
    info.update(name=torch.cuda.get_device_name(idx), total_memory_bytes=props.total_memory,
                capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count,
                cuda_runtime=torch.version.cuda)
    smi = shutil.which("nvidia-smi")
    if smi:
        q = "driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,persistence_mode,compute_mode"
        try:
            res = subprocess.run([smi, f"--query-gpu={q}", "--format=csv,noheader", f"--id={idx}"],
                                 capture_output=True, text=True, timeout=10)
            vals = [v.strip() for v in res.stdout.strip().split(",")]
            info["nvidia_smi"] = dict(zip(q.split(","), vals)) if res.returncode == 0 else res.stderr.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            info["nvidia_smi"] = f"unavailable: {exc}"
    else:
        info["nvidia_smi"] = "nvidia-smi not found: driver version and clocks not recorded"
    info["clock_control"] = "none (clocks left as found; the harness never locks them)"
    return info


class RunDir:
    """A run directory under ``runs/``; every write is atomic (tmp file + rename)."""

    def __init__(self, path: Path, config: dict, argv: list | None = None):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.manifest = {
            "status": "running", "started": _now(), "finished": None,
            "argv": argv if argv is not None else sys.argv, "cwd": os.getcwd(),
            "config": config, "versions": package_versions(), "git": git_revision(),
            "device": None, "model": None, "attention": None, "cases": [], "warnings": [], "error": None,
        }
        self.save()

    def save(self) -> None:
        _atomic_write(self.path / "manifest.json", json.dumps(self.manifest, indent=2, default=str))

    def update(self, **fields) -> None:
        self.manifest.update(fields)
        self.save()

    def warn(self, message: str) -> None:
        if message and message not in self.manifest["warnings"]:
            self.manifest["warnings"].append(message)
            self.save()

    def write_csv(self, name: str, df: pd.DataFrame) -> Path:
        out = self.path / name
        tmp = out.with_suffix(out.suffix + ".tmp")
        df.to_csv(tmp, index=False)
        tmp.replace(out)
        return out

    def append_csv(self, name: str, df: pd.DataFrame) -> Path:
        """Append rows (header only when the file is new): for large per-case tables."""
        out = self.path / name
        df.to_csv(out, mode="a", header=not out.exists(), index=False)
        return out

    def write_text(self, name: str, text: str) -> Path:
        _atomic_write(self.path / name, text)
        return self.path / name

    def complete(self) -> None:
        self.update(status="complete", finished=_now())

    @contextlib.contextmanager
    def guard(self):
        """Run a verb's body: any exception marks the run failed (``fail``) and propagates."""
        try:
            yield self
        except BaseException as exc:
            from ..errors import HarnessError

            self.fail(str(exc) if isinstance(exc, HarnessError) else f"{exc.__class__.__name__}: {exc}")
            raise

    def fail(self, error: str) -> Path:
        """Mark failed, drop a FAILED file and rename the directory to ``<name>-failed``."""
        self.update(status="failed", finished=_now(), error=error)
        (self.path / "FAILED").write_text(error + "\n")
        target = self.path.with_name(self.path.name + "-failed")
        try:
            self.path.rename(target)
            self.path = target
        except OSError:
            pass
        return self.path


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
