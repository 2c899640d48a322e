"""``vision_impl=fused``: SAM's global attention without the dense rel-pos mask, and on CUDA each
vision stage replayed from a CUDA graph.

- ``AugmentedSAMAttention``: the reference ``SAMAttention`` of a global block computing the same
  function by augmented q . k (``sam_attention.forward(method="augmented")``: the decomposed
  rel-pos terms folded into the head dim, no S x S mask; exact). Windowed blocks keep the dense path.
- ``GraphedStage``: sam, clip and projector (``DeepseekOCRModel.sam_model`` / ``vision_model`` /
  ``projector``) each captured once per input shapes (``CapturedCall``) and replayed; with
  ``vision_compile`` their blocks are compiled first (one eager pass before capture: attention
  probes and backend choices). Set-up seconds go to the model's ``info["setup_s"]``.

On a CPU the augmented attention runs eagerly (no graphs); the manifest says so.
"""
from __future__ import annotations

import torch

from .. import knobs
from ..models.vision import SAMAttention, rel_pos_table
from . import sam_attention
from .base import Converter, Variant, swap
from .static_decoder import CapturedCall


class AugmentedSAMAttention(Variant, SAMAttention):
    """A global block's ``SAMAttention`` by augmented q . k (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, _ = x.shape
        return sam_attention.forward(self, x, rel_pos_table(H, H, self.rel_pos_h), rel_pos_table(W, W, self.rel_pos_w),
                                     method="augmented")


class GraphedStage(Variant):
    """A vision stage module replayed from one CUDA graph per input shapes. State set by the converter:
    ``stage`` (its name), ``graphs`` ({input shapes and dtypes: CapturedCall}), ``compiled`` (its
    blocks are torch.compile'd), ``setup_s`` (the model's set-up seconds)."""

    def forward(self, *args):
        key = tuple((tuple(a.shape), a.dtype) for a in args)
        if key not in self.graphs:
            if self.compiled:   # one eager pass first: attention probes and backend choices
                with torch.compiler.set_stance("force_eager"):
                    super().forward(*args)
            self.graphs[key] = CapturedCall(super().forward, args)
            self.setup_s[f"{self.stage}{list(args[0].shape)}"] = self.graphs[key].setup_s
        return self.graphs[key](*args)


def vision_stages(model) -> dict:
    """{stage name: its module} of the three vision stages."""
    m = model.model
    return {"sam": m.sam_model, "clip": m.vision_model, "projector": m.projector}


class FusedVision(Converter):
    """Global SAM attention by augmented q . k; on CUDA the stages graphed (their graphs kept while the
    execution's ``vision_compile`` stays the same, released otherwise)."""

    spec = knobs.FUSED_VISION          # replayed graphs run no Python: hooks would see nothing

    def convert(self, model, ex, device, dtype) -> dict:
        stages = vision_stages(model)
        graphed = self.active(ex) and device.type == "cuda"
        for mod in stages.values():
            if not graphed or mod.__dict__.get("compiled") != ex.vision_compile:
                mod.graphs = {}                    # captured over other blocks: release
        if not self.active(ex):
            return {self.manifest_key: "vendor: dense rel-pos mask, eager launches"}
        for blk in model.model.sam_model.blocks:
            if blk.window_size == 0:
                swap(blk.attn, AugmentedSAMAttention)
        for name, mod in stages.items() if graphed else ():
            mod.stage, mod.compiled, mod.setup_s = name, ex.vision_compile, model.info.setdefault("setup_s", {})
            swap(mod, GraphedStage)
        return {self.manifest_key: "fused: SAM global blocks by augmented q.k (no dense rel-pos mask); sam, clip, "
                "projector each a CUDA graph per input shape" + ("" if graphed else " (no CUDA here: eager)")}


FUSED_VISION = FusedVision()
