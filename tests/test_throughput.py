"""The throughput pipeline (issue 25): the window arithmetic, wasted decode slots and the bound rule
on checked-in numbers (tests/data/throughput: three batches of 4 pages in a 2 s window, two
workers), the page plan, and ``python -m harness run +experiment=throughput`` end to end on the
tiny model: bad input (exit 2, one line, no model built), a complete CPU run with its files, and
SIGINT during the second configuration's window keeping the first.

The subprocesses start with the session's background runs (tests/conftest.py), as tests/test_cli.py's do.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from harness import layout
from harness.config import ThroughputConfig, TokensConfig
from harness.errors import HarnessError
from harness.throughput import plan
from harness.schema.throughput import COLUMN_NAMES
from harness.throughput.window import bound, summarize, wasted_fraction
from test_faults import harness  # noqa: E402 - the CLI as a subprocess, with an optional injected fault

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "throughput"
TINY = ["+experiment=throughput", "model=tiny", "workload.mode={name: t, base_size: 128, image_size: 64, crop: true}"]
# small synthetic pages (quick to draw), one layout in the tiny mode (2x3)
FAST = [*TINY, "workload.decode_tokens=3", "workload.page_size=[160,240]", "throughput.pages=4",
        "throughput.window_pages=2"]


def _window():
    return tuple(pd.read_csv(DATA / f) for f in ("batches.csv", "spans.csv", "prep.csv"))


# --------------------------------------------------------------------------- window arithmetic

def test_window_row_from_checked_in_numbers():
    batches, spans, prep = _window()
    row = summarize(batches, spans, prep, window_s=2.0, workers=2, peak_mem_bytes=123)
    approx = pytest.approx
    # 3 batches x 4 pages in 2 s
    assert row["window_batches"] == 3 and row["window_pages"] == 12
    assert row["pages_s"] == approx(12 / 2.0)
    # useful tokens 100 + 160 + 40 = 300; slots 4 x 40 + 4 x 40 + 4 x 25 = 420
    assert row["decode_tok_s"] == approx(300 / 2.0)
    assert row["slot_tok_s"] == approx(420 / 2.0)
    assert row["wasted_decode_slots"] == approx((420 - 300) / 420)
    # every batch: sam 100, clip 50, projector 10 (batch 3 in two parts of 5), prefill 40, decode 400 ms
    for stage, ms in (("sam", 100), ("clip", 50), ("projector", 10), ("prefill", 40), ("decode", 400)):
        assert row[f"{stage}_ms"] == approx(ms), stage
    assert row["batch_ms"] == approx(600)
    assert row["gpu_busy"] == approx(3 * 0.6 / 2.0)
    # pages that finished inside [0, 2]: 0.6, 0.3, 0.4 and 0.2 s of worker time -> 375 ms a page
    assert row["prep_ms_page"] == approx(375)
    assert row["prep_pages_s"] == approx(2 * 1000 / 375)
    # busy inside the window: 0.1 + 0.3 + 0.4 + 0.2 + 0.1 (the page running past the end) = 1.1 of 2 x 2 s
    assert row["prep_busy"] == approx(1.1 / 4)
    # copies of 4, 5 and 6 ms for 3 x 4 MB; the first ran before the window
    assert row["h2d_ms"] == approx(5)
    assert row["h2d_gbs"] == approx(12e6 / 0.015 / 1e9)
    assert row["copy_busy"] == approx((0.005 + 0.006) / 2.0)
    assert row["wait_s"] == approx(0.05)
    assert row["peak_mem_bytes"] == 123
    assert row["experts_step"] == 12                   # median of the batches' 10, 20, 12
    # device busy 90% >= 85%: saturated, decode has the largest share (400 of 600 ms)
    assert row["bound"] == "decode"
    assert set(row) <= set(COLUMN_NAMES)


def test_wasted_slots_by_hand():
    one = pd.DataFrame({"size": [2], "budget_max": [100], "budget_sum": [150]})
    assert wasted_fraction(one) == pytest.approx(50 / 200)          # one page idles for 50 of its 100 slots
    same = pd.DataFrame({"size": [8, 1], "budget_max": [512, 512], "budget_sum": [8 * 512, 512]})
    assert wasted_fraction(same) == 0.0                             # fixed budgets waste nothing


@pytest.mark.parametrize("busy, stage_ms, expected", [
    ((0.97, 0.10, 0.60), {"decode": 900}, "preprocessing"),        # workers saturated, the device waits
    ((0.20, 0.90, 0.50), {"decode": 900}, "copy"),
    ((0.30, 0.05, 0.95), {"sam": 30, "clip": 10, "projector": 2, "prefill": 5, "decode": 40}, "vision"),
    ((0.30, 0.05, 0.95), {"sam": 3, "clip": 1, "projector": 1, "prefill": 50, "decode": 40}, "prefill"),
    ((0.84, 0.50, 0.20), {"decode": 900}, "host"),                  # nothing at 85%
    ((0.90, 0.10, 0.90), {"decode": 900}, "decode"),                # a tie goes to the device
])
def test_bound_rule(busy, stage_ms, expected):
    prep, copy, gpu = busy
    assert bound(prep, copy, gpu, stage_ms) == expected


# -------------------------------------------------------------------------------- page plan

def test_budgets_fixed_and_seeded():
    assert plan.page_budgets(3, 512, None) == [512, 512, 512]
    spec = TokensConfig(mean=620, spread=150, seed=0)
    draws = plan.page_budgets(2000, 512, spec)
    assert min(draws) >= 470 and max(draws) <= 770
    assert draws == plan.page_budgets(2000, 512, spec)                          # seeded
    assert draws != plan.page_budgets(2000, 512, TokensConfig(620, 150, 1))
    # uniform on 470..770: mean 620, sd 301 / sqrt(12) = 86.9; 2000 draws: standard error 1.9
    assert abs(np.mean(draws) - 620) < 10


def test_batch_stream_keeps_layouts_apart_and_pages_distinct():
    # layouts as the tiny mode gives the cycled synthetic sizes: A 2x3, B 3x2, C 1x3
    groups = {"A": [0, 1, 5, 6], "B": [2, 4, 7, 9], "C": [3, 8]}
    stream = plan.batch_stream(groups, 2)
    # cycling 0..9: 0,1 fill A; 2 waits in B; 3 in C; 4 fills B; 5,6 fill A; 7 in B; 8 fills C; 9 fills B
    assert [next(stream) for _ in range(5)] == [[0, 1], [2, 4], [5, 6], [3, 8], [7, 9]]
    for batch in (next(stream) for _ in range(40)):
        assert len(set(batch)) == 2


def test_batch_groups_leave_out_small_layouts_and_refuse_when_none_is_left():
    src = [plan.PageSource(i, f"p{i}", "", (1, 1), (2, 3) if i < 3 else (3, 2), 1) for i in range(4)]
    kept, notes = plan.batch_groups(src, 3)
    assert kept == {(2, 3): [0, 1, 2]} and len(notes) == 1 and "1 page(s) of layout 3x2 left out" in notes[0]
    with pytest.raises(HarnessError, match="needs 4 distinct pages of one layout; the largest layout group has 3"):
        plan.batch_groups(src, 4)


@pytest.mark.parametrize("override, expect", [
    ("throughput.tokens={mean: 620, spread: 150, seed: 1}", ("tokens", TokensConfig(620, 150, 1))),
    ("throughput.tokens.mean=700", ("tokens", TokensConfig(700, 0, 0))),
    ("throughput.execution={vision_compile: false}", ("vision_compile", False)),
])
def test_nested_throughput_overrides_compose(override, expect):
    from harness.cli import check_overrides

    t = check_overrides(["+experiment=throughput", "model=tiny", override]).throughput
    key, value = expect
    assert (t.tokens if key == "tokens" else t.execution.vision_compile) == value
    assert plan.resolve(t, False).tokens == (value if key == "tokens" else None)   # mean 0: the fixed budget


def test_a_spread_without_a_mean_is_refused():
    from harness.cli import check_overrides

    with pytest.raises(HarnessError, match="spread 150 / seed 0 without a mean.*fix: set throughput.tokens.mean too"):
        check_overrides(["+experiment=throughput", "model=tiny", "throughput.tokens.spread=150"])


def test_overlap_vision_with_the_vendor_model_is_refused_before_any_build():
    """model=vendor runs the vendor's own code, which takes no embeddings computed ahead: one line, from the
    experiment's check (no model built, no worker started)."""
    from harness.cli import check_overrides
    from harness.throughput.pipeline import Throughput

    cfg = check_overrides(["+experiment=throughput", "model=vendor", "throughput.overlap_vision=true"], verb="analyze")
    with pytest.raises(HarnessError, match="^throughput.overlap_vision hands the next batch's image embeddings to the "
                                           "harness's model; model=vendor runs the vendor's own code; fix: leave "
                                           "overlap_vision off$"):
        Throughput.check(cfg)


