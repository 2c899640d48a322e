"""Routed experts on the GPU: the vendor loop (``MoE.moe_infer``) against each sync-free implementation
of ``harness.variants.fast_moe``, at DeepSeek-OCR's sizes (H=1280, I=896, E=64, top-6, bf16).

    python scripts/bench_fast_moe.py [--tokens 1 8 32 64 300] [--reps 50] [--warmup 10] [--csv out.csv]
    python scripts/bench_fast_moe.py --rows-sweep --tokens 1 2   # tiles of the decode-size kernels
    python scripts/bench_fast_moe.py --rows-sweep --shared --tokens 1   # ... with the shared expert folded in
    python scripts/bench_fast_moe.py --blocks-sweep --tokens 32   # tiles of the sorted, blocked kernels

Self-contained: one MoE layer with random weights (std 0.02, the harness's init_std), routing from
its own fp32 softmax gate on random activations. For each T and implementation it prints:

- ``ms_med`` / ``ms_p90`` (measured): CUDA events around one call, median and 90th percentile over
  ``--reps``. Before each rep a 256 MiB buffer is zeroed (L2 flushed, so weights come from HBM)
  and the device is synchronised, so each rep starts on an idle queue: launch overhead and host
  syncs count, as in an eager decode step.
- ``GB/s`` (derived): weight bytes of the experts the routing touches (each read once) / ms_med.
- ``rel_err`` (measured): max |out - vendor| / max |vendor| in bf16; ``ok`` when <= 2e-2.
- ``no_sync`` (measured): one call under ``torch.cuda.set_sync_debug_mode("error")``.
- rows ``<impl>+graph``: the call captured once in a CUDA graph and replayed (same inputs), when
  capture works; its rel_err is the replay's output against the vendor's.

An implementation that cannot run prints ``skipped: <reason>``. A final section checks fp32
parity (rel_err <= 1e-5 against the vendor loop in fp32) where the implementation runs in fp32.
"""
from __future__ import annotations

import argparse
import copy
import csv
import statistics
import sys

import torch

from harness.config import LLMConfig
from harness.kernels.availability import triton_available
from harness.variants import fast_moe as fm
from harness.models.llm import MoE

FLUSH_BYTES = 256 * 2**20
BF16_TOL, FP32_TOL = 2e-2, 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def build_layer(seed: int) -> MoE:
    """One MoE layer of the checkpoint's shape with N(0, 0.02) weights, fp32 on the CPU."""
    torch.manual_seed(seed)
    moe = MoE(LLMConfig(), layer_idx=1)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.02)
    return moe


def time_ms(fn, reps: int, warmup: int, flush: torch.Tensor) -> list[float]:
    """Per-rep GPU ms (CUDA events) of ``fn()``, each rep after an L2 flush on an idle device."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    spans = []
    for _ in range(reps):
        flush.zero_()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        spans.append(start.elapsed_time(end))
    return spans


def sync_free(fn) -> str:
    """'yes' when one call runs under sync debug mode 'error', else the error's first line."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return "yes"
    except RuntimeError as exc:
        return "no: " + str(exc).splitlines()[0][:80]
    finally:
        torch.cuda.set_sync_debug_mode(0)


