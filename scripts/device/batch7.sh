#!/usr/bin/env bash
# GPU batch 7: stability: 10 timed repeats unpinned and pinned to 4 cores; paired overhead bench.
source scripts/device_setup.sh
python -m harness run measure.repeats=10 measure.warmup=2 run.root=/tmp/cv run.name=unpinned 2>&1 | grep "wrote"
taskset -c 2-5 python -m harness run measure.repeats=10 measure.warmup=2 run.root=/tmp/cv run.name=pinned 2>&1 | grep "wrote"
python - <<'PY'
import glob, pandas as pd
for d in sorted(glob.glob("/tmp/cv/*/")):
    s = pd.read_csv(d + "stages.csv")
    cv = s[(s.repeat == "cv") & (s.call.astype(str) == "all")].set_index("stage")["gpu_ms"]
    med = s[(s.repeat == "median") & (s.call.astype(str) == "all")].set_index("stage")["gpu_ms"]
    print(d.split("/")[-2], " ".join(f"{k}:{med[k]:.2f}ms cv={cv[k]*100:.1f}%" for k in cv.index))
PY
taskset -c 2-5 python scripts/bench_overhead.py --rounds 12 --decode-tokens 64 2>&1 | grep -v "^USDT\|UserWarning\|_warn_once" | tee $OUT/bench.log
