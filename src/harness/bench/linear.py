"""Decode-size linear layers on the GPU: cuBLAS (F.linear) against the Triton GEMV kernels of
``harness.kernels.gemv_triton`` and an inductor reduction, at DeepSeek-OCR's decoder shapes (bf16).

    python -m harness bench linear [bench.linear.rows=[1,8]] [bench.linear.sweep=true] \\
        [bench.linear.inductor=true] [bench.linear.replays=50] \\
        ["bench.linear.shapes=['q|k|v|o','qkv (fused)']"]            # these shapes only (default: all)

Each (shape, rows, method) is timed as it runs in a decode graph: ``copies`` calls on distinct
weight copies (more bytes than the L2 holds, so weights come from HBM) captured back to back in
one CUDA graph; µs per call (measured) = median over ``replays`` replays of the graph's CUDA-event
time / copies, so launch gaps inside a graph count. GB/s (derived) = weight bytes / µs. rel err
(measured): max |out - F.linear| / max |F.linear| of one call. ``sweep``: GEMV tiles (block_n,
block_k, warps) at the first rows value, and the best of them per shape.
"""
from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from ..errors import HarnessError
from .timing import capture, event_ms, first_line

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
COLUMNS = ["shape", "gemv_rows", "method", "us_call", "gbs", "rel_err"]


def graph_us(call, copies: int, replays: int) -> float:
    """Median µs per call of ``copies`` calls (call(i) uses copy i) captured in one CUDA graph."""
    g, _ = capture(lambda: [call(i) for i in range(copies)])
    return statistics.median(event_ms(g.replay, replays, warmup=3)) * 1e3 / copies


def run(cfg, opts, device, report) -> None:
    """The bench (module docstring) on ``device`` (CUDA)."""
    from ..kernels.gemv_triton import GemvConfig, gemv, gemv_swiglu

    dt = torch.bfloat16
    report.note(f"device: {torch.cuda.get_device_name(device)}  torch {torch.__version__}")
    configs = [GemvConfig()]
    if opts.sweep:
        d = GemvConfig()
        configs += [GemvConfig(bn, bk, w) for bn in (2, 4, 8) for bk in (128, 256, 512) for w in (4, 8)
                    if (bn, bk, w) != (d.block_n, d.block_k, d.num_warps)]
    red = torch.compile(lambda x, w: (x.unsqueeze(-2).float() * w.float()).sum(-1).to(x.dtype), dynamic=False)
    table = report.table("linear", f"decode-size linear layers in a graph of weight copies, {opts.replays} replays",
                         COLUMNS)
    unknown = set(opts.shapes) - set(SHAPES)
    if unknown:
        raise HarnessError(f"bench.linear.shapes: unknown {sorted(unknown)}; the shapes are {list(SHAPES)}")
    for name, (N, K) in SHAPES.items():
        if opts.shapes and name not in opts.shapes:
            continue
        swiglu, fp32_out = "swiglu" in name, "fp32" in name
        wbytes = N * K * 2
        copies = max(8, min(64, -(-L2_BYTES // wbytes)))
        ws = [torch.randn(N, K, device=device, dtype=dt) * 0.02 for _ in range(copies)]
        for M in opts.rows:
            x = torch.randn(M, K, device=device, dtype=dt)
            if swiglu:
                inter = N // 2
                ref = F.silu(F.linear(x, ws[0][:inter])) * F.linear(x, ws[0][inter:])
                base = {"cublas (2 GEMMs + silu*mul)":
                        lambda i: F.silu(F.linear(x, ws[i][:inter])) * F.linear(x, ws[i][inter:])}
                ours = lambda i, c: gemv_swiglu(x, ws[i], c)  # noqa: E731
            elif fp32_out:
                ref = F.linear(x.float(), ws[0].float())
                base = {"cublas fp32 (vendor gate)": lambda i: F.linear(x.float(), ws[i].float())}
                ours = lambda i, c: gemv(x, ws[i], torch.float32, c)  # noqa: E731
            else:
                ref = F.linear(x, ws[0])
                base = {"cublas": lambda i: F.linear(x, ws[i])}
                if opts.inductor:
                    base["inductor reduction"] = lambda i: red(x, ws[i])
                ours = lambda i, c: gemv(x, ws[i], None, c)  # noqa: E731
            methods = list(base.items())
            methods += [(f"gemv {c.block_n}x{c.block_k} w{c.num_warps}", lambda i, c=c: ours(i, c))
                        for c in (configs if M == opts.rows[0] else configs[:1])]
            best = None
            for label, fn in methods:
                try:
                    us = graph_us(fn, copies, opts.replays)
                except Exception as exc:   # noqa: BLE001 - a tile that does not compile: noted, go on
                    report.note(f"{name} rows {M} {label} failed: {first_line(exc)}")
                    continue
                err = ((fn(0).float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                table.add(shape=name, gemv_rows=M, method=label, us_call=us, gbs=wbytes / us / 1e3, rel_err=err)
                if label.startswith("gemv") and (best is None or us < best[1]):
                    best = (label, us, err)
            if opts.sweep and best and M == opts.rows[0]:
                table.add(shape=name, gemv_rows=M, method="best " + best[0], us_call=best[1],
                          gbs=wbytes / best[1] / 1e3, rel_err=best[2])
        ws.clear()                            # the copies go before the next shape's
        torch.cuda.empty_cache()
