"""Kernel capture (torch.profiler over CUPTI) and attribution of each kernel to a stage and a module.

A kernel belongs to the innermost StageRecorder range that was open on the host (wall clock,
the profiler's time domain) when its launch call (cudaLaunchKernel & co., joined by correlation
id) was made; with a ``harness.measure.modules.ModuleTracker`` also to the innermost module (and
its analytic family and roofline op group) open at that moment (``attribution`` says how:
``ATTRIBUTIONS``). ``category`` is the kernel-name
category (``CATEGORIES``), kept for reference beside the module's op group. On a machine without
CUDA the same code records CPU operators instead (``device`` = cpu, top-level ops only).
Durations are ns in the raw capture and ms in the table; ``kernel_sums`` sums a capture per name
(count, ms). ``KernelCapture.save_trace`` writes the capture as a gzipped Chrome/Perfetto trace.
"""
from __future__ import annotations

import bisect
import contextlib
import functools
import gzip
import json
import os
import re
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional

import pandas as pd
import torch

from ..anatomy.stages import RECORDED_STAGES
from ..schema.kernels import KERNEL_COLUMNS
from .recorder import annotation_name

#: how a kernel's ``module`` / ``family`` / ``op_group`` were found (``attribution``): ``hooks`` (forward
#: hooks of the profiled request), ``aligned`` (a replayed or compiled decode step's kernel matched to one
#: eager, hooked step of the same execution, ``harness.measure.alignment``), ``unattributed`` (such a step's
#: kernel that matched none: module empty), ``name`` (no module: only the kernel-name ``category``)
ATTRIBUTIONS = ("hooks", "aligned", "unattributed", "name")

#: gzip level of the exported trace: 1 compresses a 141 MB JSON trace in about a third of level 6's
#: time (1.6 s against 4.5 s on one CPU core) for a file about 1.5x larger
TRACE_GZIP_LEVEL = 1

CATEGORIES = [  # first match wins; patterns are case-insensitive regexes over the kernel name
    ("memset", r"memset"),
    # "LoadWithCast"/"StoreWithCast" are the operand loaders of any mixed-dtype elementwise op (an fp32 +
    # bf16 add): not a cast kernel
    ("copy/cast", r"memcpy|copy_|direct_copy|to_copy|(?<!no)(?<!with)cast|convert|unrolled_elementwise_kernel.*copy"),
    # _split_kernel / _combine_kernel: the split-KV decode attention (kernels/decode_attention_triton.py);
    # _rel_bias_fwd: SAM's attention with the rel-pos bias inside (kernels/sam_attention_triton.py)
    ("attention", r"flash|fmha|attention|sdpa|efficient_attention|mem_eff|softmax_warp_forward.*causal"
                  r"|^_split_kernel|^_combine_kernel|^_rel_bias_fwd"),
    ("conv", r"conv|implicit_gemm|winograd|im2col|cudnn|nchw|nhwc"),
    # gate_up / down_weighted / _down_kernel / _qkv_rope_kernel / _lm_head_argmax_kernel: the harness's own
    # routed-expert, MLP, q/k/v and lm_head GEMV kernels (kernels/fast_moe_triton.py, kernels/gemv_triton.py,
    # kernels/decode_step_triton.py)
    ("gemm", r"linear|gemm|gemv|sm90_xmma|cutlass|cublas|matmul|\bmm\b|addmm|bmm|nvjet|xmma|splitk|dot_product"
             r"|gate_up|down_weighted|_down_kernel|^_qkv_rope_kernel|^_lm_head_argmax_kernel"),
    ("norm", r"layer_norm|layernorm|rms|norm_kernel|welford|batch_norm"),
    # _align_kernel / _route_align_kernel / _router_kernel: the MoE row alignment (kernels/moe_align_triton.py), the
    # router's choice with it, and the fused step's router
    ("moe routing/indexing", r"index|scatter|gather|nonzero|masked|bincount|histc|where|sort|topk|radix|unique|cumsum|scan"
                             r"|^_align_kernel|^_route_align_kernel|^_router_kernel"),
    ("softmax/reduce", r"softmax|reduce|sum_kernel|mean|argmax|max_kernel"),
    ("activation/elementwise", r"elementwise|vectorized|silu|gelu|sigmoid|mul|add|div|pow|rsqrt|exp|tanh|neg|cat|fill|triu|arange|sin|cos"),
]
_COMPILED = [(c, re.compile(p, re.IGNORECASE)) for c, p in CATEGORIES]


