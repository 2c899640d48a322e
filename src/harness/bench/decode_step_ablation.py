"""The fused batch-1 decode step (PDL, CUDA graph) taken apart on the GPU: what each kernel kind and
each kernel boundary costs, and how fast a lone kernel streams its weights (issue 24).

    python -m harness bench decode_step_ablation [bench.decode_step_ablation.reps=200] \\
        ["bench.decode_step_ablation.configs=['down=(4, 8)']"] [bench.decode_step_ablation.only_configs=true] \\
        [bench.decode_step_ablation.regs=true]
    python -m harness bench decode_step_ablation bench.decode_step_ablation.handoff=true

Tables (µs per step, measured: CUDA events around ``reps`` graph replays, median of ``rounds``):

- ``configs``: the step with its routing counted (as the ladder runs it) and with each of ``configs``
  (``DecodeStepConfig`` changes), against the step without counts (``full``); with ``regs``,
  ``residency``: each kernel's registers, spills and shared memory and the programs an SM holds
  (sm90: 64K registers, allocated per warp in units of 256; 2048 threads; 228 KB shared), so a
  launch's waves = programs / (that x SMs).
- ``ablation``: ``full``, the step as the harness runs it (``FusedDecodeStep``, PDL where the GPU has
  it); ``without LABEL``, every launch of that kind left out (its outputs are then wrong: a timing
  probe only), full - without = what that kind adds to the step's critical path; ``+ empty after
  each``, an empty PDL kernel (1 or SMs programs: wait, trigger, exit) after every launch: (that -
  full) / launches = one extra kernel boundary (derived).
- ``kinds``: each kind alone, its layer-``layer`` launch ``copies`` times in one graph (PDL), µs per
  launch and the GB/s of its weights (analytic bytes / measured µs). The copies read the same
  weights, so a kind whose bytes fit the L2 (50 MB on an H200, all but lm_head) reads them from L2
  after the first launch: its GB/s is not a DRAM rate; it bounds what the kernel's own structure
  allows.
- ``streaming``: lm_head's weight (bytes known exactly) through a Triton read-and-sum with a
  software-pipelined loop (``num_stages``), torch.mv (cuBLAS GEMV) and a device copy: the card's
  reachable read rate.
- ``handoff`` (only, with ``handoff``): what a kernel boundary (an empty PDL launch) costs against a
  grid-wide barrier inside one persistent launch (counters in global memory), per stage.

``eager_steps`` N: only the step run N times from ``pos`` without a graph (the first of ``configs``
applied, if any): a target for ncu, which profiles kernels one at a time (so PDL's overlap is gone
and, by default, L2 is flushed before each profiled kernel: its weights come from DRAM). Per step the
down kernel runs 24 times (per layer o_proj, then the dense or MoE down): launch 3 is layer 1's MoE
down; ``_gate_up_kernel`` launch 1 is layer 1's MoE gate/up:

    ncu -k regex:_down_kernel --launch-skip 3 --launch-count 1 --section SpeedOfLight --section Occupancy \
        --section WarpStateStats python -m harness bench decode_step_ablation bench.decode_step_ablation.eager_steps=2
"""
from __future__ import annotations

import math
import statistics

import torch
import triton
import triton.language as tl

from ..kernels.decode_step_triton import _pdl_wait, _tile_range
from .config import config_changes
from .decode_step_state import fused_step_state
from .timing import capture_reset, first_line, per_step_us


@triton.jit
def _empty_kernel(x_ptr, USE_PDL: tl.constexpr):
    _pdl_wait(USE_PDL)


