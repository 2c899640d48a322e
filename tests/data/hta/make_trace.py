"""Write trace.json.gz: a small synthetic Chrome trace in the kineto format Holistic Trace Analysis reads.

One request as the harness's profiled request records it on a GPU: the kernels (``cat`` kernel,
gpu_memcpy, gpu_memset; GPU process 0, ``tid`` = stream) with the launch calls that made them
(``cuda_runtime``, joined by ``args.correlation``) and the harness's stage ranges as host
``user_annotation`` events ``harness::<range>#<index>`` (what ``KernelCapture.save_trace`` writes
into a CUDA trace). Times in µs since ``baseTimeNanoseconds``. What it holds, per stage:

* sam#0: three kernels queued behind their launches, a 5 µs gap between the second and third;
* clip#0: two kernels; projector#0: a kernel and a device-to-device copy, then the layout glue (a
  second projector#0 range) with one kernel;
* prefill: a kernel on stream 7 overlapped by two on stream 20 (their union counts once);
* decode: two decode_step ranges, each a memset and two kernels of a few µs with fractions of a µs
  (as a batch-1 decode step's are; HTA rounds each event inward to whole µs unless told not to);
* a kernel launched inside the request before the first stage (in the request, in no stage).

Run from the repository root: ``python tests/data/hta/make_trace.py``.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

HOST_PID = HOST_TID = 4242
BASE_NS = 1_790_000_000_000_000_000
T0 = 1_000_000.0        # µs since BASE_NS of the request's start

# (range, index, start µs after T0, duration µs): the recorder's ranges
RANGES = [("request", None, 0, 1000), ("sam", 0, 10, 190), ("clip", 0, 200, 100), ("projector", 0, 300, 20),
          ("projector", 0, 320, 10), ("prefill", None, 330, 270), ("decode", None, 600, 400),
          ("decode_step", 0, 600, 200), ("decode_step", 1, 800, 200)]
# (launch µs after T0, GPU start µs after T0, duration µs, stream, cat, name)
KERNELS = [
    (5, 12, 3, 7, "kernel", "fill_kernel"),
    (20, 30, 40, 7, "kernel", "sm90_xmma_gemm_sam_qkv"),
    (25, 70, 20, 7, "kernel", "fmha_sam_window"),
    (40, 95, 60, 7, "kernel", "sm90_xmma_gemm_sam_mlp"),
    (210, 215, 30, 7, "kernel", "sm90_xmma_gemm_clip"),
    (220, 250, 25, 7, "kernel", "fmha_clip"),
    (305, 306, 6, 7, "kernel", "sm90_xmma_gemm_projector"),
    (310, 313, 4, 7, "gpu_memcpy", "Memcpy DtoD (Device -> Device)"),
    (322, 323, 2, 7, "kernel", "cat_kernel_layout"),
    (340, 345, 100, 7, "kernel", "sm90_xmma_gemm_prefill"),
    (350, 360, 50, 20, "kernel", "fused_moe_kernel"),
    (355, 420, 60, 20, "kernel", "fused_moe_kernel"),
    (610, 612.4, 0.9, 7, "gpu_memset", "Memset (Device)"),
    (620, 625.3, 3.4, 7, "kernel", "gemv_kernel"),
    (621, 629.1, 2.6, 7, "kernel", "decode_attention_kernel"),
    (810, 812.4, 0.9, 7, "gpu_memset", "Memset (Device)"),
    (820, 825.3, 3.4, 7, "kernel", "gemv_kernel"),
    (821, 829.1, 2.6, 7, "kernel", "decode_attention_kernel"),
]


def events() -> list:
    out = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "python"}}]
    for name, index, start, dur in RANGES:
        out.append({"ph": "X", "cat": "user_annotation", "name": f"harness::{name}" + (f"#{index}" if index is not None
                                                                                       else ""),
                    "pid": HOST_PID, "tid": HOST_TID, "ts": T0 + start, "dur": dur,
                    "args": {"source": "harness StageRecorder (host wall clock)"}})
    for corr, (launch, start, dur, stream, cat, name) in enumerate(KERNELS, start=1):
        out.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel" if cat == "kernel" else
                    ("cudaMemcpyAsync" if cat == "gpu_memcpy" else "cudaMemsetAsync"),
                    "pid": HOST_PID, "tid": HOST_TID, "ts": T0 + launch, "dur": 1,
                    "args": {"External id": corr, "correlation": corr}})
        out.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": T0 + start, "dur": dur,
                    "args": {"External id": corr, "device": 0, "stream": stream, "correlation": corr,
                             "context": 1}})
    return out


def main() -> None:
    trace = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "synthetic GPU"}],
             "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 1},
             "displayTimeUnit": "ms", "baseTimeNanoseconds": BASE_NS, "traceEvents": events(),
             "traceName": "synthetic"}
    out = Path(__file__).with_name("trace.json.gz")
    with gzip.GzipFile(out, "wb", mtime=0) as f:     # mtime 0: the same bytes on every run
        f.write(json.dumps(trace, indent=1).encode())
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
