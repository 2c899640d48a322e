"""The ncu session: run, export, parse, and join measured FLOPs / DRAM bytes with the analytic
model for the same case and stage.

Measured FLOPs: ``sm__ops_path_tensor_src_bf16_dst_fp32`` counts tensor-core FLOPs directly
(checked on an H100: a 2048^3 bf16 GEMM reads 2 * 2048^3); vector FLOPs from the fp32/fp16
add, mul (1 FLOP) and fma (2 FLOPs) SASS thread-instruction counters. DRAM bytes = read + write,
and each side on its own against its analytic counterpart: reads = weights + activations read +
KV read, writes = activations written + KV written (``READ_COLUMNS`` / ``WRITE_COLUMNS``), since a
total near 1 can hide a read excess cancelling a write deficit. ncu replays each kernel, so its
durations are per-kernel times with caches flushed between passes, not the request's timeline,
and ``L2_CAVEAT`` says what that does to reads and writes.

The analytic side is the profiled request's own: the child run measures one request (no warm-up,
one repeat), so its ``routing.csv`` / ``routing_steps.csv`` hold the experts that very request
touched, per decode step and MoE layer (the union over its batch's rows); the MoE weight bytes use
them (``roofline.join.analytic_for_run``). The comparison row records where they came from
(``routing_source``: ``roofline.join.ROUTING_SOURCES``; *expected routing* only where the child run
kept no counts), which routing ran (``routing``: ``workload.routing``) and the distinct experts per
MoE layer per step (``experts_step``: median [min–max]).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from ..analytic.compose import stage_totals
from ..errors import HarnessError
from ..markdown import LEFT, table
from ..measure.kernels import categorize
from ..roofline.ceilings import ceilings
from ..report.columns import Column, fixed
from ..report.columns import table as columns_table
from ..report.routing import routing_facts
from ..roofline.join import analytic_for_run, expected_routing
from ..rundir import RunData, load_run
from .ncu import METRIC_SETS, export_command, flops_columns, ncu_command, parse_raw_csv, shell
from .tools import find_tool, portable_command, run_logged

COMPARE_COLUMNS = ["case", "stage", "kernels", "measured_tensor_flops", "analytic_tensor_flops", "tensor_ratio",
                   "measured_vector_flops", "analytic_vector_flops", "vector_ratio", "measured_dram_bytes",
                   "analytic_bytes", "bytes_ratio", "kernel_time_ms", "decode_steps", "note",
                   "measured_dram_read_bytes", "analytic_read_bytes", "read_ratio",
                   "measured_dram_write_bytes", "analytic_write_bytes", "write_ratio", "routing_source", "routing",
                   "experts_step"]
#: analytic byte columns (``harness.analytic.compose.COLUMNS``) that a kernel reads / writes
READ_COLUMNS = ("bytes_weights", "bytes_act_read", "bytes_kv_read")
WRITE_COLUMNS = ("bytes_act_write", "bytes_kv_write")
L2_CAVEAT = ("DRAM counters see what crosses between L2 and DRAM while a kernel runs. ncu replays every kernel "
             "alone and flushes the caches before each replay, so (1) reads start from a cold L2: inputs that the "
             "previous kernel left in L2 in the real request (50 MB on an H100) are read from DRAM here, so "
             "measured reads are an upper bound of the request's; (2) outputs that fit in L2 can stay there dirty "
             "and be written back after the kernel ends, outside its counters, so measured writes are a lower "
             "bound (decode's small activations mostly never show up as writes). Judge reads and writes "
             "separately: their sum can match the analytic total while both differ.")


def _ratio(a, b):
    return float(a) / float(b) if (a is not None and b) else None


def compare_stage(kern: pd.DataFrame, totals: dict, stage: str, case: str, steps: int) -> dict:
    """One row: measured sums over the stage's kernels against the analytic stage totals."""
    t = totals.get(stage, {})
    cols = ("tensor_flops", "vector_flops", "dram_bytes", "dram_read_bytes", "dram_write_bytes")
    m_t, m_v, m_b, m_r, m_w = (kern[c].sum(min_count=1) if c in kern else float("nan") for c in cols)
    m_t, m_v, m_b, m_r, m_w = (None if pd.isna(v) else float(v) for v in (m_t, m_v, m_b, m_r, m_w))  # not collected
    a_r = sum(float(t[c]) for c in READ_COLUMNS) if all(c in t for c in READ_COLUMNS) else None
    a_w = sum(float(t[c]) for c in WRITE_COLUMNS) if all(c in t for c in WRITE_COLUMNS) else None
    return {"case": case, "stage": stage, "kernels": len(kern),
            "measured_tensor_flops": m_t, "analytic_tensor_flops": t.get("tensor_flops"),
            "tensor_ratio": _ratio(m_t, t.get("tensor_flops")),
            "measured_vector_flops": m_v, "analytic_vector_flops": t.get("vector_flops"),
            "vector_ratio": _ratio(m_v, t.get("vector_flops")),
            "measured_dram_bytes": m_b, "analytic_bytes": t.get("bytes"), "bytes_ratio": _ratio(m_b, t.get("bytes")),
            "kernel_time_ms": float(kern["duration_ns"].sum()) / 1e6, "decode_steps": steps if stage == "decode" else None,
            "note": "", "measured_dram_read_bytes": m_r, "analytic_read_bytes": a_r, "read_ratio": _ratio(m_r, a_r),
            "measured_dram_write_bytes": m_w, "analytic_write_bytes": a_w, "write_ratio": _ratio(m_w, a_w)}


