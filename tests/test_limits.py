"""Limits a run meets and what a CPU run says (issue 37 R1, R2, L1), CPU, tiny model.

* R1: a batch that cannot fit is refused by the memory check before any page is drawn or the
  model built (exit 2, one ``error:`` line naming the largest batch that fits); a ``MemoryError``
  is one line and exit 2, never an internal error. Free memory is given (no dependence on the host).
* R2: prompt + decode positions beyond what the model holds are refused, the limit named; a long
  decode reports its progress (steps done of planned, tokens/s, time left) from the host loop's
  count and its own clock (a fake clock here).
* L1: a CPU run's report says ``device: cpu (host clocks)`` where a GPU run's says GPU, with a
  note on its first line.

Expected figures are derived here from the shapes (pixels, channels, bytes), not read from the code.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import main_lines

ROOT = Path(__file__).resolve().parents[1]
TINY_MODE = "workload.mode={name: t, base_size: 128, image_size: 64, crop: true}"
GB = 1e9


def _compose(*overrides: str):
    from hydra import compose, initialize_config_dir

    from harness.config import to_config

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return to_config(compose("config", overrides=list(overrides)))


def _tiny_params(tiny_cfg) -> int:
    """The tiny model's parameters, counted on its tensors (built on the meta device: no memory)."""
    from harness.models.build import build_model

    return sum(p.numel() for p in build_model(tiny_cfg, device="meta", dtype=torch.float32).parameters())


@pytest.fixture
def no_pages(monkeypatch):
    """Drawing a synthetic page fails the test: nothing may be built before the check refuses."""
    from harness import setup

    def drawn(*_a, **_k):
        raise AssertionError("a synthetic page was drawn")

    monkeypatch.setattr(setup, "synthetic_pages", drawn)


# ------------------------------------------------------------------------------------------ R1

def test_a_batch_of_2000_is_refused_before_any_page_is_drawn(tmp_path, monkeypatch, capsys, no_pages, tiny_cfg):
    from harness import memory_check

    monkeypatch.setattr(memory_check, "free_bytes", lambda device: (24_000_000_000, "available RAM (test)"))
    root = tmp_path / "runs"
    rc, lines = main_lines(capsys, ["run", "model=tiny", "workload.batch=2000", "workload.decode_tokens=4",
                                    "hardware.calibrate=false", f"run.root={root}"])
    # per page of the batch (base mode, fp32, one request built: CPU, no warm-up, one repeat)
    page = 1240 * 1754 * 3                    # an A4 page at 150 dpi, decoded RGB, 1 byte per channel
    preprocessed = 2 * 3 * 1024 * 1024 * 4    # its 1024 px float32 view, in the page list and the stacked batch
    kv = 2 * 3 * 4 * 16 * 4 * (286 + 4)       # K and V, 3 layers x 4 heads x 16, fp32, prompt 1+12+273 + 4
    logits = 286 * 129280 * 4                 # lm_head over every prompt position, fp32 (above SAM's 141 MB mask)
    per_page = page + preprocessed + kv + logits
    weights, margin = _tiny_params(tiny_cfg) * 4, 1 << 30
    total = 2000 * per_page + weights + margin
    fits = int((24_000_000_000 - weights - margin) // per_page)
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0] == (f"error: the run needs about {total / GB:.1f} GB ({2000 * page / GB:.1f} GB of pages, "
                        f"{2000 * preprocessed / GB:.1f} GB of preprocessed tensors, {weights / 1e6:.0f} MB of "
                        f"weights, {2000 * kv / 1e6:.0f} MB of KV cache, {2000 * logits / GB:.1f} GB of activations, "
                        f"{margin / GB:.1f} GB of margin) but only 24.0 GB of available RAM (test) is free; fix: lower "
                        f"workload.batch to {fits} or less (case base-b2000 needs about {per_page / 1e6:.0f} MB per "
                        "page of its batch; run.memory_check=false skips this check)")
    assert fits == 126
    (run,) = root.iterdir()
    man = json.loads((run / "manifest.json").read_text())
    assert run.name.endswith("-failed") and man["status"] == "failed" and man["model"] is None   # never built


def test_a_memory_error_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from harness import setup

    def out_of_ram(*_a, **_k):
        raise MemoryError()

    monkeypatch.setattr(setup, "synthetic_pages", out_of_ram)
    rc, lines = main_lines(capsys, ["run", "model=tiny", TINY_MODE, "workload.decode_tokens=2", "run.memory_check=false",
                                    "hardware.calibrate=false", f"run.root={tmp_path / 'runs'}"])
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: out of memory (MemoryError) during case t-2x3 (1 of 1), repeat=0; fix: lower "
                               "workload.batch")
    assert "internal error" not in lines[0]


