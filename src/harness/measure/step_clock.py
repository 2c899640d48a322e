"""The fused decode step timed from inside its kernels (``FusedDecodeStep(clock_rows=N)``).

Each launch of a step leaves its stamps (ns, %globaltimer: one clock for every SM): ``entry`` (its
first program started), ``release`` (its first program passed its wait: the previous launch had
completed and its writes were visible) and, with ``clock_every``, ``end`` (its last program
finished; None otherwise). From them, per launch (all µs, measured):

* ``interval_us`` = the next launch's release - this launch's release: the launch's share of the
  step's critical path (its work, then the hand-off to the next launch). The next launch of a step's
  last launch (lm_head) is the next step's first; the last step timed has none (NaN). A step's
  intervals sum to its time: its first release to the next step's first release.
* with ``end``: ``work_us`` = end - release (the launch's own work once its inputs exist) and
  ``handoff_us`` = the next launch's release - end (PDL's completion and memory flush, or a launch
  without PDL): the fixed cost per launch that a persistent kernel would remove. work + hand-off =
  interval.
* ``lead_us`` = release - entry: how long the launch's first program was resident before it could
  go on (with PDL it loads its weights meanwhile); it overlaps the previous launch.

``modules`` groups the launches by module (``MODULES``) and takes, over the complete steps (every
interval known), the median (``stats.median_low``: an observed value) of each group's per-step sums;
the bandwidth floor beside it comes from the step's analytic bytes (``FusedDecodeStep.weight_bytes``/
``kv_bytes``). Differences are taken in int64 ns before any float: a %globaltimer reading (about
1.8e18 ns) steps by 256 ns as a float64.
"""
from __future__ import annotations

from typing import Optional

import pandas as pd

from .stats import median_low

#: (module, the launch labels of ``FusedDecodeStep.calls`` it holds, layer kind: "moe", "dense" or
#: "" for any layer), in step order; each launch belongs to exactly one row
MODULES = (
    ("attention: q/k/v + RoPE + KV write, attention, o_proj", ("qkv", "attention", "o_proj"), ""),
    ("dense MLP (layer 0)", ("gate_up", "down"), "dense"),
    ("router", ("router",), "moe"),
    ("routed + shared experts", ("gate_up", "down"), "moe"),
    ("final norm + lm_head + argmax", ("lm_head",), ""),
)
#: the module rows' analytic bytes: parts of ``FusedDecodeStep.weight_bytes`` (+ the KV cache read
#: for attention)
MODULE_BYTES = {
    MODULES[0][0]: ("attention",), MODULES[1][0]: ("embedding row", "dense mlp"), MODULES[2][0]: ("router",),
    MODULES[3][0]: ("routed experts", "shared experts"), MODULES[4][0]: ("final norm + lm_head",),
}
LAUNCH_COLUMNS = ["row", "launch", "label", "layer", "entry", "release", "end"]
TIMES = ["interval_us", "work_us", "handoff_us"]


def kinds(labels, layers, moe_layers: Optional[set] = None) -> list:
    """Each launch's layer kind: "moe" or "dense" ("" for lm_head). ``moe_layers`` None: the layers
    with a router launch among these (a MoE layer routes every step; the dense layer never does)."""
    labels, layers = list(labels), list(layers)
    if moe_layers is None:
        moe_layers = {layer for label, layer in zip(labels, layers) if label == "router"}
    return ["" if label == "lm_head" else "moe" if layer in moe_layers else "dense"
            for label, layer in zip(labels, layers)]


def launches(stamps, moe_layers: Optional[set] = None) -> pd.DataFrame:
    """One row per launch of each timed step from ``FusedDecodeStep.clock_stamps()`` (or a frame of
    ``LAUNCH_COLUMNS``; rows = clock rows in position order, each a step): the stamps, ``kind``
    (``kinds``) and the times of the module docstring. A step follows the one before only when its
    row is the next one (consecutive positions)."""
    df = pd.DataFrame(stamps, columns=LAUNCH_COLUMNS)
    if df.empty:
        return df.assign(kind=[], lead_us=[], **{c: [] for c in TIMES})
    df = df.sort_values(["row", "launch"], kind="stable").reset_index(drop=True)
    df["kind"] = kinds(df["label"], df["layer"], moe_layers)
    # differences in int64 ns first (a %globaltimer reading, ~1.8e18, steps by 256 ns as a float64)
    release = df["release"].astype("Int64")
    end = pd.Series(pd.array(list(df["end"]), dtype="Int64"), index=df.index)    # None (no end) -> NA
    nxt = release.shift(-1)                                                      # Int64: NA at the end, no float
    into_next = df["launch"].shift(-1) == 0
    nxt[into_next & (df["row"].shift(-1) != df["row"] + 1)] = pd.NA       # no consecutive next step
    df["interval_us"] = _us(nxt - release)
    df["work_us"] = _us(end - release)
    df["handoff_us"] = _us(nxt - end)
    df["lead_us"] = _us(release - df["entry"].astype("Int64"))
    return df


