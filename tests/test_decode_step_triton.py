"""The fused decode step's Triton kernels (``harness.kernels.decode_step_triton``) against torch.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py before
the first kernel import), where bf16 rounds to nearest-even through the kernels' emulation. Most
inputs sit on coarse grids (multiples of 1/64, small integers) so every product and sum is exact in
fp32: the kernels must then equal the eager vendor math bit for bit, in fp32 and in bf16, whatever
their summation order (compiled on a GPU: within one ulp, ``assert_exact``). The RMSNorm inputs are "norm-exact" rows: entries +-1 and +-3 in the ratio
5:3 over a power-of-two length give a mean square of exactly 4, so with eps = 0 the norm scales by
exactly 1/2. Where a transcendental function enters (exp in softmax and silu), the tolerance is
stated at the assertion.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import DEV, needs_triton
from harness.models.llm import MoEGate, RMSNorm, RotaryEmbedding, rotate_half
from harness.errors import HarnessError

pytestmark = needs_triton

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    """Small tensors: more OpenMP threads only wait for each other on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def kt():
    from harness.kernels import decode_step_triton
    return decode_step_triton


def grid(shape, g, lo=-8, hi=8, den=64):
    """Integers in [lo, hi] / den (exact in bf16)."""
    return torch.randint(lo, hi + 1, shape, generator=g) / den


