"""Our GRPO algorithm equals verl 0.9's on the same inputs (verl's padded [B, L] tensors vs our packed
stream). Needs the `verl` extra (installed in CI)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from verl.trainer.ppo import core_algos  # the verl extra is part of CI's install: a missing verl fails

from mlite.trainers.grpo.algorithm import (
    LossNorm,
    aggregate,
    clipped_surrogate,
    group_advantages,
    kl_estimate,
    kl_penalised_rewards,
    masked_mean,
)

B, L = 6, 7


def padded_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 5, 1, 6, 4])
    mask = (torch.arange(L)[None, :] < lengths[:, None]).float()
    logp = -torch.rand(B, L, generator=g) * 3
    old = logp + torch.randn(B, L, generator=g) * 0.8  # ratios well outside the clip range too
    ref = logp + torch.randn(B, L, generator=g) * 0.3
    adv = torch.randn(B, 1, generator=g).expand(B, L).contiguous()
    adv[0], old[0, 0] = -adv[0].abs(), logp[0, 0] - 2.0  # ratio e^2 > 3 with A < 0: the dual clip acts
    return mask, logp, old, ref, adv


def packed(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x[mask.bool()]


def seq_ids(mask: torch.Tensor) -> torch.Tensor:
    return torch.arange(B)[:, None].expand(B, L)[mask.bool()]


def test_advantages_equal_verl():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.5, 2.0, 3.0])
    index = np.array(["a", "a", "a", "b", "b", "c", "a"], dtype=object)
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 0])
    for std_norm in (True, False):
        token_rewards = torch.zeros(7, 3)
        token_rewards[:, -1] = rewards  # outcome reward on the last response token
        theirs, _ = core_algos.compute_grpo_outcome_advantage(
            token_rewards, torch.ones(7, 3), index, norm_adv_by_std_in_grpo=std_norm
        )
        torch.testing.assert_close(group_advantages(rewards, groups, std_norm), theirs[:, 0])


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_loss_aggregation_equals_verl(mode):
    mask, logp, *_ = padded_case(0)
    theirs = core_algos.agg_loss(logp, mask, mode)  # verl's horizon is the padded width L
    norm = LossNorm(num_tokens=int(mask.sum()), num_sequences=B, horizon=L)
    ours = aggregate(packed(logp, mask), packed(mask, mask), seq_ids(mask), B, mode, norm)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clipped_surrogate_equals_verl(seed):
    mask, logp, old, _, adv = padded_case(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # verl marks the config-free variant deprecated; the math is the same
        pg, clipfrac, ppo_kl, clipfrac_lower = core_algos.compute_policy_loss(
            old, logp, adv, mask, cliprange_low=0.2, cliprange_high=0.28, loss_agg_mode="token-mean"
        )
    loss, clipped, dual, log_ratio = clipped_surrogate(
        packed(logp, mask), packed(old, mask), packed(adv, mask), 0.2, 0.28
    )
    ones = torch.ones_like(loss)
    norm = LossNorm(num_tokens=int(mask.sum()), num_sequences=B, horizon=L)
    torch.testing.assert_close(aggregate(loss, ones, seq_ids(mask), B, "token-mean", norm), pg)
    torch.testing.assert_close(masked_mean(clipped.float(), ones), clipfrac)
    torch.testing.assert_close(masked_mean(dual.float(), ones), clipfrac_lower)
    torch.testing.assert_close(masked_mean(-log_ratio, ones), ppo_kl)
    assert 0 < float(clipfrac) < 1 and float(clipfrac_lower) > 0  # the case exercises every branch


@pytest.mark.parametrize("ours_name, verl_name", [("k1", "k1"), ("k3", "low_var_kl")])
def test_kl_estimators_and_kl_in_reward_equal_verl(ours_name, verl_name):
    mask, logp, old, ref, _ = padded_case(3)
    torch.testing.assert_close(kl_estimate(logp, ref, ours_name), core_algos.kl_penalty(logp, ref, verl_name))
    # verl's KL-in-reward: token_level_rewards = scores - beta * kl(old, ref) * mask, summed by the GRPO
    # outcome advantage; ours folds it into each response's reward
    scores = torch.zeros(B, L)
    rewards = torch.arange(B, dtype=torch.float32)
    scores[torch.arange(B), mask.sum(1).long() - 1] = rewards
    token_rewards = scores - 0.05 * core_algos.kl_penalty(old, ref, verl_name) * mask
    ours = kl_penalised_rewards(
        rewards, packed(old, mask), packed(ref, mask), packed(mask, mask), seq_ids(mask), 0.05, ours_name
    )
    torch.testing.assert_close(ours, token_rewards.sum(-1))
