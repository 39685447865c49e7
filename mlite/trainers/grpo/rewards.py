"""Reward functions: text of a response + its sample -> a float.

A reward function is `fn(response: str, sample: Mapping) -> float`; `sample` carries at least `prompt` and
`answer` (the ground truth). Built in: `arithmetic` (the demo's checker) and `gsm8k` (GSM8K-style answer
extraction + exact match). Anything else is an import path `module:function`.

A reward function that raises does not stop training: the response scores 0, and the failure is kept with
its sample (`RewardFailure`) so the trainer can report it.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from mlite.errors import MliteError

RewardFn = Callable[[str, Mapping], float]

_GSM8K_TAIL_CHARS = 300  # the final answer sits at the end; bound the regex work on long responses
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def extract_gsm8k_answer(text: str, strict: bool = False) -> str | None:
    """The final answer of a GSM8K-style solution: the number after the last '#### ' marker; without
    `strict`, the last number in the text when there is no marker. Commas and '$' removed."""
    tail = text[-_GSM8K_TAIL_CHARS:]
    marked = _STRICT.findall(tail)
    if marked:
        return _normalise_number(marked[-1])
    if strict:
        return None
    numbers = [n for n in _NUMBER.findall(tail) if n not in ("", ".", ",")]
    return _normalise_number(numbers[-1]) if numbers else None


def _normalise_number(raw: str) -> str:
    number = raw.replace(",", "").replace("$", "").rstrip(".")
    if "." in number:  # 72.0 and 72 are the same answer
        number = number.rstrip("0").rstrip(".")
    return number


def gsm8k_reward(response: str, sample: Mapping) -> float:
    """1.0 when the extracted answer equals the ground truth exactly (as normalised numbers), else 0.0.
    The ground truth may be a bare number or a full GSM8K solution ending in '#### N'."""
    truth = extract_gsm8k_answer(str(sample["answer"]))
    answer = extract_gsm8k_answer(response)
    return 1.0 if answer is not None and answer == truth else 0.0


def arithmetic_reward(response: str, sample: Mapping) -> float:
    """The demo task's checker (shared with the data pipeline): 1.0 for the right final answer."""
    from mlite.runtime.data.demo import check_answer

    return 1.0 if check_answer(response, sample["answer"]) else 0.0


BUILTIN: dict[str, RewardFn] = {"arithmetic": arithmetic_reward, "gsm8k": gsm8k_reward}


def load_reward(spec: str) -> RewardFn:
    """`arithmetic`, `gsm8k`, or `package.module:function`."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise MliteError(
            f"grpo.reward '{spec}' is neither a built-in reward ({', '.join(BUILTIN)}) nor an import path "
            "'module:function'; fix grpo.reward"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise MliteError(
            f"grpo.reward '{spec}': cannot import module '{module_name}' ({err}); "
            "put it on PYTHONPATH or fix the path"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise MliteError(f"grpo.reward '{spec}': module '{module_name}' has no function '{attr}'")
    return fn


@dataclass
class RewardFailure:
    index: int
    sample: Mapping
    response: str
    error: str

    def describe(self) -> str:
        return (
            f"reward function failed on response {self.index} ({self.error}); "
            f"prompt={self.sample.get('prompt')!r} response={self.response[:200]!r}"
        )


def score_responses(
    fn: RewardFn, responses: Sequence[str], samples: Sequence[Mapping]
) -> tuple[list[float], list[RewardFailure]]:
    """Score every response with its sample. A raising (or non-numeric) reward scores 0 and is reported."""
    scores: list[float] = []
    failures: list[RewardFailure] = []
    for i, (response, sample) in enumerate(zip(responses, samples, strict=True)):
        try:
            value = float(fn(response, sample))
            if math.isnan(value):  # NaN would poison the group's advantages
                raise ValueError("returned NaN")
        except Exception as err:  # noqa: BLE001 - any user error is reported, never fatal
            failures.append(RewardFailure(i, sample, response, f"{type(err).__name__}: {err}"))
            value = 0.0
        scores.append(value)
    return scores, failures
