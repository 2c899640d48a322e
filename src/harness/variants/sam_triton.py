"""``sam_attention=triton-windows | triton``: SAM's attention by the Triton kernel that adds the
decomposed rel-pos bias inside (``kernels.sam_attention_triton``): no S x S mask and no wider head dim.

- ``TritonSAMAttention``: the reference ``SAMAttention`` computing the same function by
  ``sam_attention.forward(method="triton")``: the kernel reads q, k, v as strided views of the qkv
  linear's output and writes proj's [B, H, W, C] layout; rel_h / rel_w are the vendor's einsums (which
  copy q, as the vendor's do). Under
  ``vision_compile`` it is the custom op ``torch.ops.harness.sam_rel_bias_attention``, which inductor
  keeps whole (no graph break).
- ``triton-windows``: the 8 windowed blocks (14 x 14 windows, in place of the dense mask that cuDNN
  reads); the global blocks keep ``vision_impl=fused``'s augmented SDPA. ``triton``: the global
  blocks too (in place of the augmented head dim's doubled FLOPs).

Needs ``vision_impl=fused`` and a device where Triton runs (the CPU: its interpreter, for tests).
"""
from __future__ import annotations

import torch

from .. import knobs
from ..kernels.availability import triton_available
from ..models.vision import SAMAttention, rel_pos_table
from . import sam_attention
from .base import Converter, Variant, need, reference_class, swap


class TritonSAMAttention(Variant, SAMAttention):
    """A ``SAMAttention`` by the in-kernel-bias Triton kernel (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, _ = x.shape
        return sam_attention.forward(self, x, rel_pos_table(H, H, self.rel_pos_h), rel_pos_table(W, W, self.rel_pos_w),
                                     method="triton")


class SamTriton(Converter):
    """The windowed SAM blocks (``triton-windows``) or every SAM block (``triton``) by the Triton kernel."""

    spec = knobs.SAM_TRITON

    def check(self, ex, device, dtype, model=None, positions=None) -> None:
        if not self.active(ex):
            return
        need(ex.vision_impl == "fused", self.knob, ex.sam_attention, "needs vision_impl=fused (it replaces that "
             "variant's SAM attention)", "add execution.vision_impl=fused")
        ok, why = triton_available(device)
        need(ok, self.knob, ex.sam_attention, f"cannot run here: {why}", "use execution.sam_attention=sdpa", here=True)

    def convert(self, model, ex, device, dtype) -> dict:
        if not self.active(ex):
            return {self.manifest_key: "sdpa: torch SDPA (windowed blocks with the dense rel-pos mask; global blocks "
                    "as vision_impl says)"}
        every = ex.sam_attention == "triton"
        for blk in model.model.sam_model.blocks:
            if every or blk.window_size > 0:      # in place of fused vision's AugmentedSAMAttention, not over it
                blk.attn.__class__ = reference_class(blk.attn)
                swap(blk.attn, TritonSAMAttention)
        which = "every block" if every else "the windowed blocks (global blocks: augmented SDPA)"
        return {self.manifest_key: f"{ex.sam_attention}: {which} by sam_attention_triton (rel-pos bias added in "
                f"the kernel, no mask); {triton_available(device)[1]}"}


SAM_TRITON = SamTriton()
