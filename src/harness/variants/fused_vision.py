"""``vision_impl=fused``: SAM's global attention without the dense rel-pos mask, and on CUDA each
vision stage replayed from a CUDA graph.

- ``AugmentedSAMAttention``: the reference ``SAMAttention`` of a global block computing the same
  function by augmented q . k (``sam_attention.forward(method="augmented")``: the decomposed
  rel-pos terms folded into the head dim, no S x S mask; exact). Windowed blocks keep the dense path.
- ``GemmPatchEmbed``: SAM's patch embedding (a 16 x 16 stride-16 convolution of 3 channels) as one
  matrix product of the non-overlapping patches, the same sums in another order. cuDNN runs the
  3-channel convolution on a kernel without tensor cores: 33.8 ms of a 425 ms SAM at batch 128 on an
  H200 (about 19 TFLOP/s; bf16, compiled blocks, graphed); the product is a 768-wide GEMM.
- ``GraphedStage``: sam, clip and projector (``DeepseekOCRModel.sam_model`` / ``vision_model`` /
  ``projector``) each captured once per input shapes (``CapturedCall``) and replayed; with
  ``vision_compile`` their blocks are compiled first (one eager pass before capture: attention
  probes and backend choices). Set-up seconds go to the model's ``info["setup_s"]``.

On a CPU the augmented attention runs eagerly (no graphs); the manifest says so.
"""
from __future__ import annotations

import torch

from .. import knobs
from ..models.vision import PatchEmbed, SAMAttention, rel_pos_table
from . import sam_attention
from .base import Converter, Variant, swap
from .static_decoder import CapturedCall


class AugmentedSAMAttention(Variant, SAMAttention):
    """A global block's ``SAMAttention`` by augmented q . k (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, _ = x.shape
        return sam_attention.forward(self, x, rel_pos_table(H, H, self.rel_pos_h), rel_pos_table(W, W, self.rel_pos_w),
                                     method="augmented")


class GemmPatchEmbed(Variant, PatchEmbed):
    """``PatchEmbed`` as a GEMM: x [B, C, H, W] cut into p x p patches flattened in (c, i, j) order, the
    conv weight's own order, times weight^T [C*p*p, dim] + bias -> [B, H/p, W/p, dim] (what the conv
    and its permute give). Sides that are not multiples of p take the reference conv."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv = self.proj
        p = conv.kernel_size[0]
        B, C, H, W = x.shape
        if H % p or W % p:          # (PatchEmbed's conv is always p x p at stride p, unpadded)
            return super().forward(x)
        patches = x.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5).reshape(B * (H // p) * (W // p), C * p * p)
        out = torch.addmm(conv.bias, patches, conv.weight.reshape(conv.out_channels, C * p * p).t())
        return out.view(B, H // p, W // p, conv.out_channels)


class GraphedStage(Variant):
    """A vision stage module replayed from one CUDA graph per input shapes. State set by the converter:
    ``stage`` (its name), ``graphs`` ({input shapes and dtypes: CapturedCall}), ``built_for`` (the knobs
    that shaped the captured blocks: vision_compile, i.e. whether they are torch.compile'd, and
    sam_attention), ``setup_s`` (the model's set-up seconds)."""

    def forward(self, *args):
        key = tuple((tuple(a.shape), a.dtype) for a in args)
        if key not in self.graphs:
            if self.built_for[0]:   # compiled blocks (vision_compile): one eager pass first, for the attention
                # probes and backend choices
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
    execution's ``vision_compile`` and ``sam_attention`` stay the same, released otherwise)."""

    spec = knobs.FUSED_VISION          # replayed graphs run no Python: hooks would see nothing

    def convert(self, model, ex, device, dtype) -> dict:
        stages = vision_stages(model)
        graphed = self.active(ex) and device.type == "cuda"
        built_for = (ex.vision_compile, ex.sam_attention)     # what the blocks captured in the graphs were
        for mod in stages.values():
            if not graphed or mod.__dict__.get("built_for") != built_for:
                mod.graphs = {}                    # captured over other blocks: release
        if not self.active(ex):
            return {self.manifest_key: "vendor: dense rel-pos mask, eager launches"}
        swap(model.model.sam_model.patch_embed, GemmPatchEmbed)
        for blk in model.model.sam_model.blocks:
            if blk.window_size == 0:
                swap(blk.attn, AugmentedSAMAttention)
        for name, mod in stages.items() if graphed else ():
            mod.stage, mod.built_for, mod.setup_s = name, built_for, model.info.setdefault("setup_s", {})
            swap(mod, GraphedStage)
        return {self.manifest_key: "fused: SAM global blocks by augmented q.k (no dense rel-pos mask), SAM patch embedding as a GEMM; sam, clip, "
                "projector each a CUDA graph per input shape" + ("" if graphed else " (no CUDA here: eager)")}


FUSED_VISION = FusedVision()
