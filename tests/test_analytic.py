"""Analytic cost model: anchors, exactness against FlopCounterMode, outputs, generated docs.

Full-size exactness runs on the meta device (base and gundam 2x3, a few decode steps); the tiny
config runs on the CPU with real tensors and real (data-dependent) MoE routing. The full table
(five modes, gundam 1x2 / 2x3 / 3x3, 128 decode tokens) is ``python -m harness.analytic.check``.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from harness.analytic import analyze, check, compose, docs, families as F
from harness.analytic import (activated_params_per_token, component_params, kv_bytes_per_token,
                              stage_totals, workload_costs)
from harness.config import ModelConfig, cost_config
from harness.errors import HarnessError

ROOT = Path(__file__).resolve().parents[1]
TINY_CROP = {"name": "t128", "base_size": 128, "image_size": 64, "crop": True}
TINY_NOCROP = {"name": "t64", "base_size": 64, "image_size": 64, "crop": False}


@pytest.fixture(scope="module")
def meta_model():
    from harness.models.build import build_model

    return build_model(ModelConfig(), device="meta")


@pytest.fixture(scope="module")
def tiny_cfg():
    return check.load_model_config(str(ROOT / "conf" / "model" / "tiny.yaml"))


# ------------------------------------------------------------------------------------ anchors
# The vendor architecture (DESIGN.md "Facts about the vendor model"), written out by hand: every
# expected count below is derived from these numbers in the test, never read from the code.

H, LAYERS, HEADS, HEAD_DIM, VOCAB = 1280, 12, 10, 128, 129280      # LLM: plain MHA, 10 KV heads
DENSE_FFN, EXPERTS, TOP_K, EXPERT_FFN, SHARED_FFN = 6848, 64, 6, 896, 1792   # layer 0 dense, 1..11 MoE


def swiglu(d: int, f: int) -> int:
    """gate, up (d -> f) and down (f -> d), no bias."""
    return 3 * d * f


def design_llm_params() -> dict:
    attn = 4 * H * (HEADS * HEAD_DIM)                 # q, k, v, o without bias
    norms = 2 * H                                     # input and post-attention RMSNorm weights
    expert = swiglu(H, EXPERT_FFN)
    moe = EXPERTS * H + EXPERTS * expert + swiglu(H, SHARED_FFN)   # gate [64, H], routed, shared
    embed = VOCAB * H
    total = (embed + embed + H                        # embedding, untied lm_head, final norm
             + LAYERS * (attn + norms) + swiglu(H, DENSE_FFN) + (LAYERS - 1) * moe)
    return {"total": total, "embed": embed, "expert": expert}


def design_sam_params(C=768, depth=12, mlp=3072, p=16, grid=64, window=14, glob=4) -> int:
    d = C // 12
    block = 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + 2 * C + (C * mlp + mlp) + (mlp * C + C)
    rel_pos = (depth - glob) * 2 * (2 * window - 1) * d + glob * 2 * (2 * grid - 1) * d
    neck = C * 256 + 2 * 256 + 256 * 256 * 9 + 2 * 256          # conv1x1, LN2d, conv3x3, LN2d (no bias)
    down = 256 * 512 * 9 + 512 * 1024 * 9                          # net_2, net_3 (no bias)
    return (p * p * 3 * C + C) + grid * grid * C + depth * block + rel_pos + neck + down


def design_clip_params(C=1024, depth=24, ffn=4096, patch=14, positions=257) -> int:
    layer = 2 * C + 4 * (C * C + C) + 2 * C + (C * ffn + ffn) + (ffn * C + C)
    return C + patch * patch * 3 * C + positions * C + 2 * C + depth * layer   # CLS, patch conv, pos, pre-LN


def test_component_params_match_design_and_model(meta_model):
    from harness.models.build import param_counts

    projector, separators = 2048 * H + H, 2 * H        # Linear(2048, 1280) with bias; image_newline, view_seperator
    expected = {"llm": design_llm_params()["total"], "sam": design_sam_params(), "clip": design_clip_params(),
                "projector": projector, "separators": separators}
    expected["total"] = sum(expected.values())
    assert expected["total"] == 3_336_106_240          # the checkpoint's tensor count (checkpoint_shapes.json)
    assert component_params() == expected
    assert param_counts(meta_model) == expected


def test_activated_params_and_kv_bytes_per_token():
    llm = design_llm_params()
    # a token runs every LLM weight except the embedding table (a lookup) and the 64 - 6 experts
    # it was not routed to in each of the 11 MoE layers; lm_head counts
    assert activated_params_per_token() == llm["total"] - llm["embed"] - (LAYERS - 1) * (EXPERTS - TOP_K) * llm["expert"]
    assert kv_bytes_per_token() == LAYERS * 2 * HEADS * HEAD_DIM * 2      # K and V, bf16
    # one decode step with a static cache writes exactly one token's K and V
    step = compose.decode_step_costs(cache_len=100, kv_cache="static")
    per_token = LAYERS * 2 * HEADS * HEAD_DIM * 2
    assert step.bytes_kv_write == per_token
    assert step.bytes_kv_read == 101 * per_token


def test_stage_params_are_the_modules_each_stage_runs():
    tot = stage_totals(workload_costs(compose.Case("gundam", (2, 3), decode_tokens=4)))
    llm = design_llm_params()["total"]
    assert {s: int(t["params"]) for s, t in tot.items()} == {
        "sam": design_sam_params(), "clip": design_clip_params(), "projector": 2048 * H + H + 2 * H,
        "prefill": llm, "decode": llm}


# ------------------------------------------------------------------------------ token layout

@pytest.mark.parametrize("spec,image_tokens", [
    ("tiny", 73), ("small", 111), ("base", 273), ("large", 421), ("gundam", 903),
    ("gundam:1x2", 493), ("gundam:2x3", 903), ("gundam:3x3", 1203), ("gundam:1x1", 273)])
def test_case_token_counts(spec, image_tokens):
    r = compose.resolve(spec, ModelConfig())
    assert r.image_tokens == image_tokens
    assert r.prefill_tokens == 1 + image_tokens + 12
    assert r.decode_steps == 127
    views = {v.label: (v.n, v.size, v.q) for v in r.views}
    if r.grid:
        assert views["tiles"] == (r.grid[0] * r.grid[1], 640, 10) and views["global"] == (1, 1024, 16)
    else:
        assert list(views) == ["global"]


def test_bad_cases_are_refused():
    with pytest.raises(HarnessError, match="does not crop"):
        compose.resolve(compose.Case("base", (2, 3)), ModelConfig())
    with pytest.raises(HarnessError, match="COLSxROWS"):
        compose.parse_grid("2by3")
    with pytest.raises(HarnessError, match="routing counts"):
        workload_costs("base", routing={"prefill": np.ones((12, 64), dtype=np.int64)})


# -------------------------------------------------------------------------------- conventions

def test_useful_and_tensor_conventions():
    L = ModelConfig().llm
    df = workload_costs("base")
    pre = df[(df.stage == "prefill") & (df.family == "llm_attention")].iloc[0]
    S = 286
    masked_pairs = S * S - S * (S + 1) // 2
    assert pre.flops_counted - pre.flops_useful == 4 * L.num_heads * L.head_dim * masked_pairs * L.num_layers
    assert pre.tensor_flops == pre.flops_useful                       # sdpa: fused, causal tiles skipped
    eager = workload_costs("base", attn_implementation="eager")
    pe = eager[(eager.stage == "prefill") & (eager.family == "llm_attention")].iloc[0]
    assert pe.tensor_flops == pe.flops_counted and pe.flops_counted == pre.flops_counted
    dec = df[(df.stage == "decode") & (df.family == "TOTAL")].iloc[0]
    assert dec.flops_useful == dec.flops_counted == dec.tensor_flops   # decode: nothing masked
    clip = df[(df.stage == "clip") & (df.family == "TOTAL")].iloc[0]
    assert clip.flops_useful == clip.flops_counted
    sam = df[df.stage == "sam"].set_index(["family", "variant"])
    assert sam.loc[("sam_attention", "window"), "flops_useful"] < sam.loc[("sam_attention", "window"), "flops_counted"]
    assert sam.loc[("sam_attention", "global"), "flops_useful"] == sam.loc[("sam_attention", "global"), "flops_counted"]
    # 64 = 4 full windows of 14 + one of 8 per side: real tokens / padded tokens
    win = F.SAMAttention(1, 64, 768, 12, 14, 14)
    assert win.geometry() == (25, 14, 196)


def test_sam_inkernel_counts_the_kernels_slots_and_no_mask():
    """sam_attention=triton (method inkernel), base mode, one view, bf16, 12 heads of 64:
    windows: 25 windows of 196 tokens; the kernel visits 4 query blocks of 64 = 256 query slots x
    7 key blocks of 2 rows x 16 slots = 224 key slots; global: 4096 x 4096 slots (query blocks of 64,
    key rows of 64: nothing masked). Bytes: the kernel reads q, k, v (3 x 196 x 768 per window) and
    rel_h, rel_w (12 heads x 196 x 28) and writes its output; no 196 x 196 mask."""
    C, nh, d = 768, 12, 64
    win = F.SAMAttention(1, 64, C, nh, 14, 14, method="inkernel").cost()
    dense = F.SAMAttention(1, 64, C, nh, 14, 14).cost()
    P = 25 * 196
    gemm, rel = 8 * P * C * C, 2 * 25 * nh * 196 * 14 * d * 2
    assert win.tensor_flops == gemm + rel + 4 * 25 * nh * 256 * 224 * d
    assert win.flops_useful == dense.flops_useful
    mask = 25 * nh * 196 * 196 * 2                                     # the dense mask, written and read
    assert dense.bytes_act_write - win.bytes_act_write == mask
    assert dense.bytes_act_read - win.bytes_act_read == mask
    glob = F.SAMAttention(1, 64, C, nh, 0, 64, method="inkernel").cost()
    aug = F.SAMAttention(1, 64, C, nh, 0, 64, method="augmented").cost()
    S = 4096
    assert glob.tensor_flops == 8 * S * C * C + 2 * nh * S * 64 * d * 2 + 4 * nh * S * S * d == glob.flops_useful
    assert aug.tensor_flops - glob.tensor_flops == 2 * nh * S * S * (192 + 64) - 4 * nh * S * S * d
    tri = workload_costs("base", cost_config(None, {"vision_impl": "fused", "sam_attention": "triton"}))
    sdpa = workload_costs("base", cost_config(None, {"vision_impl": "fused"}))
    t, a = (df[df.family == "sam_attention"].set_index("variant") for df in (tri, sdpa))
    assert t.loc["global", "tensor_flops"] == glob.tensor_flops * 4 and a.loc["global", "tensor_flops"] == aug.tensor_flops * 4
    assert t.loc["window", "tensor_flops"] == win.tensor_flops * 8 and a.loc["window", "tensor_flops"] == dense.tensor_flops * 8
    wins = workload_costs("base", cost_config(None, {"vision_impl": "fused", "sam_attention": "triton-windows"}))
    w = wins[wins.family == "sam_attention"].set_index("variant")
    assert w.loc["window", "tensor_flops"] == win.tensor_flops * 8 and w.loc["global", "tensor_flops"] == aug.tensor_flops * 4


def test_moe_weight_bytes_follow_routing_but_flops_do_not():
    assert F.expected_touched(64, 6, 1) == pytest.approx(6.0)
    assert F.expected_touched(64, 6, 286) == pytest.approx(64.0)
    case = compose.Case("tiny", text_tokens=0, decode_tokens=1)
    a = workload_costs(case)                                   # uniform-routing expectation
    S = compose.resolve(case, ModelConfig()).prefill_tokens
    counts = np.zeros((12, 64), dtype=np.int64)
    counts[1:, :6] = S                                         # measured: every token to experts 0-5
    b = workload_costs(case, routing={"prefill": counts})
    ra = a[(a.stage == "prefill") & (a.family == "moe_routed")].iloc[0]
    rb = b[(b.stage == "prefill") & (b.family == "moe_routed")].iloc[0]
    assert ra.flops_counted == rb.flops_counted
    assert rb.bytes_weights == 11 * 6 * 3 * 1280 * 896 * 2
    assert ra.bytes_weights > rb.bytes_weights


def test_per_step_rows_sum_to_the_aggregate():
    agg = workload_costs(compose.Case("small", decode_tokens=6))
    per = workload_costs(compose.Case("small", decode_tokens=6), per_step=True)
    dec = per[(per.stage == "decode") & (per.family != "TOTAL")]
    assert sorted(dec.step.unique()) == list(range(5))
    assert sorted(dec.cache_len.unique()) == [124, 125, 126, 127, 128]
    ta, tp = stage_totals(agg)["decode"], stage_totals(per)["decode"]
    for col in ("flops_counted", "flops_useful", "tensor_flops", "vector_flops", "params"):
        assert ta[col] == tp[col]
    assert ta["bytes"] == pytest.approx(tp["bytes"])


# ---------------------------------------------------------------------- exactness (counted)

def test_counted_equals_analytic_full_size_on_meta(meta_model):
    cases = [compose.Case("base", decode_tokens=3), compose.Case("gundam", (2, 3), decode_tokens=3)]
    df = check.check_cases(cases, ModelConfig(), "meta", model=meta_model)
    assert (df["diff"] == 0).all(), check.format_table(df)
    assert (df[df.stage != "(outside stages)"]["counted"] > 0).all()
    g = df[(df.case == "gundam-2x3")].set_index("stage")
    assert g.loc["sam", "calls"] == 2 and g.loc["decode", "calls"] == 2
    assert g.loc["sam", "counted"] == sam_counted_flops(6, 640) + sam_counted_flops(1, 1024)   # 6 tiles + global


def sam_counted_flops(views: int, size: int, C=768, heads=12, mlp=3072, window=14, depth=12, glob=4, p=16) -> int:
    """SAM ViT-B FLOPs of ``views`` size x size views by FlopCounterMode's convention (2 per MAC;
    windowed blocks pad the grid to a multiple of the window; the decomposed rel-pos einsums count)."""
    g, d = size // p, C // heads
    flops = 2 * views * g * g * C * 3 * p * p                          # patch-embed conv
    for count, windowed in ((depth - glob, True), (glob, False)):
        if windowed:
            padded = -(-g // window) * window
            batches, side = views * (padded // window) ** 2, window
        else:
            batches, side = views, g
        n = side * side                                                # tokens per window
        qkv_proj = 2 * batches * n * C * (3 * C) + 2 * batches * n * C * C
        rel_pos = 2 * (2 * batches * heads * n * side * d)               # rel_h and rel_w einsums
        sdpa = 2 * (2 * batches * heads * n * n * d)                     # QK^T and PV
        flops += count * (qkv_proj + rel_pos + sdpa)
    flops += depth * 2 * (2 * views * g * g * C * mlp)                 # MLP up and down
    flops += 2 * views * g * g * C * 256 + 2 * views * g * g * 256 * 256 * 9          # neck convs
    flops += 2 * views * (g // 2) ** 2 * 256 * 512 * 9 + 2 * views * (g // 4) ** 2 * 512 * 1024 * 9   # net_2, net_3
    return flops


def test_counted_equals_analytic_tiny_on_cpu_with_real_routing(tiny_cfg):
    cases = [compose.Case(TINY_CROP, (2, 3), decode_tokens=4), compose.Case(TINY_NOCROP, decode_tokens=3),
             compose.Case(TINY_CROP, (1, 1), decode_tokens=2, batch=2)]
    df = check.check_cases(cases[1:], tiny_cfg, "cpu")
    assert (df["diff"] == 0).all(), check.format_table(df)
    counted, by_view, outside, routing = check.count_case(cases[0], tiny_cfg, "cpu")
    assert outside == 0
    analytic = stage_totals(workload_costs(cases[0], tiny_cfg))
    assert counted == {st: analytic[st]["flops_counted"] for st in compose.STAGES}
    assert by_view[("sam", 0)] > 0 and by_view[("sam", 1)] > 0      # tiles, then the global view
    pre = routing["prefill"]
    S = compose.resolve(cases[0], tiny_cfg).prefill_tokens
    k = tiny_cfg.llm.num_experts_per_tok
    assert (pre[1:].sum(axis=1) == S * k).all() and (pre[0] == 0).all()
    # measured counts feed the weight bytes; FLOPs are unchanged
    measured = workload_costs(cases[0], tiny_cfg, routing=routing)
    uniform = workload_costs(cases[0], tiny_cfg)
    m, u = stage_totals(measured), stage_totals(uniform)
    assert m["prefill"]["flops_counted"] == u["prefill"]["flops_counted"] == counted["prefill"]
    row = measured[(measured.stage == "prefill") & (measured.family == "moe_routed")].iloc[0]
    per_expert = 3 * tiny_cfg.llm.hidden_size * tiny_cfg.llm.moe_intermediate_size * 2
    assert row.bytes_weights == np.count_nonzero(pre[1:]) * per_expert


def test_uniform_routing_restores_the_vendor_loop(tiny_cfg):
    from harness.models.build import build_model
    from harness.models.llm import MoE

    model = build_model(tiny_cfg, device="meta")
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    with check.uniform_routing(model):
        assert moes and all(m.uniform_counts for m in moes)
    assert not any(m.uniform_counts for m in moes)


# -------------------------------------------------------------------------------- outputs

def test_analyze_writes_the_report_without_a_model(tmp_path, monkeypatch):
    from harness.models import build

    def no_model(*a, **k):
        raise AssertionError("analyze built a model")
    monkeypatch.setattr(build, "build_model", no_model)        # analytic only: no weights, no model
    paths = analyze(["tiny", "small", "base", "large", "gundam"], tmp_path)
    doc = json.loads(paths["json"].read_text())
    assert [c["name"] for c in doc["cases"]] == ["tiny", "small", "base", "large", "gundam-2x3"]
    for c in doc["cases"]:
        assert set(c) >= {"name", "mode", "grid", "image_tokens", "prefill_tokens", "decode_tokens", "stages"}
        assert list(c["stages"]) == ["sam", "clip", "projector", "prefill", "decode"]
        for st in c["stages"].values():
            assert set(st) == {"flops_counted", "flops_useful", "tensor_flops", "vector_flops", "bytes", "params"}
            assert all(isinstance(v, int) for v in st.values())
    g = doc["cases"][4]
    assert g["grid"] == [2, 3] and g["image_tokens"] == 903 and g["prefill_tokens"] == 916
    assert doc["cases"][0]["grid"] is None
    assert doc["anchors"]["activated_params_per_token"] == 574_127_360
    md = paths["md"].read_text()
    assert "## Sweep: modes and gundam grids" in md and "gundam-3x3" in md
    import pandas as pd

    sweep = pd.read_csv(paths["sweep_csv"])
    assert len(sweep) == 5 + 22                       # five modes + every gundam grid of 2..9 tiles
    full = pd.read_csv(paths["csv"])
    assert list(full.columns) == compose.COLUMNS


def test_module_entry_with_check(tmp_path, capsys):
    from harness.analytic.__main__ import main

    rc = main(["--modes", "tiny", "--decode-tokens", "2", "--out", str(tmp_path), "--check", "--no-sweep"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "| tiny | prefill | 1 |" in out and "0 with a non-zero difference" in out
    assert (tmp_path / "static_compute.json").exists()


def test_generated_docs_are_committed_and_current():
    rendered = docs.render_all()
    for rel, text in rendered.items():
        path = ROOT / "docs" / rel
        assert path.exists(), f"{path} missing: run python -m harness.analytic.docs"
        assert path.read_text() == text, f"{path} is stale: run python -m harness.analytic.docs"
    assert {p.stem for p in (ROOT / "docs" / "formulations").glob("*.md")} - {"README"} == set(F.FAMILY_BY_NAME)


def test_prefill_logits_last_counts_one_lm_head_row_per_page():
    """execution.prefill_logits=last: the prefill's lm_head on B rows instead of B x S (base mode, 2 pages of
    S = 1 BOS + 12 text + 273 image tokens = 286): 2 h V FLOPs per row fewer, h = 1280, V = 129,280."""
    case = compose.Case("base", batch=2, text_tokens=12, decode_tokens=1)
    every = workload_costs(case, cost_config(None, {}))
    last = workload_costs(case, cost_config(None, {"prefill_logits": "last"}))
    head = [df[(df.stage == "prefill") & (df.family == "lm_head")].iloc[0] for df in (every, last)]
    assert head[0].flops_useful == 2 * (2 * 286) * 1280 * 129_280
    assert head[1].flops_useful == 2 * 2 * 1280 * 129_280
    no_head = ModelConfig(lm_head_all_positions=False)            # the model's own switch counts the same
    assert workload_costs(case, cost_config(no_head, {})).equals(last)
