"""Which commit produced each committed evidence folder, and which README tables its code has changed since.

Every folder under runs/examples/ says, in a paragraph of its README.md that starts with
``Provenance``, what each of its manifests records (``git`` in manifest.json: the revision and the
dirty flag) and which commit's code ran:

    Provenance: `manifest.json` records 98112bd (dirty), code 5fca539. <why the two differ>
    Provenance: no manifest, code 2291b55. <...>

``code`` is the commit whose tree holds the code that ran; a run that started before its code was
committed names the commit that committed it, and the paragraph says so. ``provenance(folder)``
reads the paragraph back (``tests/test_evidence.py`` checks it against the manifests).

The generated tables of README.md's pages (``<!-- generated: KIND FOLDER ... -->`` in the files of
``readme_tables.FILES``, ``scripts/readme_tables.py``) show the figures of one folder each. Those
figures are stale when a commit after the folder's code changed what produced them: a file under
``PRODUCERS`` (the Triton kernels, the execution variants), by ``git log CODE..HEAD -- PATH``. A stale table is followed, on the line after its
``<!-- end generated -->``, by its label (``stale_label``)

    *Stale: evidence from f4e3eba; kernels and variants changed since.*

and a table that is not stale has none, so no figure is presented as today's when its code is not.

    python scripts/provenance.py            # exit 1, naming each table whose label is missing or wrong
    python scripts/provenance.py --write    # put the labels in (and take the wrong ones out)
    python scripts/provenance.py --file docs/throughput.md    # only this file (repeatable)

It needs the repository's history: in a shallow clone, or outside a git checkout, it says why and
checks nothing (``history_missing``; exit 0).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))   # readme_tables, beside this script

#: what produces a generated table's figures: {name in the label: path in the repository}
PRODUCERS = {"kernels": "src/harness/kernels", "variants": "src/harness/variants"}
PARAGRAPH = re.compile(r"^Provenance\b.*?(?=\n[ \t]*\n|\Z)", re.S | re.M)
ENTRY = re.compile(r"`(?P<path>[^`\s]*manifest\.json)` records (?P<recorded>[0-9a-f]{7}|no revision)"
                   r"(?: \((?P<state>dirty|clean)\))?, code (?P<code>[0-9a-f]{7,40})\b")
NO_MANIFEST = re.compile(r"\bno manifest, code (?P<code>[0-9a-f]{7,40})\b")
LABEL = re.compile(r"\*Stale: [^\n]*\*")


# ------------------------------------------------------------------------- the folders

def manifests(folder: Path) -> list:
    """The manifests under ``folder`` (``manifest.json``, ``*_manifest.json``), relative, sorted."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*manifest.json")
                  if p.name == "manifest.json" or p.name.endswith("_manifest.json"))


def recorded(manifest: Path) -> tuple:
    """(revision's first 7 characters or None, dirty flag or None) of a manifest's ``git``."""
    git = json.loads(manifest.read_text()).get("git") or {}
    rev = git.get("revision")
    return (rev[:7] if rev else None), git.get("dirty")


def provenance(folder: Path) -> list:
    """[{'path': manifest path or None ('no manifest'), 'recorded': 7 characters or None, 'dirty':
    True / False / None, 'code': commit}] of the Provenance paragraph of ``folder``'s README.md
    (module docstring); [] without README or paragraph."""
    readme = folder / "README.md"
    hit = PARAGRAPH.search(readme.read_text()) if readme.is_file() else None
    if hit is None:
        return []
    text = " ".join(hit.group(0).split())
    out = [{"path": m["path"], "recorded": None if m["recorded"] == "no revision" else m["recorded"],
            "dirty": {"dirty": True, "clean": False}.get(m["state"]), "code": m["code"]}
           for m in ENTRY.finditer(text)]
    return out + [{"path": None, "recorded": None, "dirty": None, "code": m["code"]} for m in NO_MANIFEST.finditer(text)]


# ----------------------------------------------------------------------------- history