def test_device_defaults():
    gpu, cpu = plan.resolve(ThroughputConfig(), True, 16), plan.resolve(ThroughputConfig(), False, 2)
    assert gpu.batches == (1, 8, 32, 64) and gpu.window_s == 30 and gpu.workers == 8 and gpu.best
    assert cpu.batches == (1, 2) and cpu.window_s == 0 and cpu.workers == 1 and not cpu.best


def test_best_execution_is_the_named_best_with_execution_knobs_on_top():
    from harness.cli import check_overrides
    from harness.config import ExecutionOverrides, HarnessConfig
    from harness.throughput.execution import execution_for

    named = check_overrides(["execution=best"], verb="analyze").execution       # conf/execution/best.yaml
    cfg = check_overrides(["+experiment=throughput", "model=tiny", "execution.decode_attention=sdpa",
                           "execution.moe_kernel=torch"], verb="analyze")
    m = execution_for(cfg, best=True, cache_len=832)
    assert m == dataclasses.replace(named, moe_kernel="torch", static_cache_len=832)
    # by hand: the knobs of optimize.yaml's best row, which the throughput experiment read before
    assert (m.kv_cache, m.moe_impl, m.cuda_graphs, m.compile, m.prefill_graphs, m.linear_impl, m.vision_impl,
            m.vision_compile) == ("static", "grouped", "decode", True, True, "fused", "fused", True)
    assert m.decode_attention == "triton"          # execution.decode_attention=sdpa is the default: best's stays
    assert m.moe_kernel == "torch"                 # an execution.* knob that differs from its default wins
    cfg.throughput.execution = ExecutionOverrides(vision_compile=False)     # throughput.execution over best
    assert not execution_for(cfg, best=True, cache_len=832).vision_compile
    plain = check_overrides(["+experiment=throughput", "model=tiny"], verb="analyze")
    assert execution_for(plain, best=False, cache_len=832) == plain.execution     # off: execution.* as given
    with pytest.raises(HarnessError, match="^throughput.best needs the named execution best, which this config does "
                                           r"not load \(executions: none\); fix: compose \+experiment=throughput"):
        execution_for(HarnessConfig(throughput=ThroughputConfig()), best=True, cache_len=832)   # built by hand


