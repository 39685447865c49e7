"""The GRPO / DAPO algorithm on per-token tensors of the packed stream.

Every per-token tensor here is 1-D over the tokens of a packed micro-batch ([T]); `seq_ids` ([T]) says
which response each token belongs to and `mask` ([T], bool) which tokens are response tokens (trained).
Definitions follow verl 0.9 (`verl.trainer.ppo.core_algos`) exactly, so a run gives the same numbers
under either driver; tests compare with verl's functions on the same inputs.

Loss aggregation is normalised by *global* counts (`LossNorm`: all micro-batches of a mini-batch, all
data-parallel ranks), so summing the per-micro-batch losses gives the mini-batch loss whatever the split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
DUAL_CLIP_C = 3.0  # verl's default lower bound of the ratio for negative advantages (dual-clip PPO)
LOG_RATIO_LIMIT = 20.0  # verl clamps log-ratios to +-20 before exp, for stability


# ------------------------------------------------------------------------------------------ advantages
def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, std_norm: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-normalised advantage of each response: (r - mean_group) / (std_group + eps), or r - mean_group
    without std scaling (Dr. GRPO). The std is the unbiased one (n - 1), as in verl; a group of one response
    keeps its reward (mean 0, std 1)."""
    rewards = rewards.detach().float()
    groups, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(groups)).index_add_(0, inverse, rewards)
    means = sums / counts
    squares = torch.zeros(len(groups)).index_add_(0, inverse, (rewards - means[inverse]) ** 2)
    stds = torch.sqrt(squares / (counts - 1).clamp(min=1))
    means = torch.where(counts > 1, means, torch.zeros_like(means))
    stds = torch.where(counts > 1, stds, torch.ones_like(stds))
    centred = rewards - means[inverse]
    return centred / (stds[inverse] + eps) if std_norm else centred


