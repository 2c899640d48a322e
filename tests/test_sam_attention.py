"""The augmented-head-dim SAM attention equals the dense-mask path (fp32, CPU).

Each check draws fresh random q, k, v and rel-pos tables (std chosen so the bias moves the
softmax by O(1)), compares with a relative error max|a - b| / max|b| <= 1e-5, and shows the bias
matters (dropping it breaks the match), so a wrong gather or a wrong scale cannot pass.
"""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from harness.errors import HarnessError
from harness.knobs import augmented_dim
from harness.models import attn_probe
from harness.variants import sam_attention as sa
from harness.models.vision import SAMAttention, SAMBlock, rel_pos_table, window_partition

TOL = 1e-5


@pytest.fixture(autouse=True)
def _fp32_exact():
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")   # no TF32 / bf16 inner products
    yield
    torch.set_float32_matmul_precision(prev)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def draw(B, nh, H, W, d=64, dv=None, seed=0):
    """Random q, k, v [B, nh, H*W, d] and tables Rh [H, H, d], Rw [W, W, d] (bias terms ~ N(0, 1))."""
    g = torch.Generator().manual_seed(seed)
    S = H * W
    q, k = (torch.randn(B, nh, S, d, generator=g) for _ in range(2))
    v = torch.randn(B, nh, S, dv or d, generator=g)
    Rh = torch.randn(H, H, d, generator=g) / d ** 0.5
    Rw = torch.randn(W, W, d, generator=g) / d ** 0.5
    return q, k, v, Rh, Rw


