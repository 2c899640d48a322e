"""Execution variants of the reference LLM compute the vendor-style function: fp32 parity of prefill
logits and teacher-forced decode steps (CPU_STEPS on the CPU, STEPS on the GPU), generate() tokens
and routing, the FLOP check per variant, and the knobs the config refuses. CUDA graphs run on the
GPU only (marked ``gpu``)."""
from __future__ import annotations

import pytest
import torch

from conftest import TINY_MODE, cpu_triton, load_tiny_cfg, triton_runs
from harness import knobs, layout, variants
from harness import workload as wl
from harness.config import ExecutionConfig, ModelConfig, cost_config
from harness.errors import HarnessError
from harness.models.build import build_model
from harness.models.generate import generate
from harness.models.llm import KVCache
from harness.variants.static_kv import StaticKVCache

CPU_VARIANTS = {
    "static": dict(kv_cache="static"),
    "grouped-torch": dict(moe_impl="grouped", moe_kernel="torch"),
    "static+grouped-torch": dict(kv_cache="static", moe_impl="grouped", moe_kernel="torch"),
    "static+grouped-grouped_mm": dict(kv_cache="static", moe_impl="grouped", moe_kernel="grouped_mm"),
    "static+grouped-triton": dict(kv_cache="static", moe_impl="grouped", moe_kernel="triton"),
    "fused-linears-triton": dict(linear_impl="fused"),
    "static+grouped-triton+fused-linears-triton+attention-triton": dict(
        kv_cache="static", moe_impl="grouped", moe_kernel="triton", linear_impl="fused", decode_attention="triton"),
}
STEPS = 16
#: decode steps of the CPU runs (every decode step of a Triton variant costs seconds in the
#: interpreter). The CPU request's prefill holds 28 tokens (asserted in ``tiny``), so its decode steps
#: write positions 28 .. 28 + CPU_STEPS - 1 = 33 of a 64-position static cache (28 + 7 = 35 rounded
#: up to 64): the split-KV decode attention (BLOCK_N = 32: blocks 0-31 and 32-63, one split each)
#: runs with its second split empty (positions 28-31) and then filled (32, 33), both code paths.
CPU_STEPS = 6
CPU_PREFILL = 28


@pytest.fixture(scope="module")
def tiny():
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = load_tiny_cfg()
    model = build_model(cfg, "cpu", torch.float32, seed=0)
    page = wl.Page("p", wl.synthetic_page(0, size=(300, 200)), "s")
    req = wl.build_request([page], TINY_MODE, decode_tokens=CPU_STEPS + 1)
    assert req.prefill_tokens == CPU_PREFILL and CPU_PREFILL < 32 <= CPU_PREFILL + CPU_STEPS - 1
    return model, req


@pytest.fixture(scope="module")
def reference(tiny):
    """The vendor-style generate() result and teacher-forced logits of ``tiny``, computed once."""
    model, req = tiny
    variants.apply(model, ExecutionConfig())
    ref = generate(model, req)
    return ref, _run(model, req, KVCache(model.cfg.llm.num_layers), ref.tokens)


def _run(model, req, cache, tokens):
    """Prefill logits and the logits of CPU_STEPS decode steps fed ``tokens``."""
    with torch.inference_mode():
        img = model.image_embeddings(req.global_views, req.tiles, req.grid)
        logits = [model.prefill(req.input_ids, req.images_seq_mask, img, cache)]
        for j in range(CPU_STEPS):
            logits.append(model.decode_step(tokens[:, j:j + 1], cache))
    return logits