def test_a_knob_override_is_checked_over_best_not_alone():
    """execution.sam_attention=triton needs vision_impl=fused, which best sets: in the throughput
    experiment (best on) the CLI checks the layered execution, so it is accepted; alone (best off, or
    outside the experiment) it is refused in one line."""
    from harness.cli import check_overrides
    from harness.setup import check_cases
    from harness.throughput.pipeline import EXPERIMENT

    cfg = check_overrides(["+experiment=throughput", "model=tiny", "execution.sam_attention=triton",
                           "throughput.best=true"], verb="analyze")
    ex = EXPERIMENT.execution_of(cfg, cfg.execution)
    assert (ex.vision_impl, ex.sam_attention, ex.kv_cache) == ("fused", "triton", "static")
    with pytest.raises(HarnessError, match="^execution.cuda_graphs=decode needs a CUDA device"):  # best on a CPU
        check_cases(cfg, device=torch.device("cpu"), execution_of=EXPERIMENT.execution_of)
    case = dataclasses.replace(cfg.execution, decode_attention="sdpa", moe_kernel="torch")   # a case's own execution
    layered = EXPERIMENT.execution_of(cfg, case)
    assert layered.moe_kernel == "torch"           # the case's knob that differs from its default wins
    assert layered.decode_attention == "triton"    # sdpa is the default: best's triton stays (docs/throughput.md)
    cfg.throughput.best = False
    assert EXPERIMENT.execution_of(cfg, cfg.execution) == cfg.execution
    with pytest.raises(HarnessError, match="^execution.sam_attention=triton needs vision_impl=fused"):
        check_cases(cfg, device=torch.device("cpu"), execution_of=EXPERIMENT.execution_of)


