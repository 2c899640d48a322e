"""Batch-1 decode step on the GPU: the best execution's captured step against the fused step
(``execution.decode_step=fused``, ``harness.kernels.decode_step``), with and without programmatic
dependent launch (PDL) and with and without a CUDA graph; MBU against the datasheet; bf16 parity
with the vendor-style step.

    python scripts/bench_decode_step.py                               # ~3 min on an H100 (cold Triton cache)
    python scripts/bench_decode_step.py --sweep --no-best --no-parity # tiles of the fused step, ~3 min

The full-size reference model (random weights, seed 0, bf16) is built once. Rows of the step table:

- ``best (graph)``: the ladder's ``best`` decode knobs (static cache, grouped MoE with the Triton
  kernels, fused linears, Triton decode attention, torch.compile, CUDA graph) through the harness
  (``variants.apply``, the engine's ``StaticDecoder``): its captured step replayed (the host-side
  token copy around it is not included).
- ``best-fused (graph)``: the ladder's ``best-fused`` knobs (``decode_step=fused``, ``pdl=true``
  where the GPU has PDL, no compile) through the same harness path: the ``FusedCore`` captured in
  the decoder's graph.
- ``fused [PDL] (graph | eager)``: ``FusedDecodeStep`` (72 launches) built directly, captured in a
  CUDA graph and replayed, or launched from Python every step (eager: the host's launches pace it).

Columns: ``us/step`` (measured): CUDA events around ``--reps`` back-to-back steps / reps, the median
of ``--rounds`` rounds (min-max beside it); the position is reset to ``--pos`` before each round, so
a round covers positions pos..pos+reps-1 of a ``--len``-position cache. ``GB/s`` (derived): the
step's bytes / us; ``MBU`` (derived): GB/s / the datasheet bandwidth of this GPU
(``harness.roofline.specs``). Bytes (analytic, printed with their parts): every weight the step
reads once (embedding row, 12 x attention, the dense MLP, 11 x (router, the k = 6 routed experts a
token picks, the shared expert), final norm and lm_head; ``FusedDecodeStep.weight_bytes``) plus K/V
of positions 0..pos at the round's mean position; the same bytes for every row (the function's
minimum traffic; activations and scratch, a few hundred KB, are left out).

Then: the per-kernel table of one replayed step of each captured row (torch.profiler; with PDL a
kernel's interval starts while its predecessor runs, so durations overlap and their sum exceeds the
span), and the parity check: after a ``--prompt``-token random prefill (vendor-style execution),
``--check-steps`` greedy steps of the vendor-style step (eager, the reference) against the best
step and each fused step from the same cache state: tokens equal before the first divergence, and
for the fused steps fed the reference's tokens (teacher forcing), the max |logit difference| and
the steps whose greedy token differs. ``--sweep``: one tile of the fused step changed at a time
from the default (``DecodeStepConfig``), each captured and timed (3 rounds), the fastest choice of
each field and a config line combining them. A kernel that fails to compile is named and its rows
are skipped; the other rows still run. Needs CUDA (without it: a message and exit status 1).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fast_moe import capture as capture_after_warmup  # noqa: E402

from harness.config import ExecutionConfig, ModelConfig  # noqa: E402

BEST = dict(kv_cache="static", moe_impl="grouped", moe_kernel="triton", cuda_graphs="decode", compile=True,
            linear_impl="fused", decode_attention="triton")
BEST_FUSED = dict(BEST, compile=False, decode_step="fused")

#: the sweep: (field of DecodeStepConfig, values tried besides the default). The values of the H100
#: sweep behind the defaults (``runs/examples/h100-decode-step-bench/bench_flat.log``, run around
#: the first version's tiles); where one is now the default, the first version's value instead
SWEEP = (("qkv", [(2, 4), (8, 4), (4, 4), (4, 8)]),
         ("attention", [(32, 4), (64, 4), (16, 4)]),
         ("o_proj", [(2, 4, 1), (8, 4, 1), (4, 2, 1), (4, 4, 2)]),
         ("router", [(1, 1), (1, 2), (4, 4)]),
         ("gate_up", [(2, 4), (8, 4), (4, 2), (4, 8), (8, 8)]),
         ("down", [(1, 8), (2, 4), (2, 8), (4, 4), (1, 4)]),
         ("dense_gate_up", [(8, 4), (2, 4)]),
         ("dense_down", [(2, 4, 4), (1, 4, 1), (1, 4, 4)]),
         ("lm_head", [(4, 4, 4), (8, 8, 1), (8, 8, 3), (16, 8, 2)]),
         ("gate_up_norm", [True]),
         ("lm_head_stages", [0, 3]))


def fused_step_state(model, length: int, token_id: int = 0) -> tuple:
    """What ``FusedDecodeStep`` reads besides its config: (weights, a static cache of one sequence and
    ``length`` positions, the position (int64 [1], 0), the token (int64 [1], ``token_id``)), on the
    model's device in its dtype."""
    from harness.variants.fused_step import weights_from_model
    from harness.variants.static_kv import StaticKVCache

    L, p = model.cfg.llm, next(model.parameters())
    cache = StaticKVCache(L.num_layers, 1, L.num_kv_heads, length, L.head_dim, p.dtype, p.device,
                          query_heads=L.num_heads)
    pos = torch.zeros(1, dtype=torch.int64, device=p.device)
    token = torch.full((1,), token_id, dtype=torch.int64, device=p.device)
    return weights_from_model(model), cache, pos, token


