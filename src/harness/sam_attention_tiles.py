"""The tile rules of ``kernels.sam_attention_triton``: which kernel a sequence takes and how many query
and key slots it visits (masked slots included), for the kernel's launcher and for the analytic cost
model (``harness.analytic``: the executed FLOPs of ``sam_attention=triton``). Torch- and triton-free:
the readers of a run load it.

A sequence is an H x W grid of S = H * W tokens. ``block``: S <= BLOCK_MAX_S, every key in one block
of the next power of two >= S keys. ``rows``: H rows of cdiv(W, bn) key blocks of bn keys. Queries in
blocks of 64.
"""
from __future__ import annotations

BN_CHOICES = (128, 64, 32, 16)
KERNELS = ("rows", "block")
#: the longest sequence the one-block kernel takes (its [BM, BN] fp32 scores stay in registers)
BLOCK_MAX_S = 256


def pow2(n: int, least: int = 16) -> int:
    """The next power of two >= n, at least ``least``."""
    return max(least, 1 << (n - 1).bit_length())


def default_kernel(S: int) -> str:
    """``block`` for sequences of at most BLOCK_MAX_S tokens (windows), else ``rows``."""
    return "block" if S <= BLOCK_MAX_S else "rows"


def default_bm(S: int, kernel: str) -> int:
    """Query block: 64 (an H200, base mode, one image: rows bm 64 / 4 warps 0.193 ms against bm 128 / 8
    warps 0.244 for a global block; ``bench sam_attention``)."""
    return 64


def default_bn(W: int) -> int:
    """``rows``: the largest key block in BN_CHOICES wasting <= 25% masked slots per row, else the least waste."""
    waste = {bn: -(-W // bn) * bn / W - 1 for bn in BN_CHOICES}
    ok = [bn for bn in BN_CHOICES if waste[bn] <= 0.25]
    return ok[0] if ok else min(BN_CHOICES, key=lambda bn: (waste[bn], -bn))


def key_slots(H: int, W: int, bn: int | None = None, kernel: str = "rows") -> int:
    """Keys visited per query: rows: H * cdiv(W, bn) * bn (bn None: default_bn(W)); block: pow2(H * W)."""
    if kernel == "block":
        return pow2(H * W)
    bn = bn or default_bn(W)
    return H * -(-W // bn) * bn


def slots(H: int, W: int) -> tuple[int, int]:
    """(query slots, key slots per query) of one sequence with the default kernel and tiles."""
    S = H * W
    kernel = default_kernel(S)
    bm = default_bm(S, kernel)
    return -(-S // bm) * bm, key_slots(H, W, kernel=kernel)
