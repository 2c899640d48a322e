"""Measurement: NVTX ranges, CUDA-event stage times, kernel capture and attribution.

Facade: ``measure_case`` runs warm-up and repeats of one case and returns two DataFrames,
``stages`` (see ``summarize.STAGE_COLUMNS``) and ``kernels`` (see ``kernels.KERNEL_COLUMNS``).
"""
from .recorder import StageRecorder
from .runner import measure_case

__all__ = ["StageRecorder", "measure_case"]
