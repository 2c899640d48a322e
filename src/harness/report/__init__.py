"""Run directory and reports.

* ``rundir``: the run directory (manifest.json, atomic CSV/text writes).
* ``report``: ``write_report(run)`` -> report.md, analytic.csv, roofline.csv, roofline.png.
* ``compare``: ``python -m harness compare RUN_A RUN_B`` (``compare_main``).
"""
