"""``execution.decode_step=fused`` (+ ``pdl``): the fused batch-1 decode step as an execution variant.

Through ``variants.apply`` and ``generate`` (the static decoder runs a ``FusedCore`` instead of the
model's modules for every decode step; the prefill keeps its path), fp32 on the tiny model: the
same greedy tokens and routing counts as vendor-style. Its vocabulary is cut to 1,024 and the
request's ids taken modulo it (the image placeholders' embeddings are replaced by the image's
anyway), so the interpreter's lm_head is quick. On the CPU the kernels run in Triton's
interpreter, uncaptured (on CUDA the step is captured in the decode graph: the ``gpu`` tests).
Refusals: one line each, naming the knob and the fix.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import TINY_MODE, cpu_triton, load_tiny_cfg, needs_triton
from harness import knobs, variants
from harness import workload as wl
from harness.cli import check_overrides
from harness.config import ExecutionConfig
from harness.errors import HarnessError
from harness.models.build import build_model
from harness.models.generate import generate
from harness.variants.base import CannotRunHere

FUSED = dict(kv_cache="static", moe_impl="grouped", linear_impl="fused", decode_attention="triton",
             decode_step="fused")
TINY = ["model=tiny", "workload.mode={name: t, base_size: 128, image_size: 64, crop: true}", "device=cpu"]
#: decode steps on the CPU (each costs about a second in Triton's interpreter). The request's prefill
#: holds 28 tokens (asserted below), so the steps write positions 28 .. 33 of a 64-position static
#: cache (28 + 7 = 35 rounded up to 64); the interpreter's attention tile (``decode_step.
#: INTERPRETER_CONFIG``, 16 keys per split) then has a split always full (16-31), one empty and then
#: filled (32-47, from the fifth step) and one always empty (48-63)
STEPS = 6
VOCAB = 1024


def tiny_model_and_request(device, dtype, decode_tokens):
    """The tiny model with a VOCAB-word vocabulary and a request of the tiny crop mode whose ids fit it."""
    cfg = load_tiny_cfg()
    cfg = dataclasses.replace(cfg, llm=dataclasses.replace(cfg.llm, vocab_size=VOCAB))
    model = build_model(cfg, device, dtype, seed=0)
    page = wl.Page("p", wl.synthetic_page(0, size=(300, 200)), "s")
    req = wl.build_request([page], TINY_MODE, decode_tokens=decode_tokens)
    return model, dataclasses.replace(req, input_ids=req.input_ids % VOCAB).to(device, dtype)


def _one_line(exc) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


@needs_triton
@cpu_triton
def test_fused_variant_generates_the_vendor_tokens_and_routing_fp32():
    """STEPS decode steps through ``generate``: tokens equal to vendor-style's, prefill and decode
    routing counts equal (per layer and expert, summed over the steps: the decoder's device counter
    is one [layers, experts] buffer); a second, shorter request reuses the decoder (position and
    counts reset) and gives the first 4 of those tokens; the step that ran is the fused one (18
    launches: 5 + 2 x 6 + 1)."""
    from harness.variants.fused_step import FusedCore

    from harness.kernels.decode_step import INTERPRETER_CONFIG

    model, req = tiny_model_and_request("cpu", torch.float32, STEPS + 1)
    assert req.prefill_tokens == 28 and INTERPRETER_CONFIG.attention[0] == 16
    ref = generate(model, req)
    assert int(ref.routing["decode"].sum()) == STEPS * 2 * 2          # 2 MoE layers, top-2
    info = variants.apply(model, ExecutionConfig(**FUSED))
    try:
        assert info["decode_step_is"].startswith("fused") and info["pdl_is"] == "off"
        res = generate(model, req)
        assert torch.equal(res.tokens, ref.tokens)
        for phase in ("prefill", "decode"):
            assert (res.routing[phase] == ref.routing[phase]).all() and res.routing[phase].sum() > 0
        again = generate(model, req, max_new_tokens=4)
        assert torch.equal(again.tokens, ref.tokens[:, :4]) and int(again.routing["decode"].sum()) == 3 * 2 * 2
        (dec,) = model.static_decoders.values()
        assert isinstance(dec.core, FusedCore) and dec.core.step.launches == 18
        assert_launches_attributed(model, dec)
        assert knobs.label(ExecutionConfig(**FUSED)).endswith("triton decode attention + fused decode step")
        assert not knobs.allows_module_hooks(ExecutionConfig(**FUSED))
    finally:
        variants.apply(model, ExecutionConfig())


def assert_launches_attributed(model, dec):
    """Kernel attribution's eager reference step (``measure.alignment.reference_step``): each of the
    fused step's 18 launches runs inside the interval of the module whose work it does, in the
    vendor's order: layer 0 (dense) q/k/v, attention, o_proj in its attention and gate/up, down in
    its MLP; layers 1 and 2 (MoE) the same with the router in the MoE gate and gate/up, down in the
    MoE container; the step end in lm_head. Each interval's label carries that module's family."""
    from harness.measure.modules import ModuleTracker

    with ModuleTracker(model) as tracker:
        dec.core.module_scope = tracker.scope
        try:
            dec.eager_step()
        finally:
            dec.core.module_scope = None
    opened = [(t, i) for t, i in tracker.events if i >= 0]
    closed = [t for t, i in tracker.events if i < 0]

    def moe(n):
        return [f"model.layers.{n}.self_attn"] * 3 + [f"model.layers.{n}.mlp.gate"] + [f"model.layers.{n}.mlp"] * 2

    want = ["model.layers.0.self_attn"] * 3 + ["model.layers.0.mlp"] * 2 + moe(1) + moe(2) + ["lm_head"]
    assert [tracker.names[i][0] for _, i in opened] == want and len(closed) == len(want)
    labels = tracker.attribute([(t0 + t1) // 2 for (t0, _), t1 in zip(opened, closed)])
    fam = {"self_attn": "llm_attention", "gate": "moe_gate", "lm_head": "lm_head"}
    assert [lab.family for lab in labels] == [
        "dense_mlp" if p == "model.layers.0.mlp" else "" if p.endswith(".mlp") else fam[p.split(".")[-1]] for p in want]
    assert {lab.op_group for lab, p in zip(labels, want) if p.endswith(("1.mlp", "2.mlp"))} == {"routing/indexing"}


@cpu_triton
def test_missing_prerequisites_are_refused_in_one_line():
    with pytest.raises(HarnessError) as exc:
        variants.check(ExecutionConfig(decode_step="fused", kv_cache="static"), "cpu")
    assert _one_line(exc) == (
        "execution.decode_step=fused needs moe_impl=grouped, linear_impl=fused, decode_attention=triton (it runs on "
        "the static cache, the grouped MoE's stacked experts and the fused q/k/v and gate/up weights; its attention "
        "reads positions 0..pos as decode_attention=triton's); fix: add execution.moe_impl=grouped "
        "execution.linear_impl=fused execution.decode_attention=triton")
    with pytest.raises(HarnessError) as exc:
        variants.check(ExecutionConfig(**FUSED, compile=True), "cpu")
    assert _one_line(exc) == ("execution.decode_step=fused replaces the decode step that compile would compile; "
                              "fix: drop execution.compile")


def test_on_cuda_the_fused_step_needs_the_decode_graph():
    """The converter's own check for a CUDA device (no GPU is touched: the graph knob is checked before
    Triton's availability): without cuda_graphs=decode the 72 launches would run from the host."""
    from harness.variants.fused_step import FUSED_STEP

    with pytest.raises(HarnessError) as exc:
        FUSED_STEP.check(ExecutionConfig(**FUSED), torch.device("cuda"), torch.float32)
    assert _one_line(exc) == ("execution.decode_step=fused runs inside the decode CUDA graph on CUDA (72 launches "
                              "from the host per step would time the host); fix: add execution.cuda_graphs=decode")


