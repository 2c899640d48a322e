"""The Triton MoE router (fp32 GEMV, then softmax/top-k/scale in one kernel; the interpreter on the CPU)
against MoEGate's torch math."""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from conftest import DEV, needs_triton
from harness.errors import HarnessError
from harness.models.llm import MoE, MoEGate
from harness.models.routing import DeviceRouting

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


def test_route_counts_at_the_device_step_index():
    """``counts`` = (buffer [steps + 1, layers, E], step_index [1]): the chosen experts' counters of
    row min(step_index, steps), layer ``layer`` + 1 per call, nothing else touched (the index is
    read on the device: moving it moves the row); more than one token is refused."""
    from harness.kernels.router_triton import route

    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 96, generator=g).to(DEV)
    w = (torch.randn(8, 96, generator=g) * 0.1).to(DEV)
    buf = torch.zeros(3, 2, 8, dtype=torch.int64, device=DEV)        # steps = 2 (+ the spare row)
    step = torch.zeros(1, dtype=torch.int64, device=DEV)
    for s in (0, 1, 1, 7):                                           # step 7 > steps: the spare row (2)
        step.fill_(s)
        idx, _ = route(x, w, 3, True, 1.0, 1, counts=(buf, step))
    want = torch.zeros(3, 2, 8, dtype=torch.int64)
    for row, n in ((0, 1), (1, 2), (2, 1)):
        want[row, 1, idx[0].cpu()] = n
    assert torch.equal(buf.cpu(), want)
    with pytest.raises(HarnessError, match="one token"):
        route(torch.randn(2, 96).to(DEV), w, 3, True, 1.0, 0, counts=(buf, step))
    with pytest.raises(HarnessError, match="layer 2"):
        route(x, w, 3, True, 1.0, 2, counts=(buf, step))


def test_route_takes_forced_experts_at_the_device_position():
    """``forced`` = (table [T, positions, layers, k], position [1], on): each token's experts are its
    row's at min(position, positions - 1) for ``layer``, weighted by their own softmax probability
    (renormalised and scaled as MoEGate does); with ``on`` false the top-k as without a table."""
    from harness.kernels.router_triton import route

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 96, generator=g).to(DEV)
    w = (torch.randn(8, 96, generator=g) * 0.1).to(DEV)
    table = torch.zeros(2, 4, 2, 3, dtype=torch.int64)
    table[0, 2, 1] = torch.tensor([5, 0, 7])
    table[1, 2, 1] = torch.tensor([1, 2, 3])
    table[0, 3, 1] = torch.tensor([6, 4, 2])
    table[1, 3, 1] = torch.tensor([0, 1, 7])
    table = table.to(DEV)
    probs = (x.double() @ w.double().T).softmax(-1)                 # what the kernel's fp32 softmax approximates
    pos = torch.tensor([2], device=DEV)
    idx, wt = route(x, w, 3, False, 2.0, 1, forced=(table, pos, None))
    assert idx.tolist() == [[5, 0, 7], [1, 2, 3]]
    assert torch.allclose(wt.double(), 2.0 * probs.gather(-1, idx), rtol=1e-5)
    idx, wt = route(x, w, 3, True, 1.0, 1, forced=(table, torch.tensor([9], device=DEV), None))   # clamped: 3
    assert idx.tolist() == [[6, 4, 2], [0, 1, 7]]
    p = probs.gather(-1, idx)
    assert torch.allclose(wt.double(), p / p.sum(-1, keepdim=True), rtol=1e-5)
    on = torch.zeros(1, dtype=torch.bool, device=DEV)
    plain = route(x, w, 3, True, 1.0)
    off = route(x, w, 3, True, 1.0, 1, forced=(table, pos, on))
    assert torch.equal(off[0], plain[0]) and torch.equal(off[1], plain[1])
    on.fill_(True)
    assert route(x, w, 3, True, 1.0, 1, forced=(table, pos, on))[0].tolist() == [[5, 0, 7], [1, 2, 3]]
    with pytest.raises(HarnessError, match="forced needs"):
        route(x, w, 3, True, 1.0, 1, forced=(table[:1].contiguous(), pos, None))


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
    """linear_impl=fused at one token: the Triton router; more tokens of one sequence or fused off: the
    torch path.
    The grouped path counts the routing either way: in the kernel at the device step index (one
    token), else with add_device (a device-driven routing: its scratch, into the step's row at
    ``advance``)."""
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
    assert moe.gate.routes_in_kernel(1) and not moe.gate.routes_in_kernel(2, per_sequence=2)
    assert moe.gate.routes_in_kernel(128) and not moe.gate.routes_in_kernel(129)   # decode steps (ROUTER_MAX_ROWS)
    routing = DeviceRouting(3, 8, 2, DEV, "device")
    routing.phase = "decode"
    routing.step_index.fill_(1)
    moe.routing = routing
    y1 = moe(x1)                                       # counted in the kernel: row 1, layer 1
    assert ((y1 - ref1).norm() / ref1.norm()) <= 1e-5
    want = torch.zeros(3, 3, 8, dtype=torch.int64, device=DEV)
    want[1, 1, ref_idx[0]] = 1
    assert torch.equal(routing.decode, want)
    y2 = moe(x2)                                       # two rows: the torch gate, add_device (scratch)
    assert ((y2 - ref2).norm() / ref2.norm()) <= 1e-5
    assert int(routing.decode.sum()) == 2 and int(routing.scratch.sum()) == 2 * 2
    routing.advance()                                  # the scratch into row 1, the index to 2
    assert int(routing.decode[1].sum()) == 2 + 4 and int(routing.scratch.sum()) == 0
    assert int(routing.step_index) == 2


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


