"""The roofline join: measured stage (and kernel-category) times x analytic FLOPs and bytes.

Inputs (``harness.rundir.RunData``: what a run measured, in memory or read back once)
--------------------------------------------------------------------------------------
* ``stages.csv`` (``harness.measure.summarize.STAGE_COLUMNS``): the ``median`` aggregate row of
  each case x stage with ``call == 'all'`` gives the measured time (``gpu_ms`` from CUDA events;
  on a CPU run ``host_ms``, flagged ``timer = host``). Falls back to repeat 0 when a run has no
  aggregates. The idle fraction comes from the ``profiled`` request (idle_ms / its own span),
  else from the median row.
* ``kernels.csv`` (``KERNEL_COLUMNS`` + ``case``): kernel busy ms per case x stage x category
  (union of the kernels' intervals) for the op-family level.
* ``routing.csv`` (case, phase, layer, e0..eN): measured MoE routing counts; they set the
  experts touched in the analytic MoE weight bytes (prefill: exact per layer; decode: per step
  exact for batch 1, uniform-routing expectation per step otherwise).
* ``manifest.json``: model config, dtype, cases (``workload.Case.to_dict``), device.

Analytic side: ``analytic_for_case`` (``harness.analytic.workload_costs`` of one ``workload.Case`` with
its measured routing; the run calls it as each case finishes, ``analytic_for_run`` for a run read
back from disk). ``roofline_table`` is a pure function of the measured tables, the analytic frames
and the ceilings.

Conventions of every roofline column (``ROOFLINE_COLUMNS``)
-----------------------------------------------------------
* ``tensor_flops`` (FLOP): matmul / conv / attention FLOPs the chosen attention kernel executes
  (fused kernels: causal half in prefill). This is the FLOP count of ``achieved_tflops``,
  ``intensity`` and the compute floor. ``flops_useful`` (causal, unpadded windows) is the FLOP
  count of MFU. ``vector_flops`` are shown, never put against the tensor peak.
* ``bytes`` (B): minimum DRAM traffic of the analytic execution model (weights once per call,
  MoE experts touched, activations in/out per kernel family, KV read and written).
* ``intensity`` = tensor_flops / bytes (FLOP/B); ``ridge`` = peak FLOP/s / bandwidth (FLOP/B).
* ``floor_ms`` = max(tensor_flops / peak, bytes / bandwidth); ``efficiency`` = floor_ms /
  measured_ms (1.0 = at the roofline). ``*_cal`` columns use the calibrated ceilings
  (``python -m harness calibrate``) instead of the dense datasheet ones; an unknown device has
  no datasheet columns. The ``request`` row's floor is the sum of its stages' floors (stages
  run one after another).
* ``bound``: ``launch/host`` when idle_ms > 50% of the stage time (the GPU waited on the host);
  else ``compute`` when intensity >= ridge, ``memory`` below (datasheet ridge, else calibrated;
  ``bound_basis`` says which).
* ``mfu`` (sam, clip, projector, prefill) = flops_useful / measured / peak.
  ``mbu`` (decode) = (weight bytes of the experts actually touched + KV-cache bytes the attention
  reads, ``mbu_bytes``) / measured / bandwidth; the growing cache's extra copy traffic is excluded
  (it is counted in ``bytes`` but is not needed work).

Op families (``level = op_family``): kernel categories (``harness.measure.kernels.CATEGORIES``)
and analytic families are joined through ``OP_GROUPS``. The analytic attention families
include their q/k/v/o projection GEMMs and 1x1 convs often run as GEMM kernels, so GEMM,
convolution and attention kernels form one ``matmul`` group; elementwise/softmax kernels have
no analytic counterpart (the analytic model fuses them into the neighbouring GEMM/attention), so
their time is reported as overhead with no floor. The measured time of an op-family row is its
kernel busy time in the profiled request.
"""
from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from typing import Optional

import numpy as np
import pandas as pd

from ..analytic.registry import OP_GROUP_NAMES, op_group_families
from ..errors import HarnessError
from ..measure.summarize import busy_ms
from ..rundir import RunData, load_run
from ..stages import STAGES, VISION_STAGES as VISION
from .specs import Peaks

