"""README.md and its docs/ pages (issue 38: a README that fits on a page, its sections in docs/).

The result tables come from the committed evidence (issue 22 item 8): ``scripts/readme_tables.py --check``
passes on the repository and fails when a figure of a page or an evidence file changes; only the pages it
lists (``FILES``) hold generated tables; batches of copies are marked superseded and an efficiency above
100% is flagged, never printed. The README holds at most 300 lines, the test command CI runs, a first
run a laptop can do, headline figures that are its evidence folders', and links (README.md and every page
under docs/) that point at files and headings that exist."""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "runs" / "examples"
README = ROOT / "README.md"
#: README.md and every page under docs/: where links are checked and generated blocks are looked for
PAGES = [README] + sorted((ROOT / "docs").rglob("*.md"))


@pytest.fixture(scope="module")
def tables():
    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "scripts" / "readme_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _examples_with(tmp_path: Path, name: str) -> Path:
    """A copy of runs/examples where only ``name`` is a real copy (to edit); the rest are links."""
    root = tmp_path / "examples"
    root.mkdir()
    for d in EXAMPLES.iterdir():
        if d.name == name:
            shutil.copytree(d, root / name)
        else:
            (root / d.name).symlink_to(d, target_is_directory=True)
    return root


def test_readme_matches_its_evidence(tables, capsys):
    assert tables.main(["--check"]) == 0, capsys.readouterr().err


def test_only_the_listed_pages_hold_generated_tables(tables):
    holding = {p.relative_to(ROOT).as_posix() for p in PAGES if "<!-- generated: " in p.read_text()}
    assert holding == set(tables.FILES) == {"docs/execution-variants.md", "docs/throughput.md",
                                            "docs/vendor-model.md"}


def test_a_figure_that_differs_fails_the_check(tables, tmp_path, capsys):
    best = pd.read_csv(EXAMPLES / "h200-optimize" / "headline.csv").set_index("case").loc["best", "decode_tok_s"]
    shown = f"| best | 1 | 1 page | weights | {best:,.1f} |"    # the best row as the page prints it
    text = (ROOT / "docs" / "execution-variants.md").read_text()
    assert shown == "| best | 1 | 1 page | weights | 1,555.7 |" and text.count(shown) == 1
    page = tmp_path / "execution-variants.md"
    page.write_text(text.replace(shown, "| best | 1 | 1 page | weights | 1,234.7 |"))   # the stale figure of issue 22
    other = tmp_path / "throughput.md"
    other.write_text((ROOT / "docs" / "throughput.md").read_text())
    assert tables.main(["--check", "--file", str(other), "--file", str(page)]) == 1
    assert capsys.readouterr().err.splitlines() == [                          # the page that differs, not the other
        f"{page}: generated block 'ladder h200-optimize' differs from its evidence; run python "
        "scripts/readme_tables.py"]
    assert tables.main(["--file", str(page)]) == 0 and page.read_text() == text     # rewritten from evidence


def test_an_evidence_file_that_differs_fails_the_check(tables, tmp_path, capsys):
    examples = _examples_with(tmp_path, "h100-optimize")
    head = pd.read_csv(examples / "h100-optimize" / "headline.csv")
    head.loc[head["case"] == "best", "tpot_p50_ms"] = 0.5
    head.to_csv(examples / "h100-optimize" / "headline.csv", index=False)
    assert tables.main(["--check", "--examples", str(examples)]) == 1
    assert [ln.split("'")[1] for ln in capsys.readouterr().err.splitlines()] == ["ladder h100-optimize"]


def test_batches_of_copies_are_superseded_and_above_100_percent_is_flagged(tables, tmp_path):
    assert tables.share(0.429) == "42.9%" and tables.share(1.0) == "100.0%"
    assert tables.share(1.097) == "flagged: above 100%"
    # the committed H100 best-b32 ran 32 copies of one page: no figures, marked superseded
    lines = tables.render("ladder h100-optimize", EXAMPLES).splitlines()
    assert "| best-b32 | 32 | superseded: batch of 32 copies of 1 page | weights | – | – | – | – | – | – |" in lines
    # the same row as if its pages had been distinct: its calibrated MBU, 109.7% in the evidence README
    # (analytic bytes over measured time against the calibrated copy bandwidth), is flagged, not printed
    examples = _examples_with(tmp_path, "h100-optimize")
    man_path = examples / "h100-optimize" / "manifest.json"
    man = json.loads(man_path.read_text())
    b32 = next(c for c in man["cases"] if c["name"] == "best-b32")
    b32["pages"] = [f"synthetic-{k:04d}" for k in range(32)]
    man_path.write_text(json.dumps(man))
    # the committed roofline.csv leaves the value blank and notes it (above_ceiling); put the number
    # back into the copy, as a run without the flag would have written it, to see the README flag it
    roof_path = examples / "h100-optimize" / "roofline.csv"
    roof = pd.read_csv(roof_path)
    at = (roof["case"] == "best-b32") & (roof["stage"] == "decode") & (roof["level"] == "stage")
    assert roof.loc[at, "mbu_cal"].isna().all() and roof.loc[at, "above_ceiling"].str.contains("mbu_cal").all()
    assert round(float(roof.loc[at, "mbu"].iloc[0]), 3) == 0.984
    roof.loc[at, "mbu_cal"] = 1.097
    roof.to_csv(roof_path, index=False)
    row = next(ln for ln in tables.render("ladder h100-optimize", examples).splitlines() if ln.startswith("| best-b32"))
    assert row.startswith("| best-b32 | 32 | batch of 32 distinct pages | weights | 17,480.3 |")
    assert row.endswith("| 98.4% / flagged: above 100% |") and "109.7" not in row


