"""Overhead of measurement: the same request bare, with NVTX + CUDA events (StageRecorder), and
with kernel capture; and what one range costs. Each instrumented variant is compared with the bare
run in its own loop of interleaved rounds (order alternates A-B, B-A), so the profiler's stop never
sits between a bare run and an events run.

    python -m harness bench overhead bench.overhead.rounds=30 bench.overhead.capture_rounds=8
    python -m harness bench overhead execution.kv_cache=static execution.moe_impl=grouped \\
        execution.cuda_graphs=decode execution.compile=true

The model (``model=``, random weights, seed 0; bf16 on CUDA, fp32 on a CPU) runs one request of
``workload.mode`` with ``workload.decode_tokens`` under the execution ``execution.*`` (e.g. the
best variant of the optimize ladder, whose decode step is a CUDA graph near 1 ms: there the host
does not pace the GPU, so the request ratio measures the instrumentation itself). The ``ratios``
table gives two estimators, each the median over rounds with a bootstrap 95% interval (derived from
measured host times):

- request: instrumented wall ms / bare wall ms of the same round (synchronised host clock);
- step: median decode-step host ms instrumented / bare in the same round. Every decode step
  synchronises with the GPU 11 times (MoE routing), so host step time tracks GPU step time; the
  median over 127 steps ignores the host stalls that swing whole requests on a noisy host. With
  ``moe_impl=grouped`` no step syncs, the host runs ahead of the GPU, and a note says so: there the
  request ratio is the measure.

The ``ranges`` table: alternating steps: within one request every decode step is timed by the host
clock and only the steps of one parity also open a StageRecorder range; the difference of the
medians is the cost of one range in place, free of drift between requests (and the same with no
range on either parity: the A/A control). The implied request ratio is 1 + ranges x cost / bare
request ms (derived). Then the per-range cost of the bare paths, looped ``range_iters`` times with
nothing inside: StageRecorder's enter/exit (NVTX push/pop + two CUDA event records + host clocks)
and ``Alternating(None)``, the bare run's step clock. The profiler's post-processing after a
captured request is noted separately (it happens after the request, when the profiler stops).
"""
from __future__ import annotations

import contextlib
import statistics
import time

import numpy as np
import torch


class Alternating:
    """Host ms of every decode step; steps of one parity inside ``rec``'s range, the others bare.
    ``rec`` None: no range on either parity, i.e. the bare run's step clock and the A/A control."""

    def __init__(self, rec=None, parity: int = 0):
        self.rec = rec
        self.parity = parity
        self.on: list[float] = []
        self.off: list[float] = []

    @contextlib.contextmanager
    def __call__(self, name, step=None, **_):
        if name != "decode_step":
            yield
            return
        hit = step % 2 == self.parity
        t0 = time.perf_counter_ns()
        if hit and self.rec is not None:
            with self.rec(name, step=step):
                yield
        else:
            yield
        (self.on if hit else self.off).append((time.perf_counter_ns() - t0) / 1e6)


