"""What an execution variant is: a converter of the reference model, and the module classes it swaps in.

A converter (``Converter``) owns one knob of ``harness.config.ExecutionConfig``:

- ``check(ex, device, dtype, model=None, positions=None)``: refuse what cannot run, or would run as
  something else, with one ``HarnessError`` naming ``execution.<knob>`` and the fix (never replace
  it silently). ``CannotRunHere`` marks a refusal that is about this device (an experiment's case
  is then skipped, with the reason, instead of failing the run). ``check_batch(ex, batch)``: the
  same for the request's batch size, where it is known.
- ``convert(model, ex, device, dtype) -> dict``: swap modules / bind kernels once; its manifest
  entries (what runs, or what runs in its place when the knob is off). It is called on a model in
  the vendor's execution (``restore`` first): every conversion starts from the reference classes,
  so a model built once runs every execution of an experiment in turn and goes back to the
  vendor's between them; what a conversion sets up once (stacked or fused weights: views of the
  same parameters) stays on the modules for the next.
- ``spec``: the knob's facts, ``harness.knobs.Knob`` (torch-free, read by the report and the cost
  model too): ``knob`` / ``on``, the knob and the value that turns it on; ``label``: its short name
  in the report; ``manifest_key``; ``module_hooks``: whether forward hooks still see the modules
  that run (False where a step is compiled or replayed from a CUDA graph); ``cost_knobs``: the knobs
  the analytic cost model reads (``harness.analytic``).

Module classes of a variant subclass the reference class they replace (``StaticAttention(Variant,
Attention)``) and override only what they change; ``swap(module, cls)`` rebinds a module to ``cls``
in place (its parameters, state_dict names and module path stay the same, as
``torch.nn.utils.parametrize`` does), composing with a variant class already bound there:
``swap(attn, FusedAttention)`` on a ``StaticAttention`` gives a class whose MRO is
FusedAttention, StaticAttention, Attention (one class per combination, cached). ``reference_class`` is the class a module has
in the vendor's execution (what the module families of ``harness.anatomy.registry`` name).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import HarnessError
from ..knobs import Knob


class Variant:
    """Marker base of the module classes a converter swaps in (never the reference classes)."""


class CannotRunHere(HarnessError):
    """A knob this device (or this Triton / torch build) cannot run: the case is skipped, not the run."""


def reference_class(module) -> type:
    """The class ``module`` has in the vendor's execution: the first class of its MRO that is no variant."""
    return next(c for c in type(module).__mro__ if not issubclass(c, Variant))


_COMPOSED: dict = {}


def swap(module: torch.nn.Module, cls: type) -> None:
    """Rebind ``module`` to the variant class ``cls`` (a ``Variant`` subclass: of its reference class,
    or a mixin for several), on top of the variant class it already has."""
    if not issubclass(cls, Variant):
        raise HarnessError(f"{cls.__name__} is not a variant class")
    current = type(module)
    if issubclass(current, cls):
        return
    if current is reference_class(module) and issubclass(cls, current):
        module.__class__ = cls
        return
    key = (cls, current)
    if key not in _COMPOSED:   # one class per (variant, class below it): cls's methods over current's
        _COMPOSED[key] = type(f"{cls.__name__}+{current.__name__}", (cls, current), {"__module__": cls.__module__})
    module.__class__ = _COMPOSED[key]


def restore(model: torch.nn.Module) -> None:
    """Every module of ``model`` back to its reference class (the vendor's execution)."""
    for m in model.modules():
        m.__class__ = reference_class(m)


class Converter:
    """One execution knob as a converter (see the module docstring). Subclasses set ``spec`` (the
    knob's ``harness.knobs.Knob``: ``knob``, ``on``, ``label``, ``manifest_key``, ``module_hooks`` and
    ``cost_knobs`` read through) and implement ``check`` and ``convert``."""

    spec: Knob

    knob = property(lambda self: self.spec.name, doc="the ``ExecutionConfig`` field this converter owns")
    on = property(lambda self: self.spec.on, doc="the value of ``knob`` that turns the variant on")
    label = property(lambda self: self.spec.label, doc="the report's words for the variant")
    manifest_key = property(lambda self: self.spec.manifest_key, doc="its manifest entry (what runs)")
    module_hooks = property(lambda self: self.spec.module_hooks, doc="whether forward hooks see the modules that run")
    cost_knobs = property(lambda self: self.spec.cost_knobs, doc="the knobs the analytic cost model reads")

    def active(self, ex) -> bool:
        """Whether ``ex`` turns this variant on."""
        return self.spec.active(ex)

    def check(self, ex, device: torch.device, dtype: torch.dtype, model=None, positions: Optional[int] = None) -> None:
        """Refuse (``HarnessError`` / ``CannotRunHere``) what cannot run here; ``model``: the
        ``ModelConfig`` (None: unknown), ``positions``: the request's prompt + decode tokens."""

    def check_batch(self, ex, batch: int) -> None:
        """Refuse (``HarnessError``) what cannot run at ``batch`` rows per request (default: any batch)."""

    def convert(self, model, ex, device: torch.device, dtype: torch.dtype) -> dict:
        """On: swap modules / bind kernels on ``model`` (in the vendor's execution); off: release what
        an earlier conversion kept. Returns its manifest entries (``manifest_key``: what runs)."""
        raise NotImplementedError

    def refuse(self, ok: bool, problem: str, fix: str, here: bool = False) -> None:
        """``need`` for this converter's knob at its ``on`` value."""
        need(ok, self.knob, self.on, problem, fix, here)


def need(ok: bool, knob: str, value, problem: str, fix: str, here: bool = False) -> None:
    """Raise the one-line refusal ``execution.<knob>=<value> <problem>; fix: <fix>`` unless ``ok``
    (``here``: a ``CannotRunHere``, about this device)."""
    if not ok:
        value = str(value).lower() if isinstance(value, bool) else value
        raise (CannotRunHere if here else HarnessError)(f"execution.{knob}={value} {problem}", fix)


__all__ = ["Variant", "CannotRunHere", "Converter", "reference_class", "swap", "restore", "need"]
