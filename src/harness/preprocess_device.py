"""The vendor's preprocessing on the device (``execution.preprocess=device``).

The host keeps what only it can do: decoding the page into 8-bit RGB pixels (or rasterising a PDF
page) and the prompt's token layout (``workload.token_layout``). The pixels go to the device as
uint8 (a quarter of the float32 bytes the host path copies), and there the page is resized, padded,
normalised and tiled as ``workload.preprocess`` does with PIL:

* resize: PIL's own arithmetic, bit for bit: its bicubic coefficients (a = -0.5, the support
  stretched by the reduction) computed as ``Resample.c`` computes them in float64 and rounded to 22-bit
  fixed point, as a band of taps per output pixel (``pil_taps``), one axis at a time in PIL's order
  (``pass_order``), each output the integer sum of its taps x 8-bit pixels, + 2^21, shifted right by
  22 and clipped to 0..255 as PIL does. The sums are integers, so any arithmetic that holds them
  exactly gives PIL's bytes: on CUDA a Triton kernel in int32 (``kernels.pil_resample_triton``: one
  launch per pass for the whole batch; exact because 255 x max sum |k| + 2^21 < 2^31, about 1.3e9
  for bicubic, checked per pass, else the float64 path), elsewhere (the CPU: the reference) float64
  matrix products with the dense coefficients (``pil_coefficients``; exact below 2^53), page by page.
* pad: ``ImageOps.pad``'s geometry (``contain_size``: the aspect kept, sides rounded; the page
  centred, offsets rounded) on a ``workload.PAD_COLOR`` fill.
* normalise: (x / 255 - 0.5) / 0.5 as ``workload.to_tensor`` computes it (a table of the 256 values).
* tiles: the page resized to (tile x cols, tile x rows) and cut row-major (``workload._tiles``).

Pages of one size are stacked together. The pixels are float32 until the request's pixels are cast
to the model's dtype, as ``workload.Request.to`` does.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import time
import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np
import PIL
import torch

from . import workload as wl
from .kernels.availability import triton_available
from .layout import BOS_TOKENS, Case, get_mode, image_token_count, tile_grid_for

#: Pillow 13 resizes the vertical axis first when the height shrinks by more than twice as many
#: pixels as the width (its ``ImagingResampleInner``); earlier versions always start horizontally
VERTICAL_FIRST_FROM = (13, 0)


#: the installed Pillow's (major, minor)
PILLOW = tuple(int(p) for p in PIL.__version__.split(".")[:2])


def pass_order(in_size: tuple, out_size: tuple, pillow: Optional[tuple] = None) -> str:
    """``"hv"`` (horizontal pass first) or ``"vh"``: the order the installed Pillow (or ``pillow``,
    (major, minor)) resizes a (w, h) page to ``out_size`` [px]. Only a pass whose size changes runs."""
    (w0, h0), (w1, h1) = in_size, out_size
    vertical_first = (pillow or PILLOW) >= VERTICAL_FIRST_FROM and 0 < h0 - h1 and h0 - h1 > 2 * (w0 - w1)
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


#: PIL's fixed point: coefficients scaled by 2^22 (``PRECISION_BITS``), sums rounded by adding 2^21
PRECISION_BITS = 22
#: PIL's bicubic: a = -0.5, support 2 (``bicubic_filter`` in ``Resample.c``)
BICUBIC_A, BICUBIC_SUPPORT = -0.5, 2.0


def _bicubic(x: np.ndarray) -> np.ndarray:
    """PIL's bicubic kernel at ``x`` (float64, the same operations in the same order)."""
    a = BICUBIC_A
    x = np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


