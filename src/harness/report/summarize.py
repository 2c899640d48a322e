"""``python -m harness summarize SWEEP_DIR | RUN_DIR... [--out DIR]``: every run of a sweep in one
table and one plot.

Input: a Hydra multirun directory (``runs/multirun-<time>-<name>/``: ``multirun.yaml`` and one job
directory per sweep point, named by ``hydra.job.num``: ``0/``, ``1/``, ...; a failed run is renamed
``<n>-failed``), or run directories given one by one. Per job: ``manifest.json`` (status, error,
device), ``.hydra/overrides.yaml`` (the values this job was given), ``sweep_job.json`` (GPU slot,
``CUDA_VISIBLE_DEVICES``, pid, start/end; from ``hydra/launcher=gpus``), ``stages.csv`` and
``roofline.csv``. The swept keys are the overrides whose values differ between jobs; the expected
jobs come from ``multirun.yaml`` (basic sweeper), so a job that never started is listed as
``not started``. Failed and unfinished runs are listed with their status, never dropped. A job
folder of a sweep, or a file of a job that summarize reads (``JOB_FILES``), that is a symbolic
link is refused with one line (``harness.containment``), and so is an output file, or the output
folder, that is one: summarize reads and writes only regular files inside the folders it owns.

Output (``<SWEEP_DIR>/summary/``, rewritten by each summarize; for run directories
``<parent of the first>/summary-<time>/``; ``--out DIR`` elsewhere):

- ``summary.csv``: one row per run x case. Columns: ``job``, ``run_dir``, ``status``, one column per
  swept key (its value as given), ``case``, ``timer`` (cuda_event | host), ``decode_tok_s``,
  ``ttft_ms``, ``ttft_e2e_ms`` (with preprocessing and copy), ``tpot_p50_ms``, ``e2e_ms``,
  ``request_ms`` and ``<stage>_ms`` for sam, clip, projector, prefill, decode (medians of the timed
  repeats, measured), ``preprocess_ms`` (``model.vendor_entry=infer``: the vendor's own preprocessing,
  inside the request and so inside its TTFT, measured), ``kernels_per_step`` / ``syncs_per_step`` (decode, the profiled request,
  measured), ``pages_s_e2e`` (the run report's end-to-end pages/s, derived), ``eff_request`` /
  ``eff_request_cal`` (request floor / measured time against datasheet / calibrated ceilings,
  derived; empty without ceilings; a value above 1.0 is left empty and kept in the row's
  ``above_ceiling`` note), ``mbu_decode`` / ``mbu_decode_cal`` (decode MBU, the same rule), ``device``, ``gpu`` (the job's ``CUDA_VISIBLE_DEVICES``),
  ``pid``, ``start_unix``, ``end_unix``, ``wall_s`` and ``note``.
- ``summary.md``: the same as a table, with the fixed overrides, the sweep's wall-clock span and
  the failed runs' errors.
- ``summary.png``: decode tok/s, TTFT, end-to-end ms, stage ms and request efficiency against the
  first swept key (one line per case and value of the other swept keys).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
from pathlib import Path

import pandas as pd

from ..containment import refuse_links, refuse_out_links
from ..errors import HarnessError
from ..floats import finite as _f
from ..markdown import LEFT
from ..schema.stages import read_observations
from ..measure.summary import summarize as summarize_observations
from ..roofline import flags
from ..rundir import claim
from ..schema.headline import HEADLINE_CSV
from ..schema.manifest import Manifest
from ..schema.roofline import ROOFLINE_CSV
from .columns import Column, efficiency, fixed
from .columns import table as columns_table
from ..anatomy.stages import STAGES

JOB_DIR = re.compile(r"^(\d+)(-failed)?$")
REQUEST_COLS = ["decode_tok_s", "ttft_ms", "ttft_e2e_ms", "tpot_p50_ms", "e2e_ms"]
#: per decode step of the profiled request (measured): summary column -> summary.csv column
STEP_COLS = {"launches_per_step": "kernels_per_step", "syncs_per_step": "syncs_per_step"}
STAGE_COLS = [f"{s}_ms" for s in STAGES]
#: what summarize reads in a job folder (``refuse_job_links``)
JOB_FILES = ("manifest.json", "sweep_job.json", "stages.csv", "roofline.csv", ".hydra/overrides.yaml")
#: what summarize writes into its output folder
OUT_FILES = ("summary.csv", "summary.md", "summary.png")
FIX = "give a multirun directory (runs/multirun-<time>-<name>/) or run directories written by `python -m harness run`"


# ------------------------------------------------------------------------------ finding the runs

def _is_run_dir(p: Path) -> bool:
    return (p / "manifest.json").is_file() or (p / ".hydra" / "overrides.yaml").is_file()


def refuse_job_links(root: Path, job: str = ".") -> None:
    """Refuse the job folder ``root / job`` (``job``: a sweep's ``0``, ``1-failed``, ...; ``.`` for a
    run directory named on the command line, which may itself be a link) when it, or one of its
    ``JOB_FILES``, is a symbolic link."""
    refuse_links(root, *(f"{job}/{f}" for f in JOB_FILES), what="summarize")


def _parse_overrides(items) -> dict:
    """``["a.b=1", "+c=x"]`` -> ``{"a.b": "1", "c": "x"}`` (deletions ``~k`` are kept as ``None``)."""
    out = {}
    for item in items or []:
        item = str(item)
        if item.startswith("~"):
            out[item[1:].split("=", 1)[0]] = None
            continue
        key, _, value = item.lstrip("+").partition("=")
        out[key] = value
    return out


def _read_overrides(job_dir: Path) -> dict | None:
    from omegaconf import OmegaConf

    f = job_dir / ".hydra" / "overrides.yaml"
    return _parse_overrides(OmegaConf.to_container(OmegaConf.load(f))) if f.is_file() else None


def expected_jobs(sweep_dir: Path) -> tuple[list | None, str]:
    """The job override lists the basic sweeper made from ``multirun.yaml`` (index = job number),
    or (None, why not)."""
    f = sweep_dir / "multirun.yaml"
    if not f.is_file():
        return None, "no multirun.yaml: the expected jobs are unknown"
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(f)
    target = str(OmegaConf.select(cfg, "hydra.sweeper._target_") or "")
    if not target.endswith("BasicSweeper"):
        return None, f"sweeper {target or 'unknown'}: the expected jobs are unknown"
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser

        params = OmegaConf.select(cfg, "hydra.sweeper.params")
        params = OmegaConf.to_container(params) if OmegaConf.is_config(params) else {}
        args = [f"{k}={v}" for k, v in params.items()]
        args += [str(a) for a in OmegaConf.to_container(cfg.hydra.overrides.task)]
        batches = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(args), None)
    except Exception as exc:   # a parse failure is reported, not hidden
        return None, f"multirun.yaml could not be expanded ({exc.__class__.__name__}: {exc})"
    return [job for batch in batches for job in batch], ""


def collect_jobs(paths) -> tuple[list[dict], Path | None, list[str]]:
    """(jobs [{job, dir, overrides}], the multirun dir or None, notes) for the command-line paths."""
    paths = [Path(p) for p in paths]
    for p in paths:
        if not p.is_dir():
            raise HarnessError(f"{str(p)!r} is not a directory", FIX)
    if len(paths) == 1 and not _is_run_dir(paths[0]):
        return _sweep_jobs(paths[0])
    jobs = []
    for p in paths:
        if not _is_run_dir(p):
            raise HarnessError(f"{p} has neither manifest.json nor .hydra/overrides.yaml", FIX)
        refuse_job_links(p)
        jobs.append({"job": p.name, "dir": p, "overrides": _read_overrides(p)})
    return jobs, None, []


def _sweep_jobs(sweep: Path) -> tuple[list[dict], Path, list[str]]:
    found = {}
    for d in sorted(sweep.iterdir()):
        m = JOB_DIR.match(d.name)
        if d.is_dir() and m and _is_run_dir(d):
            refuse_job_links(sweep, d.name)
            found.setdefault(int(m.group(1)), []).append(d)
    expected, why = expected_jobs(sweep)
    if not found and not expected:
        raise HarnessError(f"{sweep} holds no job directories (0/, 1/, ...) and no multirun.yaml", FIX)
    notes = [why] if why else []
    nums = sorted(set(found) | set(range(len(expected or []))))
    jobs = []
    for n in nums:
        dirs = found.get(n) or [None]
        for d in dirs:   # a rerun of the same number next to its -failed twin: both listed
            ov = _read_overrides(d) if d is not None else None
            if ov is None and expected and n < len(expected):
                ov = _parse_overrides(expected[n])
            jobs.append({"job": str(n), "dir": d, "overrides": ov})
    if expected is not None and len(found) > len(expected):
        notes.append(f"{len(found)} job directories but multirun.yaml expands to {len(expected)} jobs")
    return jobs, sweep, notes


def swept_keys(jobs: list[dict]) -> tuple[list[str], dict]:
    """(keys whose value differs between jobs, in first-seen order; {key: value} shared by all)."""
    order, values = [], {}
    for j in jobs:
        for k, v in (j["overrides"] or {}).items():
            if k not in values:
                order.append(k)
                values[k] = set()
            values[k].add(v)
    known = [j for j in jobs if j["overrides"] is not None]
    swept = [k for k in order if len(values[k]) > 1 or any(k not in j["overrides"] for j in known)]
    fixed = {k: next(iter(values[k])) for k in order if k not in swept}
    return swept, fixed


# ------------------------------------------------------------------------------- one job's rows

def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _efficiency(job_dir: Path) -> dict:
    """{case: (request efficiency, calibrated, decode MBU, calibrated)} from roofline.csv (derived;
    a value above 1.0 is None, ``flags.value_of``)."""
    t = ROOFLINE_CSV.read(job_dir)
    if not len(t) or "level" not in t:
        return {}
    t = t[t["level"] == "stage"]
    out: dict = {}
    for r in t.to_dict("records"):
        e = out.setdefault(r["case"], [None] * 4)
        if r["stage"] == "request":
            e[0:2] = flags.value_of(r, "efficiency"), flags.value_of(r, "efficiency_cal")
        elif r["stage"] == "decode" and "mbu" in r:
            e[2:4] = flags.value_of(r, "mbu"), flags.value_of(r, "mbu_cal")
    return out


def _pages_s_e2e(job_dir: Path) -> dict:
    """{case: end-to-end pages/s} of the run's report (headline.csv: batch x repeats / the summed
    preprocessing + copy + generate() wall time, derived), where the report wrote it."""
    h = HEADLINE_CSV.read(job_dir)
    return dict(zip(h["case"], h["pages_s_e2e"])) if len(h) and "pages_s_e2e" in h else {}


def job_rows(job: dict, swept: list[str], base: Path | None) -> list[dict]:
    """One row per case of a job (one row with the status alone when it measured nothing)."""
    d = job["dir"]
    ov = job["overrides"] or {}
    head = {"job": job["job"], "run_dir": (str(d.relative_to(base)) if base and d else str(d) if d else None),
            **{k: ov.get(k) for k in swept}}
    if d is None:
        return [{**head, "status": "not started", "note": "no job directory (the sweep stopped before this job)"}]
    raw = _json(d / "manifest.json")
    man = Manifest.of(raw)
    sj = _json(d / "sweep_job.json")
    launch = man.launch
    status = man.status or "no manifest"
    note = ""
    if not raw:
        note = "Hydra started the job but the run wrote no manifest.json (see the job's .log)"
    elif status == "running":
        note = "not finished: still running, or killed before the end"
    elif status == "failed":
        note = str(man.error).splitlines()[0][:300] if man.error else "failed"
    start = _f(sj.get("start_unix")) or _iso_unix(man.started)
    end = _f(sj.get("end_unix")) or _iso_unix(man.finished)
    common = {**head, "status": status, "device": man.device_name or man.device_type,
              "gpu": sj.get("CUDA_VISIBLE_DEVICES", launch.get("CUDA_VISIBLE_DEVICES")),
              "pid": sj.get("pid", launch.get("pid")), "start_unix": start, "end_unix": end,
              "wall_s": (end - start) if start is not None and end is not None else None, "note": note}
    ms = summarize_observations(read_observations(d / "stages.csv")).stages
    if not len(ms):
        return [common]
    eff, e2e = _efficiency(d), _pages_s_e2e(d)
    rows = []
    for case, g in ms.groupby("case", sort=False):
        g = g.set_index("stage")
        req = g.loc["request"] if "request" in g.index else None
        row = {**common, "case": case, "timer": g["timer"].iloc[0]}
        row.update({c: (_f(req[c]) if req is not None and c in req else None) for c in REQUEST_COLS})
        row["request_ms"] = _f(req["time_ms"]) if req is not None else None
        row.update({f"{s}_ms": (_f(g.loc[s, "time_ms"]) if s in g.index else None) for s in STAGES})
        row["preprocess_ms"] = _f(g.loc["preprocess", "time_ms"]) if "preprocess" in g.index else None
        dec = g.loc["decode"] if "decode" in g.index else None
        row.update({out: (_f(dec[c]) if dec is not None and c in dec else None) for c, out in STEP_COLS.items()})
        row["pages_s_e2e"] = _f(e2e.get(case))
        row["eff_request"], row["eff_request_cal"], row["mbu_decode"], row["mbu_decode_cal"] = eff.get(case, [None] * 4)
        rows.append(row)
    return rows


def _iso_unix(text) -> float | None:
    try:
        return _dt.datetime.fromisoformat(str(text)).timestamp() if text else None
    except ValueError:
        return None


def summarize(paths) -> tuple[pd.DataFrame, dict]:
    """(summary DataFrame [module docstring columns], info: sweep dir, swept keys, fixed overrides, notes)."""
    jobs, sweep, notes = collect_jobs(paths)
    swept, fixed = swept_keys(jobs)
    rows = [r for j in jobs for r in job_rows(j, swept, sweep)]
    cols = (["job", "run_dir", "status", *swept, "case", "timer", *REQUEST_COLS, "request_ms", *STAGE_COLS,
             "preprocess_ms", *STEP_COLS.values(), "pages_s_e2e", "eff_request", "eff_request_cal", "mbu_decode", "mbu_decode_cal", "device", "gpu", "pid", "start_unix", "end_unix", "wall_s", "note"])
    df = pd.DataFrame(rows).reindex(columns=cols)
    return df, {"sweep": sweep, "swept": swept, "fixed": fixed, "notes": notes, "jobs": len(jobs)}


# ------------------------------------------------------------------------------------- output

_L = dict(align=LEFT)
_F2 = fixed("{:,.2f}")
#: summary.md's table (``harness.report.columns``), one row per job x case; the swept keys come before ``status``
TABLE = {c.name: c for c in [
    Column("job", "job", **_L), Column("status", "status", **_L), Column("case", "case", **_L),
    Column("decode_tok_s", "tok/s", fmt=fixed("{:,.1f}"), **_L), Column("ttft_ms", "TTFT", "ms", fmt=_F2, **_L),
    Column("ttft_e2e_ms", "TTFT + prep + copy", "ms", fmt=_F2, **_L),
    Column("tpot_p50_ms", "TPOT p50", "ms", fmt=_F2, **_L), Column("e2e_ms", "e2e", "ms", fmt=fixed("{:,.1f}"), **_L),
    Column("pages_s_e2e", "e2e pages/s", fmt=fixed("{:,.3f}"), **_L),
    *[Column(f"{s}_ms", s, "ms", fmt=_F2, **_L) for s in STAGES],
    Column("kernels_per_step", "kernels / step", fmt=fixed("{:,.0f}"), **_L),
    Column("syncs_per_step", "syncs / step", fmt=fixed("{:,.0f}"), **_L),
    Column("mbu_decode", "decode MBU", fmt=efficiency, **_L),
    Column("mbu_decode_cal", "decode MBU cal", fmt=efficiency, **_L),
    Column("eff_request", "eff", fmt=efficiency, **_L), Column("eff_request_cal", "eff cal", fmt=efficiency, **_L),
    Column("gpu", "gpu", **_L)]}


def render(df: pd.DataFrame, info: dict, png: Path | None) -> str:
    swept = info["swept"]
    L = ["# Sweep summary", ""]
    if info["sweep"] is not None:
        L.append(f"- sweep: `{info['sweep']}` ({info['jobs']} job(s))")
    if info["fixed"]:
        L.append("- fixed: " + ", ".join(f"`{k}={v}`" for k, v in info["fixed"].items()))
    L.append("- swept: " + (", ".join(f"`{k}`" for k in swept) if swept else "nothing (one configuration)"))
    counts = df.drop_duplicates("job")["status"].value_counts()
    L.append("- status: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    starts, ends = df["start_unix"].dropna(), df["end_unix"].dropna()
    if len(starts) and len(ends):
        per_job = df.drop_duplicates("job")["wall_s"].dropna()
        L.append(f"- wall clock: {ends.max() - starts.min():.1f} s from the first job's start to the last job's end; "
                 f"sum of job times {per_job.sum():.1f} s; GPUs used: "
                 f"{', '.join(sorted({str(g) for g in df['gpu'].dropna()})) or 'none recorded'}")
    L += ["", "Times: medians of each run's timed repeats (measured; CUDA events, or host clocks where timer = host); "
          "TTFT + prep + copy adds the request's preprocessing and its copy to the device (measured). e2e pages/s: "
          "the run report's end-to-end pages/s (derived: preprocessing, copy and generate() in turn). Kernels and host "
          "syncs per decode step: measured (profiled request). Decode MBU: analytic weight + KV bytes over the decode "
          "time (derived). Efficiency: the request's analytic floor over its measured time (datasheet / calibrated "
          "ceilings).", ""]
    names = ["job", *swept, *list(TABLE)[1:]]
    columns = {**{k: Column(k, k, **_L) for k in swept}, **TABLE}   # a swept key is a label column of its own
    L += columns_table(names, [{**r, "job": str(r["job"]), "status": str(r["status"])} for r in df.to_dict("records")],
                       columns)
    bad = df[~df["status"].isin(["complete"])].drop_duplicates("job")
    if len(bad):
        L += ["", "## Not complete", ""] + [f"- job {r['job']} ({r['status']}): {r['note'] or '–'}"
                                            for _, r in bad.iterrows()]
    if info["notes"]:
        L += ["", "## Notes", ""] + [f"- {n}" for n in info["notes"]]
    if png:
        L += ["", f"![metrics vs swept values]({Path(png).name})"]
    return "\n".join(L) + "\n"


def _numeric(values: pd.Series):
    num = pd.to_numeric(values, errors="coerce")
    return num if num.notna().all() else None


def plot(df: pd.DataFrame, swept: list[str], path: Path) -> Path | None:
    """Metric panels against the first swept key (categorical when not numeric); None when no
    run measured anything."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    ok = df[df["case"].notna()].copy()
    if not len(ok):
        return None
    xkey = swept[0] if swept else "job"
    num = _numeric(ok[xkey].astype(str))
    if num is not None:
        ok["_x"] = num
        ticks = None
    else:
        order = list(dict.fromkeys(ok[xkey].astype(str)))
        ok["_x"] = [order.index(v) for v in ok[xkey].astype(str)]
        ticks = order
    others = swept[1:]
    ok["_series"] = ok["case"].astype(str) + ok[others].astype(str).apply(
        lambda r: "".join(f" {k}={v}" for k, v in r.items()), axis=1) if others else ok["case"].astype(str)
    panels = [("decode_tok_s", "decode tok/s"), ("ttft_ms", "TTFT ms"), ("e2e_ms", "end-to-end ms"),
              ("stages", "stage ms"), ("eff_request", "request efficiency")]
    if ok["eff_request"].isna().all() and ok["eff_request_cal"].isna().all():
        panels = panels[:-1]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), dpi=100)
    series = list(dict.fromkeys(ok.sort_values("_x")["_series"]))
    styles = ["-", "--", ":", "-."]
    for ax, (col, title) in zip(axes, panels):
        for k, (name, g) in enumerate((n, ok[ok["_series"] == n].sort_values("_x")) for n in series):
            if col == "stages":   # colour = stage, line style = series
                for c, s in enumerate(STAGES):
                    if g[f"{s}_ms"].notna().any():
                        ax.plot(g["_x"], g[f"{s}_ms"], marker="o", color=f"C{c}", ls=styles[k % len(styles)],
                                label=f"{s} ({name})" if len(series) > 1 else s)
            elif col == "eff_request":   # above the ceiling is a flag (summary.md), never a point
                eff = g["eff_request"].where(g["eff_request"].notna(), g["eff_request_cal"])
                eff = eff.where(eff <= 1.0)
                ax.plot(g["_x"], eff, marker="o", label=name)
            else:
                ax.plot(g["_x"], g[col], marker="o", label=name)
        ax.set(title=title, xlabel=xkey)
        if ticks is not None:
            ax.set_xticks(range(len(ticks)), ticks, rotation=30, fontsize=7)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def default_out(paths, sweep: Path | None) -> Path:
    """SWEEP/summary (rewritten on each summarize), else a new ``summary-<time>`` beside the first run,
    claimed for this process (``rundir.claim``)."""
    if sweep is not None:
        return sweep / "summary"
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return claim(Path(paths[0]).resolve().parent / f"summary-{stamp}")


