"""TPOT from outside the harness's timers: ``generate()`` of 2 and of 130 tokens, wall clock.

    python -m harness bench outside_tpot                        # best and best-fused, ~2 min on an H100
    python -m harness bench outside_tpot bench.outside_tpot.executions=[best-fused] \\
        bench.outside_tpot.ladder=runs/<optimize run>           # beside the ladder's TPOT

For each named execution in ``executions`` (``conf/execution/``, loaded by ``conf/bench/outside_tpot.yaml``;
the optimize ladder's rows of the same name run them), the model (``model=``, random weights, seed
0, bf16, built once) runs that execution (``variants.apply``) on one synthetic page of
``workload.mode`` (base, the ladder's) under ``workload.routing``, and ``generate()`` of 2 tokens
(vision, prefill, 1 decode step) and of 130 tokens (vision, prefill, 129 decode steps) run back to
back, each between ``torch.cuda.synchronize()`` calls and timed with ``time.perf_counter``;
``repeats`` pairs after ``warmup`` pairs (the first builds and captures the decoder). TPOT of a pair
= (t130 - t2) / 128: the 128 extra decode steps, everything else (vision, prefill, the result's
routing read-back) in both. The ``tpot`` table (measured): the median TPOT over the pairs with its
min and max, the medians of t2 and t130, tok/s = 1000 / TPOT (derived); with ``ladder`` (a run
directory), the ladder's ``tpot_mean_ms`` and ``tpot_p50_ms`` of the row of the same name
(``headline.csv``: CUDA events around each decode step, median request) and the ratio outside /
ladder mean (issue 24 asks for it within 3%).

Both requests get the same static cache (``static_cache_len`` = prompt + 130 rounded up to 64, as
the ladder's 128-token request rounds), so they run one decoder. ``vision_compile`` is turned off
unless ``as_ladder``: vision runs the same in both requests and cancels out of the difference,
while compiling it would add minutes.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

import torch

SHORT, LONG = 2, 130
COLUMNS = ["case", "tpot_ms", "tpot_min", "tpot_max", "tok_s_head", "t_short_ms", "t_long_ms", "setup_s"]
LADDER_COLUMNS = ["ladder_tpot_mean", "ladder_tpot_p50", "outside_ladder", "within"]


def ladder_tpot(run_dir: Path, case: str):
    """(tpot_mean_ms, tpot_p50_ms) of ``case`` in a run's headline.csv, or None."""
    import pandas as pd

    path = Path(run_dir) / "headline.csv"
    if not path.exists():
        return None
    head = pd.read_csv(path)
    row = head[head["case"] == case]
    if row.empty:
        return None
    return float(row["tpot_mean_ms"].iloc[0]), float(row["tpot_p50_ms"].iloc[0])


def timed_generate(model, request, tokens: int) -> float:
    """Wall-clock ms of one ``generate`` of ``tokens`` tokens, between device synchronisations."""
    from ..models.generate import generate

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    generate(model, request, max_new_tokens=tokens)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def run(cfg, opts, device, report) -> None:
    """The bench (module docstring) on ``device`` (CUDA)."""
    from .. import variants
    from .. import workload as wl
    from ..config import ExecutionConfig
    from ..models.build import build_model
    from ..setup import synthetic_pages
    from .verb import named_execution

    t_start = time.perf_counter()
    executions = {name: named_execution(cfg, name) for name in opts.executions}
    model = build_model(cfg.model, device, torch.bfloat16, seed=cfg.seed)
    report.note(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; model built in "
                f"{time.perf_counter() - t_start:.0f} s; mode {cfg.workload.mode}, routing {cfg.workload.routing}")
    table = report.table("tpot", f"TPOT from outside: (t{LONG} - t{SHORT}) / {LONG - SHORT} over {opts.repeats} pairs",
                         COLUMNS + (LADDER_COLUMNS if opts.ladder else []))
    pages = synthetic_pages(cfg.workload, 0)                         # the ladder's first request's page
    request = wl.build_request(pages[:1], cfg.workload.mode, decode_tokens=LONG, routing=cfg.workload.routing,
                               routing_seed=cfg.workload.routing_seed).to(device, torch.bfloat16)
    for name, ex in executions.items():
        if ex.kv_cache == "static":
            ex = dataclasses.replace(ex, static_cache_len=ex.cache_len(request.prefill_tokens, LONG))
        if not opts.as_ladder:
            ex = dataclasses.replace(ex, vision_compile=False)
        t0 = time.perf_counter()
        variants.apply(model, ex)
        for _ in range(opts.warmup):
            timed_generate(model, request, SHORT)
            timed_generate(model, request, LONG)
        setup_s = time.perf_counter() - t0
        short, long, tpot = [], [], []
        for _ in range(opts.repeats):
            short.append(timed_generate(model, request, SHORT))
            long.append(timed_generate(model, request, LONG))
            tpot.append((long[-1] - short[-1]) / (LONG - SHORT))
        med = statistics.median(tpot)
        row = {"case": name, "tpot_ms": med, "tpot_min": min(tpot), "tpot_max": max(tpot), "tok_s_head": 1e3 / med,
               "t_short_ms": statistics.median(short), "t_long_ms": statistics.median(long), "setup_s": setup_s}
        if opts.ladder:
            got = ladder_tpot(opts.ladder, name)
            if got is None:
                report.note(f"no {name} row in {Path(opts.ladder) / 'headline.csv'}")
            else:
                ratio = med / got[0]
                row.update(ladder_tpot_mean=got[0], ladder_tpot_p50=got[1], outside_ladder=ratio,
                           within="yes" if abs(ratio - 1) <= 0.03 else "NO")
        table.add(**row)
    variants.apply(model, ExecutionConfig())
    report.note(f"total {time.perf_counter() - t_start:.0f} s")
