"""The parallel pieces of one training step, shared by the runtime and the parity tests.

- `local_share(batch, mesh)`: what this rank computes of a micro-batch. Context parallel needs the stream in
  2 x cp equal chunks and sequence parallel in tp equal token shards, so a stream of another length gets
  one padding sequence at its end (ignored labels; its tokens attend only to each other, so no real
  token's log-prob changes), then the zigzag split. A MoE router does see the padding tokens: they enter
  the balance-loss statistics (a few tokens per micro-batch; exact only for streams already a multiple).
- `vocab_parallel_logprobs`: per-token log-probs (and entropy) from logits split over `tp` by vocabulary:
  `cross_entropy(reduction="none")` under `loss_parallel()` (each rank reduces its vocabulary slice, one
  all-reduce of max and sum per token; the full [T, vocab] logits never exist on one rank). The result is
  replicated over tp. The caller runs the backward under `loss_parallel()` too.
- `gather_stream`: per-token outputs of the local share back into the whole stream, on every cp rank.
- `broadcast_outputs`: under pipeline parallel, the last stage's per-micro-batch outputs to every stage.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from mlite.runtime.data.packed import IGNORE, PackedBatch
from mlite.runtime.parallel.context import TOKEN_INDEX, split_for_context_parallel
from mlite.runtime.parallel.mesh import ParallelMesh


def pad_to_multiple(batch: PackedBatch, multiple: int) -> PackedBatch:
    """Append one padding sequence (token 0, ignored labels, zero extras) up to a multiple of `multiple` tokens."""
    pad = -batch.num_tokens % multiple
    if pad == 0:
        return batch
    device = batch.input_ids.device
    ends = torch.cat([batch.cu_seqlens, batch.cu_seqlens[-1:] + pad])
    return replace(
        batch,
        input_ids=torch.cat([batch.input_ids, batch.input_ids.new_zeros(pad)]),
        position_ids=torch.cat([batch.position_ids, torch.arange(pad, device=device)]),
        cu_seqlens=ends,
        labels=torch.cat([batch.labels, batch.labels.new_full((pad,), IGNORE)]),
        max_seqlen=max(batch.max_seqlen, pad),
        extras={k: torch.cat([v, v.new_zeros(pad, *v.shape[1:])]) for k, v in batch.extras.items()},
    )


def local_share(batch: PackedBatch, mesh: ParallelMesh | None) -> PackedBatch:
    """This rank's part of a micro-batch: the whole of it (padded to a multiple of tp under sequence
    parallel), or its zigzag share under context parallel."""
    if mesh is None:
        return batch
    cp, tp = mesh.dims.cp, mesh.dims.tp
    if cp == 1:
        return pad_to_multiple(batch, tp)
    return split_for_context_parallel(pad_to_multiple(batch, 2 * cp * tp), cp, mesh.rank_in("cp"))


def real_tokens(share: PackedBatch, full: PackedBatch) -> int:
    """How many of the share's tokens are the micro-batch's own (not padding): sums to it over cp."""
    if TOKEN_INDEX not in share.extras:
        return min(share.num_tokens, full.num_tokens)
    return int((share.extras[TOKEN_INDEX] < full.num_tokens).sum())


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
    logp = F.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)  # partial sums per vocabulary slice
    return logprobs, _local(entropy.redistribute(placements=[Replicate()]) if isinstance(entropy, DTensor) else entropy)


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
        header = [(float(loss.detach()) if loss is not None else None, metrics)]
    dist.broadcast(values, src=last, group=group)
    dist.broadcast_object_list(header, src=last, group=group, device=device)
    loss, metrics = header[0]
    return loss, metrics, values[0], values[1] if with_entropy else None