def _cache(model, req, ex: ExecutionConfig):
    """The request's KV cache under ``ex``: a static one (CPU_STEPS + 1 decode tokens, position 0) or a growing one."""
    if ex.kv_cache != "static":
        return KVCache(model.cfg.llm.num_layers)
    L = model.cfg.llm
    cache = StaticKVCache(L.num_layers, 1, L.num_kv_heads, ex.cache_len(req.prefill_tokens, CPU_STEPS + 1),
                          L.head_dim, torch.float32, "cpu")
    cache.position = torch.zeros(1, dtype=torch.int64)
    return cache


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name", list(CPU_VARIANTS))
def test_variant_matches_vendor_style_fp32(tiny, reference, wide_gemv_tiles, name):
    if "triton" in name and not triton_runs():
        pytest.skip("Triton cannot run here (not importable or TRITON_INTERPRET unset before import)")
    model, req = tiny
    ref, ref_logits = reference
    ex = ExecutionConfig(**CPU_VARIANTS[name])
    variants.apply(model, ex)
    try:
        cache = _cache(model, req, ex)
        logits = _run(model, req, cache, ref.tokens)
        assert len(logits) == len(ref_logits) == 1 + CPU_STEPS
        for j, (a, b) in enumerate(zip(logits, ref_logits)):
            assert _rel(a, b) <= 1e-5, (name, j, _rel(a, b))
        res = generate(model, req)
        assert torch.equal(res.tokens, ref.tokens)
        for phase in ("prefill", "decode"):
            assert (res.routing[phase] == ref.routing[phase]).all() and res.routing[phase].sum() > 0
        assert (res.routing_steps == ref.routing_steps).all()      # every step, every execution (issue 22)
    finally:
        variants.apply(model, ExecutionConfig())


@pytest.mark.parametrize("extra", [{}, dict(kv_cache="static", moe_impl="grouped", moe_kernel="torch")],
                         ids=["growing", "static+grouped-torch"])
def test_last_position_logits_match_vendor_style_fp32(tiny, reference, extra):
    """execution.prefill_logits=last: the prefill returns the last prompt position's logits alone, equal
    (fp32) to that position of vendor-style's [1, 28, V]; the decode steps and generate()'s tokens are the same."""
    model, req = tiny
    ref, ref_logits = reference
    ex = ExecutionConfig(prefill_logits="last", **extra)
    info = variants.apply(model, ex)
    try:
        cache = _cache(model, req, ex)
        logits = _run(model, req, cache, ref.tokens)
        V = model.cfg.llm.vocab_size
        assert ref_logits[0].shape == (1, CPU_PREFILL, V) and logits[0].shape == (1, 1, V)
        assert _rel(logits[0][:, 0], ref_logits[0][:, -1]) <= 1e-5
        for j, (a, b) in enumerate(zip(logits[1:], ref_logits[1:])):
            assert _rel(a, b) <= 1e-5, (j, _rel(a, b))
        assert torch.equal(generate(model, req).tokens, ref.tokens)
        assert "last prompt position" in info[knobs.PREFILL_LOGITS.manifest_key]
    finally:
        variants.apply(model, ExecutionConfig())
    assert model.logits_all_positions()                 # restored: the vendor's lm_head on every position


def test_compiled_prefill_core_matches_eager_fp32(tiny, reference):
    """What execution.prefill_compile captures (CUDA only), compiled on the CPU: ``prefill_core`` of the
    static-grouped execution under torch.compile gives vendor-style's prefill logits (fp32) and first token."""
    from harness.models.adapter import greedy

    model, req = tiny
    ref, ref_logits = reference
    ex = ExecutionConfig(kv_cache="static", moe_impl="grouped", moe_kernel="torch")
    variants.apply(model, ex)
    try:
        L = model.cfg.llm
        cache = StaticKVCache(L.num_layers, 1, L.num_kv_heads, ex.cache_len(req.prefill_tokens, 1), L.head_dim,
                              torch.float32, "cpu")
        cache.position = torch.zeros(1, dtype=torch.int64)
        ids, start = req.input_ids, req.image_start
        with torch.inference_mode():
            img = model.image_embeddings(req.global_views, req.tiles, req.grid)
            fn = torch.compile(lambda i, e: model.prefill_core(i, e, cache, lambda x: x, start), dynamic=False)
            logits = fn(ids, img)
        assert _rel(logits, ref_logits[0]) <= 1e-5
        assert torch.equal(greedy(logits), ref.tokens[:, :1])
        assert int(cache.position) == CPU_PREFILL
    finally:
        variants.apply(model, ExecutionConfig())


