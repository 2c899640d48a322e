"""Where a run's time goes (``harness.timeline``), the memory check before the model is built
(``harness.memory_check``) and the progress shown while waiting (``harness.report.progress``):
issue 26 item 11, CPU, no model built, no dependence on the machine's speed (a fake clock)."""
from __future__ import annotations

import io

import pytest
import torch

from harness.errors import HarnessError
from harness.memory_check import MARGIN_FRACTION, MARGIN_MIN_BYTES, check_memory
from harness.timeline import Timeline, phase_of


class FakeClock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_phases_add_up_to_the_total_and_the_trace_export_is_carved_out():
    clock = FakeClock()
    tl = Timeline(clock, before=2.0)              # 2 s of imports and Hydra before the run's clock
    for phase, seconds in (("set-up", 1.0), ("model build", 5.0), ("calibration", 0.5), ("warm-up", 3.0),
                           ("timed repeats", 6.0), ("profiled request", 4.0), ("analytic + writing", 0.25),
                           ("warm-up", 1.0), ("report", 2.0)):
        tl.enter(phase)
        clock.t += seconds
    tl.stop()
    tl.carve(1.5, "trace export", "profiled request")
    assert tl.seconds == {"start-up": 2.0, "set-up": 1.0, "model build": 5.0, "calibration": 0.5, "warm-up": 4.0,
                          "timed repeats": 6.0, "profiled request": 2.5, "trace export": 1.5,
                          "analytic + writing": 0.25, "report": 2.0}
    assert tl.total() == 2.0 + 1.0 + 5.0 + 0.5 + 3.0 + 6.0 + 4.0 + 0.25 + 1.0 + 2.0 == sum(tl.seconds.values())
    clock.t += 50                                  # stopped: later time does not count
    assert tl.as_dict()["total_s"] == 24.75
    assert tl.line() == ("time 24.8 s: start-up 2.0 s, set-up 1.0 s, model build 5.0 s, calibration 0.5 s, "
                         "warm-up 4.0 s, timed repeats 6.0 s, profiled request 2.5 s, trace export 1.5 s, "
                         "analytic + writing 0.2 s, report 2.0 s")
    tl.carve(99.0, "trace export", "report")       # never more than the phase holds
    assert tl.seconds["report"] == 0.0 and tl.seconds["trace export"] == 3.5


def test_request_labels_map_to_phases():
    assert [phase_of(r) for r in ("warmup=0", "repeat=2", "repeat=profiled", "writing", "done")] == [
        "warm-up", "timed repeats", "profiled request", "analytic + writing", "analytic + writing"]


def _case(mode="base", grid=None, decode: int = 128, batch: int = 1, kv_cache: str = "growing"):
    """A prepared case (``setup.CaseInputs``) of synthetic A4 pages; nothing is drawn."""
    from harness import workload as wl
    from harness.config import ExecutionConfig, WorkloadConfig
    from harness.setup import CaseInputs

    return CaseInputs(wl.Case(wl.get_mode(mode), grid, batch, 12, decode), WorkloadConfig(batch=batch),
                      ExecutionConfig(kv_cache=kv_cache), tokenizer=None)


def test_the_full_model_in_fp32_is_refused_where_it_cannot_fit():
    from harness.config import ModelConfig

    params = 3_336_106_240                         # the checkpoint's tensors (DESIGN.md)
    weights = params * 4                           # fp32
    kv = 2 * 12 * 10 * 128 * 4 * (286 + 128)       # K and V, 12 layers x 10 heads x 128, fp32, 414 positions
    margin = int(MARGIN_FRACTION * weights)        # 10% of the weights is more than 1 GiB here
    assert margin > MARGIN_MIN_BYTES
    pages = 1240 * 1754 * 3                        # one A4 page at 150 dpi, RGB bytes (one request built)
    preprocessed = 2 * 3 * 1024 * 1024 * 4         # base: a 1024 px float32 view, page list + stacked batch
    # SAM's global block at 1024 px (64 x 64 tokens, 768 channels, 12 heads of 64) writes qkv, rel_h + rel_w,
    # the dense 4096 x 4096 mask per head, the attention output and the projection + residual, fp32
    tokens = 64 * 64
    activations = (3 * tokens * 768 + 12 * tokens * (64 + 64) + 12 * tokens * tokens + 2 * tokens * 768) * 4
    total = pages + preprocessed + weights + kv + activations + margin
    cpu = torch.device("cpu")
    with pytest.raises(HarnessError) as exc:
        check_memory(ModelConfig(), cpu, torch.float32, [_case()], free=(8_000_000_000, "available RAM"))
    msg = str(exc.value)
    assert msg.startswith(f"the run needs about {total / 1e9:.1f} GB ({pages / 1e6:.0f} MB of pages, "
                          f"{preprocessed / 1e6:.0f} MB of preprocessed tensors, {weights / 1e9:.1f} GB of weights, "
                          f"{kv / 1e6:.0f} MB of KV cache, {activations / 1e6:.0f} MB of activations, "
                          f"{margin / 1e9:.1f} GB of margin) but only 8.0 GB of available RAM is free; fix: use "
                          "model=tiny, dtype=bf16 (halves the weights")
    assert msg.endswith("or a machine with more memory (run.memory_check=false skips this check)")
    assert "workload.batch" not in msg
    entry = check_memory(ModelConfig(), cpu, torch.float32, [_case()], free=(total, "available RAM"))
    assert entry["need_bytes"] == {"pages": pages, "preprocessed": preprocessed, "weights": weights, "kv_cache": kv,
                                   "graph_pools": 0, "activations": activations, "request_on_device": 0,
                                   "held_by_others": 0, "margin": margin, "total": total}
    with pytest.raises(HarnessError, match="workload.batch=1"):   # batch 8: the batch is a fix
        check_memory(ModelConfig(), cpu, torch.bfloat16, [_case(batch=8)], free=(1_000_000, "x"))
    assert check_memory(ModelConfig(), cpu, torch.float32, [_case()], free=(None, "unknown"))["free_bytes"] \
        is None                                    # nothing to compare with: the run goes on


def test_the_tiny_model_fits_with_the_one_gib_margin(tiny_cfg, tiny_mode):
    from harness.analytic import component_params

    entry = check_memory(tiny_cfg, torch.device("cpu"), torch.float32, [_case(tiny_mode, (2, 3), 4)],
                         free=(2 << 30, "RAM"))
    assert entry["need_bytes"]["weights"] == component_params(tiny_cfg)["total"] * 4
    assert entry["need_bytes"]["margin"] == MARGIN_MIN_BYTES      # 10% of 67 MB is less than 1 GiB


def test_waiting_shows_a_spinner_on_a_terminal_only():
    from harness.report.progress import RunProgress, waiting

    plain = io.StringIO()
    p = RunProgress(stream=plain, bar=False)
    with waiting(p, "building the model"):
        p("[harness] a line")
    assert plain.getvalue() == "[harness] a line\n"                # no terminal: the lines, nothing added
    term = io.StringIO()
    p = RunProgress(stream=term, bar=True)
    with waiting(p, "building the model"):
        p("[harness] a line")
    out = term.getvalue()
    assert "building the model" in out and "[harness] a line" in out
    with waiting(print, "x"):                      # any other callable: nothing to show
        pass
