"""SAM attention with decomposed relative position: the dense-mask reference and an exact
augmented-head-dim method that needs no S x S mask.

Conventions (one attention call; shapes as SDPA takes them):

- ``q, k, v``: [B, nh, S, d] with S = H * W tokens of an H x W grid, row-major (token
  j = h(j) * W + w(j)). B is images (global blocks) or images x windows (windowed blocks; the
  window's zero-padded tokens are ordinary tokens here, exactly as in the dense path).
- ``Rh``: [H, H, d] and ``Rw``: [W, W, d], the per-axis tables from ``models.vision.rel_pos_table``.
- bias[i, j] = rel_h[i, h(j)] + rel_w[i, w(j)], rel_h[i, :] = q_i @ Rh[h(i)]^T ([S, H]),
  rel_w[i, :] = q_i @ Rw[w(i)]^T ([S, W]); scores = q_i . k_j / sqrt(d) + bias[i, j].

The augmented method writes the bias as part of one dot product,

    q'_i = [q_i, sqrt(d) * rel_h[i, :], sqrt(d) * rel_w[i, :], 0...]     (d' columns)
    k'_j = [k_j, onehot_H(h(j)),        onehot_W(w(j)),        0...]
    q'_i . k'_j / sqrt(d) = q_i . k_j / sqrt(d) + rel_h[i, h(j)] + rel_w[i, w(j)],

and calls SDPA with ``scale = 1/sqrt(d)`` (the model's scale, not 1/sqrt(d')) and no mask, so
a fused kernel runs. The sqrt(d) factor is folded into the small tables (Rh * sqrt(d)), not into
q: for d = 64 it is 8, a power of two, so the rounding of q' equals the rounding of the dense
path's rel_h / rel_w, and in bf16 the bias sum is accumulated in fp32 inside the MMA (the dense
path rounds rel_h + rel_w to bf16 first). d' = augmented_dim(d, H, W, multiple) (``harness.knobs``): zero columns
pad d + H + W up to a multiple (8 by default: what efficient/cuDNN need for 16-bit inputs).

Executed work per call (BH = B * nh, dv = v's head dim, dv_x = the v dim the kernel is given:
dv for efficient / cuDNN / math, d' for flash (v zero-padded, output sliced), or ``pad_v_to``):

- useful attention FLOPs (counted convention, what the dense path's QK^T + PV is): 4*BH*S^2*d
  when dv = d;
- attention kernel FLOPs executed: 2*BH*S^2*d' + 2*BH*S^2*dv_x (the bias add is inside the
  first product: 2*S^2*(H+W) of it, plus 2*S^2*(d'-d-H-W) on zero padding);
- rel-pos einsums: 2*BH*S*(H+W)*d (same as the dense path).
- DRAM bytes (minimum, e = element bytes): no S x S term at all. Kernel reads q', k', v and
  writes o: BH*S*(2*d' + 2*dv_x)*e; building q', k' (and v padding) reads q, rel_h, rel_w, k (v)
  and writes q', k' (v_x). The dense path instead writes and reads a BH*S^2 mask (2*BH*S^2*e).
  ``augmented_cost`` / ``dense_cost`` return these numbers.

Where it pays: global blocks (base mode: 862 MB -> 133 MB per block, for 2x the kernel FLOPs;
3x with flash's padded v). For 196-token windows the mask (2*S = 392 values per query) costs
about what q' and k' do (4*d' = 384), so bytes barely change there and FLOPs grow 1.25-1.5x:
keep the dense path for windows unless the bench says otherwise. ``sam_attention_triton``
adds the bias inside the kernel instead (no mask, no wider head dim; its masked key and query slots
are the only extra FLOPs: 256 x 224 slots for a window's 196 x 196 scores) for both block kinds.

Backends (torch SDPA, chosen with ``torch.nn.attention.sdpa_kernel``; nothing falls back
silently: an explicit backend that cannot run raises ``HarnessError`` with torch's reasons):

- ``flash``: needs d_qk == d_v <= 256 on CUDA -> v zero-padded to d', output sliced to dv. On
  the CPU this is the CPU flash kernel (same padding).
- ``efficient``: CUDA only; accepts d_qk != d_v (both multiples of 8 for 16-bit inputs).
- ``cudnn``: CUDA only; accepts d_qk != d_v; head dims <= 128 on older cuDNN, 256 on sm90/sm100
  with recent cuDNN; d_qk = 192 with d_v = 128 is a special case since cuDNN 9.11 (use
  ``pad_v_to=128``). Whether it runs depends on the installed cuDNN: the bench tells.
- ``math``: the reference composite (exact, slow, S x S scores in memory).
- ``auto``: on CUDA the first of ``AUTO_ORDER_CUDA`` that ``torch.backends.cuda.can_use_*``
  accepts for these shapes (decided once per shape signature); on the CPU ``math``.
Whichever ran is noted in ``attn_probe`` under the call's site, e.g.
``augmented sdpa:efficient_attention d_qk=192 d_v=64``.
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..errors import HarnessError
from ..knobs import augmented_dim
from ..models import attn_probe

#: explicit backends ``augmented_attention`` accepts (plus "auto")
BACKENDS = ("flash", "efficient", "cudnn", "math")
#: order "auto" tries on CUDA; set it from `python -m harness bench sam_attention` on the target GPU
AUTO_ORDER_CUDA = ("cudnn", "flash", "efficient")

_SDPA = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
         "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
_PROBE_NAMES = {"flash": "sdpa:flash_attention", "efficient": "sdpa:efficient_attention",
                "cudnn": "sdpa:cudnn_attention", "math": "sdpa:math"}
_AUTO_CHOICE: dict = {}


# ------------------------------------------------------------------------------- reference

def rel_terms(q, Rh, Rw, H: int, W: int):
    """(rel_h [B, nh, S, H], rel_w [B, nh, S, W]): rel_h[i, :] = q_i @ Rh[h(i)]^T, rel_w[i, :] = q_i @ Rw[w(i)]^T.

    The vendor's einsums over q flattened to [B * nh, H, W, d] (q may be any [B, nh, S, d] view), so
    every path that uses them rounds them as ``SAMAttention.forward`` does.
    """
    B, nh, S, d = q.shape
    _check_grid(S, H, W)
    r_q = q.reshape(B * nh, H, W, d)
    return (torch.einsum("bhwc,hkc->bhwk", r_q, Rh).reshape(B, nh, S, H),
            torch.einsum("bhwc,wkc->bhwk", r_q, Rw).reshape(B, nh, S, W))


def dense_bias_attention(q, k, v, Rh, Rw, H: int, W: int, site: str | None = None) -> torch.Tensor:
    """The vendor path: build bias [B, nh, S, S] and pass it to SDPA as ``attn_mask``.

    Same ops in the same order as ``vision.SAMAttention.forward`` (so bit-identical to it).
    q, k, v [B, nh, S, d]; Rh [H, H, d]; Rw [W, W, d] -> [B, nh, S, dv]. With ``site``, the
    SDPA backend is noted in ``attn_probe`` once per site.
    """
    B, nh, S, d = q.shape
    rel_h, rel_w = rel_terms(q, Rh, Rw, H, W)
    bias = (rel_h.view(B, nh, S, H, 1) + rel_w.view(B, nh, S, 1, W)).view(B, nh, S, S)
    if site is not None and not attn_probe.seen_once(site):
        attn_probe.note(site, attn_probe.sdpa_choice(q, k, v, bias))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


# ------------------------------------------------------------------------------- augmented

@functools.lru_cache(maxsize=32)
def _key_tail(H: int, W: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``_build_key_tail``, cached (eager calls)."""
    return _build_key_tail(H, W, width, dtype, device)


