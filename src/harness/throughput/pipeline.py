"""``python -m harness run +experiment=throughput``: the pipeline's sustained pages/s per batch size.

Set-up, in this order, so bad input fails before any model is built: device and dtype; the settings
(``plan.resolve``); the pages (a folder, or N synthetic pages) with their decode budgets; the batch
groups of every batch size; one template request per layout (shapes of the host buffers); the
execution (``execution.execution_for``, checked). Then the worker pool starts (it writes the
synthetic pages while the model is built), and the model is built once.

Per configuration (batch size): the execution is applied, host buffers are allocated (pinned on
CUDA), a ``Feeder`` thread keeps the workers busy ahead of the device, ``warmup_batches`` batches
run (compile, capture), then the steady window: batches run back to back until it closes
(``Settings``), each batch's copy to the device issued before the previous batch is launched, so
it overlaps it. Its raw tables (``window``) and its row are written as soon as it finishes, whole
(a signal waits for the end of the write); a signal or an error keeps the finished configurations
and closes the run directory. The run directory, signals, timing phases, report pacing and the close
are the run lifecycle's (``harness.lifecycle``): this module plugs into it as ``EXPERIMENT``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd
import torch
from PIL import Image

from .. import workload as wl
from ..layout import Case, CropMode, get_mode
from ..config import ExecutionConfig, HarnessConfig
from ..errors import HarnessError
from ..measure.nvtx_ranges import NvtxRanges
from ..models.generate import generate
from ..models.routing import experts_per_step, routing_label
from ..lifecycle import Experiment, RunContext, setup_seconds
from ..rundir import RunData, RunDir
from ..setup import device_info, load_adapter, resolve_device, resolve_dtype
from ..stopping import Position
from . import plan, prep
from .ahead import launch, use
from .barrier import window_barrier
from .clock import BatchClock, Marks
from .execution import apply_execution, changed_knobs, execution_for, layered, shadowed
from .feeder import Feeder, HostBatch, Layout
from .section import write_outputs
from .staging import Staged, Stager
from ..schema.throughput import BATCHES_CSV, PREP_CSV, SPANS_CSV, THROUGHPUT_CSV
from .window import summarize

SPARE_BUFFERS = 2   # host buffers beyond those being filled: the batch running and the one staged


def buffer_counts(groups: dict, depth: int) -> dict:
    """Host buffers per layout: ``depth + SPARE_BUFFERS`` shared by the layouts in proportion to their
    pages, at least 2 each (one being filled while the device reads another)."""
    total = sum(len(v) for v in groups.values())
    return {k: max(2, -(-(depth + SPARE_BUFFERS) * len(v) // total)) for k, v in groups.items()}


@dataclass
class Setup:
    """Everything a configuration needs that is fixed for the run."""

    settings: plan.Settings
    mode: CropMode
    sources: list
    groups: dict            # batch size -> {layout: [page index]}
    layouts: dict           # layout key -> Layout
    cache_len: int
    execution_text: str
    notes: list = field(default_factory=list)
    device_prep: bool = False    # execution.preprocess=device: workers hand back 8-bit pages


class Outputs:
    """The run's tables, grown one finished configuration at a time (``add``) and written with the
    report section (``write``)."""

    def __init__(self, rd: RunDir):
        self.rd = rd
        self.rows: list = []
        self.timeline: list = []
        self.lanes: dict = {}

    @property
    def table(self) -> pd.DataFrame:
        return THROUGHPUT_CSV.frame(self.rows)

    def add(self, row: dict, batches: pd.DataFrame, spans: pd.DataFrame, prep_rows: pd.DataFrame, panel,
            case_entry: dict) -> None:
        """One finished configuration into the run directory, through its files' schema
        (``harness.schema.throughput``)."""
        rd = self.rd
        THROUGHPUT_CSV.write(rd, self.rows + [row])
        self.rows.append(row)
        BATCHES_CSV.append(rd, batches)
        SPANS_CSV.append(rd, spans)
        if len(prep_rows):
            PREP_CSV.append(rd, prep_rows)
        self.timeline.append(panel)
        rd.manifest["cases"].append(case_entry)
        rd.save()

    def write(self, plot: bool) -> dict:
        return write_outputs(self.rd, self.table, self.timeline, plot=plot)

    def lane(self, pid: int) -> int:
        """The timeline lane of a worker process, in order of first appearance."""
        return self.lanes.setdefault(pid, len(self.lanes))


class Throughput(Experiment):
    """The throughput experiment (``experiment_module: harness.throughput.pipeline``, set by
    ``conf/experiment/throughput.yaml``) in the run lifecycle (``harness.lifecycle``): its cases are
    the batch sizes; ``write`` is throughput.md, report.md and the charts (``Outputs``)."""

    @classmethod
    def check(cls, cfg: HarnessConfig, sweep=None) -> None:
        if cfg.throughput is None:
            raise HarnessError("experiment_module=harness.throughput.pipeline needs the throughput settings, and "
                               "throughput is unset", "run +experiment=throughput")
        if cfg.throughput.overlap_vision and cfg.model.name == "vendor":
            raise HarnessError("throughput.overlap_vision hands the next batch's image embeddings to the harness's "
                               "model; model=vendor runs the vendor's own code", "leave overlap_vision off")
        from .gpus import plan_for
        plan_for(cfg, sweep)         # throughput.gpus: more than visible, a CPU or a one-GPU-per-job sweep refused

    @staticmethod
    def _best(cfg: HarnessConfig) -> bool:
        """Whether the run layers the named execution ``best`` (``throughput.best``, or the device's default)."""
        return plan.resolve(cfg.throughput, resolve_device(cfg.device).type == "cuda").best

    @classmethod
    def check_overrides(cls, cfg: HarnessConfig, overrides: list) -> None:
        """Refuse an ``execution.<knob>=<default>`` override that ``best`` would shadow (``execution.shadowed``)."""
        lost = shadowed(cfg, cls._best(cfg), overrides)
        if lost:
            knob, value = lost[0]
            raise HarnessError(f"execution.{knob}={getattr(cfg.execution, knob)} is the knob's default, which does not "
                               f"override the named execution best's {knob}={value} under throughput.best",
                               f"write throughput.execution.{knob}={getattr(cfg.execution, knob)}, or set "
                               "throughput.best=false")

    @classmethod
    def execution_of(cls, cfg: HarnessConfig, execution):
        """``best``'s knobs under ``execution`` (a case's, or ``execution.*``; ``execution.layered``): what a
        knob override is checked with."""
        return layered(cfg, cls._best(cfg), execution)

    def data(self, rd: RunDir) -> RunData:
        self.out, self.gpus = Outputs(rd), self.gpu_plan()
        return RunData(rd.path, rd.manifest)

    def gpu_plan(self):
        """``throughput.gpus``'s plan (``gpus.plan_for``): over N GPUs (``hosts``), or None: this process."""
        from .gpus import plan_for
        return plan_for(self.cfg)

    def task(self) -> list:
        """The run's own overrides (Hydra's task overrides): what each GPU's child process runs."""
        from hydra.core.hydra_config import HydraConfig
        return list(HydraConfig.get().overrides.task)

    def command(self, overrides: list) -> list:
        """A child process's argv (``hosts.child_command``)."""
        from .hosts import child_command
        return child_command(overrides)

    def measure(self, run: RunContext) -> None:
        if self.gpus is None:
            _measure(self.cfg, run, self.out)
            return
        from .hosts import measure_gpus
        measure_gpus(run, self.gpus, self.task(), command=self.command)

    def write(self, run: RunContext, plot: bool = True, final: bool = True) -> dict:
        if self.gpus is None:
            return self.out.write(plot=plot)
        from .scaling import write_scaling
        return write_scaling(run.rd, self.gpus.gpus, self.gpus.workers)


# ------------------------------------------------------------------------------------ set-up

def prepare(cfg: HarnessConfig, cuda: bool, folder: Path) -> Setup:
    """Settings, pages, budgets, batch groups, layouts and execution, checked (no model, no pool)."""
    s = plan.resolve(cfg.throughput, cuda)
    w = cfg.workload
    mode = get_mode(w.mode)
    if s.tokens is None and w.decode_tokens < 1:
        raise HarnessError(f"workload.decode_tokens={w.decode_tokens}: a throughput run decodes at least one "
                           "token per page", "set workload.decode_tokens=1 or more, or throughput.tokens")
    if s.best and not cuda:
        raise HarnessError("throughput.best=true runs CUDA graphs and compiled kernels, and there is no CUDA "
                           "device here", "leave throughput.best unset on the CPU (it runs model.*)")
    if w.images:
        sources = plan.folder_sources(w, w.decode_tokens, s.tokens)
    else:
        sources = plan.synthetic_sources(w, s.pages, folder, plan.page_budgets(s.pages, w.decode_tokens, s.tokens))
    if max(s.batches) > len(sources):
        raise HarnessError(f"throughput.batches={list(s.batches)}: a batch of {max(s.batches)} pages is larger "
                           f"than the {len(sources)} distinct pages",
                           "lower the batch, or give more pages (throughput.pages, or a larger folder)")
    groups, notes = {}, []
    for b in s.batches:
        groups[b], skipped = plan.batch_groups(sources, b)
        notes += skipped
    tokenizer, _ = wl.load_tokenizer(cfg.model.path, w.text_tokens)
    layouts = {}
    for key in {k for g in groups.values() for k in g}:
        first = next(src for src in sources if src.layout == key)
        blank = wl.Page(first.name, Image.new("RGB", first.size, (255, 255, 255)), "template")
        layouts[key] = Layout.of(wl.build_request([blank], mode, decode_tokens=0, prompt=w.prompt,
                                                  tokenizer=tokenizer, text_tokens=w.text_tokens, seed=w.seed))
    longest = max(lay.seq for lay in layouts.values())
    cache_len = ExecutionConfig().cache_len(longest, max(src.budget for src in sources))
    device = resolve_device(cfg.device)   # checked where the run runs (a plan for CUDA made on a CPU is not)
    here = device if (device.type == "cuda") == cuda else None
    m = execution_for(cfg, s.best, cache_len, here, resolve_dtype(cfg.dtype, device))
    text = ("best: " if s.best else "execution.*: ") + (", ".join(f"{k}={v}" for k, v in changed_knobs(m).items())
                                                        or "vendor-style")
    device_prep = m.preprocess == "device"
    if device_prep:     # host buffers of 8-bit pages: room for the largest page of each layout
        layouts = {k: dataclasses.replace(lay, page_bytes=max(3 * src.size[0] * src.size[1] for src in sources
                                                               if src.layout == k))
                   for k, lay in layouts.items()}
    return Setup(s, mode, sources, groups, layouts, cache_len, text, notes, device_prep)


def start_pool(cfg: HarnessConfig, setup: Setup, stack: contextlib.ExitStack) -> tuple:
    """(pool, futures of the synthetic pages being written): ``workers`` spawned processes."""
    w = cfg.workload
    spec = prep.PrepSpec(tuple(src.path for src in setup.sources), setup.mode, w.prompt, w.text_tokens, w.seed,
                         cfg.model.path, w.max_pixels, cfg.measure.nvtx, w.pdf_dpi, setup.device_prep)
    pool = ProcessPoolExecutor(setup.settings.workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=prep.init_worker, initargs=(spec,))
    stack.callback(pool.shutdown, wait=True, cancel_futures=True)
    for _ in range(setup.settings.workers):
        pool.submit(prep.started)
    draws = [] if w.images else [pool.submit(prep.draw_page, src.index, w.seed, src.size, src.path)
                                 for src in setup.sources]
    return pool, draws


def _measure(cfg: HarnessConfig, ctx: RunContext, out: Outputs) -> None:
    rd, where, say, stack, timeline = ctx.rd, ctx.where, ctx.say, ctx.stack, ctx.timeline
    where.at("setup")
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    cuda = device.type == "cuda"
    rd.update(device=device_info(device), dtype=str(dtype).replace("torch.", ""))
    folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="harness-pages-")))
    setup = prepare(cfg, cuda, folder)
    s = setup.settings
    where.cases = len(s.batches)
    for note in setup.notes:
        rd.warn(note)
    pool, draws = start_pool(cfg, setup, stack)
    say(f"[harness] throughput: device {device} dtype {dtype}; {len(setup.sources)} distinct pages, batches "
        f"{list(s.batches)}, {s.workers} worker(s); building the model")
    timeline.enter("model build")
    model, info = load_adapter(cfg.model, device, dtype, cfg.seed)
    say(f"[harness] model {info.get('adapter')} built in {info['build_s']:.1f} s")
    timeline.enter("set-up")
    for f in draws:
        f.result()
    rd.update(model=info, throughput={
        **s.to_dict(), "mode": setup.mode.name, "page_kind": "pages from " + str(cfg.workload.images)
        if cfg.workload.images else "synthetic pages", "pages": len(setup.sources),
        "tokens": plan.tokens_text(s.tokens, cfg.workload.decode_tokens), "execution_label": setup.execution_text,
        "static_cache_len": setup.cache_len, "notes": setup.notes})
    nvtx = NvtxRanges(cfg.measure.nvtx)
    if not nvtx.available:
        rd.warn(nvtx.reason)
    marks = Marks(cuda)
    ctx.begin_cases()
    for i, batch in enumerate(s.batches):
        name = f"b{batch}"
        where.at("case", name, i + 1)
        timeline.enter("case set-up")
        execution = apply_execution(model, cfg, s.best, setup.cache_len)
        run = ConfigRun(cfg, setup, model, batch, name, pool, marks, Stager(device, dtype, marks, nvtx), nvtx, out.lane)
        timeline.enter("warm-up + window")
        try:
            row, tables, panel, warm_s = run.measure(where, i + 1, say)
        finally:
            run.close()
        row.update(config=name, batch=batch, workers=s.workers, pages=len(setup.sources),
                   tokens=plan.tokens_text(s.tokens, cfg.workload.decode_tokens),
                   routing=routing_label(cfg.workload.routing, cfg.workload.routing_seed),
                   **stage_mfus(model, setup, batch, row, rd.manifest.get("device"), dtype, execution))
        where.at("case", name, i + 1, "writing")
        timeline.enter("writing")
        entry = {**run.last_case.to_dict(), "name": name, "execution": {**execution, **setup_seconds(model)},
                 "warmup_s": round(warm_s, 3), "throughput": {k: row[k] for k in ("pages_s", "bound", "window_s")}}
        with ctx.case_written(i + 1, len(s.batches)):   # whole: a signal waits
            out.add(row, *tables, panel=panel, case_entry=entry)
        say(f"[harness] {name}: {row['pages_s']:,.2f} pages/s, {row['decode_tok_s']:,.0f} tok/s over "
            f"{row['window_s']:.1f} s ({row['window_pages']} pages); bound {row['bound']}")


