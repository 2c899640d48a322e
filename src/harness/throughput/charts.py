"""throughput.png (pages/s against batch size, each point labelled with its bound) and
throughput_timeline.png (a few batches of each configuration on one time axis: the workers,
the copy and the five stages), from the tables ``window`` documents (matplotlib Agg)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from ..roofline.plot import STAGE_COLORS, save_figure
from ..anatomy.stages import STAGES

BOUND_MARKERS = {"preprocessing": "s", "copy": "D", "vision": "^", "prefill": "v", "decode": "o", "host": "X"}
#: published pages/s (``section.ANCHORS`` quotes them): DeepSeek's claim (200k pages/day on one
#: A100-40G) and jina-ocr-v1 at concurrency 16 (RTX PRO 6000)
DEEPSEEK_CLAIM_PAGES_S, JINA_C16_PAGES_S = 2.3, 4.3
#: the published pages/s drawn as reference lines: (pages/s, label)
PUBLISHED_PAGES_S = ((DEEPSEEK_CLAIM_PAGES_S, "DeepSeek claim, A100-40G (published)"),
                     (JINA_C16_PAGES_S, "jina-ocr-v1 at concurrency 16, RTX PRO 6000 (published)"))


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    return plt


def plot_throughput(table: pd.DataFrame, path, title: str = "") -> Path:
    """pages/s (derived) against batch size, log2 x axis; marker and label = the bound."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.6), dpi=110)
    t = table.sort_values("batch")
    ax.plot(t["batch"], t["pages_s"], "-", color="tab:blue", lw=1.2, zorder=2)
    for r in t.itertuples():
        ax.scatter(r.batch, r.pages_s, s=60, marker=BOUND_MARKERS.get(r.bound, "o"), color="tab:blue",
                   edgecolors="black", linewidths=0.6, zorder=3)
        ax.annotate(f"{r.pages_s:,.2f}\n{r.bound}", (r.batch, r.pages_s), textcoords="offset points",
                    xytext=(0, 8), ha="center", fontsize=8)
    for value, label in PUBLISHED_PAGES_S:
        ax.axhline(value, color="gray", ls="--", lw=0.8)
        ax.annotate(label, (t["batch"].min() if len(t) else 1, value), fontsize=7, color="gray", va="bottom")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(t["batch"]), [str(b) for b in t["batch"]])
    ax.set_xlabel("batch [pages decoded together]")
    ax.set_ylabel("pages / s (derived: pages in the window / window s)")
    top = max([*t["pages_s"].tolist(), *(v for v, _ in PUBLISHED_PAGES_S)]) if len(t) else 5.0
    ax.set_ylim(0, top * 1.3)
    ax.set_title(title or "sustained pages/s against batch size; label: the bound", fontsize=10)
    ax.grid(True, lw=0.3, alpha=0.5)
    return save_figure(fig, Path(path))


def timeline_lanes(workers: int) -> list:
    """Lane names from top to bottom: the workers, the copy stream (copy, then device preprocessing),
    the five stages."""
    return [f"worker {i}" for i in range(workers)] + ["copy", *STAGES]


def plot_timeline(panels: list, path, title: str = "") -> Path:
    """``panels``: [(config name, spans of its first batches, prep rows in that time, workers)]; spans
    and prep as ``harness.schema.throughput`` SPANS_CSV / PREP_CSV (seconds from the window start)."""
    plt = _plt()
    heights = [len(timeline_lanes(w)) * 0.28 + 0.9 for _, _, _, w in panels] or [2.0]
    fig, axes = plt.subplots(len(heights), 1, figsize=(11, sum(heights) + 0.6), dpi=100, squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (name, spans, prep, workers) in zip(axes[:, 0], panels):
        lanes = timeline_lanes(workers)
        y = {lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}
        end = float(spans["end_s"].max()) if len(spans) else 1.0
        start = min(0.0, float(spans["start_s"].min())) if len(spans) else 0.0
        for r in prep.itertuples():
            lane = f"worker {int(r.worker)}"
            ax.broken_barh([(r.start_s * 1e3, (r.end_s - r.start_s) * 1e3)], (y[lane] - 0.4, 0.8),
                           facecolors="tab:gray", edgecolors="white", linewidth=0.3)
        for r in spans[spans["range"].isin(["copy", "preprocess", *STAGES])].itertuples():
            color = STAGE_COLORS.get(r.range, "tab:olive")   # device preprocessing: the copy lane, olive
            lane = "copy" if r.range == "preprocess" else r.range
            ax.broken_barh([(r.start_s * 1e3, (r.end_s - r.start_s) * 1e3)], (y[lane] - 0.4, 0.8),
                           facecolors=color, edgecolors="black", linewidth=0.2)
        for r in spans[spans["range"] == "request"].itertuples():
            ax.annotate(f"batch {int(r.batch_no)}", (r.start_s * 1e3, len(lanes) - 0.45), fontsize=7)
        ax.set_yticks(list(y.values()), list(y.keys()), fontsize=7)
        ax.set_xlim(start * 1e3, end * 1e3)
        ax.set_ylim(-0.6, len(lanes) + 0.1)
        ax.set_title(f"{name}: the window's first {spans['batch_no'].nunique() if len(spans) else 0} batch(es)",
                     fontsize=9, loc="left")
        ax.grid(True, axis="x", lw=0.3, alpha=0.5)
    axes[-1, 0].set_xlabel("ms from the window start (compute and copy streams: device marks; workers: host clock)")
    if title:
        fig.suptitle(title, fontsize=10)
    return save_figure(fig, Path(path))


__all__ = ["plot_throughput", "plot_timeline", "timeline_lanes", "BOUND_MARKERS", "PUBLISHED_PAGES_S",
           "DEEPSEEK_CLAIM_PAGES_S", "JINA_C16_PAGES_S"]
