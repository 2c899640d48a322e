"""Generated documentation: ``docs/module_catalog.md`` from the live module tree and
``docs/formulations/<family>.md`` from the cost classes, so neither can drift from the code.

``python -m harness.analytic.docs [--out docs]`` regenerates them (deterministic output; the test
suite compares the committed files with a fresh rendering).
"""
from __future__ import annotations

import argparse
import inspect
import re
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Optional

from ..config import ModelConfig
from ..markdown import LEFT, RIGHT, table
from ..anatomy import registry
from ..anatomy.stages import STAGE_PREFIXES, module_stage
from . import compose
from . import families as F

#: documentation notes for modules whose role the registry cannot say (held but never run, a table read)
NOTES = (
    (r"embeddings\.patch_embedding$", ("none (held in the checkpoint, never run)", "clip_embeddings")),
    (r"embeddings\.position_embedding$", ("interpolate, elementwise (table read, not a lookup)", "clip_embeddings")),
)


def _info(pattern: str, cls: str, detail: str = "") -> tuple:
    """(op families, cost families) of one module of the catalog, from ``registry``: the family the
    module is, the container it is, or (a torch leaf such as a Linear) the family of its parent."""
    for rx, info in NOTES:
        if re.search(rx, pattern):
            return info
    hit = registry.family_of(pattern.replace("#", "0"), cls)
    if hit is not None:
        return ", ".join(registry.BY_FAMILY[hit[0]].ops), hit[0]
    if cls in registry.CONTAINERS:
        return registry.CONTAINERS[cls][1:]
    if cls == "ModuleList":
        return ("-", "moe_routed") if pattern.endswith(".experts") else ("-", "-")
    if cls in registry.LEAF_OPS and "." in pattern:
        parent = pattern.rsplit(".", 1)[0]
        ops = registry.LEAF_OPS[cls]
        if cls == "Linear":
            ops = "GEMM (mm)" if "no bias" in detail else "GEMM (addmm)"
        return ops, _info(parent, _CLASS_AT.get(parent, ""))[1]
    return "?", "?"


_CLASS_AT: dict = {}


def _detail(mod) -> str:
    from torch import nn

    name = type(mod).__name__
    if isinstance(mod, nn.Linear):
        return f"{mod.in_features}->{mod.out_features}{'' if mod.bias is not None else ', no bias'}"
    if isinstance(mod, nn.Conv2d):
        return f"{mod.in_channels}->{mod.out_channels}, {mod.kernel_size[0]}x{mod.kernel_size[1]} s{mod.stride[0]}"
    if isinstance(mod, nn.LayerNorm):
        return f"{mod.normalized_shape[0]}, eps {mod.eps:g}"
    if isinstance(mod, nn.Embedding):
        return f"{mod.num_embeddings} x {mod.embedding_dim}"
    if name == "SAMBlock":
        return f"window {mod.window_size}" if mod.window_size > 0 else "global"
    if name == "SAMAttention":
        return f"{mod.num_heads} heads, rel-pos {mod.rel_pos_h.shape[0]} x {mod.rel_pos_h.shape[1]}"
    if name == "Attention":
        return f"{mod.num_heads} heads x {mod.head_dim}, {mod.impl}"
    if name == "MoE":
        return f"{len(mod.experts)} experts, top-{mod.gate.top_k}"
    if name in ("RMSNorm", "LayerNorm2d"):
        return f"{mod.weight.shape[0]}"
    if name == "SwiGLU":
        return f"{mod.gate_proj.in_features}->{mod.gate_proj.out_features}"
    return ""


