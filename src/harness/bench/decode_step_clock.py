"""The fused decode step timed from inside its kernels (``bench.decode_step.clock=true``).

The step is built again with ``clock_rows`` (``FusedDecodeStep``: each launch stamps its first
entry, first release and last end with %globaltimer), captured in a CUDA graph and timed like the
other rows (the ``steps`` row ``<label> clocked (graph)``: what the stamps' atomics cost). Then
its clock is emptied and ``reps`` steps replayed from ``pos``; ``harness.measure.step_clock`` turns
the stamps into

* ``clock_modules``: per module of the step, launches, the median per-step hand-off wait, work
  and their sum (µs, measured), its share of the step and its bandwidth floor (the step's analytic
  bytes, ``weight_bytes`` and the KV read at the mean position, over the datasheet bandwidth);
* ``clock_launches``: the same medians per launch (label, layer) and how long each launch's
  programs were resident before their release;
* ``clock_kernels``: per kernel function, the in-kernel time of a step (sum over its launches of
  end - entry, median over steps) beside torch.profiler's sum of durations of one replayed step of
  the clocked graph and of the plain one (the reconciliation: both time a kernel from its first
  program's start to its last's end).

Notes: the median step by the clock against the CUDA-event figure of the same graph, and the
clock's granularity seen (the least non-zero difference between two stamps of one launch).
"""
from __future__ import annotations

import statistics

import torch

from .timing import capture_reset

#: the kernel function each launch label runs (``decode_step_triton``)
KERNEL_OF = {"qkv": "_qkv_rope_kernel", "attention": "_attention_kernel", "o_proj": "_down_kernel",
             "router": "_router_kernel", "gate_up": "_gate_up_kernel", "down": "_down_kernel",
             "lm_head": "_lm_head_argmax_kernel"}


def run(state: dict, opts, pdl: bool, spec, report, add_row, kernel_rows, plain_graph=None) -> None:
    """The clocked step over ``state`` (weights, cache, pos, token, counts, step_index, reset: the
    bench's fused-step state), its ``steps`` row through ``add_row(label, fn, reset)`` and the three
    tables (module docstring). ``kernel_rows(graph)``: the profiler's table of one replay
    (``decode_step.kernel_rows``); ``plain_graph``: the unclocked step's graph, profiled beside it."""
    from ..kernels import decode_step as ds
    from ..measure import step_clock

    reset = state["reset"]
    label = "fused PDL clocked" if pdl else "fused clocked"
    step = ds.FusedDecodeStep(state["weights"], state["cache"], state["pos"], token=state["token"], pdl=pdl,
                              counts=(state["counts"], state["step_index"]), clock_rows=opts.cache_len)
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
    whole = step_clock.steps(df)
    mean_pos = opts.pos + opts.reps // 2
    nbytes = step.weight_bytes()
    kv = step.kv_bytes(mean_pos)
    bw = spec.mem_bw_gbs if spec else None
    table = report.table("clock_modules", f"{label}: per module from the in-kernel clock ({len(whole)} steps, "
                         f"positions {opts.pos + 1}..{opts.pos + opts.reps - 1})",
                         ["module_group", "launches_step", "wait_us", "work_us", "clock_us", "step_share", "mb_step",
                          "bw_floor_us", "floor_share"])
    for rec in step_clock.modules(df, nbytes, kv, bw):
        table.add(**rec)
    launches = report.table("clock_launches", f"{label}: per launch from the in-kernel clock (median over steps)",
                            ["launch", "kernel", "layer", "wait_us", "work_us", "lead_us"])
    for rec in step_clock.by_launch(df):
        launches.add(**rec)
    _reconcile(df, whole, graph, plain_graph, label, report, kernel_rows)
    if len(whole):
        report.note(f"{label}: median step by the in-kernel clock {statistics.median(whole):.1f} µs over {len(whole)} "
                    f"steps; the clock's least non-zero step within a launch {_granularity(stamps)} ns")


def _granularity(stamps: list) -> int:
    """The least non-zero difference between two stamps of one launch (ns): the clock's tick as seen."""
    diffs = [d for *_, entry, release, end in stamps for d in (release - entry, end - release) if d > 0]
    return min(diffs) if diffs else 0


def _reconcile(df, whole, graph, plain_graph, label: str, report, kernel_rows) -> None:
    """The ``clock_kernels`` table (module docstring)."""
    done = df[df["row"].isin(whole.index)].assign(span_us=lambda d: (d["end"] - d["entry"]) / 1e3,
                                                  kernel=lambda d: d["label"].map(KERNEL_OF))
    clock = done.groupby(["kernel", "row"])["span_us"].sum().groupby("kernel").median()
    launches = done.groupby("kernel").size() / max(len(whole), 1)
    profiled = {f"{label} (graph)": graph}
    if plain_graph is not None:
        profiled[label.replace(" clocked", "") + " (graph)"] = plain_graph
    sums = {name: {k: us for k, _, us in kernel_rows(g)[0]} for name, g in profiled.items()}
    table = report.table("clock_kernels", "per kernel function and step: in-kernel entry-to-end (median over steps) "
                         "beside the profiler's durations of one replayed step",
                         ["kernel", "launches", "entry_end_us", "step", "us_sum"])
    for kernel in clock.index:
        for name, s in sums.items():
            table.add(kernel=kernel, launches=float(launches[kernel]), entry_end_us=float(clock[kernel]), step=name,
                      us_sum=s.get(kernel))
