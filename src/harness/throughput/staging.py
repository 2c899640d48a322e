"""A ready host batch -> a device ``workload.Request``.

On CUDA the pinned buffers are copied with ``non_blocking=True`` on the stager's own stream and cast
to the model's dtype there (the values ``Request.to`` gives: float32 rounded to the dtype), between
two marks on that stream; the batch's compute waits for the copy's end mark (``wait``), so a copy
issued while the previous batch runs overlaps it. The device tensors are marked as used by the
compute stream (``record_stream``), so their memory is not reused before the batch has run. On the
CPU the buffers are plain copies, timed on the host clock. With ``execution.preprocess=device``
the host buffers hold 8-bit pages: they are copied, then resized, padded, normalised and tiled on
the same stream (``preprocess_device``), between the copy's end mark and a third mark
(``Staged.prep_end``), which the compute waits for instead.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .. import preprocess_device
from .. import workload as wl
from ..layout import Case
from .clock import Marks
from .feeder import Ready


@dataclass
class Staged:
    """A batch on the device: its request, its ready batch, the copy's marks and bytes, and with
    device preprocessing the mark after it (``prep_end``; None: the host preprocessed)."""

    request: wl.Request
    ready: Ready
    copy_start: object
    copy_end: object
    nbytes: int
    prep_end: object = None

    @property
    def ready_mark(self) -> object:
        """The mark the batch's compute waits for: the end of its copy, or of its device preprocessing."""
        return self.prep_end if self.prep_end is not None else self.copy_end


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
        prep_end = None
        self.nvtx.push("copy", ready.number)
        try:
            with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
                start = self.marks.mark(self.stream)
                dev = self._copy(host)
                end = self.marks.mark(self.stream)
                if host.pixels is not None:      # execution.preprocess=device, on the same stream
                    self.nvtx.pop()
                    self.nvtx.push("preprocess", ready.number)
                    dev = self._preprocess(dev, host, case)
                    prep_end = self.marks.mark(self.stream)
            if self.cuda:
                compute = torch.cuda.current_stream(self.device)
                for t in dev:
                    if t is not None:
                        t.record_stream(compute)
        finally:
            self.nvtx.pop()
        views, tiles, ids, mask = dev
        lay = host.layout
        req = wl.Request(case=case, input_ids=ids, images_seq_mask=mask, global_views=views, tiles=tiles,
                         pages=list(names), image_start=lay.image_start, prompt=prompt, routing=routing,
                         routing_seed=routing_seed)
        return Staged(req, ready, start, end, host.nbytes, prep_end)

    def _copy(self, host) -> tuple:
        def px(t):
            if t is None:
                return None
            if self.cuda:   # float32 over the bus, rounded to the dtype on the device (as Request.to)
                return t.to(self.device, non_blocking=True).to(self.dtype)
            return t.to(dtype=self.dtype, copy=True)
        ids = host.ids.to(self.device, non_blocking=True, copy=True)
        mask = host.mask.to(self.device, non_blocking=True, copy=True)
        if host.pixels is not None:    # 8-bit pages, packed: preprocessed by ``_preprocess``
            return host.pixels[:host.used].to(self.device, non_blocking=True, copy=True), None, ids, mask
        return px(host.views), px(host.tiles), ids, mask

    def _preprocess(self, dev: tuple, host, case: Case) -> tuple:
        """The copied 8-bit pages -> (views, tiles, ids, mask) in the model's dtype
        (``preprocess_device.views_and_tiles``)."""
        flat, _, ids, mask = dev
        pages, at = [], 0
        for shape in host.shapes[:host.batch]:
            n = shape[0] * shape[1] * shape[2]
            pages.append(flat[at:at + n].view(shape))
            at += n
        views, tiles = preprocess_device.views_and_tiles(pages, case.mode, self.dtype)
        return views, tiles, ids, mask

    def wait(self, staged: Staged) -> None:
        """The compute stream waits for ``staged``'s copy (and device preprocessing) (CUDA); nothing
        to wait for on the CPU."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(staged.ready_mark)


__all__ = ["Staged", "Stager"]
