"""Expert parallel: send each routed token to the rank that holds its expert, and bring the result back.

Capacity-free: every (token, expert) pair is computed, however unbalanced the routing; the split sizes of
the all-to-all are exchanged first, so nothing is padded or dropped. Experts are stacked [E, ...]
parameters; ep rank r holds experts [r * E/ep, (r+1) * E/ep).

The contract with the model's MoE block (mlite.runtime.models.moe): an experts function `experts(tokens
[M, H], counts [E_local]) -> [M, H]` computes tokens already grouped by local expert (counts[e] rows for
expert e, in order), and the block's `dispatch` seam takes `expert_parallel_dispatch(group)` in place of
its local one. DeepEP plugs in at the same seam on GPUs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single
from torch.distributed.tensor import DTensor

from mlite.runtime.models.moe import ExpertsFn, RouterStats, combine, group_by_expert


def expert_parallel_dispatch(group: dist.ProcessGroup):
    """The MoE block's `dispatch` under expert parallel over `group` (mlite.runtime.models.moe.DispatchFn)."""

    def dispatch(hidden, expert_ids, weights, experts: ExpertsFn, num_experts: int) -> torch.Tensor:
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
