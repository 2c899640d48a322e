"""Nsight Systems: locating nsys and its importer, the profile / stats / import command lines, the
``nsys stats`` CSV parsers and the comparison of nsys's projected GPU time per stage with the
harness's own CUDA-event stage times. No profiler is needed here; ``nsys_session`` runs them.

Capture: ``nsys profile -t cuda,nvtx --sample=none --cpuctxsw=none --backtrace=none
--capture-range=nvtx --nvtx-capture=request@harness --capture-range-end=stop``: CUDA API and
kernel trace plus NVTX, no CPU sampling, no context-switch trace, no backtraces (small captures:
with CPU sampling on, 8 decode tokens once left a 2.4 GB .qdstrm and ran 35x slower). Warm-up
requests emit no NVTX ranges, so the first ``request`` range is the first timed request. With CUDA
graphs, ``--cuda-graph-trace=node`` traces the graph's kernels one by one.

``nvtx_gpu_proj_sum`` (nsys 2023.2+) names each push/pop range ``<domain>:<message>``
(``harness:decode``; ``:name`` in the default domain) and sums all instances of a name; nested
ranges are not path-qualified (``decode_step`` is its own row inside ``decode``). Projected time
of one instance: start of the first GPU operation launched inside the range to the end of the
last one. Times in the CSVs are ns; the comparison is in ms.
"""
from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
from pathlib import Path

import pandas as pd

from ..errors import HarnessError
from ..floats import finite as _f
from ..markdown import LEFT, RIGHT, table
from ..schema.stages import CALL_ALL
from ..anatomy.stages import STAGES
from .ncu import NVTX_DOMAIN

REPORTS = ("nvtx_gpu_proj_sum", "cuda_gpu_kern_sum")
COMPARE_STAGES = tuple(STAGES) + ("request",)
TOLERANCE = 0.02                 # |nsys / CUDA events - 1| within which the two agree
PROFILE_OPTIONS = ("--sample=none", "--cpuctxsw=none", "--backtrace=none")
CUDA_GRAPH_TRACE = (None, "graph", "node")
LIBS_ENV = "HARNESS_NSYS_LIBS"   # a folder with libdw.so.1 / libelf.so.1 (e.g. .nsysdeps/root)
LIBS_DEFAULT = ".nsysdeps/root"  # what scripts/fetch_nsys_libs.sh unpacks
IMPORTER_LIBS = ("libdw.so.1", "libelf.so.1")
REPO = Path(__file__).resolve().parents[3]

# Where nsys lives besides PATH, most specific first (relative to the file-system root):
# Nsight Systems installs, the CUDA toolkit, Debian's multiarch package, and the copy inside an
# Nsight Compute install (host/target-linux-x64, next to its QdstrmImporter).
NSYS_GLOBS = ("opt/nvidia/nsight-systems/*/bin/nsys", "opt/nvidia/nsight-systems/*/target-linux-x64/nsys",
              "usr/local/cuda*/nsight-systems-*/bin/nsys", "usr/local/cuda/bin/nsys", "usr/local/cuda-*/bin/nsys",
              "usr/lib/x86_64-linux-gnu/nsight-systems/target-linux-x64/nsys",
              "opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys")
# QdstrmImporter relative to an ancestor of the nsys binary's folder
IMPORTER_GLOBS = ("host-linux-x64/QdstrmImporter", "host-linux-*/QdstrmImporter", "Host-x86_64/QdstrmImporter",
                  "linux-desktop-glibc_*-x64/QdstrmImporter", "host/linux-desktop-glibc_*-x64/QdstrmImporter",
                  "nsight-systems*/host-linux-x64/QdstrmImporter")


# ------------------------------------------------------------------------------------- locating

def _version_key(path: Path) -> tuple:
    """Sort key: the numbers in a path in order (2024.10 after 2024.9)."""
    return tuple(int(n) for n in re.findall(r"\d+", str(path)))


def nsys_candidates(root: Path = Path("/"), path_env: str | None = None) -> list[Path]:
    """Every nsys found: the one on PATH first, then NSYS_GLOBS in order (newest version first)."""
    out = []
    hit = shutil.which("nsys", path=path_env)
    if hit:
        out.append(Path(hit))
    for pattern in NSYS_GLOBS:
        for p in sorted(Path(root).glob(pattern), key=_version_key, reverse=True):
            if p.is_file() and os.access(p, os.X_OK) and p not in out:
                out.append(p)
    return out


def find_nsys(root: Path = Path("/"), path_env: str | None = None) -> Path | None:
    found = nsys_candidates(root, path_env)
    return found[0] if found else None


