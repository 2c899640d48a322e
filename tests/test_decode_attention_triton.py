"""The split-KV Triton decode attention equals softmax(q.k * scale over keys 0..pos).v, and the
``decode_attention=triton`` knob runs the tiny model to the same logits as SDPA over the masked buffer.

Without a GPU the kernels run in Triton's interpreter: TRITON_INTERPRET=1 is set in conftest.py, before
``fast_moe_triton`` / ``decode_attention_triton`` are first imported (the interpreter is chosen when
the kernels are defined; the setting then holds for the rest of the pytest process). References are
float64 on the CPU. Positions past ``pos`` hold NaN: a kernel that read them would return NaN.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch

pytest.importorskip("triton")

from conftest import DEV, TINY_MODE, load_tiny_cfg
from harness import workload as wl
from harness import variants
from harness.config import ExecutionConfig, LLMConfig, cost_config
from harness.errors import HarnessError
from harness.models import attn_probe
from harness.kernels import decode_attention_triton as dat
from harness.models.build import build_model
from harness.kernels.availability import triton_available
from harness.models.llm import Attention, KVCache
from harness.variants.base import swap
from harness.variants.decode_attention import TritonDecodeAttention
from harness.variants.static_kv import StaticKVCache

Cfg = dat.DecodeAttentionConfig
Fixed = functools.partial(Cfg, balanced=False, wide_balanced=False)   # the splits' fixed ranges of the buffer
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).abs().max() / b.abs().max()).item()


def draw(B, nh, nkv, L, d, pos, seed=0):
    """q [B, nh, 1, d], k, v [B, nkv, L, d] ~ N(0, 1) (fp32, CPU); positions past ``pos`` are NaN."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, nh, 1, d, generator=g)
    k, v = torch.randn(B, nkv, L, d, generator=g), torch.randn(B, nkv, L, d, generator=g)
    k[:, :, pos + 1:] = float("nan")
    v[:, :, pos + 1:] = float("nan")
    return q, k, v


def reference(q, k, v, pos, scale=None):
    """float64 softmax(q.k^T * scale over keys 0..pos).v with the KV heads repeated to the query heads."""
    rep = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(rep, 1)[:, :, :pos + 1] for t in (k, v))
    s = q.double() @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    return s.softmax(-1) @ v


CASES = {  # name: (B, nh, nkv, L, d, pos, config, scale)
    "pos0": (2, 4, 4, 96, 32, 0, Fixed(block_n=16), None),                      # 6 splits, 5 of them empty
    "last-partial-block": (2, 4, 4, 100, 32, 99, Fixed(block_n=16), None),      # L not a multiple of block_n
    "mid-block-gqa": (2, 4, 2, 100, 16, 40, Fixed(block_n=16), None),           # block 2 holds 9 of 16 keys
    "gqa-4to1": (1, 4, 1, 64, 16, 33, Fixed(block_n=16, num_splits=2), 0.3),     # 2 blocks per split, own scale
    "splits>filled": (1, 2, 2, 128, 32, 20, Fixed(block_n=16, num_splits=8), None),  # 2 filled blocks, 8 splits
    "one-split": (3, 2, 2, 100, 32, 77, Fixed(block_n=16, num_splits=1), None),  # direct write, no combine
    "uneven-splits": (1, 2, 2, 100, 16, 60, Fixed(block_n=16, num_splits=3), None),  # 7 blocks in 3 splits
    "model-shape": (1, 10, 10, 448, 128, 413, Cfg(), None),     # default: 14 splits of 32 keys, fixed ranges
    # 8 programs from wide_from = 8: 32-key tiles
    "wide": (2, 4, 4, 100, 32, 70, Fixed(block_n=16, wide_from=8, wide_block_n=32, wide_warps=2), None),
    # 8 programs from deep_from = 8: 16-key tiles through 2 stages, 7 blocks in one split
    "deep": (2, 4, 4, 100, 32, 99, Fixed(block_n=64, deep_from=8, deep_block_n=16, deep_warps=2, deep_stages=2,
                                       num_splits=1), None),
    # the software-pipelined loop: 7 blocks in 2 splits (4 + 3), and one split of all 7
    "pipelined": (1, 2, 2, 100, 16, 99, Fixed(block_n=16, num_splits=2, stages=3), None),
    "pipelined-one-split": (2, 4, 2, 100, 16, 60, Fixed(block_n=16, num_splits=1, stages=2), 0.2),
    # balanced: the filled blocks shared out at run time. 1 filled block over 6 splits; 2 over 4 (one each,
    # two splits empty); 4 over 3 (2 + 2 + none); 7 over 3 through the pipeline (3 + 3 + 1)
    "balanced-pos0": (2, 4, 4, 96, 32, 0, Cfg(block_n=16, balanced=True), None),
    "balanced-early": (1, 2, 2, 128, 16, 20, Cfg(block_n=16, num_splits=4, balanced=True), None),
    "balanced-uneven": (2, 4, 2, 100, 16, 60, Cfg(block_n=16, num_splits=3, balanced=True), None),
    "balanced-pipelined": (1, 2, 2, 100, 16, 99, Cfg(block_n=16, num_splits=3, stages=3, balanced=True), None),
}


