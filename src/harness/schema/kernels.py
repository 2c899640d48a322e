"""``kernels.csv``: every kernel of one profiled request per case (``measure.kernels=true``; written
by ``harness.run`` from ``harness.measure.kernels.kernel_table``, read by the op-family join
``harness.roofline.ops`` and the report's kernel sections). On a machine without CUDA the rows are
CPU operators (``device`` = cpu, top-level ops only)."""
from __future__ import annotations

from .table import table

KERNELS_CSV = table("kernels.csv", """
case | | label | case name
device | | label | cuda or cpu
name | | label | kernel (or CPU operator) name
category | | label | kernel-name category (harness.measure.kernels.CATEGORIES)
range | | label | innermost recorded range open at the launch
stage | | label | the stage of that range (empty outside every stage)
call | | label | which call of the stage
step | | label | decode step of the launch (decode only)
start_ms | ms | measured | kernel start, profiler clock, from the request's start
dur_ms | ms | measured | kernel duration, profiler
stream | | label | device stream
module:text | | label | innermost module open at the launch (empty without attribution)
family:text | | label | the module's analytic family
op_group:text | | label | the family's roofline op group
attribution | | label | how the module was found: hooks, aligned, unattributed or name
""")
#: the columns of one request's kernel table (``kernel_table``); kernels.csv adds ``case``
KERNEL_COLUMNS = [c for c in KERNELS_CSV.columns if c != "case"]

__all__ = ["KERNELS_CSV", "KERNEL_COLUMNS"]