def test_a_default_valued_knob_that_best_would_shadow_is_refused():
    """Under throughput.best, execution.sam_attention=sdpa (the knob's default) is not a change, so best's
    triton would run: the run verb refuses it in one line naming throughput.execution.sam_attention=sdpa;
    that spelling, a knob best leaves at its default and best off all pass the check."""
    from harness.cli import check_overrides
    from harness.throughput.pipeline import EXPERIMENT

    base = ["+experiment=throughput", "model=tiny", "throughput.best=true"]
    cfg = check_overrides(base + ["execution.sam_attention=sdpa"], verb="analyze")
    with pytest.raises(HarnessError, match=r"^execution.sam_attention=sdpa is the knob's default, which does not "
                                           r"override the named execution best's sam_attention=triton under "
                                           r"throughput.best; fix: write throughput.execution.sam_attention=sdpa"):
        EXPERIMENT.check_overrides(cfg, base + ["execution.sam_attention=sdpa"])
    with pytest.raises(HarnessError, match="^execution.prefill_logits=all is the knob's default"):
        check_overrides(base + ["execution.prefill_logits=all"], verb="run")            # the CLI's check
    spelled = check_overrides(base + ["throughput.execution.sam_attention=sdpa"], verb="analyze")
    EXPERIMENT.check_overrides(spelled, base + ["throughput.execution.sam_attention=sdpa"])
    EXPERIMENT.check_overrides(cfg, base + ["execution.pdl=false"])                 # best leaves pdl at its default
    cfg.throughput.best = False
    EXPERIMENT.check_overrides(cfg, base + ["execution.sam_attention=sdpa"])           # best off: honoured as given


# -------------------------------------------------------------------------- end to end (CLI)

def start_runs(tmp_path_factory, submit) -> dict:
    """Every run, started with the session's background runs (tests/conftest.py); id -> Future[Result]."""
    from PIL import Image

    tmp = tmp_path_factory.mktemp("throughput")
    one = tmp / "one-page"
    one.mkdir()
    Image.new("RGB", (120, 180), (250, 250, 250)).save(one / "p001.png")
    jobs = {
        "complete": (FAST, None),
        "balanced": ([*FAST, "workload.routing=balanced", "workload.routing_seed=3"], None),
        "device-prep": ([*FAST, "execution.preprocess=device"], None),
        "overlap": ([*FAST, "throughput.overlap_vision=true", "throughput.window_pages=6"], None),
        "sigint": (FAST, "signal:SIGINT@case=2,window"),
        "workers0": ([*TINY, "throughput.workers=0"], None),
        "batch-over-pages": ([*TINY, "throughput.pages=4", "throughput.batches=[1,8]"], None),
        "one-page-folder": ([*TINY, f"workload.images={one}"], None),
    }
    return {k: submit(harness, tmp / k, ov, fault) for k, (ov, fault) in jobs.items()}


def _manifest(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())


