"""``python -m harness bench TARGET`` (issue 38): the verb's dispatch and config, the refusal of a GPU
target on a CPU (one line, exit 2, no run directory), the targets' CPU modes writing their run
directories through the column registry, and the pieces of the GPU targets that run anywhere."""
from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from conftest import main_lines, needs_triton
from harness.bench import config as bc
from harness.errors import HarnessError

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def _run_dir(root):
    dirs = [d for d in root.iterdir() if d.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0], json.loads((dirs[0] / "manifest.json").read_text())


# ------------------------------------------------------------------------------ dispatch, config

def test_the_target_becomes_the_bench_group():
    assert bc.bench_args(["moe", "bench.moe.reps=3"]) == ["+bench=moe", "bench.moe.reps=3"]
    for args in ([], ["bench.moe.reps=3"], ["-m"]):
        with pytest.raises(HarnessError, match="bench needs a target"):
            bc.bench_args(args)
    with pytest.raises(HarnessError, match="unknown bench target 'decode'; fix: use one of decode_step, "):
        bc.bench_args(["decode"])


def test_every_target_has_its_group_file_options_and_module(repo_root):
    import importlib

    assert {p.stem for p in (repo_root / "src/harness/conf/bench").glob("*.yaml")} == set(bc.TARGETS)
    assert set(bc.GPU_ONLY) < set(bc.TARGETS)
    for target in bc.TARGETS:
        assert callable(importlib.import_module(f"harness.bench.{target}").run), target


def test_the_group_selects_the_target_and_its_defaults():
    from harness.cli import check_overrides

    cfg = check_overrides(["+bench=moe", "bench.moe.tokens=[1,2]", "bench.moe.sweep=rows"], verb="analyze")
    assert cfg.experiment_name == "bench-moe" and cfg.bench.target == "moe"
    assert bc.options(cfg.bench) == bc.MoEBench(tokens=[1, 2], sweep="rows")
    assert cfg.bench.attention is None and cfg.bench.decode_step is None


def test_a_bench_target_without_a_name_or_unknown_is_one_line(capsys, tmp_path):
    rc, err = main_lines(capsys, ["bench", f"run.root={tmp_path}"])
    assert rc == 2 and err == [f"error: bench needs a target; fix: python -m harness bench TARGET [overrides], TARGET "
                               f"one of {', '.join(bc.TARGETS)}"]
    rc, err = main_lines(capsys, ["bench", "nope", f"run.root={tmp_path}"])
    assert rc == 2 and err == [f"error: unknown bench target 'nope'; fix: use one of {', '.join(bc.TARGETS)}"]
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("override, line", [
    ("bench.moe.reps=0", "error: bench.moe.reps=0 is below its minimum 1; fix: set bench.moe.reps to 1 or more"),
    ("bench.moe.sweep=cols", "error: bench.moe.sweep='cols' is not one of rows, blocks; fix: set "
                             "bench.moe.sweep to one of rows, blocks"),
    ("bench.moe.routing=skewed", "error: bench.moe.routing='skewed' is not one of gate, balanced; fix: set "
                                 "bench.moe.routing to one of gate, balanced"),
    ("bench.moe.shared=true", "error: bench.moe.shared=true folds the shared expert into a sweep's kernels only; "
                              "fix: add bench.moe.sweep=rows or blocks, or drop bench.moe.shared"),
    ("bench.moe.tokens=[]", "error: bench.moe.tokens=[] is not a list of sizes >= 1; fix: write it like "
                            "bench.moe.tokens=[1,8]"),
])
def test_options_are_checked_before_anything_runs(capsys, tmp_path, override, line):
    rc, err = main_lines(capsys, ["bench", "moe", override, f"run.root={tmp_path}"])
    assert rc == 2 and err == [line]
    assert not any(tmp_path.iterdir())


def test_a_cache_too_short_for_the_rounds_is_refused():
    opts = bc.BenchConfig(target="decode_step", decode_step=bc.DecodeStepBench(cache_len=400))
    with pytest.raises(HarnessError, match=r"cache_len=400 is shorter than pos \+ reps \(486\); fix: raise "
                                           r"bench.decode_step.cache_len to 486"):
        bc.check_options(opts)


# ------------------------------------------------------------------------------ refusal on a CPU

