"""Host steadiness: how much a fixed amount of host work varies on this machine, right now.

A launch-bound stage (decode: ~1,200 launches and 11 host syncs per step) runs at the pace of
the host, so its GPU ms cannot vary less than the host does. ``probe`` times two fixed workloads
``n`` times each and returns their median (ms; the one median rule, ``stats.median_low``) and CV
(population std / mean, %):

- ``python``: a pure-Python loop (``sum(range(50_000))``);
- ``launch``: 200 one-element CUDA kernel launches, then one synchronisation (CUDA only).

The run verb probes before the first case and after the last (``manifest.json`` ->
``host_steadiness``), and the report quotes the figures next to the stage CVs.
"""
from __future__ import annotations

import gc
import statistics
import time

from .stats import median_low

PYTHON_ITEMS = 50_000
LAUNCHES = 200


def stats(ms: list[float]) -> dict:
    """median / CV (population std over mean, %) / min / max / n of a list of ms."""
    mean = statistics.fmean(ms)
    return {"median_ms": median_low(ms), "cv_pct": 100 * statistics.pstdev(ms) / mean if mean else None,
            "min_ms": min(ms), "max_ms": max(ms), "n": len(ms)}


def time_ms(fn, n: int, cuda: bool) -> list[float]:
    """Wall ms of ``fn()`` ``n`` times; with ``cuda`` each call ends with a synchronisation."""
    if cuda:
        import torch   # here only: the report reads ``describe`` without torch
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def probe(cuda: bool, n: int = 100) -> dict:
    """{'python': stats, 'launch': stats or None, 'launch_reason': str or None}; GC paused while timing."""
    was = gc.isenabled()
    gc.disable()
    try:
        out = {"python": stats(time_ms(lambda: sum(range(PYTHON_ITEMS)), n, cuda=False)), "launch": None,
               "launch_reason": "no CUDA device"}
        if cuda:
            import torch

            x = torch.zeros(1, device="cuda")

            def launches():
                for _ in range(LAUNCHES):
                    x.add_(1)

            launches()  # warm the launch path
            torch.cuda.synchronize()
            out.update(launch=stats(time_ms(launches, n, cuda=True)), launch_reason=None)
        return out
    finally:
        if was:
            gc.enable()


def describe(p: dict) -> str:
    """One line: 'Python loop CV 1.2% (median 0.61 ms); 200 launches + sync CV 3.4% (median 1.42 ms)'."""
    py = p["python"]
    s = f"Python loop CV {py['cv_pct']:.1f}% (median {py['median_ms']:.2f} ms)"
    ln = p.get("launch")
    if ln:
        s += f"; {LAUNCHES} launches + sync CV {ln['cv_pct']:.1f}% (median {ln['median_ms']:.2f} ms)"
    else:
        s += f"; launch loop not run ({p.get('launch_reason')})"
    return s
