"""Stamp this checkout's git revision for a copy of its working tree on another machine (the lent
GPU), whose own git metadata can lag: run manifests there recorded an older revision than the code
they ran (``rundir.git_revision`` reads ``git rev-parse HEAD`` where the run happens).

    python scripts/device_stamp.py                    # here, before a device call: .devstamp/git.json
    eval "$(python3 scripts/device_stamp.py env)"     # there (scripts/device_setup.sh does it)

``stamp`` writes the revision, whether tracked files differ from it (dirty) and a digest of every
tracked file's content (sha256 of each path and content, in path order). ``env``, on the copy,
recomputes the digest over the same files: when it matches, it prints ``export`` lines of
``HARNESS_GIT_REVISION`` and ``HARNESS_GIT_DIRTY`` (``rundir.git_revision`` then records them, and
says so); when it does not (the tree changed after stamping, or the stamp was not carried), it
prints nothing and says why on stderr, and the manifest keeps that copy's own git metadata.
``.devstamp/`` is git-ignored: name it in the device call's ``carry``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

STAMP = Path(".devstamp") / "git.json"


def digest(root: Path, files: list) -> str:
    """sha256 over each file's path and content sha256, in the given order ('-' for a missing file)."""
    h = hashlib.sha256()
    for name in files:
        p = root / name
        h.update(name.encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).hexdigest().encode() if p.is_file() else b"-")
        h.update(b"\n")
    return h.hexdigest()


def stamp(root: Path) -> dict:
    from harness.rundir import checkout_revision     # (the git reading the manifests do; not their override)

    rev = checkout_revision(root)
    if rev["revision"] is None:
        raise SystemExit(f"device_stamp: no git revision at {root}: {rev.get('reason')}")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True, check=True).stdout
    files = sorted(f for f in listed.split("\0") if f)
    entry = {"revision": rev["revision"], "dirty": rev["dirty"], "files": files, "digest": digest(root, files)}
    out = root / STAMP
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(entry))
    return entry


def env(root: Path) -> str:
    """The export lines for a matching stamp, else '' (the reason on stderr)."""
    path = root / STAMP
    if not path.is_file():
        print(f"device_stamp: no {STAMP} here (carry it): manifests record this copy's own git metadata",
              file=sys.stderr)
        return ""
    entry = json.loads(path.read_text())
    if digest(root, entry["files"]) != entry["digest"]:
        print(f"device_stamp: the tracked files differ from the stamp of {entry['revision'][:12]} (stamped "
              "before a change?): not used", file=sys.stderr)
        return ""
    return f"export HARNESS_GIT_REVISION={entry['revision']}\nexport HARNESS_GIT_DIRTY={int(entry['dirty'])}\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="?", choices=("stamp", "env"), default="stamp")
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    args = ap.parse_args(argv)
    if args.what == "env":
        sys.stdout.write(env(args.root))
        return 0
    entry = stamp(args.root)
    print(f"{STAMP}: {entry['revision'][:12]}{' (dirty)' if entry['dirty'] else ''}, {len(entry['files'])} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
