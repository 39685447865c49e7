"""The built-in rollout on a tiny model: greedy decoding with the KV cache equals argmax over the full
forward; stop tokens and length limits; reproducible under a seed."""

from __future__ import annotations

import pytest
import torch

from mlite.config.catalog import preset_arch
from mlite.runtime.data.packed import PackedBatch
from mlite.runtime.models import build_model
from mlite.trainers.grpo.rollout import SamplingParams, generate

PROMPTS = [[5, 17, 3, 99, 42, 7], [11, 2], [8, 8, 64, 1]]  # different lengths in one batch


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(preset_arch("tiny-qwen3"), attention_backend="torch").eval()


def full_forward_argmax(model, tokens: list[int]) -> int:
    batch = PackedBatch.from_sequences([tokens])
    with torch.no_grad():
        logits = model.compute_logits(model(batch).hidden)
    return int(logits[-1].argmax())


def test_greedy_with_cache_equals_argmax_of_the_full_forward(model):
    completions = generate(model, PROMPTS, SamplingParams(max_new_tokens=8, temperature=0))
    for prompt, completion in zip(PROMPTS, completions):
        assert (
            completion.prompt_ids == prompt and len(completion.response_ids) == 8 and not completion.stopped
        )
        for t, token in enumerate(completion.response_ids):
            assert token == full_forward_argmax(model, prompt + completion.response_ids[:t]), (prompt, t)


def test_stop_tokens_end_a_row_and_are_kept(model):
    greedy = generate(model, PROMPTS, SamplingParams(max_new_tokens=8, temperature=0))
    stop = greedy[0].response_ids[2]  # a token row 0 emits at step 2
    completions = generate(
        model, PROMPTS, SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=(stop,))
    )
    first = greedy[0].response_ids.index(stop)
    assert completions[0].response_ids == greedy[0].response_ids[: first + 1] and completions[0].stopped
    for full, cut in zip(greedy[1:], completions[1:]):  # other rows unaffected until their own stop
        if stop in full.response_ids:
            assert cut.response_ids == full.response_ids[: full.response_ids.index(stop) + 1] and cut.stopped
        else:
            assert cut.response_ids == full.response_ids and not cut.stopped


def test_sampling_is_reproducible_under_a_seed_and_respects_max_length(model):
    params = SamplingParams(max_new_tokens=5, temperature=1.0, top_k=50, top_p=0.95)

    def run(seed):
        return [c.response_ids
                for c in generate(model, PROMPTS * 2, params, torch.Generator().manual_seed(seed))]

    assert run(3) == run(3)
    assert run(3) != run(4)
    assert all(len(r) == 5 for r in run(3))


def test_top_k_one_is_greedy(model):
    greedy = generate(model, PROMPTS, SamplingParams(max_new_tokens=6, temperature=0))
    top1 = generate(
        model,
        PROMPTS,
        SamplingParams(max_new_tokens=6, temperature=0.7, top_k=1),
        torch.Generator().manual_seed(0),
    )
    assert [c.response_ids for c in top1] == [c.response_ids for c in greedy]


@pytest.mark.gpu
def test_rollout_on_cuda_matches_the_full_forward_and_cpu_in_fp32():
    torch.manual_seed(0)
    gpu_model = build_model(preset_arch("tiny-qwen3"), attention_backend="auto", device="cuda").eval()
    completions = generate(gpu_model, PROMPTS, SamplingParams(max_new_tokens=8, temperature=0))
    for prompt, completion in zip(PROMPTS, completions):
        for t, token in enumerate(completion.response_ids):
            batch = PackedBatch.from_sequences([prompt + completion.response_ids[:t]]).to("cuda")
            with torch.no_grad():
                assert token == int(gpu_model.compute_logits(gpu_model(batch).hidden)[-1].argmax())
    sampled = generate(
        gpu_model,
        PROMPTS,
        SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.9),
        torch.Generator(device="cuda").manual_seed(1),
    )
    again = generate(
        gpu_model,
        PROMPTS,
        SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.9),
        torch.Generator(device="cuda").manual_seed(1),
    )
    assert [c.response_ids for c in sampled] == [c.response_ids for c in again]


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-deepseek-v4"])
def test_prefill_logits_at_each_rows_last_prompt_token(preset):
    """decode(last_only=True), the rollout's prefill, is the full decode's logits at each row's last prompt
    token: [B, 1, vocab] instead of [B, longest, vocab] (what a large vocabulary cannot afford)."""
    torch.manual_seed(0)
    net = build_model(preset_arch(preset), attention_backend="torch").eval()
    rows, longest = len(PROMPTS), max(len(p) for p in PROMPTS)
    ids = torch.zeros(rows, longest, dtype=torch.long)
    positions = torch.full((rows, longest), -1)
    for i, p in enumerate(PROMPTS):
        ids[i, : len(p)], positions[i, : len(p)] = torch.tensor(p), torch.arange(len(p))
    full = net.decode(ids, positions, net.new_kv_cache(rows, longest + 2))
    last = net.decode(ids, positions, net.new_kv_cache(rows, longest + 2), last_only=True)
    lengths = torch.tensor([len(p) for p in PROMPTS])
    assert last.shape == (rows, 1, full.shape[-1])
    torch.testing.assert_close(last[:, 0], full[torch.arange(rows), lengths - 1], rtol=1e-5, atol=1e-5)
