"""roofline.png: log-log roofline, both ceilings, one point per case x stage (matplotlib Agg).

x = arithmetic intensity (tensor FLOP per DRAM byte, analytic), y = achieved TFLOP/s (analytic
tensor FLOPs / measured time). Ceilings: dense datasheet (solid) and calibrated (dashed),
each min(peak, bandwidth x intensity). Colour = stage, marker = case. Stages without tensor
FLOPs (nothing to place on a log axis) are left out and listed in the caption.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from .join import STAGES
from .specs import Peaks

STAGE_COLORS = {"sam": "tab:blue", "clip": "tab:orange", "projector": "tab:green", "prefill": "tab:red",
                "decode": "tab:purple"}
MARKERS = "osD^v<>pPX*hH8d"


def plot_roofline(table: pd.DataFrame, peaks: Peaks, path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    path = Path(path)
    st = table[(table["level"] == "stage") & (table["stage"].isin(STAGES))] if len(table) else table
    pts = st[(st["intensity"] > 0) & (st["achieved_tflops"] > 0)] if len(st) else st
    skipped = sorted({f"{r.case}/{r.stage}" for r in st.itertuples()} - {f"{r.case}/{r.stage}" for r in pts.itertuples()}) \
        if len(st) else []
    fig, ax = plt.subplots(figsize=(8.5, 5.5), dpi=110)
    xs = pts["intensity"].to_numpy(float) if len(pts) else np.array([])
    ridges = [r for r in (peaks.ridge, peaks.cal_ridge) if r]
    lo = min([*xs, *ridges, 1.0]) / 4 if len(xs) or ridges else 0.1
    hi = max([*xs, *ridges, 10.0]) * 4
    x = np.logspace(np.log10(lo), np.log10(hi), 256)
    drew = False
    if peaks.peak_tflops and peaks.mem_bw_gbs:
        ax.plot(x, np.minimum(peaks.peak_tflops, peaks.mem_bw_gbs * x / 1e3), "k-", lw=1.6,
                label=f"datasheet: {peaks.peak_tflops:g} TFLOP/s {peaks.dtype}, {peaks.mem_bw_gbs:g} GB/s")
        drew = True
    if peaks.cal_tflops and peaks.cal_gbs:
        ax.plot(x, np.minimum(peaks.cal_tflops, peaks.cal_gbs * x / 1e3), "k--", lw=1.2,
                label=f"calibrated: {peaks.cal_tflops:,.4g} TFLOP/s {peaks.cal_dtype or ''}, {peaks.cal_gbs:,.4g} GB/s")
        drew = True
    cases = list(dict.fromkeys(pts["case"])) if len(pts) else []
    for i, case in enumerate(cases):
        for r in pts[pts["case"] == case].itertuples():
            ax.scatter(r.intensity, r.achieved_tflops, s=46, color=STAGE_COLORS.get(r.stage, "gray"),
                       marker=MARKERS[i % len(MARKERS)], edgecolors="black", linewidths=0.5, zorder=3)
    from matplotlib.patches import Patch

    handles, labels = ax.get_legend_handles_labels()
    for stage, color in STAGE_COLORS.items():
        if len(pts) and (pts["stage"] == stage).any():
            handles.append(Patch(facecolor=color, edgecolor="black", linewidth=0.5))
            labels.append(stage)
    for i, case in enumerate(cases):
        handles.append(ax.scatter([], [], color="white", edgecolors="black", marker=MARKERS[i % len(MARKERS)]))
        labels.append(case)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity [tensor FLOP / DRAM byte] (analytic)")
    ax.set_ylabel("achieved [TFLOP/s] (analytic tensor FLOPs / measured time)")
    head = title or "roofline"
    if not drew:
        head += " (no ceilings: unknown device, not calibrated)"
    ax.set_title(f"{head}\n{peaks.device_name}", fontsize=10)
    ax.grid(True, which="both", lw=0.3, alpha=0.5)
    ax.legend(handles, labels, fontsize=7, loc="lower right", ncol=2)
    if skipped:
        fig.text(0.01, 0.01, "not plotted (no tensor FLOPs or time): " + ", ".join(skipped)[:180], fontsize=6)
    return save_figure(fig, path)


def save_figure(fig, path: Path) -> Path:
    """Lay out, write atomically (tmp file + rename) and close a matplotlib figure; returns ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.png")
    try:
        fig.savefig(tmp)
        tmp.replace(path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)     # a failed write (a full disk) leaves no partial file
        if isinstance(exc, OSError) and exc.filename is None:
            exc.filename = str(path)
        raise
    finally:
        plt.close(fig)
    return path


def plot_ladder(rows: pd.DataFrame, path, title: str = "") -> Path:
    """ladder.png: decode tok/s (log scale, bars) and MBU against the calibrated copy bandwidth (dots,
    right axis) per case, in run order: how far each execution variant gets toward the memory roof;
    an MBU above 100% is marked at 100% as flagged, never drawn as a value.
    ``rows``: case, tok_s (measured), mbu_cal (derived; NaN where not calibrated)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows) + 2), 4.5), dpi=110)
    x = np.arange(len(rows))
    tok = rows["tok_s"].to_numpy(float)
    ax.bar(x, tok, color="tab:blue", alpha=0.8, label="decode tok/s (measured)")
    ax.set_yscale("log")
    ax.set_ylabel("decode tokens / s (log)")
    ax.set_xticks(x, rows["case"], rotation=30, ha="right")
    for xi, t in zip(x, tok):
        if np.isfinite(t):
            ax.annotate(f"{t:,.0f}", (xi, t), ha="center", va="bottom", fontsize=8)
    mbu = rows["mbu_cal"].to_numpy(float) * 100
    over = mbu > 100            # above the ceiling: a flag (the report's caveats say what to check), no point
    if np.isfinite(mbu).any():
        ax2 = ax.twinx()
        ax2.plot(x, np.where(over, np.nan, mbu), "o-", color="tab:red", label="MBU vs calibrated copy (derived)")
        if over.any():
            ax2.plot(x[over], np.full(over.sum(), 100.0), "x", color="tab:red", markersize=9,
                     label="above the ceiling: bytes, FLOPs or ceiling wrong")
        ax2.set_ylabel("MBU % (calibrated)", color="tab:red")
        ax2.set_ylim(0, 105.0)
        ax2.legend(loc="upper right", fontsize=8)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(title or "execution ladder: decode throughput and bandwidth utilisation")
    return save_figure(fig, path)


__all__ = ["plot_roofline", "plot_ladder", "save_figure"]