MFU_STAGES = VISION + ("prefill",)
MBU_STAGES = ("decode",)
LAUNCH_BOUND_IDLE = 0.5

# op group -> (kernel categories, analytic families). Kernel categories are
# harness.measure.kernels.CATEGORIES; each family's group comes from harness.analytic.registry.
# Every kernel category and every analytic family appears exactly once (tests check it).
_CATEGORIES = {"matmul": ("gemm", "conv", "attention"), "norm": ("norm",),
               "elementwise": ("activation/elementwise", "softmax/reduce"),
               "memory/routing": ("copy/cast", "memset", "moe routing/indexing"), "other": ("other",)}
OP_GROUPS = OrderedDict((g, (_CATEGORIES[g], op_group_families(g))) for g in OP_GROUP_NAMES)
CATEGORY_GROUP = {c: g for g, (cats, _) in OP_GROUPS.items() for c in cats}
FAMILY_GROUP = {f: g for g, (_, fams) in OP_GROUPS.items() for f in fams}

ROOFLINE_COLUMNS = [
    "case", "stage", "level", "op_family", "kernel_categories", "analytic_families", "timer",
    "measured_ms", "kernel_busy_ms", "idle_ms", "idle_fraction", "kernels",
    "tensor_flops", "flops_useful", "flops_counted", "vector_flops", "bytes", "bytes_weights", "bytes_kv_read",
    "intensity", "achieved_tflops", "achieved_gbs",
    "peak_tflops", "mem_bw_gbs", "ridge", "floor_ms", "efficiency",
    "cal_tflops", "cal_gbs", "cal_ridge", "floor_ms_cal", "efficiency_cal",
    "bound", "bound_basis", "mfu", "mfu_cal", "mbu", "mbu_cal", "mbu_bytes", "routing", "note",
]


# ----------------------------------------------------------------------------------- the math

def _f(x) -> Optional[float]:
    if x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def floor_ms(flops, bytes_, peak_tflops, bw_gbs) -> Optional[float]:
    """max(flops / peak, bytes / bandwidth) in ms; None when a needed ceiling is missing."""
    flops, bytes_ = _f(flops) or 0.0, _f(bytes_) or 0.0
    parts = []
    if flops > 0:
        if not _f(peak_tflops):
            return None
        parts.append(flops / (peak_tflops * 1e12) * 1e3)
    if bytes_ > 0:
        if not _f(bw_gbs):
            return None
        parts.append(bytes_ / (bw_gbs * 1e9) * 1e3)
    return max(parts) if parts else 0.0


def classify(intensity, ridge, idle_fraction=None) -> str:
    """'launch/host' (idle > 50%), 'compute' (intensity >= ridge), 'memory', or 'unknown'."""
    idle = _f(idle_fraction)
    if idle is not None and idle > LAUNCH_BOUND_IDLE:
        return "launch/host"
    i, r = _f(intensity), _f(ridge)
    if i is None or r is None:
        return "unknown"
    return "compute" if i >= r else "memory"


def roofline_point(flops, bytes_, measured_ms, peak_tflops=None, bw_gbs=None, cal_tflops=None, cal_gbs=None,
                   idle_fraction=None) -> dict:
    """Achieved rates, intensity, ridges, floors, efficiencies and bound of one measurement.

    flops [FLOP], bytes_ [B], measured_ms [ms], peaks [TFLOP/s], bandwidths [GB/s].
    """
    flops, bytes_, ms = _f(flops) or 0.0, _f(bytes_) or 0.0, _f(measured_ms)
    out = {"intensity": flops / bytes_ if bytes_ > 0 else None,
           "achieved_tflops": flops / ms / 1e9 if ms else None,
           "achieved_gbs": bytes_ / ms / 1e6 if ms else None,
           "peak_tflops": _f(peak_tflops), "mem_bw_gbs": _f(bw_gbs),
           "ridge": Peaks._ridge(_f(peak_tflops), _f(bw_gbs)),
           "cal_tflops": _f(cal_tflops), "cal_gbs": _f(cal_gbs),
           "cal_ridge": Peaks._ridge(_f(cal_tflops), _f(cal_gbs))}
    out["floor_ms"] = floor_ms(flops, bytes_, peak_tflops, bw_gbs) if (_f(peak_tflops) or _f(bw_gbs)) else None
    out["floor_ms_cal"] = floor_ms(flops, bytes_, cal_tflops, cal_gbs) if (_f(cal_tflops) or _f(cal_gbs)) else None
    out["efficiency"] = out["floor_ms"] / ms if (ms and out["floor_ms"] is not None) else None
    out["efficiency_cal"] = out["floor_ms_cal"] / ms if (ms and out["floor_ms_cal"] is not None) else None
    idle = _f(idle_fraction)
    if idle is not None and idle > LAUNCH_BOUND_IDLE:
        out["bound"], out["bound_basis"] = "launch/host", f"idle {idle:.0%} of the stage time"
    elif out["ridge"] is not None:
        out["bound"], out["bound_basis"] = classify(out["intensity"], out["ridge"]), "datasheet ridge"
    elif out["cal_ridge"] is not None:
        out["bound"], out["bound_basis"] = classify(out["intensity"], out["cal_ridge"]), "calibrated ridge"
    else:
        out["bound"], out["bound_basis"] = "unknown", "no ceilings (unknown device, not calibrated)"
    return out


