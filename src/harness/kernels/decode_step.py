"""One batch-1 decode step of the reference LLM as the fused Triton kernels of ``decode_step_triton``.

``FusedDecodeStep(weights, cache, pos)`` owns the step's scratch and launches, on every ``run()``:

    layer 0 (dense):  qkv+RoPE+KV (embedding, norm) | attention | o_proj+residual | gate/up (norm) | down+residual
    layers 1.. (MoE): qkv+RoPE+KV (norm) | attention | o_proj+residual | router (norm) | gate/up | down+residual
    end:              final norm + lm_head + argmax: the next token, position + 1

i.e. 5 + 6 (L - 1) + 1 launches (72 for DeepSeek-OCR), no torch op and no host sync: capturable in
a CUDA graph, whose replays decode greedily (the token buffer is the next step's input). The step
reads its token from ``token`` (int64 [1]) and its position from ``pos`` (int64 [1], the static
cache's ``position``), writes K/V at ``pos`` into the cache, the logits into ``logits`` [V] (the
activation dtype, as ``lm_head`` returns them) and the next token into ``token``; it does not touch
the cache's host ``length``. ``calls`` lists the launches (label, layer, callable) in order; the
diagnostics run them one at a time.

``DecodeWeights`` holds what a step reads (model-side code builds it: ``variants.fused_step``;
this package imports no model). Options: ``counts`` = (int64 [steps + 1, layers, experts], int64
[1] step index on the device): the step end adds 1 per chosen expert of each MoE layer at
[min(step, steps), layer] (before it waits: off the critical path) and advances the index.
``forced``: int64 [rows, positions, layers, k] expert ids: each MoE layer takes table[0, pos,
layer] (and their softmax probabilities) instead of its top-k; it must hold a row for every
position the step runs at (the cache length). ``pdl``: programmatic dependent launch (Hopper;
``decode_step_triton.pdl_support``), refused where it cannot run.
``debug``: the q/k/v and lm_head kernels also write their RMSNorm output to ``norm_out`` [H].
``clock_rows``: the in-kernel clock (``decode_step_triton.Clock``): every launch's first program
stamps when it entered and when it passed its wait (was released) into ``clock`` [rows, launches,
3], row = the step's position (rows: at least the cache length); with ``clock_every`` every program
stamps, and the launch keeps its first entry, first release and last end (atomics). ``clock_stamps()`` reads them and
``harness.measure.step_clock`` turns them into per-launch and per-module times.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import HarnessError
from . import decode_step_triton as k
from .common import check_counts

#: every tile field of DecodeStepConfig
_TILES = ("qkv", "attention", "o_proj", "router", "gate_up", "down", "dense_gate_up", "dense_down", "lm_head")
#: the tiles with a third entry: (what it holds, its least value)
_THIRD = {"o_proj": ("parts", 1), "dense_down": ("parts", 1), "lm_head": ("programs per SM", 0)}


@dataclass(frozen=True)
class DecodeStepConfig:
    """Tiles of the step's kernels. ``qkv``, ``gate_up``, ``down``, ``dense_gate_up``: (rows per tile,
    num_warps), one program per tile; ``o_proj``, ``dense_down``: the same and the parts their
    reduction is cut into (equal pieces: partial sums in fp32, rounded once). Rows per tile: RoPE
    column pairs (qkv), columns of the expert or dense width (gate_up), output columns of H (down,
    o_proj). ``lm_head``: (vocabulary rows per tile, num_warps, programs per SM: each program loops
    over a balanced range of tiles; 0: one program per tile). ``attention``: (keys per split,
    num_warps); ``router``: (gate rows per program, num_warps). ``sms``: the SM count lm_head's
    programs per SM multiply (None: the device's on CUDA, 4 elsewhere). ``gate_up_norm``: the MoE
    gate/up kernel recomputes RMSNorm(h) itself instead of reading the router's. ``lm_head_stages``:
    0, each lm_head program holds its next tile in registers; 2-6, its tiles stream through Triton's
    software pipeline with that many stages (``decode_step_triton.lm_head_argmax``).
    The router's last program makes the router's choice (the waiting placement, the gate/up kernel
    choosing and the down kernel spinning on its ids, was measured slower on every timing path and
    removed). How each default was measured and chosen: ``docs/kernels/decode_step.md``."""
    qkv: tuple = (4, 2)
    attention: tuple = (32, 2)
    o_proj: tuple = (4, 4, 1)
    router: tuple = (1, 1)
    gate_up: tuple = (4, 4)
    down: tuple = (4, 4)
    dense_gate_up: tuple = (4, 4)
    dense_down: tuple = (1, 8, 4)
    lm_head: tuple = (8, 8, 2)
    sms: Optional[int] = None
    gate_up_norm: bool = False
    lm_head_stages: int = 4

    def check(self) -> None:
        for name in _TILES:
            tile = getattr(self, name)
            third = _THIRD.get(name)
            want = 3 if third else 2
            if len(tile) != want:
                raise HarnessError(f"DecodeStepConfig.{name}={tile}: {want} entries expected")
            block, warps = tile[0], tile[1]
            if block < 1 or block & (block - 1) or warps not in (1, 2, 4, 8, 16):
                raise HarnessError(f"DecodeStepConfig.{name}={tile}: the block must be a power of two, "
                                   "num_warps one of 1, 2, 4, 8, 16")
            if third and tile[2] < third[1]:
                raise HarnessError(f"DecodeStepConfig.{name}={tile}: {third[0]} must be >= {third[1]}")
        if self.lm_head_stages not in (0, 2, 3, 4, 5, 6):
            raise HarnessError(f"DecodeStepConfig.lm_head_stages={self.lm_head_stages}: 0 (register double "
                               "buffer) or 2-6 (software-pipelined stages) expected")
        if self.sms is not None and self.sms < 1:
            raise HarnessError(f"DecodeStepConfig.sms={self.sms} must be >= 1 (or None)")


#: tiles for Triton's interpreter (CPU tests): few, large programs (its cost is per program and per op)
INTERPRETER_CONFIG = DecodeStepConfig(qkv=(64, 4), attention=(16, 4), o_proj=(64, 4, 2), router=(8, 2),
                                      gate_up=(32, 4), down=(64, 4), dense_gate_up=(128, 4), dense_down=(64, 4, 2),
                                      lm_head=(1024, 4, 1), sms=2)


def default_config(device) -> DecodeStepConfig:
    """The step's tiles on ``device``: ``DecodeStepConfig()`` on CUDA, ``INTERPRETER_CONFIG`` elsewhere."""
    return DecodeStepConfig() if torch.device(device).type == "cuda" else INTERPRETER_CONFIG


@dataclass
class LayerWeights:
    """One decoder layer's tensors ([out, in] as nn.Linear). Dense: ``gate_up`` [2I, H], ``down``
    [H, I]. MoE: ``gate_up``/``down`` the shared expert's ([2S, H], [H, S]), ``router`` [E, H],
    ``experts_gate_up`` [E, 2I, H], ``experts_down`` [E, H, I]."""
    ln_in: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    ln_post: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    router: Optional[torch.Tensor] = None
    experts_gate_up: Optional[torch.Tensor] = None
    experts_down: Optional[torch.Tensor] = None

    @property
    def moe(self) -> bool:
        return self.router is not None


@dataclass
class DecodeWeights:
    """What a step reads, and the model facts it needs. ``rotary``: the model's RotaryEmbedding
    module (the RoPE tables are computed with it, so they equal the reference's values bit for bit)."""
    embed: torch.Tensor
    layers: list
    norm: torch.Tensor
    lm_head: torch.Tensor
    rotary: object
    num_heads: int
    eps: float
    top_k: int
    norm_topk: bool
    scale: float


def _refuse(what: str, fix: str = "build the step from the reference model's weights (variants.fused_step)"):
    raise HarnessError(f"FusedDecodeStep: {what}", fix)


class FusedDecodeStep:
    """The fused batch-1 decode step over ``weights`` and a static cache (``cache.k``/``cache.v``:
    per-layer [1, nkv, L, d] buffers); see the module docstring. ``history``: int64 [L] on the
    device; each step also writes its token at its position there (a caller keeps the tokens of a
    replayed graph without a copy kernel per step)."""

    def __init__(self, weights: DecodeWeights, cache, pos: torch.Tensor, *, token: Optional[torch.Tensor] = None,
                 config: DecodeStepConfig = DecodeStepConfig(), pdl: bool = False, counts: Optional[tuple] = None,
                 forced: Optional[torch.Tensor] = None, history: Optional[torch.Tensor] = None, debug: bool = False,
                 clock_rows: int = 0, clock_every: bool = False):
        config.check()
        w = weights
        self.w, self.cache, self.pos, self.config = w, cache, pos, config
        dev, dt = w.embed.device, w.embed.dtype
        k.check_runnable(w.embed)
        if pdl:
            ok, why = k.pdl_support(dev)
            if not ok:
                raise HarnessError(f"FusedDecodeStep: pdl=True cannot run here: {why}", "use pdl=False")
        self.pdl = pdl
        self._check(w, cache, pos, dev, dt)
        H = w.embed.shape[1]
        k0 = cache.k[0]
        L, d = k0.shape[2], k0.shape[3]
        nh = w.num_heads
        moe = [lw for lw in w.layers if lw.moe]
        dense = [lw for lw in w.layers if not lw.moe]
        self._check_parts(config, nh * d, dense)
        self.token = token if token is not None else torch.zeros(1, dtype=torch.int64, device=dev)
        if self.token.dtype != torch.int64 or self.token.numel() != 1 or self.token.device != dev:
            _refuse(f"token must be int64 [1] on {dev}, got {self.token.dtype} {tuple(self.token.shape)}",
                    "pass a one-element int64 device tensor")
        f32, i32 = torch.float32, torch.int32
        zeros = lambda *shape, dtype=dt: torch.zeros(shape, dtype=dtype, device=dev)  # noqa: E731
        self.h, self.q, self.attn_out = zeros(H), zeros(nh * d), zeros(nh * d)
        splits = k.attention_splits(L, config.attention[0])
        self.attn_acc, self.attn_m, self.attn_l = zeros(nh * splits, d, dtype=f32), zeros(nh * splits, dtype=f32), \
            zeros(nh * splits, dtype=f32)
        self.attn_sem = zeros(nh, dtype=i32)
        cos, sin = w.rotary(torch.zeros(1, dtype=dt, device=dev), torch.arange(L, device=dev)[None])
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()
        self.logits = zeros(w.lm_head.shape[0])
        self.moe_layers = torch.tensor([i for i, lw in enumerate(w.layers) if lw.moe], dtype=torch.int64, device=dev)
        if moe:
            E, inter = moe[0].experts_down.shape[0], moe[0].experts_down.shape[2]
            parts = moe[0].down.shape[1] // inter
            self.xn, self.router_logits, self.router_sem = zeros(H), zeros(E, dtype=f32), zeros(1, dtype=i32)
            self.ids = zeros(len(w.layers), w.top_k, dtype=torch.int64)     # the rows of MoE layers are used
            self.wts = zeros(len(w.layers), w.top_k, dtype=f32)
            self.moe_act = zeros(parts + w.top_k, inter)        # rows: the shared parts, then the routed slots
        if dense:
            self.dense_act = zeros(1, dense[0].down.shape[1])
        self.sms = config.sms or (torch.cuda.get_device_properties(dev).multi_processor_count
                                  if dev.type == "cuda" else 4)
        lm_tiles = k.tiles(w.lm_head.shape[0], config.lm_head[0])
        lm_programs = max(1, min(lm_tiles, config.lm_head[2] * self.sms if config.lm_head[2] else lm_tiles))
        self.lm_pmax, self.lm_pidx, self.lm_sem = zeros(lm_programs, dtype=f32), zeros(lm_programs, dtype=i32), \
            zeros(1, dtype=i32)
        self.counts = self._check_counts(counts, len(w.layers), moe, dev)
        self.forced = self._check_forced(forced, len(w.layers), w.top_k, L, moe, dev)
        if history is not None and (history.dtype != torch.int64 or history.dim() != 1 or history.numel() < L
                                    or history.device != dev):
            _refuse(f"history must be int64 [>= {L}] on {dev} (a token per cache position); got {history.dtype} "
                    f"{tuple(history.shape)} on {history.device}", "pass torch.zeros(L, dtype=torch.int64)")
        self.history = history
        self.norm_out = zeros(H) if debug else None
        self.calls = self._plan()
        self.clock = None
        if clock_rows:
            self._clock(int(clock_rows), dev, clock_every)

    def _clock(self, rows: int, dev, every: bool) -> None:
        """Each launch stamps its (entry, release[, end]) times into ``clock`` [rows, launches, 3] (int64,
        ns compiled; ``decode_step_triton.Clock``), row = the step's position (``rows`` >= the cache
        length, so rows never wrap and their order is the steps')."""
        L = self.cache.k[0].shape[2]
        if rows < L:
            _refuse(f"clock_rows={rows}: one row per cache position needed ({L}: the row is the step's position)",
                    f"pass clock_rows={L} (the cache length)")
        n = len(self.calls)
        self.clock = torch.empty(rows, n, 3, dtype=torch.int64, device=dev)
        self.clock_tick = torch.zeros(1, dtype=torch.int64, device=dev)
        self.clock_every = bool(every)
        self.calls = [(label, layer, functools.partial(call, clock=k.Clock(self.clock[0, i], self.clock_tick,
                                                                          self.pos, n * 3, rows, every)))
                      for i, (label, layer, call) in enumerate(self.calls)]
        self.reset_clock()

    def reset_clock(self) -> None:
        """Empty every clock row (entry and release int64 max, end int64 min): call before the steps
        timed, outside a graph capture."""
        big = torch.iinfo(torch.int64)
        self.clock[..., :2] = big.max
        self.clock[..., 2] = big.min

    def clock_stamps(self) -> list:
        """The clock's filled entries, one device read: [(row, launch, label, layer, entry, release, end)]
        (ints; ns on a GPU, logical ticks interpreted; end None unless ``clock_every``), rows whose
        launches all ran, in row order (= position order: at least a row per cache position). Only
        those rows are copied to the host."""
        if self.clock is None:
            _refuse("no clock: build the step with clock_rows=the cache length", "FusedDecodeStep(..., clock_rows=L)")
        full = (self.clock[..., 1] != torch.iinfo(torch.int64).max).all(-1).nonzero().flatten()
        out = []
        for r, row in zip(full.tolist(), self.clock[full].cpu().tolist()):     # the filled rows only
            out += [(r, i, label, layer, row[i][0], row[i][1], row[i][2] if self.clock_every else None)
                    for i, (label, layer, _) in enumerate(self.calls)]
        return out

    # ------------------------------------------------------------------ checks (host metadata only)
    @staticmethod
    def _check(w: DecodeWeights, cache, pos, dev, dt) -> None:
        if pos.dtype != torch.int64 or pos.numel() != 1 or pos.device != dev:
            _refuse(f"pos must be int64 [1] on {dev} (the static cache's position), got {pos.dtype} "
                    f"{tuple(pos.shape)} on {pos.device}", "pass cache.position")
        H = w.embed.shape[1]
        k0 = cache.k[0]
        if k0.dim() != 4 or k0.shape[0] != 1:
            _refuse(f"batch 1 only: the cache holds {tuple(k0.shape)} (need [1, nkv, L, d])",
                    "use the step at batch 1 (larger batches: the existing decode path)")
        nkv, d = k0.shape[1], k0.shape[3]
        nh = w.num_heads
        if d & (d - 1) or nh % nkv or len(cache.k) != len(w.layers):
            _refuse(f"head dim {d} (a power of two needed), {nh} heads over {nkv} KV heads, {len(cache.k)} cache "
                    f"layers for {len(w.layers)} decoder layers")
        tensors = [w.embed, w.norm, w.lm_head] + list(cache.k) + list(cache.v)
        for i, lw in enumerate(w.layers):
            want = {"qkv": ((nh + 2 * nkv) * d, H), "o": (H, nh * d), "ln_in": (H,), "ln_post": (H,)}
            for name, shape in want.items():
                if tuple(getattr(lw, name).shape) != shape:
                    _refuse(f"layer {i} {name} is {tuple(getattr(lw, name).shape)}, expected {shape}")
            if lw.moe:
                inter = lw.experts_down.shape[2]
                s_inter = lw.down.shape[1]
                if s_inter % inter or s_inter == 0 or tuple(lw.gate_up.shape) != (2 * s_inter, H):
                    _refuse(f"layer {i}: the shared expert ({tuple(lw.gate_up.shape)}, {tuple(lw.down.shape)}) is "
                            f"not P >= 1 parts of the expert width {inter}")
                tensors += [lw.router, lw.experts_gate_up, lw.experts_down]
            elif tuple(lw.gate_up.shape) != (2 * lw.down.shape[1], H):
                _refuse(f"layer {i}: dense gate_up {tuple(lw.gate_up.shape)} and down {tuple(lw.down.shape)} differ")
            tensors += [lw.ln_in, lw.qkv, lw.o, lw.ln_post, lw.gate_up, lw.down]
        for t in tensors:
            if t.device != dev or t.dtype != dt or t.stride(-1) != 1:
                _refuse(f"every weight and cache buffer must be {dt} on {dev} with unit stride in its last dim; "
                        f"got {t.dtype} {tuple(t.shape)} stride {t.stride()} on {t.device}")

    @staticmethod
    def _check_parts(config: DecodeStepConfig, attn_width: int, dense: list) -> None:
        for name, width in [("o_proj", attn_width)] + [("dense_down", dense[0].down.shape[1])] * bool(dense):
            parts = getattr(config, name)[2]
            if width % parts:
                raise HarnessError(f"DecodeStepConfig.{name}={getattr(config, name)}: {parts} parts do not divide "
                                   f"its reduction length {width}", "pick parts that divide it")

    @staticmethod
    def _check_counts(counts, layers: int, moe: list, dev):
        if counts is None:
            return None
        buf, step = counts
        check_counts("FusedDecodeStep", buf, step, layers - 1, moe[0].router.shape[0] if moe else 0, dev)
        return buf, step

    @staticmethod
    def _check_forced(forced, layers: int, top_k: int, max_len: int, moe: list, dev):
        if forced is None:
            return None
        if not moe:
            _refuse("a forced routing table needs MoE layers")
        if (forced.dtype != torch.int64 or forced.dim() != 4 or forced.shape[0] < 1 or forced.shape[1] < max_len
                or tuple(forced.shape[2:]) != (layers, top_k) or forced.device != dev or forced.stride(-1) != 1):
            _refuse(f"forced routing must be int64 [rows, positions >= {max_len}, {layers}, {top_k}] on {dev}; got "
                    f"{forced.dtype} {tuple(forced.shape)} on {forced.device}",
                    "one row of expert ids per position the cache holds")
        return forced

    # ------------------------------------------------------------------------------------ the step
    def _plan(self) -> list:
        """[(label, layer, callable)]: every launch of one step, arguments bound once."""
        w, cfg, pdl, cache = self.w, self.config, self.pdl, self.cache
        p = functools.partial
        calls = []
        o_parts = cfg.o_proj[2]
        for i, lw in enumerate(w.layers):
            first = i == 0
            calls += [
                ("qkv", i, p(k.qkv_rope, self.h, lw.ln_in, lw.qkv, self.cos, self.sin, self.pos, self.q, cache.k[i],
                             cache.v[i], w.eps, embed=w.embed if first else None,
                             token=self.token if first else None, xn_out=self.norm_out, tile=cfg.qkv, pdl=pdl)),
                ("attention", i, p(k.attention, self.q, cache.k[i], cache.v[i], self.pos, self.attn_out, self.attn_acc,
                                   self.attn_m, self.attn_l, self.attn_sem, tile=cfg.attention, pdl=pdl)),
                ("o_proj", i, p(k.down_residual, self.attn_out.view(o_parts, -1), lw.o, self.h, tile=cfg.o_proj[:2],
                                pdl=pdl))]
            if lw.moe:
                forced = (self.forced, self.pos, i) if self.forced is not None else None
                norm = cfg.gate_up_norm
                calls += [
                    ("router", i, p(k.route, self.h, lw.ln_post, lw.router, self.xn, self.router_logits,
                                    self.router_sem, self.ids[i], self.wts[i], w.eps, w.top_k, w.norm_topk, w.scale,
                                    forced=forced, tile=cfg.router, pdl=pdl)),
                    ("gate_up", i, p(k.gate_up, self.h if norm else self.xn, lw.gate_up, self.moe_act,
                                     ln=lw.ln_post if norm else None, eps=w.eps, experts_gate_up=lw.experts_gate_up,
                                     ids=self.ids[i], tile=cfg.gate_up, pdl=pdl)),
                    ("down", i, p(k.down_residual, self.moe_act, lw.down, self.h, experts=lw.experts_down,
                                  ids=self.ids[i], wts=self.wts[i], tile=cfg.down, pdl=pdl))]
            else:
                calls += [
                    ("gate_up", i, p(k.gate_up, self.h, lw.gate_up, self.dense_act, ln=lw.ln_post, eps=w.eps,
                                     tile=cfg.dense_gate_up, pdl=pdl)),
                    ("down", i, p(k.down_residual, self.dense_act.view(cfg.dense_down[2], -1), lw.down, self.h,
                                  tile=cfg.dense_down[:2], pdl=pdl))]
        calls.append(("lm_head", len(w.layers), p(
            k.lm_head_argmax, self.h, w.norm, w.lm_head, self.logits, self.lm_pmax, self.lm_pidx, self.lm_sem,
            self.token, self.pos, w.eps, step=self.counts[1] if self.counts is not None else None,
            counts=(self.counts[0], self.ids, self.moe_layers) if self.counts is not None and self.moe_layers.numel()
            else None,
            history=self.history, xn_out=self.norm_out, tile=cfg.lm_head[:2], stages=cfg.lm_head_stages, pdl=pdl)))
        return calls

    def kernel_names(self) -> dict:
        """{launch label: the name of the Triton function it runs} (``decode_step_triton.launches``)."""
        return {label: call.func.kernel.fn.__name__ for label, _, call in self.calls}

    @property
    def launches(self) -> int:
        """Kernel launches per step."""
        return len(self.calls)

    def run(self, scope=None) -> None:
        """One step: the token in ``token`` at position ``pos`` -> ``logits``, the next token in
        ``token``, ``pos`` + 1 (all on the device; nothing read back). ``scope(label, layer)``: a
        context each launch runs inside (kernel attribution: ``variants.fused_step``)."""
        for label, layer, call in self.calls:
            if scope is None:
                call()
            else:
                with scope(label, layer):
                    call()

    # ------------------------------------------------------------------------------- accounting
    def weight_bytes(self) -> dict:
        """Bytes of weights one step reads, by part (analytic: every weight row the kernels load, once;
        the routed experts are the k a token picks, distinct by construction of the top-k)."""
        w = self.w
        n = lambda t: t.numel() * t.element_size()  # noqa: E731
        out = {"embedding row": w.embed[0].numel() * w.embed.element_size(), "attention": 0, "dense mlp": 0,
               "router": 0, "routed experts": 0, "shared experts": 0, "final norm + lm_head": n(w.norm) + n(w.lm_head)}
        for lw in w.layers:
            out["attention"] += n(lw.ln_in) + n(lw.qkv) + n(lw.o)
            if lw.moe:
                out["router"] += n(lw.ln_post) + n(lw.router)
                out["routed experts"] += w.top_k * (n(lw.experts_gate_up[0]) + n(lw.experts_down[0]))
                out["shared experts"] += n(lw.gate_up) + n(lw.down)
            else:
                out["dense mlp"] += n(lw.ln_post) + n(lw.gate_up) + n(lw.down)
        out["total"] = sum(out.values())
        return out

    def kv_bytes(self, pos: int) -> int:
        """Bytes of K and V one step reads at position ``pos`` (keys 0..pos of every layer and KV head),
        plus the one position it writes."""
        k0 = self.cache.k[0]
        per_pos = 2 * k0.shape[1] * k0.shape[3] * k0.element_size() * len(self.cache.k)
        return per_pos * (min(pos + 1, k0.shape[2]) + 1)
