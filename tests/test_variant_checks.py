"""Every execution is checked as a whole before any model is built (``harness.variants.check``,
``setup.check_cases``, the CLI's validation): what would not run, or would run as something else,
is refused with one line naming ``execution.<knob>``; an experiment's case that only this device
cannot run is skipped with its reason; converters undo and redo; the manifest's label names what ran."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY_MODE, load_tiny_cfg
from harness import knobs, variants
from harness import workload as wl
from harness.cli import check_overrides
from harness.config import ExecutionConfig
from harness.errors import HarnessError
from harness.models.build import build_model
from harness.models.generate import generate
from harness.setup import check_cases
from harness.variants.base import CannotRunHere, reference_class

TINY = ["model=tiny", "workload.mode={name: t, base_size: 128, image_size: 64, crop: true}", "device=cpu"]
STATIC_GROUPED_FIX = "fix: add execution.kv_cache=static execution.moe_impl=grouped"


def _refusal(overrides) -> str:
    with pytest.raises(HarnessError) as exc:
        check_overrides(overrides)
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_compile_with_the_growing_cache_is_refused():
    """compile compiles the static-cache decode step only: with the growing cache nothing would be
    compiled, yet the manifest would say so; with the vendor MoE loop the step syncs the host
    (once an AttributeError inside the compiled step)."""
    words = ("execution.compile=true needs kv_cache=static and moe_impl=grouped (only the static-cache decode step "
             "is compiled; the vendor MoE loop syncs the host inside it); " + STATIC_GROUPED_FIX)
    assert _refusal(TINY + ["execution.compile=true"]) == words
    assert _refusal(TINY + ["execution.kv_cache=static", "execution.compile=true"]) == words


def test_vision_compile_on_a_cpu_is_refused():
    msg = _refusal(TINY + ["execution.vision_impl=fused", "execution.vision_compile=true"])
    assert msg == ("execution.vision_compile=true needs a CUDA device (this run is on cpu); "
                   "fix: run on a GPU, or leave it out")


def test_sam_attention_triton_needs_the_fused_vision():
    for value in ("triton-windows", "triton"):
        assert _refusal(TINY + [f"execution.sam_attention={value}"]) == (
            f"execution.sam_attention={value} needs vision_impl=fused (it replaces that variant's SAM attention); "
            "fix: add execution.vision_impl=fused")
    assert check_overrides(TINY + ["execution.vision_impl=fused", "execution.sam_attention=sdpa"]) is not None
    assert knobs.label(ExecutionConfig(vision_impl="fused", sam_attention="triton-windows")) == (
        "fused vision + triton SAM attention (windows)")
    assert knobs.label({"vision_impl": "fused", "sam_attention": "triton"}) == "fused vision + triton SAM attention"
    assert knobs.label(ExecutionConfig(vision_impl="fused")) == "fused vision"


def test_a_static_cache_too_short_for_the_request_is_refused_with_the_positions_it_needs():
    # The A4 synthetic page (1240 x 1754) in the tiny mode: a global view of 128 px -> q = 128/64 = 2:
    # 2 rows of (2 + 1 newline) = 6 tokens; 64 px tiles in the 2x3 grid closest to the page's aspect
    # -> q = 1: 3 tile rows of (2 + 1) = 9 tokens; one view separator: 16 image tokens. Prompt =
    # BOS + 16 + 12 text tokens = 29; with 8 decode tokens the request needs 29 + 8 = 37 positions.
    msg = _refusal(TINY + ["workload.decode_tokens=8", "execution.kv_cache=static", "execution.static_cache_len=8"])
    assert msg == ("execution.static_cache_len=8 holds 8 positions but the request needs 37 (prompt + decode tokens); "
                   "fix: set execution.static_cache_len=37 or more, or leave it unset (prompt + decode tokens, "
                   "rounded up to 64)")
    assert check_overrides(TINY + ["workload.decode_tokens=8", "execution.kv_cache=static",
                                   "execution.static_cache_len=37"]).execution.static_cache_len == 37


def test_knobs_that_would_do_nothing_are_refused():
    assert _refusal(TINY + ["execution.static_cache_len=64"]).startswith(
        "execution.static_cache_len=64 sizes the static cache, which runs only with kv_cache=static")
    assert _refusal(TINY + ["execution.moe_kernel=torch"]).startswith(
        "execution.moe_kernel=torch picks the kernel of moe_impl=grouped, which is off")


def test_the_optimize_ladder_on_a_cpu_skips_the_cases_needing_cuda_and_names_them():
    cfg = check_overrides(["+experiment=optimize"] + TINY)
    skipped = check_cases(cfg)
    best = ["best", "best-b8", "best-b32", "best-b64"]
    assert sorted(skipped) == sorted(["graphs", "compiled", "gundam-best", "best-fused", "best-fused-clock"] + best
                                     + [f"{b}-balanced" for b in best])
    assert set(skipped.values()) == {"execution.cuda_graphs=decode needs a CUDA device (this run is on cpu); "
                                     "fix: run on a GPU, or leave it out"}
    msg = _refusal(["+experiment=optimize", "run.only=[graphs,best]"] + TINY)
    assert msg.startswith("no case of the run can run here; case graphs: execution.cuda_graphs=decode needs a CUDA")


def test_a_device_refusal_without_cases_is_a_refusal_not_a_skip():
    with pytest.raises(CannotRunHere, match="execution.prefill_graphs=true needs a CUDA device"):
        check_overrides(TINY + ["execution.kv_cache=static", "execution.moe_impl=grouped",
                                "execution.prefill_graphs=true"])


@pytest.fixture(scope="module")
def tiny():
    model = build_model(load_tiny_cfg(), "cpu", torch.float32, seed=0)
    req = wl.build_request([wl.Page("p", wl.synthetic_page(0, size=(300, 200)), "s")], TINY_MODE, decode_tokens=5)
    return model, req


def test_converters_undo_to_the_reference_classes_and_redo(tiny):
    model, req = tiny
    ref = generate(model, req)
    ex = ExecutionConfig(kv_cache="static", moe_impl="grouped", moe_kernel="torch", vision_impl="fused")
    for _ in range(2):
        info = variants.apply(model, ex)
        assert type(model.model.layers[0].self_attn).__name__ == "StaticAttention"
        assert type(model.model.layers[1].mlp).__name__ == "GroupedMoE"
        assert torch.equal(generate(model, req).tokens, ref.tokens)
        variants.apply(model, ExecutionConfig())
        assert all(type(m) is reference_class(m) for m in model.modules())
        assert torch.equal(generate(model, req).tokens, ref.tokens)
    assert set(model.state_dict()) == set(build_model(load_tiny_cfg(), "meta").state_dict())   # names unchanged
    assert info["kv_cache_is"].startswith("static") and info["moe_kernel_resolved"] == "torch"


def test_variant_modules_keep_their_module_family(tiny):
    """Kernel attribution follows the module's reference class (a variant class of an attention is
    still the llm_attention family)."""
    from harness.anatomy.registry import family_of

    model, _ = tiny
    variants.apply(model, ExecutionConfig(kv_cache="static", moe_impl="grouped", moe_kernel="torch"))
    try:
        attn, moe = model.model.layers[1].self_attn, model.model.layers[1].mlp
        assert family_of("model.layers.1.self_attn", reference_class(attn).__name__) == ("llm_attention", "")
        assert reference_class(moe).__name__ == "MoE" and reference_class(model).__name__ == "DeepseekOCR"
    finally:
        variants.apply(model, ExecutionConfig())


def test_label_names_the_converters_that_ran_as_the_report_does():
    """The report's ladder labels come from the converters: each knob that differs from the vendor's
    execution adds its short name, in the registry's order (the names the ladder has always used)."""
    from harness.report.ladder import execution_label

    best = ExecutionConfig(kv_cache="static", moe_impl="grouped", cuda_graphs="decode", compile=True,
                           prefill_graphs=True, linear_impl="fused", decode_attention="triton", vision_impl="fused",
                           vision_compile=True)
    want = ("static KV + grouped MoE (triton) + decode graph + compiled + prefill graph + fused vision + "
            "fused linears + compiled vision + triton decode attention")
    assert execution_label({**best.execution(), "moe_kernel_resolved": "triton"}) == want
    assert knobs.label(ExecutionConfig()) == "vendor-style" == execution_label(ExecutionConfig().execution())
    assert knobs.label({**ExecutionConfig(kv_cache="static", moe_impl="grouped").execution(),
                           "moe_kernel_resolved": "torch"}) == "static KV + grouped MoE (torch)"


