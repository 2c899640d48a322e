"""Triton kernels of the execution variants, and their shared helpers (``common``).

``fast_moe_triton`` (routed experts), ``gemv_triton`` (decode-size linears, q/k/v + RoPE),
``router_triton`` (softmax + top-k of the MoE gate), ``decode_attention_triton`` (split-KV decode
attention), ``sam_attention_triton`` (SAM attention with the rel-pos bias in the kernel),
``decode_step_triton`` / ``decode_step`` (the fused batch-1 decode step: its kernels and driver),
``moe_blocks`` (rows sorted and padded per expert, tile sizes); ``availability`` says where they
run. Nothing here imports ``harness.models``: the variants (``harness.variants``) bind these
kernels into the model.
"""
