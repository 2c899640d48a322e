"""The committed evidence holds no efficiency above 100%: every CSV under runs/examples with an
efficiency, MFU, MBU or request-efficiency column (roofline.csv, sweep summaries) has each value
at or below 1.0; a value above it is left empty and kept in the row's ``above_ceiling`` note."""
from pathlib import Path

import pandas as pd
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "runs" / "examples"
PATTERN = ("efficiency", "mfu", "mbu", "eff_request")


def _efficiency_columns(columns) -> list:
    return [c for c in columns if c.startswith(PATTERN) and not c.endswith("_bytes")]


def _csvs() -> list:
    return sorted(p for p in EXAMPLES.rglob("*.csv") if _efficiency_columns(pd.read_csv(p, nrows=0).columns))


def test_the_walk_finds_the_roofline_files():
    found = {p.relative_to(EXAMPLES).as_posix() for p in _csvs()}
    assert {"h100-optimize/roofline.csv", "h200-optimize/roofline.csv", "h200-crop_mode/roofline.csv",
            "h200x2-sweep/gpus1/summary.csv"} <= found
    assert all(p.name in ("roofline.csv", "summary.csv") for p in _csvs())


@pytest.mark.parametrize("path", _csvs(), ids=lambda p: p.relative_to(EXAMPLES).as_posix())
def test_no_committed_efficiency_above_one(path):
    t = pd.read_csv(path)
    for c in _efficiency_columns(t.columns):
        over = t[pd.to_numeric(t[c]) > 1.0]
        assert not len(over), f"{c} above 1.0 in rows {over.index.tolist()}"
