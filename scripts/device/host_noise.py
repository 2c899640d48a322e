"""How steady is this host? Times fixed workloads many times and prints median / CV / min / max:
pure Python, a launch-bound GPU loop (1,000 tiny kernels, with and without 11 host syncs), and the
same loop as one CUDA-graph replay. Also prints the environment (affinity, load, kernel)."""
from __future__ import annotations

import gc
import os
import sys

import torch

from harness.measure.host import stats, time_ms


def line(name, xs):
    """One line: n, median, CV, min, p90, max (ms) of ``xs`` (``harness.measure.host.stats``) and
    how many exceed 1.2 x the median."""
    st = stats(xs)
    p90 = sorted(xs)[int(0.9 * (len(xs) - 1))]
    slow = sum(t > 1.2 * st["median_ms"] for t in xs)
    return (f"{name:38s} n={st['n']:4d} median {st['median_ms']:8.3f} ms  CV {st['cv_pct']:5.2f}%  "
            f"min {st['min_ms']:8.3f}  p90 {p90:8.3f}  max {st['max_ms']:8.3f}  >1.2x: {slow}")


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
    gc.disable()
    print(line("python loop (200k adds)", time_ms(lambda: sum(range(200_000)), n, cuda=False)))
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
    print(line("1000 launches, 1 sync", time_ms(launches, n, cuda=True)))
    print(line("1000 launches, 11 syncs", time_ms(launches_sync, n, cuda=True)))
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        launches()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        launches()
    print(line("graph replay of 1000 launches", time_ms(g.replay, n, cuda=True)))
    # one long run to see bursts: 2000 x 1000-launch blocks back to back, per-block wall
    ts = time_ms(launches, 600, cuda=True)
    med = stats(ts)["median_ms"]
    bad = [i for i, t in enumerate(ts) if t > 1.2 * med]
    print(f"blocks >1.2x median: {len(bad)} of {len(ts)} at {bad[:40]}")
    st1 = steal()
    print(f"steal jiffies {st1[0] - st0[0]} of {st1[1] - st0[1]}; sched {os.sched_getscheduler(0)}")


if __name__ == "__main__":
    main()
