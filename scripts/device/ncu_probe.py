"""Probe on the GPU node: which ncu NVTX include expressions select a push/pop range in the
`harness` domain, and how many FLOPs one unit of the bf16 tensor-path counter stands for.

Runs a bf16 GEMM (M=N=K=2048) inside ranges request > sam, and one outside any range.
"""
import sys

import nvtx
import torch

d = nvtx.get_domain("harness")
a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
b = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
(a @ b).sum()                     # outside: must not be profiled
d.push_range(d.get_event_attributes(message="request"))
d.push_range(d.get_event_attributes(message="sam"))
c = a @ b                         # the GEMM: 2 * 2048^3 FLOPs
d.pop_range()
d.push_range(d.get_event_attributes(message="decode"))
c = c.float().relu()              # elementwise inside decode
d.pop_range()
d.pop_range()
torch.cuda.synchronize()
print("gemm flops", 2 * 2048 ** 3, file=sys.stderr)
