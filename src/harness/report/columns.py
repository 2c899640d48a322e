"""The report's columns, each declared once: name, header text, unit, provenance, formatter.

A ``Column`` says what one report column holds: its ``header`` text and ``unit``, where its
number comes from (``provenance``: *measured* in this run, *analytic* from the cost model,
*derived* from both; empty for labels), the ``basis`` of that (which ceiling, which request, what
it divides) and how a value is written (``fmt``). Its title is built from these, so every
header states its provenance the same way: ``e2e ms (measured) [min–max]``.

A section puts records (dicts keyed by column name) through ``table(names, records)``, which
writes them with the one Markdown table writer (``harness.markdown.table``). A new column is one
``Column`` in ``COLUMNS`` and its name in a section's list.

Formatters (``fmt``) take the record's value: a number, or a tuple for composite cells
(``spread``: value, min, max; ``pair``: datasheet, calibrated; ``utilisation``: MFU or MBU with
both). Missing values (None, NaN) are written as ``DASH``; a string is a finished cell (a section's
'=' or 'overhead') and is written as given.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ..floats import finite as _f
from ..markdown import LEFT, RIGHT
from ..markdown import table as markdown_table
from ..roofline.flags import ABOVE_CEILING

DASH = "–"


# ------------------------------------------------------------------------------- formatters

def numeric(body: Callable) -> Callable:
    """A formatter that writes a number as ``body(x)``; a string is a finished cell, written as given;
    a missing value (None, NaN, inf) is ``DASH``."""
    def write(v) -> str:
        if isinstance(v, str):
            return v
        x = _f(v)
        return DASH if x is None else body(x)
    return write


def fixed(fmt: str = "{:,.2f}", scale: float = 1.0) -> Callable:
    """A number / ``scale`` through ``fmt`` (``DASH`` when missing)."""
    return numeric(lambda x: fmt.format(x / scale))


def _significant(x: float) -> str:
    """About 4 significant digits, thousands separators for large values."""
    if x == 0:
        return "0"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:,.2f}" if abs(x) >= 1 else f"{x:.3g}"


def sig(scale: float = 1.0) -> Callable:
    """A number / ``scale`` with about 4 significant digits, thousands separators for large values."""
    return numeric(lambda x: _significant(x / scale))


#: a number with three decimals below 100, one from 100 on ('0.438', '1,234.5')
magnitude = numeric(lambda x: f"{x:,.3f}" if abs(x) < 100 else f"{x:,.1f}")


def _percent(x: float) -> str:
    return f"{100 * x:.1f}%"


#: a fraction as a percentage with one decimal
pct = numeric(_percent)


def _capped(flag: str, limit: float) -> Callable:
    """A fraction as ``pct``; above ``limit`` never as a figure alone: ``flag`` (its ``{pct}`` filled in)."""
    return numeric(lambda x: flag.format(pct=100 * x) if x > limit else _percent(x))


#: an efficiency, MFU or MBU (a fraction of a ceiling) as a percentage; above 1.0 the flag
#: ``ABOVE_CEILING`` (the bytes, the FLOPs or the ceiling is wrong; the report's caveats say which to
#: check, ``harness.roofline.flags.caveats``)
efficiency = _capped(ABOVE_CEILING, 1.0)

#: an occupancy cell above 100%: spans that overlap where they cannot (``occupancy``)
OVER_FULL = "**{pct:.1f}%: over 100%, a bug (overlapping spans)**"
#: a busy fraction of a window as a percentage; above 1.0 ``OVER_FULL`` (the spans overlap, which a
#: busy fraction cannot)
occupancy = _capped(OVER_FULL, 1.0 + 1e-9)


def text(v) -> str:
    """A label as written; ``DASH`` for None or NaN."""
    return DASH if v is None or (isinstance(v, float) and v != v) else str(v)


def spread(fmt: Callable = sig()) -> Callable:
    """(value, min, max) -> 'value [min–max]' (min/max over the timed repeats); the value alone when
    they are missing or equal."""
    def write(v) -> str:
        if v is None or isinstance(v, str):
            return text(v)
        value, lo, hi = v
        if _f(value) is None:
            return DASH
        if _f(lo) is None or _f(hi) is None or _f(lo) == _f(hi):
            return fmt(value)
        return f"{fmt(value)} [{fmt(lo)}–{fmt(hi)}]"
    return write


def pair(fmt: Callable = efficiency, sep: str = " / ") -> Callable:
    """(a, b) -> 'a / b' (datasheet / calibrated)."""
    def write(v) -> str:
        if v is None or isinstance(v, str):
            return text(v)
        return sep.join(fmt(x) for x in v)
    return write


def interval(v) -> str:
    """(ratio, low, high, unstable) -> '33.7x [29.5–43.3]' ('unstable' appended when flagged; the
    value alone without an interval); ``DASH`` for None."""
    if v is None:
        return DASH
    ratio, lo, hi, unstable = v
    text_ = f"{ratio:,.2f}x" if _f(lo) is None or _f(hi) is None else f"{ratio:,.2f}x [{lo:,.2f}–{hi:,.2f}]"
    return text_ + (" unstable" if unstable else "")


#: appended to an MBU cell whose decode MoE bytes used the uniform expectation (no measured counts)
EXPECTED_ROUTING_NOTE = " (expected routing)"


def utilisation(v) -> str:
    """(kind, datasheet, calibrated[, expected]) -> 'MFU a / b' (kind MFU or MBU; ``expected``: the
    bytes used the expected routing, said in the cell); ``DASH`` for None."""
    if v is None:
        return DASH
    kind, a, b = v[:3]
    return f"{kind} {efficiency(a)} / {efficiency(b)}" + (EXPECTED_ROUTING_NOTE if v[3:] and v[3] else "")


def routed(fmt: Callable) -> Callable:
    """(value, expected) -> ``fmt(value)``, with ' (expected routing)' when ``expected`` (an MBU whose
    decode MoE bytes used the uniform expectation); a bare value as ``fmt``."""
    def write(v) -> str:
        if isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], bool):
            value, expected = v
            return fmt(value) + (EXPECTED_ROUTING_NOTE if expected else "")
        return fmt(v)
    return write


def bound_cell(v) -> str:
    """(label, prep ms, copy ms, request ms[, raster ms]) -> 'preprocessing: 1,400 > 470 ms' (the
    bound part against the request range) or 'gpu: 470 ms > prep 12 / copy 0.9 ms'; with PDF pages
    (raster ms) prep is their rasterisation + the request's build: 'prep 2.0 + raster 10.0';
    ``DASH`` without a label."""
    if v is None or isinstance(v, str):
        return text(v)
    label, prep, h2d, gpu, *raster = v
    if not isinstance(label, str):
        return DASH
    ms = sig()
    raster = _f(raster[0]) if raster else None
    host = ms(prep) if raster is None else f"{ms(prep)} + raster {ms(raster)}"
    if label == "preprocessing":
        return f"{label}: {host} > {ms(gpu)} ms" if raster is None else \
            f"{label}: {ms(_f(prep) + raster)} (prep {host}) > {ms(gpu)} ms"
    if label == "copy":
        return f"{label}: {ms(h2d)} > {ms(gpu)} ms"
    return f"{label}: {ms(gpu)} ms > prep {host} / copy {ms(h2d)} ms"


def joined(fmt: Callable, sep: str = " / ") -> Callable:
    """Any number of values -> 'a / b / c' (p50 / p90 / p99)."""
    def write(v) -> str:
        return sep.join(fmt(x) for x in v)
    return write


# ---------------------------------------------------------------------------------- columns

@dataclass(frozen=True)
class Column:
    """One report column (module docstring). ``align``: ``RIGHT`` for numbers, ``LEFT`` for text."""

    name: str
    header: str
    unit: str = ""
    provenance: str = ""
    basis: str = ""
    suffix: str = ""
    fmt: Callable = text
    align: str = RIGHT

    @property
    def title(self) -> str:
        """'header unit (provenance, basis) suffix', the parts that are set."""
        head = f"{self.header} {self.unit}".strip()
        how = ", ".join(p for p in (self.provenance, self.basis) if p)
        return " ".join(p for p in (head, f"({how})" if how else "", self.suffix) if p)

    def cell(self, record: dict) -> str:
        return self.fmt(record.get(self.name))


def _label(name: str, header: Optional[str] = None, align: str = LEFT) -> Column:
    return Column(name, header if header is not None else name, align=align)


_SIG = sig()
_SHEET_CAL = "sheet / cal"
_US, _MS = fixed("{:,.1f}"), fixed("{:,.4f}")
_DIFF = fixed("{:+,.1f}")
_REL = fixed("{:.2e}")
_COUNT = fixed("{:,.0f}")
#: the kernel and measurement benches (``harness.bench``): one row per timed call, configuration or probe
BENCH_COLUMNS = [
    _label("step", "step"), _label("impl", "implementation"), _label("method"), _label("shape"),
    _label("change", "config change"), _label("ran", "ran as"), _label("note"), _label("probe"),
    _label("workload"), _label("intermediate"), _label("instrumentation"), _label("estimator"), _label("ok"),
    _label("layer", align=RIGHT), _label("launch", "launch", RIGHT), _label("moe_tokens", "T (tokens)", RIGHT), _label("gemv_rows", "rows", RIGHT),
    _label("splits", align=RIGHT), _label("per", "blocks per split", RIGHT), _label("programs", align=RIGHT),
    _label("warps", align=RIGHT), _label("tiles"), _label("pdl_order", "PDL: global loads before the wait"),
    _label("within", "within 3%"),
    Column("no_sync", "sync-free", "", "measured", "sync debug mode 'error'", fmt=text, align=LEFT),
    # times
    Column("us_step", "step", "µs", "measured", "CUDA events, median of rounds", fmt=_US),
    Column("us_min", "min", "µs", "measured", fmt=_US), Column("us_max", "max", "µs", "measured", fmt=_US),
    Column("delta_us", "difference", "µs", "derived", fmt=_DIFF),
    Column("us_call", "per call", "µs", "measured", "CUDA events, median", fmt=fixed("{:,.2f}")),
    Column("us_p10", "p10", "µs", "measured", fmt=fixed("{:,.2f}")),
    Column("us_p90", "p90", "µs", "measured", fmt=fixed("{:,.2f}")),
    Column("ms_call", "per call", "ms", "measured", "median", fmt=_MS),
    Column("ms_p25", "p25", "ms", "measured", fmt=_MS), Column("ms_p75", "p75", "ms", "measured", fmt=_MS),
    Column("ms_p90", "p90", "ms", "measured", fmt=_MS),
    Column("us_launch", "per launch", "µs", "measured", "CUDA events, graph", fmt=fixed("{:,.2f}")),
    Column("us_boundary", "per boundary", "µs", "derived", "difference / launches", fmt=fixed("{:,.2f}")),
    Column("us_stage", "per stage", "µs", "derived", "(T(n) - T(1)) / (n - 1)", fmt=fixed("{:,.2f}")),
    Column("us_graph", "graph of n stages", "µs", "measured", fmt=_US),
    Column("us_graph_one", "graph of 1", "µs", "measured", fmt=_US),
    Column("span_us", "span", "µs", "measured", "profiler", fmt=_US),
    Column("busy_us", "busy", "µs", "measured", "profiler, union", fmt=_US),
    Column("us_sum", "sum of durations", "µs", "measured", "profiler", fmt=_US),
    Column("launches", "launches", "", "measured", fmt=_COUNT),
    # rates and errors
    Column("mbu_sheet", "MBU", "", "derived", "GB/s / datasheet", fmt=efficiency),
    Column("rel_err", "rel err", "", "measured", "max |out - ref| / max |ref|", fmt=_REL),
    Column("x_dense", "x dense", "", "derived", "dense full ms / ms", fmt=fixed("{:,.2f}")),
    Column("tflops_useful", "TFLOP/s useful", "", "derived", "analytic counted FLOPs / ms", fmt=fixed("{:,.1f}")),
    Column("tflops_exec", "TFLOP/s executed", "", "derived", "analytic FLOPs of the timed code / ms",
           fmt=fixed("{:,.1f}")),
    Column("mfu_sheet", "MFU", "", "derived", "useful TFLOP/s / dense datasheet peak", fmt=efficiency),
    # decode-step parity and numerics
    Column("greedy_prefix", "greedy tokens equal before the first divergence", "", "measured", fmt=_COUNT),
    Column("greedy_equal", "greedy tokens equal in all", "", "measured", fmt=_COUNT),
    Column("logit_diff", "max |logit diff|", "", "measured", "teacher-forced", fmt=_SIG),
    Column("logit_max", "largest |logit|", "", "measured", "reference", fmt=_SIG),
    Column("forced_flips", "steps whose greedy token differs", "", "measured", "teacher-forced", fmt=_COUNT),
    *[c for p, name in (("fused", "fused"), ("local", "local"), ("fp32red", "ref-fp32red")) for c in (
        Column(f"{p}_max_abs", f"{name}: max |d|", "", "measured", "against ref", fmt=_SIG),
        Column(f"{p}_differ", f"{name}: differ", "", "measured", "elements", fmt=_COUNT),
        Column(f"{p}_n", f"{name}: of", "", "measured", "elements", fmt=_COUNT),
        Column(f"{p}_max_ulp", f"{name}: max", "ulp", "measured", "elements >= 1/1000 of the largest", fmt=_COUNT))],
    Column("fused_err_truth", "fused err / truth", "", "measured", "||x - truth|| / ||truth||", fmt=_SIG),
    Column("ref_err_truth", "ref err / truth", "", "measured", "||x - truth|| / ||truth||", fmt=_SIG),
    # compiled kernels
    Column("regs", "registers", "/thread", "measured", "compiled", fmt=_COUNT),
    Column("spills", "spills", "", "measured", "compiled", fmt=_COUNT),
    Column("local_bytes", "local memory (spills)", "B", "measured", "compiled", fmt=_COUNT),
    Column("shared_bytes", "shared memory", "B", "measured", "compiled", fmt=_COUNT),
    Column("narrow_loads", "2-byte global loads", "", "measured", "PTX", fmt=_COUNT),
    Column("per_sm", "programs per SM", "", "derived", "registers, threads, shared memory", fmt=_COUNT),
    Column("waves", "waves", "", "derived", "programs / (per SM x SMs)", fmt=fixed("{:,.2f}")),
    # the measurement's overhead and the host
    Column("ratio", "ratio", "", "derived", "instrumented / bare", fmt=fixed("{:,.4f}")),
    Column("ratio_lo", "95% CI low", "", "derived", "bootstrap", fmt=fixed("{:,.4f}")),
    Column("ratio_hi", "95% CI high", "", "derived", "bootstrap", fmt=fixed("{:,.4f}")),
    Column("ratio_min", "min", "", "derived", "over rounds", fmt=fixed("{:,.3f}")),
    Column("ratio_max", "max", "", "derived", "over rounds", fmt=fixed("{:,.3f}")),
    _label("rounds", align=RIGHT),
    Column("request_ms", "request", "ms", "measured", "host clock, median", fmt=fixed("{:,.1f}")),
    Column("us_range", "per range", "µs", "measured", "median", fmt=fixed("{:,.2f}")),
    Column("us_range_lo", "95% CI low", "µs", "derived", "bootstrap", fmt=fixed("{:,.2f}")),
    Column("us_range_hi", "95% CI high", "µs", "derived", "bootstrap", fmt=fixed("{:,.2f}")),
    _label("ranges", "ranges per request", RIGHT),
    _label("timings", "n", RIGHT),
    Column("ms_median", "median", "ms", "measured", "host clock", fmt=fixed("{:,.3f}")),
    Column("cv_pct", "CV", "%", "derived", "population std / mean", fmt=fixed("{:,.2f}")),
    Column("ms_min", "min", "ms", "measured", fmt=fixed("{:,.3f}")),
    Column("ms_max", "max", "ms", "measured", fmt=fixed("{:,.3f}")),
    Column("slow_calls", "calls > 1.2 x median", "", "measured", fmt=_COUNT),
    # preprocessing (bench preprocess)
    Column("share_pct", "share of the host path", "%", "derived", "median / median of the whole host request build",
           fmt=fixed("{:,.1f}")),
    Column("levels_max", "max |diff|", "8-bit levels", "measured", "device vs host pixels after normalisation, x 255 / 2",
           fmt=fixed("{:,.0f}")),
    Column("differ_frac", "values that differ", "", "measured", "fraction of all view / tile values", fmt=_REL),
    # TPOT from outside
    Column("tpot_ms", "TPOT", "ms", "measured", "(t130 - t2) / 128, median of pairs", fmt=_MS),
    Column("tpot_min", "min", "ms", "measured", fmt=_MS), Column("tpot_max", "max", "ms", "measured", fmt=_MS),
    Column("t_short_ms", "t2", "ms", "measured", "median", fmt=fixed("{:,.2f}")),
    Column("t_long_ms", "t130", "ms", "measured", "median", fmt=fixed("{:,.2f}")),
    Column("ladder_tpot_mean", "ladder TPOT mean", "ms", "measured", "headline.csv", fmt=_MS),
    Column("ladder_tpot_p50", "ladder TPOT p50", "ms", "measured", "headline.csv", fmt=_MS),
    Column("outside_ladder", "outside / ladder mean", "", "derived", fmt=fixed("{:,.3f}")),
]
_COLUMNS = [
    # labels
    _label("case"), _label("mode"), _label("grid"), _label("stage"), _label("execution"),
    _label("batch", align=RIGHT), _label("tokens", "tokens image / prefill / decode", RIGHT),
    _label("requests", "warm-up + timed", RIGHT), _label("median_request", "median request", RIGHT),
    _label("dominant", "dominant stage: bound"), _label("op_family", "op family"),
    _label("op_kernels", "kernels (module attribution)"), _label("op_families", "analytic families"),
    _label("op_categories", "kernel categories (runs without module attribution)"),
    _label("kernel"), _label("category"), _label("steps", align=RIGHT), _label("first_kv", f"first 128: kv"),
    _label("last_kv", "last 128: kv"), _label("window", "steps"),
    _label("routing", "routing"), _label("bytes_routing", "MoE bytes from (analytic)"),
    # headline (the median request)
    Column("e2e", "e2e", "ms", "measured", suffix="[min–max]", fmt=spread()),
    Column("pages_s", "pages/s", "", "derived", "batch / e2e", fmt=fixed("{:,.3g}")),
    Column("bound_by", "bound by", "", "derived", "longest of prep, copy, e2e", fmt=bound_cell, align=LEFT),
    # what a user waits for (the median request; pages/s over the timed repeats back to back)
    Column("call", "generate() call", "ms", "measured", "host clock, synchronised", "[min–max]", fmt=spread()),
    Column("setup_collect", "set-up + collection", "ms", "derived", "call - e2e", "[min–max]", fmt=spread()),
    Column("raster_page", "raster / page", "ms", "measured", "PDF pages, host clock, mean over the rows", "[min–max]",
           fmt=spread()),
    Column("prep_page", "prep / page", "ms", "derived", "prep / batch", "[min–max]", fmt=spread()),
    Column("h2d_page", "copy / page", "ms", "derived", "copy / batch", "[min–max]", fmt=spread()),
    Column("pages_s_gpu", "GPU pages/s", "", "derived", "batch x repeats / sum of calls", fmt=fixed("{:,.3g}")),
    Column("pages_s_e2e", "end-to-end pages/s", "", "derived", "batch x repeats / sum of prep + copy + call",
           fmt=fixed("{:,.3g}")),
    Column("ttft", "TTFT", "ms", "measured", suffix="[min–max]", fmt=spread()),
    Column("ttft_e2e", "TTFT + prep + copy", "ms", "measured", suffix="[min–max]", fmt=spread()),
    Column("tpot_pcts", "TPOT p50 / p90 / p99", "ms", "measured", fmt=joined(fixed())),
    Column("tok_s_head", "tok/s", "", "derived", fmt=fixed("{:,.1f}")),
    Column("request_eff", "request eff", "", "derived", _SHEET_CAL, fmt=pair()),
    # stage times of the median request
    *[Column(f"{s}_ms", s, "ms", "measured", fmt=_SIG) for s in ("sam", "clip", "projector", "prefill", "decode")],
    Column("stage_sum", "stage sum", "ms", "derived", fmt=_SIG),
    Column("between", "between stages", "ms", "derived", "e2e - sum", fmt=_SIG),
    Column("stage_share", "stage sum / e2e", "", "derived", fmt=pct),
    Column("ttft_share", "vision + prefill / TTFT", "", "derived", fmt=pct),
    # execution variants
    Column("tok_s", "tok/s", "", "measured", "median request", fmt=fixed("{:,.1f}")),
    Column("tpot_p50", "TPOT p50", "ms", "measured", fmt=fixed("{:,.3f}")),
    Column("tpot_p90", "p90", "ms", "measured", fmt=fixed("{:,.3f}")),
    Column("tpot_p99", "p99", "ms", "measured", fmt=fixed("{:,.3f}")),
    Column("ttft_ms", "TTFT", "ms", "measured", fmt=fixed("{:,.2f}")),
    Column("kernels_per_step", "kernels/step", "", "measured", "profiled", fmt=fixed("{:,.0f}")),
    Column("syncs_per_step", "syncs/step", "", "measured", "profiled", fmt=fixed("{:,.1f}")),
    Column("decode_idle", "decode idle", "", "derived", fmt=pct),
    Column("decode_cv", "decode CV", "", "measured", fmt=pct),
    Column("mbu_pair", "MBU", "", "derived", _SHEET_CAL, fmt=routed(pair())),
    Column("experts_step", "experts per MoE layer per step", "", "measured", "distinct over the batch, median",
           "[min–max]", fmt=spread(fixed("{:,.0f}"))),
    Column("experts_decode", "experts per MoE layer over the decode", "", "measured", "distinct, median",
           "[min–max]", fmt=spread(fixed("{:,.0f}"))),
    Column("speedup", "speed-up", "", "derived", "decode tok/s / vendor-style batch-1 tok/s, 95% CI",
           fmt=interval),
    Column("busy_ratio", "kernel-busy ratio", "", "derived", "vendor-style busy / this busy per decode step",
           fmt=fixed("{:,.2f}x")),
    Column("span_ratio", "span ratio", "", "derived", "speed-up / kernel-busy ratio", fmt=fixed("{:,.2f}x")),
    Column("tput_vs_b1", "throughput vs best batch 1", "", "derived", "decode tok/s / best batch-1 tok/s, 95% CI",
           fmt=interval),
    Column("tpot_vs_b1", "time per token vs best batch 1", "", "derived", "TPOT p50 / best batch-1 TPOT p50, 95% CI",
           fmt=interval),
    Column("setup_s", "set-up", "s", "measured", fmt=fixed("{:,.1f}")),
    # roofline per stage and per op family
    Column("span_gpu", "GPU span", "ms", "measured", "CUDA events", "[min–max]", fmt=spread()),
    Column("span_host", "host span", "ms", "measured", "host clock", "[min–max]", fmt=spread()),
    Column("host_span", "host span", "ms", "measured", fmt=_SIG),
    Column("busy", "busy", "ms", "measured", "profiled", fmt=_SIG),
    Column("idle", "idle", "", "derived", fmt=pct),
    Column("gflop", "tensor GFLOP", "", "analytic", fmt=sig(1e9)),
    Column("mb", "MB", "", "analytic", fmt=sig(1e6)),
    Column("intensity", "FLOP/B", "", "analytic", fmt=_SIG),
    Column("tflops", "TFLOP/s", "", "derived", "analytic / measured", fmt=_SIG),
    Column("gbs", "GB/s", "", "derived", "analytic / measured", fmt=_SIG),
    Column("floor", "floor", "ms", "derived", _SHEET_CAL, fmt=pair(_SIG)),
    Column("floor_sheet", "floor", "ms", "derived", "sheet", fmt=_SIG),
    Column("eff_span", "eff vs span", "", "derived", _SHEET_CAL, fmt=pair()),
    Column("eff_busy", "eff vs busy", "", "derived", _SHEET_CAL, fmt=pair()),
    Column("util", "MFU / MBU", "", "derived", _SHEET_CAL, fmt=utilisation),
    Column("bound", "bound", "", "derived", "from idle", fmt=text, align=LEFT),
    Column("op_bound", "bound", "", "derived", "intensity vs ridge", fmt=text, align=LEFT),
    Column("kernels", "kernels", "", "measured", fmt=fixed("{:,.0f}")),
    Column("kernel_categories", "kernel categories", "", "", "by busy time", fmt=text, align=LEFT),
    # top kernels
    Column("calls", "calls", "", "measured", fmt=fixed("{:,.0f}")),
    Column("total_ms", "total", "ms", "measured", fmt=fixed("{:,.3f}")),
    Column("mean_us", "mean", "µs", "measured", fmt=fixed("{:,.1f}")),
    Column("busy_share", "of stage busy", "", "derived", fmt=pct),
    # inside the decode step: per module group, against the bandwidth floor (report.step_modules)
    _label("module_group", "module (group)"), _label("attributed_by", "attributed by"),
    Column("launches_step", "launches/step", "", "measured", "profiled", fmt=fixed("{:,.1f}")),
    Column("busy_us_step", "busy", "µs/step", "measured", "profiled, union", fmt=fixed("{:,.1f}")),
    Column("mb_step", "bytes", "MB/step", "analytic", "weights + act + KV", fmt=sig(1e6)),
    Column("gbs_busy", "GB/s", "", "derived", "analytic bytes / busy", fmt=_SIG),
    Column("bw_floor_us", "bandwidth floor", "µs/step", "derived", "bytes / datasheet bandwidth", fmt=fixed("{:,.1f}")),
    Column("floor_share", "floor / busy", "", "derived", "share of the floor", fmt=efficiency),
    Column("above_floor_us", "above the floor", "µs/step", "derived", "busy - floor", fmt=fixed("{:,.1f}")),
    # inside the fused decode step: its in-kernel clock (harness.measure.step_clock)
    Column("interval_us", "release to next release", "µs", "measured", "in-kernel clock, per step, median",
           fmt=fixed("{:,.1f}")),
    Column("work_us", "work", "µs", "measured", "in-kernel clock: last end - release, median", fmt=fixed("{:,.1f}")),
    Column("handoff_us", "hand-off", "µs", "measured", "in-kernel clock: next release - last end, median",
           fmt=fixed("{:,.1f}")),
    Column("lead_us", "resident before release", "µs", "measured", "in-kernel clock: release - entry, median",
           fmt=fixed("{:,.1f}")),
    Column("step_share", "of the step", "", "derived", "interval / the step's", fmt=pct),
    Column("clock_launches", "launches/step", "", "measured", "in-kernel clock", fmt=fixed("{:,.1f}")),
    Column("floor_interval", "floor / interval", "", "derived", "share of the floor", fmt=efficiency),
    Column("entry_end_us", "first entry to last end", "µs", "measured", "in-kernel clock, per step, median",
           fmt=fixed("{:,.1f}")),
    # TPOT against position
    Column("tpot_p50_all", "TPOT p50", "ms", "measured", fmt=fixed()),
    Column("first_p50", "p50", "ms", "measured", fmt=fixed()),
    Column("last_p50", "p50", "ms", "measured", fmt=fixed()),
    Column("last_over_first", "last / first", "", "derived", fmt=fixed("{:,.3f}")),
    *BENCH_COLUMNS,
]
COLUMNS = {c.name: c for c in _COLUMNS}
assert len(COLUMNS) == len(_COLUMNS), "a column name is declared twice"


def column(name: str) -> Column:
    return COLUMNS[name]


def table(names: list, records: list, columns: Optional[dict] = None) -> list:
    """Markdown lines of ``records`` (dicts keyed by column name) under the columns ``names``
    (from ``COLUMNS``, or ``columns`` for per-table ones such as one column per case)."""
    cols = [(columns or {}).get(n) or COLUMNS[n] for n in names]
    return markdown_table([c.title for c in cols], [[c.cell(r) for c in cols] for r in records],
                          [c.align for c in cols])


__all__ = ["Column", "COLUMNS", "BENCH_COLUMNS", "column", "table", "DASH", "fixed", "sig", "pct", "efficiency", "text",
           "occupancy", "OVER_FULL", "magnitude", "numeric",
           "spread", "pair", "joined", "utilisation", "interval", "routed", "EXPECTED_ROUTING_NOTE", "bound_cell"]
