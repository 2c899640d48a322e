"""Sync-free MoE implementations and the static KV cache against the vendor-style reference.

Every routed-expert implementation is compared with ``MoE.moe_infer`` (the vendor loop) of the
same module in fp32 (relative error <= 1e-5) and bf16 (<= 2e-2). Without a GPU the Triton kernels
run in Triton's interpreter: TRITON_INTERPRET=1 is set in conftest.py, before ``fast_moe_triton`` is first
imported (the interpreter is chosen when the kernels are defined). Sync-freedom is checked on the
CPU by running the code on meta tensors (no data: any op that needs values on the host raises).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import DEV as TRITON_DEVICE
from harness.config import LLMConfig
from harness.errors import HarnessError
from harness.kernels.availability import triton_available
from harness.variants import fast_moe as fm
from harness.variants import static_kv as sc
from harness.models.llm import Attention, KVCache, MoE, RotaryEmbedding, rotate_half

#: (hidden, expert width, experts, top-k): the tiny model's routing, and DeepSeek-OCR's 64 x top-6
SHAPES = {"tiny": (64, 32, 8, 2), "e64k6": (64, 32, 64, 6)}
TOKENS = (1, 3, 17, 40)


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    """The matrices here are tiny; with several OpenMP threads on a busy machine each small GEMM
    waits for its threads to be scheduled (~25 ms per call on a loaded 2-core host)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in fp32."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def make_moe(shape: str, dtype=torch.float32, device="cpu", seed: int = 0):
    hidden, inter, experts, k = SHAPES[shape]
    cfg = LLMConfig(hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts,
                    num_experts_per_tok=k)
    gen = torch.Generator().manual_seed(seed)
    moe = MoE(cfg, layer_idx=1)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    moe = moe.to(device=device, dtype=dtype)
    return moe, fm.stack_experts(moe)


def routed_inputs(moe: MoE, T: int, dtype, device, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, moe.gate.weight.shape[1], generator=gen).to(device=device, dtype=dtype)
    ids, w = moe.gate(x)
    return x, ids, w


def triton_ready():
    ok, reason = triton_available(TRITON_DEVICE)
    if not ok:
        pytest.skip(f"triton impl unavailable: {reason}")


def grouped_mm_ready(device, dtype):
    ok, reason = fm.grouped_mm_available(device, dtype)
    if not ok:
        pytest.skip(f"grouped_mm impl unavailable: {reason}")


# ---------------------------------------------------------------- parity with the vendor loop

@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("strategy", fm.TORCH_STRATEGIES)
def test_torch_impl_matches_vendor_fp32(shape, T, strategy):
    moe, weights = make_moe(shape)
    x, ids, w = routed_inputs(moe, T, torch.float32, "cpu")
    ref = moe.moe_infer(x, ids, w)
    out = fm.routed_experts(x, ids, w, weights, "torch", torch_strategy=strategy)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_grouped_mm_impl_matches_vendor_fp32(shape, T):
    grouped_mm_ready("cpu", torch.float32)
    moe, weights = make_moe(shape)
    x, ids, w = routed_inputs(moe, T, torch.float32, "cpu")
    assert rel_err(fm.routed_experts(x, ids, w, weights, "grouped_mm"), moe.moe_infer(x, ids, w)) <= 1e-5


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_triton_impl_matches_vendor_fp32(shape, T):
    triton_ready()
    moe, weights = make_moe(shape, device=TRITON_DEVICE)
    x, ids, w = routed_inputs(moe, T, torch.float32, TRITON_DEVICE)
    assert rel_err(fm.routed_experts(x, ids, w, weights, "triton"), moe.moe_infer(x, ids, w)) <= 1e-5


@pytest.mark.parametrize("impl", fm.IMPLEMENTATIONS)
def test_impls_match_vendor_bf16(impl):
    device = TRITON_DEVICE if impl == "triton" else "cpu"
    if impl == "triton":
        triton_ready()
    if impl == "grouped_mm":
        grouped_mm_ready(device, torch.bfloat16)
    moe, weights = make_moe("e64k6", dtype=torch.bfloat16, device=device)
    for T in (1, 40):
        x, ids, w = routed_inputs(moe, T, torch.bfloat16, device)
        out = fm.routed_experts(x, ids, w, weights, impl)
        assert out.dtype == torch.bfloat16
        assert rel_err(out, moe.moe_infer(x, ids, w)) <= 2e-2