@CPU_ONLY
@pytest.mark.parametrize("target", bc.GPU_ONLY)
def test_a_gpu_target_is_refused_on_a_cpu(capsys, tmp_path, target):
    rc, err = main_lines(capsys, ["bench", target, f"run.root={tmp_path}"])
    assert rc == 2 and err == [f"error: bench {target} times GPU kernels and has no CPU mode; this machine has no "
                               "CUDA device; fix: run it on a machine with an NVIDIA GPU (device=auto or device=cuda)"]
    assert not any(tmp_path.iterdir())


def test_device_cpu_is_named_in_the_refusal(capsys, tmp_path):
    rc, err = main_lines(capsys, ["bench", "attention", "device=cpu", f"run.root={tmp_path}"])
    assert rc == 2 and err[0].startswith("error: bench attention times GPU kernels and has no CPU mode; device=cpu "
                                         "was given; fix:")


@CPU_ONLY
def test_a_cpu_mode_needs_its_switch(capsys, tmp_path, monkeypatch):
    rc, err = main_lines(capsys, ["bench", "sam_attention", f"run.root={tmp_path}"])
    assert rc == 2 and err == ["error: bench sam_attention times GPU kernels; this machine has no CUDA device; fix: "
                               "run it on a GPU machine, or add bench.sam_attention.smoke=true to check its plumbing "
                               "on the CPU (tiny cases, fp32: the times mean nothing)"]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    rc, err = main_lines(capsys, ["bench", "decode_step_diag", f"run.root={tmp_path}"])
    assert rc == 2 and "in Triton's interpreter: TRITON_INTERPRET=1 python -m harness bench decode_step_diag " \
                       "model=tiny" in err[0]
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------------------ the CPU modes

@CPU_ONLY
def test_sam_attention_smoke_writes_its_run_directory(capsys, tmp_path):
    from harness.bench.sam_attention import COLUMNS

    rc, err = main_lines(capsys, ["bench", "sam_attention", "bench.sam_attention.smoke=true",
                                  "bench.sam_attention.reps=2", "bench.sam_attention.warmup=0",
                                  "bench.sam_attention.compiled=true", f"run.root={tmp_path}"])
    assert rc == 0, err
    run, manifest = _run_dir(tmp_path)
    assert run.name.endswith("-bench-sam_attention") and manifest["status"] == "complete"
    assert manifest["bench"] == {"target": "sam_attention", "tables": ["sam_attention.csv"], "failures": []}
    assert manifest["config"]["bench"]["sam_attention"]["smoke"] is True and "revision" in manifest["git"]
    rows = pd.read_csv(run / "sam_attention.csv")
    assert list(rows.columns) == COLUMNS
    # per case on a CPU: the dense path and SDPA's flash backend (efficient and cuDNN need CUDA; the v128
    # row only where d' = 64 + H + W exceeds 128: 80 and 96 here)
    methods = ["dense full", "dense kernel", "aug[flash] full", "aug[flash] kernel"]
    assert rows.groupby("case", sort=False)["method"].apply(list).to_dict() == {"smoke_global": methods,
                                                                                 "smoke_window": methods}
    assert (rows.loc[rows.method == "dense full", "x_dense"] == 1.0).all()
    assert (rows["rel_err"] < 1e-5).all()          # fp32 against the fp32 dense reference
    report = (run / "report.md").read_text()
    assert "| case | method | ran as | per call ms (measured, median) | p25 ms (measured) |" in report
    assert "skipped: smoke_global aug[efficient] (d_qk=80): backend 'efficient' needs a CUDA device" in report
    assert "skipped: smoke_window compiled rows: they need CUDA (inductor's GPU code)" in report


@needs_triton
@CPU_ONLY
def test_decode_step_diag_runs_the_tiny_model_in_the_interpreter(capsys, tmp_path):
    rc, err = main_lines(capsys, ["bench", "decode_step_diag", "model=tiny", "model.llm.vocab_size=1024",
                                  "device=cpu", "bench.decode_step_diag.prompt=6",
                                  "bench.decode_step_diag.cache_len=16", "bench.decode_step_diag.greedy=2",
                                  f"run.root={tmp_path}"])
    assert rc == 0, err
    run, manifest = _run_dir(tmp_path)
    rows = pd.read_csv(run / "diag.csv", dtype={"layer": str})
    # layer 0 (dense): 9 intermediates (no router); layers 1-2 (MoE): 12; then final_norm and logits
    assert len(rows) == 9 + 2 * 12 + 2
    assert rows[["layer", "intermediate"]].iloc[-1].tolist() == ["end", "logits"]
    n = rows.set_index(["layer", "intermediate"])["fused_n"]
    assert (n["0", "q"], n["end", "logits"]) == (64, 1024)      # 4 heads x 16 (hidden 64); the vocabulary
    report = (run / "report.md").read_text()
    assert "RoPE table row at position 6 against the reference's cos/sin: 0 cos and 0 sin entries differ" in report
    assert "greedy: " in report and manifest["bench"]["failures"] == []


