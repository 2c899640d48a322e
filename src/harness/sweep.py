"""One job per GPU for Hydra sweeps run side by side (``-m hydra/launcher=gpus``).

The ``gpus`` launcher (``conf/hydra/launcher/gpus.yaml``) is Hydra's joblib launcher (loky worker
processes) plus the :class:`GpuSlots` callback:

- in the sweep's parent process, ``on_multirun_start`` lists the GPUs the sweep may use
  (``CUDA_VISIBLE_DEVICES`` when set, else ``nvidia-smi`` indices with
  ``CUDA_DEVICE_ORDER=PCI_BUS_ID``), sets ``hydra.launcher.n_jobs`` to that count (the CPU count
  when there is no GPU; a larger ``n_jobs`` is lowered to it) and exports the list and a sweep key
  to the workers (``HARNESS_SWEEP_GPUS``, ``HARNESS_SWEEP_KEY``);
- in each worker, ``on_job_start`` calls :func:`pin_gpu_for_job` before the verb runs: the worker
  process claims one free slot once, with an exclusive ``fcntl.flock`` on
  ``<tmp>/harness-gpu-slots/<key>/slot-<i>.lock`` held for the life of the process, and sets
  ``CUDA_VISIBLE_DEVICES`` to that slot's GPU before CUDA is initialised. loky reuses a worker for
  later jobs: it keeps its slot (and its CUDA context on that GPU); a dead worker's lock is released
  by the kernel, so a replacement worker takes the freed slot. Two jobs never share a GPU.

Each job's directory gets ``sweep_job.json`` (slot, ``CUDA_VISIBLE_DEVICES``, pid, host, start and
end as Unix seconds), and the run manifest's ``launch`` block records the same environment
(:func:`job_environment`). SLURM jobs (``hydra/launcher=slurm``) are pinned by SLURM itself and the
sequential basic launcher runs one job at a time: neither is touched here.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from hydra.experimental.callback import Callback

from .errors import HarnessError

log = logging.getLogger("harness.sweep")

ENV_GPUS = "HARNESS_SWEEP_GPUS"      # comma list of the GPU ids a sweep may use ("" = no GPU: CPU jobs)
ENV_KEY = "HARNESS_SWEEP_KEY"        # one sweep's id: names its lock directory
ENV_SLOT = "HARNESS_GPU_SLOT"        # the slot (index into HARNESS_SWEEP_GPUS) this process holds
RECORD = "sweep_job.json"
LAUNCH_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", ENV_SLOT, ENV_KEY, "SLURM_JOB_ID",
              "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_JOB_PARTITION", "SLURM_JOB_NODELIST",
              "SUBMITIT_EXECUTOR")

_PIN: dict | None = None             # this process's claimed slot (set once)
_PIN_ERROR: HarnessError | None = None
_LOCK_FH = None                      # the open lock file: closing it (or exiting) frees the slot


def parse_visible_devices(value: str | None) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` as a list of ids, with CUDA's rule that enumeration stops at the
    first invalid (negative) index; None when unset, [] when set to nothing."""
    if value is None:
        return None
    out = []
    for item in (v.strip() for v in value.split(",")):
        if not item or (item.lstrip("-").isdigit() and int(item) < 0):
            break
        out.append(item)
    return out


def smi_gpu_indices(smi: str | None = None) -> list[str]:
    """GPU indices as ``nvidia-smi`` numbers them (PCI bus order); [] without nvidia-smi."""
    smi = smi or shutil.which("nvidia-smi")
    if not smi:
        return []
    res = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True,
                         timeout=30)
    if res.returncode != 0:
        raise HarnessError(f"nvidia-smi failed listing GPUs ({res.stderr.strip()[:200]})",
                           "set CUDA_VISIBLE_DEVICES to the GPUs the sweep may use, e.g. CUDA_VISIBLE_DEVICES=0,1")
    return [ln.strip() for ln in res.stdout.splitlines() if ln.strip()]


def visible_gpus(env: dict | None = None, smi: str | None = None) -> tuple[list[str], str]:
    """(GPU ids a sweep may use, where they came from), without initialising CUDA."""
    env = os.environ if env is None else env
    listed = parse_visible_devices(env.get("CUDA_VISIBLE_DEVICES"))
    if listed is not None:
        return listed, "CUDA_VISIBLE_DEVICES"
    return smi_gpu_indices(smi), "nvidia-smi"


