"""Triton kernels of the execution variants, and their shared helpers (``common``).

``fast_moe_triton`` (routed experts), ``gemv_triton`` (decode-size linears, q/k/v + RoPE),
``skinny_gemm_triton`` (batched-decode linears on the tensor cores), ``router_triton`` (the MoE
gate's logits, softmax and top-k), ``decode_attention_triton`` (split-KV decode attention),
``sam_attention_triton`` (SAM attention with the rel-pos bias in the kernel),
``decode_step_triton`` / ``decode_step`` (the fused batch-1 decode step: its kernels and driver),
``moe_blocks`` (rows sorted and padded per expert, tile sizes); ``availability`` says where they
run. Nothing here imports ``harness.models``: the variants (``harness.variants``) bind these
kernels into the model.
"""
