"""``analytic.csv``: the analytic FLOPs and bytes of every case a run measured, per stage and cost
family, with TOTAL rows per stage (``harness.analytic.compose.workload_costs``, joined with the
measured routing by ``harness.roofline.join.analytic_for_case``; written by ``harness.report.report``).
The cost model's frame has ``COST_COLUMNS`` (also the columns of ``analyze``'s static_compute.csv);
the run's file adds where the MoE bytes' experts come from and the KV bytes only the growing cache's
own copies move."""
from __future__ import annotations

from .table import table

ANALYTIC_CSV = table("analytic.csv", """
case | | label | case name (base, gundam-2x3, ...)
stage | | label | sam, clip, projector, prefill or decode
family | | label | cost-family key (harness.analytic.families.FAMILY_BY_NAME) or TOTAL for a stage total row
variant | | label | sub-kind of a family within a stage ('window' / 'global' SAM attention, 'neck' / 'downsample' \
convolutions), '' otherwise
step | | label | decode step index (0 = first decode step) on per-step rows, -1 otherwise
cache_len | tokens | analytic | KV-cache length before the forward: 0 for prefill, n for a decode step, -1 for rows \
aggregated over steps and for vision stages
count | calls | analytic | module invocations in the row (layers x views x steps)
tensor_flops | FLOP | analytic | matmul/conv/attention FLOPs the chosen attention kernel executes
vector_flops | FLOP | analytic | elementwise/norm/softmax FLOPs (convention in families.py)
flops_counted | FLOP | analytic | FlopCounterMode convention: full S x T attention, padded SAM windows
flops_useful | FLOP | analytic | causal-half prefill attention, unpadded SAM windows
bytes_weights | B | analytic | parameter bytes read (once per call; MoE: experts touched)
bytes_act_read | B | analytic | activation bytes read
bytes_act_write | B | analytic | activation bytes written
bytes_kv_read | B | analytic | KV-cache bytes read (attention, and the growing-cache copy)
bytes_kv_write | B | analytic | KV-cache bytes written
bytes | B | analytic | sum of the five byte columns
params | | analytic | parameters held by the row's modules (counted once per stage, not per call)
params_active | | analytic | parameters one token's computation uses (MoE: top-k experts; no embedding)
intensity | FLOP/B | analytic | tensor_flops / bytes (0 when bytes is 0)
routing | | label | where the MoE weight bytes' experts come from (harness.roofline.join.ROUTING_SOURCES)
bytes_kv_copy_read | B | analytic | KV bytes read only by the growing cache's own copies (growing minus static cache)
bytes_kv_copy_write | B | analytic | KV bytes written only by the growing cache's own copies
""")
#: the cost model's frame (``harness.analytic.compose``) and static_compute.csv
COST_COLUMNS = ANALYTIC_CSV.columns[:ANALYTIC_CSV.columns.index("routing")]
#: the KV bytes only the growing cache's copies move (``harness.roofline.join``)
KV_COPY_COLUMNS = ("bytes_kv_copy_read", "bytes_kv_copy_write")

__all__ = ["ANALYTIC_CSV", "COST_COLUMNS", "KV_COPY_COLUMNS"]
