"""``compile=true``: the static-cache decode step ``torch.compile``'d (inductor) once per (batch, cache length).

Only that step is compiled (``engine.Engine.decode_core`` inside ``StaticDecoder``), so the knob
needs ``kv_cache=static`` and ``moe_impl=grouped``: with the growing cache nothing would be
compiled (refused rather than reported as compiled), and the vendor MoE loop copies its counts to
the host inside the step. Compile seconds are reported apart (``setup_s``). The compiled step picks
its greedy token with ``greedy_chunked`` (the same token; one reduction per chunk). Runs on a CPU too.
"""
from __future__ import annotations

from .. import knobs
from .engine import PlanConverter

DECODE_COMPILE = PlanConverter(
    knobs.DECODE_COMPILE, "compile",
    "only the static-cache decode step is compiled; the vendor MoE loop syncs the host inside it",
    ("torch.compile (inductor) of the static-cache decode step, once per batch size and cache length (seconds "
     "in setup_s)", "eager decode step"), needs_cuda=False)
