"""Routed experts on the GPU: the vendor loop (``MoE.moe_infer``) against each sync-free implementation
of ``harness.variants.fast_moe``, at DeepSeek-OCR's sizes (H=1280, I=896, E=64, top-6, bf16).

    python -m harness bench moe [bench.moe.tokens=[1,8,32,64,300]] [bench.moe.reps=50] [bench.moe.warmup=10]
    python -m harness bench moe bench.moe.sweep=rows bench.moe.tokens=[1,2]   # tiles of the decode-size kernels
    python -m harness bench moe bench.moe.sweep=rows bench.moe.shared=true bench.moe.tokens=[1]   # ... with the
                                                                              # shared expert folded in
    python -m harness bench moe bench.moe.sweep=blocks bench.moe.tokens=[32]  # tiles of the sorted, blocked kernels
    python -m harness bench moe bench.moe.sweep=blocks bench.moe.tokens=[36608]  # ... at a prefill of 128 base pages
    python -m harness bench moe bench.moe.sweep=blocks bench.moe.tokens=[32] bench.moe.shared=true \
        bench.moe.routing=balanced        # ... as batch 32 decodes under balanced routing

Self-contained: one MoE layer of ``model.llm``'s shape with random weights (std 0.02, the harness's
init_std), routing from its own fp32 softmax gate on random activations (``routing=balanced``: each
token's k experts drawn uniformly without repeats, seeded by T, as ``workload.routing=balanced``
spreads a batch; the gate's weights kept). For each T and
implementation the ``moe`` table gives:

- per call / p90 (measured): CUDA events around one call, median and 90th percentile over ``reps``.
  Before each rep a 256 MiB buffer is zeroed (L2 flushed, so weights come from HBM) and the device
  is synchronised, so each rep starts on an idle queue: launch overhead and host syncs count, as in
  an eager decode step.
- GB/s (derived): weight bytes of the experts the routing touches (each read once) / ms.
- rel err (measured): max |out - vendor| / max |vendor| in bf16; ``ok`` when <= 2e-2.
- sync-free (measured): one call under ``torch.cuda.set_sync_debug_mode("error")``.
- rows ``<impl>+graph``: the call captured once in a CUDA graph and replayed (same inputs), when
  capture works; its rel err is the replay's output against the vendor's.

An implementation that cannot run is noted ``skipped: <reason>``. A final table, ``fp32``, checks
fp32 parity (rel err <= 1e-5 against the vendor loop in fp32) where the implementation runs in fp32.
A row beyond its tolerance is a failure of the bench (exit status 1).
"""
from __future__ import annotations

import copy
import statistics

import torch

from .timing import capture, event_ms, first_line, flush_buffer, quantile

BF16_TOL, FP32_TOL = 2e-2, 1e-5
COLUMNS = ["impl", "moe_tokens", "ms_call", "ms_p90", "gbs", "rel_err", "ok", "no_sync", "note"]
ROWS_CANDIDATES = [(2, 256, 4), (2, 512, 4), (4, 128, 4), (4, 256, 2), (4, 256, 4), (4, 256, 8), (4, 512, 4),
                   (8, 128, 4), (8, 256, 4), (8, 512, 4), (16, 128, 4), (16, 256, 4), (16, 256, 8), (32, 128, 4),
                   (32, 64, 2)]
BLOCK_CANDIDATES = [(bm, bn, bk, w, st) for bm in (16,) for bn in (32, 64, 128) for bk in (64, 128, 256)
                    for w in (4, 8) for st in (3, 4)]
#: the blocked kernels' candidates at prefill sizes (more than 32 routed rows per expert on average:
#: ``default_triton_config``'s large-batch branch), where tiles of 64-128 rows fill the tensor cores
LARGE_BLOCK_CANDIDATES = [(bm, bn, bk, w, st) for bm in (64, 128) for bn in (64, 128, 256) for bk in (32, 64)
                          for w in (4, 8) for st in (3, 4)]


