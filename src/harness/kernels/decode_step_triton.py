"""Triton kernels of one fused batch-1 decode step (issue 24): 6 launches per MoE layer, 5 for a
dense layer, 1 for the final norm, lm_head and greedy token; no torch op in between.

Per layer (h: the residual stream [H] in the activation dtype, updated in place): ``_qkv_rope_kernel``
(RMSNorm(h), q/k/v GEMV, RoPE at the device position, k and v written into the static cache there;
the first layer reads h as the token's embedding row), ``_attention_kernel`` (split-KV attention of
the step's q over positions 0..pos), ``_down_kernel`` as o_proj (h += o_proj(attention out)), in a MoE
layer ``_router_kernel`` (RMSNorm(h), the fp32 gate GEMV and the router's choice: softmax, top-k or a
forced routing table, renormalisation and scale), ``_gate_up_kernel`` (silu(gate(x)) * up(x) rows of
the shared or dense parts and of the k routed experts) and ``_down_kernel`` (those rows times their
down_proj columns, plus the residual). Step end: ``_lm_head_argmax_kernel`` (final RMSNorm, the logits
in the activation dtype, the greedy token - the first index of the max, as torch.argmax - into the
token buffer the next step reads, the device position and step index + 1; with routing counts, the
step's experts of every MoE layer added first).

Roundings are the vendor's eager bf16 ones; summation orders differ from cuBLAS and torch (fp32
rounding-level differences). ``USE_PDL``: programmatic dependent launch (Hopper; ``pdl_support``);
without it the same code runs as plain kernels. Importing this module imports triton; with
``TRITON_INTERPRET=1`` set before the first import of ``kernels.common`` the kernels run on CPU
tensors (tests), where ``EMU`` rounds fp32 -> bf16 to nearest-even as compiled code does.

Design notes (the work split, PDL's two-launch rule, packed bf16 pairs, each rounding, what was
tried and dropped with its measurements): ``docs/kernels/decode_step_triton.md``.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..errors import HarnessError
from .common import (INTERPRETED, LOG2E, check_runnable, counts_row, div_f32, emulates_bf16_rne, exp_f32, fp32_rounded, rne,
                     rounded, swiglu)

try:                                        # %globaltimer (ns, one clock for every SM)
    from triton.language.extra.cuda import globaltimer
except ImportError:                         # pragma: no cover - older Triton
    globaltimer = None

try:                                        # Triton >= 3.4 (grid dependency control, sm90+)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_GDC = True
except ImportError:                         # pragma: no cover - older Triton
    gdc_wait = gdc_launch_dependents = None
    HAS_GDC = False

__all__ = ["Clock", "HAS_GDC", "INTERPRETED", "k_parts", "pdl_support", "check_runnable", "tiles", "attention_splits"]


def k_parts(k: int, pieces: int = 2) -> tuple:
    """A reduction length ``k`` as ``pieces`` power-of-two tiles: each but the last the largest power
    of two <= what is left, the last the next power of two >= what is left then (masked; 0: nothing
    left). Two pieces: 1280 -> (1024, 256); 896 -> (512, 512); 6848 -> (4096, 4096). Three: 896 ->
    (512, 256, 128); 1712 -> (1024, 512, 256)."""
    if k < 1:
        raise HarnessError(f"reduction length {k} must be >= 1")
    if pieces < 1:
        raise HarnessError(f"a reduction cut into {pieces} pieces: 1 or more expected")
    out, rest = [], k
    for _ in range(pieces - 1):
        p = 1 << (rest.bit_length() - 1) if rest else 0
        out.append(p)
        rest -= p
    out.append(triton.next_power_of_2(rest) if rest else 0)
    return tuple(out)


def pdl_support(device) -> tuple:
    """(whether programmatic dependent launch can run on ``device``, why or why not)."""
    device = torch.device(device)
    if not HAS_GDC:
        return False, f"triton {triton.__version__} has no triton.language.extra.cuda.gdc_wait (needs >= 3.4)"
    if device.type != "cuda":
        return False, f"PDL is a CUDA launch attribute; the device is {device.type}"
    if INTERPRETED:
        return False, "the kernels were defined for Triton's interpreter (TRITON_INTERPRET=1)"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return False, f"PDL needs sm90 or newer; this GPU is sm{major}{minor}"
    return True, f"sm{major}{minor}: kernels launched with launch_pdl=True, gdc_wait/gdc_launch_dependents inside"


# ----------------------------------------------------------------------------------- helpers


@triton.jit
def _pdl_wait(USE_PDL: tl.constexpr):
    """Wait for the previous kernel (complete, its writes visible), then let the next one launch."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


if INTERPRETED:
    @triton.jit
    def _clock_now(tick_ptr):
        """The interpreter's clock: a logical tick (``tick_ptr`` int64 [1], + 1 per read)."""
        return tl.atomic_add(tick_ptr, 1, sem="relaxed")
else:
    @triton.jit
    def _clock_now(tick_ptr):
        """%globaltimer: nanoseconds, one clock for every SM."""
        return globaltimer()


@triton.jit
def _clock_reads(CLOCK: tl.constexpr):
    """Whether this program reads the clock: every program (CLOCK 2) or the launch's first (CLOCK 1)."""
    return (CLOCK == 2) | ((CLOCK == 1) & (tl.program_id(0) == 0) & (tl.program_id(1) == 0))


@triton.jit
def _clock_start(tick_ptr, CLOCK: tl.constexpr):
    """The program's entry time (0 where it does not read the clock)."""
    t = tl.full([], 0, tl.int64)
    if CLOCK > 0:
        if _clock_reads(CLOCK):
            t = _clock_now(tick_ptr)
    return t


@triton.jit
def _clock_released(tick_ptr, pos_ptr, rows, CLOCK: tl.constexpr):
    """(time, clock row) just after the program's wait: the row is the step's position modulo ``rows``,
    read once the previous kernel (which may be the last step's lm_head, advancing it) has completed."""
    t = tl.full([], 0, tl.int64)
    row = tl.full([], 0, tl.int64)
    if CLOCK > 0:
        if _clock_reads(CLOCK):
            t = _clock_now(tick_ptr)
            row = tl.load(pos_ptr, cache_modifier=".cg") % rows
    return t, row


@triton.jit
def _clock_end(clk_ptr, tick_ptr, row, stride, t_entry, t_release, CLOCK: tl.constexpr):
    """The program's end. CLOCK 2: stamps[row] = (min entry, min release, max end) over the launch's
    programs (atomics); CLOCK 1: the first program stores its entry and release (no end, no atomic)."""
    at = clk_ptr + row * stride
    if CLOCK == 2:
        t_end = _clock_now(tick_ptr)
        tl.atomic_min(at, t_entry, sem="relaxed")
        tl.atomic_min(at + 1, t_release, sem="relaxed")
        tl.atomic_max(at + 2, t_end, sem="relaxed")
    elif CLOCK == 1:
        if _clock_reads(CLOCK):
            tl.store(at, t_entry)
            tl.store(at + 1, t_release)


@triton.jit
def _tile_range(n_tiles):
    """[t0, t1): this program's contiguous, balanced share of ``n_tiles`` tiles."""
    pid = tl.program_id(0)
    n = tl.num_programs(0)
    return pid * n_tiles // n, (pid + 1) * n_tiles // n


@triton.jit
def _load_rows(w_rows, n_ok, K: tl.constexpr, KA: tl.constexpr, KB: tl.constexpr):
    """Weight rows [BLOCK_N, K] (pointers [BLOCK_N, 1] to each row's first element, unit stride
    along K) as tiles [BLOCK_N, KA] and [BLOCK_N, KB] (masked past K; KB = 0: the first tile twice)."""
    offs_a = tl.arange(0, KA)
    wa = tl.load(w_rows + offs_a[None, :], mask=n_ok[:, None], other=0.0)
    if KB > 0:
        offs_b = KA + tl.arange(0, KB)
        wb = tl.load(w_rows + offs_b[None, :], mask=n_ok[:, None] & (offs_b < K)[None, :], other=0.0)
    else:
        wb = wa
    return wa, wb


@triton.jit
def _zero_rows(BLOCK_N: tl.constexpr, KA: tl.constexpr, KB: tl.constexpr, dtype: tl.constexpr):
    """Zero tiles shaped as ``_load_rows``'."""
    za = tl.zeros([BLOCK_N, KA], dtype)
    if KB > 0:
        zb = tl.zeros([BLOCK_N, KB], dtype)
    else:
        zb = za
    return za, zb


