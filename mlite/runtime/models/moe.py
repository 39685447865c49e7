"""The mixture-of-experts block shared by the MoE families: a top-k softmax router in fp32, experts stored
as stacked [E, ...] parameters (expert parallel shards dim 0; the grouped GEMM needs no copies), and the
statistics for the load-balancing loss.

Parallel seams (the model imports no parallel code; mlite.runtime.parallel.parallelize sets them through
`MoE.set_parallel`): `dispatch` routes (token, expert) pairs to the experts and back (`local_dispatch`
here; expert parallel sends them across ranks), and `reduce_stats` sums the router statistics over the
ranks that share one micro-batch's tokens (cp x tp).

The load-balancing loss follows transformers' `load_balancing_loss_func` exactly, so the numbers match
HF's `aux_loss`: the router choices of all MoE layers are pooled before the product,
E * sum_e (tokens routed to e / pooled rows) * (mean router probability of e over pooled rows). A layer
therefore returns its sums (`RouterStats`) with its output and the model combines them after the last layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mlite.runtime.data.packed import PADDING
from mlite.runtime.kernels import grouped_gemm
from mlite.runtime.kernels.segment_sum import accumulated


@dataclass
class RouterStats:
    counts: torch.Tensor  # [E] (token, choice) pairs routed to each expert
    prob_sum: torch.Tensor  # [E] router probabilities summed over tokens (carries the gradient)
    rows: torch.Tensor  # scalar: tokens seen
    shards: int = 1  # ranks the statistics were summed over (cp x tp); each holds the same loss


# returned through FSDP2-wrapped modules: registered so FSDP finds prob_sum (which carries the router's
# gradient) when it hooks a module's outputs for backward, as for ModelOutput
torch.export.register_dataclass(RouterStats)

# experts(tokens [M, H] grouped by local expert, counts [E_local]) -> [M, H]
ExpertsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# dispatch(hidden [N, H], expert_ids [N, k], weights [N, k], experts, num_experts) -> [N, H]
DispatchFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ExpertsFn, int], torch.Tensor]


def expert_counts(ids: torch.Tensor, num_experts: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """[E]: how many of `ids` (flat) name each expert, or the sum of their `weights`. A scatter-add into a
    tensor whose size is known before it runs: bincount's size depends on the data, which costs a host
    sync on CUDA and a graph break under torch.compile (the dispatch would leave the block's graph)."""
    ones = torch.ones_like(ids) if weights is None else weights
    return torch.zeros(num_experts, dtype=ones.dtype, device=ids.device).scatter_add_(0, ids, ones)


class _GatherRows(torch.autograd.Function):
    """x[index] where `index` names every row of x exactly `fan` times (a permutation when fan is 1), and
    `inverse` lists, for each of x's rows in turn, the `fan` positions of the result that copy it. The
    gradient is then a gather too: the result's gradient taken in `inverse` order, its `fan` copies summed
    in fp32. Autograd's own gradient of x[index] is a scatter-add (index_put with accumulate): atomics on
    GPUs, so the sums' order, and their bf16 rounding, changed from run to run. As fast (H100 profile),
    and the MoE backward is deterministic."""

    @staticmethod
    def forward(x, index, inverse, fan):
        return x[index]

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[2])
        ctx.fan = inputs[3]

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        rows = grad[inverse]
        if ctx.fan > 1:
            rows = rows.view(-1, ctx.fan, grad.shape[-1]).sum(1, dtype=accumulated(grad)).to(grad.dtype)
        return rows, None, None, None


def gather_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, fan: int = 1) -> torch.Tensor:
    """x[index], with the deterministic gradient of `_GatherRows` (`inverse`: its contract)."""
    return _GatherRows.apply(x, index, inverse, fan)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """position[order[i]] = i: where each element of a permutation went."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def group_by_expert(hidden: torch.Tensor, expert_ids: torch.Tensor, num_experts: int):
    """(token, choice) pairs sorted by expert: (order, routed rows [N*k, H], counts [E]). Sizes are known
    from the shapes alone (N*k rows): no host sync, and one graph with the router and the experts."""
    k = expert_ids.shape[1]
    flat_ids = expert_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    # token n's k pairs sit at rows inverse_permutation(order)[n*k : n*k + k] of the routed rows
    routed = gather_rows(hidden, order // k, inverse_permutation(order), k)
    return order, routed, expert_counts(flat_ids, num_experts)


def combine(out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Expert outputs in expert order -> sum_j weights[n, j] * out of choice j, for every token n
    -> [N, H]. A gather back to (token, choice) order, fused with the weighted sum (no scatter)."""
    n, k = weights.shape
    by_pair = gather_rows(out, inverse_permutation(order), order)  # [N*k, H], (token, choice) order
    return (by_pair.view(n, k, -1) * weights.unsqueeze(-1).to(by_pair.dtype)).sum(1)


def local_dispatch(hidden, expert_ids, weights, experts: ExpertsFn, num_experts: int) -> torch.Tensor:
    """Every expert on this rank: group the pairs by expert, run the experts, combine."""
    order, routed, counts = group_by_expert(hidden, expert_ids, num_experts)
    return combine(experts(routed, counts), order, weights)


def local_stats(stats: RouterStats) -> RouterStats:
    return stats


def whole(weight: torch.Tensor) -> torch.Tensor:
    return weight


