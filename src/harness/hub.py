"""Code from a model directory runs only when the user allows it, and the Hugging Face hub is never
contacted: every ``trust_remote_code`` load is local-only.

* ``allow_directory_code(directory, allowed)``: the one gate before transformers may import Python
  code from a model directory (``trust_remote_code=True``). Only ``model=vendor`` asks, and only
  ``model.trust_remote_code=true`` allows it: otherwise a one-line HarnessError names the
  directory, its ``*.py`` files and the setting that allows them; when allowed, one warning line
  (logger ``harness.hub``, once per directory and process) says whose code runs, from where.
  Everything else (the reference and tiny models, every tokenizer) loads with
  ``trust_remote_code=False``, so transformers imports no code from the directory;
  ``tokenizer_code(directory)`` names the code a tokenizer that cannot load without it asked for.
* ``refuse_hub_code(directory)``: a model directory whose ``config.json`` or
  ``tokenizer_config.json`` has an ``auto_map`` entry naming a hub repository
  (``org/repo--module.Class``: transformers would download that code and run it) is refused with
  a one-line HarnessError, before transformers is imported.
* ``hub_offline()``: for the duration of a load, ``HF_HUB_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1``
  (read when huggingface_hub / transformers are first imported) and, where those modules are
  already imported, their offline flags (``huggingface_hub.constants.HF_HUB_OFFLINE``,
  ``transformers.utils.hub._is_offline_mode``); all restored after. A module first imported inside
  keeps the offline setting it read for the rest of the process.

Callers also pass ``local_files_only=True`` wherever transformers accepts it (``from_pretrained``
of configs, models and tokenizers; ``AutoModel.from_config`` does not take it, and resolves the
``auto_map`` checked here from the local directory).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from .errors import HarnessError

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
#: (module, attribute) holding an offline flag that was read from the environment at import time
OFFLINE_FLAGS = (("huggingface_hub.constants", "HF_HUB_OFFLINE"), ("transformers.utils.hub", "_is_offline_mode"))
#: files whose ``auto_map`` transformers follows with trust_remote_code
AUTO_MAP_FILES = ("config.json", "tokenizer_config.json")
#: the setting that lets ``model=vendor`` run its directory's code
ALLOW_CODE = "model.trust_remote_code=true"
_ANNOUNCED: set = set()   # directories whose "code runs" line this process has printed


def directory_code(directory) -> list:
    """The Python files (names, sorted) of ``directory`` that transformers may import with
    ``trust_remote_code``: the modules ``auto_map`` names and those they import, all ``*.py``."""
    return sorted(p.name for p in Path(directory).glob("*.py") if p.is_file())


def allow_directory_code(directory, allowed: bool) -> str:
    """The line that says whose Python code runs, from where (logged once per directory), when
    ``allowed``; otherwise a one-line HarnessError naming the files and ``ALLOW_CODE``."""
    files = directory_code(directory)
    listed = ", ".join(files) if files else "no *.py file yet: whatever its auto_map names"
    if not allowed:
        raise HarnessError(f"model=vendor would import and run the Python code in {directory} ({listed}) through "
                           "transformers' trust_remote_code, and model.trust_remote_code is false",
                           f"read that code; if you trust it, add {ALLOW_CODE} (or run the reference model: "
                           "model.weights=path model.path=DIR runs no code from the directory)")
    line = (f"model=vendor runs the Python code in {directory} ({listed}): the model directory's own code, "
            f"not the harness's, allowed by {ALLOW_CODE}")
    if str(directory) not in _ANNOUNCED:
        _ANNOUNCED.add(str(directory))
        print(f"[harness] {line}", file=sys.stderr, flush=True)   # the run's own line style (stderr: a notice)
    return line


def _auto_map_refs(auto_map) -> list:
    """(key, ``module.Class``) of every entry of an ``auto_map``: values are strings or, for
    tokenizers, lists of them; a tokenizer's ``auto_map`` may itself be such a list (AutoTokenizer)."""
    if isinstance(auto_map, (list, tuple)):
        auto_map = {"AutoTokenizer": auto_map}
    return [(key, ref) for key, value in (auto_map if isinstance(auto_map, dict) else {}).items()
            for ref in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(ref, str)]


def hub_references(auto_map) -> list:
    """The ``auto_map`` entries that name a hub repository (``org/repo--module.Class``), as ``key: value``."""
    return [f"{key}: {ref}" for key, ref in _auto_map_refs(auto_map) if "--" in ref]


def tokenizer_code(directory) -> list:
    """The ``AutoTokenizer`` entries of the directory's ``auto_map`` s that name a module of its own
    (``tokenization_x.Class``: code transformers would import with ``trust_remote_code``), as
    ``key: value``; [] when there is none (or a file cannot be read: ``refuse_hub_code`` says so)."""
    try:
        maps = _auto_maps(directory)
    except HarnessError:
        return []
    return [f"{key}: {ref}" for _, auto_map in maps for key, ref in _auto_map_refs(auto_map)
            if key == "AutoTokenizer" and "--" not in ref]


def check_auto_map(auto_map, source) -> None:
    """Refuse an ``auto_map`` (from ``source``, a file or config) that points at hub code."""
    refs = hub_references(auto_map)
    if refs:
        raise HarnessError(f"{source} has an auto_map that points at code on the Hugging Face hub ({refs[0]}"
                           f"{f' and {len(refs) - 1} more' if len(refs) > 1 else ''}); the harness runs only local "
                           "code and never downloads any",
                           "put that repository's *.py files in the model directory and name them in auto_map "
                           "as module.Class, without the 'org/repo--' prefix")


def _auto_maps(directory) -> list:
    """(file, its ``auto_map``) of the directory's ``AUTO_MAP_FILES`` that exist; a file that cannot
    be read is a one-line HarnessError."""
    maps = []
    for name in AUTO_MAP_FILES:
        f = Path(directory) / name
        if not f.is_file():
            continue
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError) as exc:
            raise HarnessError(f"cannot read {f} ({exc.__class__.__name__}: {exc})",
                               "restore the snapshot's original file") from None
        if isinstance(data, dict) and data.get("auto_map"):
            maps.append((f, data["auto_map"]))
    return maps


def refuse_hub_code(directory) -> None:
    """``check_auto_map`` over the directory's ``config.json`` and ``tokenizer_config.json``."""
    for f, auto_map in _auto_maps(directory):
        check_auto_map(auto_map, f)


@contextlib.contextmanager
def hub_offline():
    """The hub is off inside the block (see the module docstring); everything is restored after."""
    saved_env = {k: os.environ.get(k) for k in OFFLINE_ENV}
    os.environ.update(OFFLINE_ENV)
    patched = []
    for module, attr in OFFLINE_FLAGS:
        mod = sys.modules.get(module)
        if mod is not None and hasattr(mod, attr):
            patched.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, True)
    try:
        yield
    finally:
        for mod, attr, value in patched:
            setattr(mod, attr, value)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
