"""The static (analytic) compute report: ``analyze(cases, out_dir)`` writes ``static_compute.json``
/ ``.md`` / ``.csv`` and the sweep tables (``static_sweep.csv``: every mode and gundam grid;
``static_decode.csv``: one decode step against the KV-cache length); ``analyze_from_config`` is the
``harness analyze`` verb. No GPU and no weights are needed.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Iterable, Optional

import pandas as pd

from ..anatomy.stages import VISION_STAGES
from ..config import ModelConfig, cost_config, logits_every_position
from ..markdown import table as md_table
from .compose import (activated_params_per_token, case_summary, component_params, decode_step_costs,
                      default_sweep_cases, kv_bytes_per_token, workload_costs)

DEFAULT_CASES = ("tiny", "small", "base", "large", "gundam")
DECODE_CONTEXTS = (256, 1024, 2048, 4096, 8192)


def _g(x) -> str:
    return f"{x / 1e9:,.2f}"


def _mb(x) -> str:
    return f"{x / 1e6:,.1f}"


def _sweep_rows(cases, cfg, dtype, attn, kv) -> list:
    rows = []
    for case in cases:
        s = case_summary(case, cfg, dtype, None, attn, kv)
        st = s["stages"]
        vision = sum(st[k]["flops_counted"] for k in VISION_STAGES)
        rows.append({"case": s["name"], "mode": s["mode"], "grid": "x".join(map(str, s["grid"])) if s["grid"] else "",
                     "image_tokens": s["image_tokens"], "prefill_tokens": s["prefill_tokens"],
                     "decode_tokens": s["decode_tokens"],
                     "vision_flops_counted": vision,
                     "vision_bytes": sum(st[k]["bytes"] for k in VISION_STAGES),
                     "prefill_flops_counted": st["prefill"]["flops_counted"],
                     "prefill_flops_useful": st["prefill"]["flops_useful"],
                     "prefill_bytes": st["prefill"]["bytes"],
                     "decode_flops_counted": st["decode"]["flops_counted"], "decode_bytes": st["decode"]["bytes"],
                     "request_flops_counted": sum(v["flops_counted"] for v in st.values()),
                     "request_bytes": sum(v["bytes"] for v in st.values())})
    return rows


def _decode_rows(cfg, dtype, attn, kv) -> list:
    rows = []
    for n in DECODE_CONTEXTS:
        c = decode_step_costs(cfg, n, 1, dtype, attn, kv)
        rows.append({"cache_len": n, "tensor_flops": c.tensor_flops, "flops_counted": c.flops_counted,
                     "vector_flops": c.vector_flops, "bytes": c.bytes, "bytes_weights": c.bytes_weights,
                     "bytes_kv": c.bytes_kv_read + c.bytes_kv_write,
                     "bytes_act": c.bytes_act_read + c.bytes_act_write,
                     "intensity": c.tensor_flops / c.bytes})
    return rows


def analyze(cases: Optional[Iterable] = None, out_dir="runs/analyze", model_cfg: Optional[ModelConfig] = None,
            dtype="bf16", attn_implementation: Optional[str] = None, kv_cache: Optional[str] = None,
            per_step: bool = False, sweep: bool = True, routing: Optional[dict] = None) -> dict:
    """Write the static (analytic) compute report of ``cases`` into ``out_dir``.

    ``cases``: Case objects, mode names ('base', 'gundam:2x3') or dicts {mode, grid, batch,
    text_tokens, decode_tokens, name}; default the five modes. Returns {kind: Path} for
    ``json`` (static_compute.json), ``md`` (static_compute.md), ``csv`` (every stage x family row),
    and with ``sweep`` ``sweep_csv`` (every mode and gundam grid) and ``decode_csv`` (one decode
    step vs KV-cache length). ``routing`` (measured MoE counts, see ``workload_costs``) applies to
    every case.
    """
    t0 = time.perf_counter()
    cfg = cost_config(model_cfg)
    cases = list(cases) if cases is not None else list(DEFAULT_CASES)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    attn = attn_implementation or cfg.attn_implementation
    kv = kv_cache or cfg.kv_cache
    summaries, frames = [], []
    for case in cases:
        s = case_summary(case, cfg, dtype, routing, attn, kv)
        frame = s.pop("frame")
        frames.append(workload_costs(case, cfg, dtype, True, routing, attn, kv) if per_step else frame)
        summaries.append(s)
    anchors = {"params": component_params(cfg), "activated_params_per_token": activated_params_per_token(cfg),
               "kv_bytes_per_token": kv_bytes_per_token(cfg, dtype)}
    paths = {}
    doc = {"cases": summaries, "anchors": anchors,
           "model": {"name": cfg.name, "dtype": str(dtype), "attn_implementation": attn, "kv_cache": kv,
                     "lm_head_all_positions": logits_every_position(cfg.lm_head_all_positions, cfg.prefill_logits)},
           "units": {"flops_*": "FLOP (2 per multiply-accumulate)", "bytes": "B", "params": "parameters"},
           "conventions": {
               "flops_counted": "FlopCounterMode convention: matmul/conv/attention, full S x T attention, "
                                "padded SAM windows, rel-pos einsums and RoPE bmm included",
               "flops_useful": "causal prefill attention (S(S+1)/2 pairs), unpadded SAM windows",
               "tensor_flops": "matmul/conv/attention FLOPs the attention kernel executes (fused kernels skip "
                               "masked causal tiles)",
               "vector_flops": "elementwise/norm/softmax estimate, 1 FLOP per op per element",
               "bytes": "weights once per call (MoE: touched experts, uniform-routing expectation unless "
                        "measured), activations in/out per kernel with fused elementwise epilogues, KV read/written",
               "params": "parameters of the modules the stage runs"}}
    paths["json"] = out / "static_compute.json"
    paths["json"].write_text(json.dumps(doc, indent=2) + "\n")
    full = pd.concat(frames, ignore_index=True)
    paths["csv"] = out / "static_compute.csv"
    full.to_csv(paths["csv"], index=False)
    sweep_rows, decode_rows = [], []
    if sweep:
        sweep_rows = _sweep_rows(default_sweep_cases(summaries[0]["decode_tokens"] if summaries else 128),
                                 cfg, dtype, attn, kv)
        paths["sweep_csv"] = out / "static_sweep.csv"
        pd.DataFrame(sweep_rows).to_csv(paths["sweep_csv"], index=False)
        decode_rows = _decode_rows(cfg, dtype, attn, kv)
        paths["decode_csv"] = out / "static_decode.csv"
        pd.DataFrame(decode_rows).to_csv(paths["decode_csv"], index=False)
    paths["md"] = out / "static_compute.md"
    paths["md"].write_text(render_markdown(summaries, frames, anchors, doc["model"], sweep_rows, decode_rows,
                                           time.perf_counter() - t0))
    return paths


def render_markdown(summaries, frames, anchors, model, sweep_rows, decode_rows, seconds: float) -> str:
    L = ["# Static compute (analytic)", "",
         f"Model `{model['name']}`, dtype {model['dtype']}, attention `{model['attn_implementation']}`, "
         f"KV cache `{model['kv_cache']}`, lm_head on all prefill positions: {model['lm_head_all_positions']}. "
         "No GPU, no weights: every number comes from the cost classes in `harness.analytic.families` "
         "(formulas: `docs/formulations/`).", "",
         "FLOPs are 2 per multiply-accumulate. `counted` = FlopCounterMode convention (full S x T attention, "
         "padded SAM windows; checked exactly by `python -m harness.analytic.check`); `useful` = causal prefill "
         "attention and unpadded windows; `tensor` = what the attention kernel executes; `vector` = elementwise "
         "estimate. Bytes: weights once per call (MoE: experts touched, uniform-routing expectation), activations "
         "in/out per kernel, KV read and written.", "",
         "## Anchors", ""]
    p = anchors["params"]
    L += md_table(["quantity", "value"], [
        ["parameters LLM", f"{p['llm']:,}"], ["parameters SAM", f"{p['sam']:,}"], ["parameters CLIP", f"{p['clip']:,}"],
        ["parameters projector", f"{p['projector']:,}"], ["parameters separators", f"{p['separators']:,}"],
        ["parameters total", f"{p['total']:,}"],
        ["activated parameters per token", f"{anchors['activated_params_per_token']:,}"],
        ["KV cache bytes per token", f"{anchors['kv_bytes_per_token']:,}"]])
    L += ["", "## Stages per case", ""]
    rows = []
    for s in summaries:
        for st, v in s["stages"].items():
            rows.append([s["name"], s["image_tokens"], s["prefill_tokens"], s["decode_tokens"], st,
                         _g(v["flops_counted"]), _g(v["flops_useful"]), _g(v["tensor_flops"]), _g(v["vector_flops"]),
                         _mb(v["bytes"]), f"{v['params']:,}",
                         f"{v['tensor_flops'] / v['bytes']:.1f}" if v["bytes"] else "-"])
    L += md_table(["case", "image tok", "prefill tok", "decode tok", "stage", "counted GFLOP", "useful GFLOP",
                    "tensor GFLOP", "vector GFLOP", "MB", "params", "FLOP/B"], rows,
                   ["---"] + ["---:"] * 3 + ["---"] + ["---:"] * 7)
    L += ["", "## Families per case", "",
          "Decode rows sum all decode steps. Columns as in `harness.analytic.compose.COLUMNS`.", ""]
    for s, df in zip(summaries, frames):
        L += [f"### {s['name']}", ""]
        fam = df[df["family"] != "TOTAL"]
        rows = [[r.stage, r.family + (f" ({r.variant})" if r.variant else "") + (f" step {r.step}" if r.step >= 0 else ""),
                 f"{r['count']:,}", _g(r.flops_counted), _g(r.flops_useful), _g(r.tensor_flops), _g(r.vector_flops),
                 _mb(r.bytes_weights), _mb(r.bytes_act_read + r.bytes_act_write), _mb(r.bytes_kv_read + r.bytes_kv_write),
                 f"{r.params:,}"] for _, r in fam.iterrows()]
        L += md_table(["stage", "family", "calls", "counted GFLOP", "useful GFLOP", "tensor GFLOP", "vector GFLOP",
                        "weights MB", "act MB", "KV MB", "params"], rows, ["---", "---"] + ["---:"] * 9)
        L.append("")
    if sweep_rows:
        L += ["## Sweep: modes and gundam grids", "",
              "Every mode (gundam without tiles = global view only) and every gundam grid with 2 <= cols x rows "
              "<= 9; counted GFLOP per stage group and bytes in MB.", ""]
        rows = [[r["case"], r["image_tokens"], r["prefill_tokens"], _g(r["vision_flops_counted"]), _mb(r["vision_bytes"]),
                 _g(r["prefill_flops_counted"]), _g(r["prefill_flops_useful"]), _mb(r["prefill_bytes"]),
                 _g(r["decode_flops_counted"]), _mb(r["decode_bytes"]), _g(r["request_flops_counted"])]
                for r in sweep_rows]
        L += md_table(["case", "image tok", "prefill tok", "vision GFLOP", "vision MB", "prefill GFLOP",
                        "prefill useful GFLOP", "prefill MB", "decode GFLOP", "decode MB", "request GFLOP"], rows)
        L += ["", "## One decode step vs KV-cache length (batch 1)", ""]
        rows = [[f"{r['cache_len']:,}", _g(r["tensor_flops"]), _g(r["vector_flops"]), _mb(r["bytes"]),
                 _mb(r["bytes_weights"]), _mb(r["bytes_kv"]), _mb(r["bytes_act"]), f"{r['intensity']:.2f}"]
                for r in decode_rows]
        L += md_table(["cache tokens", "tensor GFLOP", "vector GFLOP", "MB", "weights MB", "KV MB", "act MB",
                        "FLOP/B"], rows)
    L += ["", f"_Computed in {seconds:.2f} s._", ""]
    return "\n".join(L)


def analyze_from_config(cfg, out_dir) -> dict:
    """The ``analyze`` verb: the cases of a run config (``workload`` + ``cases``, prepared as the run
    prepares them, so names, grids and token counts are the run's) -> static_compute.*. Preparing
    them loads the pages and the tokenizer and builds each case's first request (``harness.setup``,
    the running side): the only part of ``harness.analytic`` that imports torch, on call."""
    from ..setup import prepare_cases

    cases, _ = prepare_cases(cfg)
    dtype = "bf16" if cfg.dtype == "auto" else cfg.dtype
    paths = analyze([c.case for c in cases], out_dir, cost_config(cfg.model, dataclasses.asdict(cfg.execution)),
                    dtype=dtype)
    print(f"[harness] analytic report: {paths['md']}")
    return paths


__all__ = ["analyze", "analyze_from_config", "render_markdown", "DEFAULT_CASES", "DECODE_CONTEXTS"]