# ------------------------------------------------------------------------------------------------- KL
def kl_estimate(
    logprob: torch.Tensor, ref_logprob: torch.Tensor, estimator: Literal["k1", "k3"]
) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate from sampled tokens (Schulman's k1 / k3)."""
    if estimator == "k1":
        return logprob - ref_logprob
    if estimator == "k3":  # r - log r - 1 with r = p_ref / p, always >= 0, low variance
        log_r = torch.clamp(ref_logprob - logprob, min=-LOG_RATIO_LIMIT, max=LOG_RATIO_LIMIT)
        return torch.clamp(torch.exp(log_r) - log_r - 1, min=-10, max=10)
    raise ValueError(f"unknown KL estimator {estimator!r}; use k1 or k3")


def kl_penalised_rewards(
    rewards: torch.Tensor,
    old_logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    kl_coef: float,
    estimator: Literal["k1", "k3"],
) -> torch.Tensor:
    """KL in the reward: each response's reward minus kl_coef x its summed per-token KL (what GRPO's
    outcome advantage sees when verl puts the penalty on token-level rewards)."""
    kl = kl_estimate(old_logprob, ref_logprob, estimator) * mask
    return rewards - kl_coef * torch.zeros_like(rewards).index_add_(0, seq_ids, kl.float())


# --------------------------------------------------------------------------------------- aggregation
@dataclass(frozen=True)
class LossNorm:
    """Global counts of one mini-batch (all micro-batches, all data-parallel ranks)."""

    num_tokens: int  # response tokens
    num_sequences: int  # responses with at least one response token
    horizon: int  # seq-mean-token-sum-norm divisor: the longest allowed response (a constant)


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    num_seqs: int,
    mode: LossAgg,
    norm: LossNorm,
) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss under `mode`; shares over micro-batches sum to it.

    token-mean:               sum over all response tokens / number of response tokens
    seq-mean-token-mean:      mean over responses of (mean over the response's tokens)
    seq-mean-token-sum-norm:  mean over responses of (sum over the response's tokens) / horizon (Dr. GRPO)
    """
    masked = values * mask
    if mode == "token-mean":
        return masked.sum() / norm.num_tokens
    per_seq_sum = torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add(
        0, seq_ids, masked
    )
    if mode == "seq-mean-token-mean":
        per_seq_count = torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add(
            0, seq_ids, mask.to(values.dtype)
        )
        return (per_seq_sum / (per_seq_count + 1e-8)).sum() / norm.num_sequences
    if mode == "seq-mean-token-sum-norm":
        return per_seq_sum.sum() / norm.num_sequences / norm.horizon
    raise ValueError(f"unknown loss aggregation {mode!r}; use one of {', '.join(LOSS_AGG_MODES)}")


# ---------------------------------------------------------------------------------------- policy loss
def clipped_surrogate(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float = DUAL_CLIP_C,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO loss with separate low/high clip (DAPO's clip-higher) and dual clip for A < 0.

    Returns (loss, clipped, dual_clipped, log_ratio): the per-token loss and where each clip was active.
    """
    log_ratio = torch.clamp(logprob - old_logprob, min=-LOG_RATIO_LIMIT, max=LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pessimistic = torch.maximum(unclipped, clipped_loss)
    dual_bound = -advantages * clip_ratio_c
    dual = torch.minimum(dual_bound, pessimistic)
    loss = torch.where(advantages < 0, dual, pessimistic)
    clipped = clipped_loss > unclipped
    dual_clipped = (pessimistic > dual_bound) & (advantages < 0)
    return loss, clipped, dual_clipped, log_ratio


@dataclass(frozen=True)
class GRPOLossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28
    loss_agg: LossAgg = "token-mean"
    kl_coef: float = 0.0  # KL-in-loss coefficient (0: off, or KL is in the reward)
    kl_estimator: Literal["k1", "k3"] = "k3"
    entropy_coef: float = 0.0


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def grpo_loss(
    cfg: GRPOLossConfig,
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    num_seqs: int,
    norm: LossNorm,
    entropy: torch.Tensor | None = None,
    ref_logprob: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss of one micro-batch: clipped surrogate - entropy bonus + KL penalty, all aggregated
    with `cfg.loss_agg`. Metrics are this micro-batch's token means, as detached 0-dim tensors: the
    runtime reads them after the backward, so no host sync sits between the forward and the backward.
    `is_weights`: the rollout's importance weights (`truncated_importance_weights`), multiplying each
    token's surrogate."""
    mask = mask.to(logprob.dtype)
    pg, clipped, dual_clipped, log_ratio = clipped_surrogate(
        logprob, old_logprob, advantages, cfg.clip_low, cfg.clip_high
    )
    if is_weights is not None:
        pg = pg * is_weights.to(pg.dtype)
    loss = aggregate(pg, mask, seq_ids, num_seqs, cfg.loss_agg, norm)
    metrics = {
        "actor/pg_loss": loss.detach(),
        "actor/clip_frac": masked_mean(clipped.to(mask.dtype), mask).detach(),
        "actor/clip_frac_lower": masked_mean(dual_clipped.to(mask.dtype), mask).detach(),
        "actor/ppo_kl": masked_mean(-log_ratio.detach(), mask),
    }
    if entropy is not None:
        metrics["actor/entropy"] = masked_mean(entropy.detach(), mask)
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * aggregate(entropy, mask, seq_ids, num_seqs, cfg.loss_agg, norm)
    if cfg.kl_coef:
        if ref_logprob is None:
            raise ValueError("kl_coef > 0 needs the reference log-probs")
        kl = kl_estimate(logprob, ref_logprob, cfg.kl_estimator)
        loss = loss + cfg.kl_coef * aggregate(kl, mask, seq_ids, num_seqs, cfg.loss_agg, norm)
        metrics["actor/kl"] = masked_mean(kl.detach(), mask)
    return loss, metrics


# ------------------------------------------------------------------------------- rollout vs trainer
def mismatch_totals(
    trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, threshold: float
) -> dict[str, float]:
    """How far the sampler's log-probs of the sampled tokens are from the trainer's forward of the same
    tokens (the old policy), over the response tokens `mask`, as totals that add up over data-parallel
    ranks (`max` aside, the largest): the tokens, their finite absolute differences summed, how many exceed
    `threshold`, how many are not finite (a log-prob of -inf or NaN on one side), and the largest finite one.
    A different engine, kernel or precision (vLLM in bf16, say) makes the two policies differ; the share
    over the threshold says how many tokens PPO's ratio sees as off-policy."""
    diff = (trainer.float() - sampler.float()).abs()[mask.bool()]
    finite = diff[diff.isfinite()]
    nonfinite = diff.numel() - finite.numel()
    return {
        "tokens": float(diff.numel()),
        "abs_sum": float(finite.sum()),
        "over": float((finite > threshold).sum()) + nonfinite,
        "nonfinite": float(nonfinite),
        "max": float(finite.max()) if finite.numel() else 0.0,
    }


def logprob_mismatch(totals: dict[str, float]) -> dict[str, float]:
    """The step's mismatch figures from its `mismatch_totals` (summed over ranks): the mean and largest
    finite absolute difference, the share of tokens over the threshold (non-finite ones included) and the
    share whose difference is not finite; {} without response tokens."""
    if not totals["tokens"]:
        return {}
    finite = totals["tokens"] - totals["nonfinite"]
    return {
        "rollout/logprob_diff_mean": totals["abs_sum"] / finite if finite else 0.0,
        "rollout/logprob_diff_max": totals["max"],
        "rollout/logprob_diff_frac": totals["over"] / totals["tokens"],
        "rollout/logprob_diff_nonfinite": totals["nonfinite"] / totals["tokens"],
    }


def truncated_importance_weights(trainer: torch.Tensor, sampler: torch.Tensor, cap: float) -> torch.Tensor:
    """Per-token min(pi_trainer / pi_sampler, cap) (truncated importance sampling, as verl's TIS): the
    correction for tokens drawn by a sampler whose probabilities differ from the trainer's old policy."""
    log_ratio = torch.clamp(trainer.float() - sampler.float(), min=-LOG_RATIO_LIMIT, max=LOG_RATIO_LIMIT)
    return torch.exp(log_ratio).clamp(max=cap)


def vetoed_responses(trainer: list[torch.Tensor], sampler: list[torch.Tensor], masks: list[torch.Tensor],
                     limit: float) -> set[int]:
    """The responses (positions in the lists) with a response token whose sampler and trainer log-probs
    differ by more than `limit` nats, or not finitely (verl's veto, in log space): a token no healthy
    engine would disagree on by that much marks a decode that went wrong, and truncated importance
    weights would still train on its tokens at up to the cap."""
    vetoed = set()
    for i, (t, s, m) in enumerate(zip(trainer, sampler, masks)):
        diff = (t.float() - s.float()).abs()[m.bool()]
        if bool((~diff.isfinite()).any()) or bool((diff > limit).any()):
            vetoed.add(i)
    return vetoed