@functools.lru_cache(maxsize=64)
def pil_taps(in_size: int, out_size: int) -> tuple:
    """(xmin int64 [out_size], k int64 [out_size, ksize]): PIL's 8-bit resampling coefficients from
    ``in_size`` to ``out_size`` pixels along one axis as its band (``precompute_coeffs`` +
    ``normalize_coeffs_8bpc``): output i reads input pixels xmin[i] + t with weight k[i, t] (22-bit
    fixed point), t < ksize = 2 ceil(2 filterscale) + 1, k zero from t = xsize[i] on. The filter is
    stretched by the reduction, each output's weights normalised to sum 1 in float64 (summed left to
    right), then scaled by 2^22 and rounded half away from zero. Read-only arrays (cached)."""
    scale = float(in_size) / out_size
    filterscale = max(scale, 1.0)
    support = BICUBIC_SUPPORT * filterscale
    ksize = int(np.ceil(support)) * 2 + 1
    inv = 1.0 / filterscale
    center = (np.arange(out_size) + 0.5) * scale
    xmin = np.maximum(np.trunc(center - support + 0.5).astype(np.int64), 0)
    xsize = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size) - xmin
    taps = np.arange(ksize)
    w = _bicubic(((taps[None, :] + xmin[:, None]) - center[:, None] + 0.5) * inv)
    w = np.where(taps[None, :] < xsize[:, None], w, 0.0)
    ww = np.zeros(out_size)
    for t in range(ksize):          # left to right, as the C loop (numpy's sum would pair them)
        ww = ww + w[:, t]
    w = np.where(ww[:, None] != 0.0, w / np.where(ww == 0.0, 1.0, ww)[:, None], w)
    one = float(1 << PRECISION_BITS)
    k = np.where(w < 0, np.trunc(-0.5 + w * one), np.trunc(0.5 + w * one)).astype(np.int64)
    xmin.setflags(write=False)
    k.setflags(write=False)
    return xmin, k


@functools.lru_cache(maxsize=64)
def pil_coefficients(in_size: int, out_size: int) -> np.ndarray:
    """int64 [out_size, in_size]: ``pil_taps`` as a dense matrix (zero outside each output's window)."""
    xmin, k = pil_taps(in_size, out_size)
    cols = xmin[:, None] + np.arange(k.shape[1])[None, :]
    keep = cols < in_size           # beyond the page k is zero (t >= xsize)
    out = np.zeros((out_size, in_size), dtype=np.int64)
    out[np.nonzero(keep)[0], cols[keep]] = k[keep]
    return out


#: device copies of what the device part reads again and again: PIL's coefficient matrices and taps
#: per (in, out, device), at most 64 (all dropped when full: ``_kept``); the normalisation table per
#: (device, dtype)
_MATRICES: dict = {}
_NORM_TABLES: dict = {}


def _kept(store: dict, key, make, limit: Optional[int] = None):
    """``store[key]``, made by ``make()`` the first time (a device copy made once: a copy per batch would
    wait on the stream); with ``limit``, the store is emptied when it holds that many."""
    if key not in store:
        if limit is not None and len(store) >= limit:
            store.clear()
        store[key] = make()
    return store[key]


def _matrix(in_size: int, out_size: int, device) -> torch.Tensor:
    """``pil_coefficients`` as a float64 [in_size, out_size] tensor on ``device`` (kept per device)."""
    return _kept(_MATRICES, (in_size, out_size, str(device)), lambda: torch.from_numpy(
        pil_coefficients(in_size, out_size).T.astype(np.float64)).to(device), 64)


def _pass(x: torch.Tensor, axis: str, size: int) -> torch.Tensor:
    """One PIL 8-bit pass of ``x`` [..., H, W] (float64 integers 0..255) along ``axis`` to ``size``
    pixels: sums of pixel x coefficient (exact in float64: |sum| < 2^53), + 2^21, floor of / 2^22,
    clipped to 0..255 (``clip8``)."""
    if axis == "h":
        acc = torch.matmul(x, _matrix(x.shape[-1], size, x.device))
    else:
        acc = torch.matmul(_matrix(x.shape[-2], size, x.device).T, x)
    return torch.floor((acc + float(1 << (PRECISION_BITS - 1))) / float(1 << PRECISION_BITS)).clamp_(0.0, 255.0)


def _taps(in_size: int, out_size: int, device) -> Optional[tuple]:
    """``pil_taps`` as int32 tensors (xmin [out], k [out, ksize]) on ``device`` (kept per device), or
    None when their int32 sums could overflow (``pil_resample_triton.int32_exact``; never for bicubic)."""
    from .kernels.pil_resample_triton import int32_exact

    def make():
        xmin, k = pil_taps(in_size, out_size)
        return (tuple(torch.from_numpy(a.astype(np.int32)).to(device) for a in (xmin, k))
                if int32_exact(k, PRECISION_BITS) else None)
    return _kept(_MATRICES, ("taps", in_size, out_size, str(device)), make, 64)


