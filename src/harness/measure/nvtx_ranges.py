"""NVTX push/pop ranges in the ``harness`` domain with registered strings.

Range names: ``request`` > ``sam`` | ``clip`` | ``projector`` | ``prefill`` | ``decode`` >
``decode_step`` (payload = step index); optional per-layer ranges ``layer`` (payload = index).
nsys selects one with ``--capture-range=nvtx --nvtx-capture=decode@harness``; ncu with
``--nvtx --nvtx-include "harness@request/decode/"`` (push/pop ranges end with a slash).
"""
from __future__ import annotations

DOMAIN = "harness"


class NvtxRanges:
    """Thin wrapper over the ``nvtx`` package; ``available`` is False (and calls are no-ops) without it."""

    def __init__(self, enabled: bool = True):
        self.available = False
        self.reason = "disabled by measure.nvtx=false"
        self._domain = None
        self._attrs: dict = {}
        if not enabled:
            return
        try:
            import nvtx
        except ImportError:
            self.reason = "the nvtx package is not installed (pip install nvtx): no NVTX ranges emitted"
            return
        self._domain = nvtx.get_domain(DOMAIN)
        self.available = True
        self.reason = ""

    def push(self, name: str, payload: int | None = None) -> None:
        if not self.available:
            return
        key = (name, payload)
        attrs = self._attrs.get(key)
        if attrs is None:
            # get_event_attributes registers the message string once per domain
            attrs = self._domain.get_event_attributes(message=name, payload=payload)
            self._attrs[key] = attrs
        self._domain.push_range(attrs)

    def pop(self) -> None:
        if self.available:
            self._domain.pop_range()
