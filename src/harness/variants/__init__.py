"""Execution variants: one converter per knob of ``harness.config.ExecutionConfig``, applied in one order.

``CONVERTERS`` is the registry (``base.Converter``: ``check``, ``convert``, and its knob's facts,
``spec``), in the order of ``harness.knobs.KNOBS``: the order of conversion and of the report's
label (the static cache before what runs on it, the fused vision before its compiled blocks). What
a run's readers need of a knob (its label, ``allows_module_hooks``, ``cost_knobs``) is
``harness.knobs``, torch-free.

- ``check(execution, device, dtype, model=None, positions=None, batch=None)``: the whole execution, before
  any model is built (``setup.check_cases``); one ``HarnessError`` naming ``execution.<knob>``
  and the fix (``CannotRunHere`` where it is this device that cannot run it).
- ``apply(model, execution, device)``: checks, returns the model to the vendor's execution
  (``base.restore``), converts it knob by knob and returns the manifest block: every knob as it
  ran, ``moe_kernel_resolved`` and each converter's text of what runs.

A new variant is its module here (module classes + converter), its ``Knob`` in ``harness.knobs``,
one name in ``CONVERTERS`` and its parity test (fp32, TF32 off, against vendor-style).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..config import ExecutionConfig
from ..knobs import KNOBS
from ..models.deepseek_ocr import DeepseekOCR
from .base import CannotRunHere, Converter, restore
from .decode_attention import DECODE_ATTENTION
from .decode_compile import DECODE_COMPILE
from .decode_graphs import DECODE_GRAPHS
from .device_preprocess import DEVICE_PREPROCESS
from .fused_linears import FUSED_LINEARS
from .fused_step import FUSED_STEP, PDL, STEP_CLOCK
from .fused_vision import FUSED_VISION
from .grouped_moe import GROUPED_MOE
from .prefill_compile import PREFILL_COMPILE
from .prefill_graphs import PREFILL_GRAPHS
from .prefill_logits import PREFILL_LOGITS
from .sam_triton import SAM_TRITON
from .static_cache import STATIC_CACHE
from .vision_compile import VISION_COMPILE

_BY_KNOB = {c.spec: c for c in (STATIC_CACHE, GROUPED_MOE, DECODE_GRAPHS, DECODE_COMPILE, PREFILL_GRAPHS,
                                 PREFILL_COMPILE, FUSED_VISION, SAM_TRITON,
                                 FUSED_LINEARS, VISION_COMPILE, DECODE_ATTENTION, FUSED_STEP, PDL, STEP_CLOCK,
                                 DEVICE_PREPROCESS, PREFILL_LOGITS)}
#: every execution variant, in the order of conversion (and of the report's label): ``knobs.KNOBS``
CONVERTERS: tuple = tuple(_BY_KNOB[k] for k in KNOBS)


def check(execution: ExecutionConfig, device, dtype=torch.float32, model=None,
          positions: Optional[int] = None, batch: Optional[int] = None) -> None:
    """Refuse ``execution`` where it would not run, or would run as something else, on ``device``
    in ``dtype`` (see the module docstring). ``model``: the ``ModelConfig``; ``positions``: the
    request's prompt + decode tokens (the static cache's length check); ``batch``: its rows."""
    device = torch.device(device)
    for c in CONVERTERS:
        c.check(execution, device, dtype, model=model, positions=positions)
        if batch is not None:
            c.check_batch(execution, batch)


def apply(model, execution: ExecutionConfig, device=None) -> dict:
    """Run ``model`` as ``execution`` from now on (same weights); returns the manifest block."""
    if not isinstance(model, DeepseekOCR):       # the vendor's code runs as shipped (config refuses knobs)
        return {**execution.execution(), "moe_kernel_resolved": None, "moe": "vendor loop (the vendor's own moe_infer)"}
    p = next(model.parameters())
    device = torch.device(device) if device is not None else p.device
    check(execution, device, p.dtype, model=model.cfg)
    restore(model)
    out = execution.execution()
    for c in CONVERTERS:
        out.update(c.convert(model, execution, device, p.dtype))
    model.execution = execution
    return out


__all__ = ["CONVERTERS", "Converter", "CannotRunHere", "check", "apply"]