@triton.jit
def _load_row(p, K: tl.constexpr, KA: tl.constexpr, KB: tl.constexpr):
    """A row of K elements at ``p`` as parts [KA], [KB] in its own dtype (padding 0; KB = 0: the
    first part twice)."""
    xa = tl.load(p + tl.arange(0, KA))
    if KB > 0:
        offs_b = KA + tl.arange(0, KB)
        xb = tl.load(p + offs_b, mask=offs_b < K, other=0)
    else:
        xb = xa
    return xa, xb


@triton.jit
def _load_vec(p, K: tl.constexpr, KA: tl.constexpr, KB: tl.constexpr):
    """``_load_row`` as fp32 parts."""
    xa, xb = _load_row(p, K, KA, KB)
    return xa.to(tl.float32), xb.to(tl.float32)


@triton.jit
def _store_vec(p, xa, xb, K: tl.constexpr, KA: tl.constexpr, KB: tl.constexpr):
    """Store parts of a row whose fp32 values are exact in ``p``'s dtype (no rounding needed)."""
    tl.store(p + tl.arange(0, KA), xa.to(p.dtype.element_ty))
    if KB > 0:
        offs_b = KA + tl.arange(0, KB)
        tl.store(p + offs_b, xb.to(p.dtype.element_ty), mask=offs_b < K)


@triton.jit
def _dot_rows(wa, wb, xa, xb, KB: tl.constexpr):
    """sum_k w[n, k] x[k] in fp32 for the tiles of ``_load_rows`` and the parts of ``_load_vec``."""
    acc = tl.sum(wa.to(tl.float32) * xa[None, :], axis=1)
    if KB > 0:
        acc += tl.sum(wb.to(tl.float32) * xb[None, :], axis=1)
    return acc


@triton.jit
def _dot_pairs(wa, wb, xa, xb, KB: tl.constexpr):
    """``_dot_rows`` of bf16 pairs held as int32 (``_load_rows`` / ``_load_row`` of int32 pointers,
    counts in pairs): each pair's two products summed by one ``_pair_dot``, then the sum over k."""
    acc = tl.sum(_pair_dot(wa, tl.broadcast_to(xa[None, :], wa.shape)), axis=1)
    if KB > 0:
        acc += tl.sum(_pair_dot(wb, tl.broadcast_to(xb[None, :], wb.shape)), axis=1)
    return acc


