"""The fused batch-1 decode step run eagerly (no graph), ``--steps`` times: a target for ncu, which
profiles kernels one at a time (so PDL's overlap is gone and, by default, L2 is flushed before
each profiled kernel: its weights come from DRAM).

    ncu -k regex:_down_kernel --launch-skip 3 --launch-count 1 --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats python scripts/device/step_eager.py

Per step the down kernel runs 24 times (per layer o_proj, then the dense or MoE down): launch 3 is
layer 1's MoE down; ``_gate_up_kernel`` launch 1 is layer 1's MoE gate/up.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_decode_step import fused_step_state  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--pos", type=int, default=286)
    ap.add_argument("--config", default="", metavar="FIELD=VALUE[;FIELD=VALUE]", help="DecodeStepConfig changes")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("step_eager: needs a GPU", file=sys.stderr)
        return 1
    from harness.config import ModelConfig
    from harness.kernels import decode_step as ds
    from harness.kernels import decode_step_triton as kt
    from harness.models.build import build_model

    dev = torch.device("cuda")
    weights, cache, pos, token = fused_step_state(build_model(ModelConfig(), dev, torch.bfloat16, seed=0), 512,
                                                  token_id=1)
    pos.fill_(args.pos)
    step = ds.FusedDecodeStep(weights, cache, pos, token=token, pdl=kt.pdl_support(dev)[0],
                              config=ds.config_changes(args.config))
    for _ in range(args.steps):
        step.run()
    torch.cuda.synchronize()
    print(f"step_eager: {args.steps} steps from position {args.pos}, {step.launches} launches each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
