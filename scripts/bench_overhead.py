"""Overhead of measurement: the same request bare, with NVTX + CUDA events (StageRecorder), and
with kernel capture. Each instrumented variant is compared with the bare run in its own loop of
interleaved rounds (order alternates A-B, B-A), so the profiler's stop never sits between a bare
run and an events run.

Two estimators, each the median over rounds with a bootstrap 95% interval:
- request: instrumented wall ms / bare wall ms of the same round (synchronised host clock);
- step: median decode-step host ms instrumented / bare in the same round. Every decode step
  synchronises with the GPU 11 times (MoE routing), so host step time tracks GPU step time; the
  median over 127 steps ignores the host stalls that swing whole requests on a noisy host. With
  ``moe_impl=grouped`` no step syncs, the host runs ahead of the GPU, and the line says so: there the
  request ratio is the measure.
- alternating steps: within one request every decode step is timed by the host clock and only
  the even steps also open a StageRecorder range; the difference of the medians (even - odd) is
  the cost of one range in place, free of drift between requests. The implied request ratio is
  1 + ranges x cost / bare request ms (derived, labelled so).
The bare run carries only ``Alternating(None)`` (a host clock read around each decode step); its
cost is printed by ``scripts/device/range_cost.py``. The profiler's post-processing after a captured
request is printed separately (it happens after the request, when the profiler stops).

    python scripts/bench_overhead.py --rounds 30 --capture-rounds 8 --mode base --decode-tokens 128
    python scripts/bench_overhead.py --execution kv_cache=static moe_impl=grouped cuda_graphs=decode compile=true

``--execution KEY=VALUE ...`` runs the model under those execution knobs (``harness.config.ExecutionConfig``),
e.g. the best variant of the optimize ladder, whose decode step is a CUDA graph near 1 ms: there the
host does not pace the GPU, so the request ratio measures the instrumentation itself.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import numpy as np
import torch

from harness import variants
from harness import workload as wl
import yaml

from harness.config import ExecutionConfig, ModelConfig, from_dict
from harness.measure.kernels import KernelCapture
from harness.measure.recorder import StageRecorder
from harness.measure.runner import quiet_gc, request_ms
from harness.models.build import build_model


class Alternating:
    """Host ms of every decode step; steps of one parity inside ``rec``'s range, the others bare.
    ``rec`` None: no range on either parity, i.e. the bare run's step clock and the A/A control."""

    def __init__(self, rec: StageRecorder | None, parity: int = 0):
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


def median_ci(x: np.ndarray) -> tuple[float, float, float]:
    boot = np.median(np.random.default_rng(0).choice(x, (2000, len(x))), axis=1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return float(np.median(x)), float(lo), float(hi)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30, help="bare vs NVTX+events rounds")
    ap.add_argument("--capture-rounds", type=int, default=10, help="bare vs kernel-capture rounds (0: skip)")
    ap.add_argument("--alt-rounds", type=int, default=10, help="requests with alternating instrumented steps")
    ap.add_argument("--mode", default="base")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--execution", nargs="*", default=[], metavar="KEY=VALUE",
                    help="execution knobs (harness.config.ExecutionConfig), e.g. kv_cache=static moe_impl=grouped")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_model(ModelConfig(attn_implementation=args.attn), dev, dtype, seed=0)
    execution = from_dict(ExecutionConfig, {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.execution)})
    print(f"execution: {variants.apply(model, execution)}")
    # a decode step without host syncs (grouped MoE) lets the host run ahead of the GPU: its host-timed
    # step is the launch time, not the GPU's, and the step ratio says nothing about the GPU's time
    host_ahead = ("  [host-timed: this execution does not sync per step, so the host runs ahead of the GPU; "
                  "the request ratio is the measure]" if execution.moe_impl == "grouped" else "")
    page = wl.Page("p", wl.synthetic_page(0), "synthetic:0")
    req = wl.build_request([page], args.mode, decode_tokens=args.decode_tokens).to(dev, dtype)
    post_ms: list[float] = []

    def timed(stage):
        """Wall ms of one request with ``stage`` as the stage function, GC paused."""
        with quiet_gc():
            return request_ms(model, req, cuda, stage)

    def recorder_steps(rec: StageRecorder) -> list[float]:
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
    dev_name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"device: {dev_name}; torch {torch.__version__}; mode {args.mode}; decode tokens {args.decode_tokens}")
    bare_ms = []
    for name, fn, rounds in (("nvtx+events", events, args.rounds), ("kernel capture", capture, args.capture_rounds)):
        if rounds <= 0:
            continue
        req_r, step_r, inst_ms = [], [], []
        for r in range(rounds):
            (b, bs), (t, ts) = (bare(), fn()) if r % 2 == 0 else tuple(reversed((fn(), bare())))
            bare_ms.append(b)
            inst_ms.append(t)
            req_r.append(t / b)
            step_r.append(statistics.median(ts) / statistics.median(bs))
        for est, ratios in (("request", np.array(req_r)), ("step", np.array(step_r))):
            med, lo, hi = median_ci(ratios)
            print(f"{name:15s} {est:8s} ratio median {med:6.3f}  95% CI [{lo:.3f}, {hi:.3f}]  "
                  f"(rounds {rounds}, min {ratios.min():.3f}, max {ratios.max():.3f})"
                  + (host_ahead if est == "step" else ""))
        print(f"{name:15s} request median {statistics.median(inst_ms):9.1f} ms")
    if bare_ms:
        print(f"{'bare':15s} request median {statistics.median(bare_ms):9.1f} ms")
    if args.alt_rounds > 0:
        bare_med = statistics.median(bare_ms or [bare()[0] for _ in range(3)])
        n_ranges = 7 + max(args.decode_tokens - 1, 0)   # request, sam, clip, projector x2, prefill, decode + steps
        for label, instrumented in (("A/A control", False), ("StageRecorder", True)):
            cost = []
            for r in range(args.alt_rounds):   # alternate which parity carries the range
                alt = Alternating(StageRecorder(cuda) if instrumented else None, parity=r % 2)
                timed(alt)
                if alt.rec is not None:
                    alt.rec.finish()
                cost.append(statistics.median(alt.on) - statistics.median(alt.off))
            med, lo, hi = median_ci(np.array(cost))
            print(f"alternating steps, {label:13s}: {med * 1e3:7.1f} us per range in place, 95% CI "
                  f"[{lo * 1e3:.1f}, {hi * 1e3:.1f}] (requests {args.alt_rounds}); derived request ratio for "
                  f"{n_ranges} ranges: {1 + n_ranges * med / bare_med:.4f} "
                  f"[{1 + n_ranges * lo / bare_med:.4f}, {1 + n_ranges * hi / bare_med:.4f}]")
    if post_ms:
        print(f"profiler stop + event processing after each captured request: median {statistics.median(post_ms):.0f} ms")


if __name__ == "__main__":
    main()
