"""One SAM attention call on the GPU, dense rel-pos mask against the exact augmented head dim.

    python -m harness bench sam_attention                                   # all cases, SDPA rows
    python -m harness bench sam_attention bench.sam_attention.flex=true bench.sam_attention.triton=true
    python -m harness bench sam_attention bench.sam_attention.compiled=true bench.sam_attention.cuda_graph=true
    python -m harness bench sam_attention bench.sam_attention.smoke=true device=cpu   # the plumbing, on a CPU

Self-contained: random bf16 q, k, v [B, 12, S, 64] and rel-pos tables, no model build. Cases
(B = images, or images x windows; windowed grids are zero-padded to multiples of 14 and the
padded tokens are ordinary tokens, exactly as in the model):

    base_global    B=1   64 x 64 (S=4096)    d' = 192
    large_global   B=1   80 x 80 (S=6400)    d' = 224
    tiles_global   B=6   40 x 40 (S=1600)    d' = 144   (gundam: six 640 px tiles)
    base_window    B=25  14 x 14 (S=196)     d' = 96    (64 -> 70: 5 x 5 windows)
    large_window   B=36  14 x 14 (S=196)     d' = 96    (80 -> 84: 6 x 6 windows)
    b8_global      B=8   64 x 64             base_global for 8 pages
    b32_window     B=800 14 x 14             base_window for 32 pages (one page is too small to fill the GPU)

Rows per case ("full" = from q, k, v and the tables, rel-pos einsums included; "kernel" = the
attention kernel alone on prebuilt inputs):

    dense full / dense kernel           bias [B, 12, S, S] + SDPA (torch picks the backend)
    aug[<backend>] full / kernel        SDPA over q' = [q, rel_h, rel_w], k' = [k, onehots]
                                        for flash (v zero-padded to d'), efficient, cudnn and
                                        cudnn with v padded to 128 (cuDNN's d_qk=192/d_v=128 case)
    flex aug / flex score_mod (flex)    torch.compile(flex_attention) on (q', k', v), and with the
                                        bias gathered in a score_mod (the issue's 2.85 ms row)
    triton (triton)                     harness.kernels.sam_attention_triton (bias added in-kernel)
    aug[cudnn] / triton compiled        (compiled) each path torch.compile'd whole, as in vision_compile's
                                        blocks (inductor fuses the augmentation or the einsums); CUDA only

Times (measured): CUDA events around each call, L2 flushed (256 MB write) before each, median and
IQR over ``reps`` after ``warmup``; eager launches by default (a small window case can be
launch-bound: the span then includes host gaps), CUDA-graph replays with ``cuda_graph`` (run
both). rel err (measured): max|out - ref| / max|ref| against the dense path in fp32 (math backend,
TF32 off) on the same (bf16-rounded) inputs. x dense (derived): dense full ms / ms. TFLOP/s
(derived): useful = 4*B*12*S^2*64 (the dense path's QK^T + PV, counted convention) / time; executed
= what the timed code runs (kernel rows: attention kernel FLOPs; full rows: + rel-pos einsums), from
``sam_attention.{dense,augmented}_cost``. MB (analytic): minimum DRAM bytes of the timed code. A
backend that cannot run is noted ``skipped: ...`` with torch's reason. ``smoke``: two tiny cases in
fp32 on the CPU, timed by the host clock (the times mean nothing).
"""
from __future__ import annotations

import math
import statistics
import zlib

import torch

from .timing import capture, event_ms, flush_buffer

