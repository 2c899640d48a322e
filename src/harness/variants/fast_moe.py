"""Routed experts without a host sync: the same function as ``MoE.moe_infer``, capturable in a CUDA graph.

Inputs of every implementation (T tokens, k experts per token, E experts, hidden H, expert width I):

- ``x`` [T, H], the activations (any float dtype; the weights have the same dtype);
- ``topk_ids`` [T, k] int64 on x's device, the gate's expert indices (unsorted, distinct per token);
- ``topk_w`` [T, k] the gate's weights (fp32, as ``MoEGate`` returns them);
- ``weights``, an ``ExpertWeights`` built by ``stack_experts``.

Order of operations (the vendor's, so fp32 matches to ~1e-7 and bf16 rounds at the same places):
each (token, slot) row is ``down(silu(gate(x)) * up(x))`` in x's dtype; the [T, k, H] rows are cast
to topk_w's dtype, multiplied by the weight, summed over k, and cast back to x's dtype.

Implementations (``IMPLEMENTATIONS``):

- ``torch``: pure PyTorch, any device and dtype, no data-dependent shapes. ``gather`` picks each
  row's expert weights (reads T*k expert matrices) and ``dense`` runs every expert on every token
  and keeps the routed rows (E/k times the useful FLOPs); ``auto`` takes gather when T*k <= E.
- ``grouped_mm``: rows sorted by expert on the device, two ``torch._grouped_mm`` calls. See
  ``grouped_mm_available`` for where it is sync-free.
- ``triton``: vLLM-style fused MoE (our own kernels, in ``fast_moe_triton``): rows sorted and padded
  per expert to BLOCK_M on the device, gate_up GEMM with SiLU*up fused, down GEMM with the gate
  weight fused, sum over k in PyTorch.

``torch._grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None)`` conventions (read from
ATen's GroupedBlas.cpp / GroupedMMUtils.h / GroupMM.cu and checked on the CPU with torch 2.13):

- 2D x 3D (the MoE case): mat_a [M, K] rows sorted by group, mat_b [G, K, N] with either layout in
  the last two dims (a [G, N, K] weight ``.transpose(-2, -1)`` is accepted as is), offs int32 [G]
  cumulative *end* row of each group (offs[g] - offs[g-1] rows, empty groups allowed); output
  [M, N] in mat_a's dtype (out_dtype must equal it). Rows at or after offs[-1] are left unwritten.
- offs must be int32 (int64 raises "Offsets have to be int32"); bias is not supported.
- strides: each operand has a unit stride in one of its last two dims and the other stride a
  multiple of 16 bytes (K and N x element size multiples of 16 B for contiguous tensors); on CUDA
  the data pointers must be 16-byte aligned.
- dtypes: fp32, bf16 and fp16 are accepted. CUDA runs the CUTLASS grouped GEMM (no host sync,
  offsets read on the device) only for bf16 inputs and output on compute capability 9.x or 10.x
  (H100/H200 = sm90, built with CUDA >= 12) and fewer than 1024 groups; any other dtype or GPU
  takes ``_grouped_mm_fallback``, which copies offs to the host (``offs.cpu()``) and loops over
  groups: a host sync per call, not capturable. The CPU runs that same loop on host memory.
- ``torch._grouped_mm`` exists from torch 2.8; ``torch.nn.functional.grouped_mm`` is a later alias.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import HarnessError
from ..kernels.availability import triton_available
from ..kernels.moe_blocks import (ALIGN_KERNEL_MAX_ROWS, ROWS_KERNEL_MAX, BlockAlignment,  # noqa: F401 (re-exported)
                                  TritonMoEConfig,
                                  align_rows_to_blocks, counts_in_alignment, default_triton_config, expert_counts)

IMPLEMENTATIONS = ("torch", "grouped_mm", "triton")
TORCH_STRATEGIES = ("auto", "gather", "dense")


@dataclass(frozen=True)
class ExpertWeights:
    """The routed experts of one MoE layer, stacked.

    - ``gate_up`` [E, 2I, H]: rows [0, I) of expert e are its ``gate_proj.weight`` [I, H], rows
      [I, 2I) its ``up_proj.weight``; one GEMM per expert gives gate and up side by side.
    - ``down`` [E, H, I]: ``down_proj.weight`` of each expert.

    Both are contiguous and in nn.Linear's [out, in] layout, so ``gate_up[e] @ x`` is F.linear;
    the GEMMs read them K-major (``.transpose(-2, -1)`` views, no copies).
    """

    gate_up: torch.Tensor
    down: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def hidden(self) -> int:
        return self.gate_up.shape[2]

    @property
    def inter(self) -> int:
        return self.down.shape[2]

    def bytes_per_expert(self) -> int:
        """Weight bytes of one expert (gate + up + down), what a kernel reads to serve it once."""
        return (self.gate_up[0].numel() + self.down[0].numel()) * self.gate_up.element_size()


def stack_experts(moe: nn.Module) -> ExpertWeights:
    """Stack ``moe.experts`` (SwiGLU modules) into ``ExpertWeights`` and re-point each expert's
    Linear weights to views of the stacked tensors.

    After the call, ``moe.state_dict()`` has the same names and values as before, the per-expert
    parameters share storage with the stacked tensors (no second copy once the old ones are
    dropped), and ``load_state_dict`` writes through into them. A later ``moe.to(...)`` (device or
    dtype) replaces the parameters and breaks the sharing: stack after the model is placed, and
    check with ``shares_storage``.
    """
    experts = list(moe.experts)
    if not experts:
        raise HarnessError("stack_experts: the MoE module has no experts")
    first = experts[0]
    inter, hidden = first.gate_proj.weight.shape
    ref = first.gate_proj.weight
    for e, ex in enumerate(experts):
        for name, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                            ("down_proj", (hidden, inter))):
            lin = getattr(ex, name)
            if lin.bias is not None:
                raise HarnessError(f"stack_experts: expert {e} {name} has a bias; routed experts have none")
            w = lin.weight
            if tuple(w.shape) != shape or w.dtype != ref.dtype or w.device != ref.device:
                raise HarnessError(
                    f"stack_experts: expert {e} {name}.weight is {tuple(w.shape)} {w.dtype} on {w.device}, "
                    f"expected {shape} {ref.dtype} on {ref.device}")
    n = len(experts)
    gate_up = torch.empty(n, 2 * inter, hidden, dtype=ref.dtype, device=ref.device)
    down = torch.empty(n, hidden, inter, dtype=ref.dtype, device=ref.device)
    with torch.no_grad():
        for e, ex in enumerate(experts):
            gate_up[e, :inter].copy_(ex.gate_proj.weight)
            gate_up[e, inter:].copy_(ex.up_proj.weight)
            down[e].copy_(ex.down_proj.weight)
    for e, ex in enumerate(experts):
        for lin, view in ((ex.gate_proj, gate_up[e, :inter]), (ex.up_proj, gate_up[e, inter:]),
                          (ex.down_proj, down[e])):
            lin.weight = nn.Parameter(view, requires_grad=lin.weight.requires_grad)
    return ExpertWeights(gate_up=gate_up, down=down)


def shares_storage(moe: nn.Module, weights: ExpertWeights) -> bool:
    """True when every expert weight of ``moe`` is the matching view of ``weights`` (host-only check)."""
    inter = weights.inter
    for e, ex in enumerate(moe.experts):
        for lin, view in ((ex.gate_proj, weights.gate_up[e, :inter]), (ex.up_proj, weights.gate_up[e, inter:]),
                          (ex.down_proj, weights.down[e])):
            w = lin.weight
            if w.data_ptr() != view.data_ptr() or w.shape != view.shape or w.stride() != view.stride():
                return False
    return True


def stacked(moe: nn.Module) -> ExpertWeights:
    """``moe.experts_stacked``: its experts stacked once (``stack_experts``), stacked again only where
    the experts' weights no longer share its storage (``shares_storage``: a ``.to()`` since)."""
    weights = moe.__dict__.get("experts_stacked")
    if weights is None or not shares_storage(moe, weights):
        weights = moe.experts_stacked = stack_experts(moe)
    return weights