def no_bias(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


# --------------------------------------------------------------------------- functions

@pytest.mark.parametrize("H, W, B, nh, seed", [
    (8, 8, 2, 3, 1),        # global, small grid
    (16, 16, 1, 2, 2),      # global, 256 tokens
    (6, 10, 2, 2, 3),       # non-square grid: h and w indices cannot be swapped unnoticed
    (12, 12, 1, 2, 4),      # 12 = 2^2 * 3 (not square-free): d + H + W = 88, no padding
])
@pytest.mark.parametrize("backend", ["math", "flash"])
def test_global_matches_dense(H, W, B, nh, seed, backend):
    q, k, v, Rh, Rw = draw(B, nh, H, W, seed=seed * 10 + len(backend))
    ref = sa.dense_bias_attention(q, k, v, Rh, Rw, H, W)
    out = sa.augmented_attention(q, k, v, Rh, Rw, H, W, backend=backend)
    assert out.shape == ref.shape
    assert rel_err(out, ref) <= TOL
    assert rel_err(no_bias(q, k, v), ref) > 1e-2   # the bias is not negligible in this draw


def test_window_with_padding_matches_dense():
    """A 20 x 20 grid in 14 x 14 windows: padded to 28 x 28, 4 windows whose padded tokens
    carry the qkv bias (as after window_partition + Linear), attended by both paths alike."""
    g = torch.Generator().manual_seed(7)
    nh, d, ws = 2, 64, 14
    x = torch.randn(1, 20, 20, nh * d, generator=g)
    xw, pad_hw = window_partition(x, ws)
    assert pad_hw == (28, 28) and xw.shape[0] == 4
    qkv = torch.nn.Linear(nh * d, 3 * nh * d)
    with torch.no_grad():
        qkv.bias.normal_(generator=g)
        t = qkv(xw).reshape(4, ws * ws, 3, nh, d).permute(2, 0, 3, 1, 4)
    q, k, v = t.unbind(0)
    assert torch.equal(q[-1, 0, -1], q[-1, 0, -2])   # a padded token: zeros in, bias out
    Rh = torch.randn(ws, ws, d, generator=g) / d ** 0.5
    Rw = torch.randn(ws, ws, d, generator=g) / d ** 0.5
    ref = sa.dense_bias_attention(q, k, v, Rh, Rw, ws, ws)
    for backend in ("math", "flash"):
        out = sa.augmented_attention(q, k, v, Rh, Rw, ws, ws, backend=backend)
        assert rel_err(out, ref) <= TOL, backend
    assert rel_err(no_bias(q, k, v), ref) > 1e-2


def test_value_dim_may_differ_and_padding_multiple():
    q, k, v, Rh, Rw = draw(1, 2, 8, 8, dv=32, seed=11)
    ref = sa.dense_bias_attention(q, k, v, Rh, Rw, 8, 8)
    for multiple, pad_v_to in ((8, None), (64, None), (8, 48)):
        out = sa.augmented_attention(q, k, v, Rh, Rw, 8, 8, backend="math", multiple=multiple, pad_v_to=pad_v_to)
        assert out.shape[-1] == 32 and rel_err(out, ref) <= TOL


def test_augmented_qk_layout():
    q, k, _, Rh, Rw = draw(1, 1, 3, 6, d=8, seed=12)
    q_aug, k_aug = sa.augment_qk(q, k, Rh, Rw, 3, 6, multiple=8)
    assert q_aug.shape == k_aug.shape == (1, 1, 18, 24)           # 8 + 3 + 6 = 17 -> 24
    tail = k_aug[0, 0, :, 8:]
    assert tail[8].tolist()[:9] == [0, 1, 0, 0, 0, 1, 0, 0, 0]   # token 8: h = 1, w = 2
    assert torch.equal(tail.sum(1), torch.full((18,), 2.0))
    assert torch.equal(tail[:, 9:], torch.zeros(18, 7))           # padding columns are zeros
    assert torch.equal(q_aug[..., :8], q) and torch.equal(k_aug[..., :8], k)
    assert torch.equal(q_aug[..., 17:], torch.zeros(1, 1, 18, 7))
    rel_h = torch.einsum("sc,skc->sk", q[0, 0], Rh[torch.arange(18) // 6]) * 8 ** 0.5
    assert torch.allclose(q_aug[0, 0, :, 8:11], rel_h, rtol=1e-6, atol=1e-6)


def test_augment_qk_compiles_without_the_lru_cache_warning():
    """Under torch.compile the key tail is built in the graph (no Dynamo warning about the eager
    path's lru_cache), and the compiled q', k' equal the eager ones."""
    import warnings

    H = W = 4
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, H * W, 8, generator=g) for _ in range(2))
    Rh, Rw = torch.randn(H, H, 8, generator=g), torch.randn(W, W, 8, generator=g)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(lambda q, k: sa.augment_qk(q, k, Rh, Rw, H, W), fullgraph=True)(q, k)
    assert not [w for w in caught if "lru_cache" in str(w.message)]
    assert all(torch.equal(a, b) for a, b in zip(got, sa.augment_qk(q, k, Rh, Rw, H, W)))


def test_augmented_dim():
    assert augmented_dim(64, 64, 64) == 192      # base global
    assert augmented_dim(64, 14, 14) == 96       # windows (92 padded)
    assert augmented_dim(64, 80, 80) == 224      # large global
    assert augmented_dim(64, 40, 40) == 144      # small / gundam tiles
    assert augmented_dim(64, 32, 32) == 128      # tiny
    assert augmented_dim(64, 14, 14, 32) == 96
    assert augmented_dim(64, 40, 40, 32) == 160
    with pytest.raises(HarnessError):
        augmented_dim(64, 0, 14)


def test_errors_are_stated():
    q, k, v, Rh, Rw = draw(1, 1, 4, 4, seed=13)
    with pytest.raises(HarnessError, match="CUDA"):
        sa.augmented_attention(q, k, v, Rh, Rw, 4, 4, backend="efficient")
    with pytest.raises(HarnessError, match="unknown backend"):
        sa.augmented_attention(q, k, v, Rh, Rw, 4, 4, backend="fastest")
    with pytest.raises(HarnessError, match="H\\*W"):
        sa.augmented_attention(q, k, v, Rh, Rw, 4, 5)
    with pytest.raises(HarnessError, match="flash needs v padded"):
        sa.augmented_attention(q, k, v, Rh, Rw, 4, 4, backend="flash", pad_v_to=64)
    assert sa.resolve_backend("auto", q, v) == "math"            # CPU: stated, not guessed


# --------------------------------------------------------------------------- the real module

def _module(dim, heads, input_size, seed):
    g = torch.Generator().manual_seed(seed)
    m = SAMAttention(dim, heads, input_size)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(generator=g).mul_(0.5 if p.dim() == 2 and p.shape[0] != p.shape[1] else 0.2)
    return m


def test_sam_attention_module_both_paths():
    """A real SAMAttention (dim 128, 2 heads of 64, global 12 x 12 with its 2*12-1 tables and a
    resized-table case at 10 x 10): forward(method='dense') is bit-identical to the module,
    method='augmented' within 1e-5, and the backend that ran is noted in attn_probe."""
    attn_probe.reset()
    for grid, seed in ((12, 21), (10, 22)):
        m = _module(128, 2, 12, seed)
        x = torch.randn(2, grid, grid, 128, generator=torch.Generator().manual_seed(seed + 100))
        Rh, Rw = rel_pos_table(grid, grid, m.rel_pos_h), rel_pos_table(grid, grid, m.rel_pos_w)
        with torch.no_grad():
            ref = m(x)
            dense = sa.forward(m, x, Rh, Rw, method="dense")
            aug = sa.forward(m, x, Rh, Rw, method="augmented", backend="auto")
        assert torch.equal(dense, ref)
        assert rel_err(aug, ref) <= TOL
    assert "augmented sdpa:math (cpu) d_qk=88 d_v=64" in attn_probe.SEEN["sam"]   # 64 + 12 + 12
    attn_probe.reset()
    with pytest.raises(HarnessError, match="method"):
        sa.forward(m, x, Rh, Rw, method="flex")


def test_windowed_block_through_helper(tiny_cfg):
    """A SAMBlock with 14 x 14 windows on a 20 x 20 grid (4 padded windows), its attention routed
    through the helper exactly as the proposed SAMAttention change does."""
    cfg = tiny_cfg.sam
    blk = SAMBlock(cfg, window_size=14)
    g = torch.Generator().manual_seed(31)
    with torch.no_grad():
        for p in blk.parameters():
            p.normal_(generator=g).mul_(0.2)
    x = torch.randn(1, 20, 20, cfg.embed_dim, generator=g)
    with torch.no_grad():
        ref = blk(x)
        attn = blk.attn

        def routed(t):
            Hh, Ww = t.shape[1], t.shape[2]
            Rh = rel_pos_table(Hh, Hh, attn.rel_pos_h)
            Rw = rel_pos_table(Ww, Ww, attn.rel_pos_w)
            return sa.forward(attn, t, Rh, Rw, method="augmented", backend="flash", site=None)

        attn.forward = routed
        out = blk(x)
    assert out.shape == ref.shape == (1, 20, 20, cfg.embed_dim)
    assert rel_err(out, ref) <= TOL
    assert rel_err(out, x) > 1e-2   # the block did something


# --------------------------------------------------------------------------- cost formulas

def test_cost_formulas_match_flop_counter():
    """flops_kernel + flops_relpos equal what FlopCounterMode counts (math backend: the CPU flash
    op has no FLOP formula registered; its count is the same formula with dv_x = d')."""
    from torch.utils.flop_counter import FlopCounterMode

    H, W = 8, 6
    q, k, v, Rh, Rw = draw(2, 3, H, W, seed=41)
    for pad_v_to in (None, 80):
        with FlopCounterMode(display=False) as fc:
            sa.augmented_attention(q, k, v, Rh, Rw, H, W, backend="math", pad_v_to=pad_v_to)
        c = sa.augmented_cost(6, H, W, 64, dv_x=pad_v_to)
        assert fc.get_total_flops() == c.flops_kernel + c.flops_relpos == 2 * 6 * 48 * (48 * (80 + (pad_v_to or 64)) + 14 * 64)
    with FlopCounterMode(display=False) as fc, sdpa_kernel(SDPBackend.MATH):   # CPU flash: uncounted
        sa.dense_bias_attention(q, k, v, Rh, Rw, H, W)
    c = sa.dense_cost(6, H, W, 64)
    assert fc.get_total_flops() == c.flops_kernel + c.flops_relpos


def test_dense_mask_bytes_of_base_mode():
    """The issue's 3.59 GB: 4 global blocks (12 heads, 64 x 64) + 8 windowed blocks (25 padded
    windows x 12 heads, 14 x 14), mask written once and read once, bf16. The augmented method
    removes it for global blocks; for 196-token windows q'/k' cost about what the mask did."""
    mask = lambda bh, s: 2 * bh * s * s * 2
    assert 4 * mask(12, 4096) + 8 * mask(300, 196) == 3_590_019_072
    glob, aug_g = sa.dense_cost(12, 64, 64), sa.augmented_cost(12, 64, 64)
    assert aug_g.flops_kernel == 2 * 12 * 4096 ** 2 * (192 + 64)
    assert aug_g.flops_useful == glob.flops_useful == 4 * 12 * 4096 ** 2 * 64
    assert glob.bytes_total - aug_g.bytes_total > 0.9 * mask(12, 4096)
    win, aug_w = sa.dense_cost(300, 14, 14), sa.augmented_cost(300, 14, 14)
    assert abs(win.bytes_total - aug_w.bytes_total) < 0.05 * win.bytes_total


def test_sam_encoder_with_the_proposed_forward(tiny_cfg, monkeypatch):
    """The whole tiny SAM encoder (grid 16: a padded-window block and a global block) with
    SAMAttention.forward replaced by the body proposed for vision.py, augmented everywhere,
    equals the unmodified encoder."""
    from harness.models.vision import SAMEncoder

    enc = SAMEncoder(tiny_cfg.sam)
    g = torch.Generator().manual_seed(51)
    with torch.no_grad():
        for name, p in enc.named_parameters():   # attention weights large enough to matter downstream
            p.normal_(generator=g).mul_(0.5 if ".attn." in name else 0.1)
    x = torch.randn(1, 3, tiny_cfg.sam.img_size, tiny_cfg.sam.img_size, generator=g)
    with torch.no_grad():
        ref = enc(x)

    def proposed(self, t):
        B, H, W, _ = t.shape
        return sa.forward(self, t, rel_pos_table(H, H, self.rel_pos_h), rel_pos_table(W, W, self.rel_pos_w),
                          method="augmented", backend="auto", site=None)

    monkeypatch.setattr(SAMAttention, "forward", proposed)
    with torch.no_grad():
        out = enc(x)
    assert out.shape == ref.shape
    assert rel_err(out, ref) <= TOL


@pytest.mark.gpu
@pytest.mark.parametrize("H, W, B", [(64, 64, 1), (14, 14, 8), (40, 40, 2)])
def test_cuda_bf16_backends_match_fp32(H, W, B):
    """On a GPU, in bf16: every SDPA backend torch accepts for (q', k', v), and the Triton kernel,
    are as close to the fp32 dense reference as the bf16 dense path is (within 2x + 1e-3); a
    backend torch refuses must refuse with a stated reason."""
    q, k, v, Rh, Rw = draw(B, 12, H, W, seed=H + B)
    ref = sa.dense_bias_attention(q, k, v, Rh, Rw, H, W)                     # CPU fp32
    qc, kc, vc, Rhc, Rwc = (t.cuda().bfloat16() for t in (q, k, v, Rh, Rw))
    dense_err = rel_err(sa.dense_bias_attention(qc, kc, vc, Rhc, Rwc, H, W).float().cpu(), ref)
    ran = 0
    for backend in ("flash", "efficient", "cudnn"):
        try:
            out = sa.augmented_attention(qc, kc, vc, Rhc, Rwc, H, W, backend=backend)
        except HarnessError as exc:
            assert "cannot run" in str(exc) and "fix:" in str(exc), exc
            continue
        ran += 1
        assert rel_err(out.float().cpu(), ref) <= 2 * dense_err + 1e-3, backend
    assert ran >= 1
    out = sa.triton_attention(qc, kc, vc, Rhc, Rwc, H, W).permute(0, 2, 1, 3)
    assert rel_err(out.float().cpu(), ref) <= 2 * dense_err + 1e-3, "triton"
