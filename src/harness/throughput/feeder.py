"""Pages from the worker pool into host batch buffers, ahead of the batch the device runs.

``Layout``: the shapes of one layout's batch (from a one-page template request built before the
model). ``HostBatch``: one batch's host buffers (pixels float32, prompt ids, image mask; pinned on
CUDA, so the copy to the device is a non-blocking DMA), allocated by the main thread (pinning is a
CUDA call) and reused. ``Feeder``: a thread that keeps ``depth`` batches' pages submitted to the pool,
writes each page's arrays into its batch's buffer as they arrive, and queues the batch as ready.
It makes no CUDA call, so it can run while the main thread captures a CUDA graph. The main thread
takes ready batches (``get`` / ``poll``) and hands each buffer back (``release``) once the batch
that read it has run.
"""
from __future__ import annotations

import collections
import queue
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
import torch

from .prep import PreparedPage, prepare_page

POLL_S = 0.05   # how often a waiting feeder or main thread looks at the stop flag [s]


@dataclass(frozen=True)
class Layout:
    """Shapes of one page of a layout: ``view`` (3, S, S), ``tiles`` (c*r, 3, T, T) or None, prompt
    length ``seq`` [tokens]; ``grid``, ``image_start`` and ``text_tokens`` as ``workload.Request``;
    ``page_bytes``: set when the device preprocesses (the host then holds 8-bit pages, not views)."""

    grid: Optional[tuple]
    view: tuple
    tiles: Optional[tuple]
    seq: int
    image_start: int
    text_tokens: int
    page_bytes: Optional[int] = None   # execution.preprocess=device: the largest page's 8-bit pixels [B]

    @classmethod
    def of(cls, request) -> "Layout":
        """The layout of a one-page ``workload.Request``."""
        return cls(request.grid, tuple(request.global_views.shape[1:]),
                   None if request.tiles is None else tuple(request.tiles.shape), request.prefill_tokens,
                   request.image_start, request.text_tokens)


class HostBatch:
    """Host buffers of one batch of ``batch`` pages of ``layout`` (pinned when ``pin``); ``key``:
    the layout's key (its tile grid)."""

    def __init__(self, key, layout: Layout, batch: int, pin: bool):
        def empty(shape, dtype):
            return torch.empty(shape, dtype=dtype, pin_memory=pin)
        self.key, self.layout, self.batch = key, layout, batch
        device_prep = layout.page_bytes is not None
        self.views = None if device_prep else empty((batch, *layout.view), torch.float32)
        self.tiles = None if device_prep or layout.tiles is None else empty(
            (batch * layout.tiles[0], *layout.tiles[1:]), torch.float32)
        #: device preprocessing: the batch's 8-bit pages packed in page order, and each page's [H, W, 3]
        self.pixels = empty((batch * layout.page_bytes,), torch.uint8) if device_prep else None
        self.shapes: list = [None] * batch
        self.used = 0
        self.ids = empty((batch, layout.seq), torch.long)
        self.mask = empty((batch, layout.seq), torch.bool)

    @property
    def nbytes(self) -> int:
        """Bytes copied to the device per batch."""
        pixels = [self.pixels[:self.used]] if self.pixels is not None else [self.views, self.tiles]
        return sum(t.numel() * t.element_size() for t in (*pixels, self.ids, self.mask) if t is not None)

    def put(self, j: int, page: PreparedPage) -> None:
        """Page ``j`` of the batch from a worker's arrays (8-bit pages: in order, j = 0, 1, ...)."""
        if self.pixels is not None:
            if j == 0:
                self.used = 0
            flat = torch.from_numpy(np.ascontiguousarray(page.pixels).reshape(-1))
            self.pixels[self.used:self.used + flat.numel()].copy_(flat)
            self.shapes[j] = tuple(page.pixels.shape)
            self.used += flat.numel()
        else:
            self.views[j].copy_(torch.from_numpy(page.global_view))
            if self.tiles is not None:
                n = self.layout.tiles[0]
                self.tiles[j * n:(j + 1) * n].copy_(torch.from_numpy(page.tiles))
        self.ids[j].copy_(torch.from_numpy(page.input_ids))
        self.mask[j].copy_(torch.from_numpy(page.images_seq_mask))


