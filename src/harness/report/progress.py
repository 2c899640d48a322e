"""Progress during a run: a rich progress bar over the requests of all cases on a terminal,
plain lines otherwise (logs, CI). Updated only between requests, never inside a timed one."""
from __future__ import annotations

import sys


class RunProgress:
    """Callable taking progress messages; ``start(total)`` sizes the bar in requests."""

    REQUEST_WORDS = ("warm-up", "repeat", "profiled")

    def __init__(self, stream=None, bar: bool | None = None):
        self.stream = stream or sys.stdout
        self.bar = self.stream.isatty() if bar is None else bar
        self._progress = None
        self._task = None

    def start(self, total: int) -> None:
        if not self.bar:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), transient=False)
        self._progress.start()
        self._task = self._progress.add_task("requests", total=total)

    def __call__(self, message: str) -> None:
        if self._progress is None:
            print(message, file=self.stream, flush=True)
            return
        if any(w in message for w in self.REQUEST_WORDS) and ": " in message:
            self._progress.update(self._task, advance=1, description=message.split(" request ")[0])
        else:
            self._progress.console.print(message, markup=False, highlight=False)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
