"""The result tables of README.md's pages (``FILES``), generated from the committed evidence under runs/examples/.

    python scripts/readme_tables.py            # rewrite the generated blocks of every file in FILES
    python scripts/readme_tables.py --check    # exit 1, naming each file and block, when one differs
    python scripts/readme_tables.py --file docs/throughput.md    # only this file (repeatable)

A generated block (in a file of ``FILES``) is

    <!-- generated: KIND FOLDER [CASE ...] -->
    (written by this script)
    <!-- end generated -->

FOLDER is a run folder under runs/examples/ (the table names it underneath); KIND is
* ``ladder``: one row per case: batch, pages, tok/s, TPOT p50, TTFT, kernels and host syncs per
  decode step, decode MBU against the datasheet and the calibrated bandwidth;
* ``vision``: the named CASEs' sam / clip / projector time and MFU (calibrated);
* ``tpot``: FOLDER's run subfolders side by side: TPOT p50 over all decode steps, the first and the
  last 128 (the vendor's decode paths against a faster execution);
* ``overhead``: the request ratio of the overhead bench (FOLDER/bench_overhead.log, the output of
  ``scripts/bench_overhead.py``, now ``python -m harness bench overhead``);
* ``throughput``: FOLDER's throughput runs (subfolders with ``throughput.csv``): pages/s, decode tok/s,
  wasted decode slots, GPU busy, preprocessing capacity, experts per step and the bound per batch size.

Every figure is read by ``evidence`` (the one function that knows the run files) and printed as
the run measured or derived it. A batched case whose rows repeat pages (a batch of copies, the
workload of runs before distinct pages) is marked superseded and shows no figures: identical rows
route identically, so its tok/s and MBU describe no real batch. An efficiency above 100% is never
printed as a number: it is flagged (bytes, FLOPs or ceiling wrong).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))   # tpot_table, beside this script

BLOCK = re.compile(r"<!-- generated: (?P<spec>[^>]*?) -->\n(?P<body>.*?)<!-- end generated -->", re.S)
OVERHEAD = re.compile(r"nvtx\+events\s+request\s+ratio median\s+(?P<ratio>[\d.]+)\s+95% CI \[(?P<lo>[\d.]+), "
                      r"(?P<hi>[\d.]+)\]\s+\(rounds (?P<rounds>\d+)")
FLAGGED = "flagged: above 100%"
#: the files that hold generated blocks, from the repository root: the docs/ pages that README.md's
#: sections moved to (``--check`` and ``scripts/provenance.py`` read these; tests/test_readme.py checks
#: that no other page of README.md or docs/ holds a block)
FILES = ("docs/execution-variants.md", "docs/throughput.md", "docs/vendor-model.md")


# ------------------------------------------------------------------------------ reading

def evidence(folder: Path) -> dict:
    """What one evidence folder holds, as plain values: the one place that reads run files (adapt
    it here when they change).

    {"device": manifest's device name, "cases": {case: figures}, "tpot": {case: tpot_edges row},
    "overhead": {ratio, lo, hi, rounds} or None, "throughput": throughput.csv's rows (records) or []}.
    Figures per case: ``batch``, ``decode_tok_s``,
    ``tpot_p50_ms``, ``ttft_ms`` (headline.csv: the median request); ``launches_per_step``,
    ``syncs_per_step`` (stages.csv through ``read_observations`` and ``summarize``, any layout: the
    profiled request's decode row); ``<stage>_ms``,
    ``<stage>_mfu_cal``, ``mbu``, ``mbu_cal`` (roofline.csv: stage rows, median span over the
    repeats); ``rows``, ``distinct_pages`` (manifest.json's case entry: the page of each row).
    """
    from harness.schema.stages import read_observations
    from harness.measure.summary import summarize
    from harness.report.steps import tpot_edges

    manifest = json.loads((folder / "manifest.json").read_text())
    cases = {}
    for entry in manifest.get("cases") or []:
        names = entry.get("pages")
        rows = len(names) if isinstance(names, list) else int(entry["batch"])
        distinct = entry.get("distinct_pages", len(set(names)) if isinstance(names, list) else rows)
        cases[entry["name"]] = {"batch": int(entry["batch"]), "rows": rows, "distinct_pages": int(distinct),
                                "routing": entry.get("routing_label") or "weights"}
    if (folder / "headline.csv").exists():
        for r in pd.read_csv(folder / "headline.csv").to_dict("records"):
            cases.setdefault(r["case"], {}).update({k: r[k] for k in ("decode_tok_s", "tpot_p50_ms", "ttft_ms")})
    if (folder / "stages.csv").exists():   # the run's observations as the harness reads them (any layout)
        summary = summarize(read_observations(folder / "stages.csv"))
        prof = summary.profiled
        for case in dict.fromkeys(prof.loc[prof["stage"] == "decode", "case"]):
            cases.setdefault(case, {}).update({k: summary.profiled_value(case, "decode", k)
                                               for k in ("launches_per_step", "syncs_per_step")})
    if (folder / "roofline.csv").exists():
        rf = pd.read_csv(folder / "roofline.csv", low_memory=False)
        for r in rf[rf["level"] == "stage"].to_dict("records"):
            fig = cases.setdefault(r["case"], {})
            fig.update({f"{r['stage']}_ms": r["measured_ms"], f"{r['stage']}_mfu_cal": r["mfu_cal"]})
            if r["stage"] == "decode":
                fig.update(mbu=r["mbu"], mbu_cal=r["mbu_cal"], routing_source=r.get("routing"))
    tpot = {}
    if (folder / "steps.csv").exists():
        tpot = {r["case"]: r for r in tpot_edges(pd.read_csv(folder / "steps.csv")).to_dict("records")}
    log = folder / "bench_overhead.log"
    hit = OVERHEAD.search(log.read_text()) if log.exists() else None
    through = folder / "throughput.csv"
    return {"device": (manifest.get("device") or {}).get("name") or "no CUDA device", "manifest": manifest,
            "cases": cases, "tpot": tpot, "overhead": hit.groupdict() if hit else None,
            "throughput": pd.read_csv(through).to_dict("records") if through.exists() else []}


# ----------------------------------------------------------------------------- formatting

def number(value, fmt: str) -> str:
    """``fmt`` of a measured or derived value; '–' where the evidence has none (``report.columns.fixed``)."""
    from harness.report.columns import fixed

    return fixed(fmt)(value)


def share(fraction) -> str:
    """A fraction of a ceiling as a percentage; above 1 it is flagged, never printed as a figure."""
    if fraction is None or fraction != fraction:
        return "–"
    return FLAGGED if fraction > 1 else f"{fraction:.1%}"


def copies(fig: dict) -> bool:
    """Whether a case's rows repeat pages (a batch of copies)."""
    return fig.get("distinct_pages", fig.get("rows", 1)) < fig.get("rows", 1)


def pages_cell(fig: dict) -> str:
    from harness.layout import batch_wording

    wording = batch_wording(fig["rows"], fig["distinct_pages"])
    return f"superseded: {wording}" if copies(fig) else wording


def expected_note(fig: dict) -> str:
    """' (expected routing)' where a case's decode MBU used the uniform expectation, not measured counts."""
    from harness.report.columns import EXPECTED_ROUTING_NOTE
    from harness.roofline.join import expected_routing

    return EXPECTED_ROUTING_NOTE if expected_routing(fig.get("routing_source")) else ""


def table(header: list, align: list, rows: list) -> list:
    """The harness's one Markdown table writer (``harness.markdown.table``)."""
    from harness.markdown import table as markdown_table

    return markdown_table(header, rows, align)


def shown(folder: Path) -> str:
    """``folder`` as the pages name it: its path under the nearest ``examples`` folder above it
    (``h200-issue40-s8/ladder`` for a run folder inside an evidence folder), else its name."""
    parts = folder.parts
    if "examples" in parts[:-1]:
        at = len(parts) - 1 - parts[::-1].index("examples")
        return "/".join(parts[at + 1:])
    return folder.name


def source(folder: Path, device: str, files: str) -> str:
    return f"Evidence: `runs/examples/{shown(folder)}/` ({device}; {files})."


# ---------------------------------------------------------------------------------- blocks

def ladder(folder: Path, ev: dict, _cases: list) -> list:
    rows = []
    for case, fig in ev["cases"].items():
        if "decode_tok_s" not in fig:
            continue
        if copies(fig):
            rows.append([case, str(fig["batch"]), pages_cell(fig), fig.get("routing", "weights")] + ["–"] * 6)
            continue
        rows.append([case, str(fig["batch"]), pages_cell(fig), fig.get("routing", "weights"),
                     number(fig["decode_tok_s"], "{:,.1f}"),
                     number(fig["tpot_p50_ms"], "{:.3f}"), number(fig["ttft_ms"], "{:.2f}"),
                     number(fig.get("launches_per_step"), "{:,.0f}"), number(fig.get("syncs_per_step"), "{:.0f}"),
                     f"{share(fig.get('mbu'))} / {share(fig.get('mbu_cal'))}" + expected_note(fig)])
    out = table(["case", "batch", "pages", "routing", "tok/s (derived)", "TPOT p50 ms (measured)", "TTFT ms (measured)",
                 "kernels/step (measured)", "host syncs/step (measured)", "decode MBU sheet / cal (derived)"],
                ["---", "---:", "---", "---", "---:", "---:", "---:", "---:", "---:", "---:"], rows)
    superseded = [c for c, f in ev["cases"].items() if "decode_tok_s" in f and copies(f)]
    expected = [c for c, f in ev["cases"].items() if "decode_tok_s" in f and not copies(f) and expected_note(f)]
    note = ([f"MBU marked *expected routing* ({', '.join(expected)}): no usable per-step routing counts, so "
                    "the decode MoE bytes assume the uniform expectation; the evidence folder's README says why."]
                   if expected else [])
    note = note + ([f"Superseded rows ({', '.join(superseded)}): batches of copies, whose identical rows route onto "
                    "the same experts, so their tok/s and MBU describe no real batch; their figures stay in the "
                    "evidence folder's report only."] if superseded else [])
    what = ("headline.csv: the median request; stages.csv: the profiled request; roofline.csv; "
            "manifest.json: the pages")
    return out + ([""] + note if note else []) + ["", source(folder, ev["device"], what)]


def vision(folder: Path, ev: dict, cases: list) -> list:
    rows = []
    for case in cases:
        fig = ev["cases"][case]
        rows.append([case] + [number(fig.get(f"{s}_ms"), "{:.2f}" if s != "projector" else "{:.3f}")
                              for s in ("sam", "clip", "projector")]
                    + [share(fig.get(f"{s}_mfu_cal")) for s in ("sam", "clip")])
    out = table(["case", "sam ms (measured)", "clip ms (measured)", "projector ms (measured)",
                 "sam MFU cal (derived)", "clip MFU cal (derived)"], ["---", "---:", "---:", "---:", "---:", "---:"],
                rows)
    return out + ["", source(folder, ev["device"], "roofline.csv: median span over the timed repeats, analytic "
                                                   "FLOPs over it against the calibrated GEMM ceiling")]


def tpot(folder: Path, _ev: dict, _cases: list) -> list:
    from tpot_table import label

    rows, devices = [], []
    runs = {sub: evidence(sub) for sub in folder.iterdir() if (sub / "manifest.json").exists()}
    for sub, sev in sorted(runs.items(), key=lambda kv: str(kv[1]["manifest"].get("started"))):   # as they ran
        devices.append(sev["device"])
        edges = sorted(sev["tpot"].values(), key=lambda r: r["steps"])
        short, long = edges[0], edges[-1]
        rows.append([f"`{sub.name}`: {label(sev['manifest'])}", f"{short['steps'] + 1:,}",
                     number(short["tpot_p50_ms"], "{:.3f}"), f"{long['steps'] + 1:,}",
                     " / ".join(number(long[k], "{:.3f}") for k in ("tpot_p50_ms", "first_p50_ms", "last_p50_ms"))])
    out = table(["run", "decode tokens", "TPOT p50 ms (measured)", "decode tokens", "TPOT p50 ms (measured): all / "
                 "first 128 / last 128 steps"], ["---", "---:", "---:", "---:", "---"], rows)
    return out + ["", source(folder, ", ".join(dict.fromkeys(devices)), "each run's steps.csv: GPU ms from CUDA "
                                                                          "events, median over repeats and steps")]


def overhead(folder: Path, ev: dict, _cases: list) -> list:
    o = ev["overhead"]
    return [f"Measured on the best variant ({ev['device']}): NVTX ranges + CUDA events / bare request = {o['ratio']} "
            f"[{o['lo']}, {o['hi']}] (median of {o['rounds']} interleaved rounds, bootstrap 95% interval; "
            f"`runs/examples/{shown(folder)}/bench_overhead.log`)."]


def throughput(folder: Path, _ev: dict, _cases: list) -> list:
    """FOLDER's throughput runs (subfolders with throughput.csv), one row per run and batch size."""
    rows, devices = [], []
    runs = {sub: evidence(sub) for sub in sorted(folder.iterdir()) if (sub / "throughput.csv").exists()}
    for sub, sev in runs.items():
        devices.append(sev["device"])
        for r in sev["throughput"]:
            rows.append([f"`{sub.name}`", r["routing"], r["tokens"], str(int(r["batch"])),
                         number(r["pages_s"], "{:,.2f}"), number(r["decode_tok_s"], "{:,.0f}"),
                         share(r["wasted_decode_slots"]), share(r["gpu_busy"]), number(r["prep_pages_s"], "{:,.0f}"),
                         number(r["experts_step"], "{:,.0f}"), r["bound"]])
    out = table(["run", "routing", "decode tokens per page", "batch", "pages/s (derived)", "decode tok/s (derived)",
                 "wasted decode slots (derived)", "GPU busy (derived)", "prep capacity pages/s (derived)",
                 "experts per MoE layer per step (measured, median)", "bound (derived)"],
                ["---", "---", "---", "---:", "---:", "---:", "---:", "---:", "---:", "---:", "---"], rows)
    windows = " or ".join(sorted({f"{r['manifest'].get('throughput', {}).get('window_s'):g} s" for r in runs.values()}))
    return out + ["", source(folder, ", ".join(dict.fromkeys(devices)), f"each run's throughput.csv: a steady window "
                                                                          f"of at least {windows} per batch size")]


def scaling(folder: Path, _ev: dict, _cases: list) -> list:
    """The scaling.csv of FOLDER's run over N GPUs (``throughput.gpus``): one row per batch size."""
    sub = next(p for p in sorted(folder.iterdir()) if (p / "scaling.csv").exists())
    rows = [[r["config"], str(int(r["gpus"])), number(r["one_gpu_pages_s"], "{:,.2f}"), r["one_gpu_bound"],
             number(r["aggregate_pages_s"], "{:,.2f}"), f"{r['speedup']:.2f}x [{r['speedup_lo']:.2f}x, {r['speedup_hi']:.2f}x]",
             share(r["efficiency"]), share(r["windows_overlap"])] for r in pd.read_csv(sub / "scaling.csv").to_dict("records")]
    out = table(["config", "GPUs", "one GPU pages/s (derived)", "its bound", "aggregate pages/s (derived)",
                 "speed-up, aggregate / one GPU of the same run [95%] (derived)", "scaling efficiency (derived)",
                 "windows overlap (derived)"], ["---", "---:", "---:", "---", "---:", "---:", "---:", "---:"], rows)
    return out + ["", source(folder, json.loads((sub / "manifest.json").read_text())["device"]["name"], f"{sub.name}/scaling.csv")]


KINDS = {"ladder": ladder, "vision": vision, "tpot": tpot, "overhead": overhead, "throughput": throughput, "scaling": scaling}


def render(spec: str, examples: Path) -> str:
    """The text of block ``spec`` ("KIND FOLDER [CASE ...]")."""
    kind, folder, *cases = spec.split()
    path = examples / folder
    ev = evidence(path) if (path / "manifest.json").exists() else {}
    return "\n".join(KINDS[kind](path, ev, cases)) + "\n"


def generate(text: str, examples: Path) -> tuple:
    """(text with every generated block rewritten, [specs of the blocks that changed])."""
    changed = []

    def one(m):
        body = render(m["spec"], examples)
        if body != m["body"]:
            changed.append(m["spec"])
        return f"<!-- generated: {m['spec']} -->\n{body}<!-- end generated -->"

    return BLOCK.sub(one, text), changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a file differs from what would be written")
    ap.add_argument("--file", "--readme", dest="files", type=Path, action="append",
                    help="a file with generated blocks (repeatable; default: every file of FILES)")
    ap.add_argument("--examples", type=Path, default=ROOT / "runs" / "examples")
    args = ap.parse_args(argv)
    stale = False
    for path in args.files or [ROOT / name for name in FILES]:
        text = path.read_text()
        new, changed = generate(text, args.examples)
        stale = stale or bool(changed)
        if args.check:
            for spec in changed:
                print(f"{path}: generated block '{spec}' differs from its evidence; "
                      "run python scripts/readme_tables.py", file=sys.stderr)
            continue
        if new != text:
            path.write_text(new)
        print(f"{path}: {len(changed)} block(s) rewritten" if changed else f"{path}: up to date")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
