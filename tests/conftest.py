"""Shared test set-up: markers, the tiny model config and the tiny crop mode.

The calibration cache (``HARNESS_CACHE_DIR``) of the whole session is a fresh temporary directory
holding a small measured CPU calibration (128^3 GEMM, 4 MiB copy and read) stored as this CPU's
default record (a fixture: the cache keeps records per settings, and runs look up the default
ones), so runs in tests (and the CLI subprocesses, which inherit the environment) find their
ceilings cached instead of calibrating at full size, and never touch the user's cache. Tests that
need an empty cache set their own.

Markers (declared in pyproject.toml, handled here):
- ``gpu``: needs a CUDA device; skipped when ``torch.cuda.is_available()`` is false.
- ``vendor``: needs ``HARNESS_VENDOR_DIR`` pointing at a vendor model directory; skipped otherwise.

Triton: without a CUDA device ``TRITON_INTERPRET=1`` is set here, before any test module imports a
Triton kernel module (the interpreter is chosen at that import), so the kernels run on CPU tensors;
``DEV`` is the device the kernel tests use, ``needs_triton`` skips a test where Triton cannot run.

CLI runs in the background: a test module that defines ``start_runs(tmp_path_factory, submit)``
(its ``python -m harness ...`` subprocesses, ``submit(fn, *args)`` -> Future, as a dict id ->
Future) gets them started when the session starts, not when its turn comes: most tests here run on
one core, so the runs (mostly imports, on their own) use the other one meanwhile. Three run at a time,
at nice 10, so the tests in this process keep their core; the module's tests read them through the
``runs`` fixture. Runs take the environment from their module's import, never from the test that
happens to be running (tests change ``os.environ`` through monkeypatch and the harness itself).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: where the Triton kernel tests run: the GPU, else Triton's interpreter on the CPU
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def triton_runs() -> bool:
    """Whether Triton kernels run on ``DEV`` (compiled on CUDA, else the interpreter)."""
    from harness.kernels.availability import triton_available

    return triton_available(DEV)[0]


needs_triton = pytest.mark.skipif(not triton_runs(), reason="Triton cannot run here (not importable, or "
                                  "TRITON_INTERPRET unset before the first import)")
#: a test of Triton kernels on the CPU device (the interpreter): on a GPU host Triton compiles for CUDA and
#: cannot run CPU tensors, so it is skipped there (the host's ``gpu`` tests cover the kernels)
cpu_triton = pytest.mark.skipif(DEV != "cpu", reason="Triton's interpreter on the CPU: this host has a GPU "
                                "(TRITON_INTERPRET unset: Triton compiles for CUDA)")

ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL_YAML = ROOT / "conf" / "model" / "tiny.yaml"

#: a custom crop mode small enough for the tiny model: 128 px global view, 64 px tiles, cropping on
TINY_MODE = {"name": "t", "base_size": 128, "image_size": 64, "crop": True}


def pytest_configure(config):
    # pyproject.toml declares them too; repeating keeps `--strict-markers` happy when pytest is
    # run from elsewhere with another rootdir
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "vendor: needs HARNESS_VENDOR_DIR pointing at a vendor model directory")
    _session_calibration_cache()


_SESSION_CACHE: dict = {}


def pytest_unconfigure(config):
    import shutil

    if _SESSION_CACHE.get("dir"):
        shutil.rmtree(_SESSION_CACHE["dir"], ignore_errors=True)


def _session_calibration_cache() -> None:
    import tempfile

    from harness.roofline.specs import cpu_name

    import torch

    import json

    from harness.config import HardwareConfig
    from harness.roofline.calibrate import DEFAULTS, cache_path, measure

    d = tempfile.mkdtemp(prefix="harness-test-cache-")
    os.environ["HARNESS_CACHE_DIR"] = _SESSION_CACHE["dir"] = d
    small = {"gemm_size": 128, "gemm_dtype": "fp32", "copy_mib": 4, "read_mib": 4, "warmup": 0, "iters": 2}
    rec = {"device_name": cpu_name(), **measure(torch.device("cpu"), small, progress=lambda *_: None),
           "status": "accepted", "problems": [], "settings": DEFAULTS["cpu"],
           "fixture": f"tests/conftest.py: measured with {small}, stored as the default record"}
    path = cache_path(cpu_name(), HardwareConfig(cache_dir=d))
    path.write_text(json.dumps(rec, indent=2, default=str))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    need_gpu = [it for it in items if it.get_closest_marker("gpu")]
    if need_gpu and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
        for it in need_gpu:
            it.add_marker(skip)
    if not os.environ.get("HARNESS_VENDOR_DIR"):
        skip = pytest.mark.skip(reason="HARNESS_VENDOR_DIR is not set (point it at a DeepSeek-OCR snapshot)")
        for it in items:
            if it.get_closest_marker("vendor"):
                it.add_marker(skip)


def load_tiny_cfg():
    """conf/model/tiny.yaml as a ``harness.config.ModelConfig``."""
    from omegaconf import OmegaConf

    from harness.config import ModelConfig, from_dict

    return from_dict(ModelConfig, OmegaConf.to_container(OmegaConf.load(TINY_MODEL_YAML), resolve=True))


@pytest.fixture
def tiny_cfg():
    """A fresh tiny ModelConfig per test (tests may change attn_implementation etc.)."""
    return load_tiny_cfg()


@pytest.fixture
def tiny_mode() -> dict:
    """The tiny custom crop mode {name: t, base_size: 128, image_size: 64, crop: true}."""
    return dict(TINY_MODE)


@pytest.fixture
def wide_gemv_tiles(monkeypatch):
    """``linear_impl=fused``'s GEMV kernels on 64-row tiles (``fused_linears.GEMV_TILES``), for tests
    of the variant's wiring in Triton's interpreter, whose cost is per program: on the tiny model's
    shapes (K = 64 < BLOCK_K = 256, masked) q/k/v+RoPE's 96 column pairs take 2 programs (the second
    half masked) instead of 24, gate/up's 128 columns 2 instead of 32. The default 4-row tiles are
    tests/test_gemv.py's."""
    from harness.kernels.gemv_triton import GemvConfig
    from harness.variants import fused_linears

    monkeypatch.setattr(fused_linears, "GEMV_TILES", GemvConfig(block_n=64))