@pytest.mark.parametrize("block_m", (16, 32))
def test_triton_crowded_and_empty_experts(block_m):
    """40 tokens all routed to experts 0 and 5 (several blocks each, other experts empty)."""
    triton_ready()
    moe, weights = make_moe("tiny", device=TRITON_DEVICE)
    x, _, w = routed_inputs(moe, 40, torch.float32, TRITON_DEVICE)
    ids = torch.tensor([[5, 0]] * 20 + [[0, 5]] * 20, device=TRITON_DEVICE)
    cfg = fm.TritonMoEConfig(block_m=block_m, block_n=16, block_k=32)
    out = fm.routed_experts(x, ids, w, weights, "triton", triton_config=cfg)
    assert rel_err(out, moe.moe_infer(x, ids, w)) <= 1e-5


def test_parity_check_sees_wrong_routing():
    """The tolerance is tight enough to catch a routing mistake: shifted expert ids fail it."""
    moe, weights = make_moe("tiny")
    x, ids, w = routed_inputs(moe, 17, torch.float32, "cpu")
    wrong = fm.routed_experts(x, (ids + 1) % 8, w, weights, "torch")
    assert rel_err(wrong, moe.moe_infer(x, ids, w)) > 1e-2


def test_moe_forward_equals_module_forward():
    moe, weights = make_moe("e64k6")
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3))
    assert rel_err(fm.moe_forward(moe, weights, x, "torch"), moe(x)) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ("grouped_mm", "triton"))
def test_cuda_impl_is_sync_free_and_replays_new_routing(impl):
    """On a GPU: no sync under sync debug mode 'error', and a CUDA graph captured for one routing
    replays another routing (copied into the captured inputs) correctly."""
    ok, reason = (fm.grouped_mm_available("cuda", torch.bfloat16) if impl == "grouped_mm"
                  else triton_available("cuda"))
    if not ok:
        pytest.skip(f"{impl} unavailable: {reason}")
    moe, weights = make_moe("e64k6", dtype=torch.bfloat16, device="cuda")
    x, ids, w = routed_inputs(moe, 1, torch.bfloat16, "cuda", seed=1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                      # warm-up: Triton compiles, cuBLAS/CUTLASS set up
        for _ in range(3):
            fm.routed_experts(x, ids, w, weights, impl)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fm.routed_experts(x, ids, w, weights, impl)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert rel_err(out, moe.moe_infer(x, ids, w)) <= 2e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fm.routed_experts(x, ids, w, weights, impl)
    x2, ids2, w2 = routed_inputs(moe, 1, torch.bfloat16, "cuda", seed=2)
    assert not torch.equal(torch.sort(ids2).values, torch.sort(ids).values)
    x.copy_(x2), ids.copy_(ids2), w.copy_(w2)
    graph.replay()
    assert rel_err(static_out, moe.moe_infer(x2, ids2, w2)) <= 2e-2


# ---------------------------------------------------------------- routing bookkeeping, exact values

def test_expert_counts_and_block_alignment_exact():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])            # flat rows 0..5 -> experts 2,0,2,1,0,2
    assert fm.expert_counts(ids.view(-1), 4).tolist() == [2, 1, 3, 0]
    al = fm.align_rows_to_blocks(ids, num_experts=4, block_m=4)
    assert al.max_blocks == 6 // 4 + min(4, 6) == 5
    pad = 6
    assert al.sorted_rows.tolist() == [1, 4, pad, pad,        # expert 0: rows 1, 4
                                       3, pad, pad, pad,      # expert 1: row 3
                                       0, 2, 5, pad,          # expert 2: rows 0, 2, 5
                                       pad, pad, pad, pad, pad, pad, pad, pad]  # past num_padded
    assert al.block_expert.tolist() == [0, 1, 2, 3, 3]
    assert al.num_padded.tolist() == [12]
    assert al.sorted_rows.dtype == al.block_expert.dtype == al.num_padded.dtype == torch.int32


