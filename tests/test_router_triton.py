"""The Triton MoE router (fp32 GEMV, then softmax/top-k/scale in one kernel; the interpreter on the CPU)
against MoEGate's torch math."""
from __future__ import annotations

import types

import pytest
import torch

from conftest import DEV, needs_triton
from harness.errors import HarnessError
from harness.models.llm import MoE, MoEGate
from harness.models.routing import DeviceCounts

pytestmark = needs_triton

# (E, k, H, norm, scale)
CASES = [(64, 6, 1280, False, 1.0), (8, 2, 96, True, 2.5), (16, 1, 200, True, 1.0)]


def _gate(E, k, H, norm, scale, w) -> MoEGate:
    cfg = types.SimpleNamespace(num_experts_per_tok=k, norm_topk_prob=norm, routed_scaling_factor=scale,
                                n_routed_experts=E, hidden_size=H)
    gate = MoEGate(cfg).to(device=DEV, dtype=w.dtype)
    with torch.no_grad():
        gate.weight.copy_(w)
    return gate


def _by_expert(idx, w):
    """Each token's (experts, weights) in ascending expert order (the kernel's order is descending weight)."""
    idx_s, order = idx.sort(dim=-1)
    return idx_s, w.gather(-1, order)


def _rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-5)])
@pytest.mark.parametrize("E,k,H,norm,scale", CASES)
def test_route_matches_moegate(E, k, H, norm, scale, dtype, tol):
    """Same expert set per token as MoEGate (torch), weights within fp32 summation order."""
    from harness.kernels.router_triton import route

    g = torch.Generator().manual_seed(E * 1000 + H)
    x = torch.randn(2, H, generator=g).to(DEV, dtype)
    w = (torch.randn(E, H, generator=g) * 0.05).to(DEV, dtype)
    with torch.no_grad():
        ref_idx, ref_w = _gate(E, k, H, norm, scale, w)(x)
    idx, wt = route(x, w, k, norm, scale)
    assert idx.dtype == torch.int64 and wt.dtype == torch.float32 and idx.shape == wt.shape == (2, k)
    got_i, got_w = _by_expert(idx, wt)
    want_i, want_w = _by_expert(ref_idx, ref_w)
    assert torch.equal(got_i, want_i)
    assert _rel(got_w, want_w) <= tol                 # max |diff| / max |ref| (the logits' summation order)
    assert (wt[:, :-1] >= wt[:, 1:]).all()            # descending


@pytest.mark.parametrize("E,k,H,norm,scale", CASES + [(8, 3, 64, False, 2.5)])
def test_route_elementwise_when_logits_are_exact(E, k, H, norm, scale):
    """Inputs on a coarse grid (products and sums exact in fp32, so no summation-order error):
    softmax, top-k, renormalisation and scale agree elementwise within 1e-6."""
    from harness.kernels.router_triton import route

    g = torch.Generator().manual_seed(E + k)
    x = (torch.randint(-4, 5, (2, H), generator=g) / 4).to(DEV)
    w = (torch.randint(-8, 9, (E, H), generator=g) / 64).to(DEV)
    with torch.no_grad():
        ref_idx, ref_w = _gate(E, k, H, norm, scale, w)(x)
    idx, wt = route(x, w, k, norm, scale)
    got_i, got_w = _by_expert(idx, wt)
    want_i, want_w = _by_expert(ref_idx, ref_w)
    assert torch.equal(got_i, want_i)
    assert float(((got_w.double() - want_w.double()).abs() / want_w.double().abs()).max()) <= 1e-6


def test_ties_go_to_the_lowest_index():
    from harness.kernels.router_triton import route

    x = torch.randn(1, 32, device=DEV)
    idx, wt = route(x, torch.zeros(16, 32, device=DEV), 4, True, 1.0)      # all logits equal
    assert idx.tolist() == [[0, 1, 2, 3]] and torch.allclose(wt, torch.full_like(wt, 0.25))
    w = torch.zeros(8, 32, device=DEV)
    w[[2, 5, 6]] = x[0] / 32                                                # three equal winners
    idx, _ = route(x, w, 2, False, 1.0)
    assert idx.tolist() == [[2, 5]]
    idx, _ = route(x, w, 4, False, 1.0)                                     # then the tied rest
    assert idx.tolist() == [[2, 5, 6, 0]]


