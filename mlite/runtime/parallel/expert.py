"""Expert parallel: bring each routed token to the rank that holds its expert, and the result back.

Capacity-free: every (token, expert) pair is computed, however unbalanced the routing; nothing is padded
or dropped. Experts are stacked [E, ...] parameters; ep rank r holds experts [r * E/ep, (r+1) * E/ep).
Two exchanges (`mlite.plan.policy.expert_exchange` picks by ep and top_k, so the planner sizes the same one):
- `all_gather`: every rank gathers every token of the ep group (fixed sizes), runs its experts' pairs,
  sums each token's local pairs weighted, and the partial sums go home by an all-to-all of fixed splits,
  added in fp32 there. Its pair buffers hold this rank's pair count, read on the host once a layer, or
  (`bounded`, parallel.expert_buffers worst_case) the most pairs the rank can be sent, so nothing is read
  on the host: the rows past the real pairs are padding that no GEMM runs and no sum reads. With nothing
  read on the host, the bounded exchange's collectives are traceable ones, so a compiled block
  keeps the whole exchange in its graph;
- `all_to_all`: one row per routed (token, expert) pair, sent to the expert's rank and back; the split
  sizes are exchanged first.

The contract with the model's MoE block (mlite.runtime.models.moe): an experts function `experts(tokens
[M, H], counts [E_local]) -> [M, H]` computes tokens already grouped by local expert (counts[e] rows for
expert e, in order), and the block's `dispatch` seam takes `expert_parallel_dispatch(group, exchange)` in
place of its local one. DeepEP plugs in at the same seam on GPUs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single
from torch.distributed.tensor import DTensor

from mlite.plan.policy import expert_pair_rows
from mlite.runtime.adapters.pytorch import all_to_all_equal
from mlite.runtime.kernels.segment_sum import segment_sum
from mlite.runtime.models.moe import (
    ExpertsFn,
    RouterStats,
    accumulated,
    combine,
    expert_counts,
    gather_rows,
    group_by_expert,
    inverse_permutation,
)


def expert_parallel_dispatch(group: dist.ProcessGroup, exchange: str, bounded: bool = False):
    """The MoE block's `dispatch` under expert parallel over `group` (mlite.runtime.models.moe.DispatchFn),
    by `exchange` (`all_gather` or `all_to_all`, from mlite.plan.policy.expert_exchange); `bounded`: the
    all-gather's pair buffers sized for the most pairs (module docstring)."""
    if exchange not in ("all_gather", "all_to_all"):
        raise ValueError(f"expert exchange {exchange!r}: all_gather or all_to_all")
    if bounded and exchange != "all_gather":
        raise ValueError("bounded pair buffers are the all_gather exchange's")

    def dispatch(hidden, expert_ids, weights, experts: ExpertsFn, num_experts: int) -> torch.Tensor:
        if exchange == "all_gather":
            return _gathered(hidden, expert_ids, weights, experts, num_experts, group, bounded)
        order, routed, counts = group_by_expert(hidden, expert_ids, num_experts)
        out = _across_ranks(routed, counts, experts, num_experts, dist.get_world_size(group), group)
        return combine(out, order, weights)

    return dispatch


def token_group_stats(group: dist.ProcessGroup):
    """The MoE block's `reduce_stats` when one micro-batch's tokens are spread over `group` (cp x tp): the
    sums of every rank, the probability sums differentiably (each rank back-propagates its share)."""
    from torch.distributed.nn.functional import all_reduce

    def reduce_stats(stats: RouterStats) -> RouterStats:
        counts, rows = stats.counts.clone(), stats.rows.clone()
        dist.all_reduce(counts, group=group)
        dist.all_reduce(rows, group=group)
        return RouterStats(counts, all_reduce(stats.prob_sum, group=group), rows, dist.get_world_size(group))

    return reduce_stats