def test_a_case_that_fits_records_its_parts(tiny_cfg, tiny_mode):
    """The parts of a small case, each from its shape: the tiny crop mode t (128 px view, 2 x 3 tiles of
    64 px) on an A4 page, batch 2, in bf16 on a CPU, three requests built."""
    from harness import workload as wl
    from harness.config import ExecutionConfig, WorkloadConfig
    from harness.memory_check import check_memory
    from harness.setup import CaseInputs

    case = wl.Case(wl.get_mode(tiny_mode), (2, 3), 2, 12, 4)
    inputs = CaseInputs(case, WorkloadConfig(batch=2), ExecutionConfig(), tokenizer=None)
    entry = check_memory(tiny_cfg, torch.device("cpu"), torch.bfloat16, [inputs], free=(8 << 30, "RAM"), requests=3)
    need = entry["need_bytes"]
    px = 3 * (128 * 128 + 6 * 64 * 64)                 # values per row: the global view and six tiles
    assert need["pages"] == 2 * 2 * 1240 * 1754 * 3     # two pages per request, request 0's kept while another is drawn
    assert need["preprocessed"] == 2 * 2 * px * 4       # float32, page list + stacked batch
    assert need["request_on_device"] == 2 * px * 2      # the bf16 copy Request.to makes on a CPU
    assert need["kv_cache"] == 2 * 3 * 4 * 16 * 2 * (1 + 12 + 16 + 4) * 2   # prompt 29 (16 image tokens) + 4, x 2 rows
    assert need["graph_pools"] == 0 and need["held_by_others"] == 0
    assert need["total"] == sum(v for k, v in need.items() if k != "total")


# ------------------------------------------------------------------------------------------ R2

def test_positions_beyond_the_model_are_refused_with_the_limit_named(tmp_path, capsys):
    from harness.errors import HarnessError
    from harness.setup import check_cases, prepare_cases

    # base: 1 BOS + 12 text + 16 x 17 + 1 image tokens = 286; 286 + 7,907 = 8,193 > 8,192
    want = ("8,193 positions (a prompt of 286 tokens + 7,907 decode tokens) exceed the 8,192 the model holds "
            "(model.llm.max_position_embeddings); fix: lower workload.decode_tokens to 7,906 or less")
    cfg = _compose("model=tiny", "workload.decode_tokens=7907")
    for cases in (None, prepare_cases(cfg)[0]):      # from the settings alone, and from the prepared cases
        with pytest.raises(HarnessError) as exc:
            check_cases(cfg, cases)
        assert str(exc.value) == want
    check_cases(_compose("model=tiny", "workload.decode_tokens=7906"))
    # a model with its own limit: the tiny crop mode's prompt is 29 tokens
    with pytest.raises(HarnessError, match=r"^34 positions .* exceed the 32 the model holds "
                                           r"\(model.llm.max_position_embeddings\); fix: lower "
                                           r"workload.decode_tokens to 3 or less$"):
        check_cases(_compose("model=tiny", TINY_MODE, "model.llm.max_position_embeddings=32", "workload.decode_tokens=5"))
    # on the command line: refused before any run directory exists
    root = tmp_path / "runs"
    rc, lines = main_lines(capsys, ["run", "model=tiny", "workload.decode_tokens=100000", f"run.root={root}"])
    assert rc == 2 and lines == ["error: 100,286 positions (a prompt of 286 tokens + 100,000 decode tokens) exceed the "
                                 "8,192 the model holds (model.llm.max_position_embeddings); fix: lower "
                                 "workload.decode_tokens to 7,906 or less"]
    assert not root.exists()


def test_the_vendor_limit_comes_from_its_config(tmp_path):
    from harness.config import ModelConfig
    from harness.setup import position_limit

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192,
                                                      "language_config": {"max_position_embeddings": 4096}}))
    assert position_limit(ModelConfig(name="vendor", path=str(tmp_path))) == (
        4096, f"language_config.max_position_embeddings of {tmp_path / 'config.json'}")
    assert position_limit(ModelConfig()) == (8192, "model.llm.max_position_embeddings")


