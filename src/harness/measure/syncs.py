"""Host syncs per stage: CUDA operations that make the host wait for the GPU (``.cpu()``,
``.item()``, ``nonzero``, a blocking copy), counted through torch's sync debug mode while one
request runs. The vendor-style decode step syncs once per MoE layer; a captured or sync-free
step should sync zero times. Counting costs host time (a warning per sync), so the runner counts
only in the profiled request (``measure.kernels=true``), never in timed repeats.
"""
from __future__ import annotations

import contextlib
import warnings
from collections import Counter

import torch

from ..anatomy.stages import DECODE_STEP, STAGES

SYNC_MESSAGE = "called a synchronizing CUDA operation"


class SyncCounter:
    """A stage function wrapping another (``inner``, e.g. a StageRecorder) that attributes each host
    sync to the innermost open stage; ``counts[stage]`` and ``counts['decode_step']`` (syncs inside
    any decode step) after ``counting()``."""

    def __init__(self, inner):
        self.inner = inner
        self.stack: list = []
        self.counts: Counter = Counter()

    @contextlib.contextmanager
    def __call__(self, name: str, **payload):
        self.stack.append(name)
        try:
            with self.inner(name, **payload):
                yield
        finally:
            self.stack.pop()

    def _seen(self) -> None:
        self.counts[next((n for n in reversed(self.stack) if n in STAGES), "outside")] += 1
        if DECODE_STEP in self.stack:
            self.counts[DECODE_STEP] += 1

    @contextlib.contextmanager
    def counting(self):
        """Count syncs until exit (CUDA only; torch's sync debug mode is restored after)."""
        prev = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            shown = warnings.showwarning

            def show(message, category, *args, **kwargs):
                if SYNC_MESSAGE in str(message):
                    self._seen()
                else:
                    shown(message, category, *args, **kwargs)

            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode(1)
            try:
                yield self
            finally:
                torch.cuda.set_sync_debug_mode(prev)