def test_default_triton_config_by_rows_per_expert():
    assert fm.default_triton_config(6, 64).block_m == 16         # decode, batch 1
    assert fm.default_triton_config(64 * 6, 64).block_m == 16
    assert fm.default_triton_config(300 * 6, 64).block_m == 32   # ~28 rows per expert
    assert fm.default_triton_config(1024 * 6, 64).block_m == 64
    # 512 rows per expert is still a 64-row tile; a prefill of 128 base pages (128 x 286 tokens x top-6:
    # 3,432 rows per expert) takes 128 x 128 tiles with 8 warps
    assert fm.default_triton_config(512 * 64, 64).block_m == 64
    big = fm.default_triton_config(128 * 286 * 6, 64)
    assert (big.block_m, big.block_n, big.block_k, big.num_warps, big.num_stages) == (128, 128, 64, 8, 3)


# ---------------------------------------------------------------- torch._grouped_mm conventions

def test_grouped_mm_conventions():
    """2D x 3D: offs = int32 cumulative group ends, empty groups allowed, mat_b may be a transposed view."""
    grouped_mm_ready("cpu", torch.float32)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(9, 16, generator=gen)
    b_nk = torch.randn(4, 8, 16, generator=gen)                  # [G, N, K] like nn.Linear weights
    offs = torch.tensor([3, 3, 7, 9], dtype=torch.int32)         # groups of 3, 0, 4, 2 rows
    out = torch._grouped_mm(a, b_nk.transpose(1, 2), offs=offs)
    expected = torch.cat([a[0:3] @ b_nk[0].T, a[3:7] @ b_nk[2].T, a[7:9] @ b_nk[3].T])
    assert out.shape == (9, 8)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="int32"):
        torch._grouped_mm(a, b_nk.transpose(1, 2), offs=offs.long())


def test_grouped_mm_available_reasons():
    assert fm.grouped_mm_available("cpu", torch.float32)[0] is True
    ok, reason = fm.grouped_mm_available("cpu", torch.int32)
    assert not ok and "int32" in reason
    ok, reason = fm.grouped_mm_available("meta", torch.bfloat16)
    assert not ok and "meta" in reason
    narrow = fm.ExpertWeights(gate_up=torch.zeros(2, 12, 64), down=torch.zeros(2, 64, 6))   # I = 6: 24 B rows
    with pytest.raises(HarnessError, match="16 bytes"):
        fm.routed_experts(torch.zeros(1, 64), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1), narrow,
                          "grouped_mm")
    with pytest.raises(HarnessError, match="unknown moe impl"):
        moe, weights = make_moe("tiny")
        x, ids, w = routed_inputs(moe, 1, torch.float32, "cpu")
        fm.routed_experts(x, ids, w, weights, "vendor")


# ---------------------------------------------------------------- stacking

def test_stack_experts_keeps_state_dict_and_shares_storage():
    hidden, inter, experts, k = SHAPES["tiny"]
    cfg = LLMConfig(hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts,
                    num_experts_per_tok=k)
    moe = MoE(cfg, layer_idx=1)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_()                                   # MoEGate.weight starts as torch.empty
    before = {name: t.clone() for name, t in moe.state_dict().items()}
    weights = fm.stack_experts(moe)
    after = moe.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[name], before[name]) for name in before)
    assert weights.gate_up.shape == (experts, 2 * inter, hidden) and weights.down.shape == (experts, hidden, inter)
    assert weights.gate_up.is_contiguous() and weights.down.is_contiguous()
    ex3 = moe.experts[3]
    assert ex3.gate_proj.weight.data_ptr() == weights.gate_up[3, :inter].data_ptr()
    assert ex3.up_proj.weight.data_ptr() == weights.gate_up[3, inter:].data_ptr()
    assert ex3.down_proj.weight.data_ptr() == weights.down[3].data_ptr()
    assert isinstance(ex3.up_proj.weight, torch.nn.Parameter)
    assert fm.shares_storage(moe, weights)
    # load_state_dict writes through into the stacked tensors
    sd = moe.state_dict()
    sd["experts.3.up_proj.weight"] = torch.full((inter, hidden), 0.5)
    moe.load_state_dict(sd)
    assert torch.equal(weights.gate_up[3, inter:], torch.full((inter, hidden), 0.5))
    # a dtype change replaces the parameters: the sharing is gone and shares_storage says so
    moe.to(torch.float64)
    assert not fm.shares_storage(moe, weights)


# ---------------------------------------------------------------- no host sync (meta tensors)
# Meta tensors have shapes and no data: an op that needs values on the host (.item(), .cpu(),
# nonzero, bincount, a data-dependent shape) raises on them, so code that runs on the meta device
# never makes the host wait for a CUDA device.

