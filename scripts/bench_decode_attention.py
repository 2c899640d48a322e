"""Decode attention on the GPU: torch SDPA over the whole static buffer with a mask against the
split-KV Triton kernel (``harness.kernels.decode_attention_triton``), at DeepSeek-OCR's decode shapes.

    python scripts/bench_decode_attention.py [--batch 1 8 32 64] [--len 448] [--pos 413] [--reps 300]
    python scripts/bench_decode_attention.py --sweep          # also every config of bench_configs()

Self-contained: random bf16 q [B, 10, 1, 128] and, per layer, k, v [B, 10, L, 128] (``--layers``
distinct buffers, 12 as in the model, so a call does not find the previous call's K/V in L2); the
position ``pos`` is an int64 device tensor, as in the captured decode step. Each implementation runs
``--layers`` calls (one per layer's buffers) captured once in a CUDA graph; a replay is timed with
CUDA events after a 256 MiB write that flushes L2 (``bench_fast_moe.capture`` / ``time_ms``), and
``us`` is the replay's time / layers. Columns:

- ``us_med`` / ``us_p10`` / ``us_p90`` (measured): per call, over ``--reps`` replays.
- ``splits`` x ``per``: the kernel's grid split count and blocks per split (from the config);
  ``last-split``: the splits combined by the last one to finish (``sem``) instead of a second launch.
- ``GB/s`` (derived): K/V bytes the implementation reads (SDPA: all L positions; the kernel:
  positions 0..pos) / us_med.
- ``rel_err`` (measured): max |out - sdpa| / max |sdpa| of one call; ``ok`` when <= 2e-2.

Needs a CUDA device and an importable Triton (without them it says so and exits with status 1).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fast_moe import FLUSH_BYTES, capture, time_ms  # noqa: E402

from harness.models import attn_probe  # noqa: E402
from harness.kernels.availability import triton_available  # noqa: E402
from harness.variants.static_kv import attention_mask  # noqa: E402

TOL = 2e-2


def bench(B: int, args, configs, flush) -> list:
    from harness.kernels import decode_attention_triton as dat

    nh, d, L, layers = args.heads, args.head_dim, args.len, args.layers
    g = torch.Generator(device="cuda").manual_seed(B)
    q = torch.randn(B, nh, 1, d, generator=g, device="cuda", dtype=torch.bfloat16)
    kv = [(torch.randn(B, nh, L, d, generator=g, device="cuda", dtype=torch.bfloat16),
           torch.randn(B, nh, L, d, generator=g, device="cuda", dtype=torch.bfloat16)) for _ in range(layers)]
    pos = torch.tensor([args.pos], device="cuda")
    mask = attention_mask(pos, L)
    sem = torch.zeros(B * nh, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * B * nh * d * q.element_size()          # K and V bytes of one position
    ref = F.scaled_dot_product_attention(q, *kv[0], attn_mask=mask).float()
    rows = []

    def add(impl, fn, positions, splits="", per=""):
        out = fn(*kv[0]).float()
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        graph, _ = capture(lambda: [fn(k, v) for k, v in kv])
        us = sorted(ms * 1e3 / layers for ms in time_ms(graph.replay, args.reps, args.warmup, flush))
        med = statistics.median(us)
        rows.append({"B": B, "impl": impl, "splits": splits, "per": per, "us_med": round(med, 2),
                     "us_p10": round(us[len(us) // 10], 2), "us_p90": round(us[(9 * len(us)) // 10], 2),
                     "GB/s": round(positions * kv_bytes / med / 1e3, 1), "rel_err": f"{err:.1e}",
                     "ok": "ok" if err <= TOL else "FAIL"})

    add(f"sdpa ({attn_probe.sdpa_choice(q, *kv[0], mask)})",
        lambda k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), L)
    for cfg in configs:
        run = cfg.for_programs(B * nh)                    # the tiles this launch runs (the default's wide ones)
        splits, per = run.splits(B * nh, L)
        name = f"triton bn={run.block_n} w={run.num_warps}" + ("" if cfg.num_splits is None else f" s={cfg.num_splits}")
        add(name + (" (default)" if cfg == dat.DecodeAttentionConfig() else ""),
            lambda k, v, cfg=cfg: dat.decode_attention(q, k, v, pos, config=cfg), args.pos + 1, splits, per)
        if splits > 1:                                    # the last split combines (one launch)
            add(name + " last-split",
                lambda k, v, cfg=cfg: dat.decode_attention(q, k, v, pos, config=cfg, sem=sem), args.pos + 1,
                splits, per)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--heads", type=int, default=10)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--len", type=int, default=448, help="static cache positions L")
    ap.add_argument("--pos", type=int, default=413, help="the step's position (keys 0..pos are filled)")
    ap.add_argument("--layers", type=int, default=12, help="calls per graph, each on its own K/V buffers")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also time every config of bench_configs()")
    ap.add_argument("--csv", default=None, help="also write the table here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode_attention: no CUDA device (this is a device script); nothing was timed", file=sys.stderr)
        return 1
    ok, why = triton_available("cuda")
    if not ok:
        print(f"bench_decode_attention: the Triton kernel cannot run: {why}", file=sys.stderr)
        return 1
    if not 0 <= args.pos < args.len:
        print(f"bench_decode_attention: --pos {args.pos} is outside the cache (0..{args.len - 1})", file=sys.stderr)
        return 1
    import triton

    from harness.kernels import decode_attention_triton as dat

    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(dev)} sm{''.join(map(str, torch.cuda.get_device_capability(dev)))}, "
          f"torch {torch.__version__}, triton {triton.__version__}; bf16, heads {args.heads}, "
          f"head dim {args.head_dim}, L {args.len}, pos {args.pos}, {args.layers} calls per graph")
    configs = dat.bench_configs() if args.sweep else [dat.DecodeAttentionConfig()]
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)
    rows = []
    for B in args.batch:
        rows += bench(B, args, configs, flush)
        torch.cuda.empty_cache()
    table = pd.DataFrame(rows)
    print(table.to_string(index=False))
    if args.csv:
        table.to_csv(args.csv, index=False)
    return 0 if all(r["ok"] == "ok" for r in rows) else 2


if __name__ == "__main__":
    sys.exit(main())
