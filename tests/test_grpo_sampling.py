"""Sampling filters on hand-made logits: top-k, top-p, temperature, greedy, seeded draws."""

from __future__ import annotations

import math

import torch

from mlite.trainers.grpo.sampling import filter_logits, sample

PROBS = torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]])
LOGITS = PROBS.log()


def kept(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def test_top_k_keeps_the_k_most_likely():
    assert kept(filter_logits(LOGITS, 1.0, top_k=2)) == [0, 1]
    assert kept(filter_logits(LOGITS, 1.0, top_k=0)) == [0, 1, 2, 3, 4]


def test_top_p_keeps_the_smallest_set_reaching_p():
    assert kept(filter_logits(LOGITS, 1.0, top_p=0.5)) == [0]  # 0.5 alone reaches 0.5
    assert kept(filter_logits(LOGITS, 1.0, top_p=0.6)) == [0, 1]
    assert kept(filter_logits(LOGITS, 1.0, top_p=0.91)) == [0, 1, 2, 3]
    assert kept(filter_logits(LOGITS, 1.0, top_p=0.01)) == [0]  # the most likely token always stays
    shuffled = LOGITS[:, [3, 0, 4, 2, 1]]  # order in the vocabulary does not matter
    assert kept(filter_logits(shuffled, 1.0, top_p=0.6)) == [1, 4]


def test_temperature_scales_and_renormalises():
    probs = torch.softmax(filter_logits(LOGITS, 0.5), dim=-1)[0]
    expected = PROBS[0] ** 2 / (PROBS[0] ** 2).sum()
    torch.testing.assert_close(probs, expected)


def test_greedy_and_seeded_sampling():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    assert sample(logits, temperature=0).tolist() == logits.argmax(-1).tolist()

    def draw(seed):
        return sample(logits, 1.0, generator=torch.Generator().manual_seed(seed)).tolist()

    assert draw(7) == draw(7)
    assert any(draw(7) != draw(s) for s in range(8, 12))


def test_sampling_frequencies_follow_the_filtered_distribution():
    g = torch.Generator().manual_seed(1)
    draws = sample(LOGITS.expand(20000, 5), 1.0, top_k=3, generator=g)
    freq = torch.bincount(draws, minlength=5).float() / len(draws)
    expected = torch.tensor([0.5, 0.25, 0.15, 0, 0]) / 0.9
    assert freq[3] == 0 and freq[4] == 0
    assert torch.allclose(freq, expected, atol=0.015), freq
    assert math.isclose(float(freq.sum()), 1.0)