def median_ci(x: np.ndarray) -> tuple:
    """(median, 2.5th, 97.5th percentile of 2,000 bootstrap medians, seed 0) of ``x``."""
    boot = np.median(np.random.default_rng(0).choice(x, (2000, len(x))), axis=1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return float(np.median(x)), float(lo), float(hi)


def run(cfg, opts, device, report) -> None:
    """The bench (module docstring) on ``device``."""
    from .. import variants
    from .. import workload as wl
    from ..measure.kernels import KernelCapture
    from ..measure.recorder import StageRecorder
    from ..measure.runner import quiet_gc, request_ms
    from ..models.build import build_model
    from ..setup import resolve_dtype

    cuda = device.type == "cuda"
    model = build_model(cfg.model, device, resolve_dtype(cfg.dtype, device), seed=cfg.seed)
    execution = cfg.execution
    report.note(f"execution: {variants.apply(model, execution)}")
    host_ahead = execution.moe_impl == "grouped"
    page = wl.Page("p", wl.synthetic_page(0), "synthetic:0")
    mode, tokens = cfg.workload.mode, cfg.workload.decode_tokens
    req = wl.build_request([page], mode, decode_tokens=tokens).to(device, next(model.parameters()).dtype)
    post_ms: list[float] = []

    def timed(stage):
        """Wall ms of one request with ``stage`` as the stage function, GC paused."""
        with quiet_gc():
            return request_ms(model, req, cuda, stage)

    def recorder_steps(rec) -> list:
        df = rec.finish()
        return df.loc[df["range"] == "decode_step", "host_ms"].tolist()

    def bare():
        clock = Alternating(None)
        return timed(clock), clock.on + clock.off

    def events():
        rec = StageRecorder(cuda)
        return timed(rec), recorder_steps(rec)

    def capture():
        prof = KernelCapture(cuda)
        prof.__enter__()
        rec = StageRecorder(cuda)
        ms = timed(rec)
        t0 = time.perf_counter()
        prof.__exit__(None, None, None)
        prof.kineto_results.events()
        post_ms.append((time.perf_counter() - t0) * 1e3)
        return ms, recorder_steps(rec)

    for fn in (bare, events, capture):  # warm-up each path once
        fn()
    post_ms.clear()
    report.note(f"device: {torch.cuda.get_device_name(device) if cuda else 'cpu'}; torch {torch.__version__}; "
                f"mode {mode}; decode tokens {tokens}")
    if host_ahead:
        report.note("step ratios are host-timed: this execution does not sync per step (moe_impl=grouped), so the "
                    "host runs ahead of the GPU; the request ratio is the measure")
    ratios = report.table("ratios", "instrumented / bare, interleaved rounds",
                          ["instrumentation", "estimator", "ratio", "ratio_lo", "ratio_hi", "ratio_min", "ratio_max",
                           "rounds"])
    requests = report.table("requests", "request wall time", ["instrumentation", "request_ms"])
    bare_ms = []
    for name, fn, rounds in (("nvtx+events", events, opts.rounds), ("kernel capture", capture, opts.capture_rounds)):
        if rounds <= 0:
            continue
        req_r, step_r, inst_ms = [], [], []
        for r in range(rounds):
            (b, bs), (t, ts) = (bare(), fn()) if r % 2 == 0 else tuple(reversed((fn(), bare())))
            bare_ms.append(b)
            inst_ms.append(t)
            req_r.append(t / b)
            step_r.append(statistics.median(ts) / statistics.median(bs))
        for est, values in (("request", np.array(req_r)), ("step", np.array(step_r))):
            med, lo, hi = median_ci(values)
            ratios.add(instrumentation=name, estimator=est, ratio=med, ratio_lo=lo, ratio_hi=hi,
                       ratio_min=float(values.min()), ratio_max=float(values.max()), rounds=rounds)
        requests.add(instrumentation=name, request_ms=statistics.median(inst_ms))
    if bare_ms:
        requests.add(instrumentation="bare", request_ms=statistics.median(bare_ms))
    ranges = report.table("ranges", "one range in place (alternating decode steps) and looped empty",
                          ["method", "us_range", "us_range_lo", "us_range_hi", "ranges", "ratio", "ratio_lo",
                           "ratio_hi"])
    if opts.alt_rounds > 0:
        bare_med = statistics.median(bare_ms or [bare()[0] for _ in range(3)])
        n_ranges = 7 + max(tokens - 1, 0)   # request, sam, clip, projector x2, prefill, decode + steps
        for label, instrumented in (("alternating steps, A/A control", False), ("alternating steps, StageRecorder",
                                                                                True)):
            cost = []
            for r in range(opts.alt_rounds):   # alternate which parity carries the range
                alt = Alternating(StageRecorder(cuda) if instrumented else None, parity=r % 2)
                timed(alt)
                if alt.rec is not None:
                    alt.rec.finish()
                cost.append(statistics.median(alt.on) - statistics.median(alt.off))
            med, lo, hi = median_ci(np.array(cost))
            ranges.add(method=label, us_range=med * 1e3, us_range_lo=lo * 1e3, us_range_hi=hi * 1e3, ranges=n_ranges,
                       ratio=1 + n_ranges * med / bare_med, ratio_lo=1 + n_ranges * lo / bare_med,
                       ratio_hi=1 + n_ranges * hi / bare_med)
    if opts.range_iters > 0:
        looped_ranges(cuda, opts.range_iters, ranges)
    if post_ms:
        report.note(f"profiler stop + event processing after each captured request: median "
                    f"{statistics.median(post_ms):.0f} ms")


def looped_ranges(cuda: bool, n: int, table) -> None:
    """µs per empty range of StageRecorder and of ``Alternating(None)`` over ``n`` iterations (a bare
    loop's time taken off), and the ranges of a base request of 128 tokens."""
    from ..measure.recorder import StageRecorder

    def per_range(enter) -> float:
        t0 = time.perf_counter()
        for i in range(n):
            with enter(i):
                pass
        return time.perf_counter() - t0

    rec = StageRecorder(cuda)
    for _ in range(100):
        with rec("decode_step", step=0):
            pass
    if cuda:
        torch.cuda.synchronize()
    recorded = per_range(lambda i: rec("decode_step", step=i % 128))
    rec.finish()
    t0 = time.perf_counter()
    for _ in range(n):
        pass
    loop = time.perf_counter() - t0
    clock = Alternating(None)
    clocked = per_range(lambda i: clock("decode_step", step=i))
    ranges = 1 + 3 + 1 + 1 + 1 + 127   # request, sam/clip/projector, projector glue, prefill, decode, 127 decode steps
    for label, total in (("StageRecorder enter/exit, looped", recorded), ("Alternating(None) (the bare step clock), "
                                                                          "looped", clocked)):
        table.add(method=label, us_range=(total - loop) / n * 1e6, ranges=ranges)
