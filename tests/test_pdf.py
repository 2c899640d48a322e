"""PDF input (issue 39 item 3): ``workload.images=FILE.pdf`` (or a folder holding PDFs) rasterised at
``workload.pdf_dpi``, each PDF page one page of the workload in order, rasterisation timed per request
(``raster_ms``) and shown per page in the report; a broken or encrypted PDF is one ``error:`` line, exit
2, before any model is built; the memory check counts PDF pages at the size their DPI gives.

The PDFs are written here with PIL's PDF writer: an image of w x h pixels saved at ``resolution`` 72 is
a page of w x h points (its /MediaBox, checked in the bytes). Expected pixel sizes are derived below
from points x dpi / 72, rounded up (a partly covered pixel is a pixel). The encrypted file is a
generated PDF whose trailer names the standard security handler (RC4, revision 2) with an /U entry that
matches no password (PDFium then asks for the user password), as a file encrypted with a password we do
not know presents itself.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from PIL import Image

from harness import memory_check, pdf_pages, setup
from harness import workload as wl
from harness.config import HarnessConfig, WorkloadConfig
from harness.errors import HarnessError
from harness.measure.runner import prep_columns
from harness.report.columns import COLUMNS
from conftest import main_lines
from test_pages import ENV, ROOT, TINY_MODE

TINY = {"name": "t", "base_size": 128, "image_size": 64, "crop": True}
#: the pages of the small PDF (width, height in points) and their grey levels, in page order
SIZES = [(200, 300), (300, 200), (150, 150), (200, 300), (123, 77)]
GREYS = [0, 60, 120, 180, 240]


def write_pdf(path: Path, sizes: list, greys: list) -> Path:
    """A PDF of one page per (width, height) point size, page k filled with grey ``greys[k]``."""
    pages = [Image.new("L", size, grey) for size, grey in zip(sizes, greys)]
    pages[0].save(path, "PDF", save_all=True, append_images=pages[1:], resolution=72.0)
    boxes = re.findall(rb"/MediaBox \[ 0 0 ([0-9.]+) ([0-9.]+) \]", path.read_bytes())
    assert [(float(w), float(h)) for w, h in boxes] == [tuple(map(float, s)) for s in sizes]   # points, as meant
    return path


def truncated(src: Path, dst: Path) -> Path:
    """The first half of ``src``'s bytes (its cross-reference table and trailer lost)."""
    data = src.read_bytes()
    dst.write_bytes(data[: len(data) // 2])
    return dst


def encrypted(src: Path, dst: Path) -> Path:
    """``src`` with an /Encrypt entry in its trailer whose user password is unknown (module docstring)."""
    data = src.read_bytes()
    entry = (b"/Encrypt << /Filter /Standard /V 1 /R 2 /Length 40 /P -4 /O <" + b"11" * 32 + b"> /U <" + b"22" * 32
             + b"> >>\n/ID [<" + b"33" * 16 + b"> <" + b"33" * 16 + b">]\n")
    assert data.count(b"trailer\n<<\n") == 1
    dst.write_bytes(data.replace(b"trailer\n<<\n", b"trailer\n<<\n" + entry))
    return dst


def expected_px(points: tuple, dpi: float) -> tuple:
    return tuple(math.ceil(p * dpi / 72) for p in points)


def _error(call) -> str:
    with pytest.raises(HarnessError) as err:
        call()
    return str(err.value)


@pytest.fixture(scope="module")
def pdf(tmp_path_factory) -> Path:
    return write_pdf(tmp_path_factory.mktemp("pdf") / "doc.pdf", SIZES, GREYS)


# ------------------------------------------------------------------ pages, in order, at the DPI's size

def test_pages_come_in_order_at_the_size_the_dpi_gives(pdf):
    pages = wl.load_pages(str(pdf), pdf_dpi=100)
    assert [p.name for p in pages] == [f"doc.pdf#page={n}" for n in range(1, 6)]
    assert [p.source for p in pages] == [f"{pdf}#page={n}" for n in range(1, 6)]
    # 200 x 300 points at 100 dpi: 277.8 x 416.7 -> 278 x 417 pixels; 123 x 77 -> 170.8 x 106.9 -> 171 x 107
    assert [p.image.size for p in pages] == [(278, 417), (417, 278), (209, 209), (278, 417), (171, 107)]
    assert [p.image.size for p in pages] == [expected_px(s, 100) for s in SIZES]
    assert {p.image.mode for p in pages} == {"RGB"}
    for page, grey in zip(pages, GREYS):           # page k is page k: its fill (JPEG in the PDF: within 3 levels)
        w, h = page.image.size
        assert all(abs(c - grey) <= 3 for c in page.image.getpixel((w // 2, h // 2))), (page.name, grey)
    # the default DPI is the vendor's PDF script's, 144: 2 pixels per point
    assert WorkloadConfig().pdf_dpi == 144.0 == pdf_pages.VENDOR_PDF_DPI
    assert [p.image.size for p in wl.load_pages(str(pdf))] == [(2 * w, 2 * h) for w, h in SIZES]
    # an A4 page (595.276 x 841.89 points) at 144 dpi: 1190.55 x 1683.78 -> 1191 x 1684
    assert pdf_pages.pixel_size(595.276, 841.89, 144) == (1191, 1684)


def test_one_page_by_name_and_a_folder_of_images_and_pdfs(pdf, tmp_path):
    one = wl.load_pages(f"{pdf}#page=3", pdf_dpi=72)
    assert [(p.name, p.image.size) for p in one] == [("doc.pdf#page=3", (150, 150))]
    assert _error(lambda: wl.load_pages(f"{pdf}#page=6")) == (
        f"PDF file {pdf} has 5 page(s): page=6 is not one of them; fix: name a page from 1 to 5, or the whole file")
    folder = tmp_path / "mixed"
    folder.mkdir()
    Image.new("RGB", (40, 30)).save(folder / "a.png")
    write_pdf(folder / "b.pdf", SIZES[:2], GREYS[:2])
    Image.new("RGB", (40, 30)).save(folder / "c.png")
    (folder / "notes.txt").write_text("not a page")
    assert [p.name for p in wl.load_pages(str(folder))] == ["a.png", "b.pdf#page=1", "b.pdf#page=2", "c.png"]


def test_rasterise_draws_pdf_pages_anew_and_times_it(pdf):
    pages = wl.load_pages(str(pdf), pdf_dpi=72)
    image = wl.Page("img", Image.new("RGB", (8, 8)), "memory")
    again, ms = wl.rasterise([pages[1], image, pages[1]])
    assert ms > 0 and again[1] is image
    assert [p.name for p in again] == ["doc.pdf#page=2", "img", "doc.pdf#page=2"]
    assert again[0].image is not pages[1].image and again[0].image.tobytes() == pages[1].image.tobytes()
    assert wl.rasterise([image]) == ([image], None)
    # the request row: raster + prep + copy + TTFT
    assert prep_columns({"raster_ms": 2.0, "prep_ms": 3.0, "h2d_ms": 0.5}, 40.0) == {
        "raster_ms": 2.0, "prep_ms": 3.0, "h2d_ms": 0.5, "ttft_e2e_ms": 45.5}


def test_cases_memory_check_and_timed_request_of_a_pdf(tmp_path):
    """A PDF of several pages is a set of requests (as a folder); the memory check counts each row's PDF
    page at the DPI's size (it is drawn anew for every request); the timed request carries raster_ms."""
    four = write_pdf(tmp_path / "four.pdf", [(200, 300), (300, 200)] * 2, [0, 80, 160, 240])
    w = WorkloadConfig(mode=TINY, images=str(four), batch=2, decode_tokens=1, pdf_dpi=96)
    cases, _ = setup.prepare_cases(HarnessConfig(workload=w))
    # by layout in the tiny mode: 200x300 points (pages 1, 3: tile grid 2x3) and 300x200 (2, 4: 3x2)
    assert [[p.name for p in c.pages] for c in cases] == [["four.pdf#page=1", "four.pdf#page=3"],
                                                          ["four.pdf#page=2", "four.pdf#page=4"]]
    first = cases[0]
    w_px, h_px = expected_px((200, 300), 96)                     # 266.7 x 400 -> 267 x 400
    assert memory_check.page_bytes(first, 1) == 2 * w_px * h_px * 3 == 2 * 267 * 400 * 3
    assert "rasterised at workload.pdf_dpi=96" in first.pages_entry()["page_source"]
    req, times = first.timed_request(0, torch.device("cpu"), torch.float32)
    assert set(times) == {"raster_ms", "prep_ms", "h2d_ms"} and times["raster_ms"] > 0 and req.batch == 2
    # image files are loaded before the check: nothing on top
    Image.new("RGB", (200, 300)).save(tmp_path / "a.png")
    one_image = WorkloadConfig(mode=TINY, images=str(tmp_path / "a.png"))
    image_case, _ = setup.prepare_cases(HarnessConfig(workload=one_image))
    assert memory_check.page_bytes(image_case[0], 1) == 0
    assert set(image_case[0].timed_request(0, torch.device("cpu"), torch.float32)[1]) == {"prep_ms", "h2d_ms"}


def test_throughput_sources_of_a_pdf(pdf):
    from harness.throughput import plan

    sources = plan.folder_sources(WorkloadConfig(mode=TINY, images=str(pdf)), 4, None)
    assert [(s.name, s.path, s.size) for s in sources[:2]] == [
        ("doc.pdf#page=1", f"{pdf}#page=1", (400, 600)), ("doc.pdf#page=2", f"{pdf}#page=2", (600, 400))]
    # a worker loads a page by its source (harness.throughput.prep.prepare_page)
    assert wl.load_pages(sources[4].path, pdf_dpi=144)[0].image.size == (246, 154)


# ----------------------------------------------------------------------------- broken and encrypted

def test_broken_encrypted_and_oversized_pdfs_are_one_line_errors(pdf, tmp_path):
    bad = truncated(pdf, tmp_path / "bad.pdf")
    assert _error(lambda: wl.load_pages(str(bad))) == (
        f"PDF file {bad} is corrupt or truncated (PDFium: Data format error); fix: "
        "replace it with a valid PDF or remove it")
    locked = encrypted(pdf, tmp_path / "locked.pdf")
    assert _error(lambda: wl.load_pages(str(locked))) == (
        f"PDF file {locked} is encrypted: it needs a password to open; fix: decrypt it (e.g. qpdf --decrypt "
        "--password=PASSWORD in.pdf out.pdf) and point workload.images at the copy, or remove it")
    (tmp_path / "empty.pdf").write_bytes(b"")
    assert _error(lambda: wl.load_pages(str(tmp_path / "empty.pdf"))).startswith(
        f"PDF file {tmp_path / 'empty.pdf'} is empty (0 bytes); fix: replace it with a valid PDF")
    # page 1 is 200 x 300 points: 400 x 600 = 240,000 pixels at 144 dpi, refused before it is drawn
    assert _error(lambda: wl.load_pages(str(pdf), max_pixels=200_000)) == (
        f"page 1 of {pdf} is 400x600 = 240,000 pixels at workload.pdf_dpi=144, over max_pixels=200,000; fix: "
        "lower workload.pdf_dpi or raise workload.max_pixels")
    assert _error(lambda: wl.load_pages(str(pdf), pdf_dpi=0)).startswith("workload.pdf_dpi=0 is not a positive")


# ---------------------------------------------------------------------------------------------- the CLI

def test_broken_and_encrypted_pdf_stop_the_cli_before_the_model(pdf, tmp_path, monkeypatch, capsys):
    """``python -m harness run`` (in this process) on a truncated and on an encrypted PDF: one line, exit 2,
    and the model is never built (its builders replaced by a recorder)."""
    import harness.models.build as build
    import harness.run as run

    built = []
    for module, name in ((run, "load_adapter"), (setup, "load_adapter"), (build, "build_model")):
        monkeypatch.setattr(module, name, lambda *a, **k: built.append(name))
    for path, problem, fix in (
            (truncated(pdf, tmp_path / "bad.pdf"), "is corrupt or truncated (PDFium: Data format error)",
             "replace it with a valid PDF or remove it"),
            (encrypted(pdf, tmp_path / "locked.pdf"), "is encrypted: it needs a password to open",
             "decrypt it (e.g. qpdf --decrypt --password=PASSWORD in.pdf out.pdf) and point workload.images at the "
             "copy, or remove it")):
        rc, lines = main_lines(capsys, ["run", "model=tiny", f"workload.mode={TINY_MODE}", f"workload.images={path}",
                                        "workload.decode_tokens=2", "hardware.calibrate=false",
                                        f"run.root={tmp_path / 'runs'}"])
        assert (rc, lines) == (2, [f"error: PDF file {path} {problem}; fix: {fix}"])
    rc, lines = main_lines(capsys, ["run", "model=tiny", f"workload.images={pdf}", "workload.pdf_dpi=0",
                                    f"run.root={tmp_path / 'runs'}"])
    assert (rc, lines) == (2, ["error: workload.pdf_dpi=0.0 is below its minimum 1; fix: set workload.pdf_dpi to 1 "
                               "or more"])
    assert built == []


def start_runs(tmp_path_factory, submit) -> dict:
    """A 20-page PDF run end to end on the tiny model (one request of the 20 distinct pages), started with
    the session's background runs (tests/conftest.py)."""
    tmp = tmp_path_factory.mktemp("pdf-cli")
    twenty = write_pdf(tmp / "twenty.pdf", [(100, 150)] * 20, [(12 * k) % 256 for k in range(20)])
    return {"run": submit(_run_twenty, tmp, twenty)}


def _run_twenty(tmp: Path, twenty: Path) -> tuple:
    """(process, run directories) of ``python -m harness run`` of the 20 pages in one request (batch 20),
    2 decode tokens, 1 repeat, on the tiny model."""
    cmd = [sys.executable, "-m", "harness", "run", "model=tiny", f"workload.mode={TINY_MODE}",
           f"workload.images={twenty}", "workload.batch=20", "workload.decode_tokens=2", "measure.repeats=1",
           f"run.root={tmp / 'runs'}"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    return res, sorted((tmp / "runs").iterdir()) if (tmp / "runs").is_dir() else []


def test_twenty_page_pdf_runs_end_to_end_with_its_rasterisation_time(runs):
    res, dirs = runs["run"].result()
    assert res.returncode == 0, res.stderr
    assert len(dirs) == 1
    run = dirs[0]
    manifest = json.loads((run / "manifest.json").read_text())
    (case,) = manifest["cases"]
    names = [f"twenty.pdf#page={n}" for n in range(1, 21)]
    assert case["batch"] == 20 and case["distinct_pages"] == 20 and not case["copies"]
    assert case["pages"] == f"{', '.join(names[:3])}, ..., {names[-1]} (20 pages)"
    assert "PDF pages rasterised at workload.pdf_dpi=144" in case["page_source"]
    head = pd.read_csv(run / "headline.csv").iloc[0]
    assert head["raster_ms"] > 0 and head["raster_page_ms"] == pytest.approx(head["raster_ms"] / 20)
    assert head["ttft_e2e_ms"] == pytest.approx(head["raster_ms"] + head["prep_ms"] + head["h2d_ms"] + head["ttft_ms"])
    assert head["pages_s_e2e"] == pytest.approx(20 * 1000 / (head["call_ms"] + head["raster_ms"] + head["prep_ms"]
                                                              + head["h2d_ms"]))
    stages = pd.read_csv(run / "stages.csv")
    request = stages[(stages["stage"] == "request") & ~stages["profiled"]]
    assert request["raster_ms"].tolist() == [head["raster_ms"]]
    report = (run / "report.md").read_text()
    table = report[report.index("### What a user waits for"):]
    header, _, row = table.splitlines()[2:5]
    assert COLUMNS["raster_page"].title in header and COLUMNS["raster_page"].provenance == "measured"
    col = [c.strip() for c in header.split("|")].index(COLUMNS["raster_page"].title)
    assert float([c.strip() for c in row.split("|")][col].replace(",", "")) == pytest.approx(head["raster_page_ms"],
                                                                                          rel=0.01, abs=0.01)
    print(f"raster / page on this CPU: {head['raster_page_ms']:.3f} ms (20 pages of 200x300 px at 144 dpi)")
