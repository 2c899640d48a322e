"""Per-run report: report.md, analytic.csv, roofline.csv and roofline.png in the run directory.

``write_report(rd, data)`` takes what the run measured (a ``harness.rundir.RunData``: the run
verb's in-memory tables, or a run directory read back once), resolves the device ceilings (datasheet via ``harness.roofline.specs``, calibrated
via the cached ``python -m harness calibrate`` record, ``hardware.*`` overrides), computes the
analytic costs of every measured case (``harness.analytic``), joins them
(``harness.roofline.join``) and writes, through the ``RunDir`` helper:

* ``analytic.csv``: ``harness.analytic.compose.COLUMNS`` + ``routing`` (measured / uniform) +
  ``bytes_kv_copy_read/write`` for every case x stage x family, TOTAL rows per stage;
* ``headline.csv``: ``harness.measure.summarize.HEADLINE_COLUMNS``, one row per case: the
  median request with its stage times and the min/max of every value over the timed repeats;
* ``roofline.csv``: ``harness.roofline.join.ROOFLINE_COLUMNS``, ``level = stage`` rows (five
  stages + request per case) and ``level = op_family`` rows;
* ``roofline.png``: log-log roofline, both ceilings, one point per case x stage;
* ``time_breakdown.png``: per case and stage, kernel busy and idle time, host span marked;
* ``tpot_vs_position.png``: decode-step time against KV length (``harness.report.steps``);
* ``ladder.png``: decode tok/s and MBU per execution variant (runs with execution variants);
* ``report.md``: headline (median request) per case, its stage times, execution variants, TPOT
  against position, per-stage roofline table (GPU span, host span, busy, idle, efficiency against
  span and busy), op families, top kernels per stage, ceilings, environment, caveats. Every column
  header says whether it is measured, analytic or derived.

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

from ..measure import host
from ..measure.summarize import busy_ms, headline
from ..roofline.calibrate import load_calibration
from ..roofline.join import OP_GROUPS, _f
from ..roofline.table import roofline_table
from ..roofline.plot import plot_roofline
from .breakdown import plot_time_breakdown
from ..roofline.specs import Peaks, device_name_of, hardware_config, resolve_peaks
from ..rundir import RunData, RunDir, load_run
from ..stages import PREPROCESS, STAGES
from . import steps

log = logging.getLogger("harness.report")
TOP_KERNELS = 5
CV_LIMIT = 0.02


def ceilings(manifest: dict, hardware: Optional[dict] = None) -> Peaks:
    """Datasheet + calibrated ceilings for the run's device and dtype (the run's ``hardware``
    section, with ``hardware`` overriding keys of it)."""
    config = manifest.get("config") or {}
    hw = hardware_config({**(config.get("hardware") or {}), **(hardware or {})})
    name = device_name_of(manifest.get("device"))
    dtype = str(manifest.get("dtype") or "bf16").replace("torch.", "")
    entry = manifest.get("calibration") or {}
    if _f(entry.get("gemm_tflops")) is not None and "calibration" not in (hardware or {}):
        cal = {**entry, "path": entry.get("path") or "run manifest"}
    elif entry.get("status") == "rejected" and "calibration" not in (hardware or {}):
        cal = None      # the run's own calibration failed its checks: no ceiling, never another record
    else:
        cal = load_calibration(name, hw)
    peaks = resolve_peaks(name, dtype, hw, cal)
    if cal is None:
        why = f" ({entry['reason']})" if entry.get("reason") else ""
        peaks.notes.append(f"not calibrated{why}: run `python -m harness calibrate` on this device for measured "
                           "ceilings (a run calibrates on first use unless hardware.calibrate=false)")
    return peaks


def write_report(run: Union[RunDir, str, Path], data: Optional[RunData] = None, hardware: Optional[dict] = None,
                 strict: bool = False, plot: bool = True) -> dict:
    """Write analytic.csv, roofline.csv, roofline.png and report.md into the run directory.

    ``run``: the live ``RunDir`` of ``harness.run`` with its in-memory ``data``, or the path of a run
    directory (read once). Returns {name: Path}. Unless ``strict``, a failure is recorded as a
    manifest warning and {} returned (the measurement is never lost to a reporting error); an
    OSError (a full disk, an unwritable directory) always propagates.
    """
    if data is None:
        data = load_run(run.path if isinstance(run, RunDir) else run)
    rd = run if isinstance(run, RunDir) else RunDir.attach(data.path, data.manifest)
    try:
        return _write(rd, data, hardware, plot)
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
    if not len(run.stages):
        paths["report"] = rd.write_text("report.md", render(run, peaks, pd.DataFrame(), pd.DataFrame(),
                                                            pd.DataFrame(), [], pd.DataFrame()))
        return paths
    table, analytic, measured, notes = roofline_table(run, peaks)
    head = headline(run.stages, warmup_counts(rd.manifest))
    if len(analytic):
        paths["analytic"] = rd.write_csv("analytic.csv", analytic)
    paths["headline"] = rd.write_csv("headline.csv", head)
    paths["roofline"] = rd.write_csv("roofline.csv", table)
    if plot:
        cfg = rd.manifest.get("config") or {}
        exp = cfg.get("experiment_name") or (cfg.get("run") or {}).get("name")
        title = f"{exp}: {rd.path.name}" if exp and exp not in rd.path.name else rd.path.name
        for key, name, draw in (("plot", "roofline.png", lambda p: plot_roofline(table, peaks, p, title)),
                                ("breakdown", "time_breakdown.png", lambda p: plot_time_breakdown(measured, head, p,
                                                                                                  title))):
            try:
                paths[key] = draw(rd.path / name)
            except OSError:
                raise
            except Exception as exc:  # noqa: BLE001 - a plotting failure must not lose the tables
                notes.append(f"{name} not written ({exc.__class__.__name__}: {exc})")
        if len(run.steps):
            try:
                paths["steps_plot"] = steps.plot_tpot_vs_position(run.steps, rd.path / "tpot_vs_position.png",
                                                                  f"TPOT against position: {title}")
            except OSError:
                raise
            except Exception as exc:  # noqa: BLE001
                notes.append(f"tpot_vs_position.png not written ({exc.__class__.__name__}: {exc})")
    if plot and len(measured) and has_variants(run):
        try:
            ladder = execution_rows(run, table[table["level"] == "stage"] if len(table) else table, measured)
            if len(ladder) > 1:
                from ..roofline.plot import plot_ladder
                paths["ladder"] = plot_ladder(ladder, rd.path / "ladder.png")
        except OSError:
            raise
        except Exception as exc:  # noqa: BLE001 - a plotting failure must not lose the tables
            notes.append(f"ladder.png not written ({exc.__class__.__name__}: {exc})")
    paths["report"] = rd.write_text("report.md", render(run, peaks, table, analytic, measured, notes, head))
    rd.manifest["roofline"] = {**peaks.as_dict(), "files": sorted(p.name for p in map(Path, paths.values()))}
    rd.save()
    return paths


def warmup_counts(manifest: dict) -> dict:
    """{case: untimed warm-up requests} from the manifest's case entries (else its resolved ``measure``
    section; None where neither recorded it)."""
    default = (manifest.get("measure") or {}).get("warmup")
    return {c.get("name"): (len(c["warmup_ms"]) if isinstance(c.get("warmup_ms"), list) else default)
            for c in manifest.get("cases") or []}


def weights_of(man: dict) -> Optional[str]:
    """'random' / 'path' / 'safetensors' of the model that ran (None: not recorded): the reference
    adapter records a string, the vendor adapter a dict ({'source': 'random' | 'safetensors', ...})."""
    model = man.get("model") or {}
    w = model.get("weights", ((man.get("config") or {}).get("model") or {}).get("weights"))
    if isinstance(w, dict):
        return str(w["source"]) if w.get("source") else None
    return None if w is None else str(w)


# ---------------------------------------------------------------------------------- format

def _n(v, fmt="{:,.2f}", none="–") -> str:
    x = _f(v)
    return none if x is None else fmt.format(x)


def _s(v, scale: float = 1.0) -> str:
    """Number with ~4 significant digits, thousands separators for large values."""
    x = _f(v)
    if x is None:
        return "–"
    x /= scale
    if x == 0:
        return "0"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 1:
        return f"{x:,.2f}"
    return f"{x:.3g}"


def _pct(v) -> str:
    x = _f(v)
    return "–" if x is None else f"{100 * x:.1f}%"


def _table(header: list, rows: list, align: Optional[list] = None) -> list:
    align = align or ["---"] + ["---:"] * (len(header) - 1)
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return out


def _eff(r, key: str = "efficiency") -> str:
    return f"{_pct(r.get(key))} / {_pct(r.get(key + '_cal'))}"


# ---------------------------------------------------------------------------------- render

PROVENANCE = ("Column headers say where each number comes from: *measured* (CUDA events, the host clock or "
              "the profiler in this run), *analytic* (the cost model of `harness.analytic`: FLOPs and minimum "
              "DRAM bytes of the work) or *derived* (computed from both). TFLOP/s and GB/s are analytic work over "
              "measured time, not measured traffic (`python -m harness profile tool=ncu` measures traffic). "
              "Efficiency = roofline floor / measured time, floor = max(tensor FLOPs / peak, bytes / bandwidth), "
              "shown as *datasheet / calibrated* ceilings (dense peaks); MFU uses useful FLOPs (causal, unpadded), "
              "MBU (decode) the weight bytes of the experts touched + KV read.")


def render(run: RunData, peaks: Peaks, table: pd.DataFrame, analytic: pd.DataFrame, measured: pd.DataFrame,
           notes: list, head: Optional[pd.DataFrame] = None) -> str:
    man = run.manifest
    cfg = man.get("config") or {}
    head = head if head is not None else headline(run.stages, warmup_counts(man))
    L = [f"# Run report: {run.path.name}", ""]
    status = man.get("status", "?")
    L.append(f"Status **{status}**; experiment `{cfg.get('experiment_name', (cfg.get('run') or {}).get('name', '-'))}`; "
             f"{len(man.get('cases') or [])} case(s); started {man.get('started', '?')}, finished "
             f"{man.get('finished') or '-'}.")
    L.append(f"Device {peaks.device_name} ({peaks.spec_name or 'unknown device'}), dtype {peaks.dtype}; model "
             f"`{(man.get('model') or {}).get('adapter', (cfg.get('model') or {}).get('name', '?'))}` with "
             f"{weights_of(man) or '?'} weights.")
    L += ["", PROVENANCE, ""]
    st = table[table["level"] == "stage"] if len(table) else table
    L += _headline(run, st, measured, head)
    L += _execution_table(run, st, measured)
    L += steps.section(run.steps, _table, _n)
    L += _stage_table(st)
    L += _op_table(table)
    L += _top_kernels(run)
    L += _charts(run)
    L += _ceilings(peaks, man)
    L += _environment(man)
    L += _caveats(run, peaks, measured, notes, head)
    L += _files(run)
    return "\n".join(L)


def _files(run: RunData) -> list:
    L = ["## Files", ""]
    if not run.path.is_dir():
        return L + [""]
    files = sorted(p.name for p in run.path.iterdir() if p.is_file() and not p.name.endswith(".tmp")
                   and not p.name.startswith("."))
    L += [f"- `{f}`" for f in files]
    traces = sorted((run.path / "traces").glob("*/trace.json.gz")) if (run.path / "traces").is_dir() else []
    L += [f"- `{t.relative_to(run.path)}` ({t.stat().st_size / 1e6:,.1f} MB: Chrome/Perfetto trace of the profiled "
          "request)" for t in traces]
    return L + [""]


def _case_info(man: dict) -> dict:
    return {c.get("name"): c for c in man.get("cases") or []}


def _spread(v, lo, hi, fmt=_s) -> str:
    """'value [min–max]' (min/max over the timed repeats), the value alone when they are missing or equal."""
    if _f(v) is None:
        return "–"
    if _f(lo) is None or _f(hi) is None or _f(lo) == _f(hi):
        return fmt(v)
    return f"{fmt(v)} [{fmt(lo)}–{fmt(hi)}]"


def _headline(run: RunData, st: pd.DataFrame, measured: pd.DataFrame, head: pd.DataFrame) -> list:
    L = ["## Headline", ""]
    if not len(measured) or not len(head):
        return L + ["_No stage measurements yet._", ""]
    info = _case_info(run.manifest)
    timer = "host" if (measured["timer"] == "host").any() else "GPU"
    rows, stage_rows = [], []
    for h in head.to_dict("records"):
        case = h["case"]
        ci = info.get(case, {})
        s = st[st["case"] == case] if len(st) else st
        rq = s[s["stage"] == "request"]
        stages = s[s["stage"].isin(STAGES)]
        dom = ""
        if len(stages):
            d = stages.loc[pd.to_numeric(stages["measured_ms"], errors="coerce").idxmax()]
            total = pd.to_numeric(stages["measured_ms"], errors="coerce").sum()
            dom = f"{d['stage']} {_pct(d['measured_ms'] / total if total else None)}: {d['bound']}"
        warm = "?" if h.get("warmup") is None or h.get("warmup") != h.get("warmup") else int(h["warmup"])
        tpot = " / ".join(_n(h.get(c)) for c in ("tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms"))
        rows.append([case, ci.get("mode", h.get("mode") or "?"), ci.get("grid") or "-", ci.get("batch", h.get("batch")),
                     f"{ci.get('image_tokens', '?')} / {ci.get('prefill_tokens', '?')} / {ci.get('decode_tokens', '?')}",
                     f"{warm} + {int(h['repeats'])}", f"#{h['repeat']}",
                     _spread(h.get("e2e_ms"), h.get("e2e_ms_min"), h.get("e2e_ms_max")),
                     _n(h.get("pages_s"), "{:,.3g}"),
                     _spread(h.get("ttft_ms"), h.get("ttft_ms_min"), h.get("ttft_ms_max")),
                     _spread(h.get("ttft_e2e_ms"), h.get("ttft_e2e_ms_min"), h.get("ttft_e2e_ms_max")),
                     tpot, _n(h.get("decode_tok_s"), "{:,.1f}"),
                     _eff(rq.iloc[0]) if len(rq) else "–", dom])
        total, e2e = _f(h.get("stage_sum_ms")), _f(h.get("e2e_ms"))
        stage_rows.append([case] + [_s(h.get(f"{x}_ms")) for x in STAGES]
                          + [_s(total), _s(e2e - total if e2e is not None and total is not None else None),
                             _pct(total / e2e if total and e2e else None),
                             _pct(h["ttft_stage_sum_ms"] / h["ttft_ms"] if _f(h.get("ttft_ms")) else None)])
    L += _table(["case", "mode", "grid", "batch", "tokens image / prefill / decode", "warm-up + timed",
                 "median request", "e2e ms (measured) [min–max]", "pages/s (derived)", "TTFT ms (measured) [min–max]",
                 "TTFT + prep + copy ms (measured)", "TPOT p50 / p90 / p99 ms (measured)", "tok/s (derived)",
                 "request eff (derived, sheet / cal)", "dominant stage: bound"], rows,
                ["---"] * 3 + ["---:"] * 11 + ["---"])
    L += ["", f"One row per case: the **median request**, the timed repeat whose end-to-end time is the median "
          f"(with an even count the lower middle), every value from that one request; [min–max] over the timed "
          f"repeats (`headline.csv` also has the seeded bootstrap 95% interval of the median). Times: {timer} clock "
          f"({'CUDA events' if timer == 'GPU' else 'host wall clock, no CUDA'}). TTFT runs from the request's "
          "start to the first token (vision + prefill) and excludes building the request (preprocessing) and its "
          "copy to the device, which *TTFT + prep + copy* adds. TPOT percentiles and tok/s come from the same "
          "per-step distribution: tok/s = batch x 1000 / mean decode-step ms. pages/s = batch x 1000 / e2e ms.", "",
          "### Stage times of the median request", ""]
    L += _table(["case"] + [f"{x} ms (measured)" for x in STAGES] + ["stage sum ms (derived)",
                                                                       "between stages ms (derived: e2e - sum)",
                                                                       "stage sum / e2e", "vision + prefill / TTFT"],
                stage_rows)
    L += ["", "The stages are disjoint: their sum falls short of the end-to-end time by the host time between "
          "the stage ranges (GPU idle there when the host is the bottleneck), and vision + prefill ends where "
          "TTFT ends.", ""]
    pre = measured[measured["stage"] == PREPROCESS]
    if len(pre):
        L += ["Preprocess (the vendor's infer() preparing the page itself, before its first forward; in e2e and "
              "TTFT, not in the stage columns): " + ", ".join(f"{r.case} {_n(r.time_ms)} ms" for r in pre.itertuples())
              + ".", ""]
    return L


EXECUTION_SHORT = (("kv_cache", "static", "static KV"), ("moe_impl", "grouped", "grouped MoE"),
                   ("cuda_graphs", "decode", "decode graph"), ("compile", True, "compiled"),
                   ("prefill_graphs", True, "prefill graph"), ("vision_impl", "fused", "fused vision"),
                   ("linear_impl", "fused", "fused linears"), ("vision_compile", True, "compiled vision"),
                   ("decode_attention", "triton", "triton decode attention"))


def execution_label(ex: dict) -> str:
    """'static KV + grouped MoE (triton) + ...' from a manifest case's execution ('vendor-style' when
    nothing differs from the vendor's execution)."""
    parts = []
    for key, on, text in EXECUTION_SHORT:
        if ex.get(key) == on:
            kernel = ex.get("moe_kernel_resolved") if key == "moe_impl" else None
            parts.append(f"{text} ({kernel})" if kernel else text)
    return " + ".join(parts) or "vendor-style"


