"""`mlite grpo CONFIG [--set key=value ...]`: GRPO on the mlite runtime (rollout.engine: builtin or vllm).

The planner checks the job first (layout, rollout lengths, memory) for the world this run has; then
rollouts -> rewards -> PPO updates, with metrics (JSONL, TensorBoard, PNG), progress, checkpoints and
resume (trainer.resume: auto).
"""

from __future__ import annotations

from mlite.cli.training import add_training_parser


def add_parser(subparsers) -> None:
    add_training_parser(subparsers, "grpo", "GRPO reinforcement learning (built-in rollout, resumable)",
                        __doc__, "grpo.kl_coef=0.01")
