"""MoE routing of one request: routed-expert counts per phase and decode step, and forced routing.

Counts
------
Models report each MoE layer's routing either as host counts they already have (the vendor loop
copies them to the host anyway: ``add_host``) or as the device tensor of chosen experts
(``add_device``: one scatter-add on the device, no host sync, so a sync-free step stays sync-free).
A request's ``RoutingCounter`` holds the host counts and reads the device ones back once, after
the request (``result``, ``steps_result``).

Device counts live in a ``DeviceRouting``: the prefill counts int64 [1, layers, experts] and the
decode counts in ONE int64 buffer [steps + 1, layers, experts] with a device step index int64 [1].
A decode step's MoE layer adds its experts at row ``min(step_index, steps)``: the last row catches
steps beyond the plan (warm-ups, graph captures), so no write is ever out of bounds. A counting
target (``DeviceRouting``, or a ``RoutingCounter`` through its own) exposes ``device_counts() ->
(buffer, step_index)`` of the phase running (prefill: its [1, layers, experts] buffer and a constant
zero index); a kernel that counts by itself computes its offset on the device:
``(min(step, steps) * layers + layer) * experts`` with ``steps = buffer.shape[0] - 1``
(``kernels.router_triton``).

The step index moves one of two ways (``DeviceRouting.driven``):

- ``host``: a loop on the host (the vendor loop, a growing cache) tells each step with
  ``set_step(i)`` (the index filled from the host integer; no sync), and ``add_device`` writes at
  the host offset of that step;
- ``device``: a static-cache decode step (eager, compiled or replayed from a CUDA graph) calls
  ``advance()`` at its end, inside the step: the index moves on the device. There ``add_device``
  adds to a per-layer scratch [layers, experts] at a host offset (one scatter-add, as at a host
  offset), which ``advance`` adds into the step's row (one ``index_add_`` per step instead of an
  index computation per layer); a kernel that counts by itself writes the row directly.

A decode step of its own (a fused step's kernels) takes what it needs from the MoE layers' routing
target (``MoE.routing``): ``device_counts()`` for the counts, ``forced_inputs()`` -> (table,
position, on) for the forced experts (below), and calls ``advance()`` once at its end, inside the
step (it adds any torch-path counts of the step and moves the step index; a step that moves the
index itself must still add ``scratch`` into the row, or count every layer itself).

Forced routing (``workload.routing=balanced``)
----------------------------------------------
The checkpoint's own routing (``weights``) is the default: parity depends on it. ``balanced``
replaces each token's top-k by experts drawn from a seed, as a trained MoE (balanced by its
auxiliary loss) spreads a batch over most experts: a device int64 table ``forced_experts``
[batch, positions, layers, top_k] for every row, absolute position and layer of the request
(positions: prompt + decode tokens, or a static cache's length), built once per request by
``balanced_table``. The gate reads ``table[b, pos, layer]`` at the token's position (prefill:
positions 0..S-1; decode: the device position ``position`` [1], a static cache's own), and its
weights are the model's own softmax probabilities at those experts (then ``norm_topk_prob`` and
the scale as usual): ``llm.MoEGate.select``, the one place it enters the model.

A compiled decode step takes the routing as a runtime input (``switch``): a device flag ``on``
[1] (bool) picks the table's experts where it holds and the gate's top-k elsewhere, so the
weights' and the balanced routing share one compile and one capture (the weights' experts and
weights are then exactly the top-k's: the same indices, ``scores.gather`` of the same values).

Generator of ``balanced_table`` (reproducible, numpy only, the same table on every device: each
page is drawn on the host once, and on CUDA copied to the device once, where the request's table is
assembled from its pages' draws): for the page of each row, ``key = zlib.crc32(page name, UTF-8)``
(a row of a batch of copies routes as its page does), ``rng =
numpy.random.Generator(numpy.random.PCG64(numpy.random.SeedSequence([seed mod 2**32, key])))``,
``u = rng.random((positions, layers, top_k))`` (float64 in [0, 1), position-major: the table of P
positions is the first P positions of any longer one); for j = 0..top_k-1, ``r_j = floor(u[..., j]
* (experts - j))`` and expert j is the r_j-th smallest (from 0) expert id not among experts
0..j-1 of the same position and layer. Every (position, layer) gets top_k distinct experts, each
set equally likely (sequential draws without replacement).
"""
from __future__ import annotations

