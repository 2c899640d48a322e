"""Can ``model.attn_implementation=flash_attention_2`` run here? Checked before any model is built.

``flash_attention_2`` calls flash-attn's CUDA kernels (the vendor's ``LlamaFlashAttention2``, or the
reference model's ``flash_attn_func``): on a CPU it is refused, and where flash-attn is not importable
the one-line error names the set-up step that builds it for the local GPU (``FLASH_ATTN_SETUP``:
``scripts/flash_attn_wheel.py``, docs/vendor-model.md, CUDA set-up). Imports no torch: the CLI's config check
uses it too.
"""
from __future__ import annotations

from .errors import HarnessError

FLASH_ATTN = "flash_attention_2"
#: the set-up step that builds and installs flash-attn's kernels for this GPU (docs/vendor-model.md: CUDA set-up)
FLASH_ATTN_SETUP = "python scripts/flash_attn_wheel.py"


def check_flash_attn(attn_implementation: str, device_type: str) -> None:
    """Refuse ``flash_attention_2`` on a non-CUDA device, or where flash-attn does not import."""
    if attn_implementation != FLASH_ATTN:
        return
    if device_type != "cuda":
        raise HarnessError(f"model.attn_implementation={FLASH_ATTN} runs flash-attn's CUDA kernels; this run's "
                           f"device is {device_type}",
                           "use model.attn_implementation=eager (model=vendor) or sdpa on a CPU, or run on a GPU")
    try:
        import flash_attn  # noqa: F401
        import flash_attn_2_cuda  # noqa: F401  (the compiled kernels: a broken build fails here)
    except Exception as exc:  # ImportError, or an undefined symbol / CUDA mismatch in the extension
        raise HarnessError(f"model.attn_implementation={FLASH_ATTN} needs the flash-attn package, which is not "
                           f"importable ({exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
                           f"build and install it for this GPU with `{FLASH_ATTN_SETUP}` (docs/vendor-model.md: CUDA "
                           "set-up), or use model.attn_implementation=eager") from None


__all__ = ["FLASH_ATTN", "FLASH_ATTN_SETUP", "check_flash_attn"]
