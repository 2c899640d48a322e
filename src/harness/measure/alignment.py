"""Kernels of a replayed (CUDA graph) or compiled decode step attributed to modules by alignment
with one eager, hooked step of the same execution.

Module forward hooks run no Python inside a CUDA graph and would recompile a compiled step, so the
profiled request of such an execution runs without them (``knobs.allows_module_hooks``) and its
kernels carry names only. This module gives them back their modules:

* **reference** (``reference_step``): after the profiled request, the static-cache decode step's
  function runs once more, eagerly (uncompiled, outside any graph: ``StaticDecoder.eager_step``), under
  module hooks (``ModuleTracker``) and the kernel capture: its kernels in GPU order, each with the
  module path, family and op group that launched it. For a captured eager step (``cuda_graphs=decode``
  without ``compile``) these are the kernels the graph replays, in the same order. For a compiled step
  (``compile=true``) they are the same variant classes run uncompiled: the GEMMs (cuBLAS) and the
  variants' own Triton kernels are the same kernels (inductor renames a user Triton kernel with a
  numeric suffix, which ``name_key`` drops); inductor's fused kernels (``triton_poi_fused_*``, ...)
  have no eager counterpart and stay ``unattributed``. A fused decode step (``decode_step=fused``)
  calls no module: its core runs each launch under the module whose work it does
  (``FusedCore.module_of``, ``ModuleTracker.scope``). torch.compile drops
  ``torch.profiler.record_function`` ranges (dynamo: "Profiler record function ... will be ignored"),
  so no marker can carry a module into a compiled step.
* **alignment** (``align``): each decode step of the profiled request (its kernels in GPU start
  order) against the reference. The same name sequence (the same graph) matches one to one;
  otherwise ``difflib.SequenceMatcher`` (no junk heuristic) over the names: kernels inside its
  matching blocks take their counterpart's module, family and op group (``attribution`` =
  ``aligned``), the others keep an empty module (``unattributed``; counted, never guessed). A
  replay's eager glue around the graph (the token copied in, the output cloned) is unattributed.

``attribute_replay(model, request, kernels, cuda)`` does both for the profiled request of a model
with a static-cache decoder; other executions (a growing cache) keep their name-only kernels.
``aligned_fraction`` says how much of a step matched. Only decode steps are aligned: a captured
prefill and the graphed vision stages keep name-only kernels.
"""
from __future__ import annotations

import difflib
import re
from typing import NamedTuple, Optional, Sequence

import pandas as pd

from ..anatomy.stages import DECODE_STEP

LABEL_COLUMNS = ("module", "family", "op_group")
_SUFFIX = re.compile(r"(_\d+)+$")


def name_key(name: str) -> str:
    """A kernel name as compared: trailing ``_<digits>`` groups dropped (inductor numbers the kernels it
    writes and the user Triton kernels it re-emits: ``gemv_kernel_0`` is the eager ``gemv_kernel``)."""
    return _SUFFIX.sub("", str(name))


def align(replay: Sequence[str], reference: Sequence[str]) -> list:
    """For each kernel name of ``replay`` the index of its counterpart in ``reference``, or None
    (names compared by ``name_key``; see the module docstring)."""
    a, b = [name_key(n) for n in replay], [name_key(n) for n in reference]
    if a == b:
        return list(range(len(a)))
    out: list = [None] * len(a)
    for blk in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks():
        out[blk.a:blk.a + blk.size] = range(blk.b, blk.b + blk.size)
    return out


