"""Throughput of the OCR pipeline (issue 25): sustained pages/s with preprocessing, copies and
batching included, and what bounds it (``python -m harness run +experiment=throughput``).

Modules, from the bottom: ``plan`` (settings, pages, budgets, batches), ``prep`` (the worker
processes), ``feeder`` (host batch buffers filled ahead), ``clock`` (device marks, the batch's stage
function), ``staging`` (the copy to the device), ``window`` (the window's arithmetic and the bound
rule), ``execution`` (the one place that sets the model's execution), ``charts`` and ``section``
(throughput.png, throughput_timeline.png, the report section), ``pipeline`` (the verb).
"""
