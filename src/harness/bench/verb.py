"""The ``bench`` verb: refuse what cannot run here, run the target, write its run directory.

``check_bench`` runs before any run directory exists (``harness.cli``): the options a type cannot
check (``config.check_options``) and the device: a target in ``config.GPU_ONLY`` on a machine
without a CUDA device (or with ``device=cpu``) is one ``error:`` line, exit 2; the targets with a
CPU mode run there (``decode_step_sm90`` always; ``overhead`` on the CPU's own clock;
``sam_attention`` with ``bench.sam_attention.smoke=true``; ``decode_step_diag`` in Triton's
interpreter, ``TRITON_INTERPRET=1``).

``bench_from_config`` makes the run directory (``harness.rundir.RunDir``: manifest with status,
config, device, versions, git revision), hands the target a ``BenchReport`` and writes what it
collected: each table as ``<name>.csv`` (the raw values, one column per name) and all of them, in
order with the target's notes, in ``report.md`` through the column registry
(``harness.report.columns``: every header says its unit and whether it is measured, analytic or
derived). A check that failed (a kernel that did not compile, a parity beyond its tolerance) is
named in the manifest (``bench.failures``) and the report; the verb then ends with exit status 1
after the run directory is complete.
"""
from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from ..config import to_dict
from ..errors import HarnessError
from ..report.columns import COLUMNS
from ..report.columns import table as column_table
from .config import GPU_ONLY, check_options, options


@dataclass
class Table:
    """One table of a bench: ``name`` (its CSV file's stem), ``title``, the registry's column names
    and its rows (dicts keyed by those names)."""

    name: str
    title: str
    columns: list
    rows: list = field(default_factory=list)
    progress: object = None

    def add(self, **row) -> dict:
        unknown = [k for k in row if k not in self.columns]
        if unknown:
            raise KeyError(f"table {self.name}: no column {unknown} (columns: {self.columns})")
        self.rows.append(row)
        if self.progress is not None:
            cells = [f"{COLUMNS[c].header} {COLUMNS[c].cell(row)}".strip() for c in self.columns if c in row]
            self.progress(f"[bench] {self.title}: " + ", ".join(cells))
        return row


class BenchReport:
    """What a target hands back, in the order it was made: notes (lines of text) and tables; and
    the checks that failed."""

    def __init__(self, progress=print):
        self.progress = progress
        self.blocks: list = []
        self.failures: list = []

    def table(self, name: str, title: str, columns: list) -> Table:
        missing = [c for c in columns if c not in COLUMNS]
        if missing:
            raise KeyError(f"columns {missing} are not in harness.report.columns.COLUMNS")
        t = Table(name, title, list(columns), progress=self.progress)
        self.blocks.append(t)
        return t

    def note(self, text: str) -> None:
        self.blocks.append(text)
        self.progress(f"[bench] {text}")

    def fail(self, text: str) -> None:
        self.failures.append(text)
        self.note(f"FAILED {text}")

    def tables(self) -> list:
        return [b for b in self.blocks if isinstance(b, Table)]

    def markdown(self, heading: str) -> str:
        out = [f"# {heading}", ""]
        for b in self.blocks:
            if isinstance(b, Table):
                out += [f"## {b.title}", ""] + column_table(b.columns, b.rows) + [""]
            else:
                out += [b, ""]
        return "\n".join(out)


def check_bench(cfg):
    """The device the bench runs on, after refusing what cannot run here (module docstring)."""
    from ..setup import resolve_device

    bench = cfg.bench
    check_options(bench)
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        return device
    target, opts = bench.target, options(bench)
    why = ("device=cpu was given" if str(cfg.device) == "cpu" else "this machine has no CUDA device")
    if target in GPU_ONLY:
        raise HarnessError(f"bench {target} times GPU kernels and has no CPU mode; {why}",
                           "run it on a machine with an NVIDIA GPU (device=auto or device=cuda)")
    if target == "sam_attention" and not opts.smoke:
        raise HarnessError(f"bench sam_attention times GPU kernels; {why}",
                           "run it on a GPU machine, or add bench.sam_attention.smoke=true to check its plumbing on "
                           "the CPU (tiny cases, fp32: the times mean nothing)")
    if target == "decode_step_diag" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise HarnessError(f"bench decode_step_diag runs the fused step's Triton kernels; {why}",
                           "run it on a GPU machine, or on the CPU in Triton's interpreter: TRITON_INTERPRET=1 "
                           "python -m harness bench decode_step_diag model=tiny model.llm.vocab_size=1024 device=cpu")
    return device


def named_execution(cfg, name: str):
    """The ``ExecutionConfig`` of the named execution ``name`` (``conf/execution/NAME.yaml``), which the
    target's ``conf/bench/TARGET.yaml`` loads into ``cfg.executions``; a name it does not load is a
    one-line HarnessError."""
    import dataclasses

    from ..config import ExecutionConfig

    named = cfg.executions.get(name)
    if named is None:
        target = cfg.bench.target
        raise HarnessError(f"bench {target} names the execution {name!r}, which conf/bench/{target}.yaml does not "
                           f"load ({', '.join(sorted(cfg.executions)) or 'none'})",
                           f"name one of those, or add it to that file's defaults (- /execution@executions.{name}: "
                           f"{name})")
    return ExecutionConfig(**{k: v for k, v in dataclasses.asdict(named.execution).items() if v is not None})


def bench_from_config(cfg, out_dir: Path, progress=print) -> BenchReport:
    """The ``bench`` verb: ``cfg.bench.target``'s run in ``out_dir`` (module docstring). Exits with
    status 1, after the run directory is complete, when a check of the bench failed."""
    from ..rundir import RunDir
    from ..setup import device_info
    from ..sweep import job_environment

    target = cfg.bench.target
    rd = RunDir(Path(out_dir), to_dict(cfg), launch=job_environment())
    with rd.guard():
        device = check_bench(cfg)
        rd.update(device=device_info(device))
        module = importlib.import_module(f"{__package__}.{target}")
        report = BenchReport(progress)
        module.run(cfg, options(cfg.bench), device, report)
        for t in report.tables():
            rd.write_csv(f"{t.name}.csv", pd.DataFrame(t.rows, columns=t.columns))
        rd.write_text("report.md", report.markdown(f"bench {target}"))
        rd.update(bench={"target": target, "tables": [f"{t.name}.csv" for t in report.tables()],
                         "failures": report.failures})
        rd.complete()
    progress(f"[bench] wrote {rd.path}")
    if report.failures:
        print(f"failed: bench {target}: {'; '.join(report.failures)} (run directory {rd.path})", file=sys.stderr)
        sys.exit(1)
    return report


__all__ = ["Table", "BenchReport", "check_bench", "named_execution", "bench_from_config"]
