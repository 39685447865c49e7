"""The parallel pieces of one training step, shared by the runtime and the parity tests.

- `local_share(batch, mesh)`: what this rank computes of a micro-batch. Context parallel needs the stream in
  2 x cp equal chunks and sequence parallel in tp equal token shards, so a stream of another length gets
  one padding sequence at its end (ignored labels; its tokens attend only to each other, so no real
  token's log-prob changes), then the zigzag split. The padding is marked (`extras[PADDING]`; every share
  under a mesh carries the mark) and MoE routers leave it out of their balance statistics, so any stream
  length is exact.
- `equal_lengths(batches)`: each micro-batch padded (the same way) to the longest of its index on any rank,
  for the all-gather expert exchange and the embedding's row exchange
  (mlite.plan.policy.equal_micro_batch_lengths).
- `vocab_parallel_logprobs`: per-token log-probs (and entropy) from logits split over `tp` by vocabulary:
  `cross_entropy(reduction="none")` under `loss_parallel()` (each rank reduces its vocabulary slice, one
  all-reduce of max and sum per token; the full [T, vocab] logits never exist on one rank). The result is
  replicated over tp. The caller runs the backward under `loss_parallel()` too.
- `gather_stream`: per-token outputs of the local share back into the whole stream, on every cp rank.
- `broadcast_outputs`: under pipeline parallel, the last stage's per-micro-batch outputs to every stage.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from mlite.runtime.data.packed import IGNORE, PADDING, PackedBatch
from mlite.runtime.parallel.context import TOKEN_INDEX, split_for_context_parallel
from mlite.runtime.parallel.mesh import ParallelMesh


def pad_to_multiple(batch: PackedBatch, multiple: int) -> PackedBatch:
    """Append one padding sequence (token 0, ignored labels, zero extras) up to a multiple of `multiple`
    tokens."""
    return pad_to_length(batch, batch.num_tokens + -batch.num_tokens % multiple)


def pad_to_length(batch: PackedBatch, length: int) -> PackedBatch:
    """Append one padding sequence (as `pad_to_multiple`) up to `length` tokens."""
    pad = length - batch.num_tokens
    if pad <= 0:
        return batch
    batch = marked(batch)
    device = batch.input_ids.device
    ends = torch.cat([batch.cu_seqlens, batch.cu_seqlens[-1:] + pad])
    extras = {k: torch.cat([v, v.new_zeros(pad, *v.shape[1:])]) for k, v in batch.extras.items()}
    extras[PADDING] = torch.cat([batch.extras[PADDING], torch.ones(pad, device=device)])
    return replace(
        batch,
        input_ids=torch.cat([batch.input_ids, batch.input_ids.new_zeros(pad)]),
        position_ids=torch.cat([batch.position_ids, torch.arange(pad, device=device)]),
        cu_seqlens=ends,
        labels=torch.cat([batch.labels, batch.labels.new_full((pad,), IGNORE)]),
        max_seqlen=max(batch.max_seqlen, pad),
        extras=extras,
        host_lens=None if batch.host_lens is None else (*batch.host_lens, pad),
    )


def equal_lengths(batches: list[PackedBatch], group=None) -> list[PackedBatch]:
    """Each micro-batch padded (`pad_to_length`) to the longest micro-batch of the same index on any rank of
    `group` (default: the world), so that every rank's stream, and every layer's rows, have one length:
    what the all-gather expert exchange and the embedding's row exchange need
    (mlite.plan.policy.equal_micro_batch_lengths). One exchange of the lengths per call, not one per layer,
    over `group`: the runtime passes a gloo group on the host (`Placement.host_group`), so it never waits for
    the GPU. The world, not the ep group: ranks that share a micro-batch (tp, cp, pp) must pad it alike."""
    lengths = [b.num_tokens for b in batches]
    every: list[list[int] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, lengths, group=group)
    if any(len(other) != len(lengths) for other in every):
        counts = sorted({len(other) for other in every})
        raise RuntimeError(f"micro-batches per step differ between ranks ({counts}); the all-gather expert "
                           "exchange and parallel.fsdp_embedding rows run them in lockstep")
    return [pad_to_length(b, max(column)) for b, column in zip(batches, zip(*every))]


def marked(batch: PackedBatch) -> PackedBatch:
    """The batch with a padding mark (`extras[PADDING]`), zeros where it has no padding yet."""
    if PADDING in batch.extras:
        return batch
    return replace(batch, extras={**batch.extras, PADDING: torch.zeros(batch.num_tokens,
                                                                       device=batch.input_ids.device)})


def local_share(batch: PackedBatch, mesh: ParallelMesh | None, chunk_multiple: int = 1,
                token_multiple: int = 1) -> PackedBatch:
    """This rank's part of a micro-batch: the whole of it (padded to a multiple of tp under sequence
    parallel), or its zigzag share under context parallel, each chunk a multiple of `chunk_multiple`
    (the rule book's `context_chunk_multiple`) and tp tokens; every share a multiple of `token_multiple`
    tokens (the rule book's `fp8_token_multiple`). Under a mesh every share carries the padding mark, zeros
    where it has none, so every rank's routers take the same path whether or not its share needed padding:
    under full recompute a rank that ran other code put FSDP2's collectives out of step with the other
    ranks' (the Qwen3-30B twin's gloo run, with `equal_lengths`' padding)."""
    if mesh is None:
        return pad_to_multiple(batch, token_multiple) if token_multiple > 1 else batch
    batch = marked(batch)
    cp, tp = mesh.dims.cp, mesh.dims.tp
    if cp == 1:
        return pad_to_multiple(batch, math.lcm(tp, token_multiple))
    multiple = 2 * cp * math.lcm(tp, chunk_multiple, token_multiple)
    return split_for_context_parallel(pad_to_multiple(batch, multiple), cp, mesh.rank_in("cp"))


def real_token_mask(share: PackedBatch, full: PackedBatch) -> torch.Tensor:
    """[t] True where the share's token is the micro-batch's own, False on padding (over cp, the Trues add
    up to the micro-batch). The runtime zeroes the entropy of padding before a loss_fn sees it."""
    if TOKEN_INDEX in share.extras:
        return share.extras[TOKEN_INDEX] < full.num_tokens
    return torch.arange(share.num_tokens, device=share.input_ids.device) < full.num_tokens


def real_token_count(share: PackedBatch, full: PackedBatch) -> int:
    """How many of the share's tokens are the micro-batch's own: known on the host unless context parallel
    scattered them (then counted on the device)."""
    if TOKEN_INDEX in share.extras:
        return int(real_token_mask(share, full).sum())
    return min(share.num_tokens, full.num_tokens)


def vocab_parallel_logprobs(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    compute_logits,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(label) [T] (0 where IGNORE) and entropy [T] or None, from vocab-split logits. Call under
    `loss_parallel()`; both come back as plain tensors holding every token (replicated over tp)."""
    logits = compute_logits(hidden).float()  # DTensor [T, vocab], Shard(-1) over tp
    if temperature != 1.0:
        logits = logits / temperature
    nll = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="none")
    logprobs = -_local(nll)
    if not with_entropy:
        return logprobs, None
    if not isinstance(logits, DTensor):
        logp = F.log_softmax(logits, dim=-1)
        return logprobs, -(logp.exp() * logp).sum(-1)
    return logprobs, VocabParallelEntropy.apply(logits.to_local(), logits.device_mesh.get_group())


class VocabParallelEntropy(torch.autograd.Function):
    """Entropy [t] of softmax over logits split by vocabulary ([t, V/tp] here), the whole value on every tp
    rank. Not through loss_parallel's log_softmax: its backward is a pass-through that only the fused
    cross-entropy backward completes. dH/dx_v = -p_v (log p_v + H) needs only this slice's p and the whole H,
    so each rank writes its slice's gradient (the loss, replicated over tp, is back-propagated once)."""

    @staticmethod
    def forward(ctx, local_logits, group):
        top = local_logits.detach().max(-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        sum_exp = (local_logits - top[:, None]).exp().sum(-1)
        dist.all_reduce(sum_exp, group=group)
        logp = local_logits - (top + sum_exp.log())[:, None]  # this slice's log-probs
        p = logp.exp()
        entropy = -(p * logp).sum(-1)
        dist.all_reduce(entropy, group=group)
        ctx.save_for_backward(p, logp, entropy)
        return entropy

    @staticmethod
    def backward(ctx, grad):
        p, logp, entropy = ctx.saved_tensors
        return -grad[:, None] * p * (logp + entropy[:, None]), None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def gather_stream(values: torch.Tensor, share: PackedBatch, full: PackedBatch, group) -> torch.Tensor:
    """Per-token values of this rank's share -> [T] of the whole micro-batch (padding dropped), on every rank
    of the cp group. No gradient: outputs for the trainer, the loss already used the local values."""
    index = share.extras[TOKEN_INDEX]
    size = dist.get_world_size(group)
    parts = [torch.empty_like(values) for _ in range(size)]
    indices = [torch.empty_like(index) for _ in range(size)]
    dist.all_gather(parts, values.detach().contiguous(), group=group)
    dist.all_gather(indices, index.contiguous(), group=group)
    index = torch.cat(indices)  # every position of the padded stream, once
    stream = values.new_zeros(index.numel(), *values.shape[1:])
    stream[index] = torch.cat(parts)
    return stream[: full.num_tokens]


def host_number(value):
    """A loss or metric as a Python number: a 0-dim tensor is read from its device (which waits for it).
    Losses and metrics stay tensors through the step; callers read them when they need the number."""
    return value.item() if isinstance(value, torch.Tensor) else value


def broadcast_outputs(computed, num_tokens: int, with_entropy: bool, mesh: ParallelMesh, device):
    """(loss float, metrics, logprobs [t], entropy [t] or None) of one micro-batch from the last pipeline
    stage (where `computed` is not None) to every rank of its `pp` group."""
    group = mesh.group("pp")
    last = dist.get_process_group_ranks(group)[-1]
    rows = 2 if with_entropy else 1
    values = torch.empty(rows, num_tokens, dtype=torch.float32, device=device)
    header = [None]
    if computed is not None:
        loss, metrics, logprobs, entropy = computed
        values[0] = logprobs.detach().float()
        if with_entropy:
            values[1] = entropy.detach().float()
        header = [(host_number(loss), {key: host_number(value) for key, value in metrics.items()})]
    dist.broadcast(values, src=last, group=group)
    dist.broadcast_object_list(header, src=last, group=group, device=device)
    loss, metrics = header[0]
    return loss, metrics, values[0], values[1] if with_entropy else None
