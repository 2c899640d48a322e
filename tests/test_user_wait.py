"""What a user waits for (issue 22 item 7) and busy per decode step (issue 26 item 11), on checked-in
observations with every expected value derived by hand below; the runner's call timing, short
warm-up, short profiled request and a signal inside a case on the tiny model (CPU).

tests/data/observations/waits.csv (ms):

case w, batch 4, three timed repeats (127 decode steps each) and the profiled request (16 steps):
    repeat:          0     1     2   | profiled (3)
    e2e (request):  100   120   110  | 300, busy 20, 1,700 kernels
    generate call:  105   128   113  |
    set-up+collect:   5     8     3  |   (call - e2e, as the runner writes it)
    prep:           400   300   200  |
    copy (h2d):       2     3     4  |
    decode span:     80    90    85  | 250, busy 8, 1,600 kernels (100 per step)
case x, batch 1, two timed repeats: e2e 10 / 12, call 14 / 15, prep 1 / 2, copy 12 / 13 (no profiled request)
case g, batch 2, one timed repeat: e2e 50, call 52, no prep or copy timed
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from harness.schema.stages import read_observations
from harness.measure.summary import back_to_back_pages_s, bound_by, summarize
from harness.report.columns import COLUMNS, bound_cell
from harness.report.sections import partial_lines, user_wait_section

DATA = Path(__file__).resolve().parent / "data"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def waits():
    return summarize(read_observations(DATA / "observations" / "waits.csv"))


def test_call_set_up_prep_and_copy_of_the_median_request(waits):
    h = waits.headline.set_index("case")
    w = h.loc["w"]
    # e2e sorted 100 110 120: the median request is repeat 2 (110 ms); every value below is its own
    assert w["repeat"] == 2 and w["e2e_ms"] == 110.0
    assert (w["call_ms"], w["call_ms_min"], w["call_ms_max"]) == (113.0, 105.0, 128.0)
    assert (w["setup_collect_ms"], w["setup_collect_ms_min"], w["setup_collect_ms_max"]) == (3.0, 3.0, 8.0)
    # per page: prep 200 / 4 pages = 50 (repeats: 100, 75, 50), copy 4 / 4 = 1 (0.5, 0.75, 1)
    assert (w["prep_page_ms"], w["prep_page_ms_min"], w["prep_page_ms_max"]) == (50.0, 50.0, 100.0)
    assert (w["h2d_page_ms"], w["h2d_page_ms_min"], w["h2d_page_ms_max"]) == (1.0, 0.5, 1.0)
    # x: two repeats, e2e 10 / 12 -> the lower middle, repeat 0: call 14, set-up 4
    x = h.loc["x"]
    assert (x["repeat"], x["call_ms"], x["setup_collect_ms"], x["prep_page_ms"], x["h2d_page_ms"]) == \
        (0, 14.0, 4.0, 1.0, 12.0)


def test_pages_per_second_back_to_back(waits):
    h = waits.headline.set_index("case")
    # request range alone: 4 pages x 1000 / 110 ms
    assert h.loc["w", "pages_s"] == pytest.approx(4000 / 110)
    # GPU pages/s: 4 pages x 3 requests x 1000 / (105 + 128 + 113 = 346 ms of calls)
    assert h.loc["w", "pages_s_gpu"] == pytest.approx(12000 / 346)
    # end-to-end, serial: + prep 400 + 300 + 200 = 900 and copy 2 + 3 + 4 = 9 -> 1,255 ms
    assert h.loc["w", "pages_s_e2e"] == pytest.approx(12000 / 1255)
    # x: 1 page x 2 x 1000 / (14 + 15) and / (29 + 1 + 2 + 12 + 13 = 57)
    assert h.loc["x", "pages_s_gpu"] == pytest.approx(2000 / 29) and h.loc["x", "pages_s_e2e"] == pytest.approx(
        2000 / 57)
    # g timed no preparation: GPU pages/s only (2 x 1000 / 52)
    assert h.loc["g", "pages_s_gpu"] == pytest.approx(2000 / 52) and pd.isna(h.loc["g", "pages_s_e2e"])


def test_bound_by_the_longest_part_of_a_batch(waits):
    h = waits.headline.set_index("case")
    assert h.loc["w", "bound_by"] == "preprocessing"       # prep 200 > request 110 (and > copy 4)
    assert h.loc["x", "bound_by"] == "copy"                # copy 12 > request 10 (and > prep 1)
    assert pd.isna(h.loc["g", "bound_by"])                 # no prep, no copy: no claim
    # the rule by hand: strictly longer than the request range; preprocessing wins a tie with the copy
    assert bound_by(10.0, 1.0, 10.0) == "gpu" and bound_by(11.0, 1.0, 10.0) == "preprocessing"
    assert bound_by(5.0, 5.0, 4.0) == "preprocessing" and bound_by(1.0, 5.0, 4.0) == "copy"
    assert bound_by(None, 1.0, 2.0) is None
    assert back_to_back_pages_s(2, [10.0, float("nan")]) is None and back_to_back_pages_s(1, []) is None


def test_decode_busy_pairs_per_step_with_the_timed_requests(waits):
    st = waits.stages.set_index(["case", "stage"])
    # 127 timed steps / 16 profiled steps
    assert waits.step_scale("w") == 127 / 16 and waits.step_scale("x") == 1.0
    d = st.loc[("w", "decode")]
    # decode busy 8 ms over 16 steps = 0.5 ms per step, x 127 = 63.5 ms; span: median of 80 90 85 = 85
    assert (d["time_ms"], d["busy_ms"], d["idle_ms"]) == (85.0, 63.5, 85.0 - 63.5)
    assert d["kernels"] == 100 * 127 and d["launches_per_step"] == 100     # 1,600 / 16 per step, x 127
    assert d["idle_basis"] == ("median span of 3 timed repeats - kernel busy of the profiled request "
                               "(its 16 decode steps: busy per step x 127 timed steps)")
    r = st.loc[("w", "request")]
    # request: busy outside decode 20 - 8 = 12, + 63.5 = 75.5; span 110 -> idle 34.5; kernels 100 + 12,700
    assert (r["time_ms"], r["busy_ms"], r["idle_ms"], r["kernels"]) == (110.0, 75.5, 34.5, 12800.0)
    # the same pairing in stages_summary.csv's mean and median rows; the raw profiled value unchanged
    agg = waits.aggregates
    dec = agg[(agg["case"] == "w") & (agg["stage"] == "decode")].set_index("statistic")
    assert dec.loc["median", "busy_ms"] == 63.5 and dec.loc["median", "idle_ms"] == 85.0 - 63.5
    assert dec.loc["mean", "idle_ms"] == 85.0 - 63.5          # mean of 80 90 85 is 85 too
    assert waits.profiled_value("w", "decode", "busy_ms") == 8.0


def test_op_family_rows_scale_decode_busy_per_step():
    """``join_op_families`` with a step scale of 4 (4 timed steps per profiled one): decode busy
    1.0 + 0.5 ms of matmul kernels -> 6 ms against the whole decode's analytic work."""
    from harness.roofline.ops import join_op_families
    from harness.roofline.specs import resolve_peaks

    peaks = resolve_peaks("virtual", "bf16", {"peak_tflops": 100, "mem_bw_gbs": 1000})
    k = pd.DataFrame([{"case": "c", "stage": "decode", "category": "gemm", "op_group": "matmul", "start_ms": 0.0,
                       "dur_ms": 1.0},
                      {"case": "c", "stage": "decode", "category": "gemm", "op_group": "matmul", "start_ms": 2.0,
                       "dur_ms": 0.5},
                      {"case": "c", "stage": "prefill", "category": "gemm", "op_group": "matmul", "start_ms": -3.0,
                       "dur_ms": 2.0}])
    base = {"variant": "", "vector_flops": 0.0, "flops_useful": 0.0, "flops_counted": 0.0, "bytes_weights": 0.0,
            "bytes_kv_read": 0.0, "bytes_kv_write": 0.0, "routing": "measured", "family": "moe_routed",
            "tensor_flops": 1e9, "bytes": 3e9}
    a = pd.DataFrame([{**base, "case": "c", "stage": s} for s in ("decode", "prefill")])
    op = join_op_families(k, a, peaks, step_scale={"c": 4.0}).set_index("stage")
    assert op.loc["decode", "kernel_busy_ms"] == 4 * 1.5 and op.loc["decode", "kernels"] == 4 * 2
    # floor: 3 GB / 1,000 GB/s = 3 ms (memory) against 6 ms of busy -> 50%
    assert op.loc["decode", "efficiency_busy"] == pytest.approx(3.0 / 6.0)
    assert op.loc["prefill", "kernel_busy_ms"] == 2.0 and op.loc["prefill", "kernels"] == 1   # not decode: 1x


