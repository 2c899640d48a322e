"""Kernels of a replayed or compiled decode step attributed to modules by alignment (issue 24).

Recorded sequences in tests/data/alignment/ (README there); every expected attribution and figure
below is derived by hand from those files."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from harness.measure.alignment import align, aligned_fraction, attribute_steps, name_key
from harness.report.columns import COLUMNS
from harness.report.step_modules import GROUPS, TOTAL, UNATTRIBUTED, step_module_rows

DATA = Path(__file__).parent / "data" / "alignment"


def _fixture():
    ref = pd.read_csv(DATA / "reference_step.csv", dtype=str).fillna("")
    kern = pd.read_csv(DATA / "replay_kernels.csv", dtype={"module": str, "family": str, "op_group": str})
    return ref, kern


def test_name_key_drops_inductor_numbering_only():
    assert name_key("gemv_kernel_0") == "gemv_kernel" == name_key("gemv_kernel")
    assert name_key("triton_poi_fused_add_12_3") == "triton_poi_fused_add"
    assert name_key("sm90_xmma_gemm_bf16_128x64") == "sm90_xmma_gemm_bf16_128x64"   # no _<digits> at the end
    assert name_key("aten::linear") == "aten::linear"


def test_align_same_graph_one_to_one_else_matching_blocks():
    ref = ["a", "b", "c", "d", "e"]
    assert align(ref, ref) == [0, 1, 2, 3, 4]
    # inserted x at the front, c and d fused into y, e renamed e_0 (inductor suffix): the blocks [a, b] and [e]
    assert align(["x", "a", "b", "y", "e_0"], ref) == [None, 0, 1, None, 4]
    # a removed kernel leaves no hole in the replay: [a, b] and [d, e] match around it
    assert align(["a", "b", "d", "e"], ref) == [0, 1, 3, 4]
    assert align([], ref) == [] and align(["a"], []) == [None]


def test_recorded_replay_attributed_kernel_for_kernel():
    ref, kern = _fixture()
    out = attribute_steps(kern, ref)
    assert out.loc[0, "attribution"] == "name" and pd.isna(out.loc[0, "module"])   # the prefill kernel untouched
    steps = out[out["range"] == "decode_step"].sort_values(["step", "start_ms"])
    s0, s1 = steps[steps["step"] == 0], steps[steps["step"] == 1]
    # step 0 replays the same graph: the reference's labels in order (GPU start order, not file order)
    assert list(s0["module"].fillna("")) == list(ref["module"])
    assert list(s0["family"].fillna("")) == list(ref["family"]) and (s0["attribution"] == "aligned").all()
    # step 1 (compiled): reference [embed, rms, qkv, split, combine, o_proj] match the replay's kernels 1-6
    # (6, the longest block), then [gate, router, routed, final rms, lm_head] its kernels 8-12; the token copy
    # (0), the fused add + norm (7) and the fused argmax (13) have no counterpart
    want = [None, "model.embed_tokens", "model.layers.0.input_layernorm"] + ["model.layers.0.self_attn"] * 3 + [
        "model.layers.0.self_attn.o_proj", None, "model.layers.0.mlp.gate", "model.layers.0.mlp.gate",
        "model.layers.0.mlp", "model.norm", "lm_head", None]
    assert [m if isinstance(m, str) else None for m in s1["module"]] == want
    assert list(s1["attribution"]) == ["unattributed" if m is None else "aligned" for m in want]
    assert list(s1["op_group"].fillna("")) == ["", "memory/routing", "norm", "matmul", "matmul", "matmul", "matmul",
                                               "", "matmul", "matmul", "routing/indexing", "norm", "matmul", ""]
    hit = aligned_fraction(out)
    assert (hit.kernels, hit.aligned) == (28, 25) and hit.fraction == pytest.approx(25 / 28)
    # kernel time: step 0 all 100 µs, step 1 100 - 1 (copy) - 3 (fused norm) - 5 (argmax) = 91 µs
    assert hit.time_fraction == pytest.approx(191 / 200)


def _analytic() -> pd.DataFrame:
    """Decode bytes of the fixture's case over its 2 decode steps (per step: attention 9.5 MB, norms
    15 MB, lm_head 30 MB, routed 8 + shared 2 MB, router 1 MB, embedding 0.5 MB, RoPE 0.2 MB)."""
    per_step = {"llm_attention": 9.5e6, "rmsnorm": 15e6, "lm_head": 30e6, "moe_routed": 8e6, "moe_shared": 2e6,
                "moe_gate": 1e6, "embedding": 0.5e6, "rope": 0.2e6}
    rows = [{"case": "c", "stage": "decode", "family": f, "bytes": 2 * b} for f, b in per_step.items()]
    rows += [{"case": "c", "stage": "decode", "family": "TOTAL", "bytes": 2 * sum(per_step.values())},
             {"case": "c", "stage": "prefill", "family": "lm_head", "bytes": 1e9}]
    return pd.DataFrame(rows)


def test_step_module_table_from_the_recorded_replay():
    ref, kern = _fixture()
    rows = {r["module_group"]: r for r in step_module_rows(attribute_steps(kern, ref), _analytic(), "c", 2, 1000.0)}
    # 1000 GB/s = 1e6 B per µs: the floor in µs is the bytes per step / 1e6
    att = rows["attention"]     # qkv 5 + split 8 + combine 2 + o_proj 4 = 19 µs in both steps
    assert (att["launches_step"], att["busy_us_step"]) == (4, pytest.approx(19))
    assert att["mb_step"] == 9.5e6 and att["bw_floor_us"] == pytest.approx(9.5)
    assert att["floor_share"] == pytest.approx(0.5) and att["above_floor_us"] == pytest.approx(9.5)
    assert att["gbs_busy"] == pytest.approx(500) and att["attributed_by"] == "aligned"
    core = rows["· decode attention (RoPE, KV write, SDPA; fused q/k/v)"]
    assert (core["launches_step"], core["busy_us_step"], core["mb_step"]) == (3, pytest.approx(15), None)
    assert rows["· o_proj"]["busy_us_step"] == pytest.approx(4) and "· q/k/v projections" not in rows
    # norms: step 0 three kernels (9 µs), step 1 two (6 µs: the post-attention one fused away) -> 2.5, 7.5 µs;
    # 15 MB per step needs 15 µs at the floor: above 100%, flagged, no µs above the floor
    norms = rows["norms (RMSNorm)"]
    assert (norms["launches_step"], norms["busy_us_step"]) == (2.5, pytest.approx(7.5))
    assert norms["floor_share"] == pytest.approx(2.0) and norms["above_floor_us"] is None
    assert COLUMNS["floor_share"].cell(norms).startswith("above the ceiling")
    lm = rows["lm_head"]
    assert lm["floor_share"] == pytest.approx(0.75) and lm["above_floor_us"] == pytest.approx(10)
    exp = rows["experts: routed + shared (+ MoE routing)"]      # routed rows 20 µs against 8 + 2 MB
    assert exp["busy_us_step"] == pytest.approx(20) and exp["floor_share"] == pytest.approx(0.5)
    assert rows["RoPE tables"]["busy_us_step"] == 0 and rows["RoPE tables"]["floor_share"] is None
    # unattributed: step 1's copy 1 + fused norm 3 + argmax 5 = 9 µs over 2 steps; glue and argmax only in step 0
    un = rows[UNATTRIBUTED]
    assert (un["launches_step"], un["busy_us_step"], un["attributed_by"]) == (1.5, pytest.approx(4.5), "unattributed")
    assert rows["layer glue (residual adds)"]["busy_us_step"] == pytest.approx(0.5)
    assert rows["outside modules (token pick, position)"]["busy_us_step"] == pytest.approx(2.5)
    tot = rows[TOTAL]                 # 100 µs per step, 66.2 MB per step
    assert (tot["launches_step"], tot["busy_us_step"]) == (14, pytest.approx(100))
    assert tot["mb_step"] == pytest.approx(66.2e6) and tot["floor_share"] == pytest.approx(0.662)
    assert tot["above_floor_us"] == pytest.approx(33.8)
    # the top-level groups partition the step's kernels: their launches add up to the step's
    top = [r for label, r in rows.items() if not label.startswith("·") and label != TOTAL]
    assert sum(r["launches_step"] for r in top) == 14
    assert step_module_rows(kern, _analytic(), "c", 2, None)[-1]["bw_floor_us"] is None   # unknown device


def test_groups_cover_every_decode_family():
    from harness.analytic import workload_costs
    from harness.layout import Case

    df = workload_costs(Case("base", decode_tokens=3))
    fams = set(df[(df["stage"] == "decode") & (df["family"] != "TOTAL")]["family"])
    held = [f for g in GROUPS if not g.parent for f in g.families]
    assert fams <= set(held) and len(held) == len(set(held))


# ----------------------------------------------------------------------------- end to end (CPU)

def _static_grouped_case(monkeypatch, hooks: bool):
    """The tiny model, kv_cache=static moe_impl=grouped, one timed repeat and the profiled request;
    ``hooks`` False pretends module hooks cannot run (as for a graphed or compiled step)."""
    from conftest import TINY_MODE, load_tiny_cfg

    from harness import knobs, variants
    from harness import workload as wl
    from harness.config import ExecutionConfig
    from harness.measure.runner import MeasureConfig, measure_case
    from harness.models.build import build_model

    dev = torch.device("cpu")
    model = build_model(load_tiny_cfg(), dev, torch.float32, seed=0)
    variants.apply(model, ExecutionConfig(kv_cache="static", moe_impl="grouped"), dev)
    if not hooks:
        monkeypatch.setattr(knobs, "allows_module_hooks", lambda execution: False)
    pages = [wl.Page("p", wl.synthetic_page(0, size=(300, 200)), "synthetic:0")]

    def make(i):
        return wl.build_request(pages, TINY_MODE, decode_tokens=4).to(dev, torch.float32)

    got = measure_case(model, make, MeasureConfig(warmup=0, repeats=1, kernels=True),
                       {"case": "t", "mode": "t", "grid": None, "batch": 1}, False, progress=lambda m: None)
    k = got.kernels
    return k[k["range"] == "decode_step"].sort_values(["step", "start_ms"], kind="stable").reset_index(drop=True), k


def test_aligned_attribution_equals_the_hooked_one_on_the_tiny_model(monkeypatch):
    hooked, _ = _static_grouped_case(monkeypatch, hooks=True)
    aligned, every = _static_grouped_case(monkeypatch, hooks=False)
    assert len(hooked) and list(hooked["name"]) == list(aligned["name"])
    assert set(hooked["attribution"]) == {"hooks"} and set(aligned["attribution"]) == {"aligned"}
    for col in ("module", "family", "op_group"):
        assert list(hooked[col].fillna("")) == list(aligned[col].fillna("")), col
    assert {"rmsnorm", "llm_attention", "moe_gate", "moe_shared", "lm_head"} <= set(aligned["family"].dropna())
    # outside the decode steps nothing is guessed: the other stages keep name-only kernels
    assert set(every.loc[every["range"] != "decode_step", "attribution"]) == {"name"}


def test_run_report_has_the_step_table_of_an_aligned_case(tmp_path, monkeypatch, cache):
    """The run verb (tiny model, CPU, alignment forced): kernels.csv says how each kernel was attributed
    and report.md has the per-module table of the aligned case, the same when written from the files."""
    from hydra import compose, initialize_config_dir

    from harness import knobs
    from harness.config import to_config
    from harness.report.report import write_report
    from harness.run import run

    monkeypatch.setattr(knobs, "allows_module_hooks", lambda execution: False)
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = compose("config", overrides=[
            "model=tiny", "workload.decode_tokens=3", "measure.repeats=1", "measure.kernels=true",
            "hardware.calibrate=false", "cases=[{name: sg, mode: {name: t, base_size: 128, image_size: 64, crop: "
            "false}, execution: {kv_cache: static, moe_impl: grouped}}]"])
    rd = run(to_config(cfg), tmp_path / "run", progress=lambda *_: None)
    k = pd.read_csv(rd.path / "kernels.csv")
    dec = k[k["range"] == "decode_step"]
    assert len(dec) and set(dec["attribution"]) == {"aligned"} and set(k["attribution"]) == {"aligned", "name"}
    md = (rd.path / "report.md").read_text()
    section = md.split("## Inside the decode step: per module, against the bandwidth floor")[1].split("\n## ")[0]
    assert "### sg: static KV + grouped MoE (torch)" in section
    launches = dec.groupby("step").size()
    assert launches.nunique() == 1       # every step the same kernels: the table's total is that count
    total = [ln for ln in section.splitlines() if ln.startswith(f"| {TOTAL} |")]
    assert len(total) == 1 and f"| aligned | {launches.iloc[0]:,.1f} |" in total[0]
    assert f"Aligned: {len(dec):,} of {len(dec):,} decode-step kernels (100.0%)" in section
    write_report(rd.path, strict=True)
    assert section in (rd.path / "report.md").read_text()


def test_op_families_group_each_stage_by_what_it_has():
    """A prefill run without hooks (names only) beside a decode step attributed by alignment: prefill by
    kernel-name category, decode by module, its unattributed kernel by its category's group."""
    from harness.roofline.ops import join_op_families
    from harness.roofline.specs import resolve_peaks

    peaks = resolve_peaks("virtual", "bf16", {"peak_tflops": 100, "mem_bw_gbs": 1000})
    row = {"case": "c"}
    k = pd.DataFrame([
        {**row, "stage": "prefill", "category": "gemm", "op_group": None, "start_ms": 0.0, "dur_ms": 1.0},
        {**row, "stage": "prefill", "category": "norm", "op_group": None, "start_ms": 2.0, "dur_ms": 0.5},
        {**row, "stage": "decode", "category": "gemm", "op_group": "matmul", "start_ms": 3.0, "dur_ms": 0.25},
        {**row, "stage": "decode", "category": "norm", "op_group": None, "start_ms": 4.0, "dur_ms": 0.125},
        {**row, "stage": "decode", "category": "activation/elementwise", "op_group": "norm", "start_ms": 5.0,
         "dur_ms": 0.5}])
    base = {"case": "c", "variant": "", "tensor_flops": 1e9, "flops_useful": 1e9, "flops_counted": 1e9,
            "vector_flops": 0.0, "bytes": 1e6, "bytes_weights": 1e6, "bytes_kv_read": 0.0, "bytes_kv_write": 0.0,
            "routing": "measured"}
    a = pd.DataFrame([{**base, "stage": s, "family": f} for s in ("prefill", "decode")
                      for f in ("llm_attention", "rmsnorm")])
    op = join_op_families(k, a, peaks).set_index(["stage", "op_family"])
    assert set(op.loc["prefill", "attribution"]) == {"kernel name"}
    assert op.loc[("prefill", "norm"), "kernel_busy_ms"] == pytest.approx(0.5)
    assert set(op.loc["decode", "attribution"]) == {"module"}
    # decode norm: the module-attributed elementwise kernel (0.5) and the unattributed norm kernel (0.125)
    assert op.loc[("decode", "norm"), "kernel_busy_ms"] == pytest.approx(0.625)
    assert op.loc[("decode", "matmul"), "kernel_busy_ms"] == pytest.approx(0.25)


def test_overlap_is_what_the_top_level_groups_add_beyond_the_step():
    """Group busy times that overlap (PDL): 156.1 + 21.8 + 57.1 + 214.0 + 83.8 = 532.8 µs of top-level
    rows (the sub-row left out) against 438.5 for the step: 94.3 µs shared; within 1% of the step: None."""
    from harness.report.step_modules import overlap_us

    rows = [{"module_group": g, "busy_us_step": us} for g, us in [
        ("attention", 156.1), ("· decode attention (RoPE, KV write, SDPA; fused q/k/v)", 156.1),
        ("dense MLP (layer 0)", 21.8), ("router (MoE gate)", 57.1), ("experts: routed + shared (+ MoE routing)", 214.0),
        ("lm_head", 83.8), (UNATTRIBUTED, 0.0), (TOTAL, 438.5)]]
    assert overlap_us(rows) == pytest.approx(94.3)
    rows[0]["busy_us_step"] = 66.1                           # 442.8: 4.3 µs over, under 1% of 438.5
    assert overlap_us(rows) is None