def _us(ns: pd.Series) -> pd.Series:
    """int64 ns differences (missing: NA) as float µs (NaN)."""
    return ns.astype("Float64").astype("float64") / 1e3


def steps(df: pd.DataFrame) -> pd.Series:
    """Each complete step's time in µs (the sum of its launches' intervals, all known), by row."""
    if df.empty:
        return pd.Series(dtype="float64")
    g = df.groupby("row")["interval_us"]
    total = g.sum()
    return total[g.count() == g.size()]


def complete(df: pd.DataFrame) -> tuple:
    """(``steps(df)``, the launches of those complete steps): what every table of the clock reads."""
    whole = steps(df)
    return whole, df[df["row"].isin(whole.index)]


def _median(values) -> float:
    """``stats.median_low`` (an observed value; even count: the lower middle), NaN for none."""
    m = median_low(values)
    return float("nan") if m is None else m


def _medians(part: pd.DataFrame) -> dict:
    """Medians over steps of the per-step sums of each time (NaN where a step lacks it: no ``end``)."""
    per = part.groupby("row")[TIMES].sum(min_count=1)
    return {c: _median(per[c]) for c in TIMES}


def modules(df: pd.DataFrame, nbytes: Optional[dict] = None, kv_bytes: float = 0.0,
            bandwidth_gbs: Optional[float] = None) -> list:
    """Records per ``MODULES`` row: launches per step, the medians over complete steps of the
    module's per-step interval, work and hand-off (µs; NaN without ends), its share of the median
    step and, with
    ``nbytes`` (``weight_bytes()``), ``kv_bytes`` (the KV cache read per step, attention's) and
    ``bandwidth_gbs`` (datasheet), its bytes per step and bandwidth floor (µs) with floor / interval.
    A last row ``step`` holds the whole step."""
    whole, done = complete(df)
    if whole.empty:
        return []
    step_med = _median(whole)
    out = []
    for name, labels, kind in MODULES:
        part = done[done["label"].isin(labels) & ((done["kind"] == kind) if kind else True)]
        if part.empty:
            continue
        rec = {"module_group": name, "clock_launches": len(part) / len(whole), **_medians(part)}
        rec["step_share"] = rec["interval_us"] / step_med
        out.append(rec | _floor(name, nbytes, kv_bytes, bandwidth_gbs, rec["interval_us"]))
    rec = {"module_group": "step", "clock_launches": len(done) / len(whole), **_medians(done),
           "interval_us": step_med, "step_share": 1.0}
    out.append(rec | _floor(None, nbytes, kv_bytes, bandwidth_gbs, step_med))
    return out


def _floor(name: Optional[str], nbytes: Optional[dict], kv_bytes: float, bandwidth_gbs: Optional[float],
           us: float) -> dict:
    """{mb_step, bw_floor_us, floor_interval} of a module (None: the whole step), analytic / derived."""
    if not nbytes:
        return {}
    if name is None:
        b = nbytes["total"] + kv_bytes
    else:
        b = sum(nbytes.get(p, 0) for p in MODULE_BYTES[name]) + (kv_bytes if name == MODULES[0][0] else 0)
    rec = {"mb_step": b}
    if bandwidth_gbs:
        floor = b / (bandwidth_gbs * 1e3)                     # bytes / (GB/s) -> µs
        rec |= {"bw_floor_us": floor, "floor_interval": floor / us if us > 0 else None}
    return rec


def by_launch(df: pd.DataFrame) -> list:
    """Records per launch of the step (its index, ``kernel`` = its label, layer): the medians over
    complete steps of interval, work, hand-off and lead (µs)."""
    _, done = complete(df)
    if done.empty:
        return []
    g = done.groupby(["launch", "label", "layer"], sort=True)[TIMES + ["lead_us"]].agg(_median)
    return [{"launch": int(i), "kernel": label, "layer": int(layer), **{k: float(v) for k, v in row.items()}}
            for (i, label, layer), row in g.iterrows()]
