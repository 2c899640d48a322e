"""Decode-size GEMV kernels (Triton; the interpreter on the CPU) and linear_impl=fused's weight fusion."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import DEV, needs_triton
from harness.errors import HarnessError
from harness.variants import fused_linears as fused_linear

pytestmark = needs_triton


def _rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.parametrize("M,N,K", [(1, 96, 300), (2, 33, 128), (1, 64, 1280)])
def test_gemv_matches_linear(M, N, K):
    from harness.kernels.gemv_triton import GemvConfig, gemv

    torch.manual_seed(0)
    x, w = torch.randn(M, K, device=DEV), torch.randn(N, K, device=DEV) * 0.05
    for cfg in (GemvConfig(), GemvConfig(4, 128, 2)):      # K not a multiple of BLOCK_K: masked tail
        assert _rel(gemv(x, w, config=cfg), F.linear(x, w)) <= 1e-6
    xb, wb = x.bfloat16(), w.bfloat16()
    ref = F.linear(xb.float(), wb.float())                  # the vendor gate: exact products, fp32 sums
    assert gemv(xb, wb, torch.float32).dtype == torch.float32
    assert _rel(gemv(xb, wb, torch.float32), ref) <= 1e-6
    assert _rel(gemv(xb, wb), ref.bfloat16().float()) <= 8e-3   # one bf16 rounding apart at most


def test_gemv_swiglu_rounds_as_the_vendor_swiglu():
    from harness.kernels.gemv_triton import gemv_swiglu

    torch.manual_seed(1)
    x, w = torch.randn(1, 200, device=DEV), torch.randn(2 * 40, 200, device=DEV) * 0.05
    ref = F.silu(F.linear(x, w[:40])) * F.linear(x, w[40:])
    assert _rel(gemv_swiglu(x, w), ref) <= 1e-6
    xb, wb = x.bfloat16(), w.bfloat16()
    refb = F.silu(F.linear(xb, wb[:40])) * F.linear(xb, wb[40:])
    assert _rel(gemv_swiglu(xb, wb), refb) <= 1e-2


def test_bad_shapes_and_tiles_are_refused():
    from harness.kernels.gemv_triton import GemvConfig, gemv, gemv_swiglu

    x = torch.randn(1, 64, device=DEV)
    with pytest.raises(HarnessError, match=r"x \[M, K\] and w \[N, K\]"):
        gemv(x, torch.randn(8, 32, device=DEV))
    with pytest.raises(HarnessError, match="powers of two"):
        gemv(x, torch.randn(8, 64, device=DEV), config=GemvConfig(3, 64, 4))
    with pytest.raises(HarnessError, match="2I rows"):
        gemv_swiglu(x, torch.randn(7, 64, device=DEV))


def test_fuse_rows_keeps_the_state_dict_and_shares_storage():
    torch.manual_seed(2)
    lins = nn.ModuleList([nn.Linear(16, 8, bias=False), nn.Linear(16, 4, bias=False), nn.Linear(16, 4, bias=False)])
    before = {k: v.clone() for k, v in lins.state_dict().items()}
    fused = fused_linear.fuse_rows(list(lins))
    assert fused.shape == (16, 16) and fused_linear.shares_rows(list(lins), fused)
    after = lins.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    with torch.no_grad():
        lins[1].weight.fill_(3.0)                       # writes through into the fused tensor
    assert (fused[8:12] == 3.0).all()
    with pytest.raises(HarnessError, match="cannot share one tensor"):
        fused_linear.fuse_rows([nn.Linear(16, 8, bias=False), nn.Linear(8, 8, bias=False)])


def test_linear_dispatch_uses_cublas_beyond_one_row(monkeypatch):
    """More rows than GEMV_MAX_ROWS, or K > GEMV_MAX_K, go to F.linear (the GEMV kernel never runs)."""
    from harness.kernels import gemv_triton

    calls = []
    monkeypatch.setattr(gemv_triton, "gemv", lambda x, w, out_dtype=None: calls.append(x.shape) or x.new_zeros(1, 8))
    w = torch.randn(8, 16)
    assert (fused_linear.linear(torch.randn(1, 1, 16), w) == 0).all() and calls == [(1, 16)]
    x2 = torch.randn(2, 1, 16)
    assert torch.equal(fused_linear.linear(x2, w), F.linear(x2, w)) and len(calls) == 1
    K = fused_linear.GEMV_MAX_K + 1
    xw, wide = torch.randn(1, 1, K), torch.randn(8, K)
    assert torch.equal(fused_linear.linear(xw, wide), F.linear(xw, wide)) and len(calls) == 1
    assert torch.equal(fused_linear.linear(xw.bfloat16(), wide.bfloat16(), torch.float32),
                       F.linear(xw.bfloat16().float(), wide.bfloat16().float())) and len(calls) == 1


#: the model's attention shape (10 heads of 128) on the GPU; in Triton's interpreter (one program per
#: BLOCK_P = 4 column pairs, 1,920 pairs there) the same head dim 128 at 3 heads (576 pairs): the
#: same kernel paths (a head count that is not a power of two, HALF = 64 > BLOCK_P), a third the programs
MODEL_HEADS = (10, 10, 128) if DEV == "cuda" else (3, 3, 128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nh,nkv,d", [(4, 4, 16), (4, 2, 8), MODEL_HEADS])
def test_gemv_qkv_rope_equals_linear_rope_and_cache_write(nh, nkv, d, dtype):
    """q/k/v GEMV with RoPE and the KV write as its epilogue: q, and the cache rows at ``pos``, equal
    F.linear, the eager RoPE (each op rounded to the dtype) and index_copy_: fp32 to summation order;
    bf16, on inputs whose products and sums are exact in fp32, exactly in Triton's interpreter; on
    the GPU within one bf16 ulp of the RoPE terms (2^-7 (|q_i| + |q_pair|)): an H200 gave 1-ulp
    differences in 164 of 1,280 q elements, and more ulps of elements where q cos and rotate_half(q)
    sin nearly cancel, where torch's eager RoPE on the GPU equals the CPU's (the compiled kernel
    apparently does not keep every intermediate rounding). Other cache rows untouched."""
    from harness.kernels.gemv_triton import gemv_qkv_rope
    from harness.models.llm import RotaryEmbedding, rotate_half

    g = torch.Generator().manual_seed(nh * d)
    K, L, pos = 64, 12, 7
    x = (torch.randint(-4, 5, (1, K), generator=g) / 4).to(dtype)
    w = (torch.randint(-8, 9, ((nh + 2 * nkv) * d, K), generator=g) / 64).to(dtype)
    cos, sin = RotaryEmbedding(d, 10000.0)(x, torch.tensor([[pos]]))
    k_cache, v_cache = (torch.randn(1, nkv, L, d, generator=g).to(dtype) for _ in range(2))
    q, k, v = F.linear(x.float(), w.float()).to(dtype).split([nh * d, nkv * d, nkv * d], dim=-1)  # fp32 sums
    q, k, v = (t.view(1, 1, -1, d).transpose(1, 2) for t in (q, k, v))
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    want = {"q": q * c + rotate_half(q) * s, "k": (k * c + rotate_half(k) * s)[:, :, 0], "v": v[:, :, 0]}
    terms = {n: (t.double().abs() + rotate_half(t).double().abs()).reshape(want[n].shape) for n, t in (("q", q), ("k", k))}
    others = [p for p in range(L) if p != pos]
    before = k_cache[:, :, others].clone(), v_cache[:, :, others].clone()
    got_q = gemv_qkv_rope(*(t.to(DEV) for t in (x, w, cos, sin)), torch.tensor([pos], device=DEV),
                          k_cache := k_cache.to(DEV), v_cache := v_cache.to(DEV), nh)
    assert got_q.shape == (1, nh, 1, d) and got_q.dtype == dtype
    got = {"q": got_q.cpu(), "k": k_cache[:, :, pos].cpu(), "v": v_cache[:, :, pos].cpu()}
    assert torch.equal(k_cache[:, :, others].cpu(), before[0]) and torch.equal(v_cache[:, :, others].cpu(), before[1])
    for name in ("q", "k", "v"):
        diff = (got[name].double() - want[name].double()).abs()
        if dtype == torch.float32:
            assert float(diff.max()) <= 1e-6 * float(want[name].double().abs().max()), (name, float(diff.max()))
        elif DEV == "cpu" or name == "v":
            assert float(diff.max()) == 0.0, (name, float(diff.max()), int((diff > 0).sum()))
        else:
            assert bool((diff <= 2.0 ** -7 * terms[name]).all()), (name, float(diff.max()), int((diff > 0).sum()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_kv_write_equals_rope_and_cache_write(dtype):
    """The batched step's RoPE and KV write in one launch (after the q/k/v linear): each sequence's q
    and its cache rows at ``pos`` equal the eager RoPE (each op rounded to the dtype) and index_copy_,
    exactly in Triton's interpreter (fp32 too: the same operations in the same order); on the GPU
    within one ulp of the RoPE terms, as ``gemv_qkv_rope`` (its test). Other positions untouched; 5
    sequences, 3 query heads and 2 KV heads of 32: 112 column pairs a row, two programs, the second
    partly masked."""
    from harness.kernels.gemv_triton import rope_kv_write
    from harness.models.llm import RotaryEmbedding, rotate_half

    from harness.kernels.gemv_triton import ROPE_BLOCK_P

    g = torch.Generator().manual_seed(5)
    B, nh, nkv, d, L, pos = 5, 3, 2, 32, 12, 7
    assert ROPE_BLOCK_P < (nh + 2 * nkv) * d // 2 < 2 * ROPE_BLOCK_P    # two programs a row, the second partial
    qkv = torch.randn(B, (nh + 2 * nkv) * d, generator=g).to(dtype)
    cos, sin = RotaryEmbedding(d, 10000.0)(qkv, torch.tensor([[pos]]))
    k_cache, v_cache = (torch.randn(B, nkv, L, d, generator=g).to(dtype) for _ in range(2))
    q, k, v = (t.view(B, 1, -1, d).transpose(1, 2) for t in qkv.split([nh * d, nkv * d, nkv * d], dim=-1))
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    want = {"q": q * c + rotate_half(q) * s, "k": (k * c + rotate_half(k) * s)[:, :, 0], "v": v[:, :, 0]}
    terms = {n: (t.double().abs() + rotate_half(t).double().abs()).reshape(want[n].shape) for n, t in (("q", q), ("k", k))}
    others = [p for p in range(L) if p != pos]
    before = k_cache[:, :, others].clone(), v_cache[:, :, others].clone()
    got_q = rope_kv_write(qkv.to(DEV), cos.to(DEV), sin.to(DEV), torch.tensor([pos], device=DEV),
                          k_cache := k_cache.to(DEV), v_cache := v_cache.to(DEV), nh)
    assert got_q.shape == (B, nh, 1, d) and got_q.dtype == dtype
    got = {"q": got_q.cpu(), "k": k_cache[:, :, pos].cpu(), "v": v_cache[:, :, pos].cpu()}
    assert torch.equal(k_cache[:, :, others].cpu(), before[0]) and torch.equal(v_cache[:, :, others].cpu(), before[1])
    for name in ("q", "k", "v"):
        diff = (got[name].double() - want[name].double()).abs()
        if DEV == "cpu" or name == "v":
            assert float(diff.max()) == 0.0, (name, float(diff.max()), int((diff > 0).sum()))
        else:
            ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -23)
            assert bool((diff <= ulp * terms[name]).all()), (name, float(diff.max()), int((diff > 0).sum()))
    with pytest.raises(HarnessError, match="rope_kv_write"):
        rope_kv_write(qkv[:, :-2].to(DEV), cos.to(DEV), sin.to(DEV), torch.tensor([pos], device=DEV), k_cache,
                      v_cache, nh)


def test_gemv_qkv_rope_refuses_bad_shapes():
    from harness.kernels.gemv_triton import gemv_qkv_rope

    x, w = torch.randn(1, 32), torch.randn(3 * 16, 32)
    cache = torch.zeros(1, 1, 8, 16)
    with pytest.raises(HarnessError, match="gemv_qkv_rope"):
        gemv_qkv_rope(torch.randn(2, 32).to(DEV), w.to(DEV), torch.ones(16), torch.zeros(16), torch.tensor([1]),
                      cache, cache.clone(), 1)
    with pytest.raises(HarnessError, match="gemv_qkv_rope"):
        gemv_qkv_rope(x.to(DEV), w[:40].to(DEV), torch.ones(16), torch.zeros(16), torch.tensor([1]), cache,
                      cache.clone(), 1)
