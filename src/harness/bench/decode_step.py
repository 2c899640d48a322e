"""Batch-1 decode step on the GPU: the best execution's captured step against the fused step
(``execution.decode_step=fused``, ``harness.kernels.decode_step``), with and without programmatic
dependent launch (PDL) and with and without a CUDA graph; MBU against the datasheet; bf16 parity
with the vendor-style step.

    python -m harness bench decode_step                              # ~3 min on an H100 (cold Triton cache)
    python -m harness bench decode_step bench.decode_step.sweep=true bench.decode_step.best=false \\
        bench.decode_step.parity=false                               # tiles of the fused step, ~3 min

The model (``model=``: the full-size reference by default; random weights, seed 0, bf16) is built
once. Rows of the ``steps`` table:

- ``best (graph)``: the decode knobs of the named execution ``best`` (``conf/execution/best.yaml``:
  static cache, grouped MoE with the Triton kernels, fused linears, Triton decode attention,
  torch.compile, CUDA graph; its prefill and vision knobs left at their defaults) through the
  harness (``variants.apply``, the engine's ``StaticDecoder``): its captured step replayed (the
  host-side token copy around it is not included).
- ``best-fused (graph)``: the named execution ``best-fused``'s decode knobs (``decode_step=fused``,
  ``pdl=true`` where the GPU has PDL, no compile) through the same harness path: the ``FusedCore``
  captured in the decoder's graph.
- ``fused [PDL] (graph | eager)``: ``FusedDecodeStep`` (72 launches) built directly, captured in a
  CUDA graph and replayed, or launched from Python every step (eager: the host's launches pace it).

Columns: µs per step (measured): CUDA events around ``reps`` back-to-back steps / reps, the median
of ``rounds`` rounds (min and max beside it); the position is reset to ``pos`` before each round, so
a round covers positions pos..pos+reps-1 of a ``cache_len``-position cache. GB/s (derived): the
step's bytes / µs; MBU (derived): GB/s / the datasheet bandwidth of this GPU
(``harness.roofline.specs``). Bytes (analytic, noted with their parts): every weight the step
reads once (embedding row, 12 x attention, the dense MLP, 11 x (router, the k = 6 routed experts a
token picks, the shared expert), final norm and lm_head; ``FusedDecodeStep.weight_bytes``) plus K/V
of positions 0..pos at the round's mean position; the same bytes for every row (the function's
minimum traffic; activations and scratch, a few hundred KB, are left out).

Then: ``kernels``, the per-kernel table of one replayed step of each captured row (torch.profiler;
with PDL a kernel's interval starts while its predecessor runs, so durations overlap and their sum
exceeds the span), and ``parity``: after a ``prompt``-token random prefill (vendor-style
execution), ``check_steps`` greedy steps of the vendor-style step (eager, the reference) against the
best step and each fused step from the same cache state: tokens equal before the first divergence,
and for the fused steps fed the reference's tokens (teacher forcing), the max |logit difference| and
the steps whose greedy token differs. ``sweep``: one tile of the fused step changed at a time from
the default (``DecodeStepConfig``), each captured and timed (3 rounds), the fastest choice of each
field and a config combining them. ``clock``: the fused step (with PDL where the GPU has it) timed
from inside its kernels, per module and per launch (``decode_step_clock``). ``match`` (a list of ``harness.bench.config.PATH_FACTORS``): only the
``paths`` table instead, the configurations of ``configs`` timed as the direct fused step, with each
factor of the run path, with all of them and through the run path (``decode_step_paths``). A kernel that fails to compile is named (a failure of the bench:
exit status 1) and its rows are skipped; the other rows still run, and what else fails is noted.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
import traceback

import torch

from .decode_step_state import decode_execution, fused_step_state
from .timing import capture_reset, first_line, per_step_us

#: the sweep: (field of DecodeStepConfig, values tried besides the default). The values of the H100
#: sweep behind the defaults (``runs/examples/h100-decode-step-bench/bench_flat.log``, run around
#: the first version's tiles); where one is now the default, the first version's value instead; the
#: router's single-program tiles (a tile of every gate row: no semaphore) and the larger attention and
#: down tiles were added for the H200 (issue 40)
SWEEP = (("qkv", [(2, 4), (8, 4), (4, 4), (4, 8)]),
         ("attention", [(32, 4), (64, 4), (16, 4), (64, 2), (128, 4)]),
         ("o_proj", [(2, 4, 1), (8, 4, 1), (4, 2, 1), (4, 4, 2)]),
         ("router", [(1, 2), (4, 4), (16, 8), (64, 8), (64, 16)]),
         ("gate_up", [(2, 4), (8, 4), (4, 2), (4, 8), (8, 8)]),
         ("down", [(1, 8), (2, 4), (2, 8), (4, 8), (1, 4), (8, 8), (8, 16)]),
         ("dense_gate_up", [(8, 4), (2, 4)]),
         ("dense_down", [(2, 4, 4), (1, 4, 1), (1, 4, 4)]),
         ("lm_head", [(4, 4, 4), (8, 8, 1), (8, 8, 3), (16, 8, 2)]),
         ("gate_up_norm", [True]),
         ("lm_head_stages", [0, 3]))
STEP_COLUMNS = ["step", "us_step", "us_min", "us_max", "gbs", "mbu_sheet"]


def compile_check(step, report) -> bool:
    """Launch each kernel of ``step`` once; a kernel that fails is a failure of the report (each
    named once; the step's state is garbage afterwards: reset it). True when all compiled and ran."""
    from ..kernels import decode_step_triton as kt

    orig, failed = kt._launch, set()

    def guarded(kernel, grid, warps, pdl, *a, **meta):
        name = kernel.fn.__name__ + (" (PDL)" if pdl else "")
        if name in failed:
            return
        try:
            orig(kernel, grid, warps, pdl, *a, **meta)
        except Exception as exc:                      # noqa: BLE001 - named, the others go on
            failed.add(name)
            report.fail(f"kernel {name}: {first_line(exc)}")

    kt._launch = guarded
    try:
        step.run()
        torch.cuda.synchronize()
    finally:
        kt._launch = orig
    return not failed


def kernel_rows(graph, replays: int = 3) -> tuple:
    """(rows [(kernel name, launches, sum of durations µs)] by falling sum, span µs, busy µs (union of
    intervals), kernels) of the last of ``replays`` profiled replays of ``graph``."""
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

    from ..measure.observations import busy_ms

    iv = list(intervals)
    return busy_ms(pd.DataFrame({"start_ms": [a for a, _ in iv], "dur_ms": [b - a for a, b in iv]}))


def harness_decoder(model, execution, length: int, label: str, report):
    """The ``StaticDecoder`` of batch 1 and ``length`` positions of ``model`` run as ``execution``
    through ``variants.apply``; None on failure (noted)."""
    from .. import variants
    from ..knobs import label as knob_label

    try:
        t0 = time.perf_counter()
        variants.apply(model, execution)
        dec = model.static_decoder(1, length)
        report.note(f"{label}: built and captured in {time.perf_counter() - t0:.1f} s ({knob_label(execution)})")
        return dec
    except Exception as exc:                          # noqa: BLE001
        report.note(f"{label} failed: {first_line(exc)}")
        traceback.print_exc(limit=2)
        return None


def mbu(total, us: float, spec) -> dict:
    """{gbs, mbu_sheet} of ``total`` bytes in ``us`` (derived; None where a part is unknown)."""
    gbs = total / (us * 1e-6) / 1e9 if total else None
    return {"gbs": gbs, "mbu_sheet": gbs / spec.mem_bw_gbs if gbs and spec else None}


def run(cfg, opts, device, report) -> None:
    """The bench (module docstring) on ``device`` (CUDA)."""
    import triton

    from ..kernels import decode_step as ds
    from ..kernels import decode_step_triton as kt
    from ..models.build import build_model
    from ..roofline.specs import match_device

    t_start = time.perf_counter()
    name = torch.cuda.get_device_name(device)
    spec = match_device(name)
    sheet = f"datasheet {spec.mem_bw_gbs:.0f} GB/s ({spec.source})" if spec else "unknown device: no datasheet, no MBU"
    pdl_ok, pdl_why = kt.pdl_support(device)
    report.note(f"device {name} ({torch.cuda.get_device_properties(device).multi_processor_count} SMs), torch "
                f"{torch.__version__}, CUDA {torch.version.cuda}, triton {triton.__version__}; {sheet}; "
                f"PDL: {'yes' if pdl_ok else 'no'} ({pdl_why})")
    L = cfg.model.llm
    model = build_model(cfg.model, device, torch.bfloat16, seed=cfg.seed)
    report.note(f"model built in {time.perf_counter() - t_start:.1f} s")
    if opts.match:                                    # only the paths table (``decode_step_paths``)
        from .decode_step_paths import run as paths

        paths(cfg, opts, device, report, model, pdl_ok)
        report.note(f"total {time.perf_counter() - t_start:.0f} s")
        return

    decoders = {}                                     # label -> StaticDecoder (harness path)
    for name in ("best", "best-fused") if opts.best else ("best-fused",):
        decoders[name] = harness_decoder(model, decode_execution(cfg, name, pdl_ok), opts.cache_len, name, report)
    decoders = {k: v for k, v in decoders.items() if v is not None}

    weights, cache, pos, token = fused_step_state(model, opts.cache_len)
    counts = torch.zeros(opts.reps + 8, L.num_layers, L.n_routed_experts, dtype=torch.int64, device=device)
    step_index = torch.zeros(1, dtype=torch.int64, device=device)
    steps = {}

    def reset_fused():
        pos.fill_(opts.pos)
        step_index.zero_()
        token.fill_(1)

    for pdl in [False, True] if pdl_ok else [False]:
        label = "fused PDL" if pdl else "fused"
        try:
            t0 = time.perf_counter()
            step = ds.FusedDecodeStep(weights, cache, pos, token=token, pdl=pdl, counts=(counts, step_index))
            if not compile_check(step, report):
                report.note(f"{label}: kernels failed, its rows are skipped")
                continue
            reset_fused()
            steps[label] = step
            report.note(f"{label}: {step.launches} launches per step, compiled in {time.perf_counter() - t0:.1f} s")
        except Exception as exc:                      # noqa: BLE001
            report.note(f"{label} failed: {first_line(exc)}")
    nbytes = next(iter(steps.values())).weight_bytes() if steps else None
    mean_pos = opts.pos + opts.reps // 2
    total = None
    if nbytes is not None:
        kv = next(iter(steps.values())).kv_bytes(mean_pos)
        total = nbytes["total"] + kv
        report.note("bytes per step (analytic): " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in nbytes.items()
                                                              if k != "total")
                    + f", K/V at position {mean_pos} {kv / 1e6:.2f} MB; total {total / 1e6:.1f} MB")

    table = report.table("steps", f"decode step, positions {opts.pos}..{opts.pos + opts.reps - 1}, {opts.rounds} "
                         f"rounds of {opts.reps}", STEP_COLUMNS)
    timed = []                                        # (label, graph) of the captured rows

    def row(label, fn, reset):
        try:
            us = per_step_us(fn, reset, opts.reps, opts.rounds)
        except Exception as exc:                      # noqa: BLE001
            report.note(f"{label}: timing failed: {first_line(exc)}")
            return
        med = statistics.median(us)
        table.add(step=label, us_step=med, us_min=min(us), us_max=max(us), **mbu(total, med, spec))

    for label, dec in decoders.items():
        def reset_dec(dec=dec):
            dec.cache.position.fill_(opts.pos)
            dec.routing.zero()
        graph = dec.decode_graphs[dec._mode()][0]
        row(f"{label} (graph)", graph.replay, reset_dec)
        timed.append((f"{label} (graph)", graph))
    graphs = {}
    for label, step in steps.items():
        try:
            graphs[label] = capture_reset(step.run, reset_fused)
            row(f"{label} (graph)", graphs[label].replay, reset_fused)
            timed.append((f"{label} (graph)", graphs[label]))
        except Exception as exc:                      # noqa: BLE001
            report.note(f"{label}: CUDA-graph capture or replay failed: {first_line(exc)}")
        if opts.eager:
            row(f"{label} (eager)", step.run, reset_fused)
    kernel_tables(timed, report)
    if opts.clock and steps:
        from .decode_step_clock import run as clocked

        clock_pdl = "fused PDL" in steps
        state = dict(weights=weights, cache=cache, pos=pos, token=token, counts=counts, step_index=step_index,
                     reset=reset_fused)
        try:
            clocked(state, opts, clock_pdl, spec, report, row, kernel_rows,
                    graphs.get("fused PDL" if clock_pdl else "fused"))
        except Exception as exc:                      # noqa: BLE001
            report.note(f"the clocked step failed: {first_line(exc)}")
            traceback.print_exc(limit=3)
    if opts.parity:
        try:
            parity(model, decoders, steps, graphs, opts, cache, pos, token, report)
        except Exception as exc:                      # noqa: BLE001
            report.note(f"parity check failed: {first_line(exc)}")
            traceback.print_exc(limit=3)
    if opts.sweep and steps:
        sweep(weights, cache, pos, token, counts, step_index, reset_fused, opts, pdl_ok, total, spec, report)
    report.note(f"total {time.perf_counter() - t_start:.0f} s")