def test_the_readme_fits_on_a_page_with_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    test_command = ci[ci.index("set +e") + 1]      # the command .ci/run runs, as the README must show it
    assert test_command == "bash scripts/bootstrap.sh && .venv/bin/python -m pytest -q"
    lines = [ln.split("#")[0].rstrip() for ln in text.splitlines()]
    assert test_command in lines
    # the first run: bootstrap, then the tiny model (a laptop's run), before the full default
    first = text.index("bash scripts/bootstrap.sh && .venv/bin/python -m harness run model=tiny \\\n")
    assert first < text.index(test_command) < text.index(".venv/bin/python -m harness run       # the embedded default")


def _section(text: str, title: str) -> str:
    """The text under ``## title`` up to the next ``## `` heading, its whitespace folded to single spaces."""
    body = text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    return " ".join(body.split())


def test_the_readme_headline_figures_are_their_evidence(tables):
    """Every figure under 'Headline figures', as the evidence folder it links gives it (a changed figure
    or evidence file fails here, as a generated table would)."""
    def case(folder, name):
        return tables.evidence(EXAMPLES / folder)["cases"][name]

    fused200, fused100 = case("h200-decode-choose", "best-fused"), case("h100-decode-choose", "best-fused")
    vendor, best = case("h200-optimize", "vendor-style"), case("h200-optimize", "best")
    shipped, ours = case("h200-vendor-shipped/vendor-infer-fa2", "base"), case("h200-vendor-shipped/best-fused", "base")
    b32 = {(gpu, routing): case(f"{gpu}-b32-align", f"best-b32{routing}") for gpu in ("h200", "h100")
           for routing in ("", "-balanced")}
    b128 = next(r for r in tables.evidence(EXAMPLES / "h100-throughput" / "balanced-620-b128-align")["throughput"]
                if r["batch"] == 128)
    folded, apart = case("h200-issue40-s7/b32-folded", "best-b32-balanced"), case("h200-issue40-s7/b32-apart",
                                                                                 "best-b32-balanced")
    tp = {n: next(r for r in tables.evidence(EXAMPLES / "h200-issue40-s7" / n)["throughput"] if r["batch"] == 128)
          for n in ("tp620", "tp128")}
    cost = tables.evidence(EXAMPLES / "h200-optimize")["overhead"]
    expected = {
        "72 Triton launches": f"{fused200['launches_per_step']:.0f} Triton launches",
        "0.438 ms per token on an NVIDIA H200 (55.5% of":
            f"{fused200['tpot_p50_ms']:.3f} ms per token on an NVIDIA H200 ({tables.share(fused200['mbu'])} of",
        "0.534 ms on an H100 (65.2% of": f"{fused100['tpot_p50_ms']:.3f} ms on an H100 ({tables.share(fused100['mbu'])} of",
        "21.116 ms, 1,184 kernels and 11 host syncs per step":
            f"{vendor['tpot_p50_ms']:.3f} ms, {vendor['launches_per_step']:,.0f} kernels and "
            f"{vendor['syncs_per_step']:.0f} host syncs per step",
        "39.011 ms per token, 1,304 kernels and 17 host syncs per step":
            f"{shipped['tpot_p50_ms']:.3f} ms per token, {shipped['launches_per_step']:,.0f} kernels and "
            f"{shipped['syncs_per_step']:.0f} host syncs per step",
        "0.436 ms for `best-fused`": f"{ours['tpot_p50_ms']:.3f} ms for `best-fused`",
        "26,041.0 tok/s on an H200": f"{b32['h200', '']['decode_tok_s']:,.1f} tok/s on an H200",
        "59.4% of the datasheet bandwidth on an H200 and 67.4%":
            f"{tables.share(b32['h200', '-balanced']['mbu'])} of the datasheet bandwidth on an H200 and "
            f"{tables.share(b32['h100', '-balanced']['mbu'])}",
        "62.2% on an H200, against 59.1% with it apart on the same GPU, 155 kernels per step against 188":
            f"{tables.share(folded['mbu'])} on an H200, against {tables.share(apart['mbu'])} with it apart on the same "
            f"GPU, {folded['launches_per_step']:.0f} kernels per step against {apart['launches_per_step']:.0f}",
        "**40.57 pages/s** at 620 +- 150 tokens (bound by decode) and 153.97 at 128 tokens":
            f"**{tp['tp620']['pages_s']:.2f} pages/s** at 620 +- 150 tokens (bound by {tp['tp620']['bound']}) and "
            f"{tp['tp128']['pages_s']:.2f} at 128 tokens",
        "29.93 pages/s at batch 128 on an H100, bound by decode, GPU busy 98.5%":
            f"{b128['pages_s']:.2f} pages/s at batch 128 on an H100, bound by {b128['bound']}, GPU busy "
            f"{tables.share(b128['gpu_busy'])}",
        "SAM 4.36 ms against 10.80, CLIP 1.21 ms against 6.58":
            f"SAM {best['sam_ms']:.2f} ms against {vendor['sam_ms']:.2f}, CLIP {best['clip_ms']:.2f} ms against "
            f"{vendor['clip_ms']:.2f}",
        "1.007x as long as a bare one [1.004, 1.008]": f"{cost['ratio']}x as long as a bare one [{cost['lo']}, {cost['hi']}]",
    }
    assert {shown: want for shown, want in expected.items() if shown != want} == {}
    headline = _section(README.read_text(), "Headline figures")
    assert [shown for shown in expected if shown not in headline] == []


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it: lower case, punctuation but '-' and '_' dropped, spaces '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _outside_code(text: str) -> list:
    """The lines of a Markdown text outside fenced code blocks."""
    out, code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            code = not code
        elif not code:
            out.append(line)
    return out


