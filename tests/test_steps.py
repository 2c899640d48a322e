"""Decode steps at realistic lengths (issue 17): per-step rows (steps.csv), the `preprocess` row,
TPOT per 128-step window in the report, and the reference model's cache and RoPE past 2048 and
past max_position_embeddings (tiny model, CPU)."""
import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from harness.measure.observations import stage_rows, step_rows
from harness.schema.steps import STEP_COLUMNS
from harness.report import steps as S

ROOT = Path(__file__).resolve().parents[1]


def _ranges(rows):
    """A recorder-shaped frame from (range, call, step, start_ms, ms); gpu times equal host times."""
    return pd.DataFrame([{"range": n, "stage": None, "call": c, "step": s, "host_start_ms": t, "host_ms": d,
                          "gpu_start_ms": t, "gpu_ms": d, "peak_mem_bytes": None, "wall_start_ns": int(t * 1e6),
                          "wall_end_ns": int((t + d) * 1e6)} for n, c, s, t, d in rows])


def _request_ranges():
    return _ranges([("request", None, None, 0, 100), ("preprocess", None, None, 0, 20), ("prefill", None, None, 20, 5),
                    ("sam", 0, None, 25, 10), ("clip", 0, None, 35, 10), ("projector", 0, None, 45, 5),
                    ("prefill", None, None, 50, 10), ("decode", None, None, 60, 40)]
                   + [("decode_step", None, i, 60 + 10 * i, 10 - i) for i in range(4)])


def test_step_rows_and_the_preprocess_row():
    ranges = _request_ranges()
    assert step_rows(ranges, 286) == [{"step": i, "kv_len": 287 + i, "gpu_ms": float(10 - i), "host_ms": float(10 - i)}
                                      for i in range(4)]
    host_only = ranges.assign(gpu_ms=None)
    assert [r["gpu_ms"] for r in step_rows(host_only, 7)] == [None] * 4
    rows = {r["stage"]: r for r in stage_rows(ranges, None, 1)}
    assert rows["preprocess"]["gpu_ms"] == 20 and rows["preprocess"]["calls"] == 1
    assert rows["request"]["stage_sum_ms"] == 5 + 10 + 10 + 5 + 10 + 40   # the five stages, not preprocess
    assert rows["request"]["ttft_ms"] == 60 and rows["request"]["e2e_ms"] == 100


def test_preprocess_kernels_are_attributed_to_it():
    from harness.measure.kernels import _Spans

    spans = _Spans(_request_ranges())
    assert spans.lookup(int(10e6)) == ("preprocess", "preprocess", None, None)
    assert spans.lookup(int(61e6)) == ("decode_step", "decode", None, 0)


def _steps():
    """Case a: 300 steps, ms = 1 + step/100 in both repeats; case b: 100 steps of 2 ms. Prefill 10."""
    rows = [{"case": "a", "repeat": r, "step": s, "kv_len": 11 + s, "gpu_ms": 1 + s / 100, "host_ms": 9.0}
            for r in (0, 1) for s in range(300)]
    rows += [{"case": "b", "repeat": 0, "step": s, "kv_len": 11 + s, "gpu_ms": 2.0, "host_ms": 9.0} for s in range(100)]
    return pd.DataFrame(rows, columns=STEP_COLUMNS)


def test_tpot_edges_and_windows_exact():
    """The one median rule (the lower middle) over the pooled repeats: a window of k steps holds each
    step twice (2k values, ascending in pairs), so its lower middle (value k of 2k) is the step at
    offset (k - 1) // 2 of the window: steps 0-127 -> step 63, 1.63 ms; the last 128 (172-299) ->
    step 235, 3.35; all 300 -> step 149, 2.49; windows 128-255 -> step 191, 2.91; 256-299 (44
    steps) -> step 277, 3.77."""
    e = S.tpot_edges(_steps()).set_index("case")
    assert e.loc["a", "steps"] == 300 and e.loc["a", "first_kv"] == "11-138" and e.loc["a", "last_kv"] == "183-310"
    assert e.loc["a", "first_p50_ms"] == pytest.approx(1 + 63 / 100) and e.loc["a", "last_p50_ms"] == pytest.approx(1 + 235 / 100)
    assert e.loc["a", "tpot_p50_ms"] == pytest.approx(1 + 149 / 100)
    assert e.loc["a", "last_over_first"] == pytest.approx(3.35 / 1.63)
    assert e.loc["b", "first_p50_ms"] == e.loc["b", "last_p50_ms"] == 2.0 and e.loc["b", "first_kv"] == "11-110"
    w = S.tpot_windows(_steps())
    assert list(w.index) == ["0-127", "128-255", "256-383"] and list(w.columns) == ["a", "b"]
    assert w["a"].tolist() == pytest.approx([1 + 63 / 100, 1 + 191 / 100, 1 + 277 / 100])
    assert w.loc["0-127", "b"] == 2.0 and w["b"].isna().tolist() == [False, True, True]
    host = _steps().assign(gpu_ms=None)
    assert S.step_time(host) == ("host_ms", "host ms (no CUDA events)")
    assert S.tpot_edges(host)["first_p50_ms"].tolist() == [9.0, 9.0]
    assert not len(S.tpot_edges(pd.DataFrame())) and not S.section(pd.DataFrame())


