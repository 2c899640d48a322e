"""What the harness reads, copies and writes stays inside the directories it owns: no symbolic link
is followed out of them.

A run directory, a sweep, ``merge``'s staging directory and a ``--out`` folder hold what the
harness put there. A symbolic link inside one (left by a tool, a user, or planted) would carry a
copy or a write to wherever it points: ``merge`` would copy a file from outside into the merged
run, ``summarize`` would write its summary into another folder. So, before a verb copies or writes:

* ``refuse_links(root, *rels, what=...)``: ``root / rel`` and every folder between ``root`` and it
  must not be a link (``root`` itself is the directory the caller named or owns; parts that do not
  exist yet are fine: they will be made as real folders);
* ``refuse_links_under(root, rel, what=...)``: the same, and nothing below ``root / rel`` (walked
  without following links) is a link: for a folder about to be copied whole;
* ``refuse_out_links(out, names, what=...)``: a verb's output folder ``out`` is not a link, nor is
  any file ``names`` it writes there (``out``'s parent is where the user's path ends and the
  verb's begins: the parents are the user's, links included);
* ``copy_tree(src, dst)``: ``shutil.copytree`` that copies a link as a link, never what it points to
  (callers refuse links first; this is the second lock).

Each refusal is one ``HarnessError`` line (exit 2): the link, where it points, what refused it.
Nothing here imports more than the standard library and ``errors``, so the data side (merge,
summarize, compare) and the run directory (``harness.rundir``) share it.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from .errors import HarnessError

#: the fix of a link found inside a directory the harness reads or copies
LINK_FIX = "replace the link with a copy of what it points to, or remove it"
#: the fix of a link where a verb writes its output
OUT_FIX = "remove the link, or give --out a folder that is not one"


def link_error(path, what: str, fix: str = LINK_FIX) -> HarnessError:
    """The one-line refusal of the link ``path`` met by ``what`` (a verb, or ``the run``)."""
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return HarnessError(f"{path} is a symbolic link (to {target}); {what} reads, copies and writes only "
                        "regular files inside the directories it owns", fix)


def refuse_links(root, *rels, what: str, fix: str = LINK_FIX) -> None:
    """Refuse (``link_error``) ``root / rel`` for each of ``rels``, or a folder between ``root`` and
    it, that is a symbolic link. ``rels`` are relative paths (``"summary/summary.csv"``)."""
    root = Path(root)
    for rel in rels:
        path = root
        for part in Path(rel).parts:
            path = path / part
            if path.is_symlink():
                raise link_error(path, what, fix)


def refuse_links_under(root, rel, what: str, fix: str = LINK_FIX) -> None:
    """``refuse_links(root, rel)``, then every entry below ``root / rel`` (a folder about to be
    copied), walked without following links."""
    refuse_links(root, rel, what=what, fix=fix)
    for folder, dirs, files in os.walk(Path(root) / rel, followlinks=False):
        for name in sorted(dirs + files):
            if os.path.islink(os.path.join(folder, name)):
                raise link_error(Path(folder) / name, what, fix)


def refuse_out_links(out, names, what: str) -> None:
    """Refuse the output folder ``out`` or a file ``names`` in it that is a symbolic link."""
    out = Path(os.path.abspath(out))   # lexical: ".", "x/.." name their folder; no link is resolved
    refuse_links(out.parent, *(f"{out.name}/{name}" for name in names), what=what, fix=OUT_FIX)


def copy_tree(src, dst) -> None:
    """Copy the folder ``src`` to the new folder ``dst``; a link is copied as a link, never followed."""
    shutil.copytree(src, dst, symlinks=True)


__all__ = ["LINK_FIX", "OUT_FIX", "link_error", "refuse_links", "refuse_links_under", "refuse_out_links", "copy_tree"]
