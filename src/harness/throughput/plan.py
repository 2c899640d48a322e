"""What a throughput run feeds the model: the settings for this device, the distinct pages, each
page's decode budget and the batches of each configuration. Pure functions of the config and the
pages: no model, no device, so every check here runs before a model is built.

* ``resolve``: ``throughput.*`` with the device defaults filled in (``Settings``).
* ``synthetic_sources`` / ``folder_sources``: the N distinct pages as files (synthetic pages are
  written as PNG files by the worker pool first, so both kinds are read and decoded the same way),
  each with its size, its layout (tile grid in the crop mode) and its decode budget.
* ``page_budgets``: ``workload.decode_tokens`` for every page, or uniform integers in
  [mean - spread, mean + spread] from ``numpy.random.default_rng(seed)``, one per page in page order.
* ``batch_groups`` / ``batch_stream``: pages of one layout only share a batch; a layout with fewer
  distinct pages than the batch is left out (said in the run's warnings), none left is an error;
  the stream cycles through the pages in index order and emits a batch whenever a layout has
  collected ``batch`` pages, so every batch holds distinct pages.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from .. import workload as wl
from ..layout import SYNTHETIC_SIZES, grid_text, tile_grid_for
from ..config import ThroughputConfig, TokensConfig, WorkloadConfig
from ..errors import HarnessError
from ..pdf_pages import is_pdf

#: device defaults of ``throughput.*`` (None in the config): CUDA, then the CPU
DEFAULTS = {True: {"batches": (1, 8, 32, 64), "pages": 256, "window_s": 30.0, "window_pages": 0, "warmup_batches": 2},
            False: {"batches": (1, 2), "pages": 10, "window_s": 0.0, "window_pages": 4, "warmup_batches": 1}}
MAX_DEFAULT_WORKERS = 8


@dataclass(frozen=True)
class Settings:
    """``throughput.*`` as this run uses it. ``window_pages`` [pages] and ``window_s`` [s]: the
    window closes at the first batch end where both are reached."""

    batches: tuple
    workers: int
    pages: int
    window_s: float
    window_pages: int
    warmup_batches: int
    tokens: Optional[TokensConfig]
    best: bool
    prefetch: int
    timeline_batches: int
    overlap_vision: bool = False

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["batches"] = list(self.batches)
        out["tokens"] = tokens_text(self.tokens, None)
        return out


def default_workers(cpus: Optional[int]) -> int:
    """Worker processes when ``throughput.workers`` is unset: the CPU count less two (the main
    process and its launch thread), between 1 and ``MAX_DEFAULT_WORKERS``."""
    return max(1, min(MAX_DEFAULT_WORKERS, (cpus or 1) - 2))


def resolve(t: ThroughputConfig, cuda: bool, cpus: Optional[int] = None) -> Settings:
    """``t`` with the device's defaults (``DEFAULTS``) where it says None."""
    d = DEFAULTS[bool(cuda)]
    pages = t.pages if t.pages is not None else d["pages"]
    return Settings(batches=tuple(t.batches) if t.batches else d["batches"],
                    workers=t.workers if t.workers is not None else default_workers(cpus or os.cpu_count()),
                    pages=pages, window_s=float(t.window_s if t.window_s is not None else d["window_s"]),
                    window_pages=int(t.window_pages if t.window_pages is not None else d["window_pages"]),
                    warmup_batches=t.warmup_batches if t.warmup_batches is not None else d["warmup_batches"],
                    tokens=t.tokens if t.tokens.mean else None,
                    best=bool(cuda) if t.best is None else bool(t.best), prefetch=t.prefetch,
                    timeline_batches=t.timeline_batches, overlap_vision=bool(t.overlap_vision))


def tokens_text(tokens: Optional[TokensConfig], fixed: Optional[int]) -> str:
    """How the decode budget is chosen, in words: ``512 fixed`` or ``uniform 470..770 (seed 0)``."""
    if tokens is None:
        return f"{fixed} fixed" if fixed is not None else "workload.decode_tokens"
    return f"uniform {tokens.mean - tokens.spread}..{tokens.mean + tokens.spread} (seed {tokens.seed})"


