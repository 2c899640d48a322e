"""``python -m harness compare RUN_A RUN_B [--out DIR]``: side-by-side deltas of two runs.

For every case x stage present in either run (matched by case name): median stage time
(``gpu_ms``, or ``host_ms`` on a host-timer run), and per case TTFT, TPOT p50, decode tokens/s
and end-to-end ms; with the roofline efficiency (datasheet ceilings) where both runs have a
``roofline.csv``. ``delta`` = B - A, ``ratio`` = B / A (below 1 = B is faster for times; above 1
= B is faster for tok/s). Efficiency uses the datasheet ceilings, the calibrated ones where a run
has no datasheet peak.

Noise: every time and request row carries the timed repeats of each side (``repeats_a``,
``repeats_b``) and the seeded bootstrap 95% interval of B / A (``ratio_lo``, ``ratio_hi``:
``stats.ratio_ci`` over the per-repeat values of both runs, from the one summarizer's
``Summary.values``). ``within_noise`` is true when that interval holds 1, or when a side has fewer
than ``MIN_REPEATS`` timed repeats (no interval: too few repeats to tell a difference from noise);
then the ratio says nothing about which run is faster.

A case a signal stopped after some of its timed repeats (manifest ``partial``) is compared over
the repeats it kept and marked ``partial`` (``partial``: which run holds it partial), in the
tables and in the notes.

A folder without ``manifest.json`` or ``stages.csv``, or whose stages.csv cannot be read or lacks
the columns a run writes (``harness.schema.stages.REQUIRED_COLUMNS`` and a time column), is refused with a one-line
error. A run that did not complete (``failed``, ``interrupted``, still ``running``) or measured
nothing is compared as far as it goes and flagged first in the notes.

Output: printed as Markdown, and written to a **new** directory, never into either run (run
directories are never overwritten): ``<parent of RUN_B>/compare-<YYYYmmdd-HHMMSS>-<A>-vs-<B>/``
with ``compare.md`` and ``compare.csv`` (long form: case, stage, metric, a, b, delta, ratio,
ratio_lo, ratio_hi, repeats_a, repeats_b, within_noise, partial, unit). ``--out DIR`` writes to the
new directory DIR instead; an existing path or one inside either run is refused with one line
(``merge.check_out``, the refusal ``merge`` applies to its ``--out``).
"""
from __future__ import annotations

import argparse
import datetime as _dt
from pathlib import Path
from typing import Optional

import pandas as pd

from ..containment import refuse_out_links
from ..floats import finite as _f
from ..markdown import LEFT
from ..measure import stats
from ..measure.summary import Summary, summarize
from ..roofline import flags
from ..rundir import RunData, claim, open_run
from ..schema.manifest import Manifest
from ..schema.roofline import ROOFLINE_CSV
from .columns import Column, efficiency, interval, magnitude
from .columns import table as columns_table
from .merge import check_out
from ..anatomy.stages import STAGES

REQUEST_METRICS = [("ttft_ms", "TTFT", "ms"), ("tpot_p50_ms", "TPOT p50", "ms"), ("decode_tok_s", "decode tok/s", "tok/s"),
                   ("e2e_ms", "end-to-end", "ms")]
COLUMNS = ["case", "stage", "metric", "a", "b", "delta", "ratio", "ratio_lo", "ratio_hi", "repeats_a", "repeats_b",
           "within_noise", "partial", "unit"]
#: timed repeats a side needs for an interval of B / A (``stats.ratio_ci``); fewer: within noise
MIN_REPEATS = 2


def _load(path) -> RunData:
    """A run directory read back, or a one-line HarnessError when it is not one."""
    return open_run(path, "compare run directories written by `python -m harness run`",
                    "give two run directories under runs/", tables=False)


def partial_cases(run: RunData) -> dict:
    """{case: 'R of N timed repeats'} of the cases a signal stopped early (manifest ``partial``)."""
    return {c.get("name"): f"{c.get('repeats_done')} of {c.get('repeats_planned')} timed repeats"
            for c in Manifest.of(run.manifest).cases if c.get("partial")}


def state_notes(label: str, run: RunData) -> list:
    """Notes flagging a run that did not complete, kept partial cases or measured nothing (``label``: A or B)."""
    man, notes = run.manifest, []
    status = man.get("status", "unknown")
    partial = partial_cases(run)
    kept = "; ".join(f"{c} ({n})" for c, n in partial.items())
    if status != "complete":
        error = f": {man['error']}" if man.get("error") else ""
        compared = (f"its finished cases are compared, and its partial case{'s' if len(partial) > 1 else ''} {kept} "
                    "over the repeats kept, marked partial" if partial else "only its finished cases are compared")
        notes.append(f"{label} ({run.path.name}) is {status}{error}; {compared}")
    elif partial:
        notes.append(f"{label} ({run.path.name}) holds partial cases, compared over the repeats kept and marked "
                     f"partial: {kept}")
    if not len(run.stages):
        notes.append(f"{label} ({run.path.name}) measured nothing (stages.csv is empty)")
    return notes