@triton.jit
def _pair_split(x):
    """An fp32 vector [2K] as its even and odd elements [K] (lo, hi: the halves of an int32 pair)."""
    return tl.split(tl.reshape(x, [x.shape[0] // 2, 2]))


@triton.jit
def _dot_pairs_f32(wa, wb, xa, xb, KB: tl.constexpr):
    """``_dot_pairs`` against an fp32 row (the parts of ``_load_vec`` / ``_rms_norm``, bf16 values),
    split into its even and odd elements here (``_pair_dot_f32``)."""
    xa_lo, xa_hi = _pair_split(xa)
    acc = tl.sum(_pair_dot_f32(wa, tl.broadcast_to(xa_lo[None, :], wa.shape),
                               tl.broadcast_to(xa_hi[None, :], wa.shape)), axis=1)
    if KB > 0:
        xb_lo, xb_hi = _pair_split(xb)
        acc += tl.sum(_pair_dot_f32(wb, tl.broadcast_to(xb_lo[None, :], wb.shape),
                                    tl.broadcast_to(xb_hi[None, :], wb.shape)), axis=1)
    return acc


@triton.jit
def _rms_norm(xa, xb, lna, lnb, act: tl.constexpr, K: tl.constexpr, KB: tl.constexpr, EPS: tl.constexpr,
              EMU: tl.constexpr):
    """The vendor RMSNorm of one row (fp32 parts, padding 0): mean of squares in fp32 (the sum times
    fp32(1/K), as ATen's mean, rounded before + eps as two eager ops round), ``x * rsqrt(mean + eps)``
    rounded to ``act``, times the weight, rounded."""
    ss = tl.sum(xa * xa, axis=0)
    if KB > 0:
        ss += tl.sum(xb * xb, axis=0)
    r = tl.rsqrt(fp32_rounded(ss * (1.0 / K)) + EPS)
    ya = rounded(lna * rounded(xa * r, act, EMU), act, EMU)
    if KB > 0:
        yb = rounded(lnb * rounded(xb * r, act, EMU), act, EMU)
    else:
        yb = ya
    return ya, yb


@triton.jit
def _store_first(p, xa, xb, K: tl.constexpr, KA: tl.constexpr, KB: tl.constexpr):
    """Program 0 stores the row (a normed x for ``xn`` or a diagnostic output)."""
    if tl.program_id(0) == 0:
        _store_vec(p, xa, xb, K, KA, KB)


# ------------------------------------------------------------------------ 1. q/k/v + RoPE + KV


@triton.jit
def _rope_row(cos_ptr, sin_ptr, pos, stride_ct, stride_st, dim, HALF: tl.constexpr):
    """cos and sin of position ``pos`` at columns ``dim`` and ``dim + HALF`` (fp32), from the tables."""
    cos_a = tl.load(cos_ptr + pos * stride_ct + dim).to(tl.float32)
    cos_b = tl.load(cos_ptr + pos * stride_ct + dim + HALF).to(tl.float32)
    sin_a = tl.load(sin_ptr + pos * stride_st + dim).to(tl.float32)
    sin_b = tl.load(sin_ptr + pos * stride_st + dim + HALF).to(tl.float32)
    return cos_a, cos_b, sin_a, sin_b


@triton.jit
def _rope_store(ya, yb, cos_a, cos_b, sin_a, sin_b, offs_j, ok, dim, col_a, col_b, pos, max_len, q_cols, kv_cols,
                q_ptr, k_ptr, v_ptr, stride_kh, stride_kn, stride_vh, stride_vn, HALF: tl.constexpr, EMU: tl.constexpr):
    """RoPE of the q and k columns (a, a + HALF) of the linear's rounded outputs ``ya``, ``yb``; q
    stored, k and v written into the cache at ``pos`` (when it holds that position)."""
    act = q_ptr.dtype.element_ty
    # q * cos + rotate_half(q) * sin, rotate_half(q) = (-q[a + HALF], q[a]) at (a, a + HALF)
    ra = rne(rounded(ya * cos_a, act, EMU) + rounded(-yb * sin_a, act, EMU), EMU).to(act)
    rb = rne(rounded(yb * cos_b, act, EMU) + rounded(ya * sin_b, act, EMU), EMU).to(act)
    in_cache = (offs_j * 0 + pos) < max_len         # (vector masks only: the interpreter refuses vector & scalar)
    is_q = col_a < q_cols
    is_k = (col_a >= q_cols) & (col_a < q_cols + kv_cols)
    is_v = col_a >= q_cols + kv_cols
    tl.store(q_ptr + col_a, ra, mask=ok & is_q)
    tl.store(q_ptr + col_b, rb, mask=ok & is_q)
    kc = col_a - q_cols                                              # head * 2 HALF + dim
    k_at = k_ptr + (kc // (2 * HALF)).to(tl.int64) * stride_kh + pos * stride_kn + dim
    tl.store(k_at, ra, mask=ok & is_k & in_cache)
    tl.store(k_at + HALF, rb, mask=ok & is_k & in_cache)
    vc = col_a - q_cols - kv_cols
    v_at = v_ptr + (vc // (2 * HALF)).to(tl.int64) * stride_vh + pos * stride_vn + dim
    tl.store(v_at, ya.to(act), mask=ok & is_v & in_cache)
    tl.store(v_at + HALF, yb.to(act), mask=ok & is_v & in_cache)


@triton.jit
def _qkv_rope_kernel(embed_ptr, tok_ptr, h_ptr, ln_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, k_ptr, v_ptr,
                     xn_ptr, q_cols, kv_cols, max_len, stride_et, stride_wn, stride_ct, stride_st, stride_kh,
                     stride_kn, stride_vh, stride_vn,
                     H: tl.constexpr, HA: tl.constexpr, HB: tl.constexpr, HALF: tl.constexpr,
                     BLOCK_P: tl.constexpr, EPS: tl.constexpr, EMBED: tl.constexpr, XN_OUT: tl.constexpr,
                     clk_ptr, clk_tick, clk_pos, clk_stride, clk_rows, USE_PDL: tl.constexpr, CLOCK: tl.constexpr,
                     EMU: tl.constexpr):
    c_entry = _clock_start(clk_tick, CLOCK)
    offs_j = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    ok = offs_j < (q_cols + 2 * kv_cols) // 2
    dim = offs_j % HALF
    col_a = (offs_j // HALF) * (2 * HALF) + dim
    col_b = col_a + HALF
    w_aa, w_ab = _load_rows(w_ptr + col_a[:, None].to(tl.int64) * stride_wn, ok, H, HA, HB)
    w_ba, w_bb = _load_rows(w_ptr + col_b[:, None].to(tl.int64) * stride_wn, ok, H, HA, HB)
    lna, lnb = _load_vec(ln_ptr, H, HA, HB)
    if not EMBED:           # layers after the first: the position was written more than two launches ago
        pos = tl.load(pos_ptr, cache_modifier=".cg")
        cos_a, cos_b, sin_a, sin_b = _rope_row(cos_ptr, sin_ptr, pos, stride_ct, stride_st, dim, HALF)
    _pdl_wait(USE_PDL)
    c_release, c_row = _clock_released(clk_tick, clk_pos, clk_rows, CLOCK)
    if EMBED:               # the first layer: the previous kernel (last step's lm_head) advanced it
        pos = tl.load(pos_ptr)
        cos_a, cos_b, sin_a, sin_b = _rope_row(cos_ptr, sin_ptr, pos, stride_ct, stride_st, dim, HALF)
    act = q_ptr.dtype.element_ty
    if EMBED:
        x_row = embed_ptr + tl.load(tok_ptr) * stride_et
    else:
        x_row = h_ptr
    xa, xb = _load_vec(x_row, H, HA, HB)
    if EMBED:
        _store_first(h_ptr, xa, xb, H, HA, HB)
    na, nb = _rms_norm(xa, xb, lna, lnb, act, H, HB, EPS, EMU)
    if XN_OUT:
        _store_first(xn_ptr, na, nb, H, HA, HB)
    ya = rounded(_dot_rows(w_aa, w_ab, na, nb, HB), act, EMU)
    yb = rounded(_dot_rows(w_ba, w_bb, na, nb, HB), act, EMU)
    _rope_store(ya, yb, cos_a, cos_b, sin_a, sin_b, offs_j, ok, dim, col_a, col_b, pos, max_len, q_cols, kv_cols,
                q_ptr, k_ptr, v_ptr, stride_kh, stride_kn, stride_vh, stride_vn, HALF, EMU)
    _clock_end(clk_ptr, clk_tick, c_row, clk_stride, c_entry, c_release, CLOCK)


# ---------------------------------------------------------------------------- 2. attention


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, out_ptr, acc_ptr, m_ptr, l_ptr, sem_ptr, max_len,
                      stride_kh, stride_kn, stride_vh, stride_vn,
                      GROUP: tl.constexpr, SCALE_LOG2: tl.constexpr, D: tl.constexpr, SPLIT_N: tl.constexpr,
                      NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
                      clk_ptr, clk_tick, clk_pos, clk_stride, clk_rows, USE_PDL: tl.constexpr, CLOCK: tl.constexpr,
                      EMU: tl.constexpr):
    c_entry = _clock_start(clk_tick, CLOCK)
    h = tl.program_id(0)
    split = tl.program_id(1)
    kvh = (h // GROUP).to(tl.int64)
    pos = tl.load(pos_ptr, cache_modifier=".cg").to(tl.int32)   # fixed since the step began (module docstring)
    n_keys = tl.minimum(pos + 1, max_len)
    start = split * SPLIT_N
    if start >= n_keys:                                      # wholly past the position: nothing to do
        return
    offs_n = start + tl.arange(0, SPLIT_N)
    offs_d = tl.arange(0, D)
    k_tile = k_ptr + kvh * stride_kh + offs_n[:, None].to(tl.int64) * stride_kn + offs_d[None, :]
    v_tile = v_ptr + kvh * stride_vh + offs_n[:, None].to(tl.int64) * stride_vn + offs_d[None, :]
    earlier = (offs_n < tl.minimum(pos, max_len))[:, None]   # written by earlier steps: read before the wait
    k = tl.load(k_tile, mask=earlier, other=0.0, cache_modifier=".cg")
    v = tl.load(v_tile, mask=earlier, other=0.0, cache_modifier=".cg")
    _pdl_wait(USE_PDL)
    c_release, c_row = _clock_released(clk_tick, clk_pos, clk_rows, CLOCK)
    now = ((offs_n == pos) & (offs_n < max_len))[:, None]    # written by this step's q/k/v kernel
    k = tl.where(now, tl.load(k_tile, mask=now, other=0.0), k).to(tl.float32)
    v = tl.where(now, tl.load(v_tile, mask=now, other=0.0), v).to(tl.float32)
    # the scale is a compile-time constant (a runtime float reaches a kernel as fp64 under torch.compile)
    q = tl.load(q_ptr + h * D + offs_d).to(tl.float32) * SCALE_LOG2
    s = tl.where(offs_n < n_keys, tl.sum(k * q[None, :], axis=1), float("-inf"))
    m = tl.max(s, axis=0)
    p = tl.exp2(s - m)                                       # exactly 0 past the position
    ls = tl.sum(p, axis=0)
    acc = tl.sum(p[:, None] * v, axis=0)
    n_used = (n_keys + SPLIT_N - 1) // SPLIT_N
    act = out_ptr.dtype.element_ty
    if n_used == 1:
        tl.store(out_ptr + h * D + offs_d, rne(acc / ls, EMU).to(act))
    else:
        row = h * NUM_SPLITS + split
        tl.store(acc_ptr + row * D + offs_d, acc)
        tl.store(m_ptr + row, m)
        tl.store(l_ptr + row, ls)
        tl.debug_barrier()                                   # every thread's partials stored
        arrived = tl.atomic_add(sem_ptr + h, 1, sem="acq_rel", scope="gpu")
        if arrived == n_used - 1:                            # the head's other splits are done
            offs_s = tl.arange(0, SPLITS_P2)
            s_ok = offs_s < n_used
            rows = h * NUM_SPLITS + offs_s
            ms = tl.load(m_ptr + rows, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
            lss = tl.load(l_ptr + rows, mask=s_ok, other=0.0, cache_modifier=".cg")
            w = tl.exp2(ms - tl.max(ms, axis=0))
            accs = tl.load(acc_ptr + rows[:, None] * D + offs_d[None, :], mask=s_ok[:, None], other=0.0,
                           cache_modifier=".cg")
            out = tl.sum(accs * w[:, None], axis=0) / tl.sum(lss * w, axis=0)
            tl.store(out_ptr + h * D + offs_d, rne(out, EMU).to(act))
            tl.store(sem_ptr + h, 0)                         # for the next layer / step
    _clock_end(clk_ptr, clk_tick, c_row, clk_stride, c_entry, c_release, CLOCK)


# ------------------------------------------- 3./6. down (o_proj, dense down, MoE down) + residual


@triton.jit
def _slot_tile(rows, ok, OFF: tl.constexpr, KP: tl.constexpr, INTER: tl.constexpr):
    """Columns [OFF, OFF + KP) of ``rows`` (pointers [S, BLOCK_N, 1]) as a tile [S, BLOCK_N, KP]: 0
    past INTER or off ``ok`` (weights in their dtype; activation rows [S, 1, KP] as fp32 by the caller)."""
    offs = OFF + tl.arange(0, KP)
    if OFF + KP > INTER:
        t = tl.load(rows + offs[None, None, :], mask=ok & (offs < INTER)[None, None, :], other=0.0)
    else:
        t = tl.load(rows + offs[None, None, :], mask=ok, other=0.0)
    return t


@triton.jit
def _slot_dot(w, a_rows, a_ok, OFF: tl.constexpr, KP: tl.constexpr, INTER: tl.constexpr, PACKED: tl.constexpr):
    """sum_k w[s, n, k] a[s, k] in fp32 over a tile of ``_slot_tile`` (``a_rows`` [S, 1, 1] pointers).
    ``PACKED``: ``w`` and ``a_rows`` hold bf16 pairs as int32 (OFF, KP, INTER counted in pairs); each
    pair's two exact products are summed by one inline-PTX FMA that also unpacks the pair, so no
    weight is widened to fp32 before its activation has arrived (``_pair_dot``)."""
    if PACKED:
        a = tl.broadcast_to(_slot_tile(a_rows, a_ok, OFF, KP, INTER), w.shape)
        p = _pair_dot(w, a)
    else:
        p = w.to(tl.float32) * _slot_tile(a_rows, a_ok, OFF, KP, INTER).to(tl.float32)
    return tl.sum(p, axis=2)


@triton.jit
def _pair_dot(w2, a2):
    """lo(w2) * lo(a2) + hi(w2) * hi(a2) in fp32 for int32 lanes holding two bf16 each (lo: the
    element at the lower address): a bf16 widens to fp32 exactly by a 16-bit shift (lo) or by
    clearing the low half (hi); both products are exact, their sum rounded once (one FMA). Compiled
    code only (inline PTX)."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 wl, wh, al, ah;
        shl.b32 wl, $1, 16;
        and.b32 wh, $1, -65536;
        shl.b32 al, $2, 16;
        and.b32 ah, $2, -65536;
        mul.rn.f32 wl, wl, al;
        fma.rn.f32 $0, wh, ah, wl;
        }""", "=r,r,r", [w2, a2], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _pair_dot_f32(w2, x_lo, x_hi):
    """``_pair_dot`` with fp32 activations: lo(w2) * x_lo + hi(w2) * x_hi (products of a bf16 weight
    and a bf16-valued fp32 are exact), one FMA. Compiled code only."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 wl, wh;
        shl.b32 wl, $1, 16;
        and.b32 wh, $1, -65536;
        mul.rn.f32 wl, wl, $2;
        fma.rn.f32 $0, wh, $3, wl;
        }""", "=r,r,r,r", [w2, x_lo, x_hi], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _down_kernel(act_ptr, ew_ptr, sw_ptr, ids_ptr, wts_ptr, h_ptr, stride_ar, stride_we,
                 stride_wn, stride_sn, H: tl.constexpr, INTER: tl.constexpr, IA: tl.constexpr, IB: tl.constexpr, IC: tl.constexpr,
                 TOP_K: tl.constexpr, PARTS: tl.constexpr, SP2: tl.constexpr, BLOCK_N: tl.constexpr,
                 ALIGNED: tl.constexpr, PACKED: tl.constexpr,
                 clk_ptr, clk_tick, clk_pos, clk_stride, clk_rows, USE_PDL: tl.constexpr, CLOCK: tl.constexpr,
                 EMU: tl.constexpr):
    c_entry = _clock_start(clk_tick, CLOCK)
    # slot s < TOP_K: routed row s (act row PARTS + s); TOP_K <= s < TOP_K + PARTS: shared (dense,
    # attention-out) part s - TOP_K (act row s - TOP_K); past that padding (SP2: a power of two)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    slot = tl.arange(0, SP2)
    used = slot < TOP_K + PARTS
    is_s = slot >= TOP_K                      # (padding slots hold zeros)
    rows = sw_ptr + offs_n[None, :, None].to(tl.int64) * stride_sn + ((slot - TOP_K) * INTER)[:, None, None]
    a_row = slot - TOP_K
    if TOP_K > 0:           # the router (two launches back) has completed: its experts and weights, from L2
        is_r = slot < TOP_K
        expert = tl.load(ids_ptr + slot, mask=is_r, other=0, cache_modifier=".cg").to(tl.int64)
        gate_w = tl.load(wts_ptr + slot, mask=is_r, other=0.0, cache_modifier=".cg")
        r_rows = ew_ptr + expert[:, None, None] * stride_we + offs_n[None, :, None].to(tl.int64) * stride_wn
        rows = tl.where(is_r[:, None, None], r_rows, rows)
        if ALIGNED:         # (checked on the host) the selection hides the rows' 16-byte alignment
            rows = tl.multiple_of(rows, [16, 16, 16])
        a_row = tl.where(is_r, PARTS + slot, a_row)
    w_ok = used[:, None, None] & n_ok[None, :, None]
    # PACKED (bf16, rows on 4 bytes, checked on the host): the tiles hold pairs of bf16 as int32
    U: tl.constexpr = 2 if PACKED else 1
    if PACKED:
        rows = rows.to(tl.pointer_type(tl.int32))
    wa = _slot_tile(rows, w_ok, 0, IA // U, INTER // U)                           # [SP2, BLOCK_N, IA / U]
    if IB > 0:
        wb = _slot_tile(rows, w_ok, IA // U, IB // U, INTER // U)
    if IC > 0:
        wc = _slot_tile(rows, w_ok, (IA + IB) // U, IC // U, INTER // U)
    # the residual: h's last writer (o_proj, the previous layer's down, layer 0's q/k/v) is two or
    # more launches back
    res = tl.load(h_ptr + offs_n, mask=n_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    _pdl_wait(USE_PDL)
    c_release, c_row = _clock_released(clk_tick, clk_pos, clk_rows, CLOCK)
    act = h_ptr.dtype.element_ty
    a_rows = act_ptr + a_row[:, None, None] * stride_ar
    if PACKED:
        a_rows = a_rows.to(tl.pointer_type(tl.int32))
    a_ok = used[:, None, None]
    part = _slot_dot(wa, a_rows, a_ok, 0, IA // U, INTER // U, PACKED)           # [SP2, BLOCK_N] fp32
    if IB > 0:
        part += _slot_dot(wb, a_rows, a_ok, IA // U, IB // U, INTER // U, PACKED)
    if IC > 0:
        part += _slot_dot(wc, a_rows, a_ok, (IA + IB) // U, IC // U, INTER // U, PACKED)
    y = rounded(tl.sum(tl.where(is_s[:, None], part, 0.0), axis=0), act, EMU)     # shared: rounded once
    if TOP_K > 0:
        # each routed row's down_proj rounded, times its fp32 gate weight, summed over k in fp32, rounded
        r = tl.where(is_r[:, None], rounded(part, act, EMU) * gate_w[:, None], 0.0)
        y = rounded(rounded(tl.sum(r, axis=0), act, EMU) + y, act, EMU)           # routed + shared_experts(x)
    tl.store(h_ptr + offs_n, rne(res + y, EMU).to(act), mask=n_ok)     # x + linear(..), rounded
    _clock_end(clk_ptr, clk_tick, c_row, clk_stride, c_entry, c_release, CLOCK)


# ------------------------------------------------------------------------------- 4. router


@triton.jit
def _top_k(p, e_ok, offs_e, BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr):
    """(ids int64, values) [BLOCK_TOPK] of the largest ``p`` [BLOCK_E] (>= 0 where ``e_ok``) in
    descending order, ties to the lower index: one ``tl.topk`` (bitonic) of int64 keys, the value's
    bits above the reversed index (a non-negative fp32 orders as its bits; lanes off ``e_ok`` key
    -1, below every value). The values come back bit for bit."""
    bits = p.to(tl.int32, bitcast=True).to(tl.int64)
    key = tl.where(e_ok, (bits << 32) | (BLOCK_E - 1 - offs_e).to(tl.int64), -1)
    top = tl.topk(key, BLOCK_TOPK)
    ids = (BLOCK_E - 1) - (top & 0xFFFFFFFF)
    return ids, (top >> 32).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _select_experts(logits_ptr, forced_ptr, pos_ptr, n_exp, forced_offset, forced_positions, forced_pos_stride,
                    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr, NORM_TOPK: tl.constexpr,
                    SCALE: tl.constexpr, FORCED: tl.constexpr):
    """The router's choice from its fp32 logits [n_exp] (``.cg`` loads: the other programs wrote
    them): (ids int64, weights fp32) [BLOCK_TOPK]. Softmax as
    ATen's (expf, an IEEE division by the sum); ``_top_k``, or with FORCED the table's experts at
    the device position (``forced_ptr[forced_offset + min(pos, positions - 1) * stride + j]``) with
    their probabilities; renormalised if NORM_TOPK; times SCALE. Slots past TOP_K weigh 0 (their
    ids are not meant to be stored)."""
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < n_exp
    logits = tl.load(logits_ptr + offs_e, mask=e_ok, other=float("-inf"), cache_modifier=".cg")
    ex = exp_f32(logits - tl.max(logits, axis=0))
    probs = div_f32(ex, tl.sum(ex, axis=0))
    offs_k = tl.arange(0, BLOCK_TOPK)
    k_ok = offs_k < TOP_K
    if FORCED:
        row = tl.minimum(tl.load(pos_ptr, cache_modifier=".cg"), forced_positions - 1)
        sel_i = tl.load(forced_ptr + forced_offset + row * forced_pos_stride + offs_k, mask=k_ok, other=0)
        sel_w = tl.sum(tl.where(offs_e[None, :] == sel_i[:, None], probs[None, :], 0.0), axis=1)
    else:
        sel_i, sel_w = _top_k(probs, e_ok, offs_e, BLOCK_E, BLOCK_TOPK)
    sel_w = tl.where(k_ok, sel_w, 0.0)              # slots past k (BLOCK_TOPK padding) weigh nothing
    if NORM_TOPK:
        sel_w = div_f32(sel_w, tl.sum(sel_w, axis=0) + 1e-20)
    return sel_i, sel_w * SCALE


@triton.jit
def _route_store(logits_ptr, forced_ptr, pos_ptr, ids_ptr, wts_ptr, n_exp, forced_offset, forced_positions,
                 forced_pos_stride, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr,
                 NORM_TOPK: tl.constexpr, SCALE: tl.constexpr, FORCED: tl.constexpr):
    """The router's choice from the stored logits (``_select_experts``) into ``ids`` and ``wts``."""
    sel_i, sel_w = _select_experts(logits_ptr, forced_ptr, pos_ptr, n_exp, forced_offset, forced_positions,
                                   forced_pos_stride, TOP_K, BLOCK_E, BLOCK_TOPK, NORM_TOPK, SCALE, FORCED)
    offs_k = tl.arange(0, BLOCK_TOPK)
    tl.store(ids_ptr + offs_k, sel_i, mask=offs_k < TOP_K)
    tl.store(wts_ptr + offs_k, sel_w, mask=offs_k < TOP_K)


@triton.jit
def _router_kernel(h_ptr, ln_ptr, w_ptr, xn_ptr, logits_ptr, sem_ptr, ids_ptr, wts_ptr, forced_ptr, pos_ptr,
                   n_exp, forced_offset, forced_positions, forced_pos_stride, stride_wn,
                   H: tl.constexpr, HA: tl.constexpr, HB: tl.constexpr, ROWS: tl.constexpr, TOP_K: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr, NORM_TOPK: tl.constexpr, SCALE: tl.constexpr,
                   EPS: tl.constexpr, FORCED: tl.constexpr, SINGLE: tl.constexpr,
                   clk_ptr, clk_tick, clk_pos, clk_stride, clk_rows, USE_PDL: tl.constexpr, CLOCK: tl.constexpr,
                   EMU: tl.constexpr):
    c_entry = _clock_start(clk_tick, CLOCK)
    offs_r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    r_ok = offs_r < n_exp
    wa, wb = _load_rows(w_ptr + offs_r[:, None].to(tl.int64) * stride_wn, r_ok, H, HA, HB)
    lna, lnb = _load_vec(ln_ptr, H, HA, HB)
    _pdl_wait(USE_PDL)
    c_release, c_row = _clock_released(clk_tick, clk_pos, clk_rows, CLOCK)
    xa, xb = _load_vec(h_ptr, H, HA, HB)
    na, nb = _rms_norm(xa, xb, lna, lnb, xn_ptr.dtype.element_ty, H, HB, EPS, EMU)
    _store_first(xn_ptr, na, nb, H, HA, HB)          # post_attention_layernorm(h), for the gate_up kernel
    # the vendor gate: F.linear(x.float(), w.float()): exact products, fp32 sums
    tl.store(logits_ptr + offs_r, _dot_rows(wa, wb, na, nb, HB), mask=r_ok)
    tl.debug_barrier()                                   # every thread's logits stored
    if SINGLE:              # one program holds every row: no other program to wait for
        _route_store(logits_ptr, forced_ptr, pos_ptr, ids_ptr, wts_ptr, n_exp, forced_offset, forced_positions,
                     forced_pos_stride, TOP_K, BLOCK_E, BLOCK_TOPK, NORM_TOPK, SCALE, FORCED)
    else:
        arrived = tl.atomic_add(sem_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(0) - 1:            # every logit is stored: softmax, top-k
            _route_store(logits_ptr, forced_ptr, pos_ptr, ids_ptr, wts_ptr, n_exp, forced_offset,
                         forced_positions, forced_pos_stride, TOP_K, BLOCK_E, BLOCK_TOPK, NORM_TOPK, SCALE,
                         FORCED)
            tl.store(sem_ptr, 0)
    _clock_end(clk_ptr, clk_tick, c_row, clk_stride, c_entry, c_release, CLOCK)


# ------------------------------------------------------------------------------- 5. gate/up


@triton.jit
def _weight_rows(rows, n_ok, H: tl.constexpr, HA: tl.constexpr, HB: tl.constexpr, PACKED: tl.constexpr):
    """``_load_rows`` of weight rows (pointers [BLOCK_N] to each row's first element), with PACKED
    as int32 pairs of bf16 (H and the row starts even, checked on the host)."""
    if PACKED:
        wa, wb = _load_rows(rows[:, None].to(tl.pointer_type(tl.int32)), n_ok, H // 2, HA // 2, HB // 2)
    else:
        wa, wb = _load_rows(rows[:, None], n_ok, H, HA, HB)
    return wa, wb


@triton.jit
def _gate_up_kernel(x_ptr, ln_ptr, ew_ptr, sw_ptr, ids_ptr, act_ptr,
                    stride_we, stride_wn, stride_sn, stride_ar, H: tl.constexpr, HA: tl.constexpr, HB: tl.constexpr, INTER: tl.constexpr,
                    S_INTER: tl.constexpr, PARTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr,
                    ROUTED: tl.constexpr, NORM: tl.constexpr, EPS: tl.constexpr, ALIGNED: tl.constexpr,
                    PACKED: tl.constexpr,
                    clk_ptr, clk_tick, clk_pos, clk_stride, clk_rows, USE_PDL: tl.constexpr, CLOCK: tl.constexpr,
                    EMU: tl.constexpr):
    c_entry = _clock_start(clk_tick, CLOCK)
    # slot s = pid // BLOCKS: s < PARTS the shared (dense) part s, else the routed row s - PARTS
    s = tl.program_id(0) // BLOCKS
    offs_n = (tl.program_id(0) % BLOCKS) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    # PACKED (bf16, rows and x on 4 bytes, checked on the host): the tiles hold pairs of bf16 as int32
    if s < PARTS:                                    # shared / dense weights: known before the wait
        gate = sw_ptr + (s * INTER + offs_n).to(tl.int64) * stride_sn
        up = gate + S_INTER * stride_sn
        if ALIGNED:             # (checked on the host: 16-byte vector loads)
            gate = tl.multiple_of(gate, 16)
            up = tl.multiple_of(up, 16)
        ga, gb = _weight_rows(gate, n_ok, H, HA, HB, PACKED)
        ua, ub = _weight_rows(up, n_ok, H, HA, HB, PACKED)
    else:
        if PACKED:
            ga, gb = _zero_rows(BLOCK_N, HA // 2, HB // 2, tl.int32)
        else:
            ga, gb = _zero_rows(BLOCK_N, HA, HB, sw_ptr.dtype.element_ty)
        ua, ub = ga, gb
    if NORM:
        lna, lnb = _load_vec(ln_ptr, H, HA, HB)
    _pdl_wait(USE_PDL)
    c_release, c_row = _clock_released(clk_tick, clk_pos, clk_rows, CLOCK)
    if ROUTED and s >= PARTS:                        # routed: the expert the router (previous kernel) chose
        expert = tl.load(ids_ptr + s - PARTS).to(tl.int64)
        gate = ew_ptr + expert * stride_we + offs_n.to(tl.int64) * stride_wn
        up = gate + INTER * stride_wn
        if ALIGNED:
            gate = tl.multiple_of(gate, 16)
            up = tl.multiple_of(up, 16)
        ga, gb = _weight_rows(gate, n_ok, H, HA, HB, PACKED)
        ua, ub = _weight_rows(up, n_ok, H, HA, HB, PACKED)
    if PACKED and NORM:
        xa, xb = _load_vec(x_ptr, H, HA, HB)
        xa, xb = _rms_norm(xa, xb, lna, lnb, act_ptr.dtype.element_ty, H, HB, EPS, EMU)
        hv = swiglu(_dot_pairs_f32(ga, gb, xa, xb, HB), _dot_pairs_f32(ua, ub, xa, xb, HB), act_ptr, EMU)
    elif PACKED:
        xa, xb = _load_row(x_ptr.to(tl.pointer_type(tl.int32)), H // 2, HA // 2, HB // 2)
        hv = swiglu(_dot_pairs(ga, gb, xa, xb, HB), _dot_pairs(ua, ub, xa, xb, HB), act_ptr, EMU)
    else:
        xa, xb = _load_vec(x_ptr, H, HA, HB)
        if NORM:
            xa, xb = _rms_norm(xa, xb, lna, lnb, act_ptr.dtype.element_ty, H, HB, EPS, EMU)
        hv = swiglu(_dot_rows(ga, gb, xa, xb, HB), _dot_rows(ua, ub, xa, xb, HB), act_ptr, EMU)
    tl.store(act_ptr + s * stride_ar + offs_n, hv, mask=n_ok)
    _clock_end(clk_ptr, clk_tick, c_row, clk_stride, c_entry, c_release, CLOCK)


# ------------------------------------------------------------------ 7. final norm, lm_head, token


@triton.jit
def _logit_tile(wa, wb, na, nb, rows, vocab, best, best_i, logits_ptr, act: tl.constexpr, HB: tl.constexpr,
                EMU: tl.constexpr):
    """One tile of lm_head rows: logits rounded to ``act`` and stored; (best, best_i) updated with the
    tile's maximum (its first index; an equal later maximum keeps the earlier index)."""
    r_ok = rows < vocab
    y = rounded(_dot_rows(wa, wb, na, nb, HB), act, EMU)     # logits in the activation dtype
    tl.store(logits_ptr + rows, y.to(act), mask=r_ok)
    y = tl.where(r_ok, y, float("-inf"))
    m = tl.max(y, axis=0)
    at = tl.min(tl.where(y == m, rows, vocab), axis=0)
    take = m > best                                          # strictly: an equal later max keeps the first index
    return tl.where(take, m, best), tl.where(take, at, best_i)


@triton.jit
def _count_routing(counts_ptr, ids_ptr, layers_ptr, step_ptr, n_moe, n_steps, n_layers, n_exp,
                   MOE_P2: tl.constexpr, TOP_K: tl.constexpr, KP2: tl.constexpr):
    """counts[min(step, steps), layer, e] += 1 for the k experts e = ids[layer, :] of each MoE layer
    (``layers_ptr``: their indices). The routers wrote the ids and the previous step's end the step
    index, all at least two launches back (``.cg`` loads); relaxed atomics, nothing waits on them."""
    offs_m = tl.arange(0, MOE_P2)
    m_ok = offs_m < n_moe
    offs_k = tl.arange(0, KP2)
    ok = m_ok[:, None] & (offs_k < TOP_K)[None, :]
    layer = tl.load(layers_ptr + offs_m, mask=m_ok, other=0, cache_modifier=".cg")
    e = tl.load(ids_ptr + layer[:, None] * TOP_K + offs_k[None, :], mask=ok, other=0, cache_modifier=".cg")
    at = counts_row(counts_ptr, step_ptr, n_steps, n_layers, layer, n_exp)[:, None] + e
    tl.atomic_add(at, 1, mask=ok, sem="relaxed")


@triton.jit
def _lm_head_argmax_kernel(h_ptr, ln_ptr, w_ptr, logits_ptr, pmax_ptr, pidx_ptr, sem_ptr, tok_ptr, pos_ptr,
                           step_ptr, hist_ptr, xn_ptr, counts_ptr, ids_ptr, layers_ptr, vocab, n_tiles, stride_wn, n_moe,
                           n_steps, n_layers, n_exp,
                           H: tl.constexpr, HA: tl.constexpr, HB: tl.constexpr, BLOCK_N: tl.constexpr,
                           G_P2: tl.constexpr, EPS: tl.constexpr, HAS_STEP: tl.constexpr, XN_OUT: tl.constexpr,
                           STAGES: tl.constexpr, HAS_COUNTS: tl.constexpr, MOE_P2: tl.constexpr,
                           TOP_K: tl.constexpr, KP2: tl.constexpr, HAS_HIST: tl.constexpr,
                           clk_ptr, clk_tick, clk_pos, clk_stride, clk_rows, USE_PDL: tl.constexpr, CLOCK: tl.constexpr,
                           EMU: tl.constexpr):
    c_entry = _clock_start(clk_tick, CLOCK)
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    if HAS_COUNTS:      # program 0, before its wait: every MoE layer's routing count of this step
        if pid == 0:
            _count_routing(counts_ptr, ids_ptr, layers_ptr, step_ptr, n_moe, n_steps, n_layers, n_exp,
                           MOE_P2, TOP_K, KP2)
    t0, t1 = _tile_range(n_tiles)                    # a contiguous, balanced range of row tiles
    offs = tl.arange(0, BLOCK_N)
    rows = t0 * BLOCK_N + offs
    end = tl.minimum(vocab, t1 * BLOCK_N)           # rows past the range: not this program's (or none)
    cur_a, cur_b = _load_rows(w_ptr + rows[:, None].to(tl.int64) * stride_wn, rows < end, H, HA, HB)
    lna, lnb = _load_vec(ln_ptr, H, HA, HB)
    _pdl_wait(USE_PDL)
    c_release, c_row = _clock_released(clk_tick, clk_pos, clk_rows, CLOCK)
    if STAGES == 0:
        nxt = (t0 + 1) * BLOCK_N + offs             # the second tile in flight during the norm
        nxt_a, nxt_b = _load_rows(w_ptr + nxt[:, None].to(tl.int64) * stride_wn, nxt < end, H, HA, HB)
    act = logits_ptr.dtype.element_ty
    xa, xb = _load_vec(h_ptr, H, HA, HB)
    na, nb = _rms_norm(xa, xb, lna, lnb, act, H, HB, EPS, EMU)
    if XN_OUT:                                       # diagnostics: model.norm(h)
        _store_first(xn_ptr, na, nb, H, HA, HB)
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], 0, tl.int32)
    if STAGES == 0:                                  # register double buffer: one tile ahead
        for t in range(t0, t1):
            best, best_i = _logit_tile(cur_a, cur_b, na, nb, t * BLOCK_N + offs, vocab, best, best_i, logits_ptr,
                                       act, HB, EMU)
            cur_a, cur_b = nxt_a, nxt_b
            nxt = (t + 2) * BLOCK_N + offs          # one tile ahead of the one reduced
            nxt_a, nxt_b = _load_rows(w_ptr + nxt[:, None].to(tl.int64) * stride_wn, nxt < end, H, HA, HB)
    else:                                            # the first tile (loaded before the wait), then a
        if t0 < t1:                                  # software-pipelined loop (STAGES - 1 tiles in flight)
            best, best_i = _logit_tile(cur_a, cur_b, na, nb, rows, vocab, best, best_i, logits_ptr, act, HB, EMU)
        for t in tl.range(t0 + 1, t1, num_stages=STAGES):
            rows_t = t * BLOCK_N + offs
            wa, wb = _load_rows(w_ptr + rows_t[:, None].to(tl.int64) * stride_wn, rows_t < vocab, H, HA, HB)
            best, best_i = _logit_tile(wa, wb, na, nb, rows_t, vocab, best, best_i, logits_ptr, act, HB, EMU)
    tl.store(pmax_ptr + pid, best)
    tl.store(pidx_ptr + pid, best_i)
    tl.debug_barrier()
    arrived = tl.atomic_add(sem_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == n_prog - 1:                        # every program's maximum is stored: pick the token
        offs_g = tl.arange(0, G_P2)
        g_ok = offs_g < n_prog
        pm = tl.load(pmax_ptr + offs_g, mask=g_ok, other=float("-inf"), cache_modifier=".cg")
        pi = tl.load(pidx_ptr + offs_g, mask=g_ok, other=vocab, cache_modifier=".cg")
        top = tl.max(pm, axis=0)
        token = tl.min(tl.where(pm == top, pi, vocab), axis=0)      # programs own increasing rows
        tl.store(tok_ptr, token.to(tl.int64))
        pos = tl.load(pos_ptr)
        if HAS_HIST:                                 # the token of the step at this position, kept
            tl.store(hist_ptr + pos, token.to(tl.int64))
        tl.store(pos_ptr, pos + 1)
        if HAS_STEP:
            tl.store(step_ptr, tl.load(step_ptr) + 1)
        tl.store(sem_ptr, 0)
    _clock_end(clk_ptr, clk_tick, c_row, clk_stride, c_entry, c_release, CLOCK)


# ------------------------------------------------------------------------------- launchers
#
# Thin host wrappers: no allocation, no device read, shapes from tensor metadata only (callable
# inside CUDA-graph capture). ``FusedDecodeStep`` checks shapes and dtypes once; tests call these
# directly. ``tile`` = (rows per tile, num_warps): q/k/v, gate/up and down launch one program per
# tile; ``pdl`` launches with programmatic dependent launch.


class Clock(NamedTuple):
    """The in-kernel clock of one launch (``FusedDecodeStep(clock_rows=...)``). The time is
    ``_clock_now`` (%globaltimer ns compiled, a logical tick interpreted). ``every`` False: the
    launch's first program (program id 0) stores the time it entered and the time it passed its wait
    (released) in ``stamps`` (int64 [3], this launch's entry of row 0) + row x ``row_stride``; the
    third stamp is left as it is. ``every`` True: every program reads the clock on entry, after its
    wait and at its end, and the launch keeps (min entry, min release, max end) there through
    atomics (the wait / work split, at a cost: ``docs/kernels/decode_step.md``). Row = the step's
    position (``pos``, int64 [1], read after the wait) modulo ``rows``. ``tick``: int64 [1], the
    interpreter's counter (unused compiled). The host fills the stamps (int64 max, max, min) before
    the steps it times (``FusedDecodeStep.reset_clock``)."""
    stamps: torch.Tensor
    tick: torch.Tensor
    pos: torch.Tensor
    row_stride: int
    rows: int
    every: bool = False


def launch_meta(pdl: bool, args: tuple, meta: dict, clock: Optional[Clock] = None) -> dict:
    """The keyword arguments of a step kernel's launch: ``meta``, PDL's launch attribute and the clock's
    arguments (placeholders without one: any tensor, a CLOCK=False kernel never touches them). Every
    stand-in for ``_launch`` (the benches' recorders) builds its launch with this."""
    meta = dict(meta)
    if pdl:
        meta["launch_pdl"] = True
    if clock is not None:
        meta.update(clk_ptr=clock.stamps, clk_tick=clock.tick, clk_pos=clock.pos, clk_stride=clock.row_stride,
                    clk_rows=clock.rows, CLOCK=2 if clock.every else 1)
    else:
        meta.update(clk_ptr=args[0], clk_tick=args[0], clk_pos=args[0], clk_stride=0, clk_rows=1, CLOCK=0)
    return meta


def _launch(kernel, grid, warps: int, pdl: bool, *args, clock: Optional[Clock] = None, **meta) -> None:
    kernel[grid](*args, num_warps=warps, **launch_meta(pdl, args, meta, clock))


def launches(kernel):
    """Decorator of a launch wrapper: ``wrapper.kernel`` is the Triton function its one launch runs
    (``FusedDecodeStep.kernel_names`` reads it)."""
    def mark(wrapper):
        wrapper.kernel = kernel
        return wrapper
    return mark


def tiles(rows: int, block: int, slots: int = 1) -> int:
    """Tiles of ``block`` rows over ``rows`` rows of each of ``slots`` matrices."""
    return triton.cdiv(rows, block) * slots


def aligned16(tensors: tuple, strides: tuple, nbytes: int = 16) -> bool:
    """Whether every tensor starts, and every stride / offset (elements of the tensors' dtype) steps,
    on ``nbytes`` bytes: with 16 the kernels may mark the rows they pick as 16-byte aligned (vector
    loads); ``packed_pairs`` asks for 4."""
    size = tensors[0].element_size()
    return all(t.data_ptr() % nbytes == 0 for t in tensors) and all(s * size % nbytes == 0 for s in strides)


@launches(_qkv_rope_kernel)
def qkv_rope(h, ln, w, cos, sin, pos, q, k_cache, v_cache, eps: float, *, embed=None, token=None, xn_out=None,
             tile=(4, 4), pdl: bool = False, clock: Optional[Clock] = None) -> None:
    """q [nh*d] <- RoPE(q rows of w @ RMSNorm(x)); k, v rows written into ``k_cache``/``v_cache``
    [1, nkv, L, d] at position ``pos`` (int64 [1]). x = h [H], or with ``embed`` [V, H] and
    ``token`` (int64 [1]) the token's embedding row, which is also written to h. ``cos``/``sin``
    [L, d] tables in the activation dtype. ``xn_out`` [H]: RMSNorm(x) written there (diagnostics).
    ``tile[0]``: column pairs per tile (one program each)."""
    d, nkv, L = k_cache.shape[-1], k_cache.shape[1], k_cache.shape[2]
    H = h.numel()
    ha, hb = k_parts(H)
    q_cols, kv_cols = q.numel(), nkv * d
    block_p, warps = tile
    has_embed = embed is not None
    _launch(_qkv_rope_kernel, (tiles((q_cols + 2 * kv_cols) // 2, block_p),), warps, pdl,
            embed if has_embed else h, token if has_embed else pos, h, ln, w, cos, sin, pos, q, k_cache, v_cache,
            xn_out if xn_out is not None else h, q_cols, kv_cols, L, embed.stride(0) if has_embed else 0, w.stride(0),
            cos.stride(0), sin.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
            H=H, HA=ha, HB=hb, HALF=d // 2, BLOCK_P=block_p, EPS=float(eps), EMBED=has_embed,
            XN_OUT=xn_out is not None, clock=clock, USE_PDL=pdl, EMU=emulates_bf16_rne(q.dtype))


def attention_splits(max_len: int, split_n: int) -> int:
    """Splits of a head over a cache of ``max_len`` positions (a function of shapes: fixed for capture)."""
    return triton.cdiv(max_len, split_n)


@launches(_attention_kernel)
def attention(q, k_cache, v_cache, pos, out, acc, m, ls, sem, *, tile=(32, 4), pdl: bool = False,
              clock: Optional[Clock] = None) -> None:
    """out [nh*d] <- softmax(q . k_j / sqrt(d), j = 0..pos) . v over ``k_cache``/``v_cache``
    [1, nkv, L, d]. Scratch: ``acc`` fp32 [nh * splits, d], ``m``, ``ls`` fp32 [nh * splits],
    ``sem`` int32 [nh] zeros (left zero), splits = ``attention_splits(L, tile[0])``."""
    d, nkv, L = k_cache.shape[-1], k_cache.shape[1], k_cache.shape[2]
    nh = q.numel() // d
    split_n, warps = tile
    splits = attention_splits(L, split_n)
    _launch(_attention_kernel, (nh, splits), warps, pdl,
            q, k_cache, v_cache, pos, out, acc, m, ls, sem, L,
            k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
            GROUP=nh // nkv, SCALE_LOG2=d ** -0.5 * LOG2E.value, D=d, SPLIT_N=split_n, NUM_SPLITS=splits,
            SPLITS_P2=triton.next_power_of_2(splits), clock=clock, USE_PDL=pdl, EMU=emulates_bf16_rne(q.dtype))


@launches(_down_kernel)
def down_residual(act, w, h, *, experts=None, ids=None, wts=None, tile=(4, 4), pdl: bool = False,
                  clock: Optional[Clock] = None) -> None:
    """h [H] <- h + y, y the vendor's rounding of a down projection whose input is cut into the
    rows of ``act`` [P + k, I]: rows p < P are parts of one input times ``w`` [H, P*I] (columns
    [p*I, (p+1)*I): o_proj, a dense or the shared down_proj), summed in fp32 and rounded once; with
    ``experts`` [E, H, I], ``ids`` int64 [k] and ``wts`` fp32 [k], rows P + j are routed expert
    ids[j]'s input: routed = sum_j wts[j] * round(experts[ids[j]] @ act[P + j]) (fp32 sum, rounded)
    and y = round(routed + round(shared)). ``tile[0]``: output rows per tile, one program each
    holding all P + k slots of its rows (no scratch). The ids and weights are the router's (two
    launches back: complete before the previous launch's wait), read before this kernel's wait."""
    top_k = ids.numel() if experts is not None else 0
    inter = act.shape[1]
    parts = w.shape[1] // inter
    ia, ib, ic = k_parts(inter, 3)
    block_n, warps = tile
    H = h.numel()
    ew = experts if experts is not None else w
    stride_we, stride_wn = (ew.stride(0), ew.stride(1)) if experts is not None else (0, 0)
    _launch(_down_kernel, (tiles(H, block_n),), warps, pdl,
            act, ew, w, ids if ids is not None else act, wts if wts is not None else act, h,
            act.stride(0), stride_we, stride_wn, w.stride(0),
            H=H, INTER=inter, IA=ia, IB=ib, IC=ic, TOP_K=top_k, PARTS=parts,
            SP2=triton.next_power_of_2(top_k + parts), BLOCK_N=block_n,
            ALIGNED=top_k > 0 and aligned16((ew, w), (ew.stride(0), ew.stride(1), w.stride(0), inter)),
            PACKED=packed_pairs(act, ew, w, strides=(act.stride(0), stride_we, stride_wn, w.stride(0), inter)),
            clock=clock, USE_PDL=pdl, EMU=emulates_bf16_rne(h.dtype))


def packed_pairs(*tensors, strides: tuple, compiled: bool = not INTERPRETED) -> bool:
    """Whether a kernel may read these tensors as int32 pairs of bf16 (``_pair_dot``): compiled code
    (the pair FMA is inline PTX), every tensor bf16 and on 4 bytes, every stride / length / offset
    in ``strides`` (elements) even, so every pair lies within one row and on 4 bytes."""
    return compiled and all(t.dtype == torch.bfloat16 for t in tensors) and aligned16(tensors, strides, 4)


def _choice_launch(n_exp: int, top_k: int, norm_topk: bool, scale: float, forced: Optional[tuple], dummy) -> tuple:
    """(args, meta) of ``_select_experts`` for the router's launch: the forced table, the position,
    E, the table's offset, positions and stride (``dummy`` in the pointers' place without a table),
    and the constexprs TOP_K .. FORCED."""
    if forced is not None:
        table, pos, layer = forced
        args = (table, pos, n_exp, layer * top_k, table.shape[1], table.stride(1))
    else:
        args = (dummy, dummy, n_exp, 0, 1, 0)
    return args, dict(TOP_K=top_k, BLOCK_E=triton.next_power_of_2(n_exp), BLOCK_TOPK=triton.next_power_of_2(top_k),
                      NORM_TOPK=bool(norm_topk and top_k > 1), SCALE=float(scale), FORCED=forced is not None)


@launches(_router_kernel)
def route(h, ln, w, xn, logits, sem, ids, wts, eps: float, top_k: int, norm_topk: bool, scale: float, *,
          forced=None, tile=(2, 2), pdl: bool = False, clock: Optional[Clock] = None) -> None:
    """The MoE router of one token: xn [H] <- RMSNorm(h); fp32 logits [E] = w [E, H] @ xn; ids
    int64 [k] and wts fp32 [k] <- the top-k softmax probabilities (descending, ties to the lowest
    index), renormalised if ``norm_topk``, times ``scale``. ``sem`` int32 [1] zero (left zero).
    (The routing count is the lm_head kernel's: ``lm_head_argmax(counts=...)``.) ``forced`` =
    (table int64 [rows, P, layers, k], pos int64 [1], layer): the experts are table[0, min(pos, P-1),
    layer] with their softmax probabilities instead of the top-k. With ``tile[0]`` >= E one program
    holds every gate row and chooses without the semaphore (``sem`` untouched); else the last program
    to store its logits chooses."""
    H, E = h.numel(), w.shape[0]
    ha, hb = k_parts(H)
    rows, warps = tile
    sel_args, sel_meta = _choice_launch(logits.numel(), top_k, norm_topk, scale, forced, ids)
    _launch(_router_kernel, (triton.cdiv(E, rows),), warps, pdl,
            h, ln, w, xn, logits, sem, ids, wts, *sel_args, w.stride(0),
            H=H, HA=ha, HB=hb, ROWS=rows, **sel_meta, EPS=float(eps),
            SINGLE=triton.cdiv(E, rows) == 1, clock=clock, USE_PDL=pdl,
            EMU=emulates_bf16_rne(xn.dtype))


@launches(_gate_up_kernel)
def gate_up(x, shared_gate_up, act, *, ln=None, eps: float = 0.0, experts_gate_up=None, ids=None,
            tile=(4, 4), pdl: bool = False, clock: Optional[Clock] = None) -> None:
    """SwiGLU rows silu(x @ gate^T) * (x @ up^T) into ``act`` [P + k, I] (act dtype).

    ``shared_gate_up`` [2S, H] (gate rows, then up rows; S = P * I) gives rows 0..P-1 (part p: h
    columns [p*I, (p+1)*I) of the shared expert; a dense SwiGLU is P = S / I parts, no routed row).
    With ``experts_gate_up`` [E, 2I, H] and ``ids`` int64 [k], row P + j is expert ids[j]'s.
    ``ln`` given: x is h and RMSNorm(h) (weight ``ln``, ``eps``) is recomputed once per program.
    ``tile[0]``: columns of the expert width per tile (one program each, slot by slot). The ids are
    the router's (the previous launch), read after this kernel's wait."""
    H = x.numel()
    ha, hb = k_parts(H)
    inter = act.shape[1]
    s_inter = shared_gate_up.shape[0] // 2
    parts = s_inter // inter
    top_k = ids.numel() if experts_gate_up is not None else 0
    block_n, warps = tile
    ew = experts_gate_up if experts_gate_up is not None else shared_gate_up
    aligned = aligned16((shared_gate_up, ew), (inter, s_inter, shared_gate_up.stride(0))
                        + ((ew.stride(0), ew.stride(1)) if experts_gate_up is not None else ()))
    _launch(_gate_up_kernel, (tiles(inter, block_n, parts + top_k),), warps, pdl,
            x, ln if ln is not None else x, ew, shared_gate_up, ids if ids is not None else act, act,
            ew.stride(0) if experts_gate_up is not None else 0, ew.stride(1), shared_gate_up.stride(0),
            act.stride(0), H=H, HA=ha, HB=hb, INTER=inter, S_INTER=s_inter, PARTS=parts, BLOCK_N=block_n,
            BLOCKS=tiles(inter, block_n), ROUTED=top_k > 0, NORM=ln is not None, EPS=float(eps), ALIGNED=aligned,
            PACKED=packed_pairs(x, shared_gate_up, ew, strides=(
                H, s_inter, shared_gate_up.stride(0)) + ((ew.stride(0), ew.stride(1)) if top_k > 0 else ())),
            clock=clock, USE_PDL=pdl, EMU=emulates_bf16_rne(act.dtype))


@launches(_lm_head_argmax_kernel)
def lm_head_argmax(h, ln, w, logits, pmax, pidx, sem, token, pos, eps: float, *, step=None, xn_out=None,
                   counts=None, history=None, tile=(8, 8), stages: int = 0, pdl: bool = False,
                                                    clock: Optional[Clock] = None) -> None:
    """logits [V] <- w [V, H] @ RMSNorm(h) in h's dtype; token (int64 [1]) <- the first index of the
    maximum logit, also into ``history`` (int64 [> pos]) at the step's position, if given; pos (and
    ``step``, if given) += 1. One program per entry of ``pmax`` (fp32) /
    ``pidx`` (int32) scratch; ``sem`` int32 [1] zero (left zero). ``xn_out`` [H]: RMSNorm(h)
    written there (diagnostics). ``stages``: 0, each program keeps the next tile in registers while
    it reduces the current one; >= 2, its tiles after the first go through Triton's software
    pipeline (``tl.range(num_stages=stages)``: stages - 1 tiles in flight through shared memory).

    ``counts`` = (contiguous buffer int64 [steps + 1, layers, E], ids int64 [layers, k], moe int64 [n]): with
    ``step``, program 0 adds this step's routing before its wait: buffer[min(step, steps), l, e] += 1
    for the experts e = ids[l] of each MoE layer l in ``moe`` (row ``steps`` gathers steps past the
    buffer); the routers' kernels then count nothing, and no kernel waits for the counts."""
    H, V = h.numel(), w.shape[0]
    if counts is not None and step is None:
        raise HarnessError("lm_head_argmax: counts need the device step index (step=...)")
    buf, ids, moe = counts if counts is not None else (pmax, pidx, pidx)
    ha, hb = k_parts(H)
    block_n, warps = tile
    programs = pmax.numel()
    _launch(_lm_head_argmax_kernel, (programs,), warps, pdl,
            h, ln, w, logits, pmax, pidx, sem, token, pos, step if step is not None else pos,
            history if history is not None else pos, xn_out if xn_out is not None else h, buf, ids, moe, V, triton.cdiv(V, block_n), w.stride(0), moe.numel(),
            buf.shape[0] - 1 if counts is not None else 0, buf.shape[1] if counts is not None else 0,
            buf.shape[2] if counts is not None else 0,
            H=H, HA=ha, HB=hb, BLOCK_N=block_n, G_P2=triton.next_power_of_2(programs), EPS=float(eps),
            HAS_STEP=step is not None, XN_OUT=xn_out is not None, STAGES=stages, HAS_COUNTS=counts is not None,
            MOE_P2=triton.next_power_of_2(moe.numel()), TOP_K=ids.shape[-1] if counts is not None else 1,
            KP2=triton.next_power_of_2(ids.shape[-1]) if counts is not None else 1, HAS_HIST=history is not None,
            clock=clock, USE_PDL=pdl, EMU=emulates_bf16_rne(logits.dtype))