#: the stages whose model FLOPs utilisation the throughput table shows (``<stage>_mfu``)
MFU_STAGES = ("sam", "clip", "prefill")


def stage_mfus(model, setup: Setup, batch: int, row: dict, device: Optional[dict], dtype,
               execution: Optional[dict] = None) -> dict:
    """{``<stage>_mfu``: model FLOPs utilisation at ``batch``} of each of ``MFU_STAGES``: the stage's
    analytic useful FLOPs for ``batch`` pages (``harness.analytic``: every view of the mode's layout;
    the prefill over the layout's prompt, BOS + text + image tokens, top-k experts per token) / its
    measured span per batch (``row["<stage>_ms"]``) / the device's dense datasheet peak in ``dtype``
    (``roofline.specs``), counted under the knobs of ``execution`` (what ``variants.apply`` returned:
    with ``prefill_logits=last`` the prefill's lm_head runs on one row per page). None where the pages
    have more than one layout (their FLOPs differ), the device has no datasheet peak or nothing was
    timed."""
    from ..analytic import useful_flops
    from ..config import cost_config
    from ..knobs import cost_knobs
    from ..roofline.point import mfu
    from ..roofline.specs import device_name_of, resolve_peaks

    out = {f"{st}_mfu": None for st in MFU_STAGES}
    layouts = list(setup.layouts.values())
    peak = resolve_peaks(device_name_of(device), str(dtype).replace("torch.", "")).peak_tflops
    if len(layouts) != 1 or not peak:
        return out
    case = Case(setup.mode, layouts[0].grid, batch, layouts[0].text_tokens, 1, "mfu")
    flops = useful_flops(case, cost_config(model.cfg, cost_knobs(execution or {})))
    return {f"{st}_mfu": mfu(flops[st], row.get(f"{st}_ms"), peak) for st in MFU_STAGES}


