"""GPU micro-benchmark: one SAM attention call, dense rel-pos mask vs the exact augmented head dim.

Self-contained: random bf16 q, k, v [B, 12, S, 64] and rel-pos tables, no model build. Cases
(B = images, or images x windows; windowed grids are zero-padded to multiples of 14 and the
padded tokens are ordinary tokens, exactly as in the model):

    base_global    B=1   64 x 64 (S=4096)    d' = 192
    large_global   B=1   80 x 80 (S=6400)    d' = 224
    tiles_global   B=6   40 x 40 (S=1600)    d' = 144   (gundam: six 640 px tiles)
    base_window    B=25  14 x 14 (S=196)     d' = 96    (64 -> 70: 5 x 5 windows)
    large_window   B=36  14 x 14 (S=196)     d' = 96    (80 -> 84: 6 x 6 windows)

Rows per case ("full" = from q, k, v and the tables, rel-pos einsums included; "kernel" = the
attention kernel alone on prebuilt inputs):

    dense full / dense kernel           bias [B, 12, S, S] + SDPA (torch picks the backend)
    aug[<backend>] full / kernel        SDPA over q' = [q, rel_h, rel_w], k' = [k, onehots]
                                        for flash (v zero-padded to d'), efficient, cudnn and
                                        cudnn with v padded to 128 (cuDNN's d_qk=192/d_v=128 case)
    flex aug / flex score_mod (--flex)  torch.compile(flex_attention) on (q', k', v), and with the
                                        bias gathered in a score_mod (the issue's 2.85 ms row)
    triton (--triton)                   harness.kernels.sam_attention_triton (bias added in-kernel)

Times: CUDA events around each call, L2 flushed (256 MB write) before each, median and IQR over
--reps after --warmup; eager launches by default (a small window case can be launch-bound: the
span then includes host gaps), CUDA-graph replays with --cuda-graph (run both). Error: max|out - ref| / max|ref| against the dense path in fp32 (math
backend, TF32 off) on the same (bf16-rounded) inputs. TFLOP/s: useful = 4*B*12*S^2*64 (the
dense path's QK^T + PV, counted convention) / time; executed = what the timed code runs
(kernel rows: attention kernel FLOPs; full rows: + rel-pos einsums), from
``sam_attention.{dense,augmented}_cost``. Bytes: analytic minimum DRAM bytes of the timed code.
A backend that cannot run prints ``skipped: ...`` with torch's reason; the table comes last.

    python scripts/bench_sam_attention.py                       # all cases, SDPA rows
    python scripts/bench_sam_attention.py --flex --triton --csv runs/sam_attn.csv
"""
from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from harness.errors import HarnessError  # noqa: E402
from harness.models import attn_probe  # noqa: E402
from harness.variants import sam_attention as sa  # noqa: E402

CASES = {  # name: (B, H, W)
    "base_global": (1, 64, 64), "large_global": (1, 80, 80), "tiles_global": (6, 40, 40),
    "base_window": (25, 14, 14), "large_window": (36, 14, 14),
}
SMOKE_CASES = {"smoke_global": (1, 8, 8), "smoke_window": (4, 14, 14)}
HEADS, D = 12, 64
DEVICE = "cuda"
SDPA_ROWS = (("flash", None), ("efficient", None), ("cudnn", None), ("cudnn", 128))


def time_cuda(fn, warmup: int, reps: int, graph: bool = False) -> dict:
    """Median / p25 / p75 ms of ``fn()`` by CUDA events, L2 flushed before every call
    (host perf_counter under --cpu-smoke: plumbing only). With ``graph`` the call is captured
    once in a CUDA graph and replayed, so host launch gaps drop out of the GPU span."""
    for _ in range(warmup):
        fn()
    if graph and DEVICE == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
        fn()
    if DEVICE == "cpu":
        ms = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ms.append((time.perf_counter() - t0) * 1e3)
        q = statistics.quantiles(ms, n=4)
        return {"ms": statistics.median(ms), "p25": q[0], "p75": q[2]}
    flush = torch.empty(256 * 2 ** 20, dtype=torch.uint8, device="cuda")
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    q = statistics.quantiles(ms, n=4)
    return {"ms": statistics.median(ms), "p25": q[0], "p75": q[2]}


def make_case(B: int, H: int, W: int, seed: int):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    S = H * W
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    q, k, v = (torch.randn(B, HEADS, S, D, device=DEVICE, generator=g).to(dtype) for _ in range(3))
    Rh = (torch.randn(H, H, D, device=DEVICE, generator=g) / math.sqrt(D)).to(dtype)
    Rw = (torch.randn(W, W, D, device=DEVICE, generator=g) / math.sqrt(D)).to(dtype)
    return q, k, v, Rh, Rw


