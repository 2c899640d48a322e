"""Pages -> model requests, with the vendor's preprocessing and image-token layout.

Sizes are pixels, counts are tokens. The rules reproduced here (padding, normalisation, placeholder
layout) follow DeepSeek-OCR's ``infer()`` so a request built here has exactly the token count and
tensors the vendor path would feed the model. The shape arithmetic without pixels (crop modes,
tile-grid choice, image-token counts, ``Case``) is ``harness.layout``, torch-free, read by the data
side too; this module adds the pages, their tensors and the tokenizer.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont, ImageOps

from . import pdf_pages
from .errors import HarnessError
from .hub import hub_offline, refuse_hub_code, tokenizer_code
from .layout import (BOS_ID, BOS_TOKENS, IMAGE_TOKEN_ID, SYNTHETIC_SIZES, Case, CropMode, check_count, get_mode,
                     grid_text, image_token_count, tile_grid_for)

IMAGE_PLACEHOLDER = "<image>"
PAD_COLOR = (127, 127, 127)     # int(0.5 * 255): the normalisation mean as a pixel value
NORM_MEAN = 0.5
NORM_STD = 0.5
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")
#: what a folder's pages are read from: image files and PDF files (each PDF page a page)
PAGE_SUFFIXES = IMAGE_SUFFIXES + (pdf_pages.PDF_SUFFIX,)
DEFAULT_PROMPT = "<image>\n<|grounding|>Convert the document to markdown. "


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


def normalised(arr: np.ndarray) -> np.ndarray:
    """8-bit values (a uint8 array) -> float32 (x / 255 - 0.5) / 0.5, numpy's float32 arithmetic."""
    return (arr.astype(np.float32) / np.float32(255.0) - np.float32(NORM_MEAN)) / np.float32(NORM_STD)