def test_route_counts_the_routing_in_the_kernel():
    """``counts`` = (buffer, offset): the chosen experts' counters in [offset, offset + E) + 1 per
    call, nothing else touched; more than one token or a range past the buffer is refused."""
    from harness.kernels.router_triton import route

    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 96, generator=g).to(DEV)
    w = (torch.randn(8, 96, generator=g) * 0.1).to(DEV)
    buf = torch.zeros(3, 8, dtype=torch.int64, device=DEV)
    for _ in range(2):
        idx, _ = route(x, w, 3, True, 1.0, (buf, 8))
    want = torch.zeros(3, 8, dtype=torch.int64)
    want[1, idx[0].cpu()] = 2
    assert torch.equal(buf.cpu(), want)
    with pytest.raises(HarnessError, match="one token"):
        route(torch.randn(2, 96).to(DEV), w, 3, True, 1.0, (buf, 0))
    with pytest.raises(HarnessError, match="one token"):
        route(x, w, 3, True, 1.0, (buf, 20))


def test_bad_arguments_are_refused():
    from harness.kernels.router_triton import route

    x = torch.randn(1, 32, device=DEV)
    with pytest.raises(HarnessError, match=r"x \[T, H\] and w \[E, H\]"):
        route(x, torch.randn(8, 16, device=DEV), 2, True, 1.0)
    with pytest.raises(HarnessError, match="top_k"):
        route(x, torch.randn(4, 32, device=DEV), 5, True, 1.0)


def _moe(E=8, k=2, H=64, inter=16):
    cfg = types.SimpleNamespace(num_experts_per_tok=k, norm_topk_prob=True, routed_scaling_factor=1.5,
                                n_routed_experts=E, hidden_size=H, moe_intermediate_size=inter, n_shared_experts=1)
    moe = MoE(cfg, layer_idx=1).to(DEV)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(std=0.1)
    return moe


def test_moe_gate_dispatch():
    """linear_impl=fused at one token: the Triton router; more rows or fused off: the torch path.
    The grouped path counts the routing with add_device either way."""
    from harness.variants import fast_moe
    from harness.variants.base import swap
    from harness.variants.fused_linears import FusedGate
    from harness.variants.grouped_moe import GroupedMoE

    moe = _moe()
    moe.kernel = "torch"
    moe.experts_stacked = fast_moe.stack_experts(moe)
    swap(moe, GroupedMoE)
    x1, x2 = torch.randn(1, 1, 64, device=DEV), torch.randn(1, 2, 64, device=DEV)
    ref1, ref2 = moe(x1), moe(x2)                      # the reference gate, no routing target
    ref_idx, _ = moe.gate(x1)
    swap(moe.gate, FusedGate)
    assert moe.gate.routes_in_kernel(1) and not moe.gate.routes_in_kernel(2)
    counts = DeviceCounts(3, 8, DEV)
    moe.routing = counts
    y1 = moe(x1)
    assert ((y1 - ref1).norm() / ref1.norm()) <= 1e-5
    want = torch.zeros(3, 8, dtype=torch.int64, device=DEV)
    want[1, ref_idx[0]] = 1
    assert torch.equal(counts.buf, want)
    y2 = moe(x2)
    assert ((y2 - ref2).norm() / ref2.norm()) <= 1e-5 and int(counts.buf.sum()) == 2 + 2 * 2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_route_under_torch_compile_equals_eager(dtype):
    """Dynamo traces the kernels without a graph break (fullgraph); idx and weights equal the eager
    kernels' bit for bit; a CUDA graph replays them."""
    from harness.kernels.router_triton import route

    x = torch.randn(1, 1280, device="cuda", dtype=dtype)
    w = (torch.randn(64, 1280, device="cuda") * 0.05).to(dtype)
    fn = torch.compile(lambda x, w: route(x, w, 6, True, 2.5), fullgraph=True, dynamic=False)
    got = fn(x, w)
    want = route(x, w, 6, True, 2.5)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = route(x, w, 6, True, 2.5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
