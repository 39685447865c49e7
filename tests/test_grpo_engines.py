"""Rollout engines: the sampler's log-probs against the trainer's forward (the mismatch metric), truncated
importance sampling, and the refusals of the vLLM engine where it cannot run. vLLM itself runs on the GPU
machine (tests/test_vllm_gpu.py); here the built-in sampler is the engine, and a sampler that draws at
another temperature than the trainer's is a real mismatched one."""

from __future__ import annotations

import math
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from grpo_helpers import char_tokenizer, grpo_job

from mlite.runtime.engine import Runtime
from mlite.trainers.grpo.algorithm import (
    GRPOLossConfig,
    LossNorm,
    grpo_loss,
    logprob_mismatch,
    mismatch_totals,
    truncated_importance_weights,
)
from mlite.trainers.grpo.prompts import render_prompts
from mlite.trainers.grpo.rollout import BuiltinRollout, ModelSampler
from mlite.trainers.grpo.trainer import GRPOTrainer

ROOT = Path(__file__).resolve().parents[1]
ROWS = [{"prompt": f"say {d}", "answer": str(d)} for d in range(10)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return char_tokenizer(tmp_path_factory.mktemp("tok"))


def make_trainer(tmp_path, tokenizer, engine_factory=None, **sections):
    job = grpo_job(tmp_path, **sections)
    prompts, _ = render_prompts(ROWS, tokenizer, job.rollout.max_prompt_length)
    runtime = Runtime(job)
    engine = engine_factory(runtime) if engine_factory else None
    return GRPOTrainer(job, runtime, tokenizer, prompts, engine=engine)


class HotterSampler(BuiltinRollout):
    """The built-in engine sampling at `temperature`, whatever the job's: its tokens and log-probs come
    from another policy than the one the trainer's forward computes (as a bf16 engine's differ)."""

    def __init__(self, runtime, temperature: float):
        super().__init__(runtime)
        self.temperature = temperature

    @contextmanager
    def session(self, seed):
        with super().session(seed) as sampler:
            outer = self

            class Hotter(ModelSampler):
                def generate(self, prompts, params, owners=None):
                    return super().generate(prompts, replace(params, temperature=outer.temperature), owners)

            yield Hotter(sampler.model, sampler.seed, sampler.dp_rank)


def test_builtin_sampler_logprobs_are_the_trainers_forward(tmp_path, tokenizer):
    """The built-in sampler's log-prob of each response token, laid out as the runtime's (position t holds
    token t + 1's), equals the trainer's forward-only log-prob of that token: the same model in fp32,
    through the KV cache on one side and the packed forward on the other."""
    trainer = make_trainer(tmp_path, tokenizer)
    ro = trainer.rollout(0)
    old = trainer.old_logprobs(ro)
    sampler, masks = ro.sampler_logprobs(), ro.label_masks
    for o, s, m, c in zip(old, sampler, masks, ro.completions):
        assert len(o) == len(s) == len(c.prompt_ids) + len(c.response_ids)
        assert int(m.sum()) == len(c.response_ids) == len(c.logprobs)
        assert torch.all(s[m.bool()] < 0) and torch.all(s[~m.bool()] == 0)
        torch.testing.assert_close(s[m.bool()], o[m.bool()], atol=1e-5, rtol=1e-5)
    metrics, _ = trainer.train_step(1)
    assert metrics["rollout/logprob_diff_mean"] < 1e-5 and metrics["rollout/logprob_diff_frac"] == 0.0
    assert "rollout/is_weight_mean" not in metrics  # no correction asked for


def test_a_mismatched_sampler_is_measured_and_tis_corrects_the_loss(tmp_path, tokenizer):
    """A sampler at temperature 2 against a trainer at 1: the mismatch metric sees it (and its threshold
    counts the tokens over it), and importance_correction: tis changes the update, with weights capped at
    importance_cap; the same run without the correction trains on the uncorrected loss."""
    runs = {}
    for name, rollout in [("plain", {}), ("tis", {"importance_correction": "tis", "importance_cap": 1.5}),
                          ("strict", {"mismatch_threshold": 0.01})]:
        trainer = make_trainer(tmp_path / name, tokenizer, lambda rt: HotterSampler(rt, 2.0), rollout=rollout)
        runs[name], _ = trainer.train_step(0)
    plain, tis, strict = runs["plain"], runs["tis"], runs["strict"]
    assert plain["rollout/logprob_diff_mean"] > 0.05  # a real mismatch
    assert plain["rollout/logprob_diff_mean"] == pytest.approx(tis["rollout/logprob_diff_mean"], rel=1e-6)
    assert 0 < plain["rollout/logprob_diff_frac"] < strict["rollout/logprob_diff_frac"] <= 1
    assert 0 < tis["rollout/is_weight_mean"] <= 1.5 and tis["rollout/is_weight_mean"] != pytest.approx(1.0)
    assert tis["actor/pg_loss"] != pytest.approx(plain["actor/pg_loss"], rel=1e-3)
    assert plain["actor/pg_loss"] == pytest.approx(strict["actor/pg_loss"], rel=1e-6)  # a metric-only key


def test_logprob_mismatch_figures_from_totals_that_add_up_over_ranks():
    trainer = torch.tensor([-1.0, -2.0, -0.5, -3.0, -9.0])
    sampler = torch.tensor([-1.05, -1.8, -0.5, -3.3, 0.0])
    mask = torch.tensor([1, 1, 1, 1, 0])  # the last is a prompt position: not counted
    m = logprob_mismatch(mismatch_totals(trainer, sampler, mask, threshold=0.1))
    assert m["rollout/logprob_diff_mean"] == pytest.approx((0.05 + 0.2 + 0 + 0.3) / 4)
    assert m["rollout/logprob_diff_max"] == pytest.approx(0.3)
    assert m["rollout/logprob_diff_frac"] == pytest.approx(0.5)
    over = logprob_mismatch(mismatch_totals(trainer, sampler, mask, 0.25))
    assert over["rollout/logprob_diff_frac"] == 0.25
    assert logprob_mismatch(mismatch_totals(trainer, sampler, torch.zeros(5), 0.1)) == {}
    assert m["rollout/logprob_diff_nonfinite"] == 0.0
    # a token one side gives no probability (-inf): counted apart and over the threshold, the rest as before
    broken = logprob_mismatch(mismatch_totals(trainer, torch.tensor([-1.05, -1.8, -0.5, float("-inf"), 0.0]),
                                              mask, threshold=0.1))
    assert broken["rollout/logprob_diff_nonfinite"] == pytest.approx(0.25)
    assert broken["rollout/logprob_diff_mean"] == pytest.approx((0.05 + 0.2 + 0) / 3)
    assert broken["rollout/logprob_diff_max"] == pytest.approx(0.2)
    assert broken["rollout/logprob_diff_frac"] == pytest.approx(0.5)
    # two data-parallel ranks' halves: sums added, maxima maxed, give the whole's figures
    halves = [mismatch_totals(trainer[s], sampler[s], mask[s], 0.1) for s in (slice(0, 2), slice(2, 5))]
    pooled = {k: (max if k == "max" else sum)(h[k] for h in halves) for k in halves[0]}
    assert logprob_mismatch(pooled) == pytest.approx(m)


def test_truncated_importance_weights_are_the_capped_ratio():
    trainer = torch.tensor([-1.0, -1.0, -2.0])
    sampler = torch.tensor([-1.5, -0.5, -2.0])
    w = truncated_importance_weights(trainer, sampler, cap=1.2)
    torch.testing.assert_close(w, torch.tensor([1.2, math.exp(-0.5), 1.0]))


def test_is_weights_scale_each_tokens_surrogate():
    """grpo_loss with importance weights is the weighted sum of the per-token surrogate; weights of 1 leave
    the loss and its gradient as they are."""
    torch.manual_seed(0)
    logprob = (torch.randn(6) * 0.1 - 1).requires_grad_()
    old, adv = logprob.detach() + 0.01, torch.tensor([1.0, 1, -1, -1, 0.5, 0.5])
    mask, seq_ids = torch.ones(6, dtype=torch.bool), torch.tensor([0, 0, 0, 1, 1, 1])
    norm, cfg = LossNorm(num_tokens=6, num_sequences=2, horizon=8), GRPOLossConfig()
    plain, _ = grpo_loss(cfg, logprob, old, adv, mask, seq_ids, 2, norm)
    ones, _ = grpo_loss(cfg, logprob, old, adv, mask, seq_ids, 2, norm, is_weights=torch.ones(6))
    weights = torch.tensor([0.5, 1.0, 2.0, 0.0, 1.0, 1.5])
    weighted, _ = grpo_loss(cfg, logprob, old, adv, mask, seq_ids, 2, norm, is_weights=weights)
    per_token = -adv * torch.exp(logprob - old)  # ratio near 1: no clip is active
    torch.testing.assert_close(plain, per_token.sum() / 6)
    torch.testing.assert_close(ones, plain)
    torch.testing.assert_close(weighted, (weights * per_token).sum() / 6)


def run_grpo(tmp_path, overrides: list[str]) -> subprocess.CompletedProcess:
    sets = [arg for item in [*overrides, f"trainer.output_dir={tmp_path / 'run'}"] for arg in ("--set", item)]
    return subprocess.run([sys.executable, "-m", "mlite", "grpo", "demo_grpo", *sets, "--no-progress"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)


def test_vllm_engine_without_vllm_is_refused_before_any_work(tmp_path):
    """A GPU job asking for vLLM where the vllm package is absent: one line, exit 2, before the data, the
    model or the GPU are touched (the job names no prompt files: that check comes later)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.fail("this test needs a Python without vllm (CPU CI has none)")
    result = run_grpo(tmp_path, ["cluster.gpu=h100", "cluster.host_memory_gb=64", "trainer.device=auto",
                                 "precision.compute=bf16", "rollout.engine=vllm"])
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert "rollout.engine vllm needs the vllm package, which is not installed here" in lines[0]
    assert "pip install vllm==0.25.1" in lines[0] and "rollout.engine builtin" in lines[0]
    assert not (tmp_path / "run").exists()


def test_a_job_over_its_host_memory_names_host_memory(tmp_path):
    """The start-up's memory verdict says which memory is short: here the host's (8 GB per GPU process on an
    8 GB node), not the GPU's, which has room."""
    result = run_grpo(tmp_path, ["cluster.gpu=h100", "cluster.host_memory_gb=8", "trainer.device=auto"])
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert "needs 8.0 GB of host memory per node, over the usable 7.2 GB of cluster.host_memory_gb=8" \
        in lines[0]