def kernel_tables(timed: list, report) -> None:
    """The ``spans`` and ``kernels`` tables of one profiled replay of each captured step."""
    spans = report.table("spans", "one replayed step of each captured row (torch.profiler)",
                         ["step", "kernels", "span_us", "busy_us", "us_sum"])
    kernels = report.table("kernels", "kernels of one replayed step (with PDL a kernel starts while its predecessor "
                           "runs: durations overlap, their sum exceeds the span)",
                           ["step", "kernel", "launches", "us_sum", "mean_us"])
    for label, graph in timed:
        rows, span, busy, n = kernel_rows(graph)
        spans.add(step=label, kernels=n, span_us=span, busy_us=busy, us_sum=sum(us for _, _, us in rows))
        for name, count, us in rows:
            kernels.add(step=label, kernel=name, launches=count, us_sum=us, mean_us=us / count)


def parity(model, decoders: dict, steps: dict, graphs: dict, opts, cache, pos, token, report) -> None:
    """Greedy tokens and teacher-forced logits of every step against the vendor-style reference."""
    from .. import variants
    from ..config import ExecutionConfig
    from .decode_step_diag import agreement, prefill_random, reference_greedy, static_cache

    dev, n = cache.k[0].device, opts.check_steps
    variants.apply(model, ExecutionConfig(kv_cache="static"))   # vendor-style modules: the reference function
    model.route_moe(None)                    # (the decoders pointed the MoE layers at their device counts)
    ref_cache = static_cache(model.cfg.llm, opts.cache_len, cache.k[0].dtype, dev)
    first = prefill_random(model, ref_cache, opts.prompt)
    state = [t.clone() for t in ref_cache.k + ref_cache.v + [ref_cache.position]]

    def restore(target_k, target_v, target_pos):
        for dst, src in zip(list(target_k) + list(target_v) + [target_pos], state):
            dst.copy_(src)

    ref_tokens, ref_logits = reference_greedy(model, ref_cache, first, n)
    feed = [int(first)] + ref_tokens[:-1]
    scale = max(float(t.abs().max()) for t in ref_logits)
    table = report.table("parity", f"bf16 parity against the vendor-style step: prompt {opts.prompt} random tokens, "
                         f"{n} greedy steps", ["step", "greedy_prefix", "greedy_equal", "logit_diff", "logit_max",
                                               "forced_flips"])

    def forced(run_one, logits) -> dict:
        worst, flips = 0.0, 0
        for i in range(n):
            got = run_one(feed[i])
            worst = max(worst, float((logits().float() - ref_logits[i]).abs().max()))
            flips += got != ref_tokens[i]
        return {"logit_diff": worst, "logit_max": scale, "forced_flips": flips}

    def greedy_cells(tokens) -> dict:
        same, equal = agreement(tokens, ref_tokens)
        return {"greedy_prefix": same, "greedy_equal": equal}

    for label, dec in decoders.items():
        restore(dec.cache.k, dec.cache.v, dec.cache.position)
        dec.cache.length = opts.prompt
        tok, tokens = first, []
        for _ in range(n):
            tok = dec.step(tok)
            tokens.append(int(tok))
        cells = greedy_cells(tokens)
        core = getattr(dec, "core", None)
        if hasattr(core, "step"):                    # the fused step: its logits buffer is readable
            restore(dec.cache.k, dec.cache.v, dec.cache.position)
            dec.cache.length = opts.prompt
            cells.update(forced(lambda t: int(dec.step(torch.tensor([[t]], device=dev))), lambda: core.step.logits))
        table.add(step=f"{label} (graph)", **cells)
    for label, step in steps.items():
        run_step = graphs[label].replay if label in graphs else step.run
        restore(cache.k, cache.v, pos)
        token.fill_(int(first))
        tokens = []
        for _ in range(n):
            run_step()
            tokens.append(int(token))
        restore(cache.k, cache.v, pos)

        def one(t, run_step=run_step):
            token.fill_(t)
            run_step()
            return int(token)
        table.add(step=label + (" (graph)" if label in graphs else " (eager)"), **greedy_cells(tokens),
                  **forced(one, lambda step=step: step.logits))


