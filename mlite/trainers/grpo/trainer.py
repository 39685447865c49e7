"""GRPO on the mlite runtime: one step of the shared loop (mlite.trainers.loop).

One step: sample `prompts_per_step` prompts x `rollout.n` responses with the rollout engine (`rollout.engine`:
the built-in sampler, or vLLM with the weights synced every step) -> score them -> group-normalised
advantages -> old log-probs with the runtime's forward-only path (and the reference policy's, through the
same path with the initial weights swapped in, when KL is on), compared with the sampler's own
(`rollout/logprob_diff_*`; `rollout.importance_correction: tis` weights each token by their ratio) ->
`grpo.ppo_epochs` passes over `grpo.mini_batches` mini-batches, one optimizer update each. Rollouts draw
on a seed of (seed, step), so a resumed run samples exactly what the uninterrupted run sampled.

Under data parallel, each dp rank (with its tp, cp and pp ranks) owns every dp-th prompt of the step with its
whole group of `rollout.n` responses (`owners`): it generates, scores and trains on those alone, so the
group's advantages need no exchange. Only numbers cross dp: the step's figures as sums and maxima, the
micro-batch counts that keep the ranks' collectives in lockstep, the loss's global token and sequence
counts, and the gradient reduction. A mini-batch is the same set of responses as on one process (one
global shuffle, each rank its own of them), its loss is normalised by global counts, and a MoE's balance
loss is the mean over the mini-batch's real micro-batches of every rank (the fillers weigh 0), so every
logged figure is one process's for the same prompts and seeds.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import torch

from mlite.config.catalog import resolve_arch
from mlite.config.schema import JobConfig
from mlite.errors import MliteError
from mlite.plan.rules import planned_device_type
from mlite.runtime.data.packed import IGNORE, PackedBatch
from mlite.runtime.data.packing import plan_step
from mlite.runtime.data.tokenizer import check_token_ids, load_tokenizer
from mlite.runtime.engine import Runtime
from mlite.trainers import loop
from mlite.trainers.grpo.algorithm import (
    GRPOLossConfig,
    LossNorm,
    group_advantages,
    grpo_loss,
    kl_estimate,
    kl_penalised_rewards,
    logprob_mismatch,
    mismatch_totals,
    truncated_importance_weights,
    vetoed_responses,
)
from mlite.trainers.grpo.prompts import Prompt, read_prompt_rows, render_prompts
from mlite.trainers.grpo.rewards import RewardFailure, load_reward, score_responses
from mlite.trainers.grpo.rollout import BuiltinRollout, Completion, RolloutEngine, SamplingParams
from mlite.trainers.grpo.vllm_rollout import VLLMRollout, require_vllm
from mlite.trainers.metrics import read_metrics
from mlite.trainers.run_folder import RunLock, check_output_dir
from mlite.trainers.watchdog import Watchdog

log = logging.getLogger(__name__)
PLOT_KEYS = ("reward/mean", "eval/reward_mean", "response/length_mean", "actor/pg_loss")


@dataclass
class RolloutBatch:
    prompts: list[Prompt]  # one per response (a prompt repeated n times)
    completions: list[Completion]
    texts: list[str]
    rewards: torch.Tensor  # [N]
    groups: torch.Tensor  # [N] prompt index: responses of one prompt form a group
    failures: list[RewardFailure] = field(default_factory=list)
    # under dp, this rank's responses of the step's: their positions in the step's requests, and how many
    # the step has over every rank (one process: all of them, in order)
    index: list[int] = field(default_factory=list)
    size: int = 0
    vetoed: set[int] = field(default_factory=set)  # positions left out of the update (rollout.mismatch_veto)

    @property
    def sequences(self) -> list[list[int]]:
        return [c.prompt_ids + c.response_ids for c in self.completions]

    @property
    def loss_masks(self) -> list[list[int]]:
        return [[0] * len(c.prompt_ids) + [1] * len(c.response_ids) for c in self.completions]

    @property
    def label_masks(self) -> list[torch.Tensor]:
        """Per sequence, 1 where the next token is a response token: the layout of the runtime's log-probs
        (position t holds the log-prob of token t + 1)."""
        return [torch.tensor(m[1:] + [0], dtype=torch.float32) for m in self.loss_masks]

    @property
    def trained_masks(self) -> list[list[int]]:
        """The loss masks the update trains on: a vetoed response's are all 0."""
        return [[0] * len(m) if i in self.vetoed else m for i, m in enumerate(self.loss_masks)]

    def sampler_logprobs(self) -> list[torch.Tensor]:
        """The sampler's log-probs of the response tokens, laid out as the runtime's (0 elsewhere)."""
        out = []
        for c in self.completions:
            values = torch.zeros(len(c.prompt_ids) + len(c.response_ids))
            start = len(c.prompt_ids) - 1
            values[start : start + len(c.logprobs)] = torch.tensor(c.logprobs, dtype=torch.float32)
            out.append(values)
        return out