def execution_rows(run: RunData, st: pd.DataFrame, measured: pd.DataFrame) -> pd.DataFrame:
    """One row per case: execution label, decode tok/s, TPOT p50/p90/p99, TTFT, kernels and host syncs per
    decode step, decode idle share and CV, MBU (datasheet / calibrated), speed-up over the vendor-style
    case of the same mode (any batch: the throughput gain; none where the run has no such case)."""
    rows = []
    info = _case_info(run.manifest)
    stg = run.stages
    for case in dict.fromkeys(measured["case"]):
        m = measured[measured["case"] == case].set_index("stage")
        if "request" not in m.index or "decode" not in m.index:
            continue
        req, dec = m.loc["request"], m.loc["decode"]
        s = st[(st["case"] == case) & (st["stage"] == "decode")] if len(st) else st
        r = s.iloc[0] if len(s) else {}
        prof = stg[(stg["case"] == case) & (stg["stage"] == "decode") & (stg["repeat"].astype(str) == "profiled")
                   & (stg["call"].astype(str) == "all")] if len(stg) and "host_syncs" in stg else stg.iloc[:0]
        ex = info.get(case, {}).get("execution") or {}
        setup = ex.get("setup_s") or {}
        rows.append({"case": case, "execution": execution_label(ex), "batch": info.get(case, {}).get("batch"),
                     "mode": info.get(case, {}).get("mode"),
                     "tok_s": _f(req.get("decode_tok_s")), "tpot_p50_ms": _f(req.get("tpot_p50_ms")),
                     "tpot_p90_ms": _f(req.get("tpot_p90_ms")), "tpot_p99_ms": _f(req.get("tpot_p99_ms")),
                     "ttft_ms": _f(req.get("ttft_ms")), "kernels_per_step": _f(dec.get("launches_per_step")),
                     "syncs_per_step": _f(prof["syncs_per_step"].iloc[0]) if len(prof) else None,
                     "decode_idle": _f(r.get("idle_fraction")) if len(s) else None,
                     "decode_cv": _f(dec.get("cv")), "mbu": _f(r.get("mbu")) if len(s) else None,
                     "mbu_cal": _f(r.get("mbu_cal")) if len(s) else None,
                     "setup_s": sum(v for d in (setup.values() if isinstance(setup, dict) else [])
                                    for v in (d.values() if isinstance(d, dict) else [d]) if _f(v) is not None)})
    df = pd.DataFrame(rows)
    if len(df):
        base = {}
        for r in df.itertuples():
            if r.execution == "vendor-style" and _f(r.tok_s) and r.mode not in base:
                base[r.mode] = r.tok_s
        df["speedup"] = [t / base[m] if m in base and _f(t) is not None else None
                         for t, m in zip(df["tok_s"], df["mode"])]
    return df


