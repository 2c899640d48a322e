"""The ``graph`` verb: ``graph_from_config`` builds the model and one request and ``graph`` writes
the module tree, the grouped call graphs of one prefill and one decode step, and their join with
the analytic cost model (the artifacts listed in ``harness.callgraph``).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import subprocess
import time
from pathlib import Path

import pandas as pd
import torch

from ..config import cost_config, to_dict
from ..dtypes import canonical
from ..errors import HarnessError
from ..markdown import LEFT, RIGHT, table
from ..rundir import RunDir
from ..setup import device_info, load_adapter, prepare_cases, resolve_device, resolve_dtype
from ..sweep import job_environment
from .capture import capture_reference
from .grouped import flops_text, grouped_view, render_dot, render_markdown
from .join import COLUMNS as JOIN_COLUMNS, analytic_frame, join_rows
from .tree import module_tree, vendor_class, write_tree

log = logging.getLogger("harness.callgraph")

PHASES = ("prefill", "decode")


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_memory(model_cfg, dtype, device) -> dict:
    """Refuse a CPU build that cannot fit in the memory available now: weights + 4 GiB working set
    (the full-size base-mode graph peaked at 17.4 GB RSS in fp32: 13.3 GB weights + SAM's global
    attention and the traced activations)."""
    import torch

    from ..models.build import build_model

    meta = build_model(model_cfg, device="meta", dtype=dtype)
    n = sum(p.numel() for p in meta.parameters())
    need = n * torch.empty((), dtype=dtype).element_size()
    out = {"params": n, "weight_bytes": need}
    if device.type != "cpu":
        return out
    avail = _mem_available()
    out["mem_available_bytes"] = avail
    if avail is not None and need + 4 * 2**30 > avail:
        raise HarnessError(
            f"the {model_cfg.name} model needs {need / 2**30:.1f} GiB of weights in {str(dtype).replace('torch.', '')} "
            f"plus ~4 GiB working memory; only {avail / 2**30:.1f} GiB is available now",
            "wait for other processes to finish, or use dtype=bf16 (half the weight memory)")
    return out


def write_svg(dot_path: Path) -> Path | None:
    """``dot -Tsvg`` next to the .dot file when graphviz is installed; None otherwise."""
    exe = shutil.which("dot")
    if not exe:
        return None
    svg = dot_path.with_suffix(".svg")
    try:
        subprocess.run([exe, "-Tsvg", str(dot_path), "-o", str(svg)], check=True, capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("dot failed on %s: %s", dot_path, exc)
        return None
    return svg


def _join_markdown(rows: list, note: str) -> str:
    def d(x):
        return "-" if x is None else f"{x:,}"

    L = ["# Call graph x analytic cost model", "",
         "Per module family: torchlens ops and per-op FLOPs, FlopCounterMode FLOPs (matmul/conv/attention, full "
         "S x T attention) and the analytic model's `flops_counted` for the same modules (its share of each "
         "analytic row; see `harness.callgraph.join`). `diff` = counted - analytic in FLOP (0 = exact). "
         "`-` in the analytic columns: a module inside one analytic family (a q/k/v projection, an activation), "
         "which the analytic model does not split out.", ""]
    if note:
        L += [f"_Note: {note}_", ""]
    for phase in PHASES:
        pr = [r for r in rows if r["phase"] == phase]
        if not pr:
            continue
        L += [f"## {phase}", ""]
        L += table(["level", "stage", "family", "kind", "N", "ops", "torchlens FLOP", "counted FLOP", "analytic FLOP",
                    "diff FLOP", "analytic rows"],
                   [[r["level"], r["stage"], f"`{r['family']}`", r["kind"], "" if r["count"] is None else r["count"],
                     "" if r["tl_ops"] is None else f"{r['tl_ops']:,}", flops_text(r["tl_flops"]),
                     flops_text(r["counted_flops"]), flops_text(r.get("analytic_flops_counted")),
                     d(r.get("counted_minus_analytic")), r.get("analytic_rows") or ""] for r in pr],
                   [LEFT] * 4 + [RIGHT] * 6 + [LEFT])
        L.append("")
    return "\n".join(L)


def graph(model, request, out_dir: Path, model_cfg=None, dtype_name: str = "fp32", meta: dict | None = None,
          adapter: str = "reference", progress=print) -> dict:
    """Write every graph artifact for ``model`` on ``request`` into ``out_dir``; returns {name: Path}.

    ``model`` is a reference ``DeepseekOCR`` (or, with ``adapter='vendor'``, a ``VendorOCR``) on its
    device; ``request`` is already on that device and dtype.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(meta or {})
    paths: dict = {}
    t0 = time.perf_counter()
    if adapter == "vendor":
        from .vendor import capture_vendor, vendor_tree

        rows = vendor_tree(model)
    else:
        rows = module_tree(model)
    tree_meta = {"model": meta.get("model"), "adapter": adapter, "dtype": dtype_name}
    paths.update({f"module_tree.{k}": v for k, v in write_tree(rows, out, tree_meta).items()})
    progress(f"[graph] module tree: {len(rows)} modules")
    timings = {"tree_s": round(time.perf_counter() - t0, 2)}

    t1 = time.perf_counter()
    caps = capture_vendor(model, request, progress=progress) if adapter == "vendor" else \
        capture_reference(model, request, progress=progress)
    timings["capture_s"] = round(time.perf_counter() - t1, 2)

    docs = {}
    for phase in PHASES:
        cap = caps[phase]
        what = ("vision stages (every view) + one prefill forward over the whole prompt" if phase == "prefill"
                else "one decode step (1 token) after the prefill, KV cache populated")
        doc = grouped_view(cap, {**meta, "adapter": adapter, "dtype": dtype_name, "what": what},
                           vendor_of=(lambda c: c) if adapter == "vendor" else vendor_class)
        docs[phase] = doc
        base = out / f"callgraph_{phase}"
        base.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
        base.with_suffix(".md").write_text(render_markdown(doc))
        dot = base.with_suffix(".dot")
        dot.write_text(render_dot(doc))
        paths.update({f"{base.name}.json": base.with_suffix(".json"), f"{base.name}.md": base.with_suffix(".md"),
                      f"{base.name}.dot": dot})
        svg = write_svg(dot)
        if svg:
            paths[svg.name] = svg

    note = ""
    frame = None
    try:
        from .. import analytic as _analytic  # noqa: F401
    except ImportError as exc:
        note = f"analytic columns empty: harness.analytic is not importable ({exc})"
    if not note:
        if model_cfg is None:
            note = "analytic columns empty: no reference ModelConfig for this model"
        else:
            try:
                frame = analytic_frame(request, model_cfg, dtype_name,
                                       {"prefill": caps["prefill"].routing, "decode": caps["decode"].routing})
            except Exception as exc:  # the analytic model is owned elsewhere: report, do not fail the graph
                note = f"analytic columns empty: harness.analytic failed ({exc.__class__.__name__}: {exc})"
                frame = None
    join = []
    for phase in PHASES:
        join += join_rows(docs[phase], caps[phase], frame, model, note)
    df = pd.DataFrame(join, columns=JOIN_COLUMNS)
    for col in JOIN_COLUMNS:
        if col in ("count", "calls", "tl_ops", "tl_flops", "counted_flops", "counted_minus_analytic") \
                or col.startswith("analytic_") and col != "analytic_rows":
            df[col] = df[col].astype("Int64")   # integers with empty cells, not floats
    paths["callgraph_join.csv"] = out / "callgraph_join.csv"
    df.to_csv(paths["callgraph_join.csv"], index=False)
    paths["callgraph_join.md"] = out / "callgraph_join.md"
    paths["callgraph_join.md"].write_text(_join_markdown(join, note))
    timings["total_s"] = round(time.perf_counter() - t0, 2)
    meta["timings"] = timings
    meta["join_note"] = note
    return {"paths": paths, "docs": docs, "captures": caps, "join": df, "timings": timings, "note": note}


