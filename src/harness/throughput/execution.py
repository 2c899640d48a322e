"""The execution a throughput run gives the model: the one place that sets it.

``best_execution``: the knobs of the ``best`` case of ``conf/experiment/optimize.yaml`` (read from
that file, so the two experiments cannot drift apart). ``execution_for``: the model config a run
executes: with ``best`` (the CUDA default) those knobs, with every ``model.*`` execution knob that
differs from its default on top; without it ``model.*`` as given (the vendor-style default on the
CPU); then ``throughput.execution``'s knobs over either. A static cache without ``model.static_cache_len`` gets the length of the longest request of
the run (``cache_len``), so one decoder (one compile, one capture) serves every batch of a batch
size whatever its pages' budgets. ``apply_execution``: configure the model with it.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ..config import ExecutionConfig, HarnessConfig, ModelConfig, case_model, check_execution

BEST_CASE = "best"


def conf_dir() -> Path:
    """The Hydra tree the CLI composes (``HARNESS_CONF``, else the package's ``conf``)."""
    return Path(os.environ.get("HARNESS_CONF", Path(__file__).resolve().parents[1] / "conf"))


def best_execution() -> dict:
    """The execution knobs of the ``best`` case of ``experiment/optimize.yaml``."""
    from omegaconf import OmegaConf

    cases = OmegaConf.to_container(OmegaConf.load(conf_dir() / "experiment" / "optimize.yaml"))["cases"]
    return dict(next(c for c in cases if c.get("name") == BEST_CASE)["execution"])


def execution_for(cfg: HarnessConfig, best: bool, cache_len: int) -> ModelConfig:
    """The model config the run executes (see the module docstring), checked (``check_execution``)."""
    m = cfg.model
    if best:
        defaults = ExecutionConfig()
        changed = {k: v for k, v in m.execution().items() if v != getattr(defaults, k)}
        m = dataclasses.replace(m, **{**best_execution(), **changed})
    m = case_model(m, cfg.throughput)
    if m.kv_cache == "static" and m.static_cache_len is None:
        m = dataclasses.replace(m, static_cache_len=cache_len)
    check_execution(m, "throughput")
    return m


def apply_execution(model, cfg: HarnessConfig, best: bool, cache_len: int) -> dict:
    """Configure ``model`` with ``execution_for``; returns what runs (for the manifest)."""
    return model.configure(execution_for(cfg, best, cache_len))


__all__ = ["BEST_CASE", "best_execution", "execution_for", "apply_execution"]
