"""Per-run report: report.md, analytic.csv, roofline.csv and roofline.png in the run directory.

``write_report(rd, data)`` takes what the run measured (a ``harness.rundir.RunData``: the run
verb's in-memory tables, or a run directory read back once), resolves the device ceilings (datasheet via ``harness.roofline.specs``, calibrated
via the cached ``python -m harness calibrate`` record, ``hardware.*`` overrides), computes the
analytic costs of every measured case (``harness.analytic``), joins them
(``harness.roofline.join``) and writes, through the ``RunDir`` helper:

* ``analytic.csv`` (``harness.schema.analytic.ANALYTIC_CSV``): the cost columns + ``routing`` (where
  the MoE bytes' experts come from: ``harness.roofline.join.ROUTING_SOURCES``) +
  ``bytes_kv_copy_read/write`` for every case x stage x family, TOTAL rows per stage;
* ``headline.csv``: ``harness.schema.headline.HEADLINE_CSV``, one row per case: the
  median request with its stage times and the min/max of every value over the timed repeats;
* ``stages_summary.csv``: ``harness.schema.headline.STAGES_SUMMARY_CSV``, the aggregates of the
  timed repeats per case x stage x call and statistic (stages.csv holds the observations alone);
* ``roofline.csv``: ``harness.schema.roofline.ROOFLINE_CSV``, ``level = stage`` rows (five
  stages + request per case) and ``level = op_family`` rows; an efficiency, MFU or MBU above 1.0
  is left empty there and kept in the row's ``above_ceiling`` note (``harness.roofline.flags``);
* ``roofline.png``: log-log roofline, both ceilings, one point per case x stage;
* ``time_breakdown.png``: per case and stage, kernel busy and idle time, host span marked;
* ``tpot_vs_position.png``: decode-step time against KV length (``harness.report.steps``);
* ``ladder.png``: decode tok/s and MBU per execution variant (runs with execution variants);
* ``report.md``: under its title, for a merged run (``python -m harness merge``), the runs it came
  from (``context.merged_line``); headline (median request) per case, its stage times, execution
  variants, MoE routing (``report.routing``: the routing each case ran, experts touched per step), TPOT
  against position, per-stage roofline table (GPU span, host span, busy, idle, efficiency against
  span and busy), op families, inside the decode step per module against the bandwidth floor
  (cases attributed by alignment, ``harness.report.step_modules``), top kernels per stage,
  ceilings, environment, caveats. Every column header says whether it is measured, analytic or
  derived.

``python -m harness run`` calls it after every case (the report grows with the run) and once at
the end; it can be re-run on any finished run directory (``write_report(path)``). The manifest
gets a ``roofline`` entry (ceilings used, calibration or 'not calibrated'). Ceilings come from the
run's own ``calibration`` manifest entry when it has one (what the run measured or found cached),
else from this machine's calibration cache.
"""
from __future__ import annotations

import logging
import traceback
from pathlib import Path
from typing import Optional, Union

import pandas as pd

from ..measure.summary import Summary, summarize
from ..roofline import flags
from ..roofline.ceilings import ceilings
from ..roofline.plot import plot_ladder, plot_roofline
from ..roofline.specs import Peaks
from ..roofline.table import roofline_table
from ..rundir import RunData, RunDir, load_run
from ..schema.analytic import ANALYTIC_CSV
from ..schema.headline import HEADLINE_CSV, STAGES_SUMMARY_CSV
from ..schema.manifest import Manifest
from ..schema.roofline import ROOFLINE_CSV
from . import ladder, routing, step_clock, step_modules, steps
from .breakdown import plot_time_breakdown
from .context import (CPU_NOTE, calibration_line, caveats_section, ceilings_section, environment_section,
                      files_section, merged_line, model_line, on_cpu, warmup_counts, weights_of)
from .sections import charts_section, headline_section, op_section, stage_section, top_kernels_section

log = logging.getLogger("harness.report")


def write_report(run: Union[RunDir, str, Path], data: Optional[RunData] = None, hardware: Optional[dict] = None,
                 strict: bool = False, plot: bool = True) -> dict:
    """Write analytic.csv, roofline.csv, roofline.png and report.md into the run directory.

    ``run``: the live ``RunDir`` of ``harness.run`` with its in-memory ``data``, or the path of a run
    directory (read once). Returns {name: Path}. Unless ``strict``, a failure is recorded as a
    manifest warning and {} returned (the measurement is never lost to a reporting error); an
    OSError (a full disk, an unwritable directory) always propagates.
    """
    rd = run if isinstance(run, RunDir) else RunDir.attach(run, data.manifest if data is not None else None)
    try:
        return _write(rd, data if data is not None else load_run(rd.path, rd.manifest), hardware, plot)
    except Exception as exc:  # noqa: BLE001 - reporting must not kill a measured run
        if strict or isinstance(exc, OSError):
            raise
        log.warning("report not written: %s\n%s", exc, traceback.format_exc())
        try:
            rd.warn(f"report not written ({exc.__class__.__name__}: {exc})")
        except Exception:  # noqa: BLE001
            pass
        return {}


