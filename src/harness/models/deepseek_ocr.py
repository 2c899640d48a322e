"""Reference DeepSeek-OCR: the whole model in our own PyTorch, with the vendor checkpoint's
state_dict names (``model.*`` and ``lm_head.weight``) and shapes, and the ``ModelAdapter``
the harness measures it through.

A request runs as stages (``harness.stages``): per view (tiles, then the global view in Gundam
mode) ``sam`` -> ``clip`` -> ``projector``; then ``prefill`` (embed, scatter image embeddings,
12 decoder layers, norm, lm_head) and ``decode`` (one ``decode_step`` per token, greedy), driven
by ``harness.models.generate.generate``.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from ..config import ATTN_IMPLEMENTATIONS, ExecutionConfig, ModelConfig
from ..errors import HarnessError
from .adapter import GenerationResult, Select, StageFn, no_stage
from .llm import DecoderLayer, KVCache, MoE, RMSNorm
from .routing import DeviceCounts, RoutingCounter
from .static_cache import StaticKVCache
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
        self.exec = ExecutionConfig()
        self._decoders: dict = {}          # (batch, cache length) -> execution.StaticDecoder
        self._prefill_counts: Optional[DeviceCounts] = None
        self._decode_counts: Optional[DeviceCounts] = None
        self._run_decoder = None           # the StaticDecoder of the request running now
        self._vision_graphs: dict = {}     # (stage, input shapes) -> execution.CapturedCall

    # ----------------------------------------------------------------- vision
    def encode_view(self, pixels: torch.Tensor, stage: StageFn = no_stage, call: int = 0) -> torch.Tensor:
        """[N, 3, S, S] pixels -> [N, (S/64)^2, hidden] projected image tokens (no separators)."""
        m = self.model
        with stage("sam", call=call):
            sam_out = self._vision("sam", m.sam_model, pixels)
        with stage("clip", call=call):
            clip_out = self._vision("clip", m.vision_model, sam_out)
        with stage("projector", call=call):
            return self._vision("projector", m.projector, clip_out, sam_out).clone()

    def _vision(self, name: str, module, *args) -> torch.Tensor:
        """One vision stage: eager, or (``vision_impl=fused`` on CUDA) its CUDA graph for these
        input shapes, captured on first use."""
        if self.exec.vision_impl != "fused" or not args[0].is_cuda:
            return module(*args)
        from .execution import CapturedCall

        key = (name,) + tuple((tuple(a.shape), a.dtype) for a in args)
        if key not in self._vision_graphs:
            if self.exec.vision_compile:   # one eager pass first: attention probes and backend choices
                with torch.compiler.set_stance("force_eager"):
                    module(*args)
            self._vision_graphs[key] = CapturedCall(module, args)
            self.info.setdefault("setup_s", {})[f"{name}{list(args[0].shape)}"] = self._vision_graphs[key].setup_s
        return self._vision_graphs[key](*args)

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
        rope = None
        if isinstance(cache, StaticKVCache):   # cos/sin once per step for all layers (same values as per layer)
            rope = self.model.layers[0].self_attn.rotary_emb(h, position_ids)
        for layer in self.model.layers:
            h = layer(h, position_ids, cache, rope)
        h = self.model.norm(h)
        if not self.cfg.lm_head_all_positions:
            h = h[:, -1:]
        return self.lm_head(h).float()

    def prefill(self, input_ids, images_seq_mask, image_embeds, cache) -> torch.Tensor:
        """Logits [B, S, vocab] of the whole prompt; fills positions 0..S-1 of ``cache`` (growing or static)."""
        embeds = self.model.embed_tokens(input_ids)
        if image_embeds is not None:
            embeds = embeds.masked_scatter(images_seq_mask.unsqueeze(-1), image_embeds.to(embeds.dtype))
        S = input_ids.shape[1]
        pos = torch.arange(S, device=input_ids.device)
        static = isinstance(cache, StaticKVCache)
        if static:
            cache.begin_step(pos)
        logits = self.decoder(embeds, pos[None].expand(input_ids.shape[0], -1), cache)
        if static:
            cache.advance(S)
            cache.position.fill_(S)
        return logits

    def decode_step(self, token: torch.Tensor, cache) -> torch.Tensor:
        """One step: token [B, 1] -> logits [B, 1, vocab] against a cache of length n (growing or static)."""
        if isinstance(cache, StaticKVCache):
            logits = self.decode_core(token, cache, lambda x: x)
            cache.advance(1)
            return logits
        pos = torch.full_like(token, cache.length)
        return self.decoder(self.model.embed_tokens(token), pos, cache)

    def prefill_core(self, input_ids, image_embeds, cache: StaticKVCache, select: Select, image_start: int):
        """The device work of a static-cache prefill with the image tokens at ``image_start`` (the
        contiguous placeholder block of ``workload.build_request``): the same function as ``prefill``
        (a slice write equals masked_scatter for that layout), ``select`` of the logits, the device
        position set to S. Fixed shapes, no host sync: what ``StaticDecoder.prefill`` captures."""
        embeds = self.model.embed_tokens(input_ids)
        if image_embeds is not None and image_embeds.numel():
            embeds[:, image_start:image_start + image_embeds.shape[1]] = image_embeds.to(embeds.dtype)
        S = input_ids.shape[1]
        pos = torch.arange(S, device=input_ids.device)
        cache.begin_step(pos)
        logits = self.decoder(embeds, pos[None].expand(input_ids.shape[0], -1), cache)
        cache.position.fill_(S)
        return select(logits)

    def decode_core(self, token: torch.Tensor, cache: StaticKVCache, select: Select) -> torch.Tensor:
        """The device work of one static-cache step: position from ``cache.position`` (device), the
        decoder, ``select`` of the logits, the position advanced on the device. Fixed shapes and no
        host sync: what ``execution.StaticDecoder`` compiles and captures."""
        pos = cache.position
        cache.begin_step(pos)
        logits = self.decoder(self.model.embed_tokens(token), pos.view(1, 1).expand(token.shape[0], 1), cache)
        out = select(logits)
        pos.add_(1)
        return out

    # ------------------------------------------------------- execution variants
    def configure(self, m: ExecutionConfig) -> dict:
        """Execute as ``m`` from now on (same weights); returns what runs, for the manifest. Routed
        experts are stacked once (views: the state_dict is unchanged) the first time ``grouped`` is
        asked for; set-up per request shape (compile, capture) happens in ``running``."""
        from .execution import resolve_decode_attention, resolve_moe_kernel
        from .fast_moe import stack_experts

        p = next(self.parameters())
        kernel, why = resolve_moe_kernel(m, p.device, p.dtype)
        decode_attn = resolve_decode_attention(m, p.device)
        for layer in self.model.layers:
            layer.self_attn.decode_attention = m.decode_attention
        for mod in self.modules():
            if isinstance(mod, MoE):
                if kernel is not None and mod.experts_stacked is None:
                    mod.experts_stacked = stack_experts(mod)
                mod.impl, mod.kernel = ("vendor_loop", "torch") if kernel is None else ("grouped", kernel)
        linears = self._configure_linears(m.linear_impl, p.device)
        for blk in self.model.sam_model.blocks:   # fused vision: global blocks without the dense mask
            blk.attn.method = "augmented" if m.vision_impl == "fused" and blk.window_size == 0 else "dense"
        vision_compiled = self._configure_vision_compile(m.vision_compile and p.is_cuda)
        if (m.vision_impl, m.vision_compile) != (self.exec.vision_impl, self.exec.vision_compile):
            self._vision_graphs.clear()
        if m.execution() != self.exec.execution():
            self._decoders.clear()
        self.exec = ExecutionConfig(**m.execution())
        return {**m.execution(), "moe": why, "moe_kernel_resolved": kernel,
                "kv_cache_is": "static: preallocated, written in place" if m.kv_cache == "static"
                else "growing: torch.cat per step",
                "decode_attention_is": decode_attn,
                "vision": ("fused: SAM global blocks by augmented q.k (no dense rel-pos mask); sam, clip, projector "
                           "each a CUDA graph per input shape" + ("" if p.is_cuda else " (no CUDA here: eager)"))
                + (vision_compiled if m.vision_compile else "")
                if m.vision_impl == "fused" else "vendor: dense rel-pos mask, eager launches",
                "prefill": ("one CUDA graph per request shape" if p.is_cuda else "eager (no CUDA here)")
                if m.prefill_graphs else "eager launches",
                "linears": linears}

    def _configure_vision_compile(self, on: bool) -> str:
        """``vision_compile``: torch.compile each SAM and CLIP block (same code for blocks of one
        kind: parameters are graph inputs, so the blocks share compiled graphs), or undo it."""
        blocks = list(self.model.sam_model.blocks) + list(self.model.vision_model.transformer.layers)
        for blk in blocks:
            if on and blk._compiled_call_impl is None:
                blk.compile(dynamic=False)
            elif not on:
                blk._compiled_call_impl = None
        if on:   # shapes per view size and batch, windowed and global SAM blocks: more than the default 8
            import torch._dynamo.config as dcfg
            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(dcfg, name):
                    setattr(dcfg, name, max(getattr(dcfg, name), 64))
        return ("; each SAM and CLIP block torch.compile'd (inductor) before capture" if on
                else "; vision_compile asked for, but no CUDA here: blocks run eager")

    def _configure_linears(self, impl: str, device) -> str:
        """``linear_impl``: fuse q/k/v and the dense/shared SwiGLU gate/up weights once (views, the
        state_dict is unchanged) and switch the LLM's linears to ``fused_linear``; returns what runs."""
        from ..kernels.availability import triton_available
        from . import fused_linear

        if impl == "fused":
            ok, why = triton_available(device)
            if not ok:
                raise HarnessError(f"execution.linear_impl=fused needs Triton for its GEMV kernels: {why}",
                                   "use execution.linear_impl=vendor")
        on = impl == "fused"
        for layer in self.model.layers:
            attn = layer.self_attn
            mlps = [layer.mlp.shared_experts] if isinstance(layer.mlp, MoE) else [layer.mlp]
            if on and getattr(attn, "_qkv_fused", None) is None:
                attn._qkv_fused = fused_linear.fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj])
            attn.qkv_weight = attn._qkv_fused if on else None
            for mlp in mlps:
                if on and getattr(mlp, "_gate_up_fused", None) is None:
                    mlp._gate_up_fused = fused_linear.fuse_rows([mlp.gate_proj, mlp.up_proj])
                mlp.gate_up_weight = mlp._gate_up_fused if on else None
            if isinstance(layer.mlp, MoE):
                layer.mlp.gate.fused = on
        if not on:
            return "vendor: one GEMM per nn.Linear"
        return (f"fused: q/k/v and dense/shared gate/up as one weight each; at <= {fused_linear.GEMV_MAX_ROWS} "
                f"token(s) Triton GEMV kernels for K <= {fused_linear.GEMV_MAX_K}, the router's softmax, top-k, scale and "
                "routing count one Triton kernel after its GEMV; with the static cache q/k/v, RoPE and the KV write "
                "one kernel; with moe_kernel=triton the shared expert as extra rows of the routed-expert kernels; "
                "cuBLAS otherwise")

    def route_moe(self, target) -> None:
        """Send every MoE layer's routing to ``target`` (a RoutingCounter, DeviceCounts or None)."""
        for mod in self.modules():
            if isinstance(mod, MoE):
                mod.routing = target

    def _device_counts(self) -> DeviceCounts:
        L, p = self.cfg.llm, next(self.parameters())
        return DeviceCounts(L.num_layers, L.n_routed_experts, p.device)

    def static_decoder(self, batch: int, max_len: int):
        """The ``StaticDecoder`` of (batch, max_len), built (compiled, captured) on first use."""
        from .adapter import greedy, greedy_chunked
        from .execution import StaticDecoder

        key = (batch, max_len)
        if key not in self._decoders:
            p = next(self.parameters())
            select = greedy_chunked if self.exec.compile else greedy   # same token; see greedy_chunked
            self._decoders[key] = StaticDecoder(self, self.exec, batch, max_len, p.device, p.dtype, select)
            self.info.setdefault("setup_s", {})[f"b{batch}-L{max_len}"] = self._decoders[key].setup_s
        return self._decoders[key]

    # ------------------------------------------------------- adapter protocol
    def routing_counter(self) -> RoutingCounter:
        return RoutingCounter(self.cfg.llm.num_layers, self.cfg.llm.n_routed_experts)

    @contextlib.contextmanager
    def running(self, request, max_new_tokens: int, counter: RoutingCounter):
        """The request's KV cache (growing, or the static decoder's buffers for this batch and cache
        length, set up on first use). MoE routing goes to ``counter`` (vendor loop: host counts) or to
        device buffers merged into ``counter`` at the end (grouped: no sync in the step)."""
        grouped = self.exec.moe_impl == "grouped"
        self._run_decoder = None
        if self.exec.kv_cache == "static":
            self._run_decoder = self.static_decoder(request.batch,
                                                    self.exec.cache_len(request.prefill_tokens, max_new_tokens))
            cache = self._run_decoder.begin()
        else:
            cache = KVCache(self.cfg.llm.num_layers)
        if grouped:
            self._prefill_counts = self._prefill_counts or self._device_counts()
            self._prefill_counts.zero()
            if self._run_decoder is None:
                self._decode_counts = self._decode_counts or self._device_counts()
                self._decode_counts.zero()
        self.route_moe(self._prefill_counts if grouped else counter)
        try:
            yield cache
        finally:
            if grouped:
                counter.merge("prefill", self._prefill_counts.buf)
                dec = self._run_decoder.decode_counts if self._run_decoder is not None else self._decode_counts
                counter.merge("decode", dec.buf)
            self.route_moe(None)
            self._run_decoder = None

    def first_token(self, request, cache, stage: StageFn, select: Select) -> torch.Tensor:
        img = self.image_embeddings(request.global_views, request.tiles, request.grid, stage)
        with stage("prefill"):
            if self._run_decoder is not None and self.exec.prefill_graphs and request.input_ids.is_cuda:
                token = self._run_decoder.prefill(request, img)
            else:
                token = select(self.prefill(request.input_ids, request.images_seq_mask, img, cache))
        if self.exec.moe_impl == "grouped":   # decode steps count into the decode buffers
            self.route_moe(self._run_decoder.decode_counts if self._run_decoder is not None else self._decode_counts)
        return token

    def next_token(self, token: torch.Tensor, cache, select: Select) -> torch.Tensor:
        if self._run_decoder is not None:
            return self._run_decoder.step(token)
        return select(self.decode_step(token, cache))

    def generate(self, request, max_new_tokens: Optional[int] = None, stage: StageFn = no_stage) -> GenerationResult:
        """``harness.models.generate.generate`` on this model (kept as a method for callers)."""
        from .generate import generate

        return generate(self, request, stage, max_new_tokens)