def test_each_prefill_shape_compiles_past_dynamos_recompile_limit():
    """``static_decoder.own_code``: closures of one code object share dynamo's recompile limit (here 1: the
    second shape runs eagerly, no new graph); each with its own code object compiles its own graph."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from harness.variants.static_decoder import own_code

    def closure(k):
        def fn(x):
            return (x * k).sin() + 1
        return fn

    def graphs(wrap, sizes):
        made = []
        for n in sizes:
            before = counters["stats"]["unique_graphs"]
            out = torch.compile(wrap(closure(n)), dynamic=False)(torch.ones(n))
            assert torch.allclose(out, torch.ones(n).mul(n).sin() + 1)
            made.append(counters["stats"]["unique_graphs"] - before)
        return made

    with torch._dynamo.config.patch(recompile_limit=1):
        assert graphs(lambda f: f, (3, 4)) == [1, 0]      # the limit hit: shape 4 ran eagerly
        assert graphs(own_code, (5, 6)) == [1, 1]


def test_each_compiled_decoder_compiles_its_own_decode_core(tiny, monkeypatch):
    """The decode step compiles ``decode_core`` once per decoder (batch, cache length): each decoder's on a
    code object of its own (``own_code`` of the bound method: still bound to the model), so a ninth decoder
    does not hit dynamo's recompile limit and run eagerly while the manifest says compiled. The compile is
    recorded, not run (the warm-up calls the same function eagerly)."""
    import types

    from harness.variants.static_decoder import StaticDecoder

    model, _ = tiny
    variants.apply(model, ExecutionConfig(kv_cache="static"))
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(fn) or fn)
    for batch, max_len in ((1, 32), (2, 64)):
        StaticDecoder(model, batch, max_len, torch.device("cpu"), torch.float32, lambda x: x, compile=True)
    (a, b), base = compiled, type(model).decode_core
    assert all(isinstance(f, types.MethodType) and f.__self__ is model for f in (a, b))
    assert len({id(a.__func__.__code__), id(b.__func__.__code__), id(base.__code__)}) == 3
    assert a.__func__.__code__.co_code == base.__code__.co_code
    variants.apply(model, ExecutionConfig())


def test_compiled_static_grouped_decode_matches(tiny):
    """The compiled static-grouped step: vendor-style's tokens and per-step routing under the weights'
    routing and under balanced routing, from one compile (the routing is a runtime input of the
    compiled step: a balanced request after a weights one, and back, compiles no new graph)."""
    import dataclasses

    from torch._dynamo.utils import counters

    model, req = tiny
    balanced = dataclasses.replace(req, routing="balanced", routing_seed=3)
    variants.apply(model, ExecutionConfig())
    ref, ref_bal = generate(model, req), generate(model, balanced)
    info = variants.apply(model, ExecutionConfig(kv_cache="static", moe_impl="grouped", moe_kernel="torch", compile=True))
    try:
        res = generate(model, req)
        graphs = counters["stats"]["unique_graphs"]
        res_bal, again = generate(model, balanced), generate(model, req)
        assert counters["stats"]["unique_graphs"] == graphs
        for got, want in ((res, ref), (res_bal, ref_bal), (again, ref)):
            assert torch.equal(got.tokens, want.tokens)
            assert (got.routing["decode"] == want.routing["decode"]).all()
            assert (got.routing_steps == want.routing_steps).all()
        assert not (ref_bal.routing_steps == ref.routing_steps).all()      # the balanced run did route otherwise
        assert info["compile"] is True and any("warmup_compile" in v for v in model.info["setup_s"].values())
    finally:
        variants.apply(model, ExecutionConfig())


@pytest.mark.parametrize("logits", ["all", "last"])
def test_counted_flops_equal_analytic_for_the_static_grouped_variant(tiny_cfg, logits):
    from harness.analytic import check, compose

    ex = ExecutionConfig(kv_cache="static", moe_impl="grouped", moe_kernel="torch", vision_impl="fused",
                         prefill_logits=logits)
    cfg = cost_config(tiny_cfg, knobs.cost_knobs(ex))
    model = build_model(tiny_cfg, "cpu", torch.float32, seed=0)
    variants.apply(model, ex)
    cases = [compose.Case(TINY_MODE, (2, 3), decode_tokens=4), compose.Case(TINY_MODE, None, decode_tokens=3)]
    df = check.check_cases(cases, cfg, "cpu", model=model)
    assert (df["diff"] == 0).all(), check.format_table(df)
    dec = compose.workload_costs(cases[1], cfg)
    att = dec[(dec.stage == "decode") & (dec.family == "llm_attention")].iloc[0]
    grow = compose.workload_costs(cases[1], tiny_cfg)
    att_g = grow[(grow.stage == "decode") & (grow.family == "llm_attention")].iloc[0]
    assert att.flops_useful == att_g.flops_useful and att.flops_counted > att_g.flops_counted  # masked keys
    assert att.bytes_kv_write < att_g.bytes_kv_write                                         # no cat copy


@pytest.mark.parametrize("ex,words", [
    (dict(cuda_graphs="decode"), "kv_cache=static and moe_impl=grouped"),
    (dict(cuda_graphs="decode", kv_cache="static"), "moe_impl=grouped"),
    (dict(vision_compile=True), "vision_compile=true needs vision_impl=fused"),
    (dict(prefill_compile=True, kv_cache="static", moe_impl="grouped"),
     "prefill_compile=true compiles the captured prefill, which is off"),
])
def test_impossible_knob_combinations_are_refused(ex, words):
    with pytest.raises(HarnessError, match=words):
        variants.check(ExecutionConfig(**ex), "cpu")


def test_cuda_graphs_refused_without_cuda(tiny):
    from harness.variants.base import CannotRunHere

    model, req = tiny
    with pytest.raises(CannotRunHere, match="execution.cuda_graphs=decode needs a CUDA device"):
        variants.apply(model, ExecutionConfig(kv_cache="static", moe_impl="grouped", moe_kernel="torch",
                                              cuda_graphs="decode"))


GPU_VARIANTS = {
    "graphs": dict(kv_cache="static", moe_impl="grouped", cuda_graphs="decode"),
    "graphs+compile": dict(kv_cache="static", moe_impl="grouped", cuda_graphs="decode", compile=True),
    "graphs+compile+fused-linears+attention": dict(kv_cache="static", moe_impl="grouped", cuda_graphs="decode",
                                                   compile=True, linear_impl="fused", decode_attention="triton"),
    "graphs+compile+prefill-compile+last-logits": dict(kv_cache="static", moe_impl="grouped", cuda_graphs="decode",
                                                       compile=True, prefill_graphs=True, prefill_compile=True,
                                                       prefill_logits="last"),
    "graphs+fused-step": dict(kv_cache="static", moe_impl="grouped", cuda_graphs="decode", linear_impl="fused",
                              decode_attention="triton", decode_step="fused"),
    "graphs+fused-step+pdl": dict(kv_cache="static", moe_impl="grouped", cuda_graphs="decode", linear_impl="fused",
                                  decode_attention="triton", decode_step="fused", pdl=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("name", list(GPU_VARIANTS))
def test_gpu_variant_matches_vendor_style(name, dtype, tol):
    if GPU_VARIANTS[name].get("pdl"):
        from harness.kernels.decode_step_triton import pdl_support

        if not pdl_support("cuda")[0]:
            pytest.skip(pdl_support("cuda")[1])
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = load_tiny_cfg()
    model = build_model(cfg, "cuda", dtype, seed=0)
    page = wl.Page("p", wl.synthetic_page(0, size=(300, 200)), "s")
    req = wl.build_request([page], TINY_MODE, decode_tokens=STEPS + 1).to("cuda", dtype)
    ref = generate(model, req)
    ex = dict(GPU_VARIANTS[name])
    if dtype == torch.float32:
        ex["moe_kernel"] = "triton"
    info = variants.apply(model, ExecutionConfig(**ex))
    res = generate(model, req)
    res2 = generate(model, req)             # a second request replays the same graph
    assert torch.equal(res.tokens, res2.tokens)
    assert res.routing["decode"].sum() == ref.routing["decode"].sum()
    if dtype == torch.float32:
        assert torch.equal(res.tokens, ref.tokens), (info, res.tokens, ref.tokens)
        assert (res.routing["prefill"] == ref.routing["prefill"]).all()
        assert (res.routing["decode"] == ref.routing["decode"]).all()
        return
    # bf16: greedy tokens of random weights diverge at near-ties once any rounding differs, so the
    # logits are compared teacher-forced: the variant's own compiled / captured step fed the vendor
    # path's tokens, prefill and every decode step within the bf16 tolerance
    ex = ExecutionConfig(**ex)
    variants.apply(model, ExecutionConfig())
    ref_logits = _run(model, req, KVCache(model.cfg.llm.num_layers), ref.tokens)
    variants.apply(model, ex)
    got = _static_logits(model, req, ex, ref.tokens, dtype)
    for j, (a, b) in enumerate(zip(got, ref_logits)):
        assert _rel(a, b[:, -1].float()) <= tol, (name, j, _rel(a, b[:, -1].float()))


@pytest.mark.gpu
@pytest.mark.parametrize("lever", ["defaults", "vendor-rope", "route-in-alignment"])
@pytest.mark.parametrize("routing", ["weights", "balanced"])
def test_gpu_batched_decode_matches_vendor_style_fp32(routing, lever, monkeypatch):
    """12 distinct pages (24 routed rows per MoE layer: the blocked Triton MoE with the one-program
    alignment, which counts the routing, and the Triton router at 12 rows), compiled and captured,
    fp32 with TF32 off: vendor-style's tokens and per-step routing counts. ``defaults``: RoPE and the KV
    write as one Triton launch after the q/k/v linear (``fused_linears.ROPE_KV_MAX_ROWS``);
    ``vendor-rope``: the vendor's RoPE and cache update instead; ``route-in-alignment``: the router's choice
    in the alignment's launch (``grouped_moe.ROUTE_IN_ALIGNMENT``)."""
    from harness.variants import fused_linears, grouped_moe

    monkeypatch.setattr(fused_linears, "ROPE_KV_MAX_ROWS", 1 if lever == "vendor-rope" else 128)
    monkeypatch.setattr(grouped_moe, "ROUTE_IN_ALIGNMENT", lever == "route-in-alignment")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = load_tiny_cfg()
    model = build_model(cfg, "cuda", torch.float32, seed=0)
    pages = [wl.Page(f"p{i}", wl.synthetic_page(i, size=(300, 200)), "s") for i in range(12)]
    req = wl.build_request(pages, TINY_MODE, decode_tokens=STEPS + 1, routing=routing).to("cuda", torch.float32)
    ref = generate(model, req)
    info = variants.apply(model, ExecutionConfig(**GPU_VARIANTS["graphs+compile+fused-linears+attention"],
                                                 moe_kernel="triton"))
    res = generate(model, req)
    assert torch.equal(res.tokens, ref.tokens), (info, res.tokens, ref.tokens)
    assert (res.routing["prefill"] == ref.routing["prefill"]).all()
    assert (res.routing["decode"] == ref.routing["decode"]).all()
    assert int(res.routing["decode"].sum()) == STEPS * 12 * 2 * (cfg.llm.num_layers - 1)   # top-2, MoE layers