def passes(in_size: tuple, out_size: tuple) -> list:
    """The passes a resize from ``in_size`` to ``out_size`` = (w, h) [px] runs, in PIL's order: [(axis, in
    length, out length)] for the axes whose length changes ("h": width, "v": height)."""
    (w0, h0), (w1, h1) = in_size, out_size
    lengths = {"h": (w0, w1), "v": (h0, h1)}
    return [(a, *lengths[a]) for a in pass_order(in_size, out_size) if lengths[a][0] != lengths[a][1]]


def resize_triton(x: torch.Tensor, size: tuple) -> Optional[torch.Tensor]:
    """``resize`` by the Triton kernel (``kernels.pil_resample_triton``) on ``x``'s device (compiled on
    CUDA; on the CPU only under ``TRITON_INTERPRET=1``): ``x`` [B, 3, H, W] (8-bit values, uint8 or
    float32) resized to ``size`` = (w, h) [px], one launch per pass for the whole batch in PIL's order,
    int32 sums, the page between the passes in uint8; float32 out. None when a pass's int32 sums could
    overflow (never for bicubic)."""
    from .kernels.pil_resample_triton import pil_pass

    h0, w0 = x.shape[-2:]
    steps = passes((w0, h0), size)
    taps = [_taps(n_in, n_out, x.device) for _, n_in, n_out in steps]
    if any(t is None for t in taps):
        return None
    y = x if x.dtype in (torch.uint8, torch.float32) else x.float()
    for j, ((axis, _, _), (xmin, k)) in enumerate(zip(steps, taps)):
        y = pil_pass(y, axis, xmin, k, PRECISION_BITS, torch.float32 if j == len(steps) - 1 else torch.uint8)
    return y.float()


def resize(x: torch.Tensor, size: tuple) -> torch.Tensor:
    """``x`` [B, 3, H, W] holding 8-bit values (uint8 or any float dtype), resized to ``size`` = (w, h) [px]
    exactly as PIL's ``Image.resize(size)`` with BICUBIC on an RGB page (see the module docstring):
    float32 out; the same values when the size is already ``size``. On CUDA (where Triton runs) the
    whole batch at once (``resize_triton``); elsewhere float64 matrix products, page by page."""
    h0, w0 = x.shape[-2:]
    w1, h1 = size
    if (w0, h0) == (w1, h1):
        return x.float()
    if x.device.type == "cuda" and triton_available(x.device)[0]:
        y = resize_triton(x, size)
        if y is not None:
            return y
    out = []
    for page in x:                  # one page at a time: float64 copies of a whole batch would not fit
        y = page.double()
        for axis, _, n_out in passes((w0, h0), size):
            y = _pass(y, axis, n_out)
        out.append(y.float())
    return torch.stack(out)


def pad(x: torch.Tensor, side: int) -> torch.Tensor:
    """``ImageOps.pad(page, (side, side), color=PAD_COLOR)`` of ``x`` [B, 3, H, W] (8-bit values, uint8 or
    float): contained in the square, centred on the grey fill; float32 out."""
    h0, w0 = x.shape[-2:]
    w1, h1 = contain_size((w0, h0), (side, side))
    inner = resize(x, (w1, h1))
    if (w1, h1) == (side, side):
        return inner
    out = torch.empty((*x.shape[:-2], side, side), dtype=inner.dtype, device=x.device)
    for c, v in enumerate(wl.PAD_COLOR):  # scalars: no host-to-device copy on the stream
        out[:, c].fill_(v)
    left, top = round((side - w1) * 0.5), round((side - h1) * 0.5)
    out[..., top:top + h1, left:left + w1] = inner
    return out


#: (v / 255 - 0.5) / 0.5 of every 8-bit value v, computed by numpy in float32 as ``workload.to_tensor``
#: does: a device's own float division may round differently (CUDA divides by a scalar through its
#: reciprocal), a table look-up cannot
NORMALISED = wl.normalised(np.arange(256, dtype=np.uint8))