def test_a_failed_check_exits_1_after_the_run_directory_is_complete(capsys, tmp_path, monkeypatch):
    from harness.bench import sam_attention

    monkeypatch.setattr(sam_attention, "run", lambda cfg, opts, device, report: report.fail("kernel k: broke"))
    rc, err = main_lines(capsys, ["bench", "sam_attention", "bench.sam_attention.smoke=true", "device=cpu",
                                  f"run.root={tmp_path}"])
    run, manifest = _run_dir(tmp_path)
    assert rc == 1 and err == [f"failed: bench sam_attention: kernel k: broke (run directory {run})"]
    assert manifest["status"] == "complete" and manifest["bench"]["failures"] == ["kernel k: broke"]


# ------------------------------------------------------------------------------ shared pieces

def test_a_table_writes_through_the_column_registry():
    from harness.bench.verb import BenchReport

    report = BenchReport(progress=lambda line: None)
    table = report.table("steps", "the step", ["step", "us_step", "mbu_sheet"])
    table.add(step="fused (graph)", us_step=512.345, mbu_sheet=0.5551)
    report.note("a note")
    assert report.markdown("bench x").splitlines() == [
        "# bench x", "", "## the step", "",
        "| step | step µs (measured, CUDA events, median of rounds) | MBU (derived, GB/s / datasheet) |",
        "|---|---:|---:|", "| fused (graph) | 512.3 | 55.5% |", "", "a note"]
    with pytest.raises(KeyError, match="no column"):
        table.add(step="x", ms=1)
    with pytest.raises(KeyError, match="not in harness.report.columns.COLUMNS"):
        report.table("t", "t", ["no_such_column"])


def test_event_ms_on_the_host_clock_and_quantiles():
    from harness.bench.timing import event_ms, first_line, quantile

    calls = []
    ms = event_ms(lambda: calls.append(1), reps=4, warmup=2, cuda=False)
    assert len(calls) == 6 and len(ms) == 4 and min(ms) >= 0
    assert quantile([5, 1, 4, 2, 3], 0.9) == 4 and quantile([5, 1, 4, 2, 3], 0.1) == 1   # ranks 3 and 0
    assert first_line(RuntimeError("a\nb")) == "RuntimeError: b"


