"""The vendor paths as shipped: its own HF generate (``vendor_loop=hf_generate``) and ``infer()``
(``vendor_entry=infer``), driven with the harness's stage ranges (issue 17).

Two layers:

* CPU tests without the vendor code: a small stand-in of the vendor's top module (``StandIn``:
  the tiny reference model's modules under the vendor's names, a forward with the vendor's
  keyword arguments, and a ``generate`` / ``infer`` that call it once per token the way the vendor's
  do) wrapped in a real ``VendorOCR``, so the drivers, hook-based ranges, routing, dispatch and
  the infer sandbox are covered by CI;
* ``vendor``-marked tests on the real vendor code and transformers 4.46.3 (``HARNESS_VENDOR_DIR``),
  shrunken LLM, tiny custom mode, fp32 on the CPU: HF ``generate`` gives the harness loop's tokens
  when the n-gram guard cannot fire, and exactly the guard's tokens when it does.

``guarded_greedy`` is the rule both are checked against: greedy over the logits with EOS masked
(min_new_tokens = budget) and every token that would repeat an n-gram of prompt + output masked
(HF's NoRepeatNGramLogitsProcessor), driven through the adapter's own first_token/next_token.
"""
from __future__ import annotations

import io
import json
import os
import types
from contextlib import redirect_stdout

import pytest
import torch
from torch import nn

from harness import workload as W
from harness.errors import HarnessError
from harness.measure.recorder import StageRecorder
from harness.measure.observations import stage_rows, step_rows
from harness.models.adapter import GenerationResult, no_stage, own_loop
from harness.models.generate import generate

#: no tiles, 128 px global view: 2 x (2 + 1) + 1 = 7 image tokens
MODE = {"name": "t128", "base_size": 128, "image_size": 128, "crop": False}
STEPS = 10


# --------------------------------------------------------------------------------------------
# the rule
# --------------------------------------------------------------------------------------------

def banned(seq: list, n: int) -> set:
    """Tokens that would complete an n-gram already in ``seq`` (HF's no_repeat_ngram rule)."""
    if n < 1 or len(seq) + 1 < n:
        return set()
    prefix = tuple(seq[len(seq) - n + 1:]) if n > 1 else ()
    return {seq[i + n - 1] for i in range(len(seq) - n + 1) if tuple(seq[i:i + n - 1]) == prefix}


def guarded_greedy(ocr, req, n: int, eos: int, steps: int) -> tuple:
    """(tokens [1, steps], fired): greedy with EOS and the n-gram continuations masked, through the
    adapter's own forwards (the harness loop's, with this ``select``); ``fired`` counts the steps
    where the mask changed the argmax."""
    seq = req.input_ids[0].tolist()
    fired = []

    def select(logits):
        scores = logits[:, -1].float().clone()
        plain = int(scores.argmax(-1))
        scores[:, eos] = float("-inf")
        for t in banned(seq, n):
            scores[:, t] = float("-inf")
        tok = int(scores.argmax(-1))
        fired.append(tok != plain)
        seq.append(tok)
        return torch.tensor([[tok]])

    counter = ocr.routing_counter()
    with torch.inference_mode(), ocr.running(req, steps, counter) as cache:
        tok = ocr.first_token(req, cache, no_stage, select)
        for _ in range(steps - 1):
            tok = ocr.next_token(tok, cache, select)
    return torch.tensor([seq[-steps:]]), sum(fired)


def repeats(prompt: list, out: list, n: int) -> int:
    """How many output tokens complete an n-gram that prompt + output already held."""
    full = prompt + out
    return sum(full[i] in banned(full[:i], n) for i in range(len(prompt), len(full)))


# --------------------------------------------------------------------------------------------
# stand-in of the vendor's top module (no vendor code)
# --------------------------------------------------------------------------------------------

