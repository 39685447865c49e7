"""One matmul per expert over rows already grouped by expert.

Expert weights are stacked like nn.Linear weights, [E, out, in], so expert parallel shards dim 0 and the
HF per-expert tensors stack without transposes. torch's grouped matmul runs all experts in one kernel on CUDA
(bf16, 16-byte aligned dims); elsewhere a loop over experts computes the same product.
"""

from __future__ import annotations

import torch

from mlite.runtime.adapters.pytorch import grouped_mm


def grouped_gemm_loop(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [M, in] (counts[e] rows for expert e, in order), w [E, out, in] -> [M, out]."""
    outs = [rows @ w[e].t() for e, rows in enumerate(torch.split(x, counts.tolist()))]
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[1])


def _grouped_mm_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype == w.dtype == torch.bfloat16
        and x.shape[1] % 8 == 0  # 16-byte aligned rows for bf16
        and w.shape[1] % 8 == 0
    )


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [M, in] grouped by expert, w [E, out, in], counts [E] -> [M, out]."""
    if x.is_cuda and torch.is_autocast_enabled("cuda"):
        # autocast (one process, fp32 master weights) does not cover the grouped matmul: cast both operands
        # as it casts a matmul's, or fp32 experts would fall to the loop (a host sync and a graph break
        # per call)
        dtype = torch.get_autocast_dtype("cuda")
        x, w = x.to(dtype), w.to(dtype)
    if _grouped_mm_fits(x, w):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # end row of each expert's group
        return grouped_mm(x, w.transpose(-2, -1), offsets)
    return grouped_gemm_loop(x, w, counts)