import copy
import zlib
from typing import Optional

import numpy as np
import torch

from ..errors import HarnessError
from ..schema.routing import routed_steps

#: workload.routing values: the checkpoint's own routing, or seeded uniform top-k per token
ROUTINGS = ("weights", "balanced")


# ------------------------------------------------------------------------------ forced routing

def routing_label(routing: str, seed: int = 0) -> str:
    """How a case's routing is named in the manifest and the report: 'weights' or 'balanced (seed 0)'."""
    return f"{routing} (seed {seed})" if routing == "balanced" else str(routing)


def page_key(page: str) -> int:
    """The 32-bit key of a page in the balanced table's generator: CRC-32 of its name (UTF-8)."""
    return zlib.crc32(str(page).encode("utf-8"))


def balanced_experts(seed: int, page: str, positions: int, layers: int, top_k: int, experts: int) -> np.ndarray:
    """int64 [positions, layers, top_k]: the balanced routing of one row (module docstring's generator)."""
    if not 1 <= top_k <= experts:
        raise HarnessError(f"balanced routing needs 1 <= top_k <= experts, got top_k={top_k}, experts={experts}")
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, page_key(page)])))
    u = rng.random((positions, layers, top_k))
    out = np.empty((positions, layers, top_k), dtype=np.int64)
    for j in range(top_k):
        v = np.floor(u[..., j] * (experts - j)).astype(np.int64)
        for c in np.sort(out[..., :j], axis=-1).transpose(2, 0, 1):   # chosen ids, ascending: skip each
            v += v >= c
        out[..., j] = v
    return out


#: drawn pages kept for reuse (a throughput run cycles through its pages, a run repeats them): (seed, page
#: key, layers, top_k, experts) -> the longest draw so far, uint8 when the expert ids fit (the table of P
#: positions is the first P positions of any longer one: module docstring); at most ``DRAWN_PAGES`` pages
_drawn: dict = {}
DRAWN_PAGES = 2048


def page_experts(seed: int, page: str, positions: int, layers: int, top_k: int, experts: int) -> np.ndarray:
    """``balanced_experts`` of one page, drawn once per page and cut to ``positions`` (a shorter request
    reads the prefix of the longest draw; a longer one draws again). Read-only view."""
    key = (int(seed), page_key(page), layers, top_k, experts)
    kept = _drawn.get(key)
    if kept is None or kept.shape[0] < positions:
        drawn = balanced_experts(seed, page, positions, layers, top_k, experts)
        kept = drawn.astype(np.uint8) if experts <= 256 else drawn
        kept.flags.writeable = False
        if key not in _drawn and len(_drawn) >= DRAWN_PAGES:
            _drawn.clear()
        _drawn[key] = kept
    return kept[:positions]


def experts_per_step(steps: Optional[np.ndarray]) -> np.ndarray:
    """Distinct experts touched of every (decode step, layer) that routed anything (``routed_steps``)."""
    return routed_steps(steps)[1]


#: pages' draws kept on a CUDA device (``balanced_table(device=...)``): (device, seed, page key, layers,
#: top_k, experts) -> (device tensor of the draw, its pinned source, kept until the copy has run)
_on_device: dict = {}


