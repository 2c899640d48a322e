"""Report writing on checked-in run-directory fixtures (tests/data/runs, see make_fixtures.py),
compare on two fixture runs, and the run verb's report hook on the tiny model (CPU)."""
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness.errors import HarnessError
from harness.report.compare import compare_main, compare_runs
from harness.schema.stages import NotObservations
from harness.report.report import write_report
from harness.roofline.join import STAGES
from harness.schema.roofline import ROOFLINE_COLUMNS

DATA = Path(__file__).resolve().parent / "data" / "runs"
H100_CAL = {"device_name": "NVIDIA H100 80GB HBM3", "gemm_tflops": 790.0, "copy_gbs": 3000.0, "gemm_dtype": "bf16"}


def _copy(name, tmp_path) -> Path:
    dst = tmp_path / name
    shutil.copytree(DATA / name, dst)
    return dst


def test_report_on_gpu_fixture_exact(tmp_path, cache):
    (cache / "calibration-nvidia-h100-80gb-hbm3.json").write_text(json.dumps(H100_CAL))
    run = _copy("gpu_tiny_a", tmp_path)
    paths = write_report(run, strict=True)
    for f in ("analytic.csv", "roofline.csv", "roofline.png", "report.md"):
        assert (run / f).is_file() and (run / f).stat().st_size > 0
    assert set(paths) == {"analytic", "roofline", "plot", "report", "headline", "breakdown", "stages_summary"}
    rl = pd.read_csv(run / "roofline.csv")
    assert list(rl.columns) == ROOFLINE_COLUMNS
    st = rl[rl["level"] == "stage"]
    assert sorted(st["stage"].unique()) == sorted(STAGES + ("request",)) and len(st) == 2 * 6
    # exact: decode of 'nc' against the H100 SXM datasheet (989.4 TFLOP/s, 3350 GB/s) and calibration
    an = pd.read_csv(run / "analytic.csv")
    tot = an[(an["case"] == "nc") & (an["stage"] == "decode") & (an["family"] == "TOTAL")].iloc[0]
    stages = pd.read_csv(run / "stages.csv", dtype={"repeat": str, "call": str})
    med = sorted(stages[(stages["case"] == "nc") & (stages["stage"] == "decode") & stages["repeat"].isin(["0", "1", "2"])
                        & (stages["call"] == "all")]["gpu_ms"])[1]         # the middle of three timed repeats
    r = st[(st["case"] == "nc") & (st["stage"] == "decode")].iloc[0]
    floor = max(tot["tensor_flops"] / 989.4e12, tot["bytes"] / 3350e9) * 1e3
    floor_cal = max(tot["tensor_flops"] / 790e12, tot["bytes"] / 3000e9) * 1e3
    assert r["measured_ms"] == pytest.approx(med)
    assert r["floor_ms"] == pytest.approx(floor) and r["efficiency"] == pytest.approx(floor / med)
    assert r["floor_ms_cal"] == pytest.approx(floor_cal) and r["efficiency_cal"] == pytest.approx(floor_cal / med)
    assert r["achieved_gbs"] == pytest.approx(tot["bytes"] / med / 1e6)
    assert r["mbu"] > 0 and r["mbu_bytes"] <= tot["bytes"] and np.isnan(r["mfu"])
    assert r["routing"] == "measured (batch 1: top-k experts every step)"      # routing.csv, no per-step file
    pre = st[(st["case"] == "nc") & (st["stage"] == "prefill")].iloc[0]
    assert pre["mfu"] == pytest.approx(pre["flops_useful"] / (pre["measured_ms"] * 1e-3) / 989.4e12)
    req = st[(st["case"] == "nc") & (st["stage"] == "request")].iloc[0]
    stage_rows = st[(st["case"] == "nc") & (st["stage"].isin(STAGES))]
    assert req["floor_ms"] == pytest.approx(stage_rows["floor_ms"].sum())
    op = rl[rl["level"] == "op_family"]
    assert {"matmul", "elementwise"} <= set(op["op_family"])
    mm = op[(op["case"] == "nc") & (op["stage"] == "prefill") & (op["op_family"] == "matmul")].iloc[0]
    fam = an[(an["case"] == "nc") & (an["stage"] == "prefill") & (an["family"] != "TOTAL")
             & an["family"].isin(mm["analytic_families"].split("+"))]
    assert mm["tensor_flops"] == pytest.approx(fam["tensor_flops"].sum())
    md = (run / "report.md").read_text()
    for s in ("## Headline", "## Roofline per stage", "## Op families per stage", "## Top kernels per stage",
              "## Device ceilings", "## Environment", "## Caveats", "NVIDIA H100 SXM5 80GB", "| nc |", "| t-2x3 |",
              "Random weights"):
        assert s in md, s
    man = json.loads((run / "manifest.json").read_text())
    assert man["roofline"]["peak_tflops"] == 989.4 and man["roofline"]["calibrated_tflops"] == 790.0


