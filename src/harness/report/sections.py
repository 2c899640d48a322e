"""The report's measurement sections: headline (the median request), its stage times, roofline per
stage, op families per stage, top kernels and charts.

Each section is a function from the run (``harness.rundir.RunData``), the measured ``Summary``
(``harness.measure.summary``) and the roofline rows (``harness.roofline.table``) to Markdown lines;
its tables are records keyed by the column names of ``harness.report.columns``.
"""
from __future__ import annotations

import dataclasses

import pandas as pd

from ..floats import finite as _f
from ..measure.observations import busy_ms
from ..measure.summary import Summary
from ..roofline.join import OP_GROUPS, expected_routing
from ..rundir import RunData
from ..anatomy.stages import PREPROCESS, STAGES
from .columns import COLUMNS, fixed, pct, table
from .context import CPU_DEVICE, case_info, no_kernels_text, on_cpu

TOP_KERNELS = 5


def _pair(r, key: str) -> tuple:
    """(datasheet, calibrated) of an efficiency column of a roofline row."""
    return r.get(key), r.get(key + "_cal")


def _dominant(stages: pd.DataFrame) -> str:
    """'prefill 52.3%: compute': the stage with the longest median span, its share and bound."""
    if not len(stages) or stages["measured_ms"].isna().all():
        return ""
    d = stages.loc[stages["measured_ms"].idxmax()]
    total = stages["measured_ms"].sum()
    return f"{d['stage']} {pct(d['measured_ms'] / total if total else None)}: {d['bound']}"


def headline_section(run: RunData, st: pd.DataFrame, summary: Summary) -> list:
    """The median request of every case, then its stage times."""
    measured, head = summary.stages, summary.headline
    L = ["## Headline", ""]
    if not len(measured) or not len(head):
        return L + ["_No stage measurements yet._", ""]
    info = case_info(run.manifest)
    timer = "host" if (measured["timer"] == "host").any() else "GPU"
    cpu = on_cpu(run.manifest, measured)
    rows, stage_rows = [], []
    for h in head.to_dict("records"):
        case = h["case"]
        ci = info.get(case, {})
        s = st[st["case"] == case] if len(st) else st
        rq = s[s["stage"] == "request"]
        warm = _f(h.get("warmup"))
        rows.append({"case": case, "mode": ci.get("mode", h.get("mode") or "?"), "grid": ci.get("grid") or "-",
                     "batch": ci.get("batch", h.get("batch")),
                     "tokens": f"{ci.get('image_tokens', '?')} / {ci.get('prefill_tokens', '?')} / "
                               f"{ci.get('decode_tokens', '?')}",
                     "requests": f"{'?' if warm is None else int(warm)} + {int(h['repeats'])}",
                     "median_request": f"repeat={h['repeat']}",
                     **{k: (h.get(c), h.get(f"{c}_min"), h.get(f"{c}_max"))
                        for k, c in (("e2e", "e2e_ms"), ("ttft", "ttft_ms"), ("ttft_e2e", "ttft_e2e_ms"))},
                     "pages_s": h.get("pages_s"),
                     "tpot_pcts": tuple(h.get(c) for c in ("tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms")),
                     "tok_s_head": h.get("decode_tok_s"),
                     "request_eff": _pair(rq.iloc[0], "efficiency") if len(rq) else None,
                     "dominant": _dominant(s[s["stage"].isin(STAGES)]),
                     "bound_by": bound_by_cell(h, cpu)})
        total, e2e = _f(h.get("stage_sum_ms")), _f(h.get("e2e_ms"))
        stage_rows.append({"case": case, **{f"{x}_ms": h.get(f"{x}_ms") for x in STAGES}, "stage_sum": total,
                           "between": e2e - total if e2e is not None and total is not None else None,
                           "stage_share": total / e2e if total and e2e else None,
                           "ttft_share": h["ttft_stage_sum_ms"] / h["ttft_ms"] if _f(h.get("ttft_ms")) else None})
    L += table(["case", "mode", "grid", "batch", "tokens", "requests", "median_request", "e2e", "pages_s", "ttft",
                "ttft_e2e", "tpot_pcts", "tok_s_head", "request_eff", "dominant", "bound_by"], rows)
    device = CPU_DEVICE if cpu else "gpu"
    L += ["", f"One row per case: the **median request**, the timed repeat whose end-to-end time is the median "
          f"(with an even count the lower middle; `repeat=R` counts the timed repeats from 0, as stages.csv and the "
          f"run's progress lines do), every value from that one request; [min–max] over the timed "
          f"repeats (`headline.csv` also has the seeded bootstrap 95% interval of the median). Times: {timer} clock "
          f"({'CUDA events' if timer == 'GPU' else 'host wall clock, no CUDA'}). TTFT runs from the request's "
          "start to the first token (vision + prefill) and excludes building the request (preprocessing) and its "
          "copy to the device, which *TTFT + prep + copy* adds. TPOT percentiles and tok/s come from the same "
          "per-step distribution: tok/s = batch x 1000 / mean decode-step ms. pages/s = batch x 1000 / e2e ms "
          "(the request range alone: what a user waits for follows). *bound by*: preprocessing or copy when that "
          f"part of the median request took longer than its request range (e2e, the {'device' if cpu else 'GPU'} "
          f"time of the batch), else {device}.", ""]
    L += partial_lines(info)
    L += user_wait_section(head, cpu)
    L += ["### Stage times of the median request", ""]
    L += table(["case", *[f"{x}_ms" for x in STAGES], "stage_sum", "between", "stage_share", "ttft_share"], stage_rows)
    L += ["", "The stages are disjoint: their sum falls short of the end-to-end time by the host time between "
          "the stage ranges (GPU idle there when the host is the bottleneck), and vision + prefill ends where "
          "TTFT ends.", ""]
    pre = measured[measured["stage"] == PREPROCESS]
    if len(pre):
        L += ["Preprocess (the vendor's infer() preparing the page itself, before its first forward; in e2e and "
              "TTFT, not in the stage columns): " + ", ".join(f"{r.case} {fixed()(r.time_ms)} ms"
                                                             for r in pre.itertuples()) + ".", ""]
    return L


