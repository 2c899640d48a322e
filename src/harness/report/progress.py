"""Progress during a run: on a terminal, a rich progress bar over the requests of all cases (with
seconds per request and the time left) and a spinner with the elapsed time over every other wait
(``waiting``: the model build, the calibration); plain lines otherwise (logs, CI), with nothing
added. Every line the run prints starts with ``[harness]``; a request's line names it by its
label, counted from 0 as stages.csv counts (``repeat=1 (2 of 2)``: the second of two timed repeats).

Inside a request, ``DecodeProgress`` watches the decode loop (``harness.models.generate.DECODE_WATCH``)
and, from ``DECODE_EVERY_S`` seconds into its decode and then every ``DECODE_EVERY_S``, says the
steps done of those planned, tokens/s and an estimate of the time left (``decode_text``): the bar's
description on a terminal, a line in logs. It reads only the host loop's step count and its own
clock: on CUDA a step counts once the host has issued it (the device may be a few steps behind),
and nothing waits for the device."""
from __future__ import annotations

import contextlib
import sys
import time

#: seconds into a request's decode before its first progress report, and between two reports
DECODE_EVERY_S = 5.0
PREFIX = "[harness] "


def duration_text(seconds: float) -> str:
    """'45 s', '3 min 20 s', '2 h 05 min' (rounded down to the unit shown last)."""
    s = max(int(seconds), 0)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def decode_text(label: str, done: int, planned: int, batch: int, elapsed_s: float, issued: bool = False) -> str:
    """The progress line of a decode ``elapsed_s`` seconds in: ``done`` of ``planned`` steps,
    tokens/s = batch x done / elapsed_s, time left = (planned - done) x elapsed_s / done;
    ``issued``: the steps are those the host issued (CUDA)."""
    rate = batch * done / elapsed_s if elapsed_s > 0 else float("nan")
    left = (planned - done) * elapsed_s / done if done else float("nan")
    what = "issued" if issued else "done"
    return (f"{PREFIX}{label}, decode step {done:,} of {planned:,} {what}, {rate:,.1f} tok/s, about "
            f"{duration_text(left) if left == left else '?'} left")


class DecodeProgress:
    """The watcher of a decode loop (module docstring): ``begin(planned, batch)`` when the decode
    starts, ``step(done)`` after each step; ``say(text)`` gets the reports, ``label`` names the
    request (set between requests), ``issued``: the loop runs ahead of a CUDA device."""

    def __init__(self, say, issued: bool = False, every_s: float = DECODE_EVERY_S, clock=time.monotonic):
        self.say, self.issued, self.every_s, self._clock = say, issued, every_s, clock
        self.label = ""
        self.planned, self.batch, self._t0, self._last = 0, 1, 0.0, 0.0

    def begin(self, planned: int, batch: int) -> None:
        self.planned, self.batch = planned, batch
        self._t0 = self._last = self._clock()

    def step(self, done: int) -> None:
        now = self._clock()
        if now - self._last >= self.every_s:
            self._last = now
            self.say(decode_text(self.label, done, self.planned, self.batch, now - self._t0, self.issued))


class RunProgress:
    """Callable taking progress messages; ``start(total)`` sizes the bar in requests (a message
    naming a request's label advances it); ``inside(text)``: progress within a request."""

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
            self._progress.update(self._task, advance=1, rate=rate,
                                  description=message.removeprefix(PREFIX).split(", request ")[0])
        else:
            live.console.print(message, markup=False, highlight=False)

    def inside(self, text: str) -> None:
        """Progress within a request (``DecodeProgress``): the bar's description on a terminal
        (the bar does not advance), else a line."""
        if self._progress is not None:
            self._progress.update(self._task, description=text.removeprefix(PREFIX))
        else:
            self(text)

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


__all__ = ["RunProgress", "DecodeProgress", "decode_text", "duration_text", "waiting", "DECODE_EVERY_S", "PREFIX"]
