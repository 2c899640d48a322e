"""The report of a throughput run over N GPUs of one host, from its children's run directories
(data side: pandas and numpy, no torch; a parent run directory copied to a laptop opens there).

The parent's run directory holds one child run directory per (phase, GPU), named ``child_name``:
``alone-gpu<id>`` (phase 1: the first GPU alone) and ``together-gpu<id>`` (phase 2: all N at once, over
the same batch configurations), each a complete throughput run (``throughput.csv`` and its raw tables),
and the window-start records of the barrier (``window-starts-<phase>/``, ``harness.throughput.barrier``).
From them:

* ``gpu_rows``: every child's ``throughput.csv`` rows with ``phase``, ``gpu``, ``run`` in front
  (``throughput_gpus.csv``);
* ``scaling_table``: one row per configuration that phase 1 and every GPU of phase 2 finished
  (``SCALING_COLUMNS``: aggregate pages/s, the per-GPU spread, the speed-up over one GPU with its
  interval, the scaling efficiency, the windows' overlap) (``scaling.csv``);
* ``scaling_section``: the report section; ``write_scaling``: the parent's files.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from ..markdown import LEFT, RIGHT, table as md_table
from ..measure.stats import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, CI_LEVEL
from ..report.columns import Column, occupancy
from ..report.columns import table as column_table
from .barrier import read_records
from .section import TABLE, column_lines, device_text, report_head
from ..schema.throughput import SCALING_CSV, SPANS_CSV, THROUGHPUT_CSV

PHASES = ("alone", "together")
PHASE_TEXT = {"alone": "phase 1, one GPU alone", "together": "phase 2, all GPUs at once"}

#: scaling.csv's columns: (column, unit, provenance, what it is), declared in ``harness.schema.throughput``
SCALING_COLUMNS = [(f.name, f.unit, f.provenance, f.what) for f in SCALING_CSV.fields]
SCALING_NAMES = SCALING_CSV.columns


def child_name(phase: str, gpu) -> str:
    return f"{phase}-gpu{gpu}"


def starts_folder(root, phase: str) -> Path:
    """The barrier folder of a phase (``harness.throughput.barrier``)."""
    return Path(root) / f"window-starts-{phase}"


def find_child(root, phase: str, gpu) -> Optional[Path]:
    """A child's run directory, as named or renamed when it ended early (``-failed``, ``-interrupted``)."""
    name = child_name(phase, gpu)
    hits = [Path(root) / name] + sorted(Path(root).glob(f"{name}-*"))
    return next((p for p in hits if p.is_dir()), None)


def gpu_rows(root, gpus) -> pd.DataFrame:
    """The children's ``throughput.csv`` rows, ``phase``, ``gpu`` and ``run`` (the child's folder) first:
    phase 1 (the first of ``gpus``), then phase 2 in GPU order."""
    frames = []
    for phase, ids in (("alone", list(gpus)[:1]), ("together", list(gpus))):
        for g in ids:
            d = find_child(root, phase, g)
            t = THROUGHPUT_CSV.read(d) if d else pd.DataFrame()
            if len(t):
                frames.append(pd.concat([pd.DataFrame({"phase": phase, "gpu": str(g), "run": d.name}, index=t.index),
                                         t], axis=1))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["phase", "gpu", "run"])


def batch_cycles(spans: pd.DataFrame, config: str, window_s: float) -> np.ndarray:
    """Seconds of each window batch's cycle: from its ``request`` start to the next batch's, the
    last to ``window_s`` (the window's end), the first from 0 (the window's start): they add up to
    ``window_s``."""
    req = spans[(spans["config"] == config) & (spans["range"] == "request")].sort_values("start_s")
    edges = np.concatenate([[0.0], req["start_s"].to_numpy(float)[1:], [float(window_s)]])
    return np.diff(edges)


def speedup_interval(alone: np.ndarray, together: list, resamples: int = BOOTSTRAP_RESAMPLES,
                     seed: int = BOOTSTRAP_SEED, level: float = CI_LEVEL) -> tuple:
    """(lo, hi) of the speed-up (aggregate / one GPU) from batch cycles [s] of one batch size: ``alone``
    (phase 1's window) and ``together`` (one array per GPU of phase 2), each window resampled on its
    own; a GPU's pages/s is proportional to 1 / its mean cycle, so speed-up = mean(alone) x
    sum(1 / mean(together_i)). (None, None) when a window has fewer than 2 batches."""
    if len(alone) < 2 or any(len(t) < 2 for t in together):
        return None, None
    rng = np.random.default_rng(seed)

    def means(c: np.ndarray) -> np.ndarray:
        return c[rng.integers(0, len(c), size=(resamples, len(c)))].mean(axis=1)

    m1 = means(np.asarray(alone, float))
    draws = m1 * sum(1.0 / means(np.asarray(t, float)) for t in together)
    tail = (1 - level) / 2 * 100
    return (float(np.percentile(draws, tail, method="lower")), float(np.percentile(draws, 100 - tail, method="higher")))