def _meta_inputs(dtype):
    """Meta expert weights (64 experts, hidden 64, width 32) and routed inputs (3 tokens, top-6)."""
    weights = fm.ExpertWeights(gate_up=torch.empty(64, 64, 64, dtype=dtype, device="meta"),
                               down=torch.empty(64, 64, 32, dtype=dtype, device="meta"))
    x = torch.empty(3, 64, dtype=dtype, device="meta")
    ids = torch.empty(3, 6, dtype=torch.int64, device="meta")
    w = torch.empty(3, 6, dtype=torch.float32, device="meta")
    return weights, x, ids, w


def test_impls_need_no_tensor_values_on_the_host():
    weights, x, ids, w = _meta_inputs(torch.bfloat16)   # bf16: the meta _grouped_mm takes bf16 only
    outs = [fm._routed_torch(x, ids, w, weights, strategy) for strategy in ("gather", "dense")]
    outs.append(fm._routed_grouped_mm(x, ids, w, weights))   # past grouped_mm_available (no meta path)
    assert all(out.shape == (3, 64) and out.dtype == torch.bfloat16 for out in outs)
    al = fm.align_rows_to_blocks(ids, 64, 16)
    assert al.sorted_rows.shape == ((18 // 16 + 18) * 16,) and al.block_expert.shape == (18 // 16 + 18,)
    cache = sc.StaticKVCache(1, 1, 2, 8, 4, torch.float32, "meta")
    cache.begin_step(torch.empty(1, dtype=torch.int64, device="meta"))
    K, _ = cache.update(0, torch.empty(1, 2, 1, 4, device="meta"), torch.empty(1, 2, 1, 4, device="meta"))
    assert K.shape == (1, 2, 8, 4) and cache.mask.shape == (1, 8)


def test_meta_check_catches_the_vendor_loop():
    hidden, inter, experts, k = SHAPES["e64k6"]
    cfg = LLMConfig(hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts,
                    num_experts_per_tok=k)
    with torch.device("meta"):
        moe = MoE(cfg, layer_idx=1)
    _, x, ids, w = _meta_inputs(torch.float32)
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        moe.moe_infer(x, ids, w)                       # tokens_per_expert = cnts.sum(0).cpu()


# ---------------------------------------------------------------- static KV cache

def test_attention_masks_exact():
    assert sc.attention_mask(torch.tensor([2]), 5).tolist() == [[True, True, True, False, False]]
    assert sc.attention_mask(torch.arange(3), 4).tolist() == [[True, False, False, False],
                                                              [True, True, False, False],
                                                              [True, True, True, False]]
    add = sc.additive_mask(torch.tensor([[True, False]]), torch.float32)
    assert add.tolist() == [[0.0, torch.finfo(torch.float32).min]]


def test_static_cache_writes_length_nbytes_reset():
    cache = sc.StaticKVCache(num_layers=2, batch=1, kv_heads=2, max_len=8, head_dim=4,
                             dtype=torch.float32, device="cpu")
    assert cache.nbytes() == 2 * 2 * (1 * 2 * 8 * 4) * 4
    k = torch.randn(1, 2, 3, 4)
    K, V = cache.update(1, k, -k, torch.arange(3))
    cache.advance(3)
    assert torch.equal(K[:, :, :3], k) and torch.equal(V[:, :, :3], -k)
    assert torch.count_nonzero(K[:, :, 3:]) == 0 and torch.count_nonzero(cache.k[0]) == 0
    one = torch.randn(1, 2, 1, 4)
    cache.begin_step(torch.tensor([3]))
    K, _ = cache.update(1, one, one)
    cache.advance(1)
    assert torch.equal(K[:, :, 3:4], one)
    assert cache.mask.tolist() == [[True] * 4 + [False] * 4]
    assert cache.length == 4 and cache.nbytes_filled() == cache.nbytes() // 2
    with pytest.raises(HarnessError, match="positions"):
        cache.advance(5)
    cache.reset()
    assert cache.length == 0 and cache.mask is None and torch.count_nonzero(cache.k[1]) == 0


def test_rope_from_device_positions_is_bitwise_identical():
    rotary = RotaryEmbedding(16, 10000.0)
    table = sc.RopeTable(rotary.inv_freq, 64, torch.float32)
    for positions in ([[0, 1, 2, 3, 4]], [[7]], [[63]], [[5], [9]]):
        pos = torch.tensor(positions)
        cos, sin = rotary(torch.empty(0), pos)
        for got_cos, got_sin in (sc.rope_cos_sin(rotary.inv_freq, pos, torch.float32), table.lookup(pos)):
            assert torch.equal(got_cos, cos) and torch.equal(got_sin, sin)


def _attention_step_static(attn: Attention, x, pos, cache: sc.StaticKVCache, table: sc.RopeTable):
    """Attention.forward with a static cache: RoPE from the table, writes at ``pos``, SDPA over the
    whole buffer with the cache's mask."""
    B, S, _ = x.shape
    q = attn.q_proj(x).view(B, S, attn.num_heads, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(B, S, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(B, S, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    cos, sin = table.lookup(pos.expand(B, S))
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    cache.begin_step(pos)
    K, V = cache.update(attn.layer_idx, k, v)
    out = F.scaled_dot_product_attention(q, K, V, attn_mask=cache.mask)
    return attn.o_proj(out.transpose(1, 2).reshape(B, S, -1))


def test_static_cache_attention_equals_growing_cache():
    cfg = LLMConfig(hidden_size=64, num_heads=4, num_kv_heads=4)
    torch.manual_seed(0)
    attn = Attention(cfg, layer_idx=0, impl="sdpa")
    B, prompt, steps, max_len = 2, 6, 5, 16
    xs = torch.randn(B, prompt + steps, 64)
    growing = KVCache(1)
    static = sc.StaticKVCache(1, B, cfg.num_kv_heads, max_len, cfg.head_dim, torch.float32, "cpu")
    table = sc.RopeTable(attn.rotary_emb.inv_freq, max_len, torch.float32)
    ref = attn(xs[:, :prompt], torch.arange(prompt).expand(B, prompt), growing)
    got = _attention_step_static(attn, xs[:, :prompt], torch.arange(prompt), static, table)
    assert rel_err(got, ref) <= 1e-6
    for t in range(prompt, prompt + steps):
        pos = torch.tensor([t])
        ref = attn(xs[:, t:t + 1], pos.expand(B, 1), growing)
        got = _attention_step_static(attn, xs[:, t:t + 1], pos, static, table)
        assert rel_err(got, ref) <= 1e-6
    assert torch.equal(static.k[0][:, :, :prompt + steps], growing.k[0])


def test_rows_kernel_equals_the_blocked_kernels_for_decode_batches():
    """A decode-size batch (T*k <= ROWS_KERNEL_MAX) takes the per-row GEMV kernels; forcing the blocked
    kernels (an explicit TritonMoEConfig) gives the same result in fp32."""
    ok, why = triton_available("cpu" if not torch.cuda.is_available() else "cuda")
    if not ok:
        pytest.skip(why)
    from harness.kernels import fast_moe_triton as fmt

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(7)
    E, H, I, k = 8, 64, 32, 2
    weights = fm.ExpertWeights(gate_up=(torch.randn(E, 2 * I, H, generator=gen) * 0.1).to(dev),
                               down=(torch.randn(E, H, I, generator=gen) * 0.1).to(dev))
    for T in (1, 3, 8):
        x = torch.randn(T, H, generator=gen).to(dev)
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(dev)
        w = torch.rand(T, k, generator=gen).to(dev)
        assert T * k <= fmt.ROWS_KERNEL_MAX
        rows = fm.routed_experts(x, ids, w, weights, "triton")
        blocked = fm.routed_experts(x, ids, w, weights, "triton", triton_config=fm.TritonMoEConfig())
        torch.testing.assert_close(rows, blocked, rtol=1e-5, atol=1e-6)


def test_rows_kernel_tiles_cover_ragged_reduction_lengths():
    """The per-row kernels unroll over H and I in BLOCK_K steps: with H=72, I=40 (not multiples of the
    tiles) every tile choice gives the blocked kernels' result; a non-power-of-two tile is refused."""
    ok, why = triton_available("cpu" if not torch.cuda.is_available() else "cuda")
    if not ok:
        pytest.skip(why)
    from harness.errors import HarnessError
    from harness.kernels import fast_moe_triton as fmt

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(3)
    E, H, I, T, k = 6, 72, 40, 2, 3
    weights = fm.ExpertWeights(gate_up=(torch.randn(E, 2 * I, H, generator=gen) * 0.1).to(dev),
                               down=(torch.randn(E, H, I, generator=gen) * 0.1).to(dev))
    x = torch.randn(T, H, generator=gen).to(dev)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(dev)
    w = torch.rand(T, k, generator=gen).to(dev)
    blocked = fm.routed_experts(x, ids, w, weights, "triton", triton_config=fm.TritonMoEConfig())
    for cfg in (fmt.RowsConfig(gate_up=(4, 16, 2), down=(8, 16, 1)), fmt.RowsConfig(gate_up=(16, 32, 4), down=(4, 8, 2)),
                fmt.RowsConfig()):
        torch.testing.assert_close(fmt.routed_experts_rows(x, ids, w, weights, cfg), blocked, rtol=1e-5, atol=1e-6)
    with pytest.raises(HarnessError, match="powers of two"):
        fmt.routed_experts_rows(x, ids, w, weights, fmt.RowsConfig(gate_up=(12, 32, 4)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_kernels_run_the_shared_expert_as_extra_rows(dtype):
    """With ``shared``, the per-row kernels (T = 1, 2: T*k <= 16) and above them the blocked kernels
    (T = 9, 40: the shared expert's 2 parts as pseudo-experts 8 and 9) return routed + shared(x) (the
    shared expert, width S = 2I, as the vendor SwiGLU, each rounded to x's dtype before the add):
    fp32 to 1e-5 against the torch path plus the module; bf16 within one rounding. A width that is no
    multiple of I, or more rows with the parts than the alignment kernel holds (206 x 5 = 1,030), are
    refused; ``folds_shared`` at that boundary (204 x 5 = 1,020 rows fold, 205 x 5 = 1,025 do not)."""
    ok, why = triton_available(TRITON_DEVICE)
    if not ok:
        pytest.skip(why)
    from harness.kernels import fast_moe_triton as fmt
    from harness.models.llm import SwiGLU

    gen = torch.Generator().manual_seed(5)
    E, H, I, k = 8, 72, 40, 3
    weights = fm.ExpertWeights(gate_up=(torch.randn(E, 2 * I, H, generator=gen) * 0.1).to(TRITON_DEVICE, dtype),
                               down=(torch.randn(E, H, I, generator=gen) * 0.1).to(TRITON_DEVICE, dtype))
    torch.manual_seed(0)
    sh = SwiGLU(H, 2 * I).to(TRITON_DEVICE, dtype)
    gate_up = torch.cat([sh.gate_proj.weight, sh.up_proj.weight]).detach()
    for T in (1, 2, 9, 40):     # per-row kernels; above decode size the blocked ones (parts as pseudo-experts)
        x = torch.randn(T, H, generator=gen).to(TRITON_DEVICE, dtype)
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(TRITON_DEVICE)
        w = torch.rand(T, k, generator=gen).to(TRITON_DEVICE)
        with torch.no_grad():
            ref = fm.routed_experts(x, ids, w, weights, "torch") + sh(x)
            got = fm.routed_experts(x, ids, w, weights, "triton", shared=(gate_up, sh.down_proj.weight))
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert float((got.float() - ref.float()).norm() / ref.float().norm()) <= tol, T
        assert got.dtype == dtype and got.shape == (T, H)
    with pytest.raises(HarnessError, match="multiple of the width"):
        fmt.routed_experts_rows(x, ids, w, weights, shared=(gate_up[:, :H][: 2 * 30], sh.down_proj.weight[:, :30]))
    assert fm.folds_shared("triton", 204, 3, 2) and not fm.folds_shared("triton", 205, 3, 2)   # 1,020; 1,025 rows
    assert not fm.folds_shared("grouped_mm", 1, 3, 2) and fm.folds_shared("triton", 5, 3, 300)  # 15 rows: per-row
    xb = torch.randn(206, H).to(TRITON_DEVICE, dtype)
    idsb = torch.stack([torch.randperm(E)[:k] for _ in range(206)]).to(TRITON_DEVICE)
    with pytest.raises(HarnessError, match=r"up to 1024 rows with its parts; got 206 tokens x \(3 \+ 2\) = 1030"):
        fm.routed_experts(xb, idsb, torch.rand(206, k).to(TRITON_DEVICE), weights, "triton",
                          shared=(gate_up, sh.down_proj.weight))
