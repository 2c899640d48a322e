"""README.md and its docs/ pages (issue 38: a README that fits on a page, its sections in docs/).

The result tables come from the committed evidence (issue 22 item 8): ``scripts/readme_tables.py --check``
passes on the repository and fails when a figure of a page or an evidence file changes; only the pages it
lists (``FILES``) hold generated tables; batches of copies are marked superseded and an efficiency above
100% is flagged, never printed."""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "runs" / "examples"
README = ROOT / "README.md"
#: README.md and every page under docs/: where generated blocks are looked for
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

