"""Flash attention with SAM's decomposed rel-pos bias added inside the kernel (Triton).

Computes exactly what ``sam_attention.dense_bias_attention`` computes, without an S x S mask
and without widening the head dim: scores = q_i . k_j * scale + rel_h[i, h(j)] + rel_w[i, w(j)]
with rel_h [B, nh, S, H], rel_w [B, nh, S, W] from the dense path's einsums
(``sam_attention.rel_terms``). Key blocks follow the grid: a block holds R rows of BN / R columns
(R = 1: H rows of cdiv(W, BN) blocks; a 14 x 14 window: 2 rows of 16 slots, 14 real), so rel_h is
one column per row and rel_w one tile per column chunk (hoisted when a chunk spans the row). Online
softmax in fp32 (exp2 domain), fp32 accumulators; the output has q's dtype. Forward only.

Layouts: q, k, v are [B, nh, S, D] views with any strides whose last is 1 (SAM's q, k, v are
strided views of the qkv linear's [B, S, 3, nh, D] output, read in place); rel_h, rel_w alike.
The output is [B, S, nh, D] contiguous, the layout SAM's proj reads as [B, H, W, C]. D a power of
two >= 16. Under torch.compile the kernel runs as the opaque custom op
``torch.ops.harness.sam_rel_bias_attention`` (inductor compiles what is around it; no graph break).
Tested under TRITON_INTERPRET=1 on the CPU. Tile rules: ``harness.sam_attention_tiles``. Cost:
``sam_attention.inkernel_bias_cost(bh, H, W, D, key_slots(H, W, bn, rows), query_slots(S, bm))``
(``harness.sam_attention_tiles``).

Design notes (how key blocks follow the grid, what masked slots cost, the sweep, the one-block
kernel for windows that was measured slower and removed): ``docs/kernels/sam_attention_triton.md``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import HarnessError
from ..sam_attention_tiles import BN_CHOICES, BM, default_block, default_bn, key_slots, pow2  # noqa: F401 (re-exported)
from .common import LOG2E


# the softmax runs in the exp2 domain: scores, rel_h and rel_w times log2(e) (common.LOG2E)
@triton.jit
def _rel_bias_fwd(Q, K, V, RH, RW, O, sm_scale, S, H, W, NH,
                  s_qb, s_qh, s_qs, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs,
                  s_hb, s_hh, s_hs, s_wb, s_wh, s_ws, s_ob, s_oh, s_os,
                  D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, R: tl.constexpr, NWB: tl.constexpr,
                  HOIST_RW: tl.constexpr, PRECISION: tl.constexpr):
    # one program: BM queries of one (image or window, head); a 1-D grid, the query blocks of a head
    # adjacent (a 2-D grid's second axis stops at 65,535 programs: 5,461 windows of 12 heads)
    nm = tl.cdiv(S, BM)
    pid = tl.program_id(0)
    bh = pid // nm
    b = (bh // NH).to(tl.int64)
    hd = (bh % NH).to(tl.int64)
    offs_m = (pid % nm) * BM + tl.arange(0, BM)
    mask_m = offs_m < S
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b * s_qb + hd * s_qh + offs_m[:, None] * s_qs + offs_d[None, :], mask=mask_m[:, None], other=0.0)
    # a key block: R grid rows x BN // R columns (slot n: row n // WC, column n % WC of chunk wb)
    offs_n = tl.arange(0, BN)
    WC = BN // R
    r_n = offs_n // WC
    c_n = offs_n % WC
    k_base = K + b * s_kb + hd * s_kh
    v_base = V + b * s_vb + hd * s_vh
    qk_scale = sm_scale * LOG2E
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    rh_ptr = RH + b * s_hb + hd * s_hh + offs_m * s_hs
    rw_ptr = RW + b * s_wb + hd * s_wh + offs_m[:, None] * s_ws
    if HOIST_RW:  # W <= WC: one rel_w tile serves every key block
        rw0 = tl.load(rw_ptr + c_n[None, :], mask=mask_m[:, None] & (c_n[None, :] < W), other=0.0)
        rw0 = tl.where(c_n[None, :] < W, rw0.to(tl.float32) * LOG2E, float("-inf"))
    for hb in range(0, tl.cdiv(H, R)):
        h0 = hb * R
        if R == 1:
            rh = (tl.load(rh_ptr + h0, mask=mask_m, other=0.0).to(tl.float32) * LOG2E)[:, None]
        else:   # one rel_h column per row of the block, spread over its slots
            rh = tl.zeros([BM, BN], tl.float32)
            for r in tl.static_range(R):
                col = tl.load(rh_ptr + tl.minimum(h0 + r, H - 1), mask=mask_m, other=0.0).to(tl.float32)  # rows past H: masked below
                rh = tl.where(r_n[None, :] == r, col[:, None] * LOG2E, rh)
        h_n = h0 + r_n
        for wb in tl.static_range(NWB):
            w = wb * WC + c_n
            mask_n = (w < W) & (h_n < H)
            if HOIST_RW:
                rw = rw0
            else:
                rw = tl.load(rw_ptr + w[None, :], mask=mask_m[:, None] & mask_n[None, :], other=0.0)
                rw = tl.where(mask_n[None, :], rw.to(tl.float32) * LOG2E, float("-inf"))
            j = h_n * W + w
            k = tl.load(k_base + j[:, None] * s_ks + offs_d[None, :], mask=mask_n[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale + rh + rw
            if R > 1:   # rows past the grid's last (the last block of a grid whose H is no multiple of R)
                s = tl.where(mask_n[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + j[:, None] * s_vs + offs_d[None, :], mask=mask_n[:, None], other=0.0)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
            m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(O + b * s_ob + hd * s_oh + offs_m[:, None] * s_os + offs_d[None, :], acc.to(O.dtype.element_ty),
             mask=mask_m[:, None])


def attend(q, k, v, rel_h, rel_w, H: int, W: int, bm: int | None = None, bn: int | None = None,
           rows: int | None = None, hoist_rw: bool | None = None, num_warps: int | None = None,
           num_stages: int | None = None) -> torch.Tensor:
    """SAM attention with the bias added in-kernel: [B, S, nh, D] (module docstring for the layouts).

    A key block holds ``rows`` grid rows of bn // rows columns. Defaults (``harness.sam_attention_tiles``):
    bm = BM (64); neither bn nor rows: (bn, rows) = default_block(W); rows = 1 alone: bn = default_bn(W);
    rows > 1 alone: bn = rows * pow2(W); bn alone: rows = 1; hoist_rw when one block spans a row's
    columns; num_warps 8 for bm 128 else 4; num_stages 3. fp32 inputs use IEEE fp32 dots (no TF32).
    """
    B, nh, S, D = q.shape
    if S != H * W:
        raise HarnessError(f"sequence length {S} is not H*W = {H}*{W}")
    if D < 16 or D & (D - 1) or k.shape != q.shape or v.shape != q.shape:
        raise HarnessError(f"the Triton SAM kernel needs q, k, v of one shape with a power-of-two head dim >= 16; "
                           f"got q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}")
    if rel_h.shape != (B, nh, S, H) or rel_w.shape != (B, nh, S, W):
        raise HarnessError(f"rel_h{tuple(rel_h.shape)} / rel_w{tuple(rel_w.shape)} are not [B, nh, S, H] / [B, nh, S, W] "
                           f"for q{tuple(q.shape)} on a {H} x {W} grid")
    if any(t.device != q.device or t.dtype != q.dtype for t in (k, v, rel_h, rel_w)):
        raise HarnessError("q, k, v, rel_h and rel_w must share one device and dtype; got "
                           + ", ".join(f"{t.dtype} on {t.device}" for t in (q, k, v, rel_h, rel_w)))
    bm = bm or BM
    if bn is None:
        bn, rows = (default_block(W) if rows is None else (default_bn(W), 1) if rows == 1
                    else (rows * pow2(W), rows))
    rows = rows or 1
    for name, size in (("bm", bm), ("bn", bn)):
        if size < 16 or size & (size - 1):
            raise HarnessError(f"{name}={size}: query and key blocks are powers of two of at least 16",
                               f"use e.g. {name}=64")
    wc = bn // rows
    if bn % rows or wc < 16 or (rows > 1 and wc < W):
        raise HarnessError(f"a key block of {bn} keys in {rows} rows needs {rows} rows of at least 16 and, for "
                           f"several rows, at least W={W} columns", "use rows=1, or bn = rows x pow2(W)")
    nwb = -(-W // wc)
    hoist_rw = (nwb == 1) if hoist_rw is None else hoist_rw
    if hoist_rw and nwb != 1:
        raise HarnessError(f"hoist_rw needs W <= bn (W={W}, bn={bn})")
    q, k, v, rel_h, rel_w = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, rel_h, rel_w))
    out = torch.empty(B, S, nh, D, dtype=q.dtype, device=q.device)
    strides = [s for t in (q, k, v, rel_h, rel_w, out.permute(0, 2, 1, 3)) for s in t.stride()[:3]]
    _rel_bias_fwd[launch_grid(S, bm, B * nh)](
        q, k, v, rel_h, rel_w, out, D ** -0.5, S, H, W, nh, *strides,
        D=D, BM=bm, BN=bn, R=rows, NWB=nwb, HOIST_RW=hoist_rw,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps or (8 if bm == 128 else 4), num_stages=num_stages or 3)
    return out


def launch_grid(S: int, bm: int, bh: int) -> tuple:
    """The kernel's 1-D grid: cdiv(S, bm) query blocks for each of the bh (image or window, head) pairs."""
    return (triton.cdiv(S, bm) * bh,)