class _Cache:
    """The reference KVCache seen as an HF DynamicCache (key_cache / value_cache)."""

    def __init__(self, layers):
        from harness.models.llm import KVCache

        self.kv = KVCache(layers)

    @property
    def key_cache(self):
        return self.kv.k

    @property
    def value_cache(self):
        return self.kv.v


class StandIn(nn.Module):
    """The vendor's ``DeepseekOCRForCausalLM`` surface over the tiny reference model: ``model``,
    ``lm_head``, ``config``, ``forward(**vendor kwargs)``, ``generate`` (one forward per token,
    greedy with HF's EOS and n-gram masks) and ``infer`` (loads the image file, prints, calls
    ``self.generate`` with infer()'s arguments, replaces ``reset_parameters`` as the vendor's does)."""

    def __init__(self, ref):
        super().__init__()
        from harness.models.llm import MoE

        self.ref = ref
        self.model, self.lm_head = ref.model, ref.lm_head
        moe_cls = type("DeepseekV2MoE", (MoE,), {})   # the class name VendorOCR counts routing on
        for layer in ref.model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.__class__ = moe_cls
        self.config = types.SimpleNamespace(_attn_implementation="eager", eos_token_id=1,
                                            n_routed_experts=ref.cfg.llm.n_routed_experts)
        self.generate_calls: list = []

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, images=None,
                images_seq_mask=None, images_spatial_crop=None, use_cache=True, return_dict=True):
        cache = past_key_values or _Cache(len(self.ref.model.layers))
        if input_ids.shape[1] > 1:
            gv = torch.cat([g for _, g in images])
            img = self.ref.image_embeddings(gv)
            logits = self.ref.prefill(input_ids, images_seq_mask, img, cache.kv)
        else:
            logits = self.ref.decode_step(input_ids, cache.kv)
        return types.SimpleNamespace(logits=logits, past_key_values=cache)

    @torch.no_grad()
    def generate(self, input_ids, attention_mask=None, images=None, images_seq_mask=None, images_spatial_crop=None,
                 max_new_tokens=20, min_new_tokens=0, no_repeat_ngram_size=0, eos_token_id=None, temperature=None,
                 use_cache=True, streamer=None):
        self.generate_calls.append(dict(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                                        no_repeat_ngram_size=no_repeat_ngram_size))
        seq, past = input_ids, None
        for i in range(max_new_tokens):
            if past is None:
                out = self(input_ids=seq, attention_mask=attention_mask, images=images,
                           images_seq_mask=images_seq_mask, images_spatial_crop=images_spatial_crop)
            else:
                out = self(input_ids=seq[:, -1:], past_key_values=past)
            past = out.past_key_values
            scores = out.logits[:, -1].float().clone()
            if i < min_new_tokens and eos_token_id is not None:
                scores[:, eos_token_id] = float("-inf")
            for t in banned(seq[0].tolist(), no_repeat_ngram_size):
                scores[:, t] = float("-inf")
            nxt = scores.argmax(-1, keepdim=True)
            if streamer is not None:
                print(f"<{int(nxt)}>", end="")
            seq = torch.cat([seq, nxt], dim=1)
        return seq

    def infer(self, tokenizer, prompt="", image_file="", output_path="", base_size=1024, image_size=640,
              crop_mode=True, test_compress=False, save_results=False, eval_mode=False):
        setattr(nn.Linear, "reset_parameters", lambda self: None)   # as the vendor's disable_torch_init
        os.makedirs(f"{output_path}/images", exist_ok=True)
        mode = {"name": "infer", "base_size": base_size, "image_size": image_size, "crop": crop_mode}
        req = W.build_request(W.load_pages(image_file), mode, prompt=prompt, decode_tokens=1)
        print("=====================\nBASE: stand-in\n=====================")
        self.generate(req.input_ids.cuda(), images=[(torch.zeros(1), req.global_views)],
                      images_seq_mask=req.images_seq_mask, images_spatial_crop=torch.tensor([[1, 1]]),
                      temperature=0.0, eos_token_id=tokenizer.eos_token_id, streamer=object(),
                      max_new_tokens=8192, no_repeat_ngram_size=20, use_cache=True)


