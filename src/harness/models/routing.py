"""Routed-expert token counts of one request, per phase and MoE layer, and per decode step.

Models report each MoE layer's routing either as host counts they already have (the vendor-style
loop copies them to the host anyway: ``add_host``) or as the device tensor of chosen experts
(``add_device``: one scatter-add on the device, no host sync, so a sync-free step stays sync-free).
``result()`` reads everything back once, after the request.

Per decode step: the generate loop announces the number of decode steps (``plan_steps``, before
the request) and the current step (``step(i)``, a host integer); decode counts of a step then go
to a [steps, layers, experts] array (host) or tensor (device, allocated when the decode phase
starts, so no step allocates) instead of the phase's [layers, experts] one: still one scatter-add
per MoE layer. ``steps_result()`` reads it back after the request; ``result()['decode']`` includes
the steps' sum.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch


class RoutingCounter:
    """Tokens routed to each expert: {phase: int64 [layers, experts]} (dense layers stay zero)."""

    def __init__(self, layers: int, experts: int, device=None):
        self.layers, self.experts = layers, experts
        self.device = torch.device(device) if device is not None else None
        self._host: dict = {}
        self._dev: dict = {}
        self._ones: Optional[torch.Tensor] = None
        self.current: Optional[str] = None
        self.steps = 0                       # decode steps of the request (plan_steps)
        self.current_step: Optional[int] = None
        self._host_steps: Optional[np.ndarray] = None
        self._dev_steps: Optional[torch.Tensor] = None

    def plan_steps(self, steps: int) -> None:
        """Keep per-step decode counts for ``steps`` decode steps (0: none)."""
        self.steps = max(int(steps), 0)
        self._host_steps = np.zeros((self.steps, self.layers, self.experts), dtype=np.int64) if self.steps else None

    def step(self, index: Optional[int]) -> None:
        """Decode step ``index`` runs from now on (None: outside the steps)."""
        self.current_step = index

    def _step_acc(self, device) -> torch.Tensor:
        if self._dev_steps is None:
            self._dev_steps = torch.zeros((self.steps, self.layers, self.experts), dtype=torch.int64, device=device)
        return self._dev_steps

    def phase(self, name: Optional[str]) -> None:
        """Count into phase ``name`` from now on (None: stop counting). A phase entered counts as
        seen: ``result`` holds it, zeros if nothing was routed in it."""
        self.current = name
        if name is not None:
            self._host.setdefault(name, np.zeros((self.layers, self.experts), dtype=np.int64))
        known = next(iter(self._dev.values()), None)
        if name == "decode" and self.steps and known is not None:   # device known: allocate before the steps
            self._step_acc(known.device)

    def _in_step(self) -> bool:
        return self.current == "decode" and self.current_step is not None and 0 <= self.current_step < self.steps

    def add_host(self, layer: int, counts) -> None:
        """Add per-expert counts [experts] (host array) of MoE ``layer``."""
        if self.current is None:
            return
        counts = np.asarray(counts, dtype=np.int64)
        if self._in_step():
            self._host_steps[self.current_step, layer] += counts
        else:
            self._host[self.current][layer] += counts

    def device_target(self, layer: int, device) -> Optional[tuple]:
        """(contiguous int64 buffer, offset): MoE ``layer``'s per-expert counters on ``device`` are
        ``buffer.view(-1)[offset:offset + experts]`` (the current step's row within a decode step,
        else the phase's); None while not counting."""
        if self.current is None:
            return None
        if self._in_step():
            return self._step_acc(device), (self.current_step * self.layers + layer) * self.experts
        acc = self._dev.get(self.current)
        if acc is None:
            acc = self._dev[self.current] = torch.zeros((self.layers, self.experts), dtype=torch.int64, device=device)
        return acc, layer * self.experts

    def add_device(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Add the experts chosen in MoE ``layer`` (any-shaped int tensor of expert ids) on the device."""
        target = self.device_target(layer, topk_ids.device)
        if target is None:
            return
        self._ones = _scatter_count(target, self.experts, topk_ids, self._ones)

    def merge(self, phase: str, counts: torch.Tensor) -> None:
        """Add device counts [layers, experts] (a ``DeviceCounts`` buffer) to ``phase``."""
        acc = self._dev.get(phase)
        self._dev[phase] = counts.clone() if acc is None else acc + counts
        self._host.setdefault(phase, np.zeros((self.layers, self.experts), dtype=np.int64))

    def result(self) -> dict:
        """{phase: int64 array [layers, experts]} for every phase entered (decode: with its steps)."""
        out = {k: v.copy() for k, v in self._host.items()}
        for k, v in self._dev.items():
            if v.device.type == "meta":      # shapes only (the FLOP check): no counts to read
                continue
            arr = v.cpu().numpy().astype(np.int64)
            out[k] = out[k] + arr if k in out else arr
        steps = self.steps_result()
        if steps is not None and "decode" in out:
            out["decode"] = out["decode"] + steps.sum(axis=0)
        return out

    def steps_result(self) -> Optional[np.ndarray]:
        """int64 [steps, layers, experts] decode counts per step, or None without ``plan_steps``."""
        if not self.steps:
            return None
        out = self._host_steps.copy()
        if self._dev_steps is not None:
            out += self._dev_steps.cpu().numpy().astype(np.int64)
        return out


class DeviceCounts:
    """A persistent device buffer of routed-expert counts [layers, experts] (int64) that MoE layers
    add to with ``add_device``: fixed addresses, so a captured CUDA graph or a compiled step keeps
    writing into it on every replay. ``zero()`` before a request; ``RoutingCounter.merge`` after."""

    def __init__(self, layers: int, experts: int, device, max_rows: int = 64):
        self.buf = torch.zeros((layers, experts), dtype=torch.int64, device=device)
        self._ones = torch.ones(max(max_rows, 64), dtype=torch.int64, device=device)

    def zero(self) -> None:
        self.buf.zero_()

    def device_target(self, layer: int, device=None) -> tuple:
        """(buffer, offset) of MoE ``layer``'s counters, as ``RoutingCounter.device_target``."""
        return self.buf, layer * self.buf.shape[1]

    def add_device(self, layer: int, topk_ids: torch.Tensor) -> None:
        self._ones = _scatter_count(self.device_target(layer), self.buf.shape[1], topk_ids, self._ones)


def _scatter_count(target: tuple, experts: int, topk_ids: torch.Tensor, ones: Optional[torch.Tensor]) -> torch.Tensor:
    """One scatter-add of 1 per expert id into ``target``'s counters (no host sync); returns the ones
    buffer to keep (grown on the host when a call has more ids: never inside a captured graph)."""
    buf, offset = target
    idx = topk_ids.reshape(-1)
    if ones is None or ones.numel() < idx.numel() or ones.device != idx.device:
        ones = torch.ones(max(idx.numel(), 64), dtype=torch.int64, device=idx.device)
    buf.view(-1)[offset:offset + experts].scatter_add_(0, idx, ones[:idx.numel()])
    return ones
