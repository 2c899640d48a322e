"""``headline.csv`` and ``stages_summary.csv``: what the report derives from stages.csv
(``harness.measure.summary``, the one summarizer, fills them; ``harness.report.report`` writes them;
``summarize`` and the README tables read headline.csv).

* headline.csv (``HEADLINE_CSV``): one row per case, the median request (``repeat``), every value
  from it, ``<column>_min``/``_max`` over the timed repeats, the bootstrap interval of e2e, and what
  a user waits for (pages/s back to back, ``bound_by``);
* stages_summary.csv (``STAGES_SUMMARY_CSV``): per case x stage x call, one row per ``statistic``
  (``STATISTICS``) of every measured column of stages.csv over the timed repeats.

Units come from stages.csv's columns (``harness.schema.stages``) where a column is one of them.
"""
from __future__ import annotations

from ..anatomy.stages import STAGES
from .stages import NUMERIC, STAGES_CSV
from .table import Field, Table

#: request metrics of the headline (their min/max over the timed repeats come as ``<col>_min``/``_max``)
HEADLINE_METRICS = ["e2e_ms", "ttft_ms", "raster_ms", "prep_ms", "h2d_ms", "ttft_e2e_ms", "tpot_p50_ms",
                    "tpot_p90_ms", "tpot_p99_ms", "tpot_mean_ms", "decode_tok_s", "pages_s", "call_ms",
                    "setup_collect_ms", "raster_page_ms", "prep_page_ms", "h2d_page_ms"]
#: per case, over all its timed repeats (no min/max): pages/s back to back and what bounds a batch
BACK_TO_BACK = ["pages_s_gpu", "pages_s_e2e", "bound_by"]
STATISTICS = ("mean", "std", "median", "cv", "min", "max", "ci95_lo", "ci95_hi")

_OWN = {   # the headline's columns that stages.csv does not have: unit, provenance, what
    "case": ("", "label", "case name"), "mode": ("", "label", "crop mode"),
    "grid": ("", "label", "gundam tile grid"), "batch": ("pages", "setting", "pages per request"),
    "timer": ("", "label", "cuda_event or host"), "repeat": ("", "label", "the median request's index"),
    "repeats": ("", "measured", "timed repeats"), "warmup": ("", "measured", "untimed warm-up requests"),
    "pages_s": ("pages/s", "derived", "batch x 1000 / e2e_ms"),
    "raster_page_ms": ("ms", "derived", "raster_ms / batch"), "prep_page_ms": ("ms", "derived", "prep_ms / batch"),
    "h2d_page_ms": ("ms", "derived", "h2d_ms / batch"),
    **{f"{s}_ms": ("ms", "measured", f"{s} span of the median request") for s in STAGES},
    "stage_sum_ms": ("ms", "derived", "sum of the five stages"),
    "ttft_stage_sum_ms": ("ms", "derived", "sum of the stages before decode"),
    "e2e_ms_ci_lo": ("ms", "derived", "seeded bootstrap 95% interval of the median e2e, low"),
    "e2e_ms_ci_hi": ("ms", "derived", "seeded bootstrap 95% interval of the median e2e, high"),
    "pages_s_gpu": ("pages/s", "derived", "batch x repeats x 1000 / sum of the timed calls"),
    "pages_s_e2e": ("pages/s", "derived", "batch x repeats x 1000 / sum of prep + copy + call"),
    "bound_by": ("", "derived", "preprocessing, copy or gpu: the longest part of the median request"),
}


def _field(name: str) -> Field:
    if name in _OWN:
        unit, prov, what = _OWN[name]
        return Field(name, unit, prov, what, text=name == "grid")
    f = STAGES_CSV.field(name)
    return Field(name, f.unit, f.provenance, f.what, f.text)


def _headline_fields() -> tuple:
    per_stage = [f"{s}_ms" for s in STAGES]
    base = ["case", "mode", "grid", "batch", "timer", "repeat", "repeats", "warmup"] + HEADLINE_METRICS + per_stage
    out = [_field(c) for c in base]
    out += [_field(c) for c in ["stage_sum_ms", "ttft_stage_sum_ms", "e2e_ms_ci_lo", "e2e_ms_ci_hi"] + BACK_TO_BACK]
    for c in HEADLINE_METRICS + per_stage:
        for x in ("min", "max"):
            f = _field(c)
            out.append(Field(f"{c}_{x}", f.unit, f.provenance, f"{x} over the timed repeats of {c}"))
    return tuple(out)


HEADLINE_CSV = Table("headline.csv", _headline_fields())
HEADLINE_COLUMNS = HEADLINE_CSV.columns

_SUMMARY_LABELS = {"stage": ("", "label", "stage"), "call": ("", "label", "call of the stage; -1 = all calls"),
                   "calls": ("", "measured", "calls the stage made"),
                   "statistic": ("", "label", "which statistic of the timed repeats the row holds"),
                   "repeats": ("", "measured", "timed repeats")}
STAGES_SUMMARY_CSV = Table("stages_summary.csv", tuple(
    [_field(c) for c in ("case", "mode", "grid", "batch")]
    + [Field(c, *_SUMMARY_LABELS[c]) for c in ("stage", "call", "calls")] + [_field("timer")]
    + [Field(c, *_SUMMARY_LABELS[c]) for c in ("statistic", "repeats")]
    + [Field(c, STAGES_CSV.field(c).unit, "derived", f"the row's statistic of {c} ({STAGES_CSV.field(c).what})")
       for c in NUMERIC]))
SUMMARY_COLUMNS = STAGES_SUMMARY_CSV.columns

__all__ = ["HEADLINE_CSV", "HEADLINE_COLUMNS", "HEADLINE_METRICS", "BACK_TO_BACK", "STATISTICS", "STAGES_SUMMARY_CSV",
           "SUMMARY_COLUMNS"]