@pytest.mark.parametrize("job, text", [
    ("workers0", "error: throughput.workers=0 is below its minimum 1; fix: set throughput.workers to 1 or more"),
    ("batch-over-pages", "error: throughput.batches=[1, 8]: a batch of 8 pages is larger than the 4 distinct pages "
                         "(throughput.pages); fix: set throughput.pages=8 or more, or lower the batch"),
])
def test_bad_settings_fail_before_any_run_directory(runs, job, text):
    res = runs[job].result()
    assert res.rc == 2, res.describe()
    assert res.line() == text
    assert not res.root.exists() or not any(res.root.iterdir())


def test_a_folder_of_one_page_fails_before_the_model_is_built(runs):
    res = runs["one-page-folder"].result()
    assert res.rc == 2, res.describe()
    line = res.line()
    assert line.startswith("error: workload.images=") and "holds 1 page: a throughput window needs distinct pages; " \
        "fix: add pages to the folder" in line
    d = res.only_dir()
    man = _manifest(d)
    assert man["status"] == "failed" and man["model"] is None and d.name.endswith("-failed")


def test_cpu_run_writes_every_file(runs):
    res = runs["complete"].result()
    assert res.rc == 0, res.describe()
    d = res.only_dir()
    man = _manifest(d)
    assert man["status"] == "complete"
    for f in ("throughput.csv", "throughput.md", "report.md", "throughput.png", "throughput_timeline.png",
              "throughput_batches.csv", "throughput_spans.csv", "throughput_prep.csv"):
        assert (d / f).is_file() and (d / f).stat().st_size > 0, f
    table = pd.read_csv(d / "throughput.csv")
    assert list(table.columns) == COLUMN_NAMES
    assert list(table["config"]) == ["b1", "b2"] and list(table["batch"]) == [1, 2]
    assert (table["window_pages"] >= 2).all()
    assert np.allclose(table["pages_s"], table["window_pages"] / table["window_s"])
    assert set(table["bound"]) <= {"preprocessing", "copy", "vision", "prefill", "decode", "host"}
    assert (table["wasted_decode_slots"] == 0).all()           # fixed budgets
    batches = pd.read_csv(d / "throughput_batches.csv", dtype={"pages": str})
    for pages in batches["pages"]:
        ids = pages.split("+")
        assert len(set(ids)) == len(ids)                        # distinct pages in every batch
    assert set("+".join(batches["pages"]).split("+")) <= {"0", "1", "2", "3"}
    md = (d / "report.md").read_text()
    assert "## Throughput (sustained pipeline)" in md and "200k pages/day" in md and "| b2 | 2 |" in md


# the tiny model (conf/model/tiny.yaml): 8 routed experts, top-2 per token
TINY_EXPERTS, TINY_TOP_K = 8, 2


@pytest.mark.parametrize("job, label", [("complete", "weights"), ("balanced", "balanced (seed 3)")])
def test_routing_is_applied_and_its_experts_counted(runs, job, label):
    res = runs[job].result()
    assert res.rc == 0, res.describe()
    table = pd.read_csv(res.only_dir() / "throughput.csv")
    assert list(table["routing"]) == [label, label]
    # one row routes each token to top-k distinct experts; two rows to top-k .. 2 x top-k of the 8
    assert table["experts_step"].iloc[0] == TINY_TOP_K
    assert TINY_TOP_K <= table["experts_step"].iloc[1] <= min(2 * TINY_TOP_K, TINY_EXPERTS)
    md = (res.only_dir() / "report.md").read_text()
    assert f"| b1 | 1 | {label} |" in md


def test_staged_request_carries_the_routing():
    from harness.throughput.clock import Marks
    from harness.throughput.staging import Stager
    from harness.measure.nvtx_ranges import NvtxRanges

    class Host:   # the host buffers of one ready batch of 2 pages, 3 tokens (one image token)
        views, tiles, pixels = torch.zeros(2, 3, 4, 4), None, None
        ids, mask = torch.zeros(2, 3, dtype=torch.long), torch.tensor([[False, True, False]] * 2)
        nbytes = 0
        layout = type("L", (), {"image_start": 1})()

    ready = type("R", (), {"host": Host(), "number": 1})()
    case = layout.Case(layout.get_mode("tiny"), None, 2, 1, 4, "b2")
    stager = Stager(torch.device("cpu"), torch.float32, Marks(False), NvtxRanges(False))
    req = stager.stage(ready, case, ["p0", "p1"], "", "balanced", 7).request
    assert (req.routing, req.routing_seed, req.pages) == ("balanced", 7, ["p0", "p1"])


