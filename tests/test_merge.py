"""``python -m harness merge``: two real tiny runs of one split ladder (``best`` at batch 1 in one
process, ``best-b8`` in the next, as a GPU ladder is split across device calls) become one run
directory whose report, written by the one report writer, has the batched row's ratios against the
best batch-1 row; every refusal is one line, exit 2, and leaves nothing behind.

The optimize experiment's ``best`` knobs (CUDA graphs, compile, prefill graphs, Triton GEMV and
decode attention, fused vision) need CUDA; the CPU runs here use the knobs of its ``static-grouped``
row under the names ``best`` / ``best-b8``: the ladder section and its ratios need only a case that
runs otherwise than vendor-style, and pick the best batch-1 row by its measured tok/s.
"""
from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from harness.schema import CASE_FILES

ROOT = Path(__file__).resolve().parents[1]
KNOBS = "{kv_cache: static, moe_impl: grouped}"
CASES = f"cases=[{{name: best, execution: {KNOBS}}}, {{name: best-b8, batch: 8, execution: {KNOBS}}}]"
SPLIT = {"split-1": "run.only=[best]", "split-2": "run.only=[best-b8]"}
REPEATS = 3


def _run(path: Path, only: str) -> Path:
    """One tiny run of the two-case ladder restricted to ``only``, in this process, into ``path``."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from harness.config import to_config
    from harness.run import run

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=[
            "model=tiny", "workload.mode={name: t, base_size: 128, image_size: 64, crop: true}",
            "workload.decode_tokens=4", f"measure.repeats={REPEATS}", "measure.warmup=0", CASES, only])
    GlobalHydra.instance().clear()
    return run(to_config(cfg), path, progress=lambda *_: None).path


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> dict:
    """{name: run directory} of the two halves of the ladder, run one after the other (the session's
    calibration cache, tests/conftest.py, gives both the same record)."""
    root = tmp_path_factory.mktemp("split")
    return {name: _run(root / name, only) for name, only in SPLIT.items()}


@pytest.fixture(scope="module")
def merged(split, tmp_path_factory) -> tuple:
    """(exit code, stdout, the merged directory) of ``merge split-1 split-2 --out merged``."""
    import contextlib
    import io

    from harness.cli import main

    out = tmp_path_factory.mktemp("merged") / "merged"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["merge", str(split["split-1"]), str(split["split-2"]), "--out", str(out)])
    return rc, buf.getvalue(), out


def _rows(path: Path) -> tuple:
    """(header, data rows) of a CSV, read with the csv module."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], rows[1:]