@triton.jit
def _stream_sum_kernel(w_ptr, out_ptr, n, CHUNK: tl.constexpr, STAGES: tl.constexpr):
    """out[pid] = sum of this program's contiguous share of the flat ``w`` [n] (fp32)."""
    c0, c1 = _tile_range(tl.cdiv(n, CHUNK))
    offs = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], tl.float32)
    for c in tl.range(c0, c1, num_stages=STAGES):
        idx = c.to(tl.int64) * CHUNK + offs
        acc += tl.load(w_ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit
def _barrier_chain_kernel(cnt_ptr, STAGES: tl.constexpr, VOLATILE: tl.constexpr):
    """STAGES grid-wide barriers in a row: every program adds 1 to counter s (acq_rel), then polls it
    until all programs have arrived (a volatile load, or an acquire atomic add of 0). Every program
    must be resident at once (no other way to arrive): the grid is at most what the GPU holds."""
    n = tl.num_programs(0)
    for s in range(STAGES):
        c = tl.atomic_add(cnt_ptr + s, 1, sem="acq_rel", scope="gpu") + 1
        while c < n:
            if VOLATILE:
                c = tl.load(cnt_ptr + s, volatile=True)
            else:
                c = tl.atomic_add(cnt_ptr + s, 0, sem="acquire", scope="gpu")


def timed_graph(fn, reps: int, rounds: int, copies: int = 1) -> float:
    """µs per call of ``fn`` captured ``copies`` times in one graph (median of rounds)."""
    graph = capture_reset(lambda: [fn() for _ in range(copies)], lambda: None)
    return statistics.median(per_step_us(graph.replay, lambda: None, reps, rounds)) / copies


def handoff_probe(sms: int, pdl: bool, reps: int, rounds: int, report, stages: int = 40) -> None:
    """The ``handoff`` table: (T(n stages) - T(1)) / (n - 1) of empty PDL launches and of grid barriers,
    each graph also zeroing the counters (one memset) first."""
    dev = torch.device("cuda")
    cnt = torch.zeros(stages, dtype=torch.int32, device=dev)
    dummy = torch.zeros(1, device=dev)
    meta = {"launch_pdl": True} if pdl else {}
    table = report.table("handoff", f"kernel boundary against a grid barrier ({stages} stages against 1, PDL {pdl})",
                         ["programs", "probe", "us_stage", "us_graph", "us_graph_one"])
    for programs in (sms, 2 * sms):
        probes = {"empty PDL launches": lambda k, p=programs: [_empty_kernel[(p,)](dummy, USE_PDL=pdl, num_warps=4,
                                                                                   **meta) for _ in range(k)]}
        for volatile in (True, False):
            probes[f"barriers ({'volatile load' if volatile else 'atomic'} polls)"] = (
                lambda k, volatile=volatile, p=programs: _barrier_chain_kernel[(p,)](cnt, STAGES=k, VOLATILE=volatile,
                                                                                     num_warps=4))
        for label, run_probe in probes.items():
            t = {k: timed_graph(lambda k=k: (cnt.zero_(), run_probe(k)), reps, rounds) for k in (1, stages)}
            table.add(programs=programs, probe=label, us_stage=(t[stages] - t[1]) / (stages - 1), us_graph=t[stages],
                      us_graph_one=t[1])


def residency(step, kt, sms: int, config: str, table) -> None:
    """Each distinct launch of ``step`` (run once, eagerly): registers, spills, shared memory, programs
    per SM and waves (module docstring) into ``table``."""
    seen, launch = {}, kt._launch

    def record(kernel, grid, warps, pdl, *a, clock=None, **meta):
        compiled = kernel[grid](*a, num_warps=warps, **kt.launch_meta(pdl, a, meta, clock))
        key = (kernel.fn.__name__, grid, warps)
        if key not in seen:
            compiled._init_handles()
            seen[key] = (compiled.n_regs, compiled.n_spills, compiled.metadata.shared)
    kt._launch = record
    try:
        for _, _, call in step.calls:
            call()
        torch.cuda.synchronize()
    finally:
        kt._launch = launch
    for (name, grid, warps), (regs, spills, shared) in seen.items():
        per_warp = -(-regs * 32 // 256) * 256
        per_sm = min(65536 // (per_warp * warps), 2048 // (32 * warps), 32,
                     233472 // (shared + 1024) if shared else 32)
        table.add(change=config, kernel=name, grid=str(grid), warps=warps, regs=regs, spills=spills,
                  shared_bytes=shared, per_sm=per_sm, waves=math.prod(grid) / (per_sm * sms))


def run(cfg, opts, device, report) -> None:
    """The bench (module docstring) on ``device`` (CUDA)."""
    from ..kernels import decode_step as ds
    from ..kernels import decode_step_triton as kt
    from ..models.build import build_model

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    pdl, why = kt.pdl_support(device)
    report.note(f"device {torch.cuda.get_device_name(device)} ({sms} SMs), torch {torch.__version__}, triton "
                f"{triton.__version__}, PDL {pdl} ({why})")
    if opts.handoff:
        handoff_probe(sms, pdl, opts.reps, opts.rounds, report)
        return
    L = cfg.model.llm
    model = build_model(cfg.model, device, torch.bfloat16, seed=cfg.seed)
    weights, cache, pos, token = fused_step_state(model, opts.cache_len, token_id=1)
    if opts.eager_steps:
        pos.fill_(opts.pos)
        eager = ds.FusedDecodeStep(weights, cache, pos, token=token, pdl=pdl,
                                   config=config_changes(opts.configs[0] if opts.configs else ""))
        for _ in range(opts.eager_steps):
            eager.run()
        torch.cuda.synchronize()
        report.note(f"{opts.eager_steps} steps from position {opts.pos} without a graph, {eager.launches} launches "
                    "each")
        return
    step = ds.FusedDecodeStep(weights, cache, pos, token=token, pdl=pdl)
    nbytes = step.weight_bytes()["total"] + step.kv_bytes(opts.pos + opts.reps // 2)

    def reset():
        pos.fill_(opts.pos)
        token.fill_(1)

    def time_calls(calls) -> float:
        def run_calls():
            for _, _, call in calls:
                call()
        graph = capture_reset(run_calls, reset)
        return statistics.median(per_step_us(graph.replay, reset, opts.reps, opts.rounds))

    full = time_calls(step.calls)
    report.note(f"bytes per step (analytic) {nbytes / 1e6:.1f} MB; launches {step.launches}; the step without "
                f"counts (full) {full:.1f} µs")
    counts = torch.zeros(opts.reps + 8, L.num_layers, L.n_routed_experts, dtype=torch.int64, device=device)
    step_index = torch.zeros(1, dtype=torch.int64, device=device)
    configs = report.table("configs", "the whole step against the step without counts",
                           ["change", "us_step", "delta_us"])
    regs = report.table("residency", "each kernel of each config, run once", ["change", "kernel", "grid", "warps",
                        "regs", "spills", "shared_bytes", "per_sm", "waves"]) if opts.regs else None
    for text, changes in [("routing counted (as the ladder)", "")] + [(c, c) for c in opts.configs]:
        other = ds.FusedDecodeStep(weights, cache, pos, token=token, pdl=pdl, config=config_changes(changes),
                                   counts=(counts, step_index))
        step_index.zero_()
        us = time_calls(other.calls)
        configs.add(change=text, us_step=us, delta_us=us - full)
        if regs is not None:
            residency(other, kt, sms, text, regs)
    if opts.only_configs:
        return
    ablation = report.table("ablation", "the step with one kind of launch left out, or an empty kernel after each",
                            ["probe", "us_step", "delta_us", "launches", "us_boundary"])
    ablation.add(probe="full", us_step=full, launches=step.launches)
    for label in sorted({label for label, _, _ in step.calls}):
        kept = [c for c in step.calls if c[0] != label]
        us = time_calls(kept)
        ablation.add(probe=f"without {label}", us_step=us, delta_us=us - full, launches=len(kept))
    dummy = torch.zeros(1, device=device)
    for programs in (1, sms):
        empty = ("empty", -1, lambda programs=programs: _empty_kernel[(programs,)](
            dummy, USE_PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {})))
        padded = [c for call in step.calls for c in (call, empty)]
        us = time_calls(padded)
        ablation.add(probe=f"+ empty ({programs} programs) after each", us_step=us, delta_us=us - full,
                     launches=len(padded), us_boundary=(us - full) / step.launches)
    kinds(weights, cache, step, opts, pdl, reset, report)
    streaming(weights, sms, opts, report)


def kinds(weights, cache, step, opts, pdl: bool, reset, report) -> None:
    """The ``kinds`` table: each kind's layer-``layer`` launch alone (module docstring)."""
    lw = weights.layers[opts.layer]
    n = lambda t: t.numel() * t.element_size()  # noqa: E731
    kind_bytes = {"qkv": n(lw.qkv), "o_proj": n(lw.o), "router": n(lw.router),
                  "gate_up": n(lw.gate_up) + weights.top_k * n(lw.experts_gate_up[0]),
                  "down": n(lw.down) + weights.top_k * n(lw.experts_down[0]),
                  "lm_head": n(weights.lm_head),
                  "attention": 2 * n(cache.k[opts.layer][0, :, :opts.pos + 1])}
    table = report.table("kinds", f"each kind alone: {opts.copies} launches of layer {opts.layer}'s in one graph "
                         f"(PDL {pdl}; lm_head 10), position {opts.pos}; the same weights each launch: from L2 where "
                         "they fit, so GB/s is no DRAM rate", ["probe", "us_launch", "mb", "gbs"])
    for label in ("qkv", "attention", "o_proj", "router", "gate_up", "down", "lm_head"):
        call = next(c for lab, i, c in step.calls if lab == label and i in (opts.layer, len(weights.layers)))
        reset()
        us = timed_graph(call, max(opts.reps // 10, 5), opts.rounds, opts.copies if label != "lm_head" else 10)
        table.add(probe=label, us_launch=us, mb=kind_bytes[label], gbs=kind_bytes[label] / us / 1e3)


def streaming(weights, sms: int, opts, report) -> None:
    """The ``streaming`` table: lm_head's weight read by Triton sums, torch.mv and a copy, 10 per graph."""
    w = weights.lm_head.detach()
    flat, nbytes = w.view(-1), w.numel() * w.element_size()
    table = report.table("streaming", f"streaming lm_head's weight ({nbytes / 1e6:.1f} MB, {tuple(w.shape)} "
                         f"{w.dtype}), 10 per graph", ["probe", "us_launch", "gbs"])
    out = torch.empty(8 * sms, device=w.device)
    for chunk, stages, per_sm, warps in [(4096, 1, 2, 8), (4096, 3, 2, 8), (4096, 4, 2, 8), (8192, 3, 1, 8),
                                         (2048, 4, 4, 4), (8192, 2, 2, 8), (16384, 2, 1, 16)]:
        progs = per_sm * sms

        def probe(chunk=chunk, stages=stages, progs=progs, warps=warps):
            _stream_sum_kernel[(progs,)](flat, out, flat.numel(), CHUNK=chunk, STAGES=stages, num_warps=warps)
        label = f"triton sum chunk {chunk} stages {stages} programs {progs} warps {warps}"
        try:
            us = timed_graph(probe, 20, opts.rounds, 10)
        except Exception as exc:                       # noqa: BLE001 - noted, the other probes go on
            report.note(f"{label} failed: {first_line(exc)}")
            continue
        table.add(probe=label, us_launch=us, gbs=nbytes / us / 1e3)
    x = torch.randn(w.shape[1], device=w.device, dtype=w.dtype)
    y = torch.empty(w.shape[0], device=w.device, dtype=w.dtype)
    us = timed_graph(lambda: torch.mv(w, x, out=y), 20, opts.rounds, 10)
    table.add(probe="torch.mv (cuBLAS GEMV)", us_launch=us, gbs=nbytes / us / 1e3)
    dst = torch.empty_like(w)
    us = timed_graph(lambda: dst.copy_(w), 20, opts.rounds, 10)
    table.add(probe="copy (read + write: 2 x bytes)", us_launch=us, gbs=2 * nbytes / us / 1e3)
