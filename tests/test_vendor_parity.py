"""Reference model vs the vendor's own DeepSeek-OCR code: same random weights, same logits.

The parity tests run only when ``HARNESS_VENDOR_DIR`` points at a vendor directory (the Hugging
Face snapshot's config.json and *.py files; safetensors are not needed) and transformers 4.46.3
is importable (the ``vendor`` extra); otherwise they are skipped with the reason::

    HARNESS_VENDOR_DIR=models/deepseek-ocr pytest -q tests/test_vendor_parity.py -s

Method (issue 2): the reference model is built with a seed, in fp32 with TF32 off, on CUDA when
available, else the CPU; it runs a synthetic base-mode page (1024 global view): prefill logits
(all positions) and 8 greedy decode steps, whose tokens are kept. The full-size model is ~13 GB
in fp32, so only one model exists at a time: the reference is freed, then ``load_vendor`` builds
the vendor model and adopts the same seeded weights; the vendor prefill and 8 decode steps are
fed the reference's tokens (teacher forcing). Every logit tensor must agree to a relative error
||vendor - ref|| / ||ref|| <= 1e-4. A shrunken-LLM variant (2 decoder layers; the vendor's vision
sizes are hard-coded) goes through ``AutoModel.from_pretrained`` on a saved checkpoint.

The remaining tests check the adapter's one-line errors and need neither the vendor code nor
transformers.
"""
from __future__ import annotations

import gc
import json
import os
import resource
import shutil
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from harness.errors import HarnessError
from harness.models.vendor import loader as V

TOL = 1e-4
DECODE_STEPS = 8
VENDOR_PIN = "4.46.3"


# --------------------------------------------------------------------------------------------
# fixtures and helpers
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vendor_dir() -> Path:
    raw = os.environ.get("HARNESS_VENDOR_DIR")
    if not raw:
        pytest.skip("HARNESS_VENDOR_DIR is not set (point it at the DeepSeek-OCR snapshot directory)")
    try:
        path = V.check_vendor_dir(raw)
    except HarnessError as exc:
        pytest.skip(f"HARNESS_VENDOR_DIR={raw} is not a vendor directory: {exc}")
    try:
        import transformers
    except ImportError as exc:
        pytest.skip(f"transformers is not importable ({exc}); install the `vendor` extra "
                    f"(transformers=={VENDOR_PIN})")
    if transformers.__version__ != VENDOR_PIN:
        pytest.skip(f"transformers {transformers.__version__} is installed; the vendor code needs {VENDOR_PIN}")
    return path


@pytest.fixture
def fp32_strict():
    """TF32 off for matmuls and convolutions for the duration of a test."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
           torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old[:2]
    torch.set_float32_matmul_precision(old[2])


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _request(mode: str = "base", decode_tokens: int = DECODE_STEPS + 1):
    from harness import workload as W

    return W.build_request(W.load_pages(None, pages=1, seed=0), mode, decode_tokens=decode_tokens)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm())


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux: KiB


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@torch.inference_mode()
def _reference_run(ref, req, steps: int) -> dict:
    """Reference prefill logits, greedy tokens and the logits of ``steps`` decode steps (CPU)."""
    from harness.models.llm import KVCache

    dev = next(ref.parameters()).device
    vision: dict = {}
    hooks = [mod.register_forward_hook(lambda m, a, o, n=name: vision.setdefault(n, []).append(o.detach().cpu()))
             for name, mod in (("sam", ref.model.sam_model), ("clip", ref.model.vision_model),
                               ("projector", ref.model.projector))]
    try:
        gv = req.global_views.to(dev)
        tiles = None if req.tiles is None else req.tiles.to(dev)
        img = ref.image_embeddings(gv, tiles, req.grid)
        cache = KVCache(ref.cfg.llm.num_layers)
        prefill = ref.prefill(req.input_ids.to(dev), req.images_seq_mask.to(dev), img, cache)
    finally:
        for h in hooks:
            h.remove()
    tokens = [prefill[:, -1].argmax(-1, keepdim=True)]
    decode = []
    for _ in range(steps):
        logits = ref.decode_step(tokens[-1], cache)
        decode.append(logits.cpu())
        tokens.append(logits[:, -1].argmax(-1, keepdim=True))
    return {"prefill": prefill.cpu(), "decode": decode, "tokens": [t.cpu() for t in tokens], "vision": vision}


@torch.no_grad()
def _vendor_run(vend, req, tokens: list, steps: int) -> dict:
    """Vendor prefill and ``steps`` decode steps fed the reference's tokens (teacher forcing)."""
    capture: dict = {}
    cache = vend.new_cache()
    prefill = vend.prefill(req, cache, capture=capture)
    decode = [vend.decode_step(tokens[i], cache).cpu() for i in range(steps)]
    vision = {k: [t.detach().cpu() for t in v] for k, v in capture.items()}
    return {"prefill": prefill.cpu(), "decode": decode, "vision": vision}


