"""The Hugging Face hub is never contacted: every ``trust_remote_code`` load is local-only.

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


def hub_references(auto_map) -> list:
    """The ``auto_map`` entries (values are ``module.Class`` strings, or lists of them for
    tokenizers) that name a hub repository (``org/repo--module.Class``), as ``key: value``."""
    refs = []
    for key, value in (auto_map or {}).items():
        for ref in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(ref, str) and "--" in ref:
                refs.append(f"{key}: {ref}")
    return refs


def check_auto_map(auto_map, source) -> None:
    """Refuse an ``auto_map`` (from ``source``, a file or config) that points at hub code."""
    refs = hub_references(auto_map)
    if refs:
        raise HarnessError(f"{source} has an auto_map that points at code on the Hugging Face hub ({refs[0]}"
                           f"{f' and {len(refs) - 1} more' if len(refs) > 1 else ''}); the harness runs only local "
                           "code and never downloads any",
                           "put that repository's *.py files in the model directory and name them in auto_map "
                           "as module.Class, without the 'org/repo--' prefix")


def refuse_hub_code(directory) -> None:
    """``check_auto_map`` over the directory's ``config.json`` and ``tokenizer_config.json``."""
    for name in AUTO_MAP_FILES:
        f = Path(directory) / name
        if not f.is_file():
            continue
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError) as exc:
            raise HarnessError(f"cannot read {f} ({exc.__class__.__name__}: {exc})",
                               "restore the snapshot's original file") from None
        if isinstance(data, dict):
            check_auto_map(data.get("auto_map"), f)


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
