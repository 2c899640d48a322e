"""Structured configs for the harness, registered with Hydra's ConfigStore.

The YAML files under ``conf/`` fill these dataclasses; defaults here equal the vendor's
DeepSeek-OCR checkpoint (``shared/reference/deepseek-ocr/config.json``), so a model built from
an empty config has exactly the checkpoint's tensor names and shapes.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, List, Optional


@dataclass
class LLMConfig:
    """DeepSeek-V2-style decoder (``use_mla: false``: plain MHA)."""

    vocab_size: int = 129280
    hidden_size: int = 1280
    num_layers: int = 12
    num_heads: int = 10
    num_kv_heads: int = 10
    intermediate_size: int = 6848          # dense SwiGLU of layers < first_k_dense_replace
    moe_intermediate_size: int = 896       # per routed expert
    n_routed_experts: int = 64
    n_shared_experts: int = 2              # shared expert width = 2 x 896 = 1792
    num_experts_per_tok: int = 6
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass
class SAMConfig:
    """SAM ViT-B image encoder with neck and the two stride-2 convs (net_2, net_3)."""

    img_size: int = 1024                   # pretraining size: pos_embed is [1, 64, 64, 768]
    patch_size: int = 16
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_ratio: float = 4.0
    out_chans: int = 256
    window_size: int = 14
    global_attn_indexes: List[int] = field(default_factory=lambda: [2, 5, 8, 11])
    downsample_channels: List[int] = field(default_factory=lambda: [512, 1024])
    ln_eps: float = 1e-6


@dataclass
class CLIPConfig:
    """CLIP-L over SAM features (its own patch conv exists in the checkpoint but is unused)."""

    hidden_size: int = 1024
    num_layers: int = 24
    num_heads: int = 16
    ffn_hidden_size: int = 4096
    image_size: int = 224
    patch_size: int = 14
    ln_eps: float = 1e-5
    pre_ln_eps: float = 1e-5


@dataclass
class ProjectorConfig:
    input_dim: int = 2048                  # CLIP hidden + SAM net_3 channels
    n_embed: int = 1280                    # LLM hidden


@dataclass
class ModelConfig:
    """Which model, how it is built and how it executes."""

    name: str = "reference"                # reference | vendor
    path: Optional[str] = None             # model directory (safetensors, tokenizer, vendor code)
    weights: str = "random"                # random | path  (path: load safetensors from `path`)
    attn_implementation: str = "sdpa"      # eager | sdpa | sdpa_flash | flash_attention_2
    moe_impl: str = "vendor_loop"          # vendor_loop (per-expert Python loop, host sync)
    kv_cache: str = "growing"              # growing (torch.cat per step, like HF DynamicCache)
    lm_head_all_positions: bool = True     # vendor applies lm_head to every prefill position
    image_token_id: int = 128815
    bos_token_id: int = 0
    eos_token_id: int = 1
    init_std: float = 0.02                 # std of the seeded random initialisation
    llm: LLMConfig = field(default_factory=LLMConfig)
    sam: SAMConfig = field(default_factory=SAMConfig)
    clip: CLIPConfig = field(default_factory=CLIPConfig)
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)


@dataclass
class WorkloadConfig:
    """What one request contains. Token counts are exact; sizes are pixels."""

    mode: str = "base"                     # tiny | small | base | large | gundam
    images: Optional[str] = None           # image file or directory; None -> synthetic pages
    pages: int = 1                         # synthetic pages to generate when images is None
    page_size: Optional[List[int]] = None  # [width, height] of synthetic pages (pixels)
    batch: int = 1                         # requests decoded together (same layout)
    decode_tokens: int = 128               # fixed greedy decode budget (EOS ignored)
    prompt: str = "<image>\n<|grounding|>Convert the document to markdown. "
    text_tokens: int = 12                  # prompt text tokens when there is no tokenizer
    seed: int = 0
    max_pixels: int = 60_000_000           # larger pages are refused with a clear error


def from_dict(cls, data: Any):
    """Build dataclass ``cls`` from a mapping (or OmegaConf node), recursing into nested dataclasses.

    Unknown keys raise ``ValueError`` naming the key, so a typo in a YAML file is not ignored.
    """
    if data is None:
        return cls()
    if is_dataclass(data):
        return data
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(data):
            data = OmegaConf.to_container(data, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a hard dependency
        pass
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"unknown {cls.__name__} key(s) {unknown}; known: {sorted(known)}")
    kwargs = {}
    for name, value in data.items():
        sub = _NESTED.get((cls.__name__, name))
        kwargs[name] = from_dict(sub, value) if sub is not None else value
    return cls(**kwargs)


_NESTED = {
    ("ModelConfig", "llm"): LLMConfig,
    ("ModelConfig", "sam"): SAMConfig,
    ("ModelConfig", "clip"): CLIPConfig,
    ("ModelConfig", "projector"): ProjectorConfig,
}


def to_dict(obj) -> dict:
    return asdict(obj)