@functools.lru_cache(maxsize=None)
def categorize(name: str) -> str:
    """Kernel category (one of CATEGORIES' names, or 'other')."""
    for cat, pat in _COMPILED:
        if pat.search(name):
            return cat
    return "other"


@contextlib.contextmanager
def usdt_lines_dropped():
    """Kineto prints a ``USDT:... profiler_start`` / ``profiler_stop`` line on stderr (file
    descriptor 2) each time a capture starts and stops: inside the block, stderr goes to a
    temporary file, and every other line is passed on to stderr after it."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):       # no file descriptor 2 to redirect: nothing to drop
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [ln for ln in tmp.read().decode(errors="replace").splitlines(True) if not ln.startswith("USDT:")]
            if kept:
                os.write(2, "".join(kept).encode())


class KernelCapture:
    """CUPTI capture of GPU activity only (CUDA) or CPU ops (no CUDA), without torch's event
    post-processing.

    torch.profiler builds a Python object per event when it stops (seconds for the ~150k
    kernels of a 128-token request); this wrapper starts kineto through the autograd profiler's
    own set-up and stops it with ``_disable_profiler()``, keeping the raw results. Without CPU
    activity no per-operator host callbacks run. Falls back to torch.profiler.profile if the
    private entry points change.
    """

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.kineto_results = None
        self._legacy = None
        self._fallback = None

    def __enter__(self):
        from torch.autograd import profiler as ap

        try:
            self._legacy = ap.profile(use_device="cuda" if self.cuda else None, use_cpu=not self.cuda,
                                      use_kineto=True, record_shapes=False, with_stack=False)
            with usdt_lines_dropped():
                self._legacy._prepare_trace()
                self._legacy._start_trace()
        except Exception:  # private API moved: use the public profiler (slower to stop)
            from torch.profiler import ProfilerActivity, profile

            self._legacy = None
            acts = [ProfilerActivity.CUDA] if self.cuda else [ProfilerActivity.CPU]
            self._fallback = profile(activities=acts, record_shapes=False, with_stack=False)
            with usdt_lines_dropped():
                self._fallback.__enter__()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
        if self._legacy is not None:
            from torch.autograd.profiler import _disable_profiler

            with usdt_lines_dropped():
                self.kineto_results = _disable_profiler()
        else:
            with usdt_lines_dropped():
                self._fallback.__exit__(*exc)
            self.kineto_results = self._fallback.profiler.kineto_results
        return False

    def save_trace(self, path, ranges: Optional[pd.DataFrame] = None) -> int:
        """Write the capture as a gzipped Chrome trace (opens in Perfetto and Holistic Trace
        Analysis); returns its size in bytes. ``ranges`` (the request's ``StageRecorder`` rows): on
        CUDA, where the capture records no host events, each range is written into the trace as a
        ``user_annotation`` ``harness::<range>#<index>`` on the host clock (``annotation_events``),
        so a reader of the trace alone cuts it into stages as the harness does."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        raw = path.with_name(path.name.removesuffix(".gz") + ".tmp")
        try:
            if self._fallback is not None:
                self._fallback.export_chrome_trace(str(raw))
            else:
                self.kineto_results.save(str(raw))
            with open(raw, "rb") as src, gzip.open(path, "wb", compresslevel=TRACE_GZIP_LEVEL) as dst:
                if self.cuda and ranges is not None and len(ranges):
                    dst.write(with_annotations(src.read(HEAD_BYTES), ranges))
                shutil.copyfileobj(src, dst)
        except BaseException:
            path.unlink(missing_ok=True)    # a failed write (a full disk) leaves no partial trace
            raise
        finally:
            raw.unlink(missing_ok=True)
        return path.stat().st_size


#: bytes of a kineto trace's head that hold ``baseTimeNanoseconds`` and the opening of ``traceEvents``
HEAD_BYTES = 1 << 20
_EVENTS_OPEN = re.compile(rb'"traceEvents"\s*:\s*\[')
_BASE_NS = re.compile(rb'"baseTimeNanoseconds"\s*:\s*(\d+)')


def annotation_events(ranges: pd.DataFrame, base_ns: int) -> list:
    """Chrome-trace events (``ph`` X, ``cat`` user_annotation, µs since ``base_ns``, this process and
    thread) of the recorder's ranges, named as the recorder's profiler annotations."""
    pid, tid = os.getpid(), threading.get_native_id()
    out = []
    for r in ranges.dropna(subset=["wall_start_ns"]).itertuples(index=False):
        index = r.step if pd.notna(r.step) else r.call
        out.append({"ph": "X", "cat": "user_annotation", "name": annotation_name(r.range, None if pd.isna(index)
                                                                                  else int(index)),
                    "pid": pid, "tid": tid, "ts": (int(r.wall_start_ns) - base_ns) / 1e3,
                    "dur": (int(r.wall_end_ns) - int(r.wall_start_ns)) / 1e3,
                    "args": {"source": "harness StageRecorder (host wall clock)"}})
    return out


def with_annotations(head: bytes, ranges: pd.DataFrame) -> bytes:
    """``head`` (the start of a kineto Chrome trace) with ``annotation_events`` first in its
    ``traceEvents`` (times on its ``baseTimeNanoseconds``, 0 when absent); unchanged when the head
    does not open ``traceEvents``."""
    m = _EVENTS_OPEN.search(head)
    if m is None:
        return head
    base = _BASE_NS.search(head)
    events = [json.dumps(e).encode() for e in annotation_events(ranges, int(base.group(1)) if base else 0)]
    if not events:
        return head
    rest = head[m.end():]
    empty = rest.lstrip().startswith(b"]")
    return head[:m.end()] + b"\n" + b",\n".join(events) + (b"\n" if empty else b",\n") + rest


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
        i = bisect.bisect_right(self.starts, t_ns) - 1
        inner = stage = call = step = None
        while i >= 0:
            s, e, name, c, st = self.rows[i]
            if s <= t_ns <= e:
                if inner is None:
                    inner = name
                if name == "decode_step" and step is None:
                    step = int(st)
                if name in RECORDED_STAGES:
                    stage = name
                    call = None if pd.isna(c) else int(c)
                    break
            i -= 1
        return inner, stage, call, step


def kernel_table(prof, cuda: bool, ranges: pd.DataFrame, modules=None) -> pd.DataFrame:
    """One row per GPU kernel/memcpy/memset (CUDA) or top-level CPU op (no CUDA).

    A GPU activity belongs to the range that was open on the host when its launch call was
    made (joined by correlation id). ``range`` is the innermost harness range (e.g.
    decode_step), ``stage`` the enclosing top-level stage, empty when unattributed. With
    ``modules`` (a ``ModuleTracker`` of the same request) ``module`` / ``family`` / ``op_group``
    name the innermost module open at launch (``ModuleTracker.attribute``, ``attribution`` =
    hooks); empty otherwise (``attribution`` = name).
    """
    events = prof.kineto_results.events()
    spans = _Spans(ranges)
    t0 = spans.starts[0] if spans.starts else 0
    launch, acts = {}, []
    for e in events:  # one pass: launch times by correlation id, activities to attribute
        k = _kind(e, cuda)
        if k == "runtime":
            launch[e.correlation_id()] = e.start_ns()
        elif k in ("kernel", "memcpy", "memset", "cpu_op"):
            acts.append((k, e))
    device = "cuda" if cuda else "cpu"
    rows, hosts = [], []
    for k, e in acts:
        t_host = (launch.get(e.correlation_id()) or launch.get(e.linked_correlation_id())) if cuda else e.start_ns()
        rng, stage, call, step = spans.lookup(t_host) if t_host is not None else (None, None, None, None)
        name = e.name()
        hosts.append(t_host)
        rows.append((device, name, {"memcpy": "copy/cast", "memset": "memset"}.get(k) or categorize(name),
                     rng, stage, call, step, (e.start_ns() - t0) / 1e6, e.duration_ns() / 1e6,
                     e.device_resource_id() if cuda else None, None, None, None,
                     "name" if modules is None else "hooks"))
    df = pd.DataFrame.from_records(rows, columns=KERNEL_COLUMNS)
    if modules is not None and len(df):
        labels = modules.attribute(hosts)
        df["module"] = [lb.path for lb in labels]
        df["family"] = [lb.family for lb in labels]
        df["op_group"] = [lb.op_group for lb in labels]
        df = routed_expert_gemms(df)
    if not cuda and len(df):
        df = _cpu_top_level_ops(df)
    return df


def kernel_sums(prof, cuda: bool) -> dict:
    """{name: [count, total ms]} of a capture (``KernelCapture``), one entry per name.

    CUDA: each GPU kernel / memcpy / memset name, the number of its activities and the sum of their
    durations (ms, device clock). No CUDA: each CPU operator name, the number of its calls and the sum
    of their self times (ms, host clock: an operator's duration less that of the operators nested in it
    on the same thread), names whose self time sums to 0 left out; as torch.profiler's
    ``key_averages()`` counts (``count``, ``self_cpu_time_total``), an operator whose one nested
    operator is itself again (a redispatch) is one call. The CPU totals add up to the time spent inside
    operators, none counted twice (``kernel_table`` keeps the top-level operators, whole durations).
    """
    events = prof.kineto_results.events()
    if not cuda:
        return _cpu_self_times(events)
    out = {}
    for e in events:
        if _kind(e, True) in ("kernel", "memcpy", "memset"):
            s = out.setdefault(e.name(), [0, 0.0])
            s[0] += 1
            s[1] += e.duration_ns() / 1e6
    return out


def _cpu_self_times(events) -> dict:
    """``kernel_sums`` without CUDA: each synchronous CPU operator's parent is the innermost one open
    on its thread that holds it whole (torch.profiler's rule); self ns = duration - the children's."""
    ops = sorted((e for e in events if _kind(e, False) == "cpu_op" and not e.is_async()
                  and e.start_thread_id() == e.end_thread_id()),
                 key=lambda e: (e.start_thread_id(), e.start_ns(), -e.end_ns()))
    names, self_ns, parents, children = [], [], [], []
    stack, ends, thread = [], [], None      # open operators (indices) of the current thread, their ends
    for i, e in enumerate(ops):
        start, end = e.start_ns(), e.end_ns()
        if e.start_thread_id() != thread:
            thread, stack, ends = e.start_thread_id(), [], []
        while stack and (start >= ends[-1] or end > ends[-1]):
            stack.pop()
            ends.pop()
        parent = stack[-1] if stack else None
        names.append(e.name())
        self_ns.append(end - start)
        parents.append(parent)
        children.append(0)
        if parent is not None:
            self_ns[parent] -= end - start
            children[parent] += 1
        stack.append(i)
        ends.append(end)
    sums = {}
    for i, name in enumerate(names):
        p = parents[i]
        s = sums.setdefault(name, [0, 0])
        if not (p is not None and names[p] == name and children[p] == 1):    # a redispatch is its parent's call
            s[0] += 1
        s[1] += self_ns[i]
    return {name: [n, ns / 1e6] for name, (n, ns) in sums.items() if ns > 0}


#: (family, op group) of a GEMM launched by an MoE container itself: grouped MoE runs the routed experts'
#: GEMMs from the container (the experts' modules are not called), whose own other kernels are routing
ROUTED_GEMM = ("moe_routed", "matmul")


def routed_expert_gemms(df: pd.DataFrame) -> pd.DataFrame:
    """Kernels labelled with the MoE container's routing group (``modules.ROUTING_GROUP``) whose category
    is ``gemm`` are the routed experts' work: family ``moe_routed``, op group ``matmul`` (where the
    analytic bytes and FLOPs of the experts are); every other kernel keeps its label."""
    from .modules import ROUTING_GROUP

    at = (df["op_group"] == ROUTING_GROUP) & (df["category"] == "gemm")
    if at.any():
        df = df.copy()
        df.loc[at, "family"], df.loc[at, "op_group"] = ROUTED_GEMM
    return df


#: stages whose attention kernels the manifest lists as measured (the LLM's)
LLM_STAGES = ("prefill", "decode")


def kernel_function(name: str) -> str:
    """A kernel's function name without its namespace, template arguments and parameters
    (``void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, ...>>(...)`` -> ``flash_fwd_kernel``)."""
    head = re.split(r"[<(]", name, maxsplit=1)[0].strip()
    return head.split()[-1].split("::")[-1] if head else name


def llm_attention_kernels(df: pd.DataFrame) -> dict:
    """{stage: [kernel function, ...]} of the attention-category kernels (``categorize``) that ran in
    the LLM's stages (``LLM_STAGES``) of a profiled request: what the attention block of the manifest
    shows as measured, beside what each call site says it asked for."""
    if df is None or not len(df) or "stage" not in df:
        return {}
    att = df[(df["category"] == "attention") & df["stage"].isin(LLM_STAGES)]
    return {stage: sorted({kernel_function(n) for n in att.loc[att["stage"] == stage, "name"]})
            for stage in LLM_STAGES if (att["stage"] == stage).any()}


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
