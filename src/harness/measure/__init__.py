"""Measurement: NVTX ranges, CUDA-event stage times, kernel capture and attribution.

Facade: ``measure_case`` runs warm-up, timed repeats and the profiled request of one case and
returns a ``CaseMeasurement``: its observations (``observations.OBSERVATION_COLUMNS``, the typed
rows of stages.csv), kernels (``kernels.KERNEL_COLUMNS``), routing and decode steps.
``summary.summarize`` is the one summarizer of observations.
"""
from .recorder import StageRecorder
from .runner import CaseMeasurement, measure_case
from .summary import Summary, summarize

__all__ = ["StageRecorder", "CaseMeasurement", "measure_case", "Summary", "summarize"]