@torch.library.custom_op("harness::sam_rel_bias_attention", mutates_args=())
def sam_rel_bias_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel_h: torch.Tensor,
                           rel_w: torch.Tensor, H: int, W: int) -> torch.Tensor:
    """``attend`` with its default tiles as a torch custom op: torch.compile keeps it whole."""
    return attend(q, k, v, rel_h, rel_w, H, W)


@sam_rel_bias_attention.register_fake
def _(q, k, v, rel_h, rel_w, H, W):
    B, nh, S, D = q.shape
    return q.new_empty(B, S, nh, D)


def bench_configs(H: int, W: int, S: int) -> list[dict]:
    """A small sweep for ``python -m harness bench sam_attention bench.sam_attention.triton=true`` (the
    tiles that spill registers on sm90 are left out: ``docs/kernels/sam_attention_triton.md``): one-row
    key blocks, and blocks of 2 or 4 rows where a row fits in half a block of at most 128."""
    bms = (64, 128) if S >= 1024 else (64,)
    one_block = pow2(W)                                      # one key block per row, rel_w hoisted
    bns = {default_bn(W)} | ({16} if W % 16 == 0 else set()) | ({one_block} if one_block <= 64 else set())
    out = []
    for bm in bms:
        warps = 8 if bm == 128 else 4
        for bn in sorted(bns, reverse=True):
            for stages in (3, 2):
                out.append({"bm": bm, "bn": bn, "num_warps": warps, "num_stages": stages})
            if -(-W // bn) == 1:
                out.append({"bm": bm, "bn": bn, "hoist_rw": False, "num_warps": warps, "num_stages": 3})
        for rows in (2, 4):
            if rows * one_block <= 128:
                out.append({"bm": bm, "bn": rows * one_block, "rows": rows, "num_warps": warps, "num_stages": 3})
    return out
