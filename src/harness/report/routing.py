"""The report's MoE routing: which routing each case ran and how many experts its batch touched.

Per case (``routing_facts``): the routing it ran (the manifest's ``routing_label``:
``workload.routing``, 'weights' for runs that predate the knob), the distinct experts each MoE
layer touched per decode step (``routing_steps.csv``'s ``experts``: the union over the batch's
rows), as the median and range over every (step, MoE layer), and the distinct experts each MoE
layer touched over the whole decode (``routing.csv``'s decode phase), median and range over the
layers. Medians are ``stats.median_low`` (an observed value). ``section`` is the report's
"MoE routing" section; the ladder shows the same facts per row.
"""
from __future__ import annotations

from typing import Optional

import pandas as pd

from ..analytic.compose import routing_mismatch
from ..measure.stats import median_low
from ..roofline.join import expected_routing
from ..schema.routing import expert_columns
from ..schema.manifest import Manifest
from ..rundir import RunData
from .columns import table
from .context import case_info


def _spread(values) -> Optional[tuple]:
    """(median_low, min, max) of ``values``, or None for none."""
    v = [float(x) for x in values]
    return (median_low(v), min(v), max(v)) if v else None


def _experts(frame: pd.DataFrame) -> pd.Series:
    """Distinct experts of each row of a routing table (its e0..eN columns > 0)."""
    return (frame[expert_columns(frame)].fillna(0) > 0).sum(axis=1)


def _top_k(manifest: dict) -> Optional[int]:
    """Experts each token picks (the run's model config), or None where the manifest does not say."""
    k = Manifest.of(manifest).top_k
    return int(k) if k else None


def inconsistent_steps(per_step: pd.DataFrame, rows: Optional[int], top_k: Optional[int]) -> Optional[str]:
    """Why a case's per-step counts cannot be read as routing, or None: every (step, MoE layer) of a
    decode counts each of the batch's ``rows`` tokens ``top_k`` times, so its counts sum to rows x top_k."""
    if not len(per_step) or not rows or not top_k:
        return None
    sums = [routing_mismatch(r, rows, top_k) for r in per_step[expert_columns(per_step)].fillna(0).to_numpy()]
    bad = [s for s in sums if s is not None]
    if not bad:
        return None
    return (f"counts inconsistent: {len(bad):,} of {len(sums):,} (step, layer) rows do not sum to {rows} x "
            f"{top_k} = {rows * top_k} (e.g. {bad[0]:,})")


def routing_facts(run: RunData) -> dict:
    """{case: {"routing": label, "experts_step": (median, min, max) or None, "experts_decode": (...) or
    None, "inconsistent": why the per-step counts are not routing, or None}} for every case of the run's
    manifest. Inconsistent counts give no experts per step (what they count is not known)."""
    out = {}
    steps, counts = run.routing_steps, run.routing
    top_k = _top_k(run.manifest)
    for case, entry in case_info(run.manifest).items():
        per_step = steps[steps["case"] == case] if len(steps) and "case" in steps else pd.DataFrame()
        decode = (counts[(counts["case"] == case) & (counts["phase"] == "decode")]
                  if len(counts) and "case" in counts else pd.DataFrame())
        rows = len(entry["pages"]) if isinstance(entry.get("pages"), list) else entry.get("batch")
        why = inconsistent_steps(per_step, rows, top_k)
        out[case] = {"routing": entry.get("routing_label") or "weights",
                     "experts_step": _spread(per_step["experts"]) if len(per_step) and why is None else None,
                     "experts_decode": _spread(_experts(decode)) if len(decode) and why is None else None,
                     "inconsistent": why}
    return out


def section(run: RunData, st: pd.DataFrame, facts: Optional[dict] = None) -> list:
    """The report's "MoE routing" section (nothing for a run without cases); ``facts``: the run's
    ``routing_facts`` when the caller already has them."""
    facts = routing_facts(run) if facts is None else facts
    if not facts:
        return []
    info = case_info(run.manifest)
    dec = st[st["stage"] == "decode"].set_index("case") if len(st) else pd.DataFrame()
    rows = []
    for case, f in facts.items():
        source = dec.loc[case, "routing"] if case in dec.index and "routing" in dec else None
        rows.append({"case": case, "batch": info[case].get("batch"), **f,
                     "bytes_routing": source if isinstance(source, str) and source else None})
    L = ["## MoE routing", "",
         "Which routing each case ran (`workload.routing`: *weights*, the checkpoint's own gate; *balanced*, each "
         "token's top-k drawn uniformly without repeats per layer from the seed, its page and position, at the "
         "gate's own probabilities) and the experts its batch touched: per decode step, the distinct experts of "
         "each MoE layer over the batch's rows (`routing_steps.csv`), median [min–max] over every step and MoE "
         "layer; over the whole decode, per MoE layer (`routing.csv`). The decode MoE weight bytes (and MBU) use "
         "the experts of each step where they were measured; *expected routing* marks the uniform expectation.", ""]
    L += table(["case", "batch", "routing", "experts_step", "experts_decode", "bytes_routing"], rows)
    bad = [f"{r['case']}: {r['inconsistent']}" for r in rows if r["inconsistent"]]
    if bad:
        L += ["", "**Routing counts that are not routing** (no experts shown; their MoE bytes fall back to the "
              "expected routing): " + "; ".join(bad) + "."]
    if any(expected_routing(r["bytes_routing"]) for r in rows):
        L += ["", "Rows with *expected routing* had no per-step counts: their decode MoE bytes assume each token "
              "picks its experts uniformly at random, which random weights do not do."]
    return L + [""]


__all__ = ["routing_facts", "inconsistent_steps", "section"]
