"""Busy and idle per stage read back from a Chrome trace alone (a profiled request's
``traces/<case>/trace.json.gz``), by the harness's own rules: what an independent reader of the same
trace (Holistic Trace Analysis, ``harness.external.hta``) is compared with.

From the trace: the stage ranges (``user_annotation`` events ``harness::<range>#<index>``: the
recorder's profiler annotations on a CPU run, written into a CUDA trace by
``KernelCapture.save_trace``), the GPU activities (``cat`` kernel, gpu_memcpy, gpu_memset) and the
launch calls that made them (``cuda_runtime`` / ``cuda_driver``, joined by ``args.correlation``).
Each activity belongs to the innermost range open at its launch (``kernels._Spans``, as
``kernel_table``); the rows are then summarised by ``observations.stage_rows``: busy = union of the
stage's kernel intervals, idle = span - busy. The span of a range is its kernels' extent on the GPU
(first start to last end of the activities launched inside it; a stage's calls add up), since a
trace holds no CUDA events: the profiled request's stages.csv rows use the CUDA-event span, which
also counts the time before a range's first kernel and after its last.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pandas as pd

from .kernels import _Spans
from ..schema.stages import CALL_ALL
from .observations import stage_rows
from .recorder import RANGE_COLUMNS, parse_annotation

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
#: ``stage_table`` columns: ms, over every call of the stage (``request``: the whole request)
STAGE_COLUMNS = ["stage", "kernels", "busy_ms", "span_ms", "idle_ms"]


def load(path) -> dict:
    """A Chrome trace (``.json`` or ``.json.gz``) as a dict."""
    path = Path(path)
    with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
        return json.load(f)


def trace_tables(trace: dict) -> tuple:
    """(kernels: name, start_ms, dur_ms, stream, range, stage, call, step, launch_ns; ranges:
    ``recorder.RANGE_COLUMNS`` with ``gpu_ms`` = the kernels' extent) of a trace; ns and ms on the
    trace's own clock."""
    xs = [e for e in trace.get("traceEvents") or [] if e.get("ph") == "X"]
    rows = []
    for e in xs:
        if e.get("cat") == "user_annotation" and parse_annotation(str(e.get("name"))) is not None:
            name, index = parse_annotation(e["name"])
            start, end = round(float(e["ts"]) * 1e3), round((float(e["ts"]) + float(e["dur"])) * 1e3)
            rows.append({"range": name, "call": None if name == "decode_step" else index,
                         "step": index if name == "decode_step" else None, "host_start_ms": start / 1e6,
                         "host_ms": (end - start) / 1e6, "wall_start_ns": start, "wall_end_ns": end})
    ranges = pd.DataFrame(rows, columns=RANGE_COLUMNS)
    launch = {e["args"]["correlation"]: round(float(e["ts"]) * 1e3) for e in xs
              if e.get("cat") in LAUNCH_CATS and "correlation" in (e.get("args") or {})}
    spans = _Spans(ranges)
    krows = []
    for e in xs:
        if e.get("cat") not in GPU_CATS:
            continue
        t = launch.get((e.get("args") or {}).get("correlation"))
        rng, stage, call, step = spans.lookup(t) if t is not None else (None, None, None, None)
        krows.append({"name": e.get("name"), "start_ms": float(e["ts"]) / 1e3, "dur_ms": float(e["dur"]) / 1e3,
                      "stream": (e.get("args") or {}).get("stream", e.get("tid")), "range": rng, "stage": stage,
                      "call": call, "step": step, "launch_ns": t})
    kernels = pd.DataFrame(krows, columns=["name", "start_ms", "dur_ms", "stream", "range", "stage", "call", "step",
                                           "launch_ns"])
    if len(ranges):
        ranges["gpu_start_ms"], ranges["gpu_ms"] = zip(*(_extent(kernels, r) for r in ranges.itertuples()))
    return kernels, ranges


def _extent(kernels: pd.DataFrame, r) -> tuple:
    """(first start, last end - first start) ms of the activities launched inside range ``r``, or (None, None)."""
    t = kernels["launch_ns"].to_numpy(dtype=float)
    k = kernels[(t >= r.wall_start_ns) & (t <= r.wall_end_ns)]
    if not len(k):
        return None, None
    start = float(k["start_ms"].min())
    return start, float((k["start_ms"] + k["dur_ms"]).max()) - start


def stage_table(path) -> pd.DataFrame:
    """``STAGE_COLUMNS``, one row per stage of the trace (every call) and one for the request."""
    kernels, ranges = trace_tables(load(path))
    if not len(ranges) or not len(kernels):
        return pd.DataFrame(columns=STAGE_COLUMNS)
    ranges = ranges.astype({"gpu_ms": float, "gpu_start_ms": float})
    out = []
    for row in stage_rows(ranges, kernels, 1):
        if row["call"] != CALL_ALL:
            continue
        span = row["gpu_ms"] if row.get("gpu_ms") is not None and not np.isnan(row["gpu_ms"]) else None
        out.append({"stage": row["stage"], "kernels": row.get("kernels"), "busy_ms": row.get("busy_ms"),
                    "span_ms": span, "idle_ms": row.get("idle_ms")})
    return pd.DataFrame(out, columns=STAGE_COLUMNS)


__all__ = ["GPU_CATS", "LAUNCH_CATS", "STAGE_COLUMNS", "load", "trace_tables", "stage_table"]
