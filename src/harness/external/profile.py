"""The ``profile`` verb: ``cfg.tool`` (ncu or nsys) over ``cfg.stage``'s NVTX range of a child run
(``tools.child_command``), through the session of that tool (``ncu_session``, ``nsys_session``).
"""
from __future__ import annotations

from pathlib import Path

from hydra.core.hydra_config import HydraConfig

from .ncu_session import run_ncu
from .nsys_session import NsysSettings, run_nsys
from .tools import child_command


def profile_from_config(cfg, out_dir: Path) -> dict:
    """Run the profile verb (``cfg.tool`` over ``cfg.stage``, both validated by the config schema);
    returns paths of what it wrote."""
    tool, stage = cfg.tool, cfg.stage
    overrides = list(HydraConfig.get().overrides.task)
    out_dir = Path(out_dir)
    if tool == "ncu":
        return run_ncu(cfg, stage, child_command(cfg, out_dir / "child", overrides), out_dir)
    warmup = NsysSettings.from_config(cfg).warmup
    return run_nsys(cfg, stage, child_command(cfg, out_dir / "child", overrides, warmup), out_dir, overrides)


__all__ = ["profile_from_config"]
