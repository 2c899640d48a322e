"""Will the run fit? Checked before any model is built, against the memory free now.

What a run needs (``need``), in bytes:

* weights: the model's parameters, counted from its config (``harness.analytic.component_params``:
  SAM, CLIP, projector, separators, LLM), x the run's dtype size;
* the KV cache of the largest case: ``kv_bytes_per_token`` x (its cache length: prefill + decode
  tokens, or the static cache's length) x its batch;
* a margin for activations and allocator slack: ``MARGIN_FRACTION`` of the weights, at least
  ``MARGIN_MIN_BYTES`` (the full model in fp32 on a CPU peaked 1.2 GB above its 13.3 GB of weights).

What is free: on the CPU, ``MemAvailable`` of ``/proc/meminfo`` (psutil's ``available`` where
/proc is missing and psutil is installed); on a GPU, ``torch.cuda.mem_get_info``'s free bytes.
Where neither can be read the check says so and lets the run go on. A run that needs more than is
free is refused with both figures and the fix (``model=tiny``, a smaller ``workload.batch``,
``dtype=bf16`` on a CPU); ``run.memory_check=false`` skips the check.
"""
from __future__ import annotations

from typing import Optional

from .errors import HarnessError

#: the margin over the weights for activations and allocator slack
MARGIN_FRACTION = 0.10
MARGIN_MIN_BYTES = 1 << 30


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB"


def free_bytes(device) -> tuple:
    """(free bytes or None, what was read) on ``device`` (a torch.device)."""
    if device.type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        return int(free), f"free GPU memory on {device}"
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available RAM (MemAvailable)"
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None, "available RAM (neither /proc/meminfo nor psutil here)"
    return int(psutil.virtual_memory().available), "available RAM (psutil)"


def need_bytes(model_cfg, dtype_bytes: int, cases: list) -> dict:
    """{"weights", "kv_cache", "margin", "total"} bytes for ``model_cfg`` in a dtype of
    ``dtype_bytes`` per element running ``cases`` (``setup.CaseInputs``)."""
    from .analytic import component_params, kv_bytes_per_token

    weights = component_params(model_cfg)["total"] * dtype_bytes
    kv = 0
    for c in cases:
        shape = c.case
        ex = c.execution
        length = (ex.cache_len(shape.prefill_tokens, shape.decode_tokens) if ex.kv_cache == "static"
                  else ex.positions(shape.prefill_tokens, shape.decode_tokens))
        kv = max(kv, kv_bytes_per_token(model_cfg, dtype_bytes) * length * shape.batch)
    margin = max(int(MARGIN_FRACTION * weights), MARGIN_MIN_BYTES)
    return {"weights": weights, "kv_cache": kv, "margin": margin, "total": weights + kv + margin}


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX); elsewhere torch emulates it."""
    import torch

    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        fn = getattr(torch.cpu, probe, None)
        try:
            if fn is not None and fn():
                return True
        except Exception:  # noqa: BLE001 - a private probe that changed: treat as absent
            pass
    return False


def check_memory(model_cfg, device, dtype, cases: list, free: Optional[tuple] = None) -> dict:
    """The manifest's ``memory`` entry ({need, free, what}); raises HarnessError when the run cannot
    fit. ``dtype``: the run's torch dtype; ``free``: (bytes, what) instead of reading it (tests)."""
    from .dtypes import nbytes

    size = nbytes(str(dtype).replace("torch.", ""))
    need = need_bytes(model_cfg, size, cases)
    avail, what = free if free is not None else free_bytes(device)
    entry = {"need_bytes": need, "free_bytes": avail, "free_is": what,
             "rule": f"weights x {size} B + KV cache + max({MARGIN_FRACTION:.0%} of weights, "
                     f"{MARGIN_MIN_BYTES / (1 << 30):g} GiB)"}
    if avail is None or need["total"] <= avail:
        return entry
    fixes = ["model=tiny", "a smaller workload.batch" if max(c.case.batch for c in cases) > 1 else None]
    if device.type == "cpu" and size > 2:
        fixes.append("dtype=bf16 (halves the weights" + ("" if cpu_has_bf16() else
                                                         "; this CPU has no native bf16, so it runs slower") + ")")
    fixes.append("or a machine with more memory")
    raise HarnessError(f"the run needs about {_gb(need['total'])} ({_gb(need['weights'])} of weights, "
                       f"{_gb(need['kv_cache'])} of KV cache, {_gb(need['margin'])} for activations) but only "
                       f"{_gb(avail)} of {what} is free",
                       "use " + ", ".join(f for f in fixes if f) + " (run.memory_check=false skips this check)")


__all__ = ["check_memory", "need_bytes", "free_bytes", "cpu_has_bf16", "MARGIN_FRACTION", "MARGIN_MIN_BYTES"]