def test_report_on_cpu_fixture_unknown_and_not_calibrated(tmp_path, cache):
    run = _copy("cpu_tiny", tmp_path)
    write_report(run, strict=True)
    rl = pd.read_csv(run / "roofline.csv")
    assert rl["peak_tflops"].isna().all() and rl["efficiency"].isna().all() and rl["efficiency_cal"].isna().all()
    st = rl[rl["level"] == "stage"]
    assert (st["timer"] == "host").all() and st["measured_ms"].notna().all()
    md = (run / "report.md").read_text()
    assert "not calibrated" in md.lower() and "Host timers" in md and "unknown" in md.lower()


def test_report_empty_and_broken_runs(tmp_path, cache):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "manifest.json").write_text(json.dumps({"status": "running", "config": {}, "cases": [], "warnings": []}))
    write_report(empty, strict=True)
    assert "No stage measurements" in (empty / "report.md").read_text()
    broken = _copy("gpu_tiny_a", tmp_path)
    (broken / "stages.csv").write_text("case,stage\nx,sam\n")
    assert write_report(broken) == {}
    assert any("report not written" in w for w in json.loads((broken / "manifest.json").read_text())["warnings"])
    with pytest.raises(NotObservations, match=r"^lacks the column\(s\) repeat, call, gpu_ms or host_ms a run writes$"):
        write_report(broken, strict=True)


def test_compare_two_fixture_runs(tmp_path, capsys):
    a, b = _copy("gpu_tiny_a", tmp_path), _copy("gpu_tiny_b", tmp_path)
    out = tmp_path / "cmp"
    assert compare_main([str(a), str(b), "--out", str(out)]) == 0
    df = pd.read_csv(out / "compare.csv")
    t = df[df["metric"] == "time"]
    assert len(t) == 2 * 6
    assert t["ratio"].to_numpy() == pytest.approx(np.full(len(t), 50 / 62.5))     # B is 20% faster everywhere
    assert t["delta"].to_numpy() == pytest.approx((t["b"] - t["a"]).to_numpy())
    tok = df[df["metric"] == "decode tok/s"]
    assert tok["ratio"].to_numpy() == pytest.approx(np.full(len(tok), 62.5 / 50))
    printed = capsys.readouterr().out
    assert "## Stage time" in printed and (out / "compare.md").read_text() in printed
    # default output: a new compare-* directory beside RUN_B; the runs themselves are untouched
    before = sorted(p.name for p in b.iterdir())
    assert compare_main([str(a), str(b)]) == 0
    assert len(list(tmp_path.glob("compare-*-gpu_tiny_a-vs-gpu_tiny_b"))) == 1
    assert sorted(p.name for p in b.iterdir()) == before
    _, notes = compare_runs(DATA / "cpu_tiny", DATA / "gpu_tiny_a")
    assert any("timers differ" in n for n in notes)
    with pytest.raises(HarnessError):
        compare_runs(tmp_path / "nope", b)


def test_run_verb_writes_report(tmp_path, cache):
    """The run verb (tiny model, CPU) writes the report at the end (and between cases at most once a minute)."""
    from hydra import compose, initialize_config_dir

    from harness.config import to_config
    from harness.run import run

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = compose("config", overrides=[
            "model=tiny", "workload.decode_tokens=3", "measure.repeats=1", "measure.kernels=true",
            "hardware.calibrate=false",   # issue 14: a run calibrates on first use; this test checks the uncalibrated run
            "cases=[{mode: {name: t, base_size: 128, image_size: 64, crop: true}}, "
            "{mode: {name: u, base_size: 128, image_size: 64, crop: false}}]"])
    rd = run(to_config(cfg), tmp_path / "run", progress=lambda *_: None)
    for f in ("stages.csv", "kernels.csv", "analytic.csv", "roofline.csv", "roofline.png", "report.md"):
        assert (rd.path / f).is_file(), f
    man = json.loads((rd.path / "manifest.json").read_text())
    assert man["status"] == "complete" and man["roofline"]["calibration"] == "not calibrated"
    assert set(man["host_steadiness"]) == {"before", "after"}
    assert man["host_steadiness"]["after"]["python"]["n"] == 100
    assert man["cases"][0]["warmup_ms"] == [] and man["cases"][0]["warmup_steady"] is None  # CPU: no warm-up
    md = (rd.path / "report.md").read_text()
    assert "| t-2x3 |" in md and "Host steadiness (fixed host work" in md and "after the cases, Python loop CV" in md
    # the report written from the run's in-memory tables equals one written afresh from the files
    assert set(pd.read_csv(rd.path / "kernels.csv")["case"]) == {"t-2x3", "u"}
    write_report(rd.path, strict=True)
    assert (rd.path / "report.md").read_text() == md


