"""Grouped call-graph view of one captured forward (the format of the seed call-graph document).

A *family* is a set of same-class modules. Two kinds of rows:

``for``     sequential repeats: same-class children of one indexed container (ModuleList /
            Sequential), e.g. ``SAMBlock @ model.sam_model.blocks[0..11] for 12``. The count is
            the number of distinct members that ran; the brackets list their indices as
            contiguous ranges (``experts[0..18,20..57]``: expert 19 and 58 never ran).
            Containers whose name ends in ``experts`` are always listed (the experts a MoE
            layer actually used); other containers need ``min_family_size`` members.
``parfor``  calls of one module family: every module matching one address pattern (indices
            replaced by ``*``) and class, e.g. ``SAMAttention @ model.sam_model.blocks.*.attn
            parfor 12``; the count is the number of module calls.

Every row also carries ``ops`` (torchlens ops executed inside the family's calls, nested
modules included), ``flops_tl`` (torchlens' per-op FLOP estimate summed over those ops),
``flops_counted`` (FlopCounterMode, matmul/conv/attention only) and its stage: sam, clip,
projector, or the capture's phase (prefill / decode) for LLM modules.

``grouped_view(capture)`` returns the JSON document; ``render_markdown`` and ``render_dot``
turn it into ``callgraph_<phase>.md`` and ``.dot``.
"""
from __future__ import annotations

import datetime as _dt
import re
from collections import Counter, OrderedDict
from typing import Callable, Optional

from ..markdown import LEFT, RIGHT, table
from .tree import stage_label, vendor_class

MIN_FAMILY_SIZE = 2
MIN_EDGE_COUNT = 1
TOP = "<top level>"


def pattern_of(addr: str) -> str:
    """``model.layers.3.mlp.experts.5`` -> ``model.layers.*.mlp.experts.*``."""
    return ".".join("*" if p.isdigit() else p for p in addr.split("."))


def ranges(indices) -> list:
    """Sorted indices -> [[start, end], ...] contiguous runs (inclusive)."""
    out: list = []
    for i in sorted(set(int(v) for v in indices)):
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return out


def range_text(runs: list) -> str:
    """[[0, 18], [20, 20], [22, 63]] -> ``0..18,20,22..63``."""
    return ",".join(f"{a}" if a == b else f"{a}..{b}" for a, b in runs)


def _stats(cap) -> dict:
    """Per module address: calls, ops and torchlens FLOPs inside it (nested included), first op."""
    st: dict = {}
    for addr, n in cap.calls.items():
        st[addr] = {"calls": n, "ops": 0, "flops_tl": 0, "first": 1 << 60}
    for op in cap.ops:
        for addr in {a for a, _ in op["stack"]}:
            s = st.setdefault(addr, {"calls": 1, "ops": 0, "flops_tl": 0, "first": 1 << 60})
            s["ops"] += 1
            s["flops_tl"] += op["flops"]
            s["first"] = min(s["first"], op["i"])
    return st


def _row(kind, cls, where, count, members, st, cap, phase, under, extra=None) -> dict:
    ops = sum(st[m]["ops"] for m in members)
    row = {"kind": kind, "cls": cls, "vendor_cls": vendor_class(cls), "where": where, "count": count,
           "under": under, "stage": stage_label(members[0], phase),
           "members": len(members), "calls": sum(st[m]["calls"] for m in members), "ops": ops,
           "flops_tl": sum(st[m]["flops_tl"] for m in members),
           "flops_counted": sum(cap.counted.get(m, 0) for m in members) if cap.counted else None,
           "first_op": min(st[m]["first"] for m in members)}
    if extra:
        row.update(extra)
    row["label"] = f"{cls} @ {where}"
    return row


