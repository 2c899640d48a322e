"""Split-KV ("flash-decoding") attention of one query per (batch, head) against a static KV cache (Triton).

``decode_attention(q, k, v, pos)`` computes softmax(q . k_j * scale over keys j = 0..pos) . v for
q [B, nh, 1, d] against the preallocated buffers k, v [B, nkv, L, d] of a ``StaticKVCache``
(nkv divides nh: query head h reads KV head h // (nh / nkv)). ``pos`` is the step's position, an
int64 device tensor [1] read by the kernel itself: no host sync, and a CUDA graph captured once
replays correctly as the position advances. Keys past ``pos`` are never loaded (weight exactly 0).
The output is rounded once to q's dtype (fp32 accumulation). Two launches (splits, then the combine),
one with ``sem`` (a persistent int32 buffer of zeros, one counter per (batch, head):
``StaticKVCache.split_sem``: the last split to finish combines); the grid is a function of shapes
only (fixed for capture). ``DecodeAttentionConfig`` picks the tiles. Importing this module imports
triton; under ``TRITON_INTERPRET=1`` (the mode of ``common``) it runs on CPU tensors (tests).

Design notes (the two launches, the online softmax, the last-split combine, how the default tiles
were measured): ``docs/kernels/decode_attention_triton.md``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ..errors import HarnessError
from .common import LOG2E, check_runnable, emulates_bf16_rne, rne

#: streaming multiprocessors of an H100 / H200 SXM: the default split count aims at 2 waves of them
SMS = 132


@dataclass(frozen=True)
class DecodeAttentionConfig:
    """Tiles of ``decode_attention``: ``block_n`` keys per tile (a power of two), ``num_splits``
    (None: enough splits for about ``target_programs`` programs in all), ``num_warps``; from
    ``wide_from`` programs per split on, ``wide_block_n`` keys per tile with ``wide_warps`` warps and
    splits for about ``wide_target_programs`` programs (None: ``target_programs``) (``for_programs``),
    and from ``deep_from`` programs on ``deep_block_n`` keys with ``deep_warps``
    warps and ``deep_stages``. ``stages``: 0, each program loads a tile and reduces it before it loads
    the next; 2-6, its tiles stream through Triton's software pipeline with that many stages (stages - 1
    tiles in flight while one is reduced). ``balanced``: the splits share the filled positions 0..pos
    (read on the device: each split about 1/NUM_SPLITS of them) instead of fixed ranges of the buffer
    (early in a request the last splits of a fixed partition have nothing to read while the first
    ones read whole ranges); ``wide_balanced`` the same for the wide tier. How the defaults were
    measured (balanced in the wide tier only): ``docs/kernels/decode_attention_triton.md``.
    """

    block_n: int = 32
    num_splits: Optional[int] = None
    target_programs: int = 2 * SMS
    num_warps: int = 4
    wide_from: Optional[int] = 80
    wide_block_n: int = 32
    wide_warps: int = 1
    wide_target_programs: Optional[int] = 1280
    stages: int = 0
    deep_from: Optional[int] = 1280
    deep_block_n: int = 32
    deep_warps: int = 2
    deep_stages: int = 3
    balanced: bool = False
    wide_balanced: bool = True

    def for_programs(self, bh: int) -> "DecodeAttentionConfig":
        """The tiles a launch of ``bh`` = B*nh programs per split runs: from ``deep_from`` programs on
        (B >= 128 at 10 heads) ``deep_block_n`` keys per tile with ``deep_warps`` warps through
        ``deep_stages`` pipeline stages; from ``wide_from`` (B >= 8) ``wide_block_n`` keys with
        ``wide_warps`` warps, split toward ``wide_target_programs``, ``wide_balanced``; else this config
        (either threshold None: that tier never)."""
        if self.deep_from is not None and bh >= self.deep_from:
            return dataclasses.replace(self, block_n=self.deep_block_n, num_warps=self.deep_warps,
                                       stages=self.deep_stages, wide_from=None, deep_from=None)
        if self.wide_from is None or bh < self.wide_from:
            return self
        return dataclasses.replace(self, block_n=self.wide_block_n, num_warps=self.wide_warps, wide_from=None,
                                   deep_from=None, target_programs=self.wide_target_programs or self.target_programs,
                                   balanced=self.wide_balanced)

    def splits(self, bh: int, L: int) -> tuple:
        """(NUM_SPLITS, BLOCKS_PER_SPLIT) for ``bh`` = B*nh programs per split and L cache positions:
        the wanted count is clamped to [1, cdiv(L, block_n)], then reduced so no split starts past
        the buffer (every split owns at least one block of it)."""
        n_blocks = -(-L // self.block_n)
        want = self.num_splits if self.num_splits is not None else -(-self.target_programs // bh)
        want = max(1, min(want, n_blocks))
        per = -(-n_blocks // want)
        return -(-n_blocks // per), per

    def check(self) -> None:
        if self.block_n < 1 or self.block_n & (self.block_n - 1):
            raise HarnessError(f"DecodeAttentionConfig.block_n={self.block_n}: must be a power of two")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise HarnessError(f"DecodeAttentionConfig.num_warps={self.num_warps}: one of 1, 2, 4, 8, 16")
        for tier in ("wide", "deep"):                            # the tiers' tiles: the same rules
            bn, warps = getattr(self, f"{tier}_block_n"), getattr(self, f"{tier}_warps")
            if bn < 1 or bn & (bn - 1) or warps not in (1, 2, 4, 8, 16):
                raise HarnessError(f"DecodeAttentionConfig.{tier}_block_n={bn}, {tier}_warps={warps}: "
                                   "a power of two and one of 1, 2, 4, 8, 16")
        for name in ("stages", "deep_stages"):
            if getattr(self, name) not in (0, 2, 3, 4, 5, 6):
                raise HarnessError(f"DecodeAttentionConfig.{name}={getattr(self, name)}: 0 (one tile at a time) or "
                                   "2-6 (software-pipelined stages)")
        if self.wide_target_programs is not None and self.wide_target_programs < 1:
            raise HarnessError(f"DecodeAttentionConfig.wide_target_programs={self.wide_target_programs}: >= 1 or None")
        if self.num_splits is not None and self.num_splits < 1:
            raise HarnessError(f"DecodeAttentionConfig.num_splits={self.num_splits}: must be >= 1 (or None)")


#: the tiles every call without ``config`` takes (the model's decode attention, ``TritonDecodeAttention``);
#: the decode attention variant's manifest records it, so an A/B that sets it names what ran
DEFAULT_CONFIG = DecodeAttentionConfig()


@triton.jit
def _combine(ACC, M, LS, O, bh, b, h, s_ob, s_oh, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
             SPLITS_P2: tl.constexpr, EMULATE_BF16_RNE: tl.constexpr):
    """Weighted sum of the NUM_SPLITS partials of (batch b, head h) -> O, rounded once (L2 loads)."""
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, D)
    s_ok = offs_s < NUM_SPLITS
    rows = bh.to(tl.int64) * NUM_SPLITS + offs_s
    m = tl.load(M + rows, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
    ls = tl.load(LS + rows, mask=s_ok, other=0.0, cache_modifier=".cg")
    w = tl.exp2(m - tl.max(m, 0))                                 # 0 for empty and padded splits
    acc = tl.load(ACC + rows[:, None] * D + offs_d[None, :], mask=s_ok[:, None], other=0.0, cache_modifier=".cg")
    out = tl.sum(acc * w[:, None], 0) / tl.sum(ls * w, 0)
    tl.store(O + b * s_ob + h * s_oh + offs_d, rne(out, EMULATE_BF16_RNE).to(O.dtype.element_ty))


@triton.jit
def _attend_tile(q, k_tile, v_tile, first, n_keys, offs_n, s_kn, s_vn, m_i, l_i, acc):
    """The online softmax over the keys [first, first + BLOCK_N) below ``n_keys``: (m, l, acc) updated."""
    ok = first + offs_n < n_keys
    k = tl.load(k_tile + first * s_kn, mask=ok[:, None], other=0.0).to(tl.float32)
    s = tl.where(ok, tl.sum(k * q[None, :], 1), float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)                                    # exactly 0 for masked keys
    v = tl.load(v_tile + first * s_vn, mask=ok[:, None], other=0.0).to(tl.float32)
    acc = acc * alpha + tl.sum(p[:, None] * v, 0)
    l_i = l_i * alpha + tl.sum(p, 0)
    return m_new, l_i, acc


@triton.jit
def _split_kernel(Q, K, V, POS, O, ACC, M, LS, SEM, heads, group, L,
                  s_qb, s_qh, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh,
                  SCALE_LOG2: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCKS_PER_SPLIT: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
                  LAST_COMBINES: tl.constexpr, EMULATE_BF16_RNE: tl.constexpr, STAGES: tl.constexpr,
                  BALANCED: tl.constexpr):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = bh % heads
    kvh = (h // group).to(tl.int64)
    n_keys = tl.minimum(tl.load(POS).to(tl.int32) + 1, L)        # keys 0..pos
    if BALANCED:                                                  # the filled blocks, shared out at run time
        filled = (n_keys + BLOCK_N - 1) // BLOCK_N
        per = (filled + NUM_SPLITS - 1) // NUM_SPLITS
        start = split * per * BLOCK_N
        n_blocks = tl.minimum(tl.maximum(filled - split * per, 0), per)
    else:                                                         # fixed ranges of the buffer
        start = split * (BLOCKS_PER_SPLIT * BLOCK_N)
        n_blocks = tl.minimum(tl.maximum((n_keys - start + BLOCK_N - 1) // BLOCK_N, 0), BLOCKS_PER_SPLIT)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    # the scale is a compile-time constant: as a runtime float argument torch.compile passes it as fp64
    q = tl.load(Q + b * s_qb + h * s_qh + offs_d).to(tl.float32) * SCALE_LOG2
    k_tile = K + b * s_kb + kvh * s_kh + offs_n[:, None] * s_kn + offs_d[None, :]
    v_tile = V + b * s_vb + kvh * s_vh + offs_n[:, None] * s_vn + offs_d[None, :]
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([D], tl.float32)
    if STAGES == 0:                                               # one tile at a time
        for i in range(0, n_blocks):
            m_i, l_i, acc = _attend_tile(q, k_tile, v_tile, start + i * BLOCK_N, n_keys, offs_n, s_kn, s_vn, m_i,
                                         l_i, acc)
    else:                                                         # STAGES - 1 tiles in flight
        for i in tl.range(0, n_blocks, num_stages=STAGES):
            m_i, l_i, acc = _attend_tile(q, k_tile, v_tile, start + i * BLOCK_N, n_keys, offs_n, s_kn, s_vn, m_i,
                                         l_i, acc)
    if NUM_SPLITS == 1:
        out = rne(acc / l_i, EMULATE_BF16_RNE)
        tl.store(O + b * s_ob + h * s_oh + offs_d, out.to(O.dtype.element_ty))
    else:
        row = bh.to(tl.int64) * NUM_SPLITS + split
        tl.store(ACC + row * D + offs_d, acc)
        zero = tl.arange(0, 1)
        tl.store(M + row + zero, m_i)
        tl.store(LS + row + zero, l_i)
        if LAST_COMBINES:
            tl.debug_barrier()                                    # every thread's partials stored
            arrived = tl.atomic_add(SEM + bh, 1, sem="acq_rel", scope="gpu")
            if arrived == NUM_SPLITS - 1:                         # the other splits are done
                _combine(ACC, M, LS, O, bh, b, h, s_ob, s_oh, D, NUM_SPLITS, SPLITS_P2, EMULATE_BF16_RNE)
                tl.store(SEM + bh, 0)                             # reset for the next call


@triton.jit
def _combine_kernel(ACC, M, LS, O, heads, s_ob, s_oh,
                    D: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
                    EMULATE_BF16_RNE: tl.constexpr):
    bh = tl.program_id(0)
    _combine(ACC, M, LS, O, bh, (bh // heads).to(tl.int64), bh % heads, s_ob, s_oh, D, NUM_SPLITS, SPLITS_P2,
             EMULATE_BF16_RNE)


def _check_inputs(q, k, v, pos) -> None:
    """Shape/dtype/device checks; host metadata only, never reads device memory."""
    if q.dim() != 4 or q.shape[2] != 1 or k.dim() != 4 or v.shape != k.shape:
        raise HarnessError(f"decode_attention needs q [B, nh, 1, d] and k, v [B, nkv, L, d] of one shape; got "
                           f"q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}")
    B, nh, _, D = q.shape
    if k.shape[0] != B or k.shape[3] != D or nh % k.shape[1]:
        raise HarnessError(f"decode_attention: k, v {tuple(k.shape)} do not match q {tuple(q.shape)} (same B "
                           "and d, KV heads dividing the query heads)")
    if D & (D - 1):
        raise HarnessError(f"decode_attention needs a power-of-two head dim, got {D}")
    if k.dtype != q.dtype or v.dtype != q.dtype or not q.is_floating_point():
        raise HarnessError(f"decode_attention: q, k, v must share one float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if pos.dtype != torch.int64 or pos.numel() != 1:
        raise HarnessError(f"decode_attention: pos must be int64 [1] (the step's position), got "
                           f"{pos.dtype} {tuple(pos.shape)}")
    for name, t in (("k", k), ("v", v), ("pos", pos)):
        if t.device != q.device:
            raise HarnessError(f"decode_attention: {name} is on {t.device}, q on {q.device}")


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                     scale: Optional[float] = None,
                     config: Optional[DecodeAttentionConfig] = None,
                     sem: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[B, nh, 1, d] in q's dtype: attention of q over positions 0..pos of k, v [B, nkv, L, d]
    (module docstring). ``scale`` defaults to 1/sqrt(d), as SDPA. ``config`` None: ``DEFAULT_CONFIG``.
    ``sem``: int32 zeros, at least B*nh of them, left zero after each call: the last split combines (one
    launch); None: a combine launch. Callable under torch.compile."""
    check_runnable(q)
    _check_inputs(q, k, v, pos)
    config = DEFAULT_CONFIG if config is None else config
    config.check()
    B, nh, _, D = q.shape
    if sem is not None and (sem.dtype != torch.int32 or sem.numel() < B * nh or sem.device != q.device):
        raise HarnessError(f"decode_attention: sem must be int32 with >= {B * nh} counters on {q.device}, got "
                           f"{sem.dtype} [{sem.numel()}] on {sem.device}")
    nkv, L = k.shape[1], k.shape[2]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    scale_log2 = (D ** -0.5 if scale is None else scale) * LOG2E.value
    config = config.for_programs(B * nh)
    splits, per = config.splits(B * nh, L)
    emulate_rne = emulates_bf16_rne(q.dtype)
    out = torch.empty((B, nh, 1, D), dtype=q.dtype, device=q.device)
    acc = torch.empty((B * nh * splits, D) if splits > 1 else (1, D), dtype=torch.float32, device=q.device)
    m = torch.empty(B * nh * splits if splits > 1 else 1, dtype=torch.float32, device=q.device)
    ls = torch.empty_like(m)
    splits_p2 = 1 << (splits - 1).bit_length()
    last_combines = splits > 1 and sem is not None
    _split_kernel[(B * nh, splits)](
        q, k, v, pos, out, acc, m, ls, sem if last_combines else pos, nh, nh // nkv, L,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1),
        SCALE_LOG2=scale_log2, D=D, BLOCK_N=config.block_n, BLOCKS_PER_SPLIT=per, NUM_SPLITS=splits,
        SPLITS_P2=splits_p2, LAST_COMBINES=last_combines, EMULATE_BF16_RNE=emulate_rne, STAGES=config.stages,
        BALANCED=config.balanced, num_warps=config.num_warps)
    if splits > 1 and not last_combines:
        _combine_kernel[(B * nh,)](
            acc, m, ls, out, nh, out.stride(0), out.stride(1),
            D=D, NUM_SPLITS=splits, SPLITS_P2=splits_p2, EMULATE_BF16_RNE=emulate_rne,
            num_warps=4 if D >= 128 else 1)
    return out


