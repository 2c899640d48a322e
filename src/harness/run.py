"""The ``run`` verb: build the model once, run every case, write the run directory.

Steps: resolve device and dtype -> validate every case's pages and layout (before the model is
built, so bad input fails fast) -> build the model -> for each case: measure (warm-up, timed
repeats, optional profiled request) -> append to stages.csv / kernels.csv / routing.csv and
update manifest.json. Cases are written as they finish; an interruption keeps what was measured.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from .config import ModelConfig, WorkloadConfig, from_dict
from .errors import HarnessError
from .measure import host
from .measure.nvtx_ranges import NvtxRanges
from .measure.runner import MeasureConfig, measure_case
from .models import attn_probe
from .report.progress import RunProgress
from .report.rundir import RunDir, device_info
from . import workload as wl

log = logging.getLogger("harness.run")


def resolve_device(name: str) -> torch.device:
    name = str(name or "auto")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise HarnessError(f"unknown device {name!r}", "use device=auto, device=cpu or device=cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise HarnessError("device=cuda was requested but no CUDA GPU is visible to torch "
                           f"(torch {torch.__version__}, CUDA build: {torch.version.cuda})",
                           "run on a GPU machine, or use device=cpu / device=auto")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise HarnessError(f"device {name} does not exist ({torch.cuda.device_count()} GPU(s) visible)",
                           "pick an index below the GPU count")
    if dev.type not in ("cpu", "cuda"):
        raise HarnessError(f"device type {dev.type!r} is not supported", "use device=cpu or device=cuda")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    from .models.build import resolve_dtype as _rd

    if str(name) == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _rd(name)


@dataclass
class Case:
    """One workload point: its name, config and prepared pages."""

    name: str
    wcfg: WorkloadConfig
    pages: list
    tokenizer: object
    request: object   # the request of repeat 0 (CPU tensors), validated


def case_name(w: WorkloadConfig, mode: wl.CropMode, grid) -> str:
    parts = [mode.name]
    if grid:
        parts.append(f"{grid[0]}x{grid[1]}")
    if w.batch > 1:
        parts.append(f"b{w.batch}")
    return "-".join(parts)


def _pages_for(w: WorkloadConfig, repeat: int) -> list:
    """Pages for request ``repeat`` (< 0: warm-ups): synthetic pages of the same size, with new text
    per request (seed offset by the request index) so no repeat reuses the previous one's input."""
    if w.images:
        pages = wl.load_pages(w.images, seed=w.seed, max_pixels=w.max_pixels)
    else:
        size = tuple(w.page_size) if w.page_size else None
        seed = w.seed + 1000 * (repeat + 1)
        pages = [wl.Page(f"synthetic-{i:03d}", wl.synthetic_page(i, seed=seed, size=size), f"synthetic:{seed}")
                 for i in range(w.pages)]
    if w.batch > 1 and len(pages) == 1:
        pages = pages * w.batch
    elif w.batch > 1:
        pages = pages[: w.batch]
        if len(pages) < w.batch:
            raise HarnessError(f"batch={w.batch} needs {w.batch} pages but only {len(pages)} were given",
                               "add pages or lower workload.batch")
    return pages


def _request(case: Case, repeat: int):
    w = case.wcfg
    pages = case.pages if (repeat == 0 or w.images) else _pages_for(w, repeat)
    return wl.build_request(pages, w.mode, decode_tokens=w.decode_tokens, prompt=w.prompt,
                            tokenizer=case.tokenizer, text_tokens=w.text_tokens, seed=w.seed)


def prepare_cases(cfg) -> list[Case]:
    """Validate every case (pages load, mode known, layout consistent) before building the model."""
    base = cfg.get("workload") or {}
    overrides = cfg.get("cases") or [{}]
    tokenizer, reason = wl.load_tokenizer((cfg.get("model") or {}).get("path"))
    cases = []
    for ov in overrides:
        merged = dict(base)
        merged.update(dict(ov))
        name_override = merged.pop("name", None)
        w = from_dict(WorkloadConfig, merged)
        mode = wl.get_mode(w.mode)
        pages = _pages_for(w, 0)
        req = wl.build_request(pages, mode, decode_tokens=w.decode_tokens, prompt=w.prompt, tokenizer=tokenizer,
                               text_tokens=w.text_tokens, seed=w.seed)
        name = name_override or case_name(w, mode, req.grid)
        cases.append(Case(name, w, pages, tokenizer, req))
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise HarnessError(f"two cases share a name ({names})", "give each case a distinct `name`")
    return cases, reason


def build(cfg_model: dict, device, dtype, seed: int):
    """The model adapter named by ``model.name`` (reference or vendor), ready on ``device``."""
    mcfg = from_dict(ModelConfig, cfg_model)
    t0 = time.perf_counter()
    if mcfg.name == "vendor":
        from .models.vendor import load_vendor

        model = load_vendor(mcfg.path, device=device, dtype=dtype, attn_implementation=mcfg.attn_implementation,
                            seed=seed)
        info = {"adapter": "vendor", **getattr(model, "info", {})}
    elif mcfg.name == "reference":
        from .models.build import build_model, load_weights

        if mcfg.weights not in ("random", "path"):
            raise HarnessError(f"model.weights={mcfg.weights!r} is not known", "use model.weights=random or path")
        if mcfg.weights == "path" and not mcfg.path:
            raise HarnessError("model.weights=path needs model.path", "set model.path=DIR (a vendor snapshot)")
        if mcfg.weights == "path":
            from .models.build import safetensors_files
            safetensors_files(mcfg.path)  # fail before allocating the model
        model = build_model(mcfg, device=device, dtype=dtype, seed=seed, init=mcfg.weights == "random")
        info = {"adapter": "reference", "weights": mcfg.weights}
        if mcfg.weights == "path":
            info["loaded"] = load_weights(model, mcfg.path)
    else:
        raise HarnessError(f"unknown model {mcfg.name!r}", "use model=reference or model=vendor")
    if device.type == "cuda":
        torch.cuda.synchronize()
    info["build_s"] = time.perf_counter() - t0
    info["attn_implementation_requested"] = mcfg.attn_implementation
    return model, info


