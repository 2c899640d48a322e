"""The ``run`` verb's default experiment (``Stages``, ``experiment_module: harness.run``): build the
model once, run every case, write the run directory, through the run lifecycle of ``harness.lifecycle``.

Steps: resolve device and dtype -> validate every case's pages and layout (before the model is
built, so bad input fails fast) -> build the model -> make sure the device has calibrated ceilings
(the cached record, or a few seconds of GEMM/copy measurement on first use unless
``hardware.calibrate=false``) -> for each case: convert the model to the case's execution
(``harness.variants.apply``; cases this device cannot run were skipped before the build), measure (warm-up,
timed repeats with the request's host preparation and copy timed, optional profiled request with
its trace), compute its analytic frame with the measured routing (per decode step) -> append to
stages.csv / kernels.csv / routing.csv / routing_steps.csv / steps.csv, update manifest.json and
report.md (rewritten between cases at most every ``harness.lifecycle.REPORT_EVERY_S``). Cases are written as they
finish, each one whole (a signal waits until its files are written); a signal inside a case after
some of its timed repeats finished writes those repeats as a partial case (``partial: true``,
``repeats_done`` in its manifest entry) before the run closes; a signal or an error keeps what was
measured and closes the run directory (``harness.stopping``). At the end the report files are
written first and the manifest says ``complete`` last. The measured tables also stay in memory
(``RunData``), so the report never reads back what the run just wrote.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd

from . import knobs, variants
from .config import HarnessConfig, cost_config
from .errors import HarnessError
from .lifecycle import Experiment, RunContext, run_experiment, setup_seconds
from .measure import host
from .measure.step_clock import kinds as launch_kinds
from .measure.kernels import llm_attention_kernels
from .measure.nvtx_ranges import NvtxRanges
from .measure.runner import CaseMeasurement, measure_case
from .measure.summary import Summary
from .models import attn_probe
from .models.generate import DECODE_WATCH
from .report.progress import DecodeProgress, RunProgress, waiting
from .report.report import write_report
from .roofline.calibrate import ensure_calibration
from .roofline.join import analytic_for_case
from .rundir import RunData, RunDir, trace_name
from .schema import CASE_TABLES
from .schema.routing import routing_rows, routing_step_rows
from .setup import check_cases, device_info, load_adapter, prepare_cases, resolve_device, resolve_dtype
from .timeline import phase_of
from .variants.fused_step import STAMPS_KEPT, numbered_stamps, request_number




def _analytic(model, case, inputs, execution: dict, counts: dict, dtype_name: str) -> tuple:
    """``analytic_for_case`` of a measured case under the execution that ran, with its measured
    routing (None where it counted nothing)."""
    ran = dataclasses.replace(inputs.execution, moe_kernel=execution.get("moe_kernel_resolved")
                              or inputs.execution.moe_kernel)
    return analytic_for_case(case, cost_config(model.cfg, knobs.cost_knobs(ran)), dtype_name,
                             counts if any(a.sum() for k, a in counts.items() if k != "decode_steps") else None)


def _warn_unsteady(rd: RunDir, progress, name: str, warm: dict, steady_pct: float) -> None:
    """A run warning when the warm-up never became steady (``measure.steady_pct``)."""
    if warm.get("steady") is False:
        msg = (f"{name}: the last 3 of {len(warm['warmup_ms'])} untimed requests still differ by more "
               f"than {steady_pct}% (host or GPU still settling)")
        rd.warn(msg)
        progress(f"[harness] {msg}")


def _kernels_from(mcfg) -> str | None:
    """Where the run's kernels come from (the manifest's ``measure.kernels_from``)."""
    if not mcfg.kernels:
        return None
    steps = (f", its first {mcfg.profile_steps} decode steps (busy per step x the timed steps)"
             if mcfg.profile_steps else "")
    return f"one extra profiled request per case{steps}"


class _CaseFrames:
    """A ``RunData`` table a run grows one case at a time: the cases' frames are kept in a list
    (``LiveRunData.grow`` costs the case's own rows) and concatenated when the table is read after a
    change (a read costs the table once; the one frame is then kept). Assigning a frame replaces them."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        frames = obj.__dict__[self.name]
        if frames is None:
            return None
        if len(frames) > 1:
            frames[:] = [pd.concat(frames, ignore_index=True)]
        return frames[0] if frames else pd.DataFrame()

    def __set__(self, obj, frame):
        obj.__dict__[self.name] = None if frame is None else ([frame] if len(frame.columns) else [])


class LiveRunData(RunData):
    """The ``RunData`` of a run in progress: the measured tables and the analytic frames grow by
    ``grow(name, frame)``, each read as one frame (``_CaseFrames``)."""

    stages = _CaseFrames()
    kernels = _CaseFrames()
    routing = _CaseFrames()
    routing_steps = _CaseFrames()
    steps = _CaseFrames()
    step_clock = _CaseFrames()
    analytic = _CaseFrames()

    def grow(self, name: str, frame: pd.DataFrame) -> None:
        """Append one case's rows to table ``name`` (numbered on from the rows before it)."""
        self.__dict__[name].append(frame.reset_index(drop=True))


class CaseTables:
    """The run's tables, grown one finished case at a time (``add``): a case's files and the
    manifest that lists it are written as one unit (``RunDir.case_files``), then the in-memory
    ``LiveRunData`` follows, so memory, manifest and CSVs agree on the cases kept whatever stops the run.
    A case costs its own rows (the CSVs are appended to, the frames kept per case)."""

    def __init__(self, rd: RunDir, data: LiveRunData):
        self.rd, self.data = rd, data

    def add(self, inputs, measured: CaseMeasurement, analytic: tuple, execution: dict, clock: dict = None) -> None:
        """One case: stages.csv (its observations), kernels.csv, steps.csv, routing_steps.csv,
        routing.csv, then the manifest with the case's entry (a case a signal stopped early: its
        finished repeats, marked ``partial`` with ``repeats_done``, ``CaseMeasurement.entry``); when
        any of them fails, all are put back and the case is not kept. ``analytic`` =
        ``analytic_for_case``'s (frame, MBU bytes, notes); ``execution``: what the adapter ran
        (``variants.apply``) with its set-up seconds; ``clock``: the fused step's stamps of each request
        (``variants.fused_step.numbered_stamps``) by the request's index in the case (warm-ups, timed
        repeats, then a profiled one), of which step_clock.csv keeps the median request's."""
        rd, data, case = self.rd, self.data, inputs.case
        kernels, counts, steps = measured.kernels, measured.routing, measured.steps
        warm, trace = measured.warmup, measured.trace
        per_step = routing_step_rows(case.name, counts.get("decode_steps"))
        rows = routing_rows(case.name, counts)
        tables = {"stages": measured.observations, "kernels": kernels if len(kernels) else None,
                  "steps": CASE_TABLES["steps"].frame(steps) if steps else None,
                  "routing_steps": CASE_TABLES["routing_steps"].frame(per_step) if per_step else None,
                  "routing": CASE_TABLES["routing"].frame(rows) if rows else None,
                  "step_clock": self._clock(case.name, measured, clock)}
        entry = {**case.to_dict(), **inputs.pages_entry(), **inputs.routing_entry(),
                 "execution": execution,
                 "warmup_ms": [round(t, 3) for t in warm.get("warmup_ms", [])], "warmup_steady": warm.get("steady"),
                 "trace": {"file": trace_name(case.name), "bytes": trace["bytes"]} if trace else None,
                 **measured.entry()}
        with rd.case_files():   # every table has fixed columns: each case's rows are appended
            for name, frame in tables.items():
                if frame is not None:
                    CASE_TABLES[name].append(rd, frame)
            rd.manifest["cases"].append(entry)
            seen = rd.manifest.get("attention") or {}
            rd.manifest["attention"] = {**seen, **{k: list(v) for k, v in attn_probe.SEEN.items()}}
            for stage, names in llm_attention_kernels(kernels).items():   # measured, all cases so far
                key = f"llm {stage}: profiled kernels"
                rd.manifest["attention"][key] = sorted(set(seen.get(key, [])) | set(names))
            try:
                rd.save()
            except BaseException:
                rd.manifest["cases"].pop()
                raise
        frame, mbu, notes = analytic
        for name, part in {**tables, "analytic": frame}.items():
            if part is not None:
                data.grow(name, part)
        data.mbu_bytes[case.name] = mbu
        data.notes += notes

    def _clock(self, case: str, measured: CaseMeasurement, clock: dict):
        """step_clock.csv's rows of ``case``: the stamps of its median request (``clock``: {the request's
        index in the case: its stamps}, the requests in order: warm-ups, timed repeats, then a profiled
        one, which an interrupted case may or may not have reached), None without stamps; the median
        request's missing (a core keeps the last ``fused_step.STAMPS_KEPT`` requests') is warned about and
        nothing written."""
        if not clock:
            return None
        warm = len(measured.warmup.get("warmup_ms", []))
        repeat = Summary(measured.observations).median_repeat.get(case)
        stamps = clock.get(warm + int(repeat)) if repeat is not None else None
        if stamps is None:
            self.rd.warn(f"case {case}: no in-kernel stamps of its median request ({len(clock)} requests' stamps "
                         f"kept, the last {STAMPS_KEPT} at most, for {warm} warm-up and "
                         f"{measured.repeats_done} timed requests): step_clock.csv not written for it")
            return None
        kind = launch_kinds([s[2] for s in stamps], [s[3] for s in stamps])
        return CASE_TABLES["step_clock"].frame([
            {"case": case, "repeat": int(repeat), "row": row, "launch": launch, "label": label, "layer": layer,
             "kind": k, "entry": entry, "release": release, "end": end}
            for (row, launch, label, layer, entry, release, end), k in zip(stamps, kind)])


def run(cfg: HarnessConfig, run_path: Path, progress=None) -> RunDir:
    """Execute the ``run`` verb's stage measurement (``Stages``) for a validated config into
    ``run_path``, through ``harness.lifecycle.run_experiment``.

    SIGINT, SIGTERM and SIGHUP end the run as ``interrupted``, any error as ``failed``
    (``harness.stopping.close_run``): the finished cases stay in the CSVs and the manifest, the
    report is rewritten, and a ``RunStopped`` carries the one stderr line and the exit code.
    """
    return run_experiment(cfg, run_path, progress, experiment=Stages)


class Stages(Experiment):
    """The stage measurement (the module docstring): the default experiment (``experiment_module:
    harness.run``). Its ``data`` grows case by case (``LiveRunData``); ``write`` is the run report."""

    @classmethod
    def check(cls, cfg: HarnessConfig, sweep=None) -> None:
        if cfg.throughput is not None:
            raise HarnessError("throughput.* is set, and experiment_module=harness.run measures stages, not the "
                               "pipeline's pages/s", "run +experiment=throughput (experiment_module: "
                               "harness.throughput.pipeline), or leave throughput unset")

    def data(self, rd: RunDir) -> LiveRunData:
        return LiveRunData(rd.path, rd.manifest, analytic=pd.DataFrame())

    def write(self, run: RunContext, plot: bool = True, final: bool = True) -> dict:
        """``write_report``; between cases (``final=False``) a reporting error is a manifest warning."""
        return write_report(run.rd, run.data, plot=plot, strict=final)

    def measure(self, run: RunContext) -> None:
        _measure(self.cfg, run, run.progress)


def _measure(cfg: HarnessConfig, run: RunContext, progress) -> None:
    """Set up, then measure and write every case (each case's results written whole: signals wait);
    ``run.timeline`` follows where the time goes."""
    rd, data, where, timeline = run.rd, run.data, run.where, run.timeline
    bar = progress is None
    progress = progress or RunProgress()
    stack = run.stack            # closed by the lifecycle when measure returns
    where.at("setup")
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    dtype_name = str(dtype).replace("torch.", "")
    cuda = device.type == "cuda"
    rd.update(device=device_info(device), dtype=dtype_name)
    if not cuda:
        rd.warn("no CUDA device: stage times are host clocks, no NVTX consumer, kernels are CPU ops")
    cases, tok_reason = prepare_cases(cfg)
    skipped = check_cases(cfg, cases, device, dtype)   # before the model is built
    for name, reason in skipped.items():
        rd.warn(f"case {name} skipped: {reason}")
        progress(f"[harness] case {name} skipped: {reason}")
    rd.update(skipped_cases=[{"case": name, "reason": reason} for name, reason in skipped.items()])
    cases = [c for c in cases if c.name not in skipped]
    where.cases = len(cases)
    if tok_reason:
        rd.warn(tok_reason)
    for note in dict.fromkeys(n for inputs in cases for n in inputs.notes):
        rd.warn(note)
        progress(f"[harness] note: {note}")
    progress(f"[harness] device {device} dtype {dtype}; {len(cases)} case(s): {', '.join(c.name for c in cases)}")
    mcfg = cfg.measure.resolved(cuda)
    run.check_memory(cfg.model, device, dtype, cases, requests=mcfg.warmup + mcfg.repeats + int(mcfg.kernels))
    attn_probe.reset()
    timeline.enter("model build")
    with waiting(progress, f"building the {cfg.model.name} model ({dtype_name}, {cfg.model.weights} weights)"):
        model, info = load_adapter(cfg.model, device, dtype, cfg.seed, workdir=rd.path / "vendor_infer")
    progress(f"[harness] model {info['model_name']} ({info.get('adapter')}, {info['params']:,} parameters) built "
             f"in {info['build_s']:.1f} s")
    rd.update(model=info)
    timeline.enter("calibration")
    with waiting(progress, "calibrating (a cached record makes this instant)"):
        rd.update(calibration=ensure_calibration(device, cfg.hardware, progress=progress))
    rd.update(measure={**dataclasses.asdict(mcfg), "gc": "Python cyclic GC paused inside each timed request",
                       "kernels_from": _kernels_from(mcfg)})
    if bar:
        progress.start((mcfg.warmup + mcfg.repeats + int(mcfg.kernels)) * len(cases))
        stack.callback(progress.stop)
    timeline.enter("host probe")
    rd.update(host_steadiness={"before": host.probe(cuda)})
    nv = NvtxRanges(mcfg.nvtx)
    if not nv.available:
        rd.warn(nv.reason)
    tables = CaseTables(rd, data)
    run.begin_cases()
    watch = DecodeProgress(getattr(progress, "inside", progress), issued=cuda)
    stack.callback(DECODE_WATCH.reset, DECODE_WATCH.set(watch))
    for i, inputs in enumerate(cases):
        case = inputs.case
        where.at("case", case.name, i + 1)
        progress(f"[harness] case {i + 1} of {len(cases)}, {case.name}: {case.to_dict()}")
        ident = {"case": case.name, "mode": case.mode.name, "grid": case.to_dict()["grid"], "batch": case.batch}

        def make(r, inputs=inputs):
            return inputs.timed_request(r, device, dtype)

        timeline.enter("case set-up")
        execution = variants.apply(model, inputs.execution, device)

        def at(request, i=i, name=case.name):
            where.at("case", name, i + 1, request)
            timeline.enter(phase_of(request))
            watch.label = f"{name}: {request}"

        trace = rd.path / trace_name(case.name) if (mcfg.kernels and mcfg.trace) else None
        first = request_number()                 # execution.step_clock: the case's requests' in-kernel stamps,
        measured = measure_case(model, make, mcfg, ident, cuda, progress=progress, at=at, trace_path=trace)
        clock = {n - first: stamps for n, stamps in numbered_stamps(model) if n >= first}   # by request index
        if measured.stopped is None:
            at("writing")
        else:   # the position stays where the signal came; the finished repeats are written first
            timeline.enter(phase_of("writing"))
            progress(f"[harness] {case.name}: interrupted after {measured.repeats_done} of "
                     f"{measured.repeats_planned} timed repeats; writing them (partial case)")
        timeline.carve((measured.trace or {}).get("seconds") or 0.0, "trace export", "profiled request")
        with run.case_written(i + 1, len(cases), stopped=measured.stopped):   # whole: a signal waits
            analytic = _analytic(model, case, inputs, execution, measured.routing, dtype_name)
            _warn_unsteady(rd, progress, case.name, measured.warmup, mcfg.steady_pct)
            tables.add(inputs, measured, analytic, {**execution, **setup_seconds(model)}, clock)
            rd.update(model={**info, **getattr(model, "info", {})})   # what the model learnt while running
        at("done")
    timeline.enter("host probe")
    rd.update(host_steadiness={**rd.manifest["host_steadiness"], "after": host.probe(cuda)})


EXPERIMENT = Stages
