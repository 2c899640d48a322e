"""The vendor's preprocessing on the device (``execution.preprocess=device``).

The host keeps what only it can do: decoding the page into 8-bit RGB pixels (or rasterising a PDF
page) and the prompt's token layout (``workload.token_layout``). The pixels go to the device as
uint8 (a quarter of the float32 bytes the host path copies), and there the page is resized, padded,
normalised and tiled as ``workload.preprocess`` does with PIL:

* resize: PIL's bicubic (a = -0.5) with its antialiasing support (scaled by the reduction), one
  axis at a time with the 8-bit rounding PIL keeps between the two passes (round half up, clip to
  0..255), in PIL's order (``pass_order``). ``torch.nn.functional.interpolate(mode="bicubic",
  antialias=True)`` is that filter; PIL's coefficients are 22-bit fixed point, torch's float32, so
  a pixel may differ by one level (2/255 after normalisation): ``bench preprocess`` measures how
  many do.
* pad: ``ImageOps.pad``'s geometry (``contain_size``: the aspect kept, sides rounded; the page
  centred, offsets rounded) on a ``workload.PAD_COLOR`` fill.
* normalise: (x / 255 - 0.5) / 0.5 in float32, the same operations as ``workload.to_tensor``.
* tiles: the page resized to (tile x cols, tile x rows) and cut row-major (``workload._tiles``).

Pages of one size are resized together (one call per size and pass). Everything is float32 until
the request's pixels are cast to the model's dtype, as ``workload.Request.to`` does.
"""
from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np
import PIL
import torch
import torch.nn.functional as F

from . import workload as wl
from .layout import BOS_TOKENS, Case, get_mode, image_token_count

#: Pillow 13 resizes the vertical axis first when the height shrinks by more than twice as many
#: pixels as the width (its ``ImagingResampleInner``); earlier versions always start horizontally
VERTICAL_FIRST_FROM = (13, 0)


def _pillow_version() -> tuple:
    return tuple(int(p) for p in PIL.__version__.split(".")[:2])


def pass_order(in_size: tuple, out_size: tuple, pillow: Optional[tuple] = None) -> str:
    """``"hv"`` (horizontal pass first) or ``"vh"``: the order the installed Pillow (or ``pillow``,
    (major, minor)) resizes a (w, h) page to ``out_size`` [px]. Only a pass whose size changes runs."""
    (w0, h0), (w1, h1) = in_size, out_size
    vertical_first = (pillow or _pillow_version()) >= VERTICAL_FIRST_FROM and 0 < h0 - h1 and h0 - h1 > 2 * (w0 - w1)
    return "vh" if vertical_first else "hv"


def contain_size(in_size: tuple, box: tuple) -> tuple:
    """(w, h) [px] ``ImageOps.contain`` gives a (w, h) page inside ``box``: the aspect kept, the
    other side ``round``ed (Python's round: half to even), the box itself when the ratios are equal."""
    (w, h), (bw, bh) = in_size, box
    if w / h > bw / bh:
        return (bw, round(h / w * bw))
    if w / h < bw / bh:
        return (round(w / h * bh), bh)
    return (bw, bh)


def _round8(x: torch.Tensor) -> torch.Tensor:
    """PIL's 8-bit result of a pass: round half up, clipped to 0..255 (float32 holding integers)."""
    return torch.floor(x + 0.5).clamp_(0.0, 255.0)


def resize(x: torch.Tensor, size: tuple) -> torch.Tensor:
    """``x`` [B, 3, H, W] float32 holding 8-bit values, resized to ``size`` = (w, h) [px] as PIL's
    ``Image.resize(size)`` with BICUBIC (see the module docstring); the same tensor when the size
    is already ``size``."""
    h0, w0 = x.shape[-2:]
    w1, h1 = size
    for axis in pass_order((w0, h0), (w1, h1)):
        if axis == "h" and x.shape[-1] != w1:
            x = _round8(F.interpolate(x, size=(x.shape[-2], w1), mode="bicubic", antialias=True, align_corners=False))
        elif axis == "v" and x.shape[-2] != h1:
            x = _round8(F.interpolate(x, size=(h1, x.shape[-1]), mode="bicubic", antialias=True, align_corners=False))
    return x


