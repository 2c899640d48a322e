"""``linear_impl=fused``: fewer, fuller weight reads for the LLM's linears (same function).

The module classes ``FusedAttention`` (q/k/v as one weight; with a static cache at one token q/k/v,
RoPE and the KV write in one kernel), ``FusedSwiGLU`` (gate/up as one weight; the dense MLP and the
shared experts) and ``FusedGate`` (the router's fp32 GEMV, then softmax / top-k / scale / routing
count in one Triton kernel at one token) extend the reference classes; ``FUSED_LINEARS`` is the
converter. The operations they run:

- ``fuse_rows(linears)``: one weight [sum N_i, K] holding the Linears' weights one after the other;
  each Linear's weight becomes a view of it (state_dict names and values unchanged, no second copy).
  q/k/v become one GEMM and each SwiGLU's gate/up one GEMM.
- ``linear(x, w)`` / ``swiglu(x, w_gate_up)``: at one row (a batch-1 decode step) with K <= GEMV_MAX_K
  the Triton GEMV kernels of ``gemv_triton`` (a cuBLAS GEMM tile grid leaves most SMs idle at M=1);
  otherwise F.linear on the fused weight. ``python -m harness bench linear`` (H200, graph-replayed,
  µs per call): q/k/v/o 5.15 cuBLAS vs 3.48 GEMV; fused qkv 5.76 vs 4.88 (three separate GEMMs:
  15.5); shared gate/up/silu*mul 13.6 vs 5.04; router (fp32) 8.41 vs 2.13; dense down (K=6848) 10.0
  cuBLAS vs 15.2 GEMV, so K > GEMV_MAX_K stays on cuBLAS; at 8 rows cuBLAS was faster everywhere.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import knobs
from ..errors import HarnessError
from ..kernels.availability import triton_available
from ..models.llm import Attention, MoE, MoEGate, SwiGLU
from .base import Converter, Variant, swap
from .static_kv import StaticKVCache

#: rows (tokens) up to which the GEMV kernels run; more rows go to cuBLAS
GEMV_MAX_ROWS = 1
#: decode rows (one token per sequence) up to which the MoE router is the Triton GEMV + top-k kernel
#: (``FusedGate``). At batch 32 on an H200 the torch gate took about 17 µs per layer in five kernels
#: (fp32 GEMM 6.3, top-k 5.9, split-K reduce 2.1, cast 1.5, softmax 1.3), the Triton GEMV and top-k
#: kernel 2.9 + 2.5 (runs/examples/h200-b32-align/kernels_b32*.txt); the GEMV reads the 164 KB gate
#: once per row, from L2 after the first
ROUTER_MAX_ROWS = 128
#: decode rows (one token per sequence) up to which ``FusedAttention`` on a static cache runs RoPE and the
#: KV write as one Triton launch after its q/k/v linear (``gemv_triton.rope_kv_write``) instead of the
#: vendor's RoPE and ``update``. A compiled batch-32 step on an H200: 12 launches, 22.9 µs per step,
#: against two inductor kernels per layer, 31.1 µs (``runs/examples/h200-issue40-s9/levers/``); A/B'd at
#: batch 32 only (batch 128's pipeline ran it, without an A/B)
ROPE_KV_MAX_ROWS = 128
#: reduction length up to which the GEMV kernels run (their loop over K is unrolled)
GEMV_MAX_K = 2048
#: tiles of the GEMV kernels (a ``gemv_triton.GemvConfig``); None: the kernels' default (the H200's
#: fastest). A hook for the CPU tests: Triton's interpreter pays per program, so they set wider tiles.
GEMV_TILES = None


def _tiles() -> dict:
    """The GEMV kernels' ``config`` argument: empty for their default tiles, else ``GEMV_TILES``."""
    return {} if GEMV_TILES is None else {"config": GEMV_TILES}


def fuse_rows(linears: list) -> torch.Tensor:
    """Concatenate the Linears' weights (no biases) along the output dim; re-point each to its view."""
    ref = linears[0].weight
    for lin in linears:
        w = lin.weight
        if lin.bias is not None or w.shape[1] != ref.shape[1] or w.dtype != ref.dtype or w.device != ref.device:
            raise HarnessError(f"fuse_rows: weights {[tuple(l.weight.shape) for l in linears]} cannot share one "
                               "tensor (same K, dtype, device and no bias needed)")
    fused = torch.empty(sum(l.weight.shape[0] for l in linears), ref.shape[1], dtype=ref.dtype, device=ref.device)
    start = 0
    with torch.no_grad():
        for lin in linears:
            n = lin.weight.shape[0]
            fused[start:start + n].copy_(lin.weight)
            lin.weight = nn.Parameter(fused[start:start + n], requires_grad=lin.weight.requires_grad)
            start += n
    return fused


