"""Per-repeat stage GPU ms, the repeat CV per stage (the run's summary), TPOT percentiles,
host steadiness and warm-up times of one run directory."""
import sys

from harness.measure import host
from harness.schema.stages import CALL_ALL
from harness.measure.summary import summarize
from harness.rundir import load_run

run = load_run(sys.argv[1])
st = run.stages
timed = st[~st["profiled"]]
for case, g in timed.groupby("case", sort=False):
    print(f"case {case}: stage GPU ms per repeat")
    print(g[g["call"] == CALL_ALL].pivot_table(index="repeat", columns="stage", values="gpu_ms").round(2).to_string())
    print(g[g["stage"] == "request"][["repeat", "e2e_ms", "ttft_ms", "tpot_p50_ms", "tpot_p99_ms"]]
          .round(2).to_string(index=False))
ms = summarize(st).stages
print("CV % (std ddof=1 / mean):", {f"{r.case}/{r.stage}": round(100 * r.cv, 2) for r in ms.itertuples()})
for k, v in (run.manifest.get("host_steadiness") or {}).items():
    print("host", k, host.describe(v))
for c in run.manifest.get("cases") or []:
    print("case", c.get("name"), "warm-up ms", c.get("warmup_ms"), "steady", c.get("warmup_steady"))