def page_budgets(n: int, fixed: int, tokens: Optional[TokensConfig]) -> list:
    """Decode budget [tokens] of each of ``n`` pages, in page order: ``fixed`` for every page, or
    uniform integers in [mean - spread, mean + spread] from ``numpy.random.default_rng(seed)``."""
    if tokens is None:
        return [int(fixed)] * n
    rng = np.random.default_rng(tokens.seed)
    return [int(v) for v in rng.integers(tokens.mean - tokens.spread, tokens.mean + tokens.spread + 1, size=n)]


@dataclass(frozen=True)
class PageSource:
    """One distinct page: its file, size [pixels, after EXIF rotation], layout (tile grid in the
    crop mode; None: no tiles) and decode budget [tokens]."""

    index: int
    name: str
    path: str
    size: tuple
    layout: Optional[tuple]
    budget: int


def synthetic_sources(w: WorkloadConfig, n: int, folder: Path, budgets: list) -> list:
    """N synthetic pages (``workload.synthetic_page(i, seed=workload.seed)``: sizes cycled, or
    ``workload.page_size``) as the PNG files ``folder/synthetic-NNN.png`` the pool writes."""
    out = []
    for i in range(n):
        size = tuple(w.page_size) if w.page_size else SYNTHETIC_SIZES[i % len(SYNTHETIC_SIZES)]
        out.append(PageSource(i, f"synthetic-{i:03d}", str(folder / f"synthetic-{i:03d}.png"), tuple(size),
                              tile_grid_for(*size, w.mode), budgets[i]))
    return out


def folder_sources(w: WorkloadConfig, fixed: int, tokens: Optional[TokensConfig]) -> list:
    """The pages of ``workload.images=DIR`` (or of a PDF file) in name order, each opened and checked
    once here (as the workers will open it: ``workload.load_pages``); at least two pages."""
    root = Path(w.images).expanduser()
    if not (root.is_dir() or is_pdf(root)):
        raise HarnessError(f"workload.images={w.images}: a throughput run needs a folder of pages or a PDF",
                           "point workload.images at a folder or a PDF of at least two pages, or leave it unset "
                           "for synthetic pages")
    pages = wl.load_pages(str(root), seed=w.seed, max_pixels=w.max_pixels, pdf_dpi=w.pdf_dpi)
    if len(pages) < 2:
        raise HarnessError(f"workload.images={w.images} holds {len(pages)} page: a throughput window needs "
                           "distinct pages", "add pages to the folder (at least the largest batch), or leave "
                           "workload.images unset for synthetic pages")
    budgets = page_budgets(len(pages), fixed, tokens)
    return [PageSource(i, p.name if p.pdf else Path(p.source).stem, p.source, p.image.size,
                       tile_grid_for(*p.image.size, w.mode), budgets[i]) for i, p in enumerate(pages)]


def batch_groups(sources: list, batch: int) -> tuple:
    """({layout: [page index]} of the layouts with at least ``batch`` pages, [skipped layouts' notes])."""
    groups: dict = {}
    for s in sources:
        groups.setdefault(s.layout, []).append(s.index)
    kept = {k: v for k, v in groups.items() if len(v) >= batch}
    if not kept:
        largest = max(len(v) for v in groups.values())
        need = -(-batch * len(sources) // largest)
        raise HarnessError(f"throughput batch {batch} needs {batch} distinct pages of one layout; the largest "
                           f"layout group has {largest} of the {len(sources)} pages",
                           f"lower the batch, or give more pages (throughput.pages={need} or a larger folder)")
    skipped = [f"batch {batch}: {len(v)} page(s) of layout {grid_text(k) or 'no tiles'} left out (fewer "
               f"distinct pages than the batch)" for k, v in groups.items() if k not in kept]
    return kept, skipped


def batch_stream(groups: dict, batch: int) -> Iterator[list]:
    """Endless batches of page indices: the pages of ``groups`` in index order, cycled; each page
    joins its layout's queue, and a queue of ``batch`` pages is emitted (and emptied). A group holds
    at least ``batch`` pages, so the ``batch`` consecutive members of its cycle in a batch are distinct."""
    layout_of = {i: k for k, members in groups.items() for i in members}
    queues: dict = {k: [] for k in groups}
    for i in itertools.cycle(sorted(layout_of)):
        q = queues[layout_of[i]]
        q.append(i)
        if len(q) == batch:
            yield list(q)
            q.clear()


__all__ = ["DEFAULTS", "Settings", "resolve", "default_workers", "tokens_text", "page_budgets", "PageSource",
           "synthetic_sources", "folder_sources", "batch_groups", "batch_stream"]