def pad(x: torch.Tensor, side: int) -> torch.Tensor:
    """``ImageOps.pad(page, (side, side), color=PAD_COLOR)`` of ``x`` [B, 3, H, W] (8-bit values in
    float32): contained in the square, centred on the grey fill."""
    h0, w0 = x.shape[-2:]
    w1, h1 = contain_size((w0, h0), (side, side))
    inner = resize(x, (w1, h1))
    if (w1, h1) == (side, side):
        return inner
    out = torch.empty((*x.shape[:-2], side, side), dtype=x.dtype, device=x.device)
    out.copy_(torch.tensor(wl.PAD_COLOR, dtype=x.dtype, device=x.device).view(1, 3, 1, 1).expand_as(out))
    left, top = round((side - w1) * 0.5), round((side - h1) * 0.5)
    out[..., top:top + h1, left:left + w1] = inner
    return out


def normalise(x: torch.Tensor) -> torch.Tensor:
    """8-bit values (float32) -> (x / 255 - 0.5) / 0.5, as ``workload.to_tensor``."""
    return (x / np.float32(255.0) - np.float32(wl.NORM_MEAN)) / np.float32(wl.NORM_STD)


def tiles(x: torch.Tensor, grid: tuple, tile: int) -> torch.Tensor:
    """[B * cols * rows, 3, tile, tile]: ``x`` [B, 3, H, W] resized to (tile x cols, tile x rows) and
    cut row-major per page (``workload._tiles``), 8-bit values."""
    cols, rows = grid
    big = resize(x, (tile * cols, tile * rows))
    b = big.shape[0]
    return (big.view(b, 3, rows, tile, cols, tile).permute(0, 2, 4, 1, 3, 5).reshape(b * rows * cols, 3, tile, tile))


def views_and_tiles(pixels: list, mode) -> tuple:
    """(global views [B, 3, S, S], tiles [B * c * r, 3, T, T] or None) float32, normalised, of the
    pages ``pixels`` (each [H, W, 3] uint8 on the device, one tile grid for all) in ``mode``: what
    ``workload.preprocess`` gives each page, pages of one size processed together."""
    mode = get_mode(mode)
    grids = {wl.page_grid(p.shape[1], p.shape[0], mode) for p in pixels}
    if len(grids) > 1:
        raise ValueError(f"pages of one request need one tile grid, got {sorted(map(str, grids))}")
    grid = grids.pop()
    views, cuts = [None] * len(pixels), [None] * len(pixels)
    for shape in dict.fromkeys(tuple(p.shape) for p in pixels):
        rows = [k for k, p in enumerate(pixels) if tuple(p.shape) == shape]
        x = torch.stack([pixels[k] for k in rows]).permute(0, 3, 1, 2).float()
        if mode.crop:
            view = pad(x, mode.base_size)
            cut = None if grid is None else normalise(tiles(x, grid, mode.image_size))
        else:
            if mode.image_size <= 640:
                x = resize(x, (mode.image_size, mode.image_size))
            view, cut = pad(x, mode.image_size), None
        per = 0 if cut is None else cut.shape[0] // len(rows)
        for j, k in enumerate(rows):
            views[k] = view[j]
            cuts[k] = None if cut is None else cut[j * per:(j + 1) * per]
    out_views = normalise(torch.stack(views))
    return out_views, None if grid is None else torch.cat(cuts)


@dataclass
class HostPages:
    """The host's part of a request under ``preprocess=device``: the pages' 8-bit RGB pixels
    (``pixels``, [H, W, 3] uint8 arrays), the prompt rows and the request's shape (``case``)."""

    pixels: list
    input_ids: torch.Tensor
    images_seq_mask: torch.Tensor
    case: Case
    image_start: int
    pages: list

    @property
    def nbytes(self) -> int:
        """Bytes of pixels copied to the device [B]."""
        return int(sum(p.nbytes for p in self.pixels))


