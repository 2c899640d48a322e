"""Behaviour kept across a refactor of the execution variants: tokens, routing and kernel/op counts.

    python runs/examples/cpu-renovation-parity/variant_parity.py tokens OUT.json [overrides...]   # each case's tokens and routing
    python runs/examples/cpu-renovation-parity/variant_parity.py counts RUN_DIR OUT.json          # a run's per-step counts
    python runs/examples/cpu-renovation-parity/variant_parity.py compare BEFORE.json AFTER.json   # equal, or what differs

``tokens`` composes the run's config from the overrides as the CLI does (``harness.cli.check_overrides``),
builds the model once and runs, per case, the requests of timed repeat 0 and of the profiled
request (index ``measure.repeats``) through ``generate``: greedy tokens, routing per phase and per
decode step. ``counts`` reads a run directory: kernels (CPU operators on a CPU) per case, stage,
call and decode step by name, the same by module / family / op group, stage kernel counts and
launches per step of the profiled request (stages.csv), routing.csv and routing_steps.csv.
``compare`` prints the keys whose values differ and exits 1 when any does.
"""
from __future__ import annotations

import json
import sys

import pandas as pd


def tokens(out: str, overrides: list) -> None:
    from harness import variants
    from harness.cli import check_overrides
    from harness.models.generate import generate
    from harness.setup import load_adapter, prepare_cases, resolve_device, resolve_dtype

    cfg = check_overrides(overrides)
    dev = resolve_device(cfg.device)
    dt = resolve_dtype(cfg.dtype, dev)
    cases, _ = prepare_cases(cfg)
    model, _ = load_adapter(cfg.model, dev, dt, cfg.seed)
    profiled = cfg.measure.resolved(dev.type == "cuda").repeats
    result = {}
    for inputs in cases:
        variants.apply(model, inputs.execution, dev)
        for r in (0, profiled):
            req, _ = inputs.timed_request(r, dev, dt)
            res = generate(model, req)
            result[f"{inputs.name}/{r}"] = {
                "tokens": res.tokens.tolist(), "routing": {k: v.tolist() for k, v in res.routing.items()},
                "routing_steps": res.routing_steps.tolist() if res.routing_steps is not None else None}
    with open(out, "w") as fh:
        json.dump(result, fh)


def counts(run: str, out: str) -> None:
    from harness.rundir import load_run

    data = load_run(run)   # stages.csv as typed observations, of either layout (``profiled`` column)
    k = data.kernels.fillna({"step": -1, "call": -1, "module": "", "family": "", "op_group": ""})
    prof = data.stages[data.stages["profiled"]]
    result = {
        "stages": {f"{r.case}/{r.stage}/{r.call}": [None if pd.isna(r.kernels) else int(r.kernels),
                                                   None if pd.isna(r.launches_per_step) else float(r.launches_per_step)]
                   for r in prof.itertuples()},
        "ops": {"/".join(map(str, i)): int(n) for i, n in k.groupby(["case", "stage", "call", "step", "name"]).size().items()},
        "modules": {"/".join(map(str, i)): int(n)
                    for i, n in k.groupby(["case", "stage", "step", "module", "family", "op_group"]).size().items()},
        "routing": data.routing.to_dict("records"),
        "routing_steps": data.routing_steps.to_dict("records")}
    with open(out, "w") as fh:
        json.dump(result, fh, indent=0, sort_keys=True)


def compare(before: str, after: str) -> int:
    a, b = json.load(open(before)), json.load(open(after))
    bad = 0
    for section in sorted(set(a) | set(b)):
        x, y = a.get(section), b.get(section)
        if x == y:
            continue
        bad += 1
        if isinstance(x, dict) and isinstance(y, dict):
            diff = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
            print(f"{section}: {len(diff)} key(s) differ, e.g. {diff[:5]}")
        else:
            print(f"{section}: differs")
    print("equal" if not bad else f"{bad} section(s) differ")
    return 1 if bad else 0


if __name__ == "__main__":
    verb, *rest = sys.argv[1:]
    if verb == "tokens":
        tokens(rest[0], rest[1:])
    elif verb == "counts":
        counts(rest[0], rest[1])
    elif verb == "compare":
        sys.exit(compare(rest[0], rest[1]))
    else:
        sys.exit(f"unknown verb {verb!r}: tokens, counts or compare")
