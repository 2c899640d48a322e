"""Where the fused decode step's numerics leave the vendor-style step's: one decode step of the
model (``model=``; the full-size reference by default), every intermediate of every layer compared.

    python -m harness bench decode_step_diag                      # bf16, ~2 min on an H100 (cold Triton cache)
    python -m harness bench decode_step_diag dtype=fp32           # fp32, TF32 off (no fp32 "truth" column)
    TRITON_INTERPRET=1 python -m harness bench decode_step_diag model=tiny model.llm.vocab_size=1024 device=cpu \
        bench.decode_step_diag.prompt=6 bench.decode_step_diag.cache_len=16 bench.decode_step_diag.greedy=2

The model (random weights, seed 0, ``dtype``: bf16 on CUDA, fp32 on the CPU unless given) prefills
``prompt`` random tokens into a static cache with the vendor-style modules
(``variants.apply(kv_cache=static)``); from that same cache state one decode step (the token the
prefill chose, at position ``prompt``) runs through:

- ``ref``: the vendor-style modules (eager; forward hooks collect the intermediates);
- ``ref-fp32red``: the same with ``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction``
  (and its fp16 twin) off, so cuBLAS sums split-K partials in fp32 (bf16 only): how much of the
  reference's own rounding depends on cuBLAS's choice;
- ``fused``: ``FusedDecodeStep`` (``debug``: its norms are written out too), launched one kernel at
  a time, each kernel's outputs copied after it;
- ``local``: the fused step again, its residual stream h reset to the reference's before every
  attention block and every MLP block, so each row shows what that block adds by itself;
- ``truth`` (bf16 only): the vendor-style modules in fp32 over the bf16 weights and the bf16 cache
  (both exact in fp32): the step's exact math up to fp32 rounding.

Intermediates per layer: ``attn_norm`` (input_layernorm(h)), ``q`` (after RoPE), ``k``, ``v`` (the
cache row written at the position), ``attn_out`` (o_proj's input), ``h_attn`` (h after attention),
``mlp_norm``, ``router_logits`` (fp32), ``router_ids`` (the set), ``router_wts`` (the common experts'),
``mlp_act`` (SwiGLU rows: dense, or the shared parts and the routed experts matched by id),
``h_out``; then ``final_norm``, ``logits``. Columns of ``diag.csv`` (all measured): max |a - b|,
elements that differ, elements, max distance in units in the last place of the tensor's dtype
(bf16 or fp32) among the elements of at least 1/1000 of the largest magnitude (``ids``: experts not
in both sets); ``err/truth``: ||x - truth|| / ||truth|| of the fused and reference values. The first
row where ``fused`` differs from ``ref`` is where the divergence starts. Also: whether the fused
step's RoPE table row equals the reference's cos/sin, and (``greedy`` N) N greedy steps of the fused
step (CUDA graph) against the reference's (eager): tokens equal before the first divergence. The
prefill, greedy and agreement helpers serve ``bench decode_step``'s parity check too.
"""
from __future__ import annotations

import time

import torch

NAMES = ("attn_norm", "q", "k", "v", "attn_out", "h_attn", "mlp_norm", "router_logits", "router_ids", "router_wts",
         "mlp_act", "h_out")
#: the paths compared with ``ref`` (column prefix of diag.csv and the report)
PATHS = {"fused": "fused", "local": "local", "ref-fp32red": "fp32red"}


# ----------------------------------------------------------------------------------- metrics

def ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """The float bits of ``x`` (bf16 or fp32) as integers ordered like the values (sign-magnitude to
    two's complement): adjacent floats differ by 1."""
    if x.dtype == torch.bfloat16:
        i = x.contiguous().view(torch.int16).to(torch.int64)
        mag = i & 0x7FFF
    elif x.dtype == torch.float32:
        i = x.contiguous().view(torch.int32).to(torch.int64)
        mag = i & 0x7FFFFFFF
    else:
        raise ValueError(f"ulp distance of {x.dtype}")
    return torch.where(i < 0, -mag, mag)


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    """max |a - b|, elements that differ, elements, and the max ulp distance (a, b of one dtype)
    among the elements whose |b| is at least 1/1000 of the largest |b| (near zero, a distance in
    ulps of the element's own magnitude says nothing: a sum of terms that cancel)."""
    a, b = a.reshape(-1), b.reshape(-1)
    diff = (a.double() - b.double()).abs()
    big = b.double().abs() >= 1e-3 * float(b.double().abs().max()) if b.numel() else b.bool()
    ulp = (ordered_bits(a) - ordered_bits(b)).abs()[big]
    return {"max_abs": float(diff.max()) if diff.numel() else 0.0, "differ": int((a != b).sum()), "n": a.numel(),
            "max_ulp": int(ulp.max()) if ulp.numel() else 0}


