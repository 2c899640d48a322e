"""Pages -> model requests, with the vendor's preprocessing and image-token layout.

Sizes are pixels, counts are tokens. The rules reproduced here (crop modes, tile-grid choice,
padding, normalisation, placeholder layout) follow DeepSeek-OCR's ``infer()`` so a request built
here has exactly the token count and tensors the vendor path would feed the model.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import random
import warnings
from collections.abc import Mapping
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont, ImageOps

from .errors import HarnessError
from .hub import hub_offline, refuse_hub_code, tokenizer_code

PATCH_SIZE = 16                 # pixels per SAM patch side
DOWNSAMPLE = 4                  # SAM neck + net_2/net_3 shrink the patch grid 4x per side
IMAGE_TOKEN_ID = 128815
BOS_ID = 0
EOS_ID = 1
IMAGE_PLACEHOLDER = "<image>"
PAD_COLOR = (127, 127, 127)     # int(0.5 * 255): the normalisation mean as a pixel value
NORM_MEAN = 0.5
NORM_STD = 0.5
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")
DEFAULT_PROMPT = "<image>\n<|grounding|>Convert the document to markdown. "


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


# --------------------------------------------------------------------------------------------
# preprocessing
# --------------------------------------------------------------------------------------------

@dataclass
class PreparedImage:
    """One page as model inputs: normalised float32 views, tile grid and token count."""

    global_view: torch.Tensor               # [3, S, S]; S = base_size (crop) or image_size
    tiles: torch.Tensor | None              # [cols*rows, 3, T, T], row-major; T = image_size
    grid: tuple[int, int] | None            # (cols, rows)
    image_tokens: int


def to_tensor(img: Image.Image) -> torch.Tensor:
    """RGB image -> [3, H, W] float32, (x / 255 - 0.5) / 0.5 (values in [-1, 1])."""
    if img.mode != "RGB":
        img = img.convert("RGB")
    arr = np.asarray(img, dtype=np.uint8).astype(np.float32) / np.float32(255.0)
    arr = (arr - np.float32(NORM_MEAN)) / np.float32(NORM_STD)
    return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))


def _tiles(image: Image.Image, grid: tuple[int, int], tile: int) -> list[Image.Image]:
    """Resize to (tile*cols, tile*rows) pixels with PIL's default filter, crop row-major."""
    cols, rows = grid
    resized = image.resize((tile * cols, tile * rows))
    out = []
    for index in range(cols * rows):
        x, y = index % cols, index // cols
        out.append(resized.crop((x * tile, y * tile, (x + 1) * tile, (y + 1) * tile)))
    return out


def preprocess(image: Image.Image, mode) -> PreparedImage:
    """Page -> global view (+ tiles in crop mode), as the vendor prepares it.

    Crop mode: global view = page padded (aspect kept, grey fill) to base_size; tiles from the
    page resized to the grid and cut row-major. No crop: image_size <= 640 first resizes the page
    to a square; the view is then padded to image_size (larger sizes keep the aspect ratio).
    """
    mode = get_mode(mode)
    if image.mode != "RGB":
        image = image.convert("RGB")
    width, height = image.size
    if mode.crop:
        grid = tile_grid_for(width, height, mode)
        view = ImageOps.pad(image, (mode.base_size, mode.base_size), color=PAD_COLOR)
        tiles = None
        if grid is not None and (grid[0] > 1 or grid[1] > 1):
            tiles = torch.stack([to_tensor(t) for t in _tiles(image, grid, mode.image_size)])
        else:
            grid = None
    else:
        grid, tiles = None, None
        if mode.image_size <= 640:
            image = image.resize((mode.image_size, mode.image_size))
        view = ImageOps.pad(image, (mode.image_size, mode.image_size), color=PAD_COLOR)
    return PreparedImage(to_tensor(view), tiles, grid, image_token_count(mode, grid))