@pytest.fixture
def standin(tiny_cfg):
    """A real VendorOCR over the stand-in (its harness-loop cache: the reference KVCache)."""
    from harness.models.build import build_model
    from harness.models.vendor.loader import VendorCache, VendorOCR

    class StandInOCR(VendorOCR):
        def new_cache(self):
            return VendorCache(past=_Cache(len(self.model.layers)))

    tiny_cfg.attn_implementation = "eager"
    ref = build_model(tiny_cfg, "cpu", torch.float32, seed=1)
    return StandInOCR(StandIn(ref), tiny_cfg, "cpu", torch.float32, {"model": "stand-in"}, quiet=False)


def _request(steps: int = STEPS, seed: int = 0, size=(120, 90)):
    pages = [W.Page("p", W.synthetic_page(0, seed=seed, size=size), f"synthetic:{seed}")]
    return W.build_request(pages, MODE, decode_tokens=steps)


def _ranges(ocr, req, steps: int = STEPS):
    rec = StageRecorder(cuda=False, nvtx=False)
    res = generate(ocr, req, rec)
    return res, rec.finish()


def _check_ranges(ranges, steps: int, first: tuple = ()) -> None:
    """request > [first...] prefill(pre_vision) sam clip projector projector(glue) prefill decode >
    decode_step 0..steps-2, each nested in its parent, in this order."""
    names = list(ranges["range"])
    assert names == ["request", *first, "prefill", "sam", "clip", "projector", "projector", "prefill", "decode"] \
        + ["decode_step"] * (steps - 1)
    assert list(ranges[ranges["range"] == "decode_step"]["step"].astype(int)) == list(range(steps - 1))
    end = ranges["host_start_ms"] + ranges["host_ms"]
    req, dec = ranges.iloc[0], ranges[ranges["range"] == "decode"].iloc[0]
    assert (ranges["host_start_ms"] >= req.host_start_ms).all()
    assert (end <= req.host_start_ms + req.host_ms + 1e-6).all()
    inner = ranges[ranges["range"] == "decode_step"]
    assert (inner["host_start_ms"] >= dec.host_start_ms).all()
    assert (inner["host_start_ms"] + inner["host_ms"] <= dec.host_start_ms + dec.host_ms + 1e-6).all()
    flat = ranges[~ranges["range"].isin(["request", "decode"])]   # leaf ranges never overlap
    fend = (flat["host_start_ms"] + flat["host_ms"]).to_numpy()
    assert (flat["host_start_ms"].to_numpy()[1:] >= fend[:-1] - 1e-6).all()


# --------------------------------------------------------------------------------------------
# CPU: dispatch, driver, ranges, rule (stand-in)
# --------------------------------------------------------------------------------------------

def test_generate_dispatches_to_an_adapter_that_owns_its_loop():
    req = _request(steps=5)
    calls = []
    sentinel = GenerationResult(tokens=torch.zeros(1, 3, dtype=torch.long))
    adapter = types.SimpleNamespace(generate_own=lambda r, s, n: calls.append((r, s, n)) or sentinel)
    stage = object()
    assert generate(adapter, req, stage, max_new_tokens=3) is sentinel
    assert calls == [(req, stage, 3)]
    assert generate(adapter, req) is sentinel and calls[-1][2] == 5 and own_loop(adapter) is adapter.generate_own
    assert own_loop(types.SimpleNamespace()) is None and own_loop(types.SimpleNamespace(generate_own=None)) is None