def _entry(case, stage, metric, a, b, unit, values=None) -> dict:
    """One long row; ``values``: (A's per-repeat values, B's) for the repeats and the interval of B / A."""
    a, b = _f(a), _f(b)
    va, vb = values if values is not None else ((), ())
    _, lo, hi = stats.ratio_ci(vb, va) if values is not None else (None, None, None)
    ratio = (b / a) if a and b is not None else None
    noise = None
    if values is not None and ratio is not None:
        noise = bool(lo is None or hi is None or min(len(va), len(vb)) < MIN_REPEATS or lo <= 1.0 <= hi)
    return {"case": case, "stage": stage, "metric": metric, "a": a, "b": b,
            "delta": (b - a) if a is not None and b is not None else None, "ratio": ratio, "ratio_lo": lo,
            "ratio_hi": hi, "repeats_a": len(va) if values is not None else None,
            "repeats_b": len(vb) if values is not None else None, "within_noise": noise, "partial": None,
            "unit": unit}


def _values(summary: Summary, case: str, stage: str, column: str):
    """The per-repeat values of ``column`` (finite ones only) in ``summary`` (empty when absent)."""
    v = summary.values(case, stage, column)
    return v[v == v]


def _eff(path: Path) -> dict:
    t = ROOFLINE_CSV.read(path)
    if not {"level", "case", "stage", "efficiency", "efficiency_cal"} <= set(t.columns):
        return {}   # not a roofline.csv this harness wrote: no efficiency rows
    t = t[t["level"] == "stage"]
    return {(r["case"], r["stage"]): (flags.value_of(r, "efficiency") if flags.value_of(r, "efficiency") is not None
                                      else flags.value_of(r, "efficiency_cal")) for r in t.to_dict("records")}


def compare_runs(run_a, run_b) -> tuple:
    """(long DataFrame [COLUMNS], notes) comparing two run directories."""
    A, B = _load(run_a), _load(run_b)
    pa, pb = A.path, B.path
    sa, sb = summarize(A.stages), summarize(B.stages)
    ma, mb = sa.stages, sb.stages
    partial = {"A": partial_cases(A), "B": partial_cases(B)}
    notes = state_notes("A", A) + state_notes("B", B)
    ta, tb = set(ma["timer"]), set(mb["timer"])
    if ta != tb and ta and tb:
        notes.append(f"timers differ (A: {', '.join(sorted(ta))}; B: {', '.join(sorted(tb))}): host and CUDA-event "
                     "times are not comparable")
    da, db = Manifest.of(A.manifest).device_name, Manifest.of(B.manifest).device_name
    if da != db:
        notes.append(f"devices differ (A: {da or 'cpu'}; B: {db or 'cpu'})")
    cases = list(dict.fromkeys(list(mb["case"]) + list(ma["case"])))
    only_a = sorted(set(ma["case"]) - set(mb["case"]))
    only_b = sorted(set(mb["case"]) - set(ma["case"]))
    if only_a:
        notes.append(f"cases only in A: {', '.join(only_a)}")
    if only_b:
        notes.append(f"cases only in B: {', '.join(only_b)}")
    ea, eb = _eff(pa), _eff(pb)
    rows = []
    for case in cases:
        xa = ma[ma["case"] == case].set_index("stage")
        xb = mb[mb["case"] == case].set_index("stage")
        first = len(rows)
        for stage in list(STAGES) + ["request"]:
            if stage not in xa.index and stage not in xb.index:
                continue
            a = xa.loc[stage, "time_ms"] if stage in xa.index else None
            b = xb.loc[stage, "time_ms"] if stage in xb.index else None
            span = {"A": xa.loc[stage, "timer"] if stage in xa.index else None,
                    "B": xb.loc[stage, "timer"] if stage in xb.index else None}
            span = {k: "gpu_ms" if t == "cuda_event" else "host_ms" for k, t in span.items()}
            rows.append(_entry(case, stage, "time", a, b, "ms", (_values(sa, case, stage, span["A"]),
                                                                _values(sb, case, stage, span["B"]))))
            if (case, stage) in ea or (case, stage) in eb:
                rows.append(_entry(case, stage, "efficiency", ea.get((case, stage)), eb.get((case, stage)), "fraction"))
        for col, label, unit in REQUEST_METRICS:
            a = xa.loc["request", col] if "request" in xa.index and col in xa else None
            b = xb.loc["request", col] if "request" in xb.index and col in xb else None
            if _f(a) is not None or _f(b) is not None:
                rows.append(_entry(case, "request", label, a, b, unit, (_values(sa, case, "request", col),
                                                                        _values(sb, case, "request", col))))
        where = ", ".join(side for side in ("A", "B") if case in partial[side])
        for r in rows[first:]:
            r["partial"] = where or None
    return pd.DataFrame(rows, columns=COLUMNS), notes