def normalise(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """8-bit values (float32) -> (x / 255 - 0.5) / 0.5, the values ``workload.to_tensor`` gives
    (``NORMALISED``), cast to ``dtype``: a look-up in the table cast once (casting 256 values, then
    gathering, is the gather of the float32 values, then cast, value for value); int32 indices."""
    table = _kept(_NORM_TABLES, (str(x.device), dtype), lambda: torch.from_numpy(NORMALISED).to(x.device, dtype))
    return table[x.int()]


def tiles(x: torch.Tensor, grid: tuple, tile: int) -> torch.Tensor:
    """[B * cols * rows, 3, tile, tile]: ``x`` [B, 3, H, W] resized to (tile x cols, tile x rows) and
    cut row-major per page (``workload._tiles``), 8-bit values."""
    cols, rows = grid
    big = resize(x, (tile * cols, tile * rows))
    b = big.shape[0]
    return (big.view(b, 3, rows, tile, cols, tile).permute(0, 2, 4, 1, 3, 5).reshape(b * rows * cols, 3, tile, tile))


def views_and_tiles(pixels: list, mode, dtype: torch.dtype = torch.float32) -> tuple:
    """(global views [B, 3, S, S], tiles [B * c * r, 3, T, T] or None) in ``dtype``, normalised, of the
    pages ``pixels`` (each [H, W, 3] uint8 on the device, or [H, W, 4] whose last byte is unused; one
    tile grid for all) in ``mode``: what
    ``workload.preprocess`` gives each page (cast to ``dtype``), pages of one size processed together
    (one size, as in the throughput pipeline's batches: no per-page views gathered again)."""
    mode = get_mode(mode)
    grids = {tile_grid_for(p.shape[1], p.shape[0], mode) for p in pixels}
    if len(grids) > 1:
        raise ValueError(f"pages of one request need one tile grid, got {sorted(map(str, grids))}")
    grid = grids.pop()
    views, cuts = [None] * len(pixels), [None] * len(pixels)
    for shape in dict.fromkeys(tuple(p.shape) for p in pixels):
        rows = [k for k, p in enumerate(pixels) if tuple(p.shape) == shape]
        x = torch.stack([pixels[k] for k in rows]).permute(0, 3, 1, 2)[:, :3]   # uint8 RGB (of RGB + unused)
        cut = None if not mode.crop or grid is None else normalise(tiles(x, grid, mode.image_size), dtype)
        if mode.squares_first:                      # (no crop)
            x = resize(x, (mode.image_size, mode.image_size))
        view = pad(x, mode.view_size)
        if len(rows) == len(pixels):                # one size: the batch as it is, in page order
            return normalise(view, dtype), cut
        per = 0 if cut is None else cut.shape[0] // len(rows)
        for j, k in enumerate(rows):
            views[k] = view[j]
            cuts[k] = None if cut is None else cut[j * per:(j + 1) * per]
    return normalise(torch.stack(views), dtype), None if grid is None else torch.cat(cuts)


class _ArrowSchema(ctypes.Structure):
    """The Arrow C data interface's ArrowSchema (what ``__arrow_c_array__`` exports)."""


_ArrowSchema._fields_ = [("format", ctypes.c_char_p), ("name", ctypes.c_char_p), ("metadata", ctypes.c_char_p),
                         ("flags", ctypes.c_int64), ("n_children", ctypes.c_int64),
                         ("children", ctypes.POINTER(ctypes.POINTER(_ArrowSchema))), ("dictionary", ctypes.c_void_p),
                         ("release", ctypes.c_void_p), ("private_data", ctypes.c_void_p)]


class _ArrowArray(ctypes.Structure):
    """The Arrow C data interface's ArrowArray."""


_ArrowArray._fields_ = [("length", ctypes.c_int64), ("null_count", ctypes.c_int64), ("offset", ctypes.c_int64),
                        ("n_buffers", ctypes.c_int64), ("n_children", ctypes.c_int64),
                        ("buffers", ctypes.POINTER(ctypes.c_void_p)),
                        ("children", ctypes.POINTER(ctypes.POINTER(_ArrowArray))), ("dictionary", ctypes.c_void_p),
                        ("release", ctypes.c_void_p), ("private_data", ctypes.c_void_p)]


_capsule = ctypes.pythonapi.PyCapsule_GetPointer      # (capsule, name) -> the address it holds
_capsule.restype, _capsule.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]


