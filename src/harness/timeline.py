"""Where a run's own wall time goes: consecutive phases of one clock, so they add up to the total.

``Timeline.enter(phase)`` closes the phase that was running and starts ``phase`` (a phase entered
again keeps adding to its total); ``carve(seconds, part, of)`` moves seconds measured inside one
phase to a phase of their own (the trace export inside the profiled request). ``as_dict()`` is the
manifest's ``timing`` block, ``line()`` the run's last words on it. Seconds of the host's
``time.perf_counter`` (wall clock, host side), rounded to 0.1 s in the line.
"""
from __future__ import annotations

import time
from typing import Callable

#: the order phases are shown in (others follow in the order they were first entered)
ORDER = ("start-up", "set-up", "memory check", "model build", "calibration", "host probe", "case set-up", "warm-up",
         "timed repeats", "profiled request", "trace export", "analytic + writing", "report")


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc), None where that cannot be read: the
    imports, Hydra and the config checks before a run's own clock starts."""
    try:
        with open("/proc/self/stat") as fh:
            started_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        import os
        return max(uptime - started_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return None


class Timeline:
    """Phases of one wall clock (see the module docstring). ``clock``: seconds, monotonic."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, before: float | None = None):
        """``before``: seconds the process ran before this clock started (phase ``start-up``)."""
        self._clock = clock
        self._t0 = self._since = clock()
        self._current: str | None = None
        self._end: float | None = None
        self.seconds: dict = {"start-up": float(before)} if before else {}
        self._t0 -= before or 0.0

    def enter(self, phase: str | None) -> None:
        now = self._clock()
        if self._current is not None:
            self.seconds[self._current] = self.seconds.get(self._current, 0.0) + (now - self._since)
        self._current, self._since = phase, now

    def carve(self, seconds: float, part: str, of: str) -> None:
        """Move ``seconds`` (measured inside phase ``of``) from ``of`` to ``part``."""
        seconds = min(max(float(seconds), 0.0), self.seconds.get(of, 0.0))
        if seconds:
            self.seconds[of] -= seconds
            self.seconds[part] = self.seconds.get(part, 0.0) + seconds

    def stop(self) -> None:
        """Close the running phase (the total stops here)."""
        self.enter(None)
        self._end = self._since

    def total(self) -> float:
        return (self._end if self._end is not None else self._clock()) - self._t0

    def ordered(self) -> list:
        """[(phase, seconds)] in ``ORDER``, then any other phase in first-entered order."""
        known = [(p, self.seconds[p]) for p in ORDER if p in self.seconds]
        return known + [(p, s) for p, s in self.seconds.items() if p not in ORDER]

    def as_dict(self) -> dict:
        return {"total_s": round(self.total(), 3), "phases_s": {p: round(s, 3) for p, s in self.ordered()},
                "clock": "host wall clock (time.perf_counter), consecutive phases: they add up to total_s"}

    def line(self) -> str:
        """E.g. ``time 18.0 s: model build 4.6 s, calibration 6.1 s, ... report 3.2 s``."""
        return f"time {self.total():.1f} s: " + ", ".join(f"{p} {s:.1f} s" for p, s in self.ordered())


def phase_of(request: str) -> str:
    """The timeline phase of a request label (``harness.stopping.Position``'s): ``warmup=I``,
    ``repeat=R``, ``repeat=profiled``, ``writing``, ``done``."""
    if request.startswith("warmup="):
        return "warm-up"
    if request == "repeat=profiled":
        return "profiled request"
    if request.startswith("repeat="):
        return "timed repeats"
    return "analytic + writing"


__all__ = ["Timeline", "phase_of", "process_age_s", "ORDER"]
