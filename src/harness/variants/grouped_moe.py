"""``moe_impl=grouped`` (+ ``moe_kernel``): routed experts without a host sync.

``GroupedMoE`` is the reference ``MoE`` whose routed experts run as ``fast_moe.routed_experts``
with one kernel (``kernel``: triton | grouped_mm | torch) over the experts stacked once
(``experts_stacked``: views, the state_dict is unchanged) and whose routing is counted on the
device (``routing.add_device``; inside the Triton router with fused linears at one token, inside
the Triton alignment kernel at batched decode sizes: both at the device step index); its gate takes
the request's forced experts from the same routing target. ``GROUPED_MOE`` is the converter;
``resolve_kernel`` says which kernel ``moe_kernel`` gets on a device (or why none can run: refused,
never replaced).
"""
from __future__ import annotations

import torch

from .. import knobs
from ..kernels.availability import triton_available
from ..models.llm import MoE
from .base import Converter, Variant, need, swap
from .engine import attach
from .fast_moe import counts_routing, folds_shared, grouped_mm_available, routed_experts, stacked
from .fused_linears import FusedGate, FusedSwiGLU

#: whether a batched decode step's MoE layer (FusedGate's Triton router, moe_kernel triton, the blocked
#: kernels with the rows in the alignment kernel) makes the router's choice in the alignment's launch
#: (``moe_align_triton.route_and_align``: the GEMV, then one launch instead of the top-k's and the
#: alignment's; a batch-32 step on an H200 ran them as 2.5 + 4.5 µs per layer,
#: ``runs/examples/h200-issue40-s9/call4/kernels_b32-default.txt``). False until timed on a GPU
ROUTE_IN_ALIGNMENT = False


