"""MoE routing per decode step under every execution, and the forced (balanced) routing (issue 22
items 2 and 3): the tiny model in fp32 on the CPU, batches of distinct pages."""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import TINY_MODE, load_tiny_cfg, triton_runs
from harness import variants
from harness import workload as wl
from harness.config import ExecutionConfig
from harness.models.build import build_model
from harness.models.generate import generate
from harness.models.routing import balanced_experts, balanced_table, page_key

STEPS = 4
SEED = 7
#: executions whose routing must equal vendor-style's: the vendor loop on a static cache (host counts),
#: the grouped MoE on a growing cache (device counts, step set from the host) and on a static cache
#: (device counts, step index advanced on the device)
EXECUTIONS = {
    "static": dict(kv_cache="static"),
    "grouped": dict(moe_impl="grouped", moe_kernel="torch"),
    "static-grouped": dict(kv_cache="static", moe_impl="grouped", moe_kernel="torch"),
}


@pytest.fixture(scope="module")
def tiny():
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build_model(load_tiny_cfg(), "cpu", torch.float32, seed=0)
    pages = [wl.Page(f"synthetic-{i:04d}", wl.synthetic_page(i, size=(300, 200)), "s") for i in range(4)]
    return model, pages


def _request(pages, routing="weights", steps=STEPS):
    return wl.build_request(pages, TINY_MODE, decode_tokens=steps + 1, routing=routing, routing_seed=SEED)


_REFERENCE: dict = {}


def _vendor_style(model, req):
    """vendor-style's result for ``req`` (computed once per request shape and routing in this module)."""
    key = (tuple(req.pages), req.routing, req.decode_tokens)
    if key not in _REFERENCE:
        _REFERENCE[key] = _generate(model, req, {})
    return _REFERENCE[key]


def _generate(model, req, knobs: dict):
    variants.apply(model, ExecutionConfig(**knobs))
    try:
        return generate(model, req)
    finally:
        variants.apply(model, ExecutionConfig())


def _table_counts(req, cfg) -> tuple:
    """(prefill [layers, experts], decode per step [steps, layers, experts]) counts of the balanced
    table of ``req``, counted here from the table itself: every row's experts at every position."""
    L = cfg.llm
    S, n = req.prefill_tokens, req.decode_tokens - 1
    table = balanced_table(SEED, req.pages, S + n + 1, L.num_layers, L.num_experts_per_tok,
                           L.n_routed_experts).numpy()
    moe = range(L.first_k_dense_replace, L.num_layers)
    prefill = np.zeros((L.num_layers, L.n_routed_experts), dtype=np.int64)
    steps = np.zeros((n, L.num_layers, L.n_routed_experts), dtype=np.int64)
    for layer in moe:
        prefill[layer] = np.bincount(table[:, :S, layer].ravel(), minlength=L.n_routed_experts)
        for i in range(n):
            steps[i, layer] = np.bincount(table[:, S + i, layer].ravel(), minlength=L.n_routed_experts)
    return prefill, steps


# ------------------------------------------------------------------ measured routing per step

@pytest.mark.parametrize("name", list(EXECUTIONS))
def test_per_step_counts_equal_vendor_style_at_batch_4(tiny, name):
    """Issue 22 acceptance: batch 4 of distinct pages, fp32. Each decode step's counts [layers,
    experts] equal vendor-style's, and each MoE layer's row sums to batch x top-k = 4 x 2 = 8 (the
    dense layer 0 routes nothing); the tokens are the same."""
    model, pages = tiny
    req = _request(pages)
    ref = _vendor_style(model, req)
    res = _generate(model, req, EXECUTIONS[name])
    assert torch.equal(res.tokens, ref.tokens)
    assert res.routing_steps.shape == (STEPS, 3, 8)
    assert (res.routing_steps.sum(axis=2) == np.array([0, 8, 8])).all()
    assert (res.routing_steps == ref.routing_steps).all()
    assert (res.routing["prefill"] == ref.routing["prefill"]).all()
    assert (res.routing["decode"] == res.routing_steps.sum(axis=0)).all()


