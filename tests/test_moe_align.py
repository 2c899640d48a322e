"""The one-program alignment kernel (``kernels.moe_align_triton``; the interpreter on the CPU) against
the torch path (``moe_blocks.align_rows_to_blocks``), whose exact layout ``test_fast_moe`` pins by
hand: every output is an integer, so equal means bit for bit."""
from __future__ import annotations

import pytest
import torch

from conftest import DEV, needs_triton
from harness.errors import HarnessError
from harness.kernels.moe_blocks import align_rows_to_blocks

pytestmark = needs_triton


def _random_ids(T, k, E, seed, experts_used=None):
    """[T, k] int64: each token's k distinct experts, drawn from the first ``experts_used`` (all by default)."""
    g = torch.Generator().manual_seed(seed)
    pool = experts_used or E
    return torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(T)]).to(DEV)


def _same(got, want):
    assert got.max_blocks == want.max_blocks and got.num_rows == want.num_rows and got.block_m == want.block_m
    for name in ("sorted_rows", "block_expert", "num_padded"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype == torch.int32, name
        assert torch.equal(a.cpu(), b.cpu()), name


def test_align_kernel_hand_case():
    """The hand-derived layout of ``test_fast_moe.test_expert_counts_and_block_alignment_exact``."""
    from harness.kernels.moe_align_triton import align_rows

    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], device=DEV)
    al = align_rows(ids, 4, 4)
    pad = 6
    assert al.sorted_rows.tolist() == [1, 4, pad, pad, 3, pad, pad, pad, 0, 2, 5, pad] + [pad] * 8
    assert al.block_expert.tolist() == [0, 1, 2, 3, 3]
    assert al.num_padded.tolist() == [12]


@pytest.mark.parametrize("T,k,E,block_m,used", [
    (32, 6, 64, 16, None),      # batch-32 decode, balanced routing: ~61 experts
    (32, 6, 64, 16, 8),         # the random weights' routing: a few experts, several blocks each
    (8, 6, 64, 16, None),
    (3, 2, 10, 4, None),        # E not a power of two
    (85, 6, 64, 32, 20),        # 510 rows, 32-row blocks
    (128, 6, 64, 16, None),     # batch 128: 768 rows
    (5, 1, 3, 16, None),
])
def test_align_kernel_equals_torch(T, k, E, block_m, used):
    from harness.kernels.moe_align_triton import align_rows

    ids = _random_ids(T, k, E, seed=T * 7 + E, experts_used=used)
    _same(align_rows(ids, E, block_m), align_rows_to_blocks(ids, E, block_m))


def test_align_kernel_counts_at_the_device_step():
    """The per-expert rows added at (min(step, steps), layer); other rows and layers untouched."""
    from harness.kernels.moe_align_triton import align_rows

    ids = torch.tensor([[3, 1], [3, 0], [1, 3]], device=DEV)
    buf = torch.zeros(4, 2, 5, dtype=torch.int64, device=DEV)
    buf[2, 1, 4] = 7                                      # an earlier count stays
    step = torch.tensor([2], device=DEV)
    align_rows(ids, 5, 16, counts=(buf, step, 1))
    want = torch.zeros(4, 2, 5, dtype=torch.int64)
    want[2, 1] = torch.tensor([1, 2, 0, 3, 7])
    assert torch.equal(buf.cpu(), want)
    step.fill_(9)                                         # past the plan: the last row (steps = 3)
    align_rows(ids, 5, 16, counts=(buf, step, 0))
    want[3, 0] = torch.tensor([1, 2, 0, 3, 0])
    assert torch.equal(buf.cpu(), want)


