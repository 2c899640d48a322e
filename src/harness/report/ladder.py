"""The execution ladder: one row per case of a run whose cases ran otherwise than the vendor's way.

``execution_rows`` gives per case its execution label and the routing it ran (``workload.routing``),
decode tok/s, TPOT p50/p90/p99 and TTFT (the median request), kernels and host syncs per decode
step (the profiled request), decode idle share and CV, MBU (datasheet / calibrated; flagged where
its bytes used the expected routing), the distinct experts per MoE layer per step
(``report.routing``) and its ratios (``harness.report.ratios``: the speed-up over the vendor-style
batch-1 row of the same routing with its interval, split into kernel-busy and span ratios; batched
rows against the best batch-1 row of the same routing); ``section`` is the report's "Execution variants" section,
``ladder.png`` is drawn from the same rows (``harness.roofline.plot.plot_ladder``).
"""
from __future__ import annotations

from typing import Optional

import pandas as pd

from ..floats import finite as _f
from .. import knobs
from ..measure.summary import Summary
from ..rundir import RunData
from ..schema.manifest import Manifest
from .columns import table
from .context import case_info
from .ratios import UNSTABLE_CV, ladder_ratios
from .routing import routing_facts
from ..roofline.join import expected_routing

#: ``execution_rows`` columns before the ratios (floats unless named in ``LABELS``), then ``RATIO_COLUMNS``
ROW_COLUMNS = ["case", "execution", "routing", "batch", "mode", "tok_s", "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms",
               "ttft_ms", "kernels_per_step", "syncs_per_step", "decode_idle", "decode_cv", "mbu", "mbu_cal",
               "mbu_expected", "experts_step", "setup_s"]
LABELS = ("case", "execution", "routing", "mode", "mbu_expected", "experts_step")


def execution_label(ex: dict) -> str:
    """'static KV + grouped MoE (triton) + ...' from a manifest case's execution ('vendor-style' when
    nothing differs from the vendor's execution): ``harness.knobs.label``, the knobs' own labels."""
    return knobs.label(ex)


def has_variants(run: RunData) -> bool:
    """True when a case of the run executed otherwise than the vendor's way (an execution ladder)."""
    return any(execution_label(Manifest.execution_of(c)) != "vendor-style" for c in Manifest.of(run.manifest).cases)


def _setup_s(ex: dict) -> float:
    """Compile + capture seconds a case's execution recorded (``setup_s``: {what: s or {part: s}})."""
    setup = ex.get("setup_s")
    return sum(v for d in (setup.values() if isinstance(setup, dict) else [])
               for v in (d.values() if isinstance(d, dict) else [d]) if _f(v) is not None)


def execution_rows(run: RunData, st: pd.DataFrame, summary: Summary, facts: Optional[dict] = None) -> pd.DataFrame:
    """``ROW_COLUMNS``, one row per case with a request and a decode stage (module docstring);
    ``st``: the run's stage-level roofline rows (decode idle share, MBU); ``facts``: the run's
    ``routing_facts`` when the caller already has them."""
    rows = []
    info = case_info(run.manifest)
    facts = routing_facts(run) if facts is None else facts
    measured = summary.stages
    for case in dict.fromkeys(measured["case"]):
        m = measured[measured["case"] == case].set_index("stage")
        if "request" not in m.index or "decode" not in m.index:
            continue
        req, dec = m.loc["request"], m.loc["decode"]
        s = st[(st["case"] == case) & (st["stage"] == "decode")] if len(st) else st
        r = s.iloc[0] if len(s) else {}   # no decode roofline row: idle and MBU missing
        ex = Manifest.execution_of(info.get(case))
        fact = facts.get(case, {})
        rows.append({"case": case, "execution": execution_label(ex), "routing": fact.get("routing", "weights"),
                     "batch": info.get(case, {}).get("batch"),
                     "mode": info.get(case, {}).get("mode"),
                     **{c: _f(req.get(c)) for c in ("tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms", "ttft_ms")},
                     "tok_s": _f(req.get("decode_tok_s")), "kernels_per_step": _f(dec.get("launches_per_step")),
                     "syncs_per_step": _f(dec.get("syncs_per_step")), "decode_cv": _f(dec.get("cv")),
                     "decode_idle": _f(r.get("idle_fraction")), "mbu": _f(r.get("mbu")),
                     "mbu_cal": _f(r.get("mbu_cal")),
                     "mbu_expected": bool(len(s) and expected_routing(r.get("routing"))),
                     "experts_step": fact.get("experts_step"), "setup_s": _setup_s(ex)})
    df = pd.DataFrame(rows, columns=ROW_COLUMNS).astype({c: "Int64" if c == "batch" else "float64"
                                                         for c in ROW_COLUMNS if c not in LABELS})
    return pd.concat([df, ladder_ratios(df, summary)], axis=1)