def test_hf_generate_on_standin_matches_ours_ranges_routing_kv(standin):
    from harness.models.vendor.hf_generate import HFGenerate

    req = _request()
    ours, ours_ranges = _ranges(standin, req)
    assert standin.info["loop"]["loop"] == "ours"
    standin.set_loop(HFGenerate(standin))
    hf, ranges = _ranges(standin, req)
    assert standin.hf.generate_calls == [{"max_new_tokens": STEPS, "min_new_tokens": STEPS,
                                          "no_repeat_ngram_size": 20}]
    assert standin.info["loop"]["loop"] == "hf_generate"
    assert standin.info["loop"]["generate_kwargs"]["no_repeat_ngram_size"] == 20
    want, fired = guarded_greedy(standin, req, 20, 1, STEPS)
    assert fired == 0 and 1 not in ours.tokens[0].tolist()   # neither the guard nor EOS can change a token
    assert torch.equal(hf.tokens, ours.tokens) and torch.equal(hf.tokens, want)
    _check_ranges(ranges, STEPS)
    _check_ranges(ours_ranges, STEPS)
    s = req.prefill_tokens
    layers, k = len(standin.model.layers), standin.cfg.llm.num_experts_per_tok
    assert [int(x) for x in hf.routing["prefill"].sum(1)] == [0] + [s * k] * (layers - 1)
    assert [int(x) for x in hf.routing["decode"].sum(1)] == [0] + [(STEPS - 1) * k] * (layers - 1)
    for phase in ("prefill", "decode"):
        assert (hf.routing[phase] == ours.routing[phase]).all()
    llm = standin.cfg.llm
    kv_bytes = 2 * layers * llm.num_kv_heads * llm.head_dim * (s + STEPS - 1) * 4   # K and V, fp32, S + n - 1 positions
    assert hf.kv_cache_bytes == ours.kv_cache_bytes == kv_bytes
    rows = {r["stage"]: r for r in stage_rows(ranges, None, 1)}
    assert rows["request"]["tpot_p50_ms"] > 0 and rows["prefill"]["calls"] == 1
    assert [r["kv_len"] for r in step_rows(ranges, s)] == [s + 1 + i for i in range(STEPS - 1)]


def test_hf_generate_ngram_guard_fires_on_standin(standin):
    """With a test-only guard of 2 the stand-in's repeat is banned: tokens equal the harness loop's up
    to the banned one, then follow the rule exactly; no output token repeats a bigram."""
    from harness.models.vendor.hf_generate import HFGenerate

    req = _request(steps=16, seed=13)
    ours = generate(standin, req)
    seq = req.input_ids[0].tolist()
    assert repeats(seq, ours.tokens[0].tolist(), 2) == 1   # once (model seed 1, page seed 13)
    standin.set_loop(HFGenerate(standin, no_repeat_ngram_size=2))
    hf = generate(standin, req)
    want, fired = guarded_greedy(standin, req, 2, 1, 16)
    assert fired == 1 and torch.equal(hf.tokens, want)
    first = next(i for i, (a, b) in enumerate(zip(hf.tokens[0].tolist(), ours.tokens[0].tolist())) if a != b)
    assert torch.equal(hf.tokens[:, :first], ours.tokens[:, :first])   # equal up to the banned token
    assert repeats(seq, hf.tokens[0].tolist(), 2) == 0


def test_hf_generate_single_token_has_an_empty_decode(standin):
    from harness.models.vendor.hf_generate import HFGenerate

    standin.set_loop(HFGenerate(standin))
    res, ranges = _ranges(standin, _request(steps=1), 1)
    assert res.tokens.shape == (1, 1)
    _check_ranges(ranges, 1)
    with pytest.raises(HarnessError, match="at least 1 new token"):
        generate(standin, _request(steps=1), max_new_tokens=0)


class _Tok:
    eos_token_id = 1


