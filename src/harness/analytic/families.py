"""One cost class per module family of DeepSeek-OCR: FLOPs, bytes and parameters from shapes.

Every class is a dataclass of shapes (tokens, channels, heads, ...) whose ``cost()`` returns a
``Cost``. Its docstring states the formulas; ``docs.py`` copies them into
``docs/formulations/<family>.md`` so the documentation cannot drift from the code.

Conventions (all classes)
-------------------------
* FLOPs = 2 per multiply-accumulate. Integers, exact.
* ``flops_counted``: the matmul / convolution / attention FLOPs that ``torch.utils.flop_counter
  .FlopCounterMode`` counts for the reference model (``harness.models``): ``mm``, ``addmm``,
  ``bmm`` (einsum and SDPA's math path decompose into these), ``convolution`` and the fused SDPA
  ops. Attention is full S x T (no causal discount), SAM windows are the padded windows, the SAM
  relative-position einsums and the RoPE ``inv_freq @ positions`` product are counted (they are
  ``bmm`` calls). Bias adds of ``addmm`` are not counted. ``check.py`` asserts these numbers equal
  FlopCounterMode's count per stage, exactly.
* ``flops_useful``: the same tensor work restricted to what the maths needs: causal prefill
  attention counts only the S*n + S(S+1)/2 allowed (query, key) pairs, SAM windowed attention
  counts only the real (unpadded) tokens of each window. Everything else equals ``flops_counted``.
* ``tensor_flops``: the tensor-core (matmul / conv / attention) FLOPs the chosen attention kernel
  executes: ``flops_counted``, except causal LLM attention with a fused kernel (``sdpa``,
  ``sdpa_flash``, ``flash_attention_2``), which skips masked tiles and is counted at its causal
  (useful) count; ``eager`` computes the full S x T product. Per-tile rounding on the diagonal
  is ignored.
* ``vector_flops``: elementwise / reduction work (norms, activations, softmax, bias and residual
  adds, RoPE rotation, MoE combine), 1 FLOP per arithmetic or transcendental op per element with
  the per-element constants below. An estimate under that convention (FlopCounterMode counts none
  of it).
* Bytes: minimum DRAM traffic under this execution model: every GEMM / conv / attention / norm
  kernel reads its operands once and writes its result once; elementwise ops (bias, activation,
  residual, scaling, SwiGLU product) are fused into the neighbouring kernel; layout-only ops
  (views, permutes, padding, window partition, concatenation, clone) cost nothing. Exceptions
  that the reference execution cannot avoid are stated per class (SAM's dense rel-pos mask,
  eager attention scores, the growing KV cache, the fp32 logits cast). ``bytes_weights`` = each
  parameter used is read once per forward (per call); MoE routed experts count only the experts
  touched. ``b`` = bytes per element of the model dtype (bf16: 2), for weights and activations.
* ``params``: parameters held by the family's modules (all experts, unused tensors included, so
  the per-stage sums equal the checkpoint's component counts); ``params_active``: parameters a
  token's computation uses (MoE: the top-k experts; token embedding: none, a lookup).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar, Optional, Sequence

from .. import sam_attention_tiles as tiles
from ..knobs import augmented_dim

# vector-FLOP constants (per element; 1 per arithmetic or transcendental op)
LN_PER_ELEM = 7        # sum, subtract mean, square, sum, * rstd, * gamma, + beta
LN_PER_ROW = 4         # / C (mean), / C (var), + eps, rsqrt
RMS_PER_ELEM = 4       # square, sum, * rstd, * weight
RMS_PER_ROW = 3        # / C, + eps, rsqrt
SIGMOID = 4            # neg, exp, + 1, reciprocal
GELU_ERF = 5           # x / sqrt(2), erf, + 1, * x, * 0.5
QUICK_GELU = 1 + SIGMOID + 1   # 1.702 * x, sigmoid, * x
SILU = SIGMOID + 1     # sigmoid, * x
SOFTMAX = 5            # max, subtract, exp, sum, divide
ROPE_PER_ELEM_X2 = 7   # (q*cos + rotate_half(q)*sin): 2 mul + 1 add per element, 1 neg per half -> 3.5

COST_FIELDS = ("tensor_flops", "vector_flops", "flops_counted", "flops_useful", "bytes_weights",
               "bytes_act_read", "bytes_act_write", "bytes_kv_read", "bytes_kv_write", "params",
               "params_active")
FLOP_FIELDS = ("tensor_flops", "vector_flops", "flops_counted", "flops_useful")
BYTE_FIELDS = ("bytes_weights", "bytes_act_read", "bytes_act_write", "bytes_kv_read", "bytes_kv_write")
FUSED_ATTENTION = ("sdpa", "sdpa_flash", "flash_attention_2")


@dataclass
class Cost:
    """Work of one family over one call. FLOPs [FLOP], bytes [B], params [parameters].

    ``+`` combines different modules (params add); ``again`` combines another call of the same
    modules (params do not add).
    """

    tensor_flops: int = 0
    vector_flops: int = 0
    flops_counted: int = 0
    flops_useful: int = 0
    bytes_weights: float = 0
    bytes_act_read: float = 0
    bytes_act_write: float = 0
    bytes_kv_read: float = 0
    bytes_kv_write: float = 0
    params: int = 0
    params_active: int = 0

    @property
    def bytes(self) -> float:
        return sum(getattr(self, f) for f in BYTE_FIELDS)

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(**{f: getattr(self, f) + getattr(other, f) for f in COST_FIELDS})

    def again(self, other: "Cost") -> "Cost":
        out = self + other
        out.params = max(self.params, other.params)
        out.params_active = max(self.params_active, other.params_active)
        return out

    def times(self, k: int) -> "Cost":
        """``k`` identical module instances (layers): everything, params included, times k."""
        return Cost(**{f: getattr(self, f) * k for f in COST_FIELDS})

    def calls(self, k: int) -> "Cost":
        """The same modules called ``k`` times: work times k, params unchanged."""
        out = self.times(k)
        out.params, out.params_active = self.params, self.params_active
        return out

    def as_dict(self) -> dict:
        d = {f: getattr(self, f) for f in COST_FIELDS}
        d["bytes"] = self.bytes
        return d


class Family:
    """Base of the cost classes: ``family`` key, ``title``, ``cost()``. Which modules a family
    describes, what the profiler sees of it and its op group: ``harness.anatomy.registry.REGISTRY``."""

    family: ClassVar[str] = ""
    title: ClassVar[str] = ""

    def cost(self) -> Cost:  # pragma: no cover - abstract
        raise NotImplementedError

    def shapes(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]


def conv_out(size: int, k: int, stride: int, pad: int) -> int:
    return (size + 2 * pad - k) // stride + 1


def linear(tokens: int, fin: int, fout: int) -> int:
    """FLOPs of ``tokens`` rows through a [fin -> fout] GEMM (2 per MAC)."""
    return 2 * tokens * fin * fout


# -------------------------------------------------------------------------------------- vision

@dataclass
class Conv2d(Family):
    """2-D convolution (SAM neck 1x1 and 3x3 convs, ``net_2`` / ``net_3`` stride-2 downsampling).

    Input [N, Cin, H, W], kernel k x k, stride s, padding p:
    Ho = floor((H + 2p - k)/s) + 1, Wo likewise.

    * flops_counted = tensor_flops = flops_useful = 2 * N * Cout * Ho * Wo * Cin * k * k
      (FlopCounterMode's conv formula; zero-padding MACs included).
    * vector_flops = N * Cout * Ho * Wo if bias else 0.
    * bytes_weights = (Cout * Cin * k * k [+ Cout]) * b; act read N*Cin*H*W*b, write N*Cout*Ho*Wo*b.
    * params = Cout * Cin * k * k [+ Cout].
    """

    family: ClassVar[str] = "conv2d"
    title: ClassVar[str] = "Convolutions (SAM neck and net_2/net_3)"
    n: int
    cin: int
    cout: int
    h: int
    w: int
    k: int
    stride: int = 1
    pad: int = 0
    bias: bool = False
    b: int = 2

    @property
    def out_hw(self):
        return conv_out(self.h, self.k, self.stride, self.pad), conv_out(self.w, self.k, self.stride, self.pad)

    def cost(self) -> Cost:
        ho, wo = self.out_hw
        out = self.n * self.cout * ho * wo
        fl = 2 * out * self.cin * self.k * self.k
        params = self.cout * self.cin * self.k * self.k + (self.cout if self.bias else 0)
        return Cost(tensor_flops=fl, flops_counted=fl, flops_useful=fl,
                    vector_flops=out if self.bias else 0,
                    bytes_weights=params * self.b, bytes_act_read=self.n * self.cin * self.h * self.w * self.b,
                    bytes_act_write=out * self.b, params=params, params_active=params)


@dataclass
class PatchEmbed(Family):
    """SAM patch embedding: Conv2d(3 -> C, kernel = stride = p, bias) + absolute position add.

    Pixels [N, 3, S, S] -> tokens [N, g, g, C], g = S // p. The [1, G, G, C] table (G = 64,
    the 1024-pixel pretraining grid) is bicubic-resized to g x g when g != G (interpolation:
    not counted, no FLOPs assigned).

    * flops_counted = tensor_flops = flops_useful = 2 * N * C * g^2 * 3 * p^2.
    * vector_flops = 2 * N * g^2 * C (conv bias, position add).
    * bytes_weights = (C*3*p^2 + C + G^2*C) * b; act read N*3*S^2*b, write N*g^2*C*b.
    * params = C*3*p^2 + C + G^2*C.
    """

    family: ClassVar[str] = "patch_embed"
    title: ClassVar[str] = "SAM patch embedding and absolute positions"
    n: int
    size: int
    dim: int
    patch: int
    pos_grid: int
    in_chans: int = 3
    b: int = 2

    def cost(self) -> Cost:
        g = self.size // self.patch
        out = self.n * g * g * self.dim
        fl = 2 * out * self.in_chans * self.patch * self.patch
        params = self.dim * self.in_chans * self.patch ** 2 + self.dim + self.pos_grid ** 2 * self.dim
        return Cost(tensor_flops=fl, flops_counted=fl, flops_useful=fl, vector_flops=2 * out,
                    bytes_weights=params * self.b,
                    bytes_act_read=self.n * self.in_chans * self.size * self.size * self.b,
                    bytes_act_write=out * self.b, params=params, params_active=params)


@dataclass
class LayerNorm(Family):
    """LayerNorm over the last axis (SAM norm1/norm2, CLIP pre_layrnorm and layer_norm1/2).

    R rows of C features:

    * flops_counted = tensor_flops = flops_useful = 0.
    * vector_flops = 7*R*C + 4*R (sum, centre, square, sum, scale by rstd, *gamma, +beta per
      element; two divisions, +eps, rsqrt per row).
    * bytes_weights = 2*C*b; act read R*C*b, write R*C*b.  params = 2*C.
    """

    family: ClassVar[str] = "layernorm"
    title: ClassVar[str] = "LayerNorm"
    rows: int
    dim: int
    b: int = 2

    def cost(self) -> Cost:
        rc = self.rows * self.dim
        return Cost(vector_flops=LN_PER_ELEM * rc + LN_PER_ROW * self.rows, bytes_weights=2 * self.dim * self.b,
                    bytes_act_read=rc * self.b, bytes_act_write=rc * self.b, params=2 * self.dim,
                    params_active=2 * self.dim)


@dataclass
class LayerNorm2d(Family):
    """LayerNorm over the channel axis of NCHW maps (SAM neck), as LayerNorm with R = N*H*W rows.

    * flops_counted = tensor_flops = flops_useful = 0.
    * vector_flops = 7*N*C*H*W + 4*N*H*W.
    * bytes_weights = 2*C*b; act read and write N*C*H*W*b each.  params = 2*C.
    """

    family: ClassVar[str] = "layernorm2d"
    title: ClassVar[str] = "LayerNorm2d (channel LayerNorm of NCHW maps)"
    n: int
    c: int
    h: int
    w: int
    b: int = 2

    def cost(self) -> Cost:
        rows = self.n * self.h * self.w
        return LayerNorm(rows, self.c, self.b).cost()


def _window_sides(g: int, ws: int) -> list:
    """Real (unpadded) side lengths of the windows along one axis of a g-long grid."""
    nwin = -(-g // ws)
    return [min(ws, g - i * ws) for i in range(nwin)]


@dataclass
class SAMAttention(Family):
    """SAM ViT-B block attention: windowed (window ws > 0, grid zero-padded) or global (ws = 0),
    decomposed relative position as a dense additive SDPA mask, plus the residual add.

    N views of a g x g token grid, C channels, nh heads of d = C/nh. Windowed: the grid is padded
    to gp = ceil(g/ws)*ws, giving Bw = N*(gp/ws)^2 windows of n = ws^2 tokens with side h = w = ws;
    global: Bw = N, n = g^2, h = w = g. P = Bw*n tokens are processed (padded ones included).

    * qkv + proj GEMMs: 2*P*C*3C + 2*P*C*C = 8*P*C^2.
    * rel-pos einsums (``bmm``): 2*(Bw*nh)*n*h*d + 2*(Bw*nh)*n*w*d.
    * SDPA (QK^T and PV): 4*Bw*nh*n^2*d.
    * flops_counted = tensor_flops = the sum of the three (padded windows, FlopCounterMode
      convention).
    * flops_useful: only real tokens. With real window sides a_i (all ws except the last,
      g - ws*(nwin-1)), sum_i a_i = g and A2 = sum_i a_i^2: GEMMs 8*N*g^2*C^2, rel-pos
      2*nh*d*N*2*A2*g, attention 4*N*nh*d*A2^2. Global blocks: useful = counted.
    * vector_flops = qkv/proj bias 4*P*C + bias build (rel_h + rel_w) Bw*nh*n^2 + scale, mask add
      and softmax (1 + 1 + 5)*Bw*nh*n^2 + residual N*g^2*C.
    * bytes: weights (4*C^2 + 4*C + 2*(2*r - 1)*d) * b (r = rel-pos table size: ws, or the
      pretraining grid for global blocks); act read N*g^2*C (qkv GEMM; padding is zeros, not
      read) + P*C (einsums read q) + 3*P*C (attention reads q, k, v) + Bw*nh*n*(h+w) (bias build)
      + Bw*nh*n^2 (the dense mask, read by attention) + P*C (proj) + N*g^2*C (residual); act
      write 3*P*C (qkv) + Bw*nh*n*(h+w) (rel_h, rel_w) + Bw*nh*n^2 (dense mask: SDPA needs it
      materialised) + P*C (attention out) + N*g^2*C (proj + residual, real tokens only). All * b.
    * params = 4*C^2 + 4*C + 2*(2*r - 1)*d.

    ``method = "augmented"`` (``vision_impl: fused``, global blocks; ``harness.variants.sam_attention``):
    no S x S mask. q' = [q, rel_h, rel_w, 0] and k' = [k, onehot_h, onehot_w, 0] of head dim
    d' = d + h + w rounded up to a multiple of 8, one SDPA over (q', k', v). The kernel executes
    2*Bw*nh*n^2*(d' + d) (flops_counted = tensor_flops = GEMMs + rel-pos einsums + that;
    flops_useful unchanged); vector: scale + softmax 6 per score. Bytes: the mask terms go; q' and
    k' are written (Bw*nh*n*d' each) and read by the kernel with v (Bw*nh*n*(2d' + d)); building
    them reads q, rel_h, rel_w, k and the [n, d' - d] one-hot tail.

    ``method = "inkernel"`` (``sam_attention: triton-windows`` for windowed blocks, ``triton`` for
    all; ``harness.kernels.sam_attention_triton``): no mask and no wider head dim; the kernel adds
    rel_h[i, h(j)] + rel_w[i, w(j)] to each score. It visits qs x ks score slots per window or image
    (``harness.sam_attention_tiles.slots``: masked slots included): 4*Bw*nh*qs*ks*d. Vector: scale,
    the two bias adds and softmax (1 + 2 + 5) per real score. Bytes: the kernel reads q, k, v, rel_h, rel_w and
    writes its output once; no mask, no q' / k'.
    """

    family: ClassVar[str] = "sam_attention"
    title: ClassVar[str] = "SAM attention (windowed / global, decomposed rel-pos)"
    n: int
    grid: int
    dim: int
    heads: int
    window: int
    rel_size: int
    b: int = 2
    method: str = "dense"         # dense (the vendor's mask) | augmented (global blocks, no mask) | inkernel

    def geometry(self):
        g, ws = self.grid, self.window
        if ws > 0:
            gp = -(-g // ws) * ws
            bw, side = self.n * (gp // ws) ** 2, ws
        else:
            bw, side = self.n, g
        return bw, side, side * side

    def cost(self) -> Cost:
        C, nh, g, N = self.dim, self.heads, self.grid, self.n
        d = C // nh
        bw, side, n = self.geometry()
        P = bw * n
        gemm = 8 * P * C * C
        rel = 2 * bw * nh * n * side * d * 2
        attn = 4 * bw * nh * n * n * d
        counted = gemm + rel + attn
        sides = _window_sides(g, self.window) if self.window > 0 else [g]
        a2 = sum(a * a for a in sides)
        useful = 8 * N * g * g * C * C + 2 * nh * d * N * 2 * a2 * g + 4 * N * nh * d * a2 * a2
        scores = bw * nh * n * n
        real = N * g * g * C
        params = 4 * C * C + 4 * C + 2 * (2 * self.rel_size - 1) * d
        relw = bw * nh * n * 2 * side
        if self.method == "inkernel":
            qs, ks = tiles.slots(side, side)
            kernel = 4 * bw * nh * qs * ks * d
            counted = gemm + rel + kernel
            return Cost(
                tensor_flops=counted, flops_counted=counted, flops_useful=useful,
                vector_flops=4 * P * C + (1 + 2 + SOFTMAX) * scores + real,
                bytes_weights=params * self.b,
                bytes_act_read=(real + P * C + 3 * P * C + relw + P * C + real) * self.b,
                bytes_act_write=(3 * P * C + relw + P * C + real) * self.b,
                params=params, params_active=params)
        if self.method == "augmented":
            dp = augmented_dim(d, side, side)
            kernel = 2 * bw * nh * n * n * (dp + d)
            counted = gemm + rel + kernel
            aug = bw * nh * n * dp
            return Cost(
                tensor_flops=counted, flops_counted=counted, flops_useful=useful,
                vector_flops=4 * P * C + (1 + SOFTMAX) * scores + real,
                bytes_weights=params * self.b,
                bytes_act_read=(real + P * C + (P * C + relw) + (P * C + n * (dp - d)) + (2 * aug + P * C)
                                + P * C + real) * self.b,
                bytes_act_write=(3 * P * C + relw + 2 * aug + P * C + real) * self.b,
                params=params, params_active=params)
        return Cost(
            tensor_flops=counted, flops_counted=counted, flops_useful=useful,
            vector_flops=4 * P * C + scores + (1 + 1 + SOFTMAX) * scores + real,
            bytes_weights=params * self.b,
            bytes_act_read=(real + P * C + 3 * P * C + relw + scores + P * C + real) * self.b,
            bytes_act_write=(3 * P * C + relw + scores + P * C + real) * self.b,
            params=params, params_active=params)


def two_layer_mlp(T: int, C: int, F: int, act_flops: int, b: int) -> Cost:
    """Linear(C -> F, bias) -> activation (``act_flops`` per element) -> Linear(F -> C, bias), plus
    the two bias adds and the residual: the SAM and CLIP MLPs."""
    fl = 2 * linear(T, C, F)
    params = 2 * C * F + F + C
    return Cost(tensor_flops=fl, flops_counted=fl, flops_useful=fl,
                vector_flops=T * F + act_flops * T * F + 2 * T * C,
                bytes_weights=params * b, bytes_act_read=(2 * T * C + T * F) * b,
                bytes_act_write=(T * F + T * C) * b, params=params, params_active=params)


@dataclass
class SAMMLP(Family):
    """SAM MLP block: lin1 (C -> F, bias), exact GELU, lin2 (F -> C, bias), residual add.

    T tokens (real, unpadded):

    * flops_counted = tensor_flops = flops_useful = 2*T*C*F * 2.
    * vector_flops = T*F (bias) + 5*T*F (GELU: x/sqrt2, erf, +1, *x, *0.5) + T*C (bias) + T*C
      (residual).
    * bytes: weights (2*C*F + F + C)*b; act read (T*C + T*F + T*C residual)*b, write (T*F + T*C)*b.
    * params = 2*C*F + F + C.
    """

    family: ClassVar[str] = "sam_mlp"
    title: ClassVar[str] = "SAM MLP (GELU)"
    tokens: int
    dim: int
    hidden: int
    b: int = 2

    def cost(self) -> Cost:
        return two_layer_mlp(self.tokens, self.dim, self.hidden, GELU_ERF, self.b)


@dataclass
class CLIPEmbeddings(Family):
    """CLIP-L embeddings over SAM features: CLS token + SAM net_3 output as patch embeddings +
    bicubic-resized absolute positions.

    N views, q x q SAM output grid, D = 1024, S = 1 + q^2 tokens. The [1 + G^2, D] table (G = 16)
    keeps its CLS row and has its grid resized to q x q (interpolation: not counted).
    The checkpoint's own patch conv (3 -> D, 14 x 14) is held but never run.

    * flops_counted = tensor_flops = flops_useful = 0.
    * vector_flops = N*S*D (position add).
    * bytes: weights (D + (1 + G^2)*D)*b (the unused conv is not read); act read N*q^2*D*b,
      write N*S*D*b.
    * params = D + (1 + G^2)*D + D*3*14*14 (unused conv included); params_active excludes the conv.
    """

    family: ClassVar[str] = "clip_embeddings"
    title: ClassVar[str] = "CLIP embeddings (CLS + SAM features + positions)"
    n: int
    q: int
    dim: int
    pos_grid: int
    patch: int
    b: int = 2

    def cost(self) -> Cost:
        S = 1 + self.q * self.q
        used = self.dim + (1 + self.pos_grid ** 2) * self.dim
        params = used + self.dim * 3 * self.patch * self.patch
        return Cost(vector_flops=self.n * S * self.dim, bytes_weights=used * self.b,
                    bytes_act_read=self.n * self.q * self.q * self.dim * self.b,
                    bytes_act_write=self.n * S * self.dim * self.b, params=params, params_active=used)


@dataclass
class CLIPAttention(Family):
    """CLIP-L self-attention (fused qkv_proj with bias, SDPA without mask, out_proj with bias)
    plus the residual add.

    N views, S tokens, D = nh * d:

    * flops_counted = tensor_flops = flops_useful = 2*N*S*D*3D + 4*N*S^2*D + 2*N*S*D*D.
    * vector_flops = 4*N*S*D (biases) + 6*N*nh*S^2 (scale + softmax) + N*S*D (residual).
    * bytes: weights (4*D^2 + 4*D)*b; act read (N*S*D [qkv] + 3*N*S*D [q,k,v] + N*S*D [out_proj]
      + N*S*D [residual])*b; act write (3*N*S*D + N*S*D + N*S*D)*b. Fused attention: scores stay
      on chip.
    * params = 4*D^2 + 4*D.
    """

    family: ClassVar[str] = "clip_attention"
    title: ClassVar[str] = "CLIP attention (block self-attention)"
    n: int
    seq: int
    dim: int
    heads: int
    b: int = 2

    def cost(self) -> Cost:
        N, S, D = self.n, self.seq, self.dim
        fl = linear(N * S, D, 3 * D) + 4 * N * S * S * D + linear(N * S, D, D)
        nsd = N * S * D
        params = 4 * D * D + 4 * D
        return Cost(tensor_flops=fl, flops_counted=fl, flops_useful=fl,
                    vector_flops=4 * nsd + (1 + SOFTMAX) * N * self.heads * S * S + nsd,
                    bytes_weights=params * self.b, bytes_act_read=6 * nsd * self.b,
                    bytes_act_write=5 * nsd * self.b, params=params, params_active=params)


@dataclass
class CLIPMLP(Family):
    """CLIP-L feed-forward: fc1 (D -> F, bias), quick_gelu x*sigmoid(1.702x), fc2 (F -> D, bias),
    residual add.

    T tokens:

    * flops_counted = tensor_flops = flops_useful = 2*T*D*F * 2.
    * vector_flops = T*F (bias) + 6*T*F (quick_gelu) + T*D (bias) + T*D (residual).
    * bytes: weights (2*D*F + F + D)*b; act read (2*T*D + T*F)*b, write (T*F + T*D)*b.
    * params = 2*D*F + F + D.
    """

    family: ClassVar[str] = "clip_mlp"
    title: ClassVar[str] = "CLIP MLP (quick_gelu)"
    tokens: int
    dim: int
    hidden: int
    b: int = 2

    def cost(self) -> Cost:
        return two_layer_mlp(self.tokens, self.dim, self.hidden, QUICK_GELU, self.b)


@dataclass
class Projector(Family):
    """Vision -> LLM projector: Linear(2048 -> 1280, bias) over cat(CLIP tokens without CLS,
    flattened SAM features), T = N*q^2 tokens.

    * flops_counted = tensor_flops = flops_useful = 2*T*Din*Dout.
    * vector_flops = T*Dout (bias).
    * bytes: weights (Din*Dout + Dout)*b; act read T*Din*b (the concatenation is fused into the
      GEMM's load), write T*Dout*b.
    * params = Din*Dout + Dout.
    """

    family: ClassVar[str] = "projector"
    title: ClassVar[str] = "Projector (linear 2048 -> 1280)"
    tokens: int
    din: int
    dout: int
    b: int = 2

    def cost(self) -> Cost:
        fl = linear(self.tokens, self.din, self.dout)
        params = self.din * self.dout + self.dout
        return Cost(tensor_flops=fl, flops_counted=fl, flops_useful=fl, vector_flops=self.tokens * self.dout,
                    bytes_weights=params * self.b, bytes_act_read=self.tokens * self.din * self.b,
                    bytes_act_write=self.tokens * self.dout * self.b, params=params, params_active=params)


@dataclass
class ImageLayout(Family):
    """Image-token layout glue: ``image_newline`` after each grid row of every view, one
    ``view_seperator`` (vendor spelling) at the end; tiles laid out first, then the global view.

    F projected feature tokens in, I image tokens out (I = F + rows + 1 per page), hidden h:

    * all FLOPs = 0 (concatenation).
    * bytes: weights 2*h*b; act read F*h*b, write I*h*b (one concatenation kernel).
    * params = 2*h.
    """

    family: ClassVar[str] = "image_layout"
    title: ClassVar[str] = "Image layout (newline / view separator insertion)"
    features: int
    image_tokens: int
    hidden: int
    b: int = 2

    def cost(self) -> Cost:
        return Cost(bytes_weights=2 * self.hidden * self.b, bytes_act_read=self.features * self.hidden * self.b,
                    bytes_act_write=self.image_tokens * self.hidden * self.b, params=2 * self.hidden,
                    params_active=2 * self.hidden)


# ----------------------------------------------------------------------------------------- LLM

@dataclass
class TokenEmbedding(Family):
    """Token embedding lookup (vocab V x h), plus ``masked_scatter`` of I image embeddings in
    prefill.

    B sequences of S tokens:

    * all FLOPs = 0 (gather / scatter).
    * bytes: weights B*S*h*b (only the gathered rows are read, not the V x h table); act read
      B*I*h*b (image embeddings), write B*S*h*b (+ B*S*h*b read and write again for the scatter
      when I > 0).
    * params = V*h; params_active = 0 (a lookup: activated-parameter counts exclude it).
    """

    family: ClassVar[str] = "embedding"
    title: ClassVar[str] = "Token embedding (+ image scatter)"
    batch: int
    seq: int
    vocab: int
    hidden: int
    image_tokens: int = 0
    b: int = 2

    def cost(self) -> Cost:
        bsh = self.batch * self.seq * self.hidden
        img = self.batch * self.image_tokens * self.hidden
        scatter = bsh if self.image_tokens else 0
        return Cost(bytes_weights=bsh * self.b, bytes_act_read=(img + scatter) * self.b,
                    bytes_act_write=(bsh + scatter) * self.b, params=self.vocab * self.hidden, params_active=0)


@dataclass
class RMSNorm(Family):
    """RMSNorm (fp32 internally) over R rows of h: input/post-attention norms and the final norm.

    * flops_counted = tensor_flops = flops_useful = 0.
    * vector_flops = 4*R*h + 3*R (square, sum, *rstd, *weight; /h, +eps, rsqrt per row).
    * bytes: weights h*b; act read R*h*b, write R*h*b (fp32 upcast kept on chip).  params = h.
    """

    family: ClassVar[str] = "rmsnorm"
    title: ClassVar[str] = "RMSNorm"
    rows: int
    hidden: int
    b: int = 2

    def cost(self) -> Cost:
        rh = self.rows * self.hidden
        return Cost(vector_flops=RMS_PER_ELEM * rh + RMS_PER_ROW * self.rows, bytes_weights=self.hidden * self.b,
                    bytes_act_read=rh * self.b, bytes_act_write=rh * self.b, params=self.hidden,
                    params_active=self.hidden)


@dataclass
class RoPE(Family):
    """Rotary position embedding of one attention layer (recomputed in every layer, as the
    reference and transformers 4.46 do): cos/sin from ``inv_freq @ positions``, then
    q*cos + rotate_half(q)*sin for q and k.

    B sequences, S new tokens, head dim d, nh query and kvh key heads:

    * flops_counted = tensor_flops = flops_useful = 2*B*(d/2)*S (the [B, d/2, 1] x [B, 1, S]
      ``bmm``).
    * vector_flops = 2*B*S*d (cos, sin) + 3.5*B*S*(nh + kvh)*d (2 mul + 1 add per element,
      1 negation per half).
    * bytes: act read and write B*S*(nh + kvh)*d*b each (q and k rotated in place of a copy).
    * params = 0 (``inv_freq`` is a buffer).
    * ``part``: ``both`` (one layer as above) | ``tables`` (the bmm and cos/sin only) | ``apply``
      (the rotation only). A static-cache step computes the tables once for all layers
      (``DeepseekOCR.decoder``): one ``tables`` item plus ``apply`` per layer.
    """

    family: ClassVar[str] = "rope"
    title: ClassVar[str] = "Rotary position embedding"
    batch: int
    seq: int
    head_dim: int
    heads: int
    kv_heads: int
    b: int = 2
    part: str = "both"

    def cost(self) -> Cost:
        B, S, d = self.batch, self.seq, self.head_dim
        tables, apply = self.part in ("both", "tables"), self.part in ("both", "apply")
        fl = 2 * B * (d // 2) * S if tables else 0
        elems = B * S * (self.heads + self.kv_heads) * d if apply else 0
        return Cost(tensor_flops=fl, flops_counted=fl, flops_useful=fl,
                    vector_flops=(2 * B * S * d if tables else 0) + ROPE_PER_ELEM_X2 * elems // 2,
                    bytes_act_read=elems * self.b, bytes_act_write=elems * self.b)


@dataclass
class LLMAttention(Family):
    """LLM self-attention of one decoder layer (plain MHA, ``use_mla: false``): q/k/v/o
    projections without bias, causal attention of S new tokens against a KV cache of n tokens
    (T = n + S keys), residual add. Prefill: n = 0, S = prompt; decode: S = 1, n = cache length.

    h hidden, nh query heads, kvh KV heads, head dim d, B sequences:

    * GEMMs: 2*B*S*h*(nh + 2*kvh)*d + 2*B*S*nh*d*h.
    * attention, flops_counted: 4*B*nh*S*T*d (full S x T, as FlopCounterMode counts SDPA / the
      eager matmuls, causal mask ignored).
    * attention, flops_useful: 4*B*nh*d*(S*n + S*(S+1)/2) (each query sees the cache and the new
      keys up to itself; decode: = counted).
    * tensor_flops: GEMMs + attention at the full count for ``eager``, at the useful count for
      the fused kernels (sdpa, sdpa_flash, flash_attention_2: masked tiles skipped).
    * vector_flops = (scale + softmax) 6 per score [+ 1 mask add per score for eager with S > 1]
      over the scores the kernel computes, + B*S*h (residual).
    * bytes_weights = h*(nh + 2*kvh)*d*b + nh*d*h*b.
    * act read: 3*B*S*h (q, k, v GEMMs each read x) + B*S*nh*d (attention reads q) + B*S*nh*d
      (o_proj) + B*S*h (residual); act write: B*S*nh*d (q) + B*S*nh*d (attention out) + B*S*h
      (o_proj + residual). Eager additionally writes the score matrix twice (QK^T, softmax) and
      reads it twice (softmax, PV): 2*B*nh*S*T*b each way.
    * KV: the k and v GEMMs write the new entries, 2*B*S*kvh*d*b; the attention reads
      2*B*T*kvh*d*b. With the growing cache (``kv_cache: growing``, torch.cat per step as HF
      DynamicCache) a forward with n > 0 also copies the cache: reads 2*B*(n + S)*kvh*d*b and
      writes 2*B*T*kvh*d*b more (``static``: no copy).
    * ``keys`` > 0 (a static cache's decode step): the kernel attends over all ``keys`` positions
      of the preallocated buffer with a mask, so flops_counted, tensor_flops and the KV read use
      ``keys`` in place of T (flops_useful keeps T: the masked positions are waste). With
      ``decode_attention=triton`` the kernel reads positions 0..pos only: keys = 0 (T keys).
    * params = h*(nh + 2*kvh)*d + nh*d*h.
    """

    family: ClassVar[str] = "llm_attention"
    title: ClassVar[str] = "LLM attention (MHA, KV cache)"
    batch: int
    seq: int
    cache: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    impl: str = "sdpa"
    kv_cache: str = "growing"
    b: int = 2
    keys: int = 0                 # > 0: positions a static cache's masked decode attention reads

    def cost(self) -> Cost:
        B, S, n, h, nh, kvh, d = self.batch, self.seq, self.cache, self.hidden, self.heads, self.kv_heads, self.head_dim
        T = n + S
        K = self.keys or T            # keys the kernel reads
        gemm = linear(B * S, h, (nh + 2 * kvh) * d) + linear(B * S, nh * d, h)
        full_pairs = S * K
        causal_pairs = S * n + S * (S + 1) // 2
        full = 4 * B * nh * d * full_pairs
        useful = 4 * B * nh * d * causal_pairs
        fused = self.impl in FUSED_ATTENTION          # no score matrix in memory
        skips = fused and not self.keys                # masked causal tiles skipped
        executed_pairs = causal_pairs if skips else full_pairs
        tensor = gemm + (useful if skips else full)
        scores = B * nh * executed_pairs
        vec = (1 + SOFTMAX) * scores + (scores if (not fused and (S > 1 or self.keys)) else 0) + B * S * h
        params = h * (nh + 2 * kvh) * d + nh * d * h
        act_r = 3 * B * S * h + 2 * B * S * nh * d + B * S * h
        act_w = 2 * B * S * nh * d + B * S * h
        if not fused:
            act_r += 2 * B * nh * S * K
            act_w += 2 * B * nh * S * K
        kv_w = 2 * B * S * kvh * d
        kv_r = 2 * B * K * kvh * d
        if self.kv_cache == "growing" and n > 0:
            kv_r += 2 * B * (n + S) * kvh * d
            kv_w += 2 * B * T * kvh * d
        return Cost(tensor_flops=tensor, flops_counted=gemm + full, flops_useful=gemm + useful, vector_flops=vec,
                    bytes_weights=params * self.b, bytes_act_read=act_r * self.b, bytes_act_write=act_w * self.b,
                    bytes_kv_read=kv_r * self.b, bytes_kv_write=kv_w * self.b, params=params, params_active=params)


def _swiglu(tokens: int, h: int, inter: int, b: int, residual: bool):
    """(flops, vector, act_read, act_write, params) of down(silu(gate(x)) * up(x))."""
    fl = 3 * linear(tokens, h, inter)
    vec = (SILU + 1) * tokens * inter + (tokens * h if residual else 0)
    act_r = 2 * tokens * h + 2 * tokens * inter + (tokens * h if residual else 0)
    act_w = 2 * tokens * inter + tokens * h
    return fl, vec, act_r * b, act_w * b, 3 * h * inter


@dataclass
class DenseMLP(Family):
    """Dense SwiGLU of layer 0 (DeepseekV2MLP h -> I -> h, no bias) plus the residual add.

    T = B*S tokens:

    * flops_counted = tensor_flops = flops_useful = 3 * 2*T*h*I.
    * vector_flops = 6*T*I (SiLU 5 + product 1) + T*h (residual).
    * bytes: weights 3*h*I*b; act read (2*T*h [gate, up read x] + T*I [epilogue reads gate out]
      + T*I [down] + T*h [residual])*b, write (T*I [gate] + T*I [silu(gate)*up] + T*h)*b.
    * params = 3*h*I.
    """

    family: ClassVar[str] = "dense_mlp"
    title: ClassVar[str] = "Dense SwiGLU MLP (layer 0)"
    tokens: int
    hidden: int
    inter: int
    b: int = 2

    def cost(self) -> Cost:
        fl, vec, r, w, params = _swiglu(self.tokens, self.hidden, self.inter, self.b, residual=True)
        return Cost(tensor_flops=fl, flops_counted=fl, flops_useful=fl, vector_flops=vec, bytes_weights=params * self.b,
                    bytes_act_read=r, bytes_act_write=w, params=params, params_active=params)


@dataclass
class MoEGate(Family):
    """MoE router of one layer: fp32 linear h -> E (no bias), softmax, greedy top-k (unsorted),
    optional renormalisation (off in DeepSeek-OCR), scaling.

    T = B*S tokens:

    * flops_counted = tensor_flops = flops_useful = 2*T*h*E (fp32 ``mm``).
    * vector_flops = 5*T*E (softmax) + T*k (scale) [+ 2*T*k with renormalisation]; top-k
      selection is comparisons (0 FLOPs).
    * bytes: weights E*h*b (upcast on chip); act read T*h*b, write T*k*(8 + 4) (int64 index, fp32
      weight).
    * params = E*h.
    """

    family: ClassVar[str] = "moe_gate"
    title: ClassVar[str] = "MoE gate (router)"
    tokens: int
    hidden: int
    experts: int
    top_k: int
    renormalize: bool = False
    b: int = 2

    def cost(self) -> Cost:
        T = self.tokens
        fl = linear(T, self.hidden, self.experts)
        vec = SOFTMAX * T * self.experts + T * self.top_k + (2 * T * self.top_k if self.renormalize else 0)
        params = self.experts * self.hidden
        return Cost(tensor_flops=fl, flops_counted=fl, flops_useful=fl, vector_flops=vec,
                    bytes_weights=params * self.b, bytes_act_read=T * self.hidden * self.b,
                    bytes_act_write=T * self.top_k * 12, params=params, params_active=params)


def expected_touched(experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts hit by ``tokens`` tokens each picking ``top_k`` distinct experts
    uniformly at random: E * (1 - (1 - k/E)^T)."""
    if tokens <= 0:
        return 0.0
    return experts * (1.0 - ((experts - top_k) / experts) ** tokens)


@dataclass
class MoERouted(Family):
    """Routed experts of one MoE layer (vendor ``moe_infer``): tokens sorted by expert, each
    touched expert runs SwiGLU h -> Im -> h on its tokens, outputs scattered back, weighted by
    the gate and summed over the k picks.

    T = B*S tokens, k picks each, so T*k expert-rows in total whatever the routing; E experts.

    * flops_counted = tensor_flops = flops_useful = 3 * 2*(T*k)*h*Im: routing-independent (each
      row passes one expert's three GEMMs; how rows split across experts does not change the
      sum).
    * vector_flops = 6*T*k*Im (SiLU + product) + T*k*h (gate weight) + T*(k-1)*h (sum over picks).
    * bytes_weights = X * 3*h*Im*b, X = experts touched: measured (non-zero entries of this
      layer's routing counts) or, under uniform routing, E*(1 - (1 - k/E)^T) (exactly k for one
      token).
    * act read (T*h [gather] + 2*T*k*h [gate, up] + 2*T*k*Im [epilogue, down] + T*k*h [combine])*b;
      act write (T*k*h [sorted tokens] + 2*T*k*Im + T*k*h [expert outputs] + T*h [combined])*b.
    * params = E*3*h*Im; params_active = k*3*h*Im.

    ``kernel`` (what executes the rows; ``harness.variants.fast_moe``): ``loop`` (the vendor loop),
    ``triton`` and ``grouped_mm`` (rows grouped per expert on the device: the formulas above;
    Triton's padding of each expert's rows to its block is not counted) read each touched expert
    once. ``gather`` (the torch fallback when T*k <= E) reads one expert's weights per row:
    bytes_weights = T*k * 3*h*Im*b. ``dense`` (the torch fallback otherwise) runs every expert on
    every token: tensor FLOPs and flops_counted = E/k times the above (flops_useful unchanged),
    all E experts' weights read, expert outputs E*T*h written.
    """

    family: ClassVar[str] = "moe_routed"
    title: ClassVar[str] = "MoE routed experts"
    tokens: int
    hidden: int
    inter: int
    experts: int
    top_k: int
    touched: Optional[float] = None   # None: uniform-routing expectation
    b: int = 2
    kernel: str = "loop"              # loop | triton | grouped_mm | gather | dense

    def touched_experts(self) -> float:
        if self.touched is not None:
            return self.touched
        return expected_touched(self.experts, self.top_k, self.tokens)

    def cost(self) -> Cost:
        T, k, h, Im = self.tokens, self.top_k, self.hidden, self.inter
        rows = T * k
        fl = 3 * linear(rows, h, Im)
        per_expert = 3 * h * Im
        act_r = T * h + 2 * rows * h + 2 * rows * Im + rows * h
        act_w = rows * h + 2 * rows * Im + rows * h + T * h
        executed, weights = fl, self.touched_experts()
        if self.kernel == "gather":
            weights = rows
        elif self.kernel == "dense":
            executed, weights = 3 * linear(T * self.experts, h, Im), self.experts
            act_w += (self.experts - k) * T * h
        return Cost(tensor_flops=executed, flops_counted=executed, flops_useful=fl,
                    vector_flops=(SILU + 1) * rows * Im + rows * h + T * (k - 1) * h,
                    bytes_weights=weights * per_expert * self.b,
                    bytes_act_read=act_r * self.b, bytes_act_write=act_w * self.b,
                    params=self.experts * per_expert, params_active=k * per_expert)


@dataclass
class MoEShared(Family):
    """Shared expert of one MoE layer: SwiGLU h -> Is -> h (Is = n_shared * Im) on every token,
    added to the routed output, plus the layer's residual add.

    T = B*S tokens:

    * flops_counted = tensor_flops = flops_useful = 3 * 2*T*h*Is.
    * vector_flops = 6*T*Is + T*h (routed + shared) + T*h (residual).
    * bytes: weights 3*h*Is*b; act read (2*T*h + 2*T*Is + 2*T*h)*b, write (2*T*Is + T*h)*b.
    * params = 3*h*Is.
    """

    family: ClassVar[str] = "moe_shared"
    title: ClassVar[str] = "MoE shared expert"
    tokens: int
    hidden: int
    inter: int
    b: int = 2

    def cost(self) -> Cost:
        T, h = self.tokens, self.hidden
        fl, vec, r, w, params = _swiglu(T, h, self.inter, self.b, residual=True)
        return Cost(tensor_flops=fl, flops_counted=fl, flops_useful=fl, vector_flops=vec + T * h,
                    bytes_weights=params * self.b, bytes_act_read=r + T * h * self.b, bytes_act_write=w,
                    params=params, params_active=params)


@dataclass
class LMHead(Family):
    """Untied LM head h -> V (no bias) on R rows (every prefill position when
    ``lm_head_all_positions``, as the vendor does, unless ``execution.prefill_logits=last``: 1 per
    sequence then, as in decode; ``harness.config.prefill_logit_rows``), logits cast to fp32.

    * flops_counted = tensor_flops = flops_useful = 2*R*h*V.
    * vector_flops = 0.
    * bytes: weights V*h*b; act read R*h*b, write R*V*b; the fp32 cast (when b != 4) reads R*V*b
      and writes R*V*4 more.
    * params = V*h.
    """

    family: ClassVar[str] = "lm_head"
    title: ClassVar[str] = "LM head (+ fp32 logits)"
    rows: int
    hidden: int
    vocab: int
    b: int = 2

    def cost(self) -> Cost:
        R, h, V = self.rows, self.hidden, self.vocab
        fl = linear(R, h, V)
        cast_r = R * V * self.b if self.b != 4 else 0
        cast_w = R * V * 4 if self.b != 4 else 0
        return Cost(tensor_flops=fl, flops_counted=fl, flops_useful=fl, bytes_weights=V * h * self.b,
                    bytes_act_read=R * h * self.b + cast_r, bytes_act_write=R * V * self.b + cast_w,
                    params=V * h, params_active=V * h)


FAMILIES: tuple = (PatchEmbed, LayerNorm, SAMAttention, SAMMLP, LayerNorm2d, Conv2d, CLIPEmbeddings,
                   CLIPAttention, CLIPMLP, Projector, ImageLayout, TokenEmbedding, RMSNorm, RoPE,
                   LLMAttention, DenseMLP, MoEGate, MoERouted, MoEShared, LMHead)
FAMILY_BY_NAME = {cls.family: cls for cls in FAMILIES}


def total(costs: Sequence[Cost]) -> Cost:
    out = Cost()
    for c in costs:
        out = out + c
    return out


__all__ = ["Cost", "Family", "FAMILIES", "FAMILY_BY_NAME", "COST_FIELDS", "FLOP_FIELDS", "BYTE_FIELDS",
           "expected_touched", "conv_out", "total"] + [cls.__name__ for cls in FAMILIES]
