"""Compile the fused decode step's kernels for sm90 without a GPU: registers, spills, PDL load order.

    python scripts/check_decode_step_sm90.py [--tiny] [--no-pdl] [--config 'down=(4, 8);...']

Builds the reference model on the ``meta`` device (full size; ``--tiny``: conf/model/tiny.yaml),
takes its weights as the step does (``variants.fused_step.weights_from_model``) and runs one step
in which every launch is replaced by Triton's ``warmup`` (compile only) for an sm90 target, with a
stand-in Triton driver (no CUDA is touched). For each distinct kernel specialisation it prints, from
ptxas (the Triton wheel's own ``cuobjdump -res-usage``): registers per thread, local memory bytes
(register spills land there), shared memory; and, with PDL, whether every global load of a weight
(a load issued before ``griddepcontrol.wait`` in the PTX) precedes the wait and whether
``griddepcontrol.launch_dependents`` follows it; and the global loads narrower than 4 bytes
(``ld.global.b16``: a 2-byte load per element, where a weight row whose alignment the compiler
cannot see would go; the few expected ones are scalars and RoPE table entries). Exit status 1 if a
kernel fails to compile or spills. This checks the local Triton version's code generation; the
GPU's Triton may differ (triton 3.9 gave the MoE down kernel at (4, 8) 104 registers where the
GPUs' 3.6 gives 122). To match the GPU, install its Triton version without dependencies into a
directory of its own and put that first on PYTHONPATH: with triton 3.6.0 so, every kernel of the
step compiled to the register counts ``scripts/device/step_ablation.py --regs`` read on an H200
(q/k/v 158, attention 178, MoE gate/up 96, MoE down 122, lm_head 95; 2026-11-27; with packed bf16
pairs, the same day, both places gave o_proj 40, dense gate/up 115, MoE gate/up 64, MoE down 78).
``--dump DIR`` keeps each specialisation's PTX and cubin (``nvdisasm -lrm count`` on the cubin
shows the live registers at every instruction).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver as triton_driver  # noqa: E402

TINY_YAML = Path(__file__).resolve().parents[1] / "src" / "harness" / "conf" / "model" / "tiny.yaml"


class OfflineSm90Driver:
    """Just enough of Triton's active driver for ``JITFunction.warmup`` to compile for sm90."""

    backend = "cuda"

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty):
        from triton.backends.nvidia.driver import ty_to_cpp
        return ty_to_cpp(ty)


def resources(cubin: bytes) -> dict:
    """{'REG': n, 'LOCAL': bytes, 'SHARED': bytes} from the Triton wheel's cuobjdump."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    return {k: int(v) for k, v in re.findall(r"(REG|LOCAL|SHARED):(\d+)", out)}


def pdl_order(ptx: str) -> str:
    """Where the grid-dependency instructions sit among the global loads of the PTX."""
    lines = ptx.splitlines()
    wait = [i for i, l in enumerate(lines) if "griddepcontrol.wait" in l]
    launch = [i for i, l in enumerate(lines) if "griddepcontrol.launch_dependents" in l]
    loads = [i for i, l in enumerate(lines) if re.search(r"\bld\.(volatile\.)?global", l)]
    if not wait:
        return "no griddepcontrol.wait"
    before = sum(1 for i in loads if i < wait[0])
    ok = launch and launch[0] > wait[0]
    where = "after" if ok else "NOT after"
    return f"{before} of {len(loads)} global loads before the wait; launch_dependents {where} it"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny model's shapes instead of DeepSeek-OCR's")
    ap.add_argument("--no-pdl", action="store_true", help="compile the kernels without PDL")
    ap.add_argument("--len", type=int, default=512, help="static cache positions")
    ap.add_argument("--config", default="", metavar="FIELD=VALUE[;FIELD=VALUE]",
                    help="DecodeStepConfig changes (python literals), e.g. 'down=(4, 8)'")
    ap.add_argument("--dump", metavar="DIR", help="write each specialisation's PTX and cubin there "
                    "(<kernel>_<n>.ptx / .cubin; read the cubin with nvdisasm)")
    args = ap.parse_args(argv)
    triton_driver.set_active(OfflineSm90Driver())
    from harness.analytic.check import load_model_config
    from harness.kernels import decode_step as ds
    from harness.kernels import decode_step_triton as kt
    from harness.models.build import build_model
    from harness.variants.fused_step import weights_from_model
    from harness.variants.static_kv import StaticKVCache

    cfg = load_model_config(str(TINY_YAML) if args.tiny else None)   # None: the full-size model
    dt, L = torch.bfloat16, cfg.llm
    model = build_model(cfg, "meta", dt)
    cache = StaticKVCache(L.num_layers, 1, L.num_kv_heads, args.len, L.head_dim, dt, "meta")
    pos = torch.zeros(1, dtype=torch.int64, device="meta")
    pdl = not args.no_pdl
    kt.pdl_support = lambda device: (True, "offline sm90 compile")   # the check reads a CUDA device
    compiled, failed = {}, []

    def warmup(kernel, grid, warps, use_pdl, *a, **meta):
        key = (kernel.fn.__name__, tuple(sorted((k, v) for k, v in meta.items() if k != "launch_pdl")))
        if key in compiled:
            return
        try:
            if use_pdl:
                meta["launch_pdl"] = True
            compiled[key] = (kernel.warmup(*a, grid=grid, num_warps=warps, **meta), grid, warps)
        except Exception as exc:                      # report and go on with the other kernels
            failed.append(f"{key[0]}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            compiled[key] = None

    kt._launch = warmup
    counts = (torch.zeros(4, L.num_layers, L.n_routed_experts, dtype=torch.int64, device="meta"),
              torch.zeros(1, dtype=torch.int64, device="meta"))
    step = ds.FusedDecodeStep(weights_from_model(model), cache, pos, pdl=pdl, counts=counts,
                              config=ds.config_changes(args.config, ds.DecodeStepConfig(sms=132)))
    step.run()
    print(f"triton {triton.__version__}, sm90, {'PDL' if pdl else 'no PDL'}, {step.launches} launches per step")
    spilled = False
    for i, ((name, meta), entry) in enumerate(compiled.items()):
        if entry is None:
            continue
        ck, grid, warps = entry
        if args.dump:
            Path(args.dump).mkdir(parents=True, exist_ok=True)
            Path(args.dump, f"{name}_{i}.ptx").write_text(ck.asm["ptx"])
            Path(args.dump, f"{name}_{i}.cubin").write_bytes(ck.asm["cubin"])
        res = resources(ck.asm["cubin"])
        spilled |= res.get("LOCAL", 0) > 0
        small = {k: v for k, v in meta if k in ("BLOCK_N", "BLOCK_P", "SPLIT_N", "ROWS", "INTER", "TOP_K", "PARTS")}
        order = pdl_order(ck.asm["ptx"]) if pdl else ""
        narrow = len(re.findall(r"\bld\.global(?:\.[a-z]+)*\.b16\b", ck.asm["ptx"]))
        print(f"{name:24s} grid {str(grid):12s} warps {warps}  REG {res.get('REG')}  LOCAL {res.get('LOCAL')}  "
              f"SHARED {res.get('SHARED')}  2-byte loads {narrow}  {small}  {order}")
    for f in failed:
        print("FAILED", f)
    return 1 if failed or spilled else 0


if __name__ == "__main__":
    sys.exit(main())