def mfu(flops_useful, measured_ms, peak_tflops) -> Optional[float]:
    """Model FLOP utilisation: flops_useful / time / peak."""
    f, ms, p = _f(flops_useful), _f(measured_ms), _f(peak_tflops)
    if not ms or not p or f is None:
        return None
    return f / (ms * 1e-3) / (p * 1e12)


def mbu(bytes_needed, measured_ms, bw_gbs) -> Optional[float]:
    """Model bandwidth utilisation: bytes that must move / time / bandwidth."""
    b, ms, bw = _f(bytes_needed), _f(measured_ms), _f(bw_gbs)
    if not ms or not bw or b is None:
        return None
    return b / (ms * 1e-3) / (bw * 1e9)


# --------------------------------------------------------------------------- measured side

def _call_all(s: pd.Series) -> pd.Series:
    return s.astype(str).isin(("all", "nan", "None"))


def measured_stages(stages: pd.DataFrame) -> pd.DataFrame:
    """One row per case x stage (the five stages and ``request``): the median of the timed
    repeats (call 'all'), ``time_ms`` = gpu_ms (CUDA events) or host_ms (host timer), and
    ``idle_fraction`` from the profiled request when there is one."""
    cols = ["case", "mode", "grid", "batch", "stage", "timer", "time_ms", "gpu_ms", "host_ms", "kernels", "busy_ms",
            "idle_ms", "idle_fraction", "launches_per_step", "ttft_ms", "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms",
            "decode_tok_s", "e2e_ms", "peak_mem_bytes", "weight_bytes", "kv_cache_bytes", "cv", "repeats",
            "statistic"]
    if stages is None or not len(stages):
        return pd.DataFrame(columns=cols)
    df = stages[_call_all(stages["call"])].copy()
    df["repeat"] = df["repeat"].astype(str)
    rows = []
    for (case, stage), g in df.groupby(["case", "stage"], sort=False):
        timed = g[pd.to_numeric(g["repeat"], errors="coerce").notna()]
        med = g[g["repeat"] == "median"]
        stat = "median"
        if not len(med):
            med, stat = timed.head(1), "repeat 0"
        if not len(med):
            continue
        r = med.iloc[0].to_dict()
        gpu = _f(r.get("gpu_ms"))
        time_ms = gpu if gpu is not None else _f(r.get("host_ms"))
        timer = "cuda_event" if gpu is not None else "host"
        prof = g[g["repeat"] == "profiled"]
        idle_frac = None
        if len(prof):
            p = prof.iloc[0]
            span = _f(p.get("gpu_ms")) or _f(p.get("host_ms"))
            if span and _f(p.get("idle_ms")) is not None:
                idle_frac = min(max(_f(p["idle_ms"]) / span, 0.0), 1.0)
        if idle_frac is None and time_ms and _f(r.get("idle_ms")) is not None:
            idle_frac = min(max(_f(r["idle_ms"]) / time_ms, 0.0), 1.0)
        cvrow = g[g["repeat"] == "cv"]
        cv = None
        if len(cvrow):
            cv = _f(cvrow.iloc[0].get("gpu_ms")) if gpu is not None else _f(cvrow.iloc[0].get("host_ms"))
        out = {c: r.get(c) for c in cols if c in r}
        out.update(case=case, stage=stage, timer=timer, time_ms=time_ms, idle_fraction=idle_frac, cv=cv,
                   repeats=len(timed), statistic=stat)
        rows.append(out)
    res = pd.DataFrame(rows, columns=cols)
    return res


