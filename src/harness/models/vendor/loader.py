"""The vendor adapter: DeepSeek-OCR's own modeling code (``trust_remote_code``), driven with the
same API and stage map as the reference model.

``load_vendor(path, device, dtype, attn_implementation, seed)`` loads a vendor directory (the
Hugging Face snapshot: ``config.json``, ``modeling_deepseekocr.py`` and friends, optionally
``*.safetensors``) under the vendor's pinned transformers 4.46.3:

- with safetensors: ``AutoModel.from_pretrained(path, trust_remote_code=True,
  local_files_only=True, torch_dtype=dtype, attn_implementation=...)`` after a header check of
  every tensor name and shape (a missing or mismatched tensor is a one-line error);
- without: the vendor module tree is built from its config (``AutoModel.from_config``) with its
  parameters on ``meta``, then the reference model's seeded random weights
  (``build_model(cfg, device, dtype, seed)``) are adopted under the shared state_dict names,
  without a copy. Both models then hold the same weights, so they can be compared.

The directory's code runs only when the caller allows it (``trust_remote_code=True``, from
``model.trust_remote_code=true``): otherwise ``harness.hub.allow_directory_code`` refuses with one
line naming the files, before transformers is imported; when allowed, it logs whose code runs and
``info["code"]`` records it. Every transformers call is local-only (``harness.hub``): a
``config.json`` / ``tokenizer_config.json`` whose ``auto_map`` names a hub repository is refused by
``check_vendor_dir`` before transformers is imported, the loads run inside ``hub_offline()``
(HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE), and ``local_files_only=True`` goes to every ``from_pretrained``.

The vendor code supports ``eager`` and ``flash_attention_2`` only (its attention class table has
no sdpa). What ran is recorded in ``VendorOCR.info``: ``config._attn_implementation`` after the
load and the class of ``layers[0].self_attn`` (``LlamaAttention`` / ``LlamaFlashAttention2``).

``VendorOCR`` is a ``ModelAdapter``: by default (``model.vendor_loop=ours``)
``harness.models.generate.generate`` runs the vendor's own forward in the harness's greedy loop
(prefill with ``images=[(tiles or zeros, global view)]`` per batch element, then single-token
forwards with a ``DynamicCache``, attention mask and position ids as HF ``generate`` passes them;
EOS ignored, no ``no_repeat_ngram_size``). ``set_loop`` hands every request to the vendor's own
loop instead (``generate_own``): its HF ``generate`` with ``infer()``'s arguments
(``harness.models.vendor.hf_generate``) or ``infer()`` itself (``harness.models.vendor.infer``),
chosen by ``harness.models.vendor.loops``; what runs is ``info["loop"]``. Stages come from
forward hooks on ``model.sam_model``,
``model.vision_model`` and ``model.projector`` (counted calls: Gundam runs each twice, batch
elements run one after another) and from the loop itself. The vendor forward computes the token
embedding before its vision encoders, so one request emits, in order::

    request
      prefill(pre_vision=True)          embed_tokens + the vendor's two "pixels sum to 0?" host syncs
      sam(call=i) clip(call=i) projector(call=i) projector(call=i, glue=True) ...   per view
      prefill                           (from the first decoder layer) layers, norm, lm_head, argmax
      decode
        decode_step(step=j) ...         one vendor forward with one token + argmax

``glue`` covers what the vendor does between its last projector call and the first decoder layer:
newline/separator layout, the ``masked_scatter_`` into the embeddings and the causal-mask build.
A stage may therefore be entered several times per request; consumers sum the entries.
"""
from __future__ import annotations

import contextlib
import io
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from ...config import CLIPConfig, LLMConfig, ModelConfig, ProjectorConfig, SAMConfig
from ...dtypes import torch_dtype
from ...errors import HarnessError
from ...hub import ALLOW_CODE, allow_directory_code, check_auto_map, directory_code, hub_offline, refuse_hub_code
from .. import attn_probe
from ..adapter import GenerationResult, Select, StageFn, no_stage
from ..build import build_model
from ..checkpoint import check_tensors, read_headers
from ..routing import RoutingCounter
from .compat import (VENDOR_TRANSFORMERS, cuda_noop_on_cpu, ensure_torchvision, params_on_meta,
                            require_transformers)