def page_pixels(image) -> np.ndarray:
    """An RGB page's 8-bit pixels without repacking them: PIL keeps 4 bytes a pixel (RGB + one unused),
    which its Arrow export (``__arrow_c_array__``, Pillow >= 11.2) hands out in place when the image is
    one block: then a [H, W, 4] uint8 view of them (the page and the export kept alive with it); else
    ``np.asarray`` (a [H, W, 3] copy PIL repacks: 2.9 ms for an A4 page on the H200's host)."""
    h, w = image.size[1], image.size[0]
    try:
        schema, array = image.__arrow_c_array__()
        s = _ArrowSchema.from_address(_capsule(schema, b"arrow_schema"))
        a = _ArrowArray.from_address(_capsule(array, b"arrow_array"))
        child = a.children[0].contents if a.n_children == 1 else None
        if s.format != b"+w:4" or child is None or child.length != 4 * w * h or child.offset or a.offset:
            raise ValueError(f"export {s.format!r} is not one block of 4-byte pixels")
        buf = (ctypes.c_uint8 * (4 * w * h)).from_address(child.buffers[1])
        buf.keep = (image, schema, array)          # the memory is the page's: it lives as long as the view
        return np.frombuffer(buf, dtype=np.uint8).reshape(h, w, 4)
    except (AttributeError, ValueError, TypeError):
        return np.asarray(image)


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
               text_tokens: int = 12, seed: int = 0, name: str = "", in_place: bool = False) -> HostPages:
    """``pages`` (``workload.Page``) as 8-bit RGB arrays ([H, W, 3]; with ``in_place``, PIL's own 4-byte
    pixels where it can: ``page_pixels``) and their prompt rows (one tile grid for all, else the
    one-line error of ``workload.build_request``)."""
    mode = get_mode(mode)
    images = [p.image if p.image.mode == "RGB" else p.image.convert("RGB") for p in pages]
    grids = [tile_grid_for(*im.size, mode) for im in images]
    wl.check_one_grid(pages, grids)
    grid = grids[0]
    ids, mask, before, after = wl.token_layout(image_token_count(mode, grid), prompt, tokenizer, text_tokens, seed)
    batch = len(pages)
    pixels = [page_pixels(im) if in_place else np.asarray(im) for im in images]
    return HostPages(pixels, torch.tensor([ids] * batch, dtype=torch.long),
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
    views, cut = views_and_tiles(pixels, host.case.mode, dtype)
    device = pixels[0].device
    return wl.Request(case=host.case, input_ids=host.input_ids.to(device), images_seq_mask=host.images_seq_mask.to(device),
                      global_views=views, tiles=cut, pages=list(host.pages),
                      image_start=host.image_start, source_pages=list(source_pages or []), prompt=prompt,
                      routing=routing, routing_seed=routing_seed)


def timed_request(pages: list, mode, device: torch.device, dtype: torch.dtype, **build) -> tuple:
    """(request on ``device``, {"prep_ms", "h2d_ms"}) of ``pages`` under ``preprocess=device``, host
    wall clock: ``prep_ms`` = the host part (PIL's pixels in place, token layout) + the device part (resize,
    pad, normalise, tiles; synchronised on CUDA), ``h2d_ms`` = copying the 8-bit pixels and prompt
    rows (synchronised on CUDA). ``build``: ``host_pages``'s and ``request``'s keywords."""
    cuda = device.type == "cuda"
    keep = {k: build.pop(k) for k in ("prompt", "routing", "routing_seed") if k in build}
    t0 = time.perf_counter()
    host = host_pages(pages, mode, prompt=keep.get("prompt", wl.DEFAULT_PROMPT), in_place=True, **build)
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


__all__ = ["VERTICAL_FIRST_FROM", "PRECISION_BITS", "page_pixels", "pass_order", "passes", "contain_size", "pil_taps",
           "pil_coefficients", "resize", "resize_triton", "pad", "normalise", "tiles", "views_and_tiles",
           "HostPages", "host_pages", "to_device", "request", "timed_request"]