def _device_rows(seed: int, page: str, positions: int, layers: int, top_k: int, experts: int, device) -> torch.Tensor:
    """``page_experts`` of one page as a device tensor [positions, ...] (uint8 where the ids fit), copied
    once per page (and again for a longer draw) from pinned memory without a host synchronisation."""
    key = (str(device), int(seed), page_key(page), layers, top_k, experts)
    kept = _on_device.get(key)
    if kept is None or kept[0].shape[0] < positions:
        if key not in _on_device and len(_on_device) >= DRAWN_PAGES:
            _on_device.clear()
        src = torch.from_numpy(np.array(page_experts(seed, page, positions, layers, top_k, experts))).pin_memory()
        kept = _on_device[key] = (src.to(device, non_blocking=True), src)
    return kept[0][:positions]


def balanced_table(seed: int, pages: list, positions: int, layers: int, top_k: int, experts: int,
                   device=None) -> torch.Tensor:
    """int64 [batch, positions, layers, top_k]: ``balanced_experts`` of each row's page (``page_experts``).
    On the CPU by default; with a CUDA ``device`` the table is assembled there from each page's draw,
    copied to the device once per page (``_device_rows``): no per-request host work beyond the look-up,
    no host synchronisation."""
    if device is not None and torch.device(device).type == "cuda":
        rows = [_device_rows(seed, p, positions, layers, top_k, experts, device) for p in pages]
        return torch.stack(rows).to(torch.int64)
    rows = [page_experts(seed, p, positions, layers, top_k, experts) for p in pages]
    return torch.from_numpy(np.stack(rows).astype(np.int64))


class PendingCounts:
    """Device routing counts on their way to the host (``DeviceRouting.read_async``): ``get()`` ->
    ``DeviceRouting.read``'s arrays once the copy has run (one event wait), or None on ``meta``."""

    def __init__(self, parts: Optional[tuple], done=None):
        self.parts, self.done = parts, done

    def get(self) -> Optional[tuple]:
        if self.parts is None:
            return None
        if self.done is not None:
            self.done.synchronize()
        return tuple(t.numpy().astype(np.int64) for t in self.parts)


# ------------------------------------------------------------------------------ device side

def _scatter_count(buf: torch.Tensor, offset: int, experts: int, topk_ids: torch.Tensor,
                   ones: Optional[torch.Tensor]) -> torch.Tensor:
    """One scatter-add of 1 per expert id into ``buf.view(-1)[offset:offset + experts]`` (no host
    sync); returns the ones buffer to keep (grown on the host when a call has more ids: never inside
    a captured graph, whose warm-up grew it)."""
    idx = topk_ids.reshape(-1)
    if ones is None or ones.numel() < idx.numel() or ones.device != idx.device:
        ones = torch.ones(max(idx.numel(), 64), dtype=torch.int64, device=idx.device)
    buf.view(-1)[offset:offset + experts].scatter_add_(0, idx, ones[:idx.numel()])
    return ones