#: the columns of compare.md's tables (``harness.report.columns``): A and B are medians of the timed repeats
TABLE = {c.name: c for c in [
    Column("case", "case", align=LEFT), Column("stage", "stage", align=LEFT), Column("metric", "metric", align=LEFT),
    Column("a_ms", "A", "ms", fmt=magnitude), Column("b_ms", "B", "ms", fmt=magnitude),
    Column("delta_ms", "delta", "ms", fmt=magnitude),
    Column("a", "A", fmt=magnitude), Column("b", "B", fmt=magnitude), Column("delta", "delta", fmt=magnitude),
    Column("ratio", "B/A", suffix="[95% interval]", fmt=interval), Column("repeats", "repeats A / B"),
    Column("noise", "within noise", align=LEFT),
    Column("eff_a", "eff A", fmt=efficiency), Column("eff_b", "eff B", fmt=efficiency)]}


def _case(r) -> str:
    """The case cell: its name, marked where a run holds it partial."""
    return f"{r.case} (partial in {r.partial})" if isinstance(r.partial, str) and r.partial else r.case


def _ratio(r) -> Optional[tuple]:
    """B / A with its 95% interval, the ``interval`` cell's value (None without a ratio)."""
    return (r.ratio, r.ratio_lo, r.ratio_hi, False) if _f(r.ratio) is not None else None


def _repeats(r) -> str:
    return "–" if _f(r.repeats_a) is None else f"{r.repeats_a:.0f} / {r.repeats_b:.0f}"


def _noise(r) -> str:
    """'yes' (the interval holds 1, or too few repeats to have one) or 'no'; '–' without both sides."""
    if r.within_noise is None or r.within_noise != r.within_noise:
        return "–"
    if not r.within_noise:
        return "no"
    return "yes (too few repeats)" if min(r.repeats_a, r.repeats_b) < MIN_REPEATS else "yes (interval holds 1)"


def render(df: pd.DataFrame, run_a: Path, run_b: Path, notes: list) -> str:
    L = ["# Compare", "", f"- A: `{run_a}`", f"- B: `{run_b}`", "",
         "delta = B - A; ratio = B / A (times: below 1 = B faster; tok/s: above 1 = B faster). "
         "Times are medians of the timed repeats. B/A carries the seeded bootstrap 95% interval over the timed "
         f"repeats of both runs; *within noise* = that interval holds 1, or a run has fewer than {MIN_REPEATS} "
         "timed repeats (no interval): the ratio then does not show which run is faster.", ""]
    st = df[df["metric"] == "time"]
    eff = df[df["metric"] == "efficiency"].set_index(["case", "stage"])
    if len(st):
        L += ["## Stage time", ""]
        rows = []
        for r in st.itertuples():
            e = eff.loc[(r.case, r.stage)] if (r.case, r.stage) in eff.index else {}
            rows.append({"case": _case(r), "stage": r.stage, "a_ms": r.a, "b_ms": r.b, "delta_ms": r.delta,
                         "ratio": _ratio(r), "repeats": _repeats(r), "noise": _noise(r), "eff_a": _f(e.get("a")),
                         "eff_b": _f(e.get("b"))})
        L += columns_table(["case", "stage", "a_ms", "b_ms", "delta_ms", "ratio", "repeats", "noise", "eff_a", "eff_b"],
                           rows, TABLE)
        L.append("")
    rq = df[~df["metric"].isin(["time", "efficiency"])]
    if len(rq):
        L += ["## Request", ""]
        L += columns_table(["case", "metric", "a", "b", "delta", "ratio", "repeats", "noise"],
                           [{"case": _case(r), "metric": f"{r.metric} ({r.unit})", "a": r.a, "b": r.b, "delta": r.delta,
                             "ratio": _ratio(r), "repeats": _repeats(r), "noise": _noise(r)} for r in rq.itertuples()],
                           TABLE)
        L.append("")
    if notes:
        L += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(L)


def default_out(run_a: Path, run_b: Path) -> Path:
    """A new directory ``compare-<time>-A-vs-B`` beside RUN_B, claimed for this process (``rundir.claim``)."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return claim(Path(run_b).resolve().parent / f"compare-{stamp}-{Path(run_a).resolve().name}-vs-{Path(run_b).resolve().name}")


def compare_main(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m harness compare",
                                description="Side-by-side per-case, per-stage deltas of two run directories.")
    p.add_argument("run_a", help="baseline run directory (A)")
    p.add_argument("run_b", help="run directory compared against A (B)")
    p.add_argument("--out", default=None, help="a new output directory (default: <parent of RUN_B>/compare-<time>-A-vs-B/)")
    args = p.parse_args(list(argv))
    a, b = Path(args.run_a), Path(args.run_b)
    out = check_out(args.out, [a, b], "compare") if args.out else None
    df, notes = compare_runs(a, b)
    text = render(df, a, b, notes)
    if out is None:
        out = default_out(a, b)
    else:
        out.mkdir(parents=True)
    refuse_out_links(out, ("compare.csv", "compare.md"), what="compare")   # no write through a link
    df.to_csv(out / "compare.csv", index=False)
    (out / "compare.md").write_text(text)
    print(text)
    print(f"[harness] wrote {out}")
    return 0


__all__ = ["compare_main", "compare_runs", "state_notes", "partial_cases", "render", "default_out", "MIN_REPEATS"]