def capture(fn):
    """(graph, static output) of ``fn`` captured after warm-up on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def availability(impl: str, device, dtype) -> tuple[bool, str]:
    if impl == "grouped_mm":
        return fm.grouped_mm_available(device, dtype)
    if impl == "triton":
        return triton_available(device)
    return True, "pure PyTorch"


def row(impl, T, spans, bytes_touched, err, no_sync, note="") -> dict:
    med = statistics.median(spans)
    p90 = sorted(spans)[int(0.9 * (len(spans) - 1))]
    return {"impl": impl, "T": T, "ms_med": med, "ms_p90": p90, "GB_s": bytes_touched / med / 1e6,
            "rel_err": err, "ok": "" if err is None else ("ok" if err <= BF16_TOL else "FAIL"),
            "no_sync": no_sync, "note": note}


def bench_bf16(moe: MoE, weights: fm.ExpertWeights, tokens, reps, warmup, flush) -> list[dict]:
    dev = weights.gate_up.device
    rows, skipped = [], set()
    for T in tokens:
        gen = torch.Generator(device=dev).manual_seed(T)
        x = torch.randn(T, weights.hidden, device=dev, generator=gen).to(torch.bfloat16)
        ids, w = moe.gate(x)
        touched = torch.unique(ids).numel()                    # host-side, outside any timing
        bytes_touched = touched * weights.bytes_per_expert()
        ref = moe.moe_infer(x, ids, w)
        spans = time_ms(lambda: moe.moe_infer(x, ids, w), reps, warmup, flush)
        rows.append(row("vendor_loop", T, spans, bytes_touched, None, sync_free(lambda: moe.moe_infer(x, ids, w)),
                        f"{touched} experts touched"))
        for impl in fm.IMPLEMENTATIONS:
            ok, reason = availability(impl, dev, torch.bfloat16)
            if not ok:
                if impl not in skipped:
                    print(f"skipped: {impl}: {reason}")
                    skipped.add(impl)
                continue

            def call(impl=impl):
                return fm.routed_experts(x, ids, w, weights, impl)
            try:
                out = call()
            except Exception as exc:  # report and go on with the other implementations
                print(f"skipped: {impl} at T={T}: {exc.__class__.__name__}: {exc}")
                continue
            note = ""
            if impl == "triton":
                note = f"block_m={fm.default_triton_config(T * ids.shape[1], weights.num_experts).block_m}"
            spans = time_ms(call, reps, warmup, flush)
            rows.append(row(impl, T, spans, bytes_touched, rel_err(out, ref), sync_free(call), note))
            try:
                graph, static_out = capture(call)
                graph.replay()
                torch.cuda.synchronize()
                spans = time_ms(graph.replay, reps, warmup, flush)
                rows.append(row(impl + "+graph", T, spans, bytes_touched, rel_err(static_out, ref), "yes", note))
            except Exception as exc:
                print(f"skipped: {impl}+graph at T={T}: capture failed: {exc.__class__.__name__}: "
                      f"{str(exc).splitlines()[0][:120]}")
    return rows


ROWS_CANDIDATES = [(2, 256, 4), (2, 512, 4), (4, 128, 4), (4, 256, 2), (4, 256, 4), (4, 256, 8), (4, 512, 4),
                   (8, 128, 4), (8, 256, 4), (8, 512, 4), (16, 128, 4), (16, 256, 4), (16, 256, 8), (32, 128, 4),
                   (32, 64, 2)]


def rows_sweep(moe: MoE, weights: fm.ExpertWeights, tokens, reps, warmup, flush, shared: bool = False) -> list[dict]:
    """The per-row decode kernels (``fast_moe_triton.routed_experts_rows``) under each tile candidate:
    one kernel's tiles varied at a time, the other's at the default; each call graph-captured.
    ``shared``: the layer's shared expert runs as extra rows (as with linear_impl=fused); its weight
    bytes count among those read and the reference adds its output."""
    from harness.kernels import fast_moe_triton as fmt
    dev = weights.gate_up.device
    sh = moe.shared_experts
    fold = (torch.cat([sh.gate_proj.weight, sh.up_proj.weight]).detach(), sh.down_proj.weight.detach()) if shared else None
    shared_bytes = sum(t.numel() * t.element_size() for t in fold) if shared else 0
    base = fmt.RowsConfig()
    configs = [("default", base)]
    configs += [(f"gate_up={c}", fmt.RowsConfig(gate_up=c, down=base.down)) for c in ROWS_CANDIDATES if c != base.gate_up]
    configs += [(f"down={c}", fmt.RowsConfig(gate_up=base.gate_up, down=c)) for c in ROWS_CANDIDATES if c != base.down]
    rows = []
    for T in tokens:
        gen = torch.Generator(device=dev).manual_seed(T)
        x = torch.randn(T, weights.hidden, device=dev, generator=gen).to(torch.bfloat16)
        ids, w = moe.gate(x)
        if ids.numel() > fmt.ROWS_KERNEL_MAX:
            continue
        bytes_touched = torch.unique(ids).numel() * weights.bytes_per_expert() + shared_bytes
        with torch.no_grad():
            ref = moe.moe_infer(x, ids, w) + (sh(x) if shared else 0)
        for label, cfg in configs:
            def call(cfg=cfg):
                return fmt.routed_experts_rows(x, ids, w, weights, cfg, shared=fold)
            try:
                graph, out = capture(call)
                spans = time_ms(graph.replay, reps, warmup, flush)
            except Exception as exc:  # a tile that does not compile: report and go on
                print(f"skipped: rows {label} at T={T}: {exc.__class__.__name__}: {str(exc).splitlines()[0][:120]}")
                continue
            rows.append(row("rows+shared+graph" if shared else "rows+graph", T, spans, bytes_touched,
                            rel_err(out, ref), "yes", label))
    return rows


BLOCK_CANDIDATES = [(bm, bn, bk, w, st) for bm in (16,) for bn in (32, 64, 128) for bk in (64, 128, 256)
                    for w in (4, 8) for st in (3, 4)]


def blocks_sweep(moe: MoE, weights: fm.ExpertWeights, tokens, reps, warmup, flush) -> list[dict]:
    """The sorted, blocked kernels (``fast_moe_triton.routed_experts_triton`` with an explicit
    ``TritonMoEConfig``: row alignment, gate_up, down and the sum over k) under each (block_m,
    block_n, block_k, num_warps, num_stages) of ``BLOCK_CANDIDATES``, each call graph-captured; the
    first row is ``default_triton_config``'s choice."""
    from harness.kernels import fast_moe_triton as fmt
    from harness.kernels.moe_blocks import TritonMoEConfig, default_triton_config
    dev = weights.gate_up.device
    rows = []
    for T in tokens:
        gen = torch.Generator(device=dev).manual_seed(T)
        x = torch.randn(T, weights.hidden, device=dev, generator=gen).to(torch.bfloat16)
        ids, w = moe.gate(x)
        bytes_touched = torch.unique(ids).numel() * weights.bytes_per_expert()
        with torch.no_grad():
            ref = moe.moe_infer(x, ids, w)
        base = default_triton_config(ids.numel(), weights.num_experts)
        configs = [("default " + str(tuple(vars(base).values())), base)]
        configs += [(str(c), TritonMoEConfig(*c)) for c in BLOCK_CANDIDATES]
        print(f"T={T}: {torch.unique(ids).numel()} experts touched")
        for label, cfg in configs:
            def call(cfg=cfg):
                return fmt.routed_experts_triton(x, ids, w, weights, cfg)
            try:
                graph, out = capture(call)
                spans = time_ms(graph.replay, reps, warmup, flush)
            except Exception as exc:  # a tile that does not compile or fit: report and go on
                print(f"skipped: blocks {label} at T={T}: {exc.__class__.__name__}: {str(exc).splitlines()[0][:120]}")
                continue
            rows.append(row("blocks+graph", T, spans, bytes_touched, rel_err(out, ref), "yes", label))
    return rows


