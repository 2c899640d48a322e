"""Reference DeepSeek-OCR: the whole model in our own PyTorch, with the vendor checkpoint's
state_dict names (``model.*`` and ``lm_head.weight``) and shapes, and the ``ModelAdapter``
the harness measures it through.

A request runs as stages (``harness.anatomy.stages``): per view (tiles, then the global view in Gundam
mode) ``sam`` -> ``clip`` -> ``projector``; then ``prefill`` (embed, scatter image embeddings,
12 decoder layers, norm, lm_head) and ``decode`` (one ``decode_step`` per token, greedy), driven
by ``harness.models.generate.generate``.

One path, the vendor's execution (a growing KV cache, the MoE's per-expert loop, every op launched
from the host); ``harness.variants`` converts the model to the other executions (its
``engine.Engine`` extends this class: the adapter protocol under a static cache, device-side
routing counts, compiled and captured steps).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from ..config import ATTN_IMPLEMENTATIONS, ModelConfig
from ..errors import HarnessError
from .adapter import GenerationResult, Select, StageFn, no_stage
from .llm import DecoderLayer, KVCache, MoE, RMSNorm
from .routing import RoutingCounter
from .vision import CLIPEncoder, Projector, SAMEncoder


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
        self.info: dict = {"adapter": "reference"}

    # ----------------------------------------------------------------- vision
    def encode_view(self, pixels: torch.Tensor, stage: StageFn = no_stage, call: int = 0) -> torch.Tensor:
        """[N, 3, S, S] pixels -> [N, (S/64)^2, hidden] projected image tokens (no separators)."""
        m = self.model
        with stage("sam", call=call):
            sam_out = m.sam_model(pixels)
        with stage("clip", call=call):
            clip_out = m.vision_model(sam_out)
        with stage("projector", call=call):   # a tensor of its own (a variant may replay the stage into a buffer)
            return m.projector(clip_out, sam_out).clone()

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
        if not self.logits_all_positions():
            h = h[:, -1:]
        return self.lm_head(h).float()

    def logits_all_positions(self) -> bool:
        """Whether ``decoder`` applies lm_head to every position (the vendor's way,
        ``model.lm_head_all_positions``) rather than to each sequence's last."""
        return self.cfg.lm_head_all_positions

    def embed_prompt(self, input_ids, images_seq_mask, image_embeds) -> torch.Tensor:
        """Token embeddings [B, S, hidden] with the image embeddings scattered into the image positions."""
        embeds = self.model.embed_tokens(input_ids)
        if image_embeds is not None:
            embeds = embeds.masked_scatter(images_seq_mask.unsqueeze(-1), image_embeds.to(embeds.dtype))
        return embeds

    def prefill(self, input_ids, images_seq_mask, image_embeds, cache: KVCache) -> torch.Tensor:
        """Logits [B, S, vocab] of the whole prompt; fills positions 0..S-1 of ``cache``."""
        embeds = self.embed_prompt(input_ids, images_seq_mask, image_embeds)
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.decoder(embeds, pos[None].expand(input_ids.shape[0], -1), cache)

    def decode_step(self, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One step: token [B, 1] -> logits [B, 1, vocab] against a cache of length n."""
        pos = torch.full_like(token, cache.length)
        return self.decoder(self.model.embed_tokens(token), pos, cache)

    def route_moe(self, target) -> None:
        """Send every MoE layer's routing to ``target`` (a ``RoutingCounter``, a ``DeviceRouting`` or None)."""
        for mod in self.modules():
            if isinstance(mod, MoE):
                mod.routing = target

    # ------------------------------------------------------- adapter protocol
    def routing_counter(self) -> RoutingCounter:
        L = self.cfg.llm
        return RoutingCounter(L.num_layers, L.n_routed_experts, L.num_experts_per_tok)

    @contextlib.contextmanager
    def running(self, request, max_new_tokens: int, counter: RoutingCounter):
        """The request's growing KV cache; MoE routing goes to ``counter`` (host counts; its forced
        experts under ``workload.routing=balanced``)."""
        self.route_moe(counter.target())
        try:
            yield KVCache(self.cfg.llm.num_layers)
        finally:
            self.route_moe(None)

    def request_embeddings(self, request, stage: StageFn = no_stage) -> torch.Tensor:
        """``request``'s image embeddings: those it carries when they were computed ahead
        (``Request.image_embeds``, the throughput experiment's overlap_vision), else ``image_embeddings``."""
        if getattr(request, "image_embeds", None) is not None:
            return request.image_embeds
        return self.image_embeddings(request.global_views, request.tiles, request.grid, stage)

    def first_token(self, request, cache, stage: StageFn, select: Select) -> torch.Tensor:
        img = self.request_embeddings(request, stage)
        with stage("prefill"):
            return select(self.prefill(request.input_ids, request.images_seq_mask, img, cache))

    def next_token(self, token: torch.Tensor, cache, select: Select) -> torch.Tensor:
        return select(self.decode_step(token, cache))

    def generate(self, request, max_new_tokens: Optional[int] = None, stage: StageFn = no_stage) -> GenerationResult:
        """``harness.models.generate.generate`` on this model (kept as a method for callers)."""
        from .generate import generate

        return generate(self, request, stage, max_new_tokens)