CASES = {  # name: (B, H, W)
    "base_global": (1, 64, 64), "large_global": (1, 80, 80), "tiles_global": (6, 40, 40),
    "base_window": (25, 14, 14), "large_window": (36, 14, 14),
    "b8_global": (8, 64, 64), "b32_window": (800, 14, 14),       # base mode, 8 and 32 pages: a batch's scale
}
SMOKE_CASES = {"smoke_global": (1, 8, 8), "smoke_window": (4, 14, 14)}
HEADS, D = 12, 64
SDPA_ROWS = (("flash", None), ("efficient", None), ("cudnn", None), ("cudnn", 128))
COLUMNS = ["case", "method", "ran", "ms_call", "ms_p25", "ms_p75", "x_dense", "rel_err", "tflops_useful",
           "tflops_exec", "mb"]


def make_case(B: int, H: int, W: int, seed: int, device):
    g = torch.Generator(device=device).manual_seed(seed)
    S = H * W
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    q, k, v = (torch.randn(B, HEADS, S, D, device=device, generator=g).to(dtype) for _ in range(3))
    Rh = (torch.randn(H, H, D, device=device, generator=g) / math.sqrt(D)).to(dtype)
    Rw = (torch.randn(W, W, D, device=device, generator=g) / math.sqrt(D)).to(dtype)
    return q, k, v, Rh, Rw


def reference(q, k, v, Rh, Rw, H, W) -> torch.Tensor:
    """The dense path in fp32, math backend, TF32 off."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ..variants import sam_attention as sa

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


class Case:
    """One case's inputs, reference and timing: ``add`` times a call and adds its row."""

    def __init__(self, name, shape, opts, device, table, report, flush):
        from ..variants import sam_attention as sa

        self.name, (self.B, self.H, self.W) = name, shape
        self.opts, self.device, self.table, self.report, self.flush = opts, device, table, report, flush
        self.q, self.k, self.v, self.Rh, self.Rw = make_case(self.B, self.H, self.W, zlib.crc32(name.encode()), device)
        self.ref = reference(self.q, self.k, self.v, self.Rh, self.Rw, self.H, self.W)
        self.bh = self.B * HEADS
        self.dcost = sa.dense_cost(self.bh, self.H, self.W, D)

    def time(self, fn) -> dict:
        """Median / p25 / p75 ms of ``fn()`` (module docstring); a CUDA graph replay with ``cuda_graph``."""
        cuda = self.device.type == "cuda"
        if self.opts.cuda_graph and cuda:
            fn = capture(fn, warmup=max(self.opts.warmup, 1))[0].replay
        ms = event_ms(fn, self.opts.reps, self.opts.warmup, self.flush, idle=False, cuda=cuda)
        q = statistics.quantiles(ms, n=4)
        return {"ms_call": statistics.median(ms), "ms_p25": q[0], "ms_p75": q[2]}

    def add(self, method, timed, out, cost, kernel_only, backend):
        t = self.time(timed)
        flops = cost.flops_kernel + (0 if kernel_only else cost.flops_relpos)
        nbytes = cost.bytes_kernel + (0 if kernel_only else cost.bytes_prep)
        self.table.add(case=self.name, method=method, ran=backend, **t, rel_err=rel_err(out, self.ref),
                       tflops_useful=cost.flops_useful / t["ms_call"] / 1e9, tflops_exec=flops / t["ms_call"] / 1e9,
                       mb=nbytes)

    def skip(self, text: str) -> None:
        self.report.note(f"skipped: {self.name} {text}")


