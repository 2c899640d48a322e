"""Flash attention with SAM's decomposed rel-pos bias added inside the kernel (Triton).

Computes exactly what ``sam_attention.dense_bias_attention`` computes, without an S x S mask
and without widening the head dim: scores = q_i . k_j * scale + rel_h[i, h(j)] + rel_w[i, w(j)]
with rel_h [BH, S, H], rel_w [BH, S, W] from the same einsums as the dense path. Online softmax in
fp32, fp32 accumulators; the output has q's dtype. Forward only (no autograd).

Shapes: q, k, v [B, nh, S, D] (last stride 1), D a power of two >= 16; Rh [H, H, D];
Rw [W, W, D]; returns [B, nh, S, D]. Tested under TRITON_INTERPRET=1 on the CPU. Cost:
``sam_attention.inkernel_bias_cost(bh, H, W, D, key_slots(H, W, bn))``.

Design notes (how key blocks follow the grid, what masked slots cost, the sweep):
``docs/kernels/sam_attention_triton.md``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import HarnessError

BN_CHOICES = (128, 64, 32, 16)


# log2(e) = 1.4426950408889634 is written out below: the softmax runs in the exp2 domain
@triton.jit
def _rel_bias_fwd(Q, K, V, RH, RW, O, sm_scale, S, H, W,
                  s_qb, s_qs, s_kb, s_ks, s_vb, s_vs, s_hb, s_hs, s_wb, s_ws, s_ob, s_os,
                  D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NWB: tl.constexpr,
                  HOIST_RW: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BN)
    mask_m = offs_m < S
    q = tl.load(Q + bh * s_qb + offs_m[:, None] * s_qs + offs_d[None, :], mask=mask_m[:, None], other=0.0)
    qk_scale = sm_scale * 1.4426950408889634
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    rh_ptr = RH + bh * s_hb + offs_m * s_hs
    rw_ptr = RW + bh * s_wb + offs_m[:, None] * s_ws
    if HOIST_RW:  # W <= BN: one rel_w tile serves every key row
        rw0 = tl.load(rw_ptr + offs_n[None, :], mask=mask_m[:, None] & (offs_n[None, :] < W), other=0.0)
        rw0 = tl.where(offs_n[None, :] < W, rw0.to(tl.float32) * 1.4426950408889634, float("-inf"))
    for h in range(0, H):
        rh = tl.load(rh_ptr + h, mask=mask_m, other=0.0).to(tl.float32) * 1.4426950408889634
        for wb in tl.static_range(NWB):
            w = wb * BN + offs_n
            mask_n = w < W
            if HOIST_RW:
                rw = rw0
            else:
                rw = tl.load(rw_ptr + w[None, :], mask=mask_m[:, None] & mask_n[None, :], other=0.0)
                rw = tl.where(mask_n[None, :], rw.to(tl.float32) * 1.4426950408889634, float("-inf"))
            j = h * W + w
            k = tl.load(K + bh * s_kb + j[:, None] * s_ks + offs_d[None, :], mask=mask_n[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale + rh[:, None] + rw
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + bh * s_vb + j[:, None] * s_vs + offs_d[None, :], mask=mask_n[:, None], other=0.0)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
            m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(O + bh * s_ob + offs_m[:, None] * s_os + offs_d[None, :], acc.to(O.dtype.element_ty),
             mask=mask_m[:, None])


def default_bn(W: int) -> int:
    """Largest key block in BN_CHOICES wasting <= 25% masked slots per row, else the least waste."""
    waste = {bn: -(-W // bn) * bn / W - 1 for bn in BN_CHOICES}
    ok = [bn for bn in BN_CHOICES if waste[bn] <= 0.25]
    return ok[0] if ok else min(BN_CHOICES, key=lambda bn: (waste[bn], -bn))


def key_slots(H: int, W: int, bn: int) -> int:
    """Keys the kernel visits per query (masked slots included): H * cdiv(W, bn) * bn."""
    return H * -(-W // bn) * bn


def rel_bias_attention(q, k, v, Rh, Rw, H: int, W: int, bm: int | None = None, bn: int | None = None,
                       hoist_rw: bool | None = None, num_warps: int | None = None,
                       num_stages: int | None = None) -> torch.Tensor:
    """Dense-path-exact SAM attention, bias added in-kernel. Shapes in the module docstring.

    Defaults: bm 128 when S >= 1024 else 64; bn = default_bn(W); hoist_rw when W <= bn;
    num_warps 8 for bm 128 else 4; num_stages 3. fp32 inputs use IEEE fp32 dots (no TF32).
    """
    B, nh, S, D = q.shape
    if S != H * W:
        raise HarnessError(f"sequence length {S} is not H*W = {H}*{W}")
    if D < 16 or D & (D - 1) or k.shape != q.shape or v.shape != q.shape:
        raise HarnessError(f"the Triton SAM kernel needs q, k, v of one shape with a power-of-two head dim >= 16; "
                           f"got q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}")
    bm = bm or (128 if S >= 1024 else 64)
    bn = bn or default_bn(W)
    nwb = -(-W // bn)
    hoist_rw = (nwb == 1) if hoist_rw is None else hoist_rw
    if hoist_rw and nwb != 1:
        raise HarnessError(f"hoist_rw needs W <= bn (W={W}, bn={bn})")
    BH = B * nh
    q3, k3, v3 = (t.reshape(BH, S, D) for t in (q, k, v))
    if any(t.stride(-1) != 1 for t in (q3, k3, v3)):
        q3, k3, v3 = (t.contiguous() for t in (q3, k3, v3))
    r_q = q3.reshape(BH, H, W, D)
    rel_h = torch.einsum("bhwc,hkc->bhwk", r_q, Rh).reshape(BH, S, H)
    rel_w = torch.einsum("bhwc,wkc->bhwk", r_q, Rw).reshape(BH, S, W)
    rel_h, rel_w = (t if t.stride(-1) == 1 else t.contiguous() for t in (rel_h, rel_w))
    out = torch.empty_like(q3)
    grid = (triton.cdiv(S, bm), BH)
    _rel_bias_fwd[grid](
        q3, k3, v3, rel_h, rel_w, out, D ** -0.5, S, H, W,
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), v3.stride(0), v3.stride(1),
        rel_h.stride(0), rel_h.stride(1), rel_w.stride(0), rel_w.stride(1), out.stride(0), out.stride(1),
        D=D, BM=bm, BN=bn, NWB=nwb, HOIST_RW=hoist_rw,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps or (8 if bm == 128 else 4), num_stages=num_stages or 3)
    return out.view(B, nh, S, D)


def bench_configs(H: int, W: int, S: int) -> list[dict]:
    """A small sweep for ``python -m harness bench sam_attention bench.sam_attention.triton=true`` (the
    tiles that spill registers on sm90 are left out: ``docs/kernels/sam_attention_triton.md``)."""
    bms = (64, 128) if S >= 1024 else (64,)
    one_block = max(16, 1 << (W - 1).bit_length())          # one key block per row, rel_w hoisted
    bns = {default_bn(W)} | ({16} if W % 16 == 0 else set()) | ({one_block} if one_block <= 64 else set())
    out = []
    for bm in bms:
        warps = 8 if bm == 128 else 4
        for bn in sorted(bns, reverse=True):
            for stages in (3, 2):
                out.append({"bm": bm, "bn": bn, "num_warps": warps, "num_stages": stages})
            if -(-W // bn) == 1:
                out.append({"bm": bm, "bn": bn, "hoist_rw": False, "num_warps": warps, "num_stages": 3})
    return out