def _write(rd: RunDir, run: RunData, hardware: Optional[dict], plot: bool) -> dict:
    peaks = ceilings(rd.manifest, hardware)
    paths = {}
    summary = summarize(run.stages, warmup_counts(rd.manifest))
    if not len(run.stages):
        paths["report"] = rd.write_text("report.md", render(run, peaks, pd.DataFrame(), pd.DataFrame(), [], summary))
        return paths
    table, analytic, measured, notes = roofline_table(run, peaks, summary)
    head = summary.headline
    if len(analytic):
        paths["analytic"] = ANALYTIC_CSV.write(rd, analytic)
    paths["headline"] = HEADLINE_CSV.write(rd, head)
    paths["stages_summary"] = STAGES_SUMMARY_CSV.write(rd, summary.aggregates)
    paths["roofline"] = ROOFLINE_CSV.write(rd, flags.for_csv(table))
    if plot:
        exp = Manifest.of(rd.manifest).experiment
        title = f"{exp}: {rd.path.name}" if exp and exp not in rd.path.name else rd.path.name
        _draw(paths, notes, "plot", rd.path / "roofline.png", lambda p: plot_roofline(table, peaks, p, title))
        _draw(paths, notes, "breakdown", rd.path / "time_breakdown.png",
              lambda p: plot_time_breakdown(measured, head, p, title))
        if len(run.steps):
            _draw(paths, notes, "steps_plot", rd.path / "tpot_vs_position.png",
                  lambda p: steps.plot_tpot_vs_position(run.steps, p, f"TPOT against position: {title}"))
    facts = routing.routing_facts(run)   # once: the ladder rows and the MoE routing section
    rows = (ladder.execution_rows(run, table[table["level"] == "stage"] if len(table) else table, summary, facts)
            if len(measured) and ladder.has_variants(run) else None)   # one set of rows: ladder.png and the section
    if plot and rows is not None and len(rows) > 1:
        _draw(paths, notes, "ladder", rd.path / "ladder.png", lambda p: plot_ladder(rows, p))
    paths["report"] = rd.write_text("report.md", render(run, peaks, table, analytic, notes, summary, rows, facts))
    rd.manifest["roofline"] = {**peaks.as_dict(), "files": sorted(p.name for p in map(Path, paths.values()))}
    rd.save()
    return paths


def _draw(paths: dict, notes: list, key: str, path: Path, draw) -> None:
    """``paths[key] = draw(path)``; a plotting failure becomes a caveat in ``notes`` (it must not lose the
    tables), an OSError (a full disk, an unwritable directory) propagates."""
    try:
        paths[key] = draw(path)
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - a plotting failure must not lose the tables
        notes.append(f"{path.name} not written ({exc.__class__.__name__}: {exc})")


PROVENANCE = ("Column headers say where each number comes from: *measured* (CUDA events, the host clock or "
              "the profiler in this run), *analytic* (the cost model of `harness.analytic`: FLOPs and minimum "
              "DRAM bytes of the work) or *derived* (computed from both). TFLOP/s and GB/s are analytic work over "
              "measured time, not measured traffic (`python -m harness profile tool=ncu` measures traffic). "
              "Efficiency = roofline floor / measured time, floor = max(tensor FLOPs / peak, bytes / bandwidth), "
              "shown as *datasheet / calibrated* ceilings (dense peaks); MFU uses useful FLOPs (causal, unpadded), "
              "MBU (decode) the weight bytes of the experts touched + KV read.")


def render(run: RunData, peaks: Peaks, table: pd.DataFrame, analytic: pd.DataFrame, notes: list,
           summary: Optional[Summary] = None, ladder_rows: Optional[pd.DataFrame] = None,
           routing_facts: Optional[dict] = None) -> str:
    """report.md of a run: its sections in order (``sections``, ``ladder``, ``steps``, ``context``);
    ``ladder_rows`` (``ladder.execution_rows``) and ``routing_facts`` (``routing.routing_facts``) when
    the caller already has them (else derived here)."""
    man = Manifest.of(run.manifest)
    summary = summary or summarize(run.stages, warmup_counts(man))
    L = [f"# Run report: {run.path.name}", ""]
    if on_cpu(man, run.stages):
        L += [CPU_NOTE, ""]
    status = man.status or "?"
    L.append(f"Status **{status}**; experiment `{man.experiment or '-'}`; "
             f"{len(man.cases)} case(s); started {man.started or '?'}, finished "
             f"{man.finished or '-'}.")
    L.append(f"Device {peaks.device_name} ({peaks.spec_name or 'unknown device'}), dtype {peaks.dtype}; "
             f"{model_line(man)}.")
    L += merged_line(man)
    L += ["", PROVENANCE, ""]
    st = table[table["level"] == "stage"] if len(table) else table
    L += headline_section(run, st, summary)
    L += ladder.section(run, st, summary, ladder_rows)
    L += routing.section(run, st, routing_facts)
    L += steps.section(run.steps)
    L += stage_section(st)
    L += op_section(table, run)
    L += step_modules.section(run, analytic, peaks.mem_bw_gbs, _tpot_p50(summary))
    L += step_clock.section(run)
    L += top_kernels_section(run, summary)
    L += charts_section(run)
    L += ceilings_section(peaks, man)
    L += environment_section(man)
    L += caveats_section(run, peaks, summary.stages, flags.caveats(table) + notes if len(table) else notes,
                         summary.headline)
    L += files_section(run)
    return "\n".join(L)


def _tpot_p50(summary: Summary) -> dict:
    """{case: TPOT p50 of its median request, ms}."""
    st = summary.stages
    req = st[st["stage"] == "request"] if len(st) else st
    return dict(zip(req["case"], req["tpot_p50_ms"])) if len(req) else {}


__all__ = ["write_report", "render", "warmup_counts", "weights_of", "calibration_line"]