def block_candidates(routed_rows: int, experts: int) -> list:
    """``LARGE_BLOCK_CANDIDATES`` where ``default_triton_config`` takes tiles of 64 rows or more, else
    ``BLOCK_CANDIDATES``."""
    from ..kernels.moe_blocks import default_triton_config

    return LARGE_BLOCK_CANDIDATES if default_triton_config(routed_rows, experts).block_m >= 64 else BLOCK_CANDIDATES


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def build_layer(llm, seed: int):
    """One MoE layer of ``llm``'s shape with N(0, 0.02) weights, fp32 on the CPU."""
    from ..models.llm import MoE

    torch.manual_seed(seed)
    moe = MoE(llm, layer_idx=1)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.02)
    return moe


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


def availability(impl: str, device, dtype) -> tuple:
    from ..kernels.availability import triton_available
    from ..variants import fast_moe as fm

    if impl == "grouped_mm":
        return fm.grouped_mm_available(device, dtype)
    if impl == "triton":
        return triton_available(device)
    return True, "pure PyTorch"


def row(impl, T, spans, bytes_touched, err, no_sync, note="") -> dict:
    med = statistics.median(spans)
    return {"impl": impl, "moe_tokens": T, "ms_call": med, "ms_p90": quantile(spans, 0.9),
            "gbs": bytes_touched / med / 1e6, "rel_err": err,
            "ok": "" if err is None else ("ok" if err <= BF16_TOL else "FAIL"), "no_sync": no_sync, "note": note}


def routed(moe, weights, T: int, routing: str = "gate"):
    """(x, ids, w, bytes of the experts touched) of ``T`` random bf16 tokens through the layer's gate;
    ``routing="balanced"``: each token's ids k distinct experts drawn uniformly (seeded by T)."""
    dev = weights.gate_up.device
    gen = torch.Generator(device=dev).manual_seed(T)
    x = torch.randn(T, weights.hidden, device=dev, generator=gen).to(torch.bfloat16)
    ids, w = moe.gate(x)
    if routing == "balanced":
        draw = torch.Generator().manual_seed(T)
        ids = torch.stack([torch.randperm(weights.num_experts, generator=draw)[:ids.shape[1]] for _ in range(T)])
        ids = ids.to(device=dev, dtype=torch.int64)
    return x, ids, w, torch.unique(ids).numel() * weights.bytes_per_expert()   # host-side, outside any timing


def shared_fold(moe, opts) -> tuple:
    """(the shared expert's (gate_up [2S, H], down [H, S]) to fold into the kernels, its weight bytes), or
    (None, 0) without ``opts.shared``."""
    if not opts.shared:
        return None, 0
    sh = moe.shared_experts
    fold = (torch.cat([sh.gate_proj.weight, sh.up_proj.weight]).detach(), sh.down_proj.weight.detach())
    return fold, sum(t.numel() * t.element_size() for t in fold)


def bench_bf16(moe, weights, opts, flush, table, report) -> None:
    from ..variants import fast_moe as fm

    dev, skipped = weights.gate_up.device, set()
    for T in opts.tokens:
        x, ids, w, bytes_touched = routed(moe, weights, T, opts.routing)
        ref = moe.moe_infer(x, ids, w)
        spans = event_ms(lambda: moe.moe_infer(x, ids, w), opts.reps, opts.warmup, flush)
        table.add(**row("vendor_loop", T, spans, bytes_touched, None, sync_free(lambda: moe.moe_infer(x, ids, w)),
                        f"{torch.unique(ids).numel()} experts touched"))
        for impl in fm.IMPLEMENTATIONS:
            ok, reason = availability(impl, dev, torch.bfloat16)
            if not ok:
                if impl not in skipped:
                    report.note(f"skipped: {impl}: {reason}")
                    skipped.add(impl)
                continue

            def call(impl=impl):
                return fm.routed_experts(x, ids, w, weights, impl)
            try:
                out = call()
            except Exception as exc:  # noqa: BLE001 - noted, the other implementations go on
                report.note(f"skipped: {impl} at T={T}: {exc.__class__.__name__}: {exc}")
                continue
            note = ""
            if impl == "triton":
                note = f"block_m={fm.default_triton_config(T * ids.shape[1], weights.num_experts).block_m}"
            spans = event_ms(call, opts.reps, opts.warmup, flush)
            table.add(**row(impl, T, spans, bytes_touched, rel_err(out, ref), sync_free(call), note))
            try:
                graph, static_out = capture(call)
                graph.replay()
                torch.cuda.synchronize()
                spans = event_ms(graph.replay, opts.reps, opts.warmup, flush)
                table.add(**row(impl + "+graph", T, spans, bytes_touched, rel_err(static_out, ref), "yes", note))
            except Exception as exc:  # noqa: BLE001
                report.note(f"skipped: {impl}+graph at T={T}: capture failed: {first_line(exc)}")