def bench_case(case: Case) -> None:
    from ..errors import HarnessError
    from ..models import attn_probe
    from ..variants import sam_attention as sa

    q, k, v, Rh, Rw, H, W, B = case.q, case.k, case.v, case.Rh, case.Rw, case.H, case.W, case.B
    S, bh, scale = H * W, case.bh, D ** -0.5
    # dense: what SAMAttention does today
    r_q = q.reshape(bh, H, W, D)
    bias = (torch.einsum("bhwc,hkc->bhwk", r_q, Rh).reshape(B, HEADS, S, H, 1)
            + torch.einsum("bhwc,wkc->bhwk", r_q, Rw).reshape(B, HEADS, S, 1, W)).view(B, HEADS, S, S)
    ran = attn_probe.sdpa_choice(q, k, v, bias)
    case.add("dense full", lambda: sa.dense_bias_attention(q, k, v, Rh, Rw, H, W),
             sa.dense_bias_attention(q, k, v, Rh, Rw, H, W), case.dcost, False, ran)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    case.add("dense kernel", lambda: sdpa(q, k, v, attn_mask=bias), sdpa(q, k, v, attn_mask=bias), case.dcost, True,
             ran)
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
            case.skip(f"{label} (d_qk={dp}): {str(exc).splitlines()[0]}")
            continue
        cost = sa.augmented_cost(bh, H, W, D, dv_x=dvx)
        ran = f"sdpa:{backend} d_qk={dp} d_v={dvx}"
        case.add(f"{label} full", lambda: sa.augmented_attention(q, k, v, Rh, Rw, H, W, backend=backend,
                                                                 pad_v_to=pad_v_to), out, cost, False, ran)
        case.add(f"{label} kernel", lambda: sa.run_sdpa(backend, q_aug, k_aug, v_x, scale),
                 sa.run_sdpa(backend, q_aug, k_aug, v_x, scale)[..., :D], cost, True, ran)
    try:
        case.report.note(f"{case.name}: backend='auto' picks {sa.resolve_backend('auto', q_aug, v)} "
                         f"(AUTO_ORDER_CUDA={sa.AUTO_ORDER_CUDA})")
    except HarnessError as exc:
        case.report.note(f"{case.name}: backend='auto' fails: {exc}")
    if case.opts.flex:
        bench_flex(case, q_aug, k_aug)
    if case.opts.triton:
        bench_triton(case)
    if case.opts.compiled:
        bench_compiled(case)


