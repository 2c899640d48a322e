"""The tile rules of ``kernels.sam_attention_triton``: its key blocks and how many query and key slots
it visits (masked slots included), for the kernel's launcher and for the analytic cost model
(``harness.analytic``: the executed FLOPs of ``sam_attention=triton``). Torch- and triton-free: the
readers of a run load it.

A sequence is an H x W grid of S = H * W tokens, walked in key blocks of ``rows`` grid rows x
bn / rows columns (rows = 1: H rows of cdiv(W, bn) blocks of bn keys), queries in blocks of BM.
"""
from __future__ import annotations

BN_CHOICES = (128, 64, 32, 16)
#: query block (an H200, base mode: bm 64 / 4 warps 1.381 ms against bm 128 / 8 warps 1.859 for the global
#: blocks of 8 pages; 1.547 ms for the windows of 32 pages; ``bench sam_attention``, runs/examples/h200-sam-triton)
BM = 64


def pow2(n: int, least: int = 16) -> int:
    """The next power of two >= n, at least ``least``."""
    return max(least, 1 << (n - 1).bit_length())


def default_bn(W: int) -> int:
    """The largest key block in BN_CHOICES wasting <= 25% masked slots per row, else the least waste."""
    waste = {bn: -(-W // bn) * bn / W - 1 for bn in BN_CHOICES}
    ok = [bn for bn in BN_CHOICES if waste[bn] <= 0.25]
    return ok[0] if ok else min(BN_CHOICES, key=lambda bn: (waste[bn], -bn))


def default_block(W: int) -> tuple[int, int]:
    """(bn, rows) of a key block: two rows of pow2(W) slots where pow2(W) is 16 (14-wide windows: bn 32,
    7 steps per window instead of 14); else one row, default_bn(W). An H200, the windows of 32 pages
    (``bench sam_attention``, runs/examples/h200-sam-triton): 2 rows 1.532 ms, 1 row 1.548, 4 rows 1.628;
    the global blocks of 8 pages: 1 row of 64 1.371 ms, 2 rows of 64 1.582."""
    if pow2(W) <= 16:
        return 32, 2
    return default_bn(W), 1


def key_slots(H: int, W: int, bn: int | None = None, rows: int = 1) -> int:
    """Keys visited per query: cdiv(H, rows) blocks x rows x cdiv(W, wc) x wc slots, wc = bn // rows
    (bn None: default_block(W))."""
    if bn is None:
        bn, rows = default_block(W)
    wc = bn // rows
    return -(-H // rows) * rows * -(-W // wc) * wc


def query_slots(S: int, bm: int = BM) -> int:
    """Queries the kernel visits for a sequence of S tokens (masked ones included): cdiv(S, bm) * bm."""
    return -(-S // bm) * bm


def slots(H: int, W: int) -> tuple[int, int]:
    """(query slots, key slots per query) of one sequence with the default tiles."""
    return query_slots(H * W), key_slots(H, W)