def section(run: RunData, st: pd.DataFrame, summary: Summary, rows: Optional[pd.DataFrame] = None) -> list:
    """The report's "Execution variants" section (nothing for a run without variants); ``rows``:
    ``execution_rows`` when the caller already derived them (the report, which also plots them)."""
    if not len(summary.stages) or not has_variants(run):
        return []
    df = rows if rows is not None else execution_rows(run, st, summary)
    L = ["## Execution variants", "",
         "Same weights, different execution (`harness.config.ExecutionConfig`). tok/s, TPOT and TTFT: measured "
         "(the median request); kernels per step: measured (profiled request); host syncs per step: "
         "measured (torch sync debug mode, profiled request); idle and MBU: derived (kernel busy / analytic "
         "bytes over measured time, datasheet / calibrated); set-up s: measured compile + capture time "
         "(outside the timed repeats). Routing: `workload.routing` (rows of another routing are compared only with "
         "rows of theirs); experts per step: the distinct experts of each MoE layer over the batch's rows per decode "
         "step (measured), median [min–max].", ""]
    records = [{**r, "tpot_p50": r["tpot_p50_ms"], "tpot_p90": r["tpot_p90_ms"], "tpot_p99": r["tpot_p99_ms"],
                "mbu_pair": ((r["mbu"], r["mbu_cal"]), bool(r["mbu_expected"])),
                "speedup": _interval(r, "speedup", r["unstable"]), "tput_vs_b1": _interval(r, "tput"),
                "tpot_vs_b1": _interval(r, "tpot")} for r in df.to_dict("records")]
    L += table(["case", "execution", "routing", "batch", "tok_s", "tpot_p50", "tpot_p90", "tpot_p99", "ttft_ms",
                "kernels_per_step", "syncs_per_step", "decode_idle", "decode_cv", "mbu_pair", "experts_step",
                "setup_s"], records)
    L += ["", "### Ratios", "",
          "Each ratio says what it divides, with the seeded bootstrap 95% interval over the timed repeats of both "
          "rows (each row's repeats resampled on their own; ratio of the medians). Batch-1 rows: the speed-up "
          "over the vendor-style batch-1 row of the same mode and routing, split into the kernel-busy ratio (faster "
          "GPU work: that row's kernel busy time per decode step in its profiled request over this row's) and the "
          "span ratio (speed-up / kernel-busy ratio: launch and host gaps removed). Batched rows are not "
          "speed-ups: their decode throughput and time per token are compared with the best batch-1 row of the "
          "same mode and routing (its throughput is what batching multiplies; its TPOT what each request waits).", ""]
    L += table(["case", "execution", "routing", "batch", "speedup", "busy_ratio", "span_ratio", "tput_vs_b1",
                "tpot_vs_b1"], records)
    L.append("")
    cv = dict(zip(df["case"], df["decode_cv"]))
    for base in dict.fromkeys(df["base"].dropna()):
        note = f"- base of the speed-ups: `{base}`"
        if (_f(cv.get(base)) or 0.0) > UNSTABLE_CV:
            note += (f" (decode CV {100 * cv[base]:.1f}% > {100 * UNSTABLE_CV:.0f}%: unstable, the speed-ups over it "
                     "move with the host; their intervals say by how much)")
        L.append(note)
    L += [f"- best batch-1 row of the batched comparisons: `{best}`" for best in dict.fromkeys(df["best_b1"].dropna())]
    return L + ["", "Chart: `ladder.png`.", ""]


def _interval(r: dict, key: str, unstable: bool = False):
    """(ratio, lo, hi, unstable) of ``key`` in a ladder row, or None without the ratio."""
    ratio = _f(r.get(f"{key}_ratio" if key != "speedup" else key))
    if ratio is None:
        return None
    return ratio, r.get(f"{key}_lo"), r.get(f"{key}_hi"), bool(unstable)


__all__ = ["ROW_COLUMNS", "execution_label", "has_variants", "execution_rows", "section"]
