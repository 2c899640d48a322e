"""Join the grouped call graph with the analytic cost model (``harness.analytic``).

Each module instance that one analytic cost family describes is an *atom* of that family
(``atom_key``): ``SAMAttention`` -> ``sam_attention`` (variant ``window`` / ``global`` from its
block), a routed expert ``SwiGLU`` -> ``moe_routed``, ``lm_head`` -> ``lm_head``, ... Atoms may
nest (``RotaryEmbedding`` inside ``Attention``). A module family's analytic value is the sum,
over the analytic rows, of the row's value times the family's share of that row: the weight of
the row's atoms inside the family's modules over the weight of all its atoms, where an atom's
weight is its number of calls (routed experts: the tokens routed to it, so one expert's share of
``moe_routed`` is exact; convolutions: their counted FLOPs, because one analytic row holds convs
of different shapes, e.g. ``net_2`` and ``net_3`` in ``conv2d/downsample``). Composite families (``SAMBlock``, ``DecoderLayer``, ``MoE``) thus get
the sum of their parts, and a family that is one of several in a row (``norm1`` and ``norm2`` in
SAM's ``layernorm``) gets its share.

``join_rows(doc, capture, frame, ...)`` returns one dict per grouped-view family plus one per
stage and per analytic row without a module (``image_layout``); ``COLUMNS`` documents them.
``counted_minus_analytic`` compares FlopCounterMode with ``flops_counted`` (same convention:
matmul/conv/attention, full S x T attention, padded SAM windows), so it is 0 where both agree.
"""
from __future__ import annotations

import re
from typing import Optional

from ..anatomy.registry import family_of
from ..anatomy.stages import VISION_STAGES

COLUMNS = ["phase", "level", "stage", "family", "cls", "vendor_cls", "kind", "count", "calls", "tl_ops",
           "tl_flops", "counted_flops", "analytic_rows", "analytic_flops_counted", "analytic_flops_useful",
           "analytic_tensor_flops", "analytic_vector_flops", "analytic_bytes", "counted_minus_analytic", "note"]
COLUMN_DOC = {
    "phase": "prefill (vision stages + prefill forward) or decode (one decode step)",
    "level": "family (a grouped-view row), stage (a stage total) or analytic_only (no module runs it)",
    "stage": "sam | clip | projector | prefill | decode",
    "family": "grouped-view family label `Class @ where`",
    "kind": "for | parfor (see callgraph_<phase>.md)",
    "count": "for: members that ran; parfor: module calls",
    "calls": "module calls of the family",
    "tl_ops": "torchlens ops inside the family's calls [ops]",
    "tl_flops": "torchlens per-op FLOP estimate, summed (elementwise and bias included) [FLOP]",
    "counted_flops": "FlopCounterMode per module, summed over the family (matmul/conv/attention) [FLOP]",
    "analytic_rows": "analytic rows stage/family/variant x share that make up the analytic columns",
    "analytic_*": "harness.analytic.workload_costs columns for this family's share [FLOP] / [B]",
    "counted_minus_analytic": "counted_flops - analytic_flops_counted [FLOP] (0: exact agreement)",
}

FLOP_COLS = ("flops_counted", "flops_useful", "tensor_flops", "vector_flops", "bytes")


def atom_key(addr: str, cls: str, module=None) -> Optional[tuple]:
    """(family, variant) of the analytic cost class describing module ``addr`` (None: not an atom):
    ``harness.anatomy.registry.family_of``; ``module`` is the SAM block owning an attention."""
    return family_of(addr, cls, module)


def _block_of(model, addr: str):
    """The SAM block owning an attention module (its ``window_size`` says window or global)."""
    if model is None:
        return None
    try:
        return model.get_submodule(addr.rpartition(".")[0])
    except AttributeError:
        return None


def analytic_case(request):
    """The request's Case with one decode step (decode_tokens=2)."""
    import dataclasses

    return dataclasses.replace(request.case, decode_tokens=2)


