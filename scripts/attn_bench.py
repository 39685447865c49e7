"""Time the packed causal attention backends fwd+bwd on one GPU (bf16): which one should `auto` pick?"""

from __future__ import annotations

import torch

from mlite.bench import mixed_lengths, time_steps
from mlite.runtime.kernels.attention import ATTENTION_BACKENDS, available_attention_backends

heads, kv, d = 16, 8, 128
for name, lens in (("full-4k", [4096]), ("mixed-4k", mixed_lengths(4096, seed=0, shortest=256)),
                   ("full-16k", [16384])):
    T = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(T, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(T, kv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(T, kv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    flops = 4 * heads * d * sum(n * n for n in lens) / 2 * 3.5  # fwd 2 matmuls causal, bwd 2.5x
    for backend in available_attention_backends("cuda"):
        if backend == "torch" and T > 4096:
            continue
        fn = ATTENTION_BACKENDS[backend]

        def step():
            out = fn(q, k, v, cu, max(lens), d**-0.5)
            out.backward(torch.ones_like(out))

        t = time_steps(step, 3, 10, "cuda")
        print(f"{name:9s} {backend:10s} {t.median_ms:8.3f} ms {flops / t.median_ms / 1e9:7.1f} TFLOP/s")
