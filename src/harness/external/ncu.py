"""Nsight Compute over one stage's NVTX range: command builder and raw-CSV parser.

The filter is ``--nvtx --nvtx-include "harness@request/<stage>/"``: domain ``harness``, the
push/pop range stack request > stage (push/pop ranges end with a slash). Clocks are left as
found (``--clock-control none``). torch.profiler stays off in the child run (one CUPTI user).
Units: ns for durations, bytes for DRAM traffic, FLOPs (2 per FMA) for work.
"""
from __future__ import annotations

import io
import shlex
from pathlib import Path

import pandas as pd

# metric -> (column, multiplier to FLOPs or bytes)
METRICS = {
    "gpu__time_duration.sum": ("duration_ns", 1),
    "dram__bytes_read.sum": ("dram_read_bytes", 1),
    "dram__bytes_write.sum": ("dram_write_bytes", 1),
    # tensor-core bf16 path, already in FLOPs: a 2048^3 bf16 GEMM reads 2 * 2048^3 on an H100
    "sm__ops_path_tensor_src_bf16_dst_fp32.sum": ("tensor_ops_bf16", 1),
    "smsp__sass_thread_inst_executed_op_ffma_pred_on.sum": ("ffma", 2),
    "smsp__sass_thread_inst_executed_op_fadd_pred_on.sum": ("fadd", 1),
    "smsp__sass_thread_inst_executed_op_fmul_pred_on.sum": ("fmul", 1),
    "smsp__sass_thread_inst_executed_op_hfma_pred_on.sum": ("hfma", 2),
    "smsp__sass_thread_inst_executed_op_hadd_pred_on.sum": ("hadd", 1),
    "smsp__sass_thread_inst_executed_op_hmul_pred_on.sum": ("hmul", 1),
}
NVTX_DOMAIN = "harness"
# metric sets: `all` (time, DRAM, tensor path, SASS fp32/fp16 counters: several replay passes per
# kernel) and `memory` (time and DRAM bytes only: one pass, for long stages such as decode)
METRIC_SETS = {"all": list(METRICS),
               "memory": ["gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum"]}


def nvtx_filter(stage: str) -> str:
    """ncu NVTX include expression for a stage range nested in ``request``."""
    return f"{NVTX_DOMAIN}@request/{stage}/"


def ncu_command(stage: str, child: list[str], report: Path, launch_count: int | None = 2000,
                metrics=METRICS, ncu: str = "ncu") -> list[str]:
    """The full ncu command line profiling ``child`` (argv list) inside one stage's range."""
    cmd = [ncu, "--nvtx", "--nvtx-include", nvtx_filter(stage), "--clock-control", "none",
           "--metrics", ",".join(metrics), "--target-processes", "all", "-f", "-o", str(report)]
    if launch_count:
        cmd += ["--launch-count", str(launch_count)]
    return cmd + list(child)


def export_command(report: Path, ncu: str = "ncu") -> list[str]:
    return [ncu, "--import", str(report), "--csv", "--page", "raw", "--print-units", "base"]


def parse_raw_csv(text: str) -> pd.DataFrame:
    """Parse ``ncu --page raw --csv --print-units base``: one row per kernel with METRICS columns
    (duration_ns, dram_*_bytes, tensor_ops_bf16, and the SASS counters) plus name/stream/grid."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if not lines:
        return pd.DataFrame(columns=["kernel"] + [c for c, _ in METRICS.values()])
    df = pd.read_csv(io.StringIO("\n".join(lines)), dtype=str)
    if len(df) and not str(df.iloc[0].get("ID", "")).strip().isdigit():
        df = df.iloc[1:]  # units row
    out = pd.DataFrame({"kernel": df.get("Kernel Name"), "stream": df.get("Stream"),
                        "grid": df.get("Grid Size"), "block": df.get("Block Size")})
    for metric, (col, _) in METRICS.items():
        vals = df[metric] if metric in df else None
        out[col] = pd.to_numeric(vals.str.replace(",", ""), errors="coerce") if vals is not None else float("nan")
    return out.reset_index(drop=True)


def flops_columns(df: pd.DataFrame, tensor_flops_per_op: float = 1.0) -> pd.DataFrame:
    """Add ``tensor_flops`` (bf16 path counter, FLOPs), ``vector_flops`` (SASS
    fp32+fp16: FMA = 2) and ``dram_bytes`` (read + write) columns."""
    df = df.copy()
    df["tensor_flops"] = df["tensor_ops_bf16"] * tensor_flops_per_op
    sass = [(col, mult) for metric, (col, mult) in METRICS.items() if metric.startswith("smsp__sass")]
    df["vector_flops"] = sum(df[col] * mult for col, mult in sass)   # NaN when not collected
    df["dram_bytes"] = df["dram_read_bytes"] + df["dram_write_bytes"]
    return df


def shell(cmd: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)
