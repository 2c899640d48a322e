"""What a model must offer to be measured: the adapter protocol, and the result of one request.

Every model the harness drives (the reference ``DeepseekOCR``, the vendor's code through
``VendorOCR``) implements ``ModelAdapter``; ``harness.models.generate.generate`` is the one loop
that runs a request through any of them. Execution variants (``harness.variants``: a static KV
cache, a decode step captured in a CUDA graph) convert the reference model; they live behind
``running`` (set-up once per request shape, outside the timed loop) and ``next_token`` (one step,
nothing in it makes the host wait).

Stage ranges enter a model only through ``stage(name, **payload)`` context managers (a
``harness.measure.StageRecorder``, a FLOP counter, ``no_stage``): ``first_token`` opens the vision
stages and ``prefill``; the loop opens ``request``, ``decode`` and ``decode_step``.

An adapter whose decode loop is not ours (the vendor's own Hugging Face ``generate``,
``harness.models.vendor.hf_generate``) offers ``generate_own``: ``generate`` hands it the request
(``own_loop``). It must open the same ranges: ``request`` around everything (with, where the
model preprocesses the page itself, a ``preprocess`` range first), the vision stages and
``prefill`` for the first forward and the first token, one ``decode_step`` per later token inside
one ``decode``; and return the same ``GenerationResult``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional, Protocol

import numpy as np
import torch

from .routing import RoutingCounter

StageFn = Callable[..., ContextManager]
Select = Callable[[torch.Tensor], torch.Tensor]


def no_stage(name: str, **payload) -> ContextManager:
    """The stage function that records nothing."""
    return contextlib.nullcontext()


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Next token of every sequence from logits [B, S, vocab]: argmax at the last position -> [B, 1]
    (on the device: no host sync)."""
    return logits[:, -1].argmax(-1, keepdim=True)


def greedy_chunked(logits: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """``greedy`` in two reductions: the max of each ``chunk`` of the vocabulary, then the first chunk
    holding the overall max. Same token (the first index of the max, as argmax). For compiled decode
    steps: inductor turns one argmax over 129,280 logits into a single-program loop (28 µs per step
    on an H200); here the first reduction spreads over one program per chunk."""
    last = logits[:, -1]
    B, V = last.shape
    n = -(-V // chunk)
    if n * chunk != V:
        last = torch.nn.functional.pad(last, (0, n * chunk - V), value=float("-inf"))
    vals, idx = last.view(B, n, chunk).max(-1)
    c = vals.argmax(-1, keepdim=True)
    return c * chunk + idx.gather(-1, c)


@dataclass
class GenerationResult:
    """Greedy tokens [B, decode_tokens] and per-layer routed-expert token counts.

    ``routing[phase]`` is an int64 array [num_layers, n_routed_experts] (rows of dense layers
    are zero); ``phase`` is ``prefill`` or ``decode`` (summed over steps); ``routing_steps`` the
    decode counts per step, int64 [steps, layers, experts] (None when not kept). ``kv_cache_bytes``:
    the cache's size at the end [B]; ``host_ms['request']``: host wall time of the request [ms].
    ``prompt_tokens``: the prompt length that ran, where the model built its own prompt (the
    vendor's ``infer()``); None: the request's.
    """

    tokens: torch.Tensor
    routing: dict = field(default_factory=dict)
    routing_steps: Optional[np.ndarray] = None
    kv_cache_bytes: int = 0
    host_ms: dict = field(default_factory=dict)
    prompt_tokens: Optional[int] = None
    #: ``generate(defer_routing=True)``: a function giving (routing, routing_steps) once read back
    pending: Optional[Callable] = None


class ModelAdapter(Protocol):
    """A model the harness can measure.

    ``cfg`` (harness.config.ModelConfig): the architecture as the analytic model sees it;
    ``info``: what was loaded and what really runs (for the manifest).
    """

    cfg: object
    info: dict

    def routing_counter(self) -> RoutingCounter:
        """A fresh counter of routed-expert tokens for one request."""

    def running(self, request, max_new_tokens: int, counter: RoutingCounter) -> ContextManager:
        """Set up one request (hooks, caches, captured graphs) and yield its KV cache (an object
        with ``nbytes()``); undo the set-up on exit."""

    def first_token(self, request, cache, stage: StageFn, select: Select) -> torch.Tensor:
        """Vision and prefill of ``request`` (opening the sam/clip/projector/prefill ranges); the
        first new token [B, 1] from ``select`` inside the prefill range."""

    def next_token(self, token: torch.Tensor, cache, select: Select) -> torch.Tensor:
        """One single-token forward: token [B, 1] -> next token [B, 1]."""

    # optional: ``generate_own`` = None (ours drives: running/first_token/next_token) or a callable
    # (request, stage, max_new_tokens) -> GenerationResult that runs the whole request itself


OwnLoop = Callable[[object, StageFn, int], GenerationResult]


def own_loop(adapter) -> Optional[OwnLoop]:
    """The adapter's own loop (``generate_own``), or None when the harness loop drives it."""
    return getattr(adapter, "generate_own", None)