def test_user_wait_table_and_bound_cell(waits):
    md = "\n".join(user_wait_section(waits.headline))
    assert md.startswith("### What a user waits for")
    head = md.splitlines()[2]
    for name in ("call", "setup_collect", "prep_page", "h2d_page", "pages_s_gpu", "pages_s_e2e", "bound_by"):
        assert COLUMNS[name].title in head, name
    assert COLUMNS["call"].provenance == "measured" and COLUMNS["setup_collect"].provenance == "derived"
    assert COLUMNS["pages_s_gpu"].provenance == COLUMNS["pages_s_e2e"].provenance == "derived"
    # w: call 113 [105-128], set-up 3 [3-8], prep/page 50 [50-100], copy/page 1 [0.5-1],
    # pages/s 4000/110 = 36.4, GPU 12000/346 = 34.7, end-to-end 12000/1255 = 9.56
    assert ("| w | 4 | 110.00 [100.00–120.00] | 113.00 [105.00–128.00] | 3.00 [3.00–8.00] | 50.00 [50.00–100.00] | "
            "1.00 [0.5–1.00] | 36.4 | 34.7 | 9.56 | preprocessing: 200.00 > 110.00 ms |") in md
    assert bound_cell(("copy", 1.0, 12.0, 10.0)) == "copy: 12.00 > 10.00 ms"
    assert bound_cell(("gpu", 1.0, 0.5, 10.0)) == "gpu: 10.00 ms > prep 1.00 / copy 0.5 ms"
    assert bound_cell((None, None, None, 50.0)) == "–"