def grouped_mm_available(device: torch.device | str, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether ``impl="grouped_mm"`` runs sync-free on ``device`` for ``dtype``, and why (or why not)."""
    device = torch.device(device)
    if not hasattr(torch, "_grouped_mm"):
        return False, f"torch {torch.__version__} has no torch._grouped_mm (added in torch 2.8)"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False, f"torch._grouped_mm takes fp32/bf16/fp16, not {dtype}"
    if device.type == "cpu":
        return True, "CPU: ATen loops over groups on the host (no device, nothing to sync)"
    if device.type != "cuda":
        return False, f"torch._grouped_mm has no sync-free path on {device.type}"
    if torch.version.hip:
        return False, "ROCm: grouped_mm uses CK only on gfx942/gfx950, otherwise a host-sync fallback (untested here)"
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    if dtype != torch.bfloat16:
        return False, (f"CUDA grouped_mm is sync-free only in bf16 (CUTLASS); {dtype} takes the fallback "
                       "that copies offs to the host every call")
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return False, (f"CUDA grouped_mm is sync-free only on sm90/sm100 (CUTLASS); this GPU is sm{major}{minor} "
                       "and would take the host-sync fallback")
    return True, f"CUDA sm{major}{minor} bf16: CUTLASS grouped GEMM, offsets read on the device"


def combine_rows(rows: torch.Tensor, topk_w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Weighted sum over k, in the vendor's order.

    rows [T*k, H] (row t*k + j is token t's j-th expert output, in the activation dtype) ->
    cast to topk_w's dtype, multiply by topk_w [T, k], sum over k -> [T, H] in ``out_dtype``.
    """
    T, k = topk_w.shape
    return rows.view(T, k, -1).to(topk_w.dtype).mul_(topk_w.unsqueeze(-1)).sum(dim=1).to(out_dtype)


def folds_shared(impl: str, tokens: int, k: int, parts: int) -> bool:
    """Whether ``routed_experts(..., shared=...)`` can run the shared expert (``parts`` = its width over the
    expert width) inside the routed kernels of ``tokens`` tokens with ``k`` experts each: impl triton, as
    extra rows of the per-row decode kernels (T*k <= ROWS_KERNEL_MAX) or as pseudo-experts of the blocked
    kernels while the alignment kernel holds every row (T*(k + parts) <= ALIGN_KERNEL_MAX_ROWS)."""
    return impl == "triton" and (tokens * k <= ROWS_KERNEL_MAX or tokens * (k + parts) <= ALIGN_KERNEL_MAX_ROWS)


def counts_routing(impl: str, routed_rows: int) -> bool:
    """Whether ``routed_experts(..., counts=...)`` can count the routing in the kernels: impl triton with
    ``routed_rows`` = T*k in the alignment kernel's range (``moe_blocks.counts_in_alignment``)."""
    return impl == "triton" and counts_in_alignment(routed_rows)


def routed_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, weights: ExpertWeights,
                   impl: str, *, torch_strategy: str = "auto",
                   triton_config: TritonMoEConfig | None = None, shared: tuple | None = None,
                   counts: tuple | None = None) -> torch.Tensor:
    """Routed-expert output [T, H] in x's dtype, without a host sync (see the module docstring).

    ``torch_strategy`` applies to ``impl="torch"``; ``triton_config`` (a ``TritonMoEConfig``, None
    for ``default_triton_config``) to ``impl="triton"``. ``shared`` = (gate_up [2S, H], down [H, S])
    of the layer's shared expert, only where ``folds_shared``: the output is then routed + shared(x).
    ``counts`` = (buffer [steps + 1, layers, E], step index [1], layer), only where ``counts_routing``:
    the rows per routed expert are added there in the kernels (``DeviceRouting.device_counts``), with
    ``shared`` or without it (the shared expert's rows are never counted).
    """
    _check_inputs(x, topk_ids, topk_w, weights)
    if shared is not None and impl != "triton":     # the size and tile rule: routed_experts_triton
        raise HarnessError(f"routed_experts: the shared expert folds into impl=triton's per-row kernels only; "
                           f"got impl={impl}")
    if counts is not None and impl != "triton":    # the row rule: routed_experts_triton
        raise HarnessError(f"routed_experts: the routing counts in impl=triton's alignment kernel only; got impl={impl}")
    if impl == "torch":
        return _routed_torch(x, topk_ids, topk_w, weights, torch_strategy)
    if impl == "grouped_mm":
        ok, reason = grouped_mm_available(x.device, x.dtype)
        if not ok:
            raise HarnessError(f"moe impl grouped_mm is unavailable: {reason}", "use impl=triton or impl=torch")
        return _routed_grouped_mm(x, topk_ids, topk_w, weights)
    if impl == "triton":
        ok, reason = triton_available(x.device)
        if not ok:
            raise HarnessError(f"moe impl triton is unavailable: {reason}", "use impl=grouped_mm or impl=torch")
        from ..kernels import fast_moe_triton

        return fast_moe_triton.routed_experts_triton(x, topk_ids, topk_w, weights, triton_config, shared, counts)
    raise HarnessError(f"unknown moe impl {impl!r}", f"use one of {IMPLEMENTATIONS}")