def families(cap, min_family_size: int = MIN_FAMILY_SIZE, vendor_of: Callable[[str], str] = vendor_class) -> list:
    """The ``for`` rows then the ``parfor`` rows, each in execution order (first op)."""
    st = _stats(cap)
    phase = cap.phase
    fors: "OrderedDict[tuple, list]" = OrderedDict()
    pars: "OrderedDict[tuple, list]" = OrderedDict()
    for addr in sorted(st, key=lambda a: (st[a]["first"], a)):
        cls = cap.classes.get(addr, "?")
        parent, _, last = addr.rpartition(".")
        if last.isdigit() and parent:
            fors.setdefault((parent, cls), []).append(addr)
        pars.setdefault((pattern_of(addr), cls), []).append(addr)
    rows = []
    for (parent, cls), members in fors.items():
        if len(members) < min_family_size and not parent.endswith("experts"):
            continue
        idx = [int(m.rpartition(".")[2]) for m in members]
        runs = ranges(idx)
        under = parent.rpartition(".")[0]
        rows.append(_row("for", cls, f"{parent}[{range_text(runs)}]", len(members), members, st, cap, phase,
                         under, {"container": parent, "ranges": runs}))
    for (pat, cls), members in pars.items():
        rows.append(_row("parfor", cls, pat, sum(st[m]["calls"] for m in members), members, st, cap, phase,
                         pat.rpartition(".")[0], {"pattern": pat}))
    for r in rows:
        r["vendor_cls"] = vendor_of(r["cls"])
    rows.sort(key=lambda r: (r["kind"] != "for", r["first_op"]))
    return rows


def experts_used(cap) -> list:
    """Per MoE layer: the experts that ran (index ranges) and, when routing was captured, the
    tokens each routed expert received and whether the two agree."""
    used: dict = {}
    for addr in cap.calls:
        m = re.fullmatch(r"(.*\.(\d+)\.mlp)\.experts\.(\d+)", addr)
        if m:
            used.setdefault((int(m.group(2)), m.group(1)), set()).add(int(m.group(3)))
    moe_layers = sorted({(int(re.fullmatch(r".*\.(\d+)\.mlp", a).group(1)), a) for a in cap.calls
                         if re.fullmatch(r".*\.\d+\.mlp", a) and cap.classes.get(a) in ("MoE", "DeepseekV2MoE")})
    out = []
    for layer, mlp in sorted(set(moe_layers) | set(used)):
        called = sorted(used.get((layer, mlp), set()))
        row = {"layer": layer, "module": f"{mlp}.experts", "experts_called": len(called),
               "ranges": ranges(called), "where": f"{mlp}.experts[{range_text(ranges(called))}]"}
        if cap.routing is not None and layer < len(cap.routing):
            counts = [int(v) for v in cap.routing[layer]]
            routed = [j for j, v in enumerate(counts) if v]
            row["experts_routed"] = len(routed)
            row["tokens_per_expert"] = {str(j): counts[j] for j in routed}
            row["tokens_routed"] = int(sum(counts))
            row["matches_routing"] = routed == called
        out.append(row)
    return out


def stage_summary(cap) -> dict:
    """Ops and torchlens FLOPs per stage (an op's stage is its innermost module's; ops outside
    every module are ``glue``)."""
    out: "OrderedDict[str, dict]" = OrderedDict()
    for op in cap.ops:
        addr = op["stack"][-1][0] if op["stack"] else ""
        st = stage_label(addr, cap.phase) if addr else "glue"
        if st == "all":
            st = "glue"
        s = out.setdefault(st, {"ops": 0, "flops_tl": 0})
        s["ops"] += 1
        s["flops_tl"] += op["flops"]
    return dict(out)


