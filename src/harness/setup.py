"""What every verb sets up the same way: device and dtype, device facts, the cases and the model.

* ``resolve_device`` / ``resolve_dtype``: ``device=auto|cpu|cuda|cuda:N`` and ``dtype=auto|bf16|fp16|fp32``
  (auto: bf16 on CUDA, fp32 on the CPU) with one-line errors for what cannot run here.
* ``device_info``: name, memory, capability, driver and clocks setting (for manifests, calibration).
* ``prepare_cases``: the config's cases (``workload`` merged with each ``cases`` entry) with their
  page settings checked, pages loaded and the first request built, so bad input fails before any
  model is built. A batch holds distinct pages (``synthetic_pages``: new synthetic pages for every
  request; a folder, ``workload.images=DIR``, is a set of requests, one case each,
  ``workload.batch_pages``: ``batch`` pages of one layout per request, named by their pages; a PDF
  of several pages likewise, its pages rasterised at ``workload.pdf_dpi`` anew for every request); a
  batch of copies only with ``workload.repeat_pages=true``.
* ``check_cases``: every case's execution checked as a whole on the device (``harness.variants.check``)
  before any model is built: refused with one line, or, for a case of an experiment that only this
  device cannot run, skipped with its reason.
* ``load_adapter``: the ``ModelAdapter`` named by ``model.name`` (reference or vendor) on the device.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import platform
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from PIL import Image

from . import preprocess_device
from . import workload as wl
from .layout import Case, SYNTHETIC_SIZES, batch_wording
from .config import CaseConfig, ExecutionConfig, HarnessConfig, ModelConfig, WorkloadConfig, case_execution, check_page_size
from .dtypes import torch_dtype
from .attn_support import check_flash_attn
from .errors import HarnessError
from .models.routing import routing_label


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
    """One case of a run: its ``case`` (the shape, validated), its workload settings, the execution
    it runs (``execution``: the run's with the case's overrides), its pages from files (``files``,
    one per row; None: synthetic pages, drawn per request) and ``notes`` for the run's warnings
    (pages converted on loading, a batch of copies). ``pages`` and ``request`` (repeat 0's, CPU
    tensors) are made on first use, so checking a case draws and preprocesses no batch."""

    case: Case
    workload: WorkloadConfig
    execution: ExecutionConfig
    tokenizer: object
    files: list | None = None
    notes: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.case.name

    @functools.cached_property
    def pages(self) -> list:
        """The pages of repeat 0, one per row."""
        return self.files if self.files is not None else synthetic_pages(self.workload, 0)

    @functools.cached_property
    def request(self) -> wl.Request:
        """The request of repeat 0 (CPU tensors)."""
        return self.build(self.pages)

    @property
    def distinct_pages(self) -> int:
        """Different pages among a request's rows (the same count in every request of the case)."""
        return distinct_pages(self.workload) if self.files is None else len({id(p) for p in self.files})

    def pages_entry(self) -> dict:
        """The manifest case entry's page fields: ``pages`` (request 0's page names, one per row; a
        one-line summary past 16 rows), ``distinct_pages``, ``copies`` (rows repeat pages),
        ``pages_label`` (``layout.batch_wording``) and ``page_source`` (where the pages come from)."""
        names = [p.name for p in self.pages]
        distinct = self.distinct_pages
        source = page_source(self.workload)
        if any(p.pdf is not None for p in self.pages):
            source += (f"; PDF pages rasterised at workload.pdf_dpi={self.workload.pdf_dpi:g} (PDFium), anew for "
                       "every request (raster_ms)")
        return {"pages": names if len(names) <= 16 else wl.names_text(names), "distinct_pages": distinct,
                "copies": distinct < len(names), "pages_label": batch_wording(len(names), distinct),
                "page_source": source}

    def routing_entry(self) -> dict:
        """The manifest case entry's routing fields: ``routing`` (workload.routing), ``routing_seed``
        (balanced only) and ``routing_label`` (``models.routing.routing_label``)."""
        w = self.workload
        return {"routing": w.routing, "routing_seed": w.routing_seed if w.routing == "balanced" else None,
                "routing_label": routing_label(w.routing, w.routing_seed)}

    def pages_of(self, repeat: int) -> list:
        """The pages of request ``repeat`` (< 0: warm-ups): synthetic pages are new for every request
        (``synthetic_pages``); pages from files are the same every time."""
        w = self.workload
        return self.pages if (repeat == 0 or w.images) else synthetic_pages(w, repeat)

    def _request_args(self) -> dict:
        """The keywords a request of this case is built with (``build_request``'s, ``timed_request``'s)."""
        w = self.workload
        return dict(decode_tokens=w.decode_tokens, prompt=w.prompt, tokenizer=self.tokenizer, text_tokens=w.text_tokens,
                    seed=w.seed, name=self.case.name, routing=w.routing, routing_seed=w.routing_seed)

    def build(self, pages: list) -> wl.Request:
        """The request of ``pages``: preprocessing (resize/pad, normalisation, tiles) and the token layout."""
        return wl.build_request(pages, self.workload.mode, **self._request_args())

    def timed_request(self, repeat: int, device: torch.device, dtype: torch.dtype) -> tuple:
        """(request ``repeat`` on ``device``, {"prep_ms", "h2d_ms"[, "raster_ms"]}): host ms of building
        it from its pages (``build``; drawing synthetic pages is not counted) and of copying it to
        ``device`` (``Request.to``, synchronised on CUDA); with PDF pages, ``raster_ms`` first: drawing
        every row's page anew from its PDF (``workload.rasterise``). Under ``execution.preprocess=device``
        (``preprocess_device.timed_request``) ``prep_ms`` holds the host part and the device part, and
        ``h2d_ms`` copies 8-bit pixels."""
        pages, raster_ms = wl.rasterise(self.pages_of(repeat))
        if self.execution.preprocess == "device":
            req, times = preprocess_device.timed_request(pages, self.workload.mode, device, dtype, **self._request_args())
        else:
            t0 = time.perf_counter()
            req = self.build(pages)
            t1 = time.perf_counter()
            req = req.to(device, dtype)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t2 = time.perf_counter()
            times = {"prep_ms": (t1 - t0) * 1e3, "h2d_ms": (t2 - t1) * 1e3}
        return req, times if raster_ms is None else {"raster_ms": raster_ms, **times}