def _static_logits(model, req, ex, tokens, dtype) -> list:
    """Last-position logits [B, V] of the prefill and STEPS teacher-forced decode steps through a
    ``StaticDecoder`` of ``ex`` (compiled and captured as the run's is, its step bound as the run's:
    the fused step with decode_step=fused) whose select keeps the logits."""
    from harness.variants.static_decoder import StaticDecoder

    with torch.inference_mode():
        img = model.image_embeddings(req.global_views, req.tiles, req.grid)
        dec = StaticDecoder(model, 1, ex.cache_len(req.prefill_tokens, STEPS + 1), torch.device("cuda"),
                            dtype, lambda logits: logits[:, -1].float(), compile=ex.compile,
                            graphs=ex.cuda_graphs == "decode", bind=model.plan.decode_step,
                            device_routing=model.plan.device_routing)
        dec.begin()
        out = [dec.prefill(req, img).clone()]
        for j in range(STEPS):
            out.append(dec.step(tokens[:, j:j + 1]).clone())
    return out


SAM_CLASSES = {"sdpa": ("SAMAttention", "AugmentedSAMAttention"),
               "triton-windows": ("TritonSAMAttention", "AugmentedSAMAttention"),
               "triton": ("TritonSAMAttention", "TritonSAMAttention")}