def test_infer_entry_on_standin(standin, tmp_path):
    """infer() runs on a PNG of the synthetic page, its preprocessing is a `preprocess` range, its
    8192-token budget becomes the case's (fixed: min_new_tokens), its prints are captured, what it
    gave generate is recorded, and the reset_parameters it replaces is restored."""
    from harness.models.vendor.hf_generate import HFGenerate
    from harness.models.vendor.infer import STDOUT_FILE, InferEntry

    linear_init = nn.Linear.reset_parameters
    entry = InferEntry(standin, _Tok(), "test tokenizer", workdir=tmp_path)
    standin.set_loop(entry)
    req = _request(steps=6)
    out = io.StringIO()
    with redirect_stdout(out):
        res, ranges = _ranges(standin, req, 6)
    assert out.getvalue() == ""
    assert nn.Linear.reset_parameters is linear_init
    _check_ranges(ranges, 6, first=("preprocess",))
    rows = {r["stage"]: r for r in stage_rows(ranges, None, 1)}
    assert rows["preprocess"]["host_ms"] > 0
    assert rows["request"]["stage_sum_ms"] < rows["request"]["e2e_ms"] - rows["preprocess"]["host_ms"] + 1e-6
    assert standin.hf.generate_calls[-1] == {"max_new_tokens": 6, "min_new_tokens": 6, "no_repeat_ngram_size": 20}
    loop = standin.info["loop"]
    assert loop["entry"] == "infer" and loop["infer_generate_kwargs"]["max_new_tokens"] == 8192
    assert loop["infer_generate_kwargs"]["streamer"] == "object" and loop["infer_prompt_tokens"] == req.prefill_tokens
    saved = sorted((tmp_path / "pages").glob("*.png"))
    assert [p.name for p in saved] == ["p-synthetic_0.png"] and (tmp_path / "out" / "images").is_dir()
    assert "BASE: stand-in" in (tmp_path / STDOUT_FILE).read_text()
    assert res.tokens.shape == (1, 6) and res.prompt_tokens == req.prefill_tokens
    # the stand-in's infer() reads the PNG back into the harness's layout: the same tokens as hf_generate
    standin.set_loop(HFGenerate(standin))
    assert torch.equal(generate(standin, req).tokens, res.tokens)


def test_infer_entry_refuses_a_batch(standin, tmp_path):
    from harness.models.vendor.infer import InferEntry

    standin.set_loop(InferEntry(standin, _Tok(), workdir=tmp_path))
    page = W.Page("p", W.synthetic_page(0, size=(120, 90)), "synthetic:0")
    req = W.build_request([page, page], MODE, decode_tokens=2)
    with pytest.raises(HarnessError, match="one page per request") as exc:
        generate(standin, req)
    assert exc.value.fix == "use workload.batch=1"


def test_infer_without_a_tokenizer_says_what_is_missing(tmp_path):
    from harness.models.vendor.loops import tokenizer_for_infer

    with pytest.raises(HarnessError) as exc:
        tokenizer_for_infer(tmp_path)
    assert f"no tokenizer files in {tmp_path}" in str(exc.value) and "infer()" in str(exc.value)
    assert "tokenizer.json" in exc.value.fix and "vendor_entry=generate" in exc.value.fix
    (tmp_path / "tokenizer.json").write_text("")   # present but unusable (as in a code-only snapshot)
    with pytest.raises(HarnessError, match="tokenizer"):
        tokenizer_for_infer(tmp_path)