def has_variants(run: RunData) -> bool:
    """True when a case of the run executed otherwise than the vendor's way (an execution ladder)."""
    return any(execution_label(c.get("execution") or {}) != "vendor-style" for c in run.manifest.get("cases") or [])


def _execution_table(run: RunData, st: pd.DataFrame, measured: pd.DataFrame) -> list:
    if not len(measured) or not has_variants(run):
        return []
    df = execution_rows(run, st, measured)
    L = ["## Execution variants", "",
         "Same weights, different execution (`harness.config.ExecutionConfig`). tok/s, TPOT and TTFT: measured "
         "(median of the timed repeats); kernels per step: measured (profiled request); host syncs per step: "
         "measured (torch sync debug mode, profiled request); idle and MBU: derived (kernel busy / analytic "
         "bytes over measured time, datasheet / calibrated); speed-up: derived, decode tok/s over the "
         "vendor-style row of the same mode (– where the run has none); set-up s: measured compile + capture time (outside the timed repeats).", ""]
    rows = [[r["case"], r["execution"], r["batch"], _n(r["tok_s"], "{:,.1f}"), _n(r["tpot_p50_ms"], "{:,.3f}"),
             _n(r["tpot_p90_ms"], "{:,.3f}"), _n(r["tpot_p99_ms"], "{:,.3f}"), _n(r["ttft_ms"], "{:,.2f}"),
             _n(r["kernels_per_step"], "{:,.0f}"), _n(r["syncs_per_step"], "{:,.1f}"), _pct(r["decode_idle"]),
             _pct(r["decode_cv"]), f"{_pct(r['mbu'])} / {_pct(r['mbu_cal'])}",
             _n(r.get("speedup"), "{:,.1f}x"), _n(r["setup_s"], "{:,.1f}")] for r in df.to_dict("records")]
    L += _table(["case", "execution", "batch", "tok/s", "TPOT p50 ms", "p90", "p99", "TTFT ms", "kernels/step",
                 "syncs/step", "decode idle", "decode CV", "MBU (sheet / cal)", "speed-up", "set-up s"], rows,
                ["---", "---"] + ["---:"] * 13)
    return L + ["", "Chart: `ladder.png`.", ""]


