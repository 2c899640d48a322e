"""``python -m harness.analytic``: write the static compute report; ``--check`` also runs the
FlopCounterMode exactness check on the same cases and prints the comparison table."""
from __future__ import annotations

import argparse
import sys
import time

from ..errors import HarnessError
from . import analyze
from .check import DEFAULT_MODES, _split, cases_from_args, check_cases, format_table, load_model_config


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.analytic",
                                description="Analytic FLOPs / bytes / parameters per stage and module family "
                                            "(no GPU, no weights).")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help="comma-separated crop modes (gundam alone: the default A4 page's grid, 2x3)")
    p.add_argument("--grids", default="", help="extra gundam tile grids COLSxROWS, comma-separated (e.g. 1x2,2x3,3x3)")
    p.add_argument("--out", default=None, help="output directory (default runs/analyze-<time>)")
    p.add_argument("--check", action="store_true",
                   help="also count FLOPs with FlopCounterMode on the meta device and compare (exit 1 on a difference)")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--text-tokens", type=int, default=12)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--attn", default=None, help="attention kernel: eager | sdpa | sdpa_flash | flash_attention_2")
    p.add_argument("--kv-cache", default=None, help="growing (torch.cat per step) | static")
    p.add_argument("--per-step", action="store_true", help="one CSV row per decode step")
    p.add_argument("--no-sweep", action="store_true", help="skip the mode/grid and decode-length sweeps")
    p.add_argument("--model-config", default=None, help="YAML model config (default: the vendor sizes)")
    args = p.parse_args(argv)
    out = args.out or time.strftime("runs/analyze-%Y%m%d-%H%M%S")
    try:
        cfg = load_model_config(args.model_config)
        cases = cases_from_args(_split(args.modes), _split(args.grids), args.decode_tokens, args.text_tokens,
                                args.batch, cfg)
        t0 = time.perf_counter()
        paths = analyze(cases, out, cfg, args.dtype, args.attn, args.kv_cache, args.per_step, not args.no_sweep)
        print(f"analyze: {len(cases)} cases in {time.perf_counter() - t0:.2f} s")
        for kind, path in paths.items():
            print(f"  {kind}: {path}")
        if args.check:
            t0 = time.perf_counter()
            df = check_cases(cases, cfg, "meta", verbose=True)
            print(format_table(df))
            print(f"check: {len(cases)} cases in {time.perf_counter() - t0:.1f} s")
            if (df["diff"] != 0).any():
                return 1
    except HarnessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
