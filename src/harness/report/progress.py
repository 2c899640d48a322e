"""Progress during a run: on a terminal, a rich progress bar over the requests of all cases (with
seconds per request and the time left) and a spinner with the elapsed time over every other wait
(``waiting``: the model build, the calibration); plain lines otherwise (logs, CI), with nothing
added. Updated only between requests, never inside a timed one."""
from __future__ import annotations

import contextlib
import sys
import time


class RunProgress:
    """Callable taking progress messages; ``start(total)`` sizes the bar in requests."""

    REQUEST_WORDS = ("warmup=", "repeat=", "profiled")

    def __init__(self, stream=None, bar: bool | None = None):
        self.stream = stream or sys.stdout
        self.bar = self.stream.isatty() if bar is None else bar
        self._progress = None
        self._task = None
        self._waiting = None

    def start(self, total: int) -> None:
        if not self.bar:
            return
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("left"),
                                  TimeRemainingColumn(), console=Console(file=self.stream, force_terminal=True),
                                  transient=False)
        self._progress.start()
        self._task = self._progress.add_task("requests", total=total, rate="")
        self._started, self._done = time.monotonic(), 0

    def __call__(self, message: str) -> None:
        live = self._progress or self._waiting
        if live is None:
            print(message, file=self.stream, flush=True)
            return
        if self._progress is not None and any(w in message for w in self.REQUEST_WORDS) and ": " in message:
            self._done += 1       # seconds per request: the mean over the requests finished so far
            rate = f"{(time.monotonic() - self._started) / self._done:.1f} s/request"
            self._progress.update(self._task, advance=1, description=message.split(" request ")[0], rate=rate)
        else:
            live.console.print(message, markup=False, highlight=False)

    @contextlib.contextmanager
    def waiting(self, what: str):
        """A spinner with ``what`` and the elapsed seconds while the block runs (terminal only)."""
        if not self.bar or self._progress is not None or self._waiting is not None:
            yield
            return
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                      console=Console(file=self.stream, force_terminal=True), transient=True,
                      refresh_per_second=2) as spinner:
            spinner.add_task(what, total=None)
            self._waiting = spinner
            try:
                yield
            finally:
                self._waiting = None

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def waiting(progress, what: str):
    """``progress.waiting(what)`` where ``progress`` is a ``RunProgress``; otherwise nothing."""
    return progress.waiting(what) if isinstance(progress, RunProgress) else contextlib.nullcontext()


__all__ = ["RunProgress", "waiting"]