def partial_lines(info: dict) -> list:
    """One line per case a signal stopped before it finished (manifest ``partial``)."""
    out = []
    for name, c in info.items():
        if c.get("partial"):
            prof = {True: "", False: ", no profiled request (no kernels, busy or idle)"}.get(c.get("profiled"), "")
            out.append(f"- **Partial case {name}**: interrupted after {c.get('repeats_done')} of "
                       f"{c.get('repeats_planned')} timed repeats{prof}; its medians and spreads are over those "
                       "repeats.")
    return out + [""] if out else []


def bound_by_cell(h: dict, cpu: bool = False) -> tuple:
    """The ``bound_by`` cell of a headline row ``h``: (label, prep ms, copy ms, e2e ms), and raster
    ms where its pages are PDF pages (``columns.bound_cell``); on a CPU run (``cpu``) the label
    ``gpu`` (the request range bounds) reads ``CPU_DEVICE``."""
    label = h.get("bound_by")
    raster = _f(h.get("raster_ms"))
    return ((CPU_DEVICE if cpu and label == "gpu" else label), h.get("prep_ms"), h.get("h2d_ms"), h.get("e2e_ms")) \
        + ((raster,) if raster is not None else ())


def user_wait_section(head: pd.DataFrame, cpu: bool = False) -> list:
    """What a user waits for beside the request range: the whole generate() call, its set-up and
    collection, rasterisation (PDF pages: a column only where a case has them), preprocessing and copy
    per page, pages/s back to back (``harness.measure.summary``); ``cpu``: the run measured a CPU (the
    device's columns say ``CPU_DEVICE``, not GPU)."""
    if not len(head) or head["call_ms"].isna().all():
        return []
    rows = [{"case": h["case"], "batch": h["batch"],
             **{k: (h.get(c), h.get(f"{c}_min"), h.get(f"{c}_max"))
                for k, c in (("e2e", "e2e_ms"), ("call", "call_ms"), ("setup_collect", "setup_collect_ms"),
                             ("raster_page", "raster_page_ms"), ("prep_page", "prep_page_ms"),
                             ("h2d_page", "h2d_page_ms"))},
             "pages_s": h.get("pages_s"), "pages_s_gpu": h.get("pages_s_gpu"), "pages_s_e2e": h.get("pages_s_e2e"),
             "bound_by": bound_by_cell(h, cpu)}
            for h in head.to_dict("records")]
    device = f"{CPU_DEVICE} pages/s" if cpu else "GPU pages/s"
    columns = {"pages_s_gpu": dataclasses.replace(COLUMNS["pages_s_gpu"], header=device)} if cpu else None
    pdf = "raster_page_ms" in head and head["raster_page_ms"].notna().any()
    L = ["### What a user waits for", ""]
    L += table(["case", "batch", "e2e", "call", "setup_collect"] + (["raster_page"] if pdf else [])
               + ["prep_page", "h2d_page", "pages_s", "pages_s_gpu", "pages_s_e2e", "bound_by"], rows, columns)
    raster = (["*raster* draws each row's PDF page anew from its file (PDFium at `workload.pdf_dpi`, host clock, "
               "per page) before *prep*; it is in *TTFT + prep + copy*, in *end-to-end pages/s* and in *bound by*'s "
               "preprocessing. "] if pdf else [])
    return L + [""] + raster + [
        "The *generate() call* is the wall time of the whole call (host clock, the device synchronised "
                "before and after), the request range (e2e) inside it; *set-up + collection* = call - e2e: the "
                "call's own work before the request range opens and after it closes (caches, routing counts, "
                "collecting the tokens), in no stage column. *prep* builds the request from its loaded pages "
                f"(preprocessing, token layout), *copy* moves it to the device; both per page. *{device}*: the "
                "timed repeats' generate() calls back to back (requests already built and on the device: "
                "preprocessing and copy outside); *end-to-end pages/s*: each request built, copied and generated "
                "in turn (preprocessing and copy inside, serial: nothing overlaps); both = batch x repeats / the "
                "summed wall time of those parts, each synchronised at both ends, the harness's own work between "
                "requests left out (`manifest.json` `timed_wall_ms`: the timed run's wall time with it). The "
                "throughput experiment (`+experiment=throughput`) measures the overlapped pipeline.", ""]


