"""Sweeps on Hydra launchers, on the CPU: GPU pinning with fake GPU lists, the ``gpus`` launcher
(joblib) running two tiny jobs side by side, ``summarize`` over that sweep, and the SLURM config
path through submitit's local executor (no cluster)."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from harness import sweep
from harness.errors import HarnessError

pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="needs the sweep extra (hydra-joblib-launcher)")

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model=tiny", "workload.mode={name: t, base_size: 128, image_size: 64, crop: true}", "measure.repeats=1",
        "measure.warmup=0", "device=cpu"]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", sweep.ENV_KEY, sweep.ENV_GPUS)}
    env["PYTHONPATH"] = f"{ROOT / 'src'}:{env.get('PYTHONPATH', '')}"
    env.update(extra)
    return env


def _harness(args, cwd, env, timeout=240):
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


# ------------------------------------------------------------------------------ pinning logic

def test_visible_devices_follow_cudas_rules():
    assert sweep.parse_visible_devices(None) is None
    assert sweep.parse_visible_devices("") == []
    assert sweep.parse_visible_devices("0,1") == ["0", "1"]
    assert sweep.parse_visible_devices("2, 3,-1,4") == ["2", "3"]           # enumeration stops at -1
    assert sweep.parse_visible_devices("GPU-aa,GPU-bb") == ["GPU-aa", "GPU-bb"]
    assert sweep.visible_gpus({"CUDA_VISIBLE_DEVICES": "1,3"}) == (["1", "3"], "CUDA_VISIBLE_DEVICES")


def test_one_job_per_slot():
    assert sweep.jobs_for(-1, 4) == (4, "n_jobs=4 (one per slot)")
    assert sweep.jobs_for(None, 2)[0] == 2
    assert sweep.jobs_for(8, 2)[0] == 2                                       # never two on one GPU
    assert sweep.jobs_for(1, 2)[0] == 1


def _claim_and_hold(gpus, locks, release, queue):
    """Claim a slot (waiting at most 0.5 s for one), report it, hold it until ``release`` is set."""
    try:
        slot, _fh = sweep.claim_slot(gpus, Path(locks), wait_s=0.5, poll_s=0.05)
        queue.put(("slot", slot, os.getpid()))
        release.wait()
    except HarnessError as exc:
        queue.put(("error", str(exc), os.getpid()))


def test_slots_are_exclusive_across_processes_and_freed_on_exit(tmp_path):
    """Three processes ask for two slots; the holders keep theirs until the third has given up (an
    event, not a sleep: the outcome does not depend on how fast the processes start)."""
    ctx = mp.get_context("spawn")
    q, release = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_claim_and_hold, args=(["0", "1"], tmp_path, release, q)) for _ in range(3)]
    for p in procs:
        p.start()
    got = [q.get(timeout=120) for _ in procs]      # the two holders, then the one that waited and gave up
    release.set()
    for p in procs:
        p.join(timeout=60)
    slots = sorted(g[1] for g in got if g[0] == "slot")
    errors = [g[1] for g in got if g[0] == "error"]
    assert slots == [0, 1] and len(errors) == 1 and "stayed held" in errors[0]
    done = ctx.Event()
    done.set()
    p = ctx.Process(target=_claim_and_hold, args=(["0", "1"], tmp_path, done, q))   # the holders have exited
    p.start()
    assert q.get(timeout=120)[0] == "slot"
    p.join(timeout=60)


def test_pin_is_once_per_process_and_sets_cuda_visible_devices(tmp_path):
    code = ("import json, os, sys; from harness.sweep import pin_gpu_for_job\n"
            "a = pin_gpu_for_job(sys.argv[1]); b = pin_gpu_for_job()\n"
            "print(json.dumps([a, b, os.environ['CUDA_VISIBLE_DEVICES'], os.environ['HARNESS_GPU_SLOT']]))")
    key = f"test-{uuid.uuid4().hex[:8]}"
    env = _env(HARNESS_SWEEP_GPUS="4,5", HARNESS_SWEEP_KEY=key, CUDA_VISIBLE_DEVICES="4,5")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    a, b, cvd, slot = json.loads(out.stdout)
    assert a == b and a["slot"] == 0 and cvd == "4" and slot == "0" and a["gpus"] == ["4", "5"]
    assert json.loads((tmp_path / sweep.RECORD).read_text())["CUDA_VISIBLE_DEVICES"] == "4"
    code = "from harness.sweep import pin_gpu_for_job; print(pin_gpu_for_job())"
    outside = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert outside.stdout.strip() == "None"                                  # not in a gpus sweep: untouched


def test_multirun_start_sizes_the_pool_to_the_gpus(monkeypatch):
    for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", sweep.ENV_GPUS, sweep.ENV_KEY):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    cb = sweep.GpuSlots()
    for requested, expect in ((-1, 3), (8, 3), (2, 2)):
        cfg = OmegaConf.create({"hydra": {"launcher": {"n_jobs": requested}}})
        OmegaConf.set_readonly(cfg.hydra, True)
        cb.on_multirun_start(cfg)
        assert cfg.hydra.launcher.n_jobs == expect
    assert os.environ[sweep.ENV_GPUS] == "0,1,2" and os.environ[sweep.ENV_KEY]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    cfg = OmegaConf.create({"hydra": {"launcher": {"n_jobs": -1}}})
    cb.on_multirun_start(cfg)
    assert cfg.hydra.launcher.n_jobs == (os.cpu_count() or 1) and os.environ[sweep.ENV_GPUS] == ""


def test_plain_joblib_launcher_with_gpus_is_refused(monkeypatch):
    monkeypatch.delenv(sweep.ENV_KEY, raising=False)
    monkeypatch.setattr(sweep, "_hydra_context", lambda: (True, "hydra_plugins.x.JoblibLauncher", -1))
    monkeypatch.setattr(sweep, "visible_gpus", lambda: (["0", "1"], "nvidia-smi"))
    with pytest.raises(HarnessError, match="hydra/launcher=gpus"):
        sweep.pin_gpu_for_job()
    monkeypatch.setattr(sweep, "visible_gpus", lambda: ([], "nvidia-smi"))
    assert sweep.pin_gpu_for_job() is None                                    # CPU-only: nothing to share


# ----------------------------------------------------------------------- the gpus launcher

def _sweep(root: Path, overrides: list, env: dict) -> tuple:
    """(root, the finished process) of ``python -m harness run -m ...`` into ``root``, from ``root``."""
    return root, _harness(["run", "-m", *overrides, f"run.root={root}"], root, env)


def start_runs(tmp_path_factory, submit) -> dict:
    """Both sweeps, started with the session's background runs (tests/conftest.py): two tiny jobs on
    hydra/launcher=gpus with two fake GPUs (CUDA_VISIBLE_DEVICES=0,1), and one job through submitit's
    local executor (where hydra-submitit-launcher is installed); id -> Future[(root, process)]."""
    import importlib.util

    futures = {"gpus": submit(_sweep, tmp_path_factory.mktemp("sweep"),
                              ["hydra/launcher=gpus", *TINY, "workload.decode_tokens=8,12"],
                              _env(CUDA_VISIBLE_DEVICES="0,1"))}
    if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher"):
        futures["slurm-local"] = submit(_sweep, tmp_path_factory.mktemp("slurm-local"),
                                        ["hydra/launcher=slurm_local", *TINY, "workload.decode_tokens=4"], _env())
    return futures


@pytest.fixture(scope="module")
def joblib_sweep(runs):
    """Two tiny jobs on hydra/launcher=gpus with two fake GPUs (CUDA_VISIBLE_DEVICES=0,1)."""
    root, proc = runs["gpus"].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    return next(root.glob("multirun-*")), proc


def test_gpus_launcher_runs_two_jobs_at_once_each_on_its_own_gpu(joblib_sweep):
    sweep_dir, proc = joblib_sweep
    assert "sweep: GPU(s) 0,1 from CUDA_VISIBLE_DEVICES; n_jobs=2" in proc.stdout
    jobs = [json.loads((sweep_dir / n / sweep.RECORD).read_text()) for n in ("0", "1")]
    mans = [json.loads((sweep_dir / n / "manifest.json").read_text()) for n in ("0", "1")]
    assert [m["status"] for m in mans] == ["complete", "complete"]
    assert sorted(j["CUDA_VISIBLE_DEVICES"] for j in jobs) == ["0", "1"]
    assert sorted(m["launch"]["CUDA_VISIBLE_DEVICES"] for m in mans) == ["0", "1"]
    # separate worker processes of one two-job pool (n_jobs=2 above), each holding its own slot;
    # whether their runs overlapped in time depends on the machine's speed and is not asserted
    assert jobs[0]["pid"] != jobs[1]["pid"]
    assert all(j["hydra_status"] == "COMPLETED" for j in jobs)


def test_summarize_joins_the_sweep_into_one_table(joblib_sweep):
    from harness.report.summarize import summarize_main

    sweep_dir, _ = joblib_sweep
    assert summarize_main([str(sweep_dir)]) == 0
    import pandas as pd

    df = pd.read_csv(sweep_dir / "summary" / "summary.csv")
    assert len(df) == 2 and list(df["workload.decode_tokens"]) == [8, 12]
    assert list(df["status"]) == ["complete", "complete"] and sorted(df["gpu"]) == [0, 1]
    assert (df["decode_tok_s"] > 0).all() and df["decode_ms"].notna().all()
    md = (sweep_dir / "summary" / "summary.md").read_text()
    assert "swept: `workload.decode_tokens`" in md and (sweep_dir / "summary" / "summary.png").is_file()


# ---------------------------------------------------------------------------- the SLURM path

def test_slurm_config_composes_for_submitit():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "src/harness/conf"), version_base=None):
        cfg = compose("config", overrides=["hydra/launcher=slurm"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.gpus_per_node == 1 and launcher.tasks_per_node == 1 and launcher.timeout_min == 60


def test_slurm_local_runs_one_job_through_submitit(runs):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="needs hydra-submitit-launcher")
    root, proc = runs["slurm-local"].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep_dir = next(root.glob("multirun-*"))
    man = json.loads((sweep_dir / "0" / "manifest.json").read_text())
    assert man["status"] == "complete" and man["launch"].get("SUBMITIT_EXECUTOR") == "local"
    assert list((sweep_dir / ".submitit").glob("*/*_result.pkl"))