# --------------------------------------------------------------------------------------------
# pages: synthetic and from disk
# --------------------------------------------------------------------------------------------

@dataclass
class Page:
    """One input page; ``source`` is the file path or ``synthetic:<seed>``; ``note`` says what was
    done to it on loading, when that was more than decoding (a 16-bit page scaled to 8 bits)."""

    name: str
    image: Image.Image
    source: str
    note: str = ""


# (width, height) pixels, cycled by index: A4 portrait @150 dpi, US letter, A4 landscape,
# a till receipt, a small note.
SYNTHETIC_SIZES = ((1240, 1754), (1275, 1650), (1754, 1240), (600, 1600), (600, 400))

_SYLLABLES = ("ka", "lo", "mi", "re", "tan", "vo", "shi", "pe", "dor", "nu", "gal", "te", "rix",
              "ba", "on", "se", "qua", "lim", "zo", "der", "fa", "mor", "ti", "ul")


@functools.lru_cache(maxsize=None)
def _font(px: int):
    try:
        return ImageFont.load_default(size=px)
    except TypeError:  # Pillow < 10.1: fixed-size bitmap font only
        return ImageFont.load_default()


@functools.lru_cache(maxsize=None)
def _glyph(char: str, px: int) -> tuple:
    """(mask, advance px) of one character in the ``px`` font: rendered once, pasted everywhere."""
    font = _font(px)
    right, bottom = font.getbbox(char)[2:]
    mask = Image.new("L", (max(1, int(right) + 1), max(1, int(bottom) + 1)), 0)
    ImageDraw.Draw(mask).text((0, 0), char, fill=255, font=font)
    return mask, font.getlength(char)


def _text_px(text: str, px: int) -> float:
    """Width in pixels of ``text`` as ``_draw_text`` sets it (sum of the characters' advances)."""
    return sum(_glyph(c, px)[1] for c in text)


def _draw_text(page: Image.Image, xy: tuple, text: str, px: int, fill: tuple) -> None:
    """Set ``text`` at ``xy`` (top left) by pasting cached glyphs: a page of about 8,000 characters
    costs a few thousand pastes instead of one font rendering per line (several times faster)."""
    x, y = xy
    for char in text:
        mask, advance = _glyph(char, px)
        if not char.isspace():
            page.paste(fill, (int(round(x)), int(y)), mask)
        x += advance


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))