def _compare(ref: dict, ven: dict, steps: int) -> dict:
    errs = {f"{name}[{i}]": _rel(ven["vision"][name][i], t)
            for name, outs in ref["vision"].items() for i, t in enumerate(outs)}
    errs["prefill (all positions)"] = _rel(ven["prefill"], ref["prefill"])
    errs["prefill (last position)"] = _rel(ven["prefill"][:, -1], ref["prefill"][:, -1])
    for i in range(steps):
        errs[f"decode step {i}"] = _rel(ven["decode"][i], ref["decode"][i])
    return errs


def _report(title: str, errs: dict, times: dict) -> None:
    print(f"\n{title}")
    for k, v in errs.items():
        print(f"  rel err {k:<26} {v:.3e}")
    for k, v in times.items():
        print(f"  {k:<34} {v}")


# --------------------------------------------------------------------------------------------
# parity
# --------------------------------------------------------------------------------------------

@pytest.mark.vendor
@pytest.mark.slow
def test_vendor_parity_full_size(vendor_dir, fp32_strict):
    """Full-size model, base mode, fp32, eager attention on both sides."""
    from harness.models.build import build_model

    device = _device()
    req = _request("base")
    cfg = V.vendor_reference_config(vendor_dir, "eager", trust_remote_code=True)
    times = {"device": str(device), "prompt tokens": int(req.input_ids.shape[1])}

    t0 = time.perf_counter()
    ref = build_model(cfg, device, torch.float32, seed=0)
    times["reference build s"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    r = _reference_run(ref, req, DECODE_STEPS)
    times["reference prefill+8 steps s"] = round(time.perf_counter() - t0, 1)
    del ref
    _free()

    t0 = time.perf_counter()
    vend = V.load_vendor(vendor_dir, device, torch.float32, "eager", seed=0, trust_remote_code=True)
    times["vendor load (seeded) s"] = round(time.perf_counter() - t0, 1)
    assert vend.info["attn_implementation"] == "eager"
    assert vend.info["attention_class"].endswith("LlamaAttention")
    t0 = time.perf_counter()
    v = _vendor_run(vend, req, [t.to(device) for t in r["tokens"]], DECODE_STEPS)
    times["vendor prefill+8 steps s"] = round(time.perf_counter() - t0, 1)
    del vend
    _free()
    times["peak RSS GB"] = round(_peak_rss_gb(), 2)
    if device.type == "cuda":
        times["peak CUDA GB"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)

    errs = _compare(r, v, DECODE_STEPS)
    _report("vendor parity, full size (12 layers), base mode, fp32", errs, times)
    print("  reference greedy tokens", torch.cat(r["tokens"], dim=1).tolist())
    assert r["prefill"].abs().max() > 0  # not a degenerate comparison
    bad = {k: e for k, e in errs.items() if not e <= TOL}
    assert not bad, f"relative errors above {TOL}: {bad}"


@pytest.mark.vendor
@pytest.mark.slow
def test_vendor_parity_reduced_llm_from_pretrained(vendor_dir, fp32_strict, tmp_path):
    """2-layer LLM (full vision), weights saved as safetensors and loaded by from_pretrained;
    also the full generate() path: tokens, routing counts and KV bytes equal the reference's."""
    from harness.models.build import build_model, save_weights

    device = _device()
    layers = 2
    # a vendor directory with the shrunken config and a checkpoint of our seeded weights
    vdir = tmp_path / "vendor-2layer"
    vdir.mkdir()
    for f in V.VENDOR_CODE_FILES:
        shutil.copy(vendor_dir / f, vdir / f)
    conf = json.loads((vendor_dir / "config.json").read_text())
    conf["num_hidden_layers"] = layers
    conf.get("language_config", {})["num_hidden_layers"] = layers
    (vdir / "config.json").write_text(json.dumps(conf, indent=1))
    cfg = V.vendor_reference_config(vdir, "eager", trust_remote_code=True)
    assert cfg.llm.num_layers == layers

    req = _request("base")
    ref = build_model(cfg, device, torch.float32, seed=1)
    r = _reference_run(ref, req, DECODE_STEPS)
    ref_gen = ref.generate(req)
    save_weights(ref, vdir)
    del ref
    _free()

    vend = V.load_vendor(vdir, device, torch.float32, "eager", trust_remote_code=True)
    assert vend.info["weights"]["source"] == "safetensors"
    v = _vendor_run(vend, req, [t.to(device) for t in r["tokens"]], DECODE_STEPS)
    ven_gen = vend.generate(req)
    del vend
    _free()

    errs = _compare(r, v, DECODE_STEPS)
    _report(f"vendor parity, {layers}-layer LLM via from_pretrained, base mode, fp32", errs,
            {"peak RSS GB": round(_peak_rss_gb(), 2)})
    bad = {k: e for k, e in errs.items() if not e <= TOL}
    assert not bad, f"relative errors above {TOL}: {bad}"
    assert torch.equal(ven_gen.tokens.cpu(), ref_gen.tokens.cpu())
    for phase in ("prefill", "decode"):
        assert ven_gen.routing[phase].shape == ref_gen.routing[phase].shape == (layers, cfg.llm.n_routed_experts)
        assert (ven_gen.routing[phase] == ref_gen.routing[phase]).all(), phase
    assert ven_gen.kv_cache_bytes == ref_gen.kv_cache_bytes


@pytest.mark.vendor
def test_vendor_checkpoint_mismatch_is_one_line_error(vendor_dir, tmp_path):
    from safetensors.torch import save_file

    for f in V.VENDOR_CODE_FILES:
        (tmp_path / f).symlink_to((vendor_dir / f).resolve())
    save_file({"lm_head.weight": torch.zeros(3, 5)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(HarnessError) as exc:
        V.load_vendor(tmp_path, "cpu", torch.float32, "eager", trust_remote_code=True)
    msg = str(exc.value)
    assert "does not match" in msg and "missing" in msg and "mismatched" in msg and "\n" not in msg


# --------------------------------------------------------------------------------------------
# errors that need no vendor code
# --------------------------------------------------------------------------------------------

def _fake_vendor_dir(root: Path) -> Path:
    for f in V.VENDOR_CODE_FILES:
        (root / f).write_text("{}" if f.endswith(".json") else "# placeholder\n")
    return root


@pytest.mark.parametrize("case", ["unset", "missing", "file", "empty", "no_code"])
def test_bad_vendor_dir_is_one_line_error(tmp_path, case):
    path = {"unset": None, "missing": tmp_path / "nope", "file": tmp_path / "f.txt",
            "empty": tmp_path / "empty", "no_code": tmp_path / "nocode"}[case]
    if case == "file":
        path.write_text("x")
    if case == "empty":
        path.mkdir()
    if case == "no_code":
        path.mkdir()
        (path / "config.json").write_text("{}")
    with pytest.raises(HarnessError) as exc:
        V.load_vendor(path, "cpu", torch.float32, "eager")
    assert exc.value.fix and "\n" not in str(exc.value)
    if case == "no_code":
        assert "modeling_deepseekocr.py" in str(exc.value)


@pytest.mark.parametrize("attn", ["sdpa", "sdpa_flash", "bogus"])
def test_unsupported_attention_is_refused(tmp_path, attn):
    with pytest.raises(HarnessError, match="eager or flash_attention_2"):
        V.load_vendor(_fake_vendor_dir(tmp_path), "cpu", torch.float32, attn)


def test_vendor_attention_mapping():
    assert V.vendor_attn_name("eager") == "eager"
    assert V.vendor_attn_name("flash_attention_2") == "flash_attention_2"


@pytest.mark.parametrize("version", [None, "4.57.1"])
def test_wrong_transformers_names_the_vendor_extra(tmp_path, monkeypatch, version):
    if version is None:
        monkeypatch.setitem(sys.modules, "transformers", None)  # import raises ImportError
    else:
        monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(__version__=version))
    with pytest.raises(HarnessError) as exc:
        V.load_vendor(_fake_vendor_dir(tmp_path), "cpu", torch.float32, "eager", trust_remote_code=True)
    assert "vendor" in exc.value.fix and "transformers==4.46.3" in exc.value.fix


def test_checkpoint_header_check(tmp_path):
    from safetensors.torch import save_file

    from harness.models.checkpoint import check_tensors, read_headers

    f = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(2, 3), "b": torch.zeros(4), "z": torch.zeros(1)}, str(f))
    assert check_tensors(read_headers([f]), {"a": (2, 3), "b": (4,)}, tmp_path, optional={"z"}) == 3
    with pytest.raises(HarnessError) as exc:
        check_tensors(read_headers([f]), {"a": (3, 2), "c": (1,)}, tmp_path, optional=set())
    msg = str(exc.value)
    assert "1 missing (c)" in msg and "unexpected" in msg and "1 mismatched (a (2, 3) vs model (3, 2))" in msg


