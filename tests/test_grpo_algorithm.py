"""GRPO algorithm and rewards on hand-computed cases (verl parity lives in test_verl_algorithm.py)."""

from __future__ import annotations

import math
import sys
import textwrap

import pytest
import torch

from mlite.errors import MliteError
from mlite.trainers.grpo.algorithm import (
    GRPOLossConfig,
    LossNorm,
    aggregate,
    clipped_surrogate,
    group_advantages,
    grpo_loss,
    kl_estimate,
    kl_penalised_rewards,
)
from mlite.trainers.grpo.rewards import extract_gsm8k_answer, gsm8k_reward, load_reward, score_responses


# ------------------------------------------------------------------------------------------ advantages
def test_group_advantages_with_and_without_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    # group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735; group 1: all equal -> 0
    scaled = group_advantages(rewards, groups, std_norm=True)
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    torch.testing.assert_close(scaled, torch.tensor([expected, -expected, -expected, expected, 0, 0, 0, 0]))
    centred = group_advantages(rewards, groups, std_norm=False)
    torch.testing.assert_close(centred, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))


def test_group_of_one_keeps_its_reward_and_groups_may_interleave():
    adv = group_advantages(torch.tensor([0.7, 2.0, 4.0]), torch.tensor([5, 9, 9]))
    # [0.7] alone: mean 0, std 1; [2, 4]: mean 3, std sqrt(2)
    torch.testing.assert_close(
        adv, torch.tensor([0.7 / (1 + 1e-6), -1 / (math.sqrt(2) + 1e-6), 1 / (math.sqrt(2) + 1e-6)])
    )


# -------------------------------------------------------------------------------------------- KL
def test_kl_estimators_k1_k3():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([math.log(2)]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), torch.tensor([0.5 + math.log(2) - 1]))
    assert float(kl_estimate(ref, ref, "k3")) == 0.0
    with pytest.raises(ValueError, match="k2"):
        kl_estimate(logp, ref, "k2")  # type: ignore[arg-type]


def test_kl_in_reward_subtracts_the_summed_token_kl():
    rewards = torch.tensor([1.0, 0.0])
    seq_ids = torch.tensor([0, 0, 0, 1, 1])
    mask = torch.tensor([0.0, 1, 1, 1, 0])  # a prompt token and a padding-like token do not count
    old = torch.tensor([0.0, -1.0, -2.0, -0.5, -9.0])
    ref = torch.tensor([5.0, -1.5, -1.0, -0.5, 0.0])
    out = kl_penalised_rewards(rewards, old, ref, mask, seq_ids, kl_coef=0.1, estimator="k1")
    torch.testing.assert_close(out, torch.tensor([1.0 - 0.1 * (0.5 - 1.0), 0.0 - 0.1 * 0.0]))


# ---------------------------------------------------------------------------------------- aggregation
VALUES = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
MASK = torch.tensor([1.0, 1, 1, 1, 0])
SEQ = torch.tensor([0, 0, 0, 1, 1])
NORM = LossNorm(num_tokens=4, num_sequences=2, horizon=4)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (6 + 4) / 4),
        ("seq-mean-token-mean", (2 + 4) / 2),
        ("seq-mean-token-sum-norm", (6 + 4) / 2 / 4),
    ],
)
def test_aggregation_modes(mode, expected):
    assert float(aggregate(VALUES, MASK, SEQ, 2, mode, NORM)) == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_shares_sum_to_the_mini_batch_loss(mode):
    whole = aggregate(VALUES, MASK, SEQ, 2, mode, NORM)
    first = aggregate(VALUES[:3], MASK[:3], SEQ[:3], 1, mode, NORM)
    second = aggregate(VALUES[3:], MASK[3:], SEQ[3:] - 1, 1, mode, NORM)
    torch.testing.assert_close(first + second, whole)


def test_unknown_aggregation_is_refused():
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(VALUES, MASK, SEQ, 2, "sum", NORM)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------- surrogate
def test_clipped_surrogate_low_high_and_dual_clip():
    old = torch.zeros(5)
    ratio = torch.tensor([1.5, 1.1, 0.5, 5.0, 0.7])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0])
    loss, clipped, dual, _ = clipped_surrogate(torch.log(ratio), old, adv, clip_low=0.2, clip_high=0.28)
    # 1.5 > 1 + 0.28 with A > 0: clipped to -1.28; 1.1 inside; A < 0 at 0.5 < 0.8: -A * 0.8;
    # A < 0 at ratio 5: max(5, 1.28) = 5 bounded by the dual clip c = 3; A > 0 at 0.7: min objective -0.7
    torch.testing.assert_close(loss, torch.tensor([-1.28, -1.1, 0.8, 3.0, -0.7]))
    assert clipped.tolist() == [True, False, True, False, False]
    assert dual.tolist() == [False, False, False, True, False]