def jobs_for(requested, slots: int) -> tuple[int, str]:
    """(n_jobs, note): one job per slot; ``requested`` <= 0 or None means 'one per slot', a larger
    request is lowered to the slot count (so two jobs never share a GPU)."""
    req = int(requested) if requested is not None else -1
    if req <= 0:
        return slots, f"n_jobs={slots} (one per slot)"
    if req > slots:
        return slots, f"n_jobs={req} lowered to {slots}: only {slots} slot(s)"
    return req, f"n_jobs={req} (of {slots} slot(s))"


def lock_dir(key: str) -> Path:
    return Path(tempfile.gettempdir()) / "harness-gpu-slots" / key


def claim_slot(gpus: list[str], locks: Path, wait_s: float = 60.0, poll_s: float = 0.2):
    """Claim the first free slot: returns (slot index, open lock file). Waits up to ``wait_s``
    seconds (a worker being replaced still holds its lock until it exits), then raises."""
    locks.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait_s
    while True:
        for i in range(len(gpus)):
            fh = open(locks / f"slot-{i}.lock", "a+")
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.close()
                continue
            fh.seek(0)
            fh.truncate()
            fh.write(f"pid {os.getpid()} host {platform.node()} gpu {gpus[i]}\n")
            fh.flush()
            return i, fh
        if time.monotonic() >= deadline:
            raise HarnessError(f"all {len(gpus)} GPU slot(s) of this sweep ({','.join(gpus)}) stayed held by other "
                               f"jobs for {wait_s:.0f} s ({locks})",
                               "run one job per GPU: leave hydra.launcher.n_jobs unset with hydra/launcher=gpus")
        time.sleep(poll_s)


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _hydra_context() -> tuple[bool, str, int | None]:
    """(multirun?, launcher target, n_jobs) of the running Hydra job; (False, "", None) outside Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
    except (ImportError, ValueError):
        return False, "", None
    launcher = hc.launcher
    return hc.mode == RunMode.MULTIRUN, str(launcher.get("_target_", "")), launcher.get("n_jobs")


def pin_gpu_for_job(output_dir=None, wait_s: float = 60.0) -> dict | None:
    """Pin this process to one GPU of the sweep; call at the very start of a verb, before torch
    touches CUDA. Returns the pin record ({slot, CUDA_VISIBLE_DEVICES, gpus, pid, host, lock}),
    or None outside a ``hydra/launcher=gpus`` sweep. Idempotent: a reused worker keeps its slot.
    Writes ``sweep_job.json`` into ``output_dir`` when given. Raises HarnessError when no slot
    is free, when CUDA was initialised before pinning, or when Hydra's plain joblib launcher would
    put several jobs on one GPU."""
    global _PIN, _LOCK_FH
    if _PIN_ERROR is not None:
        raise _PIN_ERROR
    if _PIN is None:
        key = os.environ.get(ENV_KEY)
        if not key:
            _refuse_plain_joblib()
            return None
        gpus = [g for g in os.environ.get(ENV_GPUS, "").split(",") if g]
        record = {"slot": None, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"), "gpus": gpus,
                  "pid": os.getpid(), "host": platform.node(), "lock": None, "sweep_key": key}
        if gpus:
            if _cuda_initialised():
                raise HarnessError("CUDA was initialised in this job before its GPU was pinned",
                                   "call harness.sweep.pin_gpu_for_job() before any torch.cuda call")
            slot, _LOCK_FH = claim_slot(gpus, lock_dir(key), wait_s=wait_s)
            os.environ["CUDA_VISIBLE_DEVICES"] = gpus[slot]
            os.environ[ENV_SLOT] = str(slot)
            record.update(slot=slot, CUDA_VISIBLE_DEVICES=gpus[slot], lock=_LOCK_FH.name)
        _PIN = record
    if output_dir is not None and not (Path(output_dir) / RECORD).is_file():
        write_job_record(Path(output_dir), {**_PIN, "start_unix": time.time()})
    return dict(_PIN)


def _refuse_plain_joblib() -> None:
    """Hydra's own joblib launcher (no GpuSlots callback) with several GPUs visible would start
    every worker on the same default GPU: refuse it, naming the launcher that pins."""
    multirun, target, n_jobs = _hydra_context()
    if not multirun or not target.endswith("JoblibLauncher") or n_jobs == 1:
        return
    gpus, _ = visible_gpus()
    if gpus:
        raise HarnessError("hydra/launcher=joblib runs its jobs side by side on the same GPU",
                           "use -m hydra/launcher=gpus (one job per visible GPU), or hydra.launcher.n_jobs=1")


def write_job_record(job_dir: Path, fields: dict) -> Path | None:
    """Merge ``fields`` into ``job_dir/sweep_job.json``; a failed run's directory has been renamed
    to ``<dir>-failed``: write there instead. None when neither directory exists."""
    for d in (job_dir, job_dir.with_name(job_dir.name + "-failed")):
        if d.is_dir():
            path = d / RECORD
            old = json.loads(path.read_text()) if path.is_file() else {}
            path.write_text(json.dumps({**old, **fields}, indent=2, default=str) + "\n")
            return path
    return None


_JOB = {"started": 0, "at": None}    # jobs this process started (``job_started``), the last one's start not yet read


def job_started() -> None:
    """A job (one verb under Hydra, ``harness.cli``) starts now: where its own start-up begins."""
    _JOB["started"] += 1
    _JOB["at"] = time.perf_counter()


def start_up_s() -> float | None:
    """Seconds before a run's own clock that belong to its start-up (read once per job): the
    seconds since ``job_started`` for a later job of this process (a multirun runs its jobs one
    after another in one process, or reuses a worker: an earlier job's time is not this one's),
    else the process's age (imports, Hydra, the config checks; None where it cannot be read)."""
    at, _JOB["at"] = _JOB["at"], None
    if at is not None and _JOB["started"] > 1:
        return time.perf_counter() - at
    from .timeline import process_age_s

    return process_age_s()


