"""DeepEncoder: SAM ViT-B, CLIP-L over SAM features, and the linear projector.

Our own implementation of the vendor architecture. Parameter names and shapes equal the vendor
checkpoint under ``model.sam_model``, ``model.vision_model`` and ``model.projector``.
Shapes: SAM takes [N, 3, S, S] pixels and returns [N, 1024, S/64, S/64]; CLIP returns
[N, 1 + (S/64)^2, 1024]; the projector maps [N, (S/64)^2, 2048] -> [N, (S/64)^2, 1280].
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import CLIPConfig, ProjectorConfig, SAMConfig
from . import attn_probe


def resize_pos_2d(pos: torch.Tensor, size: int) -> torch.Tensor:
    """Bicubic (antialiased, fp32) resize of a [1, G, G, C] grid embedding to [1, size, size, C]."""
    if pos.shape[1] == size:
        return pos
    out = F.interpolate(pos.permute(0, 3, 1, 2).float(), size=(size, size), mode="bicubic",
                        antialias=True, align_corners=False)
    return out.to(pos.dtype).permute(0, 2, 3, 1)


def rel_pos_table(q_size: int, k_size: int, rel_pos: torch.Tensor) -> torch.Tensor:
    """Relative-position rows [q_size, k_size, C] for one axis (linear resize when lengths differ)."""
    max_rel = 2 * max(q_size, k_size) - 1
    if rel_pos.shape[0] != max_rel:
        resized = F.interpolate(rel_pos.float().reshape(1, rel_pos.shape[0], -1).permute(0, 2, 1),
                                size=max_rel, mode="linear").to(rel_pos.dtype)
        rel_pos = resized.reshape(-1, max_rel).permute(1, 0)
    q_coords = torch.arange(q_size, device=rel_pos.device)[:, None] * max(k_size / q_size, 1.0)
    k_coords = torch.arange(k_size, device=rel_pos.device)[None, :] * max(q_size / k_size, 1.0)
    rel = (q_coords - k_coords) + (k_size - 1) * max(q_size / k_size, 1.0)
    return rel_pos[rel.long()]


class LayerNorm2d(nn.Module):
    """LayerNorm over the channel axis of NCHW maps (computed as the vendor writes it)."""

    def __init__(self, channels: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class PatchEmbed(nn.Module):
    """Conv patchify: [N, 3, S, S] -> [N, S/16, S/16, C] (channels last)."""

    def __init__(self, patch: int, in_chans: int, dim: int):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=patch, stride=patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).permute(0, 2, 3, 1)


class SAMAttention(nn.Module):
    """MHA over a [B, H, W, C] grid with decomposed relative position as a dense SDPA mask (the
    vendor's execution). ``ExecutionConfig.vision_impl = fused`` swaps in a subclass computing the same
    function without the S x S mask (``harness.variants.fused_vision.AugmentedSAMAttention``)."""

    def __init__(self, dim: int, heads: int, input_size: int):
        super().__init__()
        self.num_heads = heads
        head_dim = dim // heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.rel_pos_h = nn.Parameter(torch.zeros(2 * input_size - 1, head_dim))
        self.rel_pos_w = nn.Parameter(torch.zeros(2 * input_size - 1, head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, _ = x.shape
        nh = self.num_heads
        qkv = self.qkv(x).reshape(B, H * W, 3, nh, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.reshape(3, B * nh, H * W, -1).unbind(0)
        Rh = rel_pos_table(H, H, self.rel_pos_h)
        Rw = rel_pos_table(W, W, self.rel_pos_w)
        r_q = q.reshape(B * nh, H, W, -1)
        rel_h = torch.einsum("bhwc,hkc->bhwk", r_q, Rh).reshape(B * nh, H * W, H, 1)
        rel_w = torch.einsum("bhwc,wkc->bhwk", r_q, Rw).reshape(B * nh, H * W, 1, W)
        bias = (rel_h.view(B, nh, H * W, H, 1) + rel_w.view(B, nh, H * W, 1, W)).view(B, nh, H * W, H * W)
        q, k, v = (t.view(B, nh, H * W, -1) for t in (q, k, v))
        if not attn_probe.seen_once("sam"):
            attn_probe.note("sam", attn_probe.sdpa_choice(q, k, v, bias))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        out = out.view(B, nh, H, W, -1).permute(0, 2, 3, 1, 4).reshape(B, H, W, -1)
        return self.proj(out)


class SAMMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.lin1 = nn.Linear(dim, hidden)
        self.lin2 = nn.Linear(hidden, dim)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.act(self.lin1(x)))


def window_partition(x: torch.Tensor, ws: int):
    """[B, H, W, C] -> [B * nW, ws, ws, C], zero-padding H and W up to multiples of ws."""
    B, H, W, C = x.shape
    ph, pw = (ws - H % ws) % ws, (ws - W % ws) % ws
    if ph or pw:
        x = F.pad(x, (0, 0, 0, pw, 0, ph))
    Hp, Wp = H + ph, W + pw
    x = x.view(B, Hp // ws, ws, Wp // ws, ws, C).permute(0, 1, 3, 2, 4, 5).contiguous()
    return x.view(-1, ws, ws, C), (Hp, Wp)


def window_unpartition(w: torch.Tensor, ws: int, pad_hw, hw) -> torch.Tensor:
    Hp, Wp = pad_hw
    H, W = hw
    B = w.shape[0] // (Hp * Wp // ws // ws)
    x = w.view(B, Hp // ws, Wp // ws, ws, ws, -1).permute(0, 1, 3, 2, 4, 5).contiguous().view(B, Hp, Wp, -1)
    if Hp > H or Wp > W:
        x = x[:, :H, :W, :].contiguous()
    return x


class SAMBlock(nn.Module):
    """Pre-LN ViT block; windowed (window_size > 0, padded) or global attention."""

    def __init__(self, cfg: SAMConfig, window_size: int):
        super().__init__()
        dim = cfg.embed_dim
        grid = cfg.img_size // cfg.patch_size
        self.norm1 = nn.LayerNorm(dim, eps=cfg.ln_eps)
        self.attn = SAMAttention(dim, cfg.num_heads, window_size if window_size > 0 else grid)
        self.norm2 = nn.LayerNorm(dim, eps=cfg.ln_eps)
        self.mlp = SAMMLP(dim, int(dim * cfg.mlp_ratio))
        self.window_size = window_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x = self.norm1(x)
        if self.window_size > 0:
            H, W = x.shape[1], x.shape[2]
            x, pad_hw = window_partition(x, self.window_size)
        x = self.attn(x)
        if self.window_size > 0:
            x = window_unpartition(x, self.window_size, pad_hw, (H, W))
        x = shortcut + x
        return x + self.mlp(self.norm2(x))


class SAMEncoder(nn.Module):
    """SAM ViT-B + neck (1x1 conv, LN2d, 3x3 conv, LN2d) + net_2/net_3 (3x3 stride-2 convs)."""

    def __init__(self, cfg: SAMConfig):
        super().__init__()
        grid = cfg.img_size // cfg.patch_size
        self.patch_embed = PatchEmbed(cfg.patch_size, 3, cfg.embed_dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, grid, grid, cfg.embed_dim))
        self.blocks = nn.ModuleList(
            SAMBlock(cfg, 0 if i in cfg.global_attn_indexes else cfg.window_size) for i in range(cfg.depth))
        oc = cfg.out_chans
        self.neck = nn.Sequential(
            nn.Conv2d(cfg.embed_dim, oc, kernel_size=1, bias=False), LayerNorm2d(oc),
            nn.Conv2d(oc, oc, kernel_size=3, padding=1, bias=False), LayerNorm2d(oc))
        c2, c3 = cfg.downsample_channels
        self.net_2 = nn.Conv2d(oc, c2, kernel_size=3, stride=2, padding=1, bias=False)
        self.net_3 = nn.Conv2d(c2, c3, kernel_size=3, stride=2, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        x = x + resize_pos_2d(self.pos_embed, x.size(1))
        for blk in self.blocks:
            x = blk(x)
        x = self.neck(x.permute(0, 3, 1, 2))
        x2 = self.net_2(x)
        return self.net_3(x2.clone())  # the vendor clones here; kept for identical kernels


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


class CLIPEmbeddings(nn.Module):
    """CLS + SAM features as patch embeddings + bicubic-resized absolute positions."""

    def __init__(self, cfg: CLIPConfig):
        super().__init__()
        n_pos = (cfg.image_size // cfg.patch_size) ** 2 + 1
        self.class_embedding = nn.Parameter(torch.zeros(cfg.hidden_size))
        # In the checkpoint but unused at inference: SAM's net_3 output replaces it.
        self.patch_embedding = nn.Conv2d(3, cfg.hidden_size, kernel_size=cfg.patch_size,
                                         stride=cfg.patch_size, bias=False)
        self.position_embedding = nn.Embedding(n_pos, cfg.hidden_size)

    def positions(self, n_tokens: int) -> torch.Tensor:
        """[1, n_tokens, C]: CLS row kept, the patch grid resized when its side differs."""
        table = self.position_embedding.weight
        src = int(math.sqrt(table.shape[0] - 1))
        tgt = int(math.sqrt(n_tokens - 1))
        if src == tgt:
            return table[None]
        grid = resize_pos_2d(table[1:].view(1, src, src, -1), tgt).reshape(tgt * tgt, -1)
        return torch.cat([table[:1], grid], dim=0)[None]

    def forward(self, patch_embeds: torch.Tensor) -> torch.Tensor:
        x = patch_embeds.flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1)
        return x + self.positions(x.size(1))


class CLIPAttention(nn.Module):
    def __init__(self, cfg: CLIPConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        qkv = self.qkv_proj(x).view(B, S, 3, self.num_heads, self.head_dim)
        q, k, v = (t.squeeze(2).permute(0, 2, 1, 3) for t in torch.split(qkv, 1, dim=2))
        if not attn_probe.seen_once("clip"):
            attn_probe.note("clip", attn_probe.sdpa_choice(q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.permute(0, 2, 1, 3).reshape(B, S, -1))


class CLIPMLP(nn.Module):
    def __init__(self, cfg: CLIPConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size)
        self.fc2 = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(quick_gelu(self.fc1(x)))


class CLIPBlock(nn.Module):
    def __init__(self, cfg: CLIPConfig):
        super().__init__()
        self.self_attn = CLIPAttention(cfg)
        self.mlp = CLIPMLP(cfg)
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.ln_eps)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.ln_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn(self.layer_norm1(x))
        return h + self.mlp(self.layer_norm2(h))


class CLIPTransformer(nn.Module):
    def __init__(self, cfg: CLIPConfig):
        super().__init__()
        self.layers = nn.ModuleList(CLIPBlock(cfg) for _ in range(cfg.num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class CLIPEncoder(nn.Module):
    """CLIP-L: embeddings, pre_layrnorm (vendor spelling), 24 pre-LN blocks."""

    def __init__(self, cfg: CLIPConfig):
        super().__init__()
        self.embeddings = CLIPEmbeddings(cfg)
        self.transformer = CLIPTransformer(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.pre_ln_eps)

    def forward(self, sam_features: torch.Tensor) -> torch.Tensor:
        return self.transformer(self.pre_layrnorm(self.embeddings(sam_features)))


class Projector(nn.Module):
    """Linear 2048 -> 1280 over cat(CLIP tokens without CLS, SAM features)."""

    def __init__(self, cfg: ProjectorConfig):
        super().__init__()
        self.layers = nn.Linear(cfg.input_dim, cfg.n_embed)

    def forward(self, clip_out: torch.Tensor, sam_out: torch.Tensor) -> torch.Tensor:
        x = torch.cat((clip_out[:, 1:], sam_out.flatten(2).permute(0, 2, 1)), dim=-1)
        return self.layers(x)
