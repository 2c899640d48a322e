"""The throughput experiment's files (``python -m harness run +experiment=throughput``, written by
``harness.throughput.pipeline``; the arithmetic that fills them: ``harness.throughput.window``):

* ``throughput.csv`` (``THROUGHPUT_CSV``): one row per configuration (batch size), its steady window;
* ``throughput_batches.csv`` (``BATCHES_CSV``): one row per batch of a window;
* ``throughput_spans.csv`` (``SPANS_CSV``): one row per timed range of a batch (the request, the five
  stages on the compute stream, ``copy`` on the copy stream and, with device preprocessing,
  ``preprocess`` after it on the same stream);
* ``throughput_prep.csv`` (``PREP_CSV``): one row per page a preprocessing worker prepared.

Times in the raw tables are seconds from the window start (a synchronised device-idle point).
"""
from __future__ import annotations

import pandas as pd

from .table import table

THROUGHPUT_CSV = table("throughput.csv", """
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
gpu_busy | fraction | derived | sum of the five stages' spans / window_s (compute stream; host clock on the CPU); \
with throughput.overlap_vision (vision on its own stream) the union of those spans inside the window / window_s
sam_ms | ms/batch | measured | sam span per batch, mean over the window's batches
sam_mfu | fraction | derived | SAM's analytic useful FLOPs of a batch (harness.analytic) / sam_ms / the \
device's dense datasheet peak in the run's dtype; empty with pages of several layouts
clip_ms | ms/batch | measured | clip span per batch, mean
clip_mfu | fraction | derived | CLIP's analytic useful FLOPs of a batch / clip_ms / the datasheet peak (as sam_mfu)
projector_ms | ms/batch | measured | projector span per batch (with its glue), mean
prefill_ms | ms/batch | measured | prefill span per batch, mean
prefill_mfu | fraction | derived | the prefill's analytic useful FLOPs of a batch (the layout's prompt, top-k \
experts per token) / prefill_ms / the datasheet peak (as sam_mfu)
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
""")
BATCHES_CSV = table("throughput_batches.csv", """
config | | label | configuration name (b<batch>)
batch_no | | label | batch index in the configuration's run (warm-up batches first)
size | pages | setting | pages in the batch
pages:text | | label | the batch's page indices
budget_max | tokens | setting | the longest decode budget of its pages
budget_sum | tokens | setting | the sum of its pages' decode budgets
copy_bytes | bytes | measured | bytes copied to the device for the batch
wait_ms | ms | measured | main thread waiting for the batch's pages before launching it
experts_step | experts | measured | median over its decode steps and MoE layers of the distinct experts its rows \
touched (empty without counts)
""")
SPANS_CSV = table("throughput_spans.csv", """
config | | label | configuration name
batch_no | | label | batch index
range | | label | request, sam, clip, projector, prefill, decode, copy or preprocess (device)
start_s | s | measured | range start from the window start (CUDA events; host clock on the CPU)
end_s | s | measured | range end from the window start
""")
PREP_CSV = table("throughput_prep.csv", """
config | | label | configuration name
page | | label | page index
worker | | label | worker lane (in order of first appearance)
start_s | s | measured | preparation start from the window start, host clock
end_s | s | measured | preparation end from the window start, host clock
""")
COLUMN_NAMES = THROUGHPUT_CSV.columns
SPAN_COLUMNS = SPANS_CSV.columns


def read_throughput(run_dir) -> pd.DataFrame:
    """A throughput run's throughput.csv (empty frame when it has none)."""
    return THROUGHPUT_CSV.read(run_dir)


#: the parent run directory of ``throughput.gpus=N`` (``harness.throughput.scaling``): one row per configuration
SCALING_CSV = table("scaling.csv", """
config | | setting | configuration name (b<batch>)
batch | pages | setting | pages decoded together on each GPU
gpus | GPUs | setting | GPUs of phase 2 (throughput.gpus), one process each
workers | processes | setting | preprocessing worker processes per GPU
one_gpu_pages_s | pages/s | derived | pages_s of phase 1 (the first GPU alone, same settings, same run)
one_gpu_bound | | derived | bound of phase 1
aggregate_pages_s | pages/s | derived | sum over the GPUs of phase 2 of their pages_s
gpu_pages_s_min | pages/s | derived | the slowest GPU's pages_s in phase 2
gpu_pages_s_max | pages/s | derived | the fastest GPU's pages_s in phase 2
speedup | ratio | derived | aggregate_pages_s / one_gpu_pages_s: what N GPUs give over one, in the same run
speedup_lo | ratio | derived | 95% percentile bootstrap interval of speedup: each window's batch cycles (one \
batch's start to the next's, the last to the window's end) resampled on their own, a GPU's pages/s = pages / \
the resampled cycles' sum (2,000 draws, seed 0); empty with fewer than 2 batches in a window
speedup_hi | ratio | derived | upper end of that interval
efficiency | fraction | derived | scaling efficiency, speedup / gpus; empty above 1.0 (kept in above_ceiling)
above_ceiling | | derived | an efficiency above 1.0 and what to check (a GPU of phase 2 ran faster than the \
GPU alone)
bounds | | derived | each GPU's bound in phase 2 (gpu id: bound)
windows_overlap | fraction | derived | phase 2's windows in common (latest start to earliest end, starts \
from the barrier's release times) / the longest window; 1 = the windows ran at the same time
""")


__all__ = ["SCALING_CSV", "THROUGHPUT_CSV", "BATCHES_CSV", "SPANS_CSV", "PREP_CSV", "COLUMN_NAMES", "SPAN_COLUMNS",
           "read_throughput"]