def run(cfg, run_path: Path, progress=None) -> RunDir:
    """Execute the ``run`` verb for a resolved config (a plain dict) into ``run_path``."""
    rd = RunDir(run_path, cfg)
    bar = progress is None
    progress = progress or RunProgress()
    with rd.guard(), contextlib.ExitStack() as stack:
        device = resolve_device(cfg.get("device", "auto"))
        dtype = resolve_dtype(cfg.get("dtype", "auto"), device)
        rd.update(device=device_info(device), dtype=str(dtype).replace("torch.", ""))
        if device.type != "cuda":
            rd.warn("no CUDA device: stage times are host clocks, no NVTX consumer, kernels are CPU ops")
        cases, tok_reason = prepare_cases(cfg)
        if tok_reason:
            rd.warn(tok_reason)
        progress(f"[harness] device {device} dtype {dtype}; {len(cases)} case(s): {', '.join(c.name for c in cases)}")
        attn_probe.reset()
        model, info = build(cfg.get("model") or {}, device, dtype, cfg.get("seed", 0))
        progress(f"[harness] model {info.get('adapter')} built in {info['build_s']:.1f} s")
        rd.update(model=info)
        mcfg = from_dict(MeasureConfig, cfg.get("measure") or {}).resolved(device.type == "cuda")
        rd.update(measure={**dataclasses.asdict(mcfg), "gc": "Python cyclic GC paused inside each timed request",
                           "kernels_from": "one extra profiled request per case" if mcfg.kernels else None})
        if bar:
            progress.start((mcfg.warmup + mcfg.repeats + int(mcfg.kernels)) * len(cases))
            stack.callback(progress.stop)
        rd.update(host_steadiness={"before": host.probe(device.type == "cuda")})
        nv = NvtxRanges(mcfg.nvtx)
        if not nv.available:
            rd.warn(nv.reason)
        stages, routing_rows = [], []
        for i, case in enumerate(cases):
            progress(f"[harness] case {i + 1}/{len(cases)} {case.name}: {wl.describe(case.request)}")
            ident = {"case": case.name, "mode": case.request.mode.name,
                     "grid": f"{case.request.grid[0]}x{case.request.grid[1]}" if case.request.grid else None,
                     "batch": case.request.batch}

            def make(r, case=case):
                return _request(case, r).to(device, dtype)

            warm = {}
            st, kt, routing = measure_case(model, make, mcfg, ident, device.type == "cuda", progress=progress,
                                           info=warm)
            if warm.get("steady") is False:
                msg = (f"{case.name}: the last 3 of {len(warm['warmup_ms'])} untimed requests still differ by more "
                       f"than {mcfg.steady_pct}% (host or GPU still settling)")
                rd.warn(msg)
                progress(f"[harness] {msg}")
            stages.append(st)
            for phase, arr in routing.items():
                for layer, counts in enumerate(arr):
                    if counts.sum():
                        routing_rows.append({"case": case.name, "phase": phase, "layer": layer,
                                             **{f"e{j}": int(c) for j, c in enumerate(counts)}})
            rd.write_csv("stages.csv", pd.concat(stages, ignore_index=True))
            if len(kt):
                rd.append_csv("kernels.csv", kt)
            if routing_rows:
                rd.write_csv("routing.csv", pd.DataFrame(routing_rows))
            rd.manifest["cases"].append({"name": case.name, **wl.describe(case.request),
                                         "warmup_ms": [round(t, 3) for t in warm.get("warmup_ms", [])],
                                         "warmup_steady": warm.get("steady")})
            rd.update(attention={k: list(v) for k, v in attn_probe.SEEN.items()})
            if i + 1 < len(cases):  # [report] report.md so far (no plot); the final write follows the last case
                _write_report(rd, final=False)
        rd.update(host_steadiness={**rd.manifest["host_steadiness"], "after": host.probe(device.type == "cuda")})
        rd.complete()
        _write_report(rd, final=True)  # [report] final report.md, roofline.csv/png, analytic.csv
        progress(f"[harness] wrote {rd.path}")
        return rd


# ---- [report] block (owner: harness.report / harness.roofline; keep run.py edits to this and the two calls) ----
def _write_report(rd: RunDir, final: bool) -> None:
    """Write analytic.csv, roofline.csv, roofline.png and report.md into the run directory.
    Loads the cached calibration of this device (``hardware.calibration: auto``) or notes 'not
    calibrated'. Never raises: a reporting failure becomes a manifest warning."""
    from .report.report import write_report

    paths = write_report(rd, plot=final)
    if final and paths.get("report"):
        log.info("report: %s", paths["report"])
# ---- end [report] block ----