def _build_key_tail(H: int, W: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[S, width]: onehot_H(h(j)) | onehot_W(w(j)) | zeros, for j = h * W + w."""
    S = H * W
    j = torch.arange(S, device=device)
    tail = torch.zeros(S, width, dtype=dtype, device=device)
    tail[j, j // W] = 1
    tail[j, H + j % W] = 1
    return tail


def augment_qk(q, k, Rh, Rw, H: int, W: int, multiple: int = 8):
    """(q', k') [B, nh, S, d'] as in the module docstring; d' = augmented_dim(d, H, W, multiple).

    Use with ``scale = 1/sqrt(d)`` (``q.shape[-1] ** -0.5``), never SDPA's default 1/sqrt(d').
    """
    B, nh, S, d = q.shape
    dp = augmented_dim(d, H, W, multiple)
    # the dense path adds rel_h/rel_w after the 1/sqrt(d) scale; folding sqrt(d) into the tables
    # keeps q untouched (exact when sqrt(d) is a power of two, as for d = 64)
    inv_scale = math.sqrt(d)
    rel_h, rel_w = rel_terms(q, Rh * inv_scale, Rw * inv_scale, H, W)
    parts = [q.reshape(B * nh, S, d), rel_h.reshape(B * nh, S, H), rel_w.reshape(B * nh, S, W)]
    if dp > d + H + W:
        parts.append(rel_h.new_zeros(()).expand(B * nh, S, dp - d - H - W))
    q_aug = torch.cat(parts, dim=-1).view(B, nh, S, dp)
    # under torch.compile the tail is traced into the graph (Dynamo would skip an lru_cache anyway, with a warning)
    tail = (_build_key_tail if torch.compiler.is_compiling() else _key_tail)(H, W, dp - d, k.dtype, k.device)
    k_aug = torch.cat([k.reshape(B * nh, S, d), tail.expand(B * nh, S, dp - d)], dim=-1).view(B, nh, S, dp)
    return q_aug, k_aug


def v_dim_for(backend: str, d_aug: int, dv: int, pad_v_to: int | None = None) -> int:
    """The v head dim the kernel is given: d' for flash (needs equal dims), else dv or pad_v_to."""
    if backend == "flash":
        if pad_v_to is not None and pad_v_to != d_aug:
            raise HarnessError(f"flash needs v padded to d'={d_aug}, got pad_v_to={pad_v_to}")
        return d_aug
    if pad_v_to is None:
        return dv
    if pad_v_to < dv:
        raise HarnessError(f"pad_v_to={pad_v_to} is below v's head dim {dv}")
    return pad_v_to


def augmented_attention(q, k, v, Rh, Rw, H: int, W: int, backend: str = "auto", multiple: int = 8,
                        pad_v_to: int | None = None, site: str | None = None) -> torch.Tensor:
    """Exact decomposed-rel-pos attention without an S x S mask: SDPA over (q', k', v).

    q, k [B, nh, S, d]; v [B, nh, S, dv]; Rh [H, H, d]; Rw [W, W, d] -> [B, nh, S, dv] (for
    ``flash`` a slice of a [B, nh, S, d'] output). ``backend``: one of ``BACKENDS`` or "auto"
    (module docstring); ``pad_v_to`` zero-pads v for backends with head-dim pairs they prefer.
    With ``site`` the backend that ran is noted in ``attn_probe``.
    """
    q_aug, k_aug = augment_qk(q, k, Rh, Rw, H, W, multiple)
    dv = v.shape[-1]
    name = resolve_backend(backend, q_aug, v, pad_v_to)
    dvx = v_dim_for(name, q_aug.shape[-1], dv, pad_v_to)
    v_x = F.pad(v, (0, dvx - dv)) if dvx != dv else v
    out = run_sdpa(name, q_aug, k_aug, v_x, scale=q.shape[-1] ** -0.5)
    if site is not None:
        cpu = " (cpu)" if q.device.type == "cpu" else ""
        attn_probe.note(site, f"augmented {_PROBE_NAMES[name]}{cpu} d_qk={q_aug.shape[-1]} d_v={dvx}")
    return out[..., :dv] if dvx != dv else out


def run_sdpa(name: str, q, k, v, scale: float) -> torch.Tensor:
    """SDPA with only backend ``name`` enabled; a backend that cannot run raises HarnessError."""
    try:
        with sdpa_kernel(_SDPA[name]):
            return F.scaled_dot_product_attention(q, k, v, scale=scale)
    except RuntimeError as exc:
        # the pre-check can accept shapes the kernel then refuses (e.g. a cuDNN graph build)
        reasons = (backend_reasons(name, q, k, v) if q.is_cuda else []) or [str(exc).splitlines()[0]]
        raise HarnessError(f"SDPA backend '{name}' cannot run q{tuple(q.shape)} k{tuple(k.shape)} "
                           f"v{tuple(v.shape)} {q.dtype} on {q.device.type}: {'; '.join(reasons)}",
                           "pick another backend (see python -m harness bench sam_attention) or 'auto'") from exc


def resolve_backend(backend: str, q_aug, v, pad_v_to: int | None = None) -> str:
    """The explicit backend name ``augmented_attention`` will run for ``backend``."""
    if backend in BACKENDS:
        if backend in ("efficient", "cudnn") and not q_aug.is_cuda:
            raise HarnessError(f"backend '{backend}' needs a CUDA device (tensors are on {q_aug.device.type})",
                               "use 'math' or 'flash' on the CPU")
        return backend
    if backend != "auto":
        raise HarnessError(f"unknown backend '{backend}'", f"one of {('auto',) + BACKENDS}")
    if not q_aug.is_cuda:
        return "math"
    key = (q_aug.device, q_aug.dtype, tuple(q_aug.shape), tuple(v.shape), pad_v_to)
    if key not in _AUTO_CHOICE:
        _AUTO_CHOICE[key] = _first_usable(q_aug, v, pad_v_to)
    return _AUTO_CHOICE[key]


def _first_usable(q_aug, v, pad_v_to) -> str:
    why = []
    for name in AUTO_ORDER_CUDA:
        try:
            dvx = v_dim_for(name, q_aug.shape[-1], v.shape[-1], pad_v_to)
        except HarnessError as exc:
            why.append(f"{name}: {exc}")
            continue
        v_x = v.new_empty(v.shape[:-1] + (dvx,))
        reasons = backend_reasons(name, q_aug, q_aug, v_x)
        if not reasons:
            return name
        why.append(f"{name}: {'; '.join(reasons)}")
    raise HarnessError("no fused SDPA backend accepts the augmented SAM attention: " + " | ".join(why),
                       "run python -m harness bench sam_attention to see which backends this torch/GPU offers")


def backend_reasons(name: str, q, k, v) -> list[str]:
    """Why torch's CUDA SDPA backend ``name`` rejects these tensors ([] when it accepts them)."""
    checks = {"flash": torch.backends.cuda.can_use_flash_attention,
              "efficient": torch.backends.cuda.can_use_efficient_attention,
              "cudnn": torch.backends.cuda.can_use_cudnn_attention}
    if name not in checks:
        return []
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, False)
    if checks[name](params, False):
        return []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checks[name](params, True)
    return [str(w.message).split(" (Triggered internally")[0] for w in caught] or ["rejected (no reason given)"]