@dataclass
class Ready:
    """A batch whose pages are in ``host`` (its layout: ``host.layout``): its sequence number in the
    configuration and page indices."""

    number: int
    pages: list
    host: HostBatch


class Feeder(threading.Thread):
    """See the module docstring. ``prep``: (page, pid, start ns, end ns) of every page prepared."""

    def __init__(self, pool, stream: Iterator[list], layout_of: dict, buffers: dict, depth: int):
        super().__init__(name="throughput-feeder", daemon=True)
        self.pool, self.stream, self.layout_of, self.depth = pool, stream, layout_of, depth
        self.free = {k: queue.Queue() for k in buffers}
        for k, bufs in buffers.items():
            for b in bufs:
                self.free[k].put(b)
        self.ready: queue.Queue = queue.Queue()
        self.prep: list = []
        self._seen: set = set()
        self.error: Optional[BaseException] = None
        self._halt = threading.Event()

    # ------------------------------------------------------------------ feeder thread
    def run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread by get()
            self.error = exc
        finally:
            self.ready.put(None)

    def _take(self, key, block: bool) -> Optional[HostBatch]:
        while not self._halt.is_set():
            try:
                return self.free[key].get(timeout=POLL_S) if block else self.free[key].get_nowait()
            except queue.Empty:
                if not block:
                    return None
        return None

    def _result(self, future) -> Optional[PreparedPage]:
        while not self._halt.is_set():
            try:
                return future.result(timeout=POLL_S)
            except FutureTimeout:
                continue
        return None

    def _loop(self) -> None:
        inflight = collections.deque()
        try:
            self._feed(inflight)
        finally:   # pages not started are dropped; pages running are waited for, so their time is counted
            for _, _, futures, _ in inflight:
                for fut in futures:
                    fut.cancel()
                    if not fut.cancelled():
                        self._record(fut)

    def _record(self, fut) -> None:
        try:
            page = fut.result(timeout=60)
        except BaseException:  # noqa: BLE001 - a page that failed while the feeder stops has no interval
            return
        if (page.index, page.start_ns) not in self._seen:
            self._seen.add((page.index, page.start_ns))
            self.prep.append((page.index, page.pid, page.start_ns, page.end_ns))

    def _feed(self, inflight) -> None:
        pending, number = None, 0
        while not self._halt.is_set():
            while len(inflight) < self.depth:
                pending = pending or next(self.stream)
                host = self._take(self.layout_of[pending[0]], block=not inflight)
                if host is None:
                    break
                inflight.append((number, pending, [self.pool.submit(prepare_page, i) for i in pending], host))
                number, pending = number + 1, None
            if not inflight:
                continue
            n, pages, futures, host = inflight[0]
            for j, fut in enumerate(futures):
                page = self._result(fut)
                if page is None:
                    return
                host.put(j, page)
                self._record(fut)
            inflight.popleft()
            self.ready.put(Ready(n, pages, host))

    # ------------------------------------------------------------------- main thread
    def get(self) -> Ready:
        """The next ready batch (waits for it)."""
        while True:
            try:
                item = self.ready.get(timeout=POLL_S)
            except queue.Empty:
                continue
            return self._checked(item)

    def poll(self) -> Optional[Ready]:
        """The next ready batch if there is one now, else None."""
        try:
            return self._checked(self.ready.get_nowait())
        except queue.Empty:
            return None

    def _checked(self, item) -> Ready:
        if item is None:
            self.ready.put(None)
            raise self.error if self.error is not None else RuntimeError("the throughput feeder stopped")
        return item

    def release(self, host: HostBatch) -> None:
        """``host`` may be refilled: the batch that read it has run."""
        self.free[host.key].put(host)

    def stop(self) -> None:
        """Stop feeding: pages not started are cancelled, the thread ends within ``POLL_S``."""
        self._halt.set()
        self.join(timeout=10)


__all__ = ["Layout", "HostBatch", "Ready", "Feeder", "POLL_S"]