def bench_compiled(case: Case) -> None:
    """The cuDNN-augmented and Triton paths from q, k, v and the tables, each torch.compile'd whole, as
    inside vision_compile's blocks (inductor fuses the augmentation, or the einsums, around the kernel)."""
    from .. import sam_attention_tiles as tiles
    from ..variants import sam_attention as sa

    q, k, v, Rh, Rw, H, W = case.q, case.k, case.v, case.Rh, case.Rw, case.H, case.W
    if not q.is_cuda:
        case.skip("compiled rows: they need CUDA (inductor's GPU code)")
        return
    qs, ks = tiles.slots(H, W)
    paths = {"aug[cudnn] compiled": (lambda q, k, v: sa.augmented_attention(q, k, v, Rh, Rw, H, W, backend="cudnn"),
                                     sa.augmented_cost(case.bh, H, W, D), "sdpa:cudnn"),
             "triton compiled": (lambda q, k, v: sa.triton_attention(q, k, v, Rh, Rw, H, W).permute(0, 2, 1, 3),
                                 sa.inkernel_bias_cost(case.bh, H, W, D, key_slots=ks, query_slots=qs),
                                 "triton (custom op)")}
    torch._dynamo.reset()          # each case compiles anew (guards on its tables): stay under the recompile limit
    for label, (fn, cost, ran) in paths.items():
        compiled = torch.compile(fn, dynamic=False)
        try:
            out = compiled(q, k, v)
        except Exception as exc:  # noqa: BLE001 - compile or lowering errors: noted, not hidden
            case.skip(f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            continue
        case.add(f"{label} full", lambda compiled=compiled: compiled(q, k, v), out, cost, False, ran)


def bench_flex(case: Case, q_aug, k_aug) -> None:
    from ..variants import sam_attention as sa

    q, k, v, Rh, Rw, H, W = case.q, case.k, case.v, case.Rh, case.Rw, case.H, case.W
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError as exc:
        case.skip(f"flex: {exc}")
        return
    flex = torch.compile(flex_attention, dynamic=False)
    try:
        out = flex(q_aug, k_aug, v, scale=D ** -0.5)
    except Exception as exc:  # noqa: BLE001 - compile or lowering errors: noted, not hidden
        case.skip(f"flex aug: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    else:
        case.add("flex aug kernel", lambda: flex(q_aug, k_aug, v, scale=D ** -0.5), out,
                 sa.augmented_cost(case.bh, H, W, D), True, "flex_attention")
    try:
        B, S = q.shape[0], H * W
        r_q = q.reshape(B * HEADS, H, W, D)
        rel_h = torch.einsum("bhwc,hkc->bhwk", r_q, Rh).reshape(B, HEADS, S, H)
        rel_w = torch.einsum("bhwc,wkc->bhwk", r_q, Rw).reshape(B, HEADS, S, W)

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + rel_h[b, h, q_idx, kv_idx // W] + rel_w[b, h, q_idx, kv_idx % W]

        out = flex(q, k, v, score_mod=score_mod)
    except Exception as exc:  # noqa: BLE001
        case.skip(f"flex score_mod: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    else:
        case.add("flex score_mod kernel", lambda: flex(q, k, v, score_mod=score_mod), out,
                 sa.inkernel_bias_cost(case.bh, H, W, D), True, "flex_attention")


def bench_triton(case: Case) -> None:
    from ..variants import sam_attention as sa

    q, k, v, Rh, Rw, H, W = case.q, case.k, case.v, case.Rh, case.Rw, case.H, case.W
    from .. import sam_attention_tiles as tiles
    try:
        from ..kernels import sam_attention_triton as st
    except ImportError as exc:
        case.skip(f"triton: {exc}")
        return
    short = {"bm": "bm", "bn": "bn", "rows": "r", "num_warps": "w", "num_stages": "s", "hoist_rw": "hoist"}
    for cfg in st.bench_configs(H, W, H * W):
        label = "triton[" + " ".join(f"{short[key]}{int(val)}" for key, val in cfg.items()) + "]"

        def call(cfg=cfg):     # [B, nh, S, D] view of the kernel's [B, S, nh, D], as the reference
            return sa.triton_attention(q, k, v, Rh, Rw, H, W, **cfg).permute(0, 2, 1, 3)
        try:
            out = call()
        except Exception as exc:  # noqa: BLE001
            case.skip(f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            continue
        cost = sa.inkernel_bias_cost(case.bh, H, W, D, key_slots=st.key_slots(H, W, cfg["bn"], cfg.get("rows", 1)),
                                     query_slots=tiles.query_slots(H * W, cfg["bm"]))
        case.add(f"{label} full", call, out, cost, False, "triton")


def run(cfg, opts, device, report) -> None:
    """The bench (module docstring) on ``device`` (CUDA; the CPU with ``smoke``)."""
    smoke = device.type == "cpu"
    cases = SMOKE_CASES if smoke else {c: CASES[c] for c in opts.cases}
    if smoke:
        report.note(f"CPU SMOKE (plumbing only, fp32, host clock; cases {', '.join(SMOKE_CASES)}) | torch "
                    f"{torch.__version__}")
    else:
        p = torch.cuda.get_device_properties(device)
        report.note(f"{p.name} sm{p.major}{p.minor} | torch {torch.__version__} CUDA {torch.version.cuda} cuDNN "
                    f"{torch.backends.cudnn.version()} | bf16, {HEADS} heads x {D}, reps {opts.reps}"
                    f"{', CUDA-graph replays' if opts.cuda_graph else ', eager launches'}")
    flush = None if smoke else flush_buffer(device)
    table = report.table("sam_attention", "one SAM attention call per row", COLUMNS)
    for name, shape in cases.items():
        bench_case(Case(name, shape, opts, device, table, report, flush))
    dense = {r["case"]: r["ms_call"] for r in table.rows if r["method"] == "dense full"}
    for r in table.rows:
        r["x_dense"] = dense[r["case"]] / r["ms_call"] if r["case"] in dense else None
