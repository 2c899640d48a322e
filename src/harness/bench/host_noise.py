"""How steady is this host? Fixed workloads timed many times (median, CV, min, p90, max, slow calls):
pure Python, a launch-bound GPU loop (1,000 tiny kernels, with and without 11 host syncs), the same
loop as one CUDA-graph replay; then which host-sync path carries the outliers: 1,000 tiny launches
with 11 syncs per block, where a sync is ``.item()`` (pageable D2H), ``torch.cuda.synchronize()`` or an
event sync, under the context's default scheduling flags, then with ``CU_CTX_SCHED_SPIN`` /
``YIELD`` / ``BLOCKING_SYNC`` set through the driver API. The notes give the environment (kernel,
CPUs, affinity, load, governor), the blocks slower than 1.2 x the median among ``blocks`` back to
back, and the steal time over the run (/proc/stat).

    python -m harness bench host_noise [bench.host_noise.repeats=200]

Every time is the host clock around the call, each GPU call ending with a synchronisation
(``harness.measure.host.time_ms``; summary ``harness.measure.host.stats``), GC off.
"""
from __future__ import annotations

import ctypes
import gc
import os

import torch

from .timing import capture, quantile

COLUMNS = ["workload", "timings", "ms_median", "cv_pct", "ms_min", "ms_p90", "ms_max", "slow_calls"]
#: the context scheduling flags tried (label, CU_CTX_SCHED_* value; None: as the context was made)
SCHED_FLAGS = (("default", None), ("spin", 1), ("yield", 2), ("blocking", 4), ("spin again", 1))


def row(name: str, xs: list) -> dict:
    """The table's row of timings ``xs`` (ms): ``stats`` and the calls above 1.2 x the median."""
    from ..measure.host import stats

    st = stats(xs)
    return {"workload": name, "timings": st["n"], "ms_median": st["median_ms"], "cv_pct": st["cv_pct"],
            "ms_min": st["min_ms"], "ms_p90": quantile(xs, 0.9), "ms_max": st["max_ms"],
            "slow_calls": sum(t > 1.2 * st["median_ms"] for t in xs)}


def steal() -> tuple:
    """(steal, total) jiffies from /proc/stat's cpu line."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return values[7], sum(values)


def environment() -> str:
    with open("/proc/loadavg") as f:
        load = f.read().strip()
    try:
        with open("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor") as f:
            governor = f.read().strip()
    except OSError as exc:
        governor = f"n/a ({exc.__class__.__name__})"
    return (f"uname {os.uname().release} | cpus {os.cpu_count()} | affinity {sorted(os.sched_getaffinity(0))} | "
            f"loadavg {load} | governor {governor}")


def run(cfg, opts, device, report) -> None:
    """The bench (module docstring) on ``device`` (CUDA)."""
    from ..measure.host import stats, time_ms

    st0 = steal()
    report.note(environment())
    gc.disable()
    try:
        table = report.table("host_noise", "fixed workloads, host clock", COLUMNS)
        table.add(**row("python loop (200k adds)", time_ms(lambda: sum(range(200_000)), opts.repeats, cuda=False)))
        x = torch.zeros(16, device=device)

        def launches():
            for _ in range(1000):
                x.add_(1)

        def launches_sync():
            for i in range(1000):
                x.add_(1)
                if i % 91 == 0:
                    x.sum().item()

        for _ in range(5):
            launches()
        table.add(**row("1000 launches, 1 sync", time_ms(launches, opts.repeats, cuda=True)))
        table.add(**row("1000 launches, 11 syncs", time_ms(launches_sync, opts.repeats, cuda=True)))
        graph, _ = capture(launches, warmup=1)
        table.add(**row("graph replay of 1000 launches", time_ms(graph.replay, opts.repeats, cuda=True)))
        ts = time_ms(launches, opts.blocks, cuda=True)   # back to back, per-block wall: bursts
        med = stats(ts)["median_ms"]
        bad = [i for i, t in enumerate(ts) if t > 1.2 * med]
        report.note(f"blocks > 1.2 x median: {len(bad)} of {len(ts)} at {bad[:40]}")
        sync_paths(x, opts.sync_repeats, report)
    finally:
        gc.enable()
    st1 = steal()
    report.note(f"steal jiffies {st1[0] - st0[0]} of {st1[1] - st0[1]}; sched {os.sched_getscheduler(0)}")


def sync_paths(x, n: int, report) -> None:
    """The ``sync_paths`` table: 1,000 launches with 11 syncs of each kind, under each scheduling flag."""
    from ..measure.host import time_ms

    def block(sync):
        def run_block():
            for i in range(1000):
                x.add_(1)
                if i % 91 == 0:
                    sync()
        return run_block

    def event_sync():
        e = torch.cuda.Event()
        e.record()
        e.synchronize()

    syncs = (("item", lambda: x.sum().item()), ("device sync", torch.cuda.synchronize), ("event sync", event_sync))
    cu = ctypes.CDLL("libcuda.so.1")
    flags = ctypes.c_uint()
    rc = cu.cuCtxGetFlags(ctypes.byref(flags))
    report.note(f"cuCtxGetFlags rc {rc}, flags {flags.value}")
    table = report.table("sync_paths", "1000 launches with 11 host syncs per block, by sync and context flag",
                         COLUMNS)
    for label, f in SCHED_FLAGS:
        if f is not None:
            rc = cu.cuCtxSetFlags(ctypes.c_uint(f))
            cu.cuCtxGetFlags(ctypes.byref(flags))
            label += f" (set rc {rc}, flags {flags.value})"
        for name, sync in syncs:
            torch.cuda.synchronize()
            table.add(**row(f"{label}: {name}", time_ms(block(sync), n, cuda=True)))
