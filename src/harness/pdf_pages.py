"""PDF files as pages: every page rasterised with PDFium (the ``pypdfium2`` package) at a DPI.

Size rule: a page of w x h points (1/72 inch: PDFium's page size, the page's /Rotate applied) at d
dots per inch becomes ceil(w x d / 72) x ceil(h x d / 72) RGB pixels (``pixel_size``; what
``PdfPage.render(scale=d / 72)`` allocates), drawn on white with no alpha channel, as the vendor's
own PDF script draws them (DeepSeek-OCR's ``run_dpsk_ocr_pdf.py``: PyMuPDF's
``get_pixmap(matrix=zoom d / 72, alpha=False)`` at d = 144; ``workload.pdf_dpi``).

A page is named ``FILE.pdf#page=N`` (N counts from 1: the PDF fragment of RFC 8118), its
``PdfPageRef.source``; ``split_ref`` reads such a name back, so ``workload.images=doc.pdf#page=3``
loads that one page and the throughput experiment's workers open a page by its name.

A file PDFium cannot read (truncated, not a PDF), one that needs a password, one encrypted with a
scheme PDFium lacks and one without pages are one-line ``HarnessError``s naming the file and the
fix (``opened``), raised where pages are loaded: before any model is built. So is a page whose
pixel size at the DPI exceeds ``max_pixels``, from its size in points, before it is drawn.
Rasterisation is timed on the host clock (``render``: ms, the files' opening included).
"""
from __future__ import annotations

import contextlib
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from .errors import HarnessError

PDF_SUFFIX = ".pdf"
#: the vendor's own PDF script rasterises at this DPI (module docstring); ``workload.pdf_dpi``'s default
VENDOR_PDF_DPI = 144
#: the pinned pypdfium2 release (pyproject.toml, scripts/device_wheels.sh), for the install fix
PYPDFIUM2 = "pypdfium2==5.15.2"
_REF = re.compile(r"^(?P<path>.+\.pdf)#page=(?P<number>[0-9]+)$", re.IGNORECASE)


@dataclass(frozen=True)
class PdfPageRef:
    """One page of a PDF file: ``path`` (the file), ``index`` (0-based) and ``dpi`` (dots per inch)."""

    path: str
    index: int
    dpi: float

    @property
    def source(self) -> str:
        """``FILE.pdf#page=N``, N = index + 1."""
        return f"{self.path}#page={self.index + 1}"

    @property
    def name(self) -> str:
        """The source with the file's name alone: ``doc.pdf#page=3``."""
        return f"{Path(self.path).name}#page={self.index + 1}"


def is_pdf(path) -> bool:
    """Whether ``path`` names a PDF file by its suffix (any case)."""
    return Path(str(path)).suffix.lower() == PDF_SUFFIX


def split_ref(text: str) -> tuple:
    """(path, 0-based page index or None): ``doc.pdf#page=3`` -> (Path("doc.pdf"), 2); anything else
    -> (Path(text), None). A file whose own name ends in ``#page=N`` is read as that file."""
    m = _REF.match(text)
    if m is None or Path(text).expanduser().exists():
        return Path(text), None
    return Path(m.group("path")), int(m.group("number")) - 1


def pixel_size(width_pt: float, height_pt: float, dpi: float) -> tuple:
    """(width, height) pixels of a page of ``width_pt`` x ``height_pt`` points at ``dpi`` (module docstring)."""
    scale = dpi / 72.0
    return math.ceil(width_pt * scale), math.ceil(height_pt * scale)


def _pdfium():
    try:
        import pypdfium2
    except ImportError:
        raise HarnessError("PDF pages need the pypdfium2 package, which is not installed",
                           f"pip install {PYPDFIUM2} (bash scripts/bootstrap.sh installs it), or give image "
                           "files") from None
    return pypdfium2


@contextlib.contextmanager
def opened(path: Path) -> Iterator:
    """The ``pypdfium2.PdfDocument`` of ``path``, closed on leaving; a file PDFium cannot open is one
    ``HarnessError`` that names it and the fix (module docstring)."""
    pdfium = _pdfium()
    from pypdfium2 import raw

    try:
        doc = pdfium.PdfDocument(str(path))
    except pdfium.PdfiumError as exc:
        code = getattr(exc, "err_code", None)
        if code == raw.FPDF_ERR_PASSWORD:
            raise HarnessError(f"PDF file {path} is encrypted: it needs a password to open",
                               "decrypt it (e.g. qpdf --decrypt --password=PASSWORD in.pdf out.pdf) and point "
                               "workload.images at the copy, or remove it") from None
        if code == raw.FPDF_ERR_SECURITY:
            raise HarnessError(f"PDF file {path} is encrypted with a security handler PDFium does not support",
                               "decrypt it (e.g. qpdf --decrypt in.pdf out.pdf) and point workload.images at the "
                               "copy, or remove it") from None
        said = re.search(r"\((PDFium: [^)]*)\)", str(exc))
        raise HarnessError(f"PDF file {path} is corrupt or truncated ({said.group(1) if said else exc})",
                           "replace it with a valid PDF or remove it") from None
    except OSError as exc:
        raise HarnessError(f"cannot read {path}: {exc.strerror or exc}", "check the path and its permissions") from None
    try:
        yield doc
    finally:
        doc.close()


def page_refs(path: Path, dpi: float, max_pixels: int, index: Optional[int] = None) -> list:
    """[PdfPageRef] of every page of the PDF ``path`` (or of page ``index`` alone), in order, each
    checked: the file opens, has pages (that page), and each page's ``pixel_size`` at ``dpi`` is at
    most ``max_pixels`` (from its size in points, nothing drawn)."""
    with opened(path) as doc:
        count = len(doc)
        if count == 0:
            raise HarnessError(f"PDF file {path} has no pages", "replace it with a PDF of at least one page or "
                               "remove it")
        if index is not None and not 0 <= index < count:
            raise HarnessError(f"PDF file {path} has {count} page(s): page={index + 1} is not one of them",
                               f"name a page from 1 to {count}, or the whole file")
        refs = []
        for i in ([index] if index is not None else range(count)):
            width, height = pixel_size(*doc[i].get_size(), dpi)
            if width * height > max_pixels:
                raise HarnessError(
                    f"page {i + 1} of {path} is {width}x{height} = {width * height:,} pixels at workload.pdf_dpi="
                    f"{dpi:g}, over max_pixels={max_pixels:,}", "lower workload.pdf_dpi or raise workload.max_pixels")
            refs.append(PdfPageRef(str(path), i, dpi))
    return refs


def render(refs: list) -> tuple:
    """([RGB PIL image per ref], ms): each page of ``refs`` rasterised at its DPI (module docstring),
    each file opened once; ms = host wall clock of the whole (opening and closing the files included)."""
    t0 = time.perf_counter()
    images: list = [None] * len(refs)
    by_file: dict = {}
    for k, ref in enumerate(refs):
        by_file.setdefault(ref.path, []).append(k)
    for path, ks in by_file.items():
        with opened(Path(path)) as doc:
            for k in ks:
                page = doc[refs[k].index]
                try:
                    bitmap = page.render(scale=refs[k].dpi / 72.0, rev_byteorder=True)
                    images[k] = bitmap.to_pil().convert("RGB")
                finally:
                    page.close()
    return images, (time.perf_counter() - t0) * 1e3


__all__ = ["PDF_SUFFIX", "VENDOR_PDF_DPI", "PYPDFIUM2", "PdfPageRef", "is_pdf", "split_ref", "pixel_size", "opened",
           "page_refs", "render"]
