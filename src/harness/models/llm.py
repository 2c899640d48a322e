"""DeepSeek-V2-style decoder as DeepSeek-OCR runs it: MHA + RoPE, dense SwiGLU in layer 0,
MoE (64 routed experts, top-6 softmax gate, 2 shared) in layers 1-11.

Execution follows the vendor by default (transformers 4.46.3 LlamaAttention +
DeepseekV2MoE.moe_infer): fp32 RMSNorm and gate, a per-expert Python loop after a device-to-host
copy of the expert counts, and a KV cache that grows by concatenation each step. The execution
variants (``harness.config.ExecutionConfig``) compute the same function differently: a
``StaticKVCache`` (preallocated, written in place; decode attends over the whole buffer with a
mask, or with ``Attention.decode_attention = "triton"`` over positions 0..pos only) and sync-free
routed experts (``MoE.impl = "grouped"``, ``fast_moe.routed_experts``).
Tensors are [B, S, hidden].
"""
from __future__ import annotations

import math
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..config import LLMConfig
from ..errors import HarnessError
from . import attn_probe, fused_linear
from .static_cache import StaticKVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin [B, S, head_dim] in fp32 from positions, cast to the activation dtype."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self, device=None) -> torch.Tensor:
        idx = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float()
        return 1.0 / (self.theta ** (idx / self.head_dim))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        pos = position_ids[:, None, :].float()
        freqs = (inv @ pos).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def flash_attn_func_or_error():
    try:
        from flash_attn import flash_attn_func  # type: ignore
    except ImportError as exc:
        raise HarnessError(
            "attn_implementation=flash_attention_2 needs the flash-attn package, which is not importable "
            f"({exc.__class__.__name__}: {exc})",
            "install the `cuda` extra (pip install flash-attn) or use model.attn_implementation=sdpa_flash "
            "(torch SDPA pinned to its FlashAttention kernel)") from None
    return flash_attn_func


