"""Whether the Triton kernels of ``harness.kernels`` can run on a device, and why (or why not).

This module does not import triton itself, so it answers where triton is missing.
"""
from __future__ import annotations

import os
import sys

import torch

#: the module whose import fixes the interpreter mode of every kernel (``common.INTERPRETED``)
COMMON = f"{__package__}.common"


def triton_available(device: torch.device | str) -> tuple[bool, str]:
    """(can the kernels run on ``device``, why or why not).

    CUDA needs an importable triton; the CPU needs ``TRITON_INTERPRET=1`` set before
    ``harness.kernels.common`` is first imported (kernels run in Triton's numpy interpreter).
    """
    device = torch.device(device)
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return False, f"triton is not importable ({exc.__class__.__name__}: {exc})"
    common = sys.modules.get(COMMON)
    if common is not None:       # already defined: the mode chosen at its import is what runs
        interpret = common.INTERPRETED
    else:
        interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if device.type == "cuda":
        if interpret:
            return False, "TRITON_INTERPRET=1 is set; unset it to compile the kernels for CUDA"
        return True, "CUDA: compiled Triton kernels"
    if device.type == "cpu":
        if not interpret:
            return False, "Triton runs on the CPU only in its interpreter: set TRITON_INTERPRET=1 before import"
        return True, "CPU: Triton interpreter (TRITON_INTERPRET=1), for correctness only"
    return False, f"no Triton backend for {device.type}"


__all__ = ["triton_available"]
