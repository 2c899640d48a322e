"""Routed rows sorted and padded per expert on the device, and the Triton MoE tile sizes.

Shared by ``fast_moe`` (the grouped_mm path counts rows per expert) and ``fast_moe_triton`` (the
kernels consume the block alignment); both import it, it imports neither. Nothing here reads
device memory on the host (no sync).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

#: routed rows (T*k) up to which impl=triton runs the per-row decode kernels
#: (``fast_moe_triton.routed_experts_rows``) instead of the sorted, blocked ones
ROWS_KERNEL_MAX = 16
#: routed rows up to which the blocked kernels' row alignment is one Triton program
#: (``moe_align_triton.align_rows``: its [rows, experts] one-hot matrix stays in registers), which
#: can also count the routing; more rows take ``align_rows_to_blocks`` (torch)
ALIGN_KERNEL_MAX_ROWS = 1024
#: mean routed rows per expert above which the blocked kernels take 128 x 128 tiles
#: (``default_triton_config``; a 128-row tile then pads less than a quarter of an expert's rows)
LARGE_TILE_ROWS = 512


def counts_in_alignment(routed_rows: int) -> bool:
    """Whether the Triton MoE (default tiles) on ``routed_rows`` = T*k rows runs the blocked kernels with
    the one-program alignment, which can count the routing."""
    return ROWS_KERNEL_MAX < routed_rows <= ALIGN_KERNEL_MAX_ROWS


def expert_counts(flat_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows per expert [E] int64, on the device (scatter_add into zeros; bincount would sync)."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_ids.device)
    return counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))


@dataclass(frozen=True)
class BlockAlignment:
    """Rows sorted by expert and padded per expert to a multiple of ``block_m`` (all on the device).

    - ``sorted_rows`` [max_blocks * block_m] int32: flat row t*k + j at each padded position (with the
      shared expert's P parts of ``moe_align_triton.align_rows``: t*(k + P) + j, the parts' blocks last);
      padding holds ``num_rows`` (= T*k, or T*(k + P)), which no real row has.
    - ``block_expert`` [max_blocks] int32: the expert of each block (blocks past the end repeat the
      last expert; kernels skip them).
    - ``num_padded`` [1] int32: padded rows in use (sum over experts of ceil(count / block_m) * block_m).
    - ``max_blocks``: host upper bound T*k // block_m + min(E, T*k) on the blocks in use (plus P * cdiv(T,
      block_m) with the shared parts), from shapes only.
    """

    sorted_rows: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    num_rows: int
    block_m: int
    max_blocks: int


def align_rows_to_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> BlockAlignment:
    """Sort the T*k (token, slot) rows by expert and pad each expert's rows to ``block_m``, on the device."""
    flat_ids = topk_ids.reshape(-1)
    num_rows = flat_ids.numel()
    dev = flat_ids.device
    max_blocks = num_rows // block_m + min(num_experts, num_rows)
    counts = expert_counts(flat_ids, num_experts)
    padded = (counts + (block_m - 1)) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    start = counts.cumsum(0) - counts
    order = torch.argsort(flat_ids, stable=True)
    sorted_e = flat_ids.index_select(0, order)
    rank = torch.arange(num_rows, device=dev) - start.index_select(0, sorted_e)
    dest = padded_start.index_select(0, sorted_e) + rank
    sorted_rows = torch.full((max_blocks * block_m,), num_rows, dtype=torch.int32, device=dev)
    sorted_rows.index_copy_(0, dest, order.to(torch.int32))
    block_first_row = torch.arange(max_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(padded_end, block_first_row, right=True).clamp_(max=num_experts - 1)
    return BlockAlignment(sorted_rows=sorted_rows, block_expert=block_expert.to(torch.int32),
                          num_padded=padded_end[-1:].to(torch.int32), num_rows=num_rows,
                          block_m=block_m, max_blocks=max_blocks)


@dataclass(frozen=True)
class TritonMoEConfig:
    """Tile sizes of the Triton kernels (rows x output columns x reduction) and launch options, both
    launches' (gate/up and down). Tiles of the down launch's own did not pay at batch 32 on an H200
    (``docs/kernels/fast_moe_triton.md``)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


def default_triton_config(num_rows: int, num_experts: int) -> TritonMoEConfig:
    """H100-minded defaults from the mean rows per expert (num_rows = T*k).

    Decode-size batches (<= 16 rows per expert) take BLOCK_M=16 so a block wastes little on padding
    and every touched expert's weights are read once; larger batches take 32 or 64 rows per block, and
    prefills of many pages (more than ``LARGE_TILE_ROWS`` rows per expert) 128 x 128 tiles with 8 warps:
    on an H200 at a prefill of 128 base pages (36,608 tokens, 3,432 rows per expert) 4.18 ms per layer
    against 5.41 ms with the 64-row tiles, the fastest of 41 tiles (``bench moe sweep=blocks``,
    ``runs/examples/h200-prefill/``).
    """
    mean_rows = num_rows / max(num_experts, 1)
    if mean_rows <= 16:
        return TritonMoEConfig(block_m=16, block_n=64, block_k=128)
    if mean_rows <= 32:
        return TritonMoEConfig(block_m=32, block_n=64, block_k=128)
    if mean_rows <= LARGE_TILE_ROWS:
        return TritonMoEConfig(block_m=64, block_n=64, block_k=64)
    return TritonMoEConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
