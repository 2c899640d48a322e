"""The fused batch-1 decode step (PDL, CUDA graph) taken apart on the GPU: what each kernel kind and
each kernel boundary costs, and how fast a lone kernel streams its weights (issue 24).

    python scripts/device/step_ablation.py [--reps 200] [--rounds 3] [--configs F=V;F=V ...] [--only-configs] [--regs]
    python scripts/device/step_ablation.py --handoff

Rows (µs per step, measured: CUDA events around ``--reps`` graph replays, median of ``--rounds``):
- ``full``: the step as the harness runs it (``FusedDecodeStep``, PDL where the GPU has it).
- ``without LABEL``: the step with every launch of that kind left out (its outputs are then wrong:
  a timing probe only). full - without = what that kind adds to the step's critical path.
- ``+ empty after each``: an empty PDL kernel (1 or ``--sms`` programs: wait, trigger, exit) after
  every launch: (that - full) / launches = one extra kernel boundary.
Then each kind alone: its layer-``--layer`` launch ``--copies`` times in one graph (PDL), µs per
launch and the GB/s of its weights (analytic bytes / measured µs). The copies read the same weights,
so a kind whose bytes fit the L2 (50 MB on an H200, all but lm_head) reads them from L2 after the
first launch: its GB/s is not a DRAM rate; it bounds what the kernel's own structure allows. Then streaming probes of
lm_head's weight (bytes known exactly): a Triton read-and-sum with a software-pipelined loop
(``num_stages``), torch.mv (cuBLAS GEMV) and a device copy, for the card's reachable read rate.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_decode_step import capture, fused_step_state, per_step_us  # noqa: E402

from harness.kernels.decode_step_triton import _pdl_wait, _tile_range  # noqa: E402


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


def handoff_probe(sms: int, pdl: bool, reps: int, rounds: int, stages: int = 40) -> None:
    """What a kernel boundary (an empty PDL launch) costs against a grid-wide barrier inside one
    persistent launch (counters in global memory), per stage: (T(n stages) - T(1)) / (n - 1), each
    graph also zeroing the counters (one memset) first."""
    dev = torch.device("cuda")
    cnt = torch.zeros(stages, dtype=torch.int32, device=dev)
    dummy = torch.zeros(1, device=dev)
    meta = {"launch_pdl": True} if pdl else {}
    print(f"\nkernel boundary against a grid barrier (µs per stage, {stages} stages against 1, PDL {pdl}):")
    for programs in (sms, 2 * sms):
        rows = {"empty PDL launches": lambda k: [_empty_kernel[(programs,)](dummy, USE_PDL=pdl, num_warps=4, **meta)
                                                 for _ in range(k)]}
        for volatile in (True, False):
            rows[f"barriers ({'volatile load' if volatile else 'atomic'} polls)"] = (
                lambda k, volatile=volatile: _barrier_chain_kernel[(programs,)](cnt, STAGES=k, VOLATILE=volatile,
                                                                                 num_warps=4))
        for label, run in rows.items():
            t = {k: timed_graph(lambda k=k: (cnt.zero_(), run(k)), reps, rounds) for k in (1, stages)}
            print(f"  {programs:4d} programs, {label:34s} {(t[stages] - t[1]) / (stages - 1):6.2f} us per stage "
                  f"(graph {t[stages]:.1f} us against {t[1]:.1f})")


def timed_graph(fn, reps: int, rounds: int, copies: int = 1) -> float:
    """µs per call of ``fn`` captured ``copies`` times in one graph (median of rounds)."""
    graph = capture(lambda: [fn() for _ in range(copies)], lambda: None)
    return statistics.median(per_step_us(graph.replay, lambda: None, reps, rounds)) / copies


def print_residency(step, kt, sms: int) -> None:
    """Each distinct launch of ``step`` (run once, eagerly): registers per thread, spilled bytes, shared
    memory, and the programs an SM holds (sm90: 64K registers, allocated per warp in units of 256;
    2048 threads; 228 KB shared), so the launch's waves = programs / (that x SMs)."""
    seen, launch = {}, kt._launch

    def record(kernel, grid, warps, pdl, *a, **meta):
        if pdl:
            meta["launch_pdl"] = True
        compiled = kernel[grid](*a, num_warps=warps, **meta)
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
        programs = math.prod(grid)
        print(f"      {name:24s} grid {str(grid):12s} warps {warps:2d} regs {regs:3d} spills {spills:4d} "
              f"shared {shared:6d}  {per_sm:2d} per SM  {programs / (per_sm * sms):5.2f} waves")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--len", type=int, default=512)
    ap.add_argument("--pos", type=int, default=286)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layer", type=int, default=5)
    ap.add_argument("--copies", type=int, default=40)
    ap.add_argument("--configs", nargs="*", default=[], metavar="FIELD=VALUE[;FIELD=VALUE]",
                    help="also time the whole step with these DecodeStepConfig changes (python literals)")
    ap.add_argument("--only-configs", action="store_true", help="skip the ablations and the probes")
    ap.add_argument("--handoff", action="store_true",
                    help="only the probe of a kernel boundary against a grid barrier in one launch")
    ap.add_argument("--regs", action="store_true",
                    help="print each kernel's registers, spills and resident programs per SM (each config)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("step_ablation: needs a GPU", file=sys.stderr)
        return 1
    from harness.config import ModelConfig
    from harness.kernels import decode_step as ds
    from harness.kernels import decode_step_triton as kt
    from harness.models.build import build_model

    dev, dt = torch.device("cuda"), torch.bfloat16
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    pdl, why = kt.pdl_support(dev)
    print(f"device {torch.cuda.get_device_name()} ({sms} SMs), torch {torch.__version__}, triton {triton.__version__}, "
          f"PDL {pdl} ({why})")
    if args.handoff:
        handoff_probe(sms, pdl, args.reps, args.rounds)
        return 0
    L = ModelConfig().llm
    model = build_model(ModelConfig(), dev, dt, seed=0)
    weights, cache, pos, token = fused_step_state(model, args.len, token_id=1)
    step = ds.FusedDecodeStep(weights, cache, pos, token=token, pdl=pdl)
    nbytes = step.weight_bytes()["total"] + step.kv_bytes(args.pos + args.reps // 2)

    def reset():
        pos.fill_(args.pos)
        token.fill_(1)

    def run_calls(calls):
        def run():
            for _, _, call in calls:
                call()
        return run

    def time_calls(calls) -> float:
        graph = capture(run_calls(calls), reset)
        return statistics.median(per_step_us(graph.replay, reset, args.reps, args.rounds))

    full = time_calls(step.calls)
    print(f"\nbytes per step (analytic) {nbytes / 1e6:.1f} MB; launches {step.launches}")
    counts = torch.zeros(args.reps + 8, L.num_layers, L.n_routed_experts, dtype=torch.int64, device=dev)
    step_index = torch.zeros(1, dtype=torch.int64, device=dev)
    variants = [("routing counted (as the ladder)", "", True)]
    for text in args.configs:
        variants.append((text, text, True))
    for text, changes, counted in variants:
        config = ds.config_changes(changes)
        other = ds.FusedDecodeStep(weights, cache, pos, token=token, pdl=pdl, config=config,
                                   counts=(counts, step_index) if counted else None)
        step_index.zero_()
        us = time_calls(other.calls)
        print(f"  {text:60s} {us:8.1f} us  ({us - full:+.1f} against the step without counts, {full:.1f})")
        if args.regs:
            print_residency(other, kt, sms)
    if args.only_configs:
        return 0
    print(f"{'row':34s} {'us/step':>9s} {'delta':>8s} {'launches':>9s}")
    print(f"{'full':34s} {full:9.1f} {'':8s} {step.launches:9d}")
    labels = sorted({label for label, _, _ in step.calls})
    for label in labels:
        kept = [c for c in step.calls if c[0] != label]
        us = time_calls(kept)
        print(f"{'without ' + label:34s} {us:9.1f} {us - full:+8.1f} {len(kept):9d}")
    dummy = torch.zeros(1, device=dev)
    for programs in (1, sms):
        empty = ("empty", -1, lambda programs=programs: _empty_kernel[(programs,)](
            dummy, USE_PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {})))
        padded = [c for call in step.calls for c in (call, empty)]
        us = time_calls(padded)
        print(f"{f'+ empty ({programs} programs) after each':34s} {us:9.1f} {us - full:+8.1f} {len(padded):9d}   "
              f"per boundary {(us - full) / step.launches:.2f} us")

    # ------------------------------------------------------------------ each kind alone
    lw = weights.layers[args.layer]
    n = lambda t: t.numel() * t.element_size()  # noqa: E731
    kind_bytes = {"qkv": n(lw.qkv), "o_proj": n(lw.o), "router": n(lw.router),
                  "gate_up": n(lw.gate_up) + weights.top_k * n(lw.experts_gate_up[0]),
                  "down": n(lw.down) + weights.top_k * n(lw.experts_down[0]),
                  "lm_head": n(weights.lm_head),
                  "attention": 2 * n(cache.k[args.layer][0, :, :args.pos + 1])}
    print(f"\neach kind alone ({args.copies} launches of layer {args.layer}'s in one graph, PDL {pdl}; position "
          f"{args.pos}; the same weights each launch: from L2 where they fit, so GB/s is no DRAM rate):")
    print(f"{'kind':12s} {'us/launch':>10s} {'MB':>8s} {'GB/s':>8s}")
    for label in ("qkv", "attention", "o_proj", "router", "gate_up", "down", "lm_head"):
        call = next(c for lab, i, c in step.calls if lab == label and i in (args.layer, len(weights.layers)))
        reset()
        us = timed_graph(call, max(args.reps // 10, 5), args.rounds, args.copies if label != "lm_head" else 10)
        b = kind_bytes[label]
        print(f"{label:12s} {us:10.2f} {b / 1e6:8.2f} {b / us / 1e3:8.0f}")

    # ------------------------------------------------------------------ streaming probes of lm_head's weight
    w = weights.lm_head.detach()
    flat = w.view(-1)
    print(f"\nstreaming lm_head's weight ({n(w) / 1e6:.1f} MB, {tuple(w.shape)} {w.dtype}), 10 per graph:")
    out = torch.empty(8 * sms, device=dev)
    for chunk, stages, per_sm, warps in [(4096, 1, 2, 8), (4096, 3, 2, 8), (4096, 4, 2, 8), (8192, 3, 1, 8),
                                         (2048, 4, 4, 4), (8192, 2, 2, 8), (16384, 2, 1, 16)]:
        progs = per_sm * sms

        def probe(chunk=chunk, stages=stages, progs=progs, warps=warps):
            _stream_sum_kernel[(progs,)](flat, out, flat.numel(), CHUNK=chunk, STAGES=stages, num_warps=warps)
        try:
            us = timed_graph(probe, 20, args.rounds, 10)
            print(f"  triton sum chunk {chunk:6d} stages {stages} programs {progs:4d} warps {warps:2d}: {us:8.1f} us "
                  f"{n(w) / us / 1e3:7.0f} GB/s")
        except Exception as exc:                       # noqa: BLE001
            print(f"  triton sum chunk {chunk} stages {stages}: failed {str(exc).splitlines()[-1][:200]}")
    x = torch.randn(w.shape[1], device=dev, dtype=dt)
    y = torch.empty(w.shape[0], device=dev, dtype=dt)
    us = timed_graph(lambda: torch.mv(w, x, out=y), 20, args.rounds, 10)
    print(f"  torch.mv (cuBLAS GEMV)                                  : {us:8.1f} us {n(w) / us / 1e3:7.0f} GB/s")
    dst = torch.empty_like(w)
    us = timed_graph(lambda: dst.copy_(w), 20, args.rounds, 10)
    print(f"  copy (read + write)                                     : {us:8.1f} us {2 * n(w) / us / 1e3:7.0f} GB/s "
          "(read + write)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