def test_grpo_loss_gradient_and_metrics():
    logprob = torch.log(torch.tensor([1.5, 1.1, 0.9])).requires_grad_(True)
    old = torch.zeros(3)
    adv = torch.tensor([1.0, 1.0, 1.0])
    mask = torch.tensor([True, True, True])
    seq = torch.tensor([0, 0, 1])
    norm = LossNorm(num_tokens=3, num_sequences=2, horizon=8)
    loss, metrics = grpo_loss(GRPOLossConfig(), logprob, old, adv, mask, seq, 2, norm)
    loss.backward()
    # token-mean: d/dlogp of -A * ratio / 3 = -ratio / 3 where unclipped, 0 where clipped (1.5)
    torch.testing.assert_close(logprob.grad, torch.tensor([0.0, -1.1 / 3, -0.9 / 3]))
    assert float(metrics["actor/clip_frac"]) == pytest.approx(1 / 3)
    expected_kl = -(math.log(1.5) + math.log(1.1) + math.log(0.9)) / 3
    assert float(metrics["actor/ppo_kl"]) == pytest.approx(expected_kl)


def test_grpo_loss_entropy_bonus_and_kl_in_loss():
    logprob = torch.tensor([-1.0, -2.0])
    mask = torch.tensor([True, True])
    seq = torch.tensor([0, 0])
    norm = LossNorm(num_tokens=2, num_sequences=1, horizon=2)
    adv = torch.zeros(2)  # policy term is 0: only the bonus and the penalty remain
    entropy = torch.tensor([0.5, 1.5])
    ref = torch.tensor([-1.5, -2.0])
    cfg = GRPOLossConfig(entropy_coef=0.1, kl_coef=0.2, kl_estimator="k1")
    loss, metrics = grpo_loss(
        cfg, logprob, logprob, adv, mask, seq, 1, norm, entropy=entropy, ref_logprob=ref
    )
    assert float(loss) == pytest.approx(-0.1 * 1.0 + 0.2 * 0.25)
    assert float(metrics["actor/entropy"]) == pytest.approx(1.0)
    assert float(metrics["actor/kl"]) == pytest.approx(0.25)


# ------------------------------------------------------------------------------------------- rewards
@pytest.mark.parametrize(
    "text, strict, expected",
    [
        ("so she has 3 + 4 = 7 apples.\n#### 7", True, "7"),
        ("The total is $1,234.", False, "1234"),
        ("#### 12 then #### -5", True, "-5"),
        ("answer: 72.0", False, "72"),
        ("no number here", False, None),
        ("the answer is 9", True, None),
    ],
)
def test_gsm8k_extraction(text, strict, expected):
    assert extract_gsm8k_answer(text, strict=strict) == expected


def test_gsm8k_exact_match_against_a_full_solution():
    sample = {"prompt": "q", "answer": "Natalia sold 48/2 = 24 clips.\n#### 72"}
    assert gsm8k_reward("48 + 24 = 72, so #### 72", sample) == 1.0
    assert gsm8k_reward("#### 73", sample) == 0.0
    assert gsm8k_reward("I don't know", sample) == 0.0


def test_user_reward_by_import_path_and_failures_reported(tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text(
        textwrap.dedent("""
        def length_bonus(response, sample):
            if response == "boom":
                raise RuntimeError("cannot score")
            return len(response) / 10
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward("my_reward:length_bonus")
    samples = [{"prompt": "p0", "answer": "1"}, {"prompt": "p1", "answer": "2"}]
    scores, failures = score_responses(fn, ["abcde", "boom"], samples)
    assert scores == [0.5, 0.0]
    assert len(failures) == 1 and failures[0].index == 1 and failures[0].sample["prompt"] == "p1"
    assert "RuntimeError: cannot score" in failures[0].describe() and "'p1'" in failures[0].describe()
    sys.modules.pop("my_reward", None)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nonsense", "neither a built-in"),
        ("no_such_module_xyz:fn", "cannot import"),
        ("math:no_fn", "no function"),
    ],
)
def test_bad_reward_spec_is_one_clear_error(spec, message):
    with pytest.raises(MliteError, match=message):
        load_reward(spec)


def test_veto_names_the_responses_with_a_token_far_off_or_not_finite():
    from mlite.trainers.grpo.algorithm import vetoed_responses

    trainer = [torch.tensor([0.0, -1.0, -2.0, 0.0]), torch.tensor([0.0, -1.0, -2.0]),
               torch.tensor([0.0, -1.0])]
    sampler = [torch.tensor([0.0, -1.5, -2.1, 0.0]), torch.tensor([0.0, -12.0, -2.0]),
               torch.tensor([0.0, float("nan")])]
    masks = [torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.0, 1.0])]
    assert vetoed_responses(trainer, sampler, masks, 5.0) == {1, 2}
    assert vetoed_responses(trainer, sampler, masks, 0.3) == {0, 1, 2}
    masks[2] = torch.tensor([1.0, 0.0])  # the NaN sits outside the response: not a reason
    assert vetoed_responses(trainer, sampler, masks, 20.0) == set()
