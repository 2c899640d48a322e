"""The fused decode step's kernels compiled for sm90 without a GPU: registers, spills, PDL load order.

    python -m harness bench decode_step_sm90 [model=tiny] [bench.decode_step_sm90.pdl=false] \\
        ["bench.decode_step_sm90.config='down=(4, 8);lm_head=(8, 8, 2)'"]

Builds the model (``model=``: the full-size reference by default) on the ``meta`` device, takes its
weights as the step does (``variants.fused_step.weights_from_model``) and runs one step in which
every launch is replaced by Triton's ``warmup`` (compile only) for an sm90 target, with a stand-in
Triton driver (no CUDA is touched: this target runs on a CPU). For each distinct kernel
specialisation the ``kernels`` table gives, from ptxas (the Triton wheel's own ``cuobjdump
-res-usage``): registers per thread, local memory bytes (register spills land there), shared
memory; with PDL, whether every global load of a weight (a load issued before
``griddepcontrol.wait`` in the PTX) precedes the wait and whether ``griddepcontrol.launch_dependents``
follows it; and the global loads narrower than 4 bytes (``ld.global.b16``: a 2-byte load per
element, where a weight row whose alignment the compiler cannot see would go; the few expected ones
are scalars and RoPE table entries). A kernel that fails to compile or spills is a failure (exit
status 1). This checks the local Triton version's code generation; the GPU's Triton may differ
(triton 3.9 gave the MoE down kernel at (4, 8) 104 registers where the GPUs' 3.6 gives 122). To
match the GPU, install its Triton version without dependencies into a directory of its own and put
that first on PYTHONPATH: with triton 3.6.0 so, every kernel of the step compiled to the register
counts ``bench decode_step_ablation bench.decode_step_ablation.regs=true`` read on an H200 (q/k/v
158, attention 178, MoE gate/up 96, MoE down 122, lm_head 95; 2026-11-27; with packed bf16 pairs,
the same day, both places gave o_proj 40, dense gate/up 115, MoE gate/up 64, MoE down 78).
``bench.decode_step_sm90.dump=DIR`` keeps each specialisation's PTX and cubin (``nvdisasm -lrm
count`` on the cubin shows the live registers at every instruction).
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from .config import config_changes

#: the meta-parameters shown in the ``tiles`` column
TILE_KEYS = ("BLOCK_N", "BLOCK_P", "SPLIT_N", "ROWS", "INTER", "TOP_K", "PARTS")


def offline_driver():
    """Just enough of Triton's active driver for ``JITFunction.warmup`` to compile for sm90."""
    from triton.backends.compiler import GPUTarget

    class OfflineSm90Driver:
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

    return OfflineSm90Driver()


def resources(cubin: bytes) -> dict:
    """{'REG': n, 'LOCAL': bytes, 'SHARED': bytes} from the Triton wheel's cuobjdump."""
    import triton

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
    wait = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
    launch = [i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line]
    loads = [i for i, line in enumerate(lines) if re.search(r"\bld\.(volatile\.)?global", line)]
    if not wait:
        return "no griddepcontrol.wait"
    before = sum(1 for i in loads if i < wait[0])
    where = "after" if launch and launch[0] > wait[0] else "NOT after"
    return f"{before} of {len(loads)} before the wait; launch_dependents {where} it"


def run(cfg, opts, device, report) -> None:
    """Compile every kernel of one fused step of ``cfg.model`` for sm90 (module docstring); ``device`` is unused."""
    import triton
    from triton.runtime import driver as triton_driver

    from ..kernels import decode_step as ds
    from ..kernels import decode_step_triton as kt
    from ..models.build import build_model
    from ..variants.fused_step import weights_from_model
    from ..variants.static_kv import StaticKVCache

    dt, L = torch.bfloat16, cfg.model.llm
    model = build_model(cfg.model, "meta", dt)
    cache = StaticKVCache(L.num_layers, 1, L.num_kv_heads, opts.cache_len, L.head_dim, dt, "meta")
    pos = torch.zeros(1, dtype=torch.int64, device="meta")
    compiled, kept = {}, (triton_driver._active, kt._launch, kt.pdl_support)   # _active: None on a CPU

    def warmup(kernel, grid, warps, use_pdl, *a, clock=None, **meta):
        key = (kernel.fn.__name__, tuple(sorted(meta.items())) + (("clock", clock is not None),))
        if key in compiled:
            return
        try:
            compiled[key] = (kernel.warmup(*a, grid=grid, num_warps=warps, **kt.launch_meta(use_pdl, a, meta, clock)),
                             grid, warps)
        except Exception as exc:                      # noqa: BLE001 - named, the other kernels go on
            report.fail(f"{key[0]}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            compiled[key] = None

    triton_driver.set_active(offline_driver())
    kt._launch = warmup
    kt.pdl_support = lambda device: (True, "offline sm90 compile")   # the check reads a CUDA device
    try:
        counts = (torch.zeros(4, L.num_layers, L.n_routed_experts, dtype=torch.int64, device="meta"),
                  torch.zeros(1, dtype=torch.int64, device="meta"))
        step = ds.FusedDecodeStep(weights_from_model(model), cache, pos, pdl=opts.pdl, counts=counts,
                                  config=config_changes(opts.config, ds.DecodeStepConfig(sms=132)))
        step.run()
    finally:
        triton_driver._active = kept[0]
        kt._launch, kt.pdl_support = kept[1], kept[2]
    report.note(f"triton {triton.__version__}, sm90, {'PDL' if opts.pdl else 'no PDL'}, {step.launches} launches "
                f"per step, {L.num_layers} layers")
    columns = ["kernel", "grid", "warps", "regs", "local_bytes", "shared_bytes", "narrow_loads", "tiles"]
    table = report.table("kernels", "each kernel specialisation compiled for sm90",
                         columns + (["pdl_order"] if opts.pdl else []))
    for i, ((name, meta), entry) in enumerate(compiled.items()):
        if entry is None:
            continue
        ck, grid, warps = entry
        if opts.dump:
            Path(opts.dump).mkdir(parents=True, exist_ok=True)
            Path(opts.dump, f"{name}_{i}.ptx").write_text(ck.asm["ptx"])
            Path(opts.dump, f"{name}_{i}.cubin").write_bytes(ck.asm["cubin"])
        res = resources(ck.asm["cubin"])
        if res.get("LOCAL", 0) > 0:
            report.fail(f"{name} {dict(meta)} spills {res['LOCAL']} bytes to local memory")
        tiles = " ".join(f"{k}={v}" for k, v in meta if k in TILE_KEYS)
        extra = {"pdl_order": pdl_order(ck.asm["ptx"])} if opts.pdl else {}
        table.add(kernel=name, grid=str(grid), warps=warps, regs=res.get("REG"), local_bytes=res.get("LOCAL"),
                  shared_bytes=res.get("SHARED"), tiles=tiles,
                  narrow_loads=len(re.findall(r"\bld\.global(?:\.[a-z]+)*\.b16\b", ck.asm["ptx"])), **extra)