#: XOR'ed into workload.seed for the warm-up requests' own stream of synthetic pages
WARMUP_STREAM = 0x5EED


def distinct_pages(w: WorkloadConfig) -> int:
    """Distinct synthetic pages in one request: ``w.batch``; ``min(w.pages, w.batch)`` when
    ``w.pages`` is set; 1 with ``w.repeat_pages`` and no ``w.pages`` (copies of one page)."""
    if w.pages is None:
        return 1 if w.repeat_pages else w.batch
    return min(w.pages, w.batch)


def page_size(w: WorkloadConfig) -> tuple:
    """(width, height) pixels of every synthetic page: ``w.page_size``, else A4 portrait at 150 dpi."""
    return tuple(w.page_size) if w.page_size else SYNTHETIC_SIZES[0]


def synthetic_pages(w: WorkloadConfig, request: int) -> list:
    """The ``w.batch`` synthetic pages (rows) of request ``request``: 0, 1, ... the timed repeats
    (then the profiled request), < 0 the warm-ups.

    Rule: page k of a stream is ``synthetic_page(k, seed, page_size(w))`` (content drawn from
    (seed, k); one size, so one layout), named ``synthetic-KKKK``. Request r takes d =
    ``distinct_pages(w)`` consecutive pages, k = r*d ... r*d + d - 1, modulo ``w.pages`` when it is
    set (the page set that the requests cycle through: d consecutive pages modulo P >= d are
    distinct), and its rows repeat them only when d < ``w.batch`` (``repeat_pages``). Without
    ``w.pages`` every request draws new pages; the warm-ups draw from their own stream (seed ^
    ``WARMUP_STREAM``, names ``synthetic-wKKKK``), so no timed request reuses a warm-up's page.
    """
    d, size = distinct_pages(w), page_size(w)
    warm = request < 0 and w.pages is None
    seed = w.seed ^ WARMUP_STREAM if warm else w.seed
    first = (-1 - request) * d if warm else request * d
    ks = [(first + j) % w.pages if w.pages else first + j for j in range(d)]
    tag = "w" if warm else ""
    pages = [wl.Page(f"synthetic-{tag}{k:04d}", wl.synthetic_page(k, seed=seed, size=size), f"synthetic:{seed}:{k}")
             for k in ks]
    return [pages[j % d] for j in range(w.batch)]


def page_source(w: WorkloadConfig) -> str:
    """Where a case's pages come from, in words (the manifest's ``page_source``)."""
    if w.images:
        return f"workload.images={w.images} (every repeat measures the same pages)"
    width, height = page_size(w)
    drawn = (f"a set of {w.pages} that the requests cycle through" if w.pages
             else "new ones for every request")
    return f"synthetic pages of {width}x{height} px, {drawn} (seed {w.seed})"