@cpu_triton
def test_batch_above_one_is_refused_before_the_run_and_when_the_decoder_is_built():
    with pytest.raises(HarnessError) as exc:
        check_overrides(TINY + ["workload.batch=2", "workload.repeat_pages=true"]
                        + [f"execution.{k}={v}" for k, v in FUSED.items()])
    assert _one_line(exc) == ("execution.decode_step=fused runs at batch 1 only; the case has batch 2; fix: use "
                              "execution.decode_step=modules at batch > 1")
    from harness.variants.fused_step import FusedCore
    from types import SimpleNamespace

    dec = SimpleNamespace(model=None, cache=None, token_in=torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(HarnessError) as exc:
        FusedCore(dec)
    assert _one_line(exc).startswith("execution.decode_step=fused runs at batch 1 only; this request has 2 rows")


@cpu_triton
def test_pdl_is_refused_on_a_cpu_and_without_the_fused_step():
    with pytest.raises(CannotRunHere) as exc:
        variants.check(ExecutionConfig(**FUSED, pdl=True), "cpu")
    assert _one_line(exc) == ("execution.pdl=true cannot run here: PDL is a CUDA launch attribute; the device is "
                              "cpu; fix: use execution.pdl=false")
    with pytest.raises(HarnessError) as exc:
        variants.check(ExecutionConfig(pdl=True), "cpu")
    assert _one_line(exc) == ("execution.pdl=true launches the fused decode step's kernels, which run only with "
                              "decode_step=fused; fix: add execution.decode_step=fused, or drop execution.pdl")


GPU_STEPS = 64


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_gpu_fused_variant_generates_the_vendor_tokens_for_64_steps_fp32(pdl):
    """fp32, TF32 off, the tiny model on a GPU: 64 decode steps of the fused step captured in the decode
    graph give vendor-style's tokens and routing counts (PDL where the GPU has it)."""
    from harness.kernels.decode_step_triton import pdl_support

    if pdl and not pdl_support("cuda")[0]:
        pytest.skip(pdl_support("cuda")[1])
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model, req = tiny_model_and_request("cuda", torch.float32, GPU_STEPS + 1)
    ref = generate(model, req)
    variants.apply(model, ExecutionConfig(**FUSED, cuda_graphs="decode", moe_kernel="triton", pdl=pdl))
    res = generate(model, req)
    assert torch.equal(res.tokens, ref.tokens)
    for phase in ("prefill", "decode"):
        assert (res.routing[phase] == ref.routing[phase]).all()


@needs_triton
@cpu_triton
def test_step_clock_keeps_each_requests_stamps_and_the_run_writes_the_median_ones():
    """``execution.step_clock=true`` on the CPU (the interpreter's clock is a tick): the fused step's
    tokens are vendor-style's; each ``generate`` leaves one list of stamps (``clock_stamps``), taken
    once: 18 launches x the request's decode steps after the first token (a request of 3 tokens: the
    prefill gives the first, the decode steps write positions 28 and 29); a row written between two
    requests is not the next one's (the clock is emptied when a request begins). ``CaseTables._clock``
    keeps the median request's: with warm-up 1 and timed repeats whose request ranges took 5, 3 and
    4 ms, the median is repeat 2, the fourth request (by its index in the case, so also with the oldest
    requests' stamps dropped); without it, a warning and nothing."""
    from types import SimpleNamespace

    from harness.run import CaseTables
    from harness.schema.stages import frame as observation_frame
    from harness.variants.fused_step import clock_stamps

    model, req = tiny_model_and_request("cpu", torch.float32, 3)
    ref = generate(model, req)
    info = variants.apply(model, ExecutionConfig(**FUSED, step_clock=True))
    try:
        assert info["step_clock_is"].startswith("each fused-step launch's first program")
        per_request = []
        for _ in range(4):
            assert torch.equal(generate(model, req).tokens, ref.tokens)
            per_request += clock_stamps(model)
            (dec,) = model.static_decoders.values()
            with torch.inference_mode():
                dec.core.step.clock[3] = 5      # a row written between requests (a warm-up, an eager step)
        assert clock_stamps(model) == []
        assert [len(s) for s in per_request] == [36] * 4
        assert sorted({r for r, *_ in per_request[0]}) == [28, 29]
        assert [(label, layer) for _, _, label, layer, *_ in per_request[0][:5]] == [
            ("qkv", 0), ("attention", 0), ("o_proj", 0), ("gate_up", 0), ("down", 0)]
    finally:
        variants.apply(model, ExecutionConfig())
    obs = observation_frame([{"case": "c", "repeat": r, "stage": "request", "call": -1, "profiled": False,
                              "e2e_ms": ms} for r, ms in enumerate((5.0, 3.0, 4.0))])
    measured = SimpleNamespace(warmup={"warmup_ms": [9.0]}, repeats_done=3, profiled=None, observations=obs)
    warned = []
    tables = CaseTables(SimpleNamespace(warn=warned.append), None)
    frame = tables._clock("c", measured, dict(enumerate(per_request)))
    assert warned == [] and set(frame["repeat"]) == {2} and len(frame) == 36
    assert frame[["row", "launch", "label", "layer", "entry", "release"]].values.tolist() == [
        list(s[:6]) for s in per_request[3]]
    assert set(frame.loc[frame["label"] == "router", "kind"]) == {"moe"} and frame["end"].isna().all()
    assert set(frame.loc[frame["layer"] == 0, "kind"]) == {"dense"}
    dropped = {i: s for i, s in enumerate(per_request) if i >= 2}    # the oldest gone: found by its index
    assert tables._clock("c", measured, dropped)["entry"].tolist() == frame["entry"].tolist() and warned == []
    assert tables._clock("c", measured, dict(enumerate(per_request[:3]))) is None
    assert "no in-kernel stamps of its median request (3 requests' stamps kept" in warned[0]


@needs_triton
@cpu_triton
def test_a_clocked_core_keeps_the_last_requests_stamps_numbered(monkeypatch):
    """Nobody takes the stamps (API use with the clock on): a core keeps the last ``STAMPS_KEPT`` requests'
    (here 2 of 3), numbered in order from ``request_number`` before the first."""
    from harness.variants import fused_step

    monkeypatch.setattr(fused_step, "STAMPS_KEPT", 2)
    model, req = tiny_model_and_request("cpu", torch.float32, 3)
    variants.apply(model, ExecutionConfig(**FUSED, step_clock=True))
    try:
        first = fused_step.request_number()
        for _ in range(3):
            generate(model, req)
        kept = fused_step.numbered_stamps(model)
        assert [n - first for n, _ in kept] == [1, 2] and fused_step.request_number() == first + 3
        assert [len(s) for _, s in kept] == [36, 36] and fused_step.numbered_stamps(model) == []
    finally:
        variants.apply(model, ExecutionConfig())


def test_step_clock_needs_the_fused_step():
    with pytest.raises(HarnessError) as exc:
        variants.check(ExecutionConfig(step_clock=True), "cpu")
    assert _one_line(exc) == ("execution.step_clock=true times the fused decode step's kernels, which run only with "
                              "decode_step=fused; fix: add execution.decode_step=fused, or drop execution.step_clock")