@pytest.mark.parametrize("combine", ["launch", "last-split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_float64_reference(name, dtype, combine):
    """Every case against float64, combined by a second launch or by the last split (``sem``), whose
    counters are back at zero afterwards (the next call relies on it)."""
    B, nh, nkv, L, d, pos, cfg, scale = CASES[name]
    q, k, v = (t.to(dtype) for t in draw(B, nh, nkv, L, d, pos, seed=len(name)))
    ref = reference(q, k, v, pos, scale)             # from the dtype-rounded inputs
    sem = torch.zeros(B * nh + 3, dtype=torch.int32, device=DEV) if combine == "last-split" else None
    out = dat.decode_attention(*(t.to(DEV) for t in (q, k, v)), torch.tensor([pos], device=DEV), scale, cfg,
                               sem=sem).cpu()
    assert out.shape == (B, nh, 1, d) and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= TOL[dtype], (name, dtype, rel_err(out, ref))
    if sem is not None:
        assert int(sem.count_nonzero()) == 0


@pytest.mark.parametrize("balanced,holding", [(False, [0]), (True, [0, 1])])
def test_which_splits_hold_keys(monkeypatch, balanced, holding):
    """21 filled keys (2 blocks of 16) of a 128-position buffer in 4 splits: fixed ranges of 2 blocks put
    both in split 0; ``balanced`` shares them out, one block each to splits 0 and 1. The partials handed
    to the combine launch say which splits read keys (their softmax sums > 0); the output is the same."""
    seen = []
    real = dat._combine_kernel

    class Spy:                                      # records the partials the combine launch reads
        def __getitem__(self, grid):
            def launch(acc, m, ls, *args, **kw):
                seen.append(ls.detach().cpu().clone())
                return real[grid](acc, m, ls, *args, **kw)
            return launch

    monkeypatch.setattr(dat, "_combine_kernel", Spy())
    q, k, v = draw(1, 2, 2, 128, 16, 20)
    cfg = Cfg(block_n=16, num_splits=4, balanced=balanced)
    out = dat.decode_attention(*(t.to(DEV) for t in (q, k, v)), torch.tensor([20], device=DEV), config=cfg).cpu()
    assert rel_err(out, reference(q, k, v, 20)) <= 1e-5
    (ls,) = seen
    assert ls.shape == (2 * 4,)                     # [bh * splits]: two heads, four splits each
    for bh in range(2):
        assert [s for s in range(4) if ls[bh * 4 + s] > 0] == holding, (bh, ls)


def test_position_is_read_on_the_device():
    """The same buffers and the same pos tensor, advanced in place (as a CUDA graph replays): each
    call attends over the positions up to the tensor's current value, with the splits' fixed ranges
    and with the filled positions shared out (``balanced``)."""
    q, k, v = draw(1, 2, 2, 64, 16, 63)
    q, k, v = (t.to(DEV) for t in (q, k, v))
    pos = torch.zeros(1, dtype=torch.int64, device=DEV)
    for cfg in (Fixed(block_n=16), Cfg(block_n=16, num_splits=3, balanced=True)):   # fixed ranges; shared
        for p in (0, 15, 16, 47, 63):
            pos.fill_(p)
            out = dat.decode_attention(q, k, v, pos, config=cfg).cpu()
            assert rel_err(out, reference(q.cpu(), k.cpu(), v.cpu(), p)) <= 1e-5, (cfg.balanced, p)


def test_wide_launches_take_the_wide_tiles():
    """From 80 programs (B*nh: B = 8 at 10 heads) the default runs 32 keys per tile with 1 warp and
    splits for about 1,280 programs (``wide_target_programs``) over a 448-position cache (14 blocks):
    B = 32 (320 programs per split) 4 wanted, 4 splits of 4 blocks; B = 8 16 wanted, clamped to the 14
    blocks; B = 64 2 splits of 7. Below it the default's own (264 programs: 4 wanted at 79), and a
    config with wide_from None keeps its own at any size. A target below 1 is refused."""
    b32 = Cfg().for_programs(320)
    assert (b32.block_n, b32.num_warps, b32.splits(320, 448)) == (32, 1, (4, 4))
    b8 = Cfg().for_programs(80)
    assert (b8.block_n, b8.num_warps, b8.splits(80, 448)) == (32, 1, (14, 1))
    assert Cfg().for_programs(640).splits(640, 448) == (2, 7)
    assert Cfg().for_programs(79) == Cfg() and Cfg().for_programs(79).splits(79, 448) == (4, 4)   # 264 / 79 -> 4
    assert Cfg(wide_from=None, deep_from=None).for_programs(10_000) == Cfg(wide_from=None, deep_from=None)
    assert Cfg(wide_target_programs=None).for_programs(320).splits(320, 448) == (1, 14)          # 264 / 320 -> 1
    with pytest.raises(HarnessError, match="wide_target_programs=0"):
        Cfg(wide_target_programs=0).check()


def test_only_the_wide_tier_shares_out_the_filled_positions_by_default():
    """The default's splits share the filled positions in the wide tier (80 to 1,279 programs: B = 8 to
    127 at 10 heads) and keep fixed ranges below it (B = 1: the H200 bench had them faster there) and in
    the deep tier (one split); ``wide_balanced=False`` keeps fixed ranges in the wide tier too, and
    ``balanced=True`` shares them out below it."""
    assert [Cfg().for_programs(bh).balanced for bh in (10, 79, 80, 320, 1279, 1280)] == \
        [False, False, True, True, True, False]
    assert not Cfg(wide_balanced=False).for_programs(320).balanced
    assert Cfg(balanced=True).for_programs(10).balanced


def test_deep_launches_take_the_pipelined_tiles():
    """From 1,280 programs (B = 128 at 10 heads) the default runs 32 keys per tile with 2 warps through 3
    pipeline stages, in one split (14 blocks of a 448-position cache: 264 / 1,280 -> 1 wanted); at 1,279
    the wide tiles, unpipelined; with deep_from None the wide tiles at any size. A bad deep tile is refused."""
    deep = Cfg().for_programs(1280)
    assert (deep.block_n, deep.num_warps, deep.stages, deep.splits(1280, 448)) == (32, 2, 3, (1, 14))
    wide = Cfg().for_programs(1279)
    assert (wide.block_n, wide.num_warps, wide.stages) == (32, 1, 0)
    assert Cfg(deep_from=None).for_programs(10_000).num_warps == 1
    for bad, match in ((Cfg(deep_stages=1), "deep_stages=1"), (Cfg(deep_block_n=48), "deep_block_n=48")):
        with pytest.raises(HarnessError, match=match):
            bad.check()


@pytest.mark.parametrize("bh,L,block_n,want", [
    (10, 448, 64, (7, 1)), (80, 448, 64, (4, 2)), (320, 448, 64, (1, 7)), (640, 448, 64, (1, 7)),
    (10, 384, 32, (12, 1)), (40, 448, 64, (7, 1)), (270, 448, 64, (1, 7)),
])
def test_default_splits(bh, L, block_n, want):
    assert Cfg(block_n=block_n).splits(bh, L) == want


def test_every_split_owns_a_block():
    for bh in (1, 3, 10, 40, 100, 640):
        for L in (1, 17, 64, 100, 448):
            for ns in (None, 1, 2, 3, 5, 8, 100):
                splits, per = Cfg(block_n=16, num_splits=ns).splits(bh, L)
                n_blocks = -(-L // 16)
                assert splits >= 1 and per >= 1 and (splits - 1) * per < n_blocks <= splits * per


def test_bench_tile_changes_parse_onto_the_attention_config():
    """``bench attention configs``: DecodeAttentionConfig changes in the decode-step benches' syntax, checked."""
    from harness.bench.config import config_changes

    assert config_changes("num_splits=4; wide_block_n=32;wide_warps=1", Cfg()) == Cfg(num_splits=4, wide_block_n=32,
                                                                                      wide_warps=1)
    with pytest.raises(HarnessError, match="FIELD=VALUE with a DecodeAttentionConfig field"):
        config_changes("down=(4, 4)", Cfg())
    with pytest.raises(HarnessError, match="deep_stages=1"):
        config_changes("deep_stages=1", Cfg())


def test_bad_inputs_are_refused():
    q, k, v = draw(1, 2, 2, 32, 16, 31)
    with pytest.raises(HarnessError, match="pos must be int64"):
        dat.decode_attention(q, k, v, torch.tensor([3], dtype=torch.int32))
    with pytest.raises(HarnessError, match="KV heads dividing"):
        dat.decode_attention(torch.zeros(1, 3, 1, 16), k, v, torch.tensor([3]))
    with pytest.raises(HarnessError, match="block_n=48"):
        dat.decode_attention(q, k, v, torch.tensor([3]), config=Cfg(block_n=48))
    with pytest.raises(HarnessError, match=r"stages=1: 0 \(one tile at a time\) or 2-6"):
        dat.decode_attention(q, k, v, torch.tensor([3]), config=Cfg(stages=1))
    with pytest.raises(HarnessError, match="sem must be int32"):
        dat.decode_attention(q, k, v, torch.tensor([3]), sem=torch.zeros(1, dtype=torch.int32))


def test_triton_without_static_cache_is_refused():
    with pytest.raises(HarnessError) as exc:
        variants.check(ExecutionConfig(decode_attention="triton"), DEV)
    assert str(exc.value) == ("execution.decode_attention=triton needs kv_cache=static (the kernel reads a preallocated "
                              "cache up to the step's device-side position); fix: add execution.kv_cache=static, or use "
                              "execution.decode_attention=sdpa")
    variants.check(ExecutionConfig(decode_attention="triton", kv_cache="static"), DEV)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_attention_module_gqa_decode_equals_growing_cache(impl):
    """Attention.forward with 4 query and 2 KV heads: the static cache with decode_attention=triton
    (the kernel reads the 2 KV heads itself) against the growing cache (KV heads repeated)."""
    cfg = LLMConfig(hidden_size=64, num_heads=4, num_kv_heads=2)
    torch.manual_seed(0)
    attn = Attention(cfg, layer_idx=0, impl=impl).to(DEV)
    static_attn = copy.deepcopy(attn)                 # the same weights, as the variant
    swap(static_attn, TritonDecodeAttention)
    B, prompt, steps = 2, 5, 4
    xs = torch.randn(B, prompt + steps, 64, device=DEV)
    growing = KVCache(1)
    static = StaticKVCache(1, B, cfg.num_kv_heads, 16, cfg.head_dim, torch.float32, DEV, query_heads=cfg.num_heads)
    attn_probe.reset()
    with torch.inference_mode():
        for lo, hi in [(0, prompt)] + [(t, t + 1) for t in range(prompt, prompt + steps)]:
            pos = torch.arange(lo, hi, device=DEV)
            ref = attn(xs[:, lo:hi], pos.expand(B, -1), growing)
            static.begin_step(pos)
            got = static_attn(xs[:, lo:hi], pos.expand(B, -1), static)
            assert rel_err(got, ref.double()) <= 1e-5, (lo, hi)
    assert attn_probe.SEEN["llm_decode"][-1].startswith("triton:decode_attention_triton")
    attn_probe.reset()


STEPS = 6


@pytest.fixture(scope="module")
def tiny():
    cfg = load_tiny_cfg()
    model = build_model(cfg, "cpu", torch.float32, seed=0)
    page = wl.Page("p", wl.synthetic_page(0, size=(300, 200)), "s")
    req = wl.build_request([page], TINY_MODE, decode_tokens=STEPS + 1)
    return model, req


def _static_logits(model, req, ex: ExecutionConfig):
    """Prefill logits and STEPS decode steps (fed the greedy tokens) through a static cache."""
    L = model.cfg.llm
    cache = StaticKVCache(L.num_layers, 1, L.num_kv_heads, ex.cache_len(req.prefill_tokens, STEPS + 1),
                          L.head_dim, torch.float32, "cpu")
    cache.position = torch.zeros(1, dtype=torch.int64)
    with torch.inference_mode():
        img = model.image_embeddings(req.global_views, req.tiles, req.grid)
        logits = [model.prefill(req.input_ids, req.images_seq_mask, img, cache)]
        for _ in range(STEPS):
            logits.append(model.decode_step(logits[-1][:, -1:].argmax(-1), cache))
    return logits


def test_model_knob_matches_sdpa_fp32(tiny):
    """Tiny model (fp32, CPU): decode_attention=triton against SDPA over the masked static buffer."""
    if not triton_available("cpu")[0]:
        pytest.skip("Triton cannot run on the CPU here (TRITON_INTERPRET unset before import)")
    model, req = tiny
    sdpa = ExecutionConfig(kv_cache="static")
    variants.apply(model, sdpa)
    ref = _static_logits(model, req, sdpa)
    triton = ExecutionConfig(kv_cache="static", decode_attention="triton")
    attn_probe.reset()
    try:
        info = variants.apply(model, triton)
        assert info["decode_attention"] == "triton" and info["decode_attention_is"].startswith("triton: split-KV")
        assert all(isinstance(layer.self_attn, TritonDecodeAttention) for layer in model.model.layers)
        got = _static_logits(model, req, triton)
        assert attn_probe.SEEN["llm_decode"] == ["triton:decode_attention_triton (split-KV, positions 0..pos only)"]
    finally:
        variants.apply(model, ExecutionConfig())
        attn_probe.reset()
    assert all(type(layer.self_attn) is Attention for layer in model.model.layers)
    for j, (a, b) in enumerate(zip(got, ref)):
        assert ((a - b).norm() / b.norm()).item() <= 1e-5, j


def test_apply_refuses_triton_without_static_cache(tiny):
    model, _ = tiny
    with pytest.raises(HarnessError, match="decode_attention=triton needs kv_cache=static"):
        variants.apply(model, ExecutionConfig(decode_attention="triton"))
    assert type(model.model.layers[0].self_attn) is Attention      # refused before anything was converted


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8, 64])
@pytest.mark.parametrize("pos", [0, 200, 447])
def test_gpu_matches_sdpa_bf16_at_model_shapes(B, pos):
    """bf16, nh = 10, d = 128, L = 448: SDPA over the masked buffer against the kernel, eager and
    replayed from a CUDA graph (the position tensor advanced in place between replays)."""
    from harness.variants.static_kv import attention_mask

    g = torch.Generator(device="cuda").manual_seed(B + pos)
    q, k, v = (torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
               for shape in ((B, 10, 1, 128), (B, 10, 448, 128), (B, 10, 448, 128)))
    p = torch.tensor([pos], device="cuda")

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(p, 448))

    ref = sdpa()
    sem = torch.zeros(B * 10, dtype=torch.int32, device="cuda")
    for s in (None, sem):
        assert rel_err(dat.decode_attention(q, k, v, p, sem=s), ref.double()) <= 2e-2
        p.fill_(0)
        dat.decode_attention(q, k, v, p, sem=s)           # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = dat.decode_attention(q, k, v, p, sem=s)
        p.fill_(pos)
        for _ in range(3):                                # the last split leaves the counters at 0
            graph.replay()
        assert rel_err(out, ref.double()) <= 2e-2
    assert int(sem.count_nonzero()) == 0


