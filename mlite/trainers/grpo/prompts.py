"""GRPO prompt data: rows with a prompt and its ground-truth answer, rendered with the chat template.

Accepted row shapes (JSONL or parquet):
  {"prompt": "What is 3 + 4?", "answer": "7"}                              plain text: one user turn
  {"prompt": [{"role": "user", "content": "..."}], "answer": "7"}           messages
  {"prompt": [...], "reward_model": {"ground_truth": "7"}}                  verl's RL parquet layout
The whole row travels to the reward function as `sample` (with `prompt` as text and `answer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlite.errors import MliteError
from mlite.runtime.data.rows import read_rows


@dataclass
class Prompt:
    ids: list[int]  # the rendered prompt, ending where the assistant's answer starts
    sample: dict[str, Any]  # for the reward function: prompt (text), answer, and the row's other fields


def read_prompt_rows(files: Sequence[str]) -> list[dict[str, Any]]:
    """Every row of the prompt files; a malformed row stops the run (a prompt set is small and curated)."""

    def refuse(problem: str) -> None:
        raise MliteError(f"{problem}; every GRPO prompt row must be a JSON object with prompt and answer")

    return [row for name in files for _, row in read_rows(Path(name), refuse, what="GRPO prompt")]


def _answer(row: dict[str, Any], where: str) -> str:
    if "answer" in row:
        return str(row["answer"])
    ground_truth = (row.get("reward_model") or {}).get("ground_truth")
    if ground_truth is None:
        raise MliteError(
            f"{where}: no 'answer' (or reward_model.ground_truth) in the row; every GRPO prompt needs one"
        )
    return str(ground_truth)


def render_prompts(
    rows: Sequence[dict[str, Any]], tokenizer, max_prompt_length: int
) -> tuple[list[Prompt], int]:
    """Rows -> tokenised prompts; rows longer than max_prompt_length are skipped and counted."""
    prompts, too_long = [], 0
    for i, row in enumerate(rows):
        if "prompt" not in row:
            raise MliteError(f"prompt row {i}: no 'prompt' key (keys: {', '.join(row)}); see docs/GRPO.md")
        messages = row["prompt"]
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        if len(ids) > max_prompt_length:
            too_long += 1
            continue
        text = "\n".join(str(m.get("content", "")) for m in messages)
        prompts.append(Prompt(list(ids), {**row, "prompt": text, "answer": _answer(row, f"prompt row {i}")}))
    return prompts, too_long