def test_sigint_during_the_window_keeps_the_finished_configuration(runs):
    res = runs["sigint"].result()
    assert res.rc == 130, res.describe()
    d = res.only_dir()
    assert d.name.endswith("-throughput-interrupted")
    assert res.line() == f"interrupted: SIGINT during case b2 (2 of 2), window; 1 finished case(s) kept in {d}"
    man = _manifest(d)
    assert man["status"] == "interrupted" and [c["name"] for c in man["cases"]] == ["b1"]
    assert list(pd.read_csv(d / "throughput.csv")["config"]) == ["b1"]
    assert set(pd.read_csv(d / "throughput_batches.csv")["config"]) == {"b1"}
    md = (d / "report.md").read_text()
    assert "Status **interrupted**" in md and "| b1 | 1 |" in md
    assert (d / "throughput.png").is_file()


def test_device_preprocessing_runs_in_the_pipeline(runs):
    res = runs["device-prep"].result()
    assert res.rc == 0, res.describe()
    d = res.only_dir()
    table = pd.read_csv(d / "throughput.csv")
    assert (table["dev_prep_ms"] > 0).all() and (table["window_pages"] >= 2).all()
    spans = pd.read_csv(d / "throughput_spans.csv")
    copies, preps = spans[spans["range"] == "copy"], spans[spans["range"] == "preprocess"]
    assert len(preps) == len(copies) > 0
    # each batch's device preprocessing starts where its copy ends (one mark), on the same stream
    joined = copies.merge(preps, on=["config", "batch_no"], suffixes=("_copy", "_prep"))
    assert (joined["start_s_prep"] == joined["end_s_copy"]).all() and (joined["end_s_prep"] >= joined["start_s_prep"]).all()
    # 8-bit pages over the bus: a 160 x 240 page is 115,200 bytes (its float32 view alone, 3 x 128^2 x 4, is
    # 196,608); the rest of a row is its prompt (int64 ids + bool mask: 9 bytes a token)
    batches = pd.read_csv(d / "throughput_batches.csv")
    per_row = (batches["copy_bytes"] / batches["size"]).unique()
    assert len(per_row) == 1 and (per_row[0] - 160 * 240 * 3) % 9 == 0 and 0 < per_row[0] - 160 * 240 * 3 < 9 * 300
    assert _manifest(d)["cases"][0]["execution"]["preprocess"] == "device"


def test_overlap_vision_computes_the_next_batch_ahead(runs):
    """throughput.overlap_vision on the CPU (one stream: the same calls in order): the first window batch
    of each configuration runs its vision inside its own request range (what the last warm-up batch
    launched is dropped), every later one before its request starts (launched as the batch before it
    opened its decode); every window batch has two sam spans, as without the knob (the tiny crop mode's
    pages have tiles: one sam call for the tiles, one for the global view); GPU busy is the union (<= 100%)."""
    res = runs["overlap"].result()
    assert res.rc == 0, res.describe()
    d = res.only_dir()
    assert _manifest(d)["throughput"]["overlap_vision"] is True
    table = pd.read_csv(d / "throughput.csv")
    assert (table["gpu_busy"] <= 1.0).all() and (table["window_pages"] >= 6).all()
    spans = pd.read_csv(d / "throughput_spans.csv")
    for config, sp in spans.groupby("config"):
        req = sp[sp["range"] == "request"].set_index("batch_no")["start_s"]
        sam = sp[sp["range"] == "sam"].groupby("batch_no")
        assert sorted(sam.size().index) == sorted(req.index) and (sam.size() == 2).all(), config
        order = sorted(req.index)
        assert sam.get_group(order[0])["start_s"].min() >= req[order[0]], config
        for n in order[1:]:
            assert sam.get_group(n)["end_s"].max() <= req[n], (config, n)


