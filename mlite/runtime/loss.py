"""Per-token log-probabilities and entropy from hidden states, and the SFT loss.

The [T, vocab] logits of a long packed batch are the largest activation of a step (32k tokens x 152k vocab
in fp32 is 19 GB), so they are computed in chunks of tokens and, when training, each chunk is recomputed in
the backward pass instead of being kept: memory holds one chunk's logits at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from mlite.runtime.data.packed import IGNORE, PackedBatch
from mlite.runtime.kernels.lm_head import linear_logprobs

DEFAULT_CHUNK_TOKENS = 4096


def _chunk_logprobs(hidden, labels, compute_logits, temperature: float, with_entropy: bool):
    logits = compute_logits(hidden).float()  # [t, V], fp32 for a stable softmax
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    token_logp = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [t]
    if not with_entropy:
        return token_logp, None
    entropy = -(logp.exp() * logp).sum(-1)  # [t]
    return token_logp, entropy


def token_logprobs(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    head_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [T, H], labels [T] -> log p(label) [T] (0 where the label is IGNORE), entropy [T] or None.

    Position t's label is the next token, so log-probs line up with the inputs (what verl's losses read).
    `head_weight`: the LM head's plain (unsharded) weight when `compute_logits` is just `hidden @ W^T`; without
    entropy it selects the fused kernel (mlite.runtime.kernels.lm_head), which never materialises fp32 logits."""
    if head_weight is not None and not with_entropy and not isinstance(head_weight, DTensor):
        valid = labels != IGNORE
        scaled = hidden if temperature == 1.0 else hidden / temperature
        return linear_logprobs(scaled, head_weight, labels.clamp(min=0), chunk_tokens) * valid, None
    recompute = torch.is_grad_enabled() and hidden.requires_grad
    logps, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, y = hidden[start : start + chunk_tokens], labels[start : start + chunk_tokens]
        if recompute:
            lp, ent = checkpoint(
                _chunk_logprobs, h, y, compute_logits, temperature, with_entropy, use_reentrant=False
            )
        else:
            lp, ent = _chunk_logprobs(h, y, compute_logits, temperature, with_entropy)
        logps.append(lp)
        entropies.append(ent)
    logp = torch.cat(logps) * (labels != IGNORE)
    return logp, (torch.cat(entropies) if with_entropy else None)


def sft_loss(global_target_tokens: int, aux_weight: float = 1.0):
    """The SFT loss of one micro-batch: its summed token NLL over the global number of target tokens, so the
    sum over micro-batches (and over data-parallel ranks, whose gradients are summed) is exactly the mean
    NLL of the step. `aux_weight` = 1 / (micro-batches x dp ranks) averages a MoE model's aux loss the same way."""

    def loss_fn(batch: PackedBatch, logprobs: torch.Tensor, entropy, aux_loss: torch.Tensor):
        nll_sum = -logprobs.sum()
        loss = nll_sum / global_target_tokens + aux_loss * aux_weight
        return loss, {"nll_sum": float(nll_sum.detach()), "target_tokens": batch.num_target_tokens}

    return loss_fn