# ------------------------------------------------------------------------------ one configuration

@dataclass
class BatchRecord:
    """One batch run: its staged request, clock and wait [ms]; its routing counts on their way back
    (``pending``, read by ``settle`` once a later batch is launched: no host synchronisation per batch)."""

    staged: Staged
    clock: BatchClock
    wait_ms: float
    pending: Optional[object] = None
    experts_step: float = float("nan")   # median distinct experts per MoE layer per decode step (nan: no counts)
    vision: Optional[BatchClock] = None  # its vision stages' clock when computed ahead (throughput.overlap_vision)

    def settle(self) -> None:
        """Read the routing counts back (waits for this batch's copy of them alone) into ``experts_step``."""
        if self.pending is not None:
            _, steps = self.pending()
            touched = experts_per_step(steps)
            self.experts_step = float(np.median(touched)) if len(touched) else float("nan")
            self.pending = None


class ConfigRun:
    """One batch size: its feeder, its batches (``run_batch``), its warm-up and window (``measure``)."""

    def __init__(self, cfg, setup: Setup, model, batch: int, name: str, pool, marks: Marks, stager: Stager, nvtx,
                 lane):
        self.cfg, self.setup, self.model, self.batch, self.name, self.lane = cfg, setup, model, batch, name, lane
        self.marks, self.stager, self.nvtx = marks, stager, nvtx
        groups = setup.groups[batch]
        depth = max(setup.settings.prefetch, -(-2 * setup.settings.workers // batch))
        buffers = {k: [HostBatch(k, setup.layouts[k], batch, pin=stager.cuda) for _ in range(n)]
                   for k, n in buffer_counts(groups, depth).items()}
        layout_of = {i: k for k, members in groups.items() for i in members}
        self.feeder = Feeder(pool, plan.batch_stream(groups, batch), layout_of, buffers, depth)
        self.staged: Optional[Staged] = None
        self.staged_wait_ms = 0.0
        self.last_case: Optional[Case] = None
        self.unsettled: Optional[BatchRecord] = None
        self.overlap = setup.settings.overlap_vision
        self.vstream = torch.cuda.Stream(stager.device) if self.overlap and stager.cuda else None
        self.ahead = None            # the next batch's vision, launched when this batch's decode started
        self.feeder.start()

    def close(self) -> None:
        self.feeder.stop()
        self.staged = None

    def _stage(self, block: bool) -> Optional[Staged]:
        t0 = time.perf_counter_ns()
        ready = self.feeder.get() if block else self.feeder.poll()
        if ready is None:
            return None
        self.staged_wait_ms = (time.perf_counter_ns() - t0) / 1e6 if block else 0.0
        src = [self.setup.sources[i] for i in ready.pages]
        lay = ready.host.layout
        case = Case(self.setup.mode, lay.grid, len(src), lay.text_tokens, max(p.budget for p in src), self.name)
        w = self.cfg.workload
        return self.stager.stage(ready, case, [p.name for p in src], w.prompt, w.routing, w.routing_seed)

    def run_batch(self) -> BatchRecord:
        """One batch: its copy waited for, the next batch's copy issued, the batch generated, the
        batch before it settled (its routing counts read back): no host synchronisation of its own."""
        cur = self.staged or self._stage(block=True)
        wait_ms = self.staged_wait_ms if self.staged is None else 0.0
        self.stager.wait(cur)
        self.staged = self._stage(block=False)
        clock = BatchClock(self.marks, self.nvtx)
        ahead, self.ahead = (self.ahead if self.ahead is not None and self.ahead.staged is cur else None), None
        request = cur.request if ahead is None else use(ahead, cur.request, self.stager.cuda)
        self.nvtx.push("batch", cur.ready.number)
        try:
            result = generate(self.model, request, self._stage_fn(clock) if self.overlap else clock, defer_routing=True)
        finally:
            self.nvtx.pop()
        if self.unsettled is not None:       # the batch before: done, or running ahead of this one
            self.unsettled.settle()
        self.marks.done(cur.copy_end)
        self.feeder.release(cur.ready.host)
        self.last_case = cur.request.case
        self.unsettled = BatchRecord(cur, clock, wait_ms, result.pending, vision=ahead.clock if ahead else None)
        return self.unsettled

    def _stage_fn(self, clock: BatchClock):
        """``clock`` that launches the next batch's vision (``ahead.launch``) as the decode range opens,
        when that batch is staged (``throughput.overlap_vision``)."""
        def stage(name: str, **kw):
            if name == "decode" and self.ahead is None and self.staged is not None:
                self.ahead = launch(self.model, self.staged, self.stager, self.marks, self.nvtx, self.vstream)
            return clock(name, **kw)
        return stage

    def measure(self, where: Position, index: int, say) -> tuple:
        """(row, (batches, spans, prep) frames, timeline panel, warm-up seconds)."""
        s = self.setup.settings
        self.marks.base()
        t0 = time.perf_counter()
        for k in range(s.warmup_batches):
            where.at("case", self.name, index, f"warmup={k}")
            self.run_batch()
        warm_s = time.perf_counter() - t0
        say(f"[harness] {self.name}: {s.warmup_batches} warm-up batch(es) in {warm_s:.1f} s; steady window")
        cuda = self.stager.cuda
        self.ahead = None             # overlap_vision: the first window batch runs its vision inside the window
        if cuda:
            torch.cuda.synchronize()  # the warm-up's queued work done first: the barrier then releases idle GPUs
        window_barrier(self.name)     # over several GPUs (throughput.gpus): every GPU's window starts together
        self.marks.origin()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        where.at("case", self.name, index, "window")
        records, pages = [], 0
        while True:
            records.append(self.run_batch())
            pages += self.batch
            elapsed = (time.perf_counter_ns() - self.marks.origin_ns) / 1e9
            if elapsed >= s.window_s and pages >= s.window_pages:
                break
        window_s = self.marks.finish()
        self.unsettled.settle()
        peak = torch.cuda.max_memory_allocated() if cuda else None
        self.feeder.stop()
        batches, spans = self._frames(records)
        prep_rows = self._prep(window_s)
        row = summarize(batches, spans, prep_rows, window_s, s.workers, peak, overlap=self.overlap)
        first = sorted(spans["batch_no"].unique())[:s.timeline_batches]
        shown = spans[spans["batch_no"].isin(first)]
        lo, hi = (float(shown["start_s"].min()), float(shown["end_s"].max())) if len(shown) else (0.0, 0.0)
        lanes = max(s.workers, int(prep_rows["worker"].max()) + 1 if len(prep_rows) else 0)
        panel = (self.name, shown, prep_rows[(prep_rows["end_s"] >= lo) & (prep_rows["start_s"] <= hi)], lanes)
        return row, (batches, spans, prep_rows), panel, warm_s

    def _frames(self, records: list) -> tuple:
        """The window's batches and spans tables (``window``) from its records."""
        brows, srows = [], []
        for r in records:
            st, n = r.staged, r.staged.ready.number
            budgets = [self.setup.sources[i].budget for i in st.ready.pages]
            brows.append([self.name, n, len(budgets), "+".join(map(str, st.ready.pages)), max(budgets), sum(budgets),
                          st.nbytes, r.wait_ms, r.experts_step])
            srows += [[self.name, n, rng, a, b] for rng, a, b in r.clock.spans()]
            if r.vision is not None:
                srows += [[self.name, n, rng, a, b] for rng, a, b in r.vision.spans()]
            srows.append([self.name, n, "copy", self.marks.seconds(st.copy_start), self.marks.seconds(st.copy_end)])
            if st.prep_end is not None:
                srows.append([self.name, n, "preprocess", self.marks.seconds(st.copy_end),
                              self.marks.seconds(st.prep_end)])
        return BATCHES_CSV.frame(brows), SPANS_CSV.frame(srows)

    def _prep(self, window_s: float) -> pd.DataFrame:
        """Pages the workers prepared that overlap the window, on the window's time axis."""
        rows = []
        for page, pid, a, b in self.feeder.prep:
            start, end = self.marks.host_seconds(a), self.marks.host_seconds(b)
            if end >= 0 and start <= window_s:
                rows.append([self.name, page, self.lane(pid), start, end])
        return PREP_CSV.frame(rows)

EXPERIMENT = Throughput

__all__ = ["EXPERIMENT", "Throughput", "prepare", "Setup", "ConfigRun", "Outputs"]
