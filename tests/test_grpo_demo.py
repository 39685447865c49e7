"""The demo's GRPO stage, shortened: SFT checkpoint -> HF export -> GRPO on the generated prompts with the
arithmetic reward, held-out reward before and after, metrics and plot. (The full demo, where the reward
rises, is `invoke demo`, run once in CI.)"""

from __future__ import annotations

import json
from types import SimpleNamespace

from mlite.runtime.ckpt.checkpoint import CheckpointManager
from mlite.runtime.engine import Runtime
from mlite.trainers.demo import demo_job, prepare_demo
from mlite.trainers.grpo.demo import HELD_OUT, KIND, grpo_stage
from mlite.trainers.grpo.trainer import reward_curve
from mlite.trainers.metrics import read_metrics


def test_grpo_stage_runs_on_the_sft_result(tmp_path):
    paths = prepare_demo(tmp_path, train_rows=300, val_rows=100)
    sft_job = demo_job(tmp_path, paths, "cpu", ("trainer.steps=1",))
    runtime = Runtime(sft_job)
    checkpoint = CheckpointManager(tmp_path / "sft").save(
        1, lambda p: runtime.save_checkpoint(p, {"step": 1})
    )

    result = grpo_stage(
        tmp_path,
        SimpleNamespace(checkpoint=checkpoint),
        "cpu",
        None,
        overrides=(
            "trainer.steps=2",
            "rollout.prompts_per_step=2",
            "rollout.n=2",
            "rollout.max_response_length=8",
        ),
    )

    assert (tmp_path / "sft_hf" / "config.json").is_file()  # GRPO started from the exported SFT weights
    val = [json.loads(line) for line in (tmp_path / "grpo_data" / "val.jsonl").read_text().splitlines()]
    train = [json.loads(line) for line in (tmp_path / "grpo_data" / "train.jsonl").read_text().splitlines()]
    assert 0 < len(val) <= HELD_OUT and train and all(r["kind"] == KIND for r in train + val)
    records = read_metrics(result.metrics_path)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert result.eval_before is not None and result.eval_after is not None
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in records[1:])  # the 0/1 arithmetic checker
    assert result.plot_path is not None and result.plot_path.stat().st_size > 1000


def test_reward_curve_compares_equal_slices_of_the_run():
    steps = list(range(1, 11))
    rewards = [0.0, 0.2, 0.1, 0.3, 0.2, 0.4, 0.5, 0.4, 0.6, 0.8]
    curve = reward_curve(steps, rewards, parts=5)
    assert [(lo, hi) for lo, hi, _ in curve] == [(1, 2), (3, 4), (5, 6), (7, 8), (9, 10)]
    assert [round(mean, 6) for _, _, mean in curve] == [0.1, 0.2, 0.3, 0.45, 0.7]
    assert reward_curve([3, 4], [0.5, 1.0], parts=5) == [(3, 3, 0.5), (4, 4, 1.0)]  # fewer steps than parts
