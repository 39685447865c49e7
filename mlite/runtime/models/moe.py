"""The mixture-of-experts block shared by the MoE families: a top-k softmax router in fp32, experts stored
as stacked [E, ...] parameters (expert parallel shards dim 0; the grouped GEMM needs no copies), tokens sent
to their experts by `moe_dispatch_combine` (local for ep = 1, all-to-all otherwise), and the statistics for
the load-balancing loss.

The load-balancing loss follows transformers' `load_balancing_loss_func` exactly, so the numbers match
HF's `aux_loss`: the router choices of all MoE layers are pooled before the product,
E * sum_e (tokens routed to e / pooled rows) * (mean router probability of e over pooled rows). A layer
therefore records its sums (`router_stats`) and the model combines them after the last layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from mlite.runtime.kernels import grouped_gemm
from mlite.runtime.parallel.expert import moe_dispatch_combine


@dataclass
class RouterStats:
    counts: torch.Tensor  # [E] (token, choice) pairs routed to each expert
    prob_sum: torch.Tensor  # [E] router probabilities summed over tokens (carries the gradient)
    rows: torch.Tensor  # scalar: tokens seen
    shards: int = 1  # ranks the statistics were summed over (cp x tp); each holds the same loss


class Experts(nn.Module):
    """E SwiGLU experts: gate and up fused as [E, 2*ffn, hidden], down as [E, hidden, ffn] (nn.Linear layout)."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, act):
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * ffn, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.act = act

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """tokens [M, hidden] grouped by local expert, counts[e] rows each -> [M, hidden]."""
        gate, up = grouped_gemm(tokens, self.gate_up, counts).chunk(2, dim=-1)  # [M, ffn] each
        return grouped_gemm(self.act(gate) * up, self.down, counts)


class MoE(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, expert_ffn: int, norm_topk_prob: bool, act):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, expert_ffn, act)
        self.ep_group: dist.ProcessGroup | None = None  # expert parallel sets these
        self.token_group: dist.ProcessGroup | None = None  # ranks sharing one micro-batch's tokens (cp x tp)
        self.router_stats: RouterStats | None = None  # of the last forward

    @property
    def first_expert(self) -> int:
        """Global index of the first expert in the stacked tensors. Expert parallel makes them DTensors of
        the global shape (checkpoints and exports see every expert, gathered), so only a plain local slice
        starts past 0."""
        if self.ep_group is None or isinstance(self.experts.down, DTensor):
            return 0
        return dist.get_rank(self.ep_group) * self.experts.down.shape[0]

    def forward(self, x: torch.Tensor, batch=None) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]. `batch` is unused here; hash-routed families read token ids from it."""
        logits = F.linear(
            x.float(), self.router.weight.float()
        )  # [N, E] in fp32: routing is precision-sensitive
        probs = logits.softmax(dim=-1)
        weights, expert_ids = probs.topk(self.top_k, dim=-1)  # [N, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = moe_dispatch_combine(
            x, expert_ids, weights.to(x.dtype), self.experts, self.num_experts, self.ep_group
        )
        self.router_stats = router_stats(probs, expert_ids, self.num_experts, self.token_group)
        return out


def router_stats(probs, expert_ids, num_experts, token_group=None) -> RouterStats:
    """Sums over this rank's tokens, and over `token_group` when one micro-batch is spread across ranks."""
    from torch.distributed.nn.functional import all_reduce

    counts = torch.bincount(expert_ids.reshape(-1), minlength=num_experts).to(probs.dtype)
    prob_sum = probs.sum(0)
    rows = torch.tensor(float(probs.shape[0]), dtype=probs.dtype, device=probs.device)
    shards = 1
    if token_group is not None and dist.get_world_size(token_group) > 1:
        dist.all_reduce(counts, group=token_group)
        dist.all_reduce(rows, group=token_group)
        prob_sum = all_reduce(prob_sum, group=token_group)
        shards = dist.get_world_size(token_group)
    return RouterStats(counts, prob_sum, rows, shards)


def load_balancing_loss(stats: list[RouterStats], num_experts: int, coef: float) -> torch.Tensor:
    """coef x transformers' aux loss over the pooled router choices of `stats` (one entry per MoE layer).

    Under cp x tp every rank of the token group returns the same value divided by the group size, so the
    gradients summed over the group equal the single-process gradient."""
    counts = torch.stack([s.counts for s in stats]).sum(0)
    prob_sum = torch.stack([s.prob_sum for s in stats]).sum(0)
    rows = torch.stack([s.rows for s in stats]).sum()
    return coef * num_experts * ((counts / rows) * (prob_sum / rows)).sum() / stats[0].shards
