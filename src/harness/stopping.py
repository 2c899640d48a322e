"""Where a run is, and how a run that ends early is closed: nothing measured is lost.

``Position`` follows the run verb (setting up, which case and request, writing, the report); each
step is also a fault-injection point (``harness.faults``). ``close_run`` turns the exception that
ended a run into its final state:

* a signal (``RunInterrupted``, or KeyboardInterrupt = SIGINT): status ``interrupted``, exit code
  128 + the signal number (130 SIGINT, 143 SIGTERM, 129 SIGHUP);
* a ``HarnessError`` (a problem the user can fix): ``failed``, exit code 2;
* anything else (a full disk, a bug): ``failed``, exit code 1; the traceback goes to the manifest.

Order of the close: status and error in memory, the directory renamed ``<name>-failed`` /
``<name>-interrupted``, report.md (and its tables and plot) rewritten from the cases kept (on a
full disk without its charts, or, where even that fails, the earlier report.md removed), the
``FAILED`` / ``INTERRUPTED`` marker, the manifest last (on a full disk, the failed manifest the
run directory prepared while there was room: ``harness.rundir``). What could not be written is
stated in the manifest (where it can be written) and in the one line returned for stderr; the
line's count of kept cases is the count the manifest on disk lists, a case a signal stopped after
some of its timed repeats counted as partial (``t: 5 of 100000 timed repeats``).
"""
from __future__ import annotations

import contextlib
import logging
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from . import faults
from .errors import HarnessError, RunStopped
from .interrupts import interrupted_by

FREE_SPACE_FIX = "free space on that disk or point run.root at another one, then run again"


def write_fix(exc: OSError) -> str:
    """The fix for a write that failed: room on the disk (ENOSPC, EDQUOT), else a writable run.root."""
    import errno

    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return FREE_SPACE_FIX
    return "make sure run.root is on a disk you can write to, then run again"


def failure_text(exc: BaseException, when: str) -> str:
    """What failed, for the manifest's ``error`` and the stderr line: ``cannot write FILE (why) WHEN``
    for a write that names its file, ``a write failed (why) WHEN`` for one that does not, else the
    exception (``Type: message (WHEN)``)."""
    if isinstance(exc, OSError) and exc.filename:
        return f"cannot write {Path(exc.filename).name} ({exc.strerror or exc}) {when}"
    if isinstance(exc, OSError) and exc.strerror:
        return f"a write failed ({exc.strerror}) {when}"
    return f"{exc.__class__.__name__}: {exc} ({when})"


@contextlib.contextmanager
def log_errors_quiet():
    """A log record that cannot be written (a full disk under Hydra's log file) is dropped, not
    printed with a traceback on stderr: the run's own error says what failed."""
    saved = logging.raiseExceptions
    logging.raiseExceptions = False
    try:
        yield
    finally:
        logging.raiseExceptions = saved


@dataclass
class Position:
    """Where the run is. ``index`` counts cases from 1; ``request`` is ``warmup=I``,
    ``repeat=R`` (stages.csv's label), ``repeat=profiled``, ``writing`` or None."""

    phase: str = "setup"            # setup | case | report
    case: Optional[str] = None
    index: int = 0
    cases: int = 0
    request: Optional[str] = None

    def at(self, phase: str, case: Optional[str] = None, index: int = 0, request: Optional[str] = None) -> None:
        self.phase, self.request = phase, request
        if case is not None:
            self.case, self.index = case, index
        faults.reached(self.point())

    def point(self) -> str:
        """The fault-injection name of this position (``harness.faults``)."""
        if self.phase != "case":
            return self.phase
        return f"case={self.index}" + (f",{self.request}" if self.request else "")

    def describe(self) -> str:
        """E.g. ``case t-2x3 (1 of 2), repeat=0``; ``the report``; ``setting up (no case started)``."""
        if self.phase == "setup":
            return "setting up (no case started)"
        if self.phase == "report":
            return "the final report"
        text = f"case {self.case} ({self.index} of {self.cases})"
        words = {"done": "after its results were written", "writing": "while writing its results"}
        return f"{text}, {words.get(self.request, self.request)}" if self.request else text

    def as_dict(self) -> dict:
        return {"phase": self.phase, "case": self.case, "case_index": self.index, "cases": self.cases,
                "request": self.request}


