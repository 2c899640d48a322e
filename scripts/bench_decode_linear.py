"""Decode-size linear layers on the GPU: cuBLAS (F.linear) against the Triton GEMV kernels of
``harness.kernels.gemv_triton`` and an inductor reduction, at DeepSeek-OCR's decoder shapes (bf16).

    python scripts/bench_decode_linear.py [--rows 1 8] [--sweep] [--inductor] [--replays 50]

Each (shape, rows, method) is timed as it runs in a decode graph: ``COPIES`` calls on distinct
weight copies (more bytes than the L2 holds, so weights come from HBM) captured back to back in
one CUDA graph; ``us`` (measured) = median over ``--replays`` replays of the graph's CUDA-event
time / COPIES, so launch gaps inside a graph count. ``GB/s`` (derived) = weight bytes / us.
``rel_err`` (measured): max |out - F.linear| / max |F.linear| of one call.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fast_moe import capture  # noqa: E402   (side-stream warm-up, then the graph)

SHAPES = {          # name: (N, K); the fused ones concatenate weights the model holds apart
    "q|k|v|o": (1280, 1280),
    "qkv (fused)": (3840, 1280),
    "shared down": (1280, 1792),
    "shared gate|up": (1792, 1280),
    "shared gate_up (fused, swiglu)": (3584, 1280),
    "dense down": (1280, 6848),
    "dense gate_up (fused, swiglu)": (13696, 1280),
    "router (fp32 out)": (64, 1280),
}
L2_BYTES = 128 * 2**20


def graph_us(call, copies: int, replays: int) -> float:
    """Median µs per call of ``copies`` calls (call(i) uses copy i) captured in one CUDA graph."""
    g, _ = capture(lambda: [call(i) for i in range(copies)])
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / copies)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--sweep", action="store_true",
                    help="also sweep GEMV tiles (block_n, block_k, warps) at the first --rows value")
    ap.add_argument("--inductor", action="store_true", help="also time torch.compile of (x * w).sum(-1)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode_linear: no CUDA device here; this benchmark times GPU kernels", file=sys.stderr)
        return 2
    from harness.kernels.gemv_triton import GemvConfig, gemv, gemv_swiglu

    dev, dt = torch.device("cuda"), torch.bfloat16
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    configs = [GemvConfig()]
    if a.sweep:
        configs += [GemvConfig(bn, bk, w) for bn in (2, 4, 8) for bk in (128, 256, 512) for w in (4, 8)
                    if (bn, bk, w) != (GemvConfig().block_n, GemvConfig().block_k, GemvConfig().num_warps)]
    red = torch.compile(lambda x, w: (x.unsqueeze(-2).float() * w.float()).sum(-1).to(x.dtype), dynamic=False)
    print(f"{'shape':32} {'rows':>4} {'method':28} {'us':>8} {'GB/s':>7} {'rel_err':>9}")
    for name, (N, K) in SHAPES.items():
        swiglu, fp32_out = "swiglu" in name, "fp32" in name
        wbytes = N * K * 2
        copies = max(8, min(64, -(-L2_BYTES // wbytes)))
        ws = [torch.randn(N, K, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        for M in a.rows:
            x = torch.randn(M, K, device=dev, dtype=dt)
            if swiglu:
                I = N // 2
                ref = F.silu(F.linear(x, ws[0][:I])) * F.linear(x, ws[0][I:])
                base = {"cublas (2 GEMMs + silu*mul)": lambda i: F.silu(F.linear(x, ws[i][:I])) * F.linear(x, ws[i][I:])}
                ours = lambda i, c: gemv_swiglu(x, ws[i], c)
            elif fp32_out:
                ref = F.linear(x.float(), ws[0].float())
                base = {"cublas fp32 (vendor gate)": lambda i: F.linear(x.float(), ws[i].float())}
                ours = lambda i, c: gemv(x, ws[i], torch.float32, c)
            else:
                ref = F.linear(x, ws[0])
                base = {"cublas": lambda i: F.linear(x, ws[i])}
                if a.inductor:
                    base["inductor reduction"] = lambda i: red(x, ws[i])
                ours = lambda i, c: gemv(x, ws[i], None, c)
            rows = list(base.items())
            rows += [(f"gemv {c.block_n}x{c.block_k} w{c.num_warps}", lambda i, c=c: ours(i, c))
                     for c in (configs if M == a.rows[0] else configs[:1])]
            best = None
            for label, fn in rows:
                try:
                    us = graph_us(fn, copies, a.replays)
                except Exception as exc:   # a tile that does not compile: say so, go on
                    print(f"{name:32} {M:>4} {label:28} failed: {exc.__class__.__name__}: {str(exc)[:80]}")
                    continue
                err = ((fn(0).float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                print(f"{name:32} {M:>4} {label:28} {us:8.2f} {wbytes / us / 1e3:7.0f} {err:9.1e}")
                if label.startswith("gemv") and (best is None or us < best[1]):
                    best = (label, us, err)
            if a.sweep and best and M == a.rows[0]:
                print(f"{name:32} {M:>4} {'best ' + best[0]:28} {best[1]:8.2f} {wbytes / best[1] / 1e3:7.0f} {best[2]:9.1e}")
        del ws
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
