"""Which loop drives the vendor model: ``model.vendor_loop`` and ``model.vendor_entry``.

``load(path, ..., loop, entry, workdir)`` is ``load_vendor`` with the driver the config names:

* ``loop=ours`` (default): the harness's greedy loop (``harness.models.generate``);
* ``loop=hf_generate``: the vendor's own HF ``generate`` with ``infer()``'s arguments
  (``hf_generate.HFGenerate``);
* ``entry=infer``: the vendor's ``infer()`` on the page file (``infer.InferEntry``; it calls
  the vendor's ``generate`` itself, whatever ``loop`` says). It needs the snapshot's tokenizer and
  torchvision (its preprocessing); both are checked before the model is built, with one-line errors.

Every load is refused, first, unless the directory's code may run (``trust_remote_code``, from
``model.trust_remote_code=true``): ``check_code_allowed``; the CLI refuses the same before any run
directory exists (``refuse_code_early``).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ...errors import HarnessError
from ...hub import allow_directory_code
from .loader import check_vendor_dir, load_vendor
from .compat import ensure_torchvision, require_transformers

VENDOR_LOOPS = ("ours", "hf_generate")
VENDOR_ENTRIES = ("generate", "infer")


def check_code_allowed(path, trust_remote_code: bool) -> Path:
    """The vendor directory (``check_vendor_dir``), refused with one line unless its Python code may
    run (``harness.hub.allow_directory_code``); nothing is imported."""
    path = check_vendor_dir(path)
    if not trust_remote_code:
        allow_directory_code(path, False)
    return path


def refuse_code_early(path, trust_remote_code: bool, entry: str = "generate") -> None:
    """``check_code_allowed``'s refusal and, for ``entry=infer``, a missing tokenizer file
    (``require_tokenizer_file``), for the CLI before any run directory exists. A directory that
    ``check_vendor_dir`` refuses (missing, empty, no code, hub code) is left to the load, whose run
    directory records why, as for any other model that cannot be built."""
    try:
        path = check_vendor_dir(path)
    except HarnessError:
        return
    if not trust_remote_code:
        allow_directory_code(path, False)
    if entry == "infer":
        require_tokenizer_file(path)


def load(path, device="cpu", dtype=torch.bfloat16, attn_implementation: str = "eager", seed: int = 0,
         loop: str = "ours", entry: str = "generate", workdir=None, trust_remote_code: bool = False, **kwargs):
    """The vendor model (``load_vendor(path, ..., trust_remote_code=..., **kwargs)``) driven by
    ``loop`` / ``entry``; ``workdir``: where ``infer()`` may write (default a new temporary directory);
    ``trust_remote_code``: the directory's code may run (``check_code_allowed``, first)."""
    if loop not in VENDOR_LOOPS or entry not in VENDOR_ENTRIES:
        raise HarnessError(f"vendor loop={loop!r} / entry={entry!r} is not one of {VENDOR_LOOPS} / {VENDOR_ENTRIES}",
                           "use model.vendor_loop=ours|hf_generate and model.vendor_entry=generate|infer")
    check_code_allowed(path, trust_remote_code)
    tokenizer = infer_prerequisites(path) if entry == "infer" else None   # before the (slow) build
    ocr = load_vendor(path, device, dtype, attn_implementation, seed, trust_remote_code=trust_remote_code, **kwargs)
    if entry == "infer":
        from .infer import InferEntry

        ocr.set_loop(InferEntry(ocr, *tokenizer, workdir=workdir))
    elif loop == "hf_generate":
        from .hf_generate import HFGenerate

        ocr.set_loop(HFGenerate(ocr))
    return ocr


def infer_prerequisites(path) -> tuple:
    """(tokenizer, where from) for ``entry=infer``, or a one-line HarnessError naming what is missing:
    the snapshot's tokenizer, or torchvision (``infer()`` builds torchvision transforms)."""
    path = check_vendor_dir(path)
    require_tokenizer_file(path)          # first: it needs no import, and it names the set-up step
    require_transformers()
    if ensure_torchvision() == "stub":
        raise HarnessError("model.vendor_entry=infer runs the vendor's infer(), whose preprocessing needs "
                           "torchvision.transforms, but torchvision is not importable here",
                           f"install the torchvision built for torch {torch.__version__}, or use "
                           "model.vendor_entry=generate")
    return tokenizer_for_infer(path)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def _no_tokenizer(path, reason: str) -> HarnessError:
    from .tokenizer_rebuild import PIP_INSTALL, rebuild_command

    return HarnessError(f"model.vendor_entry=infer calls the vendor's infer(), which needs the snapshot's "
                        f"tokenizer, but there is none: {reason}",
                        f"rebuild tokenizer.json there: {rebuild_command(path)} (after {PIP_INSTALL}), "
                        "or use model.vendor_entry=generate")


def require_tokenizer_file(path: Path) -> None:
    """The one-line error of a vendor directory with no tokenizer file (``TOKENIZER_FILES``), naming
    the rebuild; imports nothing (transformers may be missing too: the tokenizer is named first)."""
    if not any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
        raise _no_tokenizer(path, f"no tokenizer files in {path}")


def tokenizer_for_infer(path: Path) -> tuple:
    """(tokenizer, where from) from ``path``, or the HarnessError that says it is missing; where from
    adds ``tokenizer_rebuild.source_note`` ("rebuilt (sha256 ...)") when the rebuild's record is there."""
    from ...workload import tokenizer_or_reason
    from .tokenizer_rebuild import source_note

    tok, reason = tokenizer_or_reason(path)
    if tok is None:
        raise _no_tokenizer(path, reason)
    note = source_note(path)
    return tok, f"{reason}: {note}" if note else reason


__all__ = ["VENDOR_LOOPS", "VENDOR_ENTRIES", "check_code_allowed", "refuse_code_early", "load", "infer_prerequisites",
           "tokenizer_for_infer", "require_tokenizer_file", "TOKENIZER_FILES"]