def _median_low(values: list) -> float:
    """The lower median (the middle value of an odd count): what the ladder's ratios divide."""
    return sorted(values)[(len(values) - 1) // 2]


def _timed(path: Path, case: str, column: str) -> list:
    """``column`` of ``case``'s request-stage rows of the timed repeats in a stages.csv."""
    header, rows = _rows(path)
    at = {c: i for i, c in enumerate(header)}
    return [float(r[at[column]]) for r in rows
            if r[at["case"]] == case and r[at["stage"]] == "request" and r[at["profiled"]] == "False"]


def _ratio_cells(report: Path, case: str) -> list:
    """The cells of ``case``'s row in the report's "### Ratios" table (case, execution, routing, batch,
    speed-up, kernel-busy ratio, span ratio, throughput vs best batch 1, time per token vs best batch 1)."""
    section = report.read_text().split("### Ratios")[1]
    row = next(ln for ln in section.splitlines() if ln.startswith(f"| {case} |"))
    return [c.strip() for c in row.strip("|").split("|")]


# ------------------------------------------------------------------------------ the merged run

def test_merge_concatenates_the_observations_in_order(split, merged):
    rc, out_text, out = merged
    assert rc == 0 and f"merged 2 runs (2 cases) into {out}" in out_text
    a, b = split["split-1"], split["split-2"]
    for name in CASE_FILES:
        present = [p / name for p in (a, b) if (p / name).is_file()]
        if not present:
            assert not (out / name).exists()
            continue
        header, rows = _rows(out / name)
        expected = []
        for p in present:
            h, r = _rows(p)
            assert h == header
            expected += r
        assert rows == expected, name          # every row of both, A's first, as written
    _, sa = _rows(a / "stages.csv")
    _, sb = _rows(b / "stages.csv")
    # one row per request x stage; split-1: 3 timed repeats of best; split-2: of best-b8
    assert len(_rows(out / "stages.csv")[1]) == len(sa) + len(sb) and len(sa) > REPEATS and len(sb) > REPEATS
    # every CSV a source holds is in the merged directory (a new per-case file would be missing here)
    for p in (a, b):
        assert {f.name for f in p.glob("*.csv")} <= {f.name for f in out.glob("*.csv")}


def test_merged_manifest_lists_both_runs(split, merged):
    _, _, out = merged
    man = json.loads((out / "manifest.json").read_text())
    srcs = [json.loads((split[n] / "manifest.json").read_text()) for n in SPLIT]
    assert [c["name"] for c in man["cases"]] == ["best", "best-b8"]
    assert [c["source_run"] for c in man["cases"]] == ["split-1", "split-2"]
    assert man["status"] == "complete" and man["error"] is None
    assert [(s["run"], s["status"], s["cases"], s["revision"], s["started"], s["finished"])
            for s in man["merged_from"]] == [(n, "complete", [c], m["git"]["revision"], m["started"], m["finished"])
                                             for n, c, m in zip(SPLIT, ["best", "best-b8"], srcs)]
    assert man["warnings"][:len(srcs[0]["warnings"])] == [f"split-1: {w}" for w in srcs[0]["warnings"]]
    assert set(man["timing"]) == set(SPLIT) and man["timing"]["split-2"] == srcs[1]["timing"]
    assert man["started"] == srcs[0]["started"] and man["finished"] == srcs[1]["finished"]


def test_merged_report_says_so_and_has_both_cases(merged):
    _, _, out = merged
    md = (out / "report.md").read_text()
    head = md.split("## Headline")[0]
    assert "Merged from 2 runs on one machine: split-1, split-2 (" in head
    headline = md.split("## Headline")[1].split("\n\n")[1]         # the first table: one row per case
    assert [ln.split("|")[1].strip() for ln in headline.splitlines()[2:]] == ["best", "best-b8"]
    for name in ("headline.csv", "roofline.csv", "roofline.png", "ladder.png"):
        assert (out / name).is_file(), name
    assert not [p for p in out.parent.iterdir() if p.name != "merged"]     # no temporary directory left


def test_batched_row_is_compared_with_the_best_batch1_row_of_the_other_run(split, merged):
    """split-2's own report has no batch-1 row: its best-b8 ratios are dashes. In the merged report
    best-b8's throughput and time per token are divided by best's (the only batch-1 row): the lower
    medians of the 3 timed repeats' decode tok/s and TPOT p50, read from the two stages.csv."""
    _, _, out = merged
    a, b = split["split-1"] / "stages.csv", split["split-2"] / "stages.csv"
    tput = _median_low(_timed(b, "best-b8", "decode_tok_s")) / _median_low(_timed(a, "best", "decode_tok_s"))
    tpot = _median_low(_timed(b, "best-b8", "tpot_p50_ms")) / _median_low(_timed(a, "best", "tpot_p50_ms"))
    assert len(_timed(b, "best-b8", "decode_tok_s")) == REPEATS
    alone = _ratio_cells(split["split-2"] / "report.md", "best-b8")
    assert alone[7:] == ["–", "–"]
    cells = _ratio_cells(out / "report.md", "best-b8")
    assert cells[:4] == ["best-b8", "static KV + grouped MoE (torch)", "weights", "8"]
    assert cells[7].startswith(f"{tput:.2f}x [") and cells[8].startswith(f"{tpot:.2f}x [")
    assert "best batch-1 row of the batched comparisons: `best`" in (out / "report.md").read_text()


# ------------------------------------------------------------------------------ refusals

def _copy(src: Path, dst: Path, **edits) -> Path:
    """A copy of the run ``src`` at ``dst`` with manifest fields replaced (``a__b=v``: manifest["a"]["b"] = v)."""
    shutil.copytree(src, dst)
    man = json.loads((dst / "manifest.json").read_text())
    for key, value in edits.items():
        *parents, leaf = key.split("__")
        d = man
        for p in parents:
            d = d.setdefault(p, {})
        d[leaf] = value
    (dst / "manifest.json").write_text(json.dumps(man))
    return dst


def _refused(capsys, tmp_path, argv: list) -> list:
    """The stderr lines of ``merge argv`` after checking it exits 2 and leaves ``tmp_path/out``'s
    folder as it was (no --out, no temporary directory)."""
    from harness.cli import main

    before = sorted(p.name for p in tmp_path.iterdir())
    try:
        rc = main(["merge", *argv])
    except SystemExit as exc:
        rc = exc.code
    assert rc == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


def test_runs_of_another_revision_are_refused(split, tmp_path, capsys):
    rev = json.loads((split["split-2"] / "manifest.json").read_text())["git"]["revision"]
    other = _copy(split["split-2"], tmp_path / "other-rev", git__revision="0" * 40)
    err = _refused(capsys, tmp_path, [str(split["split-1"]), str(other), "--out", str(tmp_path / "out")])
    assert err == [f"error: split-1 and other-rev differ in git.revision ({rev!r} vs '{'0' * 40}'), so their numbers "
                   "are not comparable; fix: merge runs of one harness revision (rerun the odd one out from the "
                   "others' checkout)"]


def test_runs_of_another_calibration_record_are_refused(split, tmp_path, capsys):
    """The same record, found cached by both runs, carries the same ``measured`` time (the session's
    test record has none: the copies get one each)."""
    cal = json.loads((split["split-1"] / "manifest.json").read_text())["calibration"]
    assert cal == json.loads((split["split-2"] / "manifest.json").read_text())["calibration"]
    first = _copy(split["split-1"], tmp_path / "first", calibration={**cal, "measured": "2026-11-26T10:00:00+00:00"})
    later = _copy(split["split-2"], tmp_path / "later", calibration={**cal, "measured": "2026-11-26T11:00:00+00:00"})
    err = _refused(capsys, tmp_path, [str(first), str(later), "--out", str(tmp_path / "out")])
    fix = ("merge runs of one machine session: back-to-back runs find the same cached calibration record (rerun the "
           "odd one out there, without clearing the calibration cache)")
    assert err == ["error: first and later differ in calibration.measured ('2026-11-26T10:00:00+00:00' vs "
                   f"'2026-11-26T11:00:00+00:00'), so their numbers are not comparable; fix: {fix}"]
    none = _copy(split["split-2"], tmp_path / "uncalibrated",
                 calibration={"status": "not calibrated", "reason": "hardware.calibrate=false"})
    err = _refused(capsys, tmp_path, [str(first), str(none), "--out", str(tmp_path / "out")])
    assert err == ["error: first and uncalibrated differ in calibration (the record measured 2026-11-26T10:00:00+00:00 "
                   f"vs no record: not calibrated), so their numbers are not comparable; fix: {fix}"]


def test_runs_of_other_devices_or_settings_are_refused(split, tmp_path, capsys):
    gpu = _copy(split["split-2"], tmp_path / "gpu", device__name="NVIDIA H100 80GB HBM3")
    err = _refused(capsys, tmp_path, [str(split["split-1"]), str(gpu), "--out", str(tmp_path / "out")])
    assert err == ["error: split-1 and gpu differ in device.name (absent vs 'NVIDIA H100 80GB HBM3'), so their "
                   "numbers are not comparable; fix: merge runs measured on the same GPU of one machine"]
    more = _copy(split["split-2"], tmp_path / "more", measure__repeats=REPEATS + 7)
    err = _refused(capsys, tmp_path, [str(split["split-1"]), str(more), "--out", str(tmp_path / "out")])
    assert err == [f"error: split-1 and more differ in measure.repeats ({REPEATS} vs {REPEATS + 7}), so their numbers "
                   "are not comparable; fix: rerun the odd one out with the others' settings (only the cases, "
                   "run.only, may differ)"]


def test_the_clock_nvidia_smi_saw_is_not_a_difference():
    from harness.report.merge import first_difference

    def gpu(sm, driver="550.54"):
        return {"device": {"name": "NVIDIA H100 80GB HBM3", "nvidia_smi": {"driver_version": driver,
                                                                           "clocks.sm": sm, "clocks.max.sm": "1980"}}}
    assert first_difference(gpu("345 MHz"), gpu("1980 MHz")) is None
    assert first_difference(gpu("345 MHz"), gpu("345 MHz", "560.1")) == ("device.nvidia_smi.driver_version",
                                                                          "'550.54'", "'560.1'")


def test_a_case_in_two_runs_is_refused(split, tmp_path, capsys):
    again = _copy(split["split-1"], tmp_path / "again")
    err = _refused(capsys, tmp_path, [str(split["split-1"]), str(split["split-2"]), str(again),
                                      "--out", str(tmp_path / "out")])
    assert err == [f"error: case 'best' is in both {split['split-1']} and {again}; fix: merge runs of different "
                   "cases (run.only=[...] splits an experiment)"]


def test_an_existing_or_missing_out_is_refused(split, tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    runs = [str(split["split-1"]), str(split["split-2"])]
    assert _refused(capsys, tmp_path, [*runs, "--out", str(tmp_path / "taken")]) == [
        f"error: --out {tmp_path / 'taken'} already exists; fix: give --out a new directory (merge never writes into "
        "an existing one)"]
    assert _refused(capsys, tmp_path, runs) == [
        "error: --out is missing; fix: name the new directory for the merged run: --out runs/<name>"]


def test_what_is_not_a_run_is_refused(split, tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    out = str(tmp_path / "out")
    assert _refused(capsys, tmp_path, [str(split["split-1"]), str(tmp_path / "notes"), "--out", out]) == [
        f"error: {tmp_path / 'notes'} has no manifest.json, so it is not a run directory; fix: give run directories "
        "written by `python -m harness run` (each holds manifest.json)"]
    empty = _copy(split["split-2"], tmp_path / "empty")
    (empty / "stages.csv").unlink()
    assert _refused(capsys, tmp_path, [str(split["split-1"]), str(empty), "--out", out]) == [
        f"error: {empty} has no stages.csv: it measured no case; fix: merge only runs that measured a case "
        f"(leave {empty} out)"]
    going = _copy(split["split-2"], tmp_path / "going", status="running")
    assert _refused(capsys, tmp_path, [str(split["split-1"]), str(going), "--out", out]) == [
        f"error: {going} has status running: it is still going, or its process was killed before it closed it; fix: "
        "merge it once it has ended (complete, failed or interrupted)"]
    assert _refused(capsys, tmp_path, [str(split["split-1"]), "--out", out]) == [
        "error: merge needs at least two run directories, got 1; fix: name two or more: python -m harness merge "
        "RUN_A RUN_B [...] --out DIR"]


def test_a_failure_while_writing_leaves_nothing(split, tmp_path, monkeypatch):
    from harness.report import merge

    def broken(*args, **kwargs):
        raise RuntimeError("report writer broke")

    monkeypatch.setattr(merge, "write_report", broken)
    with pytest.raises(RuntimeError, match="report writer broke"):
        merge.merge_runs([split["split-1"], split["split-2"]], tmp_path / "new" / "out")
    assert list(tmp_path.iterdir()) == []       # neither --out, nor its temporary sibling, nor the parent made


def test_an_interrupted_source_keeps_its_mark(split, tmp_path):
    """A source that ended early makes the merged run say so: its status, its error after its name,
    and a case it cut short keeps ``partial``."""
    from harness.report.merge import merged_manifest
    from harness.rundir import load_run

    cut = _copy(split["split-2"], tmp_path / "cut", status="interrupted", error="interrupted by SIGTERM during case "
                "best-b8 (1 of 1), repeat=2", stopped_at={"phase": "case", "case": "best-b8"})
    man = json.loads((cut / "manifest.json").read_text())
    man["cases"][0].update(partial=True, repeats_done=2, repeats_planned=REPEATS)
    (cut / "manifest.json").write_text(json.dumps(man))
    got = merged_manifest([load_run(split["split-1"]), load_run(cut)], [])
    assert got["status"] == "interrupted"
    assert got["error"] == "cut: interrupted by SIGTERM during case best-b8 (1 of 1), repeat=2"
    assert got["stopped_at"] == {"run": "cut", "phase": "case", "case": "best-b8"}
    assert [(c["name"], c.get("partial")) for c in got["cases"]] == [("best", None), ("best-b8", True)]
    assert [s["status"] for s in got["merged_from"]] == ["complete", "interrupted"]