def shares_rows(linears: list, fused: torch.Tensor) -> bool:
    """True while every Linear's weight is still its view of ``fused`` (a ``.to()`` breaks it)."""
    start = 0
    for lin in linears:
        n = lin.weight.shape[0]
        if lin.weight.data_ptr() != fused[start:start + n].data_ptr() or lin.weight.shape != fused[start:start + n].shape:
            return False
        start += n
    return start == fused.shape[0]


def fused_weight(module: nn.Module, attr: str, linears: list) -> torch.Tensor:
    """``module.<attr>``: the fused weight of ``linears`` (``fuse_rows``), made once and made again only
    where the Linears are no longer its views (``shares_rows``: a ``.to()`` since)."""
    fused = module.__dict__.get(attr)
    if fused is None or not shares_rows(linears, fused):
        fused = fuse_rows(linears)
        module.__dict__[attr] = fused
    return fused


def gemv_fits(rows: int, k: int) -> bool:
    """Whether ``rows`` token rows against a reduction length ``k`` run the Triton GEMV kernels."""
    return rows <= GEMV_MAX_ROWS and k <= GEMV_MAX_K


def linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T -> [..., N] in ``out_dtype`` (x's by default). ``out_dtype=float32`` is
    the vendor gate's F.linear(x.float(), w.float()): exact products, fp32 sums."""
    x2 = x.reshape(-1, x.shape[-1])
    if gemv_fits(x2.shape[0], w.shape[1]):
        from ..kernels.gemv_triton import gemv
        y = gemv(x2, w, out_dtype, **_tiles())
    elif out_dtype == torch.float32:
        y = F.linear(x2.float(), w.float())
    else:
        y = F.linear(x2, w).to(out_dtype or x.dtype)
    return y.view(*x.shape[:-1], w.shape[0])


def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) with ``w_gate_up`` [2I, K] = gate rows then up rows -> [..., I]."""
    x2 = x.reshape(-1, x.shape[-1])
    inter = w_gate_up.shape[0] // 2
    if gemv_fits(x2.shape[0], w_gate_up.shape[1]):
        from ..kernels.gemv_triton import gemv_swiglu
        h = gemv_swiglu(x2, w_gate_up, **_tiles())
    else:
        gate, up = F.linear(x2, w_gate_up).split(inter, dim=-1)
        h = F.silu(gate) * up
    return h.view(*x.shape[:-1], inter)


class FusedAttention(Variant, Attention):
    """``Attention`` with q/k/v as one weight (``qkv_weight``, [q rows; k rows; v rows]) and o_proj by
    ``linear``. Against a static cache at one token (a batch-1 decode step), q/k/v, RoPE and the KV
    write run as one kernel (``gemv_triton.gemv_qkv_rope``) before the cache's decode attention; at
    2 to ``ROPE_KV_MAX_ROWS`` sequences of one token each, the q/k/v linear, then RoPE and the KV write
    as one kernel (``gemv_triton.rope_kv_write``)."""

    qkv_weight = None

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, cache) -> torch.Tensor:
        B, S, _ = x.shape
        one_row = gemv_fits(B * S, x.shape[-1])
        if not (isinstance(cache, StaticKVCache) and (one_row or (S == 1 and 2 <= B <= ROPE_KV_MAX_ROWS))):
            return super().forward(x, position_ids, cache)
        from ..kernels.gemv_triton import gemv_qkv_rope, rope_kv_write

        cos, sin = cache.rope if cache.rope is not None else self.rotary_emb(x, position_ids)
        k_buf, v_buf = cache.k[self.layer_idx], cache.v[self.layer_idx]
        if one_row:
            q = gemv_qkv_rope(x.reshape(1, -1), self.qkv_weight, cos, sin, cache.pos, k_buf, v_buf, self.num_heads,
                              **_tiles())
        else:   # one position for every sequence: the first row's cos / sin are every row's
            q = rope_kv_write(linear(x.reshape(B, -1), self.qkv_weight), cos.reshape(-1, cos.shape[-1])[0],
                              sin.reshape(-1, sin.shape[-1])[0], cache.pos, k_buf, v_buf, self.num_heads)
        out = self.attend_decode(q, k_buf, v_buf, cache)
        return self.output(out.transpose(1, 2).reshape(B, S, -1))

    def project(self, x: torch.Tensor) -> tuple:
        kv = self.num_kv_heads * self.head_dim
        return self.heads(*linear(x, self.qkv_weight).split([self.num_heads * self.head_dim, kv, kv], dim=-1))

    def output(self, out: torch.Tensor) -> torch.Tensor:
        return linear(out, self.o_proj.weight)


class FusedSwiGLU(Variant, SwiGLU):
    """``SwiGLU`` with gate and up as one weight (``gate_up_weight``, gate rows then up rows), run by ``swiglu``."""

    gate_up_weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(swiglu(x, self.gate_up_weight), self.down_proj.weight)


class FusedGate(Variant, MoEGate):
    """``MoEGate`` with its fp32 GEMV by ``linear``; at decode size (``routes_in_kernel``) the Triton
    router (``router_triton.route``: GEMV, then softmax, top-k, renormalisation and scale in one
    kernel), which also takes the routing target's forced experts (``forced_inputs``) and can count
    the routing (``count``: into the target's ``device_counts`` at its device step index, one token
    only). Its k experts come in descending order (ties: lowest index), which may differ from
    torch.topk(sorted=False)'s order: the set is the same, and the experts' outputs are summed over k
    downstream (equal up to fp32 rounding order)."""

    def routes_in_kernel(self, rows: int, per_sequence: int = 1) -> bool:
        """Whether ``forward`` on ``rows`` token rows, ``per_sequence`` of them per batch row, runs the
        Triton router: one token, or a decode step (one token per sequence) of up to
        ``ROUTER_MAX_ROWS`` sequences (the forced table holds one position per sequence)."""
        return self.weight.shape[1] <= GEMV_MAX_K and (
            rows == 1 or (per_sequence == 1 and rows <= ROUTER_MAX_ROWS))

    def counts_in_kernel(self, rows: int) -> bool:
        """Whether ``forward`` can count the routing inside the Triton router (one token)."""
        return rows == 1 and self.routes_in_kernel(rows)

    def forward(self, x: torch.Tensor, routing=None, count: bool = False, logits_only: bool = False):
        """(idx, weights) as ``MoEGate``'s; ``logits_only``: the fp32 logits [T, experts] of the Triton
        router's GEMV alone (``grouped_moe.GroupedMoE.forward_routed_in_alignment`` chooses elsewhere)."""
        if logits_only:
            from ..kernels.router_triton import router_logits

            return router_logits(x.reshape(-1, x.shape[-1]), self.weight)
        rows = x.numel() // x.shape[-1]
        if count and not self.counts_in_kernel(rows):
            raise HarnessError("FusedGate: the routing count runs in the Triton router at one token only")
        if self.routes_in_kernel(rows, rows // x.shape[0] if x.dim() == 3 else rows):
            from ..kernels.router_triton import route

            return route(x.reshape(-1, x.shape[-1]), self.weight, self.top_k, self.norm_topk_prob, self.scale,
                         self.layer_idx, counts=routing.device_counts() if count else None,
                         forced=routing.forced_inputs() if routing is not None else None)
        return super().forward(x, routing)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x.reshape(-1, x.shape[-1]), self.weight, torch.float32)