def graph_from_config(cfg, out_dir: Path, progress=print) -> dict:
    """The ``graph`` verb: model + one request from ``cfg`` -> the artifacts above in ``out_dir``.

    Under ``model=vendor model.vendor_entry=infer`` the request is the one the vendor's ``infer()``
    builds for the workload's page (``vendor.infer_request``: its template, tokenizer and crop
    preprocessing; ``vendor_infer/`` in the run directory holds the page PNG and infer()'s printout),
    refused before any model is built unless it holds one page; the manifest's ``graph.request`` and
    the case entry's ``built_by`` say who built the request, with which prompt and page.
    ``res["request"]`` is the request captured."""
    t0 = time.perf_counter()
    rd = RunDir(Path(out_dir), to_dict(cfg), launch=job_environment())
    with rd.guard():
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device)
        dtype_name = canonical(dtype)
        rd.update(device=device_info(device), dtype=dtype_name)
        cases, tok_reason = prepare_cases(dataclasses.replace(cfg, cases=None))
        if tok_reason:
            rd.warn(tok_reason)
        case = cases[0]
        mcfg = cfg.model
        adapter = mcfg.name
        via_infer = adapter == "vendor" and mcfg.vendor_entry == "infer"
        request = case.request
        if via_infer:   # infer() takes one page: refused before any model is built
            from ..models.vendor.infer import one_page
            one_page(request)
        rd.update(memory=check_memory(mcfg, dtype, device))   # the vendor model has the same tensors
        torch.manual_seed(int(cfg.seed))
        progress(f"[graph] building {adapter} model on {device} ({dtype_name})")
        model, info = load_adapter(mcfg, device, dtype, cfg.seed,
                                   workdir=rd.path / "vendor_infer" if via_infer else None)
        if adapter != "vendor":
            from .. import variants
            info["execution"] = variants.apply(model, cfg.execution, device)
        rd.update(model=info)
        built = {"built_by": "the harness (harness.workload.build_request)"}
        if via_infer:
            request, built = _request_from_infer(model, request, rd, progress)
        request = request.to(device, dtype)
        req_desc = request.case.to_dict()
        rd.manifest["cases"].append({**req_desc, "pages": list(request.pages), "built_by": built["built_by"]})
        meta = {"model": f"{adapter} ({'random weights' if mcfg.weights == 'random' else 'weights from ' + str(mcfg.path)})",
                "device": str(device), "request": {**{k: req_desc[k] for k in ("mode", "grid", "image_tokens",
                                                                                "prefill_tokens", "batch")},
                                                   **{k: built[k] for k in ("built_by", "prompt", "page")
                                                      if k in built}}}
        if adapter == "vendor":
            ref_cfg = getattr(model, "cfg", None)
        else:
            ref_cfg = cost_config(mcfg, dataclasses.asdict(cfg.execution))
        res = graph(model, request, rd.path, ref_cfg, dtype_name, meta, adapter, progress)
        res["timings"]["build_s"] = round(info.get("build_s", 0.0), 2)
        res["timings"]["wall_s"] = round(time.perf_counter() - t0, 2)
        for w in sorted({w for c in res["captures"].values() for w in c.info.get("warnings", [])}):
            rd.warn(w)
        if res["note"]:
            rd.warn(res["note"])
        rd.update(graph={"timings": res["timings"], "files": sorted(p.name for p in res["paths"].values()),
                         "request": built,
                         "captures": {k: c.info for k, c in res["captures"].items()},
                         "svg": "written" if any(n.endswith(".svg") for n in res["paths"]) else
                                "not written: graphviz `dot` is not on PATH"})
        rd.complete()
        progress(f"[graph] wrote {rd.path} in {res['timings']['wall_s']:.1f} s")
        res["request"] = request
        return res


def _request_from_infer(model, request, rd: RunDir, progress) -> tuple:
    """(Request, record) of ``vendor.infer_request``, said in the progress lines and the manifest's
    warnings (a layout that differs from the harness's)."""
    from .vendor import infer_request

    progress(f"[graph] vendor: running the vendor's infer() on {request.source_pages[0].name} to build the "
             "request (its generate replaced for the call: records its inputs, generates nothing)")
    request, built = infer_request(model, request)
    own = built["harness_request"]
    progress(f"[graph] infer() built a prompt of {built['prompt_tokens']} tokens ({built['image_tokens']} image, "
             f"{built['text_tokens']} text, grid {built['grid'] or 'none'}) in {built['infer_s']:.2f} s from "
             f"{built['page']} and prompt {built['prompt']!r}; the harness's own request: {own['prompt_tokens']} "
             f"tokens, grid {own['grid'] or 'none'}")
    if "warning" in built:
        rd.warn(built["warning"])
    return request, built


__all__ = ["graph_from_config", "graph", "check_memory", "write_svg", "PHASES"]
