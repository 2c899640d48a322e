"""Workload -> cost table: one row per stage x module family (x decode step on request) + totals.

A case is one request shape, ``harness.layout.Case`` (crop mode, tile grid, batch, prompt text
tokens, decode tokens; the same type the run measures). ``workload_costs(case)`` instantiates the
family cost classes of ``families.py`` with the shapes the reference model (``harness.models``)
runs for that case and returns a DataFrame. ``resolve(case, cfg)`` adds the vision geometry
(the encoder calls, ``View``) the model config gives the case.

Execution followed (as ``DeepseekOCR.generate`` runs a request): per view (Gundam tiles first,
then the global view) SAM -> CLIP -> projector; the newline/separator layout (projector stage);
``prefill`` over the whole prompt (embedding + image scatter, decoder layers, final norm,
lm_head on every position when ``lm_head_all_positions`` and not ``prefill_logits=last``); then ``decode_tokens - 1`` decode steps
(the first new token comes from prefill) against caches of length S, S+1, ..., S+decode_tokens-2.

DataFrame columns (``COLUMNS``): ``harness.schema.analytic.COST_COLUMNS``, each with its unit there.

Stage totals sum the family rows; ``params`` of a stage total equals the parameters of the
modules the stage runs (sam 95,569,152; clip 303,177,728; projector 2,625,280 with the two
separator vectors; prefill and decode 2,934,734,080 at the vendor sizes).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import numpy as np

from ..config import ModelConfig, cost_config, prefill_logit_rows
from ..dtypes import nbytes as dtype_bytes
from ..errors import HarnessError
from ..anatomy.stages import STAGES
from ..layout import MODES, Case, as_case, parse_grid
from ..schema.analytic import COST_COLUMNS as COLUMNS
from . import families as F
from .families import Cost

INT_COLUMNS = ["step", "cache_len", "count", "tensor_flops", "vector_flops", "flops_counted", "flops_useful",
               "params", "params_active"]

# ----------------------------------------------------------------------------------------- cases

@dataclass
class View:
    """One encoder call: ``n`` images of ``size`` x ``size`` pixels; SAM grid g, output grid q."""

    label: str
    n: int
    size: int
    g: int
    q: int


@dataclass
class Resolved:
    """A ``layout.Case`` with the encoder calls (``views``) the model config gives it."""

    case: Case
    views: list

    def __getattr__(self, name):   # name, mode, grid, batch, text/image/prefill/decode tokens, decode_steps
        if name == "case":
            raise AttributeError(name)
        return getattr(self.case, name)


def sam_grids(cfg: ModelConfig, size: int) -> tuple:
    """(g, q): SAM patch grid and output grid (after neck, net_2, net_3) of a size-pixel view."""
    g = size // cfg.sam.patch_size
    q = F.conv_out(F.conv_out(g, 3, 2, 1), 3, 2, 1)
    return g, q


def resolve(case, cfg: ModelConfig) -> Resolved:
    """The case (anything ``layout.as_case`` reads) with its views: Gundam tiles (if any), then the
    global view; checks that the model config's SAM downsampling gives the case's image tokens."""
    case = as_case(case)
    mode, grid, B = case.mode, case.grid, case.batch
    views = []
    tokens = 1                                   # view separator
    if grid is not None:
        cols, rows = grid
        g, q = sam_grids(cfg, mode.image_size)
        views.append(View("tiles", B * cols * rows, mode.image_size, g, q))
        tokens += (q * cols + 1) * (q * rows)
    gsize = mode.view_size
    g, q = sam_grids(cfg, gsize)
    views.append(View("global", B, gsize, g, q))
    tokens += q * (q + 1)
    if case.image_tokens != tokens:
        raise HarnessError(f"image tokens from the model config ({tokens}) differ from the workload's "
                           f"count ({case.image_tokens}) for mode {mode.name!r}",
                           "use a model config whose SAM downsamples 64x (patch 16, two stride-2 convs)")
    return Resolved(case, views)


# ------------------------------------------------------------------------------------ families

@dataclass
class Item:
    """One family instance in a stage: ``count`` identical modules (layers) in call ``call``."""

    stage: str
    fam: F.Family
    count: int = 1
    variant: str = ""
    call: Any = 0
    step: int = -1
    cache_len: int = -1
    distinct: bool = True     # count = distinct modules (params x count) vs repeated calls

    @property
    def cost(self) -> Cost:
        c = self.fam.cost()
        return c.times(self.count) if self.distinct else c.calls(self.count)


def vision_items(cfg: ModelConfig, view: View, b: int) -> list:
    cfg = cost_config(cfg)
    s, c = cfg.sam, cfg.clip
    n, g, q, C = view.n, view.g, view.q, s.embed_dim
    call = view.label
    items = [Item("sam", F.PatchEmbed(n, view.size, C, s.patch_size, s.img_size // s.patch_size, b=b), call=call),
             Item("sam", F.LayerNorm(n * g * g, C, b), 2 * s.depth, call=call)]
    glob = [i for i in range(s.depth) if i in s.global_attn_indexes]
    win = s.depth - len(glob)
    triton = cfg.sam_attention if cfg.vision_impl == "fused" else "sdpa"
    if win:
        method = "inkernel" if triton in ("triton-windows", "triton") else "dense"
        items.append(Item("sam", F.SAMAttention(n, g, C, s.num_heads, s.window_size, s.window_size, b, method), win,
                          "window", call))
    if glob:
        method = "inkernel" if triton == "triton" else "augmented" if cfg.vision_impl == "fused" else "dense"
        items.append(Item("sam", F.SAMAttention(n, g, C, s.num_heads, 0, s.img_size // s.patch_size, b, method),
                          len(glob), "global", call))
    items.append(Item("sam", F.SAMMLP(n * g * g, C, int(C * s.mlp_ratio), b), s.depth, call=call))
    oc = s.out_chans
    c2, c3 = s.downsample_channels
    g2 = F.conv_out(g, 3, 2, 1)
    items += [Item("sam", F.Conv2d(n, C, oc, g, g, 1, b=b), 1, "neck", call),
              Item("sam", F.Conv2d(n, oc, oc, g, g, 3, 1, 1, b=b), 1, "neck", call),
              Item("sam", F.LayerNorm2d(n, oc, g, g, b), 2, call=call),
              Item("sam", F.Conv2d(n, oc, c2, g, g, 3, 2, 1, b=b), 1, "downsample", call),
              Item("sam", F.Conv2d(n, c2, c3, g2, g2, 3, 2, 1, b=b), 1, "downsample", call)]
    S = 1 + q * q
    D = c.hidden_size
    items += [Item("clip", F.CLIPEmbeddings(n, q, D, c.image_size // c.patch_size, c.patch_size, b), call=call),
              Item("clip", F.LayerNorm(n * S, D, b), 1 + 2 * c.num_layers, call=call),
              Item("clip", F.CLIPAttention(n, S, D, c.num_heads, b), c.num_layers, call=call),
              Item("clip", F.CLIPMLP(n * S, D, c.ffn_hidden_size, b), c.num_layers, call=call),
              Item("projector", F.Projector(n * q * q, cfg.projector.input_dim, cfg.projector.n_embed, b), call=call)]
    return items


def routing_mismatch(counts, tokens: int, k: int) -> Optional[int]:
    """The sum of one MoE layer's expert counts where it is not ``tokens`` x ``k`` (each token picks
    ``k`` experts, so counts of that very workload sum to exactly that), else None."""
    total = int(np.asarray(counts).sum())
    return None if total == tokens * k else total


def _touched(routing, layer: int, tokens: int, k: int, what: str) -> Optional[float]:
    """Experts touched in MoE ``layer`` from measured counts [layers, experts] (None: expectation)."""
    if routing is None:
        return None
    row = np.asarray(routing)[layer]
    if routing_mismatch(row, tokens, k) is not None:
        raise HarnessError(f"{what} routing counts of layer {layer} sum to {int(row.sum())}, expected "
                           f"{tokens} tokens x top-{k} = {tokens * k}",
                           "pass the routing counts of this very workload (GenerationResult.routing)")
    return float(np.count_nonzero(row))


def moe_kernel(cfg: ModelConfig, rows: int) -> str:
    """The kernel that runs ``rows`` routed rows (T*k) under ``cfg``'s execution: ``loop`` (vendor),
    ``triton`` / ``grouped_mm``, or the torch fallback's ``gather`` (rows <= experts) / ``dense``.
    ``moe_kernel=auto`` is taken as triton (what a CUDA run resolves it to)."""
    if cfg.moe_impl != "grouped":
        return "loop"
    kernel = "triton" if cfg.moe_kernel == "auto" else cfg.moe_kernel
    if kernel == "torch":
        return "gather" if rows <= cfg.llm.n_routed_experts else "dense"
    return kernel


def llm_items(cfg: ModelConfig, stage: str, B: int, S: int, n: int, b: int, image_tokens: int = 0,
              routing=None, step: int = -1, attn_impl: Optional[str] = None,
              kv_cache: Optional[str] = None, call: Any = 0, keys: int = 0) -> list:
    """Families of one LLM forward: B sequences of S new tokens against a cache of n tokens
    (``keys`` > 0: a static cache's decode step attends over that many positions, masked)."""
    cfg = cost_config(cfg)
    L = cfg.llm
    h, T = L.hidden_size, B * S
    impl = attn_impl or cfg.attn_implementation
    kv = kv_cache or cfg.kv_cache
    kernel = moe_kernel(cfg, T * L.num_experts_per_tok)
    kw = dict(step=step, cache_len=n, call=call)
    dense = min(L.first_k_dense_replace, L.num_layers)
    moe = L.num_layers - dense
    items = [Item(stage, F.TokenEmbedding(B, S, L.vocab_size, h, image_tokens, b), **kw),
             Item(stage, F.RMSNorm(T, h, b), 2 * L.num_layers + 1, **kw),
             *([Item(stage, F.RoPE(B, S, L.head_dim, L.num_heads, L.num_kv_heads, b, "tables"), **kw),
                Item(stage, F.RoPE(B, S, L.head_dim, L.num_heads, L.num_kv_heads, b, "apply"), L.num_layers, **kw)]
               if kv == "static" else
               [Item(stage, F.RoPE(B, S, L.head_dim, L.num_heads, L.num_kv_heads, b), L.num_layers, **kw)]),
             Item(stage, F.LLMAttention(B, S, n, h, L.num_heads, L.num_kv_heads, L.head_dim, impl, kv, b, keys),
                  L.num_layers, **kw)]
    if dense:
        items.append(Item(stage, F.DenseMLP(T, h, L.intermediate_size, b), dense, **kw))
    if moe:
        items.append(Item(stage, F.MoEGate(T, h, L.n_routed_experts, L.num_experts_per_tok, L.norm_topk_prob, b),
                          moe, **kw))
        if routing is None:
            items.append(Item(stage, F.MoERouted(T, h, L.moe_intermediate_size, L.n_routed_experts,
                                                 L.num_experts_per_tok, None, b, kernel), moe, **kw))
        else:
            for layer in range(dense, L.num_layers):
                t = _touched(routing, layer, T, L.num_experts_per_tok, stage)
                items.append(Item(stage, F.MoERouted(T, h, L.moe_intermediate_size, L.n_routed_experts,
                                                     L.num_experts_per_tok, t, b, kernel), 1, **kw))
        items.append(Item(stage, F.MoEShared(T, h, L.moe_intermediate_size * L.n_shared_experts, b), moe, **kw))
    rows = prefill_logit_rows(cfg, B, T)
    items.append(Item(stage, F.LMHead(rows, h, L.vocab_size, b), **kw))
    return items


def _decode_routing(routing, steps: int, B: int, cfg: ModelConfig):
    """Per-step [layers, experts] arrays (or None per step) from a decode routing array."""
    if routing is None or steps == 0:
        return [None] * steps
    arr = np.asarray(routing)
    if arr.ndim == 3:
        if arr.shape[0] != steps:
            raise HarnessError(f"decode routing has {arr.shape[0]} steps, the case has {steps}",
                               "pass per-step counts [steps, layers, experts] of this workload")
        return list(arr)
    # summed over steps: check the total; per-step touched experts are exact only for B == 1 (k each)
    L = cfg.llm
    k = L.num_experts_per_tok
    for layer in range(min(L.first_k_dense_replace, L.num_layers), L.num_layers):
        if routing_mismatch(arr[layer], steps * B, k) is not None:
            raise HarnessError(f"decode routing counts of layer {layer} sum to {int(arr[layer].sum())}, expected "
                               f"{steps} steps x {B} tokens x top-{k}", "pass this workload's decode routing")
    return [None] * steps


def case_items(case, cfg: ModelConfig, dtype="bf16", routing: Optional[dict] = None,
               attn_impl: Optional[str] = None, kv_cache: Optional[str] = None):
    """(Resolved case, list of Items) for every stage of the request. ``cfg``: a ``ModelConfig``
    (the vendor's execution) or a ``CostModelConfig`` (with its execution's cost knobs)."""
    cfg = cost_config(cfg)
    r = resolve(case, cfg)
    b = dtype_bytes(dtype)
    items = []
    for view in r.views:
        items += vision_items(cfg, view, b)
    feats = sum(v.n * v.q * v.q for v in r.views)
    items.append(Item("projector", F.ImageLayout(feats, r.batch * r.image_tokens, cfg.projector.n_embed, b),
                      call="glue"))
    routing = routing or {}
    S = r.prefill_tokens
    items += llm_items(cfg, "prefill", r.batch, S, 0, b, r.image_tokens, routing.get("prefill"),
                       attn_impl=attn_impl, kv_cache=kv_cache, call="prefill")
    step_routing = _decode_routing(routing.get("decode"), r.decode_steps, r.batch, cfg)
    # a static cache's masked decode attention reads the whole buffer; decode_attention=triton reads
    # only the filled positions (as the growing cache's attention does)
    masked = (kv_cache or cfg.kv_cache) == "static" and cfg.kv_cache == "static" and cfg.decode_attention != "triton"
    keys = cfg.cache_len(S, r.decode_tokens) if masked else 0
    for j in range(r.decode_steps):
        items += llm_items(cfg, "decode", r.batch, 1, S + j, b, 0, step_routing[j], step=j,
                           attn_impl=attn_impl, kv_cache=kv_cache, call=j, keys=keys)
    return r, items


# ------------------------------------------------------------------------------------ tables

def _row(case: str, stage: str, family: str, variant: str, step: int, cache_len: int, count: int, c: Cost) -> dict:
    d = {"case": case, "stage": stage, "family": family, "variant": variant, "step": step,
         "cache_len": cache_len, "count": count}
    d.update(c.as_dict())
    d["intensity"] = c.tensor_flops / d["bytes"] if d["bytes"] else 0.0
    return d


def aggregate(name: str, items: Iterable[Item], per_step: bool = False) -> list:
    """Rows (dicts) per stage x family x variant [x step]; stage totals after each stage."""
    groups: "OrderedDict[tuple, OrderedDict]" = OrderedDict()
    for it in items:
        step = it.step if per_step else -1
        cache_len = it.cache_len if (per_step or it.stage == "prefill") else -1
        key = (it.stage, it.fam.family, it.variant, step, cache_len)
        calls = groups.setdefault(key, OrderedDict())
        prev = calls.get(it.call)
        cost, cnt = it.cost, it.count
        calls[it.call] = (cost, cnt) if prev is None else (prev[0] + cost, prev[1] + cnt)
    rows = []
    by_stage: "OrderedDict[str, list]" = OrderedDict((s, []) for s in STAGES)
    for (stage, fam, variant, step, cache_len), calls in groups.items():
        acc, n = None, 0
        for cost, cnt in calls.values():
            acc = cost if acc is None else acc.again(cost)
            n += cnt
        row = _row(name, stage, fam, variant, step, cache_len, n, acc)
        by_stage.setdefault(stage, []).append((row, acc))
    for stage, entries in by_stage.items():
        if not entries:
            rows.append(_row(name, stage, "TOTAL", "", -1, -1, 0, Cost()))
            continue
        rows += [r for r, _ in entries]
        tot = Cost()
        steps = {}
        for r, c in entries:
            if r["step"] >= 0:   # per-step rows: params repeat per step, count them once
                steps.setdefault(r["step"], Cost())
                steps[r["step"]] = steps[r["step"]] + c
            else:
                tot = tot + c
        if steps:
            st = None
            for c in steps.values():
                st = c if st is None else st.again(c)
            tot = tot + st
        rows.append(_row(name, stage, "TOTAL", "", -1, -1, sum(r["count"] for r, _ in entries), tot))
    return rows


def to_frame(rows: list):
    import pandas as pd

    df = pd.DataFrame(rows, columns=COLUMNS)
    for col in INT_COLUMNS:
        df[col] = df[col].astype("int64")
    return df


def workload_costs(case, model_cfg: Optional[ModelConfig] = None, dtype="bf16", per_step: bool = False,
                   routing: Optional[dict] = None, attn_implementation: Optional[str] = None,
                   kv_cache: Optional[str] = None):
    """Cost DataFrame (``COLUMNS``) of one case: family rows and a TOTAL row per stage.

    ``routing``: measured MoE routing counts of this workload, {"prefill": [layers, experts],
    "decode": [layers, experts] summed over steps or [steps, layers, experts]} as
    ``GenerationResult.routing`` gives them; without it MoE weight bytes use the uniform-routing
    expectation. FLOPs do not depend on routing.
    """
    cfg = cost_config(model_cfg)
    r, items = case_items(case, cfg, dtype, routing, attn_implementation, kv_cache)
    return to_frame(aggregate(r.name, items, per_step))


def stage_totals(df) -> dict:
    """{stage: {column: value}} from the TOTAL rows of a ``workload_costs`` frame (the cost columns it has)."""
    tot = df[df["family"] == "TOTAL"]
    return {row["stage"]: {c: row[c] for c in COLUMNS[6:] if c in row} for _, row in tot.iterrows()}


def useful_flops(case, model_cfg: Optional[ModelConfig] = None, dtype="bf16") -> dict:
    """{stage: the analytic useful FLOPs of ``case``} (``stage_totals`` of ``workload_costs``): what
    an MFU divides."""
    return {st: float(v["flops_useful"]) for st, v in stage_totals(workload_costs(case, model_cfg, dtype)).items()}


def case_summary(case, model_cfg: Optional[ModelConfig] = None, dtype="bf16", routing=None,
                 attn_implementation=None, kv_cache=None) -> dict:
    """The ``static_compute.json`` entry of one case."""
    cfg = cost_config(model_cfg)
    r, items = case_items(case, cfg, dtype, routing, attn_implementation, kv_cache)
    df = to_frame(aggregate(r.name, items))
    totals = stage_totals(df)
    stages = {}
    for st in STAGES:
        t = totals[st]
        stages[st] = {"flops_counted": int(t["flops_counted"]), "flops_useful": int(t["flops_useful"]),
                      "tensor_flops": int(t["tensor_flops"]), "vector_flops": int(t["vector_flops"]),
                      "bytes": int(round(t["bytes"])), "params": int(t["params"])}
    return {"name": r.name, "mode": r.mode.name, "grid": list(r.grid) if r.grid else None,
            "image_tokens": r.image_tokens, "prefill_tokens": r.prefill_tokens, "decode_tokens": r.decode_tokens,
            "batch": r.batch, "text_tokens": r.text_tokens, "dtype": str(dtype),
            "attn_implementation": attn_implementation or cfg.attn_implementation,
            "kv_cache": kv_cache or cfg.kv_cache, "stages": stages, "frame": df}


# ---------------------------------------------------------------------------------- anchors

def component_params(cfg: Optional[ModelConfig] = None) -> dict:
    """Parameters per component as ``build.param_counts`` groups them, from the cost classes."""
    cfg = cfg or ModelConfig()
    r, items = case_items(Case("base", decode_tokens=2), cfg)
    df = to_frame(aggregate(r.name, items))
    tot = stage_totals(df)
    sep = 2 * cfg.projector.n_embed
    out = {"sam": int(tot["sam"]["params"]), "clip": int(tot["clip"]["params"]),
           "projector": int(tot["projector"]["params"]) - sep, "separators": sep, "llm": int(tot["prefill"]["params"])}
    out["total"] = sum(out.values())
    return out


def activated_params_per_token(cfg: Optional[ModelConfig] = None) -> int:
    """Parameters one token's forward uses: attention, dense MLP or top-k + shared experts and
    gate, norms, lm_head; the embedding lookup excluded (DESIGN.md: 574.1M)."""
    cfg = cfg or ModelConfig()
    return int(sum(it.cost.params_active for it in llm_items(cfg, "decode", 1, 1, 0, 2)))


def kv_bytes_per_token(cfg: Optional[ModelConfig] = None, dtype="bf16") -> int:
    """K and V of every layer for one token: 2 * layers * kv_heads * head_dim * bytes."""
    cfg = cfg or ModelConfig()
    L = cfg.llm
    return 2 * L.num_layers * L.num_kv_heads * L.head_dim * dtype_bytes(dtype)


def decode_step_costs(cfg: Optional[ModelConfig] = None, cache_len: int = 0, batch: int = 1, dtype="bf16",
                      attn_implementation=None, kv_cache=None) -> Cost:
    """Total cost of one decode step (batch x 1 token) against a cache of ``cache_len`` tokens."""
    cfg = cost_config(cfg)
    return F.total([it.cost for it in llm_items(cfg, "decode", batch, 1, cache_len, dtype_bytes(dtype),
                                                attn_impl=attn_implementation, kv_cache=kv_cache)])


def default_sweep_cases(decode_tokens: int = 128) -> list:
    """Every mode (crop modes: the global view alone, named ``<mode>-global``) and every gundam
    grid with 2 <= cols*rows <= 9."""
    cases = []
    for name, mode in MODES.items():
        cases.append(Case(mode, None, decode_tokens=decode_tokens, name=f"{name}-global" if mode.crop else name))
        if mode.crop:
            for cols in range(1, 10):
                for rows in range(1, 10):
                    if 2 <= cols * rows <= 9:
                        cases.append(Case(mode, (cols, rows), decode_tokens=decode_tokens))
    return cases


__all__ = ["Case", "routing_mismatch", "COLUMNS", "STAGES", "workload_costs", "case_summary", "stage_totals", "component_params",
           "activated_params_per_token", "kv_bytes_per_token", "decode_step_costs", "resolve", "as_case",
           "parse_grid", "case_items", "default_sweep_cases", "dtype_bytes"]
