"""Holistic Trace Analysis (HTA) as an independent reader of a profiled request's trace: busy and idle
of the request and of each stage, beside the harness's own reading (``harness.measure.trace_stages``).

``hta_table(trace)`` (``trace_stages.STAGE_COLUMNS``, ms), from HTA's own parse of the trace (its
symbols, times and launch links):

* ``request``: ``TraceAnalysis.get_temporal_breakdown`` over the whole trace, as HTA publishes it:
  kernel time = first GPU activity's start to the last one's end, idle = kernel time - the union of
  the activities' intervals; busy = kernel time - idle;
* each stage: the same function over the GPU activities HTA links (``index_correlation``) to a
  launch made inside one of the stage's ``harness::<stage>#<call>`` host annotations, one annotation
  at a time; a stage's annotations add up.

``compare(trace)`` puts both side by side with the relative differences (busy against busy, idle
against the span) and whether each is within ``TOLERANCE``; ``caveats`` says which are not.

HTA rounds every event inward to whole µs by default (its ns-rounding, for overlapping events of
old traces): a batch-1 decode step's kernels of a few µs then lose a large share of their time.
``hta_table`` turns that off (``HTA_DISABLE_NS_ROUNDING=1``) unless ``rounding=True``.

HTA is a test and development dependency (``scripts/bootstrap.sh`` installs it without its
notebook dependencies); without it ``hta_table`` raises one ``HarnessError``.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

import pandas as pd

from ..anatomy.stages import RECORDED_STAGES, REQUEST
from ..errors import HarnessError
from ..measure.recorder import parse_annotation
from ..measure.trace_stages import STAGE_COLUMNS, stage_table

#: relative difference within which the two readers agree (busy: of busy; idle: of the span)
TOLERANCE = 0.01
NS_ROUNDING_ENV = "HTA_DISABLE_NS_ROUNDING"
COMPARE_COLUMNS = ["stage", "kernels", "busy_ms", "hta_busy_ms", "busy_diff", "idle_ms", "hta_idle_ms", "idle_diff",
                   "span_ms", "agree"]


@contextlib.contextmanager
def _quiet(rounding: bool):
    """HTA's INFO/WARNING lines held back and its ns-rounding off (unless ``rounding``) inside the block."""
    saved = os.environ.get(NS_ROUNDING_ENV)
    if not rounding:
        os.environ[NS_ROUNDING_ENV] = "1"
    level = logging.getLogger("hta").level
    logging.getLogger("hta").setLevel(logging.ERROR)
    try:
        yield
    finally:
        logging.getLogger("hta").setLevel(level)
        if saved is None:
            os.environ.pop(NS_ROUNDING_ENV, None)
        else:
            os.environ[NS_ROUNDING_ENV] = saved


def _analysis(trace: Path, tmp: Path):
    try:
        from hta.trace_analysis import TraceAnalysis
    except ImportError as exc:
        raise HarnessError(f"Holistic Trace Analysis is not installed ({exc})",
                           "run scripts/bootstrap.sh (it installs holistictraceanalysis with its runtime needs)") \
            from exc
    shutil.copy(trace, tmp / ("rank-0" + "".join(trace.suffixes[-2:])))
    return TraceAnalysis(trace_dir=str(tmp))


def _breakdown(ta, gpu: pd.DataFrame) -> tuple:
    """(busy µs, kernel time µs) of HTA's temporal breakdown over the GPU rows ``gpu`` alone."""
    whole = ta.t.traces
    ta.t.traces = {0: gpu.copy()}
    try:
        r = ta.get_temporal_breakdown(visualize=False).iloc[0]
    finally:
        ta.t.traces = whole
    return float(r["kernel_time(us)"] - r["idle_time(us)"]), float(r["kernel_time(us)"])


def hta_table(trace, rounding: bool = False) -> pd.DataFrame:
    """``STAGE_COLUMNS`` of the trace at ``trace`` as HTA reads it (module docstring)."""
    trace = Path(trace)
    with tempfile.TemporaryDirectory() as tmp, _quiet(rounding):
        ta = _analysis(trace, Path(tmp))
        df = ta.t.get_trace(0)
        names = ta.t.symbol_table.get_sym_table()
        ann_cat = ta.t.symbol_table.get_sym_id_map().get("user_annotation")
        gpu = df[df["stream"].ne(-1)]
        launch = gpu["index_correlation"].map(df.set_index("index")["ts"])
        acc: dict = {}
        for r in df[df["cat"] == ann_cat].itertuples():
            parsed = parse_annotation(str(names[r.name]))
            if parsed is None or parsed[0] not in RECORDED_STAGES:
                continue
            sub = gpu[(launch >= r.ts) & (launch <= r.ts + r.dur)]
            busy, span = _breakdown(ta, sub) if len(sub) else (0.0, 0.0)
            a = acc.setdefault(parsed[0], [0, 0.0, 0.0])
            a[0], a[1], a[2] = a[0] + len(sub), a[1] + busy, a[2] + span
        busy, span = _breakdown(ta, gpu)
        acc[REQUEST] = [len(gpu), busy, span]
    rows = [{"stage": s, "kernels": n, "busy_ms": b / 1e3, "span_ms": sp / 1e3, "idle_ms": (sp - b) / 1e3}
            for s, (n, b, sp) in acc.items()]
    return pd.DataFrame(rows, columns=STAGE_COLUMNS)


def compare(trace, rounding: bool = False, tolerance: float = TOLERANCE) -> pd.DataFrame:
    """``COMPARE_COLUMNS``: per stage the harness's reading and HTA's, busy_diff = (HTA - harness) /
    harness busy, idle_diff = (HTA - harness idle) / harness span, agree = both within ``tolerance``."""
    ours = stage_table(trace).set_index("stage")
    theirs = hta_table(trace, rounding).set_index("stage")
    rows = []
    for stage, r in ours.iterrows():
        h = theirs.loc[stage] if stage in theirs.index else None
        hb, hi = (float(h["busy_ms"]), float(h["idle_ms"])) if h is not None else (None, None)
        bd = (hb - r["busy_ms"]) / r["busy_ms"] if hb is not None and r["busy_ms"] else None
        idd = (hi - r["idle_ms"]) / r["span_ms"] if hi is not None and r["span_ms"] else None
        rows.append({"stage": stage, "kernels": r["kernels"], "busy_ms": r["busy_ms"], "hta_busy_ms": hb,
                     "busy_diff": bd, "idle_ms": r["idle_ms"], "hta_idle_ms": hi, "idle_diff": idd,
                     "span_ms": r["span_ms"], "agree": bd is not None and abs(bd) <= tolerance
                     and (idd is None or abs(idd) <= tolerance)})
    return pd.DataFrame(rows, columns=COMPARE_COLUMNS)


def caveats(table: pd.DataFrame, tolerance: float = TOLERANCE) -> list:
    """One line per stage of a ``compare`` table where the readers differ by more than ``tolerance``."""
    out = []
    for r in table[~table["agree"]].itertuples():
        what = ", ".join(f"{name} {100 * v:+.1f}%" for name, v in (("busy", r.busy_diff), ("idle", r.idle_diff))
                         if v is not None and abs(v) > tolerance) or "missing in HTA's reading"
        out.append(f"{r.stage}: HTA differs from the harness beyond {100 * tolerance:.0f}% ({what})")
    return out


__all__ = ["hta_table", "compare", "caveats", "TOLERANCE", "COMPARE_COLUMNS", "NS_ROUNDING_ENV"]
