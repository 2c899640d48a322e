"""The request loop of the reference adapter as the converted executions run it.

``Engine`` extends ``models.deepseek_ocr.DeepseekOCR`` (the root module, which is also the
adapter) and overrides the adapter protocol (``running``, ``first_token``, ``next_token``) and
the forward passes that depend on the cache kind. Converters attach it with ``attach(model)`` and
fill its ``Plan``:

- ``static`` (``kv_cache=static``): the execution whose static cache runs; one ``StaticDecoder``
  per (batch, cache length) holds the cache, the device-side position and the decode step as it
  runs (eager, ``compile``'d, replayed from a CUDA graph with ``decode_graphs``; the prefill too
  with ``prefill_graphs``; its step bound to other kernels with ``decode_step``), set up on first use
  outside the timed loop;
- ``device_routing`` (``moe_impl=grouped``): MoE routing counted on the device (no sync in a step):
  under the static cache into the ``StaticDecoder``'s ``DeviceRouting`` (its step index advanced on
  the device at the end of every step, inside the compiled or captured step), with a growing cache
  into the request counter's own (its step index set from the host loop); the request's
  ``RoutingCounter`` reads it back after the request. Forced routing (``workload.routing=balanced``)
  rides on the same target (``models.routing``).

Nothing here decides what may run: the converters' ``check`` did.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..config import logits_every_position
from ..knobs import Knob
from ..models.adapter import Select, StageFn, greedy, greedy_chunked
from ..models.deepseek_ocr import DeepseekOCR
from ..models.llm import KVCache
from ..models.routing import RoutingCounter
from .base import Converter, Variant, need, swap
from .static_decoder import StaticDecoder
from .static_kv import StaticKVCache


@dataclass
class Plan:
    """What the converters asked of the request loop (see the module docstring)."""

    static: Optional[object] = None      # the ExecutionConfig whose static cache runs (kv_cache=static)
    device_routing: bool = False         # moe_impl=grouped
    compile: bool = False                # compile: torch.compile of the static decode step
    decode_graphs: bool = False          # cuda_graphs=decode
    prefill_graphs: bool = False         # prefill_graphs
    prefill_compile: bool = False        # prefill_compile: the captured prefill compiled first
    decode_step: Optional[Callable] = None   # decode_step=fused: StaticDecoder -> its step (fused_step.FusedCore)
    prefill_logits: str = "all"          # prefill_logits: lm_head on every prompt position, or each sequence's last


def attach(model) -> Plan:
    """The ``Plan`` of ``model``'s request loop: the root rebound to ``Engine`` with an empty plan
    the first time a converter asks in this conversion (``restore`` rebinds it to the reference)."""
    if not isinstance(model, Engine):
        swap(model, Engine)
        model.plan = Plan()
    return model.plan


class Engine(Variant, DeepseekOCR):
    """``DeepseekOCR`` whose request runs as ``plan`` says (static cache, device-side routing counts,
    compiled and captured steps). Per-request state: ``_run_decoder`` (the ``StaticDecoder`` of
    the request running now)."""

    plan: Plan

    def logits_all_positions(self) -> bool:
        return logits_every_position(self.cfg.lm_head_all_positions, self.plan.prefill_logits)

    # ------------------------------------------------------------ static-cache forward passes
    def decoder(self, embeds: torch.Tensor, position_ids: torch.Tensor, cache) -> torch.Tensor:
        if isinstance(cache, StaticKVCache):   # cos/sin once per step for all layers (same values as per layer)
            cache.rope = self.model.layers[0].self_attn.rotary_emb(embeds, position_ids)
        return super().decoder(embeds, position_ids, cache)

    def prefill(self, input_ids, images_seq_mask, image_embeds, cache) -> torch.Tensor:
        """As ``DeepseekOCR.prefill``; with a static cache the positions are set on it and its
        length and device position advance to S."""
        if not isinstance(cache, StaticKVCache):
            return super().prefill(input_ids, images_seq_mask, image_embeds, cache)
        logits = self._static_prefill(self.embed_prompt(input_ids, images_seq_mask, image_embeds), cache)
        cache.advance(input_ids.shape[1])
        return logits

    def _static_prefill(self, embeds: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """Logits [B, S, vocab] of prompt embeddings [B, S, hidden] at positions 0..S-1 of a static cache
        (its step positions set, then its device position set to S; its host ``length`` untouched)."""
        B, S = embeds.shape[:2]
        pos = torch.arange(S, device=embeds.device)
        cache.begin_step(pos)
        logits = self.decoder(embeds, pos[None].expand(B, -1), cache)
        cache.position.fill_(S)
        return logits

    def decode_step(self, token: torch.Tensor, cache) -> torch.Tensor:
        """As ``DeepseekOCR.decode_step``; with a static cache ``decode_core`` at its device position."""
        if not isinstance(cache, StaticKVCache):
            return super().decode_step(token, cache)
        logits = self.decode_core(token, cache, lambda x: x)
        cache.advance(1)
        return logits

    def prefill_core(self, input_ids, image_embeds, cache, select: Select, image_start: int):
        """The device work of a static-cache prefill with the image tokens at ``image_start`` (the
        contiguous placeholder block of ``workload.build_request``): the same function as ``prefill``
        (a slice write equals masked_scatter for that layout), ``select`` of the logits, the device
        position set to S. Fixed shapes, no host sync: what ``StaticDecoder.prefill`` captures."""
        embeds = self.model.embed_tokens(input_ids)
        if image_embeds is not None and image_embeds.numel():
            embeds[:, image_start:image_start + image_embeds.shape[1]] = image_embeds.to(embeds.dtype)
        return select(self._static_prefill(embeds, cache))

    def decode_core(self, token: torch.Tensor, cache, select: Select, routing=None) -> torch.Tensor:
        """The device work of one static-cache step: position from ``cache.position`` (device), the
        decoder, ``select`` of the logits, the position and ``routing``'s step index (a
        ``DeviceRouting``, device-driven) advanced on the device. Fixed shapes and no host sync: what
        ``StaticDecoder`` compiles and captures."""
        pos = cache.position
        cache.begin_step(pos)
        logits = self.decoder(self.model.embed_tokens(token), pos.view(1, 1).expand(token.shape[0], 1), cache)
        out = select(logits)
        pos.add_(1)
        if routing is not None:
            routing.advance()
        return out

    # ------------------------------------------------------------------------ set-up
    def static_decoder(self, batch: int, max_len: int):
        """The ``StaticDecoder`` of (batch, max_len), built (compiled, captured) on first use."""
        key = (batch, max_len)
        if key not in self.static_decoders:
            p, plan = next(self.parameters()), self.plan
            select = greedy_chunked if plan.compile else greedy   # same token; see greedy_chunked
            self.static_decoders[key] = StaticDecoder(self, batch, max_len, p.device, p.dtype, select,
                                                      compile=plan.compile, graphs=plan.decode_graphs,
                                                      compile_prefill=plan.prefill_compile,
                                                      device_routing=plan.device_routing,
                                                      bind=plan.decode_step)
            self.info.setdefault("setup_s", {})[f"b{batch}-L{max_len}"] = self.static_decoders[key].setup_s
        return self.static_decoders[key]

    # ------------------------------------------------------------------- adapter protocol
    @contextlib.contextmanager
    def running(self, request, max_new_tokens: int, counter: RoutingCounter):
        """The request's KV cache (growing, or the static decoder's buffers for this batch and cache
        length, set up on first use). MoE routing goes to ``counter``: with the static cache and the
        grouped MoE through the decoder's ``DeviceRouting`` (begun for this request), else to the
        counter itself (host counts from the vendor loop; device counts of the grouped MoE in its own
        host-driven ``DeviceRouting``). After the request the decoder's step takes what it keeps of the
        request (``StaticDecoder.after_request``: the fused step's clock stamps)."""
        plan = self.plan
        self._run_decoder = None
        shared = None
        if plan.static is not None:
            self._run_decoder = self.static_decoder(request.batch,
                                                    plan.static.cache_len(request.prefill_tokens, max_new_tokens))
            shared = self._run_decoder.routing
        target = counter.target(shared)
        cache = self._run_decoder.begin() if self._run_decoder is not None else KVCache(self.cfg.llm.num_layers)
        self.route_moe(target)
        try:
            yield cache
            if self._run_decoder is not None:      # after the request: the step's clock stamps
                self._run_decoder.after_request()
        finally:
            self.route_moe(None)
            self._run_decoder = None

    def first_token(self, request, cache, stage: StageFn, select: Select) -> torch.Tensor:
        img = self.request_embeddings(request, stage)
        with stage("prefill"):
            if self._run_decoder is not None and self.plan.prefill_graphs:
                token = self._run_decoder.prefill(request, img)
            else:
                token = select(self.prefill(request.input_ids, request.images_seq_mask, img, cache))
        return token

    def next_token(self, token: torch.Tensor, cache, select: Select) -> torch.Tensor:
        if self._run_decoder is not None:
            return self._run_decoder.step(token)
        return select(self.decode_step(token, cache))


def need_static_grouped(ex, knob: str, value, what: str) -> None:
    """Refuse ``knob`` unless ``kv_cache=static`` and ``moe_impl=grouped`` (``what``: why it needs them)."""
    need(ex.kv_cache == "static" and ex.moe_impl == "grouped", knob, value,
         f"needs kv_cache=static and moe_impl=grouped ({what})",
         "add execution.kv_cache=static execution.moe_impl=grouped")


def need_cuda(device: torch.device, knob: str, value) -> None:
    """Refuse ``knob`` on a device without CUDA graphs (``CannotRunHere``)."""
    need(device.type == "cuda", knob, value, f"needs a CUDA device (this run is on {device.type})",
         "run on a GPU, or leave it out", here=True)


class PlanConverter(Converter):
    """A knob that sets one flag of the request loop's ``Plan`` (the compiled step, the decode and
    prefill graphs): it needs the static cache and the grouped MoE (``why``), and CUDA where
    ``needs_cuda``; ``texts`` = (what runs when on, when off)."""

    def __init__(self, spec: Knob, flag: str, why: str, texts: tuple, needs_cuda: bool):
        self.spec = spec
        self.flag, self.why, self.texts, self.needs_cuda = flag, why, texts, needs_cuda

    def check(self, ex, device, dtype, model=None, positions=None) -> None:
        if self.active(ex):
            need_static_grouped(ex, self.knob, self.on, self.why)
            if self.needs_cuda:
                need_cuda(device, self.knob, self.on)

    def convert(self, model, ex, device, dtype) -> dict:
        if self.active(ex):
            setattr(attach(model), self.flag, True)
        return {self.manifest_key: self.texts[0] if self.active(ex) else self.texts[1]}


__all__ = ["Engine", "Plan", "PlanConverter", "attach", "need_static_grouped", "need_cuda"]
