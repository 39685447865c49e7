"""Token sampling for the built-in rollout: temperature, top-k, top-p, greedy; seeded and batched.

Kept free of any model so the filters are tested on hand-made logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def filter_logits(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """[B, V] logits -> [B, V] scaled logits with filtered-out tokens at -inf.

    top_k keeps the k most likely tokens (0: off); top_p keeps the smallest set whose probability reaches
    top_p (the most likely token always stays). Temperature 0 means greedy and is handled by `sample`.
    """
    logits = logits.float() / max(temperature, 1e-5)
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # probability mass strictly above each token
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
) -> torch.Tensor:
    """[B, V] -> [B] next tokens. Sampling draws on `generator` (on the logits' device) for
    reproducibility: one for the batch, or one per row, so that a row draws the same token whatever else
    is in its batch (a rollout split over data-parallel ranks samples what one process samples)."""
    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    probs = torch.softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1)
    if isinstance(generator, Sequence):
        return torch.cat([torch.multinomial(row[None], 1, generator=g) for row, g in zip(probs, generator)]
                         ).squeeze(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
