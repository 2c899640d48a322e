"""The module-family registry: one entry per cost family, the module -> family map on the live
module tree, and the vendor class names the call graph shows."""
from __future__ import annotations

import torch

from harness.analytic import families as F
from harness.anatomy import registry as R


def test_one_entry_per_cost_family():
    assert [e.family for e in R.REGISTRY] == [cls.family for cls in F.FAMILIES]
    assert all(e.op_group in R.OP_GROUP_NAMES for e in R.REGISTRY)
    grouped = [f for g in R.OP_GROUP_NAMES for f in R.op_group_families(g)]
    assert sorted(grouped) == sorted(cls.family for cls in F.FAMILIES)


def test_family_of_every_module_of_the_tiny_model(tiny_cfg):
    from harness.models.build import build_model

    model = build_model(tiny_cfg, device="meta", dtype=torch.float32)
    found = {}
    for path, mod in model.named_modules():
        owner = model.get_submodule(path.rpartition(".")[0]) if path.endswith(".attn") else None
        hit = R.family_of(path, type(mod).__name__, owner)
        if hit:
            found.setdefault(hit, []).append(path)
    assert found[("sam_attention", "global")] == ["model.sam_model.blocks.1.attn"]
    assert found[("sam_attention", "window")] == ["model.sam_model.blocks.0.attn"]
    assert found[("conv2d", "neck")] == ["model.sam_model.neck.0", "model.sam_model.neck.2"]
    assert found[("conv2d", "downsample")] == ["model.sam_model.net_2", "model.sam_model.net_3"]
    assert found[("dense_mlp", "")] == ["model.layers.0.mlp"]
    assert len(found[("moe_routed", "")]) == 2 * 8 and found[("moe_shared", "")][0] == "model.layers.1.mlp.shared_experts"
    assert found[("llm_attention", "")] == [f"model.layers.{i}.self_attn" for i in range(3)]
    assert found[("lm_head", "")] == ["lm_head"] and found[("embedding", "")] == ["model.embed_tokens"]
    # the CLIP patch conv and position table are not modules of a family of their own
    assert R.family_of("model.vision_model.embeddings.patch_embedding", "Conv2d") is None
    assert R.family_of("model.vision_model.embeddings.position_embedding", "Embedding") is None
    every = {f for f, _ in found} | {"image_layout"}       # image_layout has no module: glue ops
    assert every == {cls.family for cls in F.FAMILIES}


def test_vendor_names_resolve_to_the_same_families():
    assert R.family_of("model.sam_model.blocks.2.attn", "Attention") == ("sam_attention", "")
    assert R.family_of("model.layers.3.self_attn", "LlamaFlashAttention2") == ("llm_attention", "")
    assert R.family_of("model.layers.3.mlp.experts.7", "DeepseekV2MLP") == ("moe_routed", "")
    assert R.vendor_class("SAMBlock") == "Block" and R.vendor_class("SwiGLU") == "DeepseekV2MLP"
    assert R.vendor_class("Attention") == "LlamaAttention" and R.vendor_class("Linear") == "Linear"
