"""The plan of a throughput run over several GPUs of one host (``throughput.gpus=N`` or ``all``):
which GPUs, how the host's cores are split, and what each child process is told. Pure functions
of the config and what the host shows (no torch, no CUDA: the parent never touches a GPU).

* ``gpu_count``: ``throughput.gpus`` read (``1``, a count, ``all``); a bad value is one line.
* ``plan_gpus``: the ``GpuPlan`` (GPU ids, cores, preprocessing workers per GPU), or None for one
  GPU (the plain single-process run); refused, before anything starts, on the CPU, with a device
  naming one GPU, in a sweep whose launcher gives each job one GPU (``hydra/launcher=gpus``), or when
  N exceeds the visible GPUs (a sweep's job checks its own: a SLURM job sees the GPUs SLURM gave it).
* ``workers_per_gpu``: ``throughput.workers`` when set, else the single-process rule
  (``plan.default_workers``) over the cores one GPU gets: cores // N.
* ``child_overrides``: a child's overrides: the parent's, with ``throughput.gpus=1``, its workers
  and its run directory (a subfolder of the parent's).

Units: cores and workers are counts of logical CPUs and processes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from ..errors import HarnessError
from .plan import default_workers

GPUS_FIX = "set throughput.gpus to a count of GPUs (1, 2, ...) or all"
#: overrides the parent sets for every child (the parent's own values are dropped)
CHILD_KEYS = ("throughput.gpus", "throughput.workers", "hydra.run.dir")


def gpu_count(value) -> Optional[int]:
    """``throughput.gpus`` as a count; None for ``all`` (every visible GPU)."""
    text = str(value).strip().lower()
    if text == "all":
        return None
    if not text.isdigit() or int(text) < 1:
        raise HarnessError(f"throughput.gpus={value} is not a count of GPUs", GPUS_FIX)
    return int(text)


def workers_per_gpu(workers: Optional[int], cores: int, gpus: int) -> int:
    """Preprocessing worker processes of each GPU's run: ``workers`` when set, else
    ``plan.default_workers(cores // gpus)`` (the cores one GPU gets, less its main process and
    launch thread, 1 to ``plan.MAX_DEFAULT_WORKERS``)."""
    return int(workers) if workers is not None else default_workers(cores // gpus)


def host_cores() -> int:
    """Logical CPUs this process may run on (its affinity mask, else the CPU count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True)
class GpuPlan:
    """N GPUs of one host: ``gpus`` the ids children get as ``CUDA_VISIBLE_DEVICES`` (``source``: where
    the list came from), ``cores`` the host's logical CPUs, ``workers`` preprocessing processes per GPU."""

    gpus: tuple
    source: str
    cores: int
    workers: int

    @property
    def n(self) -> int:
        return len(self.gpus)

    def to_dict(self) -> dict:
        return {"gpus": list(self.gpus), "source": self.source, "cores": self.cores, "workers_per_gpu": self.workers}


def plan_gpus(gpus_value, workers: Optional[int], device: str, visible: list, source: str, cores: int,
              sweep: Optional[str] = None) -> Optional[GpuPlan]:
    """The plan for ``throughput.gpus=gpus_value`` on a host showing the GPU ids ``visible`` (from
    ``source``) and ``cores`` CPUs; None when one GPU is asked for (``all`` with one visible GPU too).
    ``sweep``: the launcher of a ``-m`` sweep being checked before it starts (``gpus``: refused; any
    other: None, its jobs check their own GPUs), None for a single run or a sweep's job."""
    asked = gpu_count(gpus_value)
    if asked == 1:
        return None
    want = "every visible GPU" if asked is None else f"{asked} GPUs"
    if str(device) == "cpu":
        raise HarnessError(f"throughput.gpus={gpus_value} measures {want} at once, and device=cpu runs on the CPU",
                           "leave throughput.gpus unset on the CPU (one process measures it)")
    if str(device).startswith("cuda:"):
        raise HarnessError(f"throughput.gpus={gpus_value} with device={device}, which names one GPU",
                           "use device=auto or device=cuda, and CUDA_VISIBLE_DEVICES to choose the GPUs")
    if sweep == "gpus":
        raise HarnessError(f"throughput.gpus={gpus_value} in a sweep of hydra/launcher=gpus, which gives each job "
                           "one GPU", "run it without -m, or sweep with throughput.gpus=1")
    if sweep is not None:
        return None
    if not visible:
        where = "CUDA_VISIBLE_DEVICES is empty" if source == "CUDA_VISIBLE_DEVICES" else "nvidia-smi lists none"
        raise HarnessError(f"throughput.gpus={gpus_value} measures {want} at once, and this host shows no GPU "
                           f"({where}): it would run on the CPU", "leave throughput.gpus unset on the CPU")
    n = len(visible) if asked is None else asked
    if n > len(visible):
        raise HarnessError(f"throughput.gpus={gpus_value}: {n} GPUs asked for, {len(visible)} visible "
                           f"({source}: {','.join(visible)})",
                           f"set throughput.gpus={len(visible)} or less (or all), or widen CUDA_VISIBLE_DEVICES")
    if n == 1:
        return None
    return GpuPlan(tuple(visible[:n]), source, cores, workers_per_gpu(workers, cores, n))


def plan_for(cfg, sweep: Optional[str] = None) -> Optional[GpuPlan]:
    """``plan_gpus`` for a config (``harness.config.HarnessConfig`` with ``throughput`` set) on this
    host: GPUs from ``CUDA_VISIBLE_DEVICES`` or ``nvidia-smi`` (``harness.sweep.visible_gpus``)."""
    t = cfg.throughput
    if gpu_count(t.gpus) == 1:
        return None
    from ..sweep import visible_gpus

    visible, source = ([], "device=cpu") if str(cfg.device) == "cpu" else visible_gpus()
    return plan_gpus(t.gpus, t.workers, cfg.device, visible, source, host_cores(), sweep)


def child_overrides(task: list, workers: int, run_dir) -> list:
    """A child's overrides: the parent's ``task`` overrides without ``CHILD_KEYS``, then one GPU,
    ``workers`` and ``run_dir`` (quoted, as ``harness.cli.claim_output_dir`` writes it)."""
    kept = [o for o in task if o.split("=", 1)[0].lstrip("+~") not in CHILD_KEYS]
    quoted = "'" + str(run_dir).replace("'", "\\'") + "'"
    return kept + ["throughput.gpus=1", f"throughput.workers={workers}", f"hydra.run.dir={quoted}"]


__all__ = ["GpuPlan", "gpu_count", "workers_per_gpu", "host_cores", "plan_gpus", "plan_for", "child_overrides"]
