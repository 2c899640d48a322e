"""Workload: crop modes, tile grids, token layout, preprocessing, page loading (CPU, fast)."""
from __future__ import annotations

import io
import struct
import warnings
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from harness.errors import HarnessError
from harness import layout
from harness import workload as wl

GREY = (127 / 255 - 0.5) / 0.5
# the same value computed in float32 as ToTensor + Normalize do (x / 255, then - 0.5, / 0.5)
GREY32 = ((torch.tensor(127, dtype=torch.float32) / 255 - 0.5) / 0.5).item()


# ---------------------------------------------------------------- modes and token counts

@pytest.mark.parametrize("name,expected", [
    ("tiny", 73), ("small", 111), ("base", 273), ("large", 421), ("gundam", 273)])
def test_image_token_count_per_mode(name, expected):
    assert layout.image_token_count(name) == expected


@pytest.mark.parametrize("grid,expected", [
    ((1, 2), 493), ((2, 2), 693), ((2, 3), 903), ((3, 3), 1203), ((1, 9), 1263)])
def test_image_token_count_gundam_grids(grid, expected):
    assert layout.image_token_count("gundam", grid) == expected
    cols, rows = grid
    assert expected == 273 + (10 * cols + 1) * (10 * rows)


def test_grid_is_cols_by_rows_not_symmetric():
    # 3 cols x 1 row: 273 + 31*10; 1 col x 3 rows: 273 + 11*30
    assert layout.image_token_count("gundam", (3, 1)) == 583
    assert layout.image_token_count("gundam", (1, 3)) == 603


def test_modes_table():
    assert {k: (m.base_size, m.image_size, m.crop) for k, m in layout.MODES.items()} == {
        "tiny": (512, 512, False), "small": (640, 640, False), "base": (1024, 1024, False),
        "large": (1280, 1280, False), "gundam": (1024, 640, True)}
    assert layout.PATCH_SIZE == 16 and layout.DOWNSAMPLE == 4
    # the vendor's process() resizes to a square first only without crop at <= 640 px (tiny, small)
    assert {k for k, m in layout.MODES.items() if m.squares_first} == {"tiny", "small"}
    assert {k: m.view_size for k, m in layout.MODES.items()} == {"tiny": 512, "small": 640, "base": 1024,
                                                                 "large": 1280, "gundam": 1024}
    assert layout.CropMode("c", 1024, 640, True).view_size == 1024 and layout.CropMode("u", 96, 64, False).view_size == 64
    assert not layout.CropMode("c", 1024, 640, True).squares_first and layout.CropMode("u", 64, 64, False).squares_first


def test_get_mode_forms():
    assert layout.get_mode("gundam") is layout.MODES["gundam"]
    assert layout.get_mode(layout.MODES["base"]) is layout.MODES["base"]
    custom = layout.get_mode({"name": "mini", "base_size": 128, "image_size": 64, "crop": True})
    assert custom == layout.CropMode("mini", 128, 64, True)
    assert layout.image_token_count(custom) == 7                    # q = 2: 2*3 + 1
    assert layout.image_token_count(custom, (2, 3)) == 7 + 3 * 3    # q_t = 1: (1*2+1)*(1*3)


def test_unknown_mode_lists_valid_modes():
    with pytest.raises(HarnessError) as err:
        layout.get_mode("huge")
    msg = str(err.value)
    assert "huge" in msg and "\n" not in msg
    for name in layout.MODES:
        assert name in msg


@pytest.mark.parametrize("bad", [
    {"name": "x", "base_size": 100, "image_size": 64, "crop": True},   # not a multiple of 16
    {"name": "x", "base_size": 128, "crop": True},                     # missing image_size
    {"name": "x", "base_size": 128, "image_size": 64, "crop": True, "tile": 3},
    42,
])
def test_bad_custom_mode(bad):
    with pytest.raises(HarnessError):
        layout.get_mode(bad)


# ---------------------------------------------------------------- tile grid (vendor rule)