def test_balanced_routing_is_applied_identically_by_every_execution(tiny):
    """workload.routing=balanced, batch 4: vendor-style's prefill and per-step counts are the table's
    own (counted here from ``balanced_table``: the gate took the request's experts at each token's
    position), and every execution gets the same tokens and the same counts."""
    model, pages = tiny
    req = _request(pages, "balanced")
    ref = _vendor_style(model, req)
    prefill, steps = _table_counts(req, model.cfg)
    assert (ref.routing["prefill"] == prefill).all() and (ref.routing_steps == steps).all()
    for name, knobs in EXECUTIONS.items():
        res = _generate(model, req, knobs)
        assert torch.equal(res.tokens, ref.tokens), name
        assert (res.routing_steps == steps).all() and (res.routing["prefill"] == prefill).all(), name


@pytest.mark.skipif(not triton_runs(), reason="Triton cannot run here")
def test_fused_router_counts_at_the_device_step_and_takes_forced_experts(tiny, wide_gemv_tiles):
    """Batch 1, balanced, under fused linears on the static cache: the Triton router reads the forced
    table at the device position and counts each step in its kernel at the device step index; the
    per-step counts are the table's and vendor-style's, the tokens vendor-style's (two steps: the
    Triton interpreter is slow)."""
    model, pages = tiny
    req = _request(pages[:1], "balanced", steps=2)
    ref = _vendor_style(model, req)
    res = _generate(model, req, dict(kv_cache="static", moe_impl="grouped", moe_kernel="torch", linear_impl="fused"))
    assert torch.equal(res.tokens, ref.tokens)
    assert (res.routing_steps.sum(axis=2) == [0, 2, 2]).all()
    assert (res.routing_steps == ref.routing_steps).all()
    assert (res.routing_steps == _table_counts(req, model.cfg)[1]).all()


def test_gate_weights_are_the_models_probabilities_at_the_forced_experts():
    """MoEGate.select with forced experts: weights = softmax(logits) at those experts, renormalised
    (norm_topk_prob) and scaled, in the table's order; with the runtime flag off, the top-k exactly."""
    import types

    from harness.models.llm import MoEGate

    cfg = types.SimpleNamespace(num_experts_per_tok=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                                n_routed_experts=5, hidden_size=4)
    gate = MoEGate(cfg)
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0], [4.0, 0.0, 0.0, 0.0, 1.0]])
    forced = torch.tensor([[0, 2], [3, 1]])
    idx, w = gate.select(logits, (forced, None))
    e = [[math.exp(v) for v in row] for row in logits.tolist()]
    want = [[e[t][j] / (e[t][forced[t, 0]] + e[t][forced[t, 1]]) * 2.5 for j in forced[t].tolist()] for t in range(2)]
    assert idx.tolist() == forced.tolist() and torch.allclose(w, torch.tensor(want), rtol=1e-6)
    plain = gate.select(logits)
    off = gate.select(logits, (forced, torch.tensor([False])))
    assert torch.equal(off[0], plain[0]) and torch.equal(off[1], plain[1])
    assert gate.select(logits, (forced, torch.tensor([True])))[0].tolist() == forced.tolist()


# ------------------------------------------------------------------ the balanced generator

def test_balanced_experts_follow_the_documented_generator():
    """The table equals the generator written out per token from its docstring: key = CRC-32 of the
    page name, PCG64 seeded with SeedSequence([seed, key]), u = random((P, L, k)); slot j takes the
    floor(u * (E - j))-th smallest expert not yet taken."""
    import zlib

    P, L, k, E = 5, 3, 4, 9
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([SEED, zlib.crc32(b"page-a")])))
    u = rng.random((P, L, k))
    want = np.zeros((P, L, k), dtype=np.int64)
    for p in range(P):
        for layer in range(L):
            remaining = list(range(E))
            for j in range(k):
                want[p, layer, j] = remaining.pop(int(u[p, layer, j] * (E - j)))
    assert page_key("page-a") == zlib.crc32(b"page-a")
    assert (balanced_experts(SEED, "page-a", P, L, k, E) == want).all()


