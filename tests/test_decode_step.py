"""The fused decode step (``harness.kernels.decode_step``) against the reference model's decode.

A tiny DeepSeek-OCR (conf/model/tiny.yaml: 3 layers, dense layer 0, 8 experts top-2, 2 shared
parts; vocabulary cut to 500 so the interpreter's lm_head is quick), run as ``kv_cache=static``
(``variants.apply``: the vendor's modules against a static cache), prefills a random prompt; the
reference then decodes greedily with ``decode_step`` (SDPA over the masked buffer, the per-expert
loop, its routing counted per step on the host), and the fused step decodes from a copy of the
same cache state, its token buffer fed only by itself. Kernel tiles are chosen so each launch has
few programs (Triton's interpreter is slow) and the multi-program paths still run: 2 column blocks
in each down kernel (o_proj and the dense down with their reduction in 2 parts), gate/up tiles of
each shared part and routed slot, 2 lm_head programs looping over 2 tiles each (their maxima
combined by the last), the attention split in two (its last-split combine runs).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import DEV, load_tiny_cfg, needs_triton
from harness import variants
from harness.config import ExecutionConfig
from harness.errors import HarnessError
from harness.models.build import build_model
from harness.models.routing import RoutingCounter
from harness.variants.static_kv import StaticKVCache
from test_decode_step_triton import one_cpu_thread  # noqa: F401 (the module's autouse fixture)

pytestmark = needs_triton

VOCAB, PROMPT, MAX_LEN = 500, 7, 32


def small_tiles(**changes):
    from harness.kernels.decode_step import DecodeStepConfig

    return DecodeStepConfig(qkv=(32, 4), attention=(16, 4), o_proj=(32, 4, 2), router=(8, 2), gate_up=(16, 4),
                            down=(32, 4), dense_gate_up=(64, 4), dense_down=(32, 4, 2), lm_head=(128, 4, 1), sms=2,
                            **changes)


def tiny_model(dtype):
    """The tiny model (vocabulary VOCAB) in the vendor's modules against a static cache."""
    cfg = load_tiny_cfg()
    cfg = dataclasses.replace(cfg, llm=dataclasses.replace(cfg.llm, vocab_size=VOCAB))
    model = build_model(cfg, DEV, dtype, seed=0)
    variants.apply(model, ExecutionConfig(kv_cache="static"))
    return model


def weights(model):
    from harness.variants.fused_step import weights_from_model

    return weights_from_model(model)


def new_cache(model, dtype):
    L = model.cfg.llm
    cache = StaticKVCache(L.num_layers, 1, L.num_kv_heads, MAX_LEN, L.head_dim, dtype, DEV, query_heads=L.num_heads)
    cache.position = torch.zeros(1, dtype=torch.int64, device=DEV)
    return cache


def prefilled(model, dtype):
    """(cache after a random prompt, the first token [1, 1])."""
    cache = new_cache(model, dtype)
    ids = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1)).to(DEV)
    with torch.inference_mode():
        logits = model.prefill(ids, torch.zeros_like(ids, dtype=torch.bool), None, cache)
    return cache, logits[:, -1:].float().argmax(-1)


def copy_of(model, cache, dtype):
    other = new_cache(model, dtype)
    for dst, src in zip(other.k + other.v + [other.position], cache.k + cache.v + [cache.position]):
        dst.copy_(src)
    return other


def reference_decode(model, cache, token, steps, feed=None):
    """Greedy reference steps: (tokens, logits [V] per step, routing counts [steps, layers, E]).
    ``feed``: the tokens to feed instead of the greedy ones (teacher forcing)."""
    L = model.cfg.llm
    counter = RoutingCounter(L.num_layers, L.n_routed_experts)
    counter.plan_steps(steps)
    model.route_moe(counter)
    tokens, logits = [], []
    try:
        with torch.inference_mode():
            counter.phase("decode")
            for i in range(steps):
                counter.step(i)
                out = model.decode_step(token if feed is None else feed[i].view(1, 1), cache)[0, -1]
                token = out.float().argmax().view(1, 1)
                tokens.append(int(token))
                logits.append(out)
    finally:
        model.route_moe(None)
    return tokens, logits, counter.steps_result()


