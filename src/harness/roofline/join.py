"""The roofline join: measured stage (and op-family) times x analytic FLOPs and bytes.

Inputs (``harness.rundir.RunData``: what a run measured, in memory or read back once)
--------------------------------------------------------------------------------------
* the measured stages (``harness.measure.summary.Summary.stages`` of ``stages.csv``): per case x
  stage the median span of the timed repeats (``time_ms``: GPU span from CUDA events, or the host
  span on a CPU run) with its spread, kernel busy time from the profiled request and idle =
  max(span - busy, 0) (``idle_basis`` says so); the ``request`` row carries the median request's
  TTFT/TPOT/tok/s.
* ``kernels.csv`` (``harness.schema.kernels``): kernel busy ms per op family (``ops``).
* ``routing.csv`` and ``routing_steps.csv`` (``harness.schema.routing``): measured MoE routing; it
  sets the experts touched in the analytic MoE weight bytes (prefill per layer; decode per layer
  and step: the union over the batch's rows of each step, summed over the steps, from the per-step
  file, which every execution writes; without it exact for batch 1 and the uniform expectation per
  step for batch > 1). The ``routing`` column names the
  source (``ROUTING_SOURCES``); where decode used the expectation, the MBU cell says
  "expected routing" (``expected_routing``).
* ``manifest.json``: model config, dtype, cases (``layout.Case.to_dict``), device.

Analytic side: ``analytic_for_case`` (``harness.analytic.workload_costs`` of one ``layout.Case`` with
its measured routing; the run calls it as each case finishes, ``analytic_for_run`` for a run read
back from disk). It adds ``bytes_kv_copy_read`` / ``bytes_kv_copy_write``: the part of the KV
bytes that only the cache's own copies move (growing cache minus static cache), which the op
families book to ``kv_cache``. ``harness.roofline.table.roofline_table`` puts the stage rows and
the op-family rows (``ops``) together: a pure function of the measured tables, the analytic
frames and the ceilings.

Conventions of every roofline column (``harness.schema.roofline``; math in ``roofline.point``)
------------------------------------------------------------------------------------
* ``tensor_flops`` (FLOP, analytic): matmul / conv / attention FLOPs the chosen attention kernel
  executes (fused kernels: causal half in prefill). This is the FLOP count of
  ``achieved_tflops``, ``intensity`` and the compute floor. ``flops_useful`` (causal, unpadded
  windows) is the FLOP count of MFU. ``vector_flops`` are shown, never put against the tensor peak.
* ``bytes`` (B, analytic): minimum DRAM traffic of the analytic execution model (weights once
  per call, MoE experts touched, activations in/out per kernel family, KV read and written).
* ``intensity`` = tensor_flops / bytes (FLOP/B); ``ridge`` = peak FLOP/s / bandwidth (FLOP/B).
* ``achieved_tflops`` / ``achieved_gbs`` (derived): analytic work / measured span, not measured traffic.
* ``floor_ms`` (derived) = max(tensor_flops / peak, bytes / bandwidth); ``efficiency`` = floor_ms /
  measured_ms (the span), ``efficiency_busy`` = floor_ms / kernel_busy_ms. ``*_cal`` columns use
  the calibrated ceilings instead of the dense datasheet ones; an unknown device has no datasheet
  columns. The ``request`` row's floor is the sum of its stages' floors (stages run one after
  another).
* ``above_ceiling`` (``roofline.flags``): the efficiency, MFU and MBU columns above 1.0 with what to
  check; roofline.csv keeps such a value only in this note (the column itself is left empty).
* ``bound`` (``roofline.point.classify``, from the ``idle_fraction`` of the same row):
  ``launch/host`` when idle > 50% of the span; else ``compute`` when intensity >= ridge,
  ``memory`` below (datasheet ridge, else calibrated; ``bound_basis`` says which); ``overhead``
  for an op family without analytic work.
* ``mfu`` (sam, clip, projector, prefill) = flops_useful / measured / peak.
  ``mbu`` (decode) = (weight bytes of the experts actually touched + KV-cache bytes the attention
  reads, ``mbu_bytes``) / measured / bandwidth; the growing cache's extra copy traffic is excluded
  (it is counted in ``bytes`` but is not needed work).
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Optional

import pandas as pd

from ..analytic import workload_costs
from ..anatomy.registry import OP_GROUP_NAMES, op_group_families
from ..config import CostModelConfig, from_dict
from ..errors import HarnessError
from ..rundir import RunData
from ..schema.analytic import KV_COPY_COLUMNS
from ..schema.roofline import ROOFLINE_COLUMNS, ROOFLINE_TEXT
from ..schema.routing import routing_arrays, routing_step_array
from ..schema.manifest import Manifest
from ..anatomy.stages import STAGES, VISION_STAGES as VISION
from .point import LAUNCH_BOUND_IDLE, _f, classify, floor_ms, mbu, mfu, roofline_point
from ..layout import Case
from .specs import Peaks

MFU_STAGES = VISION + ("prefill",)
MBU_STAGES = ("decode",)

# op group -> (kernel categories, analytic families). Kernel categories are
# harness.measure.kernels.CATEGORIES (used to group kernels of runs without module attribution);
# each family's group comes from harness.anatomy.registry. Every kernel category and every
# analytic family appears exactly once (tests check it).
_CATEGORIES = {"matmul": ("gemm", "conv", "attention"), "norm": ("norm",),
               "elementwise": ("activation/elementwise", "softmax/reduce"),
               "memory/routing": ("copy/cast", "memset", "moe routing/indexing"), "other": ("other",)}
OP_GROUPS = OrderedDict((g, (_CATEGORIES.get(g, ()), op_group_families(g))) for g in OP_GROUP_NAMES)
CATEGORY_GROUP = {c: g for g, (cats, _) in OP_GROUPS.items() for c in cats}
FAMILY_GROUP = {f: g for g, (_, fams) in OP_GROUPS.items() for f in fams}

SUM_COLS = ("tensor_flops", "flops_useful", "flops_counted", "vector_flops", "bytes", "bytes_weights", "bytes_kv_read",
            "bytes_kv_write")

# ---------------------------------------------------------------------------- analytic side

def run_cases(manifest: dict) -> list:
    """The ``layout.Case`` of every case a run measured (its manifest entries, read back)."""
    return [Case.from_dict(e) for e in Manifest.of(manifest).cases]


def model_config(manifest: dict):
    """(CostModelConfig of the run: its ``model`` and ``execution``, note): keys this version does not
    know are dropped, with a note."""
    man = Manifest.of(manifest)
    raw = {**man.model_config, **man.execution_config}
    try:
        return from_dict(CostModelConfig, raw), None
    except HarnessError as exc:
        return from_dict(CostModelConfig, raw, strict=False), f"model config: {exc}"



#: the analytic frame's (and roofline row's) ``routing``: where the MoE weight bytes' experts come from
ROUTING_SOURCES = {
    "per_step": "measured per step",                                   # prefill per layer, decode per step
    "batch1": "measured (batch 1: top-k experts every step)",          # decode summed: exact at batch 1
    "decode_expected": "measured prefill; decode: expected routing",   # batch > 1 without per-step counts
    "expected": "expected routing",                                    # no counts: the uniform expectation
}
EXPECTED_ROUTING = "expected routing"


def expected_routing(source) -> bool:
    """Whether a ``routing`` source put the uniform expectation in the decode MoE bytes."""
    return isinstance(source, str) and source.endswith(EXPECTED_ROUTING)


def _kv_copy(df: pd.DataFrame, static: pd.DataFrame) -> pd.DataFrame:
    """``df`` with KV_COPY_COLUMNS: its KV bytes minus those of the static-cache execution model."""
    keys = ["stage", "family", "variant", "step", "cache_len"]
    s = static[keys + ["bytes_kv_read", "bytes_kv_write"]].rename(
        columns={"bytes_kv_read": "_r", "bytes_kv_write": "_w"})
    m = df.merge(s, on=keys, how="left")
    df = df.copy()
    read, write = KV_COPY_COLUMNS
    df[read] = (m["bytes_kv_read"] - m["_r"].fillna(m["bytes_kv_read"])).clip(lower=0).to_numpy()
    df[write] = (m["bytes_kv_write"] - m["_w"].fillna(m["bytes_kv_write"])).clip(lower=0).to_numpy()
    return df


def analytic_for_case(case, cfg, dtype: str, routing: Optional[dict]) -> tuple:
    """(analytic frame: ``harness.analytic`` COLUMNS + ``routing`` (its source, ``ROUTING_SOURCES``) +
    KV_COPY_COLUMNS; decode MBU bytes: weights of the experts touched + KV read under a static cache [B];
    notes) of one measured case. MoE weight bytes follow ``routing`` ({phase: [layers, experts]}, and
    ``decode_steps``: [steps, layers, experts], used at every batch size) where it fits the case; the
    uniform expectation where no count exists."""
    notes = []
    use = None
    source = ROUTING_SOURCES["expected"]
    if routing:
        use = {k: v for k, v in routing.items() if k in ("prefill", "decode")}
        if routing.get("decode_steps") is not None:
            use["decode"] = routing["decode_steps"]
            source = ROUTING_SOURCES["per_step"]
        else:
            source = ROUTING_SOURCES["batch1" if case.batch == 1 else "decode_expected"]
    try:
        df = workload_costs(case, cfg, dtype, False, use)
    except HarnessError as exc:
        notes.append(f"{case.name}: measured routing not usable ({exc}); MoE bytes use the "
                     "uniform-routing expectation")
        use, source = None, ROUTING_SOURCES["expected"]
        df = workload_costs(case, cfg, dtype, False, None)
    df["routing"] = source
    static = workload_costs(case, cfg, dtype, False, use, kv_cache="static")
    df = _kv_copy(df, static)
    needed = dataclasses.replace(cfg, kv_cache="growing", moe_impl="vendor_loop")   # no waste of any kernel
    static = workload_costs(case, needed, dtype, False, use, kv_cache="static")
    t = static[(static["family"] == "TOTAL") & (static["stage"] == "decode")]
    mbu_b = float(t["bytes_weights"].iloc[0] + t["bytes_kv_read"].iloc[0]) if len(t) else None
    return df, mbu_b, notes


def case_model_config(cfg, entry: dict):
    """The model config one manifest case ran: ``cfg`` with the entry's ``execution`` knobs (the
    resolved MoE kernel included)."""
    from ..config import ExecutionConfig

    ex = dict(Manifest.execution_of(entry))
    if ex.get("moe_kernel_resolved"):
        ex["moe_kernel"] = ex["moe_kernel_resolved"]
    known = {f.name for f in dataclasses.fields(ExecutionConfig)}
    return dataclasses.replace(cfg, **{k: v for k, v in ex.items() if k in known})


def analytic_for_run(run: RunData) -> tuple:
    """(analytic DataFrame, {case: MBU bytes}, notes) of a run read back from its directory: its
    cases (and each one's execution) from the manifest, MoE routing from routing.csv and
    routing_steps.csv."""
    man = Manifest.of(run.manifest)
    cfg, note = model_config(man)
    notes = [note] if note else []
    dtype = str(man.dtype or "bf16")
    frames, mbu_bytes = [], {}
    for case, entry in zip(run_cases(man), man.cases):
        routing = routing_arrays(run.routing, case.name, cfg.llm.num_layers)
        steps = routing_step_array(run.routing_steps, case.name, case.decode_steps, cfg.llm.num_layers)
        if routing is not None and steps is not None:
            routing["decode_steps"] = steps
        frame, mbu_b, n = analytic_for_case(case, case_model_config(cfg, entry), dtype, routing)
        frames.append(frame)
        mbu_bytes[case.name] = mbu_b
        notes += n
    return (pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()), mbu_bytes, notes


# ------------------------------------------------------------------------------------ join

def _row(case, stage, level, op_family, tot: dict, peaks: Peaks, m: dict, routing="", note="") -> dict:
    """One roofline row: analytic ``tot`` (SUM_COLS) against the measured fields ``m``
    (timer, measured_ms, gpu_ms, host_ms, measured_min_ms, measured_max_ms, cv, repeats,
    kernel_busy_ms, idle_ms, idle_fraction, idle_basis, kernels, kernel_categories,
    analytic_families, attribution)."""
    pt = roofline_point(tot.get("tensor_flops", 0), tot.get("bytes", 0), m.get("measured_ms"), peaks.peak_tflops,
                        peaks.mem_bw_gbs, peaks.cal_tflops, peaks.cal_gbs, m.get("idle_fraction"),
                        m.get("kernel_busy_ms"))
    r = {c: None for c in ROOFLINE_COLUMNS}
    r.update({"case": case, "stage": stage, "level": level, "op_family": op_family, "routing": routing, "note": note,
              "kernel_categories": "", "analytic_families": "", "attribution": ""})
    r.update({c: tot.get(c) for c in SUM_COLS})
    for c in ("timer", "idle_basis", "kernel_categories", "analytic_families", "attribution"):
        if m.get(c) is not None:
            r[c] = m[c]
    for c in ("measured_ms", "gpu_ms", "host_ms", "measured_min_ms", "measured_max_ms", "cv", "repeats",
              "kernel_busy_ms", "idle_ms", "idle_fraction", "kernels"):
        r[c] = _f(m.get(c))
    r.update(pt)
    return r


def _measured_fields(mr) -> dict:
    get = mr.get if hasattr(mr, "get") else (lambda c: None)
    return {"timer": get("timer"), "measured_ms": get("time_ms"), "gpu_ms": get("gpu_ms"), "host_ms": get("host_ms"),
            "measured_min_ms": get("time_min_ms"), "measured_max_ms": get("time_max_ms"), "cv": get("cv"),
            "repeats": get("repeats"), "kernel_busy_ms": get("busy_ms"), "idle_ms": get("idle_ms"),
            "idle_fraction": get("idle_fraction"), "idle_basis": get("idle_basis"), "kernels": get("kernels")}


def span_note(gpu_ms, host_ms) -> str:
    """Why a stage's GPU span and host span differ by more than half (events on one stream)."""
    g, h = _f(gpu_ms), _f(host_ms)
    if g is None or h is None or not g or not h:
        return ""
    if h > 1.5 * g:
        return ("host span > 1.5x GPU span: the GPU was still busy with the previous stage while this one was "
                "launched, so its GPU span misses that launch time (compare efficiency against busy)")
    if g > 1.5 * h:
        return "GPU span > 1.5x host span: the host ran ahead (GPU-bound; the span holds queued work)"
    return ""


def roofline_frame(rows: list) -> pd.DataFrame:
    """Roofline rows (dicts) as a table of ``ROOFLINE_COLUMNS``: floats except ``ROOFLINE_TEXT``."""
    df = pd.DataFrame(rows, columns=ROOFLINE_COLUMNS)
    return df.astype({c: "float64" for c in ROOFLINE_COLUMNS if c not in ROOFLINE_TEXT})


def join_stages(measured: pd.DataFrame, analytic: pd.DataFrame, peaks: Peaks,
                mbu_bytes: Optional[dict] = None) -> pd.DataFrame:
    """Stage-level roofline rows (``level = stage``): one per measured case x stage, plus
    ``request`` (analytic = sum of the stages, floor = sum of the stage floors)."""
    mbu_bytes = mbu_bytes or {}
    rows = []
    if analytic is None or not len(analytic):
        return roofline_frame([])
    tot = analytic[analytic["family"] == "TOTAL"]
    for case, m in measured.groupby("case", sort=False):
        a = tot[tot["case"] == case]
        if not len(a):
            continue
        routing = str(a["routing"].iloc[0]) if "routing" in a else ""
        floors, floors_cal, sums = [], [], {c: 0.0 for c in SUM_COLS}
        for stage in STAGES:
            ms = m[m["stage"] == stage]
            at = a[a["stage"] == stage]
            if not len(ms) or not len(at):
                continue
            mr, ar = ms.iloc[0], at.iloc[0].to_dict()
            for c in SUM_COLS:
                sums[c] += float(ar.get(c) or 0.0)
            note = "; ".join(n for n in ("host timer" if mr["timer"] == "host" else "",
                                         span_note(mr.get("gpu_ms"), mr.get("host_ms"))) if n)
            r = _row(case, stage, "stage", "", ar, peaks, _measured_fields(mr), routing, note)
            if stage in MFU_STAGES:
                r["mfu"] = mfu(ar["flops_useful"], r["measured_ms"], peaks.peak_tflops)
                r["mfu_cal"] = mfu(ar["flops_useful"], r["measured_ms"], peaks.cal_tflops)
            if stage in MBU_STAGES and case in mbu_bytes:
                r["mbu_bytes"] = mbu_bytes[case]
                r["mbu"] = mbu(mbu_bytes[case], r["measured_ms"], peaks.mem_bw_gbs)
                r["mbu_cal"] = mbu(mbu_bytes[case], r["measured_ms"], peaks.cal_gbs)
            floors.append(r["floor_ms"])
            floors_cal.append(r["floor_ms_cal"])
            rows.append(r)
        req = m[m["stage"] == "request"]
        if len(req):
            mr = req.iloc[0]
            r = _row(case, "request", "stage", "", sums, peaks, _measured_fields(mr), routing,
                     "floor = sum of stage floors" + ("; host timer" if mr["timer"] == "host" else ""))
            ms = r["measured_ms"]
            for key, parts, eff, effb in (("floor_ms", floors, "efficiency", "efficiency_busy"),
                                          ("floor_ms_cal", floors_cal, "efficiency_cal", "efficiency_busy_cal")):
                if parts and all(f is not None for f in parts):
                    r[key] = sum(parts)
                    r[eff] = r[key] / ms if ms else None
                    r[effb] = r[key] / r["kernel_busy_ms"] if r["kernel_busy_ms"] else None
            rows.append(r)
    return roofline_frame(rows)


__all__ = ["roofline_frame", "OP_GROUPS", "CATEGORY_GROUP", "FAMILY_GROUP", "SUM_COLS",
           "LAUNCH_BOUND_IDLE", "roofline_point", "floor_ms", "classify", "mfu", "mbu", "span_note", "run_cases",
           "analytic_for_case", "analytic_for_run",
           "join_stages", "model_config", "ROUTING_SOURCES", "EXPECTED_ROUTING", "expected_routing"]