def windows_overlap(starts: list, lengths: list) -> float:
    """(earliest end - latest start) / longest window, at least 0, of windows starting at ``starts`` [s]
    and lasting ``lengths`` [s]; nan without windows."""
    if not starts:
        return float("nan")
    ends = [s + w for s, w in zip(starts, lengths)]
    return max(0.0, min(ends) - max(starts)) / max(lengths)


def _spans(root, phase: str, gpu) -> pd.DataFrame:
    d = find_child(root, phase, gpu)
    return SPANS_CSV.read(d) if d else pd.DataFrame()


def scaling_table(root, gpus, workers: int, rows_all: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """``SCALING_COLUMNS`` rows of the configurations that phase 1 and every GPU of phase 2 finished
    (``rows_all``: ``gpu_rows(root, gpus)`` when the caller has read them already)."""
    gpus = [str(g) for g in gpus]
    rows_all = gpu_rows(root, gpus) if rows_all is None else rows_all
    alone = rows_all[rows_all["phase"] == "alone"]
    together = rows_all[rows_all["phase"] == "together"]
    starts = {(r["config"], int(r["rank"])): r.get("released_unix") for r in read_records(starts_folder(root, "together"))}
    spans = {("alone", gpus[0]): _spans(root, "alone", gpus[0]), **{("together", g): _spans(root, "together", g)
                                                                    for g in gpus}}
    out = []
    for _, one in alone.iterrows():
        name = one["config"]
        per = together[together["config"] == name].set_index("gpu").reindex(gpus)
        if per["pages_s"].isna().any():
            continue                                   # a GPU of phase 2 did not finish it
        n = len(gpus)
        aggregate = float(per["pages_s"].sum())
        cycles = [batch_cycles(spans[("together", g)], name, per.loc[g, "window_s"]) for g in gpus]
        lo, hi = speedup_interval(batch_cycles(spans[("alone", gpus[0])], name, one["window_s"]), cycles)
        speedup = aggregate / float(one["pages_s"])
        efficiency = speedup / n
        released = [starts.get((name, i)) for i in range(n)]
        overlap = (windows_overlap(released, list(per["window_s"].astype(float))) if all(s is not None for s in released)
                   else float("nan"))
        out.append({"config": name, "batch": int(one["batch"]), "gpus": n, "workers": workers,
                    "one_gpu_pages_s": float(one["pages_s"]), "one_gpu_bound": one["bound"],
                    "aggregate_pages_s": aggregate, "gpu_pages_s_min": float(per["pages_s"].min()),
                    "gpu_pages_s_max": float(per["pages_s"].max()),
                    "speedup": speedup, "speedup_lo": lo, "speedup_hi": hi,
                    "efficiency": efficiency if efficiency <= 1.0 else None,
                    "above_ceiling": None if efficiency <= 1.0 else above_one(efficiency),
                    "bounds": "; ".join(f"{g}: {per.loc[g, 'bound']}" for g in gpus), "windows_overlap": overlap})
    return pd.DataFrame(out, columns=SCALING_NAMES)


def above_one(efficiency: float) -> str:
    """The note of a scaling efficiency above 1.0 (the project's flag form: ``<column> x%: check ...``)."""
    return (f"efficiency {efficiency:.1%}: check that phase 1 had the host to itself (a GPU of phase 2 ran "
            "faster than the GPU alone)")


def _speedup(r: dict) -> str:
    lo, hi = r.get("speedup_lo"), r.get("speedup_hi")
    return f"{r['speedup']:.2f}x" + (f" [{lo:.2f}x, {hi:.2f}x]" if lo is not None and np.isfinite(lo) else "")


def _efficiency(r: dict) -> str:
    e = r.get("efficiency")
    return f"{e:.1%}" if e is not None and np.isfinite(e) else (r.get("above_ceiling") or "–")


#: (header, cell) of the scaling table
_TABLE = [("config", lambda r: r["config"]), ("batch per GPU", lambda r: f"{int(r['batch'])}"),
          ("one GPU pages/s (derived)", lambda r: f"{r['one_gpu_pages_s']:,.2f} ({r['one_gpu_bound']})"),
          ("aggregate pages/s (derived)", lambda r: f"{r['aggregate_pages_s']:,.2f}"),
          ("speed-up: aggregate / one GPU [95% interval] (derived)", _speedup),
          ("scaling efficiency (derived)", _efficiency),
          ("per-GPU pages/s, min–max (derived)", lambda r: f"{r['gpu_pages_s_min']:,.2f}–{r['gpu_pages_s_max']:,.2f}"),
          ("bound per GPU (derived)", lambda r: r["bounds"]),
          ("windows overlap (derived)", lambda r: occupancy(r["windows_overlap"]))]
#: the per-GPU table: throughput_gpus.csv's columns, written as the single-GPU table writes them (``section.TABLE``)
_GPU_NAMES = ["phase", "gpu", "config", "pages_s", "gpu_busy", "prep_busy", "prep_pages_s", "h2d_gbs", "window_s", "bound"]
_GPU_TABLE = {"phase": Column("phase", "phase", align=LEFT), "gpu": Column("gpu", "GPU", align=LEFT),
              **{c: TABLE[c] for c in _GPU_NAMES[2:]}}


def scaling_section(scaling: pd.DataFrame, per_gpu: pd.DataFrame, manifest: dict) -> list:
    """Markdown lines of the parent's section (module docstring)."""
    info = manifest.get("throughput") or {}
    hosts = manifest.get("throughput_gpus") or {}
    device = device_text(manifest)
    gpus = hosts.get("gpus") or []
    out = ["## Throughput over the GPUs of one host", ""]
    out.append(f"{len(gpus)} x {device} (CUDA_VISIBLE_DEVICES {','.join(map(str, gpus))}, from {hosts.get('source', '?')}), "
               f"{hosts.get('cores', '?')} host cores, {hosts.get('workers_per_gpu', '?')} preprocessing worker "
               f"process(es) per GPU; mode `{info.get('mode', '?')}`, decode budget per page {info.get('tokens', '?')}, "
               f"execution `{info.get('execution_label', '?')}`. One process per GPU, each a whole throughput run (its "
               "own run directory below). Phase 1: the first GPU alone over every batch configuration; phase 2: all "
               "GPUs at once over the same configurations, each configuration's steady window started on every GPU "
               "at the same moment (a barrier after the warm-up). Speed-up = aggregate pages/s / the one-GPU pages/s "
               "of phase 1; scaling efficiency = speed-up / GPUs.")
    out.append("")
    if len(scaling):
        rows = scaling.to_dict("records")
        out += md_table([h for h, _ in _TABLE], [[f(r) for _, f in _TABLE] for r in rows],
                        [LEFT, RIGHT, RIGHT, RIGHT, RIGHT, RIGHT, RIGHT, LEFT, RIGHT])
    else:
        out.append("No configuration finished in both phases.")
    if len(per_gpu):
        out += ["", "Each GPU's window (its run directory's throughput.csv):", ""]
        out += column_table(_GPU_NAMES, per_gpu.to_dict("records"), _GPU_TABLE)
    runs = sorted(set(per_gpu["run"])) if len(per_gpu) else []
    if runs:
        out += ["", "Each GPU's own report: " + ", ".join(f"[{r}]({r}/report.md)" for r in runs) + "."]
    out += column_lines("scaling.csv", SCALING_COLUMNS)
    out += ["", "Caveats: the GPUs share the host's cores (split between the preprocessing pools), its memory "
            "bandwidth and its PCIe links: what phase 2 loses against phase 1 is that contention. A window ends at "
            "its first batch end past `throughput.window_s`, so the GPUs' windows end up to one batch apart "
            "(`windows_overlap`), and a GPU that finished its window starts the next configuration's warm-up while "
            "the others finish theirs.", ""]
    return out


def write_scaling(rd, gpus, workers: int) -> dict:
    """The parent's ``throughput_gpus.csv``, ``scaling.csv``, ``throughput.md`` and ``report.md``, from
    the children's run directories under ``rd.path``; the manifest's ``cases`` are the configurations
    of ``scaling.csv`` (in memory: the caller saves the manifest)."""
    per_gpu = gpu_rows(rd.path, gpus)
    scaling = scaling_table(rd.path, gpus, workers, per_gpu)
    rd.manifest["cases"] = [{"name": r["config"], "throughput": {k: r[k] for k in ("aggregate_pages_s", "speedup")}}
                            for r in scaling.to_dict("records")]
    paths = {"gpus": rd.write_csv("throughput_gpus.csv", per_gpu), "scaling": SCALING_CSV.write(rd, scaling)}
    lines = scaling_section(scaling, per_gpu, rd.manifest)
    paths["section"] = rd.write_text("throughput.md", "\n".join(lines))
    paths["report"] = rd.write_text("report.md", "\n".join(report_head(rd, len(scaling)) + lines))
    return paths


__all__ = ["PHASES", "PHASE_TEXT", "SCALING_COLUMNS", "SCALING_NAMES", "child_name", "starts_folder", "find_child",
           "gpu_rows", "batch_cycles", "speedup_interval", "above_one", "windows_overlap", "scaling_table", "scaling_section",
           "write_scaling"]