def test_run_writes_steps_and_the_report_shows_tpot_against_position(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir

    from harness.config import to_config
    from harness.report.report import write_report
    from harness.run import run

    monkeypatch.setenv("HARNESS_CACHE_DIR", str(tmp_path / "cache"))
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=["model=tiny", "workload.decode_tokens=6", "measure.repeats=2",
                                           "workload.mode={name: u, base_size: 128, image_size: 64, crop: false}"])
    rd = run(to_config(cfg), tmp_path / "run", progress=lambda *_: None)
    steps = pd.read_csv(rd.path / "steps.csv")
    assert list(steps.columns) == STEP_COLUMNS and len(steps) == 2 * 5
    assert steps["repeat"].tolist() == [0] * 5 + [1] * 5 and steps["step"].tolist() == list(range(5)) * 2
    prefill = 1 + 3 + 12   # BOS, 1 x 2 + 1 image tokens (no crop: the 64 px image_size view), 12 text tokens
    assert steps["kv_len"].tolist() == [prefill + 1 + s for s in range(5)] * 2
    assert steps["gpu_ms"].isna().all() and (steps["host_ms"] > 0).all()
    md = (rd.path / "report.md").read_text()
    assert "## TPOT against position" in md and "| u | 5 |" in md and "`tpot_vs_position.png`" in md
    assert (rd.path / "tpot_vs_position.png").stat().st_size > 0
    man = json.loads((rd.path / "manifest.json").read_text())
    assert man["model"]["adapter"] == "reference"
    write_report(rd.path, strict=True)   # read back from the files: the same section

    def section(text):
        return text.split("## TPOT against position")[1].split("\n## ")[0]
    assert section((rd.path / "report.md").read_text()) == section(md)


@pytest.mark.parametrize("filled", [2100, 8200])
def test_reference_cache_and_rope_past_2048_and_past_max_positions(tiny_cfg, filled):
    """Teacher forcing at long positions: a prefill of ``filled`` tokens plus 4 decode steps gives
    the last logits of one prefill over all ``filled + 4`` tokens (KV cache and RoPE agree at
    positions up to 8,203 > max_position_embeddings 8,192). The last step's RoPE ran at position
    ``filled + 3`` (read from the model's rotary modules) with cos = cos(position x theta^(-2i/d))."""
    from harness.models.build import build_model
    from harness.models.llm import KVCache, RotaryEmbedding

    tiny_cfg.lm_head_all_positions = False
    model = build_model(tiny_cfg, "cpu", torch.float32, seed=0)
    ids = torch.randint(1000, 100000, (1, filled + 4), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros_like(ids, dtype=torch.bool)
    seen = []
    hooks = [m.register_forward_hook(lambda mod, args, out: seen.append((args[1].max().item(), out[0])))
             for m in model.modules() if isinstance(m, RotaryEmbedding)]
    with torch.inference_mode():
        whole = model.prefill(ids, mask, None, KVCache(tiny_cfg.llm.num_layers))[:, -1]
        cache = KVCache(tiny_cfg.llm.num_layers)
        model.prefill(ids[:, :filled], mask[:, :filled], None, cache)
        for i in range(filled, filled + 4):
            last = model.decode_step(ids[:, i:i + 1], cache)[:, -1]
    for h in hooks:
        h.remove()
    position, cos = seen[-1]
    assert cache.length == filled + 4 and position == filled + 3
    assert position >= (tiny_cfg.llm.max_position_embeddings if filled > 8192 else 2048)   # past the edge
    head_dim = cos.shape[-1]
    inv = [tiny_cfg.llm.rope_theta ** (-2 * i / head_dim) for i in range(head_dim // 2)]
    expect = torch.tensor([math.cos(position * f) for f in inv * 2], dtype=torch.float64)
    assert torch.allclose(cos[0, -1].double(), expect, atol=2e-3)         # fp32 angles near 8,000 rad
    assert float((last - whole).norm() / whole.norm()) < 1e-4
