"""The static-cache decode step and prefill as they run: eager, compiled, or replayed from CUDA graphs.

Set up once per request shape outside the timed loop (``variants.engine.Engine.static_decoder``).
``StaticDecoder`` owns, for one (batch, cache length), the static KV cache, the device-side
position, the device-side MoE routing (``models.routing.DeviceRouting``: counts per decode step
at a device step index, forced experts over the cache's positions) and the decode step as it will
run: eager, compiled (``torch.compile``) and/or captured in a CUDA graph and replayed. Nothing in
its ``step`` makes the host wait; the position and the routing step advance on the device.

Routing (``workload.routing``) and captures: a compiled step takes the routing as a runtime input
(``DeviceRouting.switch``: the weights' and the balanced routing share one compile and one graph);
an uncompiled step captured in a graph is captured once per routing (``forced`` or not: a capture
takes about as long as a few steps), so the weights' step holds no forced-routing kernels.
"""
from __future__ import annotations

import contextlib
import time
import types
from typing import Callable, Optional

import torch

from ..errors import HarnessError
from ..models.routing import DeviceRouting
from .static_kv import StaticKVCache


def own_code(fn: Callable) -> Callable:
    """``fn`` with a code object of its own (same body, globals and closure; a bound method stays bound
    to its object). Dynamo keeps compiled graphs per code object and, once one holds ``recompile_limit``
    (8) guard sets, runs the function eagerly with a warning: the prefill compiles one closure per request
    shape and the decode step one ``decode_core`` per decoder (batch, cache length), so each gets its own."""
    if isinstance(fn, types.MethodType):
        return types.MethodType(own_code(fn.__func__), fn.__self__)
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def on_side_stream(fn: Callable, n: int) -> None:
    """``fn()`` ``n`` times on a side CUDA stream that waits for the current one, which then waits for
    it: the warm-up before a capture (lazy allocations and kernel builds off the capture stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(n):
            fn()
    torch.cuda.current_stream().wait_stream(stream)


class StaticDecoder:
    """The decode step of one (batch, cache length) with a static cache.

    ``step(token)`` runs one step and returns the next token [B, 1]: through the CUDA graph of the
    running routing when ``graphs`` (``cuda_graphs=decode``: inputs copied into static buffers, one
    replay), else the step function, ``torch.compile``'d with ``compile``. ``model`` is an
    ``engine.Engine`` (its ``decode_core`` / ``prefill_core``); ``routing``: the ``DeviceRouting``
    with ``device_routing`` (grouped MoE), else None (the vendor loop counts on the host);
    ``bind`` (``decode_step=fused``) gives the step function instead: ``bind(decoder)`` -> a callable
    like ``decode_core``, built once the cache, the token buffer and the routing exist (not
    compiled). ``compile_prefill`` (``prefill_compile``): ``prefill`` compiles the forward it captures.
    ``setup_s`` holds the one-off set-up seconds (compile, captures).
    """

    def __init__(self, model, batch: int, max_len: int, device, dtype, select: Callable, compile: bool = False,
                 graphs: bool = False, device_routing: bool = False,
                 bind: Optional[Callable] = None, compile_prefill: bool = False):
        L = model.cfg.llm
        self.model, self.select = model, select
        self.cache = StaticKVCache(L.num_layers, batch, L.num_kv_heads, max_len, L.head_dim, dtype, device,
                                   query_heads=L.num_heads)
        self.cache.position = torch.zeros(1, dtype=torch.int64, device=device)
        # every step a cache of max_len positions can hold (prompt >= 1 token), forced experts over all of them
        self.routing = DeviceRouting(L.num_layers, L.n_routed_experts, max_len - 1, device, "device",
                                     position=self.cache.position, switch=compile,
                                     table_shape=(batch, max_len, L.num_layers, L.num_experts_per_tok),
                                     rows=batch * L.num_experts_per_tok) if device_routing else None
        self.use_graphs = graphs
        self.compile_prefill = compile_prefill
        self.decode_graphs: dict = {}      # routing mode -> (CUDAGraph, its output buffer)
        self.token_in = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self._returned = None       # the token the last replay returned (its value is in token_in, see step)
        self.setup_s: dict = {}
        self.graphs: dict = {}
        self.core = bind(self) if bind is not None else model.decode_core
        self.fn = self.core
        if compile and bind is None:
            self.fn = torch.compile(own_code(model.decode_core), dynamic=False)   # a code object per decoder
        if graphs and device.type != "cuda":
            raise HarnessError("execution.cuda_graphs=decode needs a CUDA device", "use execution.cuda_graphs=none")
        if compile or graphs:
            self._warm_up("warmup_compile" if compile else "warmup", 3)
        if graphs:
            self._capture()

    def _mode(self):
        """The routing the step runs: 'switch' (a runtime input), True (forced), False (the weights')."""
        r = self.routing
        return "switch" if r is None or r.switch else r.active

    @contextlib.contextmanager
    def _decoding(self):
        """The model's MoE layers count into ``routing`` as in a decode step (warm-ups, captures)."""
        self.model.route_moe(self.routing)
        if self.routing is not None:
            self.routing.phase = "decode"
        try:
            yield
        finally:
            if self.routing is not None:
                self.routing.phase = None

    def _call(self) -> torch.Tensor:
        """One call of the step function on the decoder's token buffer, cache and routing."""
        return self.fn(self.token_in, self.cache, self.select, self.routing)

    def _warm_up(self, key: str, runs: int) -> None:
        """Warm the step up (the first compiled call compiles) on a side stream (CUDA): eager once first
        (probes, lazy buffers). The warm-up writes scratch K/V and counts, which ``begin`` resets."""
        with self._decoding():
            self.core(self.token_in, self.cache, self.select, self.routing)   # eager first: probes, kernel builds
            t0 = time.perf_counter()
            if self.cache.k[0].device.type == "cuda":
                on_side_stream(self._call, runs)
                torch.cuda.synchronize()
            else:
                for _ in range(runs - 1):
                    self._call()
        self.setup_s[key] = round(time.perf_counter() - t0, 3)

    def _capture(self) -> None:
        """The step captured in a CUDA graph for the routing running now (``_mode``)."""
        mode = self._mode()
        key = "capture" if mode in ("switch", False) else "capture_forced"
        if mode is True:          # the forced step's own kernels run once before their capture
            self._warm_up("warmup_forced", 2)
        t0 = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        with self._decoding(), torch.cuda.graph(graph):
            out = self._call()
        torch.cuda.synchronize()
        self.decode_graphs[mode] = (graph, out)
        self.setup_s[key] = round(time.perf_counter() - t0, 3)

    def prefill(self, request, image_embeds: Optional[torch.Tensor]) -> torch.Tensor:
        """The first token of ``request`` through the prefill forward captured for its shape (batch,
        prompt length, image position) and routing: ``model.prefill_core`` replayed; the cache holds the
        prompt after."""
        S = request.input_ids.shape[1]
        start, n_img = request.image_start, request.image_tokens
        key = ("prefill", tuple(request.input_ids.shape), start, n_img, self._mode())
        if key not in self.graphs:
            def fn(ids, img):
                return self.model.prefill_core(ids, img, self.cache, self.select, start)
            if self.compile_prefill:           # compiled in the capture's warm-up (setup_s)
                fn = torch.compile(own_code(fn), dynamic=False)
            self.model.prefill_core(request.input_ids, image_embeds, self.cache, self.select, start)   # eager first
            self.graphs[key] = CapturedCall(fn, (request.input_ids, image_embeds))
            self.setup_s[f"prefill_capture_S{S}" + ("_forced" if key[-1] is True else "")] = self.graphs[key].setup_s
            self.cache.length = 0
            if self.routing is not None:       # the warm-up runs counted routing too
                self.routing.zero_prefill()
        out = self.graphs[key](request.input_ids, image_embeds).clone()
        self.cache.advance(S)
        return out

    def begin(self) -> StaticKVCache:
        """A new request (its routing already begun: ``RoutingCounter.target``): the step of its routing
        captured if it is not yet; position 0, empty cache bookkeeping, zero routing counts; the step
        function's ``begin`` if it has one."""
        if self.use_graphs and self._mode() not in self.decode_graphs:
            self._capture()
        self.cache.length = 0
        self._returned = None
        self.cache.position.zero_()
        if self.routing is not None:
            self.routing.zero()
        begin = getattr(self.core, "begin", None)      # the step function's own reset (``FusedCore.begin``)
        if begin is not None:
            begin()
        return self.cache

    def eager_step(self) -> torch.Tensor:
        """One decode step as the step function runs uncompiled and outside any graph, at the current
        device position, routing counted as in the captured step: the kernels a replay runs, from the
        same modules (a compiled step's differ in fusion). For kernel attribution after a request
        (``harness.measure.alignment``): the next request's ``begin`` resets what it writes."""
        self._returned = None
        with self._decoding():
            return self.core(self.token_in, self.cache, self.select, self.routing)

    def after_request(self) -> None:
        """After a request (``Engine.running``; never inside a step): the step function's own
        ``after_request``, if it has one (``FusedCore.after_request``: the clock's stamps, one device read)."""
        after = getattr(self.core, "after_request", None)
        if after is not None:
            after()

    def step(self, token: torch.Tensor) -> torch.Tensor:
        if self.use_graphs:
            graph, out = self.decode_graphs[self._mode()]
            # a graph whose output is the token buffer itself (the fused step writes the next token
            # there) already holds the token it returned last: fed that back, no copy kernel is needed
            in_place = out.data_ptr() == self.token_in.data_ptr()
            if token is not self._returned or not in_place:
                self.token_in.copy_(token)
            graph.replay()
            history = getattr(self.core, "history", None)
            if history is not None and in_place:
                # the step kept its token at its position (``FusedCore``): a view, no copy kernel; it
                # holds until a later request decodes that position again
                out = history[self.cache.length:self.cache.length + 1].view(1, 1)
            else:
                out = out.clone()
            self._returned = out
        else:
            out = self.fn(token, self.cache, self.select, self.routing)
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
        on_side_stream(lambda: fn(*self.inputs), warmup)
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
