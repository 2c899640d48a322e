"""Execution variants of the reference LLM, set up once per request shape outside the timed loop.

``resolve_moe_kernel`` says which sync-free routed-expert kernel a config gets on this device (or
why none can run), ``resolve_decode_attention`` the same for the static cache's decode attention.
``StaticDecoder`` owns, for one (batch, cache length), the static KV cache, the device-side
position, the decode-phase routing counts and the decode step as it will run: eager, compiled
(``torch.compile``) and/or captured in a CUDA graph and replayed. Nothing in its ``step`` makes
the host wait; the position advances on the device.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from ..config import ExecutionConfig
from ..errors import HarnessError
from .routing import DeviceCounts
from .static_cache import StaticKVCache


def resolve_moe_kernel(m: ExecutionConfig, device: torch.device, dtype: torch.dtype) -> tuple:
    """(kernel or None for the vendor loop, why): ``moe_kernel=auto`` takes triton on CUDA and the
    torch gather path elsewhere; a kernel that cannot run here is refused, never replaced."""
    from . import fast_moe
    from ..kernels.availability import triton_available

    if m.moe_impl == "vendor_loop":
        return None, "vendor loop: per-expert Python loop, one device-to-host copy per MoE layer"
    want = m.moe_kernel
    if want == "auto":
        want = "triton" if device.type == "cuda" and triton_available(device)[0] else "torch"
    if want == "torch":
        return "torch", "torch: per-row expert gather + bmm (sync-free, reads each routed row's expert)"
    ok, why = (triton_available(device) if want == "triton"
               else fast_moe.grouped_mm_available(device, dtype))
    if not ok:
        raise HarnessError(f"execution.moe_kernel={want} cannot run here: {why}",
                           "use execution.moe_kernel=auto or torch")
    return want, f"{want}: {why}"


def resolve_decode_attention(m: ExecutionConfig, device: torch.device) -> str:
    """What the decode attention runs under ``m`` on ``device`` (for the manifest); a Triton kernel
    that cannot run here, or without a static cache, is refused, never replaced."""
    from ..kernels.availability import triton_available

    if m.decode_attention == "triton" and m.kv_cache != "static":
        raise HarnessError("execution.decode_attention=triton needs kv_cache=static (the kernel reads a "
                           "preallocated cache up to the step's device-side position)",
                           "add execution.kv_cache=static, or use execution.decode_attention=sdpa")
    if m.kv_cache != "static":
        return "growing cache: attn_implementation over the positions so far"
    if m.decode_attention == "sdpa":
        return "sdpa: attn_implementation (torch SDPA by default) over the whole static buffer with a mask"
    ok, why = triton_available(device)
    if not ok:
        raise HarnessError(f"execution.decode_attention=triton cannot run here: {why}", "use execution.decode_attention=sdpa")
    return f"triton: split-KV kernel (decode_attention_triton) over positions 0..pos only; {why}"


class StaticDecoder:
    """The decode step of one (batch, cache length) with a static cache.

    ``step(token)`` runs one step and returns the next token [B, 1]: through the CUDA graph when
    ``cuda_graphs == 'decode'`` (inputs copied into static buffers, one replay), else the (compiled)
    step function. ``setup_s`` holds the one-off set-up seconds (compile, capture).
    """

    def __init__(self, model, m: ExecutionConfig, batch: int, max_len: int, device, dtype, select: Callable):
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
        self.fn = model.decode_core
        if m.compile:
            self.fn = torch.compile(model.decode_core, dynamic=False)
        self._prepare(m, device)

    def _run(self, n: int) -> None:
        for _ in range(n):
            self.token_out = self.fn(self.token_in, self.cache, self.select)

    def _prepare(self, m: ExecutionConfig, device) -> None:
        """Warm the step up (the first compiled call compiles) and capture it; the warm-up writes
        scratch K/V and counts, which ``begin`` resets."""
        self.model.route_moe(self.decode_counts)
        cuda = device.type == "cuda"
        if m.compile or m.cuda_graphs == "decode":
            self.model.decode_core(self.token_in, self.cache, self.select)   # eager first: probes, lazy buffers
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
            self.setup_s["warmup_compile" if m.compile else "warmup"] = round(time.perf_counter() - t0, 3)
        if m.cuda_graphs == "decode":
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
            if self.model._prefill_counts is not None:    # the warm-up runs counted routing too
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
