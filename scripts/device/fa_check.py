"""flash-attn's kernels against torch SDPA (bf16, head dim 128, 10 heads as the vendor's LLM): a causal
prefill of 300 tokens and a one-token decode over 300 cached positions, through flash_attn_func and
flash_attn_varlen_func (the path transformers takes with an attention mask); max |difference|."""
import torch
import torch.nn.functional as F
from flash_attn import flash_attn_func, flash_attn_varlen_func

torch.manual_seed(0)
dev, dt, H, D, S = "cuda", torch.bfloat16, 10, 128, 300
q, k, v = (torch.randn(1, S, H, D, device=dev, dtype=dt) for _ in range(3))
ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)
cu = torch.tensor([0, S], device=dev, dtype=torch.int32)
print("prefill 300 causal  max|diff| func %.5f varlen %.5f" % (
    (flash_attn_func(q, k, v, causal=True) - ref).abs().max(),
    (flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, S, S, causal=True) - ref[0]).abs().max()))
q1 = torch.randn(1, 1, H, D, device=dev, dtype=dt)
ref1 = F.scaled_dot_product_attention(q1.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
cq = torch.tensor([0, 1], device=dev, dtype=torch.int32)
print("decode 1 over 300   max|diff| func %.5f varlen %.5f" % (
    (flash_attn_func(q1, k, v, causal=True) - ref1).abs().max(),
    (flash_attn_varlen_func(q1[0], k[0], v[0], cq, cu, 1, S, causal=True) - ref1[0]).abs().max()))
try:
    flash_attn_func(q.half(), k.half(), v.half())
    print("fp16: ran (unexpected)")
except RuntimeError as exc:
    print("fp16 refused:", str(exc).splitlines()[0])