def host_pages(pages: list, mode, decode_tokens: int = 128, prompt: str = wl.DEFAULT_PROMPT, tokenizer=None,
               text_tokens: int = 12, seed: int = 0, name: str = "") -> HostPages:
    """``pages`` (``workload.Page``) as 8-bit RGB arrays and their prompt rows (one tile grid for all,
    else the one-line error of ``workload.build_request``)."""
    mode = get_mode(mode)
    images = [p.image if p.image.mode == "RGB" else p.image.convert("RGB") for p in pages]
    grids = [wl.page_grid(*im.size, mode) for im in images]
    if len(set(grids)) > 1:
        wl.build_request(pages, mode, decode_tokens=0, prompt=prompt, tokenizer=tokenizer, text_tokens=text_tokens,
                         seed=seed)   # raises the refusal that names each page's grid
    grid = grids[0]
    ids, mask, before, after = wl.token_layout(image_token_count(mode, grid), prompt, tokenizer, text_tokens, seed)
    batch = len(pages)
    return HostPages([np.asarray(im) for im in images], torch.tensor([ids] * batch, dtype=torch.long),
                     torch.tensor([mask] * batch, dtype=torch.bool),
                     Case(mode, grid, batch, before + after, decode_tokens, name), BOS_TOKENS + before,
                     [p.name for p in pages])


def to_device(host: HostPages, device) -> list:
    """The pages' pixels on ``device`` (uint8 [H, W, 3] each; a pageable copy, as ``Request.to``).
    PIL's arrays are read-only; nothing here writes to them (on the CPU the tensors share them)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return [torch.from_numpy(np.ascontiguousarray(p)).to(device) for p in host.pixels]


def request(host: HostPages, pixels: list, dtype: torch.dtype, prompt: str = "", routing: str = "weights",
            routing_seed: int = 0, source_pages: Optional[list] = None) -> wl.Request:
    """The ``workload.Request`` of ``host`` with its pixels (``to_device``) preprocessed where they
    are and cast to ``dtype``."""
    views, cut = views_and_tiles(pixels, host.case.mode)
    device = pixels[0].device
    return wl.Request(case=host.case, input_ids=host.input_ids.to(device), images_seq_mask=host.images_seq_mask.to(device),
                      global_views=views.to(dtype), tiles=None if cut is None else cut.to(dtype), pages=list(host.pages),
                      image_start=host.image_start, source_pages=list(source_pages or []), prompt=prompt,
                      routing=routing, routing_seed=routing_seed)


def timed_request(pages: list, mode, device: torch.device, dtype: torch.dtype, **build) -> tuple:
    """(request on ``device``, {"prep_ms", "h2d_ms"}) of ``pages`` under ``preprocess=device``, host
    wall clock: ``prep_ms`` = the host part (8-bit arrays, token layout) + the device part (resize,
    pad, normalise, tiles; synchronised on CUDA), ``h2d_ms`` = copying the 8-bit pixels and prompt
    rows (synchronised on CUDA). ``build``: ``host_pages``'s and ``request``'s keywords."""
    cuda = device.type == "cuda"
    keep = {k: build.pop(k) for k in ("prompt", "routing", "routing_seed") if k in build}
    t0 = time.perf_counter()
    host = host_pages(pages, mode, prompt=keep.get("prompt", wl.DEFAULT_PROMPT), **build)
    t1 = time.perf_counter()
    pixels = to_device(host, device)
    host = dataclasses.replace(host, input_ids=host.input_ids.to(device), images_seq_mask=host.images_seq_mask.to(device))
    if cuda:
        torch.cuda.synchronize(device)
    t2 = time.perf_counter()
    req = request(host, pixels, dtype, source_pages=pages, **keep)
    if cuda:
        torch.cuda.synchronize(device)
    t3 = time.perf_counter()
    return req, {"prep_ms": ((t1 - t0) + (t3 - t2)) * 1e3, "h2d_ms": (t2 - t1) * 1e3}


__all__ = ["VERTICAL_FIRST_FROM", "pass_order", "contain_size", "resize", "pad", "normalise", "tiles",
           "views_and_tiles", "HostPages", "host_pages", "to_device", "request", "timed_request"]
