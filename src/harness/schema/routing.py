"""``routing.csv`` and ``routing_steps.csv``: tokens routed to each MoE expert, counted on the device
(written by ``harness.run`` as each case finishes; read by the analytic MoE bytes and the MBU,
``harness.roofline.join``, and the report's routing section).

* routing.csv: one row per case x phase (prefill, decode: summed over the steps) x MoE layer, the
  tokens routed to each expert in ``e0`` .. ``eN`` (layers that routed nothing are left out);
* routing_steps.csv: one row per case x decode step x MoE layer, with ``experts``: the distinct
  experts the batch's rows touched at that step.

This module holds both sides: the rows from the device counts (``routing_rows``,
``routing_step_rows``) and the count arrays back from the tables (``routing_arrays``,
``routing_step_array``).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd

from .table import table

#: the expert count columns that follow the fixed ones
EXPERT_COLUMNS = "e0 .. eN: tokens routed to expert j (measured, device counts)"
ROUTING_CSV = table("routing.csv", """
case | | label | case name
phase | | label | prefill or decode (summed over the decode steps)
layer | | label | decoder layer
""", EXPERT_COLUMNS)
ROUTING_STEPS_CSV = table("routing_steps.csv", """
case | | label | case name
step | | label | decode step (from 0)
layer | | label | decoder layer
experts | experts | measured | distinct experts the batch's rows touched at this step and layer
""", EXPERT_COLUMNS)


def _experts(counts) -> dict:
    return {f"e{j}": int(c) for j, c in enumerate(counts)}


def routed_steps(steps: Optional[np.ndarray]) -> tuple:
    """(where int64 [n, 2]: the (decode step, layer) of every layer that routed anything, step-major;
    distinct experts touched [n] there) of a [steps, layers, experts] count array; both empty
    without counts."""
    if steps is None or not len(steps):
        return np.zeros((0, 2), dtype=np.int64), np.zeros(0, dtype=np.int64)
    counts = np.asarray(steps)
    routed = counts.sum(axis=-1) > 0
    return np.argwhere(routed), (counts > 0).sum(axis=-1)[routed]


def routing_rows(case: str, routing: dict) -> list:
    """routing.csv rows of one case's {phase: [layers, experts] counts} (a ``decode_steps`` entry is
    routing_steps.csv's, skipped here)."""
    rows = []
    for phase, arr in routing.items():
        if phase == "decode_steps":
            continue
        for layer, counts in enumerate(arr):
            if counts.sum():
                rows.append({"case": case, "phase": phase, "layer": layer, **_experts(counts)})
    return rows


def routing_step_rows(case: str, steps) -> list:
    """routing_steps.csv rows of a [steps, layers, experts] decode count array; layers that routed
    nothing are left out."""
    where, touched = routed_steps(steps)
    return [{"case": case, "step": int(step), "layer": int(layer), "experts": int(n), **_experts(steps[step][layer])}
            for (step, layer), n in zip(where, touched)]


def expert_columns(df: pd.DataFrame) -> list:
    """The expert count columns (e0..eN) of a routing table, in expert order."""
    return sorted((c for c in df.columns if c.startswith("e") and c[1:].isdigit()), key=lambda c: int(c[1:]))


def routing_arrays(routing: pd.DataFrame, case: str, num_layers: int) -> Optional[dict]:
    """{'prefill': [layers, experts], 'decode': [layers, experts] (summed over steps)} of ``case``
    from routing.csv, or None."""
    if routing is None or not len(routing) or case not in set(routing["case"]):
        return None
    r = routing[routing["case"] == case]
    ecols = expert_columns(r)
    out = {}
    for phase, g in r.groupby("phase"):
        arr = np.zeros((num_layers, len(ecols)), dtype=np.int64)
        for _, row in g.iterrows():
            layer = int(row["layer"])
            if 0 <= layer < num_layers:
                arr[layer] = [int(row[c]) if pd.notna(row[c]) else 0 for c in ecols]
        out[str(phase)] = arr
    return out or None


def routing_step_array(routing_steps: pd.DataFrame, case: str, steps: int, num_layers: int) -> Optional[np.ndarray]:
    """[steps, layers, experts] decode counts of ``case`` from routing_steps.csv, or None."""
    if routing_steps is None or not len(routing_steps) or case not in set(routing_steps["case"]):
        return None
    r = routing_steps[routing_steps["case"] == case]
    ecols = expert_columns(r)
    arr = np.zeros((steps, num_layers, len(ecols)), dtype=np.int64)
    vals = r[ecols].fillna(0).to_numpy(dtype=np.int64)
    for (st, layer), v in zip(zip(r["step"].astype(int), r["layer"].astype(int)), vals):
        if 0 <= st < steps and 0 <= layer < num_layers:
            arr[st, layer] = v
    return arr


__all__ = ["ROUTING_CSV", "ROUTING_STEPS_CSV", "EXPERT_COLUMNS", "routed_steps", "routing_rows", "routing_step_rows",
           "expert_columns", "routing_arrays", "routing_step_array"]
