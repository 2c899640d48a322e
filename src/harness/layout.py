"""The request's shape without its pixels: crop modes, the tile grid, the image-token layout and
``Case`` (one request shape), shared by the running side (``harness.workload`` builds requests
from pages) and the data side (the analytic cost model, the roofline join, the report).

Torch-free: it needs numpy for type checks only. Sizes are pixels, counts are tokens. The rules
(crop modes, tile-grid choice, placeholder layout) follow DeepSeek-OCR's ``infer()``.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .errors import HarnessError

PATCH_SIZE = 16                 # pixels per SAM patch side
DOWNSAMPLE = 4                  # SAM neck + net_2/net_3 shrink the patch grid 4x per side
IMAGE_TOKEN_ID = 128815
BOS_ID = 0
EOS_ID = 1


# --------------------------------------------------------------------------------------------
# crop modes
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CropMode:
    """A resolution mode: global-view size ``base_size``, tile size ``image_size`` (pixels)."""

    name: str
    base_size: int
    image_size: int
    crop: bool

    @property
    def view_size(self) -> int:
        """The global view's side [px]: base_size with crop, else image_size."""
        return self.base_size if self.crop else self.image_size

    @property
    def squares_first(self) -> bool:
        """Whether the vendor resizes the page to an image_size square before padding it: modes without
        crop of at most 640 px (tiny, small); larger ones keep the aspect ratio."""
        return not self.crop and self.image_size <= 640


MODES: dict[str, CropMode] = {
    "tiny": CropMode("tiny", 512, 512, False),
    "small": CropMode("small", 640, 640, False),
    "base": CropMode("base", 1024, 1024, False),
    "large": CropMode("large", 1280, 1280, False),
    "gundam": CropMode("gundam", 1024, 640, True),
}

_MODE_KEYS = ("base_size", "image_size", "crop")


