"""The throughput report section: ``throughput_section(table, manifest)`` -> Markdown lines (the
table of ``throughput.csv``, how it was measured, the bound rule, the published anchors and the
caveats). ``write_outputs`` writes ``throughput.md`` (the section), a ``report.md`` that holds it,
``throughput.png`` and ``throughput_timeline.png`` into a run directory."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import pandas as pd

from ..markdown import LEFT, table as md_table
from ..report.columns import Column, fixed, occupancy, text
from ..report.columns import table as columns_table
from ..schema.manifest import Manifest
from ..schema.throughput import THROUGHPUT_CSV
from .charts import DEEPSEEK_CLAIM_PAGES_S, JINA_C16_PAGES_S
from .window import SATURATED

#: figures published by others (as issue 25 and the design notes quote them), shown beside ours and
#: never mixed with them: (system, hardware, published figure)
ANCHORS = [
    ("DeepSeek-OCR, DeepSeek's own claim", "one A100-40G", f"200k pages/day, about {DEEPSEEK_CLAIM_PAGES_S} pages/s"),
    ("jina-ocr-v1 (same backbone, real pages, about 620 tokens per page)", "RTX PRO 6000",
     f"0.95 pages/s at concurrency 1; {JINA_C16_PAGES_S} pages/s at concurrency 16"),
    ("SGLang serving DeepSeek-OCR-2", "H200", "12,739 tok/s at 100 concurrent requests (text-only prompts)"),
]

_F2 = fixed("{:,.2f}")
#: the section's table: throughput.csv's columns (``harness.schema.throughput``) as written in the report;
#: a busy fraction (or an MFU) above 100% is flagged as the bug it is (``occupancy``)
TABLE = {c.name: c for c in [
    Column("config", "config", align=LEFT), Column("batch", "batch", fmt=fixed("{:.0f}")),
    Column("routing", "routing", align=LEFT), Column("pages_s", "pages/s", "", "derived", fmt=_F2),
    Column("decode_tok_s", "decode tok/s", "", "derived", fmt=fixed("{:,.0f}")),
    Column("wasted_decode_slots", "wasted decode slots", "", "derived", fmt=occupancy),
    Column("gpu_busy", "GPU busy", "", "derived", fmt=occupancy),
    Column("prep_pages_s", "prep capacity pages/s", "", "derived", fmt=fixed("{:,.1f}")),
    Column("prep_busy", "prep busy", "", "derived", fmt=occupancy),
    Column("h2d_gbs", "H2D GB/s", "", "derived", fmt=_F2),
    Column("copy_busy", "copy busy", "", "derived", fmt=occupancy),
    Column("dev_prep_ms", "device prep", "ms/batch", "measured", fmt=_F2),
    Column("sam_ms", "sam", "ms/batch", "measured", fmt=_F2),
    Column("sam_mfu", "SAM MFU", "", "derived", "datasheet", fmt=occupancy),
    Column("clip_ms", "clip", "ms/batch", "measured", fmt=_F2),
    Column("clip_mfu", "CLIP MFU", "", "derived", "datasheet", fmt=occupancy),
    Column("projector_ms", "projector", "ms/batch", "measured", fmt=_F2),
    Column("prefill_ms", "prefill", "ms/batch", "measured", fmt=_F2),
    Column("prefill_mfu", "prefill MFU", "", "derived", "datasheet", fmt=occupancy),
    Column("decode_ms", "decode", "ms/batch", "measured", fmt=fixed("{:,.1f}")),
    Column("peak_mem_bytes", "peak mem", "GB", "measured", fmt=fixed("{:,.2f}", 1e9)),
    Column("experts_step", "experts per MoE layer per step", "", "measured", "median", fmt=fixed("{:,.0f}")),
    Column("window_s", "window", "s", "measured", fmt=fixed("{:,.1f}")),
    Column("bound", "bound", "", "derived", fmt=text, align=LEFT)]}


def device_text(manifest) -> str:
    """The run's device as the manifest names it (its GPU's name, else its type)."""
    m = Manifest.of(manifest)
    return m.device_name or m.device_type or "?"


def column_lines(file: str, columns: list) -> list:
    """Markdown lines listing a table's ``columns`` ((name, unit, provenance, what it is) rows)."""
    return ["", f"Columns of `{file}` (unit; measured, derived or setting):", ""] + [
        f"- `{c}` ({u or '-'}; {p}): {d}" for c, u, p, d in columns]


