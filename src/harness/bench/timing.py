"""The benches' shared timing on the device: CUDA events, graph capture, an L2 flush.

Every time here is measured: CUDA events on the current stream (``elapsed_time``: ms) around the
calls, or the host clock (``time.perf_counter``) on a CPU, where only the plumbing is checked.
"""
from __future__ import annotations

import time

import torch

#: bytes written before a call to evict the L2 (the largest, an H200's, holds 50 MB)
FLUSH_BYTES = 256 * 2**20


def flush_buffer(device) -> torch.Tensor:
    """A ``FLUSH_BYTES`` buffer on ``device``: zeroing it evicts the L2, so a call's weights come from DRAM."""
    return torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)


def capture(fn, warmup: int = 3):
    """(graph, the captured call's output) of ``fn`` in a CUDA graph, after ``warmup`` calls on a side
    stream (they compile and allocate; a stateful ``fn`` has advanced: reset it before replaying)."""
    from ..variants.static_decoder import on_side_stream

    on_side_stream(fn, warmup)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def event_ms(fn, reps: int, warmup: int = 0, flush: torch.Tensor | None = None, idle: bool = True,
             cuda: bool = True) -> list:
    """ms of each of ``reps`` calls of ``fn`` (after ``warmup`` untimed ones): CUDA events around the
    call on a CUDA device, each call after ``flush`` is zeroed (L2 evicted) when given. ``idle``: the
    device is synchronised before every call, so each starts on an empty queue (launch overhead and
    host syncs count); otherwise the calls queue back to back and the events are read at the end.
    ``cuda`` False (a CPU): the host clock around each call."""
    for _ in range(warmup):
        fn()
    if not cuda:
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    torch.cuda.synchronize()
    pairs = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()
        if idle:
            torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
        if idle:
            end.synchronize()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in pairs]


def per_step_us(fn, reset, reps: int, rounds: int) -> list:
    """µs per call of ``fn`` over ``reps`` back-to-back calls (CUDA events around them all), one value
    per round; ``reset()`` before each round puts the state back (a decode step's position)."""
    out = []
    for _ in range(rounds):
        reset()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / reps)
    return out


def capture_reset(run, reset) -> torch.cuda.CUDAGraph:
    """``run`` captured (``capture``), its state reset afterwards (the warm-up advanced it)."""
    graph, _ = capture(run)
    torch.cuda.synchronize()
    reset()
    return graph


def quantile(values, q: float) -> float:
    """The value at rank ``int(q * (n - 1))`` of the sorted ``values`` (the benches' p10 and p90)."""
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def first_line(exc: BaseException) -> str:
    """``Type: last line of the message`` (300 characters at most): a failure named in one line."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"[:300]


__all__ = ["FLUSH_BYTES", "flush_buffer", "capture", "event_ms", "per_step_us", "capture_reset", "quantile",
           "first_line"]