def test_balanced_table_is_distinct_reproducible_and_position_major():
    table = balanced_table(SEED, ["a", "b", "a"], 40, 4, 6, 64)
    assert table.shape == (3, 40, 4, 6) and table.dtype == torch.int64
    s = table.sort(dim=-1).values
    assert (s[..., 1:] != s[..., :-1]).all() and int(table.min()) >= 0 and int(table.max()) <= 63   # distinct ids
    assert torch.equal(table, balanced_table(SEED, ["a", "b", "a"], 40, 4, 6, 64))                 # reproducible
    assert torch.equal(table[0], table[2]) and not torch.equal(table[0], table[1])                # per page
    assert not torch.equal(table, balanced_table(SEED + 1, ["a", "b", "a"], 40, 4, 6, 64))         # per seed
    assert torch.equal(balanced_table(SEED, ["a"], 10, 4, 6, 64)[0], table[0, :10])                # a prefix


@pytest.mark.parametrize("experts", [64, 300])        # ids kept as uint8, and wider than a byte
def test_pages_drawn_once_give_the_fresh_draw_at_any_length(experts):
    from harness.models import routing

    routing._drawn.clear()
    short = balanced_table(SEED, ["kept"], 12, 3, 6, experts)            # first draw: 12 positions
    long = balanced_table(SEED, ["kept"], 50, 3, 6, experts)             # longer: drawn again
    again = balanced_table(SEED, ["kept"], 30, 3, 6, experts)            # shorter: the kept draw's prefix
    for table, n in ((short, 12), (long, 50), (again, 30)):
        assert table.dtype == torch.int64
        assert torch.equal(table[0], torch.from_numpy(balanced_experts(SEED, "kept", n, 3, 6, experts)))
    assert len(routing._drawn) == 1


def test_balanced_experts_are_uniform_over_the_experts():
    """N = 2000 positions x 12 layers = 24,000 tokens, k = 6 of E = 64: each expert is in a token's set
    with p = k/E = 0.09375, independently across tokens, so its count is Binomial(N, p): mean
    N p = 2,250, variance N p (1 - p) = 2,039.06. Bernstein: P(|X - Np| >= t) <= 2 exp(-t^2 / (2
    (var + t/3))); for all 64 experts at once below 1e-9, 2 * 64 * exp(...) <= 1e-9 needs t^2 >=
    2 ln(1.28e11) (var + t/3) = 51.16 (2039.06 + t/3), i.e. t >= 332. A generator that favours or
    avoids any expert by more than ~15% fails."""
    table = balanced_experts(SEED, "uniform", 2000, 12, 6, 64)
    counts = np.bincount(table.ravel(), minlength=64)
    N, p = 2000 * 12, 6 / 64
    var = N * p * (1 - p)
    t = 332
    assert 2 * 64 * math.exp(-t * t / (2 * (var + t / 3))) <= 1e-9
    assert counts.sum() == N * 6 and np.abs(counts - N * p).max() <= t, counts


# ----------------------------------------------------------------------- a run, end to end

def test_a_batch_4_run_writes_per_step_routing_of_every_case(tmp_path):
    """Issue 22 acceptance: ``workload.batch=4`` under vendor-style and the static cache + grouped MoE,
    weights and balanced: 4 distinct pages per case in the manifest with the routing that ran,
    routing_steps.csv rows for every case (each MoE layer's step = 4 x top-k), the static-grouped
    rows equal vendor-style's, the analytic bytes from the measured steps, the report's routing section."""
    from hydra import compose, initialize_config_dir

    from conftest import ROOT
    from harness.config import to_config
    from harness.run import run

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = to_config(compose("config", overrides=[
            "model=tiny", "workload.mode={name: t, base_size: 128, image_size: 64, crop: true}",
            "workload.decode_tokens=4", "measure.repeats=1", "measure.warmup=0", "workload.page_size=[120,180]",
            "workload.batch=4", "cases=[{name: v}, {name: sg, execution: {kv_cache: static, moe_impl: grouped}}, "
            "{name: sg-bal, routing: balanced, execution: {kv_cache: static, moe_impl: grouped}}]"]))
    rd = run(cfg, tmp_path / "run", progress=lambda *_: None)
    man = json.loads((rd.path / "manifest.json").read_text())
    assert man["status"] == "complete"
    assert {c["name"]: (c["distinct_pages"], c["routing_label"]) for c in man["cases"]} == {
        "v": (4, "weights"), "sg": (4, "weights"), "sg-bal": (4, "balanced (seed 0)")}
    steps = pd.read_csv(rd.path / "routing_steps.csv")
    ecols = [f"e{j}" for j in range(8)]
    assert set(steps["case"]) == {"v", "sg", "sg-bal"}
    for case, g in steps.groupby("case"):
        assert sorted(set(zip(g["step"], g["layer"]))) == [(s, layer) for s in range(3) for layer in (1, 2)], case
        assert (g[ecols].sum(axis=1) == 4 * 2).all() and (g["experts"] == (g[ecols] > 0).sum(axis=1)).all()
    key = ["step", "layer", "experts"] + ecols
    v, sg = (steps[steps["case"] == c][key].reset_index(drop=True) for c in ("v", "sg"))
    assert v.equals(sg)
    analytic = pd.read_csv(rd.path / "analytic.csv")
    assert set(analytic["routing"]) == {"measured per step"}
    md = (rd.path / "report.md").read_text()
    assert "## MoE routing" in md and "| sg-bal | 4 | balanced (seed 0) |" in md


