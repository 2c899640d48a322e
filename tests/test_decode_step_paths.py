"""``bench decode_step bench.decode_step.match=[...]`` (``harness.bench.decode_step_paths``), the parts
that run on a CPU: each factor of the run path sets the direct fused step up as the run path has it.

The run path is the tiny model's request through ``decode_step=fused`` (``test_fused_step``'s: a
prompt of 28 tokens, a 64-position static cache), here of 4 tokens (3 decode steps), fp32, in
Triton's interpreter; the timing (CUDA graphs and events) needs a GPU. Option checks and the
ordering of a row are torch-free.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import cpu_triton, needs_triton
from harness.bench import config as bc
from harness.errors import HarnessError
from test_decode_step_triton import one_cpu_thread  # noqa: F401 (the module's autouse fixture)
from test_fused_step import FUSED, tiny_model_and_request


@pytest.mark.parametrize("match, configs, line", [
    (["prompt", "speed"], None, r"match=\['prompt', 'speed'\]: \['speed'\]; fix: list each of cache_len, "),
    (["events", "events"], None, r"match=\['events', 'events'\]: a factor twice"),
    (["events"], [""], r"configs=\[''\]: the paths table compares two or more distinct configurations"),
])
def test_match_and_configs_are_checked(match, configs, line):
    opts = bc.DecodeStepBench(match=match, **({"configs": configs} if configs is not None else {}))
    with pytest.raises(HarnessError, match=line):
        bc.check_options(bc.BenchConfig(target="decode_step", decode_step=opts))


def test_rows_and_their_order():
    """direct, each factor, all; a row's differences against its first configuration, the fastest
    named, and the rows where a configuration's order against the first reverses (the issue's
    figures: the step built directly 439.8 against 450.6 µs, the harness path 445.5 against 442.4)."""
    from harness.bench.decode_step_paths import COLUMNS, add_rows, flips, rows_of
    from harness.bench.verb import BenchReport

    assert rows_of(["prompt", "events"]) == [("direct", set()), ("+prompt", {"prompt"}), ("+events", {"events"}),
                                             ("all", {"prompt", "events"})]
    assert rows_of(["history"]) == [("direct", set()), ("+history", {"history"})]
    table = BenchReport(progress=lambda _: None).table("paths", "t", COLUMNS)
    deltas = {"direct": add_rows(table, "direct", ["A", "B"], [[439.8], [450.6]]),
              "run": add_rows(table, "run", ["A", "B"], [[445.5, 446.0, 445.0], [442.4, 441.0, 443.0]])}
    cells = [(r["method"], r["change"], round(r["delta_us"], 1), r["note"]) for r in table.rows]
    assert cells == [("direct", "A", 0.0, "fastest"), ("direct", "B", 10.8, ""),
                     ("run", "A", 0.0, ""), ("run", "B", -3.1, "fastest")]
    assert (table.rows[2]["us_min"], table.rows[2]["us_max"]) == (445.0, 446.0)
    assert flips(["A", "B"], deltas) == ["B against A: slower under direct (+10.8 µs); the order reverses under run"]
    deltas["+prompt"] = [0.0, 2.0]
    deltas["run"] = [0.0, 0.5]
    assert flips(["A", "B"], deltas) == ["B against A: slower under direct (+10.8 µs); the same order under every row"]


@needs_triton
@cpu_triton
def test_each_factor_sets_the_direct_step_up_as_the_run_path():
    """``prompt``: the direct step, on a cache of its own (40 positions), starts at the request's
    prompt (28) from its first token and decodes the request's own 2 decode tokens; ``buffers``: the step
    runs on the run decoder's cache, position, token buffer, counts and history; ``cache_len`` and
    ``history``: a cache of the decoder's 64 positions and a history; none: the bench's length,
    position and reps, token 1, a zero cache. The run rows: one request per configuration, each
    through a decoder of its own whose fused step has that configuration."""
    from harness import variants
    from harness.bench.decode_step_paths import factor_step, run_path_us, run_state
    from harness.config import ExecutionConfig
    from harness.kernels.decode_step import INTERPRETER_CONFIG
    from harness.models.generate import generate

    model, req = tiny_model_and_request("cpu", torch.float32, 3)
    try:
        with torch.inference_mode():      # (the run decoder's buffers are inference tensors)
            state = run_state(model, req, ExecutionConfig(**FUSED))
            want = generate(model, req).tokens[0].tolist()                 # the run path's 3 tokens
            assert (state.prompt, state.steps, state.first, state.dec.cache.max_len) == (28, 2, want[0], 64)
            weights = state.dec.core.weights

            def build(factors):
                return factor_step(model, weights, state, factors, INTERPRETER_CONFIG, False, 40, 5, 2)

            fs = build({"prompt"})
            assert (fs.start, fs.reps, fs.step.cache.max_len, fs.step.history) == (28, 2, 40, None)
            got = []
            for _ in range(fs.reps):
                fs.step.run()
                got.append(int(fs.step.token))
            assert got == want[1:]
            fs.reset()
            assert (int(fs.step.pos), int(fs.step.token), int(fs.step.counts[1])) == (28, want[0], 0)

            dec = state.dec
            fs = build({"buffers"})
            assert fs.step.cache is dec.cache and fs.step.pos is dec.cache.position
            assert fs.step.token.data_ptr() == dec.token_in.data_ptr() and fs.step.history is dec.core.history
            assert fs.step.counts[0] is dec.routing.decode and (fs.start, fs.reps) == (5, 2)
            assert not any(bool(t.any()) for t in dec.cache.k + dec.cache.v)   # no prompt: zeros

            fs = build({"cache_len", "history"})
            assert fs.step.cache.max_len == 64 and fs.step.history.numel() == 64
            fs = build(set())
            assert (fs.step.cache.max_len, fs.step.history, fs.start, fs.reps, int(fs.step.token)) == \
                (40, None, 5, 2, 1)
            assert fs.step.counts[0].shape[0] == 2 + 8

            other = dataclasses.replace(INTERPRETER_CONFIG, gate_up_norm=True)
            us = run_path_us(model, req, [INTERPRETER_CONFIG, other], 64, 1, False)    # the host clock here
            assert len(us) == 2 and all(len(u) == 1 and u[0] > 0 for u in us)
            (dec,) = model.static_decoders.values()                 # the last configuration's, swapped in
            assert dec.core.config == other and dec.core.step.config == other
    finally:
        variants.apply(model, ExecutionConfig())