def _anchors(path: Path) -> set:
    return {_slug(ln.lstrip("#")) for ln in _outside_code(path.read_text()) if re.match(r"#{1,6} ", ln)}


def test_slugs_are_githubs():
    assert _slug("flash-attn for `flash_attention_2` (CUDA set-up)") == "flash-attn-for-flash_attention_2-cuda-set-up"
    assert _slug("Throughput: pages/s of the whole pipeline") == "throughput-pagess-of-the-whole-pipeline"
    assert _slug("How steady is the host?") == "how-steady-is-the-host"


def _broken_links(page: Path) -> list:
    """'TARGET: why' for each relative link of ``page`` (outside code) whose file or heading is missing."""
    broken = []
    for line in _outside_code(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):        # http:, https:, mailto: (not checked: no network)
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                broken.append(f"{target}: no such file")
            elif anchor and (path.suffix != ".md" or anchor not in _anchors(path)):
                broken.append(f"{target}: no such heading")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_points_at_a_file_and_heading_that_exist(page):
    assert _broken_links(page) == []


def test_a_link_to_a_missing_file_or_heading_is_named(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "faults.md").write_text("# Faults and exit codes\n\n## The exit codes\n")
    (tmp_path / "README.md").write_text(
        "# R\n\n## Verbs\n\n[ok](docs/faults.md#the-exit-codes), [here](#verbs), ![pic](docs/faults.md)\n"
        "[gone](docs/throughput.md) [moved](#merging-split-runs) [old](docs/faults.md#faults) "
        "[web](https://example.invalid/x.md)\n```\n[in code](nowhere.md)\n```\n")
    assert _broken_links(tmp_path / "README.md") == [
        "docs/throughput.md: no such file", "#merging-split-runs: no such heading", "docs/faults.md#faults: no such heading"]


def test_a_block_names_a_nested_run_folder_by_its_path(tables):
    """The "Evidence:" line names FOLDER as the block does, a run folder inside an evidence folder by
    both names (``h200-issue40-s8/tp620``), a top-level one by its own."""
    assert tables.shown(EXAMPLES / "h200-issue40-s8" / "tp620") == "h200-issue40-s8/tp620"
    assert tables.shown(EXAMPLES / "h200-optimize") == "h200-optimize"
    assert tables.source(EXAMPLES / "h200-issue40-s8" / "tp620", "NVIDIA H200", "x").startswith(
        "Evidence: `runs/examples/h200-issue40-s8/tp620/` (NVIDIA H200; x)")