class Attention(nn.Module):
    """q/k/v/o projections (no bias), RoPE, causal attention against the KV cache."""

    def __init__(self, cfg: LLMConfig, layer_idx: int, impl: str):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.layer_idx = layer_idx
        self.impl = impl
        self.decode_attention = "sdpa"   # static-cache decode: sdpa | triton (DeepseekOCR.configure sets it)
        self.q_proj = nn.Linear(h, cfg.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, h, bias=False)
        self.rotary_emb = RotaryEmbedding(hd, cfg.rope_theta)
        self.qkv_weight = None          # linear_impl=fused: q/k/v weights as one tensor (fused_linear)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, cache: "KVCache", rope=None) -> torch.Tensor:
        """``rope``: (cos, sin) computed once for all layers by the caller, else from ``position_ids``."""
        B, S, _ = x.shape
        static = isinstance(cache, StaticKVCache)
        cos, sin = self.rotary_emb(x, position_ids) if rope is None else rope
        if static and self.qkv_weight is not None and fused_linear.gemv_fits(B * S, x.shape[-1]):
            # one token, static cache: q/k/v GEMV, RoPE and the KV write in one kernel (gemv_triton)
            from ..kernels.gemv_triton import gemv_qkv_rope

            q = gemv_qkv_rope(x.reshape(1, -1), self.qkv_weight, cos, sin, cache.pos, cache.k[self.layer_idx],
                              cache.v[self.layer_idx], self.num_heads)
            out = self.attend_masked(q, cache.k[self.layer_idx], cache.v[self.layer_idx], cache)
            return fused_linear.linear(out.transpose(1, 2).reshape(B, S, -1), self.o_proj.weight)
        if self.qkv_weight is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            kv = self.num_kv_heads * self.head_dim
            q, k, v = fused_linear.linear(x, self.qkv_weight).split([self.num_heads * self.head_dim, kv, kv], dim=-1)
        q = q.view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        filled = cache.length                      # host: positions already in the cache
        k, v = cache.update(self.layer_idx, k, v)
        if static and S == 1:                      # static cache, decode: the whole buffer, masked
            out = self.attend_masked(q, k, v, cache)
        else:
            k, v = self.repeat_kv(k, v)
            if not static:                         # growing cache: k, v hold exactly the positions so far
                out = self.attend(q, k, v)
            else:                                  # static cache, prefill: the first filled + S positions
                T = filled + S
                out = self.attend(q, k[:, :, :T], v[:, :, :T])
        out = out.transpose(1, 2).reshape(B, S, -1)
        if self.qkv_weight is None:
            return self.o_proj(out)
        return fused_linear.linear(out, self.o_proj.weight)

    def repeat_kv(self, k, v):
        """KV heads repeated to the query heads (GQA; a no-op when they are equal)."""
        if self.num_kv_heads == self.num_heads:
            return k, v
        rep = self.num_heads // self.num_kv_heads
        return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)

    def attend_masked(self, q, k, v, cache: "StaticKVCache") -> torch.Tensor:
        """One query [B, nh, 1, d] against a whole static buffer [B, nkv, L, d] with ``cache.mask``
        [1, L] (True = a filled position). Same function as ``attend`` over the filled positions:
        masked keys get weight exactly 0. Fixed shapes, so it can be captured in a CUDA graph.

        ``decode_attention`` (set by ``DeepseekOCR.configure``): ``sdpa`` runs over the whole buffer
        with the mask (or the eager matmuls for ``impl == "eager"``); ``triton`` runs the split-KV
        kernel of ``decode_attention_triton``, which reads only positions 0..``cache.pos`` (the
        step's position, int64 [1] on the device), needs no mask (none is built) and combines its
        splits in the last one to finish (``cache.split_sem``)."""
        pos = cache.pos
        use_triton = self.decode_attention == "triton"
        path = "triton" if use_triton else f"masked-{self.impl}"
        if self.layer_idx == 0 and attn_probe.first_time("llm_decode", path):
            attn_probe.note("llm_decode",
                            "triton:decode_attention_triton (split-KV, positions 0..pos only)" if use_triton
                            else "eager:matmul+softmax (masked static cache)" if self.impl == "eager"
                            else attn_probe.sdpa_choice(q, *self.repeat_kv(k, v), cache.mask))
        if use_triton:
            if pos is None:
                raise HarnessError("decode_attention=triton needs the step's position", "pass cache.pos")
            from ..kernels.decode_attention_triton import decode_attention

            return decode_attention(q, k, v, pos, sem=cache.split_sem)
        mask = cache.mask
        k, v = self.repeat_kv(k, v)
        if self.impl == "eager":
            w = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
            w = w.masked_fill(~mask, torch.finfo(w.dtype).min)
            w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
            return torch.matmul(w, v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def attend(self, q, k, v) -> torch.Tensor:
        """[B, nh, S, d] x [B, nh, T, d] -> [B, nh, S, d]; causal with the query block at the end of T."""
        S, T = q.shape[2], k.shape[2]
        site = "llm_prefill" if S > 1 else "llm_decode"
        if self.layer_idx == 0 and not attn_probe.seen_once(site):
            attn_probe.note(site, self.backend_name(q, k, v, S, T))
        if self.impl == "eager":
            w = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
            if S > 1:
                mask = torch.full((S, T), torch.finfo(w.dtype).min, device=w.device, dtype=w.dtype)
                mask = torch.triu(mask, diagonal=T - S + 1)
                w = w + mask
            w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
            return torch.matmul(w, v)
        if self.impl == "flash_attention_2":
            fn = flash_attn_func_or_error()
            o = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=S > 1)
            return o.transpose(1, 2)
        causal = S > 1
        if causal and S != T:  # prefill continuing a cache: explicit bottom-right mask
            mask = torch.ones(S, T, dtype=torch.bool, device=q.device).tril(diagonal=T - S)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        if self.impl == "sdpa_flash":
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


    def backend_name(self, q, k, v, S, T) -> str:
        if self.impl == "eager":
            return "eager:matmul+softmax"
        if self.impl == "flash_attention_2":
            return "flash_attn:flash_attn_func"
        if self.impl == "sdpa_flash":
            return "sdpa:flash_attention (pinned)"
        mask = torch.ones(S, T, dtype=torch.bool, device=q.device) if S > 1 and S != T else None
        return attn_probe.sdpa_choice(q, k, v, mask, is_causal=S > 1 and S == T)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); names as the vendor's DeepseekV2MLP. ``gate_up_weight``
    (linear_impl=fused): gate and up weights as one tensor, run by ``fused_linear.swiglu``."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.gate_up_weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return fused_linear.linear(fused_linear.swiglu(x, self.gate_up_weight), self.down_proj.weight)


