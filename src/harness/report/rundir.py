"""The run directory: manifest.json (status, config, versions, device, git) and incremental CSVs.

``manifest.json`` is written with ``status: running`` first and rewritten as each case finishes;
it says ``complete`` only at the very end. A failed run is marked ``failed`` (with the error),
gets a ``FAILED`` file, and its directory is renamed with a ``-failed`` suffix, so no failed
directory looks complete.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import io
import json
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pandas as pd

from ..sweep import job_environment

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


CSV_DTYPES = {"repeat": str, "call": str, "grid": str}   # mixed numbers and labels: read as text


def read_table(src) -> pd.DataFrame:
    """A run CSV (path or buffer) as every reader sees it: ``repeat``/``call``/``grid`` as text; an
    empty frame for a missing or empty file."""
    if isinstance(src, Path) and (not src.is_file() or src.stat().st_size == 0):
        return pd.DataFrame()
    return pd.read_csv(src, dtype=CSV_DTYPES)


def _stack(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """``a`` then ``b`` with the dtypes one parse of both would give: a column that is all empty
    in one part takes the other part's text dtype (numeric columns promote as usual)."""
    a, b = a.copy(deep=False), b.copy(deep=False)
    for c in a.columns.intersection(b.columns):
        x, y = a[c], b[c]
        if x.dtype == y.dtype:
            continue
        if x.isna().all() and not pd.api.types.is_numeric_dtype(y):
            a[c] = x.astype(y.dtype)
        elif y.isna().all() and not pd.api.types.is_numeric_dtype(x):
            b[c] = y.astype(x.dtype)
    return pd.concat([a, b], ignore_index=True)


class RunDir:
    """A run directory under ``runs/``; every write is atomic (tmp file + rename), except
    ``append_csv``. ``table(name)`` reads a CSV once and keeps it, adding later appends to the kept
    copy, so a report rewritten after every case does not re-read the growing ``kernels.csv``."""

    def __init__(self, path: Path, config: dict, argv: list | None = None):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.manifest = {
            "status": "running", "started": _now(), "finished": None,
            "argv": argv if argv is not None else sys.argv, "cwd": os.getcwd(), "launch": job_environment(),
            "config": config, "versions": package_versions(), "git": git_revision(),
            "device": None, "model": None, "attention": None, "cases": [], "warnings": [], "error": None,
        }
        self._tables: dict = {}
        self.save()

    @classmethod
    def attach(cls, path) -> "RunDir":
        """A RunDir over an existing directory (its manifest is read, not rewritten)."""
        rd = cls.__new__(cls)
        rd.path = Path(path)
        mp = rd.path / "manifest.json"
        rd.manifest = json.loads(mp.read_text()) if mp.is_file() else {"warnings": [], "cases": []}
        rd.manifest.setdefault("warnings", [])
        rd._tables = {}
        return rd

    def table(self, name: str) -> pd.DataFrame:
        """The CSV ``name`` as ``read_table`` gives it, read from disk once."""
        if name not in self._tables:
            self._tables[name] = read_table(self.path / name)
        return self._tables[name]

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
        self._tables.pop(name, None)
        return out

    def append_csv(self, name: str, df: pd.DataFrame) -> Path:
        """Append rows (header only when the file is new): for large per-case tables. A kept
        ``table(name)`` gets the new rows parsed from the same text."""
        out = self.path / name
        text = df.to_csv(index=False)
        new = not out.exists()
        with open(out, "a") as f:
            f.write(text if new else text.split("\n", 1)[1])
        kept = self._tables.get(name)
        if kept is not None:
            rows = read_table(io.StringIO(text))
            self._tables[name] = rows if kept.empty else _stack(kept, rows)
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
