"""``cuda_graphs=decode``: the static-cache decode step captured in a CUDA graph once per (batch,
cache length) and replayed per token (the position advances on the device). Needs
``kv_cache=static`` and ``moe_impl=grouped`` (fixed shapes, no host sync) and a CUDA device."""
from __future__ import annotations

from .. import knobs
from .engine import PlanConverter

DECODE_GRAPHS = PlanConverter(
    knobs.DECODE_GRAPHS, "decode_graphs",
    "a growing cache changes shapes every step and the vendor MoE loop syncs the host per layer",
    ("the decode step captured once per batch size and cache length, replayed per token",
     "every decode step launched from the host"), needs_cuda=True)
