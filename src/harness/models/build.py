"""Build the reference model on its target device and dtype, seeded; load or save safetensors.

Construction happens on the ``meta`` device, then storage is allocated once on the target
(``to_empty``) and filled in place, so a GPU build never materialises fp32 weights on the CPU.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
from torch import nn

from ..config import ModelConfig
from ..dtypes import torch_dtype
from ..errors import HarnessError
from .checkpoint import check_tensors, read_headers
from .deepseek_ocr import DeepseekOCR
from .llm import RMSNorm, RotaryEmbedding
from .vision import LayerNorm2d


def build_model(cfg: ModelConfig, device="cpu", dtype=torch.float32, seed: int = 0,
                init: bool = True) -> DeepseekOCR:
    """The reference model in eval mode. ``init=False`` leaves storage uninitialised (for loading)."""
    device = torch.device(device)
    dtype = torch_dtype(dtype)
    with torch.device("meta"), _skipped_init():
        model = DeepseekOCR(cfg)
    model = model.to(dtype=dtype)
    if device.type == "meta":
        return model.eval()
    model = model.to_empty(device=device)
    for mod in model.modules():
        if isinstance(mod, RotaryEmbedding):
            mod.inv_freq = mod.compute_inv_freq(device)
    if init:
        init_weights(model, seed, cfg.init_std)
    return model.eval()


@contextlib.contextmanager
def _skipped_init():
    """``torch.nn.init``'s fills as no-ops while the model is built on ``meta`` (``to_empty`` drops
    whatever they wrote, ``init_weights`` fills the real storage): on ``meta`` each fill goes through
    ``torch._refs``, whose first call imports torch._dynamo (1.7 s of every CPU run's start)."""
    names = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_",
             "kaiming_normal_", "xavier_uniform_", "xavier_normal_")
    saved = {n: getattr(nn.init, n) for n in names}
    for n in names:
        setattr(nn.init, n, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(nn.init, n, fn)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, RMSNorm, LayerNorm2d))


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, std: float) -> None:
    """Seeded init on the parameters' own device: norms 1/0, biases 0, everything else N(0, std).

    The same seed gives the same weights on the same device type (CPU and CUDA RNGs differ).
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for mod_name, mod in model.named_modules():
        for name, p in mod.named_parameters(recurse=False):
            if _is_norm(mod):
                p.fill_(1.0 if name == "weight" else 0.0)
            elif name == "bias":
                p.zero_()
            else:
                p.normal_(0.0, std, generator=gen)


def expected_shapes(model: nn.Module) -> dict:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def safetensors_files(path: str | os.PathLike) -> list:
    """The ``*.safetensors`` files of a model directory (sorted), or a clear error."""
    p = Path(path)
    if not p.exists():
        raise HarnessError(f"model directory {p} does not exist", "pass model.path=DIR of a DeepSeek-OCR snapshot")
    if p.is_file():
        return [p]
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise HarnessError(f"no *.safetensors files in {p}",
                           "download the checkpoint into that directory or use model.weights=random")
    return files


def check_checkpoint(model: nn.Module, path) -> dict:
    """Headers of the safetensors in ``path`` against ``model``'s state_dict (``model`` may live on
    meta, so a bad checkpoint is refused before any weight memory is allocated). Returns
    ``read_headers``' {name: (file, shape)}."""
    where = read_headers(safetensors_files(path))
    check_tensors(where, {k: tuple(v.shape) for k, v in model.state_dict().items()}, path)
    return where


@torch.no_grad()
def load_weights(model: nn.Module, path) -> dict:
    """Copy tensors from safetensors files into ``model`` (cast to its dtype, on its device).

    Refuses with one message listing missing, unexpected and mismatched tensors; nothing is
    half-loaded when the check fails. Returns {"files": [...], "tensors": n, "bytes": n}.
    """
    from safetensors import safe_open

    files = safetensors_files(path)
    where = check_checkpoint(model, path)
    state = model.state_dict()
    nbytes = 0
    by_file: dict = {}
    for k, (f, _) in where.items():
        by_file.setdefault(f, []).append(k)
    for f, keys in by_file.items():
        with safe_open(str(f), framework="pt") as fh:
            for k in keys:
                t = fh.get_tensor(k)
                nbytes += t.numel() * t.element_size()
                state[k].copy_(t)
    return {"files": [str(f) for f in files], "tensors": len(where), "bytes": nbytes}


def save_weights(model: nn.Module, path, dtype=None) -> Path:
    """Write the whole state_dict as one ``model.safetensors`` in directory ``path``."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.to(dtype) if dtype else v).contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out / "model.safetensors"


def param_counts(model: nn.Module) -> dict:
    """Parameters per component as DESIGN.md groups them (LLM includes embed, norm, lm_head)."""
    groups = {"sam": 0, "clip": 0, "projector": 0, "separators": 0, "llm": 0}
    for k, p in model.state_dict().items():
        n = p.numel()
        if k.startswith("model.sam_model."):
            groups["sam"] += n
        elif k.startswith("model.vision_model."):
            groups["clip"] += n
        elif k.startswith("model.projector."):
            groups["projector"] += n
        elif k in ("model.image_newline", "model.view_seperator"):
            groups["separators"] += n
        else:
            groups["llm"] += n
    groups["total"] = sum(groups.values())
    return groups