def _check_inputs(x, topk_ids, topk_w, weights: ExpertWeights) -> None:
    """Shape/dtype/device checks; host metadata only, never reads device memory."""
    if x.dim() != 2 or x.shape[1] != weights.hidden:
        raise HarnessError(f"routed_experts: x must be [T, {weights.hidden}], got {tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_ids.dtype != torch.int64:
        raise HarnessError(f"routed_experts: topk_ids must be int64 [{x.shape[0]}, k], got "
                           f"{topk_ids.dtype} {tuple(topk_ids.shape)}")
    if topk_w.shape != topk_ids.shape or not topk_w.is_floating_point():
        raise HarnessError(f"routed_experts: topk_w must be float {tuple(topk_ids.shape)}, got "
                           f"{topk_w.dtype} {tuple(topk_w.shape)}")
    if x.dtype != weights.gate_up.dtype:
        raise HarnessError(f"routed_experts: x is {x.dtype} but the expert weights are {weights.gate_up.dtype}")
    for name, t in (("topk_ids", topk_ids), ("topk_w", topk_w), ("weights", weights.gate_up)):
        if t.device != x.device:
            raise HarnessError(f"routed_experts: {name} is on {t.device}, x on {x.device}")


def _swiglu_rows(gate_up_rows: torch.Tensor, inter: int) -> torch.Tensor:
    """[..., 2I] gate|up GEMM output -> silu(gate) * up [..., I], in the input dtype (as SwiGLU)."""
    return F.silu(gate_up_rows[..., :inter]) * gate_up_rows[..., inter:]


def _routed_torch(x, topk_ids, topk_w, weights: ExpertWeights, strategy: str) -> torch.Tensor:
    T, k = topk_ids.shape
    if strategy == "auto":
        strategy = "gather" if T * k <= weights.num_experts else "dense"
    if strategy == "gather":
        flat_ids = topk_ids.reshape(-1)
        xs = x.unsqueeze(1).expand(T, k, x.shape[1]).reshape(T * k, 1, x.shape[1])  # row t*k + j
        gu = torch.bmm(xs, weights.gate_up[flat_ids].transpose(1, 2))      # [T*k, 1, 2I]
        h = _swiglu_rows(gu, weights.inter)
        rows = torch.bmm(h, weights.down[flat_ids].transpose(1, 2))        # [T*k, 1, H]
        return combine_rows(rows.view(T * k, -1), topk_w, x.dtype)
    if strategy == "dense":
        gu = torch.matmul(x.unsqueeze(0), weights.gate_up.transpose(1, 2))  # [E, T, 2I]
        h = _swiglu_rows(gu, weights.inter)
        y = torch.bmm(h, weights.down.transpose(1, 2))                     # [E, T, H]
        token = torch.arange(T, device=x.device).unsqueeze(1).expand(T, k)
        rows = y[topk_ids, token]                                           # [T, k, H]
        return combine_rows(rows.reshape(T * k, -1), topk_w, x.dtype)
    raise HarnessError(f"unknown torch strategy {strategy!r}", f"use one of {TORCH_STRATEGIES}")


def _routed_grouped_mm(x, topk_ids, topk_w, weights: ExpertWeights) -> torch.Tensor:
    T, k = topk_ids.shape
    for name, size in (("hidden", weights.hidden), ("expert width", weights.inter)):
        if size * x.element_size() % 16:
            raise HarnessError(f"torch._grouped_mm needs rows of a multiple of 16 bytes; {name} {size} x "
                               f"{x.element_size()} B is not", "use impl=triton or impl=torch")
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)                 # sorted row -> flat row t*k + j
    xs = x.index_select(0, order // k)                            # [T*k, H] grouped by expert
    offs = expert_counts(flat_ids, weights.num_experts).cumsum(0).to(torch.int32)  # group ends
    gu = torch._grouped_mm(xs, weights.gate_up.transpose(1, 2), offs=offs)        # [T*k, 2I]
    h = _swiglu_rows(gu, weights.inter).contiguous()
    y = torch._grouped_mm(h, weights.down.transpose(1, 2), offs=offs)             # [T*k, H]
    rows = torch.empty_like(y).index_copy_(0, order, y)          # back to flat (t, j) order
    return combine_rows(rows, topk_w, x.dtype)


def moe_forward(moe: nn.Module, weights: ExpertWeights, x: torch.Tensor, impl: str) -> torch.Tensor:
    """``MoE.forward`` with the routed part replaced: gate, ``routed_experts``, shared expert. [B, S, H]."""
    shape = x.shape
    idx, w = moe.gate(x)
    y = routed_experts(x.reshape(-1, shape[-1]), idx, w, weights, impl).view(*shape)
    return y + moe.shared_experts(x)
