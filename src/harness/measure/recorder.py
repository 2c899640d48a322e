"""StageRecorder: the ``stage(name, **payload)`` context factory the models call.

Inside a range it emits an NVTX push/pop, records a CUDA event at each boundary on the current
stream (no synchronisation inside the timed region), reads the host clock, resets/reads the
allocator's peak for the five top-level stages, and keeps the wall-clock (``time.time_ns``, the
profiler's clock domain) bounds used to attribute kernel launches. ``annotate`` also opens a
``torch.profiler.record_function`` named ``harness::<name>#<index>`` (visible in traces).
``finish()`` synchronises once and returns one row per range.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Optional

import pandas as pd
import torch

from ..anatomy.stages import STAGES
from .nvtx_ranges import NvtxRanges

RANGE_COLUMNS = ["range", "stage", "call", "step", "host_start_ms", "host_ms", "gpu_start_ms", "gpu_ms",
                 "peak_mem_bytes", "wall_start_ns", "wall_end_ns"]


# Timing events are reused across requests: creating one costs more host time than recording it,
# and decode opens a range (two events) per token. ``finish`` returns them after reading them.
_EVENTS: list = []


@dataclass
class _Range:
    name: str
    call: Optional[int]
    step: Optional[int]
    host_start: int
    host_end: int = 0
    ev_start: object = None
    ev_end: object = None
    peak: Optional[int] = None
    wall_start: int = 0
    wall_end: int = 0


def annotation_name(name: str, index: Optional[int]) -> str:
    return f"harness::{name}" + (f"#{index}" if index is not None else "")


def parse_annotation(label: str):
    """``harness::decode_step#5`` -> ("decode_step", 5); None for foreign annotations."""
    if not label.startswith("harness::"):
        return None
    body = label[len("harness::"):]
    name, _, idx = body.partition("#")
    return name, (int(idx) if idx else None)


class StageRecorder:
    """Collects stage ranges for one request. ``cuda`` False -> host timers only."""

    def __init__(self, cuda: bool, nvtx: bool = True, events: bool = True, annotate: bool = False,
                 memory: bool = True):
        self.cuda = cuda
        self.events = events and cuda
        self.memory = memory and cuda
        self.annotate = annotate
        self.nvtx = NvtxRanges(nvtx)
        self.ranges: list[_Range] = []
        self._table: Optional[pd.DataFrame] = None

    def _event(self):
        ev = _EVENTS.pop() if _EVENTS else torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    @contextlib.contextmanager
    def __call__(self, name: str, call: Optional[int] = None, step: Optional[int] = None, **_):
        index = step if step is not None else call
        self.nvtx.push(name, index)
        rec = contextlib.nullcontext()
        if self.annotate:
            rec = torch.profiler.record_function(annotation_name(name, index))
        r = _Range(name, call, step, time.perf_counter_ns(), wall_start=time.time_ns())
        top = name in STAGES
        if self.memory and top:
            torch.cuda.reset_peak_memory_stats()
        if self.events:
            r.ev_start = self._event()
        try:
            with rec:
                yield
        finally:
            if self.events:
                r.ev_end = self._event()
            if self.memory and top:   # the nested dict: max_memory_allocated() flattens ~100 stats (~0.1 ms)
                r.peak = torch.cuda.memory_stats_as_nested_dict().get("allocated_bytes", {}).get("all", {}).get("peak")
            r.host_end = time.perf_counter_ns()
            r.wall_end = time.time_ns()
            self.nvtx.pop()
            self.ranges.append(r)

    def finish(self) -> pd.DataFrame:
        """Synchronise once, then one row per range (ms relative to the first range's start).
        The table is kept: later calls return it (the events have gone back to the pool)."""
        if self._table is not None:
            return self._table
        if self.cuda:
            torch.cuda.synchronize()
        if not self.ranges:
            return pd.DataFrame(columns=RANGE_COLUMNS)
        first = min(self.ranges, key=lambda r: r.host_start)
        rows = []
        for r in self.ranges:
            gpu_ms = gpu_start = None
            if r.ev_start is not None:
                gpu_ms = r.ev_start.elapsed_time(r.ev_end)
                gpu_start = first.ev_start.elapsed_time(r.ev_start) if first.ev_start is not None else None
            rows.append({
                "range": r.name,
                "stage": r.name if r.name in STAGES else None,
                "call": r.call, "step": r.step,
                "host_start_ms": (r.host_start - first.host_start) / 1e6,
                "host_ms": (r.host_end - r.host_start) / 1e6,
                "gpu_start_ms": gpu_start, "gpu_ms": gpu_ms, "peak_mem_bytes": r.peak,
                "wall_start_ns": r.wall_start, "wall_end_ns": r.wall_end,
            })
        for r in self.ranges:
            _EVENTS.extend(e for e in (r.ev_start, r.ev_end) if e is not None)
            r.ev_start = r.ev_end = None
        df = pd.DataFrame(rows, columns=RANGE_COLUMNS)
        self._table = df.sort_values("host_start_ms", kind="stable").reset_index(drop=True)
        return self._table