def test_vendor_loops_choose_the_driver_and_check_infer_first(standin, tmp_path, monkeypatch):
    """``vendor_loops.load``: the driver per loop/entry; infer()'s torchvision and tokenizer are
    checked before the model is built."""
    from harness.models.vendor import loader as V
    from harness.models.vendor import loops as L
    from harness.models.vendor.hf_generate import HFGenerate
    from harness.models.vendor.infer import InferEntry

    for f in V.VENDOR_CODE_FILES:
        (tmp_path / f).write_text("{}")
    built = []
    monkeypatch.setattr(L, "require_transformers", lambda: None)
    monkeypatch.setattr(L, "load_vendor", lambda *a, **k: built.append(a) or standin)
    assert L.load(tmp_path, trust_remote_code=True).generate_own is None and standin.info["loop"]["loop"] == "ours"
    assert isinstance(L.load(tmp_path, loop="hf_generate", trust_remote_code=True).generate_own, HFGenerate)
    with pytest.raises(HarnessError, match="is not one of"):
        L.load(tmp_path, loop="bogus", trust_remote_code=True)
    monkeypatch.setattr(L, "ensure_torchvision", lambda: "stub")
    with pytest.raises(HarnessError, match="no tokenizer files"):     # named first: its check imports nothing
        L.load(tmp_path, entry="infer", trust_remote_code=True)
    (tmp_path / "tokenizer.json").write_text("")                      # present, but not a tokenizer
    with pytest.raises(HarnessError, match="torchvision"):
        L.load(tmp_path, entry="infer", trust_remote_code=True)
    monkeypatch.setattr(L, "ensure_torchvision", lambda: "0.0-test")
    with pytest.raises(HarnessError, match="needs the snapshot's tokenizer"):
        L.load(tmp_path, entry="infer", trust_remote_code=True)
    assert len(built) == 2   # refused before building
    monkeypatch.setattr("harness.workload.tokenizer_or_reason", lambda p: (_Tok(), f"tokenizer from {p}"))
    entry = L.load(tmp_path, entry="infer", workdir=tmp_path / "w", trust_remote_code=True).generate_own
    assert isinstance(entry, InferEntry) and entry.workdir == tmp_path / "w"
    assert standin.info["loop"]["entry"] == "infer"
    assert standin.info["loop"]["tokenizer"] == f"tokenizer from {tmp_path}"


def test_vendor_knobs_need_model_vendor():
    from harness.config import HarnessConfig, ModelConfig, validate

    for knobs in ({"vendor_loop": "hf_generate"}, {"vendor_entry": "infer"}):
        with pytest.raises(HarnessError, match="apply to model=vendor only"):
            validate(HarnessConfig(model=ModelConfig(**knobs)))
        validate(HarnessConfig(model=ModelConfig(name="vendor", **knobs)))
    with pytest.raises(HarnessError, match="vendor_loop"):
        validate(HarnessConfig(model=ModelConfig(name="vendor", vendor_loop="generate")))


# --------------------------------------------------------------------------------------------
# the real vendor code (HARNESS_VENDOR_DIR, transformers 4.46.3)
# --------------------------------------------------------------------------------------------

SHRUNK = {"num_hidden_layers": 2, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
          "intermediate_size": 64}


@pytest.fixture(scope="module")
def vendor_ocr():
    from harness.models.vendor import loader as V

    raw = os.environ.get("HARNESS_VENDOR_DIR")
    try:
        import transformers
    except ImportError:
        pytest.skip("transformers is not importable (the `vendor` extra)")
    if transformers.__version__ != "4.46.3":
        pytest.skip(f"transformers {transformers.__version__} is installed; the vendor code needs 4.46.3")
    return V.load_vendor(raw, "cpu", torch.float32, "eager", seed=0, config_overrides=SHRUNK, trust_remote_code=True)


@pytest.mark.vendor
def test_vendor_hf_generate_equals_ours_when_the_guard_cannot_fire(vendor_ocr):
    from harness.models.vendor.hf_generate import HFGenerate

    req = _request()
    vendor_ocr.set_loop(HFGenerate(vendor_ocr))
    hf, ranges = _ranges(vendor_ocr, req)
    vendor_ocr.generate_own = None
    ours, _ = _ranges(vendor_ocr, req)
    want, fired = guarded_greedy(vendor_ocr, req, 20, 1, STEPS)
    assert fired == 0 and torch.equal(hf.tokens, ours.tokens) and torch.equal(hf.tokens, want)
    _check_ranges(ranges, STEPS)
    for phase in ("prefill", "decode"):
        assert (hf.routing[phase] == ours.routing[phase]).all()
    assert hf.kv_cache_bytes == ours.kv_cache_bytes > 0


