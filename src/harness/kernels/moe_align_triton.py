"""Routed rows sorted and padded per expert in one Triton program (``moe_blocks.align_rows_to_blocks``'s
function), and the routing count beside it.

At decode sizes (T*k rows up to ``ALIGN_KERNEL_MAX_ROWS``) one program holds every row and every
expert and writes what the torch path writes: ``sorted_rows`` (the rows sorted by (expert, flat
row), each expert's padded to ``block_m``; padding = ``num_rows``), ``block_expert`` and
``num_padded``; with ``counts`` (``DeviceRouting.device_counts``: buffer int64 [steps + 1, layers, E]
and the device step index) the per-expert counts added at row min(step, steps), layer ``layer``. With
``shared_parts`` P each token also gets P rows of the pseudo-experts E .. E + P - 1 (the layer's shared
expert cut into parts of the expert width, ``fast_moe_triton.routed_experts_triton``): flat row t*(k + P) + j,
placed in the kernel after the routed experts' blocks (no extra launch, no wider sort), never counted.
``route_and_align`` first makes the router's choice from its fp32 logits in the same program (ids and
weights as ``router_triton.route``'s), then aligns those ids.
Every output of the alignment is an integer: equal to the torch path's, bit for bit (tests). No host sync and outputs
from ``torch.empty``: callable inside torch.compile and CUDA-graph capture. Importing this module
imports triton; ``TRITON_INTERPRET=1`` before the first import of ``common`` runs it on the CPU.

Design notes (the steps of the one program, what the torch path and a first version cost):
``docs/kernels/moe_align_triton.md``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import HarnessError
from .common import check_counts, check_runnable, counts_row
from .router_triton import check_forced, choose_store
from .moe_blocks import ALIGN_KERNEL_MAX_ROWS, BlockAlignment


@triton.jit
def _align_body(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, shift_ptr, counts_ptr, step_ptr,
                num_ids, n_exp, max_blocks, steps, n_layers, layer, top_k, slots, tokens, num_rows,
                BLOCK_M: tl.constexpr, ROWS: tl.constexpr, EXPERTS: tl.constexpr, BLOCKS: tl.constexpr,
                PARTS: tl.constexpr, TOKENS: tl.constexpr, HAS_COUNTS: tl.constexpr):
    """Steps 1-4 of ``docs/kernels/moe_align_triton.md`` in the calling program, from the flat expert ids
    at ``ids_ptr`` [num_ids] (any integer dtype)."""
    offs_n = tl.arange(0, ROWS)                                          # routed id t*k + j: out row t*slots + j
    n_ok = offs_n < num_ids
    offs_e = tl.arange(0, EXPERTS)
    e_ok = offs_e < n_exp
    ids = tl.load(ids_ptr + offs_n, mask=n_ok, other=0).to(tl.int32)
    counts = tl.histogram(ids, EXPERTS)                                  # 1. padding rows counted as expert 0
    counts = tl.where(offs_e == 0, counts - (ROWS - num_ids), counts)
    padded = (counts + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M               # 2.
    padded_end = tl.cumsum(padded, axis=0)
    start = tl.cumsum(counts, axis=0) - counts
    tl.store(shift_ptr + offs_e, padded_end - padded - start)           # sorted index -> padded position
    total = tl.sum(padded, axis=0)
    for c in range(0, BLOCKS * BLOCK_M, ROWS):                           # padding everywhere first
        p = c + offs_n
        tl.store(sorted_ptr + p, tl.zeros((ROWS,), tl.int32) + num_rows, mask=p < max_blocks * BLOCK_M)
    tl.debug_barrier()                                                   # shift stored, padding before rows
    keys = tl.sort(tl.where(n_ok, ids, EXPERTS) * ROWS + offs_n)         # stable: rows in flat order per expert
    e_s = keys // ROWS
    ok_s = e_s < EXPERTS
    dest = offs_n + tl.load(shift_ptr + e_s, mask=ok_s, other=0)
    r = keys % ROWS
    tl.store(sorted_ptr + dest, (r // top_k) * slots + r % top_k, mask=ok_s)
    per_part = (tokens + BLOCK_M - 1) // BLOCK_M * BLOCK_M               # the shared parts after the routed rows:
    if PARTS > 0:                                                        # part p's row of token t at total + p
        offs_t = tl.arange(0, TOKENS)                                    # * per_part + t, in token order
        for q in tl.static_range(PARTS):
            tl.store(sorted_ptr + total + q * per_part + offs_t, offs_t * slots + top_k + q, mask=offs_t < tokens)
    first = tl.arange(0, BLOCKS) * BLOCK_M                               # 3.
    below = (padded_end[None, :] <= first[:, None]) & e_ok[None, :]
    expert = tl.minimum(tl.sum(below.to(tl.int32), axis=1), n_exp - 1)
    if PARTS > 0:                                                        # part blocks: the pseudo-experts E + p
        expert = tl.where(first >= total, tl.minimum(n_exp + (first - total) // per_part, n_exp + PARTS - 1), expert)
    tl.store(block_expert_ptr + tl.arange(0, BLOCKS), expert, mask=tl.arange(0, BLOCKS) < max_blocks)
    tl.store(num_padded_ptr, total + PARTS * per_part)
    if HAS_COUNTS:                                                       # 4. the routed experts
        at = counts_row(counts_ptr, step_ptr, steps, n_layers, layer, n_exp) + offs_e
        tl.store(at, tl.load(at, mask=e_ok, other=0) + counts.to(tl.int64), mask=e_ok)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, shift_ptr, counts_ptr, step_ptr,
                  num_ids, n_exp, max_blocks, steps, n_layers, layer, top_k, slots, tokens, num_rows,
                  BLOCK_M: tl.constexpr, ROWS: tl.constexpr, EXPERTS: tl.constexpr, BLOCKS: tl.constexpr,
                  PARTS: tl.constexpr, TOKENS: tl.constexpr, HAS_COUNTS: tl.constexpr):
    _align_body(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, shift_ptr, counts_ptr, step_ptr,
                num_ids, n_exp, max_blocks, steps, n_layers, layer, top_k, slots, tokens, num_rows,
                BLOCK_M, ROWS, EXPERTS, BLOCKS, PARTS, TOKENS, HAS_COUNTS)


@triton.jit
def _route_align_kernel(logits_ptr, stride_lt, idx_ptr, wt_ptr, table_ptr, pos_ptr, on_ptr, n_pos, f_layers, f_layer,
                        sorted_ptr, block_expert_ptr, num_padded_ptr, shift_ptr, counts_ptr, step_ptr,
                        num_ids, n_exp, max_blocks, steps, n_layers, layer, top_k, slots, tokens, num_rows,
                        NORM: tl.constexpr, SCALE: tl.constexpr, BLOCK_TOPK: tl.constexpr, HAS_FORCED: tl.constexpr,
                        FORCED_SWITCH: tl.constexpr, TOP_K: tl.constexpr,
                        BLOCK_M: tl.constexpr, ROWS: tl.constexpr, EXPERTS: tl.constexpr, BLOCKS: tl.constexpr,
                        PARTS: tl.constexpr, TOKENS: tl.constexpr, HAS_COUNTS: tl.constexpr):
    """The router's choice of every token (``router_triton.choose_store`` on a [TOKENS, EXPERTS] tile;
    the forced table's layer ``f_layer`` of ``f_layers``), stored, then the alignment of those ids (its
    count at ``layer``), in one program."""
    offs_t = tl.arange(0, TOKENS)
    choose_store(logits_ptr, stride_lt, offs_t.to(tl.int64), offs_t < tokens, idx_ptr, wt_ptr, idx_ptr, step_ptr,
                  0, f_layers, f_layer, table_ptr, pos_ptr, on_ptr, n_pos, TOP_K, 1, TOP_K, 1, n_exp,
                  TOP_K, NORM, SCALE, EXPERTS, BLOCK_TOPK, False, HAS_FORCED, FORCED_SWITCH)
    tl.debug_barrier()                                                   # every token's ids stored
    _align_body(idx_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, shift_ptr, counts_ptr, step_ptr,
                num_ids, n_exp, max_blocks, steps, n_layers, layer, top_k, slots, tokens, num_rows,
                BLOCK_M, ROWS, EXPERTS, BLOCKS, PARTS, TOKENS, HAS_COUNTS)


def _buffers(T: int, k: int, num_experts: int, block_m: int, shared_parts: int, dev, counts: tuple | None):
    """The alignment's outputs (``torch.empty``) and the align body's launch arguments for T tokens of k
    routed rows (+ ``shared_parts``) each: (BlockAlignment, shift, (runtime args after the ids), constexprs)."""
    slots = k + shared_parts
    num_rows = T * slots
    if not 1 <= num_rows <= ALIGN_KERNEL_MAX_ROWS or block_m < 1 or shared_parts < 0:
        raise HarnessError(f"align_rows: 1 to {ALIGN_KERNEL_MAX_ROWS} routed rows, block_m >= 1 and shared_parts >= 0, "
                           f"got {num_rows} rows, block_m {block_m}, shared_parts {shared_parts}")
    per_part = triton.cdiv(T, block_m) * block_m              # each shared part's rows, padded
    max_blocks = (T * k) // block_m + min(num_experts, T * k) + shared_parts * per_part // block_m
    al = BlockAlignment(sorted_rows=torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev),
                        block_expert=torch.empty(max_blocks, dtype=torch.int32, device=dev),
                        num_padded=torch.empty(1, dtype=torch.int32, device=dev),
                        num_rows=num_rows, block_m=block_m, max_blocks=max_blocks)
    experts_pow2 = triton.next_power_of_2(num_experts)
    shift = torch.empty(experts_pow2, dtype=torch.int32, device=dev)
    if counts is not None:
        buf, step, layer = counts
        check_counts("align_rows", buf, step, layer, num_experts, dev)
    else:
        buf, step, layer = al.num_padded, al.num_padded, 0
    args = (al.sorted_rows, al.block_expert, al.num_padded, shift, buf, step,
            T * k, num_experts, max_blocks, buf.shape[0] - 1 if counts is not None else 0,
            buf.shape[1] if counts is not None else 1, layer, k, slots, T, num_rows)
    consts = dict(BLOCK_M=block_m, ROWS=triton.next_power_of_2(T * k), EXPERTS=experts_pow2,
                  BLOCKS=triton.next_power_of_2(max_blocks), PARTS=shared_parts, TOKENS=triton.next_power_of_2(T),
                  HAS_COUNTS=counts is not None)
    return al, args, consts


def align_rows(topk_ids: torch.Tensor, num_experts: int, block_m: int, counts: tuple | None = None,
               shared_parts: int = 0) -> BlockAlignment:
    """``moe_blocks.align_rows_to_blocks`` of ``topk_ids`` [T, k] (T*(k + ``shared_parts``) <=
    ``ALIGN_KERNEL_MAX_ROWS``) in one launch; ``counts`` = (buffer int64 [steps + 1, layers, E] contiguous,
    step index int64 [1], layer): the rows per routed expert added at (min(step, steps), layer) of the
    buffer, on the device. ``shared_parts`` P: token t's rows t*(k + P) + k + p belong to the pseudo-expert
    E + p, whose blocks follow the routed experts' (``num_experts`` stays E: the routed experts, the only
    ones sorted and counted; a part's T rows are in token order, padded to ``block_m``)."""
    check_runnable(topk_ids)
    if topk_ids.dim() != 2:
        raise HarnessError(f"align_rows: topk_ids [T, k] expected, got {tuple(topk_ids.shape)}")
    T, k = topk_ids.shape
    al, args, consts = _buffers(T, k, num_experts, block_m, shared_parts, topk_ids.device, counts)
    _align_kernel[(1,)](topk_ids.reshape(-1).contiguous(), *args, **consts, num_warps=4)
    return al


