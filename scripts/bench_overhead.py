"""Overhead of measurement: the same request bare, with NVTX + CUDA events, and with kernel
capture, interleaved round by round (order alternates). Prints median wall ms of each, the
median of the per-round paired ratios to the bare run, and the profiler's post-processing time
(kept out of the capture ratio: it happens after the request, when the profiler stops).

    python scripts/bench_overhead.py --rounds 8 --mode base --decode-tokens 128
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from harness import workload as wl
from harness.config import ModelConfig
from harness.measure.kernels import KernelCapture
from harness.measure.recorder import StageRecorder
from harness.measure.runner import quiet_gc
from harness.models.build import build_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--mode", default="base")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--no-capture", action="store_true", help="skip the kernel-capture variant")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_model(ModelConfig(attn_implementation=args.attn), dev, dtype, seed=0)
    page = wl.Page("p", wl.synthetic_page(0), "synthetic:0")
    req = wl.build_request([page], args.mode, decode_tokens=args.decode_tokens).to(dev, dtype)
    post_ms: list[float] = []

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(fn):
        sync()
        with quiet_gc():
            t0 = time.perf_counter()
            fn()
            sync()
            return (time.perf_counter() - t0) * 1e3

    def bare():
        return timed(lambda: model.generate(req))

    def events():
        def go():
            rec = StageRecorder(cuda)
            model.generate(req, stage=rec)
            rec.finish()
        return timed(go)

    def capture():
        prof = KernelCapture(cuda)
        prof.__enter__()
        ms = timed(lambda: (model.generate(req, stage=StageRecorder(cuda))))
        t0 = time.perf_counter()
        prof.__exit__(None, None, None)
        prof.kineto_results.events()
        post_ms.append((time.perf_counter() - t0) * 1e3)
        return ms

    variants = {"bare": bare, "nvtx+events": events}
    if not args.no_capture:
        variants["kernel capture"] = capture
    for fn in variants.values():  # warm-up each path once
        fn()
    post_ms.clear()
    times = {k: [] for k in variants}
    for r in range(args.rounds):
        order = list(variants.items())
        if r % 2:
            order.reverse()
        for name, fn in order:
            times[name].append(fn())
    dev_name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"device: {dev_name}; torch {torch.__version__}; mode {args.mode}; decode tokens {args.decode_tokens}; "
          f"rounds {args.rounds}")
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts, times["bare"])]
        print(f"{name:15s} median {statistics.median(ts):9.1f} ms  paired ratio median {statistics.median(ratios):6.3f}"
              f"  (min {min(ratios):.3f}, max {max(ratios):.3f})")
    if post_ms:
        print(f"profiler stop + event processing after each captured request: median {statistics.median(post_ms):.0f} ms")


if __name__ == "__main__":
    main()
