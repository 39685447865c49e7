"""The GRPO step on the real runtime with a tiny model: exact normalisation over micro-batches, on-policy
first update, KL to the reference, reward failures reported, deterministic rollouts."""

from __future__ import annotations

import pytest
import torch
from grpo_helpers import char_tokenizer, grpo_job

from mlite.runtime.data.packed import IGNORE
from mlite.runtime.engine import Runtime
from mlite.trainers.grpo.prompts import render_prompts
from mlite.trainers.grpo.trainer import GRPOTrainer, pack_micro_batches

ROWS = [{"prompt": f"say {d}", "answer": str(d)} for d in range(10)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return char_tokenizer(tmp_path_factory.mktemp("tok"))


def make_trainer(tmp_path, tokenizer, **sections):
    job = grpo_job(tmp_path, **sections)
    prompts, too_long = render_prompts(ROWS, tokenizer, job.rollout.max_prompt_length)
    assert too_long == 0
    return GRPOTrainer(job, Runtime(job), tokenizer, prompts)


def record_grads(trainer) -> list[torch.Tensor]:
    """Keep the gradient each optimizer step sees (then step as usual)."""
    seen: list[torch.Tensor] = []
    step = trainer.runtime.optimizer_step

    def recording_step():
        seen.append(
            torch.cat([p.grad.flatten() for p in trainer.runtime.model.parameters() if p.grad is not None])
        )
        return step()

    trainer.runtime.optimizer_step = recording_step
    return seen


def params(trainer):
    return torch.cat([p.detach().flatten() for p in trainer.runtime.model.parameters()])


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_update_is_the_same_however_the_step_is_cut_into_micro_batches(tmp_path, tokenizer, loss_agg):
    one = make_trainer(
        tmp_path,
        tokenizer,
        data={"max_tokens_per_micro_batch": 4096, "seq_len": 64},
        grpo={"loss_agg": loss_agg},
    )
    many = make_trainer(
        tmp_path,
        tokenizer,
        data={"max_tokens_per_micro_batch": 64, "seq_len": 64},
        grpo={"loss_agg": loss_agg},
    )
    grads1, grads2 = record_grads(one), record_grads(many)
    m1, ro1 = one.train_step(0)
    m2, ro2 = many.train_step(0)
    assert ro1.sequences == ro2.sequences  # same seed, same rollout
    assert len(pack_micro_batches(ro1.sequences, ro1.loss_masks, {}, 64)) >= 4  # really cut into pieces
    assert m1["reward/std"] > 0 and grads1[0].norm() > 0  # the advantages are not all zero
    relative = float((grads1[0] - grads2[0]).norm() / grads1[0].norm())
    assert relative < 1e-5, relative  # fp32 summation-order noise only
    torch.testing.assert_close(params(one), params(many), rtol=1e-4, atol=1e-5)  # Adam amplifies 1e-9 noise
    assert m1["actor/pg_loss"] == pytest.approx(m2["actor/pg_loss"], rel=1e-5, abs=1e-7)


def test_a_rank_packs_its_own_sequences_and_fills_up_to_the_ranks_count():
    """GRPO under dp: each rank packs only its own responses, then fills up with one-pad-token micro-batches
    (no target, zero extras) to the count of the dp rank with the most, so the ranks' collectives stay in
    lockstep. Every sequence is packed once, and no micro-batch exceeds the budget."""
    lengths = [40, 30, 20, 5]
    seqs = [list(range(1, n + 1)) for n in lengths]
    masks = [[0] + [1] * (n - 1) for n in lengths]
    extras = {"advantages": [torch.full((n,), float(i)) for i, n in enumerate(lengths)]}
    alone = pack_micro_batches(seqs, masks, extras, 48)
    assert sorted(i for idx, _ in alone for i in idx) == [0, 1, 2, 3]
    assert len(alone) == 3  # 95 tokens, at most 48 each
    filled = pack_micro_batches(seqs, masks, extras, 48, micro_batches=5)
    assert [idx for idx, _ in filled][:3] == [idx for idx, _ in alone] and len(filled) == 5
    for idx, batch in filled:
        assert batch.num_tokens <= 48
        if idx:
            assert torch.equal(batch.extras["advantages"], torch.cat([extras["advantages"][i] for i in idx]))
        else:  # a filler: nothing to learn from
            assert batch.num_tokens == 1 and bool((batch.labels == IGNORE).all())
            assert torch.equal(batch.extras["advantages"], torch.zeros(1))
    # a rank that owns no response this step trains on fillers only, as many as the others' micro-batches
    assert [idx for idx, _ in pack_micro_batches([], [], extras, 48, micro_batches=2)] == [[], []]
    fewer = pack_micro_batches(seqs, masks, extras, 48, micro_batches=1)  # never fewer than its own
    assert [idx for idx, _ in fewer] == [idx for idx, _ in alone]


def test_first_update_is_on_policy_and_later_epochs_clip(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer, grpo={"ppo_epochs": 1, "mini_batches": 1})
    metrics, _ = trainer.train_step(0)
    assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)  # old log-probs = current policy
    assert metrics["actor/clip_frac"] == 0.0
    several = make_trainer(
        tmp_path, tokenizer, optimizer={"lr": 5e-2}, grpo={"ppo_epochs": 4, "mini_batches": 2}
    )
    metrics, _ = several.train_step(0)
    assert metrics["actor/clip_frac"] > 0  # later passes see a moved policy and the clip acts
    assert metrics["actor/ppo_kl"] != 0


