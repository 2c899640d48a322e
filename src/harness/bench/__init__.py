"""``python -m harness bench TARGET``: kernel and measurement benches, each writing a run directory.

One module per target (``harness.bench.<target>``, each with ``run(cfg, opts, device, report)``),
the targets and their options in ``config`` (torch-free: ``harness.config`` types ``bench`` with
it), the shared CUDA timing in ``timing``, and the verb (refusal, run directory, tables) in ``verb``.
This package's ``__init__`` imports nothing, so the config schema reads ``config`` without torch.
"""
