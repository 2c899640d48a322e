"""``stages.csv``: the observations, one typed row per case x request x stage (x call), raw values
only (written by ``harness.run`` from ``harness.measure.observations.stage_rows``; summarised by
``harness.measure.summary``).

* ``repeat`` (int): the request's index: 0 .. repeats-1 for the timed repeats, ``repeats`` for
  the one profiled request; ``profiled`` (bool): True for the profiled request (kernel capture,
  module hooks, sync counting: its own spans are stretched by the profiler);
* ``call`` (int): which call of a stage that ran more than once (Gundam: 0 = tiles, 1 = global
  view); ``CALL_ALL`` (-1) for the row over all calls; ``calls``: how many calls the stage made.

Units and provenance of every column: ``STAGES_CSV`` (ms for times, bytes for memory, tokens/s
for throughput). Run directories written before this table was typed also held aggregate rows
(``repeat`` = mean, median, ...) and text labels (``repeat = profiled``, ``call = all``); ``typed``
converts such a table on read (``LEGACY_AGGREGATES`` rows dropped, the labels mapped): the one
place that knows the old layout.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from .table import table

STAGES_CSV = table("stages.csv", """
case | | label | case name
mode | | label | crop mode
grid:text | | label | gundam tile grid (columns x rows), empty without tiles
batch | pages | setting | pages in the request
repeat | | label | request index: timed repeats from 0, then the profiled request
profiled | | label | True for the profiled request (kernel capture: its spans are stretched)
stage | | label | sam, clip, projector, prefill, decode, preprocess or request
call | | label | which call of a stage that ran more than once; -1 = all calls
calls | | measured | calls the stage made in the request
timer | | label | cuda_event (GPU spans) or host (host clock)
gpu_ms | ms | measured | GPU span, CUDA events on the stream
host_ms | ms | measured | host span, wall clock around the stage's Python code
kernels | | measured | kernels launched (profiled request)
busy_ms | ms | measured | union of the stage's kernel intervals (profiled request)
idle_ms | ms | derived | span - busy_ms (profiled request)
launches_per_step | | measured | decode kernels per decode step (profiled request)
decode_steps | steps | measured | decode steps the request ran
peak_mem_bytes | bytes | measured | peak allocated device memory
ttft_ms | ms | measured | request start to the end of prefill (the first token)
raster_ms | ms | measured | rasterising the request's PDF pages, host clock
prep_ms | ms | measured | building the request on the host (pages, preprocessing, token layout)
h2d_ms | ms | measured | copying the request to the device
ttft_e2e_ms | ms | derived | raster + prep + h2d + TTFT
tpot_p50_ms | ms | measured | median decode-step time
tpot_p90_ms | ms | measured | 90th percentile decode-step time
tpot_p99_ms | ms | measured | 99th percentile decode-step time
tpot_mean_ms | ms | measured | mean decode-step time
decode_tok_s | tok/s | derived | batch x 1000 / tpot_mean_ms
e2e_ms | ms | measured | the request range
call_ms | ms | measured | the whole generate() call, host clock, synchronised before and after
setup_collect_ms | ms | derived | call_ms - e2e_ms
stage_sum_ms | ms | derived | sum of the five stages' spans
unattributed_kernel_ms | ms | measured | kernel time outside every stage (profiled request)
attributed_fraction | fraction | derived | 1 - unattributed / all kernel time
weight_bytes | bytes | measured | the model's weights on the device
kv_cache_bytes | bytes | measured | the KV cache on the device
note | | label | what to know about the row
host_syncs | | measured | device-to-host synchronisations (profiled request)
syncs_per_step | | measured | host syncs per decode step (profiled request)
""")

#: ``call`` of the row over every call of a stage
CALL_ALL = -1
OBSERVATION_COLUMNS = STAGES_CSV.columns
TEXT = ("case", "mode", "grid", "stage", "timer", "note")
INTEGER = ("batch", "repeat", "call", "calls")
#: the measured values (float; NaN where a request did not measure it)
NUMERIC = [c for c in OBSERVATION_COLUMNS if c not in TEXT + INTEGER + ("profiled",)]
DTYPES = {**{c: object for c in TEXT}, **{c: "int64" for c in INTEGER}, "profiled": bool,
          **{c: "float64" for c in NUMERIC}}
#: columns every stages.csv has (new or old layout), and one of TIME_COLUMNS
REQUIRED_COLUMNS = ("case", "stage", "repeat", "call")
TIME_COLUMNS = ("gpu_ms", "host_ms")
#: ``repeat`` labels of the aggregate rows older run directories kept in stages.csv
LEGACY_AGGREGATES = ("mean", "std", "median", "cv", "min", "max", "ci95_lo", "ci95_hi")



class NotObservations(ValueError):
    """A table that lacks columns every stages.csv has (``missing``: their names, the time
    columns as one entry 'gpu_ms or host_ms')."""

    def __init__(self, missing: list):
        self.missing = list(missing)
        super().__init__(f"lacks the column(s) {', '.join(self.missing)} a run writes")


def missing_columns(columns) -> list:
    """``REQUIRED_COLUMNS`` (and 'gpu_ms or host_ms') that ``columns`` lacks."""
    cols = set(columns)
    return [c for c in REQUIRED_COLUMNS if c not in cols] + ([] if cols & set(TIME_COLUMNS)
                                                               else [" or ".join(TIME_COLUMNS)])


def frame(rows: list[dict]) -> pd.DataFrame:
    """Observation rows (dicts with any subset of the columns) as the typed table."""
    return typed(pd.DataFrame(rows, columns=OBSERVATION_COLUMNS))


def _legacy(df: pd.DataFrame) -> pd.DataFrame:
    """A stages.csv of the old layout (no ``profiled`` column) as observations: aggregate rows
    dropped, ``repeat = profiled`` -> ``profiled`` True with the next repeat index of its case,
    ``call`` all / empty -> ``CALL_ALL``."""
    rep = df["repeat"].map(lambda v: str(v).strip())
    df = df[~rep.isin(LEGACY_AGGREGATES)].copy()
    rep = rep[df.index]
    prof = rep == "profiled"
    index = rep.map(lambda v: -1 if v == "profiled" else int(float(v)))
    n_timed = index.groupby(df["case"]).max() + 1           # the profiled request follows the timed ones
    df["profiled"] = prof
    df["repeat"] = index.where(~prof, df["case"].map(n_timed)).astype("int64")
    df["call"] = df["call"].map(lambda v: CALL_ALL if str(v).strip() in ("all", "nan", "None", "") else int(float(v)))
    return df


def typed(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` as the typed observation table (``OBSERVATION_COLUMNS`` in order, ``DTYPES``); a
    table of the old layout is converted first (module docstring); columns a request did not
    measure are empty. A table without ``REQUIRED_COLUMNS`` raises ``NotObservations``."""
    if df is None or not len(df.columns):
        return pd.DataFrame({c: pd.Series(dtype=t) for c, t in DTYPES.items()})[OBSERVATION_COLUMNS]
    missing = missing_columns(df.columns)
    if missing:
        raise NotObservations(missing)
    if "profiled" not in df.columns and "repeat" in df.columns:
        df = _legacy(df)
    out = df.reindex(columns=OBSERVATION_COLUMNS).reset_index(drop=True)
    for c in INTEGER:
        out[c] = out[c].fillna(CALL_ALL if c == "call" else 0).astype("int64")
    out["profiled"] = out["profiled"].map(lambda v: str(v).strip().lower() in ("true", "1")).astype(bool)
    for c in NUMERIC:
        out[c] = out[c].astype("float64")
    for c in TEXT:
        out[c] = out[c].astype(object).where(out[c].notna(), None)
    return out


def read_observations(path) -> pd.DataFrame:
    """``stages.csv`` of a run directory as the typed table (an empty one for a missing or empty
    file; the old layout converted)."""
    return typed(STAGES_CSV.read(Path(path), dtype={c: str for c in TEXT + ("repeat", "call", "profiled")}))


__all__ = ["STAGES_CSV", "CALL_ALL", "OBSERVATION_COLUMNS", "NUMERIC", "DTYPES", "REQUIRED_COLUMNS", "TIME_COLUMNS",
           "LEGACY_AGGREGATES", "NotObservations", "missing_columns", "frame", "typed", "read_observations"]
