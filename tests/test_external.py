"""ncu / nsys command builders and parsers (no profiler needed)."""
from pathlib import Path

import pandas as pd
import pytest

from harness.config import HarnessConfig, from_dict
from harness.external import child_command
from harness.external.ncu import METRICS, flops_columns, ncu_command, nvtx_filter, parse_raw_csv
from harness.external.ncu_session import compare_stage
from harness.external.nsys import nsys_command, parse_stats_csv


def test_nvtx_filter_is_push_pop_stack_in_harness_domain():
    assert nvtx_filter("decode") == "harness@request/decode/"
    cmd = ncu_command("sam", ["python", "-m", "harness", "run"], Path("r"), launch_count=10)
    i = cmd.index("--nvtx-include")
    assert cmd[i + 1] == "harness@request/sam/"
    assert cmd[cmd.index("--clock-control") + 1] == "none"
    assert cmd[cmd.index("--launch-count") + 1] == "10"
    assert set(cmd[cmd.index("--metrics") + 1].split(",")) == set(METRICS)
    assert cmd[-4:] == ["python", "-m", "harness", "run"]


def test_nsys_command_captures_stage_range():
    cmd = nsys_command("decode", ["python", "x.py"], Path("rep"))
    assert "--capture-range=nvtx" in cmd and "--nvtx-capture=decode@harness" in cmd
    assert cmd[cmd.index("-t") + 1] == "cuda,nvtx"


def test_child_command_drops_profile_keys_and_disables_torch_profiler():
    cmd = child_command(from_dict(HarnessConfig, {"profile": {"decode_tokens": 4}}), Path("/tmp/c"),
                        ["tool=ncu", "stage=sam", "model=tiny", "run.root=/x"])
    assert "tool=ncu" not in cmd and "stage=sam" not in cmd and "run.root=/x" not in cmd
    assert "model=tiny" in cmd and "measure.kernels=false" in cmd and "workload.decode_tokens=4" in cmd
    assert "run.root=/tmp/c" in cmd


RAW = '''"ID","Process ID","Kernel Name","Stream","Block Size","Grid Size","dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum","sm__ops_path_tensor_src_bf16_dst_fp32.sum","smsp__sass_thread_inst_executed_op_ffma_pred_on.sum","smsp__sass_thread_inst_executed_op_fadd_pred_on.sum","smsp__sass_thread_inst_executed_op_fmul_pred_on.sum","smsp__sass_thread_inst_executed_op_hfma_pred_on.sum","smsp__sass_thread_inst_executed_op_hadd_pred_on.sum","smsp__sass_thread_inst_executed_op_hmul_pred_on.sum"
"","","","","","","byte","byte","ns","","inst","inst","inst","inst","inst","inst"
"0","7","nvjet_gemm","7","(384, 1, 1)","(2, 64, 1)","16,799,232","309,248","25,728","17,179,869,184","0","0","0","0","0","0"
"1","7","silu_kernel","7","(128, 1, 1)","(64, 1, 1)","1,000","2,000","1,500","0","10","20","30","1","2","3"
'''


def test_parse_raw_csv_and_flops():
    df = flops_columns(parse_raw_csv("==PROF== noise\n" + RAW))
    assert list(df["kernel"]) == ["nvjet_gemm", "silu_kernel"]
    assert df.loc[0, "tensor_flops"] == 2 * 2048 ** 3
    assert df.loc[0, "dram_bytes"] == 16_799_232 + 309_248
    # fp32: ffma 2 + fadd 1 + fmul 1; fp16: hfma 2 + hadd 1 + hmul 1
    assert df.loc[1, "vector_flops"] == 10 * 2 + 20 + 30 + 1 * 2 + 2 + 3
    assert df.loc[1, "duration_ns"] == 1500


def test_compare_stage_ratios():
    df = flops_columns(parse_raw_csv(RAW))
    row = compare_stage(df, {"sam": {"tensor_flops": 2 * 2048 ** 3, "vector_flops": 100, "bytes": 8_555_740}},
                        "sam", "base", 0)
    assert row["tensor_ratio"] == pytest.approx(1.0)
    assert row["bytes_ratio"] == pytest.approx(2.0)
    assert row["kernels"] == 2


STATS = '''NOTICE: Existing SQLite export found
Range,Style,Total Proj Time (ns),Total Range Time (ns),Range Instances,Proj Avg (ns)
:decode,PushPop,"2500000",2600000,1,2500000
'''


def test_parse_nsys_stats():
    df = parse_stats_csv(STATS)
    assert list(df.columns)[:2] == ["Range", "Style"]
    assert df.loc[0, "Range Instances"] == 1
    assert isinstance(df, pd.DataFrame)


# ------------------------------------------------- "run it elsewhere" commands (issue 15)

def _child(tmp_path):
    import sys

    cfg = from_dict(HarnessConfig, {"profile": {"decode_tokens": 4}})
    child = child_command(cfg, tmp_path / "run" / "child", ["tool=ncu", "stage=decode", "model=tiny"])
    assert child[0] == sys.executable
    return cfg, child


