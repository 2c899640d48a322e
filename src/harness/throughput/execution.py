"""The execution a throughput run gives the model: the one place that sets it.

``best_execution``: the knobs of the named execution ``best`` (``conf/execution/best.yaml``, which
``conf/experiment/throughput.yaml`` loads into ``executions.best``; the optimize ladder's best rows
name the same file, so the two experiments cannot drift apart). ``execution_for``: the execution a run
runs: with ``best`` (the CUDA default) those knobs, with every ``execution.*`` knob that differs
from its default on top; without it ``execution.*`` as given (the vendor-style default on the CPU);
then ``throughput.execution``'s knobs over either (``shadowed``: the command-line ``execution.*``
overrides at their default that best's value would shadow, which the CLI refuses). A static cache without
``execution.static_cache_len`` gets the length of the longest request of the run (``cache_len``),
so one decoder (one compile, one capture) serves every batch of a batch size whatever its pages'
budgets. ``apply_execution``: ``harness.variants.apply`` with it.
"""
from __future__ import annotations

import dataclasses

import torch

from .. import variants
from ..config import ExecutionConfig, HarnessConfig, case_execution
from ..errors import HarnessError

BEST = "best"


def best_execution(cfg: HarnessConfig) -> dict:
    """{knob: value} the named execution ``best`` sets (``cfg.executions``; the knobs it leaves unset
    are not in it)."""
    named = cfg.executions.get(BEST)
    if named is None:
        raise HarnessError(f"throughput.best needs the named execution {BEST}, which this config does not load "
                           f"(executions: {', '.join(sorted(cfg.executions)) or 'none'})",
                           f"compose +experiment=throughput (its defaults load conf/execution/{BEST}.yaml), or set "
                           "throughput.best=false")
    return {k: v for k, v in dataclasses.asdict(named.execution).items() if v is not None}


def changed_knobs(ex: ExecutionConfig) -> dict:
    """{knob: value} of the knobs of ``ex`` that differ from their defaults (``ExecutionConfig()``)."""
    defaults = ExecutionConfig()
    return {k: v for k, v in ex.execution().items() if v != getattr(defaults, k)}


def shadowed(cfg: HarnessConfig, best: bool, overrides: list) -> list:
    """[(knob, best's value)] of the ``execution.<knob>=...`` overrides that ``layered`` would not honour:
    with ``best`` on, a knob set to its default on the command line is not a change, so best's value
    of it stays (unless ``throughput.execution`` sets it): ``execution.sam_attention=sdpa`` would run
    best's ``triton``."""
    if not best:
        return []
    named, defaults = best_execution(cfg), ExecutionConfig()
    given = cfg.throughput.execution if cfg.throughput is not None else None
    keys = (text.lstrip("+~").split("=", 1)[0] for text in overrides)
    out = []
    for knob in (key[len("execution."):] for key in keys if key.startswith("execution.")):
        default = getattr(defaults, knob, None)
        set_apart = given is not None and getattr(given, knob, None) is not None     # throughput.execution wins
        if not set_apart and getattr(cfg.execution, knob, None) == default and named.get(knob, default) != default:
            out.append((knob, named[knob]))
    return out


def layered(cfg: HarnessConfig, best: bool, execution: ExecutionConfig | None = None) -> ExecutionConfig:
    """``best``'s knobs (when ``best``), ``execution`` (default ``execution.*``)'s changed knobs on top,
    then ``throughput.execution``'s."""
    ex = cfg.execution if execution is None else execution
    if best:
        ex = dataclasses.replace(ex, **{**best_execution(cfg), **changed_knobs(ex)})
    return case_execution(ex, cfg.throughput)


def execution_for(cfg: HarnessConfig, best: bool, cache_len: int, device=None, dtype=None) -> ExecutionConfig:
    """The execution the run runs (see the module docstring), checked on ``device`` in ``dtype``
    (``harness.variants.check``: refused in one line where it cannot run)."""
    ex = layered(cfg, best)
    if ex.kv_cache == "static" and ex.static_cache_len is None:
        ex = dataclasses.replace(ex, static_cache_len=cache_len)
    if device is not None:
        variants.check(ex, device, dtype or torch.float32, model=cfg.model, positions=cache_len)
    return ex


def apply_execution(model, cfg: HarnessConfig, best: bool, cache_len: int) -> dict:
    """Run ``model`` as ``execution_for`` (``harness.variants.apply``); returns what runs (for the manifest)."""
    p = next(model.parameters())
    return variants.apply(model, execution_for(cfg, best, cache_len), p.device)


__all__ = ["BEST", "best_execution", "changed_knobs", "shadowed", "layered", "execution_for", "apply_execution"]
