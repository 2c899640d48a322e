"""What every verb sets up the same way: device and dtype, device facts, the cases and the model.

* ``resolve_device`` / ``resolve_dtype``: ``device=auto|cpu|cuda|cuda:N`` and ``dtype=auto|bf16|fp16|fp32``
  (auto: bf16 on CUDA, fp32 on the CPU) with one-line errors for what cannot run here.
* ``device_info``: name, memory, capability, driver and clocks setting (for manifests, calibration).
* ``prepare_cases``: the config's cases (``workload`` merged with each ``cases`` entry) with their
  pages loaded and the first request built, so bad input fails before any model is built. A
  folder of pages (``workload.images=DIR``) is a set of requests, one case each
  (``workload.batch_pages``: ``batch`` pages of one layout per request, named by their pages).
* ``load_adapter``: the ``ModelAdapter`` named by ``model.name`` (reference or vendor) on the device.
"""
from __future__ import annotations

import dataclasses
import platform
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import workload as wl
from .config import CaseConfig, HarnessConfig, ModelConfig, WorkloadConfig, case_model
from .dtypes import torch_dtype
from .errors import HarnessError


# ------------------------------------------------------------------------------ device, dtype

def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when torch sees a GPU, else cpu; ``cuda[:N]`` must exist."""
    name = str(name or "auto")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise HarnessError(f"unknown device {name!r}", "use device=auto, device=cpu or device=cuda[:N]") from None
    if dev.type not in ("cpu", "cuda"):
        raise HarnessError(f"device type {dev.type!r} is not supported", "use device=cpu or device=cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise HarnessError("device=cuda was requested but no CUDA GPU is visible to torch "
                           f"(torch {torch.__version__}, CUDA build: {torch.version.cuda})",
                           "run on a GPU machine, or use device=cpu / device=auto")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise HarnessError(f"device {name} does not exist ({torch.cuda.device_count()} GPU(s) visible)",
                           f"pick an index below {torch.cuda.device_count()}")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` -> bf16 on CUDA, fp32 on the CPU; otherwise the named dtype (``harness.dtypes``)."""
    if str(name) == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch_dtype(name)