@pytest.mark.vendor
def test_vendor_hf_generate_ngram_guard(vendor_ocr):
    """no_repeat_ngram_size lowered to 2 (test only) makes HF's guard fire on the random model's
    repeats: tokens differ from ours and equal the rule's exactly."""
    from harness.models.vendor.hf_generate import HFGenerate

    req = _request(steps=16)
    vendor_ocr.generate_own = None
    ours = generate(vendor_ocr, req)
    seq = req.input_ids[0].tolist()
    assert repeats(seq, ours.tokens[0].tolist(), 2) > 0, ours.tokens   # the plain loop repeats a bigram
    vendor_ocr.set_loop(HFGenerate(vendor_ocr, no_repeat_ngram_size=2))
    hf = generate(vendor_ocr, req)
    want, fired = guarded_greedy(vendor_ocr, req, 2, 1, 16)
    assert fired > 0 and not torch.equal(hf.tokens, ours.tokens) and torch.equal(hf.tokens, want)
    assert repeats(seq, hf.tokens[0].tolist(), 2) == 0


def _working_transforms(monkeypatch) -> None:
    """Without torchvision the harness stubs the three transforms infer() builds (they raise when
    used): replace them, for this test, by their few-line equivalents."""
    import sys

    import numpy as np

    from harness.models.vendor.compat import STUB_MARKER

    tr = sys.modules["torchvision.transforms"]
    if not getattr(tr, STUB_MARKER, False):
        return

    def to_tensor():
        return lambda im: torch.from_numpy(np.asarray(im, dtype=np.float32) / 255.0).permute(2, 0, 1)

    def normalize(mean, std):
        return lambda t: (t - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]

    def compose(fns):
        def run(x):
            for f in fns:
                x = f(x)
            return x
        return run

    for name, fn in (("ToTensor", to_tensor), ("Normalize", normalize), ("Compose", compose)):
        monkeypatch.setattr(tr, name, fn)


@pytest.mark.vendor
def test_vendor_infer_entry(vendor_ocr, tmp_path, monkeypatch):  # vendor_ocr: the skip checks
    """The vendor's own infer() on a page PNG with a stand-in tokenizer (the snapshot's may be
    absent): ranges complete with `preprocess`, budget fixed, stdout captured, init restored."""
    from harness.models.vendor.infer import STDOUT_FILE, InferEntry

    class Tok:
        eos_token_id = 1

        def encode(self, text, add_special_tokens=False):
            return [1000 + (ord(c) % 500) for c in text]

        def decode(self, ids, **kwargs):
            return " ".join(str(int(i)) for i in (ids.tolist() if hasattr(ids, "tolist") else ids))

    from harness.models.vendor import loader as V

    _working_transforms(monkeypatch)
    # infer() casts the page to bf16 itself (autocast covers it on CUDA only): a bf16 model on the CPU
    ocr = V.load_vendor(os.environ["HARNESS_VENDOR_DIR"], "cpu", torch.bfloat16, "eager", seed=0,
                        config_overrides=SHRUNK, trust_remote_code=True)
    linear_init, ln_init = nn.Linear.reset_parameters, nn.LayerNorm.reset_parameters
    ocr.set_loop(InferEntry(ocr, Tok(), workdir=tmp_path))
    req = _request(steps=4)
    res, ranges = _ranges(ocr, req, 4)
    assert nn.Linear.reset_parameters is linear_init and nn.LayerNorm.reset_parameters is ln_init
    _check_ranges(ranges, 4, first=("preprocess",))
    loop = ocr.info["loop"]
    kw = loop["infer_generate_kwargs"]
    assert kw["max_new_tokens"] == 8192 and kw["no_repeat_ngram_size"] == 20 and kw["streamer"] == "NoEOSTextStreamer"
    assert res.tokens.shape == (1, 4)
    assert "BASE:" in (tmp_path / STDOUT_FILE).read_text()
    json.dumps(loop)   # manifest-ready