@pytest.mark.parametrize("sam", list(SAM_CLASSES))
@pytest.mark.parametrize("mode,grid", [("t", (2, 3)), ("u", None)])
def test_fused_vision_matches_vendor_style_fp32(mode, grid, sam):
    """vision_impl=fused: SAM, CLIP and projector outputs of every view equal the dense-mask path
    (fp32, CPU: the augmented q.k without the S x S mask; with sam_attention the in-kernel-bias Triton
    kernel, interpreted, in the windowed blocks or in all; CUDA graphs only on a GPU)."""
    if sam != "sdpa" and not triton_runs():
        pytest.skip("Triton cannot run here (not importable or TRITON_INTERPRET unset before import)")
    cfg = load_tiny_cfg()
    model = build_model(cfg, "cpu", torch.float32, seed=0)
    crop_mode = dict(TINY_MODE, name=mode, crop=grid is not None)
    page = wl.Page("p", wl.synthetic_page(0, size=(300, 200) if grid is None else (128, 192)), "s")
    req = wl.build_request([page], crop_mode, decode_tokens=2)
    assert req.grid == grid

    def outputs():
        got = {}

        def hook(name):
            def f(mod, args, out):
                got.setdefault(name, []).append(out)
            return f
        handles = [getattr(model.model, attr).register_forward_hook(hook(name)) for name, attr in
                   (("sam", "sam_model"), ("clip", "vision_model"), ("projector", "projector"))]
        with torch.inference_mode():
            model.image_embeddings(req.global_views, req.tiles, req.grid)
        for h in handles:
            h.remove()
        return got

    variants.apply(model, ExecutionConfig())
    ref = outputs()
    info = variants.apply(model, ExecutionConfig(vision_impl="fused", sam_attention=sam))
    assert [b.window_size > 0 for b in model.model.sam_model.blocks] == [True, False]
    assert tuple(type(b.attn).__name__ for b in model.model.sam_model.blocks) == SAM_CLASSES[sam]
    assert type(model.model.sam_model.patch_embed).__name__ == "GemmPatchEmbed"
    assert "augmented" in info["vision"] and "patch embedding as a GEMM" in info["vision"]
    assert info["sam_attention_is"].startswith(sam)
    got = outputs()
    for name in ("sam", "clip", "projector"):
        assert len(got[name]) == len(ref[name]) == (2 if grid else 1)
        for a, b in zip(got[name], ref[name]):
            assert _rel(a, b) <= 1e-5, (name, _rel(a, b))
    variants.apply(model, ExecutionConfig())