def test_fused_step_decodes_the_reference_tokens_fp32():
    """10 greedy steps in fp32: the same tokens, the same routing counts per step and layer (a
    buffer of 10 + 1 rows: the last, for steps past it, stays empty), logits within 1e-5 of the
    reference's largest (fp32 summation order); the device position and the step index advance
    once per step, and a step is 18 launches (5 dense + 2 x 6 MoE + 1). The steps write positions
    PROMPT .. PROMPT + 9 = 7 .. 16 of MAX_LEN = 32: the attention's second split (keys 16-31 at 16
    keys per split) is empty for the first 9 steps and filled at the last. Each step's token is also
    kept in the history at its position (PROMPT + i), nothing else there."""
    from harness.kernels.decode_step import FusedDecodeStep

    dt, steps = torch.float32, 10
    split_n = small_tiles().attention[0]
    assert PROMPT + steps - 2 < split_n == PROMPT + steps - 1 and MAX_LEN == 2 * split_n
    model = tiny_model(dt)
    cache, token = prefilled(model, dt)
    fused_cache = copy_of(model, cache, dt)
    ref_tokens, ref_logits, ref_counts = reference_decode(model, cache, token, steps)
    L = model.cfg.llm
    counts = torch.zeros(steps + 1, L.num_layers, L.n_routed_experts, dtype=torch.int64, device=DEV)
    step_index = torch.zeros(1, dtype=torch.int64, device=DEV)
    history = torch.zeros(MAX_LEN, dtype=torch.int64, device=DEV)
    step = FusedDecodeStep(weights(model), fused_cache, fused_cache.position, token=token.view(1).clone(),
                           config=small_tiles(), counts=(counts, step_index), history=history)
    assert step.launches == 18
    got = []
    with torch.inference_mode():
        for i in range(steps):
            step.run()
            got.append(int(step.token))
            err = (step.logits.double() - ref_logits[i].double()).abs().max() / ref_logits[i].double().abs().max()
            assert float(err) <= 1e-5, (i, float(err))
    assert got == ref_tokens
    assert history[PROMPT:PROMPT + steps].tolist() == got and int(history.count_nonzero()) == sum(t != 0 for t in got)
    assert torch.equal(counts[:steps].cpu(), torch.from_numpy(ref_counts)) and int(counts[steps].sum()) == 0
    assert int(fused_cache.position) == PROMPT + steps and int(step_index) == steps
    assert int(ref_counts.sum()) == steps * 2 * L.num_experts_per_tok      # 2 MoE layers, k each


def test_each_launch_names_the_kernel_it_runs():
    """``kernel_names``: the Triton function behind each launch label (the clock's per-kernel table reads
    it), by hand from ``decode_step_triton``: o_proj and both downs are the one down kernel."""
    from harness.kernels.decode_step import FusedDecodeStep

    model = tiny_model(torch.float32)
    cache, token = prefilled(model, torch.float32)
    step = FusedDecodeStep(weights(model), cache, cache.position, token=token.view(1).clone(), config=small_tiles())
    assert step.kernel_names() == {"qkv": "_qkv_rope_kernel", "attention": "_attention_kernel",
                                   "o_proj": "_down_kernel", "router": "_router_kernel", "gate_up": "_gate_up_kernel",
                                   "down": "_down_kernel", "lm_head": "_lm_head_argmax_kernel"}


def test_fused_step_bf16_teacher_forced_logits():
    """bf16, 4 steps fed the reference's tokens: logits within 2e-2 of the reference's largest (the
    norms, attention and summation orders round differently at bf16's 8 bits), the same greedy
    token at every step."""
    from harness.kernels.decode_step import FusedDecodeStep

    dt, steps = torch.bfloat16, 4
    model = tiny_model(dt)
    cache, token = prefilled(model, dt)
    fused_cache = copy_of(model, cache, dt)
    ref_tokens, ref_logits, _ = reference_decode(model, cache, token, steps)
    feed = [int(token)] + ref_tokens[:-1]
    step = FusedDecodeStep(weights(model), fused_cache, fused_cache.position, config=small_tiles())
    with torch.inference_mode():
        for i in range(steps):
            step.token.fill_(feed[i])
            step.run()
            ref = ref_logits[i].double()
            assert float((step.logits.double() - ref).abs().max() / ref.abs().max()) <= 2e-2, i
            assert int(step.token) == ref_tokens[i], i