#: files the vendor code needs to import (modeling_deepseekocr imports the others)
VENDOR_CODE_FILES = ("config.json", "modeling_deepseekocr.py", "modeling_deepseekv2.py",
                     "configuration_deepseek_v2.py", "deepencoder.py", "conversation.py")

#: our attn_implementation name -> the vendor's (its ATTENTION_CLASSES has no sdpa)
VENDOR_ATTN = {"eager": "eager", "flash_attention_2": "flash_attention_2"}
#: ``info["loop"]`` of the harness loop
OURS_LOOP = {"loop": "ours", "driver": "harness.models.generate: greedy argmax per forward, EOS ignored, "
             "no logits processors (no no_repeat_ngram_size), no streamer"}


# --------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------

def check_vendor_dir(path) -> Path:
    """The vendor directory as a Path, or a one-line HarnessError (missing, empty, no code, code
    on the hub: ``harness.hub.refuse_hub_code``)."""
    fix_dl = ("download the DeepSeek-OCR snapshot (config.json, *.py, tokenizer files, optionally "
              "*.safetensors) into it, e.g. huggingface-cli download deepseek-ai/DeepSeek-OCR --local-dir DIR")
    if path is None or str(path).strip() == "":
        raise HarnessError("model=vendor needs model.path (the vendor model directory)",
                           "pass model.path=DIR of a DeepSeek-OCR snapshot")
    p = Path(path).expanduser()
    if not p.exists():
        raise HarnessError(f"vendor model directory {p} does not exist", fix_dl)
    if not p.is_dir():
        raise HarnessError(f"vendor model path {p} is not a directory", "pass the snapshot directory, not a file")
    if not any(p.iterdir()):
        raise HarnessError(f"vendor model directory {p} is empty", fix_dl)
    missing = [f for f in VENDOR_CODE_FILES if not (p / f).is_file()]
    if missing:
        raise HarnessError(f"{p} has no vendor modeling code (missing {', '.join(missing)})", fix_dl)
    refuse_hub_code(p)
    return p


def vendor_attn_name(ours: str) -> str:
    """Map our ``attn_implementation`` to the vendor's; sdpa variants are refused."""
    if ours not in VENDOR_ATTN:
        raise HarnessError(f"attn_implementation={ours!r} is not supported by the vendor code (it has only "
                           "eager and flash_attention_2 attention classes)",
                           "use model.attn_implementation=eager or flash_attention_2 with model=vendor")
    return VENDOR_ATTN[ours]


def checkpoint_files(path: Path) -> list:
    """The safetensors files from_pretrained would read: ``model.safetensors``, else the shards of
    ``model.safetensors.index.json`` (all must exist), else any ``*.safetensors``; [] when none."""
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    index = path / "model.safetensors.index.json"
    present = sorted(path.glob("*.safetensors"))
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except Exception as exc:
            raise HarnessError(f"cannot read {index}: {exc}", "re-download the snapshot's index file") from None
        have = [path / s for s in shards if (path / s).is_file()]
        if not have and not present:
            return []  # the index alone (as in a code-only snapshot): random weights
        lacking = [s for s in shards if not (path / s).is_file()]
        if lacking:
            raise HarnessError(f"checkpoint in {path} is incomplete: {len(lacking)} shard(s) named in "
                               f"{index.name} are missing ({', '.join(lacking[:3])})",
                               "download the missing *.safetensors files, or remove all of them for random weights")
        return have
    if present:
        raise HarnessError(f"{path} has {', '.join(f.name for f in present[:3])} but neither model.safetensors "
                           "nor model.safetensors.index.json, so from_pretrained cannot find the weights",
                           "name a single file model.safetensors or add the snapshot's index file")
    return []


# --------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------

