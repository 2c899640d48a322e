"""Measurement: NVTX ranges, CUDA-event stage times, kernel capture and attribution.

Facade: ``measure_case`` runs warm-up, timed repeats and the profiled request of one case and
returns a ``CaseMeasurement``: its observations (``harness.schema.stages``, the typed
rows of stages.csv), kernels (``harness.schema.kernels``), routing and decode steps.
``summary.summarize`` is the one summarizer of observations.

The facade is lazy (PEP 562): importing a light submodule (``summary``, ``observations``, ``stats``,
the report side's needs) runs this file, and must not load ``runner`` (the model, the variants,
torch and triton); a name below is imported on its first access.
"""
import importlib

_LAZY = {"StageRecorder": "recorder", "CaseMeasurement": "runner", "measure_case": "runner",
         "Summary": "summary", "summarize": "summary"}

__all__ = ["StageRecorder", "CaseMeasurement", "measure_case", "Summary", "summarize"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
