"""DeepSeek-V2-style decoder as DeepSeek-OCR runs it: MHA + RoPE, dense SwiGLU in layer 0,
MoE (64 routed experts, top-6 softmax gate, 2 shared) in layers 1-11.

One path, the vendor's (transformers 4.46.3 LlamaAttention + DeepseekV2MoE.moe_infer): fp32
RMSNorm and gate, a per-expert Python loop after a device-to-host copy of the expert counts, and
a KV cache that grows by concatenation each step. The execution variants
(``harness.config.ExecutionConfig``) are module classes of ``harness.variants`` that extend these
and are swapped in by its converters (a static KV cache, sync-free routed experts, fused linears,
a Triton decode attention); ``Attention.project`` / ``output`` and ``MoEGate.logits`` are the
steps they replace. Tensors are [B, S, hidden].
"""
from __future__ import annotations

import math
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..config import LLMConfig
from ..attn_support import FLASH_ATTN_SETUP
from ..errors import HarnessError
from . import attn_probe


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
        # built on ``meta`` (``build_model``): a placeholder of the right shape, filled after ``to_empty``
        # (arithmetic on meta tensors goes through torch._refs, which imports torch._dynamo: 1.7 s)
        inv = (torch.empty(head_dim // 2) if torch.get_default_device().type == "meta"
               else self.compute_inv_freq())
        self.register_buffer("inv_freq", inv, persistent=False)

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


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    """q, k [B, heads, S, d] rotated by cos, sin [B, S, d]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def flash_attn_func_or_error():
    try:
        from flash_attn import flash_attn_func  # type: ignore
    except ImportError as exc:
        raise HarnessError(
            "attn_implementation=flash_attention_2 needs the flash-attn package, which is not importable "
            f"({exc.__class__.__name__}: {exc})",
            f"build and install it with `{FLASH_ATTN_SETUP}` (docs/vendor-model.md: CUDA set-up), or use "
            "model.attn_implementation=sdpa_flash (torch SDPA pinned to its FlashAttention kernel)") from None
    return flash_attn_func


class Attention(nn.Module):
    """q/k/v/o projections (no bias), RoPE, causal attention against the growing KV cache."""

    def __init__(self, cfg: LLMConfig, layer_idx: int, impl: str):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.layer_idx = layer_idx
        self.impl = impl
        self.q_proj = nn.Linear(h, cfg.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, h, bias=False)
        self.rotary_emb = RotaryEmbedding(hd, cfg.rope_theta)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, cache: "KVCache") -> torch.Tensor:
        B, S, _ = x.shape
        cos, sin = self.rotary_emb(x, position_ids)
        q, k, v = self.project(x)
        q, k = apply_rope(q, k, cos, sin)
        k, v = cache.update(self.layer_idx, k, v)     # k, v hold exactly the positions so far
        out = self.attend(q, *self.repeat_kv(k, v))
        return self.output(out.transpose(1, 2).reshape(B, S, -1))

    def project(self, x: torch.Tensor) -> tuple:
        """x [B, S, hidden] -> q [B, heads, S, d], k, v [B, kv_heads, S, d]."""
        return self.heads(self.q_proj(x), self.k_proj(x), self.v_proj(x))

    def heads(self, q, k, v) -> tuple:
        """q, k, v [B, S, heads * d] -> [B, heads, S, d] views."""
        B, S = q.shape[:2]
        return (q.view(B, S, self.num_heads, self.head_dim).transpose(1, 2),
                k.view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2),
                v.view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2))

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """[B, S, heads * d] -> [B, S, hidden]: o_proj."""
        return self.o_proj(out)

    def repeat_kv(self, k, v):
        """KV heads repeated to the query heads (GQA; a no-op when they are equal)."""
        if self.num_kv_heads == self.num_heads:
            return k, v
        rep = self.num_heads // self.num_kv_heads
        return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)

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
    """down(silu(gate(x)) * up(x)); names as the vendor's DeepseekV2MLP."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEGate(nn.Module):
    """fp32 softmax over expert logits, greedy top-k (unsorted), optional renormalisation, scale.

    ``routing`` (``forward``): the request's routing target that ``MoE.routing`` holds
    (``harness.models.routing``). Under ``workload.routing=balanced`` it holds the request's forced
    experts for this layer (``forced_experts``): they replace the top-k, and their weights are the
    softmax probabilities at them (``select``). This is the one place forced routing enters the
    model; every execution's gate (``variants.fused_linears.FusedGate`` too) reads it here.
    """

    def __init__(self, cfg: LLMConfig, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scale = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))

    def forward(self, x: torch.Tensor, routing=None):
        """(idx int64 [T, k], weights fp32 [T, k]) of x [B, S, hidden] (or [T, hidden])."""
        return self.select(self.logits(x), self.forced(x, routing))

    def forced(self, x: torch.Tensor, routing):
        """``routing``'s forced experts of x's tokens (experts [T, k], on), or None: the weights' routing."""
        if routing is None:
            return None
        batch = x.shape[0]
        return routing.forced_experts(self.layer_idx, batch, x.numel() // x.shape[-1] // batch)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 expert logits [T, experts] (the vendor's F.linear of fp32 casts)."""
        return F.linear(x.reshape(-1, x.shape[-1]).float(), self.weight.float())

    def select(self, logits: torch.Tensor, forced=None):
        """Softmax, top-k, renormalisation and scale of fp32 logits [T, experts]. ``forced`` = (experts
        [T, k], on): those experts at their softmax probabilities instead of the top-k (where the
        runtime flag ``on`` [1] holds, when it is given)."""
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        if forced is None:
            w, idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        else:
            experts, on = forced
            idx = experts if on is None else torch.where(
                on, experts, torch.topk(scores, k=self.top_k, dim=-1, sorted=False)[1])
            w = scores.gather(-1, idx)
        if self.top_k > 1 and self.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, w * self.scale


class MoE(nn.Module):
    """Routed experts + shared expert. ``moe_infer`` is the vendor's per-expert loop.

    ``routing``: the request's routing target (``harness.models.routing``; set by the model for one
    request): it receives each call's routing (``add_host``) and hands the gate any forced experts.
    ``uniform_counts``: split the routed rows uniformly over the experts instead of reading the real
    counts from the device (no host sync, so it runs on ``meta`` tensors): the exactness check
    counts FLOPs that way (``harness.analytic.check``); every routed row still passes exactly one
    expert's three GEMMs.
    """

    def __init__(self, cfg: LLMConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.experts = nn.ModuleList(SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size)
                                     for _ in range(cfg.n_routed_experts))
        self.gate = MoEGate(cfg, layer_idx)
        self.shared_experts = SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
        self.routing = None
        self.uniform_counts = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        idx, w = self.gate(x, self.routing)
        y = self.moe_infer(x.reshape(-1, shape[-1]), idx, w)
        return y.view(*shape) + self.shared_experts(x)

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

    def forward(self, x, position_ids, cache):
        x = x + self.self_attn(self.input_layernorm(x), position_ids, cache)
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
