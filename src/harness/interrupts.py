"""Signals during a run: SIGINT, SIGTERM and SIGHUP become one exception, ``RunInterrupted``.

``catch_signals()`` installs the handlers for the body of the run verb and restores the previous
ones after. The first signal raises ``RunInterrupted`` in the main thread (where Python runs signal
handlers), unless a ``deferred()`` block is running (a case's results being written): then it
is raised when that block ends, so a case is written whole or not at all. Once the run is
stopping (``stopping()``), further signals are ignored so that closing the run directory
completes; SIGKILL still ends the process at once. The process exit code of an interrupted run
is 128 + the signal number: 130 (SIGINT), 143 (SIGTERM), 129 (SIGHUP).

A signal the process inherited as ignored (``nohup`` ignores SIGHUP; a shell's background job
may ignore SIGINT) stays ignored: its handler is not replaced, so ``nohup`` still protects a run.
"""
from __future__ import annotations

import contextlib
import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class RunInterrupted(BaseException):
    """A signal ended the run (BaseException, like KeyboardInterrupt: no ``except Exception`` eats it)."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        self.name = signal.Signals(self.signum).name
        super().__init__(self.name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class SignalGuard:
    """The handlers of one run (see the module docstring)."""

    def __init__(self):
        self.received: int | None = None
        self._depth = 0
        self._stopping = False
        self._saved: dict = {}

    def _handle(self, signum, frame) -> None:
        if self._stopping or self.received is not None:
            return
        self.received = signum
        if self._depth == 0:
            raise RunInterrupted(signum)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # Python runs handlers only in the main thread: nothing to install elsewhere
        for s in SIGNALS:
            if signal.getsignal(s) is signal.SIG_IGN:
                continue          # inherited as ignored (nohup): the caller asked for it to be ignored
            self._saved[s] = signal.signal(s, self._handle)

    def restore(self) -> None:
        for s, old in self._saved.items():
            signal.signal(s, old)
        self._saved = {}

    @contextlib.contextmanager
    def deferred(self):
        """A signal arriving inside is raised when the block ends without an error."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if self._depth == 0 and self.received is not None and not self._stopping:
            raise RunInterrupted(self.received)

    def stopping(self) -> None:
        """The run is being closed: ignore further signals."""
        self._stopping = True


@contextlib.contextmanager
def catch_signals():
    """Install a ``SignalGuard`` for the block; the previous handlers come back after."""
    guard = SignalGuard()
    guard.install()
    try:
        yield guard
    finally:
        guard.restore()


def interrupted_by(exc: BaseException) -> RunInterrupted | None:
    """The ``RunInterrupted`` an exception stands for (KeyboardInterrupt = SIGINT), else None."""
    if isinstance(exc, RunInterrupted):
        return exc
    if isinstance(exc, KeyboardInterrupt):
        return RunInterrupted(signal.SIGINT)
    return None
