"""time_breakdown.png: where the time goes, per case and stage (matplotlib Agg).

One panel per case; one horizontal bar per stage, in percent of the stage's median span (CUDA
events, or the host clock on a CPU run): kernel busy time (measured in the profiled request,
solid) and idle time (span - busy, hatched). A black tick marks the median host span in the same
percent (beyond 100%: the host took longer than the GPU span, see the report's span notes). The
stage's span in ms and its share of the stage sum label each bar. Each stage's bar is its own
median over the timed repeats (the stages' medians may come from different repeats), so a panel's
title says so and gives, apart, the median request's end-to-end time and pages per second
(batch / end-to-end: one request, ``harness.measure.summary``'s headline).
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from ..roofline.plot import STAGE_COLORS, save_figure
from ..roofline.point import _f
from ..anatomy.stages import STAGES

HOST_CAP_PCT = 400.0     # host ticks further right are drawn at the cap with an arrow


def plot_time_breakdown(measured: pd.DataFrame, headline: pd.DataFrame, path, title: str = "") -> Path:
    """Write the chart for ``measured`` (``measure.summary.Summary.stages``) and ``headline``
    (``Summary.headline``) to ``path``; returns ``path``."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    path = Path(path)
    cases = list(dict.fromkeys(measured["case"])) if len(measured) else []
    fig, axes = plt.subplots(max(len(cases), 1), 1, figsize=(9, 0.6 + 1.7 * max(len(cases), 1)), dpi=110,
                             squeeze=False)
    head = headline.set_index("case") if len(headline) else pd.DataFrame()
    for ax, case in zip(axes[:, 0], cases or [None]):
        if case is None:
            ax.text(0.5, 0.5, "no measurements", ha="center", va="center")
            ax.set_axis_off()
            continue
        m = measured[(measured["case"] == case) & measured["stage"].isin(STAGES)].set_index("stage")
        stages = [s for s in STAGES if s in m.index and _f(m.loc[s, "time_ms"])]
        timer = "CUDA events" if (m["timer"] == "cuda_event").any() else "host clock"
        total = sum(_f(m.loc[s, "time_ms"]) for s in stages) or 1.0
        right, labels = 110.0, []
        for y, stage in enumerate(stages):
            r = m.loc[stage]
            span, busy, host = _f(r["time_ms"]), _f(r.get("busy_ms")), _f(r.get("host_ms"))
            color = STAGE_COLORS.get(stage, "gray")
            if busy is not None:
                b = 100 * min(busy, span) / span
                ax.barh(y, b, color=color, edgecolor="black", lw=0.4)
                ax.barh(y, 100 - b, left=b, color=color, alpha=0.3, hatch="//", edgecolor="black", lw=0.4)
            else:
                ax.barh(y, 100, color=color, alpha=0.6, edgecolor="black", lw=0.4)
                ax.text(50, y, "no kernel capture", ha="center", va="center", fontsize=7)
            if host is not None and timer == "CUDA events":
                x = 100 * host / span
                if x > HOST_CAP_PCT:
                    ax.plot([HOST_CAP_PCT], [y], marker=">", color="black")
                else:
                    ax.plot([x, x], [y - 0.4, y + 0.4], color="black", lw=1.6)
                right = max(right, min(x, HOST_CAP_PCT) * 1.05)
            labels.append(f"{stage}  {_ms(span)} ms ({100 * span / total:.1f}%)")
        ax.set_yticks(range(len(stages)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, right)
        ax.axvline(100, color="gray", lw=0.6, ls=":")
        ax.grid(True, axis="x", lw=0.3, alpha=0.5)
        h = head.loc[case] if case in head.index else {}
        e2e, pps = (_f(h.get("e2e_ms")), _f(h.get("pages_s"))) if len(h) else (None, None)
        ax.set_title(panel_title(case, h.get("repeats") if len(h) else None, h.get("repeat") if len(h) else None,
                                 e2e, pps), fontsize=9, loc="left")
        ax.set_xlabel(f"% of the stage's median span ({timer}); label: span and share of the stage sum", fontsize=8)
    fig.suptitle((title + "\n" if title else "") + "solid: kernel busy (profiled request); hatched: idle "
                 "(span - busy); black tick: host span", fontsize=8)
    return save_figure(fig, path)


def panel_title(case: str, repeats, repeat, e2e_ms, pages_s) -> str:
    """A panel's title: what its bars are (each stage's median over the timed repeats) and, apart,
    the median request (``repeat``, its end-to-end ms and pages/s) where the headline has it."""
    n = _f(repeats)
    title = f"{case}: each stage's median over {int(n)} timed repeat(s)" if n else f"{case}: each stage's median"
    if e2e_ms and pages_s:
        which = f" (repeat={int(repeat)})" if _f(repeat) is not None else ""
        title += f";\nthe median request{which}: {e2e_ms:,.1f} ms end to end, {pages_s:,.3g} pages/s"
    return title


def _ms(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


__all__ = ["plot_time_breakdown", "panel_title"]
