"""The static-cache decode step and prefill as they run: eager, compiled, or replayed from CUDA graphs.

Set up once per request shape outside the timed loop (``variants.engine.Engine.static_decoder``).
``StaticDecoder`` owns, for one (batch, cache length), the static KV cache, the device-side
position, the decode-phase routing counts and the decode step as it will run: eager, compiled
(``torch.compile``) and/or captured in a CUDA graph and replayed. Nothing in its ``step`` makes
the host wait; the position advances on the device.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from ..errors import HarnessError
from ..models.routing import DeviceCounts
from .static_kv import StaticKVCache


class StaticDecoder:
    """The decode step of one (batch, cache length) with a static cache.

    ``step(token)`` runs one step and returns the next token [B, 1]: through the CUDA graph when
    ``graphs`` (``cuda_graphs=decode``: inputs copied into static buffers, one replay), else the step
    function, ``torch.compile``'d with ``compile``. ``model`` is an ``engine.Engine`` (its
    ``decode_core`` / ``prefill_core``); ``bind`` (``decode_step=fused``) gives the step function
    instead: ``bind(decoder)`` -> a callable like ``decode_core``, built once the cache, the token
    buffer and the counts exist (not compiled). ``setup_s`` holds the one-off set-up seconds
    (compile, capture).
    """

    def __init__(self, model, batch: int, max_len: int, device, dtype, select: Callable, compile: bool = False,
                 graphs: bool = False, bind: Optional[Callable] = None):
        L = model.cfg.llm
        self.model, self.select = model, select
        self.cache = StaticKVCache(L.num_layers, batch, L.num_kv_heads, max_len, L.head_dim, dtype, device,
                                   query_heads=L.num_heads)
        self.cache.position = torch.zeros(1, dtype=torch.int64, device=device)
        self.decode_counts = DeviceCounts(L.num_layers, L.n_routed_experts, device, batch * L.num_experts_per_tok)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.token_in = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.token_out: Optional[torch.Tensor] = None
        self.setup_s: dict = {}
        self.graphs: dict = {}
        self.core = bind(self) if bind is not None else model.decode_core
        self.fn = self.core
        if compile and bind is None:
            self.fn = torch.compile(model.decode_core, dynamic=False)
        self._prepare(compile, graphs, device)

    def _run(self, n: int) -> None:
        for _ in range(n):
            self.token_out = self.fn(self.token_in, self.cache, self.select)

    def _prepare(self, compile: bool, graphs: bool, device) -> None:
        """Warm the step up (the first compiled call compiles) and capture it; the warm-up writes
        scratch K/V and counts, which ``begin`` resets."""
        self.model.route_moe(self.decode_counts)
        cuda = device.type == "cuda"
        if compile or graphs:
            self.core(self.token_in, self.cache, self.select)   # eager first: probes, lazy buffers, kernel builds
            t0 = time.perf_counter()
            stream = torch.cuda.Stream() if cuda else None
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self._run(3)
                torch.cuda.current_stream().wait_stream(stream)
                torch.cuda.synchronize()
            else:
                self._run(2)
            self.setup_s["warmup_compile" if compile else "warmup"] = round(time.perf_counter() - t0, 3)
        if graphs:
            if not cuda:
                raise HarnessError("execution.cuda_graphs=decode needs a CUDA device", "use execution.cuda_graphs=none")
            t0 = time.perf_counter()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.token_out = self.fn(self.token_in, self.cache, self.select)
            torch.cuda.synchronize()
            self.setup_s["capture"] = round(time.perf_counter() - t0, 3)

    def prefill(self, request, image_embeds: Optional[torch.Tensor]) -> torch.Tensor:
        """The first token of ``request`` through the prefill forward captured for its shape (batch,
        prompt length, image position): ``model.prefill_core`` replayed; the cache holds the prompt after."""
        S = request.input_ids.shape[1]
        start, n_img = request.image_start, request.image_tokens
        key = ("prefill", tuple(request.input_ids.shape), start, n_img)
        if key not in self.graphs:
            def fn(ids, img):
                return self.model.prefill_core(ids, img, self.cache, self.select, start)
            self.model.prefill_core(request.input_ids, image_embeds, self.cache, self.select, start)   # eager first
            self.graphs[key] = CapturedCall(fn, (request.input_ids, image_embeds))
            self.setup_s[f"prefill_capture_S{S}"] = self.graphs[key].setup_s
            self.cache.length = 0
            if getattr(self.model, "_prefill_counts", None) is not None:   # the warm-up runs counted routing too
                self.model._prefill_counts.zero()
        out = self.graphs[key](request.input_ids, image_embeds).clone()
        self.cache.advance(S)
        return out

    def begin(self) -> StaticKVCache:
        """A new request: position 0, empty cache bookkeeping, zero decode counts."""
        self.cache.length = 0
        self.cache.position.zero_()
        self.decode_counts.zero()
        return self.cache

    def step(self, token: torch.Tensor) -> torch.Tensor:
        if self.graph is not None:
            self.token_in.copy_(token)
            self.graph.replay()
            out = self.token_out.clone()
        else:
            out = self.fn(token, self.cache, self.select)
        self.cache.advance(1)
        return out


class CapturedCall:
    """``fn(*inputs)`` captured once in a CUDA graph for fixed input shapes: a call copies its inputs
    into the graph's static buffers and replays it. The output tensor is the graph's own buffer
    (overwritten by the next replay): callers that keep it across replays clone it. ``setup_s``:
    warm-up + capture seconds."""

    def __init__(self, fn: Callable, inputs: tuple, warmup: int = 2):
        t0 = time.perf_counter()
        self.fn = fn
        self.inputs = tuple(t.clone() for t in inputs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = fn(*self.inputs)
        torch.cuda.synchronize()
        self.setup_s = round(time.perf_counter() - t0, 3)

    def __call__(self, *inputs):
        for static, t in zip(self.inputs, inputs):
            static.copy_(t)
        self.graph.replay()
        return self.output
