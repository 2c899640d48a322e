"""SAM, CLIP and the projector on a batch of distinct pages, stage by stage against the compute roof,
and where each stage's time goes by kernel.

    python -m harness bench vision [bench.vision.batch=[32,128]] [bench.vision.executions=[vendor-style,best]]
        [bench.vision.sam_attention=[sdpa,triton-windows,triton]]
    python -m harness bench vision model=tiny device=cpu 'bench.vision.batch=[2]' \\
        'bench.vision.executions=[vendor-style]'          # the plumbing on a CPU (host clock, CPU operators)

The model of ``model`` (random weights, bf16 on CUDA, fp32 on the CPU) runs each named execution's
vision knobs (``vision_impl``, ``vision_compile``, ``sam_attention``; ``conf/execution/``, loaded by
``conf/bench/vision.yaml``; ``sam_attention=[...]`` runs each fused execution once per value) on ``batch`` distinct random global views of ``mode`` (one view per page;
crop modes, whose pages add tiles, are refused). Each stage is called as ``encode_view`` calls it:
sam on the pixels, clip on sam's output, the projector on both.

* ``vision_stages`` (one row per execution, batch and stage): ms per call (measured: CUDA events
  around the stage's call, after ``warmup`` untimed passes that compile and capture; median, min and
  max over ``reps`` passes; the host clock on the CPU); TFLOP/s useful (derived: the stage's analytic
  useful FLOPs for ``batch`` pages, ``harness.analytic``, / ms); MFU (derived: TFLOP/s / the device's
  dense datasheet peak in bf16, ``roofline.specs``; empty where there is none).
* ``vision_kernels``: one more pass under ``measure.kernels.KernelCapture``, the stage's kernels by category
  (``measure.kernels.categorize``): count (measured), total ms (measured, kernel durations) and the
  share of the stage's kernel time (derived). On the CPU the rows are CPU operators (self time).
* ``vision_top_kernels``: the ``top`` longest kernels of each stage by total time, same columns.

An execution that cannot run here (``vision_compile`` without CUDA) is a note, not a row.
"""
from __future__ import annotations

import statistics
from collections import defaultdict

import torch

from ..errors import HarnessError
from .timing import event_ms
from .verb import named_execution

STAGES = ("sam", "clip", "projector")
STAGE_COLUMNS = ["execution", "batch", "stage", "ms_call", "ms_min", "ms_max", "tflops_useful", "mfu_sheet"]
KERNEL_COLUMNS = ["execution", "batch", "stage", "category", "kernels", "total_ms", "busy_share"]
TOP_COLUMNS = ["execution", "batch", "stage", "kernel", "kernels", "total_ms", "busy_share"]


def useful_flops(model_cfg, mode, batch: int) -> dict:
    """{stage: analytic useful FLOPs of ``batch`` global views of ``mode``} (``analytic.useful_flops``)."""
    from ..analytic import useful_flops as flops
    from ..layout import Case

    totals = flops(Case(mode, None, batch, 0, 1, "vision"), model_cfg)
    return {s: totals[s] for s in STAGES}


def stage_calls(model, pixels: torch.Tensor) -> list:
    """[(stage, call)]: sam, clip and projector as ``DeepseekOCR.encode_view`` chains them, each a
    callable of no arguments (the earlier stages' outputs kept from the first run)."""
    m = model.model
    with torch.inference_mode():
        sam_out = m.sam_model(pixels)
        clip_out = m.vision_model(sam_out)
    return [("sam", lambda: m.sam_model(pixels)), ("clip", lambda: m.vision_model(sam_out)),
            ("projector", lambda: m.projector(clip_out, sam_out))]


def kernel_times(call, cuda: bool) -> dict:
    """{kernel name: [count, total ms]} of one ``call`` under ``KernelCapture`` (``measure.kernels.kernel_sums``:
    CUDA kernels; on the CPU, CPU operators by self time)."""
    from ..measure.kernels import KernelCapture, kernel_sums

    with KernelCapture(cuda) as prof:
        call()
    return kernel_sums(prof, cuda)


