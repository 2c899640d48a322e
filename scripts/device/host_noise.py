"""How steady is this host? Times fixed workloads many times and prints median / CV / min / max:
pure Python, a launch-bound GPU loop (1,000 tiny kernels, with and without 11 host syncs), and the
same loop as one CUDA-graph replay. Also prints the environment (affinity, load, kernel)."""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch


def report(name, xs):
    m = statistics.median(xs)
    cv = statistics.pstdev(xs) / statistics.mean(xs) * 100
    xs_sorted = sorted(xs)
    p90 = xs_sorted[int(0.9 * (len(xs) - 1))]
    print(f"{name:38s} n={len(xs):4d} median {m:8.3f} ms  CV {cv:5.2f}%  min {min(xs):8.3f}  p90 {p90:8.3f}  max {max(xs):8.3f}")


def timeit(fn, n, sync=True):
    out = []
    for _ in range(n):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def steal():
    """(steal, total) jiffies from /proc/stat's cpu line."""
    f = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    return f[7], sum(f)


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    st0 = steal()
    print("uname", os.uname().release, "| cpus", os.cpu_count(), "| affinity", sorted(os.sched_getaffinity(0)),
          "| loadavg", open("/proc/loadavg").read().strip())
    try:
        print("governor", open("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor").read().strip())
    except OSError as e:
        print("governor: n/a", e.__class__.__name__)
    import gc
    gc.disable()
    report("python loop (200k adds)", timeit(lambda: sum(range(200_000)), n, sync=False))
    x = torch.zeros(16, device="cuda")

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
    report("1000 launches, 1 sync", timeit(launches, n))
    report("1000 launches, 11 syncs", timeit(launches_sync, n))
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        launches()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        launches()
    report("graph replay of 1000 launches", timeit(g.replay, n))
    # one long run to see bursts: 2000 x 1000-launch blocks back to back, per-block wall
    ts = timeit(launches, 600)
    bad = [i for i, t in enumerate(ts) if t > 1.2 * statistics.median(ts)]
    print(f"blocks >1.2x median: {len(bad)} of {len(ts)} at {bad[:40]}")
    st1 = steal()
    print(f"steal jiffies {st1[0] - st0[0]} of {st1[1] - st0[1]}; sched {os.sched_getscheduler(0)}")


if __name__ == "__main__":
    main()