def close_run(rd, data, exc: BaseException, where: Position, write_report) -> RunStopped:
    """Close the run directory ``rd`` (``harness.rundir.RunDir``; ``data`` its ``RunData``) after
    ``exc``; ``write_report(rd, data, plot=True)`` rewrites the report. Returns the ``RunStopped``
    to raise."""
    signal = interrupted_by(exc)
    if signal is not None:
        status, code = "interrupted", signal.exit_code
        error = f"interrupted by {signal.name} during {where.describe()}"
    elif isinstance(exc, HarnessError):   # 2, or the code it carries (a failed child process's)
        status, code, error = "failed", getattr(exc, "exit_code", 2), str(exc)
    else:
        status, code = "failed", 1
        error = failure_text(exc, f"during {where.describe()}")
        rd.manifest["traceback"] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    rd.stop(status, error, stopped_at=where.as_dict())
    data.path, data.manifest = rd.path, rd.manifest
    problems = _rewrite_report(rd, data, write_report)
    unwritten = rd.seal()
    if unwritten:
        problems.append(f"manifest.json not updated ({unwritten})")
    kept = rd.cases_on_disk()          # what the files hold (a case's CSVs are kept only with its manifest entry)
    partial = [c for c in rd.manifest["cases"][:kept] if c.get("partial")]   # on disk: the first ``kept``
    return RunStopped(stop_line(status, exc, error, kept, rd.path, problems, signal is not None, partial), code,
                      rd.path)


def _rewrite_report(rd, data, write_report) -> list:
    """Rewrite report.md for the cases kept; on a full disk once more without its charts; where
    even that fails, an earlier report.md (written while the run went on) is removed, so none
    describes the run as it was before it stopped. Returns what to say about it."""
    try:
        write_report(rd, data)
        return []
    except Exception as rexc:  # noqa: BLE001 - stated in the manifest and on stderr instead
        rd.manifest["report_error"] = f"{rexc.__class__.__name__}: {rexc}"
        if isinstance(rexc, OSError):
            try:
                write_report(rd, data, plot=False)
                return [f"report.md rewritten without its charts ({rd.manifest['report_error']})"]
            except Exception:  # noqa: BLE001 - the first error is the one reported
                pass
    said = f"report.md not rewritten ({rd.manifest['report_error']})"
    stale = rd.path / "report.md"
    if stale.exists():
        try:
            stale.unlink()
            said += "; the report.md written while the run went on was removed"
        except OSError:
            said += "; report.md still describes the run while it went on"
    return [said]


def kept_text(kept: int, partial: list = ()) -> str:
    """'2 finished case(s)', or with cases a signal stopped early (manifest entries with ``partial``):
    '1 finished case(s) and 1 partial case (t: 5 of 100000 timed repeats)'."""
    if not partial:
        return f"{kept} finished case(s)"
    what = ", ".join(f"{c.get('name')}: {c.get('repeats_done')} of {c.get('repeats_planned')} timed repeats"
                     + (", no profiled request" if c.get("profiled") is False else "") for c in partial)
    return (f"{kept - len(partial)} finished case(s) and {len(partial)} partial case{'s' if len(partial) > 1 else ''} "
            f"({what})")


def stop_line(status: str, exc: BaseException, error: str, kept: int, path, problems: list, interrupted: bool,
              partial: list = ()) -> str:
    """The one stderr line of a run that ended early; ``partial``: the manifest entries of the kept
    cases a signal stopped early (``kept`` counts them)."""
    after = f"{kept_text(kept, partial)} kept in {path}" + "".join(f"; {p}" for p in problems)
    if interrupted:
        return f"interrupted: {error.removeprefix('interrupted by ')}; {after}"
    if isinstance(exc, HarnessError):
        return f"error: {exc}" + "".join(f" ({p})" for p in problems)
    if isinstance(exc, OSError):
        return f"error: {error}; fix: {write_fix(exc)} ({after})"
    return (f"error: internal error: {error}; fix: report it as a harness bug with {path}/manifest.json "
            f"(its traceback field) ({after})")
