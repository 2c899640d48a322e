"""The preprocessing workers: processes started with ``spawn`` (no CUDA state, no forked locks)
that read a page file and build its one-page request the vendor's way (``workload.load_pages``:
decode, EXIF rotation, 8-bit conversion, or a PDF page, ``FILE.pdf#page=N``, rasterised at
``workload.pdf_dpi``; ``workload.build_request``: ``workload.preprocess``'s resize / pad /
normalisation and tiles, the prompt's token layout).

Everything here is a top-level function of an importable module, as ``spawn`` needs. A worker
ignores SIGINT (the run's own process handles it and shuts the pool down), runs torch on one
thread, and times each page with ``time.perf_counter_ns`` (CLOCK_MONOTONIC on Linux: the same
clock in every process, so its intervals line up with the main process's). The interval covers
reading, decoding (a PDF page: opening the file and rasterising the page), preprocessing and
request building (with ``device_prep``: reading, decoding and the prompt row only; the device
preprocesses the 8-bit pixels); handing the arrays back (a pickle, about one copy of the pixels)
is outside it.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

_STATE: dict = {}


@dataclass(frozen=True)
class PrepSpec:
    """What every worker needs: the page files (by page index; a PDF page as ``FILE.pdf#page=N``), the
    crop mode, the prompt and its tokenizer (a model directory, or None for ``text_tokens`` filler
    ids), ``max_pixels``, NVTX, the DPI PDF pages are rasterised at (``pdf_dpi``) and whether the
    device preprocesses (``device_prep``: the worker stops at the page's 8-bit pixels)."""

    paths: tuple
    mode: object
    prompt: str
    text_tokens: int
    seed: int
    tokenizer_path: Optional[str]
    max_pixels: int
    nvtx: bool
    pdf_dpi: float
    device_prep: bool = False   # execution.preprocess=device: hand back 8-bit pixels (preprocess_device)


@dataclass
class PreparedPage:
    """One page ready to batch: pixels as float32 arrays (``global_view`` [3, S, S], ``tiles``
    [c*r, 3, T, T] or None) or, with ``device_prep``, the page's 8-bit RGB pixels (``pixels`` [H, W,
    3] uint8; the views None), the prompt row (``input_ids`` [S] int64, ``images_seq_mask`` [S]
    bool), and the worker's pid and interval [ns, perf_counter]."""

    index: int
    pid: int
    start_ns: int
    end_ns: int
    global_view: Optional[np.ndarray]
    tiles: Optional[np.ndarray]
    input_ids: np.ndarray
    images_seq_mask: np.ndarray
    pixels: Optional[np.ndarray] = None


def init_worker(spec: PrepSpec) -> None:
    """Pool initializer: ignore SIGINT, one torch thread, the tokenizer and NVTX loaded once."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    from .. import workload as wl
    from ..measure.nvtx_ranges import NvtxRanges

    torch.set_num_threads(1)
    tokenizer, _ = wl.load_tokenizer(spec.tokenizer_path, spec.text_tokens)
    _STATE.update(spec=spec, tokenizer=tokenizer, nvtx=NvtxRanges(spec.nvtx))


def started() -> int:
    """A no-op task that makes the pool start a process (returns its pid)."""
    return os.getpid()


def draw_page(index: int, seed: int, size: tuple, path: str) -> str:
    """Write synthetic page ``index`` (``workload.synthetic_page``) as a PNG file at ``path``."""
    from .. import workload as wl

    wl.synthetic_page(index, seed=seed, size=tuple(size)).save(path, "PNG", compress_level=1)
    return path


def prepare_page(index: int) -> PreparedPage:
    """Page ``index`` read from its file and built into a one-page request, timed (see module)."""
    from .. import workload as wl

    spec: PrepSpec = _STATE["spec"]
    nvtx = _STATE["nvtx"]
    start = time.perf_counter_ns()
    nvtx.push("preprocess", index)
    try:
        page = wl.load_pages(spec.paths[index], seed=spec.seed, max_pixels=spec.max_pixels,
                             pdf_dpi=spec.pdf_dpi)[0]
        if spec.device_prep:
            from ..preprocess_device import host_pages

            host = host_pages([page], spec.mode, decode_tokens=0, prompt=spec.prompt, tokenizer=_STATE["tokenizer"],
                              text_tokens=spec.text_tokens, seed=spec.seed)
            out = PreparedPage(index, os.getpid(), start, 0, None, None, host.input_ids[0].numpy(),
                               host.images_seq_mask[0].numpy(), pixels=host.pixels[0])
        else:
            req = wl.build_request([page], spec.mode, decode_tokens=0, prompt=spec.prompt,
                                   tokenizer=_STATE["tokenizer"], text_tokens=spec.text_tokens, seed=spec.seed)
            out = PreparedPage(index, os.getpid(), start, 0, req.global_views[0].numpy(),
                               None if req.tiles is None else req.tiles.numpy(), req.input_ids[0].numpy(),
                               req.images_seq_mask[0].numpy())
    finally:
        nvtx.pop()
    out.end_ns = time.perf_counter_ns()
    return out


__all__ = ["PrepSpec", "PreparedPage", "init_worker", "started", "draw_page", "prepare_page"]
