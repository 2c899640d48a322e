"""The one registry of module families: which modules of the model each family is.

Each ``FamilyEntry`` names a family (its cost class of the same ``family`` name lives in
``harness.analytic.families``: formulas, FLOPs, bytes), the module classes that run it in the
reference model and in the vendor's code (a class shared by several families is told apart by
``where``, a regex over the module path), what the profiler sees of it (``ops``) and its roofline
op group (``op_group``: how kernel time and analytic work are joined,
``harness.roofline.join.OP_GROUPS``). Kernel attribution (``harness.measure.modules``), the
generated docs (``harness.analytic.docs``), the call graph (``harness.callgraph``) and the roofline
grouping read it; adding a family is one entry here plus its cost class. The order of ``REGISTRY``
is the order of ``harness.analytic.families.FAMILIES`` (a test checks both name the same families).

``CONTAINERS`` names the modules that hold families without being one (SAMBlock, DecoderLayer,
MoE, ...): their vendor class and, for the module catalog, what runs inside them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

#: roofline op groups (``harness.roofline.ops``): a kernel's group follows the module that launched it
#: (its family's ``op_group``); ``kv_cache`` (KV-cache update kernels), ``routing/indexing`` (the MoE
#: container's own kernels), ``elementwise`` (container glue) and ``other`` (outside every module) hold
#: no family of their own.
OP_GROUP_NAMES = ("matmul", "kv_cache", "norm", "rope", "elementwise", "memory/routing", "routing/indexing", "other")


@dataclass(frozen=True)
class FamilyEntry:
    """One module family. ``family``: its name (the cost class's ``family``); ``modules``: how the
    docs name the reference modules it costs;
    ``classes`` / ``vendor_classes``: class names (ours, the vendor's) whose instances are this
    family where ``where`` (a regex over the module path) matches; ``ops``: op families as the
    profiler sees them; ``op_group``: the roofline op group."""

    family: str
    modules: tuple
    classes: tuple
    vendor_classes: tuple
    ops: tuple
    op_group: str
    where: str = ""

    def matches(self, path: str, cls: str) -> bool:
        return (cls in self.classes or cls in self.vendor_classes) and (not self.where or re.search(self.where, path)
                                                                          is not None)


REGISTRY = (
    FamilyEntry("patch_embed", ("PatchEmbed", "SAMEncoder.pos_embed"), ("PatchEmbed",), ("PatchEmbed",),
                ("convolution", "elementwise (pos add)", "interpolate (pos resize)"), "matmul"),
    FamilyEntry("layernorm", ("LayerNorm",), ("LayerNorm",), ("LayerNorm", "LayerNormfp32"),
                ("norm (reduction + elementwise)",), "norm"),
    FamilyEntry("sam_attention", ("SAMAttention",), ("SAMAttention",), ("Attention",),
                ("GEMM (addmm: qkv, proj)", "bmm (rel-pos einsums)", "elementwise (bias build)",
                 "SDPA with dense float mask"), "matmul", r"(^|\.)sam_model\."),
    FamilyEntry("sam_mlp", ("SAMMLP",), ("SAMMLP",), ("MLPBlock",), ("GEMM (addmm)", "elementwise (GELU, residual)"),
                "matmul"),
    FamilyEntry("layernorm2d", ("LayerNorm2d",), ("LayerNorm2d",), ("LayerNorm2d",),
                ("norm (reduction + elementwise)",), "norm"),
    FamilyEntry("conv2d", ("Conv2d",), ("Conv2d",), ("Conv2d",), ("convolution",), "matmul",
                r"(^|\.)sam_model\.(neck\.\d+|net_2|net_3)$"),
    FamilyEntry("clip_embeddings", ("CLIPEmbeddings",), ("CLIPEmbeddings",), ("CLIPVisionEmbeddings",),
                ("concat (CLS)", "interpolate (pos resize)", "elementwise (pos add)"), "memory/routing"),
    FamilyEntry("clip_attention", ("CLIPAttention",), ("CLIPAttention",), ("NoTPAttention",),
                ("GEMM (addmm: qkv_proj, out_proj)", "SDPA (no mask)", "elementwise (residual)"), "matmul"),
    FamilyEntry("clip_mlp", ("CLIPMLP",), ("CLIPMLP",), ("NoTPFeedForward",),
                ("GEMM (addmm)", "elementwise (quick_gelu, residual)"), "matmul"),
    FamilyEntry("projector", ("Projector",), ("Projector",), ("MlpProjector",), ("concat", "GEMM (addmm)"), "matmul"),
    FamilyEntry("image_layout", ("DeepseekOCRModel.image_newline", "DeepseekOCRModel.view_seperator"), (), (),
                ("concat",), "memory/routing"),
    FamilyEntry("embedding", ("Embedding",), ("Embedding",), ("Embedding",),
                ("embedding (gather)", "masked_scatter"), "memory/routing", r"(^|\.)embed_tokens$"),
    FamilyEntry("rmsnorm", ("RMSNorm",), ("RMSNorm",), ("DeepseekV2RMSNorm",),
                ("norm (reduction + elementwise, fp32)",), "norm"),
    FamilyEntry("rope", ("RotaryEmbedding",), ("RotaryEmbedding",),
                ("LlamaRotaryEmbedding", "DeepseekV2RotaryEmbedding"),
                ("bmm (inv_freq @ positions)", "elementwise (cos, sin, rotate)"), "rope"),
    FamilyEntry("llm_attention", ("Attention",), ("Attention",), ("LlamaAttention", "LlamaFlashAttention2"),
                ("GEMM (mm: q/k/v/o)", "SDPA / flash / eager matmul+softmax", "KV cache cat"), "matmul",
                r"(^|\.)layers\.\d+\.self_attn$"),
    FamilyEntry("dense_mlp", ("SwiGLU",), ("SwiGLU",), ("DeepseekV2MLP",),
                ("GEMM (mm: gate, up, down)", "elementwise (SiLU, product, residual)"), "matmul",
                r"(^|\.)layers\.\d+\.mlp$"),
    FamilyEntry("moe_gate", ("MoEGate",), ("MoEGate",), ("MoEGate",), ("GEMM (mm, fp32)", "softmax", "topk"),
                "matmul"),
    FamilyEntry("moe_routed", ("MoE.experts", "SwiGLU"), ("SwiGLU",), ("DeepseekV2MLP",),
                ("gather / argsort / scatter", "GEMM (mm) per touched expert",
                 "elementwise (SiLU, product, weighted sum)", "device-to-host copy of counts"), "matmul",
                r"\.experts\.\d+$"),
    FamilyEntry("moe_shared", ("MoE.shared_experts", "SwiGLU"), ("SwiGLU",), ("DeepseekV2MLP",),
                ("GEMM (mm: gate, up, down)", "elementwise (SiLU, product, adds)"), "matmul", r"\.shared_experts$"),
    FamilyEntry("lm_head", ("Linear (lm_head)",), ("Linear",), ("Linear",), ("GEMM (mm)", "cast to fp32"), "matmul",
                r"^lm_head$"),
)
BY_FAMILY = {e.family: e for e in REGISTRY}

#: modules that hold families without being one: ours -> (vendor class, what runs inside, families inside)
CONTAINERS = {
    "DeepseekOCR": ("DeepseekOCRForCausalLM", "-", "all stages"),
    "DeepseekOCRModel": ("DeepseekOCRModel", "-", "all stages"),
    "SAMEncoder": ("ImageEncoderViT", "-", "patch_embed, layernorm, sam_attention, sam_mlp, conv2d, layernorm2d"),
    "SAMBlock": ("Block", "norm, attention, MLP, residual adds", "layernorm, sam_attention, sam_mlp"),
    "Sequential": ("Sequential", "-", "conv2d, layernorm2d"),
    "CLIPEncoder": ("VitModel", "-", "clip_embeddings, layernorm, clip_attention, clip_mlp"),
    "CLIPTransformer": ("NoTPTransformer", "-", "layernorm, clip_attention, clip_mlp"),
    "CLIPBlock": ("NoTPTransformerBlock", "norm, attention, MLP, residual adds", "layernorm, clip_attention, clip_mlp"),
    "DecoderLayer": ("DeepseekV2DecoderLayer", "norm, attention, MLP/MoE, residual adds",
                     "rmsnorm, rope, llm_attention, dense_mlp | moe_*"),
    "MoE": ("DeepseekV2MoE", "gate, argsort/gather, per-expert loop, scatter, host sync",
            "moe_gate, moe_routed, moe_shared"),
}

#: ops of a torch leaf module inside a family's module (it runs part of that family)
LEAF_OPS = {"Linear": "GEMM", "Conv2d": "convolution", "GELU": "elementwise", "Embedding": "embedding (gather)"}


def family_of(path: str, cls: str, owner=None) -> Optional[tuple]:
    """(family, variant) of the module at ``path`` of class ``cls`` (ours or the vendor's), None
    when no family describes that module itself. ``owner``: the SAM block that holds a SAM
    attention module (its ``window_size`` gives the variant ``window`` / ``global``)."""
    for e in REGISTRY:
        if e.matches(path, cls):
            variant = ""
            if e.family == "sam_attention" and owner is not None:
                ws = getattr(owner, "window_size", None)
                variant = "" if ws is None else ("global" if ws == 0 else "window")
            elif e.family == "conv2d":
                variant = "neck" if ".neck." in path else "downsample"
            return e.family, variant
    return None


def vendor_class(cls: str) -> str:
    """The vendor's class name for one of ours; torch built-ins keep their own name."""
    if cls in CONTAINERS:
        return CONTAINERS[cls][0]
    for e in REGISTRY:
        if cls in e.classes and e.vendor_classes:
            return e.vendor_classes[0]
    return cls


def op_group_families(group: str) -> tuple:
    """The families of roofline op group ``group``, in ``REGISTRY`` order."""
    return tuple(e.family for e in REGISTRY if e.op_group == group)


__all__ = ["FamilyEntry", "REGISTRY", "BY_FAMILY", "CONTAINERS", "LEAF_OPS", "OP_GROUP_NAMES", "family_of",
           "vendor_class", "op_group_families"]