def per_step_us(fn, reset, reps: int, rounds: int) -> list:
    """us per step of ``fn`` over ``reps`` back-to-back calls, one value per round."""
    out = []
    for _ in range(rounds):
        reset()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / reps)
    return out


def capture(run, reset) -> torch.cuda.CUDAGraph:
    """``run`` captured (``bench_fast_moe.capture``: warm-up calls on a side stream first), the
    step's state reset afterwards (the warm-up advanced it)."""
    graph, _ = capture_after_warmup(run)
    torch.cuda.synchronize()
    reset()
    return graph


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"[:300]


def compile_check(step, failures: dict) -> bool:
    """Launch each kernel of ``step`` once, naming the ones that fail (the step's state is garbage
    afterwards: reset it). True when all compiled and ran."""
    from harness.kernels import decode_step_triton as kt

    orig = kt._launch

    def guarded(kernel, grid, warps, pdl, *a, **meta):
        name = kernel.fn.__name__ + (" (PDL)" if pdl else "")
        if name in failures:
            return
        try:
            orig(kernel, grid, warps, pdl, *a, **meta)
        except Exception as exc:                      # noqa: BLE001 - reported, the others go on
            failures[name] = first_line(exc)

    before = len(failures)
    kt._launch = guarded
    try:
        step.run()
        torch.cuda.synchronize()
    finally:
        kt._launch = orig
    return len(failures) == before


