"""Packing per optimizer step: token budget, every sample once per epoch, ranks balanced and in lockstep,
exact global target counts, deterministic and resumable (also across a change of dp size)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from mlite.errors import MliteError
from mlite.runtime.data.packed import IGNORE
from mlite.runtime.data.packing import GlobalBatchSampler, Sample, StepBatcher, imbalance, plan_step


def make_samples(n: int, seed: int = 0, shortest: int = 8, longest: int = 128) -> list[Sample]:
    """Samples whose first token is their own index (so a packed batch says which samples it holds); the
    first third of each sample is the prompt (no loss)."""
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        length = rng.randint(shortest, longest)
        ids = [i] + [rng.randrange(1000, 2000) for _ in range(length - 1)]
        samples.append(Sample(ids, [int(t >= length // 3) for t in range(length)]))
    return samples


def sample_ids(micro_batches) -> list[int]:
    """Which samples these micro-batches hold (first token of each sequence), pad micro-batches excluded."""
    out = []
    for batch in micro_batches:
        starts = batch.cu_seqlens[:-1].tolist()
        out += [int(batch.input_ids[s]) for s in starts if batch.num_target_tokens or batch.num_tokens > 1]
    return out


def all_ranks(samples, global_batch, dp, steps, **kw):
    """[step][rank] -> (micro_batches, global_targets) from one batcher per rank."""
    batchers = [StepBatcher(samples, global_batch, seed=7, dp_rank=r, dp_size=dp, **kw) for r in range(dp)]
    return [[b.next_step() for b in batchers] for _ in range(steps)], batchers


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_dynamic_batches_respect_budget_cover_each_sample_once_and_balance_ranks(dp):
    samples, global_batch, budget = make_samples(96), 32, 256
    steps, batchers = all_ranks(samples, global_batch, dp, steps=3, max_tokens=budget)  # 96 / 32: one epoch
    seen, worst = [], 1.0
    for step in steps:
        counts = {len(micro) for micro, _ in step}
        assert len(counts) == 1, f"ranks disagree on the micro-batch count: {[len(m) for m, _ in step]}"
        for micro_batches, _ in step:
            assert all(b.num_tokens <= budget for b in micro_batches)
        step_ids = [i for micro, _ in step for i in sample_ids(micro)]
        assert len(step_ids) == global_batch == len(set(step_ids))
        seen += step_ids
        # the global target count is what every rank's micro-batches hold together, and all ranks agree
        targets = {t for _, t in step}
        assert targets == {sum(b.num_target_tokens for micro, _ in step for b in micro)}
        assert targets == {sum(samples[i].num_targets for i in step_ids)}
        tokens = [sum(b.num_tokens for b in micro) for micro, _ in step]
        worst = max(worst, max(tokens) / (sum(tokens) / dp))
    assert sorted(seen) == list(range(96)), "one epoch must use every sample exactly once"
    assert batchers[0].last_imbalance <= worst
    # every rank knows the step's tokens over all ranks (the SFT step's metric, with no collective)
    assert {b.last_tokens for b in batchers} == {sum(b.num_tokens for micro, _ in steps[-1] for b in micro)}
    print(f"dp={dp}: worst rank imbalance (max/mean tokens) over 3 steps = {worst:.4f}")
    assert worst < 1.05  # 32 sequences of 8-128 tokens balance to within a few percent


def test_fixed_micro_batches_hold_micro_batch_size_sequences():
    samples = make_samples(64, seed=1)
    steps, _ = all_ranks(samples, 16, 2, steps=4, micro_batch_size=2)
    for step in steps:
        for micro_batches, _ in step:
            assert [b.num_sequences for b in micro_batches] == [2, 2, 2, 2]
        tokens = [sum(b.num_tokens for b in micro) for micro, _ in step]
        assert max(tokens) / (sum(tokens) / 2) < 1.1  # equal counts, still balanced by tokens
    assert sorted(i for step in steps for micro, _ in step for i in sample_ids(micro)) == list(range(64))


def test_labels_follow_the_loss_mask():
    samples = make_samples(8, seed=2)
    ((micro_batches, targets),) = [StepBatcher(samples, 8, seed=0, max_tokens=1024).next_step()]
    for batch in micro_batches:
        for seq, labels in zip(batch.split(batch.input_ids), batch.split(batch.labels)):
            sample = samples[int(seq[0])]
            want = [
                sample.input_ids[t + 1] if sample.loss_mask[t + 1] else IGNORE for t in range(len(sample) - 1)
            ]
            assert labels.tolist() == want + [IGNORE]
    assert targets == sum(s.num_targets for s in samples)


def test_epochs_are_seeded_permutations_and_steps_run_across_epoch_boundaries():
    sampler = GlobalBatchSampler(10, 4, seed=3)
    stream = [i for _ in range(5) for i in sampler.next_indices()]  # 20 samples: exactly two epochs
    assert sorted(stream[:10]) == sorted(stream[10:]) == list(range(10))
    assert stream[:10] != stream[10:], "each epoch has its own order"
    assert sampler.epoch == 2.0 and sampler.steps_per_epoch == 3
    again = GlobalBatchSampler(10, 4, seed=3)
    assert [i for _ in range(5) for i in again.next_indices()] == stream
    other = GlobalBatchSampler(10, 4, seed=4)
    assert [i for _ in range(5) for i in other.next_indices()] != stream
    unshuffled = GlobalBatchSampler(10, 4, seed=3, shuffle=False)
    assert unshuffled.next_indices() + unshuffled.next_indices() == list(range(8))


def as_lists(step):
    micro_batches, targets = step
    return [
        (b.input_ids.tolist(), b.labels.tolist(), b.cu_seqlens.tolist(), b.position_ids.tolist())
        for b in micro_batches
    ], targets


def test_resume_gives_identical_batches():
    samples = make_samples(40, seed=4)
    uninterrupted = StepBatcher(samples, 12, seed=5, dp_rank=1, dp_size=2, max_tokens=300)
    reference = [as_lists(uninterrupted.next_step()) for _ in range(9)]  # crosses two epoch boundaries

    first = StepBatcher(samples, 12, seed=5, dp_rank=1, dp_size=2, max_tokens=300)
    for _ in range(4):
        first.next_step()
    state = first.state_dict()
    resumed = StepBatcher(samples, 12, seed=5, dp_rank=1, dp_size=2, max_tokens=300)
    resumed.load_state_dict(state)
    assert [as_lists(resumed.next_step()) for _ in range(5)] == reference[4:]


def test_resume_on_another_dp_size_sees_the_same_global_batches():
    samples = make_samples(40, seed=5)
    two = [StepBatcher(samples, 8, seed=1, dp_rank=r, dp_size=2, max_tokens=256) for r in range(2)]
    for _ in range(3):
        for b in two:
            b.next_step()
    one = StepBatcher(samples, 8, seed=1, max_tokens=256)
    one.load_state_dict(two[0].state_dict())
    micro, targets = one.next_step()
    steps = [b.next_step() for b in two]
    assert sorted(sample_ids(micro)) == sorted(i for m, _ in steps for i in sample_ids(m))
    assert targets == steps[0][1]


def test_resume_refuses_other_data():
    state = StepBatcher(make_samples(40), 8, seed=1, max_tokens=256).state_dict()
    with pytest.raises(MliteError, match="num_samples=40.*this run has 39"):
        StepBatcher(make_samples(39), 8, seed=1, max_tokens=256).load_state_dict(state)
    with pytest.raises(MliteError, match="seed=1.*this run has 2"):
        StepBatcher(make_samples(40), 8, seed=2, max_tokens=256).load_state_dict(state)


def test_ranks_without_sequences_get_a_pad_micro_batch_without_targets():
    samples = make_samples(3, seed=6)
    steps, _ = all_ranks(samples, 3, 4, steps=1, max_tokens=256, pad_id=5)
    per_rank = steps[0]
    assert {len(m) for m, _ in per_rank} == {1}
    pads = [m[0] for m, _ in per_rank if m[0].num_tokens == 1]
    assert len(pads) == 1 and pads[0].input_ids.tolist() == [5] and pads[0].num_target_tokens == 0


def test_lopsided_lengths_still_give_equal_micro_batch_counts():
    lengths = [1000, 1000, 1000, 1000, 30, 30, 30, 30, 30, 30, 30, 30, 30]
    plan = plan_step(lengths, 2, max_tokens=1000)
    assert len(plan[0]) == len(plan[1])
    assert all(sum(lengths[i] for i in micro) <= 1000 for rank in plan for micro in rank)
    assert sorted(i for rank in plan for micro in rank for i in micro) == list(range(len(lengths)))
    assert imbalance(lengths, plan) < 1.01


def test_bad_settings_are_refused():
    with pytest.raises(MliteError, match="global_batch_size=10 is not a multiple of data-parallel size 2 x"):
        StepBatcher(make_samples(20), 10, seed=0, dp_size=2, micro_batch_size=2)
    with pytest.raises(MliteError, match="no training samples"):
        StepBatcher([], 8, seed=0, max_tokens=64)
    with pytest.raises(ValueError, match="exceeds max_tokens=64"):
        plan_step([65], 1, max_tokens=64)


def _gloo_ranks_agree(rank, world, samples):
    batcher = StepBatcher(samples, 16, seed=9, dp_rank=rank, dp_size=world, max_tokens=200)
    for _ in range(4):
        micro_batches, global_targets = batcher.next_step()
        mine = torch.tensor([sum(b.num_target_tokens for b in micro_batches), len(micro_batches)])
        total = mine.clone()
        dist.all_reduce(total)
        assert int(total[0]) == global_targets, "target tokens over the ranks must be the global count"
        counts = [None] * world
        dist.all_gather_object(counts, (len(micro_batches), sample_ids(micro_batches)))
        assert len({c for c, _ in counts}) == 1, f"micro-batch counts differ: {counts}"
        everyone = [i for _, ids in counts for i in ids]
        assert len(everyone) == 16 == len(set(everyone))


def test_gloo_ranks_split_each_step_without_talking():
    from parallel_harness import launch

    launch(2, _gloo_ranks_agree, make_samples(64, seed=8))


def test_host_lens_follow_cu_seqlens_through_moves_padding_and_context_splits():
    """The host's copy of the sequence lengths (what lets a GPU step size tensors without reading
    cu_seqlens back) stays equal to cu_seqlens' lengths wherever a batch goes."""
    from mlite.runtime.data.packed import PackedBatch
    from mlite.runtime.parallel.context import split_for_context_parallel
    from mlite.runtime.parallel.step import pad_to_multiple

    def lens(b):
        return tuple((b.cu_seqlens[1:] - b.cu_seqlens[:-1]).tolist())

    batch = PackedBatch.from_sequences([[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]])
    assert batch.host_lens == lens(batch) == (3, 2, 5)
    moved = batch.to("cpu", non_blocking=True)
    padded = pad_to_multiple(moved, 4)
    assert padded.host_lens == lens(padded) == (3, 2, 5, 2)
    share = split_for_context_parallel(padded, 2, 1)
    assert share.host_lens == lens(share) and share.seq_lens == list(lens(share))
    assert pad_to_multiple(padded, 4) is padded  # already a multiple: unchanged
