"""One decode step's kernels from a run's kernels.csv: in launch order (name, µs, gap before, module,
attribution) and summed by name (launches per step, µs per step), for reading where a step's time goes.

    python runs/examples/h200-b32-align/step_kernels.py RUN_DIR [--case CASE] [--step 1] [--width 90]
"""
from __future__ import annotations

import argparse
import collections
import csv
import pathlib


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("--case", default=None)
    ap.add_argument("--step", default="1")
    ap.add_argument("--width", type=int, default=90)
    args = ap.parse_args(argv)
    rows = [r for r in csv.DictReader(open(pathlib.Path(args.run) / "kernels.csv")) if r["stage"] == "decode"]
    cases = sorted({r["case"] for r in rows}) if args.case is None else [args.case]
    for case in cases:
        steps = collections.defaultdict(list)
        for r in rows:
            if r["case"] == case:
                steps[r["step"]].append(r)
        n_steps = len(steps)
        step = sorted(steps, key=float)[min(int(args.step), n_steps - 1)]
        seq = sorted(steps[step], key=lambda r: float(r["start_ms"]))
        span = (float(seq[-1]["start_ms"]) + float(seq[-1]["dur_ms"]) - float(seq[0]["start_ms"])) * 1e3
        print(f"== {case}: step {step}, {len(seq)} kernels, span {span:.1f} us, "
              f"sum of durations {sum(float(r['dur_ms']) for r in seq) * 1e3:.1f} us")
        end = None
        for r in seq:
            t0 = float(r["start_ms"]) * 1e3
            gap = "" if end is None else f"{t0 - end:6.1f}"
            end = t0 + float(r["dur_ms"]) * 1e3
            print(f"{float(r['dur_ms']) * 1e3:8.1f} {gap:>6}  {r['name'][:args.width]:<{args.width}} "
                  f"{r['module'][-40:]:<40} {r['attribution']}")
        total = collections.defaultdict(lambda: [0, 0.0])
        for s in steps.values():
            for r in s:
                t = total[r["name"][:args.width]]
                t[0] += 1
                t[1] += float(r["dur_ms"]) * 1e3
        print(f"-- {case}: by name, per step (mean of {n_steps} steps)")
        for name, (n, us) in sorted(total.items(), key=lambda kv: -kv[1][1]):
            print(f"{n / n_steps:7.1f} {us / n_steps:9.1f} us  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