def rows_sweep(moe, weights, opts, flush, table, report) -> None:
    """The per-row decode kernels (``fast_moe_triton.routed_experts_rows``) under each tile candidate:
    one kernel's tiles varied at a time, the other's at the default; each call graph-captured.
    ``opts.shared``: the layer's shared expert runs as extra rows (as with linear_impl=fused); its
    weight bytes count among those read and the reference adds its output."""
    from ..kernels import fast_moe_triton as fmt

    sh = moe.shared_experts
    fold, shared_bytes = shared_fold(moe, opts)
    base = fmt.RowsConfig()
    configs = [("default", base)]
    configs += [(f"gate_up={c}", fmt.RowsConfig(gate_up=c, down=base.down)) for c in ROWS_CANDIDATES
                if c != base.gate_up]
    configs += [(f"down={c}", fmt.RowsConfig(gate_up=base.gate_up, down=c)) for c in ROWS_CANDIDATES if c != base.down]
    for T in opts.tokens:
        x, ids, w, bytes_touched = routed(moe, weights, T, opts.routing)
        if ids.numel() > fmt.ROWS_KERNEL_MAX:
            report.note(f"skipped: rows at T={T}: {ids.numel()} rows > {fmt.ROWS_KERNEL_MAX}")
            continue
        with torch.no_grad():
            ref = moe.moe_infer(x, ids, w) + (sh(x) if opts.shared else 0)
        for label, cfg in configs:
            def call(cfg=cfg):
                return fmt.routed_experts_rows(x, ids, w, weights, cfg, shared=fold)
            try:
                graph, out = capture(call)
                spans = event_ms(graph.replay, opts.reps, opts.warmup, flush)
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile: noted, go on
                report.note(f"skipped: rows {label} at T={T}: {first_line(exc)}")
                continue
            table.add(**row("rows+shared+graph" if opts.shared else "rows+graph", T, spans,
                            bytes_touched + shared_bytes, rel_err(out, ref), "yes", label))


