"""mlite's reward functions as verl's custom reward function (`reward.custom_reward_function.path` = this
file, `.name=compute_score`).

verl calls `compute_score(data_source, solution_str, ground_truth, extra_info)` per response. The row's
`data_source` names the reward as `grpo.reward` does in mlite's own jobs: `arithmetic`, `gsm8k`, or an
import path `module:function` (`mlite.trainers.grpo.rewards.load_reward`); anything else (e.g.
`openai/gsm8k`) is scored as `gsm8k`.
"""

from __future__ import annotations

from typing import Any

from mlite.trainers.grpo.rewards import BUILTIN, load_reward


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs
) -> float:
    spec = data_source if data_source in BUILTIN or ":" in str(data_source) else "gsm8k"
    sample = {"answer": ground_truth, **(extra_info or {})}
    return float(load_reward(spec)(solution_str, sample))