def to_tensor(img: Image.Image) -> torch.Tensor:
    """RGB image -> [3, H, W] float32, (x / 255 - 0.5) / 0.5 (values in [-1, 1])."""
    if img.mode != "RGB":
        img = img.convert("RGB")
    arr = normalised(np.asarray(img, dtype=np.uint8))
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
    page resized to the grid and cut row-major. No crop: the page is resized to a square first where
    ``mode.squares_first`` (image_size <= 640); the view is then padded to image_size.
    """
    mode = get_mode(mode)
    if image.mode != "RGB":
        image = image.convert("RGB")
    grid = tile_grid_for(*image.size, mode)
    if mode.crop:
        tiles = None if grid is None else torch.stack([to_tensor(t) for t in _tiles(image, grid, mode.image_size)])
    else:
        grid, tiles = None, None
        if mode.squares_first:
            image = image.resize((mode.image_size, mode.image_size))
    view = ImageOps.pad(image, (mode.view_size, mode.view_size), color=PAD_COLOR)
    return PreparedImage(to_tensor(view), tiles, grid, image_token_count(mode, grid))


# --------------------------------------------------------------------------------------------
# pages: synthetic and from disk
# --------------------------------------------------------------------------------------------

@dataclass
class Page:
    """One input page; ``source`` is the file path, ``FILE.pdf#page=N`` or ``synthetic:<seed>``;
    ``note`` says what was done to it on loading, when that was more than decoding (a 16-bit page
    scaled to 8 bits); ``pdf``: the PDF page it was rasterised from (``rasterise`` draws it anew)."""

    name: str
    image: Image.Image
    source: str
    note: str = ""
    pdf: Optional[pdf_pages.PdfPageRef] = None

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


def _check_not_empty(path: Path, kind: str) -> None:
    """Refuse a page file that cannot be read or has 0 bytes (``kind``: 'image' or 'PDF')."""
    try:
        nbytes = path.stat().st_size
    except OSError as exc:
        raise HarnessError(f"cannot read {path}: {exc.strerror or exc}",
                           "check the path and its permissions") from None
    if nbytes == 0:
        raise HarnessError(f"{kind} file {path} is empty (0 bytes)",
                           f"replace it with a valid {kind} or remove it from the directory")


def _open_page(path: Path, max_pixels: int) -> tuple:
    """Open, check (header size first, then verify and decode) and convert one image to RGB.
    Returns (image, note): the note says how a page wider than 8 bits was converted, and that a
    file of several frames (a multi-page TIFF) is measured by its first frame only."""
    _check_not_empty(path, "image")
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


def _pdf_file_pages(path: Path, dpi: float, max_pixels: int, index: Optional[int] = None) -> list:
    """The pages of the PDF ``path`` (page ``index`` alone when given), in order, rasterised at
    ``dpi`` (``pdf_pages``: checked first, one-line errors)."""
    _check_not_empty(path, "PDF")
    refs = pdf_pages.page_refs(path, dpi, max_pixels, index)
    images, _ = pdf_pages.render(refs)
    return [Page(ref.name, image, ref.source, pdf=ref) for ref, image in zip(refs, images)]


def load_pages(images: str | os.PathLike | None, pages: int = 1, seed: int = 0,
               max_pixels: int = 60_000_000, pdf_dpi: float = pdf_pages.VENDOR_PDF_DPI) -> list[Page]:
    """Pages to run: ``pages`` synthetic pages (images=None), one image file, one PDF file (each
    of its pages), one page of a PDF (``FILE.pdf#page=N``), or a directory.

    A directory gives its image files (jpg/jpeg/png/bmp/tif/tiff/webp) and PDF files sorted by
    name, a PDF's pages in their order in its place; other files are ignored. A PDF page is
    rasterised at ``pdf_dpi`` (``harness.pdf_pages``: ceil(points x dpi / 72) pixels a side).
    Pages over ``max_pixels`` pixels are refused before decoding (an image from its header, a PDF
    page from its size in points). Every page is RGB; a grayscale page wider than 8 bits is scaled
    from its own value range (``to_8bit``; said in ``Page.note``).
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
    if isinstance(pdf_dpi, bool) or not isinstance(pdf_dpi, (int, float)) or not pdf_dpi > 0:
        raise HarnessError(f"workload.pdf_dpi={pdf_dpi!r} is not a positive resolution in dots per inch",
                           f"set workload.pdf_dpi to e.g. {pdf_pages.VENDOR_PDF_DPI}")
    path, index = pdf_pages.split_ref(str(images))
    path = path.expanduser()
    if not path.exists():
        raise HarnessError(f"image path {path} does not exist",
                           "point workload.images at an image file, a PDF file or a directory of them")
    if path.is_dir():
        files = sorted((p for p in path.iterdir()
                        if p.is_file() and p.suffix.lower() in PAGE_SUFFIXES),
                       key=lambda p: p.name)
        if not files:
            raise HarnessError(f"directory {path} has no image files or PDF files",
                               f"add {'/'.join(s[1:] for s in PAGE_SUFFIXES)} files or "
                               "point workload.images elsewhere")
    else:
        files = [path]
    out = []
    for p in files:
        if pdf_pages.is_pdf(p):
            out += _pdf_file_pages(p, pdf_dpi, max_pixels, index)
        else:
            image, note = _open_page(p, max_pixels)
            out.append(Page(p.name, image, str(p), note))
    return out


def rasterise(pages: list) -> tuple:
    """(``pages`` with every PDF page drawn anew from its file, ms it took or None without PDF pages):
    what a request from PDF pages does before preprocessing (``pdf_pages.render``: each row rasterised,
    copies too, each file opened once; host wall clock). Other pages are passed through as they are."""
    rows = [k for k, p in enumerate(pages) if p.pdf is not None]
    if not rows:
        return list(pages), None
    images, ms = pdf_pages.render([pages[k].pdf for k in rows])
    out = list(pages)
    for k, image in zip(rows, images):
        out[k] = dataclasses.replace(pages[k], image=image)
    return out, ms


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
    #: the request's image embeddings [B, image_tokens, D] when computed ahead of it (the throughput
    #: experiment's ``overlap_vision``): the model's first token then runs no vision stage
    image_embeds: torch.Tensor | None = dataclasses.field(default=None, repr=False)

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
    batch = check_count(batch, "workload.batch", 1)
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
    check_one_grid(pages, [pi.grid for pi in prepared])
    first = prepared[0]
    ids, mask, before, after = token_layout(first.image_tokens, prompt, tokenizer, text_tokens, seed)
    batch = len(pages)
    input_ids = torch.tensor([ids] * batch, dtype=torch.long)
    seq_mask = torch.tensor([mask] * batch, dtype=torch.bool)
    views = torch.stack([pi.global_view for pi in prepared])
    tiles = torch.cat([pi.tiles for pi in prepared]) if first.tiles is not None else None
    case = Case(mode, first.grid, batch, before + after, decode_tokens, name)
    assert case.image_tokens == first.image_tokens and case.prefill_tokens == len(ids)
    return Request(case=case, input_ids=input_ids, images_seq_mask=seq_mask, global_views=views, tiles=tiles,
                   pages=[p.name for p in pages], image_start=BOS_TOKENS + before, source_pages=list(pages),
                   prompt=prompt, routing=routing, routing_seed=routing_seed)


def check_one_grid(pages: list, grids: list) -> None:
    """Refuse, naming each page's grid, pages of one batch (``Page``, with ``grids[k]`` the tile grid of
    ``pages[k]``) whose tile grids differ."""
    if len(set(grids)) > 1:
        found = ", ".join(f"{p.name}: {'x'.join(map(str, g)) if g else 'no tiles'}" for p, g in zip(pages, grids))
        raise HarnessError(f"pages in one batch have different tile grids ({found})",
                           "batch pages with the same tile grid (same size/aspect) or use batch=1")


def token_layout(image_tokens: int, prompt: str, tokenizer=None, text_tokens: int = 12, seed: int = 0) -> tuple:
    """(ids, image mask, text tokens before the image, text tokens after it) of one prompt row:
    [BOS] + text before <image> + ``image_tokens`` placeholders + text after (see ``build_request``)."""
    before_text, after_text = prompt.strip().split(IMAGE_PLACEHOLDER)
    if tokenizer is not None:
        before = [int(t) for t in tokenizer.encode(before_text, add_special_tokens=False)]
        after = [int(t) for t in tokenizer.encode(after_text, add_special_tokens=False)]
    else:
        if isinstance(text_tokens, bool) or not isinstance(text_tokens, int) or text_tokens < 0:
            raise HarnessError(f"text_tokens={text_tokens!r} is not a token count >= 0",
                               "set workload.text_tokens to e.g. 12")
        before, after = [], _filler_ids(text_tokens, seed)
    ids = [BOS_ID] * BOS_TOKENS + before + [IMAGE_TOKEN_ID] * image_tokens + after
    mask = [False] * (BOS_TOKENS + len(before)) + [True] * image_tokens + [False] * len(after)
    return ids, mask, len(before), len(after)


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
    "IMAGE_PLACEHOLDER", "PAD_COLOR", "NORM_MEAN", "NORM_STD", "IMAGE_SUFFIXES", "PAGE_SUFFIXES", "DEFAULT_PROMPT",
    "PreparedImage", "normalised", "to_tensor", "preprocess", "Page", "synthetic_page", "load_pages", "rasterise", "to_8bit",
    "batch_pages",
    "names_text", "layout_groups", "check_enough_pages", "Request", "build_request", "check_one_grid", "token_layout", "load_tokenizer",
    "tokenizer_or_reason", "describe",
]