def test_kl_to_the_reference_policy(tmp_path, tokenizer):
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        optimizer={"lr": 1e-2},
        grpo={"kl_coef": 0.1, "kl_estimator": "k3", "mini_batches": 2},
    )
    first, _ = trainer.train_step(0)
    assert first["actor/kl_ref"] == pytest.approx(0.0, abs=1e-7)  # nothing has moved yet
    second, _ = trainer.train_step(1)
    assert second["actor/kl_ref"] > 0 and second["actor/kl"] > 0
    in_reward = make_trainer(tmp_path, tokenizer, grpo={"kl_coef": 0.1, "kl_in_reward": True})
    metrics, _ = in_reward.train_step(0)
    assert "actor/kl" not in metrics and metrics["actor/kl_ref"] == pytest.approx(0.0, abs=1e-7)


def test_a_failing_reward_is_counted_not_fatal(tmp_path, tokenizer):
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        rollout={"max_response_length": 12},
        grpo={"reward": "grpo_helpers:explodes_on_x"},
    )
    failures = 0
    for step in range(3):
        metrics, ro = trainer.train_step(step)
        failures += len(ro.failures)
        assert metrics["reward/failures"] == len(ro.failures)
        for f in ro.failures:
            assert "x" in f.response and "KeyError" in f.error and f.sample["answer"] in "0123456789"
    assert failures > 0


def test_rollouts_depend_only_on_seed_and_step(tmp_path, tokenizer):
    a = make_trainer(tmp_path, tokenizer)
    b = make_trainer(tmp_path, tokenizer)
    assert a.rollout(5).sequences == b.rollout(5).sequences
    assert a.rollout(5).sequences != a.rollout(6).sequences
    assert len(a.rollout(0).sequences) == 2 * 4