class FusedLinears(Converter):
    """q/k/v and the dense / shared gate/up weights fused once (views: the state_dict is unchanged);
    every decoder attention, dense MLP, shared expert and router swapped to its fused class."""

    spec = knobs.FUSED_LINEARS

    def check(self, ex, device, dtype, model=None, positions=None) -> None:
        if self.active(ex):
            ok, why = triton_available(device)
            self.refuse(ok, f"needs Triton for its GEMV kernels: {why}", "use execution.linear_impl=vendor", here=True)

    def convert(self, model, ex, device, dtype) -> dict:
        if not self.active(ex):
            return {self.manifest_key: "vendor: one GEMM per nn.Linear"}
        for layer in model.model.layers:
            attn = layer.self_attn
            fused_weight(attn, "qkv_weight", [attn.q_proj, attn.k_proj, attn.v_proj])   # once: the Linears' views
            swap(attn, FusedAttention)
            moe = isinstance(layer.mlp, MoE)
            for mlp in [layer.mlp.shared_experts] if moe else [layer.mlp]:
                fused_weight(mlp, "gate_up_weight", [mlp.gate_proj, mlp.up_proj])
                swap(mlp, FusedSwiGLU)
            if moe:
                swap(layer.mlp.gate, FusedGate)
        return {self.manifest_key: (
            f"fused: q/k/v and dense/shared gate/up as one weight each; at <= {GEMV_MAX_ROWS} token(s) Triton GEMV "
            f"kernels for K <= {GEMV_MAX_K}, the router's softmax, top-k, scale and routing count one Triton kernel "
            f"after its GEMV (the router so up to {ROUTER_MAX_ROWS} decode rows); with the static cache q/k/v, RoPE "
            "and the KV write one kernel"
            + (f" (at 2-{ROPE_KV_MAX_ROWS} sequences RoPE and the KV write one kernel after the q/k/v GEMM)"
               if ROPE_KV_MAX_ROWS > 1 else "") + "; with moe_kernel=triton "
            "the shared expert as extra rows of the routed-expert kernels; cuBLAS otherwise")}


FUSED_LINEARS = FusedLinears()
