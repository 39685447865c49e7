"""Can the cuDNN attention kernel live inside a torch.compile graph? (graph breaks cost host time per
layer)"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mlite.bench import time_steps


def attn(q, k, v):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


q, k, v = (torch.randn(1, 16, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
explain = torch._dynamo.explain(attn)(q, k, v)
print("graph breaks:", explain.graph_break_count, [b.reason for b in explain.break_reasons][:2])
compiled = torch.compile(attn)
for name, fn in (("eager", attn), ("compiled", compiled)):
    def step():
        out = fn(q, k, v)
        out.backward(torch.ones_like(out))
    t = time_steps(step, 3, 10, "cuda")
    print(f"{name:9s} {t.median_ms:.3f} ms")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    compiled(q, k, v).sum().backward()
print([e.key[:60] for e in prof.key_averages() if "cudnn" in e.key.lower() or "flash" in e.key.lower()][:4])
