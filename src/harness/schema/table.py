"""A run-directory CSV file kind: its name, its columns (name, unit, provenance, what it holds), its
writer and its reader. Every file kind of the run directory is one ``Table`` in its own module of
``harness.schema``; the code that writes or reads the file goes through it.

``provenance`` is one of ``PROVENANCES``: *measured* (CUDA events, the host clock or the profiler,
in the run), *analytic* (the cost model), *derived* (computed from the others), *setting* (what the
run was asked to do) or *label* (a key: case, stage, ...). ``unit`` is empty for a count or a label.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pandas as pd

PROVENANCES = ("measured", "analytic", "derived", "setting", "label")


@dataclass(frozen=True)
class Field:
    """One column of a run-directory file: ``name``, ``unit``, ``provenance`` (``PROVENANCES``), ``what``
    it holds; ``text``: read as text even where its values look like numbers (a grid '2x3', a module
    path)."""

    name: str
    unit: str = ""
    provenance: str = "label"
    what: str = ""
    text: bool = False

    def __post_init__(self):
        if self.provenance not in PROVENANCES:
            raise ValueError(f"column {self.name!r}: provenance {self.provenance!r} is not one of {PROVENANCES}")


def fields(spec: str) -> list:
    """``Field`` rows of a ``|``-separated table, one a line: name | unit | provenance | what (a
    backslash at a line's end joins it to the next); a name ending in ``:text`` is read as text."""
    out = []
    for row in spec.replace("\\\n", "").strip().splitlines():
        name, unit, prov, what = (cell.strip() for cell in row.split("|", 3))
        text = name.endswith(":text")
        out.append(Field(name[:-5] if text else name, unit, prov, what, text))
    return out


@dataclass(frozen=True)
class Table:
    """A CSV file of the run directory (module docstring). ``fields`` are its fixed columns, in order;
    ``open_columns`` says what columns may follow them (the routing tables' e0..eN), empty when none."""

    file: str
    fields: tuple
    open_columns: str = ""

    @property
    def columns(self) -> list:
        return [f.name for f in self.fields]

    def field(self, name: str) -> Field:
        return next(f for f in self.fields if f.name == name)

    @property
    def text_columns(self) -> dict:
        """{column: str} for ``pd.read_csv``'s ``dtype`` (the text fields)."""
        return {f.name: str for f in self.fields if f.text}

    def frame(self, rows) -> pd.DataFrame:
        """``rows`` (a frame, dicts, or tuples in the order of the fixed columns) with the fixed columns
        first, in order (missing ones empty), then the open ones as given."""
        if isinstance(rows, pd.DataFrame):
            df = rows
        else:
            rows = list(rows)
            df = pd.DataFrame(rows, columns=None if not rows or isinstance(rows[0], dict) else self.columns)
        return df.reindex(columns=self.columns + self._extra(df))

    def checked(self, rows) -> pd.DataFrame:
        """``rows`` as a frame: a frame as given (its columns must be in the schema), dicts or tuples
        through ``frame``."""
        if not isinstance(rows, pd.DataFrame):
            return self.frame(rows)
        self._extra(rows)
        return rows

    def _extra(self, df: pd.DataFrame) -> list:
        """``df``'s columns outside the schema; refused (ValueError) unless the table has open columns."""
        known = set(self.columns)
        extra = [c for c in df.columns if c not in known]
        if extra and not self.open_columns:
            raise ValueError(f"{self.file}: columns {extra} are not in its schema")
        return extra

    def write(self, rd, rows) -> Path:
        """Replace the file in run directory ``rd`` (a ``harness.rundir.RunDir``) with ``rows``
        (``checked``)."""
        return rd.write_csv(self.file, self.checked(rows))

    def append(self, rd, rows) -> Path:
        """Append ``rows`` (``checked``; every append to one file has the same columns) to the file in
        ``rd``, the header only when the file is new."""
        return rd.append_csv(self.file, self.checked(rows))

    def read(self, src, dtype: Optional[dict] = None) -> pd.DataFrame:
        """The file (a run directory, a path or a buffer) as a frame, text columns as text (or as
        ``dtype`` says); an empty frame for a missing or empty file."""
        if isinstance(src, (str, Path)):
            src = Path(src)
            if src.is_dir():
                src = src / self.file
            if not src.is_file() or src.stat().st_size == 0:
                return pd.DataFrame()
        return pd.read_csv(src, dtype=dtype or self.text_columns)


def table(file: str, spec: str, open_columns: str = "") -> Table:
    return Table(file, tuple(fields(spec)), open_columns)


__all__ = ["PROVENANCES", "Field", "Table", "fields", "table"]
