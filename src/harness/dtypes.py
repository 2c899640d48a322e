"""The one dtype table: names a user may write, their canonical short name, torch dtype and size.

``canonical('bfloat16') == 'bf16'``; ``torch_dtype('bf16') is torch.bfloat16``; ``nbytes('bf16') == 2``
[bytes per element]. ``tf32`` and ``fp8`` are ceiling names (the datasheet rates of
``roofline.specs``), not storage dtypes a model runs in: ``torch_dtype`` refuses them.
Importing this module does not import torch.
"""
from __future__ import annotations

from .errors import HarnessError

#: canonical name -> (torch attribute, bytes per element); None: not a storage dtype here
TABLE = {"bf16": ("bfloat16", 2), "fp16": ("float16", 2), "fp32": ("float32", 4),
         "tf32": (None, 4), "fp8": (None, 1)}
#: model dtypes a run may ask for (``dtype=`` in the config); ``auto`` picks bf16 on CUDA, fp32 on the CPU
RUN_DTYPES = ("auto", "bf16", "fp16", "fp32")
ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
           "fp32": "fp32", "float32": "fp32", "float": "fp32", "tf32": "tf32", "fp8": "fp8", "float8": "fp8",
           "float8_e4m3fn": "fp8"}


def canonical(name) -> str:
    """'bfloat16' / 'torch.bfloat16' / 'bf16' / torch.bfloat16 -> 'bf16' (likewise fp16, fp32, tf32, fp8)."""
    key = str(name).strip().lower().replace("torch.", "")
    if key not in ALIASES:
        raise HarnessError(f"unknown dtype {name!r}", f"use one of {', '.join(TABLE)}")
    return ALIASES[key]


def torch_dtype(name):
    """The torch dtype of a storage dtype name (or a torch dtype, returned as is)."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    attr = TABLE[canonical(name)][0]
    if attr is None:
        raise HarnessError(f"dtype {name!r} is a ceiling name, not a dtype the model can run in",
                           "use dtype=bf16, fp16 or fp32")
    return getattr(torch, attr)


def nbytes(name) -> int:
    """Bytes per element of a dtype name or torch dtype (an int is returned unchanged)."""
    if isinstance(name, int) and not isinstance(name, bool):
        return name
    return TABLE[canonical(name)][1]


__all__ = ["TABLE", "RUN_DTYPES", "canonical", "torch_dtype", "nbytes"]
