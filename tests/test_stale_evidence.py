"""README figures whose code has changed since are labelled stale (issue 37): ``scripts/provenance.py``
on the repository's README (skipped, with the reason, where the git history is missing: a shallow
clone), and on a small git repository built here, where a commit to the kernels after the evidence's
code makes its table stale."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import provenance  # noqa: E402  (scripts/provenance.py)


@pytest.fixture
def prov():
    return provenance


def test_the_readme_pages_label_every_stale_table(prov):
    from readme_tables import FILES     # the pages that hold generated tables (scripts/, on the path)

    missing = prov.history_missing(ROOT)
    if missing:
        pytest.skip(missing)
    assert {name: prov.check((ROOT / name).read_text(), ROOT / "runs" / "examples", ROOT) for name in FILES} == {
        name: [] for name in FILES}


def test_every_code_commit_the_evidence_names_is_in_the_history(prov):
    missing = prov.history_missing(ROOT)
    if missing:
        pytest.skip(missing)
    examples = ROOT / "runs" / "examples"
    codes = {e["code"] for d in examples.iterdir() if d.is_dir() for e in prov.provenance(d)}
    assert codes
    for code in sorted(codes):
        prov.changed_since(ROOT, code)      # ValueError for a commit the history does not hold


def _git(repo: Path, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid",
                           *args], capture_output=True, text=True, check=True).stdout.strip()


def _commit(repo: Path, files: dict, message: str) -> str:
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", message)
    return _git(repo, "rev-parse", "--short=7", "HEAD")


TABLE = "<!-- generated: ladder f -->\n| a table |\n<!-- end generated -->\n"


def test_a_kernel_change_after_the_evidence_makes_its_table_stale(prov, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    code = _commit(repo, {"src/harness/kernels/k.py": "A = 1\n", "src/harness/variants/v.py": "B = 1\n"}, "code")
    _commit(repo, {"runs/examples/f/README.md": f"# f\n\nProvenance: no manifest, code {code}. Ran here.\n",
                   "README.md": f"# r\n\n{TABLE}\nmore\n"}, "evidence")
    examples = repo / "runs" / "examples"
    assert prov.provenance(examples / "f") == [{"path": None, "recorded": None, "dirty": None, "code": code}]
    readme = (repo / "README.md").read_text()
    assert prov.check(readme, examples, repo) == []                  # nothing it ran has changed
    _commit(repo, {"docs.md": "words\n"}, "docs only")
    assert prov.check(readme, examples, repo) == []
    label = f"*Stale: evidence from {code}; kernels changed since.*"
    assert prov.check(readme.replace(TABLE, TABLE + label + "\n"), examples, repo) == [
        f"generated block 'ladder f': not stale, but labelled '{label}'"]
    _commit(repo, {"src/harness/kernels/k.py": "A = 2\n"}, "kernel change")
    assert prov.check(readme, examples, repo) == [
        f"generated block 'ladder f': stale, needs the line '{label}' after it"]
    written = prov.write(readme, examples, repo)
    assert written == readme.replace(TABLE, TABLE + label + "\n") and prov.check(written, examples, repo) == []
    _commit(repo, {"src/harness/variants/v.py": "B = 2\n"}, "variant change")
    both = f"*Stale: evidence from {code}; kernels and variants changed since.*"
    assert prov.check(written, examples, repo) == [
        f"generated block 'ladder f': its label '{label}' should be '{both}'"]
    assert prov.write(written, examples, repo) == readme.replace(TABLE, TABLE + both + "\n")


def test_missing_history_is_named_not_checked(prov, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    _commit(repo, {"a.txt": "1\n"}, "one")
    _commit(repo, {"a.txt": "2\n"}, "two")
    assert prov.history_missing(repo) is None
    shallow = tmp_path / "shallow"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{repo}", str(shallow)], check=True,
                   capture_output=True)
    assert prov.history_missing(shallow) == (f"{shallow} is a shallow clone: the commits the evidence names may "
                                             "be missing (git fetch --unshallow gives the whole history)")
    plain = tmp_path / "plain"
    plain.mkdir()
    assert prov.history_missing(plain) == (f"{plain} is not a git checkout (or git is missing): no history to "
                                           "date the evidence against")
    assert prov.main(["--repo", str(shallow), "--readme", str(shallow / "README.md")]) == 0


def test_a_run_folder_inside_an_evidence_folder_takes_its_own_manifests_code(prov, tmp_path):
    """A block over ``evidence/run`` is dated by the Provenance entries of ``evidence/README.md`` that
    name manifests under ``run/`` (not the folder's other runs); a top-level folder by all of its
    entries; a folder with no README above it names no code."""
    ev = tmp_path / "examples" / "ev"
    ev.mkdir(parents=True)
    (ev / "README.md").write_text("# x\n\nProvenance: `a/manifest.json` records 1111111 (clean), code 1111111; "
                                  "`b/manifest.json` records 2222222 (clean), code 2222222; `ab/manifest.json` "
                                  "records 3333333 (clean), code 3333333.\n")
    examples = tmp_path / "examples"
    assert prov.codes_of(examples, "ev") == ["1111111", "2222222", "3333333"]
    assert prov.codes_of(examples, "ev/a") == ["1111111"]
    assert prov.codes_of(examples, "ev/b") == ["2222222"]
    assert prov.codes_of(examples, "other/a") == []
