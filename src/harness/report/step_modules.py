"""Where each decode step's microseconds go, per module, against the bandwidth floor.

For a case whose decode-step kernels were attributed to modules by alignment (a replayed or compiled
step, ``harness.measure.alignment``), one row per module group of the decode step (``GROUPS``):

* launches per step and busy µs per step (measured, the profiled request: the union of the group's
  kernel intervals in each decode step, mean over its steps);
* bytes per step (analytic: the decode stage's rows of the group's families in the cost model,
  weights + activations + KV, over the request's decode steps);
* GB/s = bytes / busy, the bandwidth floor = bytes / datasheet bandwidth, floor / busy (the share
  of the floor the kernels reach; above 100% flagged, never a figure) and µs above the floor = busy
  - floor (derived).

A group holds the kernels of its analytic ``families`` and those of its ``op_groups`` that have no
family (the MoE container's own kernels go with the experts: under ``moe_impl=grouped`` they *are*
the routed experts). A sub-row (``parent``) splits its parent's kernels by module path (q/k/v,
attention core, o_proj; routed and shared experts) and has measured columns only: the cost model
prices the family as a whole. ``unattributed``: kernels the alignment could not match.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import pandas as pd

from ..anatomy.stages import DECODE_STEP
from ..floats import finite as _f
from ..measure.alignment import aligned_fraction
from ..measure.observations import busy_ms
from ..schema.manifest import Manifest
from .columns import pct, table
from .context import case_info


@dataclass(frozen=True)
class Group:
    """One row: ``label``; ``families`` (analytic families: their bytes and their kernels);
    ``op_groups`` (kernels without a family in these op groups); ``parent`` + ``path`` (a sub-row:
    the parent's kernels whose module path matches the regex ``path``)."""

    label: str
    families: tuple = ()
    op_groups: tuple = ()
    parent: str = ""
    path: str = ""


ATTENTION, EXPERTS = "attention", "experts: routed + shared (+ MoE routing)"
GROUPS = (
    Group("embedding", ("embedding",)),
    Group("norms (RMSNorm)", ("rmsnorm",)),
    Group("RoPE tables", ("rope",)),
    Group(ATTENTION, ("llm_attention",)),
    Group("· q/k/v projections", parent=ATTENTION, path=r"\.(q|k|v)_proj$"),
    Group("· decode attention (RoPE, KV write, SDPA; fused q/k/v)", parent=ATTENTION,
          path=r"\.self_attn(\.kv_cache)?$"),
    Group("· o_proj", parent=ATTENTION, path=r"\.o_proj$"),
    Group("dense MLP (layer 0)", ("dense_mlp",)),
    Group("router (MoE gate)", ("moe_gate",)),
    Group(EXPERTS, ("moe_routed", "moe_shared"), ("routing/indexing",)),
    Group("· routed experts, routing, combine", parent=EXPERTS, path=r"\.mlp(\.experts\.\d+(\..*)?)?$"),
    Group("· shared expert", parent=EXPERTS, path=r"\.shared_experts(\..*)?$"),
    Group("lm_head", ("lm_head",)),
    Group("layer glue (residual adds)", op_groups=("elementwise",)),
    Group("outside modules (token pick, position)", op_groups=("other",)),
)
UNATTRIBUTED = "unattributed"
TOTAL = "decode step (all kernels)"
_BY_LABEL = {g.label: g for g in GROUPS}


def _selects(g: Group, k: pd.DataFrame) -> pd.Series:
    """Which kernels of ``k`` (one case's decode-step kernels) ``g`` holds."""
    if g.parent:
        path = k["module"].fillna("").astype(str)
        return _selects(_BY_LABEL[g.parent], k) & path.map(lambda p: re.search(g.path, p) is not None)
    fam = k["family"].fillna("").astype(str)
    og = k["op_group"].fillna("").astype(str)
    return fam.isin(g.families) | (fam.eq("") & og.isin(g.op_groups) & og.ne(""))


def _per_step_busy_us(k: pd.DataFrame, steps: int) -> float:
    """Mean over ``steps`` decode steps of the union of ``k``'s kernel intervals in each, µs."""
    return 1e3 * sum(busy_ms(g) for _, g in k.groupby("step", sort=False)) / steps


def step_module_rows(kernels: pd.DataFrame, analytic: Optional[pd.DataFrame], case: str, decode_steps: int,
                     bandwidth_gbs: Optional[float]) -> list:
    """Records (column names of ``harness.report.columns``) of ``case``: ``GROUPS`` with kernels or
    bytes, ``unattributed``, then the whole step. ``decode_steps``: the analytic request's decode
    steps (bytes per step); ``bandwidth_gbs``: the datasheet bandwidth (None: no floor)."""
    k = kernels[(kernels["case"] == case) & (kernels["range"] == DECODE_STEP)]
    steps = k["step"].nunique()
    if not steps:
        return []
    fam = analytic[(analytic["case"] == case) & (analytic["stage"] == "decode") & (analytic["family"] != "TOTAL")] \
        if analytic is not None and len(analytic) else None
    known = pd.Series(False, index=k.index)
    rows = []
    for g in GROUPS:
        sel = _selects(g, k)
        if not g.parent:
            known |= sel
        b = None
        if not g.parent and g.families and fam is not None and decode_steps:
            b = float(fam.loc[fam["family"].isin(g.families), "bytes"].sum()) / decode_steps
        if not sel.any() and not b:
            continue
        rows.append(_record(g.label, k[sel], steps, b, bandwidth_gbs))
    rest = k[~known]
    if len(rest):
        rows.append(_record(UNATTRIBUTED, rest, steps, None, bandwidth_gbs))
    total = float(fam["bytes"].sum()) / decode_steps if fam is not None and decode_steps else None
    rows.append(_record(TOTAL, k, steps, total, bandwidth_gbs))
    return rows


def _record(label: str, k: pd.DataFrame, steps: int, bytes_step: Optional[float], bw_gbs: Optional[float]) -> dict:
    busy = _per_step_busy_us(k, steps) if len(k) else 0.0
    floor = bytes_step / (bw_gbs * 1e3) if bytes_step and bw_gbs else None     # B / (GB/s * 1e3) = µs
    share = floor / busy if floor is not None and busy else None
    return {"module_group": label, "attributed_by": ", ".join(sorted(set(k["attribution"].dropna()))) or "–",
            "launches_step": len(k) / steps, "busy_us_step": busy,
            "mb_step": bytes_step, "gbs_busy": bytes_step / (busy * 1e3) if bytes_step and busy else None,
            "bw_floor_us": floor, "floor_share": share,
            "above_floor_us": busy - floor if share is not None and share <= 1.0 else None}


def aligned_cases(kernels: Optional[pd.DataFrame]) -> list:
    """Cases whose decode-step kernels were attributed by alignment, in run order."""
    if kernels is None or not len(kernels) or "attribution" not in kernels:
        return []
    k = kernels[(kernels["range"] == DECODE_STEP) & (kernels["attribution"] == "aligned")]
    return list(dict.fromkeys(k["case"]))


def section(run, analytic: Optional[pd.DataFrame], bandwidth_gbs: Optional[float], tpot_ms: dict) -> list:
    """The report's "Inside the decode step" section (nothing without aligned cases); ``tpot_ms``:
    {case: median TPOT p50 of the timed repeats, ms}."""
    cases = aligned_cases(run.kernels)
    if not cases:
        return []
    from .ladder import execution_label

    info = case_info(run.manifest)
    L = ["## Inside the decode step: per module, against the bandwidth floor", "",
         "Kernels of a replayed (CUDA graph) or compiled decode step, attributed to modules by aligning each step's "
         "kernel sequence with one eager, hooked step of the same execution (`harness.measure.alignment`; "
         "kernels.csv `attribution`: aligned / unattributed). Launches and busy µs: measured (profiled request, "
         "mean per decode step; busy = union of the group's kernel intervals); bytes: analytic (the cost model's "
         "families: weights + activations + KV, per step of the request); floor = bytes / datasheet bandwidth"
         + (f" ({bandwidth_gbs:,.0f} GB/s)" if bandwidth_gbs else " (unknown device: no floor)")
         + "; floor / busy is the share of the floor the kernels reach. Rows marked · split their group by module "
           "path (measured only: the cost model prices the family as a whole).", ""]
    for case in cases:
        ci = info.get(case, {})
        decode_steps = max(int(ci.get("decode_tokens") or 0) - 1, 0)
        rows = step_module_rows(run.kernels, analytic, case, decode_steps, bandwidth_gbs)
        hit = aligned_fraction(run.kernels[run.kernels["case"] == case])
        L += [f"### {case}: {execution_label(Manifest.execution_of(ci))}", ""]
        L += table(["module_group", "attributed_by", "launches_step", "busy_us_step", "mb_step", "gbs_busy",
                    "bw_floor_us", "floor_share", "above_floor_us"], rows)
        total = rows[-1] if rows else {}
        tpot = _f(tpot_ms.get(case))
        line = (f"Aligned: {hit.aligned:,} of {hit.kernels:,} decode-step kernels ({pct(hit.fraction)}), "
                f"{pct(hit.time_fraction)} of their kernel time.")
        if tpot is not None and total:
            line += (f" Median step time (TPOT p50, timed repeats) {1e3 * tpot:,.1f} µs, of which kernels busy "
                     f"{total['busy_us_step']:,.1f} µs (profiled request): the rest is launch gaps and idle.")
        shared = overlap_us(rows)
        if shared is not None:
            line += (f" The groups' busy times add up to {shared:,.1f} µs more than the step's: kernel intervals of "
                     "different groups overlap (with PDL a kernel starts while the one before it runs), so each "
                     "group's busy time includes time it shares with its neighbours; `execution.step_clock` "
                     "partitions the fused step instead.")
        flagged = [r["module_group"] for r in rows if (_f(r["floor_share"]) or 0) > 1.0]
        if flagged:
            line += (" Above the ceiling (" + ", ".join(flagged) + "): the analytic bytes of its families, the "
                     "attribution of its kernels or the bandwidth is wrong.")
        L += ["", line, ""]
    return L


def overlap_us(rows: list) -> Optional[float]:
    """How far the top-level groups' busy µs per step (sub-rows and the total left out) add up beyond
    the total's, when by more than 1% of it (derived; None otherwise): intervals shared between groups."""
    total = next((r for r in rows if r["module_group"] == TOTAL), None)
    busy = _f(total["busy_us_step"]) if total else None
    if not busy:
        return None
    top = sum(_f(r["busy_us_step"]) or 0.0 for r in rows
              if r["module_group"] != TOTAL and not _BY_LABEL.get(r["module_group"], Group("")).parent)
    return top - busy if top - busy > 0.01 * busy else None


__all__ = ["Group", "GROUPS", "UNATTRIBUTED", "TOTAL", "step_module_rows", "aligned_cases", "section", "overlap_us"]
