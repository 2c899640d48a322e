"""``prefill_graphs=true``: the static-cache prefill captured in a CUDA graph once per request shape
(batch, prompt length, image position) and replayed. Needs ``kv_cache=static`` and
``moe_impl=grouped`` and a CUDA device."""
from __future__ import annotations

from .. import knobs
from .engine import PlanConverter

PREFILL_GRAPHS = PlanConverter(
    knobs.PREFILL_GRAPHS, "prefill_graphs",
    "the captured prefill writes the static cache and counts routing on the device",
    ("one CUDA graph per request shape", "eager launches"), needs_cuda=True)