def attribute_steps(kernels: pd.DataFrame, reference: pd.DataFrame) -> pd.DataFrame:
    """``kernels`` (a kernel table) with every decode-step kernel attributed by ``align`` against
    ``reference`` (one step's kernels in GPU order, with ``LABEL_COLUMNS``): ``aligned`` rows take
    the reference's labels, the rest of the step is ``unattributed`` with empty labels."""
    out = kernels.copy()
    steps = out[out["range"] == DECODE_STEP]
    if not len(steps) or not len(reference):
        return out
    ref_names = list(reference["name"])
    ref_labels = reference[list(LABEL_COLUMNS)].astype(object).to_numpy()
    labels = out[list(LABEL_COLUMNS)].astype(object).to_numpy().copy()
    how = out["attribution"].astype(object).to_numpy().copy()
    pos = {idx: i for i, idx in enumerate(out.index)}
    for _, g in steps.groupby("step", sort=False):
        g = g.sort_values("start_ms", kind="stable")
        for idx, j in zip(g.index, align(list(g["name"]), ref_names)):
            i = pos[idx]
            labels[i] = ref_labels[j] if j is not None else (None, None, None)
            how[i] = "aligned" if j is not None else "unattributed"
    for c, col in enumerate(LABEL_COLUMNS):
        out[col] = labels[:, c]
    out["attribution"] = how
    return out


def reference_step(decoder, cuda: bool) -> pd.DataFrame:
    """One eager, hooked decode step of ``decoder`` (a ``StaticDecoder``): its kernel table rows
    (``KERNEL_COLUMNS``, range ``decode_step``) in GPU start order. The capture is imported here: the
    report reads ``aligned_fraction`` without torch."""
    import torch

    from .kernels import KernelCapture, kernel_table
    from .modules import ModuleTracker
    from .recorder import StageRecorder

    rec = StageRecorder(cuda, nvtx=False, events=False, memory=False)
    core = decoder.core if hasattr(decoder.core, "module_scope") else None   # a fused step: no module runs
    with ModuleTracker(decoder.model) as modules, KernelCapture(cuda) as prof, torch.inference_mode():
        if core is not None:
            core.module_scope = modules.scope
        try:
            with rec("decode"), rec(DECODE_STEP, step=0):
                decoder.eager_step()
        finally:
            if core is not None:
                core.module_scope = None
        ranges = rec.finish()
    k = kernel_table(prof, cuda, ranges, modules)
    return k[k["range"] == DECODE_STEP].sort_values("start_ms", kind="stable").reset_index(drop=True)


def static_decoder_of(model, request):
    """The ``StaticDecoder`` the request ran on (batch, cache length), None without a static cache."""
    static = getattr(getattr(model, "plan", None), "static", None)
    decoders = getattr(model, "static_decoders", None) or {}
    if static is None:
        return None
    return decoders.get((request.batch, static.cache_len(request.prefill_tokens, request.decode_tokens)))


def attribute_replay(model, request, kernels: pd.DataFrame, cuda: bool) -> pd.DataFrame:
    """The profiled request's ``kernels`` with its decode steps attributed by alignment with one
    eager, hooked step of the same decoder (module docstring); unchanged without a static-cache
    decoder or decode steps."""
    decoder = static_decoder_of(model, request)
    if decoder is None or not (kernels["range"] == DECODE_STEP).any():
        return kernels
    return attribute_steps(kernels, reference_step(decoder, cuda))


class Aligned(NamedTuple):
    """How much of the decode steps alignment attributed: kernels and busy-time fractions."""

    kernels: int
    aligned: int
    fraction: Optional[float]         # aligned kernels / decode-step kernels
    time_fraction: Optional[float]    # their summed durations / all decode-step kernel durations


def aligned_fraction(kernels: pd.DataFrame) -> Aligned:
    """``Aligned`` of the decode-step kernels of one case's kernel table."""
    k = kernels[kernels["range"] == DECODE_STEP] if len(kernels) else kernels
    if "attribution" not in k or not len(k):
        return Aligned(len(k), 0, None, None)
    hit = (k["attribution"] == "aligned").to_numpy()
    dur = k["dur_ms"].to_numpy(dtype=float)
    total = float(dur.sum())
    return Aligned(len(k), int(hit.sum()), float(hit.mean()), float(dur[hit].sum()) / total if total else None)


__all__ = ["name_key", "align", "attribute_steps", "reference_step", "static_decoder_of", "attribute_replay",
           "Aligned", "aligned_fraction", "LABEL_COLUMNS"]
