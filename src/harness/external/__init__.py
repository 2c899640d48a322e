"""``python -m harness profile tool=ncu|nsys stage=<stage>``: an external profiler over one
stage's NVTX range of a harness request, joined with the analytic model.

The child is ``python -m harness run`` with the same model/workload overrides, one request
(no warm-up, no torch.profiler: ncu/nsys are the only CUPTI users). Outputs go to ``ncu/`` or
``nsys/`` inside the profile run directory.

* ``profile``: the verb (``profile_from_config``); ``tools``: the child command, finding a
  profiler, running into a log; ``ncu`` / ``nsys``: commands and parsers of each tool;
  ``ncu_session`` / ``nsys_session``: one profiling session each, joined with the analytic model.
"""
from .profile import profile_from_config
from .tools import child_command, find_tool, portable_command, run_logged

__all__ = ["profile_from_config", "child_command", "find_tool", "portable_command", "run_logged"]
