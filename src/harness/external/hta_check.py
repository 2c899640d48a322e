"""Cross-check a run's profiled-request traces with Holistic Trace Analysis (issue 22 item 5).

    python -m harness.external.hta_check runs/<run>              # every traces/<case>/trace.json.gz of the run
    python -m harness.external.hta_check runs/<run> --rounding   # HTA's default whole-µs rounding left on

Per case and stage: busy and idle as the harness reads the trace (``harness.measure.trace_stages``),
as HTA reads it (``harness.external.hta``) and the profiled request's busy in stages.csv (the harness's
in-memory capture), with the relative differences; a line for every stage beyond 1%. Exit 1 when any
stage disagrees. Needs holistictraceanalysis (scripts/bootstrap.sh installs it).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from ..errors import HarnessError
from ..markdown import table
from ..schema.stages import CALL_ALL, read_observations
from .hta import TOLERANCE, caveats, compare


def _pct(v) -> str:
    return "–" if v is None or pd.isna(v) else f"{100 * v:+.2f}%"


def _ms(v) -> str:
    return "–" if v is None or pd.isna(v) else f"{v:,.4f}"


def check(run: Path, rounding: bool) -> bool:
    obs = read_observations(run / "stages.csv")
    prof = obs[obs["profiled"] & (obs["call"] == CALL_ALL)]
    ok = True
    for trace in sorted((run / "traces").glob("*/trace.json.gz")):
        case = trace.parent.name
        t = compare(trace, rounding)
        csv = prof[prof["case"] == case].set_index("stage")["busy_ms"] if len(prof) else pd.Series(dtype=float)
        rows = [[r.stage, int(r.kernels), _ms(csv.get(r.stage)), _ms(r.busy_ms), _ms(r.hta_busy_ms), _pct(r.busy_diff),
                 _ms(r.idle_ms), _ms(r.hta_idle_ms), _pct(r.idle_diff), "yes" if r.agree else "NO"]
                for r in t.itertuples()]
        print(f"## {case} ({trace})\n")
        print("\n".join(table(["stage", "kernels", "busy ms (stages.csv)", "busy ms (trace, harness)",
                               "busy ms (trace, HTA)", "busy diff", "idle ms (harness)", "idle ms (HTA)",
                               "idle diff (of span)", f"within {100 * TOLERANCE:.0f}%"], rows)))
        if not len(t):
            print("\nno GPU activities with harness:: stage annotations in this trace (a CPU run, or a run from "
                  "before the annotations were written into it)")
        for line in caveats(t):
            print(f"- {line}")
        print()
        ok = ok and bool(len(t)) and bool(t["agree"].all())
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--rounding", action="store_true", help="leave HTA's whole-µs rounding of events on")
    a = ap.parse_args(argv)
    try:
        return 0 if check(a.run, a.rounding) else 1
    except HarnessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
