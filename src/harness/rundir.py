"""The run directory: manifest.json (status, config, versions, device, git) and incremental CSVs.

A run directory belongs to one process: ``claim`` creates it atomically (``os.mkdir``; a name
that exists gets ``-2``, ``-3``, ...), and ``RunDir`` refuses a directory that already holds a
``manifest.json``. ``manifest.json`` is written with ``status: running`` first and rewritten as
each case finishes; it says ``complete`` only at the very end, after every other file. A run
that ends early is marked ``failed`` or ``interrupted`` (with the error), gets a ``FAILED`` or
``INTERRUPTED`` file, and its directory is renamed with a ``-failed`` / ``-interrupted`` suffix,
so no such directory looks complete. Files are replaced atomically (temporary file + rename; the
temporary file is removed when the write fails), CSV appends are cut back when they fail.

A full disk cannot stop the directory from saying ``failed``: the failed manifest is prepared
while there is room (``.manifest-failed.json``, rewritten after each save of the manifest with the
same cases; ``prepare`` writes the first one before Hydra writes anything), so that closing the run
needs only a rename where the manifest cannot be rewritten. The files of one case are written as a
unit (``RunDir.case_files``): when one of them fails, the others are put back as they were, so the
CSVs always hold the cases the manifest on disk lists.

``RunData`` is what one run measured, in memory: the run verb grows it case by case and hands it
to the report; ``load_run`` reads a finished run directory into one (each file read once;
``stages.csv`` as the typed observations, an older layout converted on read; ``open_run`` the same
for a directory a user names, with one-line errors). The caller passes
what placed the process (``launch``: pid, pinning and scheduler variables) in.
Writes never follow a symbolic link (``harness.containment``): a link where a file of the run is
written is refused with one line. The checkout's revision is read with ``git --no-optional-locks``,
so a run never takes ``.git/index.lock`` in the user's checkout.
This module sits near the bottom of the package: it imports nothing from it but ``errors``,
``containment``, ``faults`` (the test-only write hook) and the run directory's schema (``harness.schema``).
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

from . import faults
from .containment import refuse_links
from .errors import HarnessError
from .schema import CASE_TABLES
from .schema.stages import NotObservations, read_observations

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
    """This checkout's ``git rev-parse HEAD`` and whether tracked files differ from it. On a copy of
    a checkout (the lent GPU's, whose git metadata can lag) ``HARNESS_GIT_REVISION`` and
    ``HARNESS_GIT_DIRTY`` (0/1), set by ``scripts/device_stamp.py env`` only when the copied files
    match the stamped checkout, are recorded instead, with where they came from."""
    stamped = os.environ.get("HARNESS_GIT_REVISION")
    if stamped:
        return {"revision": stamped, "dirty": os.environ.get("HARNESS_GIT_DIRTY") == "1",
                "from": "HARNESS_GIT_REVISION (scripts/device_stamp.py: the checkout this tree was copied from)"}
    return checkout_revision(root)


#: git reads the checkout without writing it: no ``.git/index.lock``, no refreshed index
GIT_READ_ONLY = ("git", "--no-optional-locks")


def checkout_revision(root: Path | None = None) -> dict:
    """``git rev-parse HEAD`` of the checkout at ``root`` (default: this package's) and whether its
    tracked files differ from it (``git status``, read-only: ``GIT_READ_ONLY``); revision None with
    the reason when git cannot tell."""
    root = root or Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run([*GIT_READ_ONLY, "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=5)
        dirty = subprocess.run([*GIT_READ_ONLY, "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5)
        if rev.returncode != 0:
            return {"revision": None, "dirty": None, "reason": rev.stderr.strip()[:200]}
        return {"revision": rev.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError) as exc:
        return {"revision": None, "dirty": None, "reason": str(exc)}


@dataclass
class RunData:
    """What one run measured: its manifest and tables (empty frames where nothing was written).

    ``stages`` (the typed observations), ``kernels``, ``routing``, ``routing_steps`` (decode counts
    per step), ``steps`` (every decode step of the timed repeats), ``step_clock`` (the fused step's
    in-kernel stamps): ``harness.schema.CASE_TABLES``;
    ``analytic`` the analytic frames of its cases
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
    steps: pd.DataFrame = field(default_factory=pd.DataFrame)
    step_clock: pd.DataFrame = field(default_factory=pd.DataFrame)


def load_run(path, manifest: Optional[dict] = None, tables: bool = True) -> RunData:
    """A finished (or interrupted) run directory read back: manifest.json (unless given) and the
    measured CSVs (stages.csv as typed observations: ``NotObservations``, a ValueError, when it
    lacks the columns a run writes); ``tables=False``: stages.csv alone (the other tables empty),
    for a caller that needs the cases, not the kernels."""
    path = Path(path)
    mpath = path / "manifest.json"
    if manifest is None:
        manifest = json.loads(mpath.read_text()) if mpath.is_file() else {}
    manifest.setdefault("warnings", [])
    manifest.setdefault("cases", [])
    stages = read_observations(path / "stages.csv")
    if not tables:
        return RunData(path, manifest, stages)
    kernels, routing, routing_steps, steps, clock = (CASE_TABLES[n].read(path) for n in (
        "kernels", "routing", "routing_steps", "steps", "step_clock"))
    return RunData(path, manifest, stages, kernels, routing, routing_steps, steps=steps, step_clock=clock)


def open_run(path, fix: str, missing_fix: str, tables: bool = True) -> RunData:
    """``load_run`` of a directory a user named on the command line, or a one-line HarnessError
    when it is not a run directory: ``missing_fix`` where the directory does not exist, ``fix``
    where it has no manifest.json or stages.csv, or one that cannot be read (a manifest that is not
    a JSON object, a stages.csv without the columns a run writes, a parser or decoding error);
    ``tables`` as ``load_run``'s."""
    path = Path(path)
    if not path.is_dir():
        raise HarnessError(f"run directory {str(path)!r} does not exist", missing_fix)
    for name in ("manifest.json", "stages.csv"):
        if not (path / name).is_file():
            raise HarnessError(f"{path} has no {name}, so it is not a run directory", fix)
    try:
        manifest = json.loads((path / "manifest.json").read_text())
        if not isinstance(manifest, dict):
            raise ValueError(f"it holds a JSON {type(manifest).__name__}, not an object")
        return load_run(path, manifest, tables)
    except NotObservations as exc:
        raise HarnessError(f"{path / 'stages.csv'} {exc}", fix) from None
    except (ValueError, UnicodeDecodeError) as exc:   # JSON, CSV parser and decoding errors
        raise HarnessError(f"{path} has an unreadable manifest.json or stages.csv ({exc.__class__.__name__}: "
                           f"{' '.join(str(exc).split())[:200]})", fix) from None


def claim(path) -> Path:
    """Create directory ``path`` for this process alone and return it: ``os.mkdir`` is atomic, so
    of two processes asking for the same name one gets it and the other ``<name>-2`` (then -3,
    ...). Parent directories are created as needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        candidate = path if n == 1 else path.with_name(f"{path.name}-{n}")
        try:
            os.mkdir(candidate)
            return candidate
        except FileExistsError:
            n += 1


#: the failed manifest prepared in advance (see the module docstring); never left behind by a closed run
SPARE = ".manifest-failed.json"
SPARE_ERROR = ("failed with no room left on its disk to record why (the run's stderr line says it); the cases "
               "listed are those whose files were written")


def prepare(path, argv: list | None = None) -> None:
    """Write the manifest of a run that is starting (``status: starting``, this process's ``pid``)
    and its prepared failed manifest into the claimed directory ``path``, before Hydra or the run
    write anything: whatever stops the process from here on finds a directory it can mark
    (``close_unstarted``), and ``RunDir`` takes the directory over. Raises OSError (a full disk)."""
    manifest = {"status": "starting", "pid": os.getpid(), "started": _now(), "finished": None,
                "argv": argv if argv is not None else sys.argv, "cwd": os.getcwd(), "cases": [], "warnings": [],
                "error": None}
    RunDir.attach(path, manifest).save()


def close_unstarted(path, status: str, error: str, partial_hydra: bool = False, **fields) -> tuple:
    """Close a directory ``prepare`` made whose run never took it over (Hydra failed to write its
    own files, a signal came while the harness was starting, the config was refused): status
    ``failed`` or ``interrupted`` with ``error`` (and ``fields``, e.g. a traceback), the marker
    file, the ``-<status>`` suffix; ``partial_hydra``: Hydra stopped while writing ``.hydra/``, which
    is removed (no half snapshot). Returns (the directory's path, what could not be written or
    None); does nothing (returns (path, None)) when the run had taken the directory over."""
    path = Path(path)
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        manifest = None
    if not manifest or manifest.get("status") != "starting" or manifest.get("pid") != os.getpid():
        return path, None
    if partial_hydra:
        import shutil
        shutil.rmtree(path / ".hydra", ignore_errors=True)
    rd = RunDir.attach(path, manifest)
    rd.stop(status, error, **fields)
    return rd.path, rd.seal()


def trace_name(case: str) -> str:
    """Where a case's profiled-request trace goes, relative to the run directory: one directory
    per case (``traces/<case>/trace.json.gz``), so each is a Holistic Trace Analysis trace_dir."""
    return f"traces/{re.sub(r'[^A-Za-z0-9._-]+', '_', case) or 'case'}/trace.json.gz"


class RunDir:
    """A run directory under ``runs/``; every write is atomic (tmp file + rename), except
    ``append_csv`` (cut back to its previous size when it fails)."""

    def __init__(self, path: Path, config: dict, argv: list | None = None, launch: dict | None = None):
        """A new run directory at ``path`` for ``config``; ``argv`` (default ``sys.argv``) and
        ``launch`` (what placed this process, ``harness.sweep.job_environment``; default: the pid)
        go to the manifest."""
        self.path = Path(path)
        self._undo: Optional[dict] = None
        self.path.mkdir(parents=True, exist_ok=True)
        started = _now()
        try:   # the manifest is created exclusively: a directory holding a run is never reused
            with open(self.path / "manifest.json", "x"):
                pass
        except FileExistsError:
            prepared = _read_json(self.path / "manifest.json")
            if prepared.get("status") != "starting" or prepared.get("pid") != os.getpid():
                raise HarnessError(f"{self.path} already holds a run (manifest.json)",
                                   "give each run a new directory (leave hydra.run.dir unset)") from None
            started = prepared.get("started") or started      # ``prepare`` made it for this process
        self.manifest = {
            "status": "running", "started": started, "finished": None,
            "argv": argv if argv is not None else sys.argv, "cwd": os.getcwd(), "launch": launch if launch is not None else {"pid": os.getpid()},
            "config": config, "versions": package_versions(), "git": git_revision(),
            "device": None, "model": None, "attention": None, "cases": [], "warnings": [], "error": None,
        }
        self.save()

    @classmethod
    def attach(cls, path, manifest: Optional[dict] = None) -> "RunDir":
        """A RunDir over an existing directory (its manifest is read, or given, not rewritten)."""
        rd = cls.__new__(cls)
        rd.path, rd._undo = Path(path), None
        if manifest is None:
            mp = rd.path / "manifest.json"
            manifest = json.loads(mp.read_text()) if mp.is_file() else {"warnings": [], "cases": []}
        rd.manifest = manifest
        rd.manifest.setdefault("warnings", [])
        return rd

    def save(self) -> None:
        """Write manifest.json, then, while the run goes on, the prepared failed manifest (``SPARE``)
        with the same cases; once the manifest on disk is final, the spare is removed."""
        self._write(self.path / "manifest.json", json.dumps(self.manifest, indent=2, default=str))
        if self.manifest.get("status") in ("running", "starting"):
            spare = {**self.manifest, "status": "failed", "error": SPARE_ERROR}
            self._write(self.path / SPARE, json.dumps(spare, indent=2, default=str))
        else:
            _cut_back(self.path / SPARE, None)

    def _write(self, path: Path, text: str) -> None:
        """``_atomic_write``, remembering the file's previous state inside ``case_files``."""
        if self._undo is not None and path not in self._undo:
            self._undo[path] = path.read_bytes() if path.is_file() else None
        _atomic_write(path, text)

    @contextlib.contextmanager
    def case_files(self):
        """The files written in the block are one unit (one case's CSVs and the manifest that lists
        it): when the block fails, each is put back as it was before it (a rewrite restored in
        place, an append cut back, a new file removed; none needs more room than the file had),
        and the exception propagates."""
        self._undo = {}
        try:
            yield self
        except BaseException:
            for path, before in reversed(list(self._undo.items())):
                _restore(path, before)
            raise
        finally:
            self._undo = None

    def update(self, **fields) -> None:
        self.manifest.update(fields)
        self.save()

    def warn(self, message: str) -> None:
        if message and message not in self.manifest["warnings"]:
            self.manifest["warnings"].append(message)
            self.save()

    def write_csv(self, name: str, df: pd.DataFrame) -> Path:
        self._write(self.path / name, df.to_csv(index=False))
        return self.path / name

    def append_csv(self, name: str, df: pd.DataFrame) -> Path:
        """Append rows (header only when the file is new): for large per-case tables. A failed
        append is cut back, so the file never ends in a partial row."""
        out = self.path / name
        refuse_links(self.path, name, what="the run")
        text = df.to_csv(index=False)
        size = out.stat().st_size if out.exists() else None
        if self._undo is not None and out not in self._undo:
            self._undo[out] = size
        try:
            with open(out, "a") as f:
                f.write(text if size is None else text.split("\n", 1)[1])
                f.flush()
                faults.before_write(out)
        except BaseException as exc:
            _cut_back(out, size)
            _name_file(exc, out)
            raise
        return out

    def write_text(self, name: str, text: str) -> Path:
        self._write(self.path / name, text)
        return self.path / name

    def complete(self, save: bool = True) -> None:
        """Mark the run complete; ``save=False`` only in memory (the files written before the
        manifest then say so, and the manifest is saved last)."""
        self.manifest.update(status="complete", finished=_now())
        if save:
            self.save()

    @contextlib.contextmanager
    def guard(self):
        """Run a verb's body: any exception marks the run failed (``fail``) and propagates."""
        try:
            yield self
        except BaseException as exc:
            self.fail(str(exc) if isinstance(exc, HarnessError) else f"{exc.__class__.__name__}: {exc}")
            raise

    def fail(self, error: str) -> Path:
        """Mark failed, drop a FAILED file and rename the directory to ``<name>-failed``."""
        self.stop("failed", error)
        self.seal()
        return self.path

    def stop(self, status: str, error: str, **fields) -> Path:
        """Mark the run ``failed`` or ``interrupted`` in memory (``seal`` writes the manifest, last)
        and rename its directory to ``<name>-<status>`` (``-2``, ... when taken). A rename that
        fails leaves the name and says so in ``rename_error``."""
        self.manifest.update(status=status, finished=_now(), error=error, **fields)
        n = 1
        while True:
            target = self.path.with_name(f"{self.path.name}-{status}" + (f"-{n}" if n > 1 else ""))
            if not target.exists():
                break
            n += 1
        try:
            self.path.rename(target)
            self.path = target
        except OSError as exc:
            self.manifest["rename_error"] = f"{exc.__class__.__name__}: {exc}"
        return self.path

    def seal(self) -> Optional[str]:
        """Write the ``FAILED`` / ``INTERRUPTED`` marker, then the manifest (the last file). Where the
        manifest cannot be written (a full disk), the prepared failed manifest takes its place (a
        rename: no room needed). Returns what could not be written, or None."""
        problems = []
        marker = self.path / str(self.manifest["status"]).upper()
        try:
            marker.write_text(f"{self.manifest.get('error')}\n")
        except OSError as exc:
            problems.append(f"{marker.name} holds no error text ({exc.__class__.__name__}: {exc})")
            _cut_back(marker, 0)          # the marker stays, empty: its name is the status
        try:
            self.save()
        except OSError as exc:
            problems.append(f"{exc.__class__.__name__}: {exc}")
            try:
                os.replace(self.path / SPARE, self.path / "manifest.json")
                problems[-1] += "; the failed manifest prepared earlier took its place"
            except OSError as rexc:
                problems[-1] += f"; it still says {_read_json(self.path / 'manifest.json').get('status')!r} ({rexc})"
        return "; ".join(problems) or None

    def cases_on_disk(self) -> int:
        """How many cases the manifest on disk lists (the in-memory count when it cannot be read)."""
        on_disk = _read_json(self.path / "manifest.json")
        return len(on_disk["cases"]) if isinstance(on_disk.get("cases"), list) else len(self.manifest["cases"])


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through ``<path>.tmp`` + rename (which replaces a link at ``path``
    rather than writing through it); a link at ``<path>.tmp`` is refused; the tmp file never
    outlives a failed write. An OSError names ``path`` when it named no file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    refuse_links(tmp.parent, tmp.name, what="the run")
    try:
        tmp.write_text(text)
        faults.before_write(path)
        tmp.replace(path)
    except BaseException as exc:
        _cut_back(tmp, None)
        _name_file(exc, path)
        raise


def _read_json(path: Path) -> dict:
    """A JSON file's object, {} when it cannot be read."""
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def _restore(path: Path, before) -> None:
    """Put ``path`` back as ``case_files`` found it: bytes (rewritten in place, then cut to their
    length: the file already holds at least as many blocks), a size (an append cut back) or None (a
    new file removed). Quietly, as a clean-up."""
    if not isinstance(before, bytes):
        _cut_back(path, before)
        return
    try:
        with open(path, "r+b") as f:
            f.write(before)
            f.truncate(len(before))
    except OSError:
        pass


def _cut_back(path: Path, size: Optional[int]) -> None:
    """Remove ``path`` (size None) or truncate it to ``size`` bytes; quietly, as a clean-up."""
    try:
        if size is None:
            path.unlink(missing_ok=True)
        else:
            os.truncate(path, size)
    except OSError:
        pass


def _name_file(exc: BaseException, path: Path) -> None:
    if isinstance(exc, OSError) and exc.filename is None:
        exc.filename = str(path)