def test_forced_routing_counts_the_table():
    """With a forced table every MoE layer routes to the table's experts at the step's position: the
    per-step counts are exactly the table's rows at positions PROMPT and PROMPT + 1 (a buffer of
    1 + 1 rows: the second step counts into the last row)."""
    from harness.kernels.decode_step import FusedDecodeStep

    dt = torch.float32
    model = tiny_model(dt)
    L = model.cfg.llm
    cache, token = prefilled(model, dt)
    g = torch.Generator().manual_seed(4)
    table = torch.stack([torch.randperm(L.n_routed_experts, generator=g)[:L.num_experts_per_tok]
                         for _ in range(MAX_LEN * L.num_layers)]).view(1, MAX_LEN, L.num_layers, -1)
    counts = torch.zeros(2, L.num_layers, L.n_routed_experts, dtype=torch.int64, device=DEV)
    step = FusedDecodeStep(weights(model), cache, cache.position, token=token.view(1).clone(),
                           config=small_tiles(),
                           counts=(counts, torch.zeros(1, dtype=torch.int64, device=DEV)), forced=table.to(DEV))
    with torch.inference_mode():
        step.run()
        step.run()
    want = torch.zeros(2, L.num_layers, L.n_routed_experts, dtype=torch.int64)
    for s in range(2):
        for layer in (1, 2):                                  # the MoE layers
            want[s, layer, table[0, PROMPT + s, layer]] = 1
    assert torch.equal(counts.cpu(), want)
    assert torch.equal(step.ids[1:].cpu(), table[0, PROMPT + 1, 1:])


def test_weight_bytes_by_hand():
    """Tiny model, fp32 (4 B), hidden 64, 4 heads of 16, dense 128, experts 8 x 32 (top-2), shared
    2 x 32, vocabulary 500, 3 layers (1 dense):
    embedding row 64; attention 3 x (64 norm + 192 x 64 qkv + 64 x 64 o) = 49,344; dense mlp
    64 + 256 x 64 + 64 x 128 = 24,640; router 2 x (64 + 8 x 64) = 1,152; routed 2 layers x 2 x
    (64 x 64 + 64 x 32) = 24,576; shared 2 x (128 x 64 + 64 x 64) = 24,576; final norm + lm_head
    64 + 500 x 64 = 32,064 elements: 156,416 x 4 = 625,664 bytes. KV at position 9: 10 positions
    read + 1 written, x 3 layers x 2 (K, V) x 4 heads x 16 x 4 B = 16,896."""
    from harness.kernels.decode_step import FusedDecodeStep

    model = tiny_model(torch.float32)
    cache = new_cache(model, torch.float32)
    step = FusedDecodeStep(weights(model), cache, cache.position, config=small_tiles())
    got = step.weight_bytes()
    assert {k: v // 4 for k, v in got.items()} == {
        "embedding row": 64, "attention": 49_344, "dense mlp": 24_640, "router": 1_152, "routed experts": 24_576,
        "shared experts": 24_576, "final norm + lm_head": 32_064, "total": 156_416}
    assert step.kv_bytes(9) == 16_896