def analytic_frame(request, model_cfg, dtype: str, routing: dict):
    """``workload_costs`` per step for the captured request: prefill rows and decode step 0."""
    import numpy as np

    from ..analytic import workload_costs

    r = {}
    if routing.get("prefill") is not None:
        r["prefill"] = np.asarray(routing["prefill"])
    if routing.get("decode") is not None:
        r["decode"] = np.asarray(routing["decode"])[None]
    return workload_costs(analytic_case(request), model_cfg, dtype, per_step=True, routing=r or None,
                          attn_implementation=model_cfg.attn_implementation)


def _atoms(cap, model) -> dict:
    """{addr: ((family, variant), stage, weight)} for every atom that ran."""
    from .tree import stage_label

    out = {}
    for addr, calls in cap.calls.items():
        cls = cap.classes.get(addr, "?")
        mod = _block_of(model, addr) if "sam_model" in addr and cls in ("SAMAttention", "Attention") else None
        key = atom_key(addr, cls, mod)
        if key is None:
            continue
        weight = calls
        if key[0] == "conv2d" and cap.counted.get(addr):
            weight = cap.counted[addr]   # one row holds convs of different shapes: split by their FLOPs
        m = re.fullmatch(r".*layers\.(\d+)\.mlp\.experts\.(\d+)", addr)
        if m and key[0] == "moe_routed" and cap.routing is not None:
            weight = int(cap.routing[int(m.group(1))][int(m.group(2))])
        out[addr] = (key, stage_label(addr, cap.phase), weight)
    return out


def _members(row: dict, cap) -> list:
    if row["kind"] == "for":
        idx = {i for a, b in row["ranges"] for i in range(a, b + 1)}
        base = row["container"]
        return [a for a in cap.calls if a.rpartition(".")[0] == base and a.rpartition(".")[2].isdigit()
                and int(a.rpartition(".")[2]) in idx and cap.classes.get(a) == row["cls"]]
    pat = re.compile("^" + re.escape(row["pattern"]).replace(r"\*", r"\d+") + "$")
    return [a for a in cap.calls if pat.match(a) and cap.classes.get(a) == row["cls"]]


def join_rows(doc: dict, cap, frame=None, model=None, note: str = "") -> list:
    """Rows (dicts with ``COLUMNS``) for one phase; ``frame`` = ``analytic_frame`` (None: analytic
    columns empty, ``note`` says why)."""
    atoms = _atoms(cap, model)
    totals: dict = {}
    for addr, (key, stage, w) in atoms.items():
        totals[(stage, key)] = totals.get((stage, key), 0) + w
    arow = {}
    if frame is not None:
        f = frame[(frame["family"] != "TOTAL")]
        f = f[(f["step"] <= 0)]
        for _, r in f.iterrows():
            k = (r["stage"], (r["family"], r["variant"]))
            acc = arow.setdefault(k, {c: 0 for c in FLOP_COLS})
            for c in FLOP_COLS:
                acc[c] += r[c]
    rows = []
    for g in doc["groups"]:
        members = _members(g, cap)
        inside = [a for a in atoms if any(a == m or a.startswith(m + ".") for m in members)]
        parts: dict = {}
        for a in inside:
            key, stage, w = atoms[a]
            parts[(stage, key)] = parts.get((stage, key), 0) + w
        row = {"phase": cap.phase, "level": "family", "stage": g["stage"], "family": g["label"], "cls": g["cls"],
               "vendor_cls": g["vendor_cls"], "kind": g["kind"], "count": g["count"], "calls": g["calls"],
               "tl_ops": g["ops"], "tl_flops": g["flops_tl"], "counted_flops": g["flops_counted"], "note": note}
        _fill(row, parts, totals, arow, frame is not None)
        if g["flops_counted"] == 0 and g["flops_tl"] and (row.get("analytic_flops_counted") or 0) > 0:
            row["note"] = ((row["note"] + "; ") if row["note"] else "") + (
                "FlopCounterMode saw no call of these modules (their forward() is called directly, "
                "bypassing module hooks): their FLOPs are counted in the parent module")
        rows.append(row)
    # stage totals: counted per stage from the stage's top modules; analytic TOTAL per stage
    rows += _stage_rows(doc, cap, arow, frame is not None, note)
    if frame is not None:
        for (stage, key) in arow:
            if (stage, key) in totals or (stage, (key[0], "")) in totals or not _phase_has(cap.phase, stage):
                continue
            row = {"phase": cap.phase, "level": "analytic_only", "stage": stage,
                   "family": key[0] + (f" ({key[1]})" if key[1] else ""), "cls": "", "vendor_cls": "", "kind": "",
                   "count": None, "calls": None, "tl_ops": None, "tl_flops": None, "counted_flops": None,
                   "note": "analytic family without a module of its own (glue ops)"}
            _fill(row, {(stage, key): 1}, {(stage, key): 1}, arow, True)
            rows.append(row)
    return rows


