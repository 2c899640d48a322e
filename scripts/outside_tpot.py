"""TPOT from outside the harness's timers: ``generate()`` of 2 and of 130 tokens, wall clock.

    python scripts/outside_tpot.py                                        # best and best-fused, ~2 min on an H100
    python scripts/outside_tpot.py --cases best-fused --ladder runs/<optimize run>   # beside the ladder's TPOT

For each case of ``conf/experiment/optimize.yaml`` named in ``--cases``, the reference model (random
weights, seed 0, bf16, built once) runs that case's execution (``variants.apply``) on one synthetic
page of the ladder's mode (base) under the case's routing (``routing``: the weights' own, or
balanced), and ``generate()`` of 2 tokens (vision, prefill, 1 decode step) and of 130 tokens
(vision, prefill, 129 decode steps) run back to back, each between ``torch.cuda.synchronize()``
calls and timed with ``time.perf_counter``; ``--repeats`` pairs after ``--warmup`` pairs (the first
builds and captures the decoder). TPOT of a pair = (t130 - t2) / 128: the 128 extra decode steps,
everything else (vision, prefill, the result's routing read-back) in both. Printed (measured): the
median TPOT over the pairs with its min-max, the medians of t2 and t130, tok/s = 1000 / TPOT; with
``--ladder RUN_DIR``, the ladder's ``tpot_mean_ms`` and ``tpot_p50_ms`` of the same case
(``headline.csv``: CUDA events around each decode step, median request) and the ratio outside /
ladder mean (issue 24 asks for it within 3%).

Both requests get the same static cache (``static_cache_len`` = prompt + 130 rounded up to 64, as
the ladder's 128-token request rounds), so they run one decoder. ``vision_compile`` is turned off
unless ``--as-ladder``: vision runs the same in both requests and cancels out of the difference,
while compiling it would add minutes. Needs CUDA.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

SHORT, LONG = 2, 130


def ladder_cases() -> dict:
    """{case name: its case entry (a plain dict without unset fields; a named execution's knobs resolved)}
    of the optimize ladder as the CLI composes it (``+experiment=optimize``)."""
    from harness.cli import check_overrides
    from harness.config import to_dict

    def given(d: dict) -> dict:
        return {k: given(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}

    return {c.name: given(to_dict(c)) for c in check_overrides(["+experiment=optimize"], verb="analyze").cases}


def ladder_tpot(run_dir: Path, case: str):
    """(tpot_mean_ms, tpot_p50_ms) of ``case`` in a run's headline.csv, or None."""
    import pandas as pd

    path = run_dir / "headline.csv"
    if not path.exists():
        return None
    head = pd.read_csv(path)
    row = head[head["case"] == case]
    if row.empty:
        return None
    return float(row["tpot_mean_ms"].iloc[0]), float(row["tpot_p50_ms"].iloc[0])


def timed_generate(model, request, tokens: int) -> float:
    """Wall-clock ms of one ``generate`` of ``tokens`` tokens, between device synchronisations."""
    from harness.models.generate import generate

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    generate(model, request, max_new_tokens=tokens)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["best", "best-fused"], help="optimize.yaml cases")
    ap.add_argument("--repeats", type=int, default=7, help="timed (2, 130) pairs per case")
    ap.add_argument("--warmup", type=int, default=2, help="untimed pairs first (set-up, capture)")
    ap.add_argument("--ladder", type=Path, default=None, help="an optimize run directory (its headline.csv)")
    ap.add_argument("--as-ladder", action="store_true", help="keep the case's vision_compile")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("outside_tpot: no CUDA device; this measurement needs a GPU", file=sys.stderr)
        return 1
    from harness import variants
    from harness import workload as wl
    from harness.config import ExecutionConfig, ModelConfig, WorkloadConfig
    from harness.setup import synthetic_pages
    from harness.models.build import build_model

    t_start = time.perf_counter()
    cases = ladder_cases()
    unknown = [c for c in args.cases if c not in cases]
    if unknown:
        print(f"outside_tpot: no case {unknown} in optimize.yaml (cases: {', '.join(cases)})", file=sys.stderr)
        return 2
    dev, dt = torch.device("cuda"), torch.bfloat16
    model = build_model(ModelConfig(), dev, dt, seed=0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; model built in "
          f"{time.perf_counter() - t_start:.0f} s")
    out = []
    for name in args.cases:
        case = cases[name]
        if case.get("batch", 1) != 1:
            print(f"{name}: batch {case['batch']} (this script times batch 1): skipped")
            continue
        mode = case.get("mode", "base")
        pages = synthetic_pages(WorkloadConfig(), 0)                  # the ladder's first request's page
        request = wl.build_request(pages, mode, decode_tokens=LONG, routing=case.get("routing", "weights"),
                                   routing_seed=case.get("routing_seed", 0)).to(dev, dt)
        ex = ExecutionConfig(**case.get("execution", {}))
        if ex.kv_cache == "static":
            ex = dataclasses.replace(ex, static_cache_len=ex.cache_len(request.prefill_tokens, LONG))
        if not args.as_ladder:
            ex = dataclasses.replace(ex, vision_compile=False)
        t0 = time.perf_counter()
        variants.apply(model, ex)
        for _ in range(args.warmup):
            timed_generate(model, request, SHORT)
            timed_generate(model, request, LONG)
        setup_s = time.perf_counter() - t0
        short, long, tpot = [], [], []
        for _ in range(args.repeats):
            short.append(timed_generate(model, request, SHORT))
            long.append(timed_generate(model, request, LONG))
            tpot.append((long[-1] - short[-1]) / (LONG - SHORT))
        med = statistics.median(tpot)
        line = (f"{name:12s} TPOT {med:.4f} ms [{min(tpot):.4f}-{max(tpot):.4f}] over {args.repeats} pairs "
                f"({1e3 / med:.0f} tok/s); t2 {statistics.median(short):.2f} ms, t130 {statistics.median(long):.2f} ms "
                f"(medians); set-up and warm-up {setup_s:.0f} s")
        if args.ladder is not None:
            got = ladder_tpot(args.ladder, name)
            if got is None:
                line += f"; no {name} row in {args.ladder / 'headline.csv'}"
            else:
                mean, p50 = got
                ratio = med / mean
                line += (f"; ladder TPOT mean {mean:.4f} ms, p50 {p50:.4f} ms; outside / ladder mean {ratio:.3f} "
                         f"({'within' if abs(ratio - 1) <= 0.03 else 'NOT within'} 3%)")
        print(line)
        out.append((name, med))
    variants.apply(model, ExecutionConfig())
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