class GroupedMoE(Variant, MoE):
    """``MoE`` with sync-free routed experts (see the module docstring)."""

    kernel: str = "torch"
    experts_stacked = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.routes_in_alignment(x):
            return self.forward_routed_in_alignment(x)
        in_router = self.routing is not None and isinstance(self.gate, FusedGate) and \
            self.gate.counts_in_kernel(x.numel() // shape[-1])
        counts = None
        if in_router:
            idx, w = self.gate(x, self.routing, count=True)
        else:
            idx, w = self.gate(x, self.routing)
            if self.routing is not None:
                counts = self.alignment_counts() if counts_routing(self.kernel, idx.numel()) else None
                if counts is None:
                    self.routing.add_device(self.layer_idx, idx)
        shared = self.shared_fold(*idx.shape)
        y = routed_experts(x.reshape(-1, shape[-1]), idx, w, self.experts_stacked, self.kernel, counts=counts,
                           shared=shared).view(*shape)
        return y if shared is not None else y + self.shared_experts(x)

    def routes_in_alignment(self, x: torch.Tensor) -> bool:
        """Whether ``forward`` makes the router's choice in the alignment's launch (``ROUTE_IN_ALIGNMENT``):
        a batched decode step (one token per sequence, 2 or more) that FusedGate routes in its Triton
        router, whose routed rows the Triton alignment kernel holds (``fast_moe.counts_routing``: moe_kernel
        triton, the blocked kernels); the shared expert folds in where ``shares_kernels``."""
        gate = self.gate
        rows = x.numel() // x.shape[-1]
        return (ROUTE_IN_ALIGNMENT and isinstance(gate, FusedGate) and rows > 1
                and gate.routes_in_kernel(rows, rows // x.shape[0] if x.dim() == 3 else rows)
                and counts_routing(self.kernel, rows * gate.top_k))   # the alignment kernel's rows, triton

    def forward_routed_in_alignment(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` where ``routes_in_alignment``: the gate's fp32 logits (``FusedGate``, ``logits_only``:
        the router's GEMV, inside the gate module so a profile attributes it there), then
        ``fast_moe_triton.routed_experts_routing`` (its choice, forced experts and routing count in the
        alignment's launch; the shared expert folded in where ``shares_kernels``)."""
        from ..kernels.fast_moe_triton import routed_experts_routing

        shape, gate = x.shape, self.gate
        flat = x.reshape(-1, shape[-1])
        logits = gate(flat, logits_only=True)
        forced = self.routing.forced_inputs() if self.routing is not None else None
        shared = self.shared_fold(flat.shape[0], gate.top_k)
        y = routed_experts_routing(flat, logits, (gate.top_k, gate.norm_topk_prob, gate.scale, gate.layer_idx),
                                   self.experts_stacked, forced, self.alignment_counts(), shared).view(*shape)
        return y if shared is not None else y + self.shared_experts(x)

    def alignment_counts(self):
        """(buffer, step index, this layer) where the Triton alignment kernel adds the routing count at the
        device step index (``DeviceRouting.device_counts``); None while nothing counts."""
        where = self.routing.device_counts() if self.routing is not None else None
        return (*where, self.layer_idx) if where is not None else None

    def shared_fold(self, tokens: int, k: int):
        """The shared expert's (gate_up, down) weights for the routed kernels of ``tokens`` x ``k`` rows where
        ``shares_kernels``, else None (it runs as its own module)."""
        sh = self.shared_experts
        return (sh.gate_up_weight, sh.down_proj.weight) if self.shares_kernels(tokens, k) else None

    def shares_kernels(self, tokens: int, k: int) -> bool:
        """Whether the shared expert runs inside the routed kernels of ``tokens`` x ``k`` rows
        (``fast_moe.folds_shared``: moe kernel triton, as extra rows at decode size, as pseudo-experts up to
        the alignment kernel's rows) rather than as its own GEMMs: with linear_impl=fused, whose fused
        gate/up weight those kernels read."""
        if not isinstance(self.shared_experts, FusedSwiGLU):
            return False
        parts = self.shared_experts.down_proj.weight.shape[1] // self.experts_stacked.inter
        return folds_shared(self.kernel, tokens, k, parts)


def resolve_kernel(ex, device: torch.device, dtype: torch.dtype) -> tuple:
    """(kernel, why): ``moe_kernel=auto`` takes triton on CUDA and the torch gather path elsewhere;
    a kernel that cannot run here raises ``CannotRunHere``."""
    want = ex.moe_kernel
    if want == "auto":
        want = "triton" if device.type == "cuda" and triton_available(device)[0] else "torch"
    if want == "torch":
        return "torch", "torch: per-row expert gather + bmm (sync-free, reads each routed row's expert)"
    ok, why = triton_available(device) if want == "triton" else grouped_mm_available(device, dtype)
    need(ok, "moe_kernel", want, f"cannot run here: {why}", "use execution.moe_kernel=auto or torch", here=True)
    return want, f"{want}: {why}"


class GroupedMoEConverter(Converter):
    """Every MoE layer becomes a ``GroupedMoE`` with the resolved kernel; routing counts go to
    device buffers (``engine.Plan.device_routing``)."""

    spec = knobs.GROUPED_MOE

    def check(self, ex, device, dtype, model=None, positions=None) -> None:
        if not self.active(ex):
            need(ex.moe_kernel == "auto", "moe_kernel", ex.moe_kernel, "picks the kernel of moe_impl=grouped, "
                 "which is off", "add execution.moe_impl=grouped, or drop execution.moe_kernel")
            return
        resolve_kernel(ex, device, dtype)

    def convert(self, model, ex, device, dtype) -> dict:
        if not self.active(ex):
            return {self.manifest_key: "vendor loop: per-expert Python loop, one device-to-host copy per MoE layer",
                    "moe_kernel_resolved": None}
        kernel, why = resolve_kernel(ex, device, dtype)
        attach(model).device_routing = True
        for mod in model.modules():
            if isinstance(mod, MoE):
                stacked(mod)                # once: views of the same weights
                mod.kernel = kernel
                swap(mod, GroupedMoE)
        if ROUTE_IN_ALIGNMENT and kernel == "triton":
            why += ("; at batched decode with fused linears the router's choice in the alignment's launch "
                    "(grouped_moe.ROUTE_IN_ALIGNMENT)")
        return {self.manifest_key: why, "moe_kernel_resolved": kernel}


GROUPED_MOE = GroupedMoEConverter()