def test_held_out_evaluation_samples_val_n_at_val_temperature_with_a_fixed_seed(tmp_path, tokenizer,
                                                                                 monkeypatch):
    """rollout.val_n responses per held-out prompt at rollout.val_temperature, from the same seed at every
    evaluation (before and after compare policies, not draws); the default answers once, greedily."""
    import mlite.trainers.grpo.rollout as grpo_rollout

    calls, real = [], grpo_rollout.generate

    def spy(model, prompts, params, generator=None):
        completions = real(model, prompts, params, generator)
        calls.append((len(prompts), params.temperature, [c.response_ids for c in completions]))
        return completions

    monkeypatch.setattr(grpo_rollout, "generate", spy)
    sampled = make_trainer(tmp_path, tokenizer,
                           rollout={"val_n": 3, "val_temperature": 1.0, "max_response_length": 6})
    first, again = sampled.evaluate(sampled.prompts[:5]), sampled.evaluate(sampled.prompts[:5])
    assert [c[:2] for c in calls] == [(15, 1.0), (15, 1.0)] and first["eval/prompts"] == 5
    assert calls[0][2] == calls[1][2] and first == again  # same draws both times
    assert len({tuple(r) for r in calls[0][2][:3]}) > 1  # one prompt's 3 samples differ: sampled, not greedy
    calls.clear()
    greedy = make_trainer(tmp_path, tokenizer, rollout={"max_response_length": 6})
    greedy.evaluate(greedy.prompts[:5])
    assert [c[:2] for c in calls] == [(5, 0.0)]


@pytest.mark.gpu
def test_grpo_steps_on_cuda_in_bf16(tmp_path, tokenizer):
    trainer = make_trainer(
        tmp_path, tokenizer, cluster={"gpu": "h100"}, precision={"compute": "bf16"},
        trainer={"device": "cuda"}, grpo={"kl_coef": 0.05, "mini_batches": 2},
    )
    assert trainer.runtime.device.type == "cuda"
    before = params(trainer).clone()
    for step in range(3):
        metrics, ro = trainer.train_step(step)
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
        assert len(ro.completions) == 8
    assert not torch.equal(before, params(trainer))
    assert metrics["actor/kl_ref"] > 0


def test_a_response_the_sampler_decoded_wrongly_is_vetoed_out_of_the_update(tmp_path, tokenizer):
    """rollout.mismatch_veto: a response with one token whose sampler log-prob is far from the trainer's (a
    broken decode gives garbage or NaN there) trains nothing; the others train as before. With every
    response vetoed the gradient is zero; with a veto no token reaches, the update is the plain one."""

    def corrupted(trainer, which):  # the engine reports a wrong log-prob on the first token of `which`
        rollout = trainer.rollout

        def broken(step):
            ro = rollout(step)
            for i in which(len(ro.completions)):
                ro.completions[i].logprobs[0] = float("nan") if i % 2 else ro.completions[i].logprobs[0] - 30
            return ro

        trainer.rollout = broken
        return trainer

    plain = make_trainer(tmp_path, tokenizer)
    wide = corrupted(make_trainer(tmp_path, tokenizer, rollout={"mismatch_veto": 1e3}), lambda n: [])
    one = corrupted(make_trainer(tmp_path, tokenizer, rollout={"mismatch_veto": 5.0}), lambda n: [0, 3])
    every = corrupted(make_trainer(tmp_path, tokenizer, rollout={"mismatch_veto": 5.0}), range)
    grads = [record_grads(t) for t in (plain, wide, one, every)]
    m_plain, _ = plain.train_step(0)
    m_wide, ro_wide = wide.train_step(0)
    m_one, ro_one = one.train_step(0)
    m_every, ro_every = every.train_step(0)
    n = len(ro_one.completions)
    assert ro_wide.vetoed == set() and m_wide["rollout/vetoed_frac"] == 0.0
    assert torch.equal(grads[0][0], grads[1][0])  # nothing reached the veto: the plain update
    assert ro_one.vetoed == {0, 3} and m_one["rollout/vetoed_frac"] == pytest.approx(2 / n)
    assert m_one["rollout/logprob_diff_nonfinite"] > 0  # the NaN still shows in the mismatch figures
    assert grads[2][0].norm() > 0 and not torch.allclose(grads[2][0], grads[0][0])
    assert ro_every.vetoed == set(range(n)) and m_every["rollout/vetoed_frac"] == 1.0
    assert float(grads[3][0].abs().max()) == 0.0  # nothing left to learn from
    assert "rollout/vetoed_frac" not in m_plain