def pack_micro_batches(
    sequences: Sequence[list[int]],
    loss_masks: Sequence[list[int]],
    extras: dict[str, Sequence[torch.Tensor]],
    max_tokens: int | None,
    micro_batches: int = 0,
    micro_batch_size: int | None = None,
) -> list[tuple[list[int], PackedBatch]]:
    """The sequences in micro-batches of at most `max_tokens` tokens (or of `micro_batch_size` sequences,
    data.dynamic_batch off), by the SFT data's planner (mlite.runtime.data.packing.plan_step: balanced by
    tokens), then filled up to `micro_batches` with
    fillers: one pad token with no target (zero extras), which add nothing to the loss and keep a rank
    with fewer sequences in lockstep with the others' collectives. Returns (indices of the sequences,
    batch) pairs, a filler's indices empty; `extras` are per-sequence per-token tensors."""
    plan = (plan_step([len(s) for s in sequences], 1, max_tokens=max_tokens,
                      micro_batch_size=micro_batch_size)[0] if sequences else [])
    out = []
    for idx in [i for i in plan if i] + [[]] * max(0, micro_batches - sum(1 for i in plan if i)):
        if not idx:
            filler = PackedBatch.from_sequences([[0]], [[0]])
            filler.extras = {name: torch.zeros(1) for name in extras}
            out.append((idx, filler))
            continue
        batch = PackedBatch.from_sequences([sequences[i] for i in idx], [loss_masks[i] for i in idx])
        batch.extras = {name: torch.cat([values[i] for i in idx]) for name, values in extras.items()}
        out.append((idx, batch))
    return out


