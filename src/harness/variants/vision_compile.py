"""``vision_compile=true``: each SAM and CLIP block ``torch.compile``'d (inductor: window partition and
padding, norms, GELU and residuals fused around the GEMMs and attention) before ``vision_impl=fused``
captures its stage's CUDA graph. Blocks of one kind share compiled graphs (parameters are graph
inputs); shapes per view size and batch need more than Dynamo's default 8 recompiles (raised to
64). Needs ``vision_impl=fused`` and a CUDA device (on a CPU the blocks would run eager)."""
from __future__ import annotations

from .. import knobs
from .base import Converter
from .engine import need_cuda


def vision_blocks(model) -> list:
    """The SAM blocks and CLIP layers of ``model``."""
    return list(model.model.sam_model.blocks) + list(model.model.vision_model.transformer.layers)


class VisionCompile(Converter):
    spec = knobs.VISION_COMPILE

    def check(self, ex, device, dtype, model=None, positions=None) -> None:
        if self.active(ex):
            self.refuse(ex.vision_impl == "fused", "needs vision_impl=fused (the compiled blocks are captured in its "
                        "per-stage CUDA graphs)", "add execution.vision_impl=fused")
            need_cuda(device, "vision_compile", True)

    def convert(self, model, ex, device, dtype) -> dict:
        on = self.active(ex)
        for blk in vision_blocks(model):
            if on and blk._compiled_call_impl is None:
                blk.compile(dynamic=False)
            elif not on:
                blk._compiled_call_impl = None
        if not on:
            return {self.manifest_key: "eager blocks"}
        import torch._dynamo.config as dcfg

        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dcfg, name):
                setattr(dcfg, name, max(getattr(dcfg, name), 64))
        return {self.manifest_key: "each SAM and CLIP block torch.compile'd (inductor) before capture"}


VISION_COMPILE = VisionCompile()
