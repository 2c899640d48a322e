"""Reference DeepSeek-OCR: the whole model in our own PyTorch, with the vendor checkpoint's
state_dict names (``model.*`` and ``lm_head.weight``) and shapes.

A request runs as stages (see ``stages.py``): per view (tiles, then the global view in Gundam
mode) ``sam`` -> ``clip`` -> ``projector``; then ``prefill`` (embed, scatter image embeddings,
12 decoder layers, norm, lm_head) and ``decode`` (one ``decode_step`` per token, greedy).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional

import numpy as np
import torch
from torch import nn

from ..config import ModelConfig
from ..errors import HarnessError
from .llm import ATTN_IMPLEMENTATIONS, DecoderLayer, KVCache, MoE, RMSNorm
from .vision import CLIPEncoder, Projector, SAMEncoder

StageFn = Callable[..., ContextManager]


def no_stage(name: str, **payload) -> ContextManager:
    return contextlib.nullcontext()


class DeepseekOCRModel(nn.Module):
    """``model.*``: vision encoders, projector, separators, token embedding, decoder, norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        llm = cfg.llm
        self.sam_model = SAMEncoder(cfg.sam)
        self.vision_model = CLIPEncoder(cfg.clip)
        self.projector = Projector(cfg.projector)
        self.image_newline = nn.Parameter(torch.zeros(cfg.projector.n_embed))
        self.view_seperator = nn.Parameter(torch.zeros(cfg.projector.n_embed))  # vendor spelling
        self.embed_tokens = nn.Embedding(llm.vocab_size, llm.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(llm, i, cfg.attn_implementation)
                                    for i in range(llm.num_layers))
        self.norm = RMSNorm(llm.hidden_size, llm.rms_norm_eps)


@dataclass
class GenerationResult:
    """Greedy tokens [B, decode_tokens] and per-layer routed-expert token counts.

    ``routing[phase]`` is an int64 array [num_layers, n_routed_experts] (rows of dense layers
    are zero); ``phase`` is ``prefill`` or ``decode`` (summed over steps).
    """

    tokens: torch.Tensor
    routing: dict = field(default_factory=dict)
    kv_cache_bytes: int = 0
    host_ms: dict = field(default_factory=dict)