@pytest.mark.parametrize("size,grid", [
    ((1240, 1754), (2, 3)),   # A4 portrait, aspect 0.707: 2/3 beats 3/4
    ((1754, 1240), (3, 2)),   # landscape, aspect 1.41: 3/2
    ((2000, 500), (4, 1)),    # wide, aspect 4 exactly
    ((600, 1600), (1, 3)),    # receipt, aspect 0.375: 1/3
    ((1000, 1000), (2, 2)),   # square: 2x2 and 3x3 tie, area 1e6 < 0.5*640^2*9 keeps 2x2
    ((2000, 2000), (3, 3)),   # square: tie, area 4e6 > 1.84e6 takes the later 3x3
    ((641, 640), (2, 2)),
    ((300, 2700), (1, 9)),    # aspect 1/9
])
def test_select_grid(size, grid):
    assert layout.select_grid(*size) == grid


def test_tile_grid_for():
    gundam = layout.MODES["gundam"]
    assert layout.tile_grid_for(640, 640, gundam) is None
    assert layout.tile_grid_for(500, 300, "gundam") is None
    assert layout.tile_grid_for(641, 640, "gundam") == (2, 2)
    assert layout.tile_grid_for(640, 641, "gundam") == (2, 2)
    assert layout.tile_grid_for(1240, 1754, "gundam") == (2, 3)
    assert layout.tile_grid_for(1240, 1754, "base") is None


# ---------------------------------------------------------------- preprocessing

def test_to_tensor_values():
    img = Image.new("RGB", (3, 1))
    img.putdata([(0, 127, 255), (255, 0, 127), (10, 20, 30)])
    t = wl.to_tensor(img)
    assert t.shape == (3, 1, 3) and t.dtype == torch.float32
    assert t[:, 0, 0].tolist() == pytest.approx([-1.0, GREY, 1.0])
    assert t[:, 0, 1].tolist() == pytest.approx([1.0, -1.0, GREY])
    assert t[0, 0, 2].item() == pytest.approx((10 / 255 - 0.5) / 0.5)


@pytest.mark.parametrize("mode,view,tiles", [
    ("tiny", 512, None), ("small", 640, None), ("base", 1024, None), ("large", 1280, None),
    ("gundam", 1024, (6, 640)),
])
def test_preprocess_shapes(mode, view, tiles):
    page = Image.new("RGB", (1240, 1754), (255, 255, 255))
    out = wl.preprocess(page, mode)
    assert out.global_view.shape == (3, view, view) and out.global_view.dtype == torch.float32
    if tiles is None:
        assert out.tiles is None and out.grid is None
    else:
        cols, rows = out.grid
        assert out.tiles.shape == (tiles[0], 3, tiles[1], tiles[1]) and cols * rows == tiles[0]
    assert out.image_tokens == layout.image_token_count(mode, out.grid)


def test_preprocess_small_page_gundam_no_tiles():
    out = wl.preprocess(Image.new("RGB", (500, 300), (255, 255, 255)), "gundam")
    assert out.tiles is None and out.grid is None and out.image_tokens == 273
    assert out.global_view.shape == (3, 1024, 1024)


def test_grey_pad_keeps_aspect_for_large_sizes():
    page = Image.new("RGB", (1240, 1754), (255, 0, 0))
    view = wl.preprocess(page, "large").global_view          # 1280: pad, aspect kept
    assert GREY32 == pytest.approx(GREY, abs=1e-7)
    assert torch.all(view[:, :, 0] == GREY32) and torch.all(view[:, :, -1] == GREY32)
    centre = view[:, 640, 640].tolist()
    assert centre == pytest.approx([1.0, -1.0, -1.0])
    content = (view[1, 640] != GREY32).sum().item()            # red columns on the middle row
    assert abs(content - round(1280 * 1240 / 1754)) <= 2
    gview = wl.preprocess(page, "gundam").global_view         # crop mode pads to base_size
    assert torch.all(gview[:, :, 0] == GREY32)


