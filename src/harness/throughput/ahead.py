"""``throughput.overlap_vision``: the next batch's vision computed on a stream of its own while this
batch decodes.

The pipeline's stages otherwise run one after another on the compute stream: vision (SAM, CLIP, the
projector: compute-bound) and then prefill and decode (decode memory-bound at batch). With the knob,
when batch n's decode opens its range, ``launch`` puts batch n+1's vision on the vision stream:

* the vision stream first waits for everything the compute stream holds so far (batch n's vision and
  prefill: the vision stages' CUDA graphs keep their buffers between replays, so two replays must not
  run at once) and for batch n+1's copy (and device preprocessing) on the copy stream;
* the embeddings (``DeepseekOCR.image_embeddings``) and the ``done`` mark after them are on the
  vision stream; batch n+1's pixels are marked as used there (``record_stream``);
* ``use`` makes the compute stream wait for ``done`` before batch n+1's prefill and hands the
  embeddings to it (``workload.Request.image_embeds``: the model's first token then runs no vision).

Batch n+1's sam / clip / projector spans come from its own ``BatchClock`` (marks on the vision
stream) and overlap batch n's decode; GPU busy is then their union with the other stages'
(``window.summarize``). The window starts with no vision computed ahead (what the last warm-up batch
launched is dropped: the first window batch runs its vision inside the window) and its last batch
launches the vision of a batch outside it: both edges count against the knob. On the CPU there is
one stream: the same calls run in order.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from .clock import BatchClock


@dataclass
class Ahead:
    """One batch's vision computed ahead: for ``staged`` (its ``Staged``), the embeddings, the clock of
    its vision stages and the mark after them (a CUDA event on the vision stream; host ns on the CPU)."""

    staged: object
    embeds: torch.Tensor
    clock: BatchClock
    done: object


def launch(model, staged, stager, marks, nvtx, stream: Optional["torch.cuda.Stream"]) -> Ahead:
    """``staged``'s vision on ``stream`` (None: the current stream, the CPU) after the compute stream's
    work so far and ``staged``'s copy (module docstring)."""
    clock = BatchClock(marks, nvtx)
    req = staged.request
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(stream.device))
    with ctx, torch.inference_mode():
        stager.wait(staged)                       # the current stream (the vision stream) waits for the copy
        if stream is not None:
            for t in (req.global_views, req.tiles):
                if t is not None:
                    t.record_stream(stream)
        embeds = model.image_embeddings(req.global_views, req.tiles, req.grid, clock)
        done = marks.mark()
    return Ahead(staged, embeds, clock, done)


def use(ahead: Ahead, request, cuda: bool):
    """``request`` with ``ahead``'s embeddings, the compute stream waiting for them (CUDA)."""
    if cuda:
        compute = torch.cuda.current_stream(ahead.embeds.device)
        compute.wait_event(ahead.done)
        ahead.embeds.record_stream(compute)
    return dataclasses.replace(request, image_embeds=ahead.embeds)


__all__ = ["Ahead", "launch", "use"]