def rel_err(x: torch.Tensor, truth: torch.Tensor) -> float:
    t = truth.double().reshape(-1)
    return float((x.double().reshape(-1) - t).norm() / t.norm()) if t.norm() > 0 else 0.0


def compare_entry(name: str, a, b) -> dict:
    """``compare`` for one intermediate; routing entries are dicts {expert id: weight} / id sets and
    ``mlp_act`` a dict {row key: row} (rows present in both are compared)."""
    if name == "router_ids":
        return {"max_abs": 0.0, "differ": len(set(a) ^ set(b)) // 2, "n": len(a), "max_ulp": 0}
    if isinstance(a, dict):
        keys = sorted(set(a) & set(b), key=str)
        if not keys:
            return {"max_abs": 0.0, "differ": 0, "n": 0, "max_ulp": 0}
        return compare(torch.stack([torch.as_tensor(a[k]).reshape(-1) for k in keys]),
                       torch.stack([torch.as_tensor(b[k]).reshape(-1) for k in keys]))
    return compare(a, b)


def truth_error(name: str, x, truth):
    if name == "router_ids" or x is None or truth is None:
        return None
    if isinstance(x, dict):
        keys = sorted(set(x) & set(truth), key=str)
        if not keys:
            return None
        return rel_err(torch.stack([torch.as_tensor(x[k]).reshape(-1) for k in keys]),
                       torch.stack([torch.as_tensor(truth[k]).reshape(-1) for k in keys]))
    return rel_err(x, truth)


# ------------------------------------------------------------------------- the reference step

def reference_step(model, cache, token: torch.Tensor, pos: int) -> dict:
    """{(layer, name): value} of one vendor-style decode step at ``pos`` (forward hooks)."""
    from ..models.llm import MoE, apply_rope

    got, handles = {}, []
    layers = model.model.layers

    def keep(key, fn):
        def hook(mod, args, out=None):
            got[key] = fn(args, out)
        return hook

    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        handles += [
            layer.input_layernorm.register_forward_hook(keep((i, "attn_norm"), lambda a, o: o[0, -1].clone())),
            attn.q_proj.register_forward_hook(keep((i, "_q"), lambda a, o: o.clone())),
            attn.k_proj.register_forward_hook(keep((i, "_k"), lambda a, o: o.clone())),
            attn.v_proj.register_forward_hook(keep((i, "_v"), lambda a, o: o.clone())),
            attn.o_proj.register_forward_pre_hook(keep((i, "attn_out"), lambda a, o: a[0][0, -1].clone())),
            layer.post_attention_layernorm.register_forward_pre_hook(
                keep((i, "h_attn"), lambda a, o: a[0][0, -1].clone())),
            layer.post_attention_layernorm.register_forward_hook(keep((i, "mlp_norm"), lambda a, o: o[0, -1].clone())),
            layer.register_forward_hook(keep((i, "h_out"), lambda a, o: o[0, -1].clone()))]
        if isinstance(mlp, MoE):
            handles.append(mlp.gate.register_forward_hook(keep((i, "_route"),
                                                               lambda a, o: (o[0].clone(), o[1].clone()))))
            for e, ex in enumerate(mlp.experts):
                handles.append(ex.down_proj.register_forward_pre_hook(
                    keep((i, ("expert", e)), lambda a, o: a[0].reshape(-1).clone())))
            handles.append(mlp.shared_experts.down_proj.register_forward_pre_hook(
                keep((i, "_shared_act"), lambda a, o: a[0].reshape(-1).clone())))
        else:
            handles.append(mlp.down_proj.register_forward_pre_hook(
                keep((i, "_dense_act"), lambda a, o: a[0].reshape(-1).clone())))
    handles += [model.model.norm.register_forward_hook(keep((len(layers), "final_norm"),
                                                            lambda a, o: o[0, -1].clone())),
                model.lm_head.register_forward_hook(keep((len(layers), "logits"), lambda a, o: o[0, -1].clone()))]
    try:
        with torch.inference_mode():
            model.decode_step(token.view(1, 1), cache)
    finally:
        for h in handles:
            h.remove()
    cos, sin = cache.rope
    out = {}
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        q, k, _ = attn.heads(got.pop((i, "_q")), got.pop((i, "_k")), got.pop((i, "_v")))
        q, _ = apply_rope(q, k, cos, sin)
        out[(i, "q")] = q.reshape(-1)
        out[(i, "k")] = cache.k[i][0, :, pos].reshape(-1).clone()
        out[(i, "v")] = cache.v[i][0, :, pos].reshape(-1).clone()
        if (i, "_route") in got:
            idx, w = got.pop((i, "_route"))
            out[(i, "router_ids")] = sorted(int(e) for e in idx.reshape(-1))
            out[(i, "router_wts")] = {int(e): float(v) for e, v in zip(idx.reshape(-1), w.reshape(-1))}
            with torch.inference_mode():
                out[(i, "router_logits")] = layer.mlp.gate.logits(got[(i, "mlp_norm")][None])[0]
            shared = got.pop((i, "_shared_act"))
            inter = layer.mlp.experts[0].down_proj.weight.shape[1]
            acts = {("shared", p): shared[p * inter:(p + 1) * inter] for p in range(shared.numel() // inter)}
            for key in [k for k in got if k[0] == i and isinstance(k[1], tuple)]:
                acts[key[1]] = got.pop(key)
            out[(i, "mlp_act")] = acts
        else:
            out[(i, "mlp_act")] = {("dense", 0): got.pop((i, "_dense_act"))}
    out.update(got)
    out["_rope"] = (cos.reshape(-1).clone(), sin.reshape(-1).clone())
    return out


# --------------------------------------------------------------------------- the fused step

def fused_step(step, pos: int, ref=None) -> dict:
    """{(layer, name): value} of one ``FusedDecodeStep`` run launch by launch; with ``ref`` (a
    ``reference_step`` result) h is reset to the reference's before each attention and MLP block."""
    out = {}
    L = len(step.w.layers)
    for label, i, call in step.calls:
        if ref is not None and label == "qkv" and i > 0:
            step.h.copy_(ref[(i - 1, "h_out")])
        if ref is not None and label in ("router", "gate_up") and (label == "router" or not step.w.layers[i].moe):
            step.h.copy_(ref[(i, "h_attn")])
        call()
        if step.h.device.type == "cuda":
            torch.cuda.synchronize()
        if label == "qkv":
            out[(i, "attn_norm")] = step.norm_out.clone()
            out[(i, "q")] = step.q.clone()
            out[(i, "k")] = step.cache.k[i][0, :, pos].reshape(-1).clone()
            out[(i, "v")] = step.cache.v[i][0, :, pos].reshape(-1).clone()
        elif label == "attention":
            out[(i, "attn_out")] = step.attn_out.clone()
        elif label == "o_proj":
            out[(i, "h_attn")] = step.h.clone()
        elif label == "router":
            out[(i, "mlp_norm")] = step.xn.clone()
            out[(i, "router_logits")] = step.router_logits.clone()
            ids, wts = step.ids[i].tolist(), step.wts[i].tolist()
            out[(i, "router_ids")] = sorted(ids)
            out[(i, "router_wts")] = dict(zip(ids, wts))
        elif label == "gate_up":
            lw = step.w.layers[i]
            if lw.moe:
                P = step.moe_act.shape[0] - step.w.top_k
                acts = {("shared", p): step.moe_act[p].clone() for p in range(P)}
                acts.update({("expert", e): step.moe_act[P + j].clone() for j, e in enumerate(step.ids[i].tolist())})
                out[(i, "mlp_act")] = acts
            else:
                out[(i, "mlp_act")] = {("dense", 0): step.dense_act.reshape(-1).clone()}
        elif label == "down":
            out[(i, "h_out")] = step.h.clone()
        elif label == "lm_head":
            out[(L, "final_norm")] = step.norm_out.clone()
            out[(L, "logits")] = step.logits.clone()
    return out


# ------------------------------------------------- the reference's prefill and greedy steps

PROMPT_SEED = 7   # the random prompt's generator seed


def static_cache(llm, length: int, dtype, dev):
    """A batch-1 ``StaticKVCache`` of ``length`` positions for ``llm`` (``LLMConfig``), its position a
    device tensor at 0."""
    from ..variants.static_kv import StaticKVCache

    cache = StaticKVCache(llm.num_layers, 1, llm.num_kv_heads, length, llm.head_dim, dtype, dev,
                          query_heads=llm.num_heads)
    cache.position = torch.zeros(1, dtype=torch.int64, device=dev)
    return cache


def prefill_random(model, cache, prompt: int) -> torch.Tensor:
    """The greedy token [1, 1] after a prefill of ``prompt`` random tokens (seed ``PROMPT_SEED``) into
    ``cache`` (the vendor-style modules)."""
    dev = cache.k[0].device
    ids = torch.randint(0, model.cfg.llm.vocab_size, (1, prompt),
                        generator=torch.Generator().manual_seed(PROMPT_SEED)).to(dev)
    with torch.inference_mode():
        return model.prefill(ids, torch.zeros_like(ids, dtype=torch.bool), None, cache)[:, -1:].float().argmax(-1)


def reference_greedy(model, cache, token: torch.Tensor, n: int) -> tuple:
    """([token], [fp32 logits]) of ``n`` greedy vendor-style decode steps from ``token`` (eager)."""
    tokens, logits = [], []
    tok = token.view(1, 1)
    with torch.inference_mode():
        for _ in range(n):
            out = model.decode_step(tok, cache)[0, -1]
            tok = out.float().argmax().view(1, 1)
            tokens.append(int(tok))
            logits.append(out.float())
    return tokens, logits


def agreement(tokens: list, ref: list) -> tuple:
    """(tokens equal to ``ref``'s before the first divergence, tokens equal in all)."""
    same = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), min(len(tokens), len(ref)))
    return same, sum(a == b for a, b in zip(tokens, ref))


# ---------------------------------------------------------------------------------- the run

def run(cfg, opts, device, report) -> None:
    """The diagnostic (module docstring) of ``cfg.model`` on ``device``: the table ``diag`` and the notes."""
    from .. import variants
    from ..config import ExecutionConfig
    from ..kernels.decode_step import FusedDecodeStep, default_config
    from ..models.build import build_model
    from ..setup import resolve_dtype
    from ..variants.fused_step import weights_from_model

    t_start = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dt = resolve_dtype(cfg.dtype, device)
    L = cfg.model.llm
    model = build_model(cfg.model, device, dt, seed=cfg.seed)
    variants.apply(model, ExecutionConfig(kv_cache="static"))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    report.note(f"{where}, torch {torch.__version__}, {dt}, {L.num_layers} layers, vocabulary {L.vocab_size}; "
                f"model built in {time.perf_counter() - t_start:.0f} s; prompt {opts.prompt} random tokens")

    def new_cache(dtype):
        return static_cache(L, opts.cache_len, dtype, device)

    cache = new_cache(dt)
    token = prefill_random(model, cache, opts.prompt)
    state = [t.clone() for t in cache.k + cache.v + [cache.position]]

    def restore(target):
        for dst, src in zip(target.k + target.v + [target.position], state):
            dst.copy_(src.to(dst.dtype))
        target.length = opts.prompt

    P = opts.prompt
    paths = {}
    restore(cache)
    paths["ref"] = reference_step(model, cache, token, P)
    if dt == torch.bfloat16:
        rr = torch.backends.cuda.matmul
        keep = (rr.allow_bf16_reduced_precision_reduction, rr.allow_fp16_reduced_precision_reduction)
        rr.allow_bf16_reduced_precision_reduction = rr.allow_fp16_reduced_precision_reduction = False
        restore(cache)
        paths["ref-fp32red"] = reference_step(model, cache, token, P)
        rr.allow_bf16_reduced_precision_reduction, rr.allow_fp16_reduced_precision_reduction = keep

    fcache = new_cache(dt)
    restore(fcache)
    ftoken = token.view(1).clone()
    step = FusedDecodeStep(weights_from_model(model), fcache, fcache.position, token=ftoken, debug=True,
                           config=default_config(device))
    rope_row = (step.cos[P], step.sin[P])
    paths["fused"] = fused_step(step, P)
    restore(fcache)
    ftoken.fill_(int(token))
    paths["local"] = fused_step(step, P, ref=paths["ref"])

    if dt == torch.bfloat16:                          # fp32 math over the same weights and cache
        truth = build_model(cfg.model, device, torch.float32, init=False)
        truth.load_state_dict(model.state_dict())
        variants.apply(truth, ExecutionConfig(kv_cache="static"))
        tcache = new_cache(torch.float32)
        restore(tcache)
        paths["truth"] = reference_step(truth, tcache, token, P)
        del truth, tcache
        if device.type == "cuda":
            torch.cuda.empty_cache()

    ref = paths["ref"]
    cos_ok = [int((a != b).sum()) for a, b in zip(rope_row, ref["_rope"])]
    report.note(f"RoPE table row at position {P} against the reference's cos/sin: {cos_ok[0]} cos and {cos_ok[1]} "
                f"sin entries differ (of {rope_row[0].numel()})")
    columns = ["layer", "intermediate"] + [f"{p}_{m}" for p in PATHS.values() for m in ("max_abs", "differ", "n",
                                                                                        "max_ulp")]
    columns += ["fused_err_truth", "ref_err_truth"] if "truth" in paths else []
    table = report.table("diag", f"one decode step at position {P}: each path against ref", columns)
    first = None
    for row in rows(paths, L.num_layers):
        table.add(**row)
        if first is None and row.get("fused_differ"):
            first = (row["layer"], row["intermediate"])
    report.note(f"first intermediate where fused differs from ref: {first[0]} {first[1]}" if first else
                "fused equals ref in every intermediate")
    if opts.greedy:
        greedy(model, step, cache, fcache, ftoken, token, restore, opts.greedy, report)
    report.note(f"total {time.perf_counter() - t_start:.0f} s")


def rows(paths: dict, layers: int) -> list:
    """One row per (layer, intermediate): each path against ``ref`` (and the truth errors)."""
    ref = paths["ref"]
    keys = [(i, n) for i in range(layers) for n in NAMES if (i, n) in ref] + \
        [(layers, "final_norm"), (layers, "logits")]
    out = []
    for key in keys:
        row = {"layer": key[0] if key[0] < layers else "end", "intermediate": key[1]}
        for path, prefix in PATHS.items():
            if path in paths and key in paths[path]:
                c = compare_entry(key[1], paths[path][key], ref[key])
                row.update({f"{prefix}_{k}": v for k, v in c.items()})
        if "truth" in paths and key in paths["truth"]:
            for path in ("fused", "ref"):
                row[f"{path}_err_truth"] = truth_error(key[1], paths[path].get(key), paths["truth"][key])
        out.append(row)
    return out


def greedy(model, step, cache, fcache, ftoken, token, restore, n: int, report) -> None:
    """``n`` greedy steps: the reference (eager modules) against the fused step (a CUDA graph on CUDA,
    launched from Python elsewhere)."""
    from .timing import capture

    restore(cache)
    ref_tokens, _ = reference_greedy(model, cache, token, n)
    run_step = step.run
    if ftoken.device.type == "cuda":
        restore(fcache)                               # the capture's warm-up advanced the step: restored below
        run_step = capture(step.run)[0].replay
    restore(fcache)
    ftoken.fill_(int(token))
    got = []
    for _ in range(n):
        run_step()
        got.append(int(ftoken))
    same, equal = agreement(got, ref_tokens)
    report.note(f"greedy: {same} of {n} fused tokens equal the reference's before the first divergence, "
                f"{equal} equal in all")
