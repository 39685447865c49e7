"""Expert parallel: send each routed token to the rank that holds its expert, and bring the result back.

Capacity-free: every (token, expert) pair is computed, however unbalanced the routing; the split sizes of
the all-to-all are exchanged first, so nothing is padded or dropped. Experts are stacked [E, ...]
parameters; ep rank r holds experts [r * E/ep, (r+1) * E/ep).

The contract with the model's MoE block: an experts function `experts(tokens [M, H], counts [E_local])
-> [M, H]` computes tokens already grouped by local expert (counts[e] rows for expert e, in order).
`moe_dispatch_combine` wraps it for any ep degree (ep = 1 is the plain local path), so the model calls one
function either way. DeepEP plugs in at the same place on GPUs (`deep_ep` importable + NCCL group).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single

ExpertsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def moe_dispatch_combine(
    hidden: torch.Tensor,  # [N, H] this rank's tokens
    expert_ids: torch.Tensor,  # [N, k] global expert index of each choice
    weights: torch.Tensor,  # [N, k] routing weight of each choice
    experts: ExpertsFn,
    num_experts: int,
    ep_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """sum_j weights[n, j] * expert_{ids[n, j]}(hidden[n]) for every token n -> [N, H]."""
    n, k = expert_ids.shape
    flat_ids = expert_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # group the (token, choice) pairs by expert
    routed = hidden[order // k]  # [N*k, H]
    counts = torch.bincount(flat_ids, minlength=num_experts)  # [E]

    ep = dist.get_world_size(ep_group) if ep_group is not None else 1
    if ep == 1:
        out = experts(routed, counts)
    else:
        out = _across_ranks(routed, counts, experts, num_experts, ep, ep_group)

    combined = torch.empty_like(out)
    combined[order] = out  # back to (token, choice) order
    return (combined.view(n, k, -1) * weights.unsqueeze(-1).to(combined.dtype)).sum(1)


def _across_ranks(routed, counts, experts, num_experts, ep, group):
    local = num_experts // ep
    # how many rows each source rank sends to each of my local experts: [ep (source), local]
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    recv_counts = recv_counts.view(ep, local)
    send_splits = counts.view(ep, local).sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()

    received = all_to_all_single(
        routed.new_empty(sum(recv_splits), routed.shape[1]), routed, recv_splits, send_splits, group=group
    )
    # received rows are ordered (source rank, local expert); the experts want (local expert, source rank)
    by_expert = _block_permutation(recv_counts)
    out = experts(received[by_expert], recv_counts.sum(0))
    back = torch.empty_like(out)
    back[by_expert] = out
    return all_to_all_single(
        routed.new_empty(sum(send_splits), routed.shape[1]), back, send_splits, recv_splits, group=group
    )


def _block_permutation(counts: torch.Tensor) -> torch.Tensor:
    """Row order that turns blocks laid out [a][b] (sizes counts[a, b]) into the layout [b][a]."""
    a, b = counts.shape
    starts = torch.cumsum(counts.reshape(-1), 0) - counts.reshape(-1)
    starts = starts.view(a, b)
    pieces = [
        torch.arange(int(starts[i, j]), int(starts[i, j] + counts[i, j]), device=counts.device)
        for j in range(b)
        for i in range(a)
    ]
    return torch.cat(pieces) if pieces else counts.new_zeros(0)
