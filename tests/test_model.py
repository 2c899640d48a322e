"""The reference model: exact checkpoint layout (full size, on ``meta``) and a tiny config on the CPU.

Everything here is exact or fp32-tight and runs in seconds: the full-size model is only ever
built on the ``meta`` device (no storage), the rest uses conf/model/tiny.yaml.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from harness import workload as wl
from harness.config import ModelConfig
from harness.errors import HarnessError
from harness.models.build import build_model, expected_shapes, load_weights, param_counts, save_weights
from harness.models.llm import KVCache

# Tensor names and shapes of the public DeepSeek-OCR checkpoint (from its safetensors index;
# a byte-identical copy of shared/reference/deepseek-ocr/checkpoint_shapes.json).
CHECKPOINT_SHAPES = Path(__file__).resolve().parent / "data" / "checkpoint_shapes.json"

DESIGN_COUNTS = {"llm": 2_934_734_080, "sam": 95_569_152, "clip": 303_177_728, "projector": 2_622_720,
                 "separators": 2_560, "total": 3_336_106_240}


# ------------------------------------------------------------------------------------ helpers

@pytest.fixture(scope="module")
def meta_model():
    return build_model(ModelConfig(), device="meta")


@pytest.fixture(scope="module")
def tiny_model():
    from conftest import load_tiny_cfg

    return build_model(load_tiny_cfg(), device="cpu", dtype=torch.float32, seed=0)


def _page(width: int, height: int, seed: int = 0) -> wl.Page:
    return wl.Page(f"p{width}x{height}", wl.synthetic_page(0, seed=seed, size=(width, height)), "memory")


def _request(mode, width=200, height=300, batch=1, decode_tokens=5):
    """A tiny request; 200x300 px in the tiny crop mode gives a 2x3 tile grid (cols x rows)."""
    return wl.build_request([_page(width, height)] * batch, mode, decode_tokens=decode_tokens)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


class StageLog:
    """A stage function that records every stage context entered: (name, payload)."""

    def __init__(self):
        self.entries: list = []

    @contextlib.contextmanager
    def __call__(self, name, **payload):
        self.entries.append((name, payload))
        yield

    def count(self, name, **match) -> int:
        return sum(1 for n, p in self.entries if n == name and all(p.get(k) == v for k, v in match.items()))


def _logits(model, req, steps: int):
    """Prefill logits and ``steps`` decode-step logits, each step fed the same fixed tokens."""
    with torch.inference_mode():
        img = model.image_embeddings(req.global_views, req.tiles, req.grid)
        cache = KVCache(model.cfg.llm.num_layers)
        out = [model.prefill(req.input_ids, req.images_seq_mask, img, cache)]
        token = torch.full((req.batch, 1), 4242, dtype=torch.long)
        for i in range(steps):
            out.append(model.decode_step(token + i, cache))
    return out


# ----------------------------------------------------------------- full size (meta, no storage)

def test_state_dict_equals_checkpoint_tensors(meta_model):
    want = {k: tuple(v) for k, v in json.loads(CHECKPOINT_SHAPES.read_text()).items()}
    got = expected_shapes(meta_model)
    assert len(want) == 2710
    missing, unexpected = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    assert not missing and not unexpected, f"missing {missing[:5]}, unexpected {unexpected[:5]}"
    wrong = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    assert not wrong, f"{len(wrong)} shape mismatches, e.g. {list(wrong.items())[:3]}"
    assert sum(torch.Size(s).numel() for s in want.values()) == DESIGN_COUNTS["total"]


def test_param_counts_per_component(meta_model):
    assert param_counts(meta_model) == DESIGN_COUNTS


# -------------------------------------------------------------------------- tiny model (CPU)

def test_encode_view_shapes(tiny_model, tiny_cfg):
    hidden = tiny_cfg.llm.hidden_size
    for size, q in ((128, 2), (64, 1), (256, 4)):
        out = tiny_model.encode_view(torch.randn(3, 3, size, size))
        assert tuple(out.shape) == (3, q * q, hidden), size


def test_generate_batch2_tokens_and_routing(tiny_model, tiny_cfg, tiny_mode):
    req = _request(tiny_mode, batch=2, decode_tokens=5)
    assert req.grid == (2, 3)
    res = tiny_model.generate(req)
    assert tuple(res.tokens.shape) == (2, 5)
    assert res.tokens.dtype == torch.long
    assert int(res.tokens.min()) >= 0 and int(res.tokens.max()) < tiny_cfg.llm.vocab_size
    llm = tiny_cfg.llm
    B, S, k = req.batch, req.prefill_tokens, llm.num_experts_per_tok
    steps = 5 - 1
    for phase, tokens in (("prefill", B * S), ("decode", B * steps)):
        per_layer = res.routing[phase].sum(axis=1)
        assert res.routing[phase].shape == (llm.num_layers, llm.n_routed_experts)
        for layer in range(llm.num_layers):
            want = 0 if layer < llm.first_k_dense_replace else tokens * k
            assert per_layer[layer] == want, (phase, layer, per_layer)
    # KV cache: K and V of every layer over prompt + decode steps
    kv = 2 * llm.num_layers * B * llm.num_kv_heads * (S + steps) * llm.head_dim * 4
    assert res.kv_cache_bytes == kv


@pytest.mark.parametrize("kv_cache", ["growing", "static"])
def test_image_embeds_computed_ahead_give_the_same_tokens(tiny_model, tiny_mode, kv_cache):
    """A request carrying its image embeddings (``Request.image_embeds``, the throughput experiment's
    overlap_vision) decodes the same greedy tokens as one whose vision runs inside, and opens no vision
    stage range: in the vendor's execution and under the static-cache engine (``variants.engine``, whose
    first token is its own)."""
    import contextlib
    import dataclasses

    from harness import variants
    from harness.config import ExecutionConfig
    from harness.models.generate import generate

    variants.apply(tiny_model, ExecutionConfig(kv_cache=kv_cache))
    req = _request(tiny_mode, batch=2, decode_tokens=5)
    ref = generate(tiny_model, req).tokens
    with torch.inference_mode():
        embeds = tiny_model.image_embeddings(req.global_views, req.tiles, req.grid)
    seen = []

    @contextlib.contextmanager
    def stage(name, **_):
        seen.append(name)
        yield

    got = generate(tiny_model, dataclasses.replace(req, image_embeds=embeds), stage).tokens
    variants.apply(tiny_model, ExecutionConfig())
    assert torch.equal(got, ref)
    assert not {"sam", "clip", "projector"} & set(seen) and "prefill" in seen


def test_deferred_routing_counts_survive_the_next_request(tiny_model, tiny_mode):
    """generate(defer_routing=True) under the static-cache engine (device routing counts): request A's counts
    read after request B ran are A's own, the counts a direct read of A gives (on the CPU the deferred read
    once returned views of the engine's buffers, which B's start zeroes and refills)."""
    from harness import variants
    from harness.config import ExecutionConfig
    from harness.models.generate import generate

    variants.apply(tiny_model, ExecutionConfig(kv_cache="static", moe_impl="grouped", moe_kernel="torch"))
    a = _request(tiny_mode, batch=1, decode_tokens=5)
    b = wl.build_request([_page(300, 200, seed=7)], tiny_mode, decode_tokens=5)
    direct = generate(tiny_model, a)
    deferred = generate(tiny_model, a, defer_routing=True)
    generate(tiny_model, b)
    routing, steps = deferred.pending()
    variants.apply(tiny_model, ExecutionConfig())
    assert np.array_equal(steps, direct.routing_steps)
    assert all(np.array_equal(routing[k], direct.routing[k]) for k in ("prefill", "decode"))


def test_batch_rows_are_independent(tiny_model, tiny_mode):
    one = _logits(tiny_model, _request(tiny_mode, batch=1), steps=2)
    two = _logits(tiny_model, _request(tiny_mode, batch=2), steps=2)
    for a, b in zip(two, one):
        assert _rel(a[1:2], b) < 1e-5
        assert _rel(a[0:1], b) < 1e-5


def test_eager_and_sdpa_agree(tiny_cfg, tiny_mode):
    tiny_cfg.attn_implementation = "eager"
    eager = build_model(tiny_cfg, seed=3)
    tiny_cfg.attn_implementation = "sdpa"
    sdpa = build_model(tiny_cfg, seed=3)
    for (ka, va), (kb, vb) in zip(eager.state_dict().items(), sdpa.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka
    req = _request(tiny_mode, batch=2)
    for step, (a, b) in enumerate(zip(_logits(eager, req, 3), _logits(sdpa, req, 3))):
        assert _rel(a, b) < 1e-5, step


def test_seed_decides_the_weights(tiny_cfg):
    a, b, c = (build_model(tiny_cfg, seed=s).state_dict() for s in (7, 7, 8))
    assert all(torch.equal(a[k], b[k]) for k in a)
    differ = [k for k in a if not torch.equal(a[k], c[k])]
    # norms (1/0) and biases (0) are seed-independent; every other tensor must differ
    assert "lm_head.weight" in differ and "model.sam_model.pos_embed" in differ
    assert len(differ) > len(a) // 3


def test_save_load_round_trip(tiny_model, tiny_cfg, tmp_path):
    path = save_weights(tiny_model, tmp_path)
    assert path.name == "model.safetensors"
    other = build_model(tiny_cfg, seed=0, init=False)
    info = load_weights(other, tmp_path)
    assert info["tensors"] == len(tiny_model.state_dict())
    for k, v in tiny_model.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k


def _resave(src_dir: Path, dst_dir: Path, edit) -> Path:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(src_dir / "model.safetensors"))
    edit(sd)
    dst_dir.mkdir()
    save_file(sd, str(dst_dir / "model.safetensors"))
    return dst_dir


@pytest.mark.parametrize("case,word", [
    ("missing", "missing"),
    ("mismatched", "mismatched"),
    ("unexpected", "unexpected"),
    ("empty", "no *.safetensors"),
    ("absent", "does not exist"),
])
def test_load_weights_errors(tiny_model, tiny_cfg, tmp_path, case, word):
    save_weights(tiny_model, tmp_path / "good")
    edits = {
        "missing": lambda sd: sd.pop("model.layers.1.mlp.gate.weight"),
        "mismatched": lambda sd: sd.__setitem__("lm_head.weight", sd["lm_head.weight"][:-1].clone()),
        "unexpected": lambda sd: sd.__setitem__("model.extra.weight", torch.zeros(3)),
    }
    if case in edits:
        path = _resave(tmp_path / "good", tmp_path / case, edits[case])
    elif case == "empty":
        path = tmp_path / "empty"
        path.mkdir()
    else:
        path = tmp_path / "absent"
    target = build_model(tiny_cfg, seed=1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(HarnessError) as exc:
        load_weights(target, path)
    msg = str(exc.value)
    assert word in msg and "fix:" in msg and "\n" not in msg, msg
    # nothing was half-loaded
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_crop_request_runs_each_vision_stage_twice(tiny_model, tiny_mode):
    req = _request(tiny_mode, width=200, height=300, decode_tokens=4)
    assert req.grid == (2, 3) and req.tiles.shape[0] == 6
    log = StageLog()
    res = tiny_model.generate(req, stage=log)
    assert tuple(res.tokens.shape) == (1, 4)
    for name in ("sam", "clip"):
        assert log.count(name) == 2, log.entries
        assert [p["call"] for n, p in log.entries if n == name] == [0, 1]  # tiles, then the global view
    vision_projector = [p for n, p in log.entries if n == "projector" and not p.get("glue")]
    assert [p["call"] for p in vision_projector] == [0, 1]
    assert log.count("projector", glue=True) == 1
    assert log.count("request") == log.count("prefill") == log.count("decode") == 1
    assert [p["step"] for n, p in log.entries if n == "decode_step"] == [0, 1, 2]
    order = [n for n, _ in log.entries if n != "decode_step"]
    assert order == ["request", "sam", "clip", "projector", "sam", "clip", "projector", "projector",
                     "prefill", "decode"]


def test_no_crop_request_runs_each_vision_stage_once(tiny_model):
    req = _request({"name": "t64", "base_size": 64, "image_size": 64, "crop": False}, decode_tokens=2)
    log = StageLog()
    tiny_model.generate(req, stage=log)
    assert req.tiles is None
    assert log.count("sam") == log.count("clip") == 1
    assert log.count("decode_step") == 1


# ------------------------------------------------------------------------------ GPU (marker gpu)

@pytest.mark.gpu
def test_tiny_generate_on_cuda_bf16(tiny_cfg, tiny_mode):
    model = build_model(tiny_cfg, device="cuda", dtype=torch.bfloat16, seed=0)
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in model.parameters())
    req = _request(tiny_mode, batch=2, decode_tokens=5).to("cuda", torch.bfloat16)
    res = model.generate(req)
    assert tuple(res.tokens.shape) == (2, 5) and res.tokens.device.type == "cuda"
    k = tiny_cfg.llm.num_experts_per_tok
    assert res.routing["prefill"].sum() == (tiny_cfg.llm.num_layers - 1) * 2 * req.prefill_tokens * k


@pytest.mark.gpu
def test_full_size_builds_on_cuda_in_seconds():
    import time

    torch.cuda.init()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model = build_model(ModelConfig(), device="cuda", dtype=torch.bfloat16, seed=0)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    try:
        assert param_counts(model)["total"] == DESIGN_COUNTS["total"]
        assert sum(p.numel() * p.element_size() for p in model.state_dict().values()) == 6_672_212_480
        assert seconds < 10, f"full-size bf16 build took {seconds:.1f} s"
    finally:
        del model
        torch.cuda.empty_cache()


@pytest.mark.parametrize("V,chunk", [(129280, 1024), (1000, 128), (64, 64), (10, 1024)])
def test_greedy_chunked_picks_the_same_token_as_argmax(V, chunk):
    """Two-stage argmax (per chunk, then across chunks) = argmax, ties to the first index."""
    from harness.models.adapter import greedy, greedy_chunked

    g = torch.Generator().manual_seed(V)
    logits = torch.randn(3, 2, V, generator=g)
    logits[1, -1, :] = 0.0                                # all tied: index 0
    logits[2, -1, V // 2] = logits[2, -1, V - 1] = 99.0   # a tie across chunks: the first one
    assert torch.equal(greedy_chunked(logits, chunk), greedy(logits))
    assert greedy_chunked(logits, chunk)[1, 0] == 0 and greedy_chunked(logits, chunk)[2, 0] == V // 2