def _stage_table(st: pd.DataFrame) -> list:
    L = ["## Roofline per stage", ""]
    if not len(st):
        return L + ["_No analytic join (no measured stages or no analytic costs)._", ""]
    host_timer = (st["timer"] == "host").any()
    rows = []
    for r in st.to_dict("records"):
        util = ""
        if _f(r.get("mfu")) is not None or _f(r.get("mfu_cal")) is not None:
            util = f"MFU {_pct(r.get('mfu'))} / {_pct(r.get('mfu_cal'))}"
        elif _f(r.get("mbu")) is not None or _f(r.get("mbu_cal")) is not None:
            util = f"MBU {_pct(r.get('mbu'))} / {_pct(r.get('mbu_cal'))}"
        rows.append([r["case"], r["stage"], _spread(r["measured_ms"], r.get("measured_min_ms"), r.get("measured_max_ms")),
                     _s(r["host_ms"]) if not host_timer else "=", _s(r.get("kernel_busy_ms")),
                     _pct(r.get("idle_fraction")), _s(r["tensor_flops"], 1e9), _s(r["bytes"], 1e6), _s(r["intensity"]),
                     _s(r["achieved_tflops"]), _s(r["achieved_gbs"]), f"{_s(r['floor_ms'])} / {_s(r['floor_ms_cal'])}",
                     _eff(r), _eff(r, "efficiency_busy"), util or "–", r["bound"]])
    span = "host span ms (measured, host clock)" if host_timer else "GPU span ms (measured, CUDA events)"
    L += _table(["case", "stage", f"{span} [min–max]", "host span ms (measured)", "busy ms (measured, profiled)",
                 "idle (derived)", "tensor GFLOP (analytic)", "MB (analytic)", "FLOP/B (analytic)",
                 "TFLOP/s (analytic / measured)", "GB/s (analytic / measured)", "floor ms (derived, sheet / cal)",
                 "eff vs span (sheet / cal)", "eff vs busy (sheet / cal)", "MFU / MBU (sheet / cal)",
                 "bound (from idle)"], rows, ["---", "---"] + ["---:"] * 13 + ["---"])
    return L + ["", "Span = median of the timed repeats ([min–max] over them); busy = union of the stage's kernel "
                "intervals in the one profiled request (robust to host noise; on a CPU run the top-level CPU ops); "
                "idle = max(span - busy, 0) / span: idle from the timed repeats, busy from the profiled request. "
                "bound = `launch/host` when idle > 50%, else compute/memory by intensity vs ridge, from the idle "
                "shown. Efficiency against busy time is what the kernels achieve while they run; against the span "
                "it includes launch gaps. GPU spans on one stream can absorb the previous stage's queued work (or "
                "miss launch time spent while the GPU finished it): compare them with the host span and with busy "
                "time (the `note` column of roofline.csv flags spans that differ by more than 1.5x).", ""]