def test_small_sizes_resize_to_square_without_pad():
    page = Image.new("RGB", (1240, 1754), (255, 0, 0))
    for mode in ("tiny", "small"):
        view = wl.preprocess(page, mode).global_view
        assert not torch.any(view[1] == GREY32)                 # no grey column anywhere
        assert torch.all(view[0] == 1.0)


def test_tiles_are_row_major():
    # 1280x1920 is exactly 2x3 tiles of 640: tile k must be block (k % 2, k // 2)
    arr = np.zeros((1920, 1280, 3), dtype=np.uint8)
    for k in range(6):
        x, y = k % 2, k // 2
        arr[y * 640:(y + 1) * 640, x * 640:(x + 1) * 640] = (k * 40, 255 - k * 40, 7)
    out = wl.preprocess(Image.fromarray(arr), "gundam")
    assert out.grid == (2, 3)
    for k in range(6):
        expect = (k * 40 / 255 - 0.5) / 0.5
        assert out.tiles[k, 0, 320, 320].item() == pytest.approx(expect)


def test_preprocess_custom_small_mode():
    mode = {"name": "mini", "base_size": 128, "image_size": 64, "crop": True}
    out = wl.preprocess(Image.new("L", (100, 150), 200), mode)
    assert out.grid == (2, 3) and out.tiles.shape == (6, 3, 64, 64)
    assert out.global_view.shape == (3, 128, 128) and out.image_tokens == 16


# ---------------------------------------------------------------- synthetic pages

def test_synthetic_page_deterministic_and_varied():
    a, b = wl.synthetic_page(0, seed=3), wl.synthetic_page(0, seed=3)
    assert a.mode == "RGB" and a.size == (1240, 1754)
    assert a.tobytes() == b.tobytes()
    assert wl.synthetic_page(0, seed=4).tobytes() != a.tobytes()
    sizes = {wl.synthetic_page(i).size for i in range(5)}
    assert len(sizes) == 5
    arr = np.asarray(a)
    assert (arr < 100).any() and (arr == 255).mean() > 0.5   # dark text on a white page
    assert wl.synthetic_page(1, size=(300, 200)).size == (300, 200)


def test_load_pages_synthetic():
    pages = wl.load_pages(None, pages=3, seed=1)
    assert [p.name for p in pages] == ["synthetic-000", "synthetic-001", "synthetic-002"]
    assert all(p.source == "synthetic:1" and p.image.mode == "RGB" for p in pages)
    with pytest.raises(HarnessError):
        wl.load_pages(None, pages=0)


# ---------------------------------------------------------------- loading files

def _one_line_error(call) -> str:
    with pytest.raises(HarnessError) as err:
        call()
    msg = str(err.value)
    assert "\n" not in msg and "fix:" in msg
    return msg


def test_load_pages_directory(tmp_path):
    Image.new("L", (40, 30), 9).save(tmp_path / "b.png")
    Image.new("RGB", (20, 10), (1, 2, 3)).save(tmp_path / "a.JPG")
    (tmp_path / "notes.txt").write_text("hello")
    pages = wl.load_pages(str(tmp_path))
    assert [p.name for p in pages] == ["a.JPG", "b.png"]
    assert all(p.image.mode == "RGB" for p in pages)
    assert pages[1].image.size == (40, 30) and pages[1].source == str(tmp_path / "b.png")
    single = wl.load_pages(str(tmp_path / "b.png"))
    assert len(single) == 1 and single[0].image.getpixel((0, 0)) == (9, 9, 9)


def test_load_pages_missing_path(tmp_path):
    assert "does not exist" in _one_line_error(lambda: wl.load_pages(str(tmp_path / "nope")))


def test_load_pages_empty_dir(tmp_path):
    (tmp_path / "readme.txt").write_text("not an image")
    assert "no image files" in _one_line_error(lambda: wl.load_pages(str(tmp_path)))


