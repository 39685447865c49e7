"""GRPO on the mlite runtime: one step of the shared loop (mlite.trainers.loop).

One step: sample `prompts_per_step` prompts x `rollout.n` responses with the rollout engine (`rollout.engine`:
the built-in sampler, or vLLM with the weights synced every step) -> score them -> group-normalised
advantages -> old log-probs with the runtime's forward-only path (and the reference policy's, through the
same path with the initial weights swapped in, when KL is on), compared with the sampler's own
(`rollout/logprob_diff_*`; `rollout.importance_correction: tis` weights each token by their ratio) ->
`grpo.ppo_epochs` passes over `grpo.mini_batches` mini-batches, one optimizer update each. Rollouts draw
on a seed of (seed, step), so a resumed run samples exactly what the uninterrupted run sampled.

Under data parallel, each dp rank (with its tp, cp and pp ranks) generates only the prompts it owns, every
dp-th prompt's whole group of `rollout.n` responses (`owners`); the ranks then exchange the completions, so
every rank holds the step's rollout, and score, log-probs and update go on as on one process: every logged
figure is one process's for the same prompts and seeds. (Training each rank on its own groups alone would
change a MoE's balance loss, which pools router statistics per micro-batch, so the update keeps the step's
micro-batches as one process plans them.)
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, pairwise
from pathlib import Path

import torch

from mlite.config.schema import JobConfig
from mlite.errors import MliteError
from mlite.plan.rules import planned_device_type
from mlite.runtime.data.packed import IGNORE, PackedBatch
from mlite.runtime.data.packing import plan_step
from mlite.runtime.data.tokenizer import load_tokenizer
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
    truncated_importance_weights,
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
    max_tokens: int,
    dp_size: int = 1,
    dp_rank: int = 0,
) -> list[tuple[list[int], PackedBatch]]:
    """This dp rank's share of the sequences in micro-batches of at most `max_tokens` tokens, by the SFT
    data's planner (mlite.runtime.data.packing.plan_step: balanced by tokens, the same number of micro-batches
    on every rank). Returns (indices of the sequences, batch) pairs; `extras` are per-sequence per-token
    tensors. Under dp, a micro-batch left without a sequence is one pad token with no target (zero extras):
    it adds nothing to the loss and keeps the ranks' collectives in lockstep."""
    plan = plan_step([len(s) for s in sequences], dp_size, max_tokens=max_tokens)
    out = []
    for idx in plan[dp_rank]:
        if not idx:
            if dp_size == 1:
                continue
            pad = PackedBatch.from_sequences([[0]], [[0]])
            pad.extras = {name: torch.zeros(1, dtype=values[0].dtype) for name, values in extras.items()}
            out.append((idx, pad))
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
        self.max_tokens = job.data.max_tokens_per_micro_batch or (
            job.data.micro_batch_size * (job.rollout.max_prompt_length + job.rollout.max_response_length)
        )

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
        n = self.rollout_cfg.n
        prompts = [p for p in self.step_prompts(step) for _ in range(n)]
        groups = torch.arange(len(prompts)) // n
        owners = self.owners(len(prompts) // n, n)
        with self.engine.session(self.job.trainer.seed * 1_000_003 + step) as sampler:
            mine = sampler.generate([p.ids for p in prompts], self.sampling_params(), owners)
        completions = self._exchanged(mine, owners)
        texts = [self.tokenizer.decode(c.response_ids, skip_special_tokens=True) for c in completions]
        scores, failures = score_responses(self.reward_fn, texts, [p.sample for p in prompts])
        return RolloutBatch(prompts, completions, texts, torch.tensor(scores), groups, failures)

    def _exchanged(self, mine: list[Completion], owners: list[int]) -> list[Completion]:
        """Every rank's completions, in request order, from this rank's (`mine`: the requests its dp rank
        owns): one exchange over dp."""
        rt = self.runtime
        if rt.dp_size == 1:
            return mine
        parts: list = [None] * rt.dp_size
        torch.distributed.all_gather_object(parts, mine, group=rt.dp_group)
        turns = [iter(part) for part in parts]
        return [next(turns[owner]) for owner in owners]

    # ---------------------------------------------------------------------------------- log-probs
    def _per_sequence_logprobs(
        self, model_fn: Callable[[list[PackedBatch]], list[torch.Tensor]], ro: RolloutBatch
    ):
        """Each response's per-token log-probs under `model_fn`. Under dp each rank computes its share (split
        as the update splits a mini-batch, in lockstep) and writes it into the step's flat stream, zeros
        elsewhere; one sum over dp (each value written by one rank: exact) gives every rank all of them."""
        rt = self.runtime
        lengths = [len(s) for s in ro.sequences]
        starts = [0, *accumulate(lengths)]
        stream = torch.zeros(starts[-1], dtype=torch.float32)
        packed = pack_micro_batches(ro.sequences, ro.loss_masks, {}, self.max_tokens, rt.dp_size, rt.dp_rank)
        for (idx, batch), logprobs in zip(packed, model_fn([b for _, b in packed])):
            for i, values in zip(idx, batch.split(logprobs.cpu())):
                stream[starts[i] : starts[i + 1]] = values
        if rt.dp_size > 1:
            on_device = stream.to(rt.device)
            torch.distributed.all_reduce(on_device, group=rt.dp_group)
            stream = on_device.cpu()
        return list(stream.split(lengths))

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
        rewards = ro.rewards
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
        rollout's per-token importance weights, when corrected)."""
        n = len(ro.sequences)
        extras = self._loss_extras(ro, old, ref, adv, is_weights)
        totals: dict[str, float] = {}
        weights: dict[str, float] = {}
        grad_norms = []
        self.runtime.train()
        for epoch in range(self.cfg.ppo_epochs):
            order = list(range(n))
            random.Random(self.job.trainer.seed * 31 + step * 1009 + epoch).shuffle(order)
            for mini in range(self.cfg.mini_batches):
                idx = order[mini :: self.cfg.mini_batches]
                seqs = [ro.sequences[i] for i in idx]
                masks = [ro.loss_masks[i] for i in idx]
                mini_extras = {k: [v[i] for i in idx] for k, v in extras.items()}
                # every rank holds the whole rollout; each dp rank trains on its share of the mini-batch
                packed = pack_micro_batches(seqs, masks, mini_extras, self.max_tokens,
                                            self.runtime.dp_size, self.runtime.dp_rank)
                micro = [b for _, b in packed]
                norm = self._mini_batch_norm([masks[i] for chosen, _ in packed for i in chosen])
                self.runtime.zero_grad()
                outs = self.runtime.forward_backward(
                    micro, self._loss_fn(norm), with_entropy=True, temperature=self.temperature
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

    def _mini_batch_norm(self, mine: list[list[int]]) -> LossNorm:
        """The mini-batch's global token and sequence counts, which every rank's loss divides by (`mine`:
        the loss masks of this dp rank's share)."""
        # global counts: summed over the loss group (dp_cp), whose cp ranks each hold this dp
        # rank's whole share (the runtime splits every micro-batch over cp), so divided by cp
        cp = self.runtime.dims.cp
        return LossNorm(
            num_tokens=int(self.runtime.global_sum(sum(sum(m) for m in mine))) // cp,
            num_sequences=int(self.runtime.global_sum(sum(1 for m in mine if any(m)))) // cp,
            horizon=self.rollout_cfg.max_response_length,
        )

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
        lengths = torch.tensor([len(c.response_ids) for c in ro.completions], dtype=torch.float32)
        label_masks = ro.label_masks
        mask = torch.cat(label_masks)
        tokens = mask.sum().clamp(min=1)
        metrics.update(logprob_mismatch(torch.cat(old), torch.cat(sampler), mask,
                                        self.rollout_cfg.mismatch_threshold))
        if is_weights is not None:
            metrics["rollout/is_weight_mean"] = float((torch.cat(is_weights) * mask).sum() / tokens)
        metrics.update(self.engine.stats)
        if ref is not None:
            kl = torch.cat(
                [kl_estimate(o, r, self.cfg.kl_estimator) * m for o, r, m in zip(old, ref, label_masks)]
            )
            metrics["actor/kl_ref"] = float(kl.sum() / tokens)
        metrics.update(
            {
                "reward/mean": float(ro.rewards.mean()),
                "reward/std": float(ro.rewards.std()) if len(ro.rewards) > 1 else 0.0,
                "reward/failures": float(len(ro.failures)),
                "response/length_mean": float(lengths.mean()),
                "response/length_max": float(lengths.max()),
                "response/clip_ratio": float(
                    sum(not c.stopped for c in ro.completions) / len(ro.completions)
                ),
                "time/rollout_s": rollout_s,
                "time/rollout_tokens_per_s": float(lengths.sum()) / max(rollout_s, 1e-9),  # generated tokens
                "tokens": float(sum(len(s) for s in ro.sequences)),
            }
        )
        return metrics, ro

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
        scores: list[float] = []
        with self.engine.session(self.job.trainer.seed * 1_000_003 - 1) as sampler:
            for start in range(0, len(asked), batch_size):
                chunk = asked[start : start + batch_size]
                completions = sampler.generate([p.ids for p in chunk], params)
                texts = [self.tokenizer.decode(c.response_ids, skip_special_tokens=True) for c in completions]
                chunk_scores, _ = score_responses(self.reward_fn, texts, [p.sample for p in chunk])
                scores.extend(chunk_scores)
        return {"eval/reward_mean": sum(scores) / max(len(scores), 1), "eval/prompts": float(len(prompts))}


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