def find_importer(nsys: Path, path_env: str | None = None) -> Path | None:
    """QdstrmImporter of the install that holds ``nsys`` (searched from its folder up four
    levels), else one on PATH."""
    start = Path(nsys).resolve().parent
    for anc in [start, *list(start.parents)[:4]]:
        for pattern in IMPORTER_GLOBS:
            hits = sorted(anc.glob(pattern), key=_version_key, reverse=True)
            if hits:
                return hits[0]
    hit = shutil.which("QdstrmImporter", path=path_env)
    return Path(hit) if hit else None


def lib_dirs(root: Path) -> list[Path]:
    """Folders under ``root`` (or ``root`` itself) holding libdw.so.1 or libelf.so.1."""
    root = Path(root)
    dirs = {p.parent for name in IMPORTER_LIBS for p in root.rglob(name)} if root.is_dir() else set()
    return sorted(dirs)


def nsys_libs(env: dict | None = None, cwd: Path | None = None) -> tuple[list[Path], str]:
    """(library folders for the importer, where they came from): ``$HARNESS_NSYS_LIBS`` when set
    (it must hold libdw.so.1 or libelf.so.1), else ``.nsysdeps/root`` in the working directory or
    the source checkout when present; ([], reason) otherwise."""
    env = os.environ if env is None else env
    given = env.get(LIBS_ENV)
    if given:
        dirs = lib_dirs(Path(given))
        if not dirs:
            raise HarnessError(f"{LIBS_ENV}={given} holds no libdw.so.1 or libelf.so.1",
                               "point it at the folder scripts/fetch_nsys_libs.sh unpacked (.nsysdeps/root)")
        return dirs, f"${LIBS_ENV}"
    for base in dict.fromkeys([Path(cwd or Path.cwd()), REPO]):
        dirs = lib_dirs(base / LIBS_DEFAULT)
        if dirs:
            return dirs, str(LIBS_DEFAULT)
    return [], f"none (no ${LIBS_ENV}, no {LIBS_DEFAULT}/)"


def with_libs(env: dict, dirs: list[Path]) -> dict:
    """A copy of ``env`` with ``dirs`` in front of LD_LIBRARY_PATH."""
    env = dict(env)
    if dirs:
        old = env.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = ":".join([*(str(d) for d in dirs), *([old] if old else [])])
    return env


def missing_libs(binary: Path, env: dict, ldd: str | None = None) -> list[str] | None:
    """Shared libraries ``binary`` cannot load under ``env`` (``ldd``'s 'not found' lines);
    None when ldd is unavailable."""
    ldd = ldd or shutil.which("ldd")
    if not ldd:
        return None
    res = subprocess.run([ldd, str(binary)], capture_output=True, text=True, env=env, timeout=60)
    return parse_ldd_missing(res.stdout + res.stderr)


def parse_ldd_missing(text: str) -> list[str]:
    return [ln.split("=>")[0].strip() for ln in text.splitlines() if "not found" in ln and "=>" in ln]


# ----------------------------------------------------------------------------------- commands

def supported_options(help_text: str | None, wanted=PROFILE_OPTIONS) -> tuple[list[str], list[str]]:
    """(options this nsys accepts, options it does not know) judged from ``nsys profile --help``;
    every option is kept when the help text is unavailable."""
    if not help_text:
        return list(wanted), []
    keep, drop = [], []
    for opt in wanted:
        (keep if opt.split("=", 1)[0] in help_text else drop).append(opt)
    return keep, drop


def nsys_command(capture: str, child: list[str], report: Path, nsys: str = "nsys", options=PROFILE_OPTIONS,
                 cuda_graph_trace: str | None = None) -> list[str]:
    """``nsys profile`` over the first ``capture`` range (``request`` or a stage) of the harness
    domain, running ``child``; the report is ``report`` + ``.nsys-rep``."""
    if cuda_graph_trace not in CUDA_GRAPH_TRACE:
        raise HarnessError(f"cuda_graph_trace={cuda_graph_trace!r} is not an nsys mode", "use graph or node (or null)")
    cmd = [str(nsys), "profile", "-t", "cuda,nvtx", *options, "--capture-range=nvtx",
           f"--nvtx-capture={capture}@{NVTX_DOMAIN}", "--capture-range-end=stop"]
    if cuda_graph_trace:
        cmd.append(f"--cuda-graph-trace={cuda_graph_trace}")
    return cmd + ["--force-overwrite=true", "-o", str(report), *child]


