"""One matmul per expert over rows already grouped by expert.

Expert weights are stacked like nn.Linear weights, [E, out, in], so expert parallel shards dim 0 and the
HF per-expert tensors stack without transposes. torch's grouped matmul runs all experts in one kernel on
CUDA (bf16, 16-byte aligned dims); elsewhere a loop over experts computes the same product. Rows past
sum(counts) are padding (a buffer sized for the most rows there could be, mlite.runtime.parallel.expert):
no GEMM reads them, and their output rows are unspecified (torch's grouped matmul leaves them unwritten;
they get no gradient either).

FP8 (`fp8="rowwise"`, precision.fp8): torchao's rowwise FP8 grouped GEMM on CUDA, each expert's rows padded to
a multiple of 16 (the kernel's group alignment) and unpadded after; where it cannot run (not CUDA, widths
not multiples of 16) the bf16 product. `fp8="emulate"` (the test switch of mlite.runtime.adapters.torchao):
the same rounding in plain torch on any device, forward and backward.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from mlite.runtime.adapters.pytorch import grouped_mm
from mlite.runtime.adapters.torchao import emulating, scaled_grouped_mm_rowwise

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
FP8_GROUP_ROWS = 16  # the FP8 grouped GEMM's alignment of each group's rows


def grouped_gemm_loop(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [M, in] (counts[e] rows for expert e, in order, then padding), w [E, out, in] -> [M, out]."""
    sizes = counts.tolist()
    groups = torch.split(x, [*sizes, x.shape[0] - sum(sizes)])
    outs = [rows @ w[e].t() for e, rows in enumerate(groups[:-1])]
    # the padding rows in the products' dtype (bf16 under autocast, where x may be fp32)
    return torch.cat([*outs, outs[0].new_zeros(groups[-1].shape[0], w.shape[1])])


def _grouped_mm_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype == w.dtype == torch.bfloat16
        and x.shape[1] % 8 == 0  # 16-byte aligned rows for bf16
        and w.shape[1] % 8 == 0
    )


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor,
                 fp8: str | None = None) -> torch.Tensor:
    """x [M, in] grouped by expert, w [E, out, in], counts [E] -> [M, out]. `fp8`: None (the compute
    dtype), "rowwise" or "emulate" (module docstring)."""
    if x.is_cuda and torch.is_autocast_enabled("cuda"):
        # autocast (one process, fp32 master weights) does not cover the grouped matmul: cast both operands
        # as it casts a matmul's, or fp32 experts would fall to the loop (a host sync and a graph break
        # per call)
        dtype = torch.get_autocast_dtype("cuda")
        x, w = x.to(dtype), w.to(dtype)
    if fp8 == "emulate":
        return _EmulatedFp8GroupedGemm.apply(x, w, counts)
    if fp8 == "rowwise" and _fp8_grouped_mm_fits(x, w):
        return grouped_gemm_fp8(x, w, counts)
    if _grouped_mm_fits(x, w):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # end row of each expert's group
        return grouped_mm(x, w.transpose(-2, -1), offsets)
    return grouped_gemm_loop(x, w, counts)


# --------------------------------------------------------------------------------------------------- FP8
def _fp8_grouped_mm_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    high = (torch.bfloat16, torch.float32)  # torchao quantises either
    return x.is_cuda and x.dtype in high and w.dtype in high and x.shape[1] % 16 == 0 and w.shape[1] % 16 == 0


def grouped_gemm_fp8(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """torchao's rowwise FP8 grouped GEMM over groups padded to 16 rows. The padded buffer's size is known
    from the shapes (M + 15 E rows, rounded to 16), so nothing waits on the counts (no host sync). x's
    padding rows (past sum(counts)) land after the last group, which no GEMM reads."""
    experts, m = counts.shape[0], x.shape[0]
    counts = torch.cat([counts, (m - counts.sum()).reshape(1)]).long()  # x's padding: a last group, not run
    padded = (counts + FP8_GROUP_ROWS - 1) // FP8_GROUP_ROWS * FP8_GROUP_ROWS
    starts, padded_ends = torch.cumsum(counts, 0) - counts, torch.cumsum(padded, 0)
    group = torch.repeat_interleave(torch.arange(experts + 1, device=x.device), counts, output_size=m)
    rows = torch.arange(m, device=x.device) - starts[group] + (padded_ends - padded)[group]
    padded_ends = padded_ends[:-1]
    capacity = -(-(m + (FP8_GROUP_ROWS - 1) * experts) // FP8_GROUP_ROWS) * FP8_GROUP_ROWS
    a = x.new_zeros(capacity, x.shape[1]).index_copy(0, rows, x)
    # bf16 out: what the FP8 grouped kernel writes (the runtime's FP8 compute dtype)
    out = scaled_grouped_mm_rowwise(a, w.transpose(-2, -1), padded_ends.to(torch.int32), torch.bfloat16)
    return out[rows].to(x.dtype)


def fp8_round(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t rounded to float8 e4m3 with one power-of-two scale per slice along `dim` (its amax to near 448, as
    torchao's rowwise recipe scales), back in fp32: quantise then dequantise."""
    t = t.float()
    amax = t.abs().amax(dim=dim, keepdim=True).clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(FP8_MAX / amax)))
    return (t * scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() / scale


class _EmulatedFp8GroupedGemm(torch.autograd.Function):
    """The rounding of torchao's rowwise FP8 grouped GEMM in plain torch (the test switch; any device):
    forward rows of x and of each expert's weight along `in`; grad_x: rows of the gradient along `out`
    times the weight scaled along `out`; grad_w: both operands scaled along each expert's tokens."""

    @staticmethod
    def forward(ctx, x, w, counts):
        ctx.save_for_backward(x, w)
        sizes = counts.tolist()
        ctx.sizes = [*sizes, x.shape[0] - sum(sizes)]  # the last: padding rows, not run
        groups = x.split(ctx.sizes)[:-1]
        outs = [fp8_round(rows, -1) @ fp8_round(w[e], -1).t() for e, rows in enumerate(groups)]
        return torch.cat([*outs, x.new_zeros(ctx.sizes[-1], w.shape[1])]).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad_x, grad_w = [], torch.zeros_like(w, dtype=torch.float32)
        for e, (g, rows) in enumerate(zip(grad.split(ctx.sizes)[:-1], x.split(ctx.sizes)[:-1])):
            grad_x.append(fp8_round(g, -1) @ fp8_round(w[e], 0))
            if rows.shape[0]:  # an expert without tokens gets no gradient
                grad_w[e] = fp8_round(g, 0).t() @ fp8_round(rows, 0)
        grad_x.append(x.new_zeros(ctx.sizes[-1], x.shape[1]))
        return torch.cat(grad_x).to(x.dtype), grad_w.to(w.dtype), None


def use_fp8_experts(model: nn.Module) -> None:
    """Every routed-experts module of `model` (its `set_gemms` seam, mlite.runtime.models.moe.Experts) runs
    both grouped GEMMs in FP8 (precision.fp8): rowwise, or its emulation under the adapter's test switch."""
    gemm = partial(grouped_gemm, fp8="emulate" if emulating() else "rowwise")
    for module in model.modules():
        if hasattr(module, "set_gemms"):
            module.set_gemms(gemm, gemm)