def _ranges(values) -> str:
    vals = sorted(set(values))
    if len(vals) == 1:
        return str(vals[0])
    parts, start, prev = [], vals[0], vals[0]
    for v in vals[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return "{" + ",".join(parts) + "}"


def module_rows(model) -> list:
    """Grouped module tree: [stage, path pattern, class, count, detail, params each, ops, families]."""
    groups: "OrderedDict[tuple, dict]" = OrderedDict()
    _CLASS_AT.clear()
    for name, mod in model.named_modules():
        _CLASS_AT.setdefault(".".join("#" if p.isdigit() else p for p in name.split(".")) if name else "",
                             type(mod).__name__)
        parts = name.split(".") if name else []
        pattern = ".".join("#" if p.isdigit() else p for p in parts)
        idx = [int(p) for p in parts if p.isdigit()]
        cls = type(mod).__name__
        detail = _detail(mod)
        key = (pattern, cls, detail)
        g = groups.setdefault(key, {"name": name, "idx": [], "count": 0,
                                    "params": sum(p.numel() for p in mod.parameters())})
        g["idx"].append(idx)
        g["count"] += 1
    rows = []
    for (pattern, cls, detail), g in groups.items():
        path = pattern
        for pos in range(pattern.count("#")):
            path = path.replace("#", _ranges([i[pos] for i in g["idx"]]), 1)
        stage = module_stage(g["name"]) or "-"
        ops, fams = _info(pattern, cls, detail)
        rows.append([stage, path or "(root)", cls, g["count"], detail, g["params"], ops, fams])
    return rows


def render_module_catalog(cfg: Optional[ModelConfig] = None) -> str:
    from ..models.build import build_model   # the model sits above the cost model: built only for the docs

    cfg = cfg or ModelConfig()
    model = build_model(cfg, device="meta")
    rows = module_rows(model)
    L = ["# Module catalog (generated)", "",
         "Generated by `python -m harness.analytic.docs` from the live module tree of the reference model "
         "(`harness.models`, vendor sizes, built on the meta device); do not edit by hand. Stages come from "
         "`harness.anatomy.stages.module_stage` (`llm` modules run in both `prefill` and `decode`); repeated "
         "modules are folded into index ranges `{a-b}`. `params each` counts a module's parameters with its "
         "children. Cost families link to `formulations/`.", "",
         *table(["stage", "prefixes"], [[st, ", ".join(f"`{p}`" for p in pre)] for st, pre in STAGE_PREFIXES.items()],
                [LEFT, LEFT])]
    for stage in ("-", "sam", "clip", "projector", "llm"):
        sel = [r for r in rows if r[0] == stage]
        if not sel:
            continue
        title = {"-": "Containers (no stage)", "llm": "llm (prefill and decode)"}.get(stage, stage)
        L += ["", f"## {title}", ""]
        L += table(["module path", "class", "count", "detail", "params each", "op families", "cost families"],
                   [[f"`{path}`", cls, count, detail, f"{params:,}", ops,
                     ", ".join(_link(f) for f in re.split(r"[,|/]\s*", fams)) if fams not in ("-", "?") else fams]
                    for _, path, cls, count, detail, params, ops, fams in sel],
                   [LEFT, LEFT, RIGHT, LEFT, RIGHT, LEFT, LEFT])
    direct = [(n, tuple(p.shape)) for n, p in model.named_parameters()
              if n.rsplit(".", 1)[-1] in ("pos_embed", "class_embedding", "image_newline", "view_seperator")]
    L += ["", "## Parameters held directly (not in a leaf module)", ""]
    L += table(["parameter", "shape", "stage"], [[f"`{n}`", list(s), module_stage(n)] for n, s in direct],
               [LEFT, LEFT, LEFT])
    L += ["", f"Total parameters: {sum(p.numel() for p in model.parameters()):,}.", ""]
    return "\n".join(L)


def _link(fam: str) -> str:
    fam = fam.strip()
    base = fam.split(" ")[0]
    if base == "moe_*":
        return ", ".join(_link(f) for f in ("moe_gate", "moe_routed", "moe_shared"))
    return f"[{fam}](formulations/{base}.md)" if base in F.FAMILY_BY_NAME else fam


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.0f}" if v == int(v) else f"{v:,.2f}"
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def base_instances(cfg: ModelConfig) -> "OrderedDict[str, list]":
    """family -> [(stage, variant, label, Item)] of the base-mode case (decode: first step)."""
    r, items = compose.case_items(compose.Case("base", decode_tokens=2), cfg)
    out: "OrderedDict[str, list]" = OrderedDict((cls.family, []) for cls in F.FAMILIES)
    for it in items:
        label = f"{it.stage}" + (f" ({it.variant})" if it.variant else "")
        if it.stage == "decode":
            label += f", cache {it.cache_len}"
        if any(x[2] == label and type(x[3].fam) is type(it.fam) and x[3].fam == it.fam for x in out[it.fam.family]):
            continue
        out[it.fam.family].append((it.stage, it.variant, label, it))
    return out


