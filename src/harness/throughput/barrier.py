"""The window barrier of a run over several GPUs (``harness.throughput.hosts``): every GPU's
process starts the steady window of a configuration at the same moment, so the windows that are
added up ran at the same time. Inert (returns at once) unless the parent set ``ENV_DIR``.

The parent gives each child ``ENV_DIR`` (a folder of the parent's run directory), ``ENV_PARTIES``
(processes that meet there), ``ENV_RANK`` (this child's index) and ``ENV_PARENT`` (the parent's
pid). ``window_barrier(config)`` writes ``<config>.<rank>.json`` (``arrived_unix``) and waits until
``parties`` such files exist, then rewrites its own with ``released_unix`` (Unix seconds): the
window starts right after (``harness.throughput.scaling`` reads it to say how far the windows
overlapped). A parent that is gone (this process re-parented) or a wait over ``TIMEOUT_S`` is one
line. No torch.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

ENV_DIR, ENV_PARTIES, ENV_RANK, ENV_PARENT = ("HARNESS_BARRIER_DIR", "HARNESS_BARRIER_PARTIES", "HARNESS_BARRIER_RANK",
                                              "HARNESS_BARRIER_PARENT")
TIMEOUT_S = 1800.0   # a sibling that never arrives (the parent stops the run long before, when one fails)
POLL_S = 0.005


def record_path(folder, config: str, rank: int) -> Path:
    return Path(folder) / f"{config}.{rank}.json"


def _write(path: Path, fields: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(fields) + "\n")
    os.replace(tmp, path)


def window_barrier(config: str, env=None) -> dict | None:
    """Wait for every process of the parent's run to reach ``config``'s window (module docstring);
    returns this process's record, or None outside a run over several GPUs."""
    from ..errors import HarnessError

    env = os.environ if env is None else env
    folder = env.get(ENV_DIR)
    if not folder:
        return None
    parties, rank = int(env[ENV_PARTIES]), int(env[ENV_RANK])
    parent = int(env.get(ENV_PARENT) or 0)
    path = record_path(folder, config, rank)
    record = {"config": config, "rank": rank, "arrived_unix": time.time()}
    _write(path, record)
    deadline = time.monotonic() + TIMEOUT_S
    while len(list(Path(folder).glob(f"{config}.*.json"))) < parties:
        if parent and os.getppid() != parent:
            raise HarnessError(f"the parent run (pid {parent}) is gone while GPU rank {rank} waited at {config}'s "
                               "window", "run the multi-GPU throughput again")
        if time.monotonic() > deadline:
            raise HarnessError(f"{config}: the other GPUs' runs did not reach the window within {TIMEOUT_S:.0f} s",
                               "read the other GPUs' logs in the parent run directory")
        time.sleep(POLL_S)
    record["released_unix"] = time.time()
    _write(path, record)
    return record


def read_records(folder) -> list:
    """Every record of a barrier folder (dicts as written); [] for a missing folder."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


__all__ = ["window_barrier", "read_records", "record_path", "ENV_DIR", "ENV_PARTIES", "ENV_RANK", "ENV_PARENT"]