def category_busy(kernels: pd.DataFrame) -> pd.DataFrame:
    """Kernel busy ms (interval union), kernel count and summed duration per case x stage x
    category, plus a ``*`` category row per case x stage (all kernels)."""
    cols = ["case", "stage", "category", "kernels", "busy_ms", "sum_ms"]
    if kernels is None or not len(kernels) or "stage" not in kernels:
        return pd.DataFrame(columns=cols)
    k = kernels[kernels["stage"].notna()]
    rows = []
    for (case, stage), g in k.groupby(["case", "stage"], sort=False):
        rows.append({"case": case, "stage": stage, "category": "*", "kernels": len(g), "busy_ms": busy_ms(g),
                     "sum_ms": float(g["dur_ms"].sum())})
        for cat, gc in g.groupby("category", sort=False):
            rows.append({"case": case, "stage": stage, "category": cat, "kernels": len(gc), "busy_ms": busy_ms(gc),
                         "sum_ms": float(gc["dur_ms"].sum())})
    return pd.DataFrame(rows, columns=cols)


# ---------------------------------------------------------------------------- analytic side

def run_cases(manifest: dict) -> list:
    """The ``workload.Case`` of every case a run measured (its manifest entries, read back)."""
    from ..workload import Case

    return [Case.from_dict(e) for e in manifest.get("cases") or []]


def model_config(manifest: dict):
    """(ModelConfig of the run, note): keys this version does not know are dropped, with a note."""
    from ..config import ModelConfig, from_dict

    raw = dict((manifest.get("config") or {}).get("model") or {})
    try:
        return from_dict(ModelConfig, raw), None
    except HarnessError as exc:
        return from_dict(ModelConfig, raw, strict=False), f"model config: {exc}"


def routing_arrays(routing: pd.DataFrame, case: str, num_layers: int) -> Optional[dict]:
    """{'prefill': [layers, experts], 'decode': [layers, experts] (summed over steps)} or None."""
    if routing is None or not len(routing) or case not in set(routing["case"]):
        return None
    r = routing[routing["case"] == case]
    ecols = sorted((c for c in r.columns if c.startswith("e") and c[1:].isdigit()), key=lambda c: int(c[1:]))
    out = {}
    for phase, g in r.groupby("phase"):
        arr = np.zeros((num_layers, len(ecols)), dtype=np.int64)
        for _, row in g.iterrows():
            layer = int(row["layer"])
            if 0 <= layer < num_layers:
                arr[layer] = [int(row[c]) if pd.notna(row[c]) else 0 for c in ecols]
        out[str(phase)] = arr
    return out or None


def analytic_for_case(case, cfg, dtype: str, routing: Optional[dict]) -> tuple:
    """(analytic frame: ``harness.analytic`` COLUMNS + ``routing`` (its source); decode MBU bytes:
    weights of the experts touched + KV read under a static cache [B]; notes) of one measured case.
    MoE weight bytes follow ``routing`` ({phase: [layers, experts]}) where it fits the case."""
    from ..analytic import workload_costs

    notes = []
    source = "measured" if routing else "uniform expectation"
    try:
        df = workload_costs(case, cfg, dtype, False, routing)
    except HarnessError as exc:
        notes.append(f"{case.name}: measured routing not usable ({exc}); MoE bytes use the "
                     "uniform-routing expectation")
        routing, source = None, "uniform expectation"
        df = workload_costs(case, cfg, dtype, False, None)
    if routing and case.batch > 1:
        source = "measured (prefill); decode per-step uniform expectation (batch > 1)"
    df["routing"] = source
    needed = dataclasses.replace(cfg, kv_cache="growing", moe_impl="vendor_loop")   # no waste of any kernel
    static = workload_costs(case, needed, dtype, False, routing, kv_cache="static")
    t = static[(static["family"] == "TOTAL") & (static["stage"] == "decode")]
    mbu = float(t["bytes_weights"].iloc[0] + t["bytes_kv_read"].iloc[0]) if len(t) else None
    return df, mbu, notes