def sweep(weights, cache, pos, token, counts, step_index, reset, opts, pdl: bool, total, spec, report) -> None:
    """One field of ``DecodeStepConfig`` changed at a time from the default; each fused step captured
    and timed (3 rounds); the fastest value of each field and a config combining them."""
    from ..kernels import decode_step as ds

    base = ds.DecodeStepConfig()
    table = report.table("sweep", f"tiles of the fused step ({'PDL, ' if pdl else ''}graph, 3 rounds of {opts.reps}; "
                         f"one field changed from {base})", ["change", "us_step", "delta_us", "gbs", "mbu_sheet"])

    def time_config(config) -> float:
        step = ds.FusedDecodeStep(weights, cache, pos, token=token, pdl=pdl, counts=(counts, step_index),
                                  config=config)
        graph = capture_reset(step.run, reset)
        return statistics.median(per_step_us(graph.replay, reset, opts.reps, 3))

    try:
        default = time_config(base)
    except Exception as exc:                          # noqa: BLE001
        report.note(f"sweep: the default failed: {first_line(exc)}")
        return
    table.add(change="default", us_step=default, **mbu(total, default, spec))
    best = {}
    for field, values in SWEEP:
        if opts.only and field not in opts.only:
            continue
        best[field] = (getattr(base, field), default)
        for v in values:
            label = f"{field}={v}"
            try:
                us = time_config(dataclasses.replace(base, **{field: v}))
            except Exception as exc:                  # noqa: BLE001 - a tile that does not compile: named, go on
                report.note(f"sweep: {label} failed: {first_line(exc)}")
                continue
            table.add(change=label, us_step=us, delta_us=us - default, **mbu(total, us, spec))
            if us < best[field][1]:
                best[field] = (v, us)
    picks = {f: v for f, (v, _) in best.items() if v != getattr(base, f)}
    if not picks:
        report.note("sweep: the default is the fastest of every field")
        return
    try:
        us = time_config(dataclasses.replace(base, **picks))
        table.add(change=f"combined {picks}", us_step=us, delta_us=us - default, **mbu(total, us, spec))
    except Exception as exc:                          # noqa: BLE001
        report.note(f"sweep: combined {picks} failed: {first_line(exc)}")
