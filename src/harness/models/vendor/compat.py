"""Small shims that let the vendor's DeepSeek-OCR code run here without editing its files.

None of the vendor's code is copied into this module; it only prepares the environment the
vendor code imports into, and patches two things for the duration of a call:

- ``torchvision``: the vendor's ``modeling_deepseekocr.py`` imports ``torchvision.transforms``
  (``ToTensor``, ``Normalize``, ``Compose``) and ``InterpolationMode`` at module level, but uses
  them only in its own ``infer()`` preprocessing, which the harness never calls (it does the
  vendor's preprocessing itself, ``harness.workload``). Where torchvision is not importable (no
  CPU build next to this torch), a stub module with those names is put in ``sys.modules``; its
  classes raise when instantiated.
- ``Tensor.cuda``: ``DeepseekOCRModel.forward`` moves the image-token mask with a hard-coded
  ``.cuda()``. On a CPU run, ``cuda_noop_on_cpu`` makes ``Tensor.cuda`` return the tensor itself
  while the vendor forward runs (process-wide for that time; restored on exit).
- parameters on ``meta``: ``params_on_meta`` builds the vendor module tree without allocating or
  initialising weights (buffers stay real), so seeded weights can be adopted without a copy.
"""
from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types

import torch
from torch import nn

from ...errors import HarnessError

VENDOR_TRANSFORMERS = "4.46.3"
STUB_MARKER = "__harness_stub__"


def require_transformers():
    """The ``transformers`` module at the vendor's pinned version, or a one-line HarnessError."""
    fix = f"install the `vendor` extra: pip install 'dsocr-harness[vendor]' (transformers=={VENDOR_TRANSFORMERS})"
    try:
        import transformers
    except Exception as exc:  # ImportError, or a broken install raising something else
        raise HarnessError(f"transformers is not importable ({exc.__class__.__name__}: {exc}); the vendor "
                           f"code needs transformers=={VENDOR_TRANSFORMERS}", fix) from None
    if transformers.__version__ != VENDOR_TRANSFORMERS:
        raise HarnessError(f"transformers {transformers.__version__} is installed; the vendor code needs "
                           f"transformers=={VENDOR_TRANSFORMERS} (later releases break its imports)", fix)
    return transformers


class _Unavailable:
    """Stand-in for a torchvision transform: importable, fails loudly when used."""

    def __init__(self, *args, **kwargs):
        raise HarnessError(
            f"torchvision.transforms.{type(self).__name__} is a harness stub (torchvision is not installed); "
            "the vendor's infer() preprocessing is not available here",
            "drive the model through harness (it preprocesses pages itself) or install torchvision")


def _module(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
    setattr(mod, STUB_MARKER, True)
    return mod


def ensure_torchvision() -> str:
    """Make ``import torchvision.transforms`` work for the vendor code. Returns what is used:
    the real torchvision version, or ``"stub"``.

    Import transformers before calling this, so its import-time checks see the real environment.
    """
    existing = sys.modules.get("torchvision")
    if existing is not None and getattr(existing, STUB_MARKER, False):
        return "stub"
    try:
        import torchvision  # noqa: F401
        import torchvision.transforms  # noqa: F401
        from torchvision.transforms.functional import InterpolationMode  # noqa: F401
        return str(getattr(torchvision, "__version__", "unknown"))
    except Exception:
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]  # drop a half-imported real package
    tv = _module("torchvision")
    tr = _module("torchvision.transforms")
    fn = _module("torchvision.transforms.functional")
    for name in ("ToTensor", "Normalize", "Compose"):
        setattr(tr, name, type(name, (_Unavailable,), {}))

    class InterpolationMode:  # the names torchvision's enum has
        NEAREST = "nearest"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"
        LANCZOS = "lanczos"

    fn.InterpolationMode = InterpolationMode
    tr.functional = fn
    tv.transforms = tr
    tv.__version__ = "stub"
    sys.modules.update({"torchvision": tv, "torchvision.transforms": tr,
                        "torchvision.transforms.functional": fn})
    return "stub"


@contextlib.contextmanager
def cuda_noop_on_cpu(device: torch.device):
    """On a CPU device, ``Tensor.cuda()`` returns the tensor itself inside this block.

    The vendor forward calls ``images_seq_mask[idx].unsqueeze(-1).cuda()``; everything else it
    does stays on the inputs' device. On a CUDA device nothing is patched; the block runs with
    ``device`` as the current CUDA device so that ``.cuda()`` lands where the model is.
    """
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
        return
    if device.type != "cpu":
        yield
        return
    original = torch.Tensor.cuda

    def _stay(self, *args, **kwargs):
        return self

    torch.Tensor.cuda = _stay
    try:
        yield
    finally:
        torch.Tensor.cuda = original


@contextlib.contextmanager
def params_on_meta():
    """Every ``nn.Parameter`` registered inside this block lives on ``meta`` (no storage, no init
    cost); buffers stay real. The caller must assign real tensors to all parameters afterwards."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original