def test_union_seconds_by_hand():
    """[0, 2] and [1, 3] cover 3 s; [5, 6] adds 1; [-1, 0.5] adds nothing inside [0, 10] beyond [0, 2];
    [9, 12] is cut at 10 (1 s): 5 s in all; an empty interval counts nothing."""
    from harness.throughput.window import union_seconds

    assert union_seconds([0, 1, 5, -1, 9, 4], [2, 3, 6, 0.5, 12, 4], 0.0, 10.0) == 5.0
    assert union_seconds([], [], 0.0, 1.0) == 0.0


def test_staged_8bit_pages_match_the_host_path():
    """A host batch of two 8-bit pages staged on the CPU gives the views the host path builds, bit for bit."""
    import dataclasses

    from harness import workload as wl
    from harness.measure.nvtx_ranges import NvtxRanges
    from harness.preprocess_device import host_pages
    from harness.throughput.clock import Marks
    from harness.throughput.feeder import HostBatch, Layout
    from harness.throughput.prep import PreparedPage
    from harness.throughput.staging import Stager

    pages = [wl.Page(f"p{i}", wl.synthetic_page(i, size=size), "memory") for i, size in enumerate([(600, 800), (500, 900)])]
    ref = [wl.build_request([p], "tiny", decode_tokens=0) for p in pages]
    lay = dataclasses.replace(Layout.of(ref[0]), page_bytes=3 * 600 * 800)   # the larger page
    host = HostBatch(None, lay, 2, pin=False)
    for j, p in enumerate(pages):
        h = host_pages([p], "tiny", decode_tokens=0)
        host.put(j, PreparedPage(j, 0, 0, 0, None, None, h.input_ids[0].numpy(), h.images_seq_mask[0].numpy(),
                                 pixels=np.array(h.pixels[0])))
    assert host.used == 3 * (600 * 800 + 500 * 900) == host.nbytes - 2 * lay.seq * (8 + 1)
    ready = type("R", (), {"host": host, "number": 0, "pages": [0, 1]})()
    case = layout.Case(layout.get_mode("tiny"), None, 2, ref[0].text_tokens, 1, "b2")
    staged = Stager(torch.device("cpu"), torch.float32, Marks(False), NvtxRanges(False)).stage(ready, case, ["p0", "p1"], "")
    assert staged.prep_end is not None and staged.prep_end >= staged.copy_end
    want = torch.cat([r.global_views for r in ref])
    assert torch.equal(staged.request.global_views, want)
    assert torch.equal(staged.request.input_ids, torch.cat([r.input_ids for r in ref]))