class GRPOTrainer:
    def __init__(self, job: JobConfig, runtime, tokenizer, prompts: Sequence[Prompt],
                 val_prompts: Sequence[Prompt] = (), engine: RolloutEngine | None = None):
        if job.grpo is None or job.rollout is None:
            raise ValueError("GRPOTrainer needs a job: grpo config")
        self.job, self.runtime, self.tokenizer = job, runtime, tokenizer
        self.engine = engine or BuiltinRollout(runtime)
        self.prompts, self.val_prompts = list(prompts), list(val_prompts)
        self.failures: list[str] = []  # the first few reward failures, each with its sample
        self.cfg, self.rollout_cfg = job.grpo, job.rollout
        self.reward_fn = load_reward(job.grpo.reward)
        self.loss_cfg = GRPOLossConfig(
            clip_low=job.grpo.clip_low,
            clip_high=job.grpo.clip_high,
            loss_agg=job.grpo.loss_agg,
            kl_coef=0.0 if job.grpo.kl_in_reward else job.grpo.kl_coef,
            kl_estimator=job.grpo.kl_estimator,
            entropy_coef=job.grpo.entropy_coef,
        )
        # the reference policy is the initial one: this rank's shards of the weights, snapshot before any
        # update or checkpoint load, and run through the runtime's own forward path (any layout)
        self.reference = runtime.snapshot_weights() if job.grpo.kl_coef > 0 else None
        self.stop_ids = stop_token_ids(tokenizer)
        # log-probs are those of the sampling distribution (logits / temperature), as verl computes them
        self.temperature = job.rollout.temperature if job.rollout.temperature > 0 else 1.0
        # micro-batches packed to a token budget, or of data.micro_batch_size sequences (dynamic_batch off)
        self.max_tokens = job.data.max_tokens_per_micro_batch
        self.micro_batch_size = None if job.data.dynamic_batch else job.data.micro_batch_size

    # ------------------------------------------------------------------------------------ rollout
    def step_prompts(self, step: int) -> list[Prompt]:
        """The prompts of step `step` (0-based): consecutive slices of a per-epoch shuffle."""
        per_step = self.rollout_cfg.prompts_per_step
        start = step * per_step
        chosen = []
        for k in range(start, start + per_step):
            epoch, pos = divmod(k, len(self.prompts))
            order = list(range(len(self.prompts)))
            if self.job.data.shuffle:
                random.Random(self.job.trainer.seed * 7919 + epoch).shuffle(order)
            chosen.append(self.prompts[order[pos]])
        return chosen

    def sampling_params(self, held_out: bool = False) -> SamplingParams:
        r = self.rollout_cfg
        return SamplingParams(
            max_new_tokens=r.max_response_length,
            temperature=r.val_temperature if held_out else r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            stop_token_ids=self.stop_ids,
        )

    def owners(self, prompts: int, n: int) -> list[int]:
        """The data-parallel rank that generates each of `prompts` x `n` responses: prompt i's group of n goes
        to rank i mod dp, so ranks differ by one prompt at most and a group never spans two."""
        return [i % self.runtime.dp_size for i in range(prompts) for _ in range(n)]

    def rollout(self, step: int) -> RolloutBatch:
        """This dp rank's responses of step `step`: its prompts' groups, generated and scored here."""
        n = self.rollout_cfg.n
        asked = [p for p in self.step_prompts(step) for _ in range(n)]
        owners = self.owners(len(asked) // n, n)
        with self.engine.session(self.job.trainer.seed * 1_000_003 + step) as sampler:
            completions = sampler.generate([p.ids for p in asked], self.sampling_params(), owners)
        index = [i for i, owner in enumerate(owners) if owner == self.runtime.dp_rank]
        prompts = [asked[i] for i in index]
        texts = [self.tokenizer.decode(c.response_ids, skip_special_tokens=True) for c in completions]
        scores, failures = score_responses(self.reward_fn, texts, [p.sample for p in prompts])
        groups = torch.tensor(index, dtype=torch.long) // n
        return RolloutBatch(prompts, completions, texts, torch.tensor(scores, dtype=torch.float32), groups,
                            failures, index, len(asked))

    def _packed(self, sequences, loss_masks, extras) -> list[tuple[list[int], PackedBatch]]:
        """This rank's sequences in micro-batches, as many as the dp rank with the most (one number over
        dp), so that every rank's collectives (FSDP2's gathers, the expert exchange) stay in lockstep."""
        mine = pack_micro_batches(sequences, loss_masks, extras, self.max_tokens,
                                  micro_batch_size=self.micro_batch_size)
        (most,) = self.runtime.dp_reduce([float(len(mine))], "max")
        return mine + pack_micro_batches([], [], extras, self.max_tokens, int(most) - len(mine))  # fillers

    # ---------------------------------------------------------------------------------- log-probs
    def _per_sequence_logprobs(
        self, model_fn: Callable[[list[PackedBatch]], list[torch.Tensor]], ro: RolloutBatch
    ) -> list[torch.Tensor]:
        """Each of this rank's responses' per-token log-probs under `model_fn`."""
        packed = self._packed(ro.sequences, ro.loss_masks, {})
        out: list[torch.Tensor] = [torch.zeros(0)] * len(ro.sequences)
        for (idx, batch), logprobs in zip(packed, model_fn([b for _, b in packed])):
            for i, values in zip(idx, batch.split(logprobs.cpu())):
                out[i] = values
        return out

    def old_logprobs(self, ro: RolloutBatch) -> list[torch.Tensor]:
        def run(batches):
            outs = self.runtime.forward_backward(
                batches, None, forward_only=True, temperature=self.temperature
            )
            return [o["logprobs"] for o in outs]

        self.runtime.eval()
        return self._per_sequence_logprobs(run, ro)

    def reference_logprobs(self, ro: RolloutBatch) -> list[torch.Tensor]:
        def run(batches):
            outs = self.runtime.forward_with_weights(self.reference, batches, temperature=self.temperature)
            return [o["logprobs"] for o in outs]

        self.runtime.eval()
        return self._per_sequence_logprobs(run, ro)

    # ------------------------------------------------------------------------------------- update
    def advantages(self, ro: RolloutBatch, old: list[torch.Tensor], ref: list[torch.Tensor] | None):
        """Group-normalised advantages of this rank's responses (whole groups: no exchange)."""
        rewards = ro.rewards
        if not ro.completions:  # more dp ranks than prompts: this one trains on fillers only
            return rewards
        if self.cfg.kl_in_reward and ref is not None:
            masks = ro.label_masks
            seq_ids = torch.cat([torch.full((len(m),), i) for i, m in enumerate(masks)])
            rewards = kl_penalised_rewards(
                rewards,
                torch.cat(old),
                torch.cat(ref),
                torch.cat(masks),
                seq_ids,
                self.cfg.kl_coef,
                self.cfg.kl_estimator,
            )
        return group_advantages(rewards, ro.groups, std_norm=self.cfg.adv_std_norm)

    def update(self, step: int, ro: RolloutBatch, old, ref, adv: torch.Tensor,
               is_weights: list[torch.Tensor] | None = None) -> dict[str, float]:
        """`ppo_epochs` x `mini_batches` optimizer updates over this step's responses (`is_weights`: the
        rollout's per-token importance weights, when corrected). A mini-batch is a slice of one shuffle of
        the step's responses over every rank; each rank trains on its own of them."""
        extras = self._loss_extras(ro, old, ref, adv, is_weights)
        position = {request: i for i, request in enumerate(ro.index)}
        totals: dict[str, float] = {}
        weights: dict[str, float] = {}
        grad_norms = []
        self.runtime.train()
        for epoch in range(self.cfg.ppo_epochs):
            order = list(range(ro.size))
            random.Random(self.job.trainer.seed * 31 + step * 1009 + epoch).shuffle(order)
            for mini in range(self.cfg.mini_batches):
                idx = [position[i] for i in order[mini :: self.cfg.mini_batches] if i in position]
                masks = [ro.trained_masks[i] for i in idx]
                packed = self._packed([ro.sequences[i] for i in idx], masks,
                                      {k: [v[i] for i in idx] for k, v in extras.items()})
                norm, real = self._mini_batch_norm(masks, sum(1 for chosen, _ in packed if chosen))
                self.runtime.zero_grad()
                outs = self.runtime.forward_backward(
                    [b for _, b in packed], self._loss_fn(norm), with_entropy=True,
                    temperature=self.temperature,
                    aux_weights=[1.0 / real if chosen else 0.0 for chosen, _ in packed],
                )
                grad_norm, _skipped = self.runtime.optimizer_step()
                grad_norms.append(float(grad_norm))
                self._add_metrics(outs, totals, weights)
        metrics = self._step_metrics(totals, weights)
        metrics["actor/grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics["actor/lr"] = self.runtime.lr
        self.runtime.lr_scheduler_step()
        return metrics

    def _loss_extras(self, ro: RolloutBatch, old, ref, adv: torch.Tensor,
                     is_weights: list[torch.Tensor] | None) -> dict[str, list[torch.Tensor]]:
        """What the loss reads beside the new log-probs, per sequence and token, packed with the batches:
        the old log-probs, each response's advantage spread over its tokens, and when they count, the
        reference's log-probs and the importance weights."""
        extras = {
            "old_logprobs": old,
            "advantages": [torch.full((len(s),), float(a)) for s, a in zip(ro.sequences, adv)],
        }
        if ref is not None and self.loss_cfg.kl_coef > 0:
            extras["ref_logprobs"] = ref
        if is_weights is not None:
            extras["is_weights"] = is_weights
        return extras

    def _mini_batch_norm(self, mine: list[list[int]], micro_batches: int) -> tuple[LossNorm, int]:
        """The mini-batch's token and sequence counts over every dp rank, which every rank's loss divides
        by, and its real micro-batches over every rank, over which the balance loss is averaged (`mine`:
        the loss masks of this rank's responses; `micro_batches`: its real micro-batches). One collective
        over dp."""
        tokens, sequences, real = self.runtime.dp_reduce(
            [float(sum(sum(m) for m in mine)), float(sum(1 for m in mine if any(m))), float(micro_batches)]
        )
        # at least 1: a mini-batch whose responses are all vetoed has nothing to divide, and trains nothing
        norm = LossNorm(num_tokens=max(int(tokens), 1), num_sequences=max(int(sequences), 1),
                        horizon=self.rollout_cfg.max_response_length)
        return norm, max(int(real), 1)

    def _loss_fn(self, norm: LossNorm) -> Callable:
        """The runtime's loss callback for one mini-batch (mlite.runtime.forward): GRPO's loss of a
        micro-batch under the mini-batch's `norm`, plus the runtime's share of the MoE balance loss."""

        def loss_fn(batch: PackedBatch, logprobs, entropy, aux_loss):
            mask = batch.labels != IGNORE
            loss, metrics = grpo_loss(
                self.loss_cfg,
                logprobs,
                batch.extras["old_logprobs"],
                batch.extras["advantages"],
                mask,
                batch.sequence_ids(),
                batch.num_sequences,
                norm,
                entropy,
                batch.extras.get("ref_logprobs"),
                batch.extras.get("is_weights"),
            )
            metrics["tokens"] = mask.sum()
            return loss + aux_loss, metrics  # the runtime's share of the MoE balance loss

        return loss_fn

    def _add_metrics(self, outs: list[dict], totals: dict[str, float], weights: dict[str, float]) -> None:
        """Add a mini-batch's micro-batch metrics into this rank's running `totals` and their `weights`:
        token-weighted, but pg_loss, whose micro-batch shares already add up to the mini-batch loss."""
        for out in outs:  # read on the host here: a GRPO step waits on its rollout anyway
            values = {key: float(value) for key, value in out["metrics"].items()}
            tokens = values.pop("tokens")
            for key, value in values.items():
                if key == "actor/pg_loss":  # micro-batch shares add up to the mini-batch loss
                    totals[key] = totals.get(key, 0.0) + value / (
                        self.cfg.ppo_epochs * self.cfg.mini_batches
                    )
                    weights[key] = 1.0
                else:
                    totals[key] = totals.get(key, 0.0) + value * tokens
                    weights[key] = weights.get(key, 0.0) + tokens

    def _step_metrics(self, totals: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
        """The step's metrics from every rank's `totals` and `weights` (collective over the loss group)."""
        # each rank's figures cover its share of the tokens (a cp share of its dp share of the step's
        # responses, the pg_loss shares normalised by the global counts): summed over the loss group they
        # are the step's, as SFT's loss is (one process: the sums are the values)
        metrics = {}
        for key in sorted(totals):  # the same keys, in the same order, on every rank
            total = self.runtime.global_sum(totals[key])
            weight = weights[key] if key == "actor/pg_loss" else self.runtime.global_sum(weights[key])
            if weight:
                metrics[key] = total / weight
        return metrics

    def train_step(self, step: int) -> tuple[dict[str, float], RolloutBatch]:
        started = time.perf_counter()
        ro = self.rollout(step)
        rollout_s = time.perf_counter() - started
        self.runtime.reset_memory_peak()  # the training phase's own peak, apart from the rollout's
        started = time.perf_counter()
        old = self.old_logprobs(ro)
        ref = self.reference_logprobs(ro) if self.reference is not None else None
        logprobs_s = time.perf_counter() - started
        adv = self.advantages(ro, old, ref)
        sampler = ro.sampler_logprobs()
        if self.rollout_cfg.mismatch_veto is not None:
            ro.vetoed = vetoed_responses(old, sampler, ro.label_masks, self.rollout_cfg.mismatch_veto)
        is_weights = None
        if self.rollout_cfg.importance_correction == "tis":
            is_weights = [truncated_importance_weights(o, s, self.rollout_cfg.importance_cap)
                          for o, s in zip(old, sampler)]
        started = time.perf_counter()
        metrics = self.update(step, ro, old, ref, adv, is_weights)
        metrics.update({"time/logprobs_s": logprobs_s, "time/update_s": time.perf_counter() - started})
        peak = self.runtime.memory_peak_gb()
        if peak is not None:
            metrics["memory/train_gb"] = peak
        metrics.update(self.engine.stats)
        metrics.update(self._rollout_figures(ro, old, ref, sampler, is_weights, rollout_s))
        return metrics, ro

    def _rollout_figures(self, ro: RolloutBatch, old, ref, sampler, is_weights, rollout_s: float):
        """The step's rollout figures (rewards, lengths, mismatch, KL to the reference), from this rank's
        responses: sums and maxima over dp, two collectives of numbers."""
        masks = ro.label_masks
        mask = torch.cat(masks) if masks else torch.zeros(0)
        lengths = [len(c.response_ids) for c in ro.completions]
        mismatch = mismatch_totals(torch.cat(old) if old else mask, torch.cat(sampler) if sampler else mask,
                                   mask, self.rollout_cfg.mismatch_threshold)
        sums = {
            "responses": float(len(lengths)),
            "reward": float(ro.rewards.double().sum()),
            "reward_squares": float((ro.rewards.double() ** 2).sum()),
            "failures": float(len(ro.failures)),
            "length": float(sum(lengths)),
            "clipped": float(sum(not c.stopped for c in ro.completions)),
            "tokens": float(sum(len(s) for s in ro.sequences)),
            "response_tokens": float(mask.sum()),
            **{f"mismatch_{k}": v for k, v in mismatch.items() if k != "max"},
            "vetoed": float(len(ro.vetoed)),
        }
        if is_weights is not None:
            sums["is_weight"] = float(sum(float((w * m).sum()) for w, m in zip(is_weights, masks)))
        if ref is not None:
            sums["kl_ref"] = float(sum(float((kl_estimate(o, r, self.cfg.kl_estimator) * m).sum())
                                       for o, r, m in zip(old, ref, masks)))
        keys = list(sums)
        sums = dict(zip(keys, self.runtime.dp_reduce([sums[k] for k in keys])))
        longest, mismatch_max = self.runtime.dp_reduce([float(max(lengths, default=0)), mismatch["max"]],
                                                       "max")
        n, tokens = sums["responses"], max(sums["response_tokens"], 1.0)
        mean = sums["reward"] / n
        figures = logprob_mismatch({**{k: sums[f"mismatch_{k}"] for k in mismatch if k != "max"},
                                    "max": mismatch_max})
        if is_weights is not None:
            figures["rollout/is_weight_mean"] = sums["is_weight"] / tokens
        if self.rollout_cfg.mismatch_veto is not None:
            figures["rollout/vetoed_frac"] = sums["vetoed"] / n
        if ref is not None:
            figures["actor/kl_ref"] = sums["kl_ref"] / tokens
        variance = (sums["reward_squares"] - n * mean * mean) / (n - 1) if n > 1 else 0.0
        figures.update({
            "reward/mean": mean,
            "reward/std": math.sqrt(max(variance, 0.0)),
            "reward/failures": sums["failures"],
            "response/length_mean": sums["length"] / n,
            "response/length_max": longest,
            "response/clip_ratio": sums["clipped"] / n,
            "time/rollout_s": rollout_s,
            "time/rollout_tokens_per_s": sums["length"] / max(rollout_s, 1e-9),  # generated tokens
            "tokens": sums["tokens"],
        })
        return figures

    # ------------------------------------------------------------------------ the loop's interface
    name, plot_keys, plot_file, eval_at_start = "grpo", PLOT_KEYS, "grpo.png", True

    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.prompts) / self.rollout_cfg.prompts_per_step)

    def step(self, index: int) -> loop.StepResult:
        metrics, ro = self.train_step(index)
        self.failures.extend(f.describe() for f in ro.failures[: max(0, 3 - len(self.failures))])
        return loop.StepResult(metrics, metrics["tokens"], ("pg_loss", metrics["actor/pg_loss"]),
                               f"reward {metrics['reward/mean']:.3f}")

    def state_dict(self) -> dict:
        return {}  # the step alone fixes the prompts and the sampler's seed

    def load_state_dict(self, state: dict) -> None:
        pass

    def summary_lines(self, result: loop.RunResult) -> list[str]:
        lines = []
        records = [r for r in read_metrics(result.metrics_path) if "reward/mean" in r]
        if records:
            # one step's reward is noisy (a few prompts): compare the first and last fifths of the run
            curve = reward_curve([r["step"] for r in records], [r["reward/mean"] for r in records])
            (lo0, hi0, first), (lo1, hi1, last) = curve[0], curve[-1]
            lines.append(f"train reward {first:.3f} (steps {lo0}-{hi0}) -> {last:.3f} (steps {lo1}-{hi1}); "
                         f"by fifth of the run: {' '.join(f'{mean:.3f}' for _, _, mean in curve)}")
        before, after = held_out_before_after(result)
        if before is not None or after is not None:
            def fmt(v):
                return "-" if v is None else f"{v:.3f}"

            lines.append(f"held-out reward ({self.eval_sampling()}) {fmt(before)} before -> "
                         f"{fmt(after)} after")
        lines += [f"[yellow]{line}[/yellow]" for line in self.failures]
        return lines

    def eval_sampling(self) -> str:
        r = self.rollout_cfg
        if r.val_temperature == 0:
            return "greedy"
        return f"{r.val_n} per prompt at temperature {r.val_temperature:g}"

    # ---------------------------------------------------------------------------------- evaluate
    def evaluate(self, prompts: Sequence[Prompt] | None = None, batch_size: int = 64) -> dict[str, float]:
        """Held-out prompts (default: data.val_files') answered rollout.val_n times each at
        rollout.val_temperature (0: greedy): the mean reward; {} without held-out prompts. The sampler's
        seed is the same at every evaluation, so before and after draw the same random numbers and their
        difference is the policy's, not the dice's."""
        prompts = self.val_prompts if prompts is None else prompts
        if not prompts:
            return {}
        params, n = self.sampling_params(held_out=True), self.rollout_cfg.val_n
        asked = [p for p in prompts for _ in range(n)]
        owners = self.owners(len(prompts), n)  # each dp rank answers its own prompts; the sums cross dp
        scores: list[float] = []
        with self.engine.session(self.job.trainer.seed * 1_000_003 - 1) as sampler:
            for start in range(0, len(asked), batch_size):
                chunk = range(start, min(start + batch_size, len(asked)))
                completions = sampler.generate([asked[i].ids for i in chunk], params,
                                               [owners[i] for i in chunk])
                mine = [asked[i] for i in chunk if owners[i] == self.runtime.dp_rank]
                texts = [self.tokenizer.decode(c.response_ids, skip_special_tokens=True) for c in completions]
                chunk_scores, _ = score_responses(self.reward_fn, texts, [p.sample for p in mine])
                scores.extend(chunk_scores)
        total, count = self.runtime.dp_reduce([math.fsum(scores), float(len(scores))])
        return {"eval/reward_mean": total / max(count, 1.0), "eval/prompts": float(len(prompts))}


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """EOS and the chat template's end-of-turn token, when the vocabulary has them."""
    ids = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    for token in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid >= 0 and tid != getattr(tokenizer, "unk_token_id", None):
            ids.add(tid)
    return tuple(sorted(ids))


# ------------------------------------------------------------------------------------------ the run
@dataclass
class GRPOResult(loop.RunResult):
    # held-out mean reward before the first update (None without val prompts)
    eval_before: float | None = None
    eval_after: float | None = None
    reward_failures: list[str] = field(default_factory=list)  # the first few, each with its sample
    eval_sampling: str = "greedy"  # how the held-out prompts were answered, e.g. "4 samples at T=0.7"

    @property
    def rewards(self) -> list[float]:
        return [r["reward/mean"] for r in read_metrics(self.metrics_path) if "reward/mean" in r]


def held_out_before_after(result: loop.RunResult) -> tuple[float | None, float | None]:
    """The held-out reward at step 0 and after the last step, where this process evaluated them."""
    by_step = {e["step"]: e["eval/reward_mean"] for e in result.evals if "eval/reward_mean" in e}
    finished = result.stopped_by is None and result.last_step == result.total_steps
    return by_step.get(0), by_step.get(result.last_step) if finished else None


def load_prompts(files: Sequence[str], tokenizer, job: JobConfig, what: str) -> list[Prompt]:
    prompts, too_long = render_prompts(read_prompt_rows(files), tokenizer, job.rollout.max_prompt_length)
    if too_long:
        log.warning(
            "%d %s prompts are longer than rollout.max_prompt_length=%d and were skipped",
            too_long,
            what,
            job.rollout.max_prompt_length,
        )
    if not prompts and what == "train":
        raise MliteError(f"no usable GRPO prompts in {', '.join(files)} (skipped as too long: {too_long})")
    arch = resolve_arch(job.model)
    check_token_ids((p.ids for p in prompts), arch.vocab, arch.name, tokenizer,
                    str(job.data.tokenizer or job.model.path or "the caller's tokenizer"),
                    "data.train_files" if what == "train" else "data.val_files")
    return prompts


def train_grpo(job: JobConfig, console=None, show_progress: bool = True, tokenizer=None) -> GRPOResult:
    """Run (or continue) a GRPO job: rollouts, rewards, PPO updates, metrics, checkpoints, held-out eval."""
    if job.job != "grpo":
        raise MliteError(f"this job is '{job.job}'; run it with `mlite {job.job}`")
    if job.rollout.engine == "vllm" and planned_device_type(job) == "cuda":
        require_vllm()  # before any GPU work (on the CPU the rule book's line comes first)
    if not job.data.train_files:
        raise MliteError(
            "data.train_files is empty: GRPO needs prompt files (JSONL/parquet with prompt + answer)"
        )
    source = job.data.tokenizer or job.model.path
    if tokenizer is None and source is None:
        raise MliteError("GRPO needs a tokenizer: set data.tokenizer (a tokenizer dir) or use model.path")
    check_output_dir(job.trainer.output_dir)
    with Watchdog.for_job(job) as watch, RunLock(job.trainer.output_dir) as lock:
        watch.beat("start-up: the tokenizer and the prompts")
        tokenizer = tokenizer or load_tokenizer(source)
        train_prompts = load_prompts(job.data.train_files, tokenizer, job, "train")
        val_prompts = (load_prompts(job.data.val_files, tokenizer, job, "held-out") if job.data.val_files
                       else [])
        watch.beat("start-up: the runtime (process group, model, weights)")
        runtime = Runtime(job, on_placed=lock.acquire)
        engine = None
        try:  # the reference snapshot is taken here, before the loop loads any checkpoint
            watch.beat("start-up: the rollout engine, the reward and the reference policy")
            if job.rollout.engine == "vllm":
                engine = VLLMRollout(job, runtime, Path(job.trainer.output_dir) / "vllm_model")
            trainer = GRPOTrainer(job, runtime, tokenizer, train_prompts, val_prompts, engine)
        except BaseException:
            runtime.close(clean=False)
            raise
        try:
            result = loop.run(job, runtime, trainer, console, show_progress, watch)
        finally:
            trainer.engine.close()
    before, after = held_out_before_after(result)
    return GRPOResult(**vars(result), eval_before=before, eval_after=after, reward_failures=trainer.failures,
                      eval_sampling=trainer.eval_sampling())


def reward_curve(
    steps: Sequence[int], rewards: Sequence[float], parts: int = 5
) -> list[tuple[int, int, float]]:
    """(first step, last step, mean reward) of `parts` consecutive slices of the run (fewer when shorter)."""
    parts = max(1, min(parts, len(rewards)))
    bounds = [round(i * len(rewards) / parts) for i in range(parts + 1)]
    return [(steps[lo], steps[hi - 1], sum(rewards[lo:hi]) / (hi - lo)) for lo, hi in pairwise(bounds)]
