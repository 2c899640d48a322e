"""The report's context sections: device ceilings, environment, caveats and files of a run.

Each section is a function from the run (``harness.rundir.RunData``, its manifest) and what the
report derived (ceilings ``Peaks``, the measured ``Summary`` stages and headline) to Markdown lines.
"""
from __future__ import annotations

from typing import Optional

import pandas as pd

from ..floats import finite as _f
from ..markdown import LEFT, table
from ..measure import host
from ..roofline.specs import Peaks
from ..rundir import RunData
from ..schema.manifest import Manifest
from ..stopping import kept_text
from .columns import fixed, pct

CV_LIMIT = 0.02


#: what a report says where a GPU run's says "GPU" / "gpu", when the run measured a CPU
CPU_DEVICE = "device: cpu (host clocks)"
#: the report's first line under its title on a CPU run
CPU_NOTE = (f"> **{CPU_DEVICE}.** This run measured a CPU with host clocks: its times say little about a GPU "
            "(no CUDA events, no GPU kernels, the host's own speed and load). Use it to check a set-up, not to judge "
            "the model's speed.")


def on_cpu(man, measured: Optional[pd.DataFrame] = None) -> bool:
    """Whether the run measured a CPU: its manifest's device type, else (an older manifest) host
    timers in its measured stages."""
    kind = Manifest.of(man).device_type
    if kind:
        return kind == "cpu"
    return measured is not None and len(measured) > 0 and "timer" in measured and (measured["timer"] == "host").all()


def model_line(man) -> str:
    """'model `tiny` (reference, 16,867,744 parameters) with random weights': the ``conf/model``
    option the model came from and its parameters (``harness.setup.model_name`` /
    ``parameter_count``, recorded in the manifest's ``model``); a run that recorded neither is
    named by its adapter."""
    man = Manifest.of(man)
    model = man.model
    adapter = model.get("adapter", man.model_config.get("name", "?"))
    name, params = model.get("model_name"), model.get("params")
    about = ", ".join(p for p in ((adapter if name and name != adapter else None),
                                  (f"{params:,} parameters" if isinstance(params, int) else None)) if p)
    return f"model `{name or adapter}`" + (f" ({about})" if about else "") + f" with {weights_of(man) or '?'} weights"


def case_info(man) -> dict:
    """{case name: its manifest entry}."""
    return Manifest.of(man).case_entries


def warmup_counts(manifest) -> dict:
    """{case: untimed warm-up requests} from the manifest's case entries (else its resolved ``measure``
    section; None where neither recorded it)."""
    man = Manifest.of(manifest)
    default = man.warmup_default
    return {c.get("name"): (len(c["warmup_ms"]) if isinstance(c.get("warmup_ms"), list) else default)
            for c in man.cases}


def weights_of(man) -> Optional[str]:
    """'random' / 'path' / 'safetensors' of the model that ran (None: not recorded): the reference
    adapter records a string, the vendor adapter a dict ({'source': 'random' | 'safetensors', ...})."""
    man = Manifest.of(man)
    w = man.model.get("weights", man.model_config.get("weights"))
    if isinstance(w, dict):
        return str(w["source"]) if w.get("source") else None
    return None if w is None else str(w)


def calibration_line(man, p: Peaks) -> str:
    """How this run got its calibrated ceilings (the manifest's ``calibration`` entry)."""
    entry = Manifest.of(man).calibration
    status = entry.get("status")
    if status == "measured":
        cached = (f"cached at {entry['path']}" if entry.get("path") else
                  entry.get("cache_error") or "not cached (the record could not be written)")
        return f"measured by this run on first use ({fixed('{:.1f}')(entry.get('seconds'))} s), {cached}"
    if status == "cached":
        return f"cached record of this device ({entry.get('measured') or 'date not recorded'}): {entry.get('path')}"
    if status:
        return f"{status}: {entry.get('reason', '')}".rstrip(": ")
    return p.cal_source or "not calibrated"


def merged_line(man) -> list:
    """'Merged from N runs on one machine: A, B (interrupted), ...' for a run ``python -m harness merge``
    wrote (its manifest's ``merged_from``, each source with its status where it did not complete); []
    for any other run."""
    sources = Manifest.of(man).merged_from
    if not sources:
        return []
    names = [f"{s.get('run')}" + (f" ({s.get('status')})" if s.get("status") != "complete" else "") for s in sources]
    return [f"Merged from {len(sources)} runs on one machine: {', '.join(names)} (`python -m harness merge`: the "
            "same device, revision, settings and calibration record; each case measured in its own run's process)."]


def _pairs(rows: list) -> list:
    """A two-column key / value table (no header text)."""
    return table(["", ""], rows, [LEFT, LEFT])


def ceilings_section(p: Peaks, man=None) -> list:
    man = Manifest.of(man)
    L = ["## Device ceilings", ""]
    rows = [["device (reported)", p.device_name],
            ["datasheet entry", p.spec_name or "unknown (no datasheet peak)"],
            [f"peak {p.dtype} (dense)", fixed("{:,.1f} TFLOP/s")(p.peak_tflops)],
            ["memory bandwidth", fixed("{:,.0f} GB/s")(p.mem_bw_gbs)],
            ["ridge (datasheet)", fixed("{:,.1f} FLOP/B")(p.ridge)],
            ["calibrated GEMM", fixed("{:,.4g} TFLOP/s")(p.cal_tflops) + (f" ({p.cal_dtype})" if p.cal_dtype else "")],
            ["calibrated copy", fixed("{:,.4g} GB/s")(p.cal_gbs)],
            ["ridge (calibrated)", fixed("{:,.1f} FLOP/B")(p.cal_ridge)],
            ["calibration", calibration_line(man, p) if p.cal_source or man.calibration
             else "not calibrated"],
            ["source", p.source]]
    L += _pairs(rows)
    if p.notes:
        L += [""] + [f"- {n}" for n in p.notes]
    return L + [""]


