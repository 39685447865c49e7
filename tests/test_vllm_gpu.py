"""GRPO with real vLLM rollout (the device machine; vLLM from scripts/gpu_vllm_env.sh). On one GPU: the
engine sleeps and gives its memory back between rollouts, the trainer's weights reach it every step (the
sampler's log-probs match the trainer's forward), seeded sessions repeat, and the demo's GRPO stage runs on
it and still raises the held-out reward. On 2 and 4 GPUs (`-k several_gpus`): vLLM over the ranks, each rank
syncing its slab, under tp, FSDP2 and ep training layouts, for Qwen3 dense and MoE and DeepSeek-V4 (`-k dsv4`:
vLLM's V4 add-on, scripts/vllm_bundle.sh --v4)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from grpo_helpers import VLLM_SIZES, char_tokenizer, grpo_job, tiny_hf_qwen3

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[1]
ROWS = [{"prompt": f"say {d}", "answer": str(d)} for d in range(10)]
GIB = 1024**3


@pytest.fixture(autouse=True)
def _needs_vllm():
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vllm is not installed: on the device machine source scripts/gpu_vllm_env.sh after "
                    "scripts/gpu_env.sh (or deselect these tests with -m 'not vllm')")


def tiny_vllm_job(tmp_path, **rollout):
    """(a char tokenizer, a bf16 GRPO job on one GPU rolling out a tiny Qwen3 written by transformers on vLLM
    at 0.2 of the GPU); `rollout` adds rollout keys."""
    tokenizer = char_tokenizer(tmp_path / "tok")
    model_dir = tiny_hf_qwen3(tmp_path / "model", tokenizer, **VLLM_SIZES)
    job = grpo_job(tmp_path, model={"name": None, "path": str(model_dir), "attention_backend": "auto"},
                   cluster={"gpu": "h100"}, precision={"compute": "bf16"}, trainer={"device": "cuda"},
                   data={"seq_len": 128, "max_tokens_per_micro_batch": 1024},
                   rollout={"engine": "vllm", "enforce_eager": True, "gpu_memory_utilization": 0.2,
                            "n": 4, "prompts_per_step": 4, "max_response_length": 24, **rollout})
    return tokenizer, job


def test_grpo_steps_with_vllm_rollout(tmp_path):
    from mlite.runtime.engine import Runtime
    from mlite.trainers.grpo.prompts import render_prompts
    from mlite.trainers.grpo.trainer import GRPOTrainer
    from mlite.trainers.grpo.vllm_rollout import VLLMRollout

    tokenizer, job = tiny_vllm_job(tmp_path)
    prompts, _ = render_prompts(ROWS, tokenizer, job.rollout.max_prompt_length)
    runtime = Runtime(job)
    torch.cuda.synchronize()
    free_before, total = torch.cuda.mem_get_info()
    engine = VLLMRollout(job, runtime, tmp_path / "vllm")
    free_asleep = torch.cuda.mem_get_info()[0]
    trainer = GRPOTrainer(job, runtime, tokenizer, prompts, engine=engine)
    params = trainer.sampling_params()

    # a session wakes vLLM (its share of the GPU), and sleeping gives the memory back
    with engine.session(11) as sampler:
        free_awake = torch.cuda.mem_get_info()[0]
        first = sampler.generate([p.ids for p in prompts[:6]], params)
    with engine.session(11) as sampler:
        again = sampler.generate([p.ids for p in prompts[:6]], params)
    free_after = torch.cuda.mem_get_info()[0]
    print(f"GPU free: {free_before / GIB:.2f} GiB before vLLM, {free_asleep / GIB:.2f} asleep after start, "
          f"{free_awake / GIB:.2f} awake, {free_after / GIB:.2f} asleep again (of {total / GIB:.1f}); "
          f"engine start {engine.start_s:.1f} s")
    assert free_before - free_awake > 0.8 * 0.2 * total  # the KV cache and weights took vLLM's share
    assert free_before - free_asleep < 1.5 * GIB and free_before - free_after < 1.5 * GIB
    # per-request seeds: a session with the same seed draws the same responses
    assert [c.response_ids for c in first] == [c.response_ids for c in again]
    assert all(len(c.response_ids) == len(c.logprobs) <= 24 for c in first)
    assert all(c.stopped == (c.response_ids[-1] in trainer.stop_ids) for c in first if c.response_ids)

    hf_tensors = sum(1 for _ in runtime.export_weights())
    numel = sum(p.numel() for p in runtime.model.parameters())
    def weights():
        return torch.cat([p.detach().flatten().float() for p in runtime.model.parameters()])

    before = weights()
    for step in range(4):
        metrics, ro = trainer.train_step(step)
        print(f"step {step}: " + json.dumps({k: round(v, 5) for k, v in sorted(metrics.items())}))
        assert len(ro.completions) == 16
        # the weights went to vLLM whole, once each, in bf16 ...
        assert metrics["rollout/sync_tensors"] == hf_tensors
        assert metrics["rollout/sync_gb"] == pytest.approx(numel * 2 / 1e9, rel=1e-6)
        # ... and they are the trainer's current ones: vLLM's log-probs are the trainer's forward up to bf16
        # kernels (unsynced, vLLM's random dummy weights would be nats away)
        assert metrics["rollout/logprob_diff_mean"] < 0.05, metrics
        assert metrics["rollout/logprob_diff_frac"] < 0.2, metrics
    assert not torch.equal(before, weights())
    engine.close()


def test_the_trainer_waits_on_the_host_while_vllm_generates_and_comes_back_bit_for_bit(tmp_path):
    """rollout.offload_trainer: true. Inside a session (vLLM awake) the trainer's weights and Adam moments
    are in pinned host memory; after it they are back on the GPU, bit for bit, and the GRPO step trains on.
    The session reports what moved and how fast."""
    from mlite.runtime.engine import Runtime
    from mlite.trainers.grpo.prompts import render_prompts
    from mlite.trainers.grpo.trainer import GRPOTrainer
    from mlite.trainers.grpo.vllm_rollout import VLLMRollout

    tokenizer, job = tiny_vllm_job(tmp_path, offload_trainer=True)
    prompts, _ = render_prompts(ROWS, tokenizer, job.rollout.max_prompt_length)
    runtime = Runtime(job)
    engine = VLLMRollout(job, runtime, tmp_path / "vllm")
    trainer = GRPOTrainer(job, runtime, tokenizer, prompts, engine=engine)
    assert engine.offload
    trainer.train_step(0)  # Adam's moments exist from here on
    params = list(runtime.model.parameters())
    states = [runtime.optim.optimizer.state[p] for p in params]
    weights = [p.detach().clone() for p in params]
    moments = [(s["exp_avg"].clone(), s["exp_avg_sq"].clone()) for s in states]
    held = sum(t.numel() * t.element_size() for p, s in zip(params, states)
               for t in (p, s["exp_avg"], s["exp_avg_sq"]))

    with engine.session(5) as sampler:
        assert all(p.device.type == "cpu" and p.is_pinned() for p in params)
        assert all(s["exp_avg"].device.type == "cpu" and s["exp_avg"].is_pinned() for s in states)
        completions = sampler.generate([p.ids for p in prompts[:4]], trainer.sampling_params())
    assert len(completions) == 4
    assert all(p.device.type == "cuda" for p in params)
    assert all(torch.equal(p, w) for p, w in zip(params, weights))
    assert all(torch.equal(s["exp_avg"], m) and torch.equal(s["exp_avg_sq"], v)
               for s, (m, v) in zip(states, moments))
    stats = engine.stats
    print("offload: " + json.dumps({k: round(v, 5) for k, v in sorted(stats.items())}))
    assert stats["offload/gb"] * 1e9 >= held  # weights and both moments (grads are freed after a step)
    assert stats["time/offload_s"] > 0 and stats["time/reload_s"] > 0 and stats["offload/gb_per_s"] > 0
    assert stats["memory/sync_gb"] > 0 and stats["memory/rollout_gb"] > 0

    metrics, _ = trainer.train_step(1)  # and the step after trains as usual
    assert metrics["offload/gb"] == stats["offload/gb"] and metrics["rollout/logprob_diff_mean"] < 0.05
    engine.close()


def test_demo_grpo_stage_on_vllm(tmp_path):
    """`mlite demo` on the GPU with the GRPO stage rolling out on vLLM: it trains, logs the mismatch, and the
    held-out reward goes up as on the built-in sampler."""
    out = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-m", "mlite", "demo", "--device", "cuda", "--out", str(out), "--no-progress",
         "--grpo-set", "rollout.engine=vllm", "--grpo-set", "rollout.enforce_eager=true"],
        capture_output=True, text=True, cwd=ROOT, timeout=900, check=False)
    print(result.stdout[-3000:])
    assert result.returncode == 0, result.stderr[-4000:]
    records = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "rollout/logprob_diff_mean" in r]
    evals = [r for r in records if "eval/reward_mean" in r]
    assert len(steps) == 80 and all(r["rollout/sync_tensors"] > 0 for r in steps)
    diffs = [r["rollout/logprob_diff_mean"] for r in steps]
    print(f"demo on vLLM: logprob diff mean {sum(diffs) / len(diffs):.4f} (max over steps {max(diffs):.4f}); "
          f"held-out reward {evals[0]['eval/reward_mean']:.3f} -> {evals[-1]['eval/reward_mean']:.3f}")
    assert max(diffs) < 0.05
    assert evals[-1]["eval/reward_mean"] > evals[0]["eval/reward_mean"] + 0.1


def tiny_qwen3_moe(folder: Path, tokenizer) -> Path:
    """A tiny Qwen3-MoE written by transformers (4 experts, 2 per token), with vLLM-friendly heads."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                            moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            max_position_embeddings=256, tie_word_embeddings=False, decoder_sparse_step=1,
                            mlp_only_layers=[], eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
    Qwen3MoeForCausalLM(config).save_pretrained(folder)
    return folder