def clamp_gate_up(gate: torch.Tensor, up: torch.Tensor, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's clamp before the SwiGLU product: the gate from above, up on both sides."""
    return gate.clamp(max=limit), up.clamp(min=-limit, max=limit)


def real_rows(block: MoE, batch) -> torch.Tensor | None:
    """[N] bool: which of the block's input rows are the micro-batch's own tokens, None when all are
    (padding that fills a context / sequence parallel split is marked in the batch's extras)."""
    padding = batch.extras.get(PADDING) if batch is not None else None
    return None if padding is None else block.token_rows(padding) == 0


class Experts(nn.Module):
    """E SwiGLU experts: gate and up fused as [E, 2*ffn, hidden], down as [E, hidden, ffn] (nn.Linear
    layout)."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, act, limit: float | None = None):
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * ffn, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.act = act
        self.limit = limit  # DeepSeek-V4 clamps gate (above) and up (both sides) before the product
        self.local_view: Callable[[torch.Tensor], torch.Tensor] = whole
        # the two grouped GEMMs, each (tokens, weights [E, out, in], counts) -> rows
        self.gate_up_gemm: Callable[..., torch.Tensor] = grouped_gemm
        self.down_gemm: Callable[..., torch.Tensor] = grouped_gemm

    def set_gemms(self, gate_up: Callable[..., torch.Tensor], down: Callable[..., torch.Tensor]) -> None:
        """The seam: the grouped GEMMs of the fused gate/up product and of the down product (in FP8 for
        precision.fp8, or rounded as the rollout engine rounds them for rollout.match_fp8)."""
        self.gate_up_gemm, self.down_gemm = gate_up, down

    def set_local_view(self, view: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The seam: how this rank sees its experts' stacked weights (expert parallel: its slice of them)."""
        self.local_view = view

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """tokens [M, hidden] grouped by local expert, counts[e] rows each -> [M, hidden]."""
        gate_up, down = self.local_view(self.gate_up), self.local_view(self.down)
        gate, up = self.gate_up_gemm(tokens, gate_up, counts).chunk(2, dim=-1)  # [M, ffn] each
        if self.limit is not None:
            gate, up = clamp_gate_up(gate, up, self.limit)
        return self.down_gemm(self.act(gate) * up, down, counts)


class MoE(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, expert_ffn: int, norm_topk_prob: bool, act,
                 limit: float | None = None):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, expert_ffn, act, limit)
        self.dispatch: DispatchFn = local_dispatch
        self.reduce_stats: Callable[[RouterStats], RouterStats] = local_stats
        self.token_rows: Callable[[torch.Tensor], torch.Tensor] = whole

    def set_parallel(self, dispatch: DispatchFn, reduce_stats: Callable[[RouterStats], RouterStats],
                     token_rows: Callable[[torch.Tensor], torch.Tensor] = whole) -> None:
        """The parallel seam: how pairs reach their experts, how router statistics are summed over the
        ranks sharing this micro-batch, and which of the batch's per-token values are this block's input
        rows (sequence parallel: this rank's shard). mlite.runtime.parallel.parallelize calls it once."""
        self.dispatch, self.reduce_stats, self.token_rows = dispatch, reduce_stats, token_rows

    def forward(self, x: torch.Tensor, batch=None) -> tuple[torch.Tensor, RouterStats]:
        """x [N, hidden] -> ([N, hidden], router statistics). `batch` marks padding rows (left out of the
        statistics); hash-routed families also read token ids from it."""
        # [N, E] in fp32: routing is precision-sensitive
        logits = F.linear(x.float(), self.router.weight.float())
        probs = logits.softmax(dim=-1)
        weights, expert_ids = probs.topk(self.top_k, dim=-1)  # [N, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.dispatch(x, expert_ids, weights.to(x.dtype), self.experts, self.num_experts)
        return out, self.reduce_stats(router_stats(probs, expert_ids, self.num_experts,
                                                   real_rows(self, batch)))


def router_stats(probs: torch.Tensor, expert_ids: torch.Tensor, num_experts: int,
                 real: torch.Tensor | None = None) -> RouterStats:
    """Sums over this rank's tokens (`reduce_stats` adds the other ranks' under cp x tp); `real` [N] leaves
    padding rows out."""
    # padding rows weigh 0: weighted, not dropped, so no shape depends on the data
    weight = probs.new_ones(probs.shape[0]) if real is None else real.to(probs.dtype)  # [N]
    if real is not None:
        probs = probs * weight.unsqueeze(-1)
    counts = expert_counts(expert_ids.reshape(-1), num_experts,
                           weight.unsqueeze(-1).expand_as(expert_ids).reshape(-1))
    return RouterStats(counts, probs.sum(0), weight.sum())


def load_balancing_loss(stats: list[RouterStats], num_experts: int, coef: float) -> torch.Tensor:
    """coef x transformers' aux loss over the pooled router choices of `stats` (one entry per MoE layer).

    Under cp x tp every rank of the token group returns the same value divided by the group size, so the
    gradients summed over the group equal the single-process gradient."""
    counts = torch.stack([s.counts for s in stats]).sum(0)
    prob_sum = torch.stack([s.prob_sum for s in stats]).sum(0)
    rows = torch.stack([s.rows for s in stats]).sum()
    return coef * num_experts * ((counts / rows) * (prob_sum / rows)).sum() / stats[0].shards