def route_and_align(logits: torch.Tensor, top_k: int, norm: bool, scale: float, layer: int, block_m: int,
                    forced: tuple | None = None, counts: tuple | None = None, shared_parts: int = 0):
    """The router's choice from fp32 ``logits`` [T, E] (contiguous; ``router_triton.route``'s after its
    GEMV: softmax, top-k, ``forced`` (table, position, on) as there, renormalisation, ``scale``) and
    ``align_rows`` of the chosen ids (``counts``, ``shared_parts`` as there), in one launch instead of the
    router's top-k launch and the alignment's. -> (idx int64 [T, k], weights fp32 [T, k], BlockAlignment)."""
    check_runnable(logits)
    if logits.dim() != 2 or logits.dtype != torch.float32 or not logits.is_contiguous():
        raise HarnessError(f"route_and_align: contiguous fp32 logits [T, E] expected, got {logits.dtype} "
                           f"{tuple(logits.shape)}")
    T, E = logits.shape
    if not 1 <= top_k <= E:
        raise HarnessError(f"route_and_align: top_k={top_k} needs 1 <= top_k <= E={E}")
    if forced is not None:
        check_forced(forced, logits, top_k, layer)
    al, args, consts = _buffers(T, top_k, E, block_m, shared_parts, logits.device, counts)
    idx = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    table, pos, on = forced if forced is not None else (idx, idx, None)
    _route_align_kernel[(1,)](
        logits, logits.stride(0), idx, weights, table, pos, on if on is not None else table,
        table.shape[1] if forced is not None else 1, table.shape[2] if forced is not None else 1, layer, *args,
        NORM=bool(norm and top_k > 1), SCALE=float(scale), BLOCK_TOPK=triton.next_power_of_2(top_k),
        HAS_FORCED=forced is not None, FORCED_SWITCH=on is not None, TOP_K=top_k, **consts, num_warps=4)
    return idx, weights, al
