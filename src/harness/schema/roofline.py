"""``roofline.csv``: the roofline join of a run (``harness.roofline.join``: measured times x analytic
FLOPs and bytes; written by ``harness.report.report``, read by ``summarize`` and the README tables).
One ``level = stage`` row per case x stage (the five stages and ``request``) and ``level = op_family``
rows per case x stage x op family. The math of each column: ``harness.roofline.join`` and
``harness.roofline.point``; an efficiency, MFU or MBU above 1.0 is left empty and kept in
``above_ceiling`` (``harness.roofline.flags``). ``*_cal`` columns use the calibrated ceilings, the
others the dense datasheet ones.
"""
from __future__ import annotations

from .table import table

ROOFLINE_CSV = table("roofline.csv", """
case | | label | case name
stage | | label | stage (or request)
level | | label | stage or op_family
op_family | | label | op group of the row (op_family rows)
kernel_categories | | label | kernel-name categories in the row, by busy time
analytic_families | | label | analytic families in the row's op group
attribution | | label | how the kernels were given their modules
timer | | label | cuda_event or host
measured_ms | ms | measured | the span the efficiency divides: the median of the timed repeats
gpu_ms | ms | measured | GPU span, CUDA events
host_ms | ms | measured | host span, host clock
measured_min_ms | ms | measured | min over the timed repeats
measured_max_ms | ms | measured | max over the timed repeats
cv | fraction | derived | coefficient of variation over the timed repeats
repeats | | measured | timed repeats
kernel_busy_ms | ms | measured | union of the kernel intervals (profiled request)
idle_ms | ms | derived | max(span - busy, 0)
idle_fraction | fraction | derived | idle_ms / span
idle_basis | | label | which span and busy time the idle pairs
kernels | | measured | kernels (profiled request)
tensor_flops | FLOP | analytic | matmul / conv / attention FLOPs the chosen kernels execute
flops_useful | FLOP | analytic | causal, unpadded FLOPs (MFU)
flops_counted | FLOP | analytic | FLOPs under the counted (full S x S) convention
vector_flops | FLOP | analytic | norms, activations, softmax, elementwise
bytes | B | analytic | minimum DRAM traffic of the execution model
bytes_weights | B | analytic | weight bytes (MoE: experts touched)
bytes_kv_read | B | analytic | KV cache bytes read
bytes_kv_write | B | analytic | KV cache bytes written
intensity | FLOP/B | analytic | tensor_flops / bytes
achieved_tflops | TFLOP/s | derived | tensor_flops / measured_ms
achieved_gbs | GB/s | derived | bytes / measured_ms
peak_tflops | TFLOP/s | setting | dense datasheet peak of the dtype
mem_bw_gbs | GB/s | setting | datasheet memory bandwidth
ridge | FLOP/B | derived | peak_tflops / mem_bw_gbs
floor_ms | ms | derived | max(tensor_flops / peak, bytes / bandwidth), datasheet
efficiency | fraction | derived | floor_ms / measured_ms
efficiency_busy | fraction | derived | floor_ms / kernel_busy_ms
cal_tflops | TFLOP/s | measured | calibrated GEMM ceiling
cal_gbs | GB/s | measured | calibrated copy bandwidth
cal_ridge | FLOP/B | derived | cal_tflops / cal_gbs
floor_ms_cal | ms | derived | the floor under the calibrated ceilings
efficiency_cal | fraction | derived | floor_ms_cal / measured_ms
efficiency_busy_cal | fraction | derived | floor_ms_cal / kernel_busy_ms
bound | | derived | launch/host (idle > 50%), compute, memory or overhead
bound_basis | | label | which ridge or idle the bound comes from
mfu | fraction | derived | flops_useful / measured_ms / peak (vision, prefill)
mfu_cal | fraction | derived | MFU against the calibrated ceiling
mbu | fraction | derived | mbu_bytes / measured_ms / bandwidth (decode)
mbu_cal | fraction | derived | MBU against the calibrated bandwidth
mbu_bytes | B | analytic | weight bytes of the experts touched + KV bytes read
routing | | label | where the MoE bytes' experts come from
note | | label | what to know about the row
above_ceiling | | derived | efficiency, MFU or MBU values above 1.0 and what to check
""")
ROOFLINE_COLUMNS = ROOFLINE_CSV.columns
#: label columns of the roofline table; every other column is a float (NaN where not defined)
ROOFLINE_TEXT = ("case", "stage", "level", "op_family", "kernel_categories", "analytic_families", "attribution",
                 "timer", "idle_basis", "bound", "bound_basis", "routing", "note", "above_ceiling")

__all__ = ["ROOFLINE_CSV", "ROOFLINE_COLUMNS", "ROOFLINE_TEXT"]