@pytest.mark.gpu
def test_gpu_kernel_traces_under_torch_compile():
    """Dynamo traces the user Triton kernels without a graph break (fullgraph) and gives the eager result."""
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16)
               for shape in ((8, 10, 1, 128), (8, 10, 448, 128), (8, 10, 448, 128)))
    p = torch.tensor([300], device="cuda")
    fn = torch.compile(lambda q, k, v, p: dat.decode_attention(q, k, v, p) * 2, fullgraph=True, dynamic=False)
    assert torch.equal(fn(q, k, v, p), dat.decode_attention(q, k, v, p) * 2)
    q1, k1, v1 = q[:1], k[:1], v[:1]                      # batch 1: 7 splits, the last one combines
    sem = torch.zeros(10, dtype=torch.int32, device="cuda")
    fn1 = torch.compile(lambda q, k, v, p, s: dat.decode_attention(q, k, v, p, sem=s) * 2, fullgraph=True,
                        dynamic=False)
    for _ in range(3):
        assert torch.equal(fn1(q1, k1, v1, p, sem), dat.decode_attention(q1, k1, v1, p) * 2)
    assert int(sem.count_nonzero()) == 0


def test_analytic_decode_attention_reads_only_filled_positions(tiny_cfg):
    """Static cache: SDPA reads (and multiplies) the whole masked buffer; the kernel the filled positions."""
    from harness.analytic import compose

    case = compose.Case(TINY_MODE, None, decode_tokens=3)

    def attention(cfg):
        df = compose.workload_costs(case, cfg)
        return df[(df.stage == "decode") & (df.family == "llm_attention")].iloc[0]

    static = cost_config(tiny_cfg, {"kv_cache": "static"})
    sdpa, triton = attention(static), attention(cost_config(static, {"decode_attention": "triton"}))
    assert triton.bytes_kv_read < sdpa.bytes_kv_read and triton.flops_counted < sdpa.flops_counted
    assert triton.flops_counted == triton.flops_useful == sdpa.flops_useful