def blocks_sweep(moe, weights, opts, flush, table, report) -> None:
    """The sorted, blocked kernels (``fast_moe_triton.routed_experts_triton`` with an explicit
    ``TritonMoEConfig``: row alignment, gate_up, down and the sum over k; ``opts.shared``: the shared
    expert folded in as pseudo-experts) under each (block_m, block_n, block_k, num_warps, num_stages) of
    ``block_candidates`` for both launches; each call graph-captured; the first row is
    ``default_triton_config``'s choice."""
    from ..kernels import fast_moe_triton as fmt
    from ..kernels.moe_blocks import TritonMoEConfig, default_triton_config

    sh = moe.shared_experts
    fold, shared_bytes = shared_fold(moe, opts)
    for T in opts.tokens:
        x, ids, w, bytes_touched = routed(moe, weights, T, opts.routing)
        with torch.no_grad():
            ref = moe.moe_infer(x, ids, w) + (sh(x) if opts.shared else 0)
        base = default_triton_config(ids.numel(), weights.num_experts)
        configs = [("default " + str(tuple(vars(base).values())), base)]
        configs += [(str(c), TritonMoEConfig(*c)) for c in block_candidates(ids.numel(), weights.num_experts)]
        report.note(f"T={T}: {torch.unique(ids).numel()} experts touched ({opts.routing} routing)"
                    + (", the shared expert folded in" if opts.shared else ""))
        impl = "blocks+shared+graph" if opts.shared else "blocks+graph"
        for label, cfg in configs:
            def call(cfg=cfg):
                return fmt.routed_experts_triton(x, ids, w, weights, cfg, shared=fold)
            try:
                graph, out = capture(call)
                spans = event_ms(graph.replay, opts.reps, opts.warmup, flush)
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile or fit: noted, go on
                report.note(f"skipped: blocks {label} at T={T}: {first_line(exc)}")
                continue
            table.add(**row(impl, T, spans, bytes_touched + shared_bytes, rel_err(out, ref), "yes", label))
    table.rows.sort(key=lambda r: (r["moe_tokens"], r["ms_call"]))


def check_fp32(moe32, weights32, tokens, report) -> None:
    from ..variants import fast_moe as fm

    dev = weights32.gate_up.device
    table = report.table("fp32", "fp32 parity against the vendor loop (rel err <= 1e-5)",
                         ["impl", "moe_tokens", "rel_err", "ok"])
    for impl in fm.IMPLEMENTATIONS:
        ok, reason = availability(impl, dev, torch.float32)
        if not ok:
            report.note(f"skipped: {impl} fp32: {reason}")
            continue
        for T in tokens:
            gen = torch.Generator(device=dev).manual_seed(T)
            x = torch.randn(T, weights32.hidden, device=dev, generator=gen)
            ids, w = moe32.gate(x)
            err = rel_err(fm.routed_experts(x, ids, w, weights32, impl), moe32.moe_infer(x, ids, w))
            table.add(impl=impl, moe_tokens=T, rel_err=err, ok="ok" if err <= FP32_TOL else "FAIL")


def run(cfg, opts, device, report) -> None:
    """The bench (module docstring) on ``device`` (CUDA)."""
    from ..variants import fast_moe as fm

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not importable"
    report.note(f"device: {torch.cuda.get_device_name(device)} "
                f"sm{''.join(map(str, torch.cuda.get_device_capability(device)))}, torch {torch.__version__}, "
                f"triton {triton_version}")
    moe32 = build_layer(cfg.model.llm, opts.seed)
    moe = copy.deepcopy(moe32).to(device=device, dtype=torch.bfloat16)
    weights = fm.stack_experts(moe)
    report.note(f"experts: {weights.num_experts} x (gate_up {tuple(weights.gate_up.shape[1:])} + down "
                f"{tuple(weights.down.shape[1:])}) bf16, {weights.bytes_per_expert() / 1e6:.2f} MB per expert")
    flush = flush_buffer(device)
    title = {None: "routed experts, bf16", "rows": "per-row decode kernels under each tile candidate",
             "blocks": "sorted, blocked kernels under each (block_m, block_n, block_k, warps, stages)"}[opts.sweep]
    table = report.table("moe", title + f" ({opts.reps} reps, L2 flushed)", COLUMNS)
    if opts.sweep == "rows":
        rows_sweep(moe, weights, opts, flush, table, report)
    elif opts.sweep == "blocks":
        blocks_sweep(moe, weights, opts, flush, table, report)
    else:
        bench_bf16(moe, weights, opts, flush, table, report)
        if opts.fp32:
            del moe, weights
            moe32 = moe32.to(device)
            check_fp32(moe32, fm.stack_experts(moe32), [1, 64, 300], report)
    for t in report.tables():
        for r in t.rows:
            if r.get("ok") == "FAIL":
                report.fail(f"{t.name} {r['impl']} T={r['moe_tokens']}: rel err {r['rel_err']:.2e}")