def summarize_main(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m harness summarize",
                                description="One table and plot of every run of a sweep "
                                            "(a multirun directory, or run directories).")
    p.add_argument("paths", nargs="+", help="a multirun directory (runs/multirun-...) or run directories")
    p.add_argument("--out", default=None,
                   help="output directory (default: SWEEP/summary/, or summary-<time>/ beside the runs)")
    args = p.parse_args(list(argv))
    df, info = summarize(args.paths)
    out = Path(args.out) if args.out else default_out(args.paths, info["sweep"])
    refuse_out_links(out, OUT_FILES, what="summarize")
    out.mkdir(parents=True, exist_ok=True)
    flags.for_csv(df, ("eff_request", "eff_request_cal")).to_csv(out / "summary.csv", index=False)
    png = plot(df, info["swept"], out / "summary.png")
    text = render(df, info, png)
    (out / "summary.md").write_text(text)
    print(text)
    print(f"[harness] wrote {out}")
    return 0


__all__ = ["summarize_main", "summarize", "collect_jobs", "refuse_job_links", "JOB_FILES", "OUT_FILES", "expected_jobs",
           "swept_keys", "job_rows", "render", "plot"]


if __name__ == "__main__":   # python -m harness.report.summarize SWEEP_DIR (same as the summarize verb)
    import sys

    try:
        sys.exit(summarize_main(sys.argv[1:]))
    except HarnessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