def vision_executions(cfg, opts) -> list:
    """[(row name, ExecutionConfig of its vision knobs)]: each named execution, and for one with
    ``vision_impl=fused`` once per value of ``opts.sam_attention`` (rows ``best sam=triton``) when given."""
    from ..config import ExecutionConfig
    from ..knobs import only_in

    out = []
    for name in opts.executions:
        named = named_execution(cfg, name)
        vision = {k: getattr(named, k) for k in only_in("vision")}
        sweep = bool(opts.sam_attention) and named.vision_impl == "fused"
        for value in opts.sam_attention if sweep else [named.sam_attention]:
            out.append((f"{name} sam={value}" if sweep else name, ExecutionConfig(**{**vision, "sam_attention": value})))
    return out


def run(cfg, opts, device, report) -> None:
    """The bench (module docstring) on ``device``."""
    from .. import variants
    from ..config import ExecutionConfig
    from ..layout import get_mode
    from ..measure.kernels import categorize
    from ..models.build import build_model
    from ..roofline.point import mfu
    from ..roofline.specs import device_name_of, resolve_peaks
    from ..setup import device_info

    mode = get_mode(opts.mode)
    if mode.crop:
        raise HarnessError(f"bench vision times one global view per page; mode {mode.name} adds tiles",
                           "use a mode without crop (tiny, small, base, large)")
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    peak = resolve_peaks(device_name_of(device_info(device)), "bf16").peak_tflops if cuda else None
    model = build_model(cfg.model, device, dtype, seed=cfg.workload.seed)
    side = mode.image_size
    stages = report.table("vision_stages", f"vision stages, {mode.name} views of {side} px, {dtype}", STAGE_COLUMNS)
    cats = report.table("vision_kernels", "kernels by category (one profiled pass)", KERNEL_COLUMNS)
    tops = report.table("vision_top_kernels", f"the {opts.top} longest kernels of each stage", TOP_COLUMNS)
    gen = torch.Generator(device="cpu").manual_seed(cfg.workload.seed)
    flops_of = {batch: useful_flops(model.cfg, mode, batch) for batch in opts.batch}
    for name, ex in vision_executions(cfg, opts):
        try:
            variants.apply(model, ex, device)
        except HarnessError as e:
            report.note(f"{name}: not run here: {e}")
            continue
        for batch in opts.batch:
            pixels = torch.randn(batch, 3, side, side, generator=gen).to(device, dtype)
            flops = flops_of[batch]
            calls = stage_calls(model, pixels)
            with torch.inference_mode():
                for stage, call in calls:
                    ms = event_ms(call, opts.reps, opts.warmup, cuda=cuda)
                    med = statistics.median(ms)
                    stages.add(execution=name, batch=batch, stage=stage, ms_call=med, ms_min=min(ms), ms_max=max(ms),
                               tflops_useful=flops[stage] / med / 1e9 if med > 0 else None,
                               mfu_sheet=mfu(flops[stage], med, peak))
                    kern = kernel_times(call, cuda)
                    busy = sum(t for _, t in kern.values()) or None
                    by_cat = defaultdict(lambda: [0, 0.0])
                    for k, (n, t) in kern.items():
                        by_cat[categorize(k)][0] += n
                        by_cat[categorize(k)][1] += t
                    for c, (n, t) in sorted(by_cat.items(), key=lambda kv: -kv[1][1]):
                        cats.add(execution=name, batch=batch, stage=stage, category=c, kernels=n, total_ms=t,
                                 busy_share=t / busy if busy else None)
                    for k, (n, t) in sorted(kern.items(), key=lambda kv: -kv[1][1])[:opts.top]:
                        tops.add(execution=name, batch=batch, stage=stage, kernel=k[:120], kernels=n, total_ms=t,
                                 busy_share=t / busy if busy else None)
            del pixels, calls
            if cuda:
                torch.cuda.empty_cache()
    variants.apply(model, ExecutionConfig(), device)
    report.note("ms per call: the stage alone, inputs already on the device (the earlier stages' outputs kept); "
                "MFU: analytic useful FLOPs / ms / the dense datasheet peak (bf16). Kernel rows come from one "
                "profiled pass: their total can differ from ms per call (the profiler's own cost, launch gaps).")