def kernel_table(graph, replays: int = 3) -> list:
    """(rows [(kernel name, launches, sum of durations us)], span us, busy us (union of intervals),
    kernels) of the last of ``replays`` profiled replays of ``graph``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
            time.sleep(0.002)
    ev = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    groups, cur = [], []
    for e in ev:                                      # replays are separated by the host's sleeps
        if cur and e.time_range.start - max(c.time_range.end for c in cur) > 500:
            groups.append(cur)
            cur = []
        cur.append(e)
    if cur:
        groups.append(cur)
    last = groups[-1] if groups else []
    rows: dict = {}
    for e in last:
        r = rows.setdefault(e.name, [0, 0.0])
        r[0] += 1
        r[1] += e.time_range.end - e.time_range.start
    span = (max(e.time_range.end for e in last) - min(e.time_range.start for e in last)) if last else 0.0
    busy = union_us([(e.time_range.start, e.time_range.end) for e in last])
    return sorted(((n, c, us) for n, (c, us) in rows.items()), key=lambda r: -r[2]), span, busy, len(last)


def union_us(intervals) -> float:
    """Length of the union of (start, end) intervals, in their unit (``measure.observations.busy_ms``)."""
    import pandas as pd

    from harness.measure.observations import busy_ms

    iv = list(intervals)
    return busy_ms(pd.DataFrame({"start_ms": [a for a, _ in iv], "dur_ms": [b - a for a, b in iv]}))


def print_kernels(label: str, table) -> None:
    rows, span, busy, n = table
    total = sum(us for _, _, us in rows)
    print(f"\n{label}: {n} kernels, span {span:.1f} us, busy (union) {busy:.1f} us, sum of durations {total:.1f} us"
          f"{' (> span: overlapping kernels, PDL)' if total > span * 1.001 else ''}")
    print(f"  {'kernel':58s} {'launches':>8s} {'us sum':>9s} {'us mean':>8s}")
    for name, count, us in rows[:18]:
        print(f"  {name[:58]:58s} {count:8d} {us:9.1f} {us / count:8.2f}")
    if len(rows) > 18:
        rest = rows[18:]
        print(f"  {'(' + str(len(rest)) + ' more names)':58s} {sum(c for _, c, _ in rest):8d} "
              f"{sum(u for _, _, u in rest):9.1f}")


def harness_decoder(model, knobs: dict, length: int, label: str):
    """(the ``StaticDecoder`` of batch 1 and ``length`` positions, seconds to build it) of ``model``
    run as ``knobs`` through ``variants.apply``; None on failure (reported)."""
    from harness import variants

    try:
        t0 = time.perf_counter()
        variants.apply(model, ExecutionConfig(**knobs))
        dec = model.static_decoder(1, length)
        print(f"{label}: built and captured in {time.perf_counter() - t0:.1f} s "
              f"({variants.label(ExecutionConfig(**knobs))})")
        return dec
    except Exception as exc:                          # noqa: BLE001
        print(f"{label} failed: {first_line(exc)}")
        traceback.print_exc(limit=2)
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--len", type=int, default=512, help="static cache positions")
    ap.add_argument("--pos", type=int, default=286, help="first position of each timed round (base page prompt)")
    ap.add_argument("--reps", type=int, default=200, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (the median is reported)")
    ap.add_argument("--prompt", type=int, default=286, help="prefill tokens before the parity check")
    ap.add_argument("--check-steps", type=int, default=64, help="greedy steps of the parity check")
    ap.add_argument("--no-best", action="store_true", help="skip the best execution (its compile takes ~40 s)")
    ap.add_argument("--no-parity", action="store_true", help="skip the parity check")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager (uncaptured) fused rows")
    ap.add_argument("--sweep", action="store_true", help="also time alternative tiles of the fused step")
    ap.add_argument("--only", nargs="+", default=None, metavar="FIELD",
                    help="with --sweep: only these fields of DecodeStepConfig")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode_step: no CUDA device; this benchmark needs a GPU", file=sys.stderr)
        return 1
    if args.pos + args.reps > args.len or args.prompt + args.check_steps > args.len:
        print(f"bench_decode_step: --len {args.len} must hold --pos + --reps and --prompt + --check-steps",
              file=sys.stderr)
        return 2
    import triton

    from harness.kernels import decode_step as ds
    from harness.kernels import decode_step_triton as kt
    from harness.models.build import build_model
    from harness.roofline.specs import match_device

    t_start = time.perf_counter()
    dev, dt = torch.device("cuda"), torch.bfloat16
    name = torch.cuda.get_device_name()
    spec = match_device(name)
    sheet = f"datasheet {spec.mem_bw_gbs:.0f} GB/s ({spec.source})" if spec else "unknown device: no datasheet, no MBU"
    print(f"device {name} ({torch.cuda.get_device_properties(dev).multi_processor_count} SMs), torch "
          f"{torch.__version__}, CUDA {torch.version.cuda}, triton {triton.__version__}; {sheet}")
    pdl_ok, pdl_why = kt.pdl_support(dev)
    print(f"PDL: {'yes' if pdl_ok else 'no'} ({pdl_why})")
    cfg = ModelConfig()
    L = cfg.llm
    model = build_model(cfg, dev, dt, seed=0)
    print(f"model built in {time.perf_counter() - t_start:.1f} s")

    results, tables, failures = [], {}, {}
    decoders = {}                                     # label -> StaticDecoder (harness path)
    if not args.no_best:
        decoders["best"] = harness_decoder(model, BEST, args.len, "best")
    decoders["best-fused"] = harness_decoder(model, dict(BEST_FUSED, pdl=pdl_ok), args.len, "best-fused")
    decoders = {k: v for k, v in decoders.items() if v is not None}

    # ------------------------------------------------------------------------- fused steps
    weights, cache, pos, token = fused_step_state(model, args.len)
    counts = torch.zeros(args.reps + 8, L.num_layers, L.n_routed_experts, dtype=torch.int64, device=dev)
    step_index = torch.zeros(1, dtype=torch.int64, device=dev)
    steps = {}

    def reset_fused():
        pos.fill_(args.pos)
        step_index.zero_()
        token.fill_(1)

    for pdl in [False, True] if pdl_ok else [False]:
        label = "fused PDL" if pdl else "fused"
        try:
            t0 = time.perf_counter()
            step = ds.FusedDecodeStep(weights, cache, pos, token=token, pdl=pdl, counts=(counts, step_index))
            if not compile_check(step, failures):
                print(f"{label}: kernels failed, its rows are skipped")
                continue
            reset_fused()
            steps[label] = step
            print(f"{label}: {step.launches} launches per step, compiled in {time.perf_counter() - t0:.1f} s")
        except Exception as exc:                      # noqa: BLE001
            print(f"{label} failed: {first_line(exc)}")
    nbytes = next(iter(steps.values())).weight_bytes() if steps else None

    # ------------------------------------------------------------------------------ timing
    def row(label, fn, reset):
        try:
            us = per_step_us(fn, reset, args.reps, args.rounds)
            results.append((label, statistics.median(us), min(us), max(us)))
        except Exception as exc:                      # noqa: BLE001
            print(f"{label}: timing failed: {first_line(exc)}")

    for label, dec in decoders.items():
        def reset_dec(dec=dec):
            dec.cache.position.fill_(args.pos)
            dec.routing.zero()
        graph = dec.decode_graphs[dec._mode()][0]
        row(f"{label} (graph)", graph.replay, reset_dec)
        tables[f"{label} (graph)"] = kernel_table(graph)
    graphs = {}
    for label, step in steps.items():
        try:
            graphs[label] = capture(step.run, reset_fused)
            row(f"{label} (graph)", graphs[label].replay, reset_fused)
            tables[f"{label} (graph)"] = kernel_table(graphs[label])
        except Exception as exc:                      # noqa: BLE001
            print(f"{label}: CUDA-graph capture or replay failed: {first_line(exc)}")
        if not args.no_eager:
            row(f"{label} (eager)", step.run, reset_fused)

    mean_pos = args.pos + args.reps // 2
    total = None
    if nbytes is not None:
        kv = next(iter(steps.values())).kv_bytes(mean_pos)
        total = nbytes["total"] + kv
        print("\nbytes per step (analytic): " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in nbytes.items()
                                                        if k != "total")
              + f", K/V at position {mean_pos} {kv / 1e6:.2f} MB; total {total / 1e6:.1f} MB")
    print(f"\n{'step':22s} {'us/step':>9s} {'min-max':>15s} {'GB/s':>7s} {'MBU':>7s}   (position {args.pos}.."
          f"{args.pos + args.reps - 1}, {args.rounds} rounds of {args.reps})")
    for label, med, lo, hi in results:
        print(f"{label:22s} {med:9.1f} {lo:7.1f}-{hi:<7.1f} " + mbu_text(total, med, spec))
    for label, table in tables.items():
        print_kernels(label, table)

    # ------------------------------------------------------------------------ parity check
    if not args.no_parity:
        try:
            parity(model, decoders, steps, graphs, args, cache, pos, token)
        except Exception as exc:                      # noqa: BLE001
            print(f"parity check failed: {first_line(exc)}")
            traceback.print_exc(limit=3)
    if args.sweep and steps:
        sweep(weights, cache, pos, token, counts, step_index, reset_fused, args, pdl_ok, total, spec)
    for name, why in failures.items():
        print(f"FAILED kernel {name}: {why}")
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    return 1 if failures else 0


def mbu_text(total, us: float, spec) -> str:
    """'GB/s MBU' of ``total`` bytes in ``us`` (derived), 'BUG>100%' for an impossible share."""
    gbs = total / (us * 1e-6) / 1e9 if total else None
    mbu = gbs / spec.mem_bw_gbs if gbs and spec else None
    mbu_txt = ("BUG>100%" if mbu > 1 else f"{mbu:.1%}") if mbu is not None else "n/a"
    return f"{gbs or 0:7.0f} {mbu_txt:>7s}"


def parity(model, decoders: dict, steps: dict, graphs: dict, args, cache, pos, token) -> None:
    """Greedy tokens and teacher-forced logits of every step against the vendor-style reference."""
    from diag_decode_step import agreement as agree, prefill_random, reference_greedy, static_cache
    from harness import variants

    dev, n = cache.k[0].device, args.check_steps
    variants.apply(model, ExecutionConfig(kv_cache="static"))   # vendor-style modules: the reference function
    model.route_moe(None)                    # (the decoders pointed the MoE layers at their device counts)
    ref_cache = static_cache(model.cfg.llm, args.len, cache.k[0].dtype, dev)
    first = prefill_random(model, ref_cache, args.prompt)
    state = [t.clone() for t in ref_cache.k + ref_cache.v + [ref_cache.position]]

    def restore(target_k, target_v, target_pos):
        for dst, src in zip(list(target_k) + list(target_v) + [target_pos], state):
            dst.copy_(src)

    ref_tokens, ref_logits = reference_greedy(model, ref_cache, first, n)
    feed = [int(first)] + ref_tokens[:-1]
    scale = max(float(t.abs().max()) for t in ref_logits)

    def agreement(tokens) -> str:
        same, equal = agree(tokens, ref_tokens)
        return f"{same} of {n} greedy tokens equal before the first divergence, {equal} equal in all"

    def forced(run, logits, set_token) -> str:
        worst, flips = 0.0, 0
        for i in range(n):
            got = run(feed[i], set_token)
            worst = max(worst, float((logits().float() - ref_logits[i]).abs().max()))
            flips += got != ref_tokens[i]
        return (f"teacher-forced: max |logit diff| {worst:.4g} (largest |logit| {scale:.4g}), greedy token differs "
                f"at {flips} of {n} steps")

    print(f"\nparity (bf16) against the vendor-style step, prompt {args.prompt} random tokens, {n} steps:")
    for label, dec in decoders.items():
        restore(dec.cache.k, dec.cache.v, dec.cache.position)
        dec.cache.length = args.prompt
        tok, tokens = first, []
        for _ in range(n):
            tok = dec.step(tok)
            tokens.append(int(tok))
        line = f"  {label + ' (graph)':22s} {agreement(tokens)}"
        core = getattr(dec, "core", None)
        if hasattr(core, "step"):                    # the fused step: its logits buffer is readable
            restore(dec.cache.k, dec.cache.v, dec.cache.position)
            dec.cache.length = args.prompt
            line += "; " + forced(lambda t, _: int(dec.step(torch.tensor([[t]], device=dev))), lambda: core.step.logits,
                                  None)
        print(line)
    for label, step in steps.items():
        run = graphs[label].replay if label in graphs else step.run
        restore(cache.k, cache.v, pos)
        token.fill_(int(first))
        tokens = []
        for _ in range(n):
            run()
            tokens.append(int(token))
        restore(cache.k, cache.v, pos)

        def one(t, _, run=run):
            token.fill_(t)
            run()
            return int(token)
        print(f"  {label + (' (graph)' if label in graphs else ' (eager)'):22s} {agreement(tokens)}; "
              + forced(one, lambda step=step: step.logits, None))


def sweep(weights, cache, pos, token, counts, step_index, reset, args, pdl: bool, total, spec) -> None:
    """One field of ``DecodeStepConfig`` changed at a time from the default; each fused step captured
    and timed (3 rounds); the fastest value of each field and a config combining them."""
    from harness.kernels import decode_step as ds

    base = ds.DecodeStepConfig()
    print(f"\nsweep ({'PDL, ' if pdl else ''}graph, 3 rounds of {args.reps}; one field changed from {base}):")
    timed = {}

    def time_config(config) -> float:
        step = ds.FusedDecodeStep(weights, cache, pos, token=token, pdl=pdl, counts=(counts, step_index),
                                  config=config)
        graph = capture(step.run, reset)
        return statistics.median(per_step_us(graph.replay, reset, args.reps, 3))

    try:
        timed["default"] = time_config(base)
    except Exception as exc:                          # noqa: BLE001
        print(f"  default failed: {first_line(exc)}")
        return
    print(f"  {'default':34s} {timed['default']:8.1f} us  " + mbu_text(total, timed["default"], spec))
    best = {}
    for field, values in SWEEP:
        if args.only and field not in args.only:
            continue
        best[field] = (getattr(base, field), timed["default"])
        for v in values:
            label = f"{field}={v}"
            try:
                us = time_config(dataclasses.replace(base, **{field: v}))
            except Exception as exc:                  # noqa: BLE001
                print(f"  {label:34s} failed: {first_line(exc)}")
                continue
            print(f"  {label:34s} {us:8.1f} us  ({us - timed['default']:+.1f})  " + mbu_text(total, us, spec))
            if us < best[field][1]:
                best[field] = (v, us)
    picks = {f: v for f, (v, _) in best.items() if v != getattr(base, f)}
    if picks:
        combined = dataclasses.replace(base, **picks)
        try:
            us = time_config(combined)
            print(f"  combined {picks}: {us:.1f} us  " + mbu_text(total, us, spec))
        except Exception as exc:                      # noqa: BLE001
            print(f"  combined {picks} failed: {first_line(exc)}")
    else:
        print("  the default is the fastest of every field")


if __name__ == "__main__":
    sys.exit(main())
