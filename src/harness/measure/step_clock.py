"""The fused decode step timed from inside its kernels (``FusedDecodeStep(clock_rows=N)``).

Each launch of a step leaves three stamps (ns, %globaltimer: one clock for every SM): ``entry``
(its first program started), ``release`` (its first program passed its wait, i.e. the previous
launch had completed and its writes were visible) and ``end`` (its last program finished). From
them, per launch of a step (all µs, measured):

* ``wait_us`` = release - the previous launch's end: the hand-off between two kernels (PDL's
  completion and memory flush, or a launch without PDL), the fixed cost per launch that a
  persistent kernel would remove. The previous launch of a step's first launch is the previous
  step's last (its lm_head); for the first step timed it is unknown (NaN).
* ``work_us`` = end - release: the launch's own work once its inputs exist.
* ``lead_us`` = release - entry: how long its programs were resident before they could go on (with
  PDL they load their weights meanwhile); it overlaps the previous launch, so it is not in the step.

A step's time is the sum of its launches' wait + work: its last launch's end - the previous step's
last launch's end. ``modules`` groups the launches by module (``MODULES``) and takes, over the
steps with a known previous step, the median of each group's per-step sums; the bandwidth floor
beside it comes from the step's analytic bytes (``FusedDecodeStep.weight_bytes``/``kv_bytes``).
"""
from __future__ import annotations

import math
from typing import Optional

import pandas as pd

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


def launches(stamps: list, moe_layers: set) -> pd.DataFrame:
    """One row per launch of each timed step from ``FusedDecodeStep.clock_stamps()`` (rows = clock
    rows in position order, each a step): the stamps, ``kind`` ("moe" or "dense") and
    ``wait_us``, ``work_us``, ``lead_us`` (module docstring). A step follows the one before only
    when its row is the next one (consecutive positions)."""
    df = pd.DataFrame(stamps, columns=LAUNCH_COLUMNS)
    if df.empty:
        return df.assign(kind=[], wait_us=[], work_us=[], lead_us=[])
    df = df.sort_values(["row", "launch"], kind="stable").reset_index(drop=True)
    df["kind"] = ["moe" if layer in moe_layers else "dense" for layer in df["layer"]]
    prev_end = df["end"].shift(1).astype("float64")
    first = df["launch"] == 0
    follows = df["row"].shift(1) == df["row"] - 1            # the previous row is the previous step
    prev_end[first & ~follows] = math.nan
    df["wait_us"] = (df["release"] - prev_end) / 1e3
    df["work_us"] = (df["end"] - df["release"]) / 1e3
    df["lead_us"] = (df["release"] - df["entry"]) / 1e3
    return df


def steps(df: pd.DataFrame) -> pd.Series:
    """Each complete step's time in µs (wait + work of its launches; its first wait known), by row."""
    if df.empty:
        return pd.Series(dtype="float64")
    known = df.groupby("row")["wait_us"].apply(lambda w: not w.isna().any())
    total = df.groupby("row")[["wait_us", "work_us"]].sum().sum(axis=1)
    return total[known[known].index]


def modules(df: pd.DataFrame, nbytes: Optional[dict] = None, kv_bytes: float = 0.0,
            bandwidth_gbs: Optional[float] = None) -> list:
    """Records per ``MODULES`` row: launches per step, the medians over complete steps of the
    module's per-step wait, work and wait + work (µs), its share of the median step, and with
    ``nbytes`` (``weight_bytes()``), ``kv_bytes`` (the KV cache read per step, attention's) and
    ``bandwidth_gbs`` (datasheet) its bytes per step and bandwidth floor (µs) with floor / (wait + work).
    A last row ``step`` holds the whole step."""
    whole = steps(df)
    if whole.empty:
        return []
    done = df[df["row"].isin(whole.index)]
    step_med = float(whole.median())
    out = []
    for name, labels, kind in MODULES:
        part = done[done["label"].isin(labels) & ((done["kind"] == kind) if kind else True)]
        if part.empty:
            continue
        per = part.groupby("row")[["wait_us", "work_us"]].sum()
        total = per.sum(axis=1)
        rec = {"module_group": name, "launches_step": len(part) / len(whole), "wait_us": float(per["wait_us"].median()),
               "work_us": float(per["work_us"].median()), "clock_us": float(total.median()),
               "step_share": float(total.median()) / step_med}
        out.append(rec | _floor(name, nbytes, kv_bytes, bandwidth_gbs, rec["clock_us"]))
    per = done.groupby("row")[["wait_us", "work_us"]].sum()
    rec = {"module_group": "step", "launches_step": len(done) / len(whole), "wait_us": float(per["wait_us"].median()),
           "work_us": float(per["work_us"].median()), "clock_us": step_med, "step_share": 1.0}
    out.append(rec | _floor(None, nbytes, kv_bytes, bandwidth_gbs, step_med))
    return out


def _floor(name: Optional[str], nbytes: Optional[dict], kv_bytes: float, bandwidth_gbs: Optional[float],
           us: float) -> dict:
    """{mb_step, bw_floor_us, floor_share} of a module (None: the whole step), analytic / derived."""
    if not nbytes:
        return {}
    if name is None:
        b = nbytes["total"] + kv_bytes
    else:
        b = sum(nbytes.get(p, 0) for p in MODULE_BYTES[name]) + (kv_bytes if name == MODULES[0][0] else 0)
    rec = {"mb_step": b}
    if bandwidth_gbs:
        floor = b / (bandwidth_gbs * 1e3)                     # bytes / (GB/s) -> µs
        rec |= {"bw_floor_us": floor, "floor_share": floor / us if us > 0 else None}
    return rec


def by_launch(df: pd.DataFrame) -> list:
    """Records per launch of the step (its index, ``kernel`` = its label, layer): the medians over complete steps of
    wait, work and lead (µs)."""
    whole = steps(df)
    done = df[df["row"].isin(whole.index)]
    if done.empty:
        return []
    g = done.groupby(["launch", "label", "layer"], sort=True)[["wait_us", "work_us", "lead_us"]].median()
    return [{"launch": int(i), "kernel": label, "layer": int(layer), **{k: float(v) for k, v in row.items()}}
            for (i, label, layer), row in g.iterrows()]