def test_hooks_follow_the_converters():
    assert knobs.allows_module_hooks(None) and knobs.allows_module_hooks(ExecutionConfig(kv_cache="static"))
    assert not knobs.allows_module_hooks(ExecutionConfig(kv_cache="static", moe_impl="grouped", compile=True))
    assert not knobs.allows_module_hooks(ExecutionConfig(vision_impl="fused"))


def test_a_run_skips_what_this_device_cannot_run_and_says_so(tmp_path):
    """``execution.kv_cache=static`` runs (the vendor-style case takes the run's execution); the graphs
    case is skipped: named in the progress output, the manifest and the report."""
    from harness.run import run

    cfg = check_overrides(["+experiment=optimize", "run.only=[vendor-style,graphs]", "execution.kv_cache=static",
                           "workload.decode_tokens=2", "measure.repeats=1", "measure.warmup=0",
                           f"run.root={tmp_path}"] + TINY)
    lines = []
    rd = run(cfg, tmp_path / "run", progress=lines.append)
    reason = "execution.cuda_graphs=decode needs a CUDA device (this run is on cpu); fix: run on a GPU, or leave it out"
    assert f"[harness] case graphs skipped: {reason}" in lines
    man = json.loads((rd.path / "manifest.json").read_text())
    assert man["status"] == "complete" and man["skipped_cases"] == [{"case": "graphs", "reason": reason}]
    assert [c["name"] for c in man["cases"]] == ["vendor-style"]
    ran = man["cases"][0]["execution"]
    assert ran["kv_cache"] == "static" and ran["kv_cache_is"].startswith("static") and knobs.label(ran) == "static KV"
    assert f"case graphs skipped: {reason}" in (rd.path / "report.md").read_text()