def test_a_grown_ones_buffer_stays_alive_and_unchanged_for_a_captured_step():
    """A decode step captured with the routing's ones buffer reads that address on every replay. A
    later, larger call (a prefill of 3 rows x 2 tokens x top-2 = 12 ids > the 8 a step of 4 rows x
    top-2 counts) grows the buffer; the old one must stay allocated and all ones (freed, the
    allocator hands its memory to other tensors: an H100 batch-8 decode counted garbage)."""
    import weakref

    from harness.models.routing import DeviceRouting

    r = DeviceRouting(layers=2, experts=5, steps=3, device="cpu", driven="device", rows=8)
    r._ones = torch.ones(8, dtype=torch.int64)         # as small as a 4-row step needs (the default floor is 64)
    first = weakref.ref(r._ones)
    r.phase = "decode"
    r.add_device(1, torch.tensor([[0, 1], [1, 2], [2, 3], [3, 4]]))   # 8 ids: the captured step's call
    assert r._ones is first()
    r.phase = "prefill"
    ids = torch.tensor([[4, 0], [4, 1], [4, 2], [4, 3], [0, 1], [2, 3]])   # 12 ids: grows the buffer
    r.add_device(0, ids)
    assert r._ones is not first() and first() is not None and torch.equal(first(), torch.ones(8, dtype=torch.int64))
    # counts: prefill layer 0: expert 4 in four rows, 0..3 in two rows each; decode scratch layer 1: 1, 2, 2, 2, 1
    assert r.prefill[0, 0].tolist() == [2, 2, 2, 2, 4] and r.scratch[1].tolist() == [1, 2, 2, 2, 1]


def test_per_step_counts_that_do_not_sum_to_the_batch_are_not_shown_as_experts(tmp_path):
    """Every (step, MoE layer) of a batch of 2 rows at top-2 counts 2 x 2 = 4 routed tokens. A case
    whose rows sum to 4 shows its distinct experts (step 0: e0, e1, e3 -> 3; step 1: e2 -> 1); one
    whose counts were garbage (a freed buffer read by a replayed graph: 7 and 4) shows none, and says
    why."""
    from harness.report.routing import routing_facts
    from harness.rundir import RunData

    manifest = {"config": {"model": {"llm": {"num_experts_per_tok": 2}}},
                "cases": [{"name": n, "batch": 2, "pages": ["a", "b"]} for n in ("ok", "bad")]}
    rows = [("ok", 0, [2, 1, 0, 1]), ("ok", 1, [0, 0, 4, 0]), ("bad", 0, [5, 1, 0, 1]), ("bad", 1, [0, 0, 4, 0])]
    steps = pd.DataFrame([{"case": c, "step": s, "layer": 1, "experts": sum(v > 0 for v in e),
                           **{f"e{j}": v for j, v in enumerate(e)}} for c, s, e in rows])
    facts = routing_facts(RunData(tmp_path, manifest, routing_steps=steps))
    assert facts["ok"]["experts_step"] == (1.0, 1.0, 3.0) and facts["ok"]["inconsistent"] is None
    assert facts["bad"]["experts_step"] is None
    assert facts["bad"]["inconsistent"] == ("counts inconsistent: 1 of 2 (step, layer) rows do not sum to 2 x 2 = 4 "
                                            "(e.g. 7)")
