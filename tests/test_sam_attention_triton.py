"""The Triton in-kernel-bias SAM attention equals the dense-mask path (fp32, TRITON_INTERPRET=1).

Without a GPU the kernel runs in Triton's interpreter (set before triton is imported; the
setting then holds for the rest of the pytest process); with one it is compiled and run there.
References are computed on the CPU in fp32; sizes are small. Every check draws fresh inputs and must reach max|a - b| / max|b| <= 1e-5.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from conftest import DEV  # noqa: E402
from harness.errors import HarnessError  # noqa: E402
from harness.variants import sam_attention as sa  # noqa: E402
from harness import sam_attention_tiles as tiles  # noqa: E402
from harness.kernels import sam_attention_triton as st  # noqa: E402

from test_sam_attention import draw, no_bias, rel_err  # noqa: E402

TOL = 1e-5


@pytest.mark.parametrize("H, W, kw", [
    (8, 8, {}),                                 # blocks of 2 rows x 16 slots (8 real): half the slots masked
    (7, 10, {}),                                # non-square; the 4th block's 2nd row lies past H: masked
    (14, 14, {"bm": 64}),                       # a 14 x 14 window: S=196 not a multiple of BM; 7 blocks of 2 rows
    (14, 14, {"bn": 16, "rows": 1}),            # the same window one row per block (14 steps)
    (6, 10, {"bn": 64, "rows": 4}),             # 4 rows per block; the 2nd block's last 2 rows past H
    (4, 20, {"bn": 16}),                        # one row per block, two blocks per row (rel_w loaded per block)
    (8, 8, {"bm": 16, "hoist_rw": False}),      # small query blocks, rel_w not hoisted
    (7, 10, {"hoist_rw": False}),               # rows past H with rel_w loaded per block
])
def test_triton_matches_dense(H, W, kw):
    q, k, v, Rh, Rw = draw(2, 2, H, W, d=16, seed=H * 100 + W + len(kw))
    ref = sa.dense_bias_attention(q, k, v, Rh, Rw, H, W)        # CPU fp32 (no TF32 anywhere)
    out = sa.triton_attention(*(t.to(DEV) for t in (q, k, v, Rh, Rw)), H, W, **kw).cpu()
    assert out.shape == (2, H * W, 2, 16) and out.is_contiguous() and out.dtype == q.dtype
    out = out.permute(0, 2, 1, 3)                               # [B, nh, S, d] like ref
    assert rel_err(out, ref) <= TOL
    assert rel_err(no_bias(q, k, v), ref) > 1e-2


def test_triton_reads_strided_views_and_the_custom_op_equals_attend():
    """q, k, v as the strided views of one [B, S, 3, nh, d] tensor (SAM's qkv output; no copy made)
    give what contiguous copies give, through attend and through torch.ops.harness."""
    B, nh, H, W, d = 2, 3, 5, 6, 16
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(B, H * W, 3, nh, d, generator=g).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    assert not q.is_contiguous()
    Rh, Rw = torch.randn(H, H, d, generator=g) * 0.3, torch.randn(W, W, d, generator=g) * 0.3
    ref = sa.dense_bias_attention(q.contiguous(), k.contiguous(), v.contiguous(), Rh, Rw, H, W)
    rel_h, rel_w = sa.rel_terms(q, Rh, Rw, H, W)
    dev = [t.to(DEV) for t in (q, k, v, rel_h, rel_w)]
    out = st.attend(*dev, H, W).cpu()
    assert rel_err(out.permute(0, 2, 1, 3), ref) <= TOL
    torch.library.opcheck(torch.ops.harness.sam_rel_bias_attention.default, (*dev, H, W))  # fake vs real, schema


class _Launch:
    """Stands in for the jitted kernel: records the grid and the tile constants of one launch."""

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.grid, self.kw = grid, kw
        return launch


def test_the_launch_grid_is_one_axis(monkeypatch):
    """A 2-D grid's second axis stops at 65,535 programs: 5,462 windows x 12 heads = 65,544 (window, head)
    pairs would not launch (base mode at batch 219: 25 windows a page; gundam pages of 9 tiles at batch
    68: 81 windows a page). The kernel's grid is one axis: 1 query block x 65,544 pairs here (inputs are
    expanded views: nothing that large is allocated but the output)."""
    rec = _Launch()
    monkeypatch.setattr(st, "_rel_bias_fwd", rec)
    B, nh, H, W, d = 5462, 12, 2, 2, 16
    q = torch.zeros(1, 1, H * W, d).expand(B, nh, H * W, d)
    rel = torch.zeros(1, 1, H * W, H).expand(B, nh, H * W, H)
    out = st.attend(q, q, q, rel, rel, H, W)
    assert rec.grid == (B * nh,) and B * nh > 65535 and out.shape == (B, H * W, nh, d)
    assert st.launch_grid(196, 64, 128 * 25 * 12) == (4 * 38400,)      # base mode at batch 128: 4 query blocks


def test_the_tiles_attend_picks(monkeypatch):
    """Which key block ``attend`` launches: rows=1 alone takes default_bn(W) (40 -> 16, three blocks per
    row; not pow2(40) = 64), rows=2 alone 2 x pow2(W), neither the default block (14 -> 2 rows of 16)."""
    rec = _Launch()
    monkeypatch.setattr(st, "_rel_bias_fwd", rec)
    for (H, W), kw, want in [((3, 40), {"rows": 1}, (16, 1, 3)), ((6, 10), {"rows": 2}, (32, 2, 1)),
                             ((14, 14), {}, (32, 2, 1)), ((64, 64), {}, (64, 1, 1))]:
        q, k, v, Rh, Rw = draw(1, 1, H, W, d=16, seed=3)
        sa.triton_attention(q, k, v, Rh, Rw, H, W, **kw)
        assert (rec.kw["BN"], rec.kw["R"], rec.kw["NWB"]) == want, (H, W, kw)
        assert rec.grid == (-(-H * W // 64),)


def test_block_choice_and_slots():
    assert st.default_bn(64) == 64 and st.default_bn(80) == 32 and st.default_bn(40) == 16
    assert st.default_bn(14) == 16 and st.default_bn(8) == 16
    assert tiles.default_block(14) == (32, 2) and tiles.default_block(64) == (64, 1) and tiles.default_block(40) == (16, 1)
    # 14 x 14: 7 blocks of 2 rows x 16 slots = 224; 4 blocks of 4 rows (the last 2 past the grid) = 256
    assert st.key_slots(14, 14) == 224 and st.key_slots(14, 14, 64, 4) == 256 and st.key_slots(6, 10, 32, 2) == 96
    assert st.key_slots(64, 64) == 4096 and st.key_slots(80, 80, 32) == 80 * 96 and st.key_slots(40, 40) == 40 * 48
    assert tiles.slots(14, 14) == (256, 224) and tiles.slots(64, 64) == (4096, 4096)
    c = sa.inkernel_bias_cost(12, 64, 64, 64, st.key_slots(64, 64, 64))
    assert c.flops_kernel == c.flops_useful == 4 * 12 * 4096 ** 2 * 64
    w = sa.inkernel_bias_cost(12, 14, 14, 64, key_slots=224, query_slots=256)       # a window's slots
    assert w.flops_kernel == 4 * 12 * 256 * 224 * 64 and w.flops_vector == 8 * 12 * 196 * 196
    assert tiles.query_slots(196) == 256 and tiles.query_slots(196, 128) == 256 and tiles.query_slots(4096) == 4096
    assert c.bytes_kernel == 2 * (4 * 12 * 4096 * 64 + 12 * 4096 * 128)
    one_row = [c for c in st.bench_configs(80, 80, 6400) if c.get("rows", 1) == 1]
    assert {c["bn"] for c in one_row} == {32, 16} and len(one_row) == len(st.bench_configs(80, 80, 6400))
    assert {(c["bn"], c.get("rows", 1)) for c in st.bench_configs(40, 40, 1600)} == {(64, 1), (16, 1), (128, 2)}
    window = st.bench_configs(14, 14, 196)
    assert {(c["bn"], c.get("rows", 1)) for c in window} == {(16, 1), (32, 2), (64, 4)}
    assert {(c["bn"], c.get("rows", 1)) for c in st.bench_configs(64, 64, 4096)} == {(64, 1), (16, 1), (128, 2)}
    for cfg in st.bench_configs(64, 64, 4096) + st.bench_configs(40, 40, 1600):
        assert cfg["bm"] in (64, 128)


def test_triton_rejects_what_it_cannot_do():
    q, k, v, Rh, Rw = draw(1, 1, 4, 5, d=16, seed=5)
    with pytest.raises(HarnessError, match="hoist_rw"):
        sa.triton_attention(*draw(1, 1, 2, 20, d=16, seed=6), 2, 20, bn=16, hoist_rw=True)
    with pytest.raises(HarnessError, match="power-of-two"):
        sa.triton_attention(*draw(1, 1, 4, 5, d=24, seed=7), 4, 5)
    with pytest.raises(HarnessError, match="H\\*W"):
        sa.triton_attention(q, k, v, Rh, Rw, 5, 5)
    rel_h, rel_w = sa.rel_terms(q, Rh, Rw, 4, 5)
    with pytest.raises(HarnessError, match="rel_h"):
        st.attend(q, k, v, rel_w, rel_h, 4, 5)
    with pytest.raises(HarnessError, match="in 4 rows"):
        st.attend(q, k, v, rel_h, rel_w, 4, 5, bn=32, rows=4)       # rows of 8 slots
    with pytest.raises(HarnessError, match="in 2 rows"):
        sa.triton_attention(*draw(1, 1, 2, 20, d=16, seed=9), 2, 20, bn=32, rows=2)   # 16 columns < W
    for tile in ({"bm": 48}, {"bn": 48}, {"bm": 8}):
        with pytest.raises(HarnessError, match="powers of two of at least 16"):
            st.attend(q, k, v, rel_h, rel_w, 4, 5, **tile)
    with pytest.raises(HarnessError, match="one device and dtype"):
        st.attend(q, k, v, rel_h.double(), rel_w, 4, 5)


def test_module_forward_with_triton_method():
    """forward(method='triton') on a real SAMAttention (2 heads of 16) matches the module."""
    from harness.models import attn_probe
    from harness.models.vision import SAMAttention, rel_pos_table

    g = torch.Generator().manual_seed(9)
    m = SAMAttention(32, 2, 6)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(generator=g).mul_(0.3)
    x = torch.randn(2, 6, 6, 32, generator=g)
    with torch.no_grad():
        ref = m(x)                                              # CPU fp32
    m, x = m.to(DEV), x.to(DEV)
    attn_probe.reset()
    with torch.no_grad():
        out = sa.forward(m, x, rel_pos_table(6, 6, m.rel_pos_h), rel_pos_table(6, 6, m.rel_pos_w), method="triton").cpu()
    assert rel_err(out, ref) <= TOL
    assert attn_probe.SEEN["sam"] == ["triton:sam_attention_triton._rel_bias_fwd"]
    attn_probe.reset()