def throughput_section(table: pd.DataFrame, manifest) -> list:
    """Markdown lines of the section (see the module docstring); ``manifest``: the run's (a dict or a
    ``harness.schema.manifest.Manifest``)."""
    manifest = Manifest.of(manifest)
    info = manifest.throughput
    device = device_text(manifest)
    out = ["## Throughput (sustained pipeline)", ""]
    out.append(f"Device {device}, dtype {manifest.dtype or '?'}; mode `{info.get('mode', '?')}`, "
               f"{info.get('pages', '?')} distinct {info.get('page_kind', 'pages')}, decode budget per page "
               f"{info.get('tokens', '?')}; {info.get('workers', '?')} preprocessing worker process(es); execution "
               f"`{info.get('execution_label', '?')}`. Each configuration: {info.get('warmup_batches', '?')} warm-up "
               f"batch(es), then a steady window of at least {info.get('window_s', '?')} s and "
               f"{info.get('window_pages', '?')} pages, synchronised at both edges. Preprocessing (read, decode, "
               "the vendor's resize/pad/normalise, request building) runs in the worker processes ahead of the "
               "device (with `execution.preprocess=device` the workers stop at the page's 8-bit pixels, which the "
               "copy stream resizes, pads and normalises after copying them); batches are copied from pinned host "
               "buffers on their own stream while the previous batch runs (CPU: plain copies). Random weights "
               "decode every page's full budget.")
    out.append("")
    if len(table):
        out += columns_table(list(TABLE), table.to_dict("records"), TABLE)
    else:
        out.append("No configuration finished.")
    out += ["", f"**Bound**: the resource whose busy fraction of the window is highest, when it is at least "
            f"{SATURATED:.0%} (saturated): `preprocessing` (worker busy time / workers x window), `copy` (copy "
            "stream spans / window) or the device (stage spans / window), the device then named by its phase with "
            "the largest share of the stage time (`vision` = sam + clip + projector, `prefill`, `decode`); `host` "
            "when nothing is saturated (the pipeline waits on serial host work between them). "
            "`harness.throughput.window.bound` holds the rule.", ""]
    out += ["Published figures (not measured here: other hardware, weights or prompts):", ""]
    out += md_table(["system", "hardware", "published figure"], ANCHORS, [LEFT] * 3)
    out += column_lines("throughput.csv", [(f.name, f.unit, f.provenance, f.what) for f in THROUGHPUT_CSV.fields])
    out += ["", "Caveats: stage spans are marks on the compute stream: in a host-bound execution they include "
            "launch gaps, so `GPU busy` is the stream's occupancy, not kernel busy time; device preprocessing "
            "(`execution.preprocess=device`) runs on the copy stream beside it and is not in it. Each batch's "
            "routing counts are copied to pinned memory on the stream and read once the next batch is launched "
            "(no host synchronisation per batch). A worker's time per page leaves out handing its arrays back "
            "(about one copy of the pixels). Under `workload.routing=balanced` every batch assembles its "
            "forced-routing table on the device from its pages' draws (`models.routing.balanced_table`: each "
            "page drawn on the host and copied once): harness work a trained model does not do, inside the window."]
    notes = info.get("notes") or []
    if notes:
        out += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    out.append("")
    return out


def report_head(rd, finished: int) -> list:
    """report.md's first lines: the run's name, status, experiment and times; for a run that ended
    early, how many configurations (``finished``) it kept and why; its warnings."""
    man = Manifest.of(rd.manifest)
    status = man.status or "?"
    head = [f"# Throughput run {Path(rd.path).name}", "",
            f"Status **{status}**; experiment `{man.config.get('experiment_name', '-')}`; "
            f"started {man.started}, finished {man.finished or '-'}.", ""]
    if status != "complete":
        head += [f"Partial: the run {status} after {finished} finished configuration(s)"
                 + (f": {man.error}" if man.error else "") + ".", ""]
    if man.warnings:
        head += ["Warnings:", ""] + [f"- {w}" for w in man.warnings] + [""]
    return head


def write_outputs(rd, table: pd.DataFrame, timeline: Optional[list], plot: bool = True) -> dict:
    """throughput.md, report.md (status line + the section), and with ``plot`` the two charts."""
    from .charts import plot_throughput, plot_timeline

    lines = throughput_section(table, rd.manifest)
    paths = {"section": rd.write_text("throughput.md", "\n".join(lines))}
    paths["report"] = rd.write_text("report.md", "\n".join(report_head(rd, len(table)) + lines))
    if plot and len(table):
        paths["chart"] = plot_throughput(table, rd.path / "throughput.png")
        if timeline:
            paths["timeline"] = plot_timeline(timeline, rd.path / "throughput_timeline.png")
    return paths


__all__ = ["ANCHORS", "column_lines", "device_text", "throughput_section", "report_head", "write_outputs"]
