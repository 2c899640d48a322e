"""harness.callgraph on the tiny model: module tree, torchlens grouped view, experts, join, verb.

One capture of the whole ``graph`` verb (tiny model, tiny crop mode with a 2x3 tile grid, CPU,
fp32) is shared by the tests of this module (a few seconds). ``model=vendor model.vendor_entry=infer``
runs on test_vendor_generate's stand-in of the vendor model (its ``infer()`` builds the request).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image
from torch import nn

from conftest import TINY_MODE, TINY_MODEL_YAML, load_tiny_cfg
from harness import workload as W
from harness.errors import HarnessError
from test_vendor_generate import MODE as INFER_MODE, _Tok, standin  # noqa: F401  (standin: the stand-in fixture)


@pytest.fixture(scope="module")
def tiny_cfg_dict():
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(TINY_MODEL_YAML), resolve=True)


@pytest.fixture(scope="module")
def graph_run(tmp_path_factory, tiny_cfg_dict):
    """The ``graph`` verb on the tiny model: (result, out_dir)."""
    from harness.callgraph import graph_from_config
    from harness.config import HarnessConfig, from_dict

    out = tmp_path_factory.mktemp("graph")
    cfg = {"model": tiny_cfg_dict, "workload": {"mode": dict(TINY_MODE), "decode_tokens": 4, "pages": 1},
           "device": "cpu", "dtype": "fp32", "seed": 0}
    res = graph_from_config(from_dict(HarnessConfig, cfg), out, progress=lambda *a: None)
    return res, out


@pytest.fixture(scope="module")
def reference_routing(tiny_cfg_dict):
    """What the model itself reports: GenerationResult.routing of prefill + one decode step."""
    from harness import workload as wl
    from harness.config import WorkloadConfig
    from harness.models.build import build_model
    from harness.setup import synthetic_pages

    model = build_model(load_tiny_cfg(), "cpu", torch.float32, seed=0)
    req = wl.build_request(synthetic_pages(WorkloadConfig(pages=1), 0), TINY_MODE, decode_tokens=2)   # graph_run's page
    res = model.generate(req, max_new_tokens=2)
    return res.routing, req


# --------------------------------------------------------------------------------- helpers

def test_ranges_and_patterns():
    from harness.callgraph.grouped import pattern_of, range_text, ranges

    assert ranges([5, 0, 1, 2, 4, 9]) == [[0, 2], [4, 5], [9, 9]]
    assert range_text(ranges(range(12))) == "0..11"
    assert range_text(ranges([0, 2])) == "0,2"
    assert range_text(ranges([*range(19), *range(20, 58), *range(59, 64)])) == "0..18,20..57,59..63"
    assert pattern_of("model.layers.3.mlp.experts.17.up_proj") == "model.layers.*.mlp.experts.*.up_proj"


# ----------------------------------------------------------------------------- module tree

def test_module_tree_every_module_once_with_stages(tmp_path):
    from harness.callgraph.tree import module_tree, read_tree, write_tree
    from harness.models.build import build_model

    model = build_model(load_tiny_cfg(), "meta")
    rows = module_tree(model)
    names = [n for n, _ in model.named_modules()]
    assert [r["name"] for r in rows] == names
    assert len(set(names)) == len(names)
    mods = dict(model.named_modules())
    for r in rows:
        n = r["name"]
        want = ("sam" if n.startswith("model.sam_model") else "clip" if n.startswith("model.vision_model")
                else "projector" if n.startswith("model.projector")
                else "prefill/decode" if n.startswith(("model.layers", "model.embed_tokens", "model.norm", "lm_head"))
                else "all")
        assert r["stage"] == want, n
        assert r["cls"] == type(mods[n]).__name__
        assert r["leaf"] == (len(list(mods[n].children())) == 0)
        assert r["params_total"] == sum(p.numel() for p in mods[n].parameters())
        assert r["params_own"] == sum(p.numel() for p in mods[n].parameters(recurse=False))
    by = {r["name"]: r for r in rows}
    assert by["model.sam_model.blocks.0"]["vendor_cls"] == "Block"
    assert by["model.layers.1.mlp.experts.0"]["vendor_cls"] == "DeepseekV2MLP"
    paths = write_tree(rows, tmp_path)
    assert read_tree(paths["json"]) == rows
    assert len(paths["txt"].read_text().splitlines()) == len(rows)


# ----------------------------------------------------------------------------- grouped view

def _group(doc, label):
    hits = [g for g in doc["groups"] if g["label"] == label]
    assert len(hits) == 1, (label, [g["label"] for g in doc["groups"]])
    return hits[0]


def test_files_written(graph_run):
    res, out = graph_run
    for name in ("module_tree.json", "module_tree.txt", "callgraph_prefill.json", "callgraph_prefill.md",
                 "callgraph_prefill.dot", "callgraph_decode.json", "callgraph_decode.md", "callgraph_decode.dot",
                 "callgraph_join.csv", "callgraph_join.md", "manifest.json"):
        assert (out / name).is_file(), name
    man = json.loads((out / "manifest.json").read_text())
    assert man["status"] == "complete"
    assert json.loads((out / "callgraph_decode.json").read_text())["meta"]["phase"] == "decode"
    assert (out / "callgraph_prefill.dot").read_text().startswith("digraph")


def test_prefill_block_families(graph_run):
    doc = graph_run[0]["docs"]["prefill"]
    sam = _group(doc, "SAMBlock @ model.sam_model.blocks[0..1]")
    assert (sam["kind"], sam["count"], sam["stage"], sam["vendor_cls"]) == ("for", 2, "sam", "Block")
    clip = _group(doc, "CLIPBlock @ model.vision_model.transformer.layers[0..1]")
    assert (clip["kind"], clip["count"], clip["stage"]) == ("for", 2, "clip")
    dec = _group(doc, "DecoderLayer @ model.layers[0..2]")
    assert (dec["kind"], dec["count"], dec["stage"]) == ("for", 3, "prefill")
    # Gundam-style request (tiles + global view): every vision module runs twice
    par = _group(doc, "SAMBlock @ model.sam_model.blocks.*")
    assert (par["kind"], par["count"]) == ("parfor", 4)
    assert _group(doc, "SAMAttention @ model.sam_model.blocks.*.attn")["count"] == 4
    assert _group(doc, "DecoderLayer @ model.layers.*")["count"] == 3
    assert all(g["ops"] > 0 for g in doc["groups"])
    md = (graph_run[1] / "callgraph_prefill.md").read_text()
    assert "- `SAMBlock @ model.sam_model.blocks[0..1]` for 2 under `model.sam_model` (stage: sam;" in md


def test_decode_families_and_experts_match_model_routing(graph_run, reference_routing):
    res = graph_run[0]
    routing, req = reference_routing
    cfg = load_tiny_cfg()
    dec = res["docs"]["decode"]
    assert _group(dec, "DecoderLayer @ model.layers[0..2]")["count"] == 3
    assert all(g["stage"] == "decode" for g in dec["groups"])
    assert res["captures"]["prefill"].info["cache_len_after"] == req.prefill_tokens
    assert res["captures"]["decode"].info["cache_len_before"] == req.prefill_tokens
    for phase in ("prefill", "decode"):
        doc = res["docs"][phase]
        model_counts = np.asarray(routing[phase])
        experts = {e["layer"]: e for e in doc["experts"]}
        moe_layers = range(cfg.llm.first_k_dense_replace, cfg.llm.num_layers)
        assert sorted(experts) == list(moe_layers)
        for layer in moe_layers:
            want = [j for j, n in enumerate(model_counts[layer]) if n]
            e = experts[layer]
            ran = [i for a, b in e["ranges"] for i in range(a, b + 1)]
            assert ran == want, (phase, layer)
            assert e["matches_routing"] is True
            assert {int(k): v for k, v in e["tokens_per_expert"].items()} == {j: int(model_counts[layer][j]) for j in want}
            # the for-row of that layer's experts lists exactly those experts
            row = _group(doc, f"SwiGLU @ {e['where']}")
            assert row["kind"] == "for" and row["count"] == len(want)
        assert np.array_equal(res["captures"][phase].routing, model_counts)
    # one decode token: top-k experts per MoE layer
    for e in dec["experts"]:
        assert e["experts_called"] == cfg.llm.num_experts_per_tok


def test_join_rows_for_every_family_and_counted_equals_analytic(graph_run):
    res, out = graph_run
    df = pd.read_csv(out / "callgraph_join.csv")
    for phase in ("prefill", "decode"):
        fams = df[(df["phase"] == phase) & (df["level"] == "family")]
        labels = [g["label"] for g in res["docs"][phase]["groups"]]
        assert sorted(fams["family"]) == sorted(labels)
        assert (fams["tl_ops"] > 0).all()
        stages = df[(df["phase"] == phase) & (df["level"] == "stage")]
        assert set(stages["stage"]) == ({"sam", "clip", "projector", "prefill"} if phase == "prefill" else {"decode"})
    assert res["note"] == "", res["note"]
    with_analytic = df[df["analytic_flops_counted"].notna() & df["counted_flops"].notna()]
    assert len(with_analytic) > 20
    # FlopCounterMode (CPU fused SDPA counted too) equals the analytic flops_counted, family by family
    bad = with_analytic[with_analytic["counted_minus_analytic"] != 0]
    assert bad.empty, bad[["phase", "family", "counted_flops", "analytic_flops_counted"]].to_string()
    for fam in ("SAMBlock @ model.sam_model.blocks[0..1]", "Linear @ lm_head", "MoE @ model.layers.*.mlp"):
        assert fam in set(with_analytic["family"])


def test_rescue_rerun_is_refused():
    """A step that reads a tensor from outside its arguments would run twice under torchlens."""
    from harness.callgraph.capture import _Step, trace_step

    outer = torch.ones(3)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Linear(3, 3)
            self.lm_head = nn.Identity()

    m = M()
    wrapper = _Step(m, lambda x: m.model(x + outer.unsqueeze(0)))
    with pytest.raises(RuntimeError, match="re-ran"):
        trace_step("prefill", wrapper, [torch.ones(1, 3)], lambda a: "Linear", count_flops=False)


# ----------------------------------------------------------------------------- vendor model

@pytest.mark.vendor
def test_vendor_graph_quick_gelu_visible_and_experts(tmp_path):
    """The vendor code (2 LLM layers, its full vision encoders), tiny mode (512 px): grouped view
    with the vendor's class names, quick_gelu's ops visible, experts equal the gate's routing, and
    the jit-scripted quick_gelu restored afterwards."""
    import os
    import sys

    transformers = pytest.importorskip("transformers")
    if transformers.__version__ != "4.46.3":
        pytest.skip(f"transformers {transformers.__version__}; the vendor code needs 4.46.3")
    from harness import workload as wl
    from harness.callgraph import graph
    from harness.models.vendor.loader import load_vendor

    vm = load_vendor(os.environ["HARNESS_VENDOR_DIR"], device="cpu", dtype=torch.float32,
                     attn_implementation="eager", seed=0, config_overrides={"num_hidden_layers": 2},
                     trust_remote_code=True)
    deepencoder = sys.modules[type(vm.model.sam_model).__module__]
    scripted = deepencoder.quick_gelu
    req = wl.build_request([wl.Page("p", wl.synthetic_page(0, seed=1000), "x")], "tiny", decode_tokens=2)
    res = graph(vm, req, tmp_path, vm.cfg, "fp32", {"model": "vendor"}, adapter="vendor",
                progress=lambda *a: None)
    assert deepencoder.quick_gelu is scripted
    pre, dec = res["docs"]["prefill"], res["docs"]["decode"]
    assert _group(pre, "Block @ model.sam_model.blocks[0..11]")["count"] == 12
    assert _group(pre, "NoTPTransformerBlock @ model.vision_model.transformer.layers[0..23]")["count"] == 24
    assert _group(dec, "DeepseekV2DecoderLayer @ model.layers[0..1]")["count"] == 2
    mlp_funcs = {op["func"] for op in res["captures"]["prefill"].ops
                 if any(a.endswith("transformer.layers.0.mlp") for a, _ in op["stack"])}
    assert "sigmoid" in mlp_funcs, mlp_funcs
    for e in dec["experts"]:
        assert e["matches_routing"] is True and e["experts_called"] == 6



# ------------------------------------------------- vendor model, request built by its infer() (stand-in)

@pytest.fixture
def infer_graph(standin, tmp_path, monkeypatch, tiny_cfg_dict):  # noqa: F811
    """``graph_from_config(model=vendor, vendor_entry=infer)`` with the stand-in vendor model of
    test_vendor_generate as what ``load_vendor`` builds (no vendor code, no transformers here): a
    function (model and workload overrides; ``prereq``: a ``vendor.loops`` function to replace
    otherwise, None to leave the real one) -> (result or the HarnessError, out_dir, load_vendor calls)."""
    from harness.callgraph import graph_from_config
    from harness.config import HarnessConfig, from_dict
    from harness.models.vendor import loader as V
    from harness.models.vendor import loops as L

    vdir = tmp_path / "vendor"
    vdir.mkdir()
    for f in (*V.VENDOR_CODE_FILES, "tokenizer.json"):    # tokenizer.json: a file; the tokenizer is a stand-in
        (vdir / f).write_text("{}")
    built = []

    def run(model=None, workload=None, **prereq):
        patches = {"load_vendor": lambda *a, **k: built.append(a) or standin, "require_transformers": lambda: None,
                   "ensure_torchvision": lambda: "0.0-test",
                   "tokenizer_for_infer": lambda p: (_Tok(), "test tokenizer"), **prereq}
        for name, fn in patches.items():
            if fn is not None:
                monkeypatch.setattr(L, name, fn)
        cfg = {"model": {**tiny_cfg_dict, "name": "vendor", "path": str(vdir), "attn_implementation": "eager",
                         "trust_remote_code": True, "vendor_entry": "infer", **(model or {})},
               "workload": {"mode": dict(INFER_MODE), "decode_tokens": 2, "pages": 1, "page_size": [120, 90],
                            "text_tokens": 3, **(workload or {})},
               "device": "cpu", "dtype": "fp32", "seed": 0}
        out = tmp_path / "graph"
        try:
            return graph_from_config(from_dict(HarnessConfig, cfg), out, progress=lambda *a: None), out, built
        except HarnessError as exc:
            return exc, out, built

    return run


def test_vendor_graph_of_the_request_infer_built(infer_graph, standin):  # noqa: F811
    """The request is the one infer() built (the stand-in's: BOS + 7 image + its 12 text tokens = 20),
    not the harness's own (BOS + 7 + workload.text_tokens=3 = 11): the prefill runs over 20 tokens,
    the decode step follows a 20-token cache; generate itself never runs; the manifest and the
    graph files say who built the request, from which prompt and page."""
    from harness.callgraph.vendor import INFER_BUILT

    linear_init = nn.Linear.reset_parameters
    res, out, built = infer_graph()
    assert not isinstance(res, Exception), res
    assert len(built) == 1 and standin.hf.generate_calls == []    # infer()'s generate stood in for
    assert "generate" not in vars(standin.hf) and nn.Linear.reset_parameters is linear_init
    req = res["request"]
    ids = req.input_ids[0].tolist()
    assert len(ids) == 20 and ids[0] == 0 and ids[1:8] == [128815] * 7
    assert req.images_seq_mask[0].tolist() == [False] + [True] * 7 + [False] * 12
    page = out / "vendor_infer" / "pages" / "synthetic-0000-synthetic_0_0.png"   # page 0 of seed 0, saved
    assert page.is_file() and req.tiles is None
    with Image.open(page) as im:
        view = W.preprocess(im.convert("RGB"), INFER_MODE).global_view   # what the stand-in's infer() read
    assert torch.equal(req.global_views[0], view)
    pre, dec = res["captures"]["prefill"], res["captures"]["decode"]
    assert pre.info["cache_len_after"] == 20 and dec.info["cache_len_before"] == 20
    assert dec.info["cache_len_after"] == 21
    k = standin.cfg.llm.num_experts_per_tok
    assert pre.routing.sum(1).tolist() == [0, 20 * k, 20 * k] and dec.routing.sum(1).tolist() == [0, k, k]

    man = json.loads((out / "manifest.json").read_text())
    assert man["status"] == "complete"
    case = man["cases"][0]
    assert (case["prefill_tokens"], case["image_tokens"], case["text_tokens"], case["built_by"]) == \
        (20, 7, 12, INFER_BUILT)
    rq = man["graph"]["request"]
    assert (rq["built_by"], rq["prompt"], rq["page"], rq["page_source"]) == \
        (INFER_BUILT, W.DEFAULT_PROMPT, str(page), "synthetic:0:0")
    assert (rq["prompt_tokens"], rq["image_tokens"], rq["text_tokens"], rq["grid"]) == (20, 7, 12, None)
    assert rq["harness_request"] == {"prompt_tokens": 11, "image_tokens": 7, "text_tokens": 3, "grid": None}
    kw = rq["generate_kwargs"]
    assert (kw["max_new_tokens"], kw["no_repeat_ngram_size"], kw["streamer"], kw["images_spatial_crop"]) == \
        (8192, 20, "object", "tensor[1, 2] int64")
    assert kw["images"] == [["tensor[1] float32", "tensor[1, 3, 128, 128] float32"]]
    assert "BASE: stand-in" in Path(rq["infer_stdout"]).read_text() and "warning" not in rq
    for phase in ("prefill", "decode"):
        meta = json.loads((out / f"callgraph_{phase}.json").read_text())["meta"]["request"]
        assert (meta["built_by"], meta["prompt"], meta["page"], meta["prefill_tokens"]) == \
            (INFER_BUILT, W.DEFAULT_PROMPT, str(page), 20)
        assert f"'built_by': \"{INFER_BUILT}\"" in (out / f"callgraph_{phase}.md").read_text()


@pytest.mark.parametrize("overrides, message, fix", [
    ({"workload": {"pages": 2, "batch": 2}}, "one page per request", "use workload.batch=1"),
    ({"tokenizer_for_infer": None}, "needs the snapshot's tokenizer", "tokenizer_rebuild"),
    ({"ensure_torchvision": lambda: "stub"}, "torchvision is not importable", "install the torchvision"),
    ({"model": {"trust_remote_code": False}}, "model.trust_remote_code is false", "model.trust_remote_code=true"),
], ids=["batch", "tokenizer", "torchvision", "trust_remote_code"])
def test_vendor_graph_via_infer_refusals(infer_graph, overrides, message, fix):
    """Each refusal is one HarnessError (the CLI's one `error:` line, exit 2), before any model is built."""
    exc, out, built = infer_graph(**overrides)
    assert isinstance(exc, HarnessError), exc
    assert message in str(exc) and fix in exc.fix and "\n" not in str(exc)
    assert built == []


@pytest.mark.vendor
def test_vendor_graph_of_the_real_infer_request(tmp_path, monkeypatch):
    """The vendor's own infer() (its template and preprocessing; shrunken LLM, bf16 on the CPU, a
    tokenizer of one id per character) builds the request the graph captures: BOS, the 7 image
    placeholders of a 128 px view, then the text after <image> of the stripped prompt (infer()'s
    plain template), one id per character; the prefill runs over all of it."""
    import os

    transformers = pytest.importorskip("transformers")
    if transformers.__version__ != "4.46.3":
        pytest.skip(f"transformers {transformers.__version__}; the vendor code needs 4.46.3")
    from harness.callgraph import graph
    from harness.callgraph.vendor import infer_request
    from harness.models.vendor.infer import InferEntry
    from harness.models.vendor.loader import load_vendor
    from test_vendor_generate import SHRUNK, _working_transforms

    class CharTok(_Tok):
        def encode(self, text, add_special_tokens=False):
            return [1000 + ord(c) % 500 for c in text]

    _working_transforms(monkeypatch)
    ocr = load_vendor(os.environ["HARNESS_VENDOR_DIR"], "cpu", torch.bfloat16, "eager", seed=0,
                      config_overrides=SHRUNK, trust_remote_code=True)
    ocr.set_loop(InferEntry(ocr, CharTok(), workdir=tmp_path / "infer"))
    page = W.Page("p", W.synthetic_page(0, size=(120, 90)), "synthetic:0")
    built, record = infer_request(ocr, W.build_request([page], INFER_MODE, decode_tokens=2))
    text = W.DEFAULT_PROMPT.strip().split("<image>")[1]
    want = [0] + [128815] * 7 + [1000 + ord(c) % 500 for c in text]
    assert built.input_ids[0].tolist() == want and built.tiles is None
    assert (record["prompt_tokens"], record["image_tokens"], record["grid"]) == (len(want), 7, None)
    assert record["generate_kwargs"]["streamer"] == "NoEOSTextStreamer"
    res = graph(ocr, built.to("cpu", torch.bfloat16), tmp_path / "graph", ocr.cfg, "bf16", {"model": "vendor"},
                adapter="vendor", progress=lambda *a: None)
    assert res["captures"]["prefill"].info["cache_len_after"] == len(want)
    assert res["captures"]["decode"].info["cache_len_after"] == len(want) + 1
