"""One run lifecycle for every experiment: the run directory, its manifest status, signals, the
timing phases, the memory check, report pacing and the close of a run that ends early.

An experiment is a config (``conf/experiment/NAME.yaml``) plus at most one module, named by the
config's ``experiment_module`` (default ``harness.run``: the stage measurement). That module
defines ``EXPERIMENT``, a subclass of ``Experiment`` with three hooks: ``data`` (what the run keeps
in memory), ``measure`` (set up, then measure and keep each case) and ``write`` (the report files);
``check`` refuses, before any run directory exists, a config the experiment cannot run. The CLI's
``run`` verb calls ``run_experiment`` for every experiment alike.

``run_experiment`` in order: a ``Timeline`` (phase ``set-up``, the process's start-up before it),
the signal guard (``harness.interrupts``: SIGINT, SIGTERM and SIGHUP end the run as
``interrupted``), the ``RunDir`` (``status: running``, the launch environment) with the
experiment's ``RunData``, then ``measure`` (what it entered on ``RunContext.stack`` is closed when
it returns: worker pools, threads, progress bars), then the report (phase ``report``): the status
set to ``complete`` in memory, ``write(plot=True)``, the manifest with its ``timing`` saved last.
Any exception (a signal, an error, an out-of-memory turned into one line by
``harness.memory_check.out_of_memory``) closes the run directory (``harness.stopping.close_run``:
the kept cases stay, the report is rewritten by ``write``) and raises ``RunStopped`` with the
one stderr line and the exit code. At the end three lines go to ``progress`` (default: print):
the report's path, the timing line and the run directory.

Inside ``measure`` an experiment uses its ``RunContext``: ``where`` (the position a stopped run
names), ``timeline.enter(phase)``, ``check_memory`` (``run.memory_check``), ``begin_cases``
(the report pacer starts) and ``case_written`` (a finished case written whole: a signal waits until
its block ends; report.md rewritten between cases at most every ``REPORT_EVERY_S``).
"""
from __future__ import annotations

import contextlib
import importlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from .config import HarnessConfig, to_dict
from .errors import HarnessError
from .interrupts import SignalGuard, catch_signals
from .memory_check import check_memory, out_of_memory
from .rundir import RunData, RunDir
from .stopping import Position, close_run, log_errors_quiet
from .sweep import job_environment, start_up_s
from .timeline import Timeline

#: seconds between two rewrites of report.md while a run goes on (the final report is always written;
#: a run that stops early rewrites it too): a short run writes none in between
REPORT_EVERY_S = 60.0


class ReportPacer:
    """Whether report.md is due for a rewrite between cases: ``REPORT_EVERY_S`` after the run's cases
    started or the last rewrite (``clock``: seconds, monotonic)."""

    def __init__(self, every_s: float = REPORT_EVERY_S, clock=time.monotonic):
        self.every_s, self._clock = every_s, clock
        self._last = clock()

    def due(self) -> bool:
        return self._clock() - self._last >= self.every_s

    def written(self) -> None:
        self._last = self._clock()


def setup_seconds(model) -> dict:
    """``{"setup_s": {...}}``: the one-off set-up seconds (compile, graph capture) the adapter recorded
    so far, for a case's ``execution`` manifest entry; {} where it recorded none."""
    setup = (getattr(model, "info", None) or {}).get("setup_s") or {}
    return {"setup_s": dict(setup)} if setup else {}


@dataclass
class RunContext:
    """One run in progress, as ``run_experiment`` hands it to the experiment's hooks."""

    cfg: HarnessConfig
    rd: RunDir
    data: RunData
    experiment: "Experiment"
    where: Position = field(default_factory=lambda: Position(cases=0))
    timeline: Timeline = field(default_factory=Timeline)
    signals: SignalGuard = field(default_factory=SignalGuard)
    progress: Optional[Callable] = None      # the caller's progress function; None: the experiment's own
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)   # closed when measure returns
    reports: ReportPacer = field(default_factory=ReportPacer)

    def say(self, message: str) -> None:
        """One line of progress (the caller's function, else print)."""
        (self.progress or print)(message)

    def check_memory(self, model_cfg, device, dtype, cases: list, requests: int) -> None:
        """``harness.memory_check.check_memory`` into the manifest's ``memory`` (phase ``memory
        check``), unless ``run.memory_check=false``; call it before any page is drawn or model built."""
        if self.cfg.run.memory_check:
            self.timeline.enter("memory check")
            self.rd.update(memory=check_memory(model_cfg, device, dtype, cases, requests=requests))

    def begin_cases(self) -> None:
        """The cases start now: the first rewrite of report.md is due ``REPORT_EVERY_S`` later."""
        self.reports = ReportPacer(self.reports.every_s)

    @contextlib.contextmanager
    def case_written(self, index: int, count: int, stopped: Optional[BaseException] = None):
        """The block that writes case ``index`` of ``count`` (from 1) runs whole: a signal arriving
        inside is raised when it ends. After it, ``stopped`` (a signal that ended the case after
        some of its work, written as a partial case) is raised; else report.md is rewritten when
        due (``write(plot=False, final=False)``; not after the last case: the final report follows)
        and the position says the case's results are written."""
        with self.signals.deferred():
            yield
            if stopped is not None:
                raise stopped        # written: the run closes as interrupted (harness.stopping)
            if index < count and self.reports.due():
                self.experiment.write(self, plot=False, final=False)
                self.reports.written()
            self.where.request = "done"


