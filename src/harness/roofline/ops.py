"""Op-family rows of the roofline (``level = op_family``): kernel busy time per op group against
the analytic work of the group's families, per case x stage.

Which op group a kernel belongs to follows the module that launched it (``kernels.csv``
``op_group``, from ``harness.measure.modules.ModuleTracker``; ``attribution = module``):

* ``matmul``: GEMM/conv/attention families (attention, MLPs, projector, gate, experts, lm_head,
  patch embedding, convs) incl. their own elementwise kernels (bias, activation, residual),
  less the KV-cache copy traffic;
* ``kv_cache``: kernels inside the KV cache's ``update`` (the growing cache's ``torch.cat``)
  against the analytic copy traffic (``bytes_kv_copy_read/write``: growing minus static cache);
* ``norm`` (layernorm, layernorm2d, rmsnorm), ``rope`` (the cos/sin tables; the rotation itself
  runs inline in the attention module and is counted there), ``memory/routing`` (token
  embedding, image layout, CLIP embeddings);
* ``routing/indexing``: the MoE container's own kernels (argsort, gather, scatter, expert counts
  and their copy to the host, the weighted sum): no analytic work of their own;
* ``elementwise``: kernels of container modules (decoder layer, SAM/CLIP block: residual adds,
  casts); ``other``: kernels launched outside every module (adapter glue, argmax).

Stages whose kernels have no ``op_group`` (runs written before module attribution, stages run
without hooks) are grouped by kernel-name category (``OP_GROUPS`` categories; ``attribution =
kernel name``); in a stage with module attribution, a kernel without one (left ``unattributed`` by
the alignment of a replayed step) goes to its category's group.

``measured_ms`` and ``kernel_busy_ms`` of an op-family row are the union of its kernel intervals
in the profiled request; a decode row's busy time and kernels are scaled by the case's
``step_scale`` (``harness.measure.summary``: busy per decode step x the timed requests' steps, when
the profiled request decoded fewer steps), so they pair with the analytic work of the whole
decode. A row whose group has no analytic work (zero FLOPs and bytes) is ``overhead``: no floor,
no efficiency.
"""
from __future__ import annotations

from typing import Optional

import pandas as pd

from ..measure.observations import busy_ms
from ..anatomy.stages import STAGES
from .join import CATEGORY_GROUP, OP_GROUPS, SUM_COLS, _row, roofline_frame
from .specs import Peaks

KV_GROUP = "kv_cache"


def _sums(fsub: pd.DataFrame, group: str) -> dict:
    """Analytic SUM_COLS of a group's family rows; the KV copy traffic moves from matmul to kv_cache."""
    tot = {c: float(fsub[c].fillna(0).sum()) if c in fsub else 0.0 for c in SUM_COLS}
    cr = float(fsub["bytes_kv_copy_read"].fillna(0).sum()) if "bytes_kv_copy_read" in fsub else 0.0
    cw = float(fsub["bytes_kv_copy_write"].fillna(0).sum()) if "bytes_kv_copy_write" in fsub else 0.0
    if group == KV_GROUP:
        return {c: 0.0 for c in SUM_COLS} | {"bytes_kv_read": cr, "bytes_kv_write": cw, "bytes": cr + cw}
    if group == "matmul":
        tot.update(bytes_kv_read=tot["bytes_kv_read"] - cr, bytes_kv_write=tot["bytes_kv_write"] - cw,
                   bytes=tot["bytes"] - cr - cw)
    return tot


def _categories(sub: pd.DataFrame) -> str:
    """Kernel-name categories of a row's kernels, most busy first ('gemm+activation/elementwise')."""
    if not len(sub):
        return ""
    order = sub.groupby("category")["dur_ms"].sum().sort_values(ascending=False, kind="stable")
    return "+".join(map(str, order.index))


def _by_module(kernels: pd.DataFrame) -> bool:
    return "op_group" in kernels and kernels["op_group"].fillna("").ne("").any()


def _groups(kernels: pd.DataFrame) -> pd.Series:
    """Each kernel's op group: its module's, else its name category's (a replayed step's kernel that
    alignment left unattributed, ``harness.measure.alignment``)."""
    og = kernels["op_group"].fillna("").astype(str)
    return og.where(og.ne(""), kernels["category"].map(CATEGORY_GROUP).fillna("other"))


def join_op_families(kernels: pd.DataFrame, analytic: pd.DataFrame, peaks: Peaks,
                     timers: Optional[dict] = None, step_scale: Optional[dict] = None) -> pd.DataFrame:
    """Op-family rows per case x stage x ``OP_GROUPS`` entry (see the module docstring);
    ``step_scale``: {case: factor of its decode rows} (default 1)."""
    if kernels is None or not len(kernels) or "stage" not in kernels or analytic is None or not len(analytic):
        return roofline_frame([])
    fam = analytic[analytic["family"] != "TOTAL"]
    kk = kernels[kernels["stage"].notna()]
    rows = []
    for (case, stage), ks in kk.groupby(["case", "stage"], sort=False):
        af = fam[(fam["case"] == case) & (fam["stage"] == stage)]
        if stage not in STAGES or not len(af):
            continue
        module = _by_module(ks)     # per stage: a graphed prefill keeps names while its decode is aligned
        group_of = _groups(ks) if module else None
        routing = str(af["routing"].iloc[0]) if "routing" in af else ""
        for group, (cats, fams) in OP_GROUPS.items():
            if module:
                sub = ks[group_of == group]
                fsub = af[af["family"].isin(("llm_attention",) if group == KV_GROUP else fams)]
            else:
                sub = ks[ks["category"].isin(cats)]
                fsub = af[af["family"].isin(fams)]
            tot = _sums(fsub, group if module else "")
            work = tot["tensor_flops"] > 0 or tot["bytes"] > 0
            if not len(sub) and not work:
                continue
            k = (step_scale or {}).get(case, 1.0) if stage == "decode" else 1.0
            busy = k * busy_ms(sub) if len(sub) else 0.0
            present = [f for f in dict.fromkeys(fsub["family"])] if work else []
            note = ""
            if not work:
                note = ("no analytic work: MoE routing and indexing (pure overhead)" if group == "routing/indexing"
                        else "no analytic work in this group (pure overhead)")
            elif not len(sub):
                note = ("analytic work but no kernels of this group were captured" if module else
                        "no kernel category maps to this group (kernel-name grouping)")
            m = {"timer": (timers or {}).get(case, ""), "measured_ms": busy if busy > 0 else None,
                 "kernel_busy_ms": busy, "kernels": k * len(sub),
                 "kernel_categories": _categories(sub) if module else "+".join(cats),
                 "analytic_families": "+".join(present), "attribution": "module" if module else "kernel name"}
            r = _row(case, stage, "op_family", group, tot, peaks, m, routing, note)
            if not work:
                for c in ("floor_ms", "floor_ms_cal", "efficiency", "efficiency_cal", "efficiency_busy",
                          "efficiency_busy_cal", "intensity"):
                    r[c] = None
                r["bound"], r["bound_basis"] = "overhead", "no analytic counterpart"
            rows.append(r)
    return roofline_frame(rows)


__all__ = ["join_op_families", "KV_GROUP"]
