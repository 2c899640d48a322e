"""The throughput report section: ``throughput_section(table, manifest)`` -> Markdown lines (the
table of ``throughput.csv``, how it was measured, the bound rule, the published anchors and the
caveats). ``write_outputs`` writes ``throughput.md`` (the section), a ``report.md`` that holds it,
``throughput.png`` and ``throughput_timeline.png`` into a run directory."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import pandas as pd

from ..markdown import LEFT, RIGHT, table as md_table
from .charts import DEEPSEEK_CLAIM_PAGES_S, JINA_C16_PAGES_S
from .window import COLUMNS, SATURATED

#: figures published by others (as issue 25 and the design notes quote them), shown beside ours and
#: never mixed with them: (system, hardware, published figure)
ANCHORS = [
    ("DeepSeek-OCR, DeepSeek's own claim", "one A100-40G", f"200k pages/day, about {DEEPSEEK_CLAIM_PAGES_S} pages/s"),
    ("jina-ocr-v1 (same backbone, real pages, about 620 tokens per page)", "RTX PRO 6000",
     f"0.95 pages/s at concurrency 1; {JINA_C16_PAGES_S} pages/s at concurrency 16"),
    ("SGLang serving DeepSeek-OCR-2", "H200", "12,739 tok/s at 100 concurrent requests (text-only prompts)"),
]

#: (column, header, format) of the section's table
TABLE = [("config", "config", "{}"), ("batch", "batch", "{:d}"), ("routing", "routing", "{}"),
         ("pages_s", "pages/s (derived)", "{:,.2f}"), ("decode_tok_s", "decode tok/s (derived)", "{:,.0f}"),
         ("wasted_decode_slots", "wasted decode slots (derived)", "pct"), ("gpu_busy", "GPU busy (derived)", "pct"),
         ("prep_pages_s", "prep capacity pages/s (derived)", "{:,.1f}"), ("prep_busy", "prep busy (derived)", "pct"),
         ("h2d_gbs", "H2D GB/s (derived)", "{:,.2f}"), ("copy_busy", "copy busy (derived)", "pct"),
         ("dev_prep_ms", "device prep ms/batch", "{:,.2f}"),
         ("sam_ms", "sam ms/batch", "{:,.2f}"), ("sam_mfu", "SAM MFU (derived, datasheet)", "pct"), ("clip_ms", "clip ms/batch", "{:,.2f}"),
         ("projector_ms", "projector ms/batch", "{:,.2f}"), ("prefill_ms", "prefill ms/batch", "{:,.2f}"),
         ("decode_ms", "decode ms/batch", "{:,.1f}"), ("peak_mem_bytes", "peak mem GB (measured)", "gb"),
         ("experts_step", "experts per MoE layer per step (measured, median)", "{:,.0f}"),
         ("window_s", "window s (measured)", "{:,.1f}"), ("bound", "bound (derived)", "{}")]


def _cell(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if fmt == "pct":
        return f"{value:.1%}" if value <= 1.0 + 1e-9 else f"**{value:.1%}: over 100%, a bug (overlapping spans)**"
    if fmt == "gb":
        return f"{value / 1e9:,.2f}"
    if fmt == "{:d}":
        return f"{int(value):d}"
    return fmt.format(value)


def device_text(manifest: dict) -> str:
    """The run's device as the manifest names it (its GPU's name, else its type)."""
    device = manifest.get("device") or {}
    return device.get("name") or device.get("type", "?")


def column_lines(file: str, columns: list) -> list:
    """Markdown lines listing a table's ``columns`` ((name, unit, provenance, what it is) rows)."""
    return ["", f"Columns of `{file}` (unit; measured, derived or setting):", ""] + [
        f"- `{c}` ({u or '-'}; {p}): {d}" for c, u, p, d in columns]


def throughput_section(table: pd.DataFrame, manifest: dict) -> list:
    """Markdown lines of the section (see the module docstring)."""
    info = manifest.get("throughput") or {}
    device = device_text(manifest)
    out = ["## Throughput (sustained pipeline)", ""]
    out.append(f"Device {device}, dtype {manifest.get('dtype', '?')}; mode `{info.get('mode', '?')}`, "
               f"{info.get('pages', '?')} distinct {info.get('page_kind', 'pages')}, decode budget per page "
               f"{info.get('tokens', '?')}; {info.get('workers', '?')} preprocessing worker process(es); execution "
               f"`{info.get('execution_label', '?')}`. Each configuration: {info.get('warmup_batches', '?')} warm-up "
               f"batch(es), then a steady window of at least {info.get('window_s', '?')} s and "
               f"{info.get('window_pages', '?')} pages, synchronised at both edges. Preprocessing (read, decode, "
               "the vendor's resize/pad/normalise, request building) runs in the worker processes ahead of the "
               "device; batches are copied from pinned host buffers on their own stream while the previous batch "
               "runs (CPU: plain copies). Random weights decode every page's full budget.")
    out.append("")
    if len(table):
        out += md_table([h for _, h, _ in TABLE],
                        [[_cell(r.get(c), f) for c, _, f in TABLE] for r in table.to_dict("records")],
                        [LEFT if c in ("config", "routing", "bound") else RIGHT for c, _, _ in TABLE])
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
    out += column_lines("throughput.csv", COLUMNS)
    out += ["", "Caveats: stage spans are marks on the compute stream: in a host-bound execution they include "
            "launch gaps, so `GPU busy` is the stream's occupancy, not kernel busy time. The generate loop reads "
            "the routing counts back at the end of every batch (one synchronisation per batch). A worker's time "
            "per page leaves out handing its arrays back (about one copy of the pixels). Under "
            "`workload.routing=balanced` every batch also builds its forced-routing table on the host "
            "(`models.routing.balanced_table`: each page drawn once, then cut to the batch's positions) and "
            "copies it to the device: harness work a trained model does not do, inside the window."]
    notes = info.get("notes") or []
    if notes:
        out += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    out.append("")
    return out


def report_head(rd, finished: int) -> list:
    """report.md's first lines: the run's name, status, experiment and times; for a run that ended
    early, how many configurations (``finished``) it kept and why; its warnings."""
    man = rd.manifest
    status = man.get("status", "?")
    head = [f"# Throughput run {Path(rd.path).name}", "",
            f"Status **{status}**; experiment `{(man.get('config') or {}).get('experiment_name', '-')}`; "
            f"started {man.get('started')}, finished {man.get('finished') or '-'}.", ""]
    if status != "complete":
        head += [f"Partial: the run {status} after {finished} finished configuration(s)"
                 + (f": {man.get('error')}" if man.get("error") else "") + ".", ""]
    if man.get("warnings"):
        head += ["Warnings:", ""] + [f"- {w}" for w in man["warnings"]] + [""]
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