def test_align_kernel_shared_parts_are_pseudo_experts_never_counted():
    """``shared_parts`` P: token t's rows t*(k + P) + k + p belong to expert E + p. Hand case: 3 tokens,
    k = 2 of E = 4, P = 2, blocks of 4: rows (flat t*4 + j) 0:2 1:0 | 4:2 5:1 | 8:0 9:2 and the shared
    rows 2, 6, 10 (expert 4) and 3, 7, 11 (expert 5); padding holds 12. Expert 0: rows 1, 8; 1: 5;
    2: 0, 4, 9; 3: none; 4: 2, 6, 10; 5: 3, 7, 11. The count adds the routed experts only (1 block each
    of 0, 1, 2, 4, 5 = 20 padded rows). The same layout as the torch alignment of the ids with the
    pseudo-experts written out (its rows in use; the host bounds differ), at a batch-32 size too."""
    from harness.kernels.moe_align_triton import align_rows

    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], device=DEV)
    buf = torch.zeros(2, 1, 4, dtype=torch.int64, device=DEV)
    al = align_rows(ids, 4, 4, counts=(buf, torch.zeros(1, dtype=torch.int64, device=DEV), 0), shared_parts=2)
    pad = 12
    assert al.num_rows == 12 and al.num_padded.tolist() == [20]
    assert al.sorted_rows.tolist()[:20] == [1, 8, pad, pad, 5, pad, pad, pad, 0, 4, 9, pad, 2, 6, 10, pad,
                                            3, 7, 11, pad]
    assert al.block_expert.tolist()[:5] == [0, 1, 2, 4, 5]
    assert buf[0, 0].tolist() == [2, 1, 3, 0] and int(buf[1].sum()) == 0
    for T, k, E, block_m, parts in ((3, 2, 4, 4, 2), (32, 6, 64, 16, 2), (5, 1, 3, 16, 1)):
        ids = _random_ids(T, k, E, seed=T + k)
        written = torch.cat([ids, (E + torch.arange(parts, device=DEV)).expand(T, parts)], dim=1)
        got, want = align_rows(ids, E, block_m, shared_parts=parts), align_rows_to_blocks(written, E + parts, block_m)
        used = int(want.num_padded)
        assert got.num_rows == want.num_rows and int(got.num_padded) == used
        assert torch.equal(got.sorted_rows[:used].cpu(), want.sorted_rows[:used].cpu())
        assert torch.equal(got.block_expert[:used // block_m].cpu(), want.block_expert[:used // block_m].cpu())
        assert got.max_blocks >= used // block_m


def test_align_kernel_refuses():
    from harness.kernels.moe_align_triton import ALIGN_KERNEL_MAX_ROWS, align_rows

    with pytest.raises(HarnessError, match="routed rows"):
        align_rows(torch.zeros(ALIGN_KERNEL_MAX_ROWS + 1, 1, dtype=torch.int64, device=DEV), 4, 16)
    ids = torch.zeros(2, 1, dtype=torch.int64, device=DEV)
    with pytest.raises(HarnessError, match="counts need"):
        align_rows(ids, 4, 16, counts=(torch.zeros(3, 2, 5, dtype=torch.int64, device=DEV),
                                       torch.zeros(1, dtype=torch.int64, device=DEV), 0))
    with pytest.raises(HarnessError, match=r"counts need .* got torch.int64 \(0, 2, 4\)"):   # no row at all
        align_rows(ids, 4, 16, counts=(torch.zeros(0, 2, 4, dtype=torch.int64, device=DEV),
                                       torch.zeros(1, dtype=torch.int64, device=DEV), 0))


@pytest.mark.gpu
def test_gpu_align_under_torch_compile_and_graph_equals_torch():
    """Dynamo traces the kernel without a graph break (fullgraph); a CUDA graph replays it with the
    step index moved on the device; layouts equal the torch path's, counts land at each replay's row."""
    from harness.kernels.moe_align_triton import align_rows

    ids = _random_ids(32, 6, 64, seed=3).cuda()
    want = align_rows_to_blocks(ids, 64, 16)
    buf = torch.zeros(3, 2, 64, dtype=torch.int64, device="cuda")
    step = torch.zeros(1, dtype=torch.int64, device="cuda")
    fn = torch.compile(lambda i: align_rows(i, 64, 16, counts=(buf, step, 1)), fullgraph=True, dynamic=False)
    _same(fn(ids), want)
    _same(align_rows(ids, 64, 16, counts=(buf, step, 1)), want)        # eager: compiled before the capture
    assert torch.equal(buf[0, 1], 2 * torch.bincount(ids.view(-1), minlength=64))
    buf.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = align_rows(ids, 64, 16, counts=(buf, step, 1))
    step.fill_(1)
    graph.replay()
    step.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    _same(out, want)
    per_expert = torch.bincount(ids.view(-1), minlength=64)
    assert torch.equal(buf[1:, 1], torch.stack([per_expert, per_expert]))     # one replay at row 1, one at 2
    assert int(buf[0].sum()) == 0 and int(buf[:, 0].sum()) == 0


@pytest.mark.parametrize("forced,parts,counted", [(None, 0, False), (None, 2, True), ("on", 0, True),
                                                  ("off", 1, False), ("always", 0, False)])
def test_route_and_align_equals_the_router_then_the_alignment(forced, parts, counted, monkeypatch):
    """One launch (``route_and_align``) against the router's top-k launch then the alignment's, at a batch-32
    step of the model's shape (64 experts, top-6): the same experts in the same order, the same weights
    (rel <= 1e-6), the same alignment bit for bit and the same counts; forced experts from the table at
    the device position and the router's layer (``on``/``off``: a runtime switch; ``always``: no switch),
    the counts at their own layer."""
    from harness.kernels import gemv_triton, router_triton
    from harness.kernels.moe_align_triton import align_rows, route_and_align

    T, E, k, block_m = 32, 64, 6, 16
    g = torch.Generator().manual_seed(5 + parts)
    logits = (torch.randn(T, E, generator=g) * 2).to(DEV)
    table = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T * 3 * 2)]).view(T, 3, 2, k).to(DEV)
    pos = torch.tensor([1], device=DEV)
    fin = None
    if forced is not None:
        fin = (table, pos, None if forced == "always" else torch.tensor([forced == "on"], device=DEV))

    def counts():
        return (torch.zeros(4, 2, E, dtype=torch.int64, device=DEV), torch.tensor([2], device=DEV), 0)   # not the
        # router's layer (1): each reads its own

    # the reference: the router's top-k kernel on these logits (route() with its GEMV handing them over)
    monkeypatch.setattr(gemv_triton, "gemv", lambda x, w, dtype: logits)
    want_idx, want_w = router_triton.route(logits, torch.zeros(E, E, device=DEV), k, True, 2.5, 1, forced=fin)
    monkeypatch.undo()
    want_counts = counts() if counted else None
    want_al = align_rows(want_idx, E, block_m, want_counts, parts)
    got_counts = counts() if counted else None
    idx, w, al = route_and_align(logits, k, True, 2.5, 1, block_m, fin, got_counts, parts)
    assert torch.equal(idx.cpu(), want_idx.cpu())
    assert ((w - want_w).norm() / want_w.norm()) <= 1e-6
    _same(al, want_al)
    if counted:
        assert torch.equal(got_counts[0].cpu(), want_counts[0].cpu()) and int(got_counts[0].sum()) == T * k
    if forced in ("on", "always"):
        assert torch.equal(idx.sort(-1)[0].cpu(), table[:, 1, 1].sort(-1)[0].cpu())


def test_route_and_align_refuses():
    from harness.kernels.moe_align_triton import route_and_align

    with pytest.raises(HarnessError, match="contiguous fp32 logits"):
        route_and_align(torch.zeros(4, 8, dtype=torch.float64, device=DEV), 2, True, 1.0, 0, 16)
    with pytest.raises(HarnessError, match="top_k=9 needs"):
        route_and_align(torch.zeros(4, 8, device=DEV), 9, True, 1.0, 0, 16)
    with pytest.raises(HarnessError, match="routed rows"):
        route_and_align(torch.zeros(600, 8, device=DEV), 2, True, 1.0, 0, 16)
