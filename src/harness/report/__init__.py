"""Reports of a run directory and across runs.

* ``report``: ``write_report(run)`` -> report.md, headline.csv, stages_summary.csv, analytic.csv,
  roofline.csv and the charts; its sections (``sections``, ``ladder``, ``steps``, ``context``) write
  their tables through the column registry (``columns``).
* ``compare``: ``python -m harness compare RUN_A RUN_B`` (``compare_main``).
* ``summarize``: ``python -m harness summarize SWEEP_DIR`` (``summarize_main``).
* ``breakdown``, ``progress``: time_breakdown.png and the run's progress line.
"""
