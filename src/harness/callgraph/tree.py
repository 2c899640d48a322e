"""The module tree: every ``named_modules()`` entry with class, stage, leaf flag and parameters.

Rows (``module_tree``; one per module, in ``named_modules()`` order, each module once):

name            dotted path (``""`` is the root, shown as ``<root>`` in the text tree)
depth           number of dots + 1 (root 0)
cls             our class name (``SAMBlock``); ``vendor_cls`` the vendor's name for it
stage           sam | clip | projector | prefill/decode (LLM modules run in both) | all (containers)
leaf            True when the module has no child modules
params_own      parameters registered on the module itself [parameters]
params_total    parameters of the module and everything below it [parameters]

``write_tree(rows, out_dir)`` writes ``module_tree.json`` (columns + one list per row, compact;
``depth`` and ``vendor_cls`` derived, see ``write_tree``; ``read_tree`` restores them)
and ``module_tree.txt`` (an indented tree, two spaces per level).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

from torch import nn

from ..anatomy.registry import vendor_class
from ..anatomy.stages import module_stage

COLUMNS = ["name", "depth", "cls", "vendor_cls", "stage", "leaf", "params_own", "params_total"]


def stage_label(name: str, phase: Optional[str] = None) -> str:
    """sam / clip / projector; LLM modules ``prefill/decode`` (or ``phase`` when given); else ``all``."""
    st = module_stage(name)
    if st == "llm":
        return phase or "prefill/decode"
    return st or "all"


def _totals(model: nn.Module) -> dict:
    """params_total per module name, in one pass over the modules."""
    out: dict = {}
    for name, mod in model.named_modules():
        n = sum(p.numel() for p in mod.parameters(recurse=False))
        parts = name.split(".") if name else []
        for i in range(len(parts) + 1):
            key = ".".join(parts[:i])
            out[key] = out.get(key, 0) + n
    return out


def module_tree(model: nn.Module, class_of: Callable[[nn.Module], str] = lambda m: type(m).__name__,
                     vendor_of: Callable[[str], str] = vendor_class) -> list:
    """One dict per ``named_modules()`` entry (see the module docstring for the fields)."""
    totals = _totals(model)
    rows = []
    for name, mod in model.named_modules():
        cls = class_of(mod)
        rows.append({"name": name, "depth": 0 if not name else name.count(".") + 1, "cls": cls,
                     "vendor_cls": vendor_of(cls), "stage": stage_label(name),
                     "leaf": next(iter(mod.children()), None) is None,
                     "params_own": sum(p.numel() for p in mod.parameters(recurse=False)),
                     "params_total": totals.get(name, 0)})
    return rows


def tree_text(rows: list) -> str:
    """Indented text: ``name: Class (vendor Class) [stage] leaf own=N total=N``, two spaces per level."""
    lines = []
    for r in rows:
        short = r["name"].rsplit(".", 1)[-1] if r["name"] else "<root>"
        vend = f" (vendor {r['vendor_cls']})" if r["vendor_cls"] != r["cls"] else ""
        leaf = " leaf" if r["leaf"] else ""
        own = f" own={r['params_own']:,}" if r["params_own"] and not r["leaf"] else ""
        lines.append(f"{'  ' * r['depth']}{short}: {r['cls']}{vend} [{r['stage']}]{leaf}"
                     f" params={r['params_total']:,}{own}")
    return "\n".join(lines) + "\n"


JSON_COLUMNS = ["name", "cls", "stage", "leaf", "params_own", "params_total"]


def write_tree(rows: list, out_dir: Path, meta: Optional[dict] = None) -> dict:
    """``module_tree.json`` and ``module_tree.txt``; returns their paths.

    The JSON is compact (the full model has 3,367 modules): ``columns`` + one list per row;
    ``depth`` (dots + 1) and ``vendor_cls`` (``vendor_classes[cls]``, else ``cls``) are derived,
    and ``read_tree`` restores them.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vendor = {r["cls"]: r["vendor_cls"] for r in rows if r["vendor_cls"] != r["cls"]}
    doc = {"meta": {**(meta or {}), "modules": len(rows),
                    "stage": "sam | clip | projector | prefill/decode (LLM modules) | all (containers)",
                    "leaf": "module without child modules",
                    "params": "parameters (own: registered on the module itself; total: the module and its "
                              "descendants)",
                    "derived": "depth = dots in name + 1 (root 0); vendor class = vendor_classes[cls] or cls"},
           "vendor_classes": dict(sorted(vendor.items())), "columns": JSON_COLUMNS}
    body = ",\n".join(json.dumps([r[c] for c in JSON_COLUMNS], separators=(",", ":")) for r in rows)
    head = json.dumps(doc, indent=1)[:-2]  # drop the closing "\n}"
    text = head + ',\n "rows": [\n' + body + "\n ]\n}\n"
    paths = {"json": out_dir / "module_tree.json", "txt": out_dir / "module_tree.txt"}
    paths["json"].write_text(text)
    paths["txt"].write_text(tree_text(rows))
    return paths


def read_tree(path: Path) -> list:
    """Rows (dicts with every ``COLUMNS`` field) back from ``module_tree.json``."""
    doc = json.loads(Path(path).read_text())
    vendor = doc.get("vendor_classes", {})
    out = []
    for cells in doc["rows"]:
        r = dict(zip(doc["columns"], cells))
        r["depth"] = 0 if not r["name"] else r["name"].count(".") + 1
        r["vendor_cls"] = vendor.get(r["cls"], r["cls"])
        out.append({c: r[c] for c in COLUMNS})
    return out