def test_report_on_real_h100_crop_mode(tmp_path, cache):
    """A real H100 run (reference model, bf16, 128 decode tokens; kernels.csv left out for size)."""
    run = _copy("h100_crop_mode", tmp_path)
    write_report(run, strict=True)
    rl = pd.read_csv(run / "roofline.csv")
    st = rl[rl["level"] == "stage"].set_index(["case", "stage"])
    assert len(st) == 5 * 6 and (rl["level"] == "stage").all()          # no kernels.csv: no op-family rows
    assert (st["peak_tflops"] == 989.4).all() and (st["mem_bw_gbs"] == 3350.0).all()
    eff = st["efficiency"]
    assert ((eff > 0) & (eff <= 1)).all()
    base_dec = st.loc[("base", "decode")]
    # MBU bytes per decode step ~1.15 GB (DESIGN.md anchor: weights of the experts touched + KV)
    assert 1.1e9 < base_dec["mbu_bytes"] / 127 < 1.25e9
    assert base_dec["bound"] == "launch/host" and base_dec["idle_fraction"] > 0.5
    assert base_dec["mbu"] == pytest.approx(base_dec["mbu_bytes"] / (base_dec["measured_ms"] * 1e-3) / 3350e9)
    md = (run / "report.md").read_text()
    assert "| gundam-2x3 | gundam | 2x3 |" in md and "No kernel capture" in md


def test_a_copy_without_its_kernel_table_says_so_instead_of_no_capture(tmp_path, cache):
    """A run that captured kernels (``measure.kernels: true``) read back from a copy without kernels.csv
    (committed evidence, a merge of such copies): the report names the missing file, not 'no capture'."""
    run = _copy("h100_crop_mode", tmp_path)
    man = json.loads((run / "manifest.json").read_text())
    man.setdefault("measure", {})["kernels"] = True
    (run / "manifest.json").write_text(json.dumps(man))
    write_report(run, strict=True)
    md = (run / "report.md").read_text()
    assert "No kernel capture" not in md
    # the caveat, the op-family section and the top-kernels section
    assert md.count("kernels.csv is not in this directory (the run captured kernels") == 3


