"""Will the run fit? Checked before any page is drawn or model built, against the memory free now.

What a run holds, in bytes (``need_bytes``). Per case: B = its batch, b = the run's dtype size
(``harness.dtypes.nbytes``), S = the global view's side (``base_size`` with crop, ``image_size``
without), T = a tile's side (``image_size``), c x r its tile grid (none: 0 tiles), pixel values
per row px = 3 channels x (S^2 + c*r x T^2) (``harness.workload.preprocess`` makes these tensors).

Host memory (RAM; on a CPU run the same memory as the device's):

* pages: the synthetic pages the harness draws, decoded RGB images of W x H pixels x 3 channels
  x 1 byte (PIL's "RGB"): d = ``setup.distinct_pages`` distinct pages per request, d x W x H x 3,
  twice when the case builds more than one request (request 0's pages stay cached while another
  request's are drawn). Pages from files are loaded before the check: already outside what is free;
  but every request draws its PDF pages anew (``workload.rasterise``): one request's rows, each W x H
  x 3 at the size its DPI gives (``harness.pdf_pages.pixel_size``), on top.
* preprocessed tensors: 2 x B x px x 4 bytes (float32): each page's views and their stacked batch
  exist together while a request is built (``workload.build_request``).

Device memory (the GPU's; RAM on a CPU run):

* weights: the model's parameters (``harness.analytic.component_params``) x b;
* caches: the KV cache, ``kv_bytes_per_token`` x its length x B: a growing cache holds prefill +
  decode positions while its case runs; a static cache holds ``ExecutionConfig.cache_len``
  positions for the rest of the run, one per (batch, length) of an execution (its decoders are
  kept per shape; another execution drops them);
* CUDA graphs' pools (CUDA only): a captured region keeps its peak activations (below) in its pool
  for the rest of the run, held like the static cache: the decode step (``cuda_graphs=decode``),
  the prefill (``prefill_graphs``), the vision stages (``vision_impl=fused``);
* activations at the batch: the largest single module call's writes in a stage that is not
  captured (``bytes_act_write`` of the analytic cost model, ``harness.analytic.compose.case_items``,
  at the case's batch and execution: every tensor the module materialises, e.g. SAM's dense
  rel-pos mask, B x heads x N^2 x b, or the prefill's logits over every position, B x S x vocab
  x b): a lower bound of what eager PyTorch holds at once;
* the request on the device: on CUDA 2 x B x px x b (the request running and the next one copied);
  on a CPU B x px x b when the run's dtype is not fp32 (``Request.to`` copies), else nothing (the
  same tensors as the preprocessed ones);
* a margin for allocator slack and what the cost model leaves out: ``MARGIN_FRACTION`` of the
  weights, at least ``MARGIN_MIN_BYTES`` (the full model in fp32 on a CPU peaked 1.2 GB above its
  13.3 GB of weights).

Cases run one at a time: the run needs the weights, what every case holds for the run (static
caches, graph pools; the execution that holds the most), and the largest of what one case adds
while it runs. On a GPU the device and the host are checked apart; on a CPU their sum.

What is free: on the CPU, ``MemAvailable`` of ``/proc/meminfo`` (psutil's ``available`` where
/proc is missing and psutil is installed); on a GPU, ``torch.cuda.mem_get_info``'s free bytes.
Where neither can be read the check says so and lets the run go on. A run that needs more than is
free is refused with the parts and the fix: the largest ``workload.batch`` that fits (every part
but the weights and the margin grows with the batch), else ``model=tiny`` or ``dtype=bf16`` on a
CPU; ``run.memory_check=false`` skips the check.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from .errors import HarnessError

#: the margin over the weights for activations and allocator slack
MARGIN_FRACTION = 0.10
MARGIN_MIN_BYTES = 1 << 30
#: bytes of one decoded page pixel (PIL "RGB": 3 channels of 1 byte) and of one preprocessed value (float32)
PAGE_PIXEL_BYTES = 3
PIXEL_VALUE_BYTES = 4
#: the parts of a case, in the order the refusal names them
HOST_PARTS = ("pages", "preprocessed")
DEVICE_PARTS = ("kv_cache", "graph_pools", "activations", "request_on_device")
PART_WORDS = {"pages": "pages", "preprocessed": "preprocessed tensors", "weights": "weights",
              "kv_cache": "KV cache", "graph_pools": "CUDA graph pools", "activations": "activations",
              "request_on_device": "the request on the device", "held_by_others": "caches and pools other cases hold",
              "margin": "margin"}


def _gb(n: float) -> str:
    """Bytes as '13.0 GB', or '182 MB' below 1 GB."""
    return f"{n / 1e9:,.1f} GB" if n >= 1e9 else f"{n / 1e6:,.0f} MB"


def free_bytes(device) -> tuple:
    """(free bytes or None, what was read) on ``device`` (a torch.device)."""
    if device.type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        return int(free), f"free GPU memory on {device}"
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available RAM (MemAvailable)"
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None, "available RAM (neither /proc/meminfo nor psutil here)"
    return int(psutil.virtual_memory().available), "available RAM (psutil)"


def pixel_values(case) -> int:
    """Preprocessed values per row of ``case`` (a ``workload.Case``): 3 x (S^2 + c*r x T^2)."""
    mode = case.mode
    side = mode.view_size
    tiles = case.grid[0] * case.grid[1] if case.grid else 0
    return 3 * (side * side + tiles * mode.image_size * mode.image_size)


def page_bytes(inputs, requests: int) -> int:
    """Bytes of the pages ``inputs`` (``setup.CaseInputs``) draws (module docstring): synthetic
    pages, or the PDF pages of one request's rows drawn anew (their loaded size: the DPI's); 0 for
    image files."""
    if inputs.files is not None:
        return sum(p.image.size[0] * p.image.size[1] * PAGE_PIXEL_BYTES for p in inputs.files if p.pdf is not None)
    from .setup import page_size

    width, height = page_size(inputs.workload)
    return (2 if requests > 1 else 1) * inputs.distinct_pages * width * height * PAGE_PIXEL_BYTES


def stage_peaks(model_cfg, execution, case, dtype_bytes: int) -> dict:
    """{"vision", "prefill", "decode": bytes}: the largest single module call's activation writes
    in each part of one request of ``case`` under ``execution`` (one decode step, the first)."""
    from .analytic.compose import case_items
    from .config import cost_config
    from .knobs import cost_knobs

    cfg = cost_config(model_cfg, cost_knobs(execution))
    short = dataclasses.replace(case, decode_tokens=min(case.decode_tokens, 2))   # one decode step is enough
    _, items = case_items(short, cfg, dtype_bytes)
    peaks = {"vision": 0, "prefill": 0, "decode": 0}
    for it in items:
        part = it.stage if it.stage in ("prefill", "decode") else "vision"
        peaks[part] = max(peaks[part], int(it.fam.cost().bytes_act_write))
    return peaks


def captured(execution, cuda: bool) -> set:
    """The parts of a request ``execution`` captures in CUDA graphs (none off CUDA)."""
    if not cuda:
        return set()
    return ({"decode"} if execution.cuda_graphs == "decode" else set()) \
        | ({"prefill"} if execution.prefill_graphs else set()) | ({"vision"} if execution.vision_impl == "fused" else set())


def case_need(model_cfg, inputs, dtype_bytes: int, cuda: bool, requests: int = 1) -> dict:
    """What one case adds (``HOST_PARTS`` and ``DEVICE_PARTS``, bytes) and ``held``: the part of it
    kept for the rest of the run (a static cache, graph pools), with ``key``: what it is kept under."""
    from .analytic import kv_bytes_per_token

    case, ex = inputs.case, inputs.execution
    batch = case.batch
    static = ex.kv_cache == "static"
    length = (ex.cache_len(case.prefill_tokens, case.decode_tokens) if static
              else ex.positions(case.prefill_tokens, case.decode_tokens))
    kv = kv_bytes_per_token(model_cfg, dtype_bytes) * length * batch
    peaks = stage_peaks(model_cfg, ex, case, dtype_bytes)
    graphs = captured(ex, cuda)
    pools = sum(peaks[p] for p in graphs)
    px = batch * pixel_values(case)
    on_device = 2 * px * dtype_bytes if cuda else (px * dtype_bytes if dtype_bytes != PIXEL_VALUE_BYTES else 0)
    need = {"pages": page_bytes(inputs, requests), "preprocessed": 2 * px * PIXEL_VALUE_BYTES,
            "kv_cache": kv, "graph_pools": pools,
            "activations": max([v for k, v in peaks.items() if k not in graphs] or [0]),
            "request_on_device": on_device}
    need["held"] = (kv if static else 0) + pools
    need["key"] = (tuple(sorted(ex.execution().items())), batch, length, case.mode, case.grid)
    return need


def _worst(entries: list) -> dict:
    """The entry of ``entries`` ({"total", ...}) with the largest total (the first on a tie); an empty
    entry when there is none."""
    return max(entries, key=lambda e: e["total"]) if entries else {"total": 0, "case": None, "batch": 0,
                                                                    "scaling": 0, "fixed": 0, "parts": {}}


def need_bytes(model_cfg, dtype_bytes: int, cases: list, cuda: bool = False, requests: int = 1) -> dict:
    """What the run needs (module docstring) for ``model_cfg`` in a dtype of ``dtype_bytes`` running
    ``cases`` (``setup.CaseInputs``), each building ``requests`` requests: {"device": ..., "host": ...},
    each {"total": bytes at the case that needs the most, "case", "batch": that case and its batch,
    "parts": its parts {name: bytes} (``PART_WORDS``), "scaling": its bytes that grow with its
    batch, "fixed": the rest}. On a CPU the host and the device are one memory: ``device`` holds
    both and ``host`` is empty."""
    from .analytic import component_params

    weights = component_params(model_cfg)["total"] * dtype_bytes
    margin = max(int(MARGIN_FRACTION * weights), MARGIN_MIN_BYTES)
    needs = [case_need(model_cfg, c, dtype_bytes, cuda, requests) for c in cases]
    groups: dict = {}   # execution -> {key: held}: what each execution keeps for the run
    for n in needs:
        groups.setdefault(n["key"][0], {})[n["key"]] = n["held"]
    device, host = [], []
    for c, n in zip(cases, needs):
        others = sum(groups[n["key"][0]].values()) - n["held"]   # held for the run by the other cases
        parts = {} if cuda else {p: n[p] for p in HOST_PARTS}     # a CPU's host memory is its device's
        parts["weights"] = weights
        parts.update({p: n[p] for p in DEVICE_PARTS}, held_by_others=others, margin=margin)
        scaling = sum(v for k, v in parts.items() if k not in ("weights", "held_by_others", "margin"))
        device.append({"total": sum(parts.values()), "case": c.name, "batch": c.case.batch, "parts": parts,
                       "scaling": scaling, "fixed": weights + margin + others})
        if cuda:
            hparts = {p: n[p] for p in HOST_PARTS}
            host.append({"total": sum(hparts.values()), "case": c.name, "batch": c.case.batch, "parts": hparts,
                         "scaling": sum(hparts.values()), "fixed": 0})
    if not device:
        device = [{"total": weights + margin, "case": None, "batch": 0, "scaling": 0, "fixed": weights + margin,
                   "parts": {"weights": weights, "margin": margin}}]
    return {"device": _worst(device), "host": _worst(host)}


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX); elsewhere torch emulates it."""
    import torch

    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        fn = getattr(torch.cpu, probe, None)
        try:
            if fn is not None and fn():
                return True
        except Exception:  # noqa: BLE001 - a private probe that changed: treat as absent
            pass
    return False


