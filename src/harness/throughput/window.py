"""The steady window's arithmetic: raw observations of one configuration -> its row of
``throughput.csv`` (``summarize``), and the rule that names what bounds it (``bound``).

Raw observations (one table each, declared in ``harness.schema.throughput`` with throughput.csv's
columns; times in seconds from the window start, which is a synchronised device-idle point; the
window ends at ``window_s``, synchronised too):

* batches (``harness.schema.throughput.BATCHES_CSV``): one row per batch of the window: its pages, their decode budgets'
  max and sum [tokens], the bytes copied to the device, how long the main thread waited for the
  batch's pages before launching it [ms], and the median over its decode steps and MoE layers of the
  distinct experts the batch's rows touched (``models.routing.experts_per_step``; empty without counts);
* spans (``SPANS_CSV``): one row per timed range of a batch: ``request`` and the five stages
  (marks on the compute stream: CUDA events, or the host clock on the CPU), ``copy`` (marks on
  the copy stream) and, with device preprocessing, ``preprocess`` (after the copy, same stream);
* prep (``PREP_CSV``): one row per page a worker prepared around the window: worker lane and
  interval (host clock).

Every number of throughput.csv (``harness.schema.throughput.THROUGHPUT_CSV``) comes from these by the
formula in its description.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..anatomy.stages import STAGES, VISION_STAGES
from ..measure.observations import busy_ms


#: a resource busy for at least this fraction of the window is saturated (see ``bound``)
SATURATED = 0.85

def _clip(start, end, lo: float, hi: float) -> tuple:
    """The intervals [start, end] clipped to [lo, hi] (arrays of starts and ends) [s]."""
    return np.clip(np.asarray(start, float), lo, hi), np.clip(np.asarray(end, float), lo, hi)


def _clipped(start, end, lo: float, hi: float) -> float:
    """Total length of intervals [start, end] inside [lo, hi] [s]."""
    s, e = _clip(start, end, lo, hi)
    return float(np.sum(e - s))


def wasted_fraction(batches: pd.DataFrame) -> float:
    """``wasted_decode_slots`` of the window's batches (throughput.csv's description)."""
    slots = (batches["size"] * batches["budget_max"]).sum()
    return float((slots - batches["budget_sum"].sum()) / slots) if slots else 0.0


def bound(prep_busy: float, copy_busy: float, gpu_busy: float, stage_ms: dict) -> str:
    """What bounds a configuration, from its measured busy fractions of the window.

    Each resource's busy fraction is its utilisation: the pipeline's pages/s over the pages/s that
    resource would sustain alone. The one closest to 1 is the bottleneck, when it is saturated
    (busy >= ``SATURATED``): ``preprocessing`` (the workers), ``copy`` (the copy stream) or the
    compute device; the device is then named by its phase with the largest share of the stage time:
    ``vision`` (sam + clip + projector), ``prefill`` or ``decode``. When none is saturated the
    pipeline waits on serial host work between them (batch assembly, launches, the end-of-batch
    read-back): ``host``. Ties go to the device, then preprocessing."""
    busy = {"gpu": gpu_busy, "preprocessing": prep_busy, "copy": copy_busy}
    name = max(busy, key=lambda k: busy[k])
    if not busy[name] >= SATURATED:
        return "host"
    if name != "gpu":
        return name
    phases = {"vision": sum(stage_ms.get(s, 0.0) for s in VISION_STAGES),
              "prefill": stage_ms.get("prefill", 0.0), "decode": stage_ms.get("decode", 0.0)}
    return max(phases, key=lambda k: phases[k])


def union_seconds(starts, ends, lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by at least one of the intervals [starts[i], ends[i]] [s]
    (``measure.observations.busy_ms`` of the clipped intervals)."""
    s, e = _clip(starts, ends, lo, hi)
    return busy_ms(pd.DataFrame({"start_ms": s, "dur_ms": np.maximum(e - s, 0.0)}))


def summarize(batches: pd.DataFrame, spans: pd.DataFrame, prep: pd.DataFrame, window_s: float, workers: int,
              peak_mem_bytes=None, overlap: bool = False) -> dict:
    """The derived columns of throughput.csv for one configuration's window (settings columns excluded).
    ``overlap`` (``throughput.overlap_vision``: vision on a stream of its own): GPU busy is the union of
    the stage spans inside the window instead of their sum."""
    n = len(batches)
    pages = int(batches["size"].sum())
    stage_sum = {s: float(spans.loc[spans["range"] == s, "end_s"].sub(spans.loc[spans["range"] == s, "start_s"]).sum())
                 for s in STAGES}
    stage_ms = {s: stage_sum[s] * 1e3 / n if n else float("nan") for s in STAGES}
    req = spans[spans["range"] == "request"]
    copy = spans[spans["range"] == "copy"]
    dev_prep = spans[spans["range"] == "preprocess"]
    copy_s = float((copy["end_s"] - copy["start_s"]).sum())
    done = prep[(prep["end_s"] >= 0) & (prep["end_s"] <= window_s)]
    prep_ms = float((done["end_s"] - done["start_s"]).mean() * 1e3) if len(done) else float("nan")
    prep_busy = _clipped(prep["start_s"], prep["end_s"], 0.0, window_s) / (workers * window_s)
    copy_busy = _clipped(copy["start_s"], copy["end_s"], 0.0, window_s) / window_s
    staged = spans[spans["range"].isin(STAGES)]
    gpu_busy = (union_seconds(staged["start_s"], staged["end_s"], 0.0, window_s) if overlap
                else sum(stage_sum.values())) / window_s
    row = {
        "window_s": window_s, "window_batches": n, "window_pages": pages,
        "pages_s": pages / window_s,
        "decode_tok_s": float(batches["budget_sum"].sum()) / window_s,
        "slot_tok_s": float((batches["size"] * batches["budget_max"]).sum()) / window_s,
        "wasted_decode_slots": wasted_fraction(batches),
        "gpu_busy": gpu_busy,
        **{f"{s}_ms": stage_ms[s] for s in STAGES},
        "batch_ms": float((req["end_s"] - req["start_s"]).mean() * 1e3) if len(req) else float("nan"),
        "prep_ms_page": prep_ms,
        "prep_pages_s": workers * 1e3 / prep_ms if prep_ms > 0 else float("nan"),
        "prep_busy": prep_busy,
        "h2d_ms": copy_s * 1e3 / len(copy) if len(copy) else float("nan"),
        "dev_prep_ms": float((dev_prep["end_s"] - dev_prep["start_s"]).mean() * 1e3) if len(dev_prep) else float("nan"),
        "h2d_gbs": float(batches["copy_bytes"].sum()) / copy_s / 1e9 if copy_s > 0 else float("nan"),
        "copy_busy": copy_busy,
        "wait_s": float(batches["wait_ms"].sum()) / 1e3,
        "experts_step": float(batches["experts_step"].median()) if n else float("nan"),
        "peak_mem_bytes": peak_mem_bytes,
    }
    row["bound"] = bound(prep_busy, copy_busy, gpu_busy, stage_ms)
    return row


__all__ = ["SATURATED", "summarize", "bound", "wasted_fraction", "union_seconds"]
