"""The execution knobs as data: what each variant is called, when it is on, what it writes into the
manifest, and what it changes for the readers of a run. Torch-free: the report, the analytic cost
model and the README tables read it without loading the converters of ``harness.variants``, which
take each converter's facts from here (``Converter.spec``).

* ``Knob``: one knob of ``harness.config.ExecutionConfig`` (``name``) and the value that turns its
  variant on (``on``), the report's words for it (``label``), its manifest entry (``manifest_key``:
  what runs), whether forward hooks still see the modules that run (``module_hooks``: False where a
  step is compiled, replayed from a CUDA graph or fused into kernels) and the knobs the analytic cost
  model reads (``cost_knobs``), and the one stage of a request it changes, where it changes one only
  (``only``: ``vision`` or ``prefill``; None: several, or how the request is built).
* ``KNOBS``: every knob, in the order of conversion and of the report's label.
* ``label(execution)``: 'static KV + grouped MoE (triton) + ...' or 'vendor-style';
  ``active(execution)``, ``allows_module_hooks(execution)``, ``cost_knobs(execution)``.
* ``augmented_dim``: the head width of SAM's augmented attention (``execution.vision_impl=fused``),
  the one shape rule of a variant that the cost model counts.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from .config import ExecutionConfig
from .errors import HarnessError


@dataclass(frozen=True)
class Knob:
    """One execution knob (see the module docstring)."""

    name: str
    on: object
    label: str
    manifest_key: str
    module_hooks: bool = True
    cost_knobs: tuple = ()
    only: Optional[str] = None

    def active(self, ex) -> bool:
        """Whether ``ex`` (an ``ExecutionConfig``) turns this variant on (``on``: a value, or a tuple of them)."""
        value = getattr(ex, self.name)
        return value in self.on if isinstance(self.on, tuple) else value == self.on


STATIC_CACHE = Knob("kv_cache", "static", "static KV", "kv_cache_is", cost_knobs=("kv_cache", "static_cache_len"))
GROUPED_MOE = Knob("moe_impl", "grouped", "grouped MoE", "moe", cost_knobs=("moe_impl", "moe_kernel"))
DECODE_GRAPHS = Knob("cuda_graphs", "decode", "decode graph", "decode_graphs", module_hooks=False)
DECODE_COMPILE = Knob("compile", True, "compiled", "decode_compile", module_hooks=False)
PREFILL_GRAPHS = Knob("prefill_graphs", True, "prefill graph", "prefill", module_hooks=False, only="prefill")
PREFILL_COMPILE = Knob("prefill_compile", True, "compiled prefill", "prefill_compile_is", module_hooks=False,
                       only="prefill")
FUSED_VISION = Knob("vision_impl", "fused", "fused vision", "vision", module_hooks=False, cost_knobs=("vision_impl",),
                    only="vision")
SAM_TRITON = Knob("sam_attention", ("triton-windows", "triton"), "triton SAM attention", "sam_attention_is",
                  cost_knobs=("sam_attention",), only="vision")
FUSED_LINEARS = Knob("linear_impl", "fused", "fused linears", "linears")
VISION_COMPILE = Knob("vision_compile", True, "compiled vision", "vision_compile_is", module_hooks=False, only="vision")
DECODE_ATTENTION = Knob("decode_attention", "triton", "triton decode attention", "decode_attention_is",
                        cost_knobs=("decode_attention",))
FUSED_STEP = Knob("decode_step", "fused", "fused decode step", "decode_step_is", module_hooks=False)
PDL = Knob("pdl", True, "PDL", "pdl_is", module_hooks=False)
STEP_CLOCK = Knob("step_clock", True, "in-kernel clock", "step_clock_is", module_hooks=False)
DEVICE_PREPROCESS = Knob("preprocess", "device", "device preprocessing", "preprocess_is")
PREFILL_LOGITS = Knob("prefill_logits", "last", "last-position logits", "prefill_logits_are",
                      cost_knobs=("prefill_logits",), only="prefill")

#: every knob, in the order of conversion (the static cache before what runs on it, the fused vision
#: before its compiled blocks) and of the report's label
KNOBS: tuple = (STATIC_CACHE, GROUPED_MOE, DECODE_GRAPHS, DECODE_COMPILE, PREFILL_GRAPHS, PREFILL_COMPILE, FUSED_VISION, SAM_TRITON, FUSED_LINEARS,
                VISION_COMPILE, DECODE_ATTENTION, FUSED_STEP, PDL, STEP_CLOCK, DEVICE_PREPROCESS, PREFILL_LOGITS)


def _config(execution) -> ExecutionConfig:
    """``execution`` as an ``ExecutionConfig`` (a manifest's dict: its known knobs, defaults for the rest)."""
    if isinstance(execution, ExecutionConfig):
        return execution
    return ExecutionConfig(**{f.name: execution[f.name] for f in dataclasses.fields(ExecutionConfig)
                              if f.name in execution})


def active(execution) -> list:
    """The knobs ``execution`` turns on (an ``ExecutionConfig`` or a manifest's execution dict), in ``KNOBS`` order."""
    ex = _config(execution)
    return [k for k in KNOBS if k.active(ex)]


def label(execution) -> str:
    """'static KV + grouped MoE (torch) + ...' for an execution (a manifest's dict names the resolved
    MoE kernel; ``sam_attention=triton-windows`` reads 'triton SAM attention (windows)'); 'vendor-style'
    when every knob is the vendor's."""
    kernel = execution.get("moe_kernel_resolved") if isinstance(execution, dict) else None
    windows = _config(execution).sam_attention == "triton-windows"
    parts = [f"{k.label} ({kernel})" if k is GROUPED_MOE and kernel else f"{k.label} (windows)" if k is SAM_TRITON
             and windows else k.label for k in active(execution)]
    return " + ".join(parts) or "vendor-style"


def allows_module_hooks(execution: Optional[ExecutionConfig]) -> bool:
    """Whether forward hooks see the modules that run (no compiled step, no replayed graph); True
    for None (a model no converter touched)."""
    return execution is None or all(k.module_hooks for k in active(execution))


def only_in(*stages: str) -> tuple:
    """The names of the knobs that change only one of ``stages`` (``Knob.only``), in ``KNOBS`` order."""
    return tuple(k.name for k in KNOBS if k.only in stages)


def cost_knobs(execution) -> dict:
    """{knob: value} of the knobs that change the analytic cost (``harness.config.cost_config``) of
    ``execution`` (an ``ExecutionConfig`` or a manifest's execution dict)."""
    ex = _config(execution)
    return {name: getattr(ex, name) for k in KNOBS for name in k.cost_knobs}


def augmented_dim(d: int, H: int, W: int, multiple: int = 8) -> int:
    """d' = d + H + W rounded up to a multiple of ``multiple`` (zero columns fill the rest): the head
    width of SAM's augmented attention (``harness.variants.sam_attention``) over an H x W grid.

    Base-mode global block: augmented_dim(64, 64, 64) = 192; 14 x 14 windows: 92 -> 96;
    large (80 x 80): 224; small / gundam tiles (40 x 40): 144; tiny (32 x 32): 128.
    """
    if min(d, H, W, multiple) < 1:
        raise HarnessError(f"augmented_dim needs positive sizes, got d={d}, H={H}, W={W}, multiple={multiple}")
    return -(-(d + H + W) // multiple) * multiple


__all__ = ["Knob", "KNOBS", "STATIC_CACHE", "GROUPED_MOE", "DECODE_GRAPHS", "DECODE_COMPILE", "PREFILL_GRAPHS", "PREFILL_COMPILE",
           "FUSED_VISION", "SAM_TRITON", "FUSED_LINEARS", "VISION_COMPILE", "DECODE_ATTENTION", "FUSED_STEP", "PDL", "STEP_CLOCK", "DEVICE_PREPROCESS",
           "PREFILL_LOGITS", "active", "only_in",
           "label", "allows_module_hooks", "cost_knobs", "augmented_dim"]