def reference_config(vcfg, attn_implementation: str = "eager", strict: bool = True) -> ModelConfig:
    """Our ModelConfig for a vendor config (LLM sizes from it; the vision sizes are hard-coded in
    the vendor's deepencoder.py and equal our defaults). ``strict``: refuse vendor options the
    reference does not implement (needed when the reference's weights are adopted)."""
    unsupported = []
    for key, want in (("use_mla", False), ("topk_method", "greedy"), ("scoring_func", "softmax"),
                      ("moe_layer_freq", 1), ("rope_scaling", None), ("attention_bias", False),
                      ("hidden_act", "silu"), ("ep_size", 1)):
        have = getattr(vcfg, key, want)
        if have != want:
            unsupported.append(f"{key}={have!r}")
    if unsupported and strict:
        raise HarnessError(f"vendor config uses {', '.join(unsupported)}, which the reference model does not "
                           "implement, so its random weights cannot be adopted",
                           "use a DeepSeek-OCR snapshot with its safetensors, or its unmodified config.json")
    llm = LLMConfig(
        vocab_size=vcfg.vocab_size, hidden_size=vcfg.hidden_size, num_layers=vcfg.num_hidden_layers,
        num_heads=vcfg.num_attention_heads, num_kv_heads=vcfg.num_key_value_heads,
        intermediate_size=vcfg.intermediate_size, moe_intermediate_size=vcfg.moe_intermediate_size,
        n_routed_experts=vcfg.n_routed_experts, n_shared_experts=vcfg.n_shared_experts,
        num_experts_per_tok=vcfg.num_experts_per_tok, first_k_dense_replace=vcfg.first_k_dense_replace,
        routed_scaling_factor=float(vcfg.routed_scaling_factor), norm_topk_prob=bool(vcfg.norm_topk_prob),
        rope_theta=float(vcfg.rope_theta), rms_norm_eps=float(vcfg.rms_norm_eps),
        max_position_embeddings=vcfg.max_position_embeddings)
    return ModelConfig(name="vendor", attn_implementation=attn_implementation, llm=llm, sam=SAMConfig(),
                       clip=CLIPConfig(), projector=ProjectorConfig(n_embed=vcfg.hidden_size),
                       bos_token_id=_int_or(getattr(vcfg, "bos_token_id", None), 0),
                       eos_token_id=_int_or(getattr(vcfg, "eos_token_id", None), 1))


def _int_or(value, default: int) -> int:
    return default if value is None else int(value)


def _wrap(what: str, path, exc: Exception, fix: str) -> HarnessError:
    msg = " ".join(str(exc).split())
    if len(msg) > 300:
        msg = msg[:300] + " ..."
    return HarnessError(f"{what} {path} failed ({exc.__class__.__name__}: {msg})", fix)


def _load_config(path: Path, overrides: Optional[dict], trust_remote_code: bool):
    from transformers import AutoConfig

    try:
        vcfg = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code, local_files_only=True)
    except HarnessError:
        raise
    except Exception as exc:
        raise _wrap("loading the vendor config and code from", path, exc,
                    f"check the snapshot's *.py files are unmodified and transformers=={VENDOR_TRANSFORMERS}, "
                    "einops, addict and easydict are installed (the `vendor` extra)") from None
    vcfg._name_or_path = str(path)  # from_config resolves the remote code from here (local dir)
    for key, value in (overrides or {}).items():
        if not hasattr(vcfg, key):
            raise HarnessError(f"vendor config has no field {key!r}", "override only fields of config.json")
        setattr(vcfg, key, value)
    check_auto_map(getattr(vcfg, "auto_map", None), f"the vendor config of {path}")   # what from_config follows
    return vcfg


def vendor_reference_config(path, attn_implementation: str = "eager",
                            config_overrides: Optional[dict] = None, trust_remote_code: bool = False) -> ModelConfig:
    """Our ModelConfig equal to the vendor directory's config (what ``load_vendor`` builds its
    random weights with), e.g. to build the reference model for a comparison. The config class is
    the directory's code: ``trust_remote_code`` as ``load_vendor``'s."""
    path = check_vendor_dir(path)
    allow_directory_code(path, trust_remote_code)
    with hub_offline():
        require_transformers()
        ensure_torchvision()
        with _transformers_quiet(True):
            return reference_config(_load_config(path, config_overrides, trust_remote_code), attn_implementation)