def case_model_config(cfg, entry: dict):
    """The model config one manifest case ran: ``cfg`` with the entry's ``execution`` knobs (the
    resolved MoE kernel included)."""
    from ..config import ExecutionConfig

    ex = dict(entry.get("execution") or {})
    if ex.get("moe_kernel_resolved"):
        ex["moe_kernel"] = ex["moe_kernel_resolved"]
    known = {f.name for f in dataclasses.fields(ExecutionConfig)}
    return dataclasses.replace(cfg, **{k: v for k, v in ex.items() if k in known})


def analytic_for_run(run: RunData) -> tuple:
    """(analytic DataFrame, {case: MBU bytes}, notes) of a run read back from its directory: its
    cases (and each one's execution) from the manifest, MoE routing from routing.csv."""
    man = run.manifest
    cfg, note = model_config(man)
    notes = [note] if note else []
    dtype = str(man.get("dtype") or "bf16")
    frames, mbu_bytes = [], {}
    for case, entry in zip(run_cases(man), man.get("cases") or []):
        frame, mbu_b, n = analytic_for_case(case, case_model_config(cfg, entry), dtype,
                                            routing_arrays(run.routing, case.name, cfg.llm.num_layers))
        frames.append(frame)
        mbu_bytes[case.name] = mbu_b
        notes += n
    return (pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()), mbu_bytes, notes


# ------------------------------------------------------------------------------------ join

def _row(case, stage, level, op_family, cats, fams, timer, ms, busy, idle, idle_frac, nk, tot: dict,
         peaks: Peaks, routing="", note="") -> dict:
    pt = roofline_point(tot.get("tensor_flops", 0), tot.get("bytes", 0), ms, peaks.peak_tflops, peaks.mem_bw_gbs,
                        peaks.cal_tflops, peaks.cal_gbs, idle_frac)
    r = {"case": case, "stage": stage, "level": level, "op_family": op_family, "kernel_categories": cats,
         "analytic_families": fams, "timer": timer, "measured_ms": _f(ms), "kernel_busy_ms": _f(busy),
         "idle_ms": _f(idle), "idle_fraction": _f(idle_frac), "kernels": _f(nk),
         "tensor_flops": tot.get("tensor_flops"), "flops_useful": tot.get("flops_useful"),
         "flops_counted": tot.get("flops_counted"), "vector_flops": tot.get("vector_flops"),
         "bytes": tot.get("bytes"), "bytes_weights": tot.get("bytes_weights"),
         "bytes_kv_read": tot.get("bytes_kv_read"), "routing": routing, "note": note}
    r.update(pt)
    return r


SUM_COLS = ("tensor_flops", "flops_useful", "flops_counted", "vector_flops", "bytes", "bytes_weights", "bytes_kv_read")


def join_stages(measured: pd.DataFrame, analytic: pd.DataFrame, peaks: Peaks,
                mbu_bytes: Optional[dict] = None) -> pd.DataFrame:
    """Stage-level roofline rows (``level = stage``): one per measured case x stage, plus
    ``request`` (analytic = sum of the stages, floor = sum of the stage floors)."""
    mbu_bytes = mbu_bytes or {}
    rows = []
    if analytic is None or not len(analytic):
        return pd.DataFrame(columns=ROOFLINE_COLUMNS)
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
                sums[c] += float(ar[c])
            note = "host timer" if mr["timer"] == "host" else ""
            r = _row(case, stage, "stage", "", "", "", mr["timer"], mr["time_ms"], mr.get("busy_ms"),
                     mr.get("idle_ms"), mr.get("idle_fraction"), mr.get("kernels"), ar, peaks, routing, note)
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
            r = _row(case, "request", "stage", "", "", "", mr["timer"], mr["time_ms"], mr.get("busy_ms"),
                     mr.get("idle_ms"), mr.get("idle_fraction"), mr.get("kernels"), sums, peaks, routing,
                     "floor = sum of stage floors" + ("; host timer" if mr["timer"] == "host" else ""))
            ms = r["measured_ms"]
            if floors and all(f is not None for f in floors):
                r["floor_ms"] = sum(floors)
                r["efficiency"] = r["floor_ms"] / ms if ms else None
            if floors_cal and all(f is not None for f in floors_cal):
                r["floor_ms_cal"] = sum(floors_cal)
                r["efficiency_cal"] = r["floor_ms_cal"] / ms if ms else None
            rows.append(r)
    return pd.DataFrame(rows, columns=ROOFLINE_COLUMNS)


