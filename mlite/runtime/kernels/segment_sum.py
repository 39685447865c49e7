"""Sums of consecutive runs of rows: [sum(lengths), H] -> [len(lengths), H], an empty run giving 0. Rows
past the last run (a buffer sized for the most rows there could be) are left out, and get no gradient.

The all-gather expert exchange (mlite.runtime.parallel.expert) sums each gathered token's local (token,
expert) pairs with it, forward and backward. Each run is added in order in fp32 (or the rows' wider
dtype) and stored in the rows' dtype, so the result is the same every run (unlike a scatter-add's
atomics).

- CUDA (Triton): one program per (run, column block) reads its rows once in their own dtype and writes
  the sum once. torch.segment_reduce, the path elsewhere, needs the rows cast to fp32 first and its result
  cast back: about five passes over the data for one (the segment sums took 8.0 ms of rank 0's ep4 step
  on 4 x H200: docs/PERFORMANCE.md).
- The gradient of a run's sum is its gradient repeated over the run's rows (a gather, no host read).

An opaque op (torch.library.custom_op), so a compiled block traces through it by its output shape.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: torch.segment_reduce
    triton = None

BLOCK_COLUMNS = 1024


def accumulated(x: torch.Tensor) -> torch.dtype:
    """The dtype sums of x's rows are taken in: fp32 for bf16 and fp16, x's own where it is wider (fp64)."""
    return torch.promote_types(x.dtype, torch.float32)


if triton is not None:

    @triton.jit
    def _segment_sum_kernel(rows_ptr, starts_ptr, out_ptr, columns, BLOCK: tl.constexpr):
        run, block = tl.program_id(0), tl.program_id(1)
        first = tl.load(starts_ptr + run)
        end = tl.load(starts_ptr + run + 1)
        cols = block * BLOCK + tl.arange(0, BLOCK)
        mask = cols < columns
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for row in range(first, end):  # in order: the sum is the same every run
            acc += tl.load(rows_ptr + row * columns + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + run.to(tl.int64) * columns + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _triton_fits(rows: torch.Tensor) -> bool:
    return triton is not None and rows.is_cuda and rows.dtype in (torch.bfloat16, torch.float16,
                                                                   torch.float32)


@torch.library.custom_op("mlite::segment_sum", mutates_args=())
def segment_sum(rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """rows [at least sum(lengths), ...], lengths [S] (int64, on rows' device) -> [S, ...]: each run of rows
    summed in fp32 (or the rows' wider dtype), stored in the rows' dtype; rows past the runs left out."""
    if not _triton_fits(rows):
        # the rows past the runs as one more run, dropped: its length stays on the device
        lengths = torch.cat([lengths, (rows.shape[0] - lengths.sum()).reshape(1)])
        summed = torch.segment_reduce(rows.to(accumulated(rows)), "sum", lengths=lengths, unsafe=True)
        return summed[:-1].to(rows.dtype)
    flat = rows.reshape(rows.shape[0], -1).contiguous()
    out = flat.new_empty(lengths.shape[0], flat.shape[1])
    if out.numel():
        starts = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64, device=rows.device)
        torch.cumsum(lengths, 0, out=starts[1:])
        grid = (lengths.shape[0], triton.cdiv(flat.shape[1], BLOCK_COLUMNS))
        _segment_sum_kernel[grid](flat, starts, out, flat.shape[1], BLOCK=BLOCK_COLUMNS)
    return out.view(lengths.shape[0], *rows.shape[1:])


@segment_sum.register_fake
def _segment_sum_shape(rows, lengths):
    return rows.new_empty(lengths.shape[0], *rows.shape[1:])


def _save_lengths(ctx, inputs, output):
    rows, lengths = inputs
    ctx.save_for_backward(lengths)
    ctx.rows = rows.shape[0]


def _segment_sum_backward(ctx, grad):
    (lengths,) = ctx.saved_tensors
    # the rows past the runs take a zero row's gradient (one more run), with no host read of their number
    lengths = torch.cat([lengths, (ctx.rows - lengths.sum()).reshape(1)])
    grad = torch.cat([grad, grad.new_zeros(1, *grad.shape[1:])])
    return grad.repeat_interleave(lengths, dim=0, output_size=ctx.rows), None


segment_sum.register_autograd(_segment_sum_backward, setup_context=_save_lengths)