def _skeleton(vcfg, dtype: torch.dtype, vendor_attn: str, trust_remote_code: bool):
    """The vendor module tree with parameters on meta (buffers real), from its config."""
    from transformers import AutoModel

    try:
        with params_on_meta(), contextlib.redirect_stdout(io.StringIO()):
            return AutoModel.from_config(vcfg, trust_remote_code=trust_remote_code, torch_dtype=dtype,
                                         attn_implementation=vendor_attn)
    except Exception as exc:
        raise _wrap(f"building the vendor model (attn_implementation={vendor_attn}) from", vcfg._name_or_path,
                    exc, "use attn_implementation=eager, or install flash-attn and run on a CUDA device "
                         "for flash_attention_2") from None


def _adopt(model: nn.Module, state: dict) -> None:
    """Assign ``state``'s tensors (no copy) to every parameter of ``model``; names must match."""
    params = dict(model.named_parameters())
    buffers = {k for k, _ in model.named_buffers()}
    missing = sorted(set(params) - set(state))
    unexpected = sorted(set(state) - set(params) - buffers)
    mismatched = sorted(k for k in set(params) & set(state) if tuple(params[k].shape) != tuple(state[k].shape))
    if missing or unexpected or mismatched:
        raise HarnessError(f"reference and vendor state_dicts differ: missing {missing[:3]}, unexpected "
                           f"{unexpected[:3]}, mismatched {mismatched[:3]}",
                           "the vendor config and the reference model disagree; report this as a bug")
    model.load_state_dict({k: v for k, v in state.items() if k in params}, strict=False, assign=True)
    still_meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if still_meta:
        raise HarnessError(f"{len(still_meta)} vendor parameters got no weights ({still_meta[:3]})",
                           "report this as a bug")


# --------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------

