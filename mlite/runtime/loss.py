"""Per-token log-probabilities and entropy from hidden states, and the SFT loss.

The [T, vocab] logits of a long packed batch are the largest activation of a step (32k tokens x 152k vocab
in fp32 is 19 GB), so they never exist whole. Two paths, chosen in `token_logprobs`:

- the LM-head kernel (mlite.runtime.kernels.lm_head), when the head is a plain bias-free linear layer on this
  rank and no entropy is asked for: logits in the compute dtype one chunk at a time, log-sum-exp in fp32,
  the softmax gradient formed in place. What one process trains with (SFT, GRPO without entropy).
- chunked autograd otherwise (entropy; an LM head sharded by FSDP2 or tp, whose weight is gathered only
  inside its own forward): fp32 logits per chunk, each chunk recomputed in the backward pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from mlite.runtime.adapters.pytorch import has_forward_hooks, reduce_in_backward
from mlite.runtime.data.packed import IGNORE, PackedBatch
from mlite.runtime.kernels.lm_head import linear_logprobs
from mlite.runtime.models.base import LossHead, loss_head_of

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


def linear_head_weight(compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """W when `compute_logits(h)` is exactly `h @ W^T` with W whole on this rank: a bias-free nn.Linear, or a
    model's `compute_logits` over such a head (what its `loss_head` declares). None for anything else, so the
    caller keeps the autograd path: tp shards (a DTensor weight), other hooks on the head, a bias.

    An untied FSDP2 head, a unit of its own, is gathered here (`unshard`), since the kernel's path never
    calls the forward in whose hooks FSDP2 would gather it (the last layer unit's forward has queued its
    all-gather already: `apply_fsdp`). With gradients on, the unit's post-backward hook reduce-scatters the
    gradient and reshards the weight (`_reduce_head_early`); without, call `release_head` once the log-probs
    are computed. A tied head shares its unit with the embedding, whose own backward hooks reduce it: it keeps
    the autograd path."""
    declared = _head(compute_logits)
    head = declared.linear
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return None
    if isinstance(head, FSDPModule):
        embed = declared.embedding
        if embed is None or embed.weight is head.weight:
            return None  # tied, or a head handed over without its model: the autograd path
        head.unshard()
    elif has_forward_hooks(head):
        return None
    weight = head.weight
    return None if isinstance(weight, DTensor) else weight


def release_head(compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Reshard an FSDP2 head that `linear_head_weight` gathered for a pass without backward: left gathered,
    it would keep its weights of before the next update."""
    head = _head(compute_logits).linear
    if isinstance(head, FSDPModule):
        head.reshard()


def _reduce_head_early(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor):
    """`hidden` through an untied FSDP2 head's post-backward hook: once autograd has the gradient of the
    hidden states, the head's gradient is reduce-scattered (or accumulated, without gradient sync), as for
    a unit whose forward took them as input, under the layers' backward. FSDP2's own hooks never see the
    kernel read the weight, and would reduce it in their end-of-backward callback, where nothing overlaps
    the reduce-scatter. The weight's gradient is in place by then: autograd runs a leaf's accumulation
    before the other nodes the kernel's backward feeds, which FSDP2's hooks rely on too. Not where the model
    reads the head in its own forward as well (`LossHead.read_in_forward`: DeepSeek-V4's MTP loss): the hook
    reshards the head, whose later backward still needs it."""
    declared = _head(compute_logits)
    if not isinstance(declared.linear, FSDPModule) or declared.read_in_forward:
        return hidden
    return reduce_in_backward(declared.linear, hidden)  # FSDP2 has no public way to register its hook


def _head(compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> LossHead:
    """The head the model declares for its `compute_logits` (mlite.runtime.models.base.loss_head_of), else
    compute_logits itself as the head, with no model around it (a module handed over alone, any function)."""
    declared = loss_head_of(compute_logits)
    return LossHead(compute_logits) if declared is None else declared


def _head_logprobs(hidden, labels, weight, temperature: float, chunk_tokens: int) -> torch.Tensor:
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # the head's matmuls in the autocast dtype, as compute_logits runs them; cast here because the
        # kernel's backward runs outside autocast
        hidden = hidden.to(torch.get_autocast_dtype(device_type))
    if temperature != 1.0:
        hidden = hidden / temperature  # (h / T) @ W^T = logits / T
    with torch.autocast(device_type, enabled=False):
        logp = linear_logprobs(hidden, weight, labels.clamp(min=0), chunk_tokens)
    return logp * (labels != IGNORE)


def token_logprobs(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [T, H], labels [T] -> log p(label) [T] fp32 (0 where the label is IGNORE), entropy [T] or None.

    Position t's label is the next token, so log-probs line up with the inputs (what verl's losses read).
    Without entropy and with a plain linear head (`linear_head_weight`) this is the LM-head kernel, else
    chunked autograd; both take the log-softmax in fp32 and agree to the compute dtype's rounding."""
    backward = torch.is_grad_enabled() and hidden.requires_grad
    weight = None if with_entropy else linear_head_weight(compute_logits)
    if weight is not None:
        if backward:
            hidden = _reduce_head_early(compute_logits, hidden)
        logp = _head_logprobs(hidden, labels, weight, temperature, chunk_tokens)
        if not backward:
            release_head(compute_logits)
        return logp, None
    logps, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, y = hidden[start : start + chunk_tokens], labels[start : start + chunk_tokens]
        if backward:  # recomputed in the backward: no chunk's logits are kept
            lp, ent = checkpoint(
                _chunk_logprobs, h, y, compute_logits, temperature, with_entropy, use_reentrant=False
            )
        else:
            lp, ent = _chunk_logprobs(h, y, compute_logits, temperature, with_entropy)
        logps.append(lp)
        entropies.append(ent)
    logp = torch.cat(logps) * (labels != IGNORE)
    return logp, (torch.cat(entropies) if with_entropy else None)


def sft_loss(global_target_tokens: int):
    """The SFT loss of one micro-batch: its summed token NLL over the global number of target tokens, so the
    sum over micro-batches (and over data-parallel ranks, whose gradients are summed) is exactly the mean
    NLL of the step. `aux_loss` arrives as this micro-batch's share of a MoE model's balance loss, already
    averaged over micro-batches and ranks by the runtime (mlite.runtime.forward)."""

    def loss_fn(batch: PackedBatch, logprobs: torch.Tensor, entropy, aux_loss: torch.Tensor):
        nll_sum = -logprobs.sum()
        loss = nll_sum / global_target_tokens + aux_loss
        # tensors: the runtime reads metrics after the backward (no host sync between forward and backward)
        return loss, {"nll_sum": nll_sum.detach(), "target_tokens": batch.target_count()}

    return loss_fn