def test_ncu_missing_gives_a_portable_command(tmp_path, monkeypatch):
    import sys

    from harness.errors import HarnessError
    from harness.external import ncu_session

    cfg, child = _child(tmp_path)
    monkeypatch.setattr(ncu_session, "find_tool", lambda name: None)
    with pytest.raises(HarnessError) as exc:
        ncu_session.run_ncu(cfg, "decode", child, tmp_path / "run")
    cmd = exc.value.fix.removeprefix("install Nsight Compute and run: ")
    assert cmd.startswith("ncu --nvtx --nvtx-include harness@request/decode/ ")
    assert " -o ncu-decode " in cmd and cmd.endswith(
        " python -m harness run model=tiny measure.kernels=false measure.warmup=0 measure.repeats=1 "
        "measure.nvtx=true workload.decode_tokens=4")
    assert sys.executable not in cmd and str(tmp_path) not in cmd
    assert (tmp_path / "run" / "ncu" / "command.txt").read_text() == cmd + "\n"




# ------------------------------------- ncu against the profiled request's own routing (issue 22 item 5)

def _ncu_child_run(tmp_path, with_steps: bool):
    """A child run of ``profile tool=ncu stage=decode`` (batch 8 of distinct pages, static cache + grouped
    MoE, 4 decode tokens, the tiny model) as RunData: its manifest and, with ``with_steps``, the
    profiled request's routing.csv / routing_steps.csv. MoE layer 1 touches 3, 5, 8 experts in steps
    0, 1, 2; layer 2 touches 2, 4, 6 (each step: 8 rows x top-2 = 16 picks)."""
    import dataclasses

    import numpy as np

    from conftest import TINY_MODE, load_tiny_cfg
    from harness.rundir import RunData
    from harness.layout import Case

    case = Case(TINY_MODE, None, batch=8, decode_tokens=4, name="b8")
    execution = {"kv_cache": "static", "moe_impl": "grouped", "moe_kernel": "auto", "moe_kernel_resolved": "triton"}
    manifest = {"config": {"model": dataclasses.asdict(load_tiny_cfg()), "execution": execution}, "dtype": "bf16",
                "cases": [{**case.to_dict(), "execution": execution, "routing": "balanced", "routing_seed": 3,
                           "routing_label": "balanced (seed 3)"}]}
    if not with_steps:
        return RunData(tmp_path, manifest)
    touched = {1: (3, 5, 8), 2: (2, 4, 6)}
    steps, rows = [], []
    decode = np.zeros((3, 8), dtype=np.int64)
    for layer, per_step in touched.items():
        for step, n in enumerate(per_step):
            counts = np.array([16 // n + (1 if j < 16 % n else 0) if j < n else 0 for j in range(8)])
            decode[layer] += counts
            steps.append({"case": "b8", "step": step, "layer": layer, "experts": n,
                          **{f"e{j}": int(c) for j, c in enumerate(counts)}})
    for layer in (1, 2):
        rows.append({"case": "b8", "phase": "decode", "layer": layer,
                     **{f"e{j}": int(c) for j, c in enumerate(decode[layer])}})
    return RunData(tmp_path, manifest, routing=pd.DataFrame(rows), routing_steps=pd.DataFrame(steps))


def test_ncu_compares_dram_reads_with_the_profiled_requests_own_routing(tmp_path):
    """The analytic decode reads use the experts each step touched: against the uniform expectation
    for 8 rows x top-2 of 8 experts, E (1 - (1 - k/E)^B) = 8 (1 - 0.75^8) = 7.19910 experts per layer
    and step, the weights differ by (sum touched - 2 layers x 3 steps x 7.19910) experts x 3 x 64 x 32
    weights x 2 bytes (bf16); the comparison row and report.md name the routing."""
    from harness.external.ncu_session import analytic_totals_of, compare_stage, render, routing_line

    totals, case, routing = analytic_totals_of(_ncu_child_run(tmp_path, True))
    uniform, _, expected = analytic_totals_of(_ncu_child_run(tmp_path, False))
    touched = 3 + 5 + 8 + 2 + 4 + 6
    per_expert = 3 * 64 * 32 * 2
    delta = (touched - 2 * 3 * 8 * (1 - 0.75 ** 8)) * per_expert
    assert totals["decode"]["bytes_weights"] - uniform["decode"]["bytes_weights"] == pytest.approx(delta, rel=1e-12)
    assert case["name"] == "b8"
    assert routing == {"routing_source": "measured per step", "routing": "balanced (seed 3)",
                       "experts_step": "4 [2–8]"}
    assert expected["routing_source"] == "expected routing" and expected["experts_step"] is None
    reads = sum(totals["decode"][c] for c in ("bytes_weights", "bytes_act_read", "bytes_kv_read"))
    kern = pd.DataFrame({"kernel": ["moe", "attn"], "duration_ns": [2000.0, 1000.0],
                         "dram_read_bytes": [0.75 * 1.05 * reads, 0.25 * 1.05 * reads],
                         "dram_write_bytes": [10.0, 10.0],
                         "tensor_flops": [None, None], "vector_flops": [None, None], "dram_bytes": [None, None]})
    row = {**compare_stage(kern, totals, "decode", "b8", 3), **routing}
    assert row["analytic_read_bytes"] == pytest.approx(reads) and row["read_ratio"] == pytest.approx(1.05)
    line = routing_line(row)
    assert line == ("MoE bytes from: measured per step; routing `balanced (seed 3)`; distinct experts per MoE layer "
                    "per decode step (over the batch's rows) 4 [2–8].")
    md = render(pd.DataFrame([row]), kern, "decode")
    assert line in md and "- reads: measured/analytic = 1.050 (within +-15%)." in md
    assert routing_line({**row, **expected}).endswith("(no per-step counts: the uniform expectation, not what the "
                                                      "request touched).")