def test_load_pages_empty_file(tmp_path):
    (tmp_path / "empty.png").write_bytes(b"")
    assert "empty" in _one_line_error(lambda: wl.load_pages(str(tmp_path)))


def test_load_pages_text_named_png(tmp_path):
    (tmp_path / "fake.png").write_text("this is plain text, not a PNG\n" * 20)
    assert "not an image" in _one_line_error(lambda: wl.load_pages(str(tmp_path / "fake.png")))


def test_load_pages_truncated_png(tmp_path):
    buf = io.BytesIO()
    noise = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(noise).save(buf, format="PNG")
    data = buf.getvalue()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    msg = _one_line_error(lambda: wl.load_pages(str(tmp_path / "cut.png")))
    assert "cut.png" in msg and ("corrupt" in msg or "truncated" in msg)


def _png_with_header_size(width: int, height: int) -> bytes:
    """A 1x1 PNG whose IHDR claims width x height (CRC fixed): tiny file, huge header."""
    buf = io.BytesIO()
    Image.new("L", (1, 1)).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    assert data[12:16] == b"IHDR"
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])) & 0xFFFFFFFF)
    return bytes(data)


def test_load_pages_refuses_huge_header_without_decoding(tmp_path, monkeypatch):
    from PIL import ImageFile

    path = tmp_path / "huge.png"
    path.write_bytes(_png_with_header_size(20000, 20000))
    limit_before = Image.MAX_IMAGE_PIXELS
    decoded = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(self) or None)
    monkeypatch.setattr(ImageFile.ImageFile, "verify", lambda self: decoded.append(self) or None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        msg = _one_line_error(lambda: wl.load_pages(str(path)))
    assert decoded == []                                  # refused from the header: no pixel was read
    assert "20000x20000" in msg and "max_pixels" in msg
    assert not [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]
    assert Image.MAX_IMAGE_PIXELS == limit_before


def test_a_multi_frame_tiff_is_measured_by_its_first_frame_with_a_note(tmp_path):
    first, second = Image.new("RGB", (30, 20), (10, 20, 30)), Image.new("RGB", (30, 20), (200, 200, 200))
    first.save(tmp_path / "two.tif", save_all=True, append_images=[second])
    (page,) = wl.load_pages(str(tmp_path / "two.tif"))
    assert page.image.getpixel((0, 0)) == (10, 20, 30)
    assert page.note == ("two.tif: 2 frames (pages) in one file, only the first is measured (save one page per file "
                         "to measure every page)")
    first.save(tmp_path / "one.tif")
    assert wl.load_pages(str(tmp_path / "one.tif"))[0].note == ""


def test_load_pages_max_pixels_applies(tmp_path):
    Image.new("RGB", (20, 20)).save(tmp_path / "p.png")
    assert len(wl.load_pages(str(tmp_path), max_pixels=400)) == 1
    assert "max_pixels" in _one_line_error(lambda: wl.load_pages(str(tmp_path), max_pixels=399))


# ---------------------------------------------------------------- requests

def _page(index: int, size=None) -> wl.Page:
    return wl.Page(f"p{index}", wl.synthetic_page(index, size=size), f"synthetic:{index}")



def test_sixteen_bit_page_is_scaled_from_its_own_range(tmp_path):
    """A 16-bit grayscale PNG (values 1000..5000): PIL's plain conversion clips it all to white;
    here 1000 -> 0, 3000 -> 128 (127.5 rounded half to even: 128), 5000 -> 255, with a note."""
    arr = np.array([[1000, 3000, 5000, 2000]], dtype=np.uint16)
    Image.fromarray(arr).save(tmp_path / "deep.png")
    with Image.open(tmp_path / "deep.png") as im:
        assert im.mode == "I;16" and (np.asarray(im.convert("RGB")) == 255).all()
    page = wl.load_pages(str(tmp_path / "deep.png"))[0]
    assert page.image.mode == "RGB"
    assert np.asarray(page.image)[0, :, 0].tolist() == [0, 128, 255, 64]
    assert page.note == "deep.png: I;16 pixels (values 1000..5000) scaled linearly to 8 bits"
    Image.new("RGB", (4, 1), (9, 9, 9)).save(tmp_path / "plain.png")
    assert wl.load_pages(str(tmp_path / "plain.png"))[0].note == ""


def _sized(*sizes) -> list:
    return [wl.Page(f"{i:02d}.png", Image.new("RGB", s, (255, 255, 255)), "memory") for i, s in enumerate(sizes)]


def test_batch_pages_groups_a_folder_by_layout():
    """Tiny mode (128 global, 64 tiles): 120x180 -> 2x3, 200x100 -> 4x2, 50x50 -> no tiles. So the
    six pages form three layout groups, in name order: 2x3 = pages 1, 3, 5; 4x2 = 2, 6; none = 4.
    A batch holds distinct pages of one layout; a group's last request continues from the group's
    start; requests are ordered by their first page; labels name the distinct pages by position."""
    mode = {"name": "t", "base_size": 128, "image_size": 64, "crop": True}
    pages = _sized((120, 180), (200, 100), (120, 180), (50, 50), (120, 180), (200, 100))
    one = wl.batch_pages(pages, mode, 1)
    assert [(label, [p.name for p in group]) for label, group in one] == [
        (f"p00{i + 1}", [f"0{i}.png"]) for i in range(6)]
    # batch 2: the no-tiles group has one page -> refused without repeat_pages
    msg = _one_line_error(lambda: wl.batch_pages(pages, mode, 2, where="workload.images=DIR"))
    assert msg == ("workload.images=DIR has fewer than workload.batch=2 distinct pages of one layout (no tiles: "
                   "1 page(s), 03.png); fix: set workload.repeat_pages=true to fill each batch by repeating pages "
                   "(measured as copies), or use workload.batch=1, or add pages of that layout")
    two = wl.batch_pages(pages, mode, 2, repeat=True)
    # 2x3 (3 pages): 1+3, then 5 continued by 1; 4x2: 2+6; no tiles: 4 copied
    assert [(label, [p.name for p in group]) for label, group in two] == [
        ("p001+p003", ["00.png", "02.png"]), ("p002+p006", ["01.png", "05.png"]),
        ("p004", ["03.png", "03.png"]), ("p005+p001", ["04.png", "00.png"])]
    three = wl.batch_pages(pages, mode, 3, repeat=True)
    assert [label for label, _ in three] == ["p001+p003+p005", "p002+p006", "p004"]
    assert [p.name for p in three[1][1]] == ["01.png", "05.png", "01.png"]
    for _, group in two + three:   # every request builds: one layout per batch
        wl.build_request(group, mode, decode_tokens=1)
    # two groups short at batch 3: both named; batch 1 is what every group can fill
    msg = _one_line_error(lambda: wl.batch_pages(pages, mode, 3))
    assert msg.startswith("the folder has fewer than workload.batch=3 distinct pages of one layout (tile grid 4x2: "
                          "2 page(s), 01.png, 05.png; no tiles: 1 page(s), 03.png); fix: ") and "workload.batch=1," in msg


def test_batch_wording():
    assert layout.batch_wording(1, 1) == "1 page"
    assert layout.batch_wording(4, 4) == "batch of 4 distinct pages"
    assert layout.batch_wording(32, 1) == "batch of 32 copies of 1 page"
    assert layout.batch_wording(4, 2) == "batch of 4 copies of 2 pages"
    assert wl.names_text(["a", "b"]) == "a, b"
    assert wl.names_text([f"p{i}" for i in range(32)]) == "p0, p1, p2, ..., p31 (32 pages)"


def test_build_request_layout_base():
    req = wl.build_request([_page(0)], "base", decode_tokens=16, text_tokens=12, seed=5)
    ids, mask = req.input_ids, req.images_seq_mask
    assert ids.dtype == torch.long and mask.dtype == torch.bool
    assert req.batch == 1 and req.prefill_tokens == 1 + 273 + 12 == ids.shape[1]
    assert ids[0, 0].item() == layout.BOS_ID and not mask[0, 0]
    assert mask.sum().item() == req.image_tokens == 273
    assert torch.all(mask[0, 1:274]) and not torch.any(mask[0, 274:])
    assert torch.all(ids[mask] == layout.IMAGE_TOKEN_ID)
    text = ids[0, 274:]
    assert torch.all((text >= 1000) & (text < 100000))
    assert req.text_tokens == 12 and req.decode_tokens == 16 and req.pages == ["p0"]   # BOS excluded
    assert req.global_views.shape == (1, 3, 1024, 1024) and req.tiles is None
    again = wl.build_request([_page(0)], "base", text_tokens=12, seed=5)
    other = wl.build_request([_page(0)], "base", text_tokens=12, seed=6)
    assert torch.equal(again.input_ids, ids) and not torch.equal(other.input_ids, ids)


def test_build_request_batch_of_two_gundam():
    pages = [_page(0), _page(5)]                    # indices 0 and 5 are both A4 portrait
    req = wl.build_request(pages, "gundam", text_tokens=4)
    assert req.batch == 2 and req.grid == (2, 3) and req.image_tokens == 903
    assert req.input_ids.shape == (2, 1 + 903 + 4)
    assert torch.equal(req.input_ids[0], req.input_ids[1])
    assert req.global_views.shape == (2, 3, 1024, 1024)
    assert req.tiles.shape == (12, 3, 640, 640)
    single = wl.preprocess(pages[1].image, "gundam")
    assert torch.equal(req.tiles[6:], single.tiles)   # batch-major: page 1's tiles last
    d = wl.describe(req)
    assert d == {"name": "gundam-2x3-b2", "mode": "gundam", "base_size": 1024, "image_size": 640, "crop": True,
                 "grid": "2x3", "image_tokens": 903, "bos_tokens": 1, "text_tokens": 4, "prefill_tokens": 908,
                 "decode_tokens": 128, "batch": 2, "pages": ["p0", "p5"]}


def test_build_request_mismatched_grids():
    pages = [_page(0), _page(2)]                    # portrait 2x3 vs landscape 3x2
    msg = _one_line_error(lambda: wl.build_request(pages, "gundam"))
    assert "grid" in msg and "batch=1" in msg
    assert wl.build_request(pages, "tiny").batch == 2     # no tiles: same layout


@pytest.mark.parametrize("prompt", ["Convert the document.", "<image><image> twice"])
def test_build_request_prompt_needs_one_image(prompt):
    msg = _one_line_error(lambda: wl.build_request([_page(4)], "tiny", prompt=prompt))
    assert "<image>" in msg


class _CharTokenizer:
    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        return [ord(c) for c in text]


def test_build_request_with_tokenizer():
    tok = _CharTokenizer()
    req = wl.build_request([_page(4)], "tiny", tokenizer=tok, prompt="Hi <image>\nGo. ")
    ids = req.input_ids[0].tolist()
    before, after = [ord(c) for c in "Hi "], [ord(c) for c in "\nGo."]   # prompt stripped
    assert ids == [0] + before + [layout.IMAGE_TOKEN_ID] * 73 + after
    assert req.text_tokens == len(before) + len(after) and req.prefill_tokens == 1 + len(before) + 73 + len(after)
    assert req.images_seq_mask[0].tolist() == [False] * 4 + [True] * 73 + [False] * 4


def test_load_tokenizer_without_files(tmp_path):
    tok, reason = wl.load_tokenizer(str(tmp_path))
    assert tok is None and "no tokenizer files" in reason and "12" in reason
    tok, reason = wl.load_tokenizer(None, text_tokens=7)
    assert tok is None and "7" in reason
    (tmp_path / "tokenizer.json").write_text("{}")
    tok, reason = wl.load_tokenizer(str(tmp_path))       # broken or no transformers: no raise
    if tok is None:
        assert reason
