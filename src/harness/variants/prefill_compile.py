"""``prefill_compile=true``: the captured prefill ``torch.compile``'d (inductor) before its capture.

``StaticDecoder.prefill`` compiles ``engine.Engine.prefill_core`` once per request shape (batch, prompt
length, image position, routing) with fixed shapes, then captures the compiled forward in the
prefill's CUDA graph: the norms, RoPE, residual adds and activations between the GEMMs, attention
and the routed-expert kernels run fused instead of as eager elementwise launches. Compile seconds
go into ``setup_s`` (``prefill_capture_S<S>``). Needs ``prefill_graphs`` (what is compiled is what
that knob captures), hence the static cache, the grouped MoE and CUDA.
"""
from __future__ import annotations

from .. import knobs
from .base import need
from .engine import PlanConverter


class PrefillCompile(PlanConverter):
    """``PlanConverter`` of ``Plan.prefill_compile`` that also needs ``prefill_graphs``."""

    def check(self, ex, device, dtype, model=None, positions=None) -> None:
        if self.active(ex):
            need(ex.prefill_graphs, self.knob, self.on, "compiles the captured prefill, which is off",
                 "add execution.prefill_graphs=true")
        super().check(ex, device, dtype, model, positions)


PREFILL_COMPILE = PrefillCompile(
    knobs.PREFILL_COMPILE, "prefill_compile",
    "the captured prefill is compiled: it runs on the static cache and the grouped MoE",
    ("torch.compile (inductor) of the captured prefill, once per request shape (seconds in setup_s)",
     "eager prefill kernels"), needs_cuda=True)