def check_pages(w: WorkloadConfig, name: str | None) -> None:
    """Refuse page settings that contradict each other (one-line HarnessError; ``name``: the case)."""
    where = f"case {name}: " if name else ""
    check_page_size(w, where)
    if w.images and w.pages is not None:
        raise HarnessError(f"{where}workload.pages={w.pages} counts synthetic pages, but workload.images="
                           f"{w.images} gives the pages", "drop workload.pages (the pages of workload.images "
                           "are its files)")
    if not w.images and w.pages is not None and w.pages < w.batch and not w.repeat_pages:
        raise HarnessError(f"{where}workload.pages={w.pages} distinct page(s) cannot fill workload.batch={w.batch} "
                           "without repeating pages",
                           f"drop workload.pages (each request then draws {w.batch} new pages) or set it to "
                           f"{w.batch} or more, or set workload.repeat_pages=true to measure a batch of copies")


def unused_base_size(mode: wl.CropMode) -> list:
    """[the note] for a mode that does not crop but names a ``base_size`` other than its
    ``image_size``: without crop the page is viewed at ``image_size`` only (the vendor's non-crop
    path, ``workload.preprocess``), so that base_size is not used; [] for any other mode."""
    if mode.crop or mode.base_size == mode.image_size:
        return []
    return [f"mode {mode.name!r} has crop: false, so each page is viewed at image_size ({mode.image_size} px) only and "
            f"its base_size {mode.base_size} is not used (set base_size: {mode.image_size} to say so, or crop: true for "
            f"a {mode.base_size} px global view with {mode.image_size} px tiles)"]


def case_workloads(cfg: HarnessConfig) -> list:
    """[(name or None, WorkloadConfig, ExecutionConfig)]: ``workload`` with each ``cases`` entry's non-None
    workload fields, ``execution`` with its execution overrides (every case: ``run.only`` selects among
    the prepared cases, ``select_cases``)."""
    out = []
    names = {f.name for f in dataclasses.fields(WorkloadConfig)}
    for ov in cfg.cases or [CaseConfig()]:
        fields = {f.name: getattr(ov, f.name) for f in dataclasses.fields(ov) if f.name in names}
        w = dataclasses.replace(cfg.workload, **{k: v for k, v in fields.items() if v is not None})
        out.append((ov.name, w, case_execution(cfg.execution, ov)))
    return out


def request_pages(w: WorkloadConfig) -> list:
    """[(label, pages)]: the requests of one case's workload. Synthetic pages make one request,
    label "", pages None (drawn per request: ``synthetic_pages``); one page (an image file, a
    one-page PDF, ``FILE.pdf#page=N``) makes one request, label ""; a folder or a PDF of several
    pages makes ``workload.batch_pages``' requests, labelled by their pages (``p003+p004``). A page
    source with fewer distinct pages of one layout than ``w.batch`` is refused unless
    ``w.repeat_pages`` (``workload.check_enough_pages``)."""
    if not w.images:
        return [("", None)]
    pages = wl.load_pages(w.images, seed=w.seed, max_pixels=w.max_pixels, pdf_dpi=w.pdf_dpi)
    where = f"workload.images={w.images}"
    if len(pages) > 1 or Path(w.images).expanduser().is_dir():
        return wl.batch_pages(pages, w.mode, w.batch, w.repeat_pages, where)
    wl.check_enough_pages(wl.layout_groups(pages, w.mode), w.batch, w.repeat_pages, where)
    return [("", pages * w.batch)]


def prepare_cases(cfg: HarnessConfig) -> tuple:
    """([CaseInputs], tokenizer note): every case validated (page settings consistent, pages load,
    mode known, layout consistent, names distinct) before any model is built. A case whose requests
    come from a folder becomes one case per request, named ``<name>-<label>`` (e.g.
    ``gundam-2x3-p003``, ``gundam-2x3-b2-p003+p004``). A case whose rows repeat pages
    (``workload.repeat_pages``) gets a note that says so (``layout.batch_wording``)."""
    tokenizer, reason = wl.load_tokenizer(cfg.model.path, cfg.workload.text_tokens)
    cases, entries = [], []
    for name, w, m in case_workloads(cfg):
        check_pages(w, name)
        for label, files in request_pages(w):
            # synthetic pages all have one size: a blank page of that size has their layout
            shown = files if files is not None else [wl.Page("layout", Image.new("RGB", page_size(w)), "layout")]
            req = wl.build_request(shown, w.mode, decode_tokens=w.decode_tokens, prompt=w.prompt,
                                   tokenizer=tokenizer, text_tokens=w.text_tokens, seed=w.seed)
            c = req.case
            case = Case(c.mode, c.grid, w.batch, c.text_tokens, c.decode_tokens, name or "")
            if label:
                case = dataclasses.replace(case, name=f"{case.name}-{label}")
            notes = [p.note for p in {id(p): p for p in files or []}.values() if p.note] + unused_base_size(c.mode)
            inputs = CaseInputs(case, w, m, tokenizer, files, notes)
            if inputs.distinct_pages < w.batch:
                notes.append(f"{inputs.name}: {batch_wording(w.batch, inputs.distinct_pages)} "
                             "(workload.repeat_pages=true): identical rows route identically, so its tok/s and MBU "
                             "do not describe a batch of distinct pages")
            cases.append(inputs)
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


