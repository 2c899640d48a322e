"""``python -m harness run +experiment=throughput throughput.gpus=N`` (or ``all``): the pipeline's
pages/s over N GPUs of one host, one process per GPU, scaling measured in one run.

The parent (this module; it never touches a GPU) runs the same CLI as child processes, each with
``CUDA_VISIBLE_DEVICES`` set to its GPU, ``throughput.gpus=1``, its share of the host's cores as
preprocessing workers (``harness.throughput.gpus.GpuPlan``) and a subfolder of the parent's run
directory as its own (``harness.throughput.scaling.child_name``):

1. phase 1 (``alone``): the first GPU alone, every batch configuration: the one-GPU figure;
2. phase 2 (``together``): all N GPUs at once over the same configurations; each configuration's
   steady window starts on every GPU at the same moment (``harness.throughput.barrier``).

Each child's output goes to ``<child>.log`` in the parent's directory and, prefixed with its name, to
the parent's stdout. The parent's report (``scaling.write_scaling``) adds the children up. A child
that fails stops the others (SIGTERM) and fails the parent with the child's one line (its exit code:
2 for a problem the user can fix, else 1). A signal to the parent is passed on to the running
children, which keep the configurations they finished; the parent then keeps what finished in both
phases. ``HARNESS_FAULT`` (``harness.faults``) applies to the parent only: children do not inherit it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..errors import HarnessError
from ..faults import ENV as FAULT_ENV
from ..interrupts import interrupted_by
from ..rundir import RunDir
from . import barrier
from .gpus import GpuPlan, child_overrides
from .scaling import PHASE_TEXT, PHASES, child_name, starts_folder

POLL_S = 0.2
STOP_WAIT_S = 120.0   # a stopped child closes its run directory (report, charts) before it exits; then SIGKILL


def child_command(overrides: list) -> list:
    """The argv of a child: this interpreter running the harness CLI's run verb."""
    return [sys.executable, "-m", "harness", "run", *overrides]


class ChildFailed(HarnessError):
    """A child process that ended with a non-zero status: its one line, with where it ran."""

    def __init__(self, child: "Child", code: int):
        line = child.last_line
        where = f"GPU {child.gpu} ({PHASE_TEXT[child.phase]})"
        if line.startswith("error: "):
            problem, _, fix = line[len("error: "):].partition("; fix: ")
            problem = f"{where}: {problem}"
        else:
            what = line or (f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}")
            problem, fix = f"{where} stopped: {what}", f"read {child.log.name} in the run directory"
        super().__init__(problem, fix or None)
        self.exit_code = code if code in (1, 2) else 1


class Child:
    """One child process: started by ``start``, its output pumped to its log and the parent's stdout."""

    def __init__(self, root: Path, phase: str, gpu: str, rank: int, parties: int, plan: GpuPlan, task: list,
                 command=child_command, say=print):
        self.phase, self.gpu, self.name = phase, gpu, child_name(phase, gpu)
        self.log = root / f"{self.name}.log"
        self.argv = command(child_overrides(task, plan.workers, root / self.name))
        env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
        env.update({"CUDA_VISIBLE_DEVICES": gpu, "PYTHONUNBUFFERED": "1", barrier.ENV_DIR: str(starts_folder(root, phase)),
                    barrier.ENV_PARTIES: str(parties), barrier.ENV_RANK: str(rank), barrier.ENV_PARENT: str(os.getpid())})
        if plan.source == "nvidia-smi":
            env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")     # GPU i = nvidia-smi's GPU i
        self.env, self.say = env, say
        self.proc = None
        self.last_line = ""
        self._pump = None

    def start(self) -> "Child":
        starts_folder(self.log.parent, self.phase).mkdir(exist_ok=True)
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)   # signals reach it through the parent only
        self._pump = threading.Thread(target=self._copy_output, daemon=True)
        self._pump.start()
        return self

    def _copy_output(self) -> None:
        with open(self.log, "w") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                text = line.rstrip("\n")
                if text.startswith(("error: ", "interrupted: ")):
                    self.last_line = text
                self.say(f"[{self.name}] {text}")

    def poll(self):
        return self.proc.poll() if self.proc else 0

    def stop(self, signum: int) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signum)

    def wait(self, timeout: float) -> None:
        if not self.proc:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._pump:
            self._pump.join(timeout=10)


def run_phase(children: list) -> None:
    """Start ``children`` and wait for all of them; the first that exits non-zero raises ``ChildFailed``."""
    for c in children:
        c.start()
    while True:
        codes = [c.poll() for c in children]
        for c, code in zip(children, codes):
            if code not in (None, 0):
                c.wait(STOP_WAIT_S)               # its last line is read
                raise ChildFailed(c, code)
        if all(code == 0 for code in codes):
            for c in children:
                c.wait(STOP_WAIT_S)
            return
        time.sleep(POLL_S)


def stop_children(children: list, signum: int) -> None:
    """Send ``signum`` to the children still running and wait for each to close its run directory."""
    for c in children:
        c.stop(signum)
    for c in children:
        c.wait(STOP_WAIT_S)


def _adopt(rd: RunDir, child_dir: Path) -> None:
    """The parent's manifest takes the first child's device, dtype, model and throughput settings."""
    path = child_dir / "manifest.json"
    man = json.loads(path.read_text()) if path.is_file() else {}
    rd.update(**{k: man.get(k) for k in ("device", "dtype", "model", "throughput")})


def measure_gpus(run, plan: GpuPlan, task: list, command=child_command) -> None:
    """The measurement of a throughput run over ``plan``'s GPUs (module docstring) inside the run
    lifecycle (``harness.lifecycle``: ``run`` is its ``RunContext``; the run directory, signals and
    the close are its); ``task``: the parent's overrides (Hydra's task overrides), ``command``: a
    child's argv from its overrides. Running children are stopped (with the signal that stopped the
    run, else SIGTERM) before what stopped it goes on."""
    rd, where, say = run.rd, run.where, run.say
    rd.update(throughput_gpus=plan.to_dict())
    where.cases = len(PHASES)
    children: list = []
    try:
        for index, phase in enumerate(PHASES, 1):
            where.at("case", phase, index)
            gpus = plan.gpus[:1] if phase == "alone" else plan.gpus
            say(f"[harness] throughput over {plan.n} GPUs: {PHASE_TEXT[phase]} (GPU {', '.join(gpus)}), "
                f"{plan.workers} worker(s) per GPU")
            children = [Child(rd.path, phase, g, rank, len(gpus), plan, task, command, say)
                        for rank, g in enumerate(gpus)]
            run_phase(children)
            if phase == "alone":
                _adopt(rd, rd.path / child_name(phase, gpus[0]))
    except BaseException as exc:
        run.signals.stopping()
        got = interrupted_by(exc)
        stop_children(children, got.signum if got else signal.SIGTERM)
        raise


__all__ = ["measure_gpus", "run_phase", "stop_children", "Child", "ChildFailed", "child_command"]
