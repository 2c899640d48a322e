"""Rebuild the run-directory fixtures of tests/test_report.py from a real CPU run.

    python -m harness run model=tiny \
      'cases=[{mode: {name: t, base_size: 128, image_size: 64, crop: true}}, {mode: {name: nc, base_size: 128, image_size: 128, crop: false}}]' \
      workload.decode_tokens=6 measure.repeats=3 measure.kernels=true run.root=/tmp/fx
    python tests/data/runs/make_fixtures.py /tmp/fx/<run>

cpu_tiny: that run (host timers) with kernels.csv trimmed to the matmul/norm ops and the 6 longest
other ops per case x stage. gpu_tiny_a / gpu_tiny_b: the same measurements relabelled as an H100
run (CUDA-event timer, bf16, "NVIDIA H100 80GB HBM3"), times divided by 50 (A) and by 62.5 (B, 20%
faster), so the datasheet ceilings apply. Synthetic numbers: only for testing the report code.
"""
import json
import shutil
import sys
from pathlib import Path

import pandas as pd

HERE = Path(__file__).resolve().parent
MS_COLS = ["gpu_ms", "host_ms", "busy_ms", "idle_ms", "ttft_ms", "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms",
           "e2e_ms", "stage_sum_ms", "unattributed_kernel_ms"]


def trim_kernels(k: pd.DataFrame) -> pd.DataFrame:
    keep = k["category"].isin(["gemm", "conv", "attention", "norm"])
    rest = k[~keep].sort_values("dur_ms", ascending=False).groupby(["case", "stage"], dropna=False).head(6)
    return pd.concat([k[keep], rest]).sort_values(["case", "start_ms"]).reset_index(drop=True)


def as_gpu(src: Path, dst: Path, scale: float) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    st = pd.read_csv(src / "stages.csv", dtype={"repeat": str, "call": str, "grid": str})
    cv = st["repeat"] == "cv"
    st.loc[:, "timer"] = "cuda_event"
    st.loc[:, "gpu_ms"] = st["host_ms"]
    for c in MS_COLS:
        st.loc[~cv, c] = pd.to_numeric(st.loc[~cv, c]) / scale
    st.loc[~cv, "decode_tok_s"] = pd.to_numeric(st.loc[~cv, "decode_tok_s"]) * scale
    st.loc[:, "note"] = ""
    st.to_csv(dst / "stages.csv", index=False)
    k = pd.read_csv(src / "kernels.csv")
    k["device"] = "cuda"
    k["start_ms"] = k["start_ms"] / scale
    k["dur_ms"] = k["dur_ms"] / scale
    k.to_csv(dst / "kernels.csv", index=False)
    shutil.copy(src / "routing.csv", dst / "routing.csv")
    man = json.loads((src / "manifest.json").read_text())
    man["device"] = {"type": "cuda", "host": "fixture", "name": "NVIDIA H100 80GB HBM3", "capability": "9.0",
                     "total_memory_bytes": 85520809984, "multiprocessors": 132, "cuda_runtime": "12.8",
                     "nvidia_smi": {"driver_version": "570.00", "clocks.sm": "1980 MHz"}}
    man["dtype"] = "bfloat16"
    man["config"]["device"] = "cuda"
    man["warnings"] = ["fixture: synthetic GPU numbers derived from a CPU run"]
    (dst / "manifest.json").write_text(json.dumps(man, indent=2) + "\n")


def main(run: str) -> None:
    src = Path(run)
    cpu = HERE / "cpu_tiny"
    cpu.mkdir(exist_ok=True)
    for f in ("stages.csv", "routing.csv", "manifest.json"):
        shutil.copy(src / f, cpu / f)
    man = json.loads((cpu / "manifest.json").read_text())
    man["argv"] = ["harness-run", "model=tiny", "(fixture)"]
    man["cwd"] = "."
    (cpu / "manifest.json").write_text(json.dumps(man, indent=2) + "\n")
    trim_kernels(pd.read_csv(src / "kernels.csv")).to_csv(cpu / "kernels.csv", index=False)
    as_gpu(cpu, HERE / "gpu_tiny_a", 50.0)
    as_gpu(cpu, HERE / "gpu_tiny_b", 62.5)


if __name__ == "__main__":
    main(sys.argv[1])
