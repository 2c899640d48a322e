"""TPOT p50 over all decode steps, the first 128 and the last 128, for the cases of several run
directories side by side (markdown), e.g. the vendor's two loops and the best execution variant:

    python scripts/tpot_table.py runs/A runs/B runs/C

Each row names its run by directory, model adapter, decode loop and any execution knobs of the
manifest's model; times come from the run's steps.csv (``harness.report.steps.tpot_edges``).
"""
from __future__ import annotations

import sys

from harness.markdown import LEFT, RIGHT, table
from harness.report.steps import WINDOW, step_time, tpot_edges
from harness.rundir import load_run

KNOBS = ("kv_cache", "moe_impl", "moe_kernel", "cuda_graphs", "compile", "attn_implementation")


def label(manifest: dict) -> str:
    """adapter, decode loop and the execution knobs that differ from the vendor's defaults."""
    model = manifest.get("model") or {}
    config = manifest.get("config") or {}
    cfg = {**(config.get("model") or {}), **(config.get("execution") or {})}   # older runs: knobs under model
    loop = (model.get("loop") or {}).get("loop", "ours")
    knobs = [f"{k}={cfg[k]}" for k in KNOBS if k in cfg and cfg[k] not in (None, False, "growing", "vendor_loop",
                                                                            "none", "auto")]
    return ", ".join([str(model.get("adapter", cfg.get("name", "?"))), f"loop {loop}"] + knobs)


def main(paths: list) -> int:
    if not paths:
        print(__doc__)
        return 2
    rows = []
    for path in paths:
        run = load_run(path)
        if not len(run.steps):
            rows.append([run.path.name, label(run.manifest), "(no steps.csv)", *[""] * 6])
            continue
        timer = step_time(run.steps)[1]
        rows += [[run.path.name, label(run.manifest), r.case, r.steps, f"{r.tpot_p50_ms:.3f}", f"{r.first_p50_ms:.3f}",
                  f"{r.last_p50_ms:.3f}", f"{r.last_over_first:.3f}", timer] for r in tpot_edges(run.steps).itertuples()]
    print("\n".join(table(["run", "model", "case", "steps", "TPOT p50 ms", f"first {WINDOW} p50 ms",
                           f"last {WINDOW} p50 ms", "last / first", "timer"], rows,
                          [LEFT] * 3 + [RIGHT] * 5 + [LEFT])))
    device = (load_run(paths[0]).manifest.get("device") or {}).get("name")
    print(f"\ndevice: {device or 'no CUDA device'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