def job_environment() -> dict:
    """What placed this process: pid and the pinning/scheduler variables that are set (for the
    run manifest's ``launch`` block)."""
    return {"pid": os.getpid(), **{k: os.environ[k] for k in LAUNCH_ENV if k in os.environ}}


class GpuSlots(Callback):
    """Hydra callback of ``hydra/launcher=gpus``: sizes the joblib pool to the GPU slots in the
    parent and pins each worker to its own GPU (module docstring). ``wait_s``: how long a job
    waits for a free slot before failing."""

    def __init__(self, wait_s: float = 60.0):
        self.wait_s = float(wait_s)

    def on_multirun_start(self, config, **kwargs) -> None:
        from omegaconf import open_dict, read_write

        gpus, source = visible_gpus()
        if source == "nvidia-smi" and gpus:
            os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")   # index i = nvidia-smi's GPU i
        slots = len(gpus) or (os.cpu_count() or 1)
        n_jobs, note = jobs_for(config.hydra.launcher.get("n_jobs"), slots)
        with read_write(config.hydra.launcher), open_dict(config.hydra.launcher):
            config.hydra.launcher.n_jobs = n_jobs
        os.environ[ENV_GPUS] = ",".join(gpus)
        os.environ[ENV_KEY] = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        where = f"GPU(s) {','.join(gpus)} from {source}" if gpus else f"no GPU ({source}): {slots} CPU slot(s)"
        print(f"[harness] sweep: {where}; {note}", flush=True)

    def on_multirun_end(self, config, **kwargs) -> None:
        key = os.environ.get(ENV_KEY)
        if key:   # workers still alive keep their open locks; the next sweep has another key
            shutil.rmtree(lock_dir(key), ignore_errors=True)

    def on_job_start(self, config, **kwargs) -> None:
        global _PIN_ERROR
        try:
            pin = pin_gpu_for_job(config.hydra.runtime.output_dir, wait_s=self.wait_s)
        except HarnessError as exc:
            # Hydra turns callback exceptions into warnings: hide every GPU so the job cannot land on
            # a GPU another job holds; the verb's own pin_gpu_for_job() call raises the error.
            _PIN_ERROR = exc
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return
        if pin is not None:
            print(f"[harness] job {config.hydra.job.num}: pid {pin['pid']} slot {pin['slot']} "
                  f"CUDA_VISIBLE_DEVICES={pin['CUDA_VISIBLE_DEVICES']}", flush=True)

    def on_job_end(self, config, job_return=None, **kwargs) -> None:
        status = getattr(getattr(job_return, "status", None), "name", None)
        write_job_record(Path(config.hydra.runtime.output_dir), {"end_unix": time.time(), "hydra_status": status})


__all__ = ["GpuSlots", "pin_gpu_for_job", "visible_gpus", "parse_visible_devices", "claim_slot", "jobs_for",
           "job_environment", "job_started", "start_up_s", "write_job_record", "lock_dir", "RECORD"]