def _phase_has(phase: str, stage: str) -> bool:
    return stage == "decode" if phase == "decode" else stage in VISION_STAGES + ("prefill",)


def _fill(row, parts, totals, arow, have_frame) -> None:
    desc, vals = [], {c: 0.0 for c in FLOP_COLS}
    missing = []
    for (stage, key), w in sorted(parts.items()):
        tot = totals.get((stage, key), 0)
        share = w / tot if tot else 0.0
        a = arow.get((stage, key))
        if a is None and key[1]:
            a = arow.get((stage, (key[0], "")))
        label = f"{stage}/{key[0]}" + (f"/{key[1]}" if key[1] else "")
        if a is None:
            missing.append(label)
            continue
        desc.append(label + ("" if abs(share - 1) < 1e-12 else f" x {w}/{tot}"))
        for c in FLOP_COLS:
            vals[c] += a[c] * share
    row["analytic_rows"] = " + ".join(desc)
    if not have_frame or not desc:
        for c in FLOP_COLS:
            row[f"analytic_{c}"] = None
        row["counted_minus_analytic"] = None
        if have_frame and missing:
            row["note"] = (row.get("note") or "") + f"no analytic row for {', '.join(missing)}"
        elif have_frame and not parts:
            row["note"] = (row.get("note") or "") + ("inside one analytic family's module (e.g. a projection of "
                                                     "llm_attention): the analytic model has no row for it alone")
        return
    row["analytic_flops_counted"] = int(round(vals["flops_counted"]))
    row["analytic_flops_useful"] = int(round(vals["flops_useful"]))
    row["analytic_tensor_flops"] = int(round(vals["tensor_flops"]))
    row["analytic_vector_flops"] = int(round(vals["vector_flops"]))
    row["analytic_bytes"] = int(round(vals["bytes"]))
    c = row.get("counted_flops")
    row["counted_minus_analytic"] = None if c is None else int(c) - row["analytic_flops_counted"]
    if missing:
        row["note"] = (row.get("note") or "") + f"no analytic row for {', '.join(missing)}"


STAGE_TOPS = {"sam": ("model.sam_model",), "clip": ("model.vision_model",), "projector": ("model.projector",)}


def _stage_rows(doc, cap, arow, have_frame, note) -> list:
    """One row per stage of the phase: counted FLOPs of the stage's top modules (prefill / decode:
    the whole forward minus the vision stages) next to the sum of the stage's analytic rows."""
    rows = []
    total = cap.counted.get("") if cap.counted else None
    stages = VISION_STAGES + ("prefill",) if cap.phase == "prefill" else ("decode",)
    vision = 0
    for st in stages:
        if st in STAGE_TOPS:
            counted = sum(cap.counted.get(a, 0) for a in STAGE_TOPS[st]) if cap.counted else None
            vision += counted or 0
        else:
            counted = None if total is None else total - vision
        summary = doc["stages"].get(st, {})
        row = {"phase": cap.phase, "level": "stage", "stage": st, "family": f"stage {st}", "cls": "",
               "vendor_cls": "", "kind": "", "count": None, "calls": None, "tl_ops": summary.get("ops"),
               "tl_flops": summary.get("flops_tl"), "counted_flops": counted, "note": note}
        parts = {(s, k): 1 for (s, k) in arow if s == st}
        _fill(row, parts, dict(parts), arow, have_frame)
        if have_frame:
            row["analytic_rows"] = f"{st}/TOTAL"
        rows.append(row)
    return rows