def load_vendor(path, device="cpu", dtype=torch.bfloat16, attn_implementation: str = "eager", seed: int = 0,
                *, config_overrides: Optional[dict] = None, autocast: Optional[bool] = None,
                quiet: bool = True, trust_remote_code: bool = False) -> "VendorOCR":
    """Load the vendor model from directory ``path`` and wrap it as a ``VendorOCR``.

    ``config_overrides``: fields of the vendor config to change before building (e.g.
    ``{"num_hidden_layers": 2}`` for a shrunken LLM; random weights only). ``autocast``: run the
    forwards under ``torch.autocast('cuda', bfloat16)`` as the vendor's ``infer()`` does; default
    on for CUDA with bf16 weights. ``quiet``: swallow the vendor forward's prints and, while
    loading, transformers' expected warnings. ``trust_remote_code``: the directory's Python code may
    run (``model.trust_remote_code``; refused with one line before transformers is imported when
    False). The harness loop drives it (``info["loop"]``); ``harness.models.vendor.loops`` loads it
    with the vendor's own loop or entry instead.
    """
    path = check_vendor_dir(path)
    vendor_attn = vendor_attn_name(attn_implementation)
    device = torch.device(device)
    dtype = torch_dtype(dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise HarnessError("device=cuda was requested but no CUDA device is available", "use device=cpu")
    files = checkpoint_files(path)
    if files and config_overrides:
        raise HarnessError("config_overrides apply to random weights only, but the directory has a checkpoint",
                           "drop the overrides or use a directory without *.safetensors")
    allow_directory_code(path, trust_remote_code)
    with hub_offline():
        transformers = require_transformers()
        torchvision = ensure_torchvision()
        with _transformers_quiet(quiet):
            return _load(path, files, device, dtype, attn_implementation, vendor_attn, seed, config_overrides,
                         autocast, quiet, transformers.__version__, torchvision, trust_remote_code)


@contextlib.contextmanager
def _transformers_quiet(quiet: bool):
    """While loading, hide transformers' warnings that are expected here ("model of type
    deepseek_vl_v2 to instantiate a model of type DeepseekOCR"; the CLIP ``position_ids`` buffer,
    which the checkpoint omits, reported as "newly initialized" although it is computed)."""
    if not quiet:
        yield
        return
    from transformers.utils import logging as tlog

    level = tlog.get_verbosity()
    tlog.set_verbosity_error()
    try:
        yield
    finally:
        tlog.set_verbosity(level)


def _load(path, files, device, dtype, attn_implementation, vendor_attn, seed, config_overrides, autocast,
          quiet, transformers_version, torchvision, trust_remote_code) -> "VendorOCR":
    vcfg = _load_config(path, config_overrides, trust_remote_code)
    cfg = reference_config(vcfg, attn_implementation, strict=not files)
    t0 = time.perf_counter()
    if files:
        skel = _skeleton(vcfg, dtype, vendor_attn, trust_remote_code)
        params = {k: tuple(p.shape) for k, p in skel.named_parameters()}
        optional = {k for k, _ in skel.named_buffers()}
        n_tensors = check_tensors(read_headers(files), params, files[0].parent, "the vendor model", optional)
        del skel
        from transformers import AutoModel

        try:
            with contextlib.redirect_stdout(io.StringIO()):
                hf, loading = AutoModel.from_pretrained(
                    str(path), config=vcfg, trust_remote_code=trust_remote_code, local_files_only=True,
                    torch_dtype=dtype, attn_implementation=vendor_attn, output_loading_info=True)
        except HarnessError:
            raise
        except Exception as exc:
            raise _wrap("AutoModel.from_pretrained on", path, exc,
                        "check the checkpoint is complete and unmodified; for flash_attention_2 install "
                        "flash-attn and use a CUDA device") from None
        bad = {k: sorted(set(v) - optional) if k == "missing_keys" else sorted(v)
               for k, v in loading.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        if any(bad.values()):
            raise HarnessError(f"checkpoint in {path} does not match the vendor model: "
                               + "; ".join(f"{len(v)} {k} ({v[:3]})" for k, v in bad.items() if v),
                               "point model.path at an unmodified DeepSeek-OCR snapshot")
        hf = hf.to(device)
        weights = {"source": "safetensors", "files": [str(f) for f in files], "tensors": n_tensors}
    else:
        hf = _skeleton(vcfg, dtype, vendor_attn, trust_remote_code)
        ref = build_model(cfg, device, dtype, seed)
        _adopt(hf, ref.state_dict())
        del ref
        hf = hf.to(device)  # buffers (rotary inv_freq, CLIP position_ids); parameters are there already
        weights = {"source": "random", "seed": seed, "init": "reference build_model (shared state_dict names)"}
    hf.eval()
    attn_cls = type(hf.model.layers[0].self_attn)
    info = {
        "model": "vendor", "path": str(path), "device": str(device), "dtype": str(dtype).replace("torch.", ""),
        "attn_implementation": hf.config._attn_implementation,
        "attention_class": f"{attn_cls.__module__}.{attn_cls.__name__}",
        "requested_attn_implementation": attn_implementation,
        "transformers": transformers_version, "torchvision": torchvision,
        "weights": weights, "load_s": round(time.perf_counter() - t0, 3),
        "config_overrides": dict(config_overrides or {}),
        "code": {"directory": str(path), "files": directory_code(path), "allowed_by": ALLOW_CODE},
    }
    return VendorOCR(hf, cfg, device, dtype, info, autocast=autocast, quiet=quiet)


# --------------------------------------------------------------------------------------------
# driving
# --------------------------------------------------------------------------------------------

@dataclass
class VendorCache:
    """State between vendor forwards: the HF ``DynamicCache`` and the attention mask that HF
    ``generate`` would grow by one column per step."""

    past: object
    attention_mask: Optional[torch.Tensor] = None

    @property
    def length(self) -> int:
        return 0 if self.attention_mask is None else int(self.attention_mask.shape[1])

    def nbytes(self) -> int:
        tensors = list(getattr(self.past, "key_cache", [])) + list(getattr(self.past, "value_cache", []))
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class _Segments:
    """Flat, non-overlapping stage contexts opened and closed from hooks."""

    def __init__(self, stage: StageFn):
        self.stage = stage
        self.cm = None
        self.name: Optional[str] = None
        self.payload: dict = {}

    def switch(self, name: str, **payload) -> None:
        self.close()
        cm = self.stage(name, **payload)
        cm.__enter__()
        self.cm, self.name, self.payload = cm, name, payload

    def close(self, exc: Optional[BaseException] = None) -> None:
        cm, self.cm, self.name, self.payload = self.cm, None, None, {}
        if cm is not None:
            if exc is None:
                cm.__exit__(None, None, None)
            else:
                cm.__exit__(type(exc), exc, exc.__traceback__)


class VendorOCR(nn.Module):
    """The vendor's ``DeepseekOCRForCausalLM`` with the reference model's driving API.

    ``model`` and ``lm_head`` are the vendor's own modules, so module and state_dict names equal
    the reference's (plus the vendor's ``model.vision_model.embeddings.position_ids`` buffer).
    ``hf`` is the whole vendor module; ``cfg`` our equivalent ModelConfig; ``info`` what was
    loaded and what ran.
    """

    def __init__(self, hf: nn.Module, cfg: ModelConfig, device, dtype, info: dict,
                 autocast: Optional[bool] = None, quiet: bool = True):
        super().__init__()
        self.model = hf.model
        self.lm_head = hf.lm_head
        object.__setattr__(self, "hf", hf)  # not a child: keeps names identical to the reference
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        if autocast is None:
            autocast = self.device.type == "cuda" and dtype == torch.bfloat16
        self.autocast = bool(autocast)
        self.quiet = quiet
        info = dict(info)
        info["autocast"] = "cuda bf16 (as the vendor infer())" if self.autocast else "off"
        info["loop"] = dict(OURS_LOOP)
        self.info = info
        #: None: the harness loop drives (``harness.models.adapter.own_loop``); else the vendor's own
        self.generate_own = None
        self._moe = [(i, layer.mlp) for i, layer in enumerate(hf.model.layers)
                     if type(layer.mlp).__name__ == "DeepseekV2MoE" and hasattr(layer.mlp, "gate")]
        self.stage_calls: dict = {}

    def forward(self, *args, **kwargs):
        return self.hf(*args, **kwargs)

    @property
    def attn_implementation(self) -> str:
        return self.hf.config._attn_implementation

    def set_loop(self, driver) -> None:
        """Let ``driver`` (request, stage, max_new_tokens) -> GenerationResult run every request
        (``generate_own``); ``info["loop"]`` says what it runs (``driver.describe()``)."""
        self.generate_own = driver
        self.info["loop"] = driver.describe()

    # ----------------------------------------------------------------- helpers
    def new_cache(self) -> VendorCache:
        from transformers.cache_utils import DynamicCache

        return VendorCache(past=DynamicCache())

    def _autocast(self):
        if self.autocast:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _images(self, request):
        """``images`` (list of (patches, global view) per batch element) and ``images_spatial_crop``
        as the vendor's ``infer()`` builds them; zeros stand for "no tiles"."""
        gv = request.global_views.to(self.device, self.dtype)
        b = gv.shape[0]
        if request.tiles is not None:
            if request.grid is None:
                raise HarnessError("request has tiles but no grid", "build requests with harness.workload")
            cols, rows = request.grid
            n = cols * rows
            tiles = request.tiles.to(self.device, self.dtype)
            if tiles.shape[0] != b * n:
                raise HarnessError(f"request has {tiles.shape[0]} tiles for {b} page(s) of {cols}x{rows}",
                                   "build requests with harness.workload")
            images = [(tiles[i * n:(i + 1) * n], gv[i:i + 1]) for i in range(b)]
            crop = torch.tensor([[cols, rows]] * b, dtype=torch.long)
        else:
            zeros = torch.zeros((1, 3, gv.shape[-2], gv.shape[-1]), device=self.device, dtype=self.dtype)
            images = [(zeros, gv[i:i + 1]) for i in range(b)]
            crop = torch.tensor([[1, 1]] * b, dtype=torch.long)
        return images, crop

    @staticmethod
    def _positions(mask: torch.Tensor) -> torch.Tensor:
        """Position ids as the vendor's ``prepare_inputs_for_generation`` derives them."""
        pos = mask.long().cumsum(-1) - 1
        pos.masked_fill_(mask == 0, 1)
        return pos

    def _vision_hooks(self, seg: _Segments, capture: Optional[dict]) -> list:
        m = self.model
        calls = {"sam": 0, "clip": 0, "projector": 0}
        self.stage_calls = calls
        handles = []

        def pre(name):
            def hook(module, args):
                seg.switch(name, call=calls[name])
            return hook

        def post(name):
            def hook(module, args, output):
                i = calls[name]
                calls[name] += 1
                if capture is not None:
                    capture.setdefault(name, []).append(output)
                if name == "projector":
                    seg.switch("projector", call=i, glue=True)
                else:
                    seg.close()
            return hook

        for name, mod in (("sam", m.sam_model), ("clip", m.vision_model), ("projector", m.projector)):
            handles.append(mod.register_forward_pre_hook(pre(name)))
            handles.append(mod.register_forward_hook(post(name)))

        def llm_start(module, args):
            if seg.name != "prefill" or seg.payload:
                seg.switch("prefill")

        handles.append(m.layers[0].register_forward_pre_hook(llm_start))
        # one-shot SDPA probes; the vendor's CLIP block calls self_attn.forward() directly (no hooks):
        # probe the block
        clip0 = m.vision_model.transformer.layers[0]
        for site, mod, heads in (("sam", m.sam_model.blocks[0].attn, m.sam_model.blocks[0].attn.num_heads),
                                 ("clip", clip0, clip0.self_attn.num_heads)):
            if not attn_probe.seen_once(site):
                handles.append(mod.register_forward_pre_hook(self._sdpa_probe(site, heads)))
        return handles

    def _sdpa_probe(self, site: str, heads: int):
        """One-shot: the SDPA backend torch picks for the vendor's SAM / CLIP attention call
        (decided from shapes, dtype, device and mask presence; empty tensors suffice)."""
        def hook(module, args):
            if attn_probe.seen_once(site):
                return
            x = args[0]
            dtype = torch.bfloat16 if self.autocast else x.dtype
            if site == "sam":  # [B, H, W, C] -> q [B, heads, H*W, C/heads], dense rel-pos bias
                b, h, w, c = x.shape
                q = x.new_empty((b, heads, h * w, c // heads), dtype=dtype)
                attn_probe.note(site, attn_probe.sdpa_choice(q, q, q, q.new_empty((b, heads, h * w, h * w))))
            else:  # [B, S, C] -> q [B, heads, S, C/heads], no mask
                b, n, c = x.shape
                q = x.new_empty((b, heads, n, c // heads), dtype=dtype)
                attn_probe.note(site, attn_probe.sdpa_choice(q, q, q))
        return hook

    def _note_llm(self, site: str) -> None:
        if not attn_probe.seen_once(site):
            impl = self.attn_implementation
            kernel = "eager:matmul+softmax" if impl == "eager" else "flash_attn:flash_attn_func"
            attn_probe.note(site, f"{kernel} (vendor {type(self.hf.model.layers[0].self_attn).__name__})")

    # -------------------------------------------------------- adapter protocol
    def routing_counter(self) -> RoutingCounter:
        return RoutingCounter(len(self.hf.model.layers), self.hf.config.n_routed_experts)

    @contextlib.contextmanager
    def routing_hooks(self, counter: RoutingCounter):
        """Each MoE gate's chosen experts go to ``counter`` on the device (one scatter_add per layer,
        no sync) through forward hooks, removed on exit."""
        def make(layer):
            def hook(module, args, output):
                counter.add_device(layer, output[0])
            return hook

        handles = [moe.gate.register_forward_hook(make(i)) for i, moe in self._moe]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @contextlib.contextmanager
    def running(self, request, max_new_tokens: int, counter: RoutingCounter):
        """A fresh ``DynamicCache``; routing counted through ``routing_hooks``."""
        with self.routing_hooks(counter):
            yield self.new_cache()

    def first_token(self, request, cache: VendorCache, stage: StageFn, select: Select) -> torch.Tensor:
        seg = _Segments(stage)
        try:
            token = select(self._prefill(request, cache, seg))
        except BaseException as exc:
            seg.close(exc)
            raise
        seg.close()
        return token

    def next_token(self, token: torch.Tensor, cache: VendorCache, select: Select) -> torch.Tensor:
        return select(self._decode(token, cache))

    # ------------------------------------------------------------------- steps
    def _prefill(self, request, cache: VendorCache, seg: _Segments, capture: Optional[dict] = None):
        """Vendor forward over the whole prompt (vision included). Leaves the last ``prefill``
        segment open so the caller's argmax lands in it."""
        ids = request.input_ids.to(self.device)
        mask = request.images_seq_mask.to(self.device)
        images, crop = self._images(request)
        cache.attention_mask = torch.ones(ids.shape, dtype=torch.long, device=self.device)
        pos = self._positions(cache.attention_mask)
        handles = self._vision_hooks(seg, capture)
        quiet = contextlib.redirect_stdout(io.StringIO()) if self.quiet else contextlib.nullcontext()
        try:
            seg.switch("prefill", pre_vision=True)
            with self._autocast(), cuda_noop_on_cpu(self.device), quiet:
                out = self.hf(input_ids=ids, attention_mask=cache.attention_mask, position_ids=pos,
                              past_key_values=cache.past, use_cache=True, images=images, images_seq_mask=mask,
                              images_spatial_crop=crop, return_dict=True)
        except BaseException as exc:
            seg.close(exc)
            raise
        finally:
            for h in handles:
                h.remove()
        if self.stage_calls.get("sam", 0) == 0:
            seg.close()
            raise HarnessError("the vendor forward skipped its vision encoders (it does so when the first "
                               "global view's pixels sum to exactly 0)", "use a page with content")
        cache.past = out.past_key_values
        self._note_llm("llm_prefill")
        return out.logits

    def _decode(self, token: torch.Tensor, cache: VendorCache) -> torch.Tensor:
        token = token.to(self.device)
        cache.attention_mask = torch.cat(
            [cache.attention_mask, cache.attention_mask.new_ones((cache.attention_mask.shape[0], 1))], dim=-1)
        pos = self._positions(cache.attention_mask)[:, -token.shape[1]:]
        with self._autocast():
            out = self.hf(input_ids=token, attention_mask=cache.attention_mask, position_ids=pos,
                          past_key_values=cache.past, use_cache=True, return_dict=True)
        cache.past = out.past_key_values
        self._note_llm("llm_decode")
        return out.logits

    @torch.no_grad()
    def prefill(self, request, cache: VendorCache, stage: StageFn = no_stage,
                capture: Optional[dict] = None) -> torch.Tensor:
        """Teacher-forcing entry: fp32 logits [B, S, vocab] of the vendor prefill (vision included).
        ``capture`` (a dict) receives the sam/clip/projector outputs per call."""
        seg = _Segments(stage)
        logits = self._prefill(request, cache, seg, capture)
        seg.close()
        return logits

    @torch.no_grad()
    def decode_step(self, token: torch.Tensor, cache: VendorCache) -> torch.Tensor:
        """Teacher-forcing entry: token [B, 1] -> fp32 logits [B, 1, vocab]."""
        return self._decode(token, cache)

    def generate(self, request, max_new_tokens: Optional[int] = None, stage: StageFn = no_stage) -> GenerationResult:
        """``harness.models.generate.generate`` on this adapter (same stages and result as the
        reference model's)."""
        from ..generate import generate

        return generate(self, request, stage, max_new_tokens)