def bench_configs() -> list:
    """A small sweep for ``python -m harness bench attention bench.attention.sweep=true``: the default
    with and without its deep tier, the wide tiles software-pipelined, then block_n x split counts at 4
    warps, then 1, 2 and 8 warps at the default splits, and 1 or 2 warps with 2 or 4 splits or 3 stages
    (none spills registers on sm90: ``docs/kernels/decode_attention_triton.md``)."""
    def flat(**tiles):                                            # these tiles at every batch size (no tier)
        return DecodeAttentionConfig(wide_from=None, deep_from=None, **tiles)

    out = [DecodeAttentionConfig(), DecodeAttentionConfig(deep_from=None)]    # with and without the deep tier
    for stages in (2, 3, 4):                                      # the wide tiles, software-pipelined
        for bn, warps in ((64, 2), (32, 2), (64, 4)):
            out.append(DecodeAttentionConfig(stages=stages, wide_block_n=bn, wide_warps=warps, deep_from=None))
    for bn in (32, 64, 128):
        out += [flat(block_n=bn, num_splits=splits) for splits in (None, 1, 2, 4, 8, 14)]
        out += [flat(block_n=bn, num_warps=warps) for warps in ((1, 2, 8) if bn < 128 else (8,))]
        for warps in (1, 2) if bn < 128 else ():           # fewer warps, more splits: no cross-warp sums
            out += [flat(block_n=bn, num_warps=warps, num_splits=splits) for splits in (2, 4)]
            out.append(flat(block_n=bn, num_warps=warps, stages=3))
    return list(dict.fromkeys(out))