def test_union_of_kernel_intervals():
    from harness.bench.decode_step import union_us

    assert union_us([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0     # [0, 3] and [5, 6]


def test_named_executions_of_the_decode_step_rows():
    from harness import variants
    from harness.bench.decode_step_state import NOT_DECODE, decode_execution
    from harness.variants.base import CannotRunHere
    from harness.bench.verb import named_execution
    from harness.cli import check_overrides

    cfg = check_overrides(["+bench=decode_step"], verb="analyze")
    assert set(cfg.executions) == {"best", "best-fused"}
    best = decode_execution(cfg, "best", pdl=True)      # the decode knobs; prefill and vision at their defaults
    assert (best.compile, best.decode_step, best.prefill_graphs, best.vision_impl, best.vision_compile) == \
        (True, "modules", False, "vendor", False)
    fused = decode_execution(cfg, "best-fused", pdl=False)
    assert (fused.compile, fused.decode_step, fused.pdl) == (False, "fused", False)
    assert set(NOT_DECODE) == {"prefill_graphs", "prefill_compile", "prefill_logits", "vision_impl", "sam_attention",
                               "vision_compile"}                 # the knobs that change only the prefill or vision
    for ex in (best, fused):       # no prefill or vision knob left that needs one set back (sam_attention=triton
        assert (ex.sam_attention, ex.prefill_compile, ex.prefill_logits) == ("sdpa", False, "all")  # needs fused vision)
        try:                       # the knobs' own rules hold; only this machine may lack what they need
            variants.check(ex, torch.device("cuda"), torch.bfloat16)
        except CannotRunHere:
            pass
    assert named_execution(cfg, "best-fused").pdl is True
    with pytest.raises(HarnessError, match="names the execution 'fast', which conf/bench/decode_step.yaml does not "
                                           "load"):
        named_execution(cfg, "fast")


def test_outside_tpot_reads_the_ladder_row(tmp_path):
    from harness.bench.outside_tpot import ladder_tpot

    (tmp_path / "headline.csv").write_text("case,tpot_p50_ms,tpot_mean_ms\nbest,0.75,0.76\nbest-fused,0.6,0.61\n")
    assert ladder_tpot(tmp_path, "best-fused") == (0.61, 0.6)
    assert ladder_tpot(tmp_path, "graphs") is None and ladder_tpot(tmp_path / "none", "best") is None


def test_diag_counts_ulps_by_hand():
    """bf16 1.0 is 0x3F80 and the next float up, 1 + 2^-7, is 0x3F81: one ulp apart; -1.0 (0xBF80)
    lies 2 x 0x3F80 = 32,512 ulps below 1.0. fp32 1.0 (0x3F800000) and 1 + 2^-23: one ulp. An
    element below 1/1000 of the largest |b| is left out of the ulp column, not of the counts."""
    from harness.bench import decode_step_diag as diag

    bf = lambda *v: torch.tensor(v, dtype=torch.bfloat16)  # noqa: E731
    assert diag.ordered_bits(bf(1.0, 1.0078125, -1.0)).tolist() == [0x3F80, 0x3F81, -0x3F80]
    assert diag.compare(bf(1.0078125, 2.0, -1.0), bf(1.0, 2.0, 1.0)) == {
        "max_abs": 2.0, "differ": 2, "n": 3, "max_ulp": 32512}
    f32 = torch.tensor([1.0, 2e-6]), torch.tensor([1.0 + 2 ** -23, 1e-6])
    assert diag.compare(*f32) == {"max_abs": pytest.approx(1e-6), "differ": 2, "n": 2, "max_ulp": 1}
    assert diag.compare_entry("router_ids", [1, 4, 9], [1, 5, 9])["differ"] == 1


def test_pdl_order_of_a_ptx_listing():
    from harness.bench.decode_step_sm90 import pdl_order

    ptx = "\n".join(["ld.global.b16 %rs1, [%rd1];", "ld.global.v4.b32 {%r1}, [%rd2];", "griddepcontrol.wait;",
                     "ld.global.b32 %r2, [%rd3];", "griddepcontrol.launch_dependents;"])
    assert pdl_order(ptx) == "2 of 3 before the wait; launch_dependents after it"
    assert pdl_order(ptx.replace("griddepcontrol.launch_dependents;", "")) == \
        "2 of 3 before the wait; launch_dependents NOT after it"
    assert pdl_order("ld.global.b32 %r2, [%rd3];") == "no griddepcontrol.wait"


def test_the_bare_step_clock_times_decode_steps_by_parity():
    from harness.bench.overhead import Alternating

    clock = Alternating(None, parity=1)
    for step in range(5):
        with clock("decode_step", step=step):
            pass
    with clock("prefill"):
        pass
    assert (len(clock.on), len(clock.off)) == (2, 3)     # odd steps 1, 3; even 0, 2, 4; prefill not timed


def test_vision_bench_on_cpu(capsys, tmp_path):
    """bench vision on the CPU (tiny model, 512 px views): a row per stage and batch for the execution that
    runs here, the compiled one named as not run; the projector's useful FLOPs are its one linear layer,
    2 x tokens x 64 x 64 per page with 64 tokens (512 / 16 = 32 after SAM's patches, / 2 / 2 after net_2 and
    net_3 = 8 x 8), twice that for 2 pages; each stage's kernel categories share its profiled time."""
    import pandas as pd

    from harness.bench.vision import useful_flops
    from harness.config import ModelConfig
    from harness.layout import get_mode
    from conftest import load_tiny_cfg

    rc, err = main_lines(capsys, ["bench", "vision", "model=tiny", "device=cpu", "bench.vision.batch=[1,2]",
                                  "bench.vision.mode=tiny", "bench.vision.executions=[vendor-style,best]",
                                  "bench.vision.warmup=0", "bench.vision.reps=1", f"run.root={tmp_path}"])
    assert rc in (0, None), err
    run = next(tmp_path.iterdir())
    stages = pd.read_csv(run / "vision_stages.csv")
    assert list(zip(stages["batch"], stages["stage"])) == [(1, "sam"), (1, "clip"), (1, "projector"),
                                                         (2, "sam"), (2, "clip"), (2, "projector")]
    assert set(stages["execution"]) == {"vendor-style"} and stages["mfu_sheet"].isna().all()
    assert "best: not run here" in (run / "report.md").read_text()
    cfg = load_tiny_cfg()
    assert isinstance(cfg, ModelConfig)
    assert useful_flops(cfg, get_mode("tiny"), 1)["projector"] == 2 * 64 * 64 * 64
    assert useful_flops(cfg, get_mode("tiny"), 2)["projector"] == 2 * 2 * 64 * 64 * 64
    kern = pd.read_csv(run / "vision_kernels.csv")
    for (_, _), g in kern.groupby(["batch", "stage"]):
        assert abs(g["busy_share"].sum() - 1.0) < 1e-9


def test_vision_kernel_times_counts_a_calls_cpu_operators(monkeypatch):
    """``kernel_times`` of a call that runs 5 matrix products and 3 linear layers (each a linear with one
    addmm inside): 5 aten::mm, 3 aten::linear, 3 aten::addmm, each with a positive self time that adds up
    to no more than the call; the same counts when KernelCapture falls back to torch.profiler.profile."""
    import time

    from torch.autograd import profiler as ap
    from torch.nn import functional as F

    from harness.bench.vision import kernel_times

    a, x, w, b = torch.randn(16, 16), torch.randn(4, 16), torch.randn(8, 16), torch.randn(8)

    def call():
        for _ in range(5):
            torch.mm(a, a)
        for _ in range(3):
            F.linear(x, w, b)

    def counts(kern):
        return {k: kern[k][0] for k in ("aten::mm", "aten::linear", "aten::addmm")}

    t0 = time.perf_counter()
    kern = kernel_times(call, cuda=False)
    wall_ms = (time.perf_counter() - t0) * 1e3
    assert counts(kern) == {"aten::mm": 5, "aten::linear": 3, "aten::addmm": 3}
    assert all(t > 0 for _, t in kern.values()) and sum(t for _, t in kern.values()) < wall_ms

    tried, prepare = [], ap.profile._prepare_trace

    def moved(self):  # KernelCapture's own call fails; torch.profiler.profile's (the fallback) goes through
        tried.append(self)
        if len(tried) == 1:
            raise AttributeError("private profiler API moved")
        return prepare(self)

    monkeypatch.setattr(ap.profile, "_prepare_trace", moved)
    assert counts(kernel_times(call, cuda=False)) == {"aten::mm": 5, "aten::linear": 3, "aten::addmm": 3}
    assert len(tried) == 2


def test_moe_block_candidates_follow_the_rows_per_expert():
    from harness.bench import moe

    # 300 tokens x top-6 over 64 experts: 28.1 rows per expert (decode-size tiles, block_m 16);
    # a prefill of 128 base pages, 128 x 286 tokens x 6: 3,432 rows per expert (64- and 128-row tiles)
    assert moe.block_candidates(300 * 6, 64) is moe.BLOCK_CANDIDATES
    assert moe.block_candidates(33 * 64, 64) is moe.LARGE_BLOCK_CANDIDATES
    assert {c[0] for c in moe.block_candidates(128 * 286 * 6, 64)} == {64, 128}
    assert len(moe.LARGE_BLOCK_CANDIDATES) == 2 * 3 * 2 * 2 * 2


def test_moe_bench_balanced_routing_draws_k_distinct_experts_per_token():
    """``bench.moe.routing=balanced``: each token's k ids are distinct experts, drawn the same way for
    the same T (seeded by it) and not the gate's choice; the bytes are those of the distinct experts
    touched. The gate's routing is the layer's own top-k."""
    from harness.bench.moe import routed
    from harness.models.llm import LLMConfig, MoE
    from harness.variants import fast_moe as fm

    cfg = LLMConfig(hidden_size=32, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4)
    torch.manual_seed(0)
    moe = MoE(cfg, layer_idx=1).to(torch.bfloat16)
    weights = fm.stack_experts(moe)
    _, ids, _, nbytes = routed(moe, weights, 24, "balanced")
    assert ids.shape == (24, 4) and ids.dtype == torch.int64
    assert all(len(set(r)) == 4 for r in ids.tolist()) and int(ids.min()) >= 0 and int(ids.max()) < 16
    assert torch.equal(ids, routed(moe, weights, 24, "balanced")[1])
    assert nbytes == len(set(ids.flatten().tolist())) * weights.bytes_per_expert()
    x, gate_ids, _, _ = routed(moe, weights, 24)
    assert torch.equal(gate_ids, moe.gate(x)[0]) and not torch.equal(gate_ids, ids)