def _grouped_decode_moe(B, E, k):
    """A decode step of B sequences through an MoE layer of E experts, top-k: (the layer as GroupedMoE with
    the Triton kernel and FusedGate, x [B, 1, 64], the vendor loop's output and the torch gate's experts)."""
    from harness.variants import fast_moe
    from harness.variants.base import swap
    from harness.variants.fused_linears import FusedGate
    from harness.variants.grouped_moe import GroupedMoE

    moe = _moe(E=E, k=k)
    x = torch.randn(B, 1, 64, device=DEV)
    ref_y = moe(x)                                     # the vendor loop, the torch gate
    ref_idx, _ = moe.gate(x)
    moe.kernel = "triton"
    moe.experts_stacked = fast_moe.stack_experts(moe)
    swap(moe, GroupedMoE)
    swap(moe.gate, FusedGate)
    return moe, x, ref_y, ref_idx


def _step_as_the_vendor_loop(y, ref_y, ref_idx, routing, E):
    """The step's output within fp32 rounding of the vendor loop's and its counts exactly the vendor gate's
    experts, at step 1 of layer 1, nothing in the scratch -> the counts buffer expected [steps + 1, layers, E]."""
    assert ((y - ref_y).norm() / ref_y.norm()) <= 1e-5
    want = torch.zeros(3, 3, E, dtype=torch.int64)
    want[1, 1] = torch.bincount(ref_idx.view(-1).cpu(), minlength=E)
    assert torch.equal(routing.decode.cpu(), want)
    assert not routing.scratch_used and int(routing.scratch.sum()) == 0
    return want


def _decode_routing(E):
    """A device-driven routing target of 3 layers and 2 decode steps, in the decode phase at step 1."""
    routing = DeviceRouting(3, E, 2, DEV, "device")
    routing.phase = "decode"
    routing.step_index.fill_(1)
    return routing


def _force(routing, B, E, k):
    """Balanced routing on: each of the B rows' k experts drawn at position 2 of layer 1 -> those [B, k]."""
    forced = torch.stack([torch.randperm(E)[:k] for _ in range(B)]).to(DEV)
    routing.table = torch.zeros(B, 4, 3, k, dtype=torch.int64, device=DEV)
    routing.table[:, 2, 1] = forced
    routing.position.fill_(2)
    routing.active = True
    return forced


def test_batched_decode_routes_and_counts_in_the_kernels():
    """A decode step of 20 sequences (one token each, 40 routed rows): the Triton router (forced experts
    at the device position under balanced routing) and the blocked Triton MoE, whose alignment kernel
    counts the routing at the device step index: outputs as the reference MoE's within fp32 rounding,
    the counts exactly the reference routing's experts, nothing in the scratch."""
    B, E, k = 20, 8, 2
    moe, x, ref_y, ref_idx = _grouped_decode_moe(B, E, k)
    routing = _decode_routing(E)
    moe.routing = routing
    y = moe(x)
    _step_as_the_vendor_loop(y, ref_y, ref_idx, routing, E)
    forced = _force(routing, B, E, k)
    idx, w = moe.gate(x, routing)
    assert torch.equal(idx.sort(-1)[0], forced.sort(-1)[0])
    probs = torch.softmax(F.linear(x.view(B, -1), moe.gate.weight), -1).gather(-1, idx)
    assert torch.allclose(w, probs / probs.sum(-1, keepdim=True) * 1.5, rtol=1e-5)