def check_fp32(moe32: MoE, weights32: fm.ExpertWeights, tokens) -> None:
    dev = weights32.gate_up.device
    print("\nfp32 parity against the vendor loop (rel_err <= 1e-5):")
    for impl in fm.IMPLEMENTATIONS:
        ok, reason = availability(impl, dev, torch.float32)
        if not ok:
            print(f"  skipped: {impl} fp32: {reason}")
            continue
        for T in tokens:
            gen = torch.Generator(device=dev).manual_seed(T)
            x = torch.randn(T, weights32.hidden, device=dev, generator=gen)
            ids, w = moe32.gate(x)
            err = rel_err(fm.routed_experts(x, ids, w, weights32, impl), moe32.moe_infer(x, ids, w))
            print(f"  {impl:<10} T={T:<4} rel_err={err:.2e} {'ok' if err <= FP32_TOL else 'FAIL'}")


def print_table(rows: list[dict]) -> None:
    print(f"\n{'impl':<18}{'T':>5}{'ms_med':>10}{'ms_p90':>10}{'GB/s':>9}{'rel_err':>10}  {'':<4}  "
          f"{'no_sync':<10} note")
    for r in rows:
        err = "" if r["rel_err"] is None else f"{r['rel_err']:.2e}"
        print(f"{r['impl']:<18}{r['T']:>5}{r['ms_med']:>10.4f}{r['ms_p90']:>10.4f}{r['GB_s']:>9.0f}{err:>10}  "
              f"{r['ok']:<4}  {r['no_sync'][:10]:<10} {r['note']}")
    print("ms: measured (CUDA events, median / p90); GB/s: derived (touched experts' weight bytes / ms_med); "
          "rel_err: measured vs vendor_loop, bf16")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 300])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--csv", default=None, help="also write the table here")
    ap.add_argument("--no-fp32", action="store_true", help="skip the fp32 parity section")
    ap.add_argument("--rows-sweep", action="store_true",
                    help="only time the per-row decode kernels under each tile candidate (T*k <= 16)")
    ap.add_argument("--blocks-sweep", action="store_true",
                    help="only time the sorted, blocked kernels under each (block_m, block_n, block_k, warps, "
                         "stages) of BLOCK_CANDIDATES")
    ap.add_argument("--shared", action="store_true",
                    help="with --rows-sweep: the shared expert as extra rows of the kernels (linear_impl=fused)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("skipped: all: no CUDA device (this is a device script)")
        return 1
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not importable"
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(dev)} sm{''.join(map(str, torch.cuda.get_device_capability(dev)))}, "
          f"torch {torch.__version__}, triton {triton_version}")
    moe32 = build_layer(args.seed)
    moe = copy.deepcopy(moe32).to(device=dev, dtype=torch.bfloat16)
    weights = fm.stack_experts(moe)
    print(f"experts: {weights.num_experts} x (gate_up {tuple(weights.gate_up.shape[1:])} + down "
          f"{tuple(weights.down.shape[1:])}) bf16, {weights.bytes_per_expert() / 1e6:.2f} MB per expert")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)
    if args.blocks_sweep:
        rows = blocks_sweep(moe, weights, args.tokens, args.reps, args.warmup, flush)
        print_table(sorted(rows, key=lambda r: (r["T"], r["ms_med"])))
        return 0
    if args.rows_sweep:
        print_table(rows_sweep(moe, weights, args.tokens, args.reps, args.warmup, flush, args.shared))
        return 0
    rows = bench_bf16(moe, weights, args.tokens, args.reps, args.warmup, flush)
    print_table(rows)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    if not args.no_fp32:
        del moe, weights
        moe32 = moe32.to(dev)
        check_fp32(moe32, fm.stack_experts(moe32), [1, 64, 300])
    return 0


if __name__ == "__main__":
    sys.exit(main())
