"""The one Markdown table writer: every table the harness writes (run report, analytic docs and
static report, ncu/nsys reports, call-graph views, compare and sweep summaries) goes through
``table``.

A table is a header row, an alignment row (``---`` left, ``---:`` right; by default the first
column left and the rest right) and one row per record; a ``|`` inside a cell is escaped so it
cannot split the cell. Cells are written as given (formatting numbers is the caller's: the run
report's column registry, ``harness.report.columns``). This module imports nothing from the package.
"""
from __future__ import annotations

from typing import Optional, Sequence

LEFT, RIGHT = "---", "---:"


def cell(value) -> str:
    """A cell's text: ``str(value)`` with ``|`` escaped."""
    return str(value).replace("|", "\\|")


def table(header: Sequence, rows: Sequence[Sequence], align: Optional[Sequence[str]] = None) -> list:
    """Lines of a Markdown table (no trailing blank line). ``align``: one of ``LEFT``/``RIGHT`` per
    column, default the first column left and the others right."""
    align = list(align) if align is not None else [LEFT] + [RIGHT] * (len(header) - 1)
    out = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "|".join(align) + "|"]
    out += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return out


__all__ = ["table", "cell", "LEFT", "RIGHT"]