def test_decode_progress_from_the_host_loop_and_a_clock():
    from harness.report.progress import DecodeProgress, duration_text

    now, said = [100.0], []                # a fake clock: seconds
    watch = DecodeProgress(said.append, every_s=5.0, clock=lambda: now[0])
    watch.label = "t-2x3: repeat=0"
    watch.begin(99, 2)                     # 99 decode steps planned, 2 rows
    for t, done in ((101.0, 1),            # 1 s in: nothing yet
                    (110.0, 20),           # 10 s in: 2 x 20 / 10 = 4.0 tok/s, (99 - 20) x 10 / 20 = 39.5 s left
                    (112.0, 21),           # 2 s after the last report: nothing
                    (125.0, 60)):          # 25 s in: 2 x 60 / 25 = 4.8 tok/s, 39 x 25 / 60 = 16.25 s left
        now[0] = t
        watch.step(done)
    assert said == ["[harness] t-2x3: repeat=0, decode step 20 of 99 done, 4.0 tok/s, about 39 s left",
                    "[harness] t-2x3: repeat=0, decode step 60 of 99 done, 4.8 tok/s, about 16 s left"]
    gpu = DecodeProgress(said.append, issued=True, every_s=5.0, clock=lambda: now[0])
    gpu.label = "b: warmup=0"
    gpu.begin(8191, 1)
    now[0] += 30.0
    gpu.step(300)                          # 10 steps/s: 7,891 steps left in 789.1 s
    assert said[-1] == "[harness] b: warmup=0, decode step 300 of 8,191 issued, 10.0 tok/s, about 13 min 09 s left"
    assert [duration_text(s) for s in (0, 59.9, 200, 7500)] == ["0 s", "59 s", "3 min 20 s", "2 h 05 min"]


# ------------------------------------------------------------------- R2 and L1 on one tiny run

@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny CPU run (2 timed repeats, 4 tokens) whose decode watch reports at every step; its
    progress lines and run directory."""
    from harness import run as run_module
    from harness.report.progress import DecodeProgress

    cfg = _compose("model=tiny", TINY_MODE, "workload.decode_tokens=4", "measure.repeats=2", "hardware.calibrate=false")
    said = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(run_module, "DecodeProgress", functools.partial(DecodeProgress, every_s=0.0))
        rd = run_module.run(cfg, tmp_path_factory.mktemp("limits") / "run", progress=said.append)
    return said, rd.path


def test_the_run_reports_its_decode_steps(tiny_run):
    said, _ = tiny_run
    inside = [ln for ln in said if "decode step" in ln]
    assert [ln.split(" done,")[0] for ln in inside] == [
        f"[harness] t-2x3: repeat={r}, decode step {s} of 3" for r in (0, 1) for s in (1, 2, 3)]
    assert [ln for ln in said if ln.startswith("[harness] t-2x3: repeat=")
            and ", request " in ln][0].startswith("[harness] t-2x3: repeat=0 (1 of 2), request ")


def test_a_cpu_report_says_cpu_where_a_gpu_report_says_gpu(tiny_run, tiny_cfg):
    from harness.report.sections import user_wait_section

    _, path = tiny_run
    lines = (path / "report.md").read_text().splitlines()
    assert lines[0].startswith("# Run report: ") and lines[1] == ""
    assert lines[2].startswith("> **device: cpu (host clocks).**") and "say little about a GPU" in lines[2]
    md = "\n".join(lines)
    assert "GPU pages/s" not in md and "| gpu: " not in md
    assert "| device: cpu (host clocks) pages/s (derived, batch x repeats / sum of calls) |" in md
    row = next(ln for ln in lines if ln.startswith("| t-2x3 | t | 2x3 |"))
    assert row.split(" | ")[-1].startswith("device: cpu (host clocks): ")   # bound by
    assert "| repeat=0 |" in row or "| repeat=1 |" in row                     # the median request, counted from 0
    assert f"model `tiny` (reference, {_tiny_params(tiny_cfg):,} parameters) with random weights" in md   # L2
    head = pd.read_csv(path / "headline.csv")
    assert "GPU pages/s" in "\n".join(user_wait_section(head))                  # the same table of a GPU run
    assert "GPU pages/s" not in "\n".join(user_wait_section(head, cpu=True))


def test_torch_cpu_allocator_running_out_is_one_line():
    """torch's CPU allocator raises a RuntimeError, not a MemoryError, when it cannot allocate (seen with
    ``ulimit -v``: 'DefaultCPUAllocator: can't allocate memory: you tried to allocate 805306368 bytes'):
    it is the same one-line error as a MemoryError; another RuntimeError stays what it is."""
    from harness.errors import HarnessError
    from harness.memory_check import out_of_memory

    oom = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 805306368 bytes. Error code 12 (Cannot allocate memory)")
    err = out_of_memory(oom, "case base-b64 (1 of 1), repeat=0")
    assert isinstance(err, HarnessError)
    assert err.problem == "out of memory (torch's CPU allocator) during case base-b64 (1 of 1), repeat=0"
    assert "workload.batch" in err.fix
    other = RuntimeError("shape mismatch")
    assert out_of_memory(other, "x") is other
    assert isinstance(out_of_memory(MemoryError(), "x"), HarnessError)
