"""Why the bench and the run path rank two fused-step configurations in opposite orders (issue 40).

    python -m harness bench decode_step bench.decode_step.match=[cache_len,positions,prompt,history,buffers,events]

``bench.decode_step.match`` (``harness.bench.config.PATH_FACTORS``) replaces the bench's tables with
one: each configuration of ``bench.decode_step.configs`` (``DecodeStepConfig`` changes, ``''`` the
defaults) timed as the bench's ``fused [PDL] (graph)`` row times it (``direct``), then with one
factor of the run path (``harness run``'s decode, the ladder's ``best-fused`` row) at a time, then
with all of them (``all``); and as the bench's ``best-fused (graph)`` row times the harness path
(``harness``) and through the run path itself (``run``), timed right after ``direct`` (a run cut short
keeps the disagreement itself). A factor changes the direct step to do as the run path does:

- ``cache_len``: the static cache has the request's length (prompt + ``workload.decode_tokens``
  rounded up to 64: 448 positions for the base page, against the bench's 512), so the attention
  launches that many splits;
- ``positions``: each round starts at the request's prompt length and runs its decode steps
  (``decode_tokens`` - 1), against ``pos`` .. ``pos + reps - 1``;
- ``prompt`` (implies ``positions``): the cache holds the request's own prefill (the run path's
  prefill of the ladder's first page, copied from its decoder) and each round starts from its first
  token, so the steps decode the request's tokens and route as it routes; without it the cache
  holds zeros and each round starts from token 1;
- ``history``: the step also keeps each token in a history buffer (as ``FusedCore``);
- ``buffers`` (implies ``cache_len`` and ``history``): the step runs on the run decoder's own
  buffers (cache, position, token buffer, routing counts and step index, history) instead of
  buffers of its own (the counts buffer is counted into in both);
- ``events``: each replay between its own CUDA events, with the stage recorder's host work between
  replays (NVTX range, events: ``measure.recorder.StageRecorder``), the median of the per-step spans
  (the ladder's TPOT p50), against one event pair around the round's back-to-back replays.

``harness``: the bench's other row, on a decoder of its own per configuration built through the
harness (``Engine.static_decoder`` of the bench's cache length, its ``FusedCore`` captured after the
decoder's warm-ups at positions 0..3: cache K/V zero elsewhere), replayed from ``pos`` with the
routing counts zeroed and the token carried over between rounds (not reset: each round decodes
other tokens, so routes otherwise); its buffers are the decoder's, with a token history.

``run``: ``generate()`` of the request through ``variants.apply`` (``best-fused``'s decode knobs,
vision not compiled), the decoder's ``FusedCore`` built with the configuration, the TPOT p50 of the
request's ``decode_step`` ranges: the ladder's measurement of one request. What every row shares
with the run path: the same weights, counted routing (the weights' routing), PDL where the GPU has
it, a CUDA graph of the 72 launches captured after 3 warm-up steps. Within each row the
configurations' rounds alternate (A, B, A, B, ...), so the GPU's clock drifts over both alike.

Table ``paths`` (µs per step, measured: the median of the rounds, min and max): ``difference``
(derived) = this configuration's time - the first configuration's in the same row; ``note`` names
the fastest. Then a note per configuration after the first: faster or slower than the first under
``direct``, and the rows under which that order reverses (compare the difference with the rounds'
spread before reading a reversal as a factor).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import NamedTuple

import torch

from .timing import capture_reset, per_step_us

COLUMNS = ["method", "change", "us_step", "us_min", "us_max", "delta_us", "note"]


class RunState(NamedTuple):
    """The run path's request as the factors need it: ``dec`` (the ``StaticDecoder`` that ran it),
    ``prompt`` (its prefill tokens = the first decode position), ``first`` (its first token),
    ``steps`` (its decode steps), ``kv`` (K and V of positions 0..prompt-1 of every layer)."""
    dec: object
    prompt: int
    first: int
    steps: int
    kv: list


class FactorStep(NamedTuple):
    """A fused step set up for one row: ``step`` (``FusedDecodeStep``), ``reset()`` (position, step
    index and token back to the round's start), ``start`` (first position), ``reps`` (steps per round)."""
    step: object
    reset: object
    start: int
    reps: int


def run_state(model, request, execution) -> RunState:
    """Run ``request`` once (``generate()`` of 2 tokens: vision, prefill, one step) through
    ``execution`` applied to ``model``; its decoder and what the factors copy from it."""
    from .. import variants
    from ..models.generate import generate

    variants.apply(model, execution)
    res = generate(model, request, max_new_tokens=2)
    (dec,) = model.static_decoders.values()
    P = request.prefill_tokens
    kv = [t[:, :, :P].clone() for t in dec.cache.k + dec.cache.v]
    return RunState(dec, P, int(res.tokens[0, 0]), request.decode_tokens - 1, kv)


def factor_step(model, weights, run: RunState, factors: set, config, pdl: bool, cache_len: int, pos: int,
                reps: int) -> FactorStep:
    """The direct fused step of ``config`` with the run path's ``factors`` (module docstring; the
    bench's own ``cache_len``, ``pos``, ``reps`` where a factor does not replace them). Under
    ``torch.inference_mode`` (the run decoder's buffers are inference tensors), as ``reset``."""
    from ..kernels.decode_step import FusedDecodeStep
    from .decode_step_state import fused_step_state

    positions = bool(factors & {"positions", "prompt"})
    start, n = (run.prompt, run.steps) if positions else (pos, reps)
    dev = run.dec.cache.position.device
    if "buffers" in factors:
        dec = run.dec
        cache, p, token, history = dec.cache, dec.cache.position, dec.token_in.view(1), dec.core.history
        counts = (dec.routing.decode, dec.routing.step_index)
    else:
        length = run.dec.cache.max_len if "cache_len" in factors else cache_len
        _, cache, p, token = fused_step_state(model, length)
        history = torch.zeros(length, dtype=torch.int64, device=dev) if "history" in factors else None
        L = model.cfg.llm
        counts = (torch.zeros(n + 8, L.num_layers, L.n_routed_experts, dtype=torch.int64, device=dev),
                  torch.zeros(1, dtype=torch.int64, device=dev))
    for i, t in enumerate(cache.k + cache.v):
        t.zero_()
        if "prompt" in factors:
            t[:, :, :run.prompt].copy_(run.kv[i])
    first = run.first if "prompt" in factors else 1
    step = FusedDecodeStep(weights, cache, p, token=token, config=config, pdl=pdl, counts=counts, history=history)

    def reset():
        p.fill_(start)
        counts[1].zero_()
        token.fill_(first)

    reset()
    return FactorStep(step, reset, start, n)


def recorded_step_us(replay, reset, reps: int) -> float:
    """µs per step as the ladder times it: each of ``reps`` calls of ``replay`` inside a
    ``decode_step`` range of a ``StageRecorder`` (NVTX, CUDA events), the median of the spans."""
    from ..measure.recorder import StageRecorder

    reset()
    torch.cuda.synchronize()
    rec = StageRecorder(cuda=True, memory=False)
    for i in range(reps):
        with rec("decode_step", step=i):
            replay()
    return tpot_p50_us(rec)


def tpot_p50_us(rec) -> float:
    """The median ``decode_step`` span of a recorder's ranges, µs (its CUDA events; a CPU recorder's
    host clock)."""
    rows = rec.finish()
    return statistics.median(rows[rows["range"] == "decode_step"]["gpu_ms" if rec.cuda else "host_ms"]) * 1e3


def rows_of(factors: list) -> list:
    """[(method, factor set)]: ``direct``, each factor alone, ``all`` (more than one factor)."""
    out = [("direct", set())] + [(f"+{f}", {f}) for f in factors]
    return out + ([("all", set(factors))] if len(factors) > 1 else [])


@torch.inference_mode()
def run(cfg, opts, device, report, model, pdl: bool) -> None:
    """The paths table (module docstring) on ``device`` (CUDA), ``model`` built by the caller; ``pdl``:
    whether the GPU has programmatic dependent launch."""
    from .. import workload as wl
    from .config import config_changes
    from ..setup import synthetic_pages
    from .decode_step_state import decode_execution

    t0 = time.perf_counter()
    configs = [config_changes(text) for text in opts.configs]
    names = [text or "defaults" for text in opts.configs]
    ex = decode_execution(cfg, "best-fused", pdl)
    pages = synthetic_pages(cfg.workload, 0)                         # the ladder's first request's page
    request = wl.build_request(pages[:1], cfg.workload.mode, decode_tokens=cfg.workload.decode_tokens,
                               routing=cfg.workload.routing,
                               routing_seed=cfg.workload.routing_seed).to(device, next(model.parameters()).dtype)
    ex = dataclasses.replace(ex, vision_compile=False,
                             static_cache_len=ex.cache_len(request.prefill_tokens, request.decode_tokens))
    state = run_state(model, request, ex)
    weights = state.dec.core.weights
    report.note(f"run path: {cfg.workload.mode} page, prompt {state.prompt} tokens, {state.steps} decode steps, "
                f"cache {state.dec.cache.max_len} positions, first token {state.first}; bench: cache {opts.cache_len}, "
                f"positions {opts.pos}..{opts.pos + opts.reps - 1}; {opts.rounds} rounds per configuration, alternating")
    table = report.table("paths", "the fused step's configurations under each factor of the run path (µs per step)",
                         COLUMNS)
    deltas = {}                                       # method -> [each configuration - the first, µs]

    def time_row(method: str, factors: set) -> None:
        built = [factor_step(model, weights, state, factors, c, ex.pdl, opts.cache_len, opts.pos, opts.reps)
                 for c in configs]
        graphs = [capture_reset(b.step.run, b.reset) for b in built]
        us = [[] for _ in built]
        for _ in range(opts.rounds):
            for i, (b, g) in enumerate(zip(built, graphs)):
                us[i].append(recorded_step_us(g.replay, b.reset, b.reps) if "events" in factors
                             else per_step_us(g.replay, b.reset, b.reps, 1)[0])
        deltas[method] = add_rows(table, method, names, us)

    rows = rows_of(list(opts.match))
    time_row(*rows[0])                                # direct, harness and run first: the disagreement itself
    deltas["harness"] = add_rows(table, "harness", names, harness_us(model, configs, opts.rounds, opts.cache_len,
                                                                     opts.pos, opts.reps, ex.pdl))
    deltas["run"] = add_rows(table, "run", names, run_path_us(model, request, configs, state.dec.cache.max_len,
                                                             opts.rounds, ex.pdl))
    for method, factors in rows[1:]:
        time_row(method, factors)
    for line in flips(names, deltas):
        report.note(line)
    report.note(f"paths: {time.perf_counter() - t0:.0f} s")


def add_rows(table, method: str, names: list, us: list) -> list:
    """The row's cells per configuration (``us``: its rounds' µs); each configuration's median minus
    the first's."""
    med = [statistics.median(u) for u in us]
    fastest = names[min(range(len(med)), key=med.__getitem__)]
    for name, u, m in zip(names, us, med):
        table.add(method=method, change=name, us_step=m, us_min=min(u), us_max=max(u), delta_us=m - med[0],
                  note="fastest" if name == fastest else "")
    return [m - med[0] for m in med]


def flips(names: list, deltas: dict) -> list:
    """One line per configuration after the first: faster or slower than the first under ``direct``,
    and the rows (``deltas``: method -> differences, ``add_rows``) where that order is reversed."""
    out = []
    for i, name in enumerate(names[1:], 1):
        sign = deltas["direct"][i] < 0
        flipped = [m for m, d in deltas.items() if (d[i] < 0) != sign]
        out.append(f"{name} against {names[0]}: {'faster' if sign else 'slower'} under direct "
                   f"({deltas['direct'][i]:+.1f} µs); " + (f"the order reverses under {', '.join(flipped)}"
                                                          if flipped else "the same order under every row"))
    return out


def fused_decoders(model, configs: list, length: int, pdl: bool) -> list:
    """One ``StaticDecoder`` of batch 1 and ``length`` positions per configuration, each built through
    the harness already applied to ``model`` (``run_state``: ``Engine.static_decoder``, captured where
    the execution has graphs) with its ``FusedCore`` of that configuration; none is left in the model."""
    import functools

    from ..variants.engine import attach
    from ..variants.fused_step import FusedCore

    plan = attach(model)
    out = []
    for config in configs:
        plan.decode_step = functools.partial(FusedCore, pdl=pdl, config=config)
        model.static_decoders.pop((1, length), None)
        out.append(model.static_decoder(1, length))
    model.static_decoders.pop((1, length), None)
    return out


def harness_us(model, configs: list, rounds: int, length: int, pos: int, reps: int, pdl: bool) -> list:
    """[[µs per step per round]] per configuration as the bench's ``best-fused (graph)`` row times the
    harness path: a decoder of ``length`` positions (``fused_decoders``), its graph replayed ``reps``
    times back to back from position ``pos`` with the routing counts zeroed before each round and the
    token carried over from the previous round (not reset); the configurations' rounds alternate."""
    decoders = fused_decoders(model, configs, length, pdl)
    us = [[] for _ in configs]
    for _ in range(rounds):
        for i, dec in enumerate(decoders):
            def reset(dec=dec):
                dec.cache.position.fill_(pos)
                dec.routing.zero()
            us[i].append(per_step_us(dec.decode_graphs[dec._mode()][0].replay, reset, reps, 1)[0])
    return us


def run_path_us(model, request, configs: list, length: int, rounds: int, pdl: bool) -> list:
    """[[TPOT p50 µs per round]] per configuration: ``generate()`` of ``request`` (its static cache
    ``length`` positions) through the run path already applied to ``model`` (``run_state``) on a
    decoder of its own per configuration (``fused_decoders``, swapped in before its request: one
    untimed request each, then the timed requests alternate)."""
    from ..measure.recorder import StageRecorder
    from ..models.generate import generate

    key = (1, length)
    cuda = next(model.parameters()).device.type == "cuda"
    decoders = fused_decoders(model, configs, key[1], pdl)
    for dec in decoders:
        model.static_decoders[key] = dec
        generate(model, request)
    us = [[] for _ in configs]
    for _ in range(rounds):
        for i, dec in enumerate(decoders):
            model.static_decoders[key] = dec
            rec = StageRecorder(cuda=cuda, memory=False)
            generate(model, request, stage=rec)
            us[i].append(tpot_p50_us(rec))
    return us


__all__ = ["COLUMNS", "RunState", "FactorStep", "run_state", "factor_step", "recorded_step_us", "rows_of", "add_rows",
           "flips", "fused_decoders", "harness_us", "run_path_us", "run"]
