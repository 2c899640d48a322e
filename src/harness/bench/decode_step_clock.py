"""The fused decode step timed from inside its kernels (``bench.decode_step.clock=true``).

The step is built again with ``clock_rows`` (``FusedDecodeStep``), twice: with the first program's
clock (each launch's program 0 stores when it entered and when its wait released it: two
%globaltimer reads and two stores per launch) and with every program's (each program reads the
clock three times and the launch keeps its first entry, first release and last end through
atomics: the work / hand-off split, at a cost). Each is captured in a CUDA graph and timed like the
other rows (the ``steps`` rows ``<label> clocked[, every program] (graph)``: what the clock costs
against the plain row). Then its clock is emptied and ``reps`` steps replayed from ``pos``;
``harness.measure.step_clock`` turns the stamps into

* ``clock_modules[_every]``: per module of the step, launches, the median per-step interval
  (release to next release: the module's share of the critical path), work and hand-off (µs,
  measured; every program only), its share of the step and its bandwidth floor (the step's
  analytic bytes, ``weight_bytes`` and the KV read at the mean position, over the datasheet
  bandwidth);
* ``clock_launches[_every]``: the same medians per launch (label, layer) and how long each launch's
  first program was resident before its release;
* ``clock_kernels`` (every program): per kernel function, the in-kernel time of a step (sum over
  its launches of last end - first entry, median over steps) beside torch.profiler's sum of
  durations of one replayed step of the clocked graph and of the plain one (the reconciliation:
  both time a kernel from its first program's start to its last's end).

Notes: the median step by the clock against the CUDA-event figure of the same graph, and the
clock's granularity seen (the least non-zero difference between two stamps of one launch).
"""
from __future__ import annotations

import torch

from ..measure.stats import median_low

from .timing import capture_reset

#: the columns of the three tables (``harness.report.columns``)
MODULE_TABLE = ["module_group", "clock_launches", "interval_us", "work_us", "handoff_us", "step_share", "mb_step",
                "bw_floor_us", "floor_interval"]
LAUNCH_TABLE = ["launch", "kernel", "layer", "interval_us", "work_us", "handoff_us", "lead_us"]
KERNEL_TABLE = ["kernel", "launches", "entry_end_us", "step", "us_sum"]


def run(state: dict, opts, pdl: bool, spec, report, add_row, kernel_rows, plain_graph=None) -> None:
    """The clocked step over ``state`` (weights, cache, pos, token, counts, step_index, reset: the
    bench's fused-step state), first with the first program's clock, then with every program's: its
    ``steps`` row through ``add_row(label, fn, reset)`` and the tables (module docstring).
    ``kernel_rows(graph)``: the profiler's table of one replay (``decode_step.kernel_rows``);
    ``plain_graph``: the unclocked step's graph, profiled beside it."""
    for every in (False, True):
        _one(state, opts, pdl, spec, report, add_row, kernel_rows, plain_graph, every)


def _one(state: dict, opts, pdl: bool, spec, report, add_row, kernel_rows, plain_graph, every: bool) -> None:
    from ..kernels import decode_step as ds
    from ..measure import step_clock

    reset = state["reset"]
    label = ("fused PDL clocked" if pdl else "fused clocked") + (", every program" if every else "")
    step = ds.FusedDecodeStep(state["weights"], state["cache"], state["pos"], token=state["token"], pdl=pdl,
                              counts=(state["counts"], state["step_index"]), clock_rows=opts.cache_len,
                              clock_every=every)
    reset()
    graph = capture_reset(step.run, reset)
    add_row(f"{label} (graph)", graph.replay, reset)
    reset()
    step.reset_clock()
    torch.cuda.synchronize()
    for _ in range(opts.reps):
        graph.replay()
    torch.cuda.synchronize()
    stamps = step.clock_stamps()
    df = step_clock.launches(stamps, set(step.moe_layers.tolist()))
    whole, done = step_clock.complete(df)
    mean_pos = opts.pos + opts.reps // 2
    suffix = "_every" if every else ""
    table = report.table(f"clock_modules{suffix}", f"{label}: per module from the in-kernel clock ({len(whole)} "
                         f"steps from position {opts.pos})",
                         MODULE_TABLE)
    for rec in step_clock.modules(df, step.weight_bytes(), step.kv_bytes(mean_pos), spec.mem_bw_gbs if spec else None):
        table.add(**rec)
    launches = report.table(f"clock_launches{suffix}", f"{label}: per launch from the in-kernel clock (median over "
                            "steps)", LAUNCH_TABLE)
    for rec in step_clock.by_launch(df):
        launches.add(**rec)
    if every:
        _reconcile(done, len(whole), graph, plain_graph, label, report, kernel_rows, step.kernel_names())
    if len(whole):
        report.note(f"{label}: median step by the in-kernel clock {median_low(whole):.1f} µs over {len(whole)} "
                    f"steps; the clock's least non-zero step within a launch {_granularity(stamps)} ns")


def _granularity(stamps: list) -> int:
    """The least non-zero difference between two stamps of one launch (ns): the clock's tick as seen."""
    diffs = [d for *_, entry, release, end in stamps
             for d in ((release - entry, end - release) if end is not None else (release - entry,)) if d > 0]
    return min(diffs) if diffs else 0


def _reconcile(done, n_steps: int, graph, plain_graph, label: str, report, kernel_rows, kernel_of: dict) -> None:
    """The ``clock_kernels`` table (module docstring) from the launches of ``n_steps`` complete steps;
    ``kernel_of``: {launch label: kernel function name} (``FusedDecodeStep.kernel_names``)."""
    done = done.assign(span_us=lambda d: (d["end"] - d["entry"]) / 1e3, kernel=lambda d: d["label"].map(kernel_of))
    clock = done.groupby(["kernel", "row"])["span_us"].sum().groupby("kernel").agg(median_low)
    launches = done.groupby("kernel").size() / max(n_steps, 1)
    profiled = {f"{label} (graph)": graph}
    if plain_graph is not None:
        profiled[label.replace(" clocked, every program", "") + " (graph)"] = plain_graph
    sums = {name: {k: us for k, _, us in kernel_rows(g)[0]} for name, g in profiled.items()}
    table = report.table("clock_kernels", "per kernel function and step: in-kernel entry-to-end (median over steps) "
                         "beside the profiler's durations of one replayed step",
                         KERNEL_TABLE)
    for kernel in clock.index:
        for name, s in sums.items():
            table.add(kernel=kernel, launches=float(launches[kernel]), entry_end_us=float(clock[kernel]), step=name,
                      us_sum=s.get(kernel))