def test_partial_case_line():
    info = {"a": {"name": "a"}, "t": {"name": "t", "partial": True, "repeats_done": 5, "repeats_planned": 100000,
                                      "profiled": False}}
    assert partial_lines(info) == ["- **Partial case t**: interrupted after 5 of 100000 timed repeats, no profiled "
                                   "request (no kernels, busy or idle); its medians and spreads are over those "
                                   "repeats.", ""]
    assert partial_lines({"a": {"name": "a"}}) == []


def test_stop_line_counts_a_partial_case():
    from harness.stopping import kept_text, stop_line
    from harness.interrupts import RunInterrupted
    import signal

    part = [{"name": "t", "partial": True, "repeats_done": 5, "repeats_planned": 100000, "profiled": False}]
    assert kept_text(2, part) == ("1 finished case(s) and 1 partial case (t: 5 of 100000 timed repeats, "
                                  "no profiled request)")
    assert kept_text(2) == "2 finished case(s)"
    line = stop_line("interrupted", RunInterrupted(signal.SIGINT), "interrupted by SIGINT during case t (2 of 2), "
                     "repeat=5", 2, "runs/x", [], True, part)
    assert line == ("interrupted: SIGINT during case t (2 of 2), repeat=5; 1 finished case(s) and 1 partial case "
                    "(t: 5 of 100000 timed repeats, no profiled request) kept in runs/x")


# ------------------------------------------------------------------- the runner on the tiny model

@pytest.fixture(scope="module")
def tiny():
    """(model, make_request) of the tiny config on the CPU, fp32; requests of 5 tokens (4 decode steps)."""
    import yaml

    from harness import workload as wl
    from harness.config import ModelConfig, from_dict
    from harness.models.build import build_model

    cfg = from_dict(ModelConfig, yaml.safe_load((ROOT / "conf/model/tiny.yaml").read_text()))
    model = build_model(cfg, torch.device("cpu"), torch.float32, seed=0)
    mode = {"name": "t", "base_size": 128, "image_size": 64, "crop": True}
    pages = [wl.Page("p", wl.synthetic_page(0, size=(300, 200)), "synthetic:0")]

    def make(i):
        return wl.build_request(pages, mode, decode_tokens=5), {"prep_ms": 2.0, "h2d_ms": 1.0}

    return model, make


def _measure(tiny, at=lambda request: None, **measure):
    from harness.measure.runner import MeasureConfig, measure_case

    model, make = tiny
    return measure_case(model, make, MeasureConfig(**measure), {"case": "t", "mode": "t", "grid": None, "batch": 1},
                        False, progress=lambda m: None, at=at)


def test_short_warm_up_short_profile_and_the_call_timed(tiny, monkeypatch):
    """warmup_tokens=2: the warm-up request decodes 1 step (2 tokens); profile_steps=2: the profiled
    request 2 steps (3 tokens) while the timed ones run 4; each timed call encloses its request range."""
    model, _ = tiny
    steps = []
    real = type(model).next_token
    monkeypatch.setattr(type(model), "next_token", lambda self, *a, **k: steps.append(1) or real(self, *a, **k))
    seen = []
    m = _measure(tiny, at=lambda request: seen.append((request, len(steps))), warmup=1, warmup_tokens=2, repeats=2,
                 kernels=True, profile_steps=2)
    # next_token calls before each request: warm-up 0, then +1 (warm-up), +4, +4 (timed), profiled +2 after
    assert seen == [("warmup=0", 0), ("repeat=0", 1), ("repeat=1", 5), ("repeat=profiled", 9)] and len(steps) == 11
    obs = m.observations
    dec = obs[obs["stage"] == "decode"].set_index("repeat")
    assert dec["decode_steps"].tolist() == [4, 4, 2] and dec["profiled"].tolist() == [False, False, True]
    req = obs[(obs["stage"] == "request") & ~obs["profiled"]]
    # the request range lies inside the call (one host clock on a CPU): set-up + collection >= 0, = call - e2e
    assert (req["setup_collect_ms"] >= 0).all()
    assert (req["setup_collect_ms"] == req["call_ms"] - req["e2e_ms"]).all()
    assert (req["prep_ms"] == 2.0).all() and (req["ttft_e2e_ms"] == 3.0 + req["ttft_ms"]).all()
    assert m.timed_wall_ms >= req["call_ms"].sum() and not m.partial and m.entry() == {
        "timed_wall_ms": round(m.timed_wall_ms, 3)}
    assert summarize(obs).step_scale("t") == 2.0          # 4 timed steps / 2 profiled


