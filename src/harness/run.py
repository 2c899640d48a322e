"""The ``run`` verb: build the model once, run every case, write the run directory.

Steps: resolve device and dtype -> validate every case's pages and layout (before the model is
built, so bad input fails fast) -> build the model -> make sure the device has calibrated ceilings
(the cached record, or a few seconds of GEMM/copy measurement on first use unless
``hardware.calibrate=false``) -> for each case: measure (warm-up, timed repeats with the request's host
preparation and copy timed, optional profiled request with its trace), compute its analytic frame
with the measured routing (per decode step) -> append to stages.csv / kernels.csv / routing.csv /
routing_steps.csv, update manifest.json and report.md. Cases are
written as they finish; an interruption keeps what was measured. The measured tables also stay in
memory (``RunData``), so the report never reads back what the run just wrote.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path

import pandas as pd

from .config import HarnessConfig, to_dict
from .measure import host
from .measure.nvtx_ranges import NvtxRanges
from .measure.runner import measure_case
from .models import attn_probe
from .report.progress import RunProgress
from .report.report import write_report
from .roofline.calibrate import ensure_calibration
from .roofline.join import analytic_for_case
from .rundir import RunData, RunDir, trace_name
from .setup import device_info, load_adapter, prepare_cases, resolve_device, resolve_dtype

log = logging.getLogger("harness.run")


def routing_rows(case: str, routing: dict) -> list:
    """routing.csv rows (case, phase, layer, e0..eN) of one case's ``GenerationResult.routing``."""
    rows = []
    for phase, arr in routing.items():
        if phase == "decode_steps":
            continue
        for layer, counts in enumerate(arr):
            if counts.sum():
                rows.append({"case": case, "phase": phase, "layer": layer,
                             **{f"e{j}": int(c) for j, c in enumerate(counts)}})
    return rows


def routing_step_rows(case: str, steps) -> list:
    """routing_steps.csv rows (case, step, layer, experts = distinct experts touched, e0..eN) of a
    [steps, layers, experts] decode count array; layers that routed nothing are left out."""
    rows = []
    for step, arr in enumerate(steps if steps is not None else []):
        for layer, counts in enumerate(arr):
            if counts.sum():
                rows.append({"case": case, "step": step, "layer": layer, "experts": int((counts > 0).sum()),
                             **{f"e{j}": int(c) for j, c in enumerate(counts)}})
    return rows


def run(cfg: HarnessConfig, run_path: Path, progress=None) -> RunDir:
    """Execute the ``run`` verb for a validated config into ``run_path``."""
    rd = RunDir(run_path, to_dict(cfg))
    bar = progress is None
    progress = progress or RunProgress()
    with rd.guard(), contextlib.ExitStack() as stack:
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device)
        dtype_name = str(dtype).replace("torch.", "")
        cuda = device.type == "cuda"
        rd.update(device=device_info(device), dtype=dtype_name)
        if not cuda:
            rd.warn("no CUDA device: stage times are host clocks, no NVTX consumer, kernels are CPU ops")
        cases, tok_reason = prepare_cases(cfg)
        if tok_reason:
            rd.warn(tok_reason)
        progress(f"[harness] device {device} dtype {dtype}; {len(cases)} case(s): {', '.join(c.name for c in cases)}")
        attn_probe.reset()
        model, info = load_adapter(cfg.model, device, dtype, cfg.seed)
        progress(f"[harness] model {info.get('adapter')} built in {info['build_s']:.1f} s")
        rd.update(model=info)
        rd.update(calibration=ensure_calibration(device, cfg.hardware, progress=progress))
        mcfg = cfg.measure.resolved(cuda)
        rd.update(measure={**dataclasses.asdict(mcfg), "gc": "Python cyclic GC paused inside each timed request",
                           "kernels_from": "one extra profiled request per case" if mcfg.kernels else None})
        if bar:
            progress.start((mcfg.warmup + mcfg.repeats + int(mcfg.kernels)) * len(cases))
            stack.callback(progress.stop)
        rd.update(host_steadiness={"before": host.probe(cuda)})
        nv = NvtxRanges(mcfg.nvtx)
        if not nv.available:
            rd.warn(nv.reason)
        data = RunData(rd.path, rd.manifest, analytic=pd.DataFrame())
        stages, kernels, routing, routing_steps = [], [], [], []
        for i, inputs in enumerate(cases):
            case = inputs.case
            progress(f"[harness] case {i + 1}/{len(cases)} {case.name}: {case.to_dict()}")
            ident = {"case": case.name, "mode": case.mode.name, "grid": case.to_dict()["grid"], "batch": case.batch}

            def make(r, inputs=inputs):
                return inputs.timed_request(r, device, dtype)

            warm = {}
            trace = rd.path / trace_name(case.name) if (mcfg.kernels and mcfg.trace) else None
            st, kt, counts = measure_case(model, make, mcfg, ident, cuda, progress=progress, info=warm,
                                          trace_path=trace)
            if warm.get("steady") is False:
                msg = (f"{case.name}: the last 3 of {len(warm['warmup_ms'])} untimed requests still differ by more "
                       f"than {mcfg.steady_pct}% (host or GPU still settling)")
                rd.warn(msg)
                progress(f"[harness] {msg}")
            stages.append(st)
            routing += routing_rows(case.name, counts)
            data.stages = pd.concat(stages, ignore_index=True)
            rd.write_csv("stages.csv", data.stages)
            if len(kt):
                kernels.append(kt)
                data.kernels = pd.concat(kernels, ignore_index=True)
                rd.append_csv("kernels.csv", kt)
            if routing:
                data.routing = pd.DataFrame(routing)
                rd.write_csv("routing.csv", data.routing)
            step_rows = routing_step_rows(case.name, counts.get("decode_steps"))
            if step_rows:
                routing_steps.append(pd.DataFrame(step_rows))
                data.routing_steps = pd.concat(routing_steps, ignore_index=True)
                rd.append_csv("routing_steps.csv", routing_steps[-1])
            frame, mbu, notes = analytic_for_case(case, model.cfg, dtype_name, counts if any(
                a.sum() for a in counts.values()) else None)
            data.analytic = pd.concat([data.analytic, frame], ignore_index=True)
            data.mbu_bytes[case.name] = mbu
            data.notes += notes
            rd.manifest["cases"].append({**case.to_dict(), "pages": [p.name for p in inputs.pages],
                                         "warmup_ms": [round(t, 3) for t in warm.get("warmup_ms", [])],
                                         "warmup_steady": warm.get("steady"),
                                         "trace": {"file": trace_name(case.name), "bytes": warm["trace"]["bytes"]}
                                         if warm.get("trace") else None})
            rd.update(attention={k: list(v) for k, v in attn_probe.SEEN.items()})
            if i + 1 < len(cases):  # report.md so far (no plot); the final write follows the last case
                write_report(rd, data, plot=False)
        rd.update(host_steadiness={**rd.manifest["host_steadiness"], "after": host.probe(cuda)})
        rd.complete()
        paths = write_report(rd, data, plot=True)
        if paths.get("report"):
            log.info("report: %s", paths["report"])
        progress(f"[harness] wrote {rd.path}")
        return rd
