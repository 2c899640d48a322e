"""Decode attention on the GPU: torch SDPA over the whole static buffer with a mask against the
split-KV Triton kernel (``harness.kernels.decode_attention_triton``), at DeepSeek-OCR's decode shapes.

    python -m harness bench attention [bench.attention.batch=[1,8,32,64]] [bench.attention.cache_len=448] \\
        [bench.attention.pos=413] [bench.attention.reps=300]
    python -m harness bench attention bench.attention.sweep=true      # also every config of bench_configs()
    python -m harness bench attention 'bench.attention.batch=[32]' \
        "bench.attention.configs=['num_splits=4;wide_block_n=32;wide_warps=1']"   # also these tile changes

Self-contained: random bf16 q [B, 10, 1, 128] and, per layer, k, v [B, 10, L, 128] (``layers``
distinct buffers, 12 as in the model, so a call does not find the previous call's K/V in L2); the
position ``pos`` is an int64 device tensor, as in the captured decode step. Each implementation runs
``layers`` calls (one per layer's buffers) captured once in a CUDA graph; a replay is timed with
CUDA events after a 256 MiB write that flushes L2 (``timing.capture`` / ``timing.event_ms``), and
µs per call is the replay's time / layers. Columns of ``attention``:

- per call, p10, p90 (measured): µs per call, over ``reps`` replays.
- splits x blocks per split: the kernel's grid split count and blocks per split (from the config);
  ``last-split``: the splits combined by the last one to finish (``sem``) instead of a second launch.
- GB/s (derived): K/V bytes the implementation reads (SDPA: all L positions; the kernel: positions
  0..pos) / µs.
- rel err (measured): max |out - sdpa| / max |sdpa| of one call; ``ok`` when <= 2e-2 (a row beyond it
  is a failure of the bench: exit status 1).

Needs a CUDA device and an importable Triton.
"""
from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from .config import config_changes
from .timing import capture, event_ms, flush_buffer, quantile

TOL = 2e-2
COLUMNS = ["batch", "impl", "splits", "per", "us_call", "us_p10", "us_p90", "gbs", "rel_err", "ok"]


def bench(B: int, opts, configs, flush, table) -> None:
    """The rows of batch ``B``: SDPA, then each config (and its last-split variant where it splits)."""
    from ..kernels import decode_attention_triton as dat
    from ..models import attn_probe
    from ..variants.static_kv import attention_mask

    nh, d, L, layers = opts.heads, opts.head_dim, opts.cache_len, opts.layers
    g = torch.Generator(device="cuda").manual_seed(B)
    q = torch.randn(B, nh, 1, d, generator=g, device="cuda", dtype=torch.bfloat16)
    kv = [(torch.randn(B, nh, L, d, generator=g, device="cuda", dtype=torch.bfloat16),
           torch.randn(B, nh, L, d, generator=g, device="cuda", dtype=torch.bfloat16)) for _ in range(layers)]
    pos = torch.tensor([opts.pos], device="cuda")
    mask = attention_mask(pos, L)
    sem = torch.zeros(B * nh, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * B * nh * d * q.element_size()          # K and V bytes of one position
    ref = F.scaled_dot_product_attention(q, *kv[0], attn_mask=mask).float()

    def add(impl, fn, positions, splits="", per=""):
        out = fn(*kv[0]).float()
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        graph, _ = capture(lambda: [fn(k, v) for k, v in kv])
        us = [ms * 1e3 / layers for ms in event_ms(graph.replay, opts.reps, opts.warmup, flush)]
        med = statistics.median(us)
        table.add(batch=B, impl=impl, splits=splits, per=per, us_call=med, us_p10=quantile(us, 0.1),
                  us_p90=quantile(us, 0.9), gbs=positions * kv_bytes / med / 1e3, rel_err=err,
                  ok="ok" if err <= TOL else "FAIL")

    add(f"sdpa ({attn_probe.sdpa_choice(q, *kv[0], mask)})",
        lambda k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), L)
    for cfg in configs:
        run_cfg = cfg.for_programs(B * nh)                # the tiles this launch runs (the default's wide ones)
        splits, per = run_cfg.splits(B * nh, L)
        name = (f"triton bn={run_cfg.block_n} w={run_cfg.num_warps}"
                + ("" if cfg.num_splits is None else f" s={cfg.num_splits}")
                + (f" st={run_cfg.stages}" if run_cfg.stages else "") + (" balanced" if run_cfg.balanced else ""))
        add(name + (" (default)" if cfg == dat.DEFAULT_CONFIG else ""),
            lambda k, v, cfg=cfg: dat.decode_attention(q, k, v, pos, config=cfg), opts.pos + 1, splits, per)
        if splits > 1:                                    # the last split combines (one launch)
            add(name + " last-split",
                lambda k, v, cfg=cfg: dat.decode_attention(q, k, v, pos, config=cfg, sem=sem), opts.pos + 1,
                splits, per)


def run(cfg, opts, device, report) -> None:
    """The bench (module docstring) on ``device`` (CUDA)."""
    import triton

    from ..errors import HarnessError
    from ..kernels import decode_attention_triton as dat
    from ..kernels.availability import triton_available

    ok, why = triton_available(device)
    if not ok:
        raise HarnessError(f"the Triton decode attention kernel cannot run here: {why}", "install triton")
    report.note(f"device: {torch.cuda.get_device_name(device)} "
                f"sm{''.join(map(str, torch.cuda.get_device_capability(device)))}, torch {torch.__version__}, triton "
                f"{triton.__version__}; bf16, heads {opts.heads}, head dim {opts.head_dim}, L {opts.cache_len}, "
                f"pos {opts.pos}, {opts.layers} calls per graph")
    configs = (dat.bench_configs() if opts.sweep else [dat.DEFAULT_CONFIG]) + [
        config_changes(text, dat.DEFAULT_CONFIG) for text in opts.configs]
    flush = flush_buffer(device)
    table = report.table("attention", f"decode attention, {opts.reps} graph replays (L2 flushed) per row", COLUMNS)
    for B in opts.batch:
        bench(B, opts, configs, flush, table)
        torch.cuda.empty_cache()
    for r in table.rows:
        if r["ok"] != "ok":
            report.fail(f"batch {r['batch']} {r['impl']}: rel err {r['rel_err']:.1e} > {TOL}")
