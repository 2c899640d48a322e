"""The steady window's arithmetic: raw observations of one configuration -> its row of
``throughput.csv`` (``summarize``), and the rule that names what bounds it (``bound``).

Raw observations (one table each, times in seconds from the window start, which is a synchronised
device-idle point; the window ends at ``window_s``, synchronised too):

* batches (``BATCH_COLUMNS``): one row per batch of the window: its pages, their decode budgets'
  max and sum [tokens], the bytes copied to the device, how long the main thread waited for the
  batch's pages before launching it [ms], and the median over its decode steps and MoE layers of the
  distinct experts the batch's rows touched (``models.routing.experts_per_step``; empty without counts);
* spans (``SPAN_COLUMNS``): one row per timed range of a batch: ``request`` and the five stages
  (marks on the compute stream: CUDA events, or the host clock on the CPU), ``copy`` (marks on
  the copy stream) and, with device preprocessing, ``preprocess`` (after the copy, same stream);
* prep (``PREP_COLUMNS``): one row per page a worker prepared around the window: worker lane and
  interval (host clock).

Every number of ``COLUMNS`` comes from these by the formula in its description.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..anatomy.stages import STAGES, VISION_STAGES

BATCH_COLUMNS = ["config", "batch_no", "size", "pages", "budget_max", "budget_sum", "copy_bytes", "wait_ms",
                 "experts_step"]
SPAN_COLUMNS = ["config", "batch_no", "range", "start_s", "end_s"]
PREP_COLUMNS = ["config", "page", "worker", "start_s", "end_s"]

#: a resource busy for at least this fraction of the window is saturated (see ``bound``)
SATURATED = 0.85

#: throughput.csv's columns, in order: column | unit | provenance | what it is (read by ``_columns``; a
#: backslash at a line's end joins it to the next)
_COLUMNS_TEXT = """
config | | setting | configuration name (b<batch>)
batch | pages | setting | pages decoded together (throughput.batches)
workers | processes | setting | preprocessing worker processes (throughput.workers)
pages | pages | setting | distinct pages the run cycles through (throughput.pages or the folder)
tokens | | setting | decode budget per page: fixed, or the seeded uniform range
routing | | setting | MoE routing the pages ran (workload.routing: the weights' own, or balanced with its seed)
window_s | s | measured | wall clock of the steady window, synchronised at both edges
window_batches | batches | measured | batches run inside the window
window_pages | pages | measured | pages decoded inside the window
pages_s | pages/s | derived | window_pages / window_s
decode_tok_s | tok/s | derived | sum of the window's page budgets / window_s (tokens a user gets)
slot_tok_s | tok/s | derived | sum of batch x its longest budget / window_s (tokens the device decoded)
wasted_decode_slots | fraction | derived | sum(B x max budget - sum of budgets) / sum(B x max budget) over the \
window's batches: decode slots spent on pages already finished (what continuous batching would win back)
gpu_busy | fraction | derived | sum of the five stages' spans / window_s (compute stream; host clock on the CPU)
sam_ms | ms/batch | measured | sam span per batch, mean over the window's batches
sam_mfu | fraction | derived | SAM's analytic useful FLOPs of a batch (harness.analytic) / sam_ms / the \
device's dense datasheet peak in the run's dtype; empty with pages of several layouts
clip_ms | ms/batch | measured | clip span per batch, mean
projector_ms | ms/batch | measured | projector span per batch (with its glue), mean
prefill_ms | ms/batch | measured | prefill span per batch, mean
decode_ms | ms/batch | measured | decode span per batch, mean
batch_ms | ms/batch | measured | request span per batch (first stage start to last stage end), mean
prep_ms_page | ms/page | measured | worker time per page (read, decode, preprocess, request build), mean over \
the pages finished inside the window
prep_pages_s | pages/s | derived | workers x 1000 / prep_ms_page: what the pool sustains when never idle
prep_busy | fraction | derived | worker busy time inside the window / (workers x window_s)
h2d_ms | ms/batch | measured | copy span per batch (host to device, with the cast), mean
dev_prep_ms | ms/batch | measured | device preprocessing span per batch (execution.preprocess=device: resize, \
pad, normalise and tiles on the copy stream, after the copy), mean; empty when the host preprocesses
h2d_gbs | GB/s | derived | sum of copy_bytes / sum of copy spans, 1e9 bytes
copy_busy | fraction | derived | copy spans inside the window / window_s
wait_s | s | measured | main thread waiting for preprocessed batches inside the window
experts_step | experts | measured | distinct experts per MoE layer per decode step over a batch's rows, median \
over the window's batches of each batch's median (device routing counts)
peak_mem_bytes | bytes | measured | peak allocated device memory in the window (torch allocator; weights \
included); empty on the CPU
bound | | derived | what bounds the configuration (harness.throughput.window.bound)
"""


def _columns(text: str) -> list:
    """(column, unit, provenance, what it is) rows of a ``|``-separated table, one row a line."""
    rows = text.strip().splitlines()
    return [tuple(cell.strip() for cell in row.split("|", 3)) for row in rows]


COLUMNS = _columns(_COLUMNS_TEXT)
COLUMN_NAMES = [c[0] for c in COLUMNS]


def _clipped(start, end, lo: float, hi: float) -> float:
    """Total length of intervals [start, end] inside [lo, hi] [s]."""
    s, e = np.clip(np.asarray(start, float), lo, hi), np.clip(np.asarray(end, float), lo, hi)
    return float(np.sum(e - s))


def wasted_fraction(batches: pd.DataFrame) -> float:
    """``wasted_decode_slots`` of the window's batches (see COLUMNS)."""
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


def summarize(batches: pd.DataFrame, spans: pd.DataFrame, prep: pd.DataFrame, window_s: float, workers: int,
              peak_mem_bytes=None) -> dict:
    """The derived columns of ``COLUMNS`` for one configuration's window (settings columns excluded)."""
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
    gpu_busy = sum(stage_sum.values()) / window_s
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


__all__ = ["BATCH_COLUMNS", "SPAN_COLUMNS", "PREP_COLUMNS", "SATURATED", "COLUMNS", "COLUMN_NAMES", "summarize",
           "bound", "wasted_fraction"]
