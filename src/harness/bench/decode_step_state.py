"""What the decode-step benches build their timed steps from (``decode_step``, ``decode_step_paths``,
``decode_step_ablation``): the decode knobs of a named execution and a fused step's buffers."""
from __future__ import annotations

import dataclasses

import torch

from ..knobs import only_in
from .verb import named_execution

#: the knobs of a named execution set back to their defaults for the step table's harness rows: they
#: change no decode step (and vision_compile would compile SAM and CLIP first); each prefill or vision
#: knob goes with the knob it needs (prefill_compile with prefill_graphs, sam_attention with vision_impl)
NOT_DECODE = only_in("prefill", "vision")


def fused_step_state(model, length: int, token_id: int = 0) -> tuple:
    """What ``FusedDecodeStep`` reads besides its config: (weights, a static cache of one sequence and
    ``length`` positions, the position (int64 [1], 0), the token (int64 [1], ``token_id``)), on the
    model's device in its dtype."""
    from ..variants.fused_step import weights_from_model
    from ..variants.static_kv import StaticKVCache

    L, p = model.cfg.llm, next(model.parameters())
    cache = StaticKVCache(L.num_layers, 1, L.num_kv_heads, length, L.head_dim, p.dtype, p.device,
                          query_heads=L.num_heads)
    pos = torch.zeros(1, dtype=torch.int64, device=p.device)
    token = torch.full((1,), token_id, dtype=torch.int64, device=p.device)
    return weights_from_model(model), cache, pos, token


def decode_execution(cfg, name: str, pdl: bool):
    """The named execution ``name``'s decode knobs (``NOT_DECODE`` at their defaults; ``pdl`` off
    where the GPU has none)."""
    from ..config import ExecutionConfig

    ex, default = named_execution(cfg, name), ExecutionConfig()
    return dataclasses.replace(ex, pdl=ex.pdl and pdl, **{k: getattr(default, k) for k in NOT_DECODE})


__all__ = ["NOT_DECODE", "fused_step_state", "decode_execution"]
