"""Time on the compute device during a throughput run, and the stage function of one batch.

``Marks`` makes points in time: on CUDA an event recorded on the current stream (read only after
the work before it has run, so reading never stalls the pipeline), on the CPU the host clock
(``perf_counter_ns``). ``Marks.base()`` starts a configuration (synchronised) and ``origin()`` the
steady window (synchronised: the window's edges are device-idle points); ``seconds(mark)`` is a
mark's time after the window start [s], negative before it. On CUDA the origin is also taken on the
host clock right after the synchronisation, so device marks and host intervals (the workers') share
one time axis, to within the synchronisation's latency.

``BatchClock`` is the ``stage(name, **payload)`` function ``models.generate.generate`` calls: an
NVTX range for every range it opens (``request``, ``sam`` ... ``decode``, ``decode_step``), and two
marks around ``request`` and each of the five stages (none per decode step: they add host work to
every token).
"""
from __future__ import annotations

import contextlib
import time
from typing import Optional

import torch

from ..anatomy.stages import REQUEST, STAGES

TIMED = STAGES + (REQUEST,)


class Marks:
    """Points in time on the compute device (see the module docstring)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._base = None
        self._origin_ms = 0.0
        self.origin_ns = 0

    def mark(self, stream=None):
        """Now on ``stream`` (default: the current one): a recorded CUDA event, or host ns on the CPU."""
        if not self.cuda:
            return time.perf_counter_ns()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def _sync_mark(self):
        """(a mark, the host time it completed) with the device idle."""
        if self.cuda:
            torch.cuda.synchronize()
        m = self.mark()
        self.done(m)
        return m, time.perf_counter_ns()

    def base(self) -> None:
        """A configuration starts: device idle, every later mark is timed from here."""
        self._base, _ = self._sync_mark()
        self._origin_ms, self.origin_ns = 0.0, time.perf_counter_ns()

    def origin(self) -> None:
        """The steady window starts now (device idle): ``seconds`` counts from here."""
        m, self.origin_ns = self._sync_mark()
        self._origin_ms = self._ms(m) if self.cuda else 0.0
        if not self.cuda:
            self.origin_ns = m

    def finish(self) -> float:
        """The window ends now (device idle); its length [s]."""
        m, _ = self._sync_mark()
        return self.seconds(m)

    def _ms(self, m) -> float:
        if self._base is None:
            self.base()
        return self._base.elapsed_time(m)

    def seconds(self, m) -> float:
        """Time of mark ``m`` after the window start [s]; its work must have run (``done``)."""
        if self.cuda:
            return (self._ms(m) - self._origin_ms) / 1e3
        return (m - self.origin_ns) / 1e9

    def host_seconds(self, ns: int) -> float:
        """A host ``perf_counter_ns`` time after the window start [s]."""
        return (ns - self.origin_ns) / 1e9

    @staticmethod
    def done(m) -> None:
        """Wait until the work before mark ``m`` has run (one event; not a device synchronisation)."""
        if isinstance(m, torch.cuda.Event):
            m.synchronize()


class BatchClock:
    """The stage function of one batch: NVTX ranges, and marks around the request and each stage.
    ``spans(marks)`` -> [(range, start s, end s)] after the batch ran (times from the window start)."""

    def __init__(self, marks: Marks, nvtx):
        self.marks, self.nvtx = marks, nvtx
        self._marks: list = []

    @contextlib.contextmanager
    def __call__(self, name: str, call: Optional[int] = None, step: Optional[int] = None, **_):
        self.nvtx.push(name, step if step is not None else call)
        timed = name in TIMED
        start = self.marks.mark() if timed else None
        try:
            yield
        finally:
            if timed:
                self._marks.append((name, start, self.marks.mark()))
            self.nvtx.pop()

    def spans(self) -> list:
        if self._marks:
            self.marks.done(self._marks[-1][2])
        return [(name, self.marks.seconds(a), self.marks.seconds(b)) for name, a, b in self._marks]


__all__ = ["Marks", "BatchClock", "TIMED"]