def analytic_totals_of(run) -> tuple:
    """(stage totals {stage: {column: value}}, first case entry, routing {"routing_source", "routing",
    "experts_step"}: the compare row's routing fields) of a ``RunData``: its routing tables, when it has
    them, set the MoE bytes (per decode step where ``routing_steps.csv`` has the case); else the
    uniform-routing expectation, said in ``routing_source``."""
    analytic, _, _ = analytic_for_run(run)
    case = run.manifest["cases"][0]
    fact = routing_facts(run).get(case.get("name"), {})
    spread = fact.get("experts_step")
    routing = {"routing_source": str(analytic["routing"].iloc[0]) if len(analytic) else None,
               "routing": fact.get("routing"),
               "experts_step": f"{spread[0]:g} [{spread[1]:g}–{spread[2]:g}]" if spread else None}
    return stage_totals(analytic), case, routing


def run_ncu(cfg, stage: str, child: list[str], out_dir: Path) -> dict:
    prof = cfg.profile
    ncu = find_tool("ncu")
    out = out_dir / "ncu"
    out.mkdir(parents=True, exist_ok=True)
    report = out / "report"
    cmd = ncu_command(stage, child, report, launch_count=prof.launch_count, metrics=METRIC_SETS[prof.metrics],
                      ncu=ncu or "ncu")
    portable = shell(ncu_command(stage, portable_command(child), Path(f"ncu-{stage}"),
                                 launch_count=prof.launch_count, metrics=METRIC_SETS[prof.metrics]))
    (out / "command.txt").write_text(portable + "\n")   # the exact local command heads ncu.log
    if ncu is None:
        raise HarnessError("Nsight Compute (ncu) was not found on PATH or under /opt/nvidia",
                           f"install Nsight Compute and run: {portable}")
    print(f"[harness] ncu over stage {stage}: {shell(cmd)}", flush=True)
    rc = run_logged(cmd, out / "ncu.log")
    rep = report.with_suffix(".ncu-rep")
    if rc != 0 or not rep.exists():
        tail = (out / "ncu.log").read_text()[-600:].replace("\n", " | ")
        raise HarnessError(f"ncu exited with {rc} and wrote no report ({tail})", f"see {out / 'ncu.log'}")
    raw = run_logged_capture(export_command(rep, ncu))
    (out / "kernels_raw.csv").write_text(raw)
    kern = flops_columns(parse_raw_csv(raw))
    kern.insert(0, "stage", stage)
    kern["category"] = [categorize(k) for k in kern["kernel"].fillna("")]
    kern.to_csv(out / "kernels.csv", index=False)
    child_runs = sorted((out_dir / "child").glob("*/manifest.json"))
    if not child_runs:
        raise HarnessError("the profiled child run wrote no manifest", f"see {out / 'ncu.log'}")
    child_run = load_run(child_runs[-1].parent)   # read once: its analytic totals and its manifest
    totals, case, routing = analytic_totals_of(child_run)
    steps = max(case["decode_tokens"] - 1, 0)
    row = {**compare_stage(kern, totals, stage, case["name"], steps), **routing}
    if len(kern) >= prof.launch_count:
        row["note"] = "launch count reached: the stage was cut short; raise profile.launch_count"
    cmp_df = pd.DataFrame([row], columns=COMPARE_COLUMNS)
    cmp_df.to_csv(out / "stage_compare.csv", index=False)
    paths = write_outputs(out, cmp_df, kern, stage, child_run.manifest)
    print((out / "report.md").read_text())
    return {"report": rep, **paths}