def check_cases(cfg: HarnessConfig, cases: Optional[list] = None, device: Optional[torch.device] = None,
                dtype: Optional[torch.dtype] = None, execution_of=None) -> dict:
    """{case name: reason} of the cases to skip: every case's execution (``cases``: prepared
    ``CaseInputs``, else the config's cases) goes through ``harness.variants.check`` on ``device``
    (default: ``cfg.device`` resolved). An execution that would not run, or would run as something
    else, is refused (``HarnessError``, naming the case); one that only this device cannot run
    (``CannotRunHere``) is skipped where the run has cases of an experiment, unless no case is left.
    The static cache's length is checked against each request's prompt + decode tokens (the config's
    cases are prepared for that, and for ``run.only``'s selection, only when either is set). Prompt
    + decode positions beyond what the model holds (``position_limit``) are refused
    (``check_positions``): exactly for prepared cases, else from a lower bound of the prompt.
    ``execution_of(cfg, execution)``: the execution the experiment runs for a case's (its
    ``Experiment.execution_of``; the throughput experiment layers ``best`` under it)."""
    from . import variants
    from .variants.base import CannotRunHere

    device = device or resolve_device(cfg.device)
    dtype = dtype or resolve_dtype(cfg.dtype, device)
    if cases is None and (cfg.run.only is not None
                          or any(ex.static_cache_len is not None for _, _, ex in case_workloads(cfg))):
        cases, _ = prepare_cases(cfg)      # the cases run.only selects (and their lengths): no batch drawn
    limit = position_limit(cfg.model)
    if cases is None:
        for name, w, _ in case_workloads(cfg):
            prompt, exact = prompt_tokens(w, cfg.model)
            check_positions(f"case {name}: " if cfg.cases else "", prompt, w.decode_tokens, limit, at_least=not exact)
    else:
        for c in cases:
            check_positions(f"case {c.name}: " if cfg.cases else "", c.case.prefill_tokens, c.workload.decode_tokens,
                            limit)
    entries = ([(c.name, c.execution, c.execution.positions(c.case.prefill_tokens, c.workload.decode_tokens),
                 c.case.batch) for c in cases] if cases is not None else
               [(name, ex, None, w.batch) for name, w, ex in case_workloads(cfg)])
    skipped, first = {}, None
    for name, ex, positions, batch in entries:
        if execution_of is not None:
            ex = execution_of(cfg, ex)
        try:
            variants.check(ex, device, dtype, model=cfg.model, positions=positions, batch=batch)
        except CannotRunHere as exc:
            first = first or (name, exc)
            if not cfg.cases:
                raise
            skipped[name] = str(exc)
        except HarnessError as exc:
            raise HarnessError(f"case {name}: {exc.problem}" if cfg.cases else exc.problem, exc.fix) from None
    if first is not None and len(skipped) == len(entries):
        name, exc = first
        raise HarnessError(f"no case of the run can run here; case {name}: {exc.problem}", exc.fix)
    return skipped


def position_limit(mcfg: ModelConfig) -> tuple:
    """(positions the model holds, where that figure comes from): ``max_position_embeddings`` of the
    vendor directory's config.json for ``model=vendor`` (its code reads it there; the language
    model's entry first), else ``model.llm.max_position_embeddings`` (8192, the vendor's)."""
    if mcfg.name == "vendor" and mcfg.path:
        path = Path(mcfg.path).expanduser() / "config.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = None
        for node, key in ((data or {}).get("language_config"), "language_config."), (data, ""):
            value = node.get("max_position_embeddings") if isinstance(node, dict) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value, f"{key}max_position_embeddings of {path}"
    return mcfg.llm.max_position_embeddings, "model.llm.max_position_embeddings"