def _utilisation(r) -> tuple | None:
    """('MFU', sheet, cal) for the vision stages and prefill, ('MBU', sheet, cal, expected) for decode
    (``expected``: its MoE bytes used the expected routing), else None."""
    for kind in ("mfu", "mbu"):
        if _f(r.get(kind)) is not None or _f(r.get(kind + "_cal")) is not None:
            return (kind.upper(), *_pair(r, kind)) + ((expected_routing(r.get("routing")),) if kind == "mbu" else ())
    return None


def stage_section(st: pd.DataFrame) -> list:
    """Roofline per stage: spans, busy, idle, analytic work, rates, floor, efficiencies, bound."""
    L = ["## Roofline per stage", ""]
    if not len(st):
        return L + ["_No analytic join (no measured stages or no analytic costs)._", ""]
    host_timer = (st["timer"] == "host").any()
    span = "span_host" if host_timer else "span_gpu"
    rows = [{"case": r["case"], "stage": r["stage"], span: (r["measured_ms"], r["measured_min_ms"], r["measured_max_ms"]),
             "host_span": "=" if host_timer else r["host_ms"], "busy": r["kernel_busy_ms"],
             "idle": r["idle_fraction"], "gflop": r["tensor_flops"], "mb": r["bytes"], "intensity": r["intensity"],
             "tflops": r["achieved_tflops"], "gbs": r["achieved_gbs"], "floor": (r["floor_ms"], r["floor_ms_cal"]),
             "eff_span": _pair(r, "efficiency"), "eff_busy": _pair(r, "efficiency_busy"), "util": _utilisation(r),
             "bound": r["bound"]} for r in st.to_dict("records")]
    L += table(["case", "stage", span, "host_span", "busy", "idle", "gflop", "mb", "intensity", "tflops", "gbs",
                "floor", "eff_span", "eff_busy", "util", "bound"], rows)
    return L + ["", "Span = median of the timed repeats ([min–max] over them); busy = union of the stage's kernel "
                "intervals in the one profiled request (robust to host noise; on a CPU run the top-level CPU ops); "
                "idle = max(span - busy, 0) / span: idle from the timed repeats, busy from the profiled request. "
                "bound = `launch/host` when idle > 50%, else compute/memory by intensity vs ridge, from the idle "
                "shown. Efficiency against busy time is what the kernels achieve while they run; against the span "
                "it includes launch gaps. GPU spans on one stream can absorb the previous stage's queued work (or "
                "miss launch time spent while the GPU finished it): compare them with the host span and with busy "
                "time (the `note` column of roofline.csv flags spans that differ by more than 1.5x).", ""]


OP_GROUP_TEXT = {"matmul": "GEMM/conv/attention modules incl. their own elementwise kernels",
                 "kv_cache": "KV-cache update kernels (the growing cache's copies)",
                 "norm": "LayerNorm / LayerNorm2d / RMSNorm modules", "rope": "rotary cos/sin tables",
                 "elementwise": "container glue (residual adds, casts in decoder layers and blocks)",
                 "memory/routing": "embedding, image layout, CLIP embeddings",
                 "routing/indexing": "the MoE container's own kernels (argsort, gather, scatter, counts, host copy)",
                 "other": "kernels outside every module (adapter glue, argmax)"}


