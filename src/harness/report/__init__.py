"""Reports of a run directory and across runs.

* ``report``: ``write_report(run)`` -> report.md, headline.csv, stages_summary.csv, analytic.csv,
  roofline.csv and the charts; its sections (``sections``, ``ladder``, ``steps``, ``context``) write
  their tables through the column registry (``columns``).
* ``compare``: ``python -m harness compare RUN_A RUN_B`` (``compare_main``).
* ``summarize``: ``python -m harness summarize SWEEP_DIR`` (``summarize_main``).
* ``merge``: ``python -m harness merge RUN_A RUN_B --out DIR`` (``merge_main``): one run directory,
  and its report, from runs split across processes on one machine.
* ``breakdown``, ``progress``: time_breakdown.png and the run's progress line.
"""
