"""The five stages of a request, the ranges inside them, and the module prefixes each one runs.

Stages are disjoint in time and their GPU times add up to the request. ``prefill`` and
``decode`` run the same LLM modules; the phase (sequence length > 1 or == 1) tells them apart.
Module prefixes are the same for the reference model and the vendor model (same state_dict).
This module is the one place that names the stages; it imports nothing from the package.
"""
from __future__ import annotations

STAGES = ("sam", "clip", "projector", "prefill", "decode")
VISION_STAGES = ("sam", "clip", "projector")
#: ranges a model opens: ``request`` around everything, one ``decode_step`` per token inside ``decode``
REQUEST, DECODE_STEP = "request", "decode_step"
#: ranges that hold work directly (a FLOP counter attributes to these; ``decode_step`` stands for decode)
LEAF_RANGES = VISION_STAGES + ("prefill", DECODE_STEP)
#: host preprocessing inside ``request`` before the first forward, where the model does its own (the
#: vendor's ``infer()``): recorded as its own row, outside STAGES (so not in the stage sum or the roofline)
PREPROCESS = "preprocess"
#: every range summarised as a row of its own: the five stages, then ``preprocess``
RECORDED_STAGES = STAGES + (PREPROCESS,)

STAGE_PREFIXES = {
    "sam": ("model.sam_model",),
    "clip": ("model.vision_model",),
    "projector": ("model.projector", "model.image_newline", "model.view_seperator"),
    "llm": ("model.embed_tokens", "model.layers", "model.norm", "lm_head"),
}


def module_stage(name: str) -> str | None:
    """Stage of a module or parameter name: sam, clip, projector, llm (prefill and decode) or None."""
    for stage, prefixes in STAGE_PREFIXES.items():
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return stage
    return None