class MoEGate(nn.Module):
    """fp32 softmax over expert logits, greedy top-k (unsorted), optional renormalisation, scale."""

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scale = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.fused = False              # linear_impl=fused: fused_linear.linear with fp32 output

    def routes_in_kernel(self, rows: int) -> bool:
        """Whether ``forward`` on ``rows`` token rows runs the Triton router (``router_triton.route``:
        linear_impl=fused at decode size)."""
        return self.fused and fused_linear.gemv_fits(rows, self.weight.shape[1])

    def counts_in_kernel(self, rows: int) -> bool:
        """Whether ``forward`` can count the routing inside the Triton router (one token)."""
        return rows == 1 and self.routes_in_kernel(rows)

    def forward(self, x: torch.Tensor, counts: tuple | None = None):
        """(idx int64 [T, k], weights fp32 [T, k]). ``counts`` (a routing target's ``device_target``):
        the Triton router also counts the routing there (one token only: ``counts_in_kernel``)."""
        if counts is not None and not self.counts_in_kernel(x.numel() // x.shape[-1]):
            raise HarnessError("MoEGate: the routing count runs in the Triton router at one token only")
        if self.routes_in_kernel(x.numel() // x.shape[-1]):
            # gate GEMV, then softmax, top-k, renormalisation and scale in one Triton kernel. Its k
            # experts come in descending order (ties: lowest index), which may differ from
            # torch.topk(sorted=False)'s order: the set is the same, and the experts' outputs are
            # summed over k downstream (equal up to fp32 rounding order).
            from ..kernels.router_triton import route
            return route(x.reshape(-1, x.shape[-1]), self.weight, self.top_k, self.norm_topk_prob, self.scale, counts)
        if self.fused:
            logits = fused_linear.linear(x.reshape(-1, x.shape[-1]), self.weight, torch.float32)
        else:
            logits = F.linear(x.reshape(-1, x.shape[-1]).float(), self.weight.float())
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        w, idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        if self.top_k > 1 and self.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, w * self.scale


class MoE(nn.Module):
    """Routed experts + shared expert. ``moe_infer`` is the vendor's per-expert loop.

    ``routing``: a ``RoutingCounter`` (or ``DeviceCounts``) that receives each call's routing (set
    by the model for one request). ``uniform_counts``: split the routed rows uniformly over the
    experts instead of reading the real counts from the device (no host sync, so it runs on
    ``meta`` tensors): the exactness check counts FLOPs that way (``harness.analytic.check``);
    every routed row still passes exactly one expert's three GEMMs. ``impl``: ``vendor_loop`` or
    ``grouped`` (``fast_moe.routed_experts`` with ``kernel`` over the stacked ``experts_stacked``:
    no host sync; the routing goes to ``routing.add_device``).
    """

    def __init__(self, cfg: LLMConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.experts = nn.ModuleList(SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size)
                                     for _ in range(cfg.n_routed_experts))
        self.gate = MoEGate(cfg)
        self.shared_experts = SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
        self.routing = None
        self.uniform_counts = False
        self.impl, self.kernel, self.experts_stacked = "vendor_loop", "torch", None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.impl == "vendor_loop":
            idx, w = self.gate(x)
            y = self.moe_infer(x.reshape(-1, shape[-1]), idx, w)
        else:
            from .fast_moe import routed_experts

            if self.routing is not None and self.gate.counts_in_kernel(x.numel() // shape[-1]):
                idx, w = self.gate(x, self.routing.device_target(self.layer_idx, x.device))
            else:
                idx, w = self.gate(x)
                if self.routing is not None:
                    self.routing.add_device(self.layer_idx, idx)
            sh = self.shared_experts
            if self.shares_kernels(idx.numel()):
                return routed_experts(x.reshape(-1, shape[-1]), idx, w, self.experts_stacked, self.kernel,
                                      shared=(sh.gate_up_weight, sh.down_proj.weight)).view(*shape)
            y = routed_experts(x.reshape(-1, shape[-1]), idx, w, self.experts_stacked, self.kernel)
        return y.view(*shape) + self.shared_experts(x)

    def shares_kernels(self, routed_rows: int) -> bool:
        """Whether the shared expert runs as extra rows of the routed kernels (``fast_moe.folds_shared``:
        moe kernel triton at decode size) rather than as its own GEMVs: with linear_impl=fused, whose
        fused gate/up weight those kernels read."""
        from .fast_moe import folds_shared

        return self.shared_experts.gate_up_weight is not None and folds_shared(self.kernel, routed_rows)

    def moe_infer(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        n_exp = len(self.experts)
        if self.uniform_counts:
            rows = topk_ids.numel()
            tokens_per_expert = np.array([rows // n_exp + (1 if i < rows % n_exp else 0) for i in range(n_exp)])
        else:
            cnts = topk_ids.new_zeros((topk_ids.shape[0], n_exp))
            cnts.scatter_(1, topk_ids, 1)
        idxs = topk_ids.view(-1).argsort()
        sorted_tokens = x[idxs // topk_ids.shape[1]]
        if not self.uniform_counts:
            tokens_per_expert = cnts.sum(dim=0).cpu().numpy()  # host sync, as the vendor does
        if self.routing is not None:
            self.routing.add_host(self.layer_idx, tokens_per_expert)
        outputs, start = [], 0
        for i, n in enumerate(tokens_per_expert):
            if n == 0:
                continue
            outputs.append(self.experts[i](sorted_tokens[start:start + int(n)]))
            start += int(n)
        outs = torch.cat(outputs, dim=0) if outputs else sorted_tokens.new_empty(0)
        new_x = torch.empty_like(outs)
        new_x[idxs] = outs
        return (new_x.view(*topk_ids.shape, -1).type(topk_w.dtype).mul_(topk_w.unsqueeze(-1))
                .sum(dim=1).type(new_x.dtype))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LLMConfig, layer_idx: int, impl: str):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, impl)
        self.mlp = (MoE(cfg, layer_idx) if layer_idx >= cfg.first_k_dense_replace
                    else SwiGLU(cfg.hidden_size, cfg.intermediate_size))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, position_ids, cache, rope=None):
        x = x + self.self_attn(self.input_layernorm(x), position_ids, cache, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class KVCache:
    """Per-layer K/V [B, kv_heads, T, head_dim], grown with torch.cat (HF DynamicCache style)."""

    def __init__(self, num_layers: int):
        self.k: list = [None] * num_layers
        self.v: list = [None] * num_layers

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k, v
        else:
            self.k[layer] = torch.cat([self.k[layer], k], dim=-2)
            self.v[layer] = torch.cat([self.v[layer], v], dim=-2)
        return self.k[layer], self.v[layer]

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[-2]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)
