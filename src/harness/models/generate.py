"""The one generate loop: vision + prefill, then greedy single-token steps, for any adapter.

``generate(adapter, request, stage)`` runs ``request`` (a ``harness.workload.Request`` already on
the model's device) through a ``ModelAdapter``: the adapter's ``first_token`` (vision stages and
prefill), then ``decode_tokens - 1`` calls of ``next_token`` (one ``decode_step`` range each).
EOS is ignored: decoding always runs the fixed budget. Routing counts (per phase, and per decode
step: ``counter.step(i)`` is a host integer, nothing syncs; a static-cache step moves its own device
step index), the KV cache size and the request's host time come back in a ``GenerationResult``.
The counter is planned with the request (its decode steps and ``workload.routing``) before the
adapter sets the request up. An adapter that owns its loop (``generate_own``,
``harness.models.adapter.own_loop``) runs the request itself instead.

Progress inside a request: where ``DECODE_WATCH`` holds a watcher (the run verb sets
``harness.report.progress.DecodeProgress``), the loop tells it the decode steps planned
(``begin(steps, batch)``) and, after each step, the steps its host loop has issued
(``step(done)``: a host integer; on CUDA the device may still be running the last ones). The
watcher reads its own clock and decides when to say something: nothing here waits for the device.
"""
from __future__ import annotations

import contextvars
import time
from typing import Optional

import torch

from .adapter import GenerationResult, ModelAdapter, StageFn, greedy, no_stage, own_loop

#: who watches the decode loop's progress (module docstring); None: nobody
DECODE_WATCH: contextvars.ContextVar = contextvars.ContextVar("decode_watch", default=None)


def generate(adapter: ModelAdapter, request, stage: StageFn = no_stage,
             max_new_tokens: Optional[int] = None, defer_routing: bool = False) -> GenerationResult:
    """Run one request end to end; ``max_new_tokens`` overrides ``request.decode_tokens`` (the
    tokens decoded; a static cache keeps the length of the longer of the two, so a shorter call
    runs on the same cache and captured step as the request's full budget). ``defer_routing``: the
    routing counts are not read back now (no host synchronisation at the request's end): the
    result's ``routing`` / ``routing_steps`` stay empty and ``pending()`` gives them later
    (``RoutingCounter.deferred``); an adapter that owns its loop reads them as it does."""
    n_new = request.decode_tokens if max_new_tokens is None else max_new_tokens
    own = own_loop(adapter)
    if own is not None:  # outside inference_mode: the owner decides (HF generate runs under no_grad)
        return own(request, stage, n_new)
    return _loop(adapter, request, stage, n_new, defer_routing)


@torch.inference_mode()
def _loop(adapter: ModelAdapter, request, stage: StageFn, n_new: int, defer: bool = False) -> GenerationResult:
    """The harness's greedy loop over ``first_token`` / ``next_token``."""
    counter = adapter.routing_counter()
    steps = max(n_new - 1, 0)
    counter.plan(request, steps)
    out = []
    # caches (and the graphs captured for them) are sized for the request's budget, also when this
    # call decodes fewer tokens (a short warm-up or profiled request runs the timed requests' shapes)
    with adapter.running(request, max(n_new, request.decode_tokens), counter) as cache, stage("request"):
        t0 = time.perf_counter()
        counter.phase("prefill")
        token = adapter.first_token(request, cache, stage, greedy)
        counter.phase("decode")
        out.append(token)
        watch = DECODE_WATCH.get()
        if watch is not None:
            watch.begin(steps, request.batch)
        with stage("decode"):
            for step in range(steps):
                counter.step(step)
                with stage("decode_step", step=step):
                    token = adapter.next_token(token, cache, greedy)
                out.append(token)
                if watch is not None:
                    watch.step(step + 1)
        counter.step(None)
        counter.phase(None)
        host_ms = (time.perf_counter() - t0) * 1e3
    tokens = torch.cat(out, dim=1)[:, :n_new]
    if defer:
        return GenerationResult(tokens=tokens, kv_cache_bytes=cache.nbytes(), host_ms={"request": host_ms},
                                pending=counter.deferred())
    return GenerationResult(tokens=tokens, routing=counter.result(), routing_steps=counter.steps_result(),
                            kv_cache_bytes=cache.nbytes(), host_ms={"request": host_ms})
