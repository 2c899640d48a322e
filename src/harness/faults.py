"""Test-only fault injection for the run verb, driven by one environment variable; inert when unset.

``HARNESS_FAULT`` holds one fault:

* ``signal:NAME@POINT``: when the run reaches ``POINT`` the process sends itself signal ``NAME``
  (SIGINT, SIGTERM or SIGHUP). Points (``harness.stopping.Position.point``; cases counted from 1,
  requests from 0 as in stages.csv): ``start`` (the run directory is made, Hydra has not
  started: ``harness.cli``), ``setup`` (before the device and cases are set up),
  ``case=N`` (case N starts), ``case=N,warmup=I``, ``case=N,repeat=R``, ``case=N,repeat=profiled``
  (before that request), ``case=N,writing`` (measured, before its files are written),
  ``case=N,done`` (written, before the next case), ``report`` (before the final report).
* ``enospc:FILE`` or ``enospc:FILE#K``: the K-th write (default the first) of ``FILE`` in the run
  directory, and every later one, fails with ``OSError(ENOSPC)`` after its temporary file was
  written, as a full disk does.

``tests/test_faults.py`` uses it; nothing else sets it. The variable is read at each point and
write (a dictionary look-up), so nothing here runs unless it is set.
"""
from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

ENV = "HARNESS_FAULT"
_writes: dict = {}   # file name -> writes seen (enospc)


def _parse() -> tuple:
    """(kind, target, arg) of ``HARNESS_FAULT``; ("", "", 0) when unset. A bad spec is an error."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return ("", "", 0)
    kind, _, rest = text.partition(":")
    if kind == "signal" and "@" in rest:
        name, point = rest.split("@", 1)
        if name in ("SIGINT", "SIGTERM", "SIGHUP"):
            return ("signal", point, int(getattr(signal, name)))
    if kind == "enospc" and rest:
        name, _, nth = rest.partition("#")
        return ("enospc", name, int(nth or 1))
    raise ValueError(f"{ENV}={text!r} is not signal:SIGINT|SIGTERM|SIGHUP@POINT or enospc:FILE[#K]")


def reached(point: str) -> None:
    """The run is at ``point``: send the configured signal when it is this one."""
    kind, target, signum = _parse()
    if kind == "signal" and point == target:
        os.kill(os.getpid(), signum)


def before_write(path: Path) -> None:
    """A file of the run directory is about to replace its previous version: fail like a full
    disk when the configured write is reached."""
    kind, target, nth = _parse()
    if kind != "enospc" or Path(path).name != target:
        return
    _writes[target] = _writes.get(target, 0) + 1
    if _writes[target] >= nth:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