def _op_table(table: pd.DataFrame) -> list:
    L = ["## Op families per stage", ""]
    op = table[table["level"] == "op_family"] if len(table) else table
    if not len(op):
        return L + ["_No kernel capture in this run (`measure.kernels=true` adds it)._", ""]
    by_module = (op["attribution"] == "module").any()
    what = {"matmul": "GEMM/conv/attention modules incl. their own elementwise kernels",
            "kv_cache": "KV-cache update kernels (the growing cache's copies)",
            "norm": "LayerNorm / LayerNorm2d / RMSNorm modules", "rope": "rotary cos/sin tables",
            "elementwise": "container glue (residual adds, casts in decoder layers and blocks)",
            "memory/routing": "embedding, image layout, CLIP embeddings",
            "routing/indexing": "the MoE container's own kernels (argsort, gather, scatter, counts, host copy)",
            "other": "kernels outside every module (adapter glue, argmax)"}
    mapping = []
    for g, (c, f) in OP_GROUPS.items():
        fams = ", ".join(f) or ("llm_attention (KV copy bytes only)" if g == "kv_cache" else "– (no analytic work)")
        mapping.append([g, what.get(g, ""), fams, ", ".join(c) or "–"])
    L += _table(["op family", "kernels (module attribution)", "analytic families",
                 "kernel categories (runs without module attribution)"], mapping, ["---", "---", "---", "---"])
    L.append("")
    rows = []
    for r in op.to_dict("records"):
        eff = "overhead" if r["bound"] == "overhead" else _eff(r, "efficiency_busy")
        rows.append([r["case"], r["stage"], r["op_family"], _n(r["kernels"], "{:,.0f}"), _s(r["kernel_busy_ms"]),
                     r.get("kernel_categories") or "–", _s(r["tensor_flops"], 1e9), _s(r["bytes"], 1e6),
                     _s(r["floor_ms"]), eff, r["bound"]])
    L += _table(["case", "stage", "op family", "kernels (measured)", "busy ms (measured, profiled)",
                 "kernel categories (by busy time)", "tensor GFLOP (analytic)", "MB (analytic)",
                 "floor ms (derived, sheet)", "eff vs busy (sheet / cal)", "bound"], rows,
                ["---"] * 3 + ["---:"] * 2 + ["---"] + ["---:"] * 4 + ["---"])
    how = ("each kernel belongs to the innermost module open when it was launched (forward hooks in the profiled "
           "request only) and that module's analytic family; the KV cache's copy traffic (growing minus static "
           "cache) is its own row, the attention keeps the KV reads it needs" if by_module else
           "this run predates module attribution: kernels are grouped by their names (kernel categories), so "
           "unfused norms, KV-cache copies and MoE indexing land in elementwise/memory rows")
    return L + ["", f"busy ms = union of the group's kernel intervals in the profiled request; {how}. A row without "
                "analytic work is `overhead` (no efficiency).", ""]