def render_formulation(cls, entries, cfg: ModelConfig) -> str:
    doc = inspect.cleandoc(cls.__doc__ or "")
    L = [f"# {cls.title} (`{cls.family}`)", "",
         "Generated by `python -m harness.analytic.docs` from `harness.analytic.families."
         f"{cls.__name__}`; do not edit by hand.", "",
         f"- Cost class: `{cls.__name__}`",
         f"- Reference modules: {', '.join(f'`{m}`' for m in registry.BY_FAMILY[cls.family].modules)}",
         f"- Op families: {', '.join(registry.BY_FAMILY[cls.family].ops)}", "", "## Formulas", "", doc, "",
         "Conventions shared by all families (FLOPs = 2 per MAC, counted / useful / tensor / vector, the bytes "
         "execution model): [README](README.md).", ""]
    if not entries:
        L += ["Not used by the base-mode request.", ""]
        return "\n".join(L)
    L += ["## Base mode (1024 x 1024, 273 image tokens, prompt 286 tokens, bf16)", "",
          "Shapes of each instance (one module, one call; `b` = bytes per element):", ""]
    fields = list(entries[0][3].fam.shapes())
    L += table(["where", "modules", *fields],
               [[label, it.count, *(_fmt(it.fam.shapes()[f]) for f in fields)] for _, _, label, it in entries])
    L += ["", "Cost of one module instance (one call):", ""]
    cols = list(F.COST_FIELDS) + ["bytes"]
    L += table(["where", *cols], [[label, *(_fmt(it.fam.cost().as_dict()[c]) for c in cols)]
                                  for _, _, label, it in entries])
    L.append("")
    return "\n".join(L)


def render_index(cfg: ModelConfig, instances) -> str:
    L = ["# Cost formulations (generated)", "",
         "One page per module family, generated by `python -m harness.analytic.docs` from the cost classes in "
         "`src/harness/analytic/families.py` (their docstrings and the base-mode shapes); do not edit by hand.", "",
         *table(["family", "title", "cost class", "base-mode stages"],
                [[f"[{cls.family}]({cls.family}.md)", cls.title, f"`{cls.__name__}`",
                  ", ".join(sorted({e[0] for e in instances.get(cls.family, [])}, key=compose.STAGES.index))]
                 for cls in F.FAMILIES], [LEFT] * 4)]
    L += ["", "## Conventions", "", inspect.cleandoc(F.__doc__ or "").split("Conventions (all classes)", 1)[-1]
          .split("\n", 2)[-1].strip(), ""]
    return "\n".join(L)


def render_all(cfg: Optional[ModelConfig] = None) -> "OrderedDict[str, str]":
    """{relative path under docs/: text} of every generated page."""
    cfg = cfg or ModelConfig()
    out: "OrderedDict[str, str]" = OrderedDict()
    out["module_catalog.md"] = render_module_catalog(cfg)
    inst = base_instances(cfg)
    out["formulations/README.md"] = render_index(cfg, inst)
    for cls in F.FAMILIES:
        out[f"formulations/{cls.family}.md"] = render_formulation(cls, inst.get(cls.family, []), cfg)
    return out


def write_docs(root="docs", cfg: Optional[ModelConfig] = None) -> list:
    root = Path(root)
    paths = []
    for rel, text in render_all(cfg).items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        paths.append(p)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.analytic.docs",
                                 description="Regenerate docs/module_catalog.md and docs/formulations/.")
    ap.add_argument("--out", default="docs")
    args = ap.parse_args(argv)
    for p in write_docs(args.out):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