def device_info(device: torch.device) -> dict:
    """Device name, index (``cuda:N``: N among the visible GPUs), memory, capability, driver and
    the clocks setting (nvidia-smi when present)."""
    info = {"type": device.type, "host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "cpu_threads": torch.get_num_threads()}
    if device.type != "cuda":
        return info
    idx = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(idx)
    info.update(index=idx, torch_device=f"cuda:{idx}",   # the GPU among those visible (CUDA_VISIBLE_DEVICES)
                name=torch.cuda.get_device_name(idx), total_memory_bytes=props.total_memory,
                capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count,
                cuda_runtime=torch.version.cuda)
    smi = shutil.which("nvidia-smi")
    if smi:
        q = "driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,persistence_mode,compute_mode"
        try:
            res = subprocess.run([smi, f"--query-gpu={q}", "--format=csv,noheader", f"--id={idx}"],
                                 capture_output=True, text=True, timeout=10)
            vals = [v.strip() for v in res.stdout.strip().split(",")]
            info["nvidia_smi"] = dict(zip(q.split(","), vals)) if res.returncode == 0 else res.stderr.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            info["nvidia_smi"] = f"unavailable: {exc}"
    else:
        info["nvidia_smi"] = "nvidia-smi not found: driver version and clocks not recorded"
    info["clock_control"] = "none (clocks left as found; the harness never locks them)"
    return info


# ------------------------------------------------------------------------------------ cases

@dataclass
class CaseInputs:
    """One case of a run: its ``case`` (the shape), its workload settings, the model config it runs
    (``model``: the run's model with the case's execution overrides), its pages, the validated
    request of repeat 0 (``request``, CPU tensors) and ``notes`` for the run's warnings (pages
    converted on loading, a batch filled by repeating pages)."""

    case: wl.Case
    workload: WorkloadConfig
    model: ModelConfig
    pages: list
    tokenizer: object
    request: wl.Request
    notes: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.case.name

    def pages_of(self, repeat: int) -> list:
        """The pages of request ``repeat`` (< 0: warm-ups). Synthetic pages are drawn anew per
        request (same size, new text: seed offset by the request index) so no repeat reuses the
        previous one's input; pages from files are the same every time."""
        w = self.workload
        return self.pages if (repeat == 0 or w.images) else pages_for(w, repeat)

    def build(self, pages: list) -> wl.Request:
        """The request of ``pages``: preprocessing (resize/pad, normalisation, tiles) and the token layout."""
        w = self.workload
        return wl.build_request(pages, w.mode, decode_tokens=w.decode_tokens, prompt=w.prompt,
                                tokenizer=self.tokenizer, text_tokens=w.text_tokens, seed=w.seed,
                                name=self.case.name)

    def request_for(self, repeat: int) -> wl.Request:
        """The request of timed repeat ``repeat`` (< 0: warm-ups), CPU tensors."""
        return self.build(self.pages_of(repeat))

    def timed_request(self, repeat: int, device: torch.device, dtype: torch.dtype) -> tuple:
        """(request ``repeat`` on ``device``, {"prep_ms", "h2d_ms"}): host ms of building it from its
        pages (``build``; drawing synthetic pages is not counted) and of copying it to ``device``
        (``Request.to``, synchronised on CUDA)."""
        pages = self.pages_of(repeat)
        t0 = time.perf_counter()
        req = self.build(pages)
        t1 = time.perf_counter()
        req = req.to(device, dtype)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t2 = time.perf_counter()
        return req, {"prep_ms": (t1 - t0) * 1e3, "h2d_ms": (t2 - t1) * 1e3}


def pages_for(w: WorkloadConfig, repeat: int) -> list:
    """Synthetic pages of request ``repeat``: ``w.pages`` pages seeded by the request index,
    repeated or cut to ``w.batch``."""
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


def case_workloads(cfg: HarnessConfig) -> list:
    """[(name or None, WorkloadConfig, ModelConfig)]: ``workload`` with each ``cases`` entry's non-None
    workload fields, ``model`` with its execution overrides (every case: ``run.only`` selects among the
    prepared cases, ``select_cases``)."""
    out = []
    names = {f.name for f in dataclasses.fields(WorkloadConfig)}
    for ov in cfg.cases or [CaseConfig()]:
        fields = {f.name: getattr(ov, f.name) for f in dataclasses.fields(ov) if f.name in names}
        w = dataclasses.replace(cfg.workload, **{k: v for k, v in fields.items() if v is not None})
        out.append((ov.name, w, case_model(cfg.model, ov)))
    return out


def request_pages(w: WorkloadConfig) -> list:
    """[(label, pages)]: the requests of one case's workload. Synthetic pages (``pages_for``) or
    one image file (repeated to ``w.batch``) make one request, label ""; a folder makes
    ``workload.batch_pages``' requests, labelled by their pages (``p003+p004``)."""
    if not w.images:
        return [("", pages_for(w, 0))]
    pages = wl.load_pages(w.images, seed=w.seed, max_pixels=w.max_pixels)
    if Path(w.images).expanduser().is_dir():
        return wl.batch_pages(pages, w.mode, w.batch)
    return [("", pages * w.batch)]


def prepare_cases(cfg: HarnessConfig) -> tuple:
    """([CaseInputs], tokenizer note): every case validated (pages load, mode known, layout
    consistent, names distinct) before any model is built. A case whose requests come from a
    folder becomes one case per request, named ``<name>-<label>`` (e.g. ``gundam-2x3-p003``,
    ``gundam-2x3-b2-p003+p004``)."""
    tokenizer, reason = wl.load_tokenizer(cfg.model.path, cfg.workload.text_tokens)
    cases, entries = [], []
    for name, w, m in case_workloads(cfg):
        for label, pages in request_pages(w):
            req = wl.build_request(pages, w.mode, decode_tokens=w.decode_tokens, prompt=w.prompt,
                                   tokenizer=tokenizer, text_tokens=w.text_tokens, seed=w.seed, name=name or "")
            notes = [p.note for p in {id(p): p for p in pages}.values() if p.note]
            if label:
                req = dataclasses.replace(req, case=dataclasses.replace(req.case, name=f"{req.case.name}-{label}"))
                distinct = label.count("+") + 1
                if distinct < w.batch:
                    notes.append(f"{req.case.name}: the last {distinct} page(s) of this tile grid fill a batch of "
                                 f"{w.batch} by repeating")
            cases.append(CaseInputs(req.case, w, m, pages, tokenizer, req, notes))
            entries.append(name)
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise HarnessError(f"two cases share a name ({names})", "give each case a distinct `name`")
    return select_cases(cases, entries, cfg.run.only), reason


def select_cases(cases: list, entries: list, only) -> list:
    """The ``cases`` (``CaseInputs``) that ``run.only`` names, in the run's order (all when None). A
    case is named by the name the run prints (``CaseInputs.name``: ``tiny``, ``gundam-2x3``, ...) or
    by the ``name`` of its ``cases`` entry (``entries``, None where unnamed; it selects every case a
    folder of pages makes of that entry). An unknown name is refused, listing the run's names."""
    if only is None:
        return cases
    wanted = set(map(str, only))
    known = {c.name for c in cases} | {e for e in entries if e}
    unknown = [n for n in map(str, only) if n not in known]
    if unknown or not wanted:
        raise HarnessError(f"run.only={list(map(str, only))}: "
                           + (f"no case named {', '.join(unknown)}" if unknown else "names no case"),
                           f"name cases as the run prints them: {', '.join(c.name for c in cases)}")
    return [c for c, e in zip(cases, entries) if c.name in wanted or e in wanted]


def check_run_only(cfg: HarnessConfig) -> None:
    """Refuse a ``run.only`` that names no case of ``cfg`` before any run directory exists; the
    cases' printed names come from their pages (``prepare_cases``), prepared only when ``run.only``
    names something that is not an explicit ``name`` of a ``cases`` entry."""
    named = {c.name for c in cfg.cases or [] if c.name}
    if cfg.run.only is not None and not (cfg.run.only and set(map(str, cfg.run.only)) <= named):
        prepare_cases(cfg)


# ------------------------------------------------------------------------------------ model

def load_adapter(mcfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int, workdir=None) -> tuple:
    """(adapter, info): the model named by ``mcfg.name`` ready on ``device``. ``info`` says what was
    loaded (adapter, weights, build seconds, the attention implementation asked for). ``workdir``:
    where the vendor's ``infer()`` may write (``model.vendor_entry=infer``; default a temporary directory)."""
    t0 = time.perf_counter()
    if mcfg.name == "vendor":
        from .models import vendor_loops

        model = vendor_loops.load(mcfg.path, device=device, dtype=dtype, attn_implementation=mcfg.attn_implementation,
                                  seed=seed, loop=mcfg.vendor_loop, entry=mcfg.vendor_entry, workdir=workdir)
        info = {"adapter": "vendor", **getattr(model, "info", {})}
    else:
        from .models.build import build_model, check_checkpoint, load_weights

        if mcfg.weights == "path" and not mcfg.path:
            raise HarnessError("model.weights=path needs model.path", "set model.path=DIR (a vendor snapshot)")
        if mcfg.weights == "path":   # refuse a bad checkpoint before allocating the model
            check_checkpoint(build_model(mcfg, device="meta", dtype=dtype), mcfg.path)
        model = build_model(mcfg, device=device, dtype=dtype, seed=seed, init=mcfg.weights == "random")
        info = {"adapter": "reference", "weights": mcfg.weights}
        if mcfg.weights == "path":
            info["loaded"] = load_weights(model, mcfg.path)
        info["execution"] = model.configure(mcfg)
        model.info.update(info)
    if device.type == "cuda":
        torch.cuda.synchronize()
    info["build_s"] = time.perf_counter() - t0
    info["attn_implementation_requested"] = mcfg.attn_implementation
    return model, info


__all__ = ["resolve_device", "resolve_dtype", "device_info", "CaseInputs", "pages_for", "request_pages", "case_workloads",
           "prepare_cases", "select_cases", "check_run_only", "load_adapter"]
