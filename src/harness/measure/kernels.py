"""Kernel capture (torch.profiler over CUPTI) and attribution of each kernel to a stage.

A kernel belongs to the innermost StageRecorder range that was open on the host (wall clock,
the profiler's time domain) when its launch call (cudaLaunchKernel & co., joined by correlation
id) was made. On a machine without
CUDA the same code records CPU operators instead (``device`` = cpu, top-level ops only).
Durations are ns in the raw capture and ms in the table.
"""
from __future__ import annotations

import bisect
import re

import pandas as pd
import torch


KERNEL_COLUMNS = ["device", "name", "category", "range", "stage", "call", "step", "start_ms", "dur_ms",
                  "stream"]

CATEGORIES = [  # first match wins; patterns are case-insensitive regexes over the kernel name
    ("memset", r"memset"),
    ("copy/cast", r"memcpy|copy_|direct_copy|to_copy|cast|convert|unrolled_elementwise_kernel.*copy"),
    ("attention", r"flash|fmha|attention|sdpa|efficient_attention|mem_eff|softmax_warp_forward.*causal"),
    ("conv", r"conv|implicit_gemm|winograd|im2col|cudnn|nchw|nhwc"),
    ("gemm", r"linear|gemm|gemv|sm90_xmma|cutlass|cublas|matmul|\bmm\b|addmm|bmm|nvjet|xmma|splitk|dot_product"),
    ("norm", r"layer_norm|layernorm|rms|norm_kernel|welford|batch_norm"),
    ("moe routing/indexing", r"index|scatter|gather|nonzero|masked|bincount|histc|where|sort|topk|radix|unique|cumsum|scan"),
    ("softmax/reduce", r"softmax|reduce|sum_kernel|mean|argmax|max_kernel"),
    ("activation/elementwise", r"elementwise|vectorized|silu|gelu|sigmoid|mul|add|div|pow|rsqrt|exp|tanh|neg|cat|fill|triu|arange|sin|cos"),
]
_COMPILED = [(c, re.compile(p, re.IGNORECASE)) for c, p in CATEGORIES]


def categorize(name: str) -> str:
    """Kernel category (one of CATEGORIES' names, or 'other')."""
    for cat, pat in _COMPILED:
        if pat.search(name):
            return cat
    return "other"


def profiler_for(cuda: bool):
    """torch.profiler capturing GPU activity only (CUDA) or CPU ops (no CUDA).

    Without CPU activity no per-operator host callbacks run, which keeps capture overhead low;
    stage attribution uses the StageRecorder's wall-clock ranges instead of record_function.
    """
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    return profile(activities=acts, record_shapes=False, with_stack=False, acc_events=True)


GPU_RUNTIME = re.compile(r"^(cuda|cu)[A-Z]")   # cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync, ...


def _is_cuda(e) -> bool:
    return e.device_type() == torch.autograd.DeviceType.CUDA


def _kind(e, cuda: bool) -> str | None:
    """kernel | memcpy | memset | runtime | cpu_op | None, without relying on activity_type()
    (absent in some torch releases)."""
    name = e.name()
    if _is_cuda(e):
        if name.startswith("Memcpy"):
            return "memcpy"
        if name.startswith("Memset"):
            return "memset"
        return "kernel"
    if cuda:
        return "runtime" if GPU_RUNTIME.match(name) else None
    if getattr(e, "is_user_annotation", lambda: False)() or name.startswith("harness::"):
        return None
    return "cpu_op"


class _Spans:
    """Innermost-range lookup over the recorder's wall-clock ranges (ns)."""

    def __init__(self, ranges: pd.DataFrame):
        r = ranges.dropna(subset=["wall_start_ns"]).sort_values("wall_start_ns")
        self.rows = list(r[["wall_start_ns", "wall_end_ns", "range", "call", "step"]].itertuples(index=False))
        self.starts = [int(x[0]) for x in self.rows]

    def lookup(self, t_ns: int):
        """(range, stage, call, step) for a host time, or Nones when outside every range."""
        from ..models.stages import STAGES

        i = bisect.bisect_right(self.starts, t_ns) - 1
        inner = stage = call = step = None
        while i >= 0:
            s, e, name, c, st = self.rows[i]
            if s <= t_ns <= e:
                if inner is None:
                    inner = name
                if name == "decode_step" and step is None:
                    step = int(st)
                if name in STAGES:
                    stage = name
                    call = None if pd.isna(c) else int(c)
                    break
            i -= 1
        return inner, stage, call, step


def kernel_table(prof, cuda: bool, ranges: pd.DataFrame) -> pd.DataFrame:
    """One row per GPU kernel/memcpy/memset (CUDA) or top-level CPU op (no CUDA).

    A GPU activity belongs to the range that was open on the host when its launch call was
    made (joined by correlation id). ``range`` is the innermost harness range (e.g.
    decode_step), ``stage`` the enclosing top-level stage, empty when unattributed.
    """
    events = prof.profiler.kineto_results.events()
    spans = _Spans(ranges)
    t0 = spans.starts[0] if spans.starts else 0
    launch = {}
    kinds = [(_kind(e, cuda), e) for e in events]
    if cuda:
        for k, e in kinds:
            if k == "runtime":
                launch[e.correlation_id()] = e.start_ns()
    rows = []
    for k, e in kinds:
        if k not in ("kernel", "memcpy", "memset", "cpu_op"):
            continue
        if cuda:
            t_host = launch.get(e.correlation_id()) or launch.get(e.linked_correlation_id())
        else:
            t_host = e.start_ns()
        rng, stage, call, step = spans.lookup(t_host) if t_host is not None else (None, None, None, None)
        name = e.name()
        cat = {"memcpy": "copy/cast", "memset": "memset"}.get(k) or categorize(name)
        rows.append({"device": "cuda" if cuda else "cpu", "name": name, "category": cat, "range": rng,
                     "stage": stage, "call": call, "step": step, "start_ms": (e.start_ns() - t0) / 1e6,
                     "dur_ms": e.duration_ns() / 1e6,
                     "stream": e.device_resource_id() if cuda else None})
    df = pd.DataFrame(rows, columns=KERNEL_COLUMNS)
    if not cuda and len(df):
        df = _cpu_top_level_ops(df)
    return df


def _cpu_top_level_ops(df: pd.DataFrame) -> pd.DataFrame:
    """Keep CPU ops not nested in another op (aten::linear, not its aten::addmm), so durations
    and busy time are not double counted."""
    df = df.sort_values("start_ms", kind="stable").reset_index(drop=True)
    keep, end = [], float("-inf")
    for s, d in zip(df["start_ms"], df["dur_ms"]):
        top = s >= end
        keep.append(top)
        if top:
            end = s + d
    return df[keep].reset_index(drop=True)