def test_ladder_ratios_on_the_committed_h200_runs(tmp_path, cache):
    """Checked-in H200 runs: the speed-up divides the median decode tok/s of the timed repeats by the
    vendor-style batch-1 case of the same mode, says it is unstable (that row's decode CV is above
    5%), and a batched row is compared with the best batch-1 row of its mode, never as a speed-up
    ('–' where the run has no such row). Expected medians come from the raw repeats of stages.csv."""
    examples = Path(__file__).resolve().parents[1] / "runs" / "examples"
    got = {}
    for name in ("h200-optimize", "h200-optimize-gundam-batch"):
        run = tmp_path / name
        shutil.copytree(examples / name, run)
        write_report(run)
        md = (run / "report.md").read_text()
        table = md[md.index("### Ratios"):md.index("## MoE routing")]
        got.update({line.split("|")[1].strip(): [c.strip() for c in line.split("|")[5:10]]
                    for line in table.splitlines() if line.startswith("| ") and not line.startswith("| case")})

    def median(name, case, column="decode_tok_s"):
        st = pd.read_csv(examples / name / "stages.csv", dtype={"repeat": str})
        v = sorted(st[(st["case"] == case) & (st["stage"] == "request") & st["repeat"].str.isdigit()][column])
        return v[(len(v) - 1) // 2]                                  # ten repeats: the lower middle

    best = median("h200-optimize", "best") / median("h200-optimize", "vendor-style")
    assert got["best"][0].startswith(f"{best:.2f}x [") and got["best"][0].endswith("] unstable")
    assert got["vendor-style"][0].startswith("1.00x [") and got["best"][3:] == ["–", "–"]
    b32 = median("h200-optimize", "best-b32") / median("h200-optimize", "best")
    assert got["best-b32"][:3] == ["–", "–", "–"] and got["best-b32"][3].startswith(f"{b32:.2f}x [")
    gundam = median("h200-optimize-gundam-batch", "gundam-best") / median("h200-optimize-gundam-batch",
                                                                           "gundam-vendor-style")
    assert got["gundam-best"][0].startswith(f"{gundam:.2f}x [")              # over the vendor-style of its mode
    assert got["best-b8"] == got["best-b64"] == ["–"] * 5                   # no base-mode batch-1 row there


def test_one_table_writer_and_the_column_registry():
    from harness import markdown
    from harness.report import columns as C

    assert markdown.table(["a", "b"], [[1, "x|y"]]) == ["| a | b |", "|---|---:|", "| 1 | x\\|y |"]
    assert markdown.table(["a"], [], [markdown.LEFT]) == ["| a |", "|---|"]
    # a title is built from the declaration: header, unit, (provenance, basis), suffix
    assert C.column("e2e").title == "e2e ms (measured) [min–max]"
    assert C.column("floor").title == "floor ms (derived, sheet / cal)"
    assert C.column("gflop").title == "tensor GFLOP (analytic)" and C.column("case").title == "case"
    assert C.table(["case", "e2e", "idle"], [{"case": "c", "e2e": (50.0, 40.0, 60.0), "idle": 0.25},
                                             {"case": "d", "e2e": (7.0, 7.0, 7.0), "idle": None}]) == [
        "| case | e2e ms (measured) [min–max] | idle (derived) |", "|---|---:|---:|",
        "| c | 50.00 [40.00–60.00] | 25.0% |", "| d | 7.00 | – |"]
    for c in C.COLUMNS.values():           # every number says where it comes from; labels are text
        assert c.provenance in ("measured", "analytic", "derived") or c.fmt is C.text, c.name


def test_efficiency_above_the_ceiling_is_a_flag_not_a_figure():
    """A synthetic decode row at MBU 1.2 (calibrated): the cell is flagged, the caveat names the row
    and the MBU bytes / calibrated bandwidth to check, roofline.csv keeps the value only in its note."""
    from harness.report.columns import efficiency
    from harness.report.sections import stage_section
    from harness.roofline import flags
    from harness.roofline.join import roofline_frame

    assert efficiency(1.2) == "above the ceiling (120.0%): bytes, FLOPs or ceiling wrong"
    assert efficiency(1.0) == "100.0%" and efficiency(0.5) == "50.0%"
    row = {c: None for c in ROOFLINE_COLUMNS}
    row.update(case="b32", stage="decode", level="stage", timer="cuda_event", bound="memory", routing="measured",
               measured_ms=2.0, tensor_flops=1e9, bytes=7.2e9, mbu_bytes=7.2e9, mbu=0.9, mbu_cal=1.2,
               efficiency=0.95, efficiency_cal=1.2, peak_tflops=989.0, mem_bw_gbs=4000.0, cal_tflops=790.0,
               cal_gbs=3000.0)
    table = flags.flag_rows(roofline_frame([row]))
    md = "\n".join(stage_section(table))
    cells = [c.strip() for line in md.splitlines() if line.startswith("| b32") for c in line.split("|")]
    assert "MBU 90.0% / above the ceiling (120.0%): bytes, FLOPs or ceiling wrong" in cells
    assert "95.0% / above the ceiling (120.0%): bytes, FLOPs or ceiling wrong" in cells
    assert not any(c == "120.0%" or c.endswith("/ 120.0%") for c in cells)
    (cav,) = flags.caveats(table)
    assert cav.startswith("Above the ceiling, shown flagged instead of as a figure: b32/decode: ")
    assert "mbu_cal 120.0%: check the analytic MBU bytes (7,200 MB: weights of the experts touched + KV read; " \
           "routing: measured) or the calibrated copy bandwidth" in cav
    # efficiency_cal: floor = max(1e9 / 790e12, 7.2e9 / 3000e9) s is the bytes side
    assert "efficiency_cal 120.0%: check the analytic bytes (7,200 MB; routing: measured) or the calibrated copy " \
           "bandwidth" in cav
    csv = flags.for_csv(table)
    assert np.isnan(csv.loc[0, "mbu_cal"]) and np.isnan(csv.loc[0, "efficiency_cal"]) and csv.loc[0, "mbu"] == 0.9
    assert flags.value_of(csv.iloc[0], "mbu_cal") == 1.2 and flags.value_of(csv.iloc[0], "mbu") == 0.9
    assert flags.caveats(csv) == [cav]                                   # read back, the same flag