def small_deepseek_v4(folder: Path, tokenizer) -> Path:
    """`small-deepseek-v4` with the char tokenizer's vocabulary: its config.json only (the release fields
    vLLM reads written by the rollout's own writer). Hidden 2048: vLLM 0.25.1's fused mHC kernel computes
    narrower widths wrongly (mlite.plan.policy.vllm_v4_width_misfit)."""
    from mlite.config.arch import arch_from_hf_config
    from mlite.config.catalog import PRESETS
    from mlite.runtime.ckpt.hf import write_hf_config

    config = dict(PRESETS["small-deepseek-v4"], vocab_size=len(tokenizer),
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    folder.mkdir(parents=True)
    write_hf_config(folder / "config.json", arch_from_hf_config(config, name="small-deepseek-v4"), config,
                    torch.bfloat16)
    return folder


@pytest.fixture(scope="module")
def trained_v4(tmp_path_factory) -> Path:
    """`small-deepseek-v4` (the char tokenizer's vocabulary) after 40 SFT steps on one GPU on the GRPO
    prompts' answers, exported in DeepSeek's release names. A randomly initialised V4 is a poor instrument
    for the sampler-trainer mismatch: its near-uniform logits move 0.03 nats a token between bf16 and fp32
    alone, and 0.08 with wo_a in block FP8 (on the CPU), so vLLM's FP8 wo_a and fp8 KV cache put the mean
    at 0.12-0.15 nats on every engine shape, and a slab sent wrong would hide in that. Trained, the same
    engines agree with the trainer to a few thousandths (docs/GRPO.md)."""
    import yaml

    from mlite.runtime.engine import export_checkpoint
    from mlite.trainers.metrics import read_metrics

    root = tmp_path_factory.mktemp("dsv4")
    tokenizer = char_tokenizer(root / "tok")
    small_deepseek_v4(root / "init", tokenizer)
    rows = [{"messages": [{"role": "user", "content": r["prompt"]},
                          {"role": "assistant", "content": f"{r['answer']} is {r['answer']}"}]} for r in ROWS]
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows * 4))
    job = {
        "job": "sft",
        "model": {"path": str(root / "init"), "load_weights": False},
        "cluster": {"gpus_per_node": 1, "gpu": "h100"},
        "precision": {"compute": "bf16"},
        "optimizer": {"lr": 1e-3, "warmup_steps": 2, "schedule": "constant"},
        "data": {"train_files": [str(root / "sft.jsonl")], "tokenizer": str(root / "tok"), "seq_len": 64,
                 "global_batch_size": 8, "max_tokens_per_micro_batch": 512},
        "trainer": {"steps": 40, "device": "cuda", "output_dir": str(root / "sft"), "seed": 5,
                    "log_every": 10},
    }
    (root / "sft.yaml").write_text(yaml.safe_dump(job))
    done = subprocess.run([sys.executable, "-m", "mlite", "sft", str(root / "sft.yaml"), "--no-progress"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600, check=False,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    assert done.returncode == 0, done.stderr[-4000:]
    losses = [r["loss"] for r in read_metrics(root / "sft" / "metrics.jsonl") if "loss" in r]
    print(f"V4 SFT before GRPO: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return export_checkpoint(root / "sft", root / "model")


# rollout.tp x the training layout: on 2 GPUs, one engine over both ranks whose slabs are the training tp
# shards (dense tp2), one engine over both ranks fed from FSDP2 shards, two engines (rollout.tp 1) that
# split each batch, an MoE engine over both ranks fed from expert-parallel shards, and DeepSeek-V4's (the
# V4 add-on of scripts/vllm_bundle.sh --v4) in three engine shapes; on 4 GPUs, the Qwen3-30B template's
# shape (experts over all ranks, FSDP2, two vLLM engines of rollout.tp ranks) and one engine over all four,
# for Qwen3-MoE and DeepSeek-V4
RANK_RUNS = {
    "dense-tp2-rollout-tp2": ("dense", {"tp": 2}, 2, 2),
    "dense-fsdp2-rollout-tp2": ("dense", {}, 2, 2),
    "dense-fsdp2-rollout-tp1": ("dense", {}, 1, 2),
    "moe-ep2-rollout-tp2": ("moe", {"ep": 2}, 2, 2),
    "moe-ep4-rollout-tp2-4gpus": ("moe", {"ep": 4}, 2, 4),
    "moe-ep4-rollout-tp4-4gpus": ("moe", {"ep": 4}, 4, 4),
    "dsv4-ep2-rollout-tp2": ("dsv4", {"ep": 2}, 2, 2),
    "dsv4-ep2-rollout-tp1": ("dsv4", {"ep": 2}, 1, 2),
    "dsv4-ep2-rollout-tp2-experts-split": ("dsv4", {"ep": 2}, 2, 2),
    "dsv4-ep4-rollout-tp2-4gpus": ("dsv4", {"ep": 4}, 2, 4),
    "dsv4-ep4-rollout-tp4-4gpus": ("dsv4", {"ep": 4}, 4, 4),
}
# the runs whose engine splits every expert over its ranks (vLLM's tensor-parallel experts) instead
ROLLOUT_EXPERTS_SPLIT = {"dsv4-ep2-rollout-tp2-experts-split"}
# the runs whose trainer waits in pinned host memory while vLLM is awake (rollout.offload_trainer)
OFFLOADED = {"dsv4-ep2-rollout-tp2", "dsv4-ep4-rollout-tp2-4gpus", "dsv4-ep4-rollout-tp4-4gpus"}


@pytest.mark.parametrize("label", list(RANK_RUNS))
def test_grpo_on_several_gpus_with_vllm_over_the_ranks(tmp_path, label, request):
    """`torchrun --nproc-per-node N -m mlite grpo` with rollout.engine vllm: world / rollout.tp engines in
    vLLM's torchrun mode, each rank feeding its engine worker only its slab of each tensor. Its log-probs
    match the trainer's forward every step (the weights arrive whole and current: a slab left NaN or stale
    would show), every rank sees the whole batch, and the run trains."""
    import yaml

    model, layout, rollout_tp, world = RANK_RUNS[label]
    if torch.cuda.device_count() < world:
        pytest.fail(f"this test needs {world} GPUs, {torch.cuda.device_count()} visible")
    tokenizer = char_tokenizer(tmp_path / "tok")
    make = {"dense": lambda folder, tok: tiny_hf_qwen3(folder, tok, **VLLM_SIZES), "moe": tiny_qwen3_moe,
            "dsv4": lambda folder, tok: request.getfixturevalue("trained_v4")}[model]
    model_dir = make(tmp_path / "model", tokenizer)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "run"
    job = {
        "job": "grpo",
        "model": {"path": str(model_dir), "attention_backend": "auto"},
        "cluster": {"gpus_per_node": world, "gpu": "h100"},
        "parallel": layout,
        "precision": {"compute": "bf16"},
        "optimizer": {"lr": 1e-3, "schedule": "constant"},
        "data": {"train_files": [str(tmp_path / "train.jsonl")], "tokenizer": str(tmp_path / "tok"),
                 "seq_len": 128, "max_tokens_per_micro_batch": 1024},
        "trainer": {"steps": 3, "device": "cuda", "output_dir": str(out), "seed": 5, "save_every": 0},
        "rollout": {"engine": "vllm", "tp": rollout_tp, "enforce_eager": True, "gpu_memory_utilization": 0.2,
                    "n": 4, "prompts_per_step": 4, "max_prompt_length": 48, "max_response_length": 24,
                    **({"offload_trainer": True} if label in OFFLOADED else {}),
                    **({"expert_parallel": False} if label in ROLLOUT_EXPERTS_SPLIT else {})},
        "grpo": {"reward": "grpo_helpers:text_reward"},
    }
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job))
    path = os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    result = subprocess.run([*torchrun, "-m", "mlite", "grpo", str(config), "--no-progress"],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=600, check=False)
    print(result.stdout[-3000:])
    assert result.returncode == 0, result.stderr[-6000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "rollout/logprob_diff_mean" in r]
    assert len(steps) == 3
    for r in steps:
        print(f"{label} step: logprob diff mean {r['rollout/logprob_diff_mean']:.4f} "
              f"max {r['rollout/logprob_diff_max']:.3f} frac {r['rollout/logprob_diff_frac']:.3f}; "
              f"sync {r['time/sync_s']:.3f} s, {r['rollout/sync_tensors']:.0f} tensors, "
              f"{r['rollout/sync_gb'] * 1e3:.2f} MB fed, "
              f"{r['rollout/sync_received_gb'] * 1e3:.2f} MB received")
    for r in steps:
        assert r["rollout/logprob_diff_mean"] < 0.05, r
        assert r["rollout/logprob_diff_frac"] < 0.2, r
        assert r["rollout/generated_tokens"] > 0
        if label in OFFLOADED:  # every rank's weights and Adam moments went to the host and back
            assert r["offload/gb"] > 0, r
    if label == "dense-tp2-rollout-tp2":
        # the engine's slabs are the trainer's tp shards but for the vocabulary, which vLLM pads to 64 before
        # splitting it: rank 0 (the metrics; its DTensor shard holds the first ceil(vocab / 2) rows) gets only
        # the rest of its slab of the embedding and the LM head from rank 1
        from mlite.runtime.ckpt.sync import tp_slab

        vocab = len(tokenizer)
        rows = tp_slab(vocab, 2, 0, pad_to=64)[1] - -(-vocab // 2)
        assert all(r["rollout/sync_received_gb"] * 1e9 == pytest.approx(2 * rows * 128 * 2) for r in steps)