#: CLI runs of the background pool at once, and their nice value
BACKGROUND_WORKERS, BACKGROUND_NICE = 3, 10


def _nice_this_thread() -> None:
    """Lower the priority of this pool thread; the subprocesses it starts inherit it (on Linux the
    nice value is per thread and copied at fork). Elsewhere the runs keep the normal priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):
        pass


def main_lines(capsys, argv: list) -> tuple:
    """(exit code, the non-empty stderr lines) of ``harness.cli.main(argv)`` run in this process."""
    from harness.cli import main

    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    return rc, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


def cli_env(*drop: str) -> dict:
    """``os.environ`` without HYDRA_FULL_ERROR (a run's error is one line) and ``drop``, for CLI
    subprocesses. Modules take it when imported: their runs start in the background while tests
    change ``os.environ``."""
    return {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", *drop)}


class BackgroundRuns(dict):
    """module name -> {run id: Future}, or the exception its ``start_runs`` raised."""

    def of(self, module: str) -> dict:
        started = self[module]
        if isinstance(started, BaseException):
            raise started
        return started


@pytest.fixture(scope="session", autouse=True)
def background_runs(request, tmp_path_factory):
    """Start the CLI runs of every module whose selected tests use ``runs``, in the order the modules
    run (so the first needed finish first); cancel what has not started when the session ends."""
    modules = dict.fromkeys(item.module for item in request.session.items
                            if "runs" in getattr(item, "fixturenames", ()) and hasattr(item.module, "start_runs"))
    pool = ThreadPoolExecutor(BACKGROUND_WORKERS, thread_name_prefix="cli-run", initializer=_nice_this_thread)
    started = BackgroundRuns()
    for module in modules:
        try:
            started[module.__name__] = module.start_runs(tmp_path_factory, pool.submit)
        except Exception as exc:  # noqa: BLE001 - the module's tests report it, not the first test of the session
            started[module.__name__] = exc
    yield started
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def runs(background_runs, request) -> dict:
    """This module's CLI runs (its ``start_runs``), started with the session: id -> Future."""
    return background_runs.of(request.module.__name__)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty calibration cache (``HARNESS_CACHE_DIR``) for one test."""
    d = tmp_path / "cache"
    d.mkdir()
    monkeypatch.setenv("HARNESS_CACHE_DIR", str(d))
    return d
