"""Per-repeat stage GPU ms, CV per stage, TPOT percentiles and host steadiness of one run dir."""
import json
import sys
from pathlib import Path

import pandas as pd

run = Path(sys.argv[1])
d = pd.read_csv(run / "stages.csv")
r = d[d.repeat.astype(str).str.isdigit()]
p = r.pivot_table(index="repeat", columns="stage", values="gpu_ms")
print(p.round(2).to_string())
print("CV % (std ddof=1 / mean):", (p.std() / p.mean() * 100).round(2).to_dict())
print(r[r.stage == "request"][["repeat", "e2e_ms", "ttft_ms", "tpot_p50_ms", "tpot_p99_ms"]].round(2).to_string(index=False))
m = json.loads((run / "manifest.json").read_text())
from harness.measure import host
for k, v in (m.get("host_steadiness") or {}).items():
    print("host", k, host.describe(v))
for c in m.get("cases") or []:
    print("case", c.get("name"), "warm-up ms", c.get("warmup_ms"), "steady", c.get("warmup_steady"))