def test_refusals():
    """PDL off a Hopper GPU, a batch-2 cache, a counts buffer of the wrong shape, a forced table or a
    token history shorter than the cache, o_proj parts that do not divide its width and a tile of the wrong length
    (a programs-per-SM entry where there is none) are refused with one-line errors."""
    from harness.kernels.decode_step import DecodeStepConfig, FusedDecodeStep

    model = tiny_model(torch.float32)
    w = weights(model)
    cache = new_cache(model, torch.float32)
    pos = cache.position
    if DEV == "cpu":
        with pytest.raises(HarnessError, match="pdl=True cannot run here"):
            FusedDecodeStep(w, cache, pos, pdl=True)
    L = model.cfg.llm
    two = StaticKVCache(L.num_layers, 2, L.num_kv_heads, MAX_LEN, L.head_dim, torch.float32, DEV)
    with pytest.raises(HarnessError, match="batch 1 only"):
        FusedDecodeStep(w, two, pos)
    one = torch.zeros(1, dtype=torch.int64, device=DEV)
    with pytest.raises(HarnessError, match=r"FusedDecodeStep: counts need a contiguous int64 buffer \[steps \+ 1, "
                                           r"layers, 8\] holding layer 2"):
        FusedDecodeStep(w, cache, pos, counts=(torch.zeros(4, 3, 7, dtype=torch.int64, device=DEV), one))
    with pytest.raises(HarnessError, match="forced routing must be"):
        FusedDecodeStep(w, cache, pos, forced=torch.zeros(1, MAX_LEN - 1, 3, 2, dtype=torch.int64, device=DEV))
    with pytest.raises(HarnessError, match=rf"history must be int64 \[>= {MAX_LEN}\]"):
        FusedDecodeStep(w, cache, pos, history=torch.zeros(MAX_LEN - 1, dtype=torch.int64, device=DEV))
    with pytest.raises(HarnessError, match=r"3 parts do not divide its reduction length 64") as exc:
        FusedDecodeStep(w, cache, pos, config=DecodeStepConfig(o_proj=(4, 4, 3)))
    assert "\n" not in str(exc.value)
    with pytest.raises(HarnessError, match=r"DecodeStepConfig.qkv=\(4, 2, 0\): 2 entries expected"):
        FusedDecodeStep(w, cache, pos, config=DecodeStepConfig(qkv=(4, 2, 0)))
    with pytest.raises(HarnessError, match=r"lm_head_stages=1: 0 \(register double buffer\) or 2-6"):
        FusedDecodeStep(w, cache, pos, config=DecodeStepConfig(lm_head_stages=1))


def test_config_changes_parse_literals_onto_a_base_and_refuse_bad_text():
    from harness.bench.config import config_changes
    from harness.kernels.decode_step import DecodeStepConfig

    base = DecodeStepConfig(sms=132)
    assert config_changes("", base) == base
    assert config_changes(" down=(2, 8) ; lm_head_stages=3;", base) == DecodeStepConfig(sms=132, down=(2, 8),
                                                                                       lm_head_stages=3)
    assert config_changes("gate_up_norm=True") == DecodeStepConfig(gate_up_norm=True)
    for text, match in (("down", "FIELD=VALUE with a DecodeStepConfig field"),
                        ("tiles=(2, 4)", "FIELD=VALUE with a DecodeStepConfig field"),
                        ("down=(2,", "not a python literal"),
                        ("down=(3, 4)", r"DecodeStepConfig.down=\(3, 4\): the block must be a power of two")):
        with pytest.raises(HarnessError, match=match):
            config_changes(text)


