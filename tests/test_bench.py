"""The benchmark's own arithmetic and code paths (the GPU figures live in docs/PERFORMANCE.md)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mlite.bench import effective_seq_len, flops_per_token, mfu, mixed_lengths
from mlite.config.catalog import preset_arch


def test_mfu_formula_reproduces_the_reference_baselines():
    # ../shared/REFERENCE.md section 4: HF transformers on one H100, sequence 4096
    dense = preset_arch("qwen3-1.7b")
    assert mfu(dense, [4096], tokens_per_s=21_816, peak_tflops=989) == pytest.approx(0.259, abs=0.001)
    moe = replace(preset_arch("qwen3-30b-a3b"), num_layers=6)
    assert mfu(moe, [4096], tokens_per_s=33_556, peak_tflops=989) == pytest.approx(0.153, abs=0.001)


def test_attention_flops_follow_the_packed_lengths():
    arch = preset_arch("qwen3-1.7b")
    one_long = flops_per_token(arch, [4096])
    four_short = flops_per_token(arch, [1024] * 4)
    # same tokens, a quarter of the causal attention work per token
    attention_long = 6 * arch.num_layers * arch.num_heads * arch.head_dim * 4096
    assert one_long - four_short == pytest.approx(attention_long * 3 / 4)
    assert effective_seq_len([1024] * 4) == 1024


def test_mixed_lengths_fill_the_budget_exactly_and_vary():
    lens = mixed_lengths(4096, seed=3)
    assert sum(lens) == 4096 and len(set(lens)) > 1
    assert lens == mixed_lengths(4096, seed=3)
