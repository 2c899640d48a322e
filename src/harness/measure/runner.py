"""Warm-up, timed repeats and one optional profiled repeat of a case: its observations.

Warm-up: ``warmup`` untimed requests (``warmup_tokens`` tokens each when set: a few decode steps
run every code path and shape; the default is the request's budget); with ``steady_pct`` > 0
more, up to ``max_warmup``, until the last three took times within ``steady_pct`` % of their
median, so the timed repeats do not start while the host or GPU is still speeding up. The warm-up
times go to the manifest.

Timed repeats carry only NVTX ranges and CUDA events (no profiler), with Python's cyclic GC
paused during each request. Each request's whole ``generate()`` call is timed on the host clock,
the device synchronised before and after (``call_ms``: what its caller waits for; ``e2e_ms`` is
the request range inside it, so ``setup_collect_ms`` = call - e2e is the call's own set-up and
collection). The run of timed repeats is timed as a whole too (``timed_wall_ms``, synchronised at
both ends: the requests and the harness's own work between them).

With ``kernels=True`` one extra request runs under torch.profiler (``profiled`` = True, ``repeat``
= the number of timed repeats) with module hooks (``harness.measure.modules.ModuleTracker``: the
module, family and op group that launched each kernel; ``module_hooks=false`` leaves them out,
e.g. for compiled modules that hooks would recompile); its rows carry the kernel counts, busy
times and host syncs. With ``profile_steps`` = N it decodes only N steps (N + 1 tokens): the
summary pairs its busy time per decode step with the timed requests' steps
(``harness.measure.summary``). Profiler overhead and hooks never enter the timed rows. With a
``trace_path`` the profiled request's trace is saved as a gzipped Chrome/Perfetto trace.

``make_request(i)`` returns the request of repeat ``i`` on the device, or ``(request, prep)`` where
``prep`` = {"prep_ms": building it on the host, "h2d_ms": copying it to the device} and, for PDF
pages, "raster_ms" (rasterising them first): the request rows then carry them and ``ttft_e2e_ms`` =
raster + prep + h2d + TTFT.

``measure_case`` returns one ``CaseMeasurement``: the raw observations (``stages.csv`` rows,
``harness.measure.observations``), kernels, routing, decode steps, warm-up record and trace; a
signal after the first finished timed repeat ends the case early with its finished repeats
(``CaseMeasurement.stopped``).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import pandas as pd
import torch

from .. import knobs
from ..config import MeasureConfig
from ..floats import finite as _f
from ..interrupts import interrupted_by
from ..models.generate import generate
from .alignment import attribute_replay
from ..schema.kernels import KERNEL_COLUMNS
from .kernels import KernelCapture, kernel_table
from .modules import ModuleTracker
from .nvtx_ranges import NvtxRanges
from .recorder import StageRecorder
from .stats import median_low
from ..schema.stages import frame
from .observations import stage_rows, step_rows
from .syncs import SyncCounter

log = logging.getLogger("harness.measure")


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@contextlib.contextmanager
def layer_ranges(model: torch.nn.Module, nvtx: NvtxRanges, enabled: bool):
    """NVTX ``layer`` ranges around SAM blocks, CLIP layers and decoder layers (payload = index):
    the hooks are registered on entering and removed on leaving (``measure_case`` holds them over
    a case's timed repeats, so each layer module gets one pre- and one post-hook per case)."""
    handles = []
    if enabled and nvtx.available:
        for name, mod in model.named_modules():
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in ("blocks", "layers") and parts[-1].isdigit():
                idx = int(parts[-1])
                handles.append(mod.register_forward_pre_hook(lambda m, a, i=idx: nvtx.push("layer", i)))
                handles.append(mod.register_forward_hook(lambda m, a, o: nvtx.pop()))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def settle_gpu(ms: float) -> None:
    """Keep the GPU busy for about ``ms`` (bf16 4096^3 matmuls, synchronised every 8), so a timed
    request starts on a GPU that has just been working rather than one that sat idle between
    repeats (its clocks drop while idle). CUDA only; no-op for ms <= 0."""
    if ms <= 0:
        return
    a = torch.ones(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while (time.perf_counter() - t0) * 1e3 < ms:
        for _ in range(8):
            a @ a
        torch.cuda.synchronize()


def _sync(cuda: bool):
    if cuda:
        torch.cuda.synchronize()


@contextlib.contextmanager
def quiet_gc():
    """Collect, then keep Python's cyclic GC off for the timed request (its pauses land in
    host-bound decode steps as outliers); restored afterwards."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def is_steady(ms: list[float], pct: float, last: int = 3) -> bool:
    """True when the last ``last`` times all lie within ``pct`` % of their median."""
    if len(ms) < last:
        return False
    tail = ms[-last:]
    mid = median_low(tail)
    return all(abs(t - mid) <= pct / 100 * mid for t in tail)


def unpack(made) -> tuple:
    """(request, prep timings {} or {"prep_ms", "h2d_ms"[, "raster_ms"]}) of what ``make_request`` returned."""
    if isinstance(made, tuple):
        return made[0], dict(made[1] or {})
    return made, {}


def prep_columns(prep: dict, ttft_ms) -> dict:
    """prep_ms, h2d_ms, raster_ms (PDF pages only) and ttft_e2e_ms (= raster + prep + h2d + TTFT) of
    one request row; {} without timings."""
    if not prep:
        return {}
    out = {"prep_ms": prep.get("prep_ms"), "h2d_ms": prep.get("h2d_ms")}
    if prep.get("raster_ms") is not None:
        out["raster_ms"] = prep["raster_ms"]
    if ttft_ms is not None and out["prep_ms"] is not None and out["h2d_ms"] is not None:
        out["ttft_e2e_ms"] = out.get("raster_ms", 0.0) + out["prep_ms"] + out["h2d_ms"] + ttft_ms
    return out


def timed_call(model, req, cuda: bool, stage=None, clock: Callable[[], float] = time.perf_counter,
               max_new_tokens: Optional[int] = None) -> tuple:
    """(``GenerationResult``, wall ms) of one ``generate`` call, the device synchronised before and
    after: everything the caller waits for (``stage``: the stage function, none by default;
    ``max_new_tokens``: the request's own budget unless given)."""
    _sync(cuda)
    t0 = clock()
    kwargs = {} if stage is None else {"stage": stage}
    res = generate(model, req, max_new_tokens=max_new_tokens, **kwargs)
    _sync(cuda)
    return res, (clock() - t0) * 1e3


def request_ms(model, req, cuda: bool, stage=None, clock: Callable[[], float] = time.perf_counter,
               max_new_tokens: Optional[int] = None) -> float:
    """Wall ms of one request through ``generate``, synchronised before and after (``timed_call``)."""
    return timed_call(model, req, cuda, stage, clock, max_new_tokens)[1]


def call_columns(call_ms: float, e2e_ms) -> dict:
    """``call_ms`` and ``setup_collect_ms`` = call - e2e (the call's set-up before the request range
    and its collection after it) of one request row."""
    e2e = _f(e2e_ms)
    return {"call_ms": call_ms, "setup_collect_ms": call_ms - e2e if e2e is not None else None}


def warm_up(model, make_request: Callable[[int], object], mcfg: MeasureConfig, cuda: bool,
            say: Callable[[str], None], label: str, clock: Callable[[], float] = time.perf_counter,
            at: Callable[[str], None] = lambda request: None) -> dict:
    """Run ``mcfg.warmup`` warm-up requests (each ``mcfg.warmup_tokens`` tokens long when set: a
    few decode steps run every code path and shape of the step; None: the request's budget); with
    ``steady_pct`` > 0 keep going (up to ``max_warmup``) until ``is_steady`` holds for their wall
    times (ms, synchronised).
    ``at("warmup=I")`` is called before each. Returns {"warmup_ms": [...], "steady": bool or None
    (not asked)}."""
    times: list[float] = []
    want = mcfg.steady_pct > 0

    def more() -> bool:
        if len(times) < mcfg.warmup:
            return True
        return want and len(times) < mcfg.max_warmup and not is_steady(times, mcfg.steady_pct)

    while more():
        at(f"warmup={len(times)}")
        times.append(request_ms(model, unpack(make_request(-1 - len(times)))[0], cuda, clock=clock,
                                max_new_tokens=mcfg.warmup_tokens))
        say(f"[harness] {label}: warmup={len(times) - 1}, {times[-1]:.1f} ms (untimed)")
    return {"warmup_ms": times, "steady": is_steady(times, mcfg.steady_pct) if want else None}


@dataclass
class Repeat:
    """One finished timed repeat: its observation rows, decode-step rows and routing counts (kept
    together, so a case stopped by a signal keeps whole repeats only)."""

    rows: list
    steps: list
    routing: dict


@dataclass
class CaseMeasurement:
    """What ``measure_case`` measured for one case.

    ``observations``: the typed stages.csv rows of the timed repeats and the profiled request
    (``harness.measure.observations``); ``kernels``: the profiled request's kernels
    (``KERNEL_COLUMNS`` + ``case``); ``routing``: the last timed repeat's {phase: [layers,
    experts]}, plus ``decode_steps`` [steps, layers, experts] when the model reported per-step
    counts; ``steps``: one row per decode step of every timed repeat (``STEP_COLUMNS``);
    ``warmup``: ``warm_up``'s record {"warmup_ms", "steady"}; ``trace``: {"path", "bytes"} of the
    saved profiled-request trace, or None; ``timed_wall_ms``: wall ms of the run of timed repeats,
    the device synchronised before the first and after the last (their requests plus the
    harness's own work between them), None when a signal cut it short.

    ``stopped``: the signal (``harness.interrupts.RunInterrupted`` or KeyboardInterrupt) that
    ended the case early, None when it ran whole; then ``repeats_done`` of ``repeats_planned``
    timed repeats finished (and are all the case holds); ``profiled``: whether its profiled
    request finished (None: none was asked for)."""

    observations: pd.DataFrame
    kernels: pd.DataFrame
    routing: dict = field(default_factory=dict)
    steps: list = field(default_factory=list)
    warmup: dict = field(default_factory=dict)
    trace: Optional[dict] = None
    timed_wall_ms: Optional[float] = None
    repeats_done: int = 0
    repeats_planned: int = 0
    profiled: Optional[bool] = None
    stopped: Optional[BaseException] = None

    @property
    def partial(self) -> bool:
        """True when a signal stopped the case after some of its timed repeats (or before its
        profiled request finished)."""
        return self.stopped is not None

    def entry(self) -> dict:
        """The manifest's record of how the case ended: ``timed_wall_ms`` (when whole), and for a
        case a signal stopped ``partial: true``, ``repeats_done``, ``repeats_planned`` and
        ``profiled``."""
        out = {"timed_wall_ms": None if self.timed_wall_ms is None else round(self.timed_wall_ms, 3)}
        if self.partial:
            out.update(partial=True, repeats_done=self.repeats_done, repeats_planned=self.repeats_planned,
                       profiled=self.profiled)
        return out


def _timed_repeat(model, req, prep: dict, r: int, mcfg: MeasureConfig, case: dict, cuda: bool, wbytes: int,
                  note: str) -> Repeat:
    """Timed repeat ``r`` of ``req`` (NVTX + CUDA events, GC paused, the ``generate`` call timed as
    a whole): its rows, steps and routing."""
    rec = StageRecorder(cuda, nvtx=mcfg.nvtx, events=mcfg.events)
    with quiet_gc():
        if cuda:
            settle_gpu(mcfg.settle_ms)
        res, call_ms = timed_call(model, req, cuda, rec)
    ranges = rec.finish()
    rows = []
    for row in stage_rows(ranges, None, req.batch):
        row.update(case, repeat=r, profiled=False, weight_bytes=wbytes if row["stage"] == "request" else None,
                   kv_cache_bytes=res.kv_cache_bytes if row["stage"] == "request" else None, note=note)
        if row["stage"] == "request":
            row.update(prep_columns(prep, row.get("ttft_ms")))
            row.update(call_columns(call_ms, row.get("e2e_ms")))
        rows.append(row)
    prompt = res.prompt_tokens or req.prefill_tokens   # the vendor's infer() builds its own prompt
    steps = [{"case": case["case"], "repeat": r, **row} for row in step_rows(ranges, prompt)]
    routing = dict(res.routing)
    if res.routing_steps is not None:
        routing["decode_steps"] = res.routing_steps
    return Repeat(rows, steps, routing)


def _profiled_request(model, req, prep: dict, mcfg: MeasureConfig, case: dict, cuda: bool, note: str,
                      say: Callable[[str], None], trace_path) -> tuple:
    """The profiled request (kernel capture, module hooks, sync counting), ``mcfg.profile_steps``
    decode steps when set: (its observation rows, its kernels, its trace record or None)."""
    rec = StageRecorder(cuda, nvtx=mcfg.nvtx, events=mcfg.events, annotate=True)
    syncs = SyncCounter(rec)
    # module hooks would recompile a compiled step and never run inside a captured graph
    hooks = mcfg.module_hooks and knobs.allows_module_hooks(getattr(model, "execution", None))
    tracker = ModuleTracker(model) if hooks else contextlib.nullcontext()
    n_new = None if mcfg.profile_steps is None else min(mcfg.profile_steps + 1, req.decode_tokens)
    with tracker as modules, KernelCapture(cuda) as prof, quiet_gc(), \
            (syncs.counting() if cuda else contextlib.nullcontext()):
        generate(model, req, syncs, max_new_tokens=n_new)
        ranges = rec.finish()
    kern = kernel_table(prof, cuda, ranges, modules)
    if mcfg.module_hooks and not hooks:   # graphed / compiled steps: modules by alignment
        kern = attribute_replay(model, req, kern, cuda)   # harness.measure.alignment
    kern.insert(0, "case", case["case"])
    trace = None
    if trace_path is not None:
        t_trace = time.perf_counter()
        size = prof.save_trace(trace_path, ranges)
        trace = {"path": str(trace_path), "bytes": size, "seconds": time.perf_counter() - t_trace}
        say(f"[harness] {case['case']}: trace {trace_path} ({size / 1e6:.1f} MB)")
    n_steps = int((ranges["range"] == "decode_step").sum())
    rows = []
    for row in stage_rows(ranges, kern, req.batch):
        row.update(case, repeat=mcfg.repeats, profiled=True, note=note)
        if row["stage"] == "request":
            row.update(prep_columns(prep, row.get("ttft_ms")))
        if cuda:
            row["host_syncs"] = syncs.counts.get(row["stage"], 0) if row["stage"] != "request" \
                else sum(syncs.counts.values()) - syncs.counts.get("decode_step", 0)
            if row["stage"] == "decode" and n_steps:
                row["syncs_per_step"] = syncs.counts.get("decode_step", 0) / n_steps
        rows.append(row)
    return rows, kern, trace


def measure_case(model, make_request: Callable[[int], object], mcfg: MeasureConfig, case: dict,
                 cuda: bool, progress: Callable[[str], None] | None = None,
                 at: Callable[[str], None] = lambda request: None, trace_path=None) -> CaseMeasurement:
    """Run one case (warm-up, timed repeats, optional profiled request): its ``CaseMeasurement``.

    ``make_request(i)`` builds request ``i`` on the model's device (i < 0 for warm-ups), see the
    module docstring. ``case`` holds the identifying columns: case, mode, grid, batch. With
    ``trace_path`` (and kernel capture) the profiled request's trace is saved there (its ``trace``
    record: {"path", "bytes", "seconds": host seconds the export took}). ``at(request)`` is called
    before each request with its label: ``warmup=I``, ``repeat=R`` (stages.csv's repeat),
    ``repeat=profiled``.

    A signal (``harness.interrupts.interrupted_by``) during the timed repeats or the profiled
    request, after at least one timed repeat finished, ends the case early: the finished repeats
    come back (``stopped`` holds the signal for the caller to raise once they are written). One
    during the warm-up or the first timed repeat propagates: nothing of the case finished.
    """
    say = progress or (lambda msg: log.info(msg))
    mcfg = mcfg.resolved(cuda)
    wbytes = weight_bytes(model)
    note = "" if cuda else "no CUDA device: gpu_ms/TTFT/TPOT from host clocks; kernel columns are CPU ops"
    warm = warm_up(model, make_request, mcfg, cuda, say, case["case"], at=at)
    done: list = []
    stopped, wall_ms = None, None
    try:
        _sync(cuda)
        t_run = time.perf_counter()
        # layer ranges in the timed repeats only, hooked once for all of them (none in warm-up or profiled)
        with layer_ranges(model, NvtxRanges(mcfg.nvtx), mcfg.layer_ranges):
            for r in range(mcfg.repeats):
                at(f"repeat={r}")
                req, prep = unpack(make_request(r if mcfg.fresh_inputs else 0))
                done.append(_timed_repeat(model, req, prep, r, mcfg, case, cuda, wbytes, note))   # whole or not
                req_row = done[-1].rows[-1]
                say(f"[harness] {case['case']}: repeat={r} ({r + 1} of {mcfg.repeats}), request "
                    f"{req_row['e2e_ms']:.1f} ms ({req_row['timer']})")
        _sync(cuda)
        wall_ms = (time.perf_counter() - t_run) * 1e3
    except BaseException as exc:
        if interrupted_by(exc) is None or not done:
            raise
        stopped = exc
    rows = [row for rep in done for row in rep.rows]
    kern, trace, profiled = pd.DataFrame(columns=KERNEL_COLUMNS + ["case"]), None, (False if mcfg.kernels else None)
    if mcfg.kernels and stopped is None:
        say(f"[harness] {case['case']}: profiled request (kernel capture"
            + (f", first {mcfg.profile_steps} decode steps)" if mcfg.profile_steps else ")"))
        try:
            at("repeat=profiled")
            req, prep = unpack(make_request(mcfg.repeats))
            prof_rows, kern, trace = _profiled_request(model, req, prep, mcfg, case, cuda, note, say, trace_path)
            rows += prof_rows
            profiled = True
        except BaseException as exc:
            if interrupted_by(exc) is None:
                raise
            stopped = exc
            kern = pd.DataFrame(columns=KERNEL_COLUMNS + ["case"])
    return CaseMeasurement(frame(rows), kern, done[-1].routing if done else {},
                           [s for rep in done for s in rep.steps], warm, trace, wall_ms, len(done), mcfg.repeats,
                           profiled, stopped)