def prompt_tokens(w: WorkloadConfig, mcfg: ModelConfig) -> tuple:
    """(prompt tokens of ``w`` from its settings alone, no page drawn and no tokenizer loaded, exact?):
    BOS + text tokens + image tokens. Exact for synthetic pages without ``model.path`` (their one
    size gives the tile grid; ``workload.text_tokens`` filler tokens); a lower bound otherwise
    (pages from files: the global view's image tokens alone; a tokenizer: no text tokens)."""
    mode = wl.get_mode(w.mode)
    grid = None if w.images else wl.tile_grid_for(*page_size(w), mode)
    image = wl.image_token_count(mode, grid if grid and grid != (1, 1) else None)
    return wl.BOS_TOKENS + image + (0 if mcfg.path else w.text_tokens), not (w.images or mcfg.path)


def check_positions(where: str, prefill: int, decode: int, limit: tuple, at_least: bool = False) -> None:
    """Refuse prompt (``prefill``) + ``decode`` tokens beyond the positions the model holds
    (``limit``: ``position_limit``'s (positions, source)); ``at_least``: ``prefill`` is a lower bound.
    The positions are ``ExecutionConfig.positions`` (prompt + decode tokens, at least one)."""
    held, source = limit
    need = ExecutionConfig.positions(prefill, decode)
    if need <= held:
        return
    some = "at least " if at_least else ""
    fix = (f"lower workload.decode_tokens to {held - prefill:,} or less" + (" (fewer with a longer prompt)" if at_least
                                                                             else "")
           if held - prefill >= 1 else "use a mode with fewer image tokens or a shorter prompt")
    raise HarnessError(f"{where}{some}{need:,} positions (a prompt of {some}{prefill:,} tokens + {decode:,} decode "
                       f"tokens) exceed the {held:,} the model holds ({source})", fix)


# ------------------------------------------------------------------------------------ model

def load_adapter(mcfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int, workdir=None) -> tuple:
    """(adapter, info): the model named by ``mcfg.name`` ready on ``device``. ``info`` says what was
    loaded (adapter, weights, build seconds, the attention implementation asked for). ``workdir``:
    where the vendor's ``infer()`` may write (``model.vendor_entry=infer``; default a temporary directory)."""
    check_flash_attn(mcfg.attn_implementation, device.type)
    t0 = time.perf_counter()
    if mcfg.name == "vendor":
        from .models.vendor import loops as vendor_loops

        model = vendor_loops.load(mcfg.path, device=device, dtype=dtype, attn_implementation=mcfg.attn_implementation,
                                  seed=seed, loop=mcfg.vendor_loop, entry=mcfg.vendor_entry, workdir=workdir,
                                  trust_remote_code=mcfg.trust_remote_code)
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
        model.info.update(info)
    if device.type == "cuda":
        torch.cuda.synchronize()
    info["build_s"] = round(time.perf_counter() - t0, 3)
    info["attn_implementation_requested"] = mcfg.attn_implementation
    info.update(model_name=model_name(mcfg), params=parameter_count(model, mcfg))
    return model, info


#: the parts of a ``ModelConfig`` that make a ``conf/model`` option what it is (``model_name``)
MODEL_IDENTITY = ("name", "llm", "sam", "clip", "projector")


def model_name(mcfg: ModelConfig) -> str:
    """The ``conf/model`` option (``tiny``, ``reference``, ``vendor``) whose model name and sizes
    ``mcfg`` has, else ``<model.name> (custom sizes)``: what a report calls the model."""
    from omegaconf import OmegaConf

    from .conf_tree import CONF_DIR
    from .config import from_dict

    for path in sorted((CONF_DIR / "model").glob("*.yaml")):
        try:
            option = from_dict(ModelConfig, OmegaConf.to_container(OmegaConf.load(path)) or {})
        except Exception:  # noqa: BLE001 - an option that does not read as a ModelConfig names nothing
            continue
        if all(getattr(option, k) == getattr(mcfg, k) for k in MODEL_IDENTITY):
            return path.stem
    return f"{mcfg.name} (custom sizes)"


def parameter_count(model, mcfg: ModelConfig) -> int:
    """Parameters of the built ``model`` (each tensor once), or the analytic count of ``mcfg``
    (``harness.analytic.component_params``) where the adapter is no ``nn.Module``."""
    if isinstance(model, torch.nn.Module):
        return sum(p.numel() for p in model.parameters())
    from .analytic.compose import component_params

    return int(component_params(mcfg)["total"])


__all__ = ["resolve_device", "resolve_dtype", "device_info", "CaseInputs", "WARMUP_STREAM", "distinct_pages",
           "page_size", "synthetic_pages", "page_source", "check_pages", "request_pages", "case_workloads", "prepare_cases",
           "select_cases", "check_run_only", "check_cases", "position_limit", "prompt_tokens", "check_positions",
           "unused_base_size", "load_adapter", "model_name", "parameter_count", "MODEL_IDENTITY"]