def _charts(run: RunData) -> list:
    L = []
    for name, what in (("time_breakdown.png", "where the time goes"), ("roofline.png", "roofline")):
        if (run.path / name).is_file():
            L.append(f"![{what}]({name})")
    return (["## Charts", ""] + L + [""]) if L else []


def _top_kernels(run: RunData) -> list:
    L = ["## Top kernels per stage", ""]
    k = run.kernels
    if k is None or not len(k):
        return L + ["_No kernel capture in this run._", ""]
    k = k[k["stage"].notna()]
    by_case: dict = {}
    for (case, stage), ks in k.groupby(["case", "stage"], sort=False):
        by_case.setdefault(case, {})[stage] = ks
    for case, stages in by_case.items():
        L += [f"### {case}", ""]
        rows = []
        for stage in STAGES:
            ks = stages.get(stage)
            if ks is None or not len(ks):
                continue
            busy = busy_ms(ks)
            g = ks.groupby("name", sort=False).agg(category=("category", "first"), calls=("dur_ms", "size"),
                                                   total=("dur_ms", "sum")).sort_values("total", ascending=False)
            for name, r in g.head(TOP_KERNELS).iterrows():
                short = name if len(name) <= 80 else name[:77] + "..."
                rows.append([stage, f"`{short}`", r["category"], int(r["calls"]), f"{r['total']:,.3f}",
                             f"{1e3 * r['total'] / r['calls']:,.1f}", _pct(r["total"] / busy if busy else None)])
        L += _table(["stage", "kernel", "category", "calls", "total ms", "mean µs", "of stage busy"], rows,
                    ["---", "---", "---"] + ["---:"] * 4)
        L.append("")
    return L


