"""The committed evidence holds no efficiency above 100%: every CSV under runs/examples with an
efficiency, MFU, MBU or request-efficiency column (roofline.csv, sweep summaries, a multi-GPU run's
scaling.csv) has each value at or below 1.0; a value above it is left empty and kept in the row's
``above_ceiling`` note. No
committed report (``report.md`` and the source reports beside it) prints a percentage above 100%
except inside a flag: ``above the ceiling (x%): ...`` (``harness.roofline.flags.ABOVE_CEILING``) or a
caveat's ``<column> x%: check ...``. Every folder's README.md says which commit's code ran it and
what each of its manifests records (its Provenance paragraph, ``scripts/provenance.py``), and that is
what the manifests record."""
import json
import re
import sys
from pathlib import Path

import pandas as pd
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "runs" / "examples"
sys.path.insert(0, str(EXAMPLES.parents[1] / "scripts"))
import provenance as PROVENANCE  # noqa: E402  (scripts/provenance.py)

PATTERN = ("efficiency", "mfu", "mbu", "eff_request")


def _efficiency_columns(columns) -> list:
    return [c for c in columns if c.startswith(PATTERN) and not c.endswith("_bytes")]


def _csvs() -> list:
    return sorted(p for p in EXAMPLES.rglob("*.csv") if _efficiency_columns(pd.read_csv(p, nrows=0).columns))


def test_the_walk_finds_the_roofline_files():
    found = {p.relative_to(EXAMPLES).as_posix() for p in _csvs()}
    assert {"h100-optimize/roofline.csv", "h200-optimize/roofline.csv", "h200-crop_mode/roofline.csv",
            "h200x2-sweep/gpus1/summary.csv"} <= found
    def bench_table(p):   # a `python -m harness bench` run's table (its manifest names the bench)
        man = p.parent / "manifest.json"
        return man.is_file() and bool(json.loads(man.read_text()).get("bench"))

    assert all(p.name in ("roofline.csv", "summary.csv", "scaling.csv") or bench_table(p) for p in _csvs())


@pytest.mark.parametrize("path", _csvs(), ids=lambda p: p.relative_to(EXAMPLES).as_posix())
def test_no_committed_efficiency_above_one(path):
    t = pd.read_csv(path)
    for c in _efficiency_columns(t.columns):
        over = t[pd.to_numeric(t[c]) > 1.0]
        assert not len(over), f"{c} above 1.0 in rows {over.index.tolist()}"


#: a percentage in a report; one above 100 must sit inside a flag
PERCENT = re.compile(r"(?<![\d.,])(\d{1,3}(?:,\d{3})*(?:\.\d+)?)%")
FLAGGED = re.compile(r"above the ceiling \([\d.,]+%\)|\b\w+ [\d.,]+%: check\b")


def unflagged_above_100(text: str) -> list:
    """(line number, percentage) of every percentage above 100% that no flag holds."""
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        rest = FLAGGED.sub("", line)
        out += [(i, m.group(0)) for m in PERCENT.finditer(rest) if float(m.group(1).replace(",", "")) > 100]
    return out


def test_the_report_check_finds_an_unflagged_figure():
    assert unflagged_above_100("| a | 98.4% / 109.7% | 1,234.5% |\n| b | 100.0% |") == [(1, "109.7%"), (1, "1,234.5%")]
    assert unflagged_above_100("| a | 98.4% / above the ceiling (109.7%): bytes, FLOPs or ceiling wrong |") == []
    assert unflagged_above_100("- flagged: best/prefill: efficiency 178.4%: check the analytic bytes") == []


@pytest.mark.parametrize("path", sorted(p for p in EXAMPLES.rglob("*.md") if p.name != "README.md"),
                         ids=lambda p: p.relative_to(EXAMPLES).as_posix())
def test_no_committed_report_prints_an_efficiency_above_100_percent(path):
    assert unflagged_above_100(path.read_text()) == []


@pytest.mark.parametrize("folder", sorted(d for d in EXAMPLES.iterdir() if d.is_dir()), ids=lambda d: d.name)
def test_every_folder_names_its_code_and_what_its_manifests_record(folder):
    entries = PROVENANCE.provenance(folder)
    assert entries, f"{folder.name}/README.md has no Provenance paragraph naming the code that ran"
    listed = [e["path"] for e in entries if e["path"] is not None]
    assert sorted(listed) == PROVENANCE.manifests(folder)
    if not listed:
        assert len(entries) == 1, "one 'no manifest, code REV' where the folder has no manifest"
    for e in entries:
        if e["path"] is None:
            continue
        revision, dirty = PROVENANCE.recorded(folder / e["path"])
        assert (e["recorded"], e["dirty"]) == (revision, dirty), e["path"]
        if dirty is False:     # a clean tree is its commit
            assert e["code"].startswith(revision), e["path"]


def test_the_provenance_paragraph_is_read_as_written(tmp_path):
    (tmp_path / "README.md").write_text(
        "# x\n\nProvenance: `manifest.json` records 98112bd (dirty), code 5fca539; `a/manifest.json` records\n"
        "no revision, code fb8a6c2; `b/child_manifest.json` records 1710d61 (clean), code 1710d61. Why.\n\n"
        "Later: `c/manifest.json` records 0000000 (clean), code 0000000 (not the paragraph).\n")
    assert PROVENANCE.provenance(tmp_path) == [
        {"path": "manifest.json", "recorded": "98112bd", "dirty": True, "code": "5fca539"},
        {"path": "a/manifest.json", "recorded": None, "dirty": None, "code": "fb8a6c2"},
        {"path": "b/child_manifest.json", "recorded": "1710d61", "dirty": False, "code": "1710d61"}]
