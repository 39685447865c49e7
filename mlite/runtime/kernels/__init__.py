"""Pluggable kernels: the fast path and the pure-torch path sit one function apart.

- `attention`: causal attention over a packed token stream that never crosses a sequence boundary, by
  backend name (`torch`, `sdpa`, `varlen`, `cudnn`, `packed`, `flash_attn`, `te`) or `auto`;
  `cached_attention` for decoding.
- `grouped_gemm`: one matmul per expert over rows grouped by expert (torch's grouped matmul or a loop).
- `lm_head`: log p(label) through the LM head without [T, vocab] fp32 logits; the runtime's loss path
  (mlite.runtime.loss.token_logprobs) takes it for a plain linear head.
- `segment_sum`: sums of consecutive runs of rows in fp32, in order (a Triton kernel on CUDA,
  `torch.segment_reduce` elsewhere); the all-gather expert exchange's per-token sums.
"""

from mlite.runtime.kernels.attention import (
    ATTENTION_BACKENDS,
    available_attention_backends,
    cached_attention,
    resolve_attention_backend,
    varlen_attention,
)
from mlite.runtime.kernels.grouped_gemm import grouped_gemm, grouped_gemm_loop

__all__ = [
    "ATTENTION_BACKENDS",
    "available_attention_backends",
    "cached_attention",
    "grouped_gemm",
    "grouped_gemm_loop",
    "resolve_attention_backend",
    "varlen_attention",
]