class _Signal:
    """``at`` that raises KeyboardInterrupt (what SIGINT raises without the run's guard) at ``where``."""

    def __init__(self, where: str):
        self.where = where

    def __call__(self, request: str) -> None:
        if request == self.where:
            raise KeyboardInterrupt


def test_a_signal_after_finished_repeats_keeps_them(tiny):
    m = _measure(tiny, at=_Signal("repeat=3"), warmup=0, repeats=100000, kernels=True)
    assert m.partial and isinstance(m.stopped, KeyboardInterrupt)
    assert (m.repeats_done, m.repeats_planned, m.profiled, m.timed_wall_ms) == (3, 100000, False, None)
    obs = m.observations
    assert sorted(set(obs["repeat"])) == [0, 1, 2] and not obs["profiled"].any() and not len(m.kernels)
    assert len(m.steps) == 3 * 4 and sorted({s["repeat"] for s in m.steps}) == [0, 1, 2]
    assert m.routing["decode"].sum() > 0
    assert m.entry() == {"timed_wall_ms": None, "partial": True, "repeats_done": 3, "repeats_planned": 100000,
                         "profiled": False}


def test_a_signal_in_the_profiled_request_keeps_the_timed_ones(tiny):
    m = _measure(tiny, at=_Signal("repeat=profiled"), warmup=0, repeats=2, kernels=True)
    assert m.partial and (m.repeats_done, m.profiled) == (2, False) and m.timed_wall_ms is not None
    assert sorted(set(m.observations["repeat"])) == [0, 1] and not m.observations["profiled"].any()


def test_a_signal_before_any_repeat_finished_propagates(tiny):
    with pytest.raises(KeyboardInterrupt):
        _measure(tiny, at=_Signal("repeat=0"), warmup=0, repeats=5)


def test_top_kernels_say_the_profiled_steps(waits, tmp_path):
    from harness.report.sections import top_kernels_section
    from harness.rundir import RunData

    k = pd.DataFrame([{"case": "w", "stage": "decode", "name": "gemm_a", "category": "gemm", "start_ms": 0.0,
                       "dur_ms": 0.5}])
    md = top_kernels_section(RunData(tmp_path, {}, kernels=k), waits)
    assert "Decode: the profiled request's 16 steps (the timed requests run 127; calls and totals are those of the " \
           "profiled steps)." in md
    assert not any(line.startswith("Decode:") for line in top_kernels_section(RunData(tmp_path, {}, kernels=k)))


def test_a_short_call_runs_on_the_cache_of_the_full_budget():
    """A short warm-up or profiled request (``max_new_tokens`` below the request's budget) uses the
    static cache, and the step set up for it, of the full budget: prompt 28 + 40 tokens = 68
    positions -> a 128-position cache (rounded up to 64); the short call alone would need 28 + 2 =
    30 -> 64, a second decoder set up inside the timed requests."""
    import yaml

    from harness import variants, workload as wl
    from harness.config import ExecutionConfig, ModelConfig, from_dict
    from harness.models.build import build_model
    from harness.models.generate import generate

    cfg = from_dict(ModelConfig, yaml.safe_load((ROOT / "conf/model/tiny.yaml").read_text()))
    model = build_model(cfg, torch.device("cpu"), torch.float32, seed=0)
    variants.apply(model, ExecutionConfig(kv_cache="static"), torch.device("cpu"))
    pages = [wl.Page("p", wl.synthetic_page(0, size=(300, 200)), "synthetic:0")]
    req = wl.build_request(pages, {"name": "t", "base_size": 128, "image_size": 64, "crop": True}, decode_tokens=40)
    assert req.prefill_tokens == 28
    short = generate(model, req, max_new_tokens=2)
    assert short.tokens.shape == (1, 2) and list(model.static_decoders) == [(1, 128)]
    full = generate(model, req)
    assert full.tokens.shape == (1, 40) and list(model.static_decoders) == [(1, 128)]
    assert torch.equal(full.tokens[:, :2], short.tokens)     # the same cache, the same first tokens