def local_slice(weight: torch.Tensor) -> torch.Tensor:
    """The experts' seam under expert parallel (`Experts.set_local_view`): this rank's slice of a stacked
    weight that is a DTensor of the global shape. The grouped GEMM knows nothing of DTensor, and to_local
    keeps the autograd link to the sharded parameter."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def _across_ranks(routed, counts, experts, num_experts, ep, group):
    local = num_experts // ep
    # how many rows each source rank sends to each of my local experts: [ep (source), local]
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    recv_counts = recv_counts.view(ep, local)
    # the all-to-all takes its split sizes as host numbers: the one read back from the device per exchange
    send_splits, recv_splits = torch.stack([counts.view(ep, local).sum(1), recv_counts.sum(1)]).tolist()

    received = all_to_all_single(
        routed.new_empty(sum(recv_splits), routed.shape[1]), routed, recv_splits, send_splits, group=group
    )
    # received rows are ordered (source rank, local expert); the experts want (local expert, source rank)
    by_expert = _block_permutation(recv_counts, sum(recv_splits))
    out = experts(received[by_expert], recv_counts.sum(0))
    back = torch.empty_like(out)
    back[by_expert] = out
    return all_to_all_single(
        routed.new_empty(sum(send_splits), routed.shape[1]), back, send_splits, recv_splits, group=group
    )


def _block_permutation(counts: torch.Tensor, total: int) -> torch.Tensor:
    """Row order that turns blocks laid out [a][b] (sizes counts[a, b], `total` rows) into the layout
    [b][a], each block's rows kept in order. Computed on the device: each row's block (i, j), then a stable
    sort by (j, i); reading every block's bounds to the host instead cost a sync per block."""
    a, b = counts.shape
    block = torch.repeat_interleave(torch.arange(a * b, device=counts.device), counts.reshape(-1),
                                    output_size=total)
    return torch.argsort((block % b) * a + block // b, stable=True)


def _gathered(hidden, expert_ids, weights, experts, num_experts, group, bounded=False) -> torch.Tensor:
    """The `all_gather` exchange: [N, H] -> [N, H], every rank's tokens seen by every rank of `group`. Every
    rank holds the same N: the step pads the micro-batches to one length (mlite.plan.policy.
    equal_micro_batch_lengths), so the gathers' blocks are equal without a read of the group's longest.
    `bounded`: the pair buffers hold expert_pair_rows rows, the real pairs first (module docstring)."""
    ep, me, k = dist.get_world_size(group), dist.get_rank(group), expert_ids.shape[1]
    local = num_experts // ep
    # the routing of every token of the group: weights (differentiable) and expert ids, exact in fp32
    wide = accumulated(weights)
    routing = torch.cat([weights.to(wide), expert_ids.to(wide)], 1)
    routing = _gather_rows(routing, group, traceable=bounded)  # [ep*N, 2k]
    gathered_weights, gathered_ids = routing[:, :k], routing[:, k:].long()
    mine = gathered_ids // local == me  # [ep*N, k]: which pairs run here
    if bounded:
        rows = expert_pair_rows(ep, hidden.shape[0], k, local)
        tokens = _gather_rows(hidden, group, traceable=True)  # tokens: [ep*N, H]
    else:
        rows, tokens = _count_then_gather_rows(mine.sum(), hidden, group)
    # this rank's pairs in (token, choice) order, then grouped by local expert for the grouped GEMM
    position = torch.argsort((~mine).reshape(-1).to(torch.int8), stable=True)[:rows]
    expert = gathered_ids.reshape(-1)[position] - me * local
    if bounded:  # the rows past the real pairs: an expert past the last, so they sort after every group
        real = torch.arange(rows, device=expert.device) < mine.sum()
        expert = torch.where(real, expert, local)
    order = torch.argsort(expert, stable=True)
    by_token = inverse_permutation(order)
    fan = mine.sum(1)  # pairs of each gathered token that run here (0 to k)
    routed = _GatherRepeated.apply(tokens, (position // k)[order], by_token, fan)
    out = experts(routed, expert_counts(expert, local + 1)[:local])
    pair_weights = gathered_weights.reshape(-1)[position].to(out.dtype).unsqueeze(-1)  # [rows, 1]
    by_pair = gather_rows(out, by_token, order)
    if bounded:  # the padding's output rows are unspecified (unwritten, maybe not finite): zero them
        by_pair = torch.where(real.unsqueeze(-1), by_pair, 0)
    # each gathered token's local pairs, weighted and summed here: one row a token goes home, not k (the
    # sums read the real pairs only, which come first)
    partial = segment_sum(by_pair * pair_weights, fan)
    return _sum_home(partial, group, traceable=bounded)


class _GatherRepeated(torch.autograd.Function):
    """x[index] where row i of x is copied `lengths[i]` times (0 or more), and `inverse` lists the result's
    positions row by row (x's row 0's copies first). The gradient: the result's gradient in `inverse` order,
    each row's run summed in fp32 (`segment_sum`), deterministic, with no [rows x max copies] buffer."""

    @staticmethod
    def forward(x, index, inverse, lengths):
        return x[index]

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[2], inputs[3])

    @staticmethod
    def backward(ctx, grad):
        inverse, lengths = ctx.saved_tensors
        return segment_sum(grad[inverse], lengths), None, None, None


class _AllGatherRows(torch.autograd.Function):
    """[N, ...] -> [ep*N, ...], rank r's rows at block r. The gradient: each block back to its rank by an
    all-to-all of fixed splits, the ep contributions added in fp32 (a ring reduce-scatter would add bf16
    partial sums ep - 1 times)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_blocks(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _sum_blocks(grad, ctx.group), None


class _SumHome(torch.autograd.Function):
    """[ep*N, ...] -> [N, ...]: block r of every rank's rows goes to rank r, which adds the ep blocks in
    fp32. The gradient is the all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _sum_blocks(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_blocks(grad, ctx.group), None


def _gather_blocks(x, group):
    out = x.new_empty(dist.get_world_size(group) * x.shape[0], *x.shape[1:])
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _sum_blocks(x, group):
    ep = dist.get_world_size(group)
    received = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(received, x.contiguous(), group=group)
    return received.view(ep, -1, *x.shape[1:]).sum(0, dtype=accumulated(x)).to(x.dtype)


def _gather_rows(x, group, traceable=False):
    """[N, ...] -> [ep*N, ...], rank r's rows at block r; the gradient comes home summed in fp32."""
    if not traceable:
        return _eager_gather_rows(x, group)
    # an all-to-all of ep copies is the all-gather whose backward (the reverse all-to-all, then the copies'
    # sum) adds the ep gradients in fp32 with one rounding, as _AllGatherRows does
    ep = dist.get_world_size(group)
    copies = x.unsqueeze(0).expand(ep, *x.shape).reshape(ep * x.shape[0], *x.shape[1:])
    return all_to_all_equal(copies, group)


def _sum_home(x, group, traceable=False):
    """[ep*N, ...] -> [N, ...]: block r of every rank's rows added in fp32 on rank r; the gradient is the
    all-gather."""
    if not traceable:
        return _eager_sum_home(x, group)
    ep = dist.get_world_size(group)
    received = all_to_all_equal(x.contiguous(), group)
    return received.view(ep, -1, *x.shape[1:]).sum(0, dtype=accumulated(x)).to(x.dtype)


# The eager collectives break a compiled block's graph: c10d calls in an autograd.Function are not traced.
@torch.compiler.disable
def _eager_gather_rows(x, group):
    return _AllGatherRows.apply(x, group)


@torch.compiler.disable
def _count_then_gather_rows(count, x, group):
    """(int(count), _gather_rows(x)): the exchange's host read, this rank's pair count (the grouped GEMM's
    row count), waits for the router and the small routing gather only; the tokens' gather is the first
    thing queued after it. A blocking read: the copy queued ahead of the tokens' gather and read after an
    event stepped no faster on 4 x H200 (docs/PERFORMANCE.md, "What the defaults rest on"). (Its first form
    gave counts larger than the routing's: it asked the host copy, not the device tensor, whether to wait.)"""
    pairs = int(count)
    return pairs, _AllGatherRows.apply(x, group)


@torch.compiler.disable
def _eager_sum_home(x, group):
    return _SumHome.apply(x, group)