def norm_exact_row(H, g):
    """A row of +-1 (5/8 of it) and +-3 (3/8): mean square exactly 4 (H a multiple of 8)."""
    mag = torch.ones(H)
    mag[: 3 * H // 8] = 3.0
    sign = torch.randint(0, 2, (H,), generator=g) * 2 - 1
    return (mag * sign)[torch.randperm(H, generator=g)]


def vendor_norm(x, w, eps):
    norm = RMSNorm(x.shape[-1], eps).to(x.dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
        return norm(x)


def on(*ts):
    return [t.to(DEV) for t in ts]


def assert_exact(got, want, dtype, scale=None):
    """Bit for bit in Triton's interpreter. Compiled on a GPU (an approximate rsqrt in the norms, a
    rounding of the RoPE terms that the existing q/k/v test saw differ on an H200; not run here):
    within one bf16 ulp, or 1e-6 in fp32, of ``scale`` (the magnitude of the terms; default |want|)."""
    got = got.cpu()
    if DEV == "cpu":
        assert torch.equal(got, want)
        return
    scale = want.double().abs() if scale is None else scale
    bound = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-6
    assert bool(((got.double() - want.double()).abs() <= bound * scale).all())


def test_k_parts_split_a_length_into_power_of_two_tiles():
    k = kt()
    # 1280 = 1024 + 256; 896 = 512 + 384 -> 512 masked; 6848 = 4096 + 2752 -> 4096; 64 is one tile
    assert [k.k_parts(n) for n in (1280, 896, 6848, 64, 1)] == [(1024, 256), (512, 512), (4096, 4096), (64, 0), (1, 0)]
    # three tiles: 896 = 512 + 256 + 128; 1712 = 1024 + 512 + 176 -> 256 masked; 27 = 16 + 8 + 3 -> 4;
    # 1280 = 1024 + 256 and nothing left
    assert [k.k_parts(n, 3) for n in (896, 1712, 27, 1280)] == [(512, 256, 128), (1024, 512, 256), (16, 8, 4),
                                                               (1024, 256, 0)]
    assert k.k_parts(5, 1) == (8,)
    for bad in ((0, 2), (5, 0)):
        with pytest.raises(HarnessError):
            k.k_parts(*bad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("embed", [False, True])
def test_qkv_rope_equals_norm_linear_rope_and_cache_write(dtype, embed):
    """RMSNorm, the q/k/v linear, RoPE from the table at the device position and the KV write equal
    the eager vendor ops bit for bit (exact inputs); the embedding variant also writes h; the other
    cache positions are untouched. 64 column pairs in 4 tiles of 16, one program each; program 0
    writes the normed x when asked."""
    k = kt()
    g = torch.Generator().manual_seed(3 + embed)
    H, nh, nkv, d, L, pos = 64, 4, 2, 16, 12, 7
    x = norm_exact_row(H, g).to(dtype)
    ln = grid((H,), g, -8, 8, 8).to(dtype)
    w = grid(((nh + 2 * nkv) * d, H), g).to(dtype)
    cos, sin = RotaryEmbedding(d, 10000.0)(x, torch.arange(L)[None])
    kc, vc = (torch.randn(1, nkv, L, d, generator=g).to(dtype) for _ in range(2))
    xn = vendor_norm(x[None], ln, 0.0)
    q, kk, v = F.linear(xn.float(), w.float()).to(dtype).split([nh * d, nkv * d, nkv * d], dim=-1)
    q, kk, v = (t.view(-1, d) for t in (q, kk, v))
    c, s = cos[0, pos], sin[0, pos]
    want_q, want_k = (t * c + rotate_half(t) * s for t in (q, kk))
    table = torch.randn(50, H, generator=g).to(dtype)
    table[41] = x
    h = torch.zeros(H, dtype=dtype) if embed else x.clone()
    hd, lnd, wd, cd, sd, kcd, vcd = on(h, ln, w, cos[0], sin[0], kc.clone(), vc.clone())
    qd = torch.zeros(nh * d, dtype=dtype, device=DEV)
    xn_out = torch.zeros(H, dtype=dtype, device=DEV)
    k.qkv_rope(hd, lnd, wd, cd, sd, torch.tensor([pos], device=DEV), qd, kcd, vcd, 0.0,
               embed=table.to(DEV) if embed else None, token=torch.tensor([41], device=DEV) if embed else None,
               xn_out=xn_out, tile=(16, 4))
    assert_exact(xn_out, xn[0], dtype)
    terms = [(t.double().abs() + rotate_half(t).double().abs()) for t in (q, kk)]   # |t cos| + |rot(t) sin| bound
    assert_exact(qd, want_q.reshape(-1), dtype, terms[0].reshape(-1))
    assert_exact(kcd[0, :, pos], want_k, dtype, terms[1])
    assert_exact(vcd[0, :, pos], v, dtype)
    others = [p for p in range(L) if p != pos]
    assert torch.equal(kcd[0, :, others].cpu(), kc[0, :, others])
    assert torch.equal(vcd[0, :, others].cpu(), vc[0, :, others])
    assert torch.equal(hd.cpu(), x)                     # the embedding row is the residual stream


def attention_reference(q, kc, vc, pos):
    """float64 softmax(q.k / sqrt(d) over keys 0..pos).v, KV heads repeated to the query heads."""
    nh, d = q.shape
    rep = nh // kc.shape[1]
    k_, v_ = (t[0].double().repeat_interleave(rep, 0)[:, :pos + 1] for t in (kc, vc))
    s = torch.einsum("hd,hnd->hn", q.double(), k_) * d ** -0.5
    return torch.einsum("hn,hnd->hd", s.softmax(-1), v_)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("nh,nkv,L,split,pos", [
    (2, 2, 40, 16, 0),          # one key: one split, written directly, no combine
    (2, 1, 40, 16, 33),         # GQA 2:1, 3 splits combined by the last; the new key in the third
    (2, 2, 40, 16, 15),         # the new key is the last of a full split
    (1, 1, 40, 16, 39),         # the last position of a buffer that is not a multiple of the split
])
def test_attention_matches_float64(dtype, tol, nh, nkv, L, split, pos):
    """Positions past ``pos`` hold NaN (a kernel that read them would return NaN); the counters are
    back at zero afterwards (the next layer relies on it)."""
    k = kt()
    g = torch.Generator().manual_seed(pos + nh)
    d = 16
    q = torch.randn(nh, d, generator=g).to(dtype)
    kc, vc = (torch.randn(1, nkv, L, d, generator=g).to(dtype) for _ in range(2))
    kc[:, :, pos + 1:] = float("nan")
    vc[:, :, pos + 1:] = float("nan")
    splits = k.attention_splits(L, split)
    out = torch.zeros(nh * d, dtype=dtype, device=DEV)
    acc, m, ls = (torch.zeros(nh * splits, *s, device=DEV) for s in ((d,), (), ()))
    sem = torch.zeros(nh, dtype=torch.int32, device=DEV)
    qd, kcd, vcd = on(q.reshape(-1), kc, vc)
    k.attention(qd, kcd, vcd, torch.tensor([pos], device=DEV), out, acc, m, ls, sem, tile=(split, 4))
    ref = attention_reference(q, kc, vc, pos).reshape(-1)
    assert torch.isfinite(out.cpu()).all()
    assert float((out.cpu().double() - ref).abs().max() / ref.abs().max()) <= tol
    assert int(sem.count_nonzero()) == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_down_residual_rounds_the_linear_then_the_sum(dtype, parts):
    """h + F.linear(x, w), each rounded to the dtype (eager order), bit for bit on exact inputs, with
    the reduction (K = 90) cut into 1, 2 or 3 parts (fp32 partials of 90, 45 or 30 columns: tiles
    64 + 16 + 16 of which 10 read, 32 + 8 + 8 of 5, 16 + 8 + 8 of 6) summed in one program per output
    block (N = 40 in 3 blocks of 16: a partial block), each holding its block's parts."""
    k = kt()
    g = torch.Generator().manual_seed(5)
    x, w, h = grid((90,), g).to(dtype), grid((40, 90), g).to(dtype), grid((40,), g, -64, 64, 16).to(dtype)
    want = h + F.linear(x[None], w)[0]
    hd = h.clone().to(DEV)
    k.down_residual(x.to(DEV).view(parts, -1), w.to(DEV), hd, tile=(16, 4))
    assert_exact(hd, want, dtype)


def _gate(E, k, H, norm, scale, w):
    import types

    cfg = types.SimpleNamespace(num_experts_per_tok=k, norm_topk_prob=norm, routed_scaling_factor=scale,
                                n_routed_experts=E, hidden_size=H)
    gate = MoEGate(cfg).to(w.dtype)
    with torch.no_grad():
        gate.weight.copy_(w)
    return gate


def _router_buffers(H, E, top_k, dtype):
    f = lambda *s, dt=torch.float32: torch.zeros(s, dtype=dt, device=DEV)  # noqa: E731
    return dict(xn=f(H, dt=dtype), logits=f(E), sem=f(1, dt=torch.int32), ids=f(top_k, dt=torch.int64), wts=f(top_k))


@pytest.mark.parametrize("programs", [4, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E,top_k,norm,scale", [(8, 2, False, 1.0), (16, 3, True, 2.5)])
def test_route_normalises_then_matches_moegate(dtype, E, top_k, norm, scale, programs):
    """xn = post_attention_layernorm(h) bit for bit; the experts equal MoEGate's on xn (as a set;
    the kernel's order is descending weight) and their weights agree to 1e-6 relative (softmax's
    exp: numpy's against torch's); every program's logits reach the last one (4 programs, the
    semaphore left zero), or one program holds every gate row and chooses without the semaphore
    (left as it was: 5 here)."""
    k = kt()
    g = torch.Generator().manual_seed(E + top_k)
    H = 64
    h = norm_exact_row(H, g).to(dtype)
    ln = grid((H,), g, -8, 8, 8).to(dtype)
    w = grid((E, H), g).to(dtype)
    xn = vendor_norm(h[None], ln, 0.0)
    with torch.no_grad():
        ref_i, ref_w = _gate(E, top_k, H, norm, scale, w)(xn)
    b = _router_buffers(H, E, top_k, dtype)
    b["sem"].fill_(0 if programs > 1 else 5)
    k.route(*on(h, ln, w), b["xn"], b["logits"], b["sem"], b["ids"], b["wts"], 0.0, top_k, norm, scale,
            tile=(E // programs, 2))
    assert_exact(b["xn"], xn[0], dtype)
    order = ref_i[0].argsort()
    got = b["ids"].cpu().sort()
    assert torch.equal(got.values, ref_i[0][order])
    assert float(((b["wts"].cpu()[got.indices] - ref_w[0][order]).abs() / ref_w[0][order]).max()) <= 1e-6
    assert (b["wts"][:-1] >= b["wts"][1:]).all() and int(b["sem"]) == (0 if programs > 1 else 5)


def test_route_takes_a_forced_table():
    """A forced table replaces the top-k by its experts at the device position, weighted by their
    softmax probabilities."""
    k = kt()
    g = torch.Generator().manual_seed(11)
    H, E, top_k, layer = 64, 8, 2, 1
    h, ln, w = norm_exact_row(H, g), torch.ones(H), grid((E, H), g)
    xn = vendor_norm(h[None], ln, 0.0)
    probs = F.linear(xn, w).softmax(-1)[0]
    b = _router_buffers(H, E, top_k, torch.float32)
    args = (*on(h, ln, w), b["xn"], b["logits"], b["sem"], b["ids"], b["wts"], 0.0, top_k, False, 1.0)
    table = torch.zeros(1, 6, 2, top_k, dtype=torch.int64)
    table[0, 4, layer] = torch.tensor([5, 0])              # position 4, this layer: experts 5 and 0
    for tile in ((4, 2), (8, 2)):                           # 2 programs, and 1 holding every row
        b["ids"].zero_()
        k.route(*args, forced=(table.to(DEV), torch.tensor([4], device=DEV), layer), tile=tile)
        assert b["ids"].cpu().tolist() == [5, 0]
        assert torch.allclose(b["wts"].cpu(), probs[[5, 0]], rtol=1e-6, atol=0)


def test_lm_head_counts_the_routing_of_every_moe_layer_per_step():
    """counts[min(step, steps), l, e] += 1 for the experts e = ids[l] of each MoE layer l listed (the
    dense layer 0's row of ids is not counted), at the step index read on the device (a buffer of
    steps + 1 = 3 rows: step 1 counts into row 1, steps 2 and 5 into the last row), once per launch
    whatever the number of programs (4 here); counts without the step index are refused."""
    k = kt()
    g = torch.Generator().manual_seed(12)
    H, V, E = 64, 40, 8
    h, ln, w = norm_exact_row(H, g), torch.ones(H), grid((V, H), g)
    ids = torch.tensor([[7, 7], [6, 1], [3, 0]])                # layer 0 dense: its row is ignored
    moe = torch.tensor([1, 2])
    counts = torch.zeros(3, 3, E, dtype=torch.int64, device=DEV)
    logits, pmax, pidx = torch.zeros(V, device=DEV), torch.zeros(4, device=DEV), torch.zeros(4, dtype=torch.int32,
                                                                                               device=DEV)
    sem, token, pos = torch.zeros(1, dtype=torch.int32, device=DEV), torch.zeros(1, dtype=torch.int64, device=DEV), \
        torch.tensor([3], device=DEV)
    step = torch.tensor([1], device=DEV)
    args = (*on(h, ln, w), logits, pmax, pidx, sem, token, pos, 0.0)
    k.lm_head_argmax(*args, step=step, counts=(counts, *on(ids, moe)), tile=(8, 4))
    want = torch.zeros(3, 3, E, dtype=torch.int64)
    want[1, 1, [6, 1]] = 1
    want[1, 2, [3, 0]] = 1
    assert torch.equal(counts.cpu(), want) and int(step) == 2
    k.lm_head_argmax(*args, step=step, counts=(counts, *on(ids, moe)), tile=(8, 4))   # step 2: the last row
    step.fill_(5)
    k.lm_head_argmax(*args, step=step, counts=(counts, *on(ids, moe)), tile=(8, 4))   # past it: the last row
    want[2, 1, [6, 1]] = 2
    want[2, 2, [3, 0]] = 2
    assert torch.equal(counts.cpu(), want)
    with pytest.raises(HarnessError, match="counts need the device step index"):
        k.lm_head_argmax(*args, counts=(counts, *on(ids, moe)), tile=(8, 4))


def test_route_ties_go_to_the_lowest_index():
    """Equal probabilities: the lower expert index first (as the existing router and torch.topk on
    the CPU); three equal winners over five equal others keep their index order."""
    k = kt()
    H, E = 64, 8
    h = norm_exact_row(H, torch.Generator().manual_seed(2))
    b = _router_buffers(H, E, 4, torch.float32)
    args = (b["xn"], b["logits"], b["sem"], b["ids"], b["wts"], 0.0, 4, False, 1.0)
    k.route(*on(h, torch.ones(H), torch.zeros(E, H)), *args, tile=(4, 2))
    assert b["ids"].cpu().tolist() == [0, 1, 2, 3] and torch.allclose(b["wts"].cpu(), torch.full((4,), 0.125))
    w = torch.zeros(E, H)
    w[[6, 2, 5]] = vendor_norm(h[None], torch.ones(H), 0.0)[0] / 64
    k.route(*on(h, torch.ones(H), w), *args, tile=(4, 2))
    assert b["ids"].cpu().tolist() == [2, 5, 6, 0]


def swiglu_rows(x, gate_up):
    """The vendor SwiGLU's gate/up/silu/product on rows [2I, H] = gate rows then up rows (eager roundings)."""
    inter = gate_up.shape[0] // 2
    return F.silu(F.linear(x, gate_up[:inter])) * F.linear(x, gate_up[inter:])


def assert_within_one_ulp(got, want, dtype):
    """fp32: equal to 1e-6 relative (torch's and numpy's exp in silu); bf16: at most one ulp apart."""
    diff = (got.double() - want.double()).abs()
    bound = 1e-6 if dtype == torch.float32 else 2.0 ** -7
    assert bool((diff <= bound * want.double().abs()).all()), float(diff.max())


@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_up_routed_and_shared_rows(dtype):
    """Rows p < P: part p of the shared expert's SwiGLU of x (h columns [p*I, (p+1)*I)); rows P + j:
    expert ids[j]'s; I = 24 is not a multiple of the tile (16). 2 column blocks x 4 slots = 8 tiles,
    one program each, slot by slot (the routed ones loaded after the wait)."""
    k = kt()
    g = torch.Generator().manual_seed(13)
    H, I, E, top_k, P = 64, 24, 6, 2, 2
    x = grid((H,), g, -16, 16, 16).to(dtype)
    experts = grid((E, 2 * I, H), g).to(dtype)
    shared = grid((2 * P * I, H), g).to(dtype)
    ids = torch.tensor([4, 1])
    act = torch.zeros(P + top_k, I, dtype=dtype, device=DEV)
    k.gate_up(*on(x, shared), act, experts_gate_up=experts.to(DEV), ids=ids.to(DEV), tile=(16, 4))
    want = torch.cat([swiglu_rows(x[None], shared).view(P, I)]
                     + [swiglu_rows(x[None], experts[e]) for e in ids.tolist()])
    assert_within_one_ulp(act.cpu(), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_up_dense_recomputes_the_norm(dtype):
    """The dense SwiGLU (one part, no routed rows) of post_attention_layernorm(h), the norm
    computed once in each of the 4 programs (one per tile of 16 of I = 64)."""
    k = kt()
    g = torch.Generator().manual_seed(17)
    H, I = 64, 64
    h, ln = norm_exact_row(H, g).to(dtype), grid((H,), g, -8, 8, 8).to(dtype)
    w = grid((2 * I, H), g).to(dtype)
    act = torch.zeros(1, I, dtype=dtype, device=DEV)
    k.gate_up(*on(h, w), act, ln=ln.to(DEV), eps=0.0, tile=(16, 4))
    assert_within_one_ulp(act.cpu()[0], swiglu_rows(vendor_norm(h[None], ln, 0.0), w)[0], dtype)


def test_packed_pairs_needs_compiled_bf16_on_4_bytes_and_even_strides():
    """int32 pairs of bf16 only where every pair lies in one row on 4 bytes: compiled code, bf16,
    data on 4 bytes, every stride / length even. Under the interpreter never (inline PTX)."""
    k = kt()
    t = torch.zeros(4, 6, dtype=torch.bfloat16)
    assert t.data_ptr() % 4 == 0
    assert k.packed_pairs(t, strides=(6, 6), compiled=True)
    assert not k.packed_pairs(t, strides=(6, 6), compiled=False)
    assert not k.packed_pairs(t, strides=(6, 7), compiled=True)                   # an odd length
    assert not k.packed_pairs(t.view(-1)[1:], strides=(6,), compiled=True)        # 2 bytes off
    assert not k.packed_pairs(t.float(), strides=(6,), compiled=True)
    assert not k.packed_pairs(t, t.float(), strides=(6,), compiled=True)
    assert k.packed_pairs(t, strides=(6,)) == (DEV == "cuda")


@pytest.mark.parametrize("I", [24, 27])
@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_down_weights_sums_adds_shared_and_residual(dtype, I):
    """h + (routed + shared) in the vendor's order: each routed row's down_proj rounded, cast to
    fp32, times its gate weight, summed over k, rounded; the shared down_proj over its whole width
    (P parts) rounded; their sum rounded; the residual add rounded. Exact inputs, 2 shared parts and
    3 routed rows (act rows in that order; 5 of a program's 8 slots), I = 24 (tiles 16 + 8, rows on
    16 bytes: the kernel is told so) or 27 (16 + 8 + 4 of which 3 read; rows off 16 bytes), H = 40
    in 3 blocks of 16 (a partial block): 3 programs, each holding its block's slots. Compiled, bf16
    at I = 24 reads the weights as int32 pairs (``packed_pairs``), at I = 27 as bf16."""
    k = kt()
    g = torch.Generator().manual_seed(19)
    H, E, top_k, P = 40, 5, 3, 2
    act = grid((P + top_k, I), g, -16, 16, 16).to(dtype)
    experts = grid((E, H, I), g).to(dtype)
    shared = grid((H, P * I), g).to(dtype)
    ids, wts = torch.tensor([3, 0, 4]), grid((top_k,), g, 1, 16, 16)
    h = grid((H,), g, -64, 64, 16).to(dtype)
    rows = torch.stack([F.linear(act[P + j][None], experts[e])[0] for j, e in enumerate(ids.tolist())])
    routed = (rows.float() * wts[:, None]).sum(0).to(dtype)
    want = h + (routed + F.linear(act[:P].reshape(1, -1), shared)[0])
    hd = h.clone().to(DEV)
    act_d, experts_d, shared_d, ids_d, wts_d = on(act, experts, shared, ids, wts)
    k.down_residual(act_d, shared_d, hd, experts=experts_d, ids=ids_d, wts=wts_d, tile=(16, 4))
    assert_exact(hd, want, dtype)


@pytest.mark.parametrize("stages", [0, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_lm_head_argmax_picks_the_first_maximum_across_programs(dtype, stages):
    """logits = lm_head(norm(h)) in the dtype bit for bit; the token is the first index of the
    maximum (torch.argmax) when equal maxima sit in different programs' row ranges and twice in one
    tile; the position and the step index advance by one, the counter is back at zero. Both loops:
    the register double buffer (stages 0) and the software-pipelined one (stages 3)."""
    k = kt()
    g = torch.Generator().manual_seed(23)
    H, V = 64, 150
    h, ln = norm_exact_row(H, g).to(dtype), grid((H,), g, -8, 8, 8).to(dtype)
    w = grid((V, H), g).to(dtype)
    xn = vendor_norm(h[None], ln, 0.0)
    top = torch.full((H,), 0.25) * torch.sign(xn[0].float())        # twice any grid weight: the largest logit
    # 19 tiles of 8 rows over 4 programs (tiles 0-3, 4-8, 9-13, 14-18): rows 97 and 99 share tile 12
    # (program 2), row 105 is program 2's next tile, row 140 is in tile 17 (program 3)
    for row in (97, 99, 105, 140):
        w[row] = top.to(dtype)
        w[row] = top.to(dtype)
    want_logits = F.linear(xn, w)[0]
    assert int(want_logits.float().argmax()) == 97 and float(want_logits[97]) == float(want_logits[140])
    logits = torch.zeros(V, dtype=dtype, device=DEV)
    pmax, pidx = torch.zeros(4, device=DEV), torch.zeros(4, dtype=torch.int32, device=DEV)
    sem, token = torch.zeros(1, dtype=torch.int32, device=DEV), torch.zeros(1, dtype=torch.int64, device=DEV)
    pos, step = torch.tensor([30], device=DEV), torch.tensor([5], device=DEV)
    xn_out = torch.zeros(H, dtype=dtype, device=DEV)
    k.lm_head_argmax(*on(h, ln, w), logits, pmax, pidx, sem, token, pos, 0.0, step=step, xn_out=xn_out, tile=(8, 4),
                     stages=stages)
    assert_exact(logits, want_logits, dtype, F.linear(xn.abs().double(), w.abs().double())[0])
    assert_exact(xn_out, xn[0], dtype)
    assert int(token) == 97 and int(pos) == 31 and int(step) == 6 and int(sem) == 0