def synthetic_page(index: int, seed: int = 0, size: tuple[int, int] | None = None) -> Image.Image:
    """A deterministic RGB document page: title, text lines and a ruled table.

    Same (index, seed, size) -> identical pixels; the text is drawn from (seed, index). Size
    (pixels) cycles with ``index`` through ``SYNTHETIC_SIZES`` unless given; index 0 is an A4
    portrait page (1240 x 1754).
    """
    width, height = size if size is not None else SYNTHETIC_SIZES[index % len(SYNTHETIC_SIZES)]
    if width <= 0 or height <= 0:
        raise HarnessError(f"synthetic page size {width}x{height} pixels is empty",
                           "give a positive width and height")
    state = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(index)]).generate_state(2)
    rng = random.Random(int(state[0]) << 32 | int(state[1]))
    page = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(page)
    margin = max(8, width // 16)
    body_px = max(10, width // 70)
    line_h = int(body_px * 1.5)
    right = width - margin

    y = margin
    title = " ".join(_word(rng).capitalize() for _ in range(rng.randint(2, 4)))
    _draw_text(page, (margin, y), title, body_px * 2, (0, 0, 0))
    y += body_px * 3

    # paragraphs of pseudo-random words, filling about half the page
    text_end = margin + int((height - 2 * margin) * 0.5)
    space = _text_px(" ", body_px)
    while y + line_h <= text_end:
        if rng.random() < 0.15:          # paragraph break
            y += line_h // 2
        x = margin + (body_px * 2 if rng.random() < 0.1 else 0)
        words, used = [], 0.0       # a line's width: its words' widths plus one space between each
        while True:
            word = _word(rng)
            add = _text_px(word, body_px) + (space if words else 0.0)
            if x + used + add > right:
                break
            words.append(word)
            used += add
        _draw_text(page, (x, y), " ".join(words), body_px, (20, 20, 20))
        y += line_h

    # ruled table with cell text
    y += line_h
    n_cols = rng.randint(3, 5)
    n_rows = rng.randint(3, 8)
    row_h = line_h + body_px // 2
    n_rows = max(0, min(n_rows, (height - margin - y) // row_h))
    if n_rows >= 2:
        col_w = (right - margin) / n_cols
        for r in range(n_rows + 1):
            draw.line([(margin, y + r * row_h), (right, y + r * row_h)], fill=(0, 0, 0), width=1)
        for c in range(n_cols + 1):
            xc = int(round(margin + c * col_w))
            draw.line([(xc, y), (xc, y + n_rows * row_h)], fill=(0, 0, 0), width=1)
        for r in range(n_rows):
            for c in range(n_cols):
                cell = _word(rng) if r == 0 or not c else f"{rng.randrange(100000) / 100:.2f}"
                while cell and _text_px(cell, body_px) > col_w - 6:
                    cell = cell[:-1]
                _draw_text(page, (int(margin + c * col_w) + 3, y + r * row_h + body_px // 4), cell, body_px,
                           (0, 0, 0))
        y += n_rows * row_h + line_h

    # footer lines where room is left
    while y + line_h <= height - margin:
        _draw_text(page, (margin, y), " ".join(_word(rng) for _ in range(rng.randint(2, 6))), body_px,
                   (60, 60, 60))
        y += line_h
    return page


@contextlib.contextmanager
def _no_pil_bomb_check():
    """Turn PIL's own pixel limit off: ``load_pages`` applies ``max_pixels`` from the header."""
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


#: PIL modes of grayscale pages with more than 8 bits per pixel (16-bit PNG/TIFF, 32-bit int, float)
WIDE_GRAY_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")


def to_8bit(image: Image.Image) -> tuple:
    """(RGB image, note) of a grayscale page with more than 8 bits per pixel (``WIDE_GRAY_MODES``):
    values scaled linearly from their own range [min, max] to [0, 255] (a constant page becomes
    black). PIL's plain conversion clips at 255, which turns a 16-bit page almost all white."""
    arr = np.asarray(image, dtype=np.float64)
    lo, hi = float(arr.min()), float(arr.max())
    scaled = (arr - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(arr)
    out = Image.fromarray(np.clip(np.rint(scaled), 0, 255).astype(np.uint8), "L").convert("RGB")
    return out, f"{image.mode} pixels (values {lo:g}..{hi:g}) scaled linearly to 8 bits"


def _open_page(path: Path, max_pixels: int) -> tuple:
    """Open, check (header size first, then verify and decode) and convert one image to RGB.
    Returns (image, note): the note says how a page wider than 8 bits was converted, and that a
    file of several frames (a multi-page TIFF) is measured by its first frame only."""
    try:
        nbytes = path.stat().st_size
    except OSError as exc:
        raise HarnessError(f"cannot read {path}: {exc.strerror or exc}",
                           "check the path and its permissions") from None
    if nbytes == 0:
        raise HarnessError(f"image file {path} is empty (0 bytes)",
                           "replace it with a valid image or remove it from the directory")
    with _no_pil_bomb_check():
        try:
            with Image.open(path) as probe:
                width, height = probe.size
                if width * height > max_pixels:
                    raise HarnessError(
                        f"image {path} is {width}x{height} = {width * height:,} pixels, over "
                        f"max_pixels={max_pixels:,}",
                        "downscale the image or raise workload.max_pixels")
                probe.verify()
            with Image.open(path) as im:
                im.load()
                frames = getattr(im, "n_frames", 1)
                extra = (f"{path.name}: {frames} frames (pages) in one file, only the first is measured (save one "
                         "page per file to measure every page)") if frames > 1 else ""
                im = ImageOps.exif_transpose(im)
                if im.mode in WIDE_GRAY_MODES:
                    img, note = to_8bit(im)
                    return img, "; ".join(filter(None, [f"{path.name}: {note}", extra]))
                return im.convert("RGB"), extra
        except HarnessError:
            raise
        except Exception as exc:  # PIL raises many types for bad files
            kind = "not an image" if isinstance(exc, Image.UnidentifiedImageError) else \
                "corrupt or truncated"
            raise HarnessError(f"image file {path} is {kind} ({type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''})".rstrip(),
                               "replace it with a valid image or remove it") from None


def load_pages(images: str | os.PathLike | None, pages: int = 1, seed: int = 0,
               max_pixels: int = 60_000_000) -> list[Page]:
    """Pages to run: ``pages`` synthetic pages (images=None), one image file, or a directory.

    A directory gives its image files (jpg/jpeg/png/bmp/tif/tiff/webp) sorted by name; other
    files are ignored. Images over ``max_pixels`` pixels are refused from their header, before
    decoding. Every page is RGB; a grayscale page wider than 8 bits is scaled from its own value
    range (``to_8bit``; said in ``Page.note``).
    """
    if images is None or (isinstance(images, str) and not images.strip()):
        if isinstance(pages, bool) or not isinstance(pages, int) or pages < 1:
            raise HarnessError(f"workload.pages={pages!r} synthetic pages is not a positive count",
                               "set workload.pages to 1 or more")
        return [Page(f"synthetic-{i:03d}", synthetic_page(i, seed), f"synthetic:{seed}")
                for i in range(pages)]
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1:
        raise HarnessError(f"workload.max_pixels={max_pixels!r} is not a positive pixel count",
                           "set workload.max_pixels to e.g. 60000000")
    path = Path(images).expanduser()
    if not path.exists():
        raise HarnessError(f"image path {path} does not exist",
                           "point workload.images at an image file or a directory of images")
    if path.is_dir():
        files = sorted((p for p in path.iterdir()
                        if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES),
                       key=lambda p: p.name)
        if not files:
            raise HarnessError(f"directory {path} has no image files",
                               f"add {'/'.join(s[1:] for s in IMAGE_SUFFIXES)} files or "
                               "point workload.images elsewhere")
    else:
        files = [path]
    pages = []
    for p in files:
        image, note = _open_page(p, max_pixels)
        pages.append(Page(p.name, image, str(p), note))
    return pages


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


def _count(value, key: str, low: int) -> int:
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
        object.__setattr__(self, "batch", _count(self.batch, "batch", 1))
        object.__setattr__(self, "text_tokens", _count(self.text_tokens, "text_tokens", 0))
        object.__setattr__(self, "decode_tokens", _count(self.decode_tokens, "decode_tokens", 0))
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


@dataclass
class Request:
    """One batched model input: its ``case`` (the shape) and its tensors (batch-major)."""

    case: Case
    input_ids: torch.LongTensor             # [B, S]
    images_seq_mask: torch.BoolTensor       # [B, S], True at image-token positions
    global_views: torch.Tensor              # [B, 3, Sg, Sg] float32
    tiles: torch.Tensor | None              # [B*cols*rows, 3, T, T] float32, batch-major
    pages: list[str]
    image_start: int = BOS_TOKENS           # position of the first image placeholder (a contiguous block)
    #: what it was built from, for a model that preprocesses pages itself (the vendor's infer())
    source_pages: list = dataclasses.field(default_factory=list, repr=False)   # [Page]
    prompt: str = ""
    #: MoE routing the request runs (workload.routing): the weights' own, or balanced (seeded, per page)
    routing: str = "weights"
    routing_seed: int = 0

    @property
    def mode(self) -> CropMode:
        return self.case.mode

    @property
    def grid(self) -> tuple[int, int] | None:
        return self.case.grid

    @property
    def image_tokens(self) -> int:
        return self.case.image_tokens

    @property
    def text_tokens(self) -> int:
        """Prompt text tokens, BOS excluded."""
        return self.case.text_tokens

    @property
    def decode_tokens(self) -> int:
        return self.case.decode_tokens

    @property
    def prefill_tokens(self) -> int:
        """Prompt length S in tokens (BOS + text + image)."""
        return int(self.input_ids.shape[1])

    @property
    def batch(self) -> int:
        """Pages decoded together (B)."""
        return int(self.input_ids.shape[0])

    def to(self, device, dtype=None) -> "Request":
        """A copy with tensors on ``device``; pixel tensors cast to ``dtype`` (ids and mask keep theirs)."""
        def px(t):
            return None if t is None else t.to(device=device, dtype=dtype or t.dtype)
        return dataclasses.replace(self, input_ids=self.input_ids.to(device),
                                   images_seq_mask=self.images_seq_mask.to(device),
                                   global_views=px(self.global_views), tiles=px(self.tiles))


def _filler_ids(count: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed & 0xFFFFFFFF)
    return [int(v) for v in rng.integers(1000, 100000, size=count)]


def batch_wording(batch: int, distinct: int) -> str:
    """How a request's pages are named everywhere (manifest case entry, warnings, report):
    ``batch of 32 copies of 1 page`` when its ``batch`` rows hold only ``distinct`` different pages,
    else ``batch of 4 distinct pages`` (``1 page`` at batch 1)."""
    if distinct >= batch:
        return "1 page" if batch == 1 else f"batch of {batch} distinct pages"
    return f"batch of {batch} copies of {distinct} page{'' if distinct == 1 else 's'}"


def names_text(names: list, limit: int = 4) -> str:
    """Page names for one line: all of them up to ``limit``, else the first three, an ellipsis, the
    last one and the count (``a.png, b.png, c.png, ..., z.png (26 pages)``)."""
    names = [str(n) for n in names]
    if len(names) <= limit:
        return ", ".join(names)
    return f"{', '.join(names[:3])}, ..., {names[-1]} ({len(names)} pages)"


def layout_groups(pages: list[Page], mode) -> dict:
    """{tile grid or None: [(1-based position in ``pages``, page)]}: pages grouped by their layout in
    ``mode`` (the tile grid fixes the image-token count, so only one layout fits in a batch)."""
    groups: dict = {}
    for number, page in enumerate(pages, 1):
        groups.setdefault(tile_grid_for(*page.image.size, mode), []).append((number, page))
    return groups


def check_enough_pages(groups: dict, batch: int, repeat: bool, where: str) -> None:
    """Refuse a layout group with fewer than ``batch`` distinct pages unless ``repeat`` (then its
    batches are copies). ``where`` names the page source in the one-line error."""
    short = {g: m for g, m in groups.items() if len(m) < batch}
    if not short or repeat:
        return
    found = "; ".join(f"{'tile grid ' + grid_text(g) if g else 'no tiles'}: {len(m)} page(s), "
                      f"{names_text([p.name for _, p in m])}" for g, m in short.items())
    fewest = min(len(m) for m in groups.values())
    raise HarnessError(f"{where} has fewer than workload.batch={batch} distinct pages of one layout ({found})",
                       "set workload.repeat_pages=true to fill each batch by repeating pages (measured as "
                       f"copies), or use workload.batch={fewest}, or add pages of that layout")


def batch_pages(pages: list[Page], mode, batch: int, repeat: bool = False, where: str = "the folder") -> list:
    """The requests of a folder of pages: [(label, pages)], ``batch`` pages each.

    Rule: the pages, in name order, are grouped by layout in ``mode`` (``layout_groups``). A group of
    n >= ``batch`` pages is cut into ceil(n / batch) requests of ``batch`` consecutive pages; the
    last one continues from the group's start (n = 5, batch 4: p1-p4, then p5 p1 p2 p3), so every
    page is measured and no request holds a page twice. A group of fewer than ``batch`` pages is
    refused (``check_enough_pages``) unless ``repeat``: its one request then cycles through its
    pages (a batch of copies). Requests are ordered by their first page. ``label`` names the
    request's distinct pages by their 1-based position in name order: ``p003``, ``p003+p004``.
    """
    mode = get_mode(mode)
    batch = _count(batch, "workload.batch", 1)
    width = max(3, len(str(len(pages))))
    groups = layout_groups(pages, mode)
    check_enough_pages(groups, batch, repeat, where)
    requests = []
    for members in groups.values():
        for start in range(0, len(members), batch):
            chunk = [members[(start + j) % len(members)] for j in range(batch)]
            distinct = list({number: (number, page) for number, page in chunk}.values())
            label = "+".join(f"p{number:0{width}d}" for number, _ in distinct)
            requests.append((chunk[0][0], label, [page for _, page in chunk]))
    return [(label, group) for _, label, group in sorted(requests, key=lambda r: r[0])]


def build_request(pages: list[Page], mode, decode_tokens: int = 128,
                  prompt: str = DEFAULT_PROMPT, tokenizer=None, text_tokens: int = 12,
                  seed: int = 0, name: str = "", routing: str = "weights", routing_seed: int = 0) -> Request:
    """Batch pages (same tile grid) into one request with the vendor's token layout.

    Layout: [BOS] + text before <image> + image tokens + text after. The prompt is stripped as
    the vendor's plain template does. With a tokenizer the text is encoded without special
    tokens; without one, ``text_tokens`` fixed filler ids (seeded) stand in after the image.
    ``name`` names the request's Case (default: mode[-grid][-bB]). ``routing`` / ``routing_seed``:
    the MoE routing it runs (``workload.routing``; ``harness.models.routing``).
    """
    mode = get_mode(mode)
    if not pages:
        raise HarnessError("no pages to build a request from",
                           "give workload.images or workload.pages >= 1")
    if isinstance(decode_tokens, bool) or not isinstance(decode_tokens, int) or decode_tokens < 0:
        raise HarnessError(f"decode_tokens={decode_tokens!r} is not a token count >= 0",
                           "set workload.decode_tokens to e.g. 128")
    if prompt.count(IMAGE_PLACEHOLDER) != 1:
        raise HarnessError(f"prompt must contain exactly one {IMAGE_PLACEHOLDER} "
                           f"(found {prompt.count(IMAGE_PLACEHOLDER)})",
                           f"write the prompt like {DEFAULT_PROMPT!r}")
    pages = [p if isinstance(p, Page) else Page(f"page-{i:03d}", p, "memory")
             for i, p in enumerate(pages)]

    prepared = [preprocess(p.image, mode) for p in pages]
    layouts = {(pi.grid, pi.image_tokens) for pi in prepared}
    if len(layouts) > 1:
        found = ", ".join(f"{p.name}: {'x'.join(map(str, pi.grid)) if pi.grid else 'no tiles'}"
                          for p, pi in zip(pages, prepared))
        raise HarnessError(f"pages in one batch have different tile grids ({found})",
                           "batch pages with the same tile grid (same size/aspect) or use batch=1")
    first = prepared[0]

    before_text, after_text = prompt.strip().split(IMAGE_PLACEHOLDER)
    if tokenizer is not None:
        before = [int(t) for t in tokenizer.encode(before_text, add_special_tokens=False)]
        after = [int(t) for t in tokenizer.encode(after_text, add_special_tokens=False)]
    else:
        if isinstance(text_tokens, bool) or not isinstance(text_tokens, int) or text_tokens < 0:
            raise HarnessError(f"text_tokens={text_tokens!r} is not a token count >= 0",
                               "set workload.text_tokens to e.g. 12")
        before, after = [], _filler_ids(text_tokens, seed)

    ids = [BOS_ID] * BOS_TOKENS + before + [IMAGE_TOKEN_ID] * first.image_tokens + after
    mask = [False] * (BOS_TOKENS + len(before)) + [True] * first.image_tokens + [False] * len(after)
    batch = len(pages)
    input_ids = torch.tensor([ids] * batch, dtype=torch.long)
    seq_mask = torch.tensor([mask] * batch, dtype=torch.bool)
    views = torch.stack([pi.global_view for pi in prepared])
    tiles = torch.cat([pi.tiles for pi in prepared]) if first.tiles is not None else None
    case = Case(mode, first.grid, batch, len(before) + len(after), decode_tokens, name)
    assert case.image_tokens == first.image_tokens and case.prefill_tokens == len(ids)
    return Request(case=case, input_ids=input_ids, images_seq_mask=seq_mask, global_views=views, tiles=tiles,
                   pages=[p.name for p in pages], image_start=BOS_TOKENS + len(before), source_pages=list(pages),
                   prompt=prompt, routing=routing, routing_seed=routing_seed)


def load_tokenizer(path: str | os.PathLike | None, text_tokens: int = 12):
    """(tokenizer or None, reason). Loads only local files and runs no code from them
    (``tokenizer_or_reason``); never raises for a missing one."""
    tok, reason = tokenizer_or_reason(path)
    if tok is None:
        return None, f"{reason}: prompt uses {text_tokens} fixed text tokens"
    return tok, reason


def tokenizer_or_reason(path: str | os.PathLike | None):
    """(tokenizer, "tokenizer from DIR") or (None, why there is none), from local files only
    (``harness.hub``: offline, and a tokenizer or config whose ``auto_map`` names hub code is a
    HarnessError). ``trust_remote_code=False`` always: a tokenizer whose ``auto_map`` names a
    ``tokenization_*.py`` of the directory loads its built-in ``tokenizer_class`` if it has one, or
    fails, and the reason names that code (``harness.hub.tokenizer_code``); transformers imports none
    of the directory's Python files."""
    if path is None:
        return None, "no tokenizer path given"
    root = Path(path).expanduser()
    if not any((root / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        return None, f"no tokenizer files in {root}"
    refuse_hub_code(root)
    with hub_offline():
        try:
            from transformers import AutoTokenizer
        except Exception as exc:  # not installed, or a broken install
            return None, f"transformers unavailable ({type(exc).__name__})"
        try:
            tok = AutoTokenizer.from_pretrained(str(root), trust_remote_code=False,
                                                local_files_only=True)
        except Exception as exc:
            own = tokenizer_code(root)
            if own:
                return None, (f"tokenizer in {root} needs code of its own ({', '.join(own)}), which the harness "
                              "never runs")
            msg = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
            return None, f"tokenizer in {root} failed to load ({type(exc).__name__}: {msg})"
    return tok, f"tokenizer from {root}"


def describe(request: Request) -> dict:
    """Plain dict of a request: its Case (``Case.to_dict``) and its pages."""
    return {**request.case.to_dict(), "pages": list(request.pages)}


__all__ = [
    "PATCH_SIZE", "DOWNSAMPLE", "IMAGE_TOKEN_ID", "BOS_ID", "BOS_TOKENS", "EOS_ID", "PAD_COLOR", "MODES",
    "Case", "as_case", "parse_grid", "grid_text", "default_grid",
    "CropMode", "get_mode", "queries_per_side", "select_grid", "tile_grid_for",
    "image_token_count", "PreparedImage", "to_tensor", "preprocess", "Page", "SYNTHETIC_SIZES",
    "synthetic_page", "load_pages", "to_8bit", "batch_pages", "batch_wording", "names_text", "layout_groups",
    "check_enough_pages", "Request", "build_request", "load_tokenizer",
    "tokenizer_or_reason", "describe",
]