def _parts_text(parts: dict) -> str:
    """'13.0 GB of pages, 25.2 GB of preprocessed tensors, ...' (the parts that are not 0)."""
    return ", ".join(f"{_gb(v)} of {PART_WORDS[k]}" for k, v in parts.items() if v)


def _fix(need: dict, avail: int, device, size: int) -> str:
    """The fix of a refusal: the largest batch that fits when a smaller batch would, else the model,
    the dtype or the machine."""
    if need["batch"] > 1 and need["scaling"]:
        per_page = need["scaling"] / need["batch"]
        fits = int((avail - need["fixed"]) // per_page)
        if fits >= 1:
            return (f"lower workload.batch to {fits} or less (case {need['case']} needs about {_gb(per_page)} per "
                    "page of its batch; run.memory_check=false skips this check)")
    fixes = ["model=tiny"]
    if device.type == "cpu" and size > 2:
        fixes.append("dtype=bf16 (halves the weights" + ("" if cpu_has_bf16() else
                                                         "; this CPU has no native bf16, so it runs slower") + ")")
    if need["batch"] > 1:
        fixes.append("workload.batch=1")
    fixes.append("or a machine with more memory")
    return "use " + ", ".join(fixes) + " (run.memory_check=false skips this check)"


def check_memory(model_cfg, device, dtype, cases: list, free: Optional[tuple] = None, requests: int = 1,
                 host_free: Optional[tuple] = None) -> dict:
    """The manifest's ``memory`` entry ({need_bytes, free_bytes, free_is, rule}: the parts of the
    case that needs the most); raises HarnessError when the run cannot fit. ``dtype``: the run's
    torch dtype; ``requests``: requests each case builds (warm-ups, timed repeats, the profiled
    one); ``free`` / ``host_free``: (bytes, what) instead of reading the device's / the host's
    (tests; ``host_free`` on CUDA only)."""
    import torch

    from .dtypes import nbytes

    size = nbytes(str(dtype).replace("torch.", ""))
    cuda = device.type == "cuda"
    need = need_bytes(model_cfg, size, cases, cuda=cuda, requests=requests)
    avail, what = free if free is not None else free_bytes(device)
    dev = need["device"]
    entry = {"need_bytes": {**dev["parts"], "total": dev["total"]}, "largest_case": dev["case"], "free_bytes": avail,
             "free_is": what, "rule": "harness.memory_check (its docstring): pages + preprocessed tensors + weights + "
                                      "KV caches + CUDA graph pools + activations + the request on the device + margin"}
    checks = [(dev, avail, what)]
    if cuda:
        hfree, hwhat = host_free if host_free is not None else free_bytes(torch.device("cpu"))
        entry.update(host_need_bytes={**need["host"]["parts"], "total": need["host"]["total"]},
                     host_free_bytes=hfree, host_free_is=hwhat)
        checks.append((need["host"], hfree, hwhat))
    for wanted, have, where in checks:
        if have is not None and wanted["total"] > have:
            raise HarnessError(f"the run needs about {_gb(wanted['total'])} ({_parts_text(wanted['parts'])}) but only "
                               f"{_gb(have)} of {where} is free", _fix(wanted, have, device, size))
    return entry


#: what torch's CPU allocator says when it cannot allocate (a RuntimeError, not a MemoryError)
CPU_ALLOCATOR_OOM = "DefaultCPUAllocator: can't allocate memory"


def out_of_memory(exc: BaseException, during: str) -> BaseException:
    """``exc`` as the one-line HarnessError of running out of memory (``MemoryError`` on the host,
    torch's CPU allocator's RuntimeError (``CPU_ALLOCATOR_OOM``), torch's ``OutOfMemoryError`` on a
    GPU) ``during`` what; any other exception unchanged."""
    import sys

    torch = sys.modules.get("torch")
    gpu = torch is not None and isinstance(exc, getattr(torch, "OutOfMemoryError", ()))
    cpu_torch = isinstance(exc, RuntimeError) and CPU_ALLOCATOR_OOM in str(exc)
    if not (gpu or cpu_torch or isinstance(exc, MemoryError)):
        return exc
    what = "GPU memory" if gpu else "memory (torch's CPU allocator)" if cpu_torch else "memory (MemoryError)"
    return HarnessError(f"out of {what} during {during}",
                        "lower workload.batch or workload.decode_tokens, or use model=tiny or a machine with more free "
                        "memory (the check before the run counts pages, preprocessed tensors, weights, caches and "
                        "the largest activations, not every tensor)")


__all__ = ["check_memory", "out_of_memory", "need_bytes", "case_need", "stage_peaks", "pixel_values", "page_bytes", "free_bytes",
           "cpu_has_bf16", "MARGIN_FRACTION", "MARGIN_MIN_BYTES", "PAGE_PIXEL_BYTES", "PIXEL_VALUE_BYTES"]