def environment_section(man) -> list:
    L = ["## Environment", ""]
    man = Manifest.of(man)
    dev, ver, git, model = man.device, man.versions, man.git, man.model
    rows = [["device", ", ".join(f"{k}={v}" for k, v in dev.items() if k != "nvidia_smi") or "-"]]
    smi = dev.get("nvidia_smi")
    if smi:
        rows.append(["nvidia-smi", ", ".join(f"{k}={v}" for k, v in smi.items()) if isinstance(smi, dict) else str(smi)])
    rows += [["dtype", man.dtype or "-"],
             ["model", ", ".join(f"{k}={v}" for k, v in model.items() if not isinstance(v, (dict, list))) or "-"],
             ["decode loop", ", ".join(f"{k}={v}" for k, v in man.loop.items()) or "-"],
             ["attention kernels used", "; ".join(f"{k}: {', '.join(v)}" for k, v in man.attention.items()) or "-"],
             ["versions", ", ".join(f"{k} {v}" for k, v in ver.items() if v)],
             ["git", f"{git.get('revision') or 'no revision'}" + (" (dirty)" if git.get("dirty") else "")
              + (f" ({git.get('reason')[:80]})" if git.get("reason") else "")],
             ["command", " ".join(map(str, man.argv))]]
    L += _pairs(rows)
    return L + [""]


def kernels_captured(run: RunData) -> bool:
    """Whether the run captured kernels (``measure.kernels``), whether or not kernels.csv is still beside it."""
    return Manifest.of(run.manifest).kernels_captured


def no_kernels_text(run: RunData, caveat: bool = False) -> str:
    """What a report says where it has no kernel table: the run captured none, or it did and kernels.csv
    is not in this directory (a copy without it: the busy time and kernels per step in stages.csv stay)."""
    if kernels_captured(run):
        return ("kernels.csv is not in this directory (the run captured kernels; this copy left the table out): "
                "busy, idle and kernels per step come from stages.csv; the op-family, per-module and top-kernel "
                "tables need the kernel table" + ("." if caveat else ""))
    if caveat:
        return ("No kernel capture: no op-family rows, no busy or idle time, so launch/host-bound stages cannot be "
                "told apart from slow kernels.")
    return "No kernel capture in this run (`measure.kernels=true` adds it)"


def caveats_section(run: RunData, p: Peaks, measured: pd.DataFrame, notes: list,
                    head: Optional[pd.DataFrame] = None) -> list:
    man = Manifest.of(run.manifest)
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
        out.append(no_kernels_text(run, caveat=True))
    if man.status == "running":
        out.append(f"Partial: the run is still going (or was interrupted) after {len(man.cases)} case(s).")
    elif man.status in ("failed", "interrupted"):
        kept = kept_text(len(man.cases), [c for c in man.cases if c.get("partial")])
        out.append(f"Partial: the run {man.status} after {kept}: {man.error}.")
    out.append("Measured vs analytic: TFLOP/s and GB/s are the analytic FLOPs and minimum DRAM bytes divided by the "
               "measured time; they are not measured FLOP rates or traffic (ncu measures those).")
    if head is not None and len(head):
        if head["ttft_e2e_ms"].isna().all():
            out.append("TTFT excludes building the request (preprocessing) and copying it to the device: this run did "
                       "not time them.")
        else:
            out.append("TTFT excludes preprocessing and the copy to the device; *TTFT + prep + copy* includes them "
                       "(host-timed building of the request from its loaded pages, then `.to(device)`).")
    if len(measured):
        for r in measured[measured["stage"] == "request"].to_dict("records"):
            if (_f(r.get("unattributed_kernel_ms")) or 0) > 0:
                out.append(f"{r['case']}: {_f(r['unattributed_kernel_ms']):.3f} ms of kernel time outside any stage "
                           f"(attributed {pct(r.get('attributed_fraction'))}).")
        noisy = measured[(measured["cv"] > CV_LIMIT) & (measured["time_ms"] >= 1.0) & (measured["stage"] != "request")]
        if len(noisy):
            out.append("Repeat CV above 2%: " + ", ".join(f"{r.case}/{r.stage} {100 * r.cv:.1f}%"
                                                           for r in noisy.itertuples()) + ".")
        steady = man.host_steadiness
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
    out += [f"Run warning: {w}" for w in man.warnings if not str(w).startswith("report not written")]
    return ["## Caveats", ""] + [f"- {c}" for c in out] + [""]


def files_section(run: RunData) -> list:
    L = ["## Files", ""]
    if not run.path.is_dir():
        return L + [""]
    files = sorted({p.name for p in run.path.iterdir() if p.is_file() and not p.name.endswith(".tmp")
                    and not p.name.startswith(".")} | {"report.md"})   # the report lists itself before it exists
    L += [f"- `{f}`" for f in files]
    traces = sorted((run.path / "traces").glob("*/trace.json.gz")) if (run.path / "traces").is_dir() else []
    L += [f"- `{t.relative_to(run.path)}` ({t.stat().st_size / 1e6:,.1f} MB: Chrome/Perfetto trace of the profiled "
          "request)" for t in traces]
    return L + [""]


__all__ = ["CPU_DEVICE", "CPU_NOTE", "on_cpu", "model_line", "case_info", "warmup_counts", "weights_of", "calibration_line", "merged_line", "ceilings_section",
           "environment_section", "caveats_section", "files_section", "CV_LIMIT"]