def edges(cap, min_edge_count: int = MIN_EDGE_COUNT) -> list:
    """Data-flow edges between parfor families: an op's family is its innermost module's pattern
    and class; ops outside every module belong to ``<top level>``. Counted per tensor edge."""
    fam = []
    for op in cap.ops:
        if op["stack"]:
            addr = op["stack"][-1][0]
            fam.append(f"{cap.classes.get(addr, '?')} @ {pattern_of(addr)}")
        else:
            fam.append(TOP)
    cnt: Counter = Counter()
    for op in cap.ops:
        for p in op["parents"]:
            a, b = fam[p], fam[op["i"]]
            if a != b:
                cnt[(a, b)] += 1
    return [{"src": a, "dst": b, "count": n} for (a, b), n in cnt.items() if n >= min_edge_count]


def grouped_view(cap, meta: Optional[dict] = None, min_family_size: int = MIN_FAMILY_SIZE,
                 min_edge_count: int = MIN_EDGE_COUNT, vendor_of: Callable[[str], str] = vendor_class) -> dict:
    """The JSON document of one capture: meta, groups, experts per MoE layer, stages, edges."""
    rows = families(cap, min_family_size, vendor_of)
    doc = {"meta": {"phase": cap.phase,
                    "generated_at": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "min_family_size": min_family_size, "min_edge_count": min_edge_count,
                    "ops": len(cap.ops), "module_calls": sum(cap.calls.values()),
                    "flops_tl_total": sum(o["flops"] for o in cap.ops),
                    "flops_counted_total": cap.counted.get("") if cap.counted else None,
                    **cap.info, **(meta or {})},
           "conventions": {
               "for": "sequential repeats: N distinct same-class members of one indexed container ran "
                      "(index ranges in brackets)",
               "parfor": "calls of one module family: N module calls matching the address pattern and class",
               "ops": "torchlens ops executed inside the family's calls (nested modules included)",
               "flops_tl": "torchlens FLOP estimate per op (2 per MAC; bias, elementwise and norms included)",
               "flops_counted": "torch.utils.flop_counter.FlopCounterMode: matmul/conv/attention only, full "
                                "S x T attention (the analytic model's flops_counted convention)",
               "stage": "sam | clip | projector | prefill | decode (LLM modules take the capture's phase)"},
           "groups": rows, "experts": experts_used(cap), "stages": stage_summary(cap),
           "edges": edges(cap, min_edge_count)}
    return doc


# ----------------------------------------------------------------------------------- rendering

def flops_text(x) -> str:
    """FLOPs with a unit: 1.234 G, 56.7 M, 890 k."""
    if x is None:
        return "-"
    for div, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:,.3f} {unit}"
    return f"{x:,.0f}"


def group_line(r: dict) -> str:
    """One seed-format line: ``Cls @ where for|parfor N under X (stage: s)``."""
    under = f" under `{r['under']}`" if r["under"] else ""
    vend = f"; vendor `{r['vendor_cls']}`" if r["vendor_cls"] != r["cls"] else ""
    return (f"- `{r['cls']} @ {r['where']}` {r['kind']} {r['count']}{under} (stage: {r['stage']}; "
            f"{r['ops']:,} ops{vend})")