class DeepseekOCR(nn.Module):
    """Top level (``DeepseekOCRForCausalLM`` in the vendor code): ``model`` + ``lm_head``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise HarnessError(f"unknown attn_implementation {cfg.attn_implementation!r}",
                               f"use one of {', '.join(ATTN_IMPLEMENTATIONS)}")
        if cfg.clip.hidden_size != cfg.sam.downsample_channels[-1]:
            raise HarnessError("clip.hidden_size must equal sam.downsample_channels[-1] (SAM features are "
                               "CLIP's patch embeddings)", "fix the model config")
        if cfg.projector.input_dim != 2 * cfg.clip.hidden_size or cfg.projector.n_embed != cfg.llm.hidden_size:
            raise HarnessError("projector must map 2 x clip.hidden_size to llm.hidden_size", "fix the model config")
        self.cfg = cfg
        self.model = DeepseekOCRModel(cfg)
        self.lm_head = nn.Linear(cfg.llm.hidden_size, cfg.llm.vocab_size, bias=False)
        self._routing: Optional[np.ndarray] = None

    # ----------------------------------------------------------------- vision
    def encode_view(self, pixels: torch.Tensor, stage: StageFn = no_stage, call: int = 0) -> torch.Tensor:
        """[N, 3, S, S] pixels -> [N, (S/64)^2, hidden] projected image tokens (no separators)."""
        m = self.model
        with stage("sam", call=call):
            sam_out = m.sam_model(pixels)
        with stage("clip", call=call):
            clip_out = m.vision_model(sam_out)
        with stage("projector", call=call):
            return m.projector(clip_out, sam_out)

    def layout_view(self, feats: torch.Tensor, grid=None) -> torch.Tensor:
        """Add ``image_newline`` after each row: [B*(c*r), q*q, D] -> [B, (q*r)*(q*c+1), D]."""
        n, hw, d = feats.shape
        q = int(hw ** 0.5)
        cols, rows = grid or (1, 1)
        b = n // (cols * rows)
        x = feats.view(b, rows, cols, q, q, d).permute(0, 1, 3, 2, 4, 5).reshape(b, rows * q, cols * q, d)
        nl = self.model.image_newline.to(x.dtype)[None, None, None, :].expand(b, rows * q, 1, d)
        return torch.cat([x, nl], dim=2).reshape(b, -1, d)

    def image_embeddings(self, global_views, tiles=None, grid=None, stage: StageFn = no_stage) -> torch.Tensor:
        """[B, image_tokens, D]: tiles (if any) then the global view, then ``view_seperator``.

        The vendor computes tiles first, then the global view, and lays the tile rows first.
        """
        parts = []
        call = 0
        if tiles is not None:
            tile_feats = self.encode_view(tiles, stage, call)
            call += 1
        glob = self.encode_view(global_views, stage, call)
        with stage("projector", call=call, glue=True):
            if tiles is not None:
                parts.append(self.layout_view(tile_feats, grid))
            parts.append(self.layout_view(glob))
            sep = self.model.view_seperator.to(glob.dtype)[None, None, :].expand(glob.shape[0], 1, -1)
            parts.append(sep)
            return torch.cat(parts, dim=1)

    # -------------------------------------------------------------------- LLM
    def decoder(self, embeds: torch.Tensor, position_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Decoder layers + final norm + lm_head. Returns fp32 logits [B, S, vocab] (or [B, 1, vocab])."""
        h = embeds
        for layer in self.model.layers:
            h = layer(h, position_ids, cache)
        h = self.model.norm(h)
        if not self.cfg.lm_head_all_positions:
            h = h[:, -1:]
        return self.lm_head(h).float()

    def prefill(self, input_ids, images_seq_mask, image_embeds, cache: KVCache) -> torch.Tensor:
        embeds = self.model.embed_tokens(input_ids)
        if image_embeds is not None:
            embeds = embeds.masked_scatter(images_seq_mask.unsqueeze(-1), image_embeds.to(embeds.dtype))
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand(input_ids.shape[0], -1)
        return self.decoder(embeds, pos, cache)

    def decode_step(self, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One greedy step: token [B, 1] -> logits [B, 1, vocab] against a cache of length n."""
        pos = torch.full_like(token, cache.length)
        return self.decoder(self.model.embed_tokens(token), pos, cache)

    # ------------------------------------------------------------- generation
    def _sink(self, layer: int, counts: np.ndarray):
        if self._routing is not None:
            self._routing[layer] += counts

    def _routing_array(self) -> np.ndarray:
        return np.zeros((self.cfg.llm.num_layers, self.cfg.llm.n_routed_experts), dtype=np.int64)

    @torch.inference_mode()
    def generate(self, request, max_new_tokens: Optional[int] = None, stage: StageFn = no_stage) -> GenerationResult:
        """Run one request end to end: vision, prefill, then ``max_new_tokens`` greedy steps.

        ``request`` is a ``harness.workload.Request`` already on this model's device/dtype (see
        ``to_device``). EOS is ignored: decoding always runs the fixed budget.
        """
        n_new = request.decode_tokens if max_new_tokens is None else max_new_tokens
        for mod in self.modules():
            if isinstance(mod, MoE):
                mod.routing_sink = self._sink
        result = GenerationResult(tokens=None)
        cache = KVCache(self.cfg.llm.num_layers)
        with stage("request"):
            t0 = time.perf_counter()
            img = self.image_embeddings(request.global_views, request.tiles, request.grid, stage)
            self._routing = self._routing_array()
            with stage("prefill"):
                logits = self.prefill(request.input_ids, request.images_seq_mask, img, cache)
                token = logits[:, -1].argmax(-1, keepdim=True)
            result.routing["prefill"], self._routing = self._routing, self._routing_array()
            out = [token]
            with stage("decode"):
                for step in range(max(n_new - 1, 0)):
                    with stage("decode_step", step=step):
                        token = self.decode_step(token, cache)[:, -1].argmax(-1, keepdim=True)
                    out.append(token)
            result.routing["decode"], self._routing = self._routing, None
            result.host_ms["request"] = (time.perf_counter() - t0) * 1e3
        result.tokens = torch.cat(out, dim=1)[:, :n_new]
        result.kv_cache_bytes = cache.nbytes()
        return result