class Experiment:
    """What one experiment plugs into the run lifecycle (see the module docstring); ``cfg``: the
    run's validated config. Subclass it in the experiment's module and name the class ``EXPERIMENT``."""

    def __init__(self, cfg: HarnessConfig):
        self.cfg = cfg

    @classmethod
    def check(cls, cfg: HarnessConfig, sweep: Optional[str] = None) -> None:
        """Raise ``HarnessError`` for a config this experiment cannot run (before any run directory);
        ``sweep``: None for one run, else the kind of multirun the CLI was given (``gpus``: Hydra's
        one-GPU-per-job launcher, ``other``)."""

    @classmethod
    def check_overrides(cls, cfg: HarnessConfig, overrides: list) -> None:
        """Raise ``HarnessError`` for a command-line override (``key=value`` strings, as given) that this
        experiment would not honour as written (before any run directory); the default: none."""

    @classmethod
    def execution_of(cls, cfg: HarnessConfig, execution):
        """The execution this experiment runs where the config says ``execution`` (the CLI's check of
        every case, ``setup.check_cases``, checks that one); the default: ``execution`` itself."""
        return execution

    def data(self, rd: RunDir) -> RunData:
        """What the run keeps in memory (handed to ``write`` and to the close); the default holds
        the manifest alone."""
        return RunData(rd.path, rd.manifest)

    def measure(self, run: RunContext) -> None:
        """Set up, then measure each case and write it (``run.case_written``)."""
        raise NotImplementedError

    def write(self, run: RunContext, plot: bool = True, final: bool = True) -> dict:
        """The report files from the cases kept ({name: path}; ``report`` is printed at the end);
        ``plot=False``: without charts; ``final=False``: a rewrite between cases."""
        raise NotImplementedError


FIX_MODULE = "name a module that defines EXPERIMENT, a harness.lifecycle.Experiment (e.g. harness.run), or drop it"


def experiment_class(cfg: HarnessConfig, sweep: Optional[str] = None) -> type:
    """The ``EXPERIMENT`` class of the module ``cfg.experiment_module`` names, checked against ``cfg``
    (its ``check``; ``sweep`` as there). Raises HarnessError."""
    name = cfg.experiment_module
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (name == exc.name or name.startswith(exc.name + ".")):
            raise                            # the module is there; something it imports is not
        raise HarnessError(f"experiment_module={name}: no module of that name here", FIX_MODULE) from None
    kind = getattr(module, "EXPERIMENT", None)
    if not (isinstance(kind, type) and issubclass(kind, Experiment)):
        raise HarnessError(f"experiment_module={name} defines no EXPERIMENT (a harness.lifecycle.Experiment)",
                           FIX_MODULE)
    kind.check(cfg, sweep)
    return kind


def run_experiment(cfg: HarnessConfig, run_path: Path, progress=None, experiment: Optional[type] = None) -> RunDir:
    """Run the experiment ``cfg`` names (``experiment``: this class instead) into ``run_path`` through
    the lifecycle of the module docstring; returns the complete ``RunDir``, or raises ``RunStopped``."""
    exp = (experiment or experiment_class(cfg))(cfg)
    where, timeline = Position(cases=0), Timeline(before=start_up_s())
    timeline.enter("set-up")
    with catch_signals() as signals, log_errors_quiet():
        with signals.deferred():
            rd = RunDir(run_path, to_dict(cfg), launch=job_environment())
            data = exp.data(rd)
        run = RunContext(cfg, rd, data, exp, where, timeline, signals, progress)
        try:
            with run.stack:
                exp.measure(run)
            where.at("report")
            timeline.enter("report")
            rd.complete(save=False)   # report.md says so; the manifest is saved last
            paths = exp.write(run, plot=True)
            timeline.stop()
            with signals.deferred():
                rd.update(timing=timeline.as_dict())
        except BaseException as exc:
            signals.stopping()
            timeline.stop()
            rd.manifest["timing"] = timeline.as_dict()
            raise close_run(rd, data, out_of_memory(exc, where.describe()), where,
                            lambda r, d, plot=True: exp.write(run, plot=plot)) from exc
    if paths.get("report"):
        run.say(f"[harness] report: {paths['report']}")
    run.say(f"[harness] {timeline.line()}")
    run.say(f"[harness] wrote {rd.path}")
    return rd


__all__ = ["Experiment", "RunContext", "ReportPacer", "REPORT_EVERY_S", "experiment_class", "run_experiment",
           "setup_seconds"]