# ------------------------------------------------------------------------------- module forward

#: dense: the vendor's mask; augmented: SDPA over (q', k', v); triton: sam_attention_triton
METHODS = ("dense", "augmented", "triton")


def triton_attention(q, k, v, Rh, Rw, H: int, W: int, **tiles) -> torch.Tensor:
    """The in-kernel-bias Triton attention from q, k, v [B, nh, S, d] (any views) and the tables:
    ``rel_terms``, then ``sam_attention_triton`` (``tiles``: its ``attend`` options; none: the custom op,
    what torch.compile keeps whole). Returns [B, S, nh, d] contiguous (proj's layout)."""
    from ..kernels import sam_attention_triton as st  # needs triton; imported only when asked for

    rel_h, rel_w = rel_terms(q, Rh, Rw, H, W)
    if tiles:
        return st.attend(q, k, v, rel_h, rel_w, H, W, **tiles)
    return torch.ops.harness.sam_rel_bias_attention(q, k, v, rel_h, rel_w, H, W)


def forward(module, x: torch.Tensor, Rh, Rw, method: str = "augmented", backend: str = "auto",
            site: str | None = "sam") -> torch.Tensor:
    """``vision.SAMAttention.forward`` with the attention step chosen by ``method``.

    ``module`` has ``qkv``, ``proj`` and ``num_heads`` (a SAMAttention); x [B, H, W, C];
    Rh = rel_pos_table(H, H, module.rel_pos_h), Rw = rel_pos_table(W, W, module.rel_pos_w)
    (the caller builds them, so this module does not import vision). Returns [B, H, W, C].
    ``method="dense"`` is bit-identical to the current SAMAttention.forward; ``backend`` applies
    to ``method="augmented"`` only.
    """
    if method not in METHODS:
        raise HarnessError(f"unknown SAM attention method '{method}'", f"one of {METHODS}")
    B, H, W, _ = x.shape
    nh = module.num_heads
    qkv = module.qkv(x).reshape(B, H * W, 3, nh, -1).permute(2, 0, 3, 1, 4)
    if method == "triton":      # strided views of qkv's output; the kernel writes proj's layout
        out = triton_attention(*qkv.unbind(0), Rh, Rw, H, W)
        if site is not None and not torch.compiler.is_compiling():
            attn_probe.note(site, "triton:sam_attention_triton._rel_bias_fwd")
        return module.proj(out.view(B, H, W, -1))
    q, k, v = (t.view(B, nh, H * W, -1) for t in qkv.reshape(3, B * nh, H * W, -1).unbind(0))
    if method == "dense":
        out = dense_bias_attention(q, k, v, Rh, Rw, H, W, site=site)
    else:
        out = augmented_attention(q, k, v, Rh, Rw, H, W, backend=backend, site=site)
    out = out.reshape(B, nh, H, W, -1).permute(0, 2, 3, 1, 4).reshape(B, H, W, -1)
    return module.proj(out)