def write_outputs(out: Path, cmp_df: pd.DataFrame, kern: pd.DataFrame, stage: str, manifest: dict) -> dict:
    """report.md (comparison, gap explanations, categories, top kernels) and roofline_ncu.png."""
    peaks = ceilings(manifest)
    png = plot_points(kern, cmp_df.iloc[0], peaks, out / "roofline_ncu.png", stage)
    (out / "report.md").write_text(render(cmp_df, kern, stage, peaks, png))
    return {"report_md": out / "report.md", "plot": png, "kernels": out / "kernels.csv",
            "compare": out / "stage_compare.csv"}


def run_logged_capture(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise HarnessError(f"ncu --import failed: {proc.stderr.strip()[:300]}", "check the ncu version")
    return proc.stdout


def _fmt(scale: float = 1.0):
    """Three decimals of a value / ``scale`` (the report's formatter, ``harness.report.columns.fixed``)."""
    return fixed("{:,.3f}", scale)


#: the per-category and per-kernel tables: ncu's counters summed, in MB, GFLOP and µs
TABLE = {c.name: c for c in [
    Column("category", "category", align=LEFT), Column("kernel", "kernel", align=LEFT), Column("kernels", "kernels"),
    Column("dram_bytes", "MB", fmt=_fmt(1e6)), Column("tensor_flops", "tensor GFLOP", fmt=_fmt(1e9)),
    Column("vector_flops", "vector GFLOP", fmt=_fmt(1e9)), Column("duration_ns", "µs", fmt=_fmt(1e3))]}


TOLERANCE = {"tensor": 0.05, "bytes": 0.15, "vector": 0.15, "reads": 0.15, "writes": 0.15}
WHY = {
    "tensor": "tensor-core work the analytic count does not have: GEMM/attention tiles padded to the "
              "kernel's tile shape (partial M/N/K tiles still issue full MMAs), convolutions lowered to "
              "implicit GEMM over padded channels, and attention kernels that compute masked blocks",
    "bytes": "traffic the analytic execution model leaves out: intermediate tensors that a fused kernel would "
             "keep on chip (dense rel-pos bias, score/probability tensors, permute/contiguous copies, "
             "KV-cache concatenation copies), and re-reads when a working set exceeds L2 (ncu flushes "
             "caches between replays, so every kernel starts cold)",
    "vector": "the analytic vector count is an estimate of one FLOP per elementwise operation and element; "
              "kernels expand transcendental functions (erf in exact GELU, exp in softmax, rsqrt) into "
              "polynomial FMA sequences and do fp32 accumulation and index arithmetic on the FP pipes",
    "reads": "reads start from a cold L2 under ncu (upper bound), and unfused intermediates (bias, score and "
             "probability tensors, permute copies) are read again by the next kernel",
    "writes": "writes of outputs that fit in L2 can be written back after the kernel ends, outside its counters "
              "(lower bound); unfused intermediates add writes the analytic model keeps on chip",
}


def gap_notes(r) -> list:
    """One line per quantity whose measured/analytic ratio is outside its tolerance, with the reason."""
    notes = []
    for q, col in (("tensor", "tensor_ratio"), ("bytes", "bytes_ratio"), ("reads", "read_ratio"),
                   ("writes", "write_ratio"), ("vector", "vector_ratio")):
        v = r.get(col) if hasattr(r, "get") else r[col]
        if v is None or v != v:
            continue
        inside = abs(v - 1) <= TOLERANCE[q]
        notes.append(f"- {q}: measured/analytic = {v:.3f} ({'within' if inside else 'outside'} "
                     f"+-{TOLERANCE[q]:.0%}){'' if inside else ': ' + WHY[q]}.")
    return notes


def plot_points(kern: pd.DataFrame, r, peaks, path: Path, stage: str):
    """Empirical roofline: one point per kernel (ncu FLOPs / ncu DRAM bytes, FLOPs / kernel time)
    and one for the stage, under the datasheet (solid) and calibrated (dashed) ceilings."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    k = kern.copy()
    k["flops"] = k["tensor_flops"].fillna(0) + k["vector_flops"].fillna(0)
    k = k[(k["flops"] > 0) & (k["dram_bytes"] > 0) & (k["duration_ns"] > 0)]
    if not len(k):
        return None
    x = (k["flops"] / k["dram_bytes"]).to_numpy(float)
    y = (k["flops"] / k["duration_ns"] / 1e3).to_numpy(float)     # TFLOP/s
    fig, ax = plt.subplots(figsize=(8, 5.2), dpi=110)
    xs = np.logspace(np.log10(max(x.min() / 4, 1e-3)), np.log10(x.max() * 4), 200)
    for tf, bw, style, label in ((peaks.peak_tflops, peaks.mem_bw_gbs, "-", "datasheet"),
                                 (peaks.cal_tflops, peaks.cal_gbs, "--", "calibrated")):
        if tf and bw:
            ax.plot(xs, np.minimum(tf, bw * xs / 1e3), style, color="black", lw=1, label=f"{label} ceiling")
    for cat in sorted(k["category"].unique()):
        m = (k["category"] == cat).to_numpy()
        ax.scatter(x[m], y[m], s=10, alpha=0.6, label=cat)
    tot_f = k["flops"].sum()
    ax.scatter([tot_f / k["dram_bytes"].sum()], [tot_f / k["duration_ns"].sum() / 1e3], marker="*", s=220,
               color="red", edgecolor="black", label=f"stage {stage}", zorder=5)
    ax.set(xscale="log", yscale="log", xlabel="FLOP per DRAM byte (ncu)", ylabel="TFLOP/s (ncu FLOPs / kernel time)",
           title=f"ncu empirical roofline: {r['case']} / {stage} ({peaks.device_name})")
    ax.grid(True, which="both", alpha=0.2)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def render(cmp_df: pd.DataFrame, kern: pd.DataFrame, stage: str, peaks=None, png=None) -> str:
    r = cmp_df.iloc[0]
    quantities = (("tensor-core FLOPs (G)", "measured_tensor_flops", "analytic_tensor_flops", "tensor_ratio", 1e9),
                  ("vector FLOPs (G, fp32/fp16 SASS)", "measured_vector_flops", "analytic_vector_flops", "vector_ratio",
                   1e9),
                  ("DRAM reads (MB): weights + act read + KV read", "measured_dram_read_bytes", "analytic_read_bytes",
                   "read_ratio", 1e6),
                  ("DRAM writes (MB): act write + KV write", "measured_dram_write_bytes", "analytic_write_bytes",
                   "write_ratio", 1e6),
                  ("DRAM bytes (MB), read + write", "measured_dram_bytes", "analytic_bytes", "bytes_ratio", 1e6))
    lines = [f"# Nsight Compute: stage `{stage}` ({r['case']})", "",
             *table(["quantity", "measured (ncu)", "analytic", "measured / analytic"],
                    [[q, _fmt(scale)(r.get(m)), _fmt(scale)(r.get(a)), _fmt()(r.get(ratio))]
                     for q, m, a, ratio, scale in quantities]),
             "", f"{int(r['kernels'])} kernels; sum of ncu kernel durations {r['kernel_time_ms']:.3f} ms "
                 "(replayed one by one, caches flushed: not the request timeline)."
             + (f" Decode: {int(r['decode_steps'])} step(s)." if r["decode_steps"] == r["decode_steps"]
                and r["decode_steps"] is not None else ""),
             "", routing_line(r),
             "", "Analytic: `harness.analytic` for the same case (MoE bytes from the profiled request's measured "
                 "routing unless the line above says otherwise); measured: "
                 "`sm__ops_path_tensor_src_bf16_dst_fp32` (FLOPs), SASS fp32/fp16 add/mul (1) and fma (2), "
                 "`dram__bytes_read`, `dram__bytes_write`.", "", f"L2 and write-back: {L2_CAVEAT}", "",
             "## Gaps", ""]
    lines += gap_notes(r) or ["- no quantity collected with an analytic counterpart"]
    if r["note"]:
        lines += ["", f"Note: {r['note']}"]
    if "category" in kern:
        cat = kern.groupby("category", as_index=False)[["dram_bytes", "tensor_flops", "vector_flops",
                                                          "duration_ns"]].sum(min_count=1)
        cat["kernels"] = kern.groupby("category").size().to_numpy()
        cat = cat.sort_values("dram_bytes", ascending=False)
        lines += ["", "## By kernel category", ""]
        lines += columns_table(["category", "kernels", "dram_bytes", "tensor_flops", "vector_flops", "duration_ns"],
                               cat.to_dict("records"), TABLE)
    top = kern.groupby("kernel", as_index=False)[["dram_bytes", "tensor_flops", "vector_flops",
                                                   "duration_ns"]].sum(min_count=1)
    top = top.sort_values("dram_bytes", ascending=False).head(12)
    lines += ["", "## Kernels moving the most DRAM bytes", ""]
    lines += columns_table(["kernel", "dram_bytes", "tensor_flops", "vector_flops", "duration_ns"],
                           [{**t, "kernel": f"`{t['kernel'][:90]}`"} for t in top.to_dict("records")], TABLE)
    if png:
        lines += ["", f"![empirical roofline]({Path(png).name})"]
    else:
        lines += ["", "No roofline points: no FLOP counters were collected (profile.metrics=memory) or no kernel "
                      "had both FLOPs and DRAM bytes."]
    if peaks is not None:
        lines += ["", f"Ceilings: datasheet {peaks.peak_tflops} TFLOP/s, {peaks.mem_bw_gbs} GB/s; calibrated "
                      f"{peaks.cal_tflops} TFLOP/s, {peaks.cal_gbs} GB/s ({peaks.device_name})."]
    return "\n".join(lines) + "\n"


def routing_line(r) -> str:
    """Where the analytic MoE weight bytes took their experts from (a compare row's routing fields)."""
    get = r.get if hasattr(r, "get") else (lambda c: None)
    source, routing, experts = get("routing_source"), get("routing"), get("experts_step")
    if not source:
        return "MoE bytes: routing source not recorded (a comparison written before it was)."
    text = f"MoE bytes from: {source}"
    if routing:
        text += f"; routing `{routing}`"
    if experts:
        text += f"; distinct experts per MoE layer per decode step (over the batch's rows) {experts}"
    if expected_routing(source):
        text += " (no per-step counts: the uniform expectation, not what the request touched)"
    return text + "."


def rerender(ncu_dir: Path, child_manifest: Path) -> dict:
    """Rebuild report.md and roofline_ncu.png from a saved ncu folder (kernels.csv,
    stage_compare.csv) and the child run's manifest: ``python -m harness.external.ncu_session DIR MANIFEST``."""
    ncu_dir = Path(ncu_dir)
    kern = pd.read_csv(ncu_dir / "kernels.csv")
    if "category" not in kern:
        kern["category"] = [categorize(k) for k in kern["kernel"].fillna("")]
        kern.to_csv(ncu_dir / "kernels.csv", index=False)
    cmp_df = pd.read_csv(ncu_dir / "stage_compare.csv").astype(object).where(lambda d: d.notna(), None)
    cmp_df["note"] = cmp_df["note"].fillna("")
    manifest = json.loads(Path(child_manifest).read_text())
    if "analytic_read_bytes" not in cmp_df or cmp_df["analytic_read_bytes"].isna().all():
        cmp_df = recompare(kern, cmp_df.iloc[0], manifest, ncu_dir)
        cmp_df.to_csv(ncu_dir / "stage_compare.csv", index=False)
    return write_outputs(ncu_dir, cmp_df, kern, str(cmp_df.iloc[0]["stage"]), manifest)


def recompare(kern: pd.DataFrame, old, manifest: dict, where: Path) -> pd.DataFrame:
    """The comparison row of an ncu folder written before reads and writes were compared: the
    analytic side recomputed from the child run's manifest (uniform-routing expectation for MoE
    bytes, said in the note: the folder keeps no routing.csv)."""
    totals, case, routing = analytic_totals_of(RunData(Path(where), manifest))
    stage = str(old["stage"])
    row = {**compare_stage(kern[kern["stage"] == stage] if "stage" in kern else kern, totals, stage, case["name"],
                           max(int(case["decode_tokens"]) - 1, 0)), **routing}
    notes = [str(old.get("note") or ""), "analytic side recomputed from child_manifest.json with the "
             "uniform-routing expectation for MoE bytes (routing.csv not kept)"]
    row["note"] = "; ".join(n for n in notes if n)
    return pd.DataFrame([row], columns=COMPARE_COLUMNS).astype(object).where(lambda d: d.notna(), None)


if __name__ == "__main__":
    print(rerender(Path(sys.argv[1]), Path(sys.argv[2])))