@pytest.mark.parametrize("shared", [False, True], ids=["shared-apart", "shared-folded"])
def test_batched_decode_routes_in_the_alignment_launch(shared, monkeypatch):
    """``grouped_moe.ROUTE_IN_ALIGNMENT``: a decode step of 20 sequences (40 routed rows) runs the router's
    GEMV, then its choice and the alignment in one launch (``route_and_align``; ``route`` not called): the
    vendor loop's output within fp32 rounding under the weights' routing, the counts exactly its experts;
    under forced routing the table's experts, as with the lever off. ``shared-folded``: the shared expert
    (fused gate/up, as linear_impl=fused gives it) as a pseudo-expert of the same kernels."""
    from harness.kernels import moe_align_triton, router_triton
    from harness.variants import grouped_moe
    from harness.variants.base import swap
    from harness.variants.fused_linears import FusedSwiGLU, fused_weight

    B, E, k = 20, 8, 2
    moe, x, ref_y, ref_idx = _grouped_decode_moe(B, E, k)
    if shared:
        sh = moe.shared_experts
        fused_weight(sh, "gate_up_weight", [sh.gate_proj, sh.up_proj])
        swap(sh, FusedSwiGLU)
    assert moe.shares_kernels(B, k) == shared
    gate_calls = []                                   # the GEMV runs inside the gate module (profiles attribute it)
    moe.gate.register_forward_hook(lambda mod, args, kwargs, out: gate_calls.append(kwargs.get("logits_only", False)),
                                   with_kwargs=True)
    calls = {"route": 0, "route_and_align": 0}
    for mod, name in ((router_triton, "route"), (moe_align_triton, "route_and_align")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, real=real, name=name, **kw: calls.__setitem__(name, calls[name] + 1)
                            or real(*a, **kw))

    def step(lever, routing):
        monkeypatch.setattr(grouped_moe, "ROUTE_IN_ALIGNMENT", lever)
        moe.routing = routing
        return moe(x)

    routing = _decode_routing(E)
    y = step(True, routing)
    assert calls == {"route": 0, "route_and_align": 1} and gate_calls == [True]
    want = _step_as_the_vendor_loop(y, ref_y, ref_idx, routing, E)
    forced = _force(routing, B, E, k)
    y_forced = step(True, routing)
    assert calls == {"route": 0, "route_and_align": 2}
    y_plain = step(False, routing)                     # the router's launch, then the alignment's
    assert calls == {"route": 1, "route_and_align": 2}
    assert ((y_forced - y_plain).norm() / y_plain.norm()) <= 1e-6
    want[1, 1] += torch.bincount(forced.view(-1).cpu(), minlength=E) * 2   # counted by both steps
    assert torch.equal(routing.decode.cpu(), want)


@pytest.mark.parametrize("shape,kernel,taken", [
    ((20, 1), "triton", True),        # 20 sequences, 40 routed rows: the blocked kernels
    ((1, 1), "triton", False),        # one token: the router counts in its own kernel
    ((4, 1), "triton", False),        # 8 routed rows: the per-row kernels, no alignment
    ((1, 12), "triton", False),       # a prefill of 12 tokens: the torch router
    ((20, 1), "torch", False),        # the torch MoE kernel
])
def test_the_route_in_alignment_path_only_where_the_alignment_kernel_runs(shape, kernel, taken, monkeypatch):
    """``grouped_moe.ROUTE_IN_ALIGNMENT`` on: ``GroupedMoE`` takes the one-launch choice only at a batched
    decode step of the blocked Triton kernels (k = 2, more than 16 routed rows); elsewhere its usual path,
    with the vendor loop's output either way."""
    from harness.kernels import moe_align_triton
    from harness.variants import grouped_moe

    B, S = shape
    moe, _, _, _ = _grouped_decode_moe(20, 8, 2)
    moe.kernel = kernel
    x = torch.randn(B, S, 64, device=DEV)
    monkeypatch.setattr(grouped_moe, "ROUTE_IN_ALIGNMENT", True)
    calls = []
    real = moe_align_triton.route_and_align
    monkeypatch.setattr(moe_align_triton, "route_and_align", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    assert moe.routes_in_alignment(x) == taken
    y = moe(x)
    assert len(calls) == int(taken)
    ref = grouped_moe.MoE.forward(moe, x)            # the reference MoE's forward: the vendor loop
    assert ((y - ref).norm() / ref.norm()) <= 1e-5