def op_section(table_rows: pd.DataFrame, run: RunData | None = None) -> list:
    """Op families per stage: what each group holds, then kernel busy time against its analytic work."""
    L = ["## Op families per stage", ""]
    op = table_rows[table_rows["level"] == "op_family"] if len(table_rows) else table_rows
    if not len(op):
        return L + [f"_{no_kernels_text(run) if run is not None else 'No kernel capture in this run'}._", ""]
    by_module = (op["attribution"] == "module").any()
    mapping = [{"op_family": g, "op_kernels": OP_GROUP_TEXT.get(g, ""),
                "op_families": ", ".join(f) or ("llm_attention (KV copy bytes only)" if g == "kv_cache"
                                                else "– (no analytic work)"),
                "op_categories": ", ".join(c) or "–"} for g, (c, f) in OP_GROUPS.items()]
    L += table(["op_family", "op_kernels", "op_families", "op_categories"], mapping)
    L.append("")
    rows = [{"case": r["case"], "stage": r["stage"], "op_family": r["op_family"], "kernels": r["kernels"],
             "busy": r["kernel_busy_ms"], "kernel_categories": r.get("kernel_categories") or "–",
             "gflop": r["tensor_flops"], "mb": r["bytes"], "floor_sheet": r["floor_ms"],
             "eff_busy": "overhead" if r["bound"] == "overhead" else _pair(r, "efficiency_busy"),
             "op_bound": r["bound"]} for r in op.to_dict("records")]
    L += table(["case", "stage", "op_family", "kernels", "busy", "kernel_categories", "gflop", "mb", "floor_sheet",
                "eff_busy", "op_bound"], rows)
    how = ("each kernel belongs to the innermost module open when it was launched (forward hooks in the profiled "
           "request only) and that module's analytic family; the KV cache's copy traffic (growing minus static "
           "cache) is its own row, the attention keeps the KV reads it needs" if by_module else
           "this run predates module attribution: kernels are grouped by their names (kernel categories), so "
           "unfused norms, KV-cache copies and MoE indexing land in elementwise/memory rows")
    return L + ["", f"busy ms = union of the group's kernel intervals in the profiled request; {how}. A row without "
                "analytic work is `overhead` (no efficiency).", ""]


def charts_section(run: RunData) -> list:
    L = [f"![{what}]({name})" for name, what in (("time_breakdown.png", "where the time goes"),
                                                 ("roofline.png", "roofline")) if (run.path / name).is_file()]
    return (["## Charts", ""] + L + [""]) if L else []


def top_kernels_section(run: RunData, summary: Summary | None = None) -> list:
    """The ``TOP_KERNELS`` longest kernels (by total time) of each case x stage of the profiled request
    (with ``summary``: a line where its decode ran fewer steps than the timed requests)."""
    L = ["## Top kernels per stage", ""]
    kernels = run.kernels
    if kernels is None or not len(kernels):
        return L + [f"_{no_kernels_text(run)}._", ""]
    kernels = kernels[kernels["stage"].notna()]
    by_case: dict = {}
    for (case, stage), ks in kernels.groupby(["case", "stage"], sort=False):
        by_case.setdefault(case, {})[stage] = ks
    for case, stages in by_case.items():
        L += [f"### {case}", ""]
        scale = summary.step_scale(case) if summary is not None else 1.0   # timed decode steps / profiled
        if scale != 1.0:
            n = summary.profiled_value(case, "decode", "decode_steps")
            L += [f"Decode: the profiled request's {n:.0f} steps (the timed requests run {scale * n:.0f}; calls and "
                  "totals are those of the profiled steps).", ""]
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
                rows.append({"stage": stage, "kernel": f"`{short}`", "category": r["category"], "calls": r["calls"],
                             "total_ms": r["total"], "mean_us": 1e3 * r["total"] / r["calls"],
                             "busy_share": r["total"] / busy if busy else None})
        L += table(["stage", "kernel", "category", "calls", "total_ms", "mean_us", "busy_share"], rows)
        L.append("")
    return L


__all__ = ["headline_section", "user_wait_section", "bound_by_cell", "partial_lines", "stage_section", "op_section", "charts_section",
           "top_kernels_section", "OP_GROUP_TEXT", "TOP_KERNELS"]