def calibration_line(man: dict, p: Peaks) -> str:
    """How this run got its calibrated ceilings (the manifest's ``calibration`` entry)."""
    entry = man.get("calibration") or {}
    status = entry.get("status")
    if status == "measured":
        return f"measured by this run on first use ({_n(entry.get('seconds'), '{:.1f}')} s), cached at {entry.get('path')}"
    if status == "cached":
        return f"cached record of this device ({entry.get('measured') or 'date not recorded'}): {entry.get('path')}"
    if status:
        return f"{status}: {entry.get('reason', '')}".rstrip(": ")
    return p.cal_source or "not calibrated"


def _ceilings(p: Peaks, man: Optional[dict] = None) -> list:
    L = ["## Device ceilings", ""]
    rows = [["device (reported)", p.device_name],
            ["datasheet entry", p.spec_name or "unknown (no datasheet peak)"],
            [f"peak {p.dtype} (dense)", _n(p.peak_tflops, "{:,.1f} TFLOP/s")],
            ["memory bandwidth", _n(p.mem_bw_gbs, "{:,.0f} GB/s")],
            ["ridge (datasheet)", _n(p.ridge, "{:,.1f} FLOP/B")],
            ["calibrated GEMM", _n(p.cal_tflops, "{:,.4g} TFLOP/s") + (f" ({p.cal_dtype})" if p.cal_dtype else "")],
            ["calibrated copy", _n(p.cal_gbs, "{:,.4g} GB/s")],
            ["ridge (calibrated)", _n(p.cal_ridge, "{:,.1f} FLOP/B")],
            ["calibration", calibration_line(man or {}, p) if p.cal_source or (man or {}).get("calibration")
             else "not calibrated"],
            ["source", p.source]]
    L += _table(["", ""], rows, ["---", "---"])
    if p.notes:
        L += [""] + [f"- {n}" for n in p.notes]
    return L + [""]


def _environment(man: dict) -> list:
    L = ["## Environment", ""]
    dev = man.get("device") or {}
    ver = man.get("versions") or {}
    git = man.get("git") or {}
    model = man.get("model") or {}
    rows = [["device", ", ".join(f"{k}={v}" for k, v in dev.items() if k != "nvidia_smi") or "-"]]
    smi = dev.get("nvidia_smi")
    if smi:
        rows.append(["nvidia-smi", ", ".join(f"{k}={v}" for k, v in smi.items()) if isinstance(smi, dict) else str(smi)])
    rows += [["dtype", man.get("dtype", "-")],
             ["model", ", ".join(f"{k}={v}" for k, v in model.items() if not isinstance(v, (dict, list))) or "-"],
             ["decode loop", ", ".join(f"{k}={v}" for k, v in (model.get("loop") or {}).items()) or "-"],
             ["attention kernels used", "; ".join(f"{k}: {', '.join(v)}" for k, v in (man.get("attention") or {}).items())
              or "-"],
             ["versions", ", ".join(f"{k} {v}" for k, v in ver.items() if v)],
             ["git", f"{git.get('revision') or 'no revision'}" + (" (dirty)" if git.get("dirty") else "")
              + (f" ({git.get('reason')[:80]})" if git.get("reason") else "")],
             ["command", " ".join(map(str, man.get("argv") or []))]]
    L += _table(["", ""], rows, ["---", "---"])
    return L + [""]