# ------------------------------------------------------------------------------- cost

@dataclass(frozen=True)
class AttentionCost:
    """FLOPs and minimum DRAM bytes of one SAM attention call (after qkv, before proj).

    flops_useful: 4*BH*S^2*d (QK^T + PV at the model's head dim; counted convention).
    flops_kernel: tensor-core FLOPs the attention kernel executes at the dims it is given.
    flops_relpos: rel-pos einsums 2*BH*S*(H+W)*d (both methods).
    flops_vector: elementwise work per real score, times BH*S^2 (dense: bias build 1 + scale 1 + mask
    add 1 + softmax 5; augmented: scale 1 + softmax 5; in-kernel: scale 1 + the two bias adds 2 +
    softmax 5, as ``harness.analytic``'s SAM attention family counts it).
    bytes_prep: everything before the attention kernel (einsums, bias build or q'/k'/v padding).
    bytes_kernel: the attention kernel's reads and writes, each tensor once.
    """

    flops_useful: int
    flops_kernel: int
    flops_relpos: int
    flops_vector: int
    bytes_prep: int
    bytes_kernel: int

    @property
    def bytes_total(self) -> int:
        return self.bytes_prep + self.bytes_kernel


def dense_cost(bh: int, H: int, W: int, d: int = 64, elem_bytes: int = 2) -> AttentionCost:
    """Dense-mask path. bytes_prep = einsums (read q, write rel_h/rel_w) + bias build (read
    rel_h/rel_w, write the BH*S^2 mask); bytes_kernel = read q, k, v, mask, write o."""
    S = H * W
    e = elem_bytes
    return AttentionCost(
        flops_useful=4 * bh * S * S * d, flops_kernel=4 * bh * S * S * d,
        flops_relpos=2 * bh * S * (H + W) * d, flops_vector=8 * bh * S * S,
        bytes_prep=e * (bh * S * d + 2 * bh * S * (H + W) + bh * S * S),
        bytes_kernel=e * (4 * bh * S * d + bh * S * S))


