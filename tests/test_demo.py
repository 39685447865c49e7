"""`mlite demo` as a user runs it (shortened): generated data, tokenizer, model config, a falling loss,
checkpoint, metrics, TensorBoard events and the plot; the checkpoint exports to a model transformers runs;
the GRPO stage runs on the SFT result and the summary reports it. (That the full demo's GRPO raises the
held-out reward is tests/test_grpo_demo.py.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlite.trainers.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # two pytest workers share two cores
SHORT = ["--set", "trainer.steps=60", "--set", "trainer.eval_every=30", "--set", "trainer.save_every=0",
         "--set", "trainer.log_every=2",
         "--grpo-set", "trainer.steps=2", "--grpo-set", "rollout.prompts_per_step=2",
         "--grpo-set", "rollout.n=4"]


def mlite(*args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlite", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, check=False, timeout=timeout)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    done = mlite("demo", "--out", str(out), *SHORT)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done.stderr


def test_demo_learns_and_writes_everything(demo):
    out, log = demo
    for part in ("data/train.parquet", "data/val.jsonl", "tokenizer/tokenizer.json", "model/config.json",
                 "sft/metrics.jsonl", "sft/loss.png", "sft/checkpoints/lineage",
                 "sft/checkpoints/step_00000060"):
        assert (out / part).exists(), part
    assert list((out / "sft" / "tensorboard").glob("events.out.tfevents.*"))
    from transformers import AutoTokenizer

    config = json.loads((out / "model" / "config.json").read_text())
    # sized to its tokenizer
    assert config["vocab_size"] == len(AutoTokenizer.from_pretrained(out / "tokenizer"))

    records = read_metrics(out / "sft" / "metrics.jsonl")
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 30
    assert sum(losses[-3:]) / 3 < 0.5 * sum(losses[:3]) / 3, losses  # clearly falling
    evals = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0]

    assert "mlite demo ->" in log and "demo finished in" in log
    assert f"2/4 model: qwen3, hidden 128, 4 layers ({out / 'model'})" in log.replace("\n", "")
    assert f"-> {losses[-1]:.4f} (step 60)" in log and "tokens/s" in log
    assert f"plot        {out / 'sft' / 'loss.png'}" in log
    held_out = r"held-out questions answered right \(greedy\): \d+/64, answer stated in \d+/64\n"
    assert re.search(held_out, log), log

    assert "1/4 data:" in log and "3/4 sft: 60 steps" in log
    assert "4/4 grpo: 2 steps of 2 prompts x 4 responses" in log
    grpo = read_metrics(out / "grpo" / "metrics.jsonl")
    assert [r["step"] for r in grpo] == [0, 1, 2]
    assert "eval/reward_mean" in grpo[0] and "eval/reward_mean" in grpo[-1]
    assert (out / "sft_hf" / "config.json").is_file() and (out / "grpo" / "checkpoints" / "lineage").is_file()
    assert (out / "grpo" / "grpo.png").stat().st_size > 1000
    before, after = grpo[0]["eval/reward_mean"], grpo[-1]["eval/reward_mean"]
    line = f"held-out reward (8 per prompt at temperature 0.7) {before:.3f} before -> {after:.3f} after"
    assert line in log
    first, last = grpo[1]["reward/mean"], grpo[2]["reward/mean"]
    assert f"train reward {first:.3f} (steps 1-1) -> {last:.3f} (steps 2-2)" in log
    assert f"plot        {out / 'grpo' / 'grpo.png'}" in log


def test_demo_refuses_bad_grpo_overrides_before_training(tmp_path):
    done = mlite("demo", "--out", str(tmp_path), "--grpo-set", "rollout.nn=4", timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "unknown key 'rollout.nn'" in done.stderr
    assert not (tmp_path / "sft").exists()  # refused before SFT spent minutes
    done = mlite("demo", "--out", str(tmp_path), "--no-grpo", "--grpo-set", "trainer.steps=2", timeout=120)
    assert done.returncode == 2 and "--no-grpo" in done.stderr and "Traceback" not in done.stderr


def test_demo_checkpoint_exports_to_transformers(demo, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = demo
    done = mlite("export", str(out / "sft"), "--out", str(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "tokenizer")
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all() and logits.shape[-1] == model.config.vocab_size


def test_no_grpo_stops_after_sft(tmp_path):
    done = mlite("demo", "--out", str(tmp_path), "--no-grpo", "--set", "trainer.steps=2",
                 "--set", "trainer.save_every=0")
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stderr.replace(str(tmp_path), "OUT")  # the folder's name holds "grpo"
    assert "3/3 sft: 2 steps" in log and "grpo" not in log and "held-out reward" not in log
    assert (tmp_path / "sft" / "checkpoints" / "lineage").is_file() and not (tmp_path / "grpo").exists()


def test_demo_names_the_model_an_override_chose(tmp_path):
    """The model line describes the model that trains, not the generated config an override replaced."""
    from mlite.trainers.demo import demo_job, describe_model, prepare_demo

    paths = prepare_demo(tmp_path, train_rows=50)
    assert describe_model(demo_job(tmp_path, paths)) == f"qwen3, hidden 128, 4 layers ({tmp_path / 'model'})"
    chosen = demo_job(tmp_path, paths, overrides=("model.name=small-deepseek-v4", "model.path=null"))
    assert describe_model(chosen) == ("deepseek_v4, hidden 2048, 4 layers, 16 experts "
                                      "(preset small-deepseek-v4)")


def test_prepare_only_prints_a_runnable_sft_command(tmp_path):
    done = mlite("demo", "--out", str(tmp_path), "--prepare-only")
    assert done.returncode == 0, done.stderr
    command = done.stdout.strip()
    assert command.startswith("mlite sft demo_sft --set model.path=")
    from mlite.config import load_job

    args = command.split()[3:]
    job = load_job("demo_sft", [a for a in args if a != "--set"])
    assert Path(job.data.train_files[0]).is_file() and Path(job.data.tokenizer, "tokenizer.json").is_file()
    assert job.trainer.output_dir == str(tmp_path / "sft")


@pytest.mark.gpu
def test_demo_on_cuda(tmp_path):
    done = mlite("demo", "--out", str(tmp_path), "--device", "cuda", *SHORT)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [r["loss"] for r in read_metrics(tmp_path / "sft" / "metrics.jsonl") if "loss" in r]
    assert sum(losses[-3:]) / 3 < 0.5 * sum(losses[:3]) / 3, losses
