"""``summarize`` on a hand-built multirun directory from the checked-in fixture runs: swept values
from each job's overrides, failed and never-started jobs listed, garbage refused."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from harness.errors import HarnessError
from harness.report.summarize import expected_jobs, summarize, summarize_main

RUNS = Path(__file__).resolve().parent / "data" / "runs"

MULTIRUN_YAML = """\
hydra:
  sweeper:
    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper
    max_batch_size: null
    params: null
  overrides:
    task:
    - model=tiny
    - workload.batch=1,2,4
"""


def _job(sweep: Path, name: str, fixture: str | None, overrides: list[str], **manifest) -> Path:
    d = sweep / name
    if fixture:
        shutil.copytree(RUNS / fixture, d)
    (d / ".hydra").mkdir(parents=True, exist_ok=True)
    (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if manifest:
        (d / "manifest.json").write_text(json.dumps(manifest))
    return d


@pytest.fixture
def sweep(tmp_path) -> Path:
    """multirun.yaml for 3 jobs: job 0 complete (two cases), job 1 failed, job 2 never started."""
    s = tmp_path / "multirun-20261126-000000-default"
    s.mkdir()
    (s / "multirun.yaml").write_text(MULTIRUN_YAML)
    _job(s, "0", "gpu_tiny_a", ["model=tiny", "workload.batch=1"])
    _job(s, "1-failed", None, ["model=tiny", "workload.batch=2"], status="failed",
         error="CUDA out of memory; fix: lower workload.batch", started="2026-11-26T00:00:01+00:00",
         finished="2026-11-26T00:00:09+00:00", device={"type": "cuda", "name": "NVIDIA H100 80GB HBM3"})
    (s / ".submitit").mkdir()                        # launcher clutter is not a job
    return s


def test_expected_jobs_come_from_multirun_yaml(sweep):
    jobs, why = expected_jobs(sweep)
    assert why == "" and [j[-1] for j in jobs] == ["workload.batch=1", "workload.batch=2", "workload.batch=4"]


def test_every_job_is_listed_with_its_status(sweep):
    df, info = summarize([sweep])
    assert info["swept"] == ["workload.batch"] and info["fixed"] == {"model": "tiny"}
    assert list(df["job"]) == ["0", "0", "1", "2"]                           # job 0 has two cases
    assert list(df["status"]) == ["complete", "complete", "failed", "not started"]
    assert list(df["workload.batch"]) == ["1", "1", "2", "4"]
    ok = df[df["status"] == "complete"].set_index("case")
    assert list(ok.index) == ["t-2x3", "nc"] and (ok["decode_tok_s"] > 0).all() and ok["sam_ms"].notna().all()
    assert ok.loc["t-2x3", "run_dir"] == "0"
    failed = df[df["status"] == "failed"].iloc[0]
    assert failed["run_dir"] == "1-failed" and failed["note"].startswith("CUDA out of memory")
    assert failed["wall_s"] == 8.0


def test_summarize_writes_table_markdown_and_plot(sweep, capsys):
    assert summarize_main([str(sweep)]) == 0
    out = sweep / "summary"
    df = pd.read_csv(out / "summary.csv")
    assert len(df) == 4 and (out / "summary.png").is_file()
    md = (out / "summary.md").read_text()
    assert "- status: 1 complete, 1 failed, 1 not started" in md and "swept: `workload.batch`" in md
    assert "job 1 (failed): CUDA out of memory" in md and "job 2 (not started)" in md
    assert "[harness] wrote" in capsys.readouterr().out


def test_run_directories_one_by_one(tmp_path):
    a, b = shutil.copytree(RUNS / "gpu_tiny_a", tmp_path / "a"), shutil.copytree(RUNS / "gpu_tiny_b", tmp_path / "b")
    df, info = summarize([a, b])
    assert info["sweep"] is None and info["swept"] == [] and set(df["job"]) == {"a", "b"}
    assert summarize_main([str(a), str(b), "--out", str(tmp_path / "s")]) == 0
    assert (tmp_path / "s" / "summary.csv").is_file()


def test_garbage_is_refused(tmp_path):
    with pytest.raises(HarnessError, match="not a directory"):
        summarize([tmp_path / "missing"])
    (tmp_path / "junk" / "x").mkdir(parents=True)
    with pytest.raises(HarnessError, match="no job directories") as err:
        summarize([tmp_path / "junk"])
    assert "fix: give a multirun directory" in str(err.value)
    with pytest.raises(HarnessError, match="neither manifest.json"):
        summarize([tmp_path / "junk", tmp_path / "junk" / "x"])


def test_per_step_counts_mbu_and_end_to_end_pages(tmp_path):
    """A committed GPU run (H200, the optimize ladder): its vendor-style row as the README's table shows
    it (42.9 tok/s, TPOT p50 21.116 ms, 1,184 kernels and 11 host syncs per decode step), its decode MBU
    and end-to-end pages/s as the run's own roofline.csv and headline.csv say."""
    run = Path(__file__).resolve().parent.parent / "runs" / "examples" / "h200-optimize"
    df, _ = summarize([run])
    row = df.set_index("case").loc["vendor-style"]
    assert round(row["decode_tok_s"], 1) == 42.9 and round(row["tpot_p50_ms"], 3) == 21.116
    assert row["kernels_per_step"] == 1184 and row["syncs_per_step"] == 11
    roof = pd.read_csv(run / "roofline.csv")
    dec = roof[(roof["case"] == "vendor-style") & (roof["stage"] == "decode") & (roof["level"] == "stage")].iloc[0]
    assert row["mbu_decode"] == pytest.approx(dec["mbu"]) and 0 < row["mbu_decode"] < 0.05
    assert row["ttft_e2e_ms"] > row["ttft_ms"] > 0          # preprocessing and copy come on top
    assert pd.isna(row["pages_s_e2e"])                      # this run's headline.csv predates the column
    assert pd.isna(row["preprocess_ms"])                    # no infer(): no preprocessing inside the request
    copy = shutil.copytree(run, tmp_path / "run")
    head = pd.read_csv(copy / "headline.csv")
    head["pages_s_e2e"] = [0.125 * (i + 1) for i in range(len(head))]
    head.to_csv(copy / "headline.csv", index=False)
    df, _ = summarize([copy])
    assert df.set_index("case").loc["vendor-style", "pages_s_e2e"] == 0.125 * (list(head["case"]).index("vendor-style") + 1)