def augmented_cost(bh: int, H: int, W: int, d: int = 64, dv_x: int | None = None, multiple: int = 8,
                   elem_bytes: int = 2) -> AttentionCost:
    """Augmented path with d' = augmented_dim(d, H, W, multiple), v given to the kernel at dv_x
    (default d; flash: d'). bytes_prep = einsums (read q, write rel) + q' (read q and rel, write
    q') + k' (read k and the [S, d'-d] tail, write k') + v padding when dv_x != d (read v, write
    v_x); bytes_kernel = read q', k', v_x, write o at dv_x. The sliced output is read by the
    caller's reshape at d columns (not counted here)."""
    S = H * W
    dp = augmented_dim(d, H, W, multiple)
    dvx = d if dv_x is None else dv_x
    e = elem_bytes
    relpos = bh * S * (d + H + W)
    qk_prep = (bh * S * (d + H + W) + bh * S * dp) + (bh * S * d + S * (dp - d) + bh * S * dp)
    v_prep = bh * S * (d + dvx) if dvx != d else 0
    return AttentionCost(
        flops_useful=4 * bh * S * S * d, flops_kernel=2 * bh * S * S * (dp + dvx),
        flops_relpos=2 * bh * S * (H + W) * d, flops_vector=6 * bh * S * S,
        bytes_prep=e * (relpos + qk_prep + v_prep),
        bytes_kernel=e * (bh * S * (2 * dp + 2 * dvx)))


def inkernel_bias_cost(bh: int, H: int, W: int, d: int = 64, key_slots: int | None = None,
                       query_slots: int | None = None, elem_bytes: int = 2) -> AttentionCost:
    """A kernel that adds rel_h[i, h(j)] + rel_w[i, w(j)] on the fly (``sam_attention_triton``,
    flex_attention with a score_mod). It visits ``query_slots`` queries (default S) x ``key_slots`` keys
    per query (default S); the Triton kernel's slots, masked ones included, are
    ``harness.sam_attention_tiles.slots``: flops_kernel 4*BH*query_slots*key_slots*d;
    vector: scale, the two bias adds and softmax (1 + 2 + 5) per real score; bytes_prep = einsums (read q,
    write rel_h, rel_w); bytes_kernel = read q, k, v, rel_h, rel_w and write o, each once."""
    S = H * W
    keys = S if key_slots is None else key_slots
    queries = S if query_slots is None else query_slots
    e = elem_bytes
    return AttentionCost(
        flops_useful=4 * bh * S * S * d, flops_kernel=4 * bh * queries * keys * d,
        flops_relpos=2 * bh * S * (H + W) * d, flops_vector=8 * bh * S * S,
        bytes_prep=e * (bh * S * d + bh * S * (H + W)),
        bytes_kernel=e * (4 * bh * S * d + bh * S * (H + W)))


def _check_grid(S: int, H: int, W: int) -> None:
    if S != H * W:
        raise HarnessError(f"sequence length {S} is not H*W = {H}*{W}")