def _git(repo: Path, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def history_missing(repo: Path) -> Optional[str]:
    """Why the history the check needs is not in ``repo`` (None when it is there)."""
    try:
        shallow = _git(repo, "rev-parse", "--is-shallow-repository")
    except (OSError, subprocess.CalledProcessError):
        return f"{repo} is not a git checkout (or git is missing): no history to date the evidence against"
    if shallow == "true":
        return (f"{repo} is a shallow clone: the commits the evidence names may be missing "
                "(git fetch --unshallow gives the whole history)")
    return None


def changed_since(repo: Path, rev: str) -> list:
    """The ``PRODUCERS`` (names) that a commit after ``rev`` (up to HEAD) touched; ValueError for an
    unknown commit."""
    try:
        _git(repo, "cat-file", "-e", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError:
        raise ValueError(f"commit {rev} is not in this repository's history") from None
    return [name for name, path in PRODUCERS.items() if _git(repo, "log", "-1", "--format=%h", f"{rev}..HEAD", "--", path)]


def stale_label(revs: list, changed: list) -> str:
    """The line under a stale table: '*Stale: evidence from REV[, REV]; kernels and variants changed since.*'."""
    return f"*Stale: evidence from {', '.join(revs)}; {' and '.join(changed)} changed since.*"


# ------------------------------------------------------------------------------ tables

def _blocks(text: str) -> list:
    """(spec, end of its ``<!-- end generated -->`` line, its label or None) of every generated table."""
    from readme_tables import BLOCK

    out = []
    for m in BLOCK.finditer(text):
        end = m.end() + 1 if text[m.end():m.end() + 1] == "\n" else m.end()
        label = LABEL.match(text, end)
        out.append((m["spec"], end, label.group(0) if label else None))
    return out


def codes_of(examples: Path, folder: str) -> list:
    """The commits (7 characters, in order, once each) whose code made ``folder``'s figures: the
    Provenance entries of its README.md, or for a run folder inside an evidence folder
    (``h200-issue40-s8/tp620``) those of the evidence folder's README that name manifests under it."""
    parts = folder.split("/")
    for i in range(len(parts), 0, -1):
        top = examples.joinpath(*parts[:i])
        if (top / "README.md").is_file():
            sub = "/".join(parts[i:])
            entries = [e for e in provenance(top) if not sub or (e["path"] or "").startswith(sub + "/")]
            return list(dict.fromkeys(e["code"][:7] for e in entries))
    return []


def expected_label(spec: str, examples: Path, repo: Path, cache: Optional[dict] = None) -> Optional[str]:
    """The label table ``spec`` ("KIND FOLDER ...") needs under it, None when it is not stale;
    ValueError when its folder names no code."""
    cache = {} if cache is None else cache
    folder = spec.split()[1]
    revs = codes_of(examples, folder)
    if not revs:
        raise ValueError(f"runs/examples/{folder}/README.md has no Provenance paragraph naming its code")
    changed = set()
    for rev in revs:
        if rev not in cache:
            cache[rev] = changed_since(repo, rev)
        changed.update(cache[rev])
    return stale_label(revs, [n for n in PRODUCERS if n in changed]) if changed else None


def check(text: str, examples: Path, repo: Path) -> list:
    """One line per generated table whose label is missing, wrong or out of place."""
    problems, cache = [], {}
    for spec, _, label in _blocks(text):
        try:
            want = expected_label(spec, examples, repo, cache)
        except ValueError as exc:
            problems.append(f"generated block '{spec}': {exc}")
            continue
        if label != want:
            problems.append(f"generated block '{spec}': " + (f"stale, needs the line '{want}' after it" if want and
                            not label else f"its label '{label}' should be '{want}'" if want else
                            f"not stale, but labelled '{label}'"))
    return problems


def write(text: str, examples: Path, repo: Path) -> str:
    """``text`` with every generated table's label as ``expected_label`` has it."""
    cache, out, at = {}, [], 0
    for spec, end, label in _blocks(text):
        want = expected_label(spec, examples, repo, cache)
        out.append(text[at:end])
        at = end + (len(label) + 1 if label else 0)
        if want:
            out.append(want + "\n")
    return "".join(out) + text[at:]


def main(argv=None) -> int:
    from readme_tables import FILES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="put the labels into the files")
    ap.add_argument("--file", "--readme", dest="files", type=Path, action="append",
                    help="a file with generated tables (repeatable; default: every file of readme_tables.FILES)")
    ap.add_argument("--examples", type=Path, default=ROOT / "runs" / "examples")
    ap.add_argument("--repo", type=Path, default=ROOT)
    args = ap.parse_args(argv)
    missing = history_missing(args.repo)
    if missing:
        print(f"provenance: not checked: {missing}")
        return 0
    failed = False
    for path in args.files or [args.repo / name for name in FILES]:
        text = path.read_text()
        if args.write:
            new = write(text, args.examples, args.repo)
            if new != text:
                path.write_text(new)
            print(f"{path}: labels {'rewritten' if new != text else 'up to date'}")
            continue
        problems = check(text, args.examples, args.repo)
        for p in problems:
            print(f"{path}: {p}; run python scripts/provenance.py --write", file=sys.stderr)
        failed = failed or bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