def render_markdown(doc: dict) -> str:
    m = doc["meta"]
    phase = m["phase"]
    L = [f"# DeepSeek-OCR call graph - grouped view ({phase})", "", "## Metadata"]
    keys = ["model", "adapter", "dtype", "device", "request", "phase", "what", "generated_at", "torchlens",
            "min_family_size", "min_edge_count", "ops", "module_calls", "flops_tl_total", "flops_counted_total",
            "trace_s", "cache_len_before", "cache_len_after", "capture_verified", "notes", "warnings"]
    for k in keys:
        if k in m and m[k] not in (None, [], ""):
            v = m[k]
            if isinstance(v, int) and not isinstance(v, bool) and v > 9999:
                v = f"{v:,}"
            L.append(f"- **{k}**: {v}")
    L += ["", "## Groups", "",
          "`for N` = N same-class members of one container ran, one after another (index ranges in "
          "brackets); `parfor N` = N calls of the module family (address pattern with `*` for indices). "
          "Ops = torchlens ops inside the calls, nested modules included. Our class names; the vendor's "
          "where they differ.", ""]
    L += [group_line(r) for r in doc["groups"]]
    if doc["experts"]:
        L += ["", "## Experts used per MoE layer", "",
              "Experts whose module ran in this forward (contiguous index ranges), and the tokens the gate "
              "routed to each (MoE routing sink of the same forward).", ""]
        L += table(["layer", "experts ran", "experts", "routed experts", "tokens routed", "matches routing"],
                   [[e["layer"], e["experts_called"], f"`{e['where']}`", e.get("experts_routed", "-"),
                     e.get("tokens_routed", "-"), e.get("matches_routing", "-")] for e in doc["experts"]],
                   [RIGHT, RIGHT, LEFT, RIGHT, RIGHT, LEFT])
    L += ["", "## Families", ""]
    L += table(["kind", "family", "N", "stage", "members", "calls", "ops", "torchlens FLOP", "counted FLOP",
                "vendor class"],
               [[r["kind"], f"`{r['cls']} @ {r['where']}`", r["count"], r["stage"], r["members"], r["calls"],
                 f"{r['ops']:,}", flops_text(r["flops_tl"]), flops_text(r["flops_counted"]), r["vendor_cls"]]
                for r in doc["groups"]], [LEFT, LEFT, RIGHT, LEFT] + [RIGHT] * 5 + [LEFT])
    L += ["", "## Stages", ""]
    L += table(["stage", "ops", "torchlens FLOP"],
               [[st, f"{s['ops']:,}", flops_text(s["flops_tl"])] for st, s in doc["stages"].items()])
    L += ["", "Conventions: " + "; ".join(f"**{k}**: {v}" for k, v in doc["conventions"].items()), ""]
    return "\n".join(L)


_STAGE_COLOR = {"sam": "#dbe9f6", "clip": "#e3f2d9", "projector": "#fdebd3", "prefill": "#f3dcef",
                "decode": "#f6e0e0", "glue": "#eeeeee"}


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_dot(doc: dict) -> str:
    """Data-flow graph between parfor families (innermost module of each op), clustered by stage."""
    phase = doc["meta"]["phase"]
    par = {f"{r['cls']} @ {r['where']}": r for r in doc["groups"] if r["kind"] == "parfor"}
    used = {e["src"] for e in doc["edges"]} | {e["dst"] for e in doc["edges"]}
    by_stage: "OrderedDict[str, list]" = OrderedDict()
    for name in sorted(used, key=lambda n: par[n]["first_op"] if n in par else -1):
        st = par[name]["stage"] if name in par else "glue"
        by_stage.setdefault(st, []).append(name)
    ids = {name: f"n{i}" for i, name in enumerate(sorted(used))}
    L = [f"digraph callgraph_{phase} {{", "  rankdir=TB;", '  node [shape=box, fontname="Helvetica", fontsize=10];',
         '  edge [fontname="Helvetica", fontsize=8, color="#555555"];',
         f'  label={_q(f"DeepSeek-OCR {phase}: data flow between module families (edge = tensor edges)")};']
    for i, (st, names) in enumerate(by_stage.items()):
        L.append(f"  subgraph cluster_{i} {{")
        L.append(f"    label={_q(st)}; style=filled; color={_q(_STAGE_COLOR.get(st, '#eeeeee'))};")
        for n in names:
            r = par.get(n)
            if r:
                text = f"{r['cls']}\n{r['where']}\nparfor {r['count']} | {r['ops']:,} ops"
            else:
                text = n
            L.append(f"    {ids[n]} [label={_q(text)}, style=filled, fillcolor=white];")
        L.append("  }")
    for e in doc["edges"]:
        L.append(f"  {ids[e['src']]} -> {ids[e['dst']]} [label={_q(str(e['count']))}];")
    L.append("}")
    return "\n".join(L) + "\n"