def _check_size(value, key: str, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0 \
            or value % PATCH_SIZE:
        raise HarnessError(f"mode {name!r}: {key}={value!r} is not a positive multiple of "
                           f"{PATCH_SIZE} pixels", f"set {key} to e.g. 64, 640 or 1024")
    return int(value)


def get_mode(name_or_mode) -> CropMode:
    """Resolve a mode name, a ``CropMode`` or a mapping {name, base_size, image_size, crop}."""
    if isinstance(name_or_mode, CropMode):
        return name_or_mode
    if isinstance(name_or_mode, str):
        key = name_or_mode.strip().lower()
        if key not in MODES:
            raise HarnessError(f"unknown crop mode {name_or_mode!r}",
                               f"use one of {', '.join(MODES)}")
        return MODES[key]
    if isinstance(name_or_mode, Mapping):
        data = dict(name_or_mode)
        name = str(data.get("name") or "custom")
        if not any(k in data for k in _MODE_KEYS) and name in MODES:
            return MODES[name]
        missing = [k for k in _MODE_KEYS if k not in data]
        if missing:
            raise HarnessError(f"custom mode {name!r} lacks {', '.join(missing)}",
                               "give name, base_size, image_size and crop")
        unknown = sorted(set(data) - {"name", *_MODE_KEYS})
        if unknown:
            raise HarnessError(f"custom mode {name!r} has unknown key(s) {unknown}",
                               "use only name, base_size, image_size and crop")
        return CropMode(name, _check_size(data["base_size"], "base_size", name),
                        _check_size(data["image_size"], "image_size", name), bool(data["crop"]))
    raise HarnessError(f"cannot read a crop mode from {type(name_or_mode).__name__}",
                       f"use a mode name ({', '.join(MODES)}) or a mapping "
                       "{name, base_size, image_size, crop}")


def queries_per_side(size: int) -> int:
    """Vision tokens per side for a ``size``-pixel square view: ceil((size // 16) / 4)."""
    return math.ceil((size // PATCH_SIZE) / DOWNSAMPLE)


# --------------------------------------------------------------------------------------------
# tile grid (vendor rule)
# --------------------------------------------------------------------------------------------

def _grid_candidates(min_num: int, max_num: int) -> list[tuple[int, int]]:
    # The vendor collects the grids in a set and sorts it by tile count; Python's sort is stable,
    # so grids with the same count keep the set's iteration order. Building the set with the
    # same insertions in the same order reproduces that order (int tuples hash deterministically).
    found = set()
    for n in range(min_num, max_num + 1):
        for cols in range(1, n + 1):
            for rows in range(1, n + 1):
                if min_num <= cols * rows <= max_num:
                    found.add((cols, rows))
    return sorted(found, key=lambda g: g[0] * g[1])


def select_grid(width: int, height: int, image_size: int = 640, min_num: int = 2,
                max_num: int = 9) -> tuple[int, int]:
    """Tile grid (cols, rows) whose aspect ratio is closest to width/height (pixels).

    Candidates: every cols x rows with min_num <= cols*rows <= max_num, visited by tile count.
    A strictly smaller ratio difference wins; on an exact tie the later candidate wins only when
    the page area exceeds half the candidate's tiled area (0.5 * image_size^2 * cols * rows).
    """
    if width <= 0 or height <= 0:
        raise HarnessError(f"page size {width}x{height} pixels is empty",
                           "use an image with positive width and height")
    aspect = width / height
    area = width * height
    best_diff = float("inf")
    best = (1, 1)
    for cols, rows in _grid_candidates(min_num, max_num):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best_diff, best = diff, (cols, rows)
        elif diff == best_diff and area > 0.5 * image_size * image_size * cols * rows:
            best = (cols, rows)
    return best


def tile_grid_for(width: int, height: int, mode) -> tuple[int, int] | None:
    """Tile grid (cols, rows) for a page of width x height pixels, or None (no tiles).

    None when the mode does not crop, or when the page fits in one tile (both sides <=
    ``image_size``); otherwise ``select_grid``.
    """
    mode = get_mode(mode)
    if not mode.crop:
        return None
    if width <= mode.image_size and height <= mode.image_size:
        return None
    return select_grid(width, height, mode.image_size)


def image_token_count(mode, grid: tuple[int, int] | None = None) -> int:
    """Image placeholder tokens per page, row newlines and the view separator included.

    Global view: q rows of (q + 1) tokens plus 1 separator, q = queries_per_side(base_size) in
    crop mode, queries_per_side(image_size) otherwise. A c x r tile grid adds q_t*r rows of
    (q_t*c + 1) tokens, q_t = queries_per_side(image_size) (gundam: 273 + (10c+1)(10r)).
    """
    mode = get_mode(mode)
    if not mode.crop:
        if grid is not None and tuple(grid) != (1, 1):
            raise HarnessError(f"mode {mode.name!r} does not crop but a {grid} tile grid was given",
                               "pass grid=None for non-crop modes")
        q = queries_per_side(mode.image_size)
        return q * (q + 1) + 1
    q = queries_per_side(mode.base_size)
    count = q * (q + 1) + 1
    if grid is not None:
        cols, rows = grid
        if cols > 1 or rows > 1:
            qt = queries_per_side(mode.image_size)
            count += (qt * cols + 1) * (qt * rows)
    return count


# (width, height) pixels of the synthetic pages, cycled by index: A4 portrait @150 dpi, US letter, A4
# landscape, a till receipt, a small note (``harness.workload.synthetic_page`` draws them).
SYNTHETIC_SIZES = ((1240, 1754), (1275, 1650), (1754, 1240), (600, 1600), (600, 400))


# --------------------------------------------------------------------------------------------
# requests
# --------------------------------------------------------------------------------------------

BOS_TOKENS = 1                  # every prompt starts with one BOS token (id BOS_ID): stated here only


def parse_grid(text) -> tuple[int, int] | None:
    """'2x3' / [2, 3] / (2, 3) -> (2, 3) (cols x rows); None / '' / 'none' -> None."""
    if text is None:
        return None
    if isinstance(text, (tuple, list)):
        if len(text) != 2:
            raise HarnessError(f"tile grid {text!r} is not (cols, rows)", "write it as COLSxROWS, e.g. 2x3")
        cols, rows = (int(v) for v in text)
    else:
        s = str(text).strip().lower()
        if s in ("", "none", "null", "nan"):
            return None
        try:
            cols, rows = (int(v) for v in s.split("x"))
        except ValueError:
            raise HarnessError(f"cannot read tile grid {text!r}", "write it as COLSxROWS, e.g. 2x3") from None
    if cols < 1 or rows < 1:
        raise HarnessError(f"tile grid {text!r} is empty", "use positive cols and rows, e.g. 2x3")
    return cols, rows


def grid_text(grid) -> str | None:
    """(2, 3) -> '2x3'; None -> None."""
    return f"{grid[0]}x{grid[1]}" if grid else None


def check_count(value, key: str, low: int) -> int:
    """``value`` as an int when it is an integer >= ``low``; else the one-line error naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise HarnessError(f"{key}={value!r} is not a count >= {low}", f"set {key} to an integer >= {low}")
    return int(value)


@dataclass(frozen=True)
class Case:
    """One request shape: what the run measures and the analytic model costs (one type for both).

    ``mode`` crop mode; ``grid`` tile grid (cols, rows), None = no tiles ((1, 1) means the same);
    ``batch`` pages decoded together; ``text_tokens`` prompt text tokens, BOS excluded;
    ``decode_tokens`` new tokens (1 from prefill + ``decode_steps`` single-token forwards).
    The prompt is BOS + text + image placeholders: ``prefill_tokens = BOS_TOKENS + text_tokens +
    image_tokens``. ``name`` defaults to mode[-COLSxROWS][-bB].
    """

    mode: CropMode
    grid: tuple[int, int] | None = None
    batch: int = 1
    text_tokens: int = 12
    decode_tokens: int = 128
    name: str = ""

    def __post_init__(self):
        mode = get_mode(self.mode)
        grid = parse_grid(self.grid)
        if grid == (1, 1):
            grid = None
        if grid is not None and not mode.crop:
            raise HarnessError(f"mode {mode.name!r} does not crop but a {grid_text(grid)} tile grid was given",
                               "give a grid only for crop modes (gundam)")
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "grid", grid)
        object.__setattr__(self, "batch", check_count(self.batch, "batch", 1))
        object.__setattr__(self, "text_tokens", check_count(self.text_tokens, "text_tokens", 0))
        object.__setattr__(self, "decode_tokens", check_count(self.decode_tokens, "decode_tokens", 0))
        if not self.name:
            parts = [mode.name] + ([grid_text(grid)] if grid else []) + ([f"b{self.batch}"] if self.batch > 1 else [])
            object.__setattr__(self, "name", "-".join(parts))

    @property
    def image_tokens(self) -> int:
        """Image placeholders per page (row newlines and the view separator included)."""
        return image_token_count(self.mode, self.grid)

    @property
    def prefill_tokens(self) -> int:
        """Prompt length S in tokens: BOS + text + image."""
        return BOS_TOKENS + self.text_tokens + self.image_tokens

    @property
    def decode_steps(self) -> int:
        """Single-token forwards after prefill (the first new token comes from prefill)."""
        return max(self.decode_tokens - 1, 0)

    def to_dict(self) -> dict:
        """Plain dict (the manifest's case entry): sizes in pixels, counts in tokens."""
        m = self.mode
        return {"name": self.name, "mode": m.name, "base_size": m.base_size, "image_size": m.image_size,
                "crop": m.crop, "grid": grid_text(self.grid), "batch": self.batch,
                "image_tokens": self.image_tokens, "bos_tokens": BOS_TOKENS, "text_tokens": self.text_tokens,
                "prefill_tokens": self.prefill_tokens, "decode_tokens": self.decode_tokens}

    @classmethod
    def from_dict(cls, entry: Mapping) -> "Case":
        """The Case of a manifest entry (``to_dict``). Entries written before ``bos_tokens`` was
        recorded counted BOS in ``text_tokens`` and did not record ``crop``: both are read back
        here (a crop mode is recognised by its name, a tile grid or base_size != image_size)."""
        e = dict(entry)
        name, base, image = e.get("mode"), e.get("base_size"), e.get("image_size")
        grid = parse_grid(e.get("grid"))
        if name in MODES and base in (None, MODES[name].base_size) and image in (None, MODES[name].image_size):
            mode = MODES[name]
        else:
            crop = e.get("crop")
            if crop is None:
                crop = grid is not None or (base is not None and base != image)
            mode = get_mode({"name": name or "custom", "base_size": int(base), "image_size": int(image),
                             "crop": bool(crop)})
        text = int(e.get("text_tokens", 12))
        if "bos_tokens" not in e:
            text -= BOS_TOKENS
        return cls(mode, grid, int(e.get("batch", 1)), max(text, 0), int(e.get("decode_tokens", 0)),
                   str(e.get("name") or ""))


def default_grid(mode) -> tuple[int, int] | None:
    """The tile grid of the default synthetic page (A4 portrait, SYNTHETIC_SIZES[0]) in ``mode``."""
    w, h = SYNTHETIC_SIZES[0]
    return tile_grid_for(w, h, mode)


def as_case(spec) -> Case:
    """A Case from a Case, a mode name (``base``; ``gundam`` = the default page's grid; ``gundam:2x3``
    or ``gundam-2x3`` with an explicit grid) or a mapping of Case fields."""
    if isinstance(spec, Case):
        return spec
    if isinstance(spec, str):
        for sep in (":", "-", "@"):
            if sep in spec:
                mode, grid = spec.split(sep, 1)
                return Case(mode, parse_grid(grid) or (1, 1))
        return Case(spec, default_grid(spec))
    if isinstance(spec, Mapping):
        known = {f.name for f in dataclasses.fields(Case)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise HarnessError(f"unknown case key(s) {unknown}", f"use {sorted(known)}")
        return Case(**dict(spec))
    if isinstance(spec, CropMode):
        return Case(spec, default_grid(spec))
    raise HarnessError(f"cannot read a case from {type(spec).__name__}", "give a mode name, a mapping or a Case")


def batch_wording(batch: int, distinct: int) -> str:
    """How a request's pages are named everywhere (manifest case entry, warnings, report):
    ``batch of 32 copies of 1 page`` when its ``batch`` rows hold only ``distinct`` different pages,
    else ``batch of 4 distinct pages`` (``1 page`` at batch 1)."""
    if distinct >= batch:
        return "1 page" if batch == 1 else f"batch of {batch} distinct pages"
    return f"batch of {batch} copies of {distinct} page{'' if distinct == 1 else 's'}"




__all__ = [
    "PATCH_SIZE", "DOWNSAMPLE", "IMAGE_TOKEN_ID", "BOS_ID", "BOS_TOKENS", "EOS_ID", "CropMode", "MODES", "get_mode",
    "queries_per_side", "select_grid", "tile_grid_for", "image_token_count", "SYNTHETIC_SIZES", "parse_grid",
    "grid_text", "check_count", "Case", "default_grid", "as_case", "batch_wording",
]