class DeviceRouting:
    """The device side of one request shape's MoE routing (module docstring): counts, step index,
    forced experts. A static decoder keeps one across its requests (fixed addresses: a captured graph
    or a compiled step keeps using them); a growing cache's request has its own.

    ``steps``: decode steps the buffer holds (its rows - 1); ``driven``: ``host`` or ``device``;
    ``position``: the decode token's position [1] (int64, device; a static cache's own tensor, else
    one filled from the host); ``switch``: forced routing as a runtime input (``on``);
    ``table_shape``: [batch, positions, layers, top_k] of a forced table allocated now and kept (a
    static decoder's: requests copy theirs into it, so a captured graph keeps reading it); without
    it each request's table is allocated as it comes; ``rows``: expert ids one call counts at most
    (sizes the ones buffer).
    ``phase`` (``prefill``, ``decode`` or None: not counting) is set from the host between phases.
    """

    def __init__(self, layers: int, experts: int, steps: int, device, driven: str = "host",
                 position: Optional[torch.Tensor] = None, switch: bool = False, table_shape: Optional[tuple] = None,
                 rows: int = 64):
        if driven not in ("host", "device"):
            raise HarnessError(f"DeviceRouting: driven={driven!r} is not host or device")
        self.layers, self.experts, self.steps, self.driven = layers, experts, max(int(steps), 0), driven
        self.device = torch.device(device)
        z = dict(dtype=torch.int64, device=self.device)
        self.prefill = torch.zeros((1, layers, experts), **z)
        self.decode = torch.zeros((self.steps + 1, layers, experts), **z)
        self.step_index = torch.zeros(1, **z)
        self._zero = torch.zeros(1, **z)
        self.scratch = torch.zeros((layers, experts), **z) if driven == "device" else None
        self.scratch_used = False      # a torch-path layer counted into scratch (set on the host, while tracing)
        self._flat: Optional[torch.Tensor] = None
        self.position = position if position is not None else torch.zeros(1, **z)
        self.switch = bool(switch)
        self.on = torch.zeros(1, dtype=torch.bool, device=self.device) if switch else None
        self.table: Optional[torch.Tensor] = None
        self.keeps_table = table_shape is not None
        if table_shape is not None:    # valid experts (0..k-1) until a request loads its own
            self.table = torch.arange(table_shape[-1], **z).expand(*table_shape).contiguous()
        self.active = False            # this request runs forced routing
        self.phase: Optional[str] = None
        self.host_step: Optional[int] = None
        self.prompt_tokens = 0
        self._ones = torch.ones(max(rows, 64), **z)
        # ones buffers replaced by a larger one, kept alive: a CUDA graph or compiled step captured
        # with one reads its address on every replay (freed, the allocator reuses it: an H100 batch-8
        # decode counted 625,965 per layer per step instead of 48)
        self._retired: list = []

    # -------------------------------------------------------------------- a request
    def begin(self, table: Optional[torch.Tensor], prompt_tokens: int) -> None:
        """A new request: zero counts and step index; its forced experts (a CPU int64 [batch, positions,
        layers, top_k] from ``balanced_table``, copied into the table this object keeps) or None (the
        weights' routing); ``prompt_tokens``: its prompt length (host-driven positions: prompt + step)."""
        self.prompt_tokens = int(prompt_tokens)
        self.active = table is not None
        if table is not None:
            if self.table is None or (self.table.shape != table.shape and not self.keeps_table):
                self.table = torch.empty(table.shape, dtype=torch.int64, device=self.device)
            if self.table.shape != table.shape:
                raise HarnessError(f"forced routing table {tuple(table.shape)} does not fit the kept "
                                   f"{tuple(self.table.shape)}")
            self.table.copy_(table)
        if self.on is not None:
            self.on.fill_(self.active)
        self.zero()

    @property
    def positions(self) -> Optional[int]:
        """Positions of the forced table this object keeps (None: none yet)."""
        return None if self.table is None else int(self.table.shape[1])

    def zero(self) -> None:
        """Counts, scratch and step index back to zero."""
        for t in (self.prefill, self.decode, self.step_index, self.scratch):
            if t is not None:
                t.zero_()
        self.host_step = None

    def zero_prefill(self) -> None:
        """The prefill counts back to zero (after a capture's warm-up runs)."""
        self.prefill.zero_()

    # ---------------------------------------------------------------------- steps
    def set_step(self, index: Optional[int]) -> None:
        """Host-driven: decode step ``index`` runs from now on (None: outside the steps)."""
        self.host_step = index
        row = self.steps if index is None else index
        self.step_index.fill_(row)
        if self.active and index is not None:
            self.position.fill_(self.prompt_tokens + index)

    def advance(self) -> None:
        """Device-driven, at the end of a decode step (inside it): the scratch counts into row
        min(step_index, steps) (one scatter-add at a device offset: ``index_add_`` at a device row
        lowers under torch.compile to a sorted ``index_put_`` with bounds asserts, ~20 µs per step),
        scratch zeroed, step index + 1. A step whose layers all counted by themselves (a kernel
        writing the row: ``scratch_used`` still False when the step ends) only moves the index. No
        host sync."""
        if self.scratch is not None and self.scratch_used:
            n = self.layers * self.experts
            if self._flat is None:
                self._flat = torch.arange(n, dtype=torch.int64, device=self.device)
            at = self.step_index.clamp(max=self.steps) * n + self._flat
            self.decode.view(-1).scatter_add_(0, at, self.scratch.view(-1))
            self.scratch.zero_()
        self.step_index.add_(1)

    # ------------------------------------------------------------------- counting
    def device_counts(self) -> Optional[tuple]:
        """(buffer [steps + 1, layers, experts], step_index [1]) of the phase running (prefill: its
        [1, layers, experts] buffer, a zero index); None while not counting."""
        if self.phase == "prefill":
            return self.prefill, self._zero
        if self.phase == "decode":
            return self.decode, self.step_index
        return None

    def add_device(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Add the experts chosen in MoE ``layer`` (any-shaped int64 tensor of expert ids) on the device."""
        if self.phase is None:
            return
        E = self.experts
        if self.phase == "prefill":
            buf, offset = self.prefill, layer * E
        elif self.scratch is not None:          # device-driven: advance() moves it into the step's row
            buf, offset = self.scratch, layer * E
            self.scratch_used = True
        else:
            step = self.steps if self.host_step is None else min(self.host_step, self.steps)
            buf, offset = self.decode, (step * self.layers + layer) * E
        ones = _scatter_count(buf, offset, E, topk_ids, self._ones)
        if ones is not self._ones:   # grown (a prefill of many rows): a captured step may still read the old one
            self._retired.append(self._ones)
            self._ones = ones

    def read(self, steps: int) -> Optional[tuple]:
        """(prefill [layers, experts], decode per step [steps, layers, experts], decode outside the
        planned steps [layers, experts]) as int64 numpy arrays (one device read); None on ``meta``."""
        return self.read_async(steps).get()

    def read_async(self, steps: int) -> "PendingCounts":
        """``read`` without waiting: on CUDA the counts are copied into pinned host memory on the
        current stream (no host synchronisation); ``get()`` waits for that copy alone."""
        if self.device.type == "meta":
            return PendingCounts(None)
        parts = (self.prefill[0], self.decode[:steps], self.decode[steps:].sum(0))
        if self.device.type != "cuda":     # copies: the buffers are the next request's once it begins
            return PendingCounts(tuple(t.to("cpu", copy=True) for t in parts))
        host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in parts)
        done = torch.cuda.Event()
        done.record()
        return PendingCounts(host, done)

    # -------------------------------------------------------------------- forced
    def _forcing(self) -> bool:
        # ``switch`` first: a compiled step never reads ``active`` (no guard on it, so no recompile per routing)
        return self.table is not None and (self.switch or self.active)

    def forced_experts(self, layer: int, batch: int, tokens: int) -> Optional[tuple]:
        """(experts int64 [batch * tokens, top_k], on) of MoE ``layer`` for ``tokens`` tokens per row in
        the phase running (prefill: positions 0..tokens-1; decode: ``position``), or None (the weights'
        routing). ``on``: None (forced) or the runtime flag [1] (bool; ``switch``)."""
        if not self._forcing():
            return None
        if self.table.shape[0] != batch:
            raise HarnessError(f"forced routing table has {self.table.shape[0]} rows, the batch {batch}")
        if self.phase == "decode":
            pos = self.position.clamp(max=self.table.shape[1] - 1)
            rows = self.table.index_select(1, pos)[:, 0, layer]
        else:
            rows = self.table[:, :tokens, layer]
        return rows.reshape(batch * tokens, -1).contiguous(), self.on

    def forced_inputs(self) -> Optional[tuple]:
        """(table [batch, positions, layers, top_k], position [1], on [1] bool or None) for a kernel
        that reads the table itself (prefill: position 0), or None (the weights' routing)."""
        if not self._forcing():
            return None
        return self.table, (self.position if self.phase == "decode" else self._zero), self.on


# ------------------------------------------------------------------------------ one request

class RoutingCounter:
    """Tokens routed to each expert in one request: {phase: int64 [layers, experts]} (dense layers
    stay zero) and per decode step [steps, layers, experts]; the request's forced routing.

    ``plan(request, steps)`` (before the request): the decode steps and the request's routing
    (``request.routing``, ``routing_seed``, ``pages``, prompt length, device); ``target(shared)``:
    what the MoE layers report to (``shared``: a static decoder's ``DeviceRouting``, begun for this
    request; else this counter, whose device counts and forced table live in its own host-driven
    ``DeviceRouting``, made on first use). ``phase(name)`` and ``step(i)`` from the loop;
    ``result()`` / ``steps_result()`` read everything back once, after the request."""

    def __init__(self, layers: int, experts: int, top_k: Optional[int] = None):
        self.layers, self.experts, self.top_k = layers, experts, top_k
        self._host: dict = {}
        self.current: Optional[str] = None
        self.steps = 0                       # decode steps of the request (plan_steps)
        self.current_step: Optional[int] = None
        self._host_steps: Optional[np.ndarray] = None
        self.device: Optional[DeviceRouting] = None
        self._read: Optional[tuple] = None
        self.routing, self.seed, self.pages, self.prompt_tokens, self._where = "weights", 0, [], 0, None

    # ----------------------------------------------------------------------- plan
    def plan_steps(self, steps: int) -> None:
        """Keep per-step decode counts for ``steps`` decode steps (0: none)."""
        self.steps = max(int(steps), 0)
        self._host_steps = np.zeros((self.steps, self.layers, self.experts), dtype=np.int64) if self.steps else None

    def plan(self, request, steps: int) -> None:
        """``plan_steps(steps)`` and the routing ``request`` asks for (``workload.Request``)."""
        self.plan_steps(steps)
        self.routing = getattr(request, "routing", "weights")
        self.seed = getattr(request, "routing_seed", 0)
        self.pages = list(request.pages)
        self.prompt_tokens = int(request.input_ids.shape[1])
        self._where = request.input_ids.device
        if self.routing not in ROUTINGS:
            raise HarnessError(f"workload.routing={self.routing!r} is not one of {', '.join(ROUTINGS)}")
        if self.routing == "balanced" and self.top_k is None:
            raise HarnessError("this model does not take workload.routing=balanced (its top-k is unknown)",
                               "use workload.routing=weights with it")

    def forced_table(self, positions: int) -> Optional[torch.Tensor]:
        """The request's forced experts over ``positions`` positions (int64 [batch, positions, layers,
        top_k]; ``balanced_table``: on the request's CUDA device, else the CPU), or None for the
        weights' routing."""
        if self.routing != "balanced":
            return None
        return balanced_table(self.seed, self.pages, positions, self.layers, self.top_k, self.experts, self._where)

    def target(self, shared: Optional[DeviceRouting] = None):
        """What the request's MoE layers report to: ``shared`` (begun for this request: zeroed, its
        forced table over its own positions loaded) or this counter (a balanced request gets its own
        host-driven ``DeviceRouting`` now, its table over prompt + decode tokens)."""
        if shared is not None:
            shared.begin(self.forced_table(shared.positions or self.prompt_tokens + self.steps + 1),
                         self.prompt_tokens)
            self.device = shared
            shared.phase = self.current
            return shared
        if self.routing == "balanced":
            self._own(self._where).begin(self.forced_table(self.prompt_tokens + self.steps + 1), self.prompt_tokens)
        return self

    def _own(self, device) -> DeviceRouting:
        if self.device is None:
            if device is None:
                raise HarnessError("RoutingCounter: device counts before the request's device is known",
                                   "call plan(request, steps) first")
            self.device = DeviceRouting(self.layers, self.experts, self.steps, device, "host")
            self.device.phase = self.current
            if self.current_step is not None:
                self.device.set_step(self.current_step)
        return self.device

    # ----------------------------------------------------------------- the loop
    def phase(self, name: Optional[str]) -> None:
        """Count into phase ``name`` from now on (None: stop counting). A phase entered counts as
        seen: ``result`` holds it, zeros if nothing was routed in it."""
        self.current = name
        if name is not None:
            self._host.setdefault(name, np.zeros((self.layers, self.experts), dtype=np.int64))
        if self.device is not None:
            self.device.phase = name

    def step(self, index: Optional[int]) -> None:
        """Decode step ``index`` runs from now on (None: outside the steps); a host-driven device
        routing follows (a device-driven one advances inside the step)."""
        self.current_step = index
        if self.device is not None and self.device.driven == "host":
            self.device.set_step(index)

    def _in_step(self) -> bool:
        return self.current == "decode" and self.current_step is not None and 0 <= self.current_step < self.steps

    # ----------------------------------------------------------------- counting
    def add_host(self, layer: int, counts) -> None:
        """Add per-expert counts [experts] (host array) of MoE ``layer``."""
        if self.current is None:
            return
        counts = np.asarray(counts, dtype=np.int64)
        if self._in_step():
            self._host_steps[self.current_step, layer] += counts
        else:
            self._host[self.current][layer] += counts

    def add_device(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Add the experts chosen in MoE ``layer`` (any-shaped int tensor of expert ids) on the device."""
        if self.current is not None:
            self._own(topk_ids.device).add_device(layer, topk_ids)

    def device_counts(self) -> Optional[tuple]:
        """``DeviceRouting.device_counts`` of this request's device routing."""
        return self._own(self._where).device_counts() if self.current is not None else None

    def forced_experts(self, layer: int, batch: int, tokens: int) -> Optional[tuple]:
        """``DeviceRouting.forced_experts`` (None without forced routing)."""
        return self.device.forced_experts(layer, batch, tokens) if self.device is not None else None

    def forced_inputs(self) -> Optional[tuple]:
        """``DeviceRouting.forced_inputs`` (None without forced routing)."""
        return self.device.forced_inputs() if self.device is not None else None

    # ------------------------------------------------------------------- results
    def deferred(self):
        """A function giving (``result()``, ``steps_result()``) of this request later: the device counts'
        copy starts now without a host synchronisation (``DeviceRouting.read_async``), the function
        waits for that copy alone; what the host counted is kept as it is now."""
        pending = self.device.read_async(self.steps) if self.device is not None and self._read is None else None
        later = copy.copy(self)
        later._host = {k: v.copy() for k, v in self._host.items()}
        later._host_steps = None if self._host_steps is None else self._host_steps.copy()

        def get() -> tuple:
            if pending is not None:
                later._read = pending.get()
            return later.result(), later.steps_result()
        return get

    def _device_read(self) -> Optional[tuple]:
        """``DeviceRouting.read`` once, after the request (``result`` and ``steps_result`` share it)."""
        if self.device is None:
            return None
        if self._read is None:
            self._read = self.device.read(self.steps)
        return self._read

    def result(self) -> dict:
        """{phase: int64 array [layers, experts]} for every phase entered (decode: with its steps and
        any decode counts outside them)."""
        out = {k: v.copy() for k, v in self._host.items()}
        dev = self._device_read()
        if dev is not None:
            prefill, steps, outside = dev
            for phase, arr in (("prefill", prefill), ("decode", steps.sum(axis=0) + outside)):
                out[phase] = out[phase] + arr if phase in out else arr
        if self._host_steps is not None and "decode" in out:
            out["decode"] = out["decode"] + self._host_steps.sum(axis=0)
        return out

    def steps_result(self) -> Optional[np.ndarray]:
        """int64 [steps, layers, experts] decode counts per step, or None without ``plan_steps``."""
        if not self.steps:
            return None
        out = self._host_steps.copy()
        dev = self._device_read()
        if dev is not None:
            out += dev[1]
        return out


__all__ = ["ROUTINGS", "routing_label", "RoutingCounter", "DeviceRouting", "PendingCounts", "balanced_experts",
           "balanced_table", "experts_per_step", "page_experts", "page_key"]