def test_checkpoint_files(tmp_path):
    from safetensors.torch import save_file

    assert V.checkpoint_files(tmp_path) == []
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert V.checkpoint_files(tmp_path) == []  # index without shards: a code-only snapshot
    save_file({"a": torch.zeros(1)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    with pytest.raises(HarnessError, match="incomplete"):
        V.checkpoint_files(tmp_path)
    save_file({"b": torch.zeros(1)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    assert [p.name for p in V.checkpoint_files(tmp_path)] == ["model-00001-of-00002.safetensors",
                                                             "model-00002-of-00002.safetensors"]


# --------------------------------------------------------------------------------------------
# the hub is never contacted (issue 15)
# --------------------------------------------------------------------------------------------

HUB_REF = "deepseek-ai/DeepSeek-OCR--modeling_deepseekocr.DeepseekOCRForCausalLM"


@pytest.fixture
def no_network(monkeypatch):
    """Any socket use inside the test raises (and is recorded): a test never reaches the network."""
    import socket

    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network blocked by the test")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    return attempts


def test_hub_auto_map_is_refused_before_transformers(tmp_path, no_network, monkeypatch):
    """A config.json mapping AutoModel to a hub repository: refused with one line, before
    transformers is imported (poisoned here: importing it would fail the test differently) and
    without a single socket."""
    path = _fake_vendor_dir(tmp_path)
    (path / "config.json").write_text(json.dumps({"auto_map": {
        "AutoConfig": "configuration_deepseek_v2.DeepseekV2Config", "AutoModel": HUB_REF}}))
    monkeypatch.setitem(sys.modules, "transformers", None)
    for load in (lambda: V.load_vendor(path, "cpu", torch.float32, "eager"),
                 lambda: V.vendor_reference_config(path)):
        with pytest.raises(HarnessError) as exc:
            load()
        assert exc.value.problem == (f"{path / 'config.json'} has an auto_map that points at code on the Hugging "
                                     f"Face hub (AutoModel: {HUB_REF}); the harness runs only local code and never "
                                     "downloads any")
        assert exc.value.fix.startswith("put that repository's *.py files in the model directory")
    assert no_network == []


def test_hub_tokenizer_code_is_refused(tmp_path, no_network):
    from harness.workload import load_tokenizer

    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["org/repo--tokenization.Slow", None]}}))
    with pytest.raises(HarnessError, match=r"tokenizer_config.json has an auto_map .* \(AutoTokenizer: "
                                           r"org/repo--tokenization.Slow\)"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tokenization.Slow", None]}}))     # local code passes the check
    from harness.hub import refuse_hub_code
    refuse_hub_code(tmp_path)
    assert no_network == []


def test_hub_offline_for_the_load_then_restored(monkeypatch):
    from harness.hub import hub_offline

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    constants = types.SimpleNamespace(HF_HUB_OFFLINE=False)
    monkeypatch.setitem(sys.modules, "huggingface_hub.constants", constants)
    with hub_offline():
        assert (os.environ["HF_HUB_OFFLINE"], os.environ["TRANSFORMERS_OFFLINE"]) == ("1", "1")
        assert constants.HF_HUB_OFFLINE is True
    assert "HF_HUB_OFFLINE" not in os.environ and os.environ["TRANSFORMERS_OFFLINE"] == "0"
    assert constants.HF_HUB_OFFLINE is False