def test_the_in_kernel_clock_stamps_every_launch_in_order_and_changes_no_token():
    """fp32, 3 steps with ``clock_rows=MAX_LEN`` (row = position), the first program's clock and every
    program's (``clock_every``): the same tokens and logits as the step without a clock.

    Interpreted, the clock is a tick (+1 per read) and programs run one after another. First program
    only: it reads the clock twice per launch (entry, release), so launch i of the run enters at tick
    2i and is released at 2i + 1, and each step's intervals sum to 18 launches x 2 ticks. Every
    program: each reads it 3 times (entry, release, end) and an idle attention split once (it returns
    before its wait). With ``small_tiles`` the launches have, from the tiles alone: q/k/v 96 column
    pairs / 32 = 3 programs, o_proj and every down 64 rows / 32 = 2, the router 8 experts / 8 = 1, the
    MoE gate/up 32 / 16 = 2 tiles x (2 shared parts + 2 routed) = 8, the dense gate/up 128 / 64 = 2,
    lm_head min(4 tiles, 1 x 2 SMs) = 2; a launch of n programs spans 3n - 1 ticks from its first
    entry to its last end, its first program is released one tick after entry, and the launch after it
    (after the step's last, the next step's first) enters on the next tick. An attention launch (4
    heads x 2 splits, the second split idle at positions 7-9) ends before the next enters.

    Compiled (a GPU, %globaltimer; with PDL where the GPU has it): entry <= release, releases
    increase, and with every program's clock each launch is released no earlier than the previous
    one ended."""
    from harness.kernels.decode_step import FusedDecodeStep
    from harness.kernels.decode_step_triton import INTERPRETED, pdl_support
    from harness.measure import step_clock

    dt, steps, moe = torch.float32, 3, {1, 2}
    model = tiny_model(dt)
    cache, token = prefilled(model, dt)
    caches = [copy_of(model, cache, dt) for _ in range(3)]
    pdl = pdl_support(DEV)[0]
    plain, first, every = (FusedDecodeStep(weights(model), c, c.position, token=token.view(1).clone(),
                                           config=small_tiles(), **kw)
                           for c, kw in zip(caches, [{}, dict(clock_rows=MAX_LEN, pdl=pdl),
                                                     dict(clock_rows=MAX_LEN, pdl=pdl, clock_every=True)]))
    with torch.inference_mode():
        for _ in range(steps):
            for s in (plain, first, every):
                s.run()
            assert int(plain.token) == int(first.token) == int(every.token)
            assert torch.equal(plain.logits, first.logits) and torch.equal(plain.logits, every.logits)
    with pytest.raises(HarnessError, match=r"clock_rows=31: one row per cache position needed \(32"):
        FusedDecodeStep(weights(model), caches[0], caches[0].position, config=small_tiles(), clock_rows=MAX_LEN - 1)
    light, full = first.clock_stamps(), every.clock_stamps()
    assert sorted({r for r, *_ in light}) == sorted({r for r, *_ in full}) == [PROMPT, PROMPT + 1, PROMPT + 2]
    assert all(s[-1] is None for s in light) and all(s[-1] is not None for s in full)
    if not INTERPRETED:
        releases = [s[5] for s in light]
        assert all(s[4] <= s[5] for s in light + full) and releases == sorted(set(releases))
        for (*_, end), (row, _, label, layer, entry, release, end2) in zip(full, full[1:]):
            assert release >= end and end2 >= release, (row, label, layer)
        return
    base = light[0][4]
    assert [(s[4] - base, s[5] - base) for s in light] == [(2 * i, 2 * i + 1) for i in range(3 * 18)]
    df = step_clock.launches(light, moe)
    assert step_clock.steps(df).to_dict() == pytest.approx({PROMPT: 0.036, PROMPT + 1: 0.036}, rel=1e-12)
    programs = {("qkv", False): 3, ("o_proj", False): 2, ("router", True): 1, ("gate_up", True): 8,
                ("down", True): 2, ("gate_up", False): 2, ("down", False): 2, ("lm_head", False): 2}
    prev = None
    for row, launch, label, layer, entry, release, end in full:
        assert entry < release < end, (row, label, layer)
        if label != "attention":
            n = programs[(label, layer in moe and label in ("router", "gate_up", "down"))]
            assert (end - entry, release - entry) == (3 * n - 1, 1), (row, label, layer)
        if prev is not None:
            assert entry == prev[1] + 1 if prev[0] != "attention" else entry > prev[1], (row, label, layer)
        prev = (label, end)
    df = step_clock.launches(full, moe)
    first_release = {row: release for row, launch, _, _, _, release, _ in full if launch == 0}
    assert step_clock.steps(df).to_dict() == pytest.approx(
        {PROMPT: (first_release[PROMPT + 1] - first_release[PROMPT]) / 1e3,
         PROMPT + 1: (first_release[PROMPT + 2] - first_release[PROMPT + 1]) / 1e3}, rel=1e-12)
    assert (df["work_us"] + df["handoff_us"] - df["interval_us"]).abs().max() < 1e-12
    assert df[df["row"] == PROMPT + 2]["interval_us"].isna().tolist() == [False] * 17 + [True]