def test_the_triton_sam_attention_leaves_a_compiled_block_whole():
    """vision_compile compiles each SAM block; the Triton attention must not break its graph (the
    session before it was a custom op called the kernel around the compiled blocks, and the break's
    copies took back most of the kernel's gain). Dynamo's explain (eager backend: no inductor needed)
    over the tiny model's windowed and global block: one graph each, no break, the custom op in it."""
    if not triton_runs():
        pytest.skip("Triton cannot run here (not importable or TRITON_INTERPRET unset before import)")
    model = build_model(load_tiny_cfg(), "cpu", torch.float32, seed=0)
    variants.apply(model, ExecutionConfig(vision_impl="fused", sam_attention="triton"))
    x = torch.randn(1, 16, 16, 32)                 # the tiny SAM's 256 px view: a 16 x 16 grid of 32 channels
    for blk, window in zip(model.model.sam_model.blocks, (14, 0)):
        assert blk.window_size == window and type(blk.attn).__name__ == "TritonSAMAttention"
        torch._dynamo.reset()
        ex = torch._dynamo.explain(blk)(x)
        assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons
        assert "harness.sam_rel_bias_attention" in ex.graphs[0].code
    torch._dynamo.reset()
    variants.apply(model, ExecutionConfig())


def test_gemm_patch_embed_is_the_convolution_fp32():
    """GemmPatchEmbed: 16 x 16 patches of 3 channels as one GEMM give the stride-16 convolution's
    [B, H/16, W/16, C] (fp32: the same 768 products per output, summed in another order); a side
    that is no multiple of 16 (here 40 px: the conv drops the last 8) takes the conv itself."""
    from harness.models.vision import PatchEmbed
    from harness.variants.base import swap
    from harness.variants.fused_vision import GemmPatchEmbed

    torch.manual_seed(0)
    pe = PatchEmbed(16, 3, 24)
    x = torch.randn(2, 3, 64, 48)
    ref = pe(x)
    swap(pe, GemmPatchEmbed)
    got = pe(x)
    assert got.shape == ref.shape == (2, 4, 3, 24)
    assert _rel(got, ref) <= 1e-6, _rel(got, ref)
    odd = torch.randn(1, 3, 40, 32)
    assert torch.equal(pe(odd), pe.proj(odd).permute(0, 2, 3, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("sam", list(SAM_CLASSES))
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("mode,grid", [("t", (2, 3)), ("u", None)])
def test_gpu_fused_vision_matches_vendor_style_fp32(mode, grid, compiled, sam):
    """On CUDA (graphs, and with vision_compile the inductor-compiled blocks, the Triton SAM attention a
    custom op inside them): the image embeddings of every view equal the vendor path's in fp32 with TF32
    off, on capture and on replay."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = build_model(load_tiny_cfg(), "cuda", torch.float32, seed=0)
    crop_mode = dict(TINY_MODE, name=mode, crop=grid is not None)
    page = wl.Page("p", wl.synthetic_page(0, size=(300, 200) if grid is None else (128, 192)), "s")
    req = wl.build_request([page], crop_mode, decode_tokens=2).to("cuda", torch.float32)
    with torch.inference_mode():
        ref = model.image_embeddings(req.global_views, req.tiles, req.grid).clone()
        info = variants.apply(model, ExecutionConfig(vision_impl="fused", vision_compile=compiled, sam_attention=sam))
        assert tuple(type(b.attn).__name__.split("+")[0] for b in model.model.sam_model.blocks) == SAM_CLASSES[sam]
        first = model.image_embeddings(req.global_views, req.tiles, req.grid).clone()
        again = model.image_embeddings(req.global_views, req.tiles, req.grid).clone()
    assert ("torch.compile" in info["vision_compile_is"]) == compiled     # (its own manifest key since the renovation)
    assert _rel(first, ref) <= 1e-5 and _rel(again, ref) <= 1e-5, (_rel(first, ref), _rel(again, ref))


@pytest.mark.gpu
@pytest.mark.parametrize("sam", ["sdpa", "triton"])
@pytest.mark.parametrize("mode", list(layout.MODES))
def test_gpu_fused_vision_full_size_fp32(mode, sam):
    """Full-size SAM / CLIP / projector (random weights, fp32, TF32 off) on a GPU: the fused vision
    (augmented global attention, or with sam_attention=triton the Triton kernel in every block;
    compiled blocks, CUDA graphs) gives the vendor path's image embeddings within 1e-5 in every crop
    mode (gundam: tiles, then the global view)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = build_model(ModelConfig(), "cuda", torch.float32, seed=0)
    req = wl.build_request([wl.Page("p", wl.synthetic_page(0), "s")], mode, decode_tokens=2).to("cuda", torch.float32)
    assert (req.grid is not None) == (mode == "gundam")
    with torch.inference_mode():
        ref = model.image_embeddings(req.global_views, req.tiles, req.grid).clone()
        variants.apply(model, ExecutionConfig(vision_impl="fused", vision_compile=True, sam_attention=sam))
        got = model.image_embeddings(req.global_views, req.tiles, req.grid).clone()
    assert _rel(got, ref) <= 1e-5, _rel(got, ref)


@cpu_triton
@pytest.mark.skipif(not triton_runs(), reason="Triton cannot run here")
@pytest.mark.parametrize("attention", ["sdpa", "triton"])
def test_batched_static_step_with_rope_and_kv_write_in_one_launch(tiny, wide_gemv_tiles, monkeypatch, attention):
    """linear_impl=fused on a static cache, a decode step of 3 sequences at position 30: with
    ``ROPE_KV_MAX_ROWS`` >= 3 the attention runs the q/k/v linear, then RoPE and the KV write as one
    Triton launch (``rope_kv_write``, and nothing of the static cache's update); its output and both
    caches equal the step without it (the static cache's RoPE and update) in fp32, to rounding order."""
    from harness.kernels import gemv_triton
    from harness.variants import fused_linears

    model, _ = tiny
    L = model.cfg.llm
    ex = ExecutionConfig(kv_cache="static", linear_impl="fused", decode_attention=attention)
    variants.apply(model, ex)
    try:
        attn = model.model.layers[0].self_attn
        g = torch.Generator().manual_seed(3)
        x = torch.randn(3, 1, L.hidden_size, generator=g)
        prior = [torch.randn(3, L.num_kv_heads, 40, L.head_dim, generator=g) for _ in range(2)]
        pos = torch.tensor([30])

        def step(rows):
            monkeypatch.setattr(fused_linears, "ROPE_KV_MAX_ROWS", rows)
            cache = StaticKVCache(L.num_layers, 3, L.num_kv_heads, 40, L.head_dim, torch.float32, "cpu")
            cache.k[0].copy_(prior[0])
            cache.v[0].copy_(prior[1])
            cache.length = 30
            cache.begin_step(pos)
            with torch.inference_mode():
                out = attn(x, pos.expand(3, 1), cache)
            return out, cache.k[0].clone(), cache.v[0].clone()

        calls = []
        real = gemv_triton.rope_kv_write
        monkeypatch.setattr(gemv_triton, "rope_kv_write", lambda *a: calls.append(a[0].shape) or real(*a))
        want = step(1)
        assert calls == []
        got = step(8)
        assert calls == [(3, (L.num_heads + 2 * L.num_kv_heads) * L.head_dim)]
        for a, b in zip(got, want):
            assert _rel(a, b) <= 1e-6
        assert torch.equal(got[1][:, :, :30], prior[0][:, :, :30])
    finally:
        variants.apply(model, ExecutionConfig())


@cpu_triton
@pytest.mark.skipif(not triton_runs(), reason="Triton cannot run here")
def test_manifest_names_the_attention_tiles_and_the_batched_rope_launch(tiny, monkeypatch):
    """The manifest records what ran: decode_attention=triton names the kernel's tile config
    (``DEFAULT_CONFIG``, a changed one too), linear_impl=fused the batched RoPE + KV write launch when
    ``ROPE_KV_MAX_ROWS`` > 1 (the default) and not when it is 1."""
    from harness.kernels import decode_attention_triton as dat
    from harness.variants import fused_linears

    model, _ = tiny
    ex = ExecutionConfig(kv_cache="static", linear_impl="fused", decode_attention="triton")
    try:
        info = variants.apply(model, ex)
        assert "wide_target_programs=1280" in info[knobs.DECODE_ATTENTION.manifest_key]
        assert ", balanced=False, wide_balanced=True)" in info[knobs.DECODE_ATTENTION.manifest_key]
        assert "at 2-128 sequences RoPE and the KV write one kernel" in info[knobs.FUSED_LINEARS.manifest_key]
        assert "top-k, scale and routing count one Triton kernel after its GEMV" in info[knobs.FUSED_LINEARS.manifest_key]
        monkeypatch.setattr(dat, "DEFAULT_CONFIG", dat.DecodeAttentionConfig(wide_balanced=False))
        monkeypatch.setattr(fused_linears, "ROPE_KV_MAX_ROWS", 1)
        info = variants.apply(model, ex)
        assert ", balanced=False, wide_balanced=False)" in info[knobs.DECODE_ATTENTION.manifest_key]
        assert "sequences RoPE" not in info[knobs.FUSED_LINEARS.manifest_key]
    finally:
        variants.apply(model, ExecutionConfig())


@cpu_triton
@pytest.mark.skipif(not triton_runs(), reason="Triton cannot run here")
def test_manifest_names_the_router_in_the_alignment_launch(tiny, monkeypatch):
    """moe_impl=grouped with moe_kernel=triton: the manifest says when ``grouped_moe.ROUTE_IN_ALIGNMENT``
    makes the router's choice in the alignment's launch, and says nothing of it when off."""
    from harness.variants import grouped_moe

    model, _ = tiny
    ex = ExecutionConfig(kv_cache="static", moe_impl="grouped", moe_kernel="triton", linear_impl="fused")
    try:
        assert "ROUTE_IN_ALIGNMENT" not in variants.apply(model, ex)[knobs.GROUPED_MOE.manifest_key]
        monkeypatch.setattr(grouped_moe, "ROUTE_IN_ALIGNMENT", True)
        assert "router's choice in the alignment's launch (grouped_moe.ROUTE_IN_ALIGNMENT)" in \
            variants.apply(model, ex)[knobs.GROUPED_MOE.manifest_key]
    finally:
        variants.apply(model, ExecutionConfig())
