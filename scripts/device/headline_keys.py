"""Print the key columns of headline.csv in run directories (device runs: one line per case)."""
import csv, sys, glob
keys = ("case", "batch", "routing", "e2e_ms", "call_ms", "ttft_ms", "tpot_p50_ms", "tpot_p50_ms_min", "tpot_p50_ms_max",
        "decode_tok_s", "pages_s", "pages_s_e2e", "bound_by")
for d in sys.argv[1:]:
    for f in glob.glob(d.rstrip("/") + "/headline.csv"):
        print(f)
        for r in csv.DictReader(open(f)):
            print("  " + " ".join(f"{k}={r[k][:9]}" for k in keys if k in r))
