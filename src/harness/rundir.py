"""The run directory: manifest.json (status, config, versions, device, git) and incremental CSVs.

``manifest.json`` is written with ``status: running`` first and rewritten as each case finishes;
it says ``complete`` only at the very end. A failed run is marked ``failed`` (with the error),
gets a ``FAILED`` file, and its directory is renamed with a ``-failed`` suffix, so no failed
directory looks complete.

``RunData`` is what one run measured, in memory: the run verb grows it case by case and hands it
to the report; ``load_run`` reads a finished run directory into one (each file read once).
This module sits at the bottom of the package: it imports nothing from it but ``errors``.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import re
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Optional

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
    root = root or Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5)
        if rev.returncode != 0:
            return {"revision": None, "dirty": None, "reason": rev.stderr.strip()[:200]}
        return {"revision": rev.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError) as exc:
        return {"revision": None, "dirty": None, "reason": str(exc)}


CSV_DTYPES = {"repeat": str, "call": str, "grid": str}   # mixed numbers and labels: read as text


def read_table(src) -> pd.DataFrame:
    """A run CSV (path or buffer) as every reader sees it: ``repeat``/``call``/``grid`` as text; an
    empty frame for a missing or empty file."""
    if isinstance(src, Path) and (not src.is_file() or src.stat().st_size == 0):
        return pd.DataFrame()
    return pd.read_csv(src, dtype=CSV_DTYPES)


@dataclass
class RunData:
    """What one run measured: its manifest and tables (empty frames where nothing was written).

    ``stages`` (``harness.measure.summarize.STAGE_COLUMNS``), ``kernels`` (``KERNEL_COLUMNS`` +
    ``case``), ``routing`` (case, phase, layer, e0..eN), ``routing_steps`` (case, step, layer,
    experts, e0..eN: decode counts per step); ``analytic`` the analytic frames of its cases
    (``harness.analytic`` COLUMNS + ``routing``) and ``mbu_bytes`` {case: decode bytes that must
    move}, filled by the run as each case finishes, None when the run directory was read back
    (the report then derives them); ``notes`` for the report's caveats.
    """

    path: Path
    manifest: dict
    stages: pd.DataFrame = field(default_factory=pd.DataFrame)
    kernels: pd.DataFrame = field(default_factory=pd.DataFrame)
    routing: pd.DataFrame = field(default_factory=pd.DataFrame)
    routing_steps: pd.DataFrame = field(default_factory=pd.DataFrame)
    analytic: Optional[pd.DataFrame] = None
    mbu_bytes: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)


def load_run(path) -> RunData:
    """A finished (or interrupted) run directory read back: manifest.json and the measured CSVs."""
    path = Path(path)
    mpath = path / "manifest.json"
    manifest = json.loads(mpath.read_text()) if mpath.is_file() else {}
    manifest.setdefault("warnings", [])
    manifest.setdefault("cases", [])
    return RunData(path, manifest, read_table(path / "stages.csv"), read_table(path / "kernels.csv"),
                   read_table(path / "routing.csv"), read_table(path / "routing_steps.csv"))


def trace_name(case: str) -> str:
    """Where a case's profiled-request trace goes, relative to the run directory: one directory
    per case (``traces/<case>/trace.json.gz``), so each is a Holistic Trace Analysis trace_dir."""
    return f"traces/{re.sub(r'[^A-Za-z0-9._-]+', '_', case) or 'case'}/trace.json.gz"


class RunDir:
    """A run directory under ``runs/``; every write is atomic (tmp file + rename), except
    ``append_csv``."""

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

    @classmethod
    def attach(cls, path, manifest: Optional[dict] = None) -> "RunDir":
        """A RunDir over an existing directory (its manifest is read, or given, not rewritten)."""
        rd = cls.__new__(cls)
        rd.path = Path(path)
        if manifest is None:
            mp = rd.path / "manifest.json"
            manifest = json.loads(mp.read_text()) if mp.is_file() else {"warnings": [], "cases": []}
        rd.manifest = manifest
        rd.manifest.setdefault("warnings", [])
        return rd

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
        text = df.to_csv(index=False)
        new = not out.exists()
        with open(out, "a") as f:
            f.write(text if new else text.split("\n", 1)[1])
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
            from .errors import HarnessError

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