def join_op_families(kernels: pd.DataFrame, analytic: pd.DataFrame, peaks: Peaks,
                     timers: Optional[dict] = None) -> pd.DataFrame:
    """Op-family rows (``level = op_family``): per case x stage x ``OP_GROUPS`` entry, kernel
    busy ms of the group's categories (profiled request) against the analytic work of the
    group's families."""
    if kernels is None or not len(kernels) or "stage" not in kernels or analytic is None or not len(analytic):
        return pd.DataFrame(columns=ROOFLINE_COLUMNS)
    fam = analytic[analytic["family"] != "TOTAL"]
    kk = kernels[kernels["stage"].notna()]
    rows = []
    for (case, stage), ks in kk.groupby(["case", "stage"], sort=False):
        af = fam[(fam["case"] == case) & (fam["stage"] == stage)]
        if stage not in STAGES or not len(af):
            continue
        routing = str(af["routing"].iloc[0]) if "routing" in af else ""
        for group, (cats, fams) in OP_GROUPS.items():
            sub = ks[ks["category"].isin(cats)]
            fsub = af[af["family"].isin(fams)]
            if not len(sub) and not len(fsub):
                continue
            busy = busy_ms(sub) if len(sub) else 0.0
            tot = {c: float(fsub[c].sum()) for c in SUM_COLS}
            timer = (timers or {}).get(case, "")
            note = ""
            if not fams:
                note = "no analytic work: fused into neighbouring kernels in the analytic model (pure overhead)"
            elif not len(fsub):
                note = f"no analytic work of this group in {stage} (pure overhead)"
            elif not len(sub):
                note = "analytic work but no kernels of these categories were captured"
            r = _row(case, stage, "op_family", group, "+".join(cats), "+".join(f for f in fams if f in set(fsub["family"])),
                     timer, busy if busy > 0 else None, busy, None, None, len(sub), tot, peaks, routing, note)
            if not len(fsub):
                for c in ("floor_ms", "floor_ms_cal", "efficiency", "efficiency_cal", "intensity"):
                    r[c] = None
                r["bound"], r["bound_basis"] = "overhead", "no analytic counterpart"
            rows.append(r)
    return pd.DataFrame(rows, columns=ROOFLINE_COLUMNS)


def roofline_table(run: RunData, peaks: Peaks) -> tuple:
    """(roofline DataFrame [ROOFLINE_COLUMNS], analytic DataFrame, measured stages, notes): the
    run's measured tables joined with its analytic frames (derived here when ``run.analytic`` is
    None, i.e. for a run read back from disk)."""
    measured = measured_stages(run.stages)
    if run.analytic is None:
        analytic, mbu_bytes, notes = analytic_for_run(run)
    else:
        analytic, mbu_bytes, notes = run.analytic, run.mbu_bytes, list(run.notes)
    st = join_stages(measured, analytic, peaks, mbu_bytes)
    timers = {c: g["timer"].iloc[0] for c, g in measured.groupby("case")} if len(measured) else {}
    op = join_op_families(run.kernels, analytic, peaks, timers)
    frames = [f for f in (st, op) if len(f)]
    table = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=ROOFLINE_COLUMNS)
    return table, analytic, measured, notes


__all__ = ["ROOFLINE_COLUMNS", "OP_GROUPS", "CATEGORY_GROUP", "FAMILY_GROUP", "roofline_point", "floor_ms",
           "classify", "mfu", "mbu", "busy_ms", "load_run", "measured_stages", "category_busy",
           "run_cases", "analytic_for_case", "analytic_for_run", "join_stages", "join_op_families", "roofline_table",
           "routing_arrays", "model_config"]