def stats_command(rep: Path, out_base: Path, nsys: str = "nsys") -> list[str]:
    """``nsys stats`` writing ``<out_base>_<report>.csv`` for each of REPORTS."""
    return [str(nsys), "stats", "--report", ",".join(REPORTS), "--format", "csv", "--force-export=true",
            "--output", str(out_base), str(rep)]


def import_command(importer: Path, qdstrm: Path) -> list[str]:
    """QdstrmImporter converting a left-over .qdstrm into a .nsys-rep beside it."""
    return [str(importer), "-i", str(qdstrm)]


def pick_report(folder: Path, stem: str, suffix: str) -> Path | None:
    """``<stem>.<suffix>``, or the highest-numbered ``<stem>.<n>.<suffix>``; None if absent."""
    name = re.compile(rf"{re.escape(stem)}(\.\d+)?\.{re.escape(suffix)}")
    hits = [p for p in Path(folder).glob(f"{stem}*.{suffix}") if name.fullmatch(p.name)]
    return max(hits, key=_version_key) if hits else None


# ------------------------------------------------------------------------------------ parsing

def parse_stats_csv(text: str) -> pd.DataFrame:
    """An ``nsys stats --format csv`` report (notices before the header skipped) as a DataFrame;
    columns with ``(ns)`` and the counts numeric."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if "," in ln and not ln.startswith(("NOTICE", "WARNING", "ERROR"))),
                 None)
    if start is None:
        return pd.DataFrame()
    df = pd.read_csv(io.StringIO("\n".join(lines[start:])))
    for c in df.columns:
        if "(ns)" in c or c in ("Instances", "Range Instances", "Time (%)", "Total GPU Ops", "Avg GPU Ops",
                                "Avg Range Lvl", "Avg Num Child"):
            df[c] = pd.to_numeric(df[c], errors="coerce")
    return df


def split_range(name: str) -> tuple[str | None, str]:
    """``harness:decode`` -> (``harness``, ``decode``); ``:decode`` -> ("", ``decode``) (default
    domain); ``decode`` -> (None, ``decode``) (no domain shown)."""
    name = str(name)
    if ":" in name:
        domain, text = name.split(":", 1)
        return domain, text
    return None, name


def projected_by_stage(proj: pd.DataFrame, stages=COMPARE_STAGES) -> dict:
    """{stage: {range, proj_ns, range_ns, instances, gpu_ops}} from ``nvtx_gpu_proj_sum``: push/pop
    rows of the ``harness`` domain (rows showing no domain are accepted too)."""
    need = ("Range", "Total Proj Time (ns)")
    missing = [c for c in need if c not in proj.columns]
    if missing:
        raise HarnessError(f"nvtx_gpu_proj_sum has no {', '.join(missing)} column (columns: {list(proj.columns)})",
                           "use Nsight Systems 2023.2 or later (nvtx_gpu_proj_sum report)")
    out = {}
    style = proj["Style"].astype(str).str.replace("/", "").str.lower() if "Style" in proj else None
    for i, r in proj.iterrows():
        if style is not None and style[i] != "pushpop":
            continue
        domain, text = split_range(r["Range"])
        if text not in stages or domain not in (NVTX_DOMAIN, None):
            continue
        if text in out and out[text]["domain"] == NVTX_DOMAIN:
            continue
        out[text] = {"range": str(r["Range"]), "domain": domain, "proj_ns": float(r["Total Proj Time (ns)"]),
                     "range_ns": _f(r.get("Total Range Time (ns)")), "instances": _f(r.get("Range Instances")),
                     "gpu_ops": _f(r.get("Total GPU Ops"))}
    return out



def harness_stage_ms(stages: pd.DataFrame, repeat: int = 0) -> dict:
    """{stage: (ms, timer)} of one timed repeat of the child run (its observations, all calls):
    CUDA-event ``gpu_ms``, or ``host_ms`` with timer 'host' where there were no events."""
    if stages is None or not len(stages):
        return {}
    df = stages[(stages["repeat"] == repeat) & ~stages["profiled"] & (stages["call"] == CALL_ALL)]
    out = {}
    for _, r in df.iterrows():
        gpu = _f(r.get("gpu_ms"))
        out[str(r["stage"])] = (gpu, "cuda_event") if gpu is not None else (_f(r.get("host_ms")), "host")
    return out


COMPARE_COLUMNS = ["stage", "nsys_range", "instances", "nsys_proj_ms", "nsys_range_ms", "gpu_ops", "harness_ms",
                   "timer", "ratio", "within_2pct", "note"]


def compare_stages(projected: dict, harness: dict, captured: tuple = COMPARE_STAGES) -> pd.DataFrame:
    """One row per stage (and ``request``): nsys projected GPU ms against the harness's time for
    the same request; ratio = nsys / harness; within_2pct = |ratio - 1| <= TOLERANCE (CUDA-event
    rows only)."""
    rows = []
    for stage in COMPARE_STAGES:
        p, (h_ms, timer) = projected.get(stage), harness.get(stage, (None, None))
        row = dict.fromkeys(COMPARE_COLUMNS)
        row.update(stage=stage, harness_ms=h_ms, timer=timer, note="")
        if p is not None:
            row.update(nsys_range=p["range"], instances=p["instances"], nsys_proj_ms=p["proj_ns"] / 1e6,
                       nsys_range_ms=None if p["range_ns"] is None else p["range_ns"] / 1e6, gpu_ops=p["gpu_ops"])
        if p is None:
            row["note"] = ("not in nvtx_gpu_proj_sum" if stage in captured else "outside the capture range")
        elif h_ms is None:
            row["note"] = "no such stage in the child run's stages.csv (repeat 0)"
        elif timer != "cuda_event":
            row["note"] = "harness time is a host clock (no CUDA events): not comparable"
        if p is not None and h_ms:
            row["ratio"] = row["nsys_proj_ms"] / h_ms
            if timer == "cuda_event":
                row["within_2pct"] = bool(abs(row["ratio"] - 1) <= TOLERANCE)
        rows.append(row)
    df = pd.DataFrame(rows, columns=COMPARE_COLUMNS)
    df["within_2pct"] = df["within_2pct"].astype(object)   # True / False / None (not compared)
    return df


def top_kernels(kern: pd.DataFrame, n: int = 12) -> pd.DataFrame:
    """The ``n`` kernels with the most total time from ``cuda_gpu_kern_sum``."""
    if not len(kern) or "Total Time (ns)" not in kern:
        return pd.DataFrame()
    return kern.sort_values("Total Time (ns)", ascending=False).head(n)


def render(cmp: pd.DataFrame, kern: pd.DataFrame, meta: dict) -> str:
    """report.md: the capture, the stage comparison and the top kernels."""
    def ms(v):
        return "–" if v is None or v != v else f"{v:,.3f}"

    L = [f"# Nsight Systems: {meta.get('case', '')} (capture `{meta['capture']}@{NVTX_DOMAIN}`)", "",
         f"- nsys: {meta.get('nsys_version') or 'version unknown'}; options: `{' '.join(meta.get('options', []))}`"
         + (f"; `--cuda-graph-trace={meta['cuda_graph_trace']}`" if meta.get("cuda_graph_trace") else ""),
         f"- report: `{meta['report']}`" + (f" (converted from a left-over .qdstrm by {meta['imported_by']})"
                                             if meta.get("imported_by") else ""),
         f"- captured: the first timed request (after {meta.get('warmup', 0)} untimed warm-up request(s), "
         "which emit no NVTX ranges)", ""]
    L += table(["stage", "nsys projected GPU ms", "harness ms", "timer", "nsys / harness", "within 2%", "GPU ops", "note"],
               [[r["stage"], ms(r["nsys_proj_ms"]), ms(r["harness_ms"]), r["timer"] or "–",
                 "–" if _f(r["ratio"]) is None else f"{r['ratio']:.4f}",
                 {True: "yes", False: "**no**"}.get(r["within_2pct"], "–"),
                 "–" if _f(r["gpu_ops"]) is None else f"{int(r['gpu_ops'])}", r["note"] or ""]
                for _, r in cmp.iterrows()], [LEFT, RIGHT, RIGHT, LEFT, RIGHT, LEFT, RIGHT, LEFT])
    L += ["", "nsys projected time: from the start of the first GPU operation launched inside the range to the end "
          "of the last one, summed over the range's instances (sam/clip/projector run twice in Gundam mode). "
          "Harness time: CUDA events recorded on the stream at the range's push and pop (stages.csv, repeat 0, "
          "call all), so it also holds GPU idle time before the stage's first kernel and after its last one."]
    top = top_kernels(kern)
    if len(top):
        L += ["", "## Kernels with the most GPU time (whole capture)", ""]
        L += table(["kernel", "instances", "total µs", "avg µs"],
                   [[f"`{str(r.get('Name', ''))[:90]}`", int(r.get("Instances", 0)), f"{r['Total Time (ns)'] / 1e3:,.1f}",
                     "–" if _f(r.get("Avg (ns)")) is None else f"{_f(r.get('Avg (ns)')) / 1e3:,.2f}"]
                    for _, r in top.iterrows()])
    return "\n".join(L) + "\n"