def test_stage_mfus_by_hand(monkeypatch):
    """A stage's MFU = the cost model's useful FLOPs of the stage for the batch / its span / the datasheet
    peak: with a cost model that says 5e11 (SAM), 7e11 (CLIP) and 3e11 (prefill) FLOPs per page, batch 2,
    100 ms of sam, 50 ms of clip and 40 ms of prefill per batch on an H200 in bf16 (datasheet dense peak
    989.4 TFLOP/s, roofline.specs): 1e12 / 0.1 s / 989.4e12 = 1.0107%, 1.4e12 / 0.05 s / 989.4e12 =
    2.830%, 6e11 / 0.04 s / 989.4e12 = 1.516%. The prefill's case carries the layout's text tokens."""
    from types import SimpleNamespace

    import harness.analytic.compose as analytic      # analytic.useful_flops reads its workload_costs
    from harness.config import ModelConfig
    from harness.throughput.pipeline import stage_mfus

    seen = []

    def costs(case, cfg, dtype):
        seen.append((case.text_tokens, cfg.prefill_logits))
        return pd.DataFrame([{"family": "TOTAL", "stage": "sam", "flops_useful": 5e11 * case.batch},
                             {"family": "TOTAL", "stage": "clip", "flops_useful": 7e11 * case.batch},
                             {"family": "TOTAL", "stage": "prefill", "flops_useful": 3e11 * case.batch}])
    monkeypatch.setattr(analytic, "workload_costs", costs)
    setup = SimpleNamespace(mode=layout.get_mode("base"), layouts={None: SimpleNamespace(grid=None, text_tokens=12)})
    model = SimpleNamespace(cfg=ModelConfig())
    row = {"sam_ms": 100.0, "clip_ms": 50.0, "prefill_ms": 40.0}
    got = stage_mfus(model, setup, 2, row, {"name": "NVIDIA H200"}, torch.bfloat16)
    assert got["sam_mfu"] == pytest.approx(1e12 / 0.1 / 989.4e12, rel=1e-12)
    assert got["clip_mfu"] == pytest.approx(1.4e12 / 0.05 / 989.4e12, rel=1e-12)
    assert got["prefill_mfu"] == pytest.approx(6e11 / 0.04 / 989.4e12, rel=1e-12)
    assert seen == [(12, "all")]
    stage_mfus(model, setup, 2, row, {"name": "NVIDIA H200"}, torch.bfloat16, {"prefill_logits": "last"})
    assert seen[-1] == (12, "last")          # the cost model counts under the knobs that ran
    assert stage_mfus(model, setup, 2, {**row, "clip_ms": float("nan")}, {"name": "NVIDIA H200"},
                      torch.bfloat16)["clip_mfu"] is None                      # nothing timed
    assert set(stage_mfus(model, setup, 2, row, {"name": "cpu"}, torch.bfloat16).values()) == {None}   # no peak
    two = SimpleNamespace(mode=layout.get_mode("gundam"), layouts={(2, 3): SimpleNamespace(grid=(2, 3), text_tokens=12),
                                                                   (3, 2): SimpleNamespace(grid=(3, 2), text_tokens=12)})
    assert set(stage_mfus(model, two, 2, row, {"name": "NVIDIA H200"}, torch.bfloat16).values()) == {None}


@pytest.mark.gpu
@pytest.mark.parametrize("vision_impl", ["vendor", "fused"])
def test_gpu_vision_ahead_on_its_stream_gives_the_same_tokens(vision_impl):
    """On CUDA (tiny model, fp32, TF32 off, static cache): batch B's vision launched on a stream of its own as batch A's
    decode opens (``ahead.launch`` / ``ahead.use``, as throughput.overlap_vision runs them; with
    vision_impl=fused the stages replay their CUDA graphs there) gives B the greedy tokens of a plain
    generate, and A's tokens are unchanged."""
    import contextlib
    from types import SimpleNamespace

    from conftest import TINY_MODE, load_tiny_cfg
    from harness import variants
    from harness import workload as wl
    from harness.config import ExecutionConfig
    from harness.measure.nvtx_ranges import NvtxRanges
    from harness.models.build import build_model
    from harness.models.generate import generate
    from harness.throughput.ahead import launch, use
    from harness.throughput.clock import Marks

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = build_model(load_tiny_cfg(), "cuda", torch.float32, seed=0)
    variants.apply(model, ExecutionConfig(kv_cache="static", vision_impl=vision_impl))   # the engine's first token
    a, b = (wl.build_request([wl.Page(f"p{i}", wl.synthetic_page(i, size=(200, 300)), "s")], TINY_MODE,
                             decode_tokens=6).to("cuda", torch.float32) for i in (0, 1))
    ref_a, ref_b = generate(model, a).tokens, generate(model, b).tokens
    held = []

    def stage(name, **_):
        if name == "decode":
            held.append(launch(model, SimpleNamespace(request=b), SimpleNamespace(wait=lambda s: None),
                               Marks(True), NvtxRanges(False), torch.cuda.Stream()))
        return contextlib.nullcontext()

    got_a = generate(model, a, stage).tokens
    got_b = generate(model, use(held[0], b, True)).tokens
    assert torch.equal(got_a, ref_a) and torch.equal(got_b, ref_b)