def _caveats(run: RunData, p: Peaks, measured: pd.DataFrame, notes: list, head: Optional[pd.DataFrame] = None) -> list:
    man = run.manifest
    out = []
    weights = weights_of(man)
    if weights in (None, "random"):
        out.append("Random weights: decoding runs a fixed token budget (EOS ignored) and MoE routing follows random "
                   "gates, so the expert spread (and MoE weight bytes) is not the trained model's.")
    if len(measured) and (measured["timer"] == "host").any():
        out.append("Host timers: no CUDA device, stage times are host wall clock and 'kernels' are CPU ops; the "
                   "CPU has no datasheet peak, so only calibrated ceilings apply.")
    if not p.known:
        out.append(f"Unknown device {p.device_name!r}: no datasheet peak is assumed.")
    if not p.cal_source:
        out.append("Not calibrated: no measured ceilings (`python -m harness calibrate` caches them per device; a run "
                   "calibrates on first use unless hardware.calibrate=false).")
    if not len(run.kernels):
        out.append("No kernel capture: no op-family rows, no busy or idle time, so launch/host-bound stages cannot be "
                   "told apart from slow kernels.")
    if man.get("status") == "running":
        out.append(f"Partial: the run is still going (or was interrupted) after {len(man.get('cases') or [])} case(s).")
    elif man.get("status") in ("failed", "interrupted"):
        out.append(f"Partial: the run {man['status']} after {len(man.get('cases') or [])} finished case(s): "
                   f"{man.get('error')}.")
    out.append("Measured vs analytic: TFLOP/s and GB/s are the analytic FLOPs and minimum DRAM bytes divided by the "
               "measured time; they are not measured FLOP rates or traffic (ncu measures those).")
    if head is not None and len(head):
        if head["ttft_e2e_ms"].isna().all():
            out.append("TTFT excludes building the request (preprocessing) and copying it to the device: this run did "
                       "not time them.")
        else:
            out.append("TTFT excludes preprocessing and the copy to the device; *TTFT + prep + copy* includes them "
                       "(host-timed building of the request from its loaded pages, then `.to(device)`).")
    if len(run.stages) and "unattributed_kernel_ms" in run.stages:
        un = run.stages[(run.stages["stage"] == "request") & (run.stages["repeat"].astype(str) == "profiled")]
        for r in un.to_dict("records"):
            if (_f(r.get("unattributed_kernel_ms")) or 0) > 0:
                out.append(f"{r['case']}: {_f(r['unattributed_kernel_ms']):.3f} ms of kernel time outside any stage "
                           f"(attributed {_pct(r.get('attributed_fraction'))}).")
    if len(measured):
        noisy = measured[(pd.to_numeric(measured["cv"], errors="coerce") > CV_LIMIT)
                         & (pd.to_numeric(measured["time_ms"], errors="coerce") >= 1.0)
                         & (measured["stage"] != "request")]
        if len(noisy):
            out.append("Repeat CV above 2%: " + ", ".join(f"{r.case}/{r.stage} {100 * r.cv:.1f}%"
                                                           for r in noisy.itertuples()) + ".")
        steady = man.get("host_steadiness") or {}
        if steady:
            out.append("Host steadiness (fixed host work, launch-bound stages cannot vary less): "
                       + "; ".join(f"{k} the cases, {host.describe(steady[k])}" for k in ("before", "after")
                                   if k in steady)
                       + ". A stage whose idle share is high runs at the host's pace: its CV cannot drop below the "
                         "host's, whatever the harness does; its busy time (profiler) is the host-noise-robust "
                         "figure.")
        few = measured[measured["repeats"] < 3]
        if len(few):
            out.append(f"Fewer than 3 timed repeats for {', '.join(dict.fromkeys(few['case']))}: medians are weak.")
    if len(run.kernels) and not ("op_group" in run.kernels and run.kernels["op_group"].notna().any()):
        out.append("Op families: kernels grouped by name (this run predates module attribution): GEMM, convolution "
                   "and attention kernels are one `matmul` group because the analytic attention families include "
                   "their projection GEMMs; elementwise kernels have no analytic work, so their time is overhead.")
    out += notes
    out += [f"Run warning: {w}" for w in man.get("warnings") or [] if not str(w).startswith("report not written")]
    return ["## Caveats", ""] + [f"- {c}" for c in out] + [""]


__all__ = ["write_report", "render", "ceilings", "warmup_counts", "weights_of", "calibration_line"]
