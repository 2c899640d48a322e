"""Compile Triton kernels for an H100/H200 (sm90) on a machine without a GPU, to find compile errors
before a lent GPU does (Triton's interpreter, which the CPU tests use, accepts code the compiler may not).

    python scripts/sm90_compile.py            # every case of ``cases()``; exit 1 naming each one that fails

Each case is a kernel at the model's shapes (64 experts, top-6, batch 32 or 128; the shared expert's two
parts) with one set of compile-time flags: its PTX and cubin are built through the Triton wheel's own
``ptxas``; nothing runs. The local Triton may be another version than the GPU machine's (3.9 here, 3.6
there when this was written): a case that compiles here is likely, not certain, to compile there. Run
without TRITON_INTERPRET (it turns ``triton.jit`` functions into the interpreter's).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def _ptr(t: str) -> str:
    return "*" + t


def _types(fn, ptrs: dict) -> dict:
    """Every runtime argument of ``fn`` an i32, except the pointers named in ``ptrs`` (name -> element type)."""
    return {n: _ptr(ptrs[n]) if n in ptrs else "i32" for n in fn.arg_names}


def cases() -> list:
    """[(label, kernel, {arg: type}, {constexpr: value}, num_warps)]."""
    from harness.kernels import moe_align_triton as ma
    from harness.kernels import router_triton as rt

    out = []
    topk_ptrs = dict(logits_ptr="fp32", idx_ptr="i64", wt_ptr="fp32", counts_ptr="i64", step_ptr="i64",
                     table_ptr="i64", pos_ptr="i64", on_ptr="i1")
    for forced, switch, counts in ((False, False, True), (True, True, False), (True, False, False)):
        consts = dict(TOP_K=6, NORM=False, SCALE=1.0, BLOCK_E=64, BLOCK_TOPK=8, HAS_COUNTS=counts, HAS_FORCED=forced,
                      FORCED_SWITCH=switch)
        out.append((f"router top-k, forced={forced} switch={switch} counts={counts}", rt._topk_kernel,
                    _types(rt._topk_kernel, topk_ptrs), consts, 1))
    align_ptrs = dict(logits_ptr="fp32", wt_ptr="fp32", idx_ptr="i64", table_ptr="i64", pos_ptr="i64",
                      counts_ptr="i64", step_ptr="i64", on_ptr="i1", sorted_ptr="i32", block_expert_ptr="i32",
                      num_padded_ptr="i32", shift_ptr="i32")
    for T, forced, switch, counts in ((32, True, True, True), (32, False, False, True), (128, True, False, False)):
        k, parts, block_m = 6, 2, 16
        max_blocks = (T * k) // block_m + min(64, T * k) + parts * (-(-T // block_m) * block_m) // block_m
        consts = dict(NORM=False, SCALE=1.0, BLOCK_TOPK=8, HAS_FORCED=forced, FORCED_SWITCH=switch, TOP_K=k,
                      BLOCK_M=block_m, ROWS=1 << (T * k - 1).bit_length(), EXPERTS=64,
                      BLOCKS=1 << (max_blocks - 1).bit_length(), PARTS=parts, TOKENS=T, HAS_COUNTS=counts)
        out.append((f"route + align, T={T} forced={forced} switch={switch} counts={counts}", ma._route_align_kernel,
                    _types(ma._route_align_kernel, align_ptrs), consts, 4))
    return out


def compile_sm90(fn, types: dict, consts: dict, num_warps: int):
    """The compiled kernel of ``fn`` for sm90 (raises what the compiler raises)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(fn.arg_names)
    signature = {n: "constexpr" if n in consts else types[n] for n in names}
    constexprs = {(names.index(n),): v for n, v in consts.items()}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("sm90_compile: unset TRITON_INTERPRET (it replaces the kernels with the interpreter's)", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")      # the default the GPU machine's Triton has
    failed = 0
    for label, fn, types, consts, warps in cases():
        t0 = time.perf_counter()
        try:
            kernel = compile_sm90(fn, types, consts, warps)
            print(f"ok    {label}: cubin {len(kernel.asm['cubin']):,} bytes ({time.perf_counter() - t0:.1f} s)")
        except Exception as exc:  # noqa: BLE001 - each case reported, then the exit status
            failed += 1
            print(f"FAIL  {label}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