def reference(q, k, v, Rh, Rw, H, W) -> torch.Tensor:
    """The dense path in fp32, math backend, TF32 off."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with sdpa_kernel(SDPBackend.MATH):
            f = [t.float() for t in (q, k, v, Rh, Rw)]
            return sa.dense_bias_attention(*f, H, W)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def rel_err(out, ref) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def bench_case(name, args, rows, skipped):
    B, H, W = CASES[name]
    S, bh = H * W, B * HEADS
    q, k, v, Rh, Rw = make_case(B, H, W, seed=zlib.crc32(name.encode()))
    ref = reference(q, k, v, Rh, Rw, H, W)
    dcost = sa.dense_cost(bh, H, W, D)
    scale = D ** -0.5

    def add(method, timed, out, cost, kernel_only, backend):
        t = time_cuda(timed, args.warmup, args.reps, graph=args.cuda_graph)
        flops = cost.flops_kernel + (0 if kernel_only else cost.flops_relpos)
        nbytes = cost.bytes_kernel + (0 if kernel_only else cost.bytes_prep)
        rows.append({"case": name, "method": method, "ran": backend, "ms": t["ms"], "p25": t["p25"], "p75": t["p75"],
                     "rel_err": rel_err(out, ref), "tflops_useful": cost.flops_useful / t["ms"] / 1e9,
                     "tflops_exec": flops / t["ms"] / 1e9, "mb_analytic": nbytes / 1e6})

    # dense: what SAMAttention does today
    r_q = q.reshape(bh, H, W, D)
    bias = (torch.einsum("bhwc,hkc->bhwk", r_q, Rh).reshape(B, HEADS, S, H, 1)
            + torch.einsum("bhwc,wkc->bhwk", r_q, Rw).reshape(B, HEADS, S, 1, W)).view(B, HEADS, S, S)
    ran = attn_probe.sdpa_choice(q, k, v, bias)
    add("dense full", lambda: sa.dense_bias_attention(q, k, v, Rh, Rw, H, W), sa.dense_bias_attention(q, k, v, Rh, Rw, H, W),
        dcost, False, ran)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    add("dense kernel", lambda: sdpa(q, k, v, attn_mask=bias), sdpa(q, k, v, attn_mask=bias), dcost, True, ran)
    bias = None  # free the mask before the next rows

    # augmented, one explicit SDPA backend at a time
    q_aug, k_aug = sa.augment_qk(q, k, Rh, Rw, H, W)
    dp = q_aug.shape[-1]
    for backend, pad_v_to in SDPA_ROWS:
        label = f"aug[{backend}{'' if pad_v_to is None else f',v{pad_v_to}'}]"
        if pad_v_to is not None and dp <= pad_v_to:
            continue  # the v-padding row only matters where d' exceeds it
        try:
            dvx = sa.v_dim_for(backend, dp, D, pad_v_to)
            v_x = torch.nn.functional.pad(v, (0, dvx - D)) if dvx != D else v
            reasons = sa.backend_reasons(backend, q_aug, k_aug, v_x) if q.is_cuda else []
            if reasons:
                raise HarnessError("; ".join(reasons))
            out = sa.augmented_attention(q, k, v, Rh, Rw, H, W, backend=backend, pad_v_to=pad_v_to)
        except (HarnessError, RuntimeError) as exc:
            skipped.append(f"skipped: {name} {label} (d_qk={dp}): {str(exc).splitlines()[0]}")
            continue
        cost = sa.augmented_cost(bh, H, W, D, dv_x=dvx)
        add(f"{label} full", lambda: sa.augmented_attention(q, k, v, Rh, Rw, H, W, backend=backend, pad_v_to=pad_v_to),
            out, cost, False, f"sdpa:{backend} d_qk={dp} d_v={dvx}")
        add(f"{label} kernel", lambda: sa.run_sdpa(backend, q_aug, k_aug, v_x, scale),
            sa.run_sdpa(backend, q_aug, k_aug, v_x, scale)[..., :D], cost, True, f"sdpa:{backend} d_qk={dp} d_v={dvx}")
    try:
        print(f"info: {name}: backend='auto' picks {sa.resolve_backend('auto', q_aug, v)} (AUTO_ORDER_CUDA={sa.AUTO_ORDER_CUDA})")
    except HarnessError as exc:
        print(f"info: {name}: backend='auto' fails: {exc}")

    if args.flex:
        bench_flex(name, args, q, k, v, Rh, Rw, q_aug, k_aug, H, W, rows, skipped, add, dcost)
    if args.triton:
        bench_triton(name, args, q, k, v, Rh, Rw, H, W, rows, skipped, add, dcost)


def bench_flex(name, args, q, k, v, Rh, Rw, q_aug, k_aug, H, W, rows, skipped, add, dcost):
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError as exc:
        skipped.append(f"skipped: {name} flex: {exc}")
        return
    flex = torch.compile(flex_attention, dynamic=False)
    try:
        out = flex(q_aug, k_aug, v, scale=D ** -0.5)
    except Exception as exc:  # compile or lowering errors: report, don't hide
        skipped.append(f"skipped: {name} flex aug: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    else:
        cost = sa.augmented_cost(q.shape[0] * HEADS, H, W, D)
        add("flex aug kernel", lambda: flex(q_aug, k_aug, v, scale=D ** -0.5), out, cost, True, "flex_attention")
    try:
        B, S = q.shape[0], H * W
        r_q = q.reshape(B * HEADS, H, W, D)
        rel_h = torch.einsum("bhwc,hkc->bhwk", r_q, Rh).reshape(B, HEADS, S, H)
        rel_w = torch.einsum("bhwc,wkc->bhwk", r_q, Rw).reshape(B, HEADS, S, W)

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + rel_h[b, h, q_idx, kv_idx // W] + rel_w[b, h, q_idx, kv_idx % W]

        out = flex(q, k, v, score_mod=score_mod)
    except Exception as exc:
        skipped.append(f"skipped: {name} flex score_mod: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    else:
        cost = sa.inkernel_bias_cost(B * HEADS, H, W, D)
        add("flex score_mod kernel", lambda: flex(q, k, v, score_mod=score_mod), out, cost, True, "flex_attention")


def bench_triton(name, args, q, k, v, Rh, Rw, H, W, rows, skipped, add, dcost):
    try:
        from harness.kernels import sam_attention_triton as st
    except ImportError as exc:
        skipped.append(f"skipped: {name} triton: {exc}")
        return
    bh = q.shape[0] * HEADS
    for cfg in st.bench_configs(H, W, H * W):
        short = {"bm": "bm", "bn": "bn", "num_warps": "w", "num_stages": "s", "hoist_rw": "hoist"}
        label = "triton[" + " ".join(f"{short[k]}{int(v)}" for k, v in cfg.items()) + "]"
        try:
            out = st.rel_bias_attention(q, k, v, Rh, Rw, H, W, **cfg)
        except Exception as exc:
            skipped.append(f"skipped: {name} {label}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            continue
        cost = sa.inkernel_bias_cost(bh, H, W, D, st.key_slots(H, W, cfg["bn"]))
        add(f"{label} full", lambda: st.rel_bias_attention(q, k, v, Rh, Rw, H, W, **cfg), out, cost, False, "triton")


def print_table(rows, skipped, header):
    for line in skipped:
        print(line)
    print()
    print(header)
    cols = [("case", 13, "s"), ("method", 38, "s"), ("ran", 34, "s"), ("ms", 8, ".3f"), ("p25", 8, ".3f"),
            ("p75", 8, ".3f"), ("x_dense", 7, ".2f"), ("rel_err", 9, ".2e"), ("tflops_useful", 13, ".1f"),
            ("tflops_exec", 11, ".1f"), ("mb_analytic", 11, ".1f")]
    print(" ".join(f"{c:<{n}}" if f == "s" else f"{c:>{n}}" for c, n, f in cols))
    dense = {r["case"]: r["ms"] for r in rows if r["method"] == "dense full"}
    for r in rows:
        r["x_dense"] = dense[r["case"]] / r["ms"] if r["case"] in dense else float("nan")
        print(" ".join(f"{r[c]:<{n}}" if f == "s" else f"{r[c]:>{n}{f}}" for c, n, f in cols))
    print("columns: ms/p25/p75 measured (CUDA events, L2 flushed); x_dense = dense full ms / ms (derived); "
          "rel_err vs fp32 dense (measured); tflops_* derived from analytic FLOPs; mb_analytic = analytic min DRAM bytes")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {list(CASES)}")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--flex", action="store_true", help="add flex_attention rows (compiles: slow start)")
    ap.add_argument("--triton", action="store_true", help="add the Triton in-kernel-bias rows")
    ap.add_argument("--csv", type=Path, help="also write the rows to this CSV")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="time CUDA-graph replays (no host launch gaps: small window cases are launch-bound)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run the script's plumbing on the CPU (fp32, tiny cases, --cases ignored; times mean nothing)")
    args = ap.parse_args(argv)
    global DEVICE
    if args.cpu_smoke:
        DEVICE = "cpu"
        CASES.clear()
        CASES.update(SMOKE_CASES)
        args.cases = ",".join(SMOKE_CASES)
    elif not torch.cuda.is_available():
        print("error: needs a CUDA device (this is a GPU benchmark; --cpu-smoke checks the plumbing)")
        return 2
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        print(f"error: unknown case(s) {unknown}; choose from {list(CASES)}")
        return 2
    rows, skipped = [], []
    for name in cases:
        bench_case(name, args, rows, skipped)
    if DEVICE == "cpu":
        header = f"CPU SMOKE (plumbing only, fp32, host clock) | torch {torch.__version__}"
    else:
        p = torch.cuda.get_device_properties(0)
        header = (f"{p.name} sm{p.major}{p.minor} | torch {torch.__version__} CUDA {torch.version.cuda} "
                  f"cuDNN {torch.backends.cudnn.version()} | bf16, {HEADS} heads x {D}, reps {args.reps}"
                  f"{', CUDA-graph replays' if args.cuda_graph else ', eager launches'}")
    print_table(rows, skipped, header)
    if args.csv:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        with args.csv.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
