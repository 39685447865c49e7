"""Context parallel: one packed micro-batch split over cp ranks, attention still exact.

Split (zigzag): the packed token stream (all sequences of the micro-batch, T tokens) is cut into 2 x cp
equal chunks and rank r keeps chunks r and 2cp-1-r. Under a causal mask, early chunks are cheap and late
ones dear, so every rank gets one of each and the work is balanced. Sequence boundaries may fall anywhere
inside a chunk: each token keeps its position id (RoPE), its sequence id and its index in the stream, and
attention masks by those, never by chunk.

Attention: K and V are all-gathered over cp (their gradients are reduce-scattered back by autograd), and
each local query attends to the keys of its own sequence at or before its own stream index. The result is
exactly the single-rank attention; all-gather rather than a ring keeps it simple and is what upstream uses
for short-context post-training.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mlite.errors import MliteError
from mlite.runtime.data.packed import PackedBatch

TOKEN_INDEX = "cp_token_index"  # extras key: index of each local token in the full stream
SEQUENCE_ID = "cp_sequence_id"  # extras key: which sequence of the micro-batch the token belongs to


def zigzag_indices(num_tokens: int, cp: int, rank: int) -> torch.Tensor:
    """Stream indices kept by `rank`: chunks rank and 2cp-1-rank of 2cp equal chunks."""
    if num_tokens % (2 * cp):
        raise MliteError(
            f"context parallel cp={cp} splits a micro-batch into {2 * cp} equal chunks but it has "
            f"{num_tokens} tokens; pad each micro-batch to a multiple of {2 * cp} tokens"
        )
    chunk = num_tokens // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
    return torch.cat([first, second])


def split_for_context_parallel(batch: PackedBatch, cp: int, rank: int) -> PackedBatch:
    """This rank's share of a packed micro-batch: its tokens, their positions, labels and extras."""
    keep = zigzag_indices(batch.num_tokens, cp, rank).to(batch.input_ids.device)
    extras = {name: t[keep] for name, t in batch.extras.items()}
    extras[TOKEN_INDEX] = keep
    extras[SEQUENCE_ID] = batch.sequence_ids()[keep]
    return replace(
        batch,
        input_ids=batch.input_ids[keep],
        position_ids=batch.position_ids[keep],
        labels=batch.labels[keep],
        extras=extras,
    )


def context_parallel_attention(
    q: torch.Tensor,  # [t, heads, d] local queries
    k: torch.Tensor,  # [t, kv_heads, d]
    v: torch.Tensor,  # [t, kv_heads, d]
    batch: PackedBatch,  # the local share made by split_for_context_parallel
    group: dist.ProcessGroup,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact causal attention of local queries over the keys of the whole stream -> [t, heads, d]."""
    token_index, sequence_id = batch.extras[TOKEN_INDEX], batch.extras[SEQUENCE_ID]
    all_k = GatherTokens.apply(k, group)
    all_v = GatherTokens.apply(v, group)
    with torch.no_grad():
        key_index = _gather_ints(token_index, group)
        key_sequence = _gather_ints(sequence_id, group)
    allowed = (sequence_id[:, None] == key_sequence[None, :]) & (key_index[None, :] <= token_index[:, None])
    return masked_attention(q, all_k, all_v, allowed, scale)


def masked_attention(q, k, v, allowed, scale=None) -> torch.Tensor:
    """softmax(q k^T) v with a boolean [tq, tk] mask; KV heads repeated for grouped-query attention."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed, scale=scale
    )
    return out.transpose(0, 1)


class GatherTokens(torch.autograd.Function):
    """All-gather along tokens (equal shares); backward sums each share's gradient back to its owner.

    torch.distributed.nn's all_gather backward addresses group members by their global rank, which breaks on
    sub-groups with gloo; this one reduce-scatters on NCCL and all-reduces then slices elsewhere."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        group, size = ctx.group, dist.get_world_size(ctx.group)
        grad = grad.contiguous()
        if dist.get_backend(group) == "nccl":
            out = grad.new_empty(grad.shape[0] // size, *grad.shape[1:])
            dist.reduce_scatter_tensor(out, grad, group=group)
            return out, None
        dist.all_reduce(grad, group=group)
        return grad.chunk(size)[dist.get_rank(group)].clone(), None


def _gather_ints(t: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)
