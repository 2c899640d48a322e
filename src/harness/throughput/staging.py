"""A ready host batch -> a device ``workload.Request``.

On CUDA the pinned buffers are copied with ``non_blocking=True`` on the stager's own stream and cast
to the model's dtype there (the values ``Request.to`` gives: float32 rounded to the dtype), between
two marks on that stream; the batch's compute waits for the copy's end mark (``wait``), so a copy
issued while the previous batch runs overlaps it. The device tensors are marked as used by the
compute stream (``record_stream``), so their memory is not reused before the batch has run. On the
CPU the buffers are plain copies, timed on the host clock.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import workload as wl
from ..layout import Case
from .clock import Marks
from .feeder import Ready


@dataclass
class Staged:
    """A batch on the device: its request, its ready batch, the copy's marks and bytes."""

    request: wl.Request
    ready: Ready
    copy_start: object
    copy_end: object
    nbytes: int


class Stager:
    """See the module docstring."""

    def __init__(self, device: torch.device, dtype: torch.dtype, marks: Marks, nvtx):
        self.device, self.dtype, self.marks, self.nvtx = device, dtype, marks, nvtx
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def stage(self, ready: Ready, case: Case, names: list, prompt: str, routing: str = "weights",
              routing_seed: int = 0) -> Staged:
        """Copy ``ready``'s buffers to the device as the request of ``case`` (pages ``names``) that runs
        ``routing`` (``workload.routing``, seed ``routing_seed``)."""
        host = ready.host
        self.nvtx.push("copy", ready.number)
        try:
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    start = self.marks.mark(self.stream)
                    dev = self._copy(host)
                    end = self.marks.mark(self.stream)
                compute = torch.cuda.current_stream(self.device)
                for t in dev:
                    if t is not None:
                        t.record_stream(compute)
            else:
                start = self.marks.mark()
                dev = self._copy(host)
                end = self.marks.mark()
        finally:
            self.nvtx.pop()
        views, tiles, ids, mask = dev
        lay = host.layout
        req = wl.Request(case=case, input_ids=ids, images_seq_mask=mask, global_views=views, tiles=tiles,
                         pages=list(names), image_start=lay.image_start, prompt=prompt, routing=routing,
                         routing_seed=routing_seed)
        return Staged(req, ready, start, end, host.nbytes)

    def _copy(self, host) -> tuple:
        def px(t):
            if t is None:
                return None
            if self.cuda:   # float32 over the bus, rounded to the dtype on the device (as Request.to)
                return t.to(self.device, non_blocking=True).to(self.dtype)
            return t.to(dtype=self.dtype, copy=True)
        return (px(host.views), px(host.tiles), host.ids.to(self.device, non_blocking=True, copy=True),
                host.mask.to(self.device, non_blocking=True, copy=True))

    def wait(self, staged: Staged) -> None:
        """The compute stream waits for ``staged``'s copy (CUDA); nothing to wait for on the CPU."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(staged.copy_end)


__all__ = ["Staged", "Stager"]
