"""Demo tasks with checkable answers: arithmetic and short word problems, deterministic by seed.

    rows = demo_rows(200, seed=0)                  # [{"messages": [...], "prompt": ..., "answer": "85", ...}]
    paths = write_demo_data("data/demo", seed=0)   # train/val in parquet and JSONL
    check_answer("... The answer is 85.", "85")    # True

Every row serves both trainers: `messages` (system?/user/assistant, the column verl's SFT reads) for SFT,
and `prompt` + `answer` (the ground truth) for RL. The assistant turn ends in "The answer is N.", which
`extract_answer` reads back, so a reward is exact match on that number; with `unstated` a share of the word
problems stop after the worked equation instead, like a second source that writes only its working (the
demo's SFT data: GRPO then learns to state the answer, `docs/GRPO.md`).
"""

from __future__ import annotations

import json
import operator
import random
import re
from pathlib import Path
from typing import Any

ANSWER_PATTERN = re.compile(r"The answer is (-?\d+)\.?")

# (operator, level) -> operand ranges; level 1 is one digit, 2 two digits, 3 three digits (or 2x2 products)
_OPERAND_RANGES = {
    ("+", 1): ((0, 9), (0, 9)),
    ("+", 2): ((10, 99), (10, 99)),
    ("+", 3): ((100, 999), (100, 999)),
    ("-", 1): ((0, 9), (0, 9)),
    ("-", 2): ((10, 99), (10, 99)),
    ("-", 3): ((100, 999), (100, 999)),
    ("*", 1): ((0, 9), (0, 9)),
    ("*", 2): ((10, 99), (2, 9)),
    ("*", 3): ((10, 99), (10, 99)),
    ("/", 1): ((1, 9), (1, 9)),
    ("/", 2): ((2, 9), (10, 99)),
    ("/", 3): ((10, 99), (10, 99)),
}
_NAMES = ["Tom", "Anna", "Ben", "Mia", "Sam", "Lily", "Max", "Eva", "Leo", "Zoe"]
_ITEMS = ["apples", "pencils", "cookies", "marbles", "stickers", "books", "coins", "cards"]


def _arithmetic(rng: random.Random, level: int) -> tuple[str, str, int]:
    """(question, worked solution, answer). Division is exact; subtraction at level 1 stays non-negative."""
    op = rng.choice("+-*/")
    (lo_a, hi_a), (lo_b, hi_b) = _OPERAND_RANGES[(op, level)]
    a, b = rng.randint(lo_a, hi_a), rng.randint(lo_b, hi_b)
    if op == "/":  # a / b with an integer result: build it from the quotient a and divisor b
        a, b = a * b, a
    if op == "-" and level == 1 and b > a:
        a, b = b, a
    answer = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}[op](a, b)
    return f"What is {a} {op} {b}?", f"{a} {op} {b} = {answer}.", answer


def _word_problem(rng: random.Random, level: int) -> tuple[str, str, int]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    top = 9 if level == 1 else 20 * level
    kind = rng.choice(["buys", "gives", "boxes", "shares"])
    if kind == "buys":
        a, b = rng.randint(1, top), rng.randint(1, top)
        answer = a + b
        question = f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?"
        solution = f"{name} has {a} + {b} = {answer} {item}."
    elif kind == "gives":
        a = rng.randint(2, top)
        b = rng.randint(1, a)
        answer = a - b
        question = f"{name} has {a} {item} and gives {b} to a friend. How many {item} are left?"
        solution = f"{a} - {b} = {answer} {item} are left."
    elif kind == "boxes":
        a, b = rng.randint(2, 3 + 3 * level), rng.randint(2, 3 + 3 * level)
        answer = a * b
        question = f"{name} has {a} boxes with {b} {item} in each box. How many {item} are there in all?"
        solution = f"{a} * {b} = {answer} {item}."
    else:
        friends, each = rng.randint(2, 2 + 2 * level), rng.randint(1, 3 + 3 * level)
        total, answer = friends * each, each
        question = (
            f"{name} shares {total} {item} equally among {friends} friends. "
            f"How many {item} does each friend get?"
        )
        solution = f"{total} / {friends} = {answer} {item} each."
    return question, solution, answer


def demo_task(rng: random.Random) -> dict[str, Any]:
    """One task drawn from `rng`: a third word problems, the rest arithmetic, levels 1-3."""
    level = rng.randint(1, 3)
    kind = "word" if rng.random() < 1 / 3 else "arithmetic"
    question, solution, answer = (_word_problem if kind == "word" else _arithmetic)(rng, level)
    return {
        "question": question,
        "solution": f"{solution} The answer is {answer}.",
        "answer": str(answer),
        "kind": kind,
        "level": level,
    }


def to_row(task: dict[str, Any], system: str | None = None) -> dict[str, Any]:
    """A task as a row: `messages` for SFT, `prompt` + `answer` for RL, and what the task was."""
    messages = [{"role": "system", "content": system}] if system else []
    messages += [
        {"role": "user", "content": task["question"]},
        {"role": "assistant", "content": task["solution"]},
    ]
    return {
        "messages": messages,
        "prompt": task["question"],
        "answer": task["answer"],
        "kind": task["kind"],
        "level": task["level"],
    }


def demo_rows(
    count: int,
    seed: int = 0,
    system: str | None = None,
    exclude: frozenset[str] = frozenset(),
    kind: str | None = None,
    level: int | None = None,
    unstated: float = 0.0,
) -> list[dict]:
    """`count` rows with distinct questions (none of them in `exclude`; only `kind` / `level` when given),
    the same for the same arguments. A share `unstated` of the word problems' solutions end after the
    worked equation, without "The answer is N." (drawn from a generator of its own: the questions and
    answers are those of `unstated=0`)."""
    rng, style = random.Random(seed), random.Random(f"unstated-{seed}")
    rows, seen = [], set(exclude)
    for _ in range(count * 1000):  # the question space (~10^6) is far larger than any demo set
        task = demo_task(rng)
        if (kind or task["kind"]) != task["kind"] or (level or task["level"]) != task["level"]:
            continue
        if task["question"] not in seen:
            seen.add(task["question"])
            if unstated and task["kind"] == "word" and style.random() < unstated:
                task = {
                    **task,
                    "solution": task["solution"].removesuffix(f" The answer is {task['answer']}."),
                }
            rows.append(to_row(task, system))
            if len(rows) == count:
                return rows
    raise ValueError(f"could only draw {len(rows)} distinct demo questions of {count}")


def demo_split(
    train: int, val: int, seed: int = 0, system: str | None = None, unstated: float = 0.0
) -> tuple[list[dict], list[dict]]:
    """Train and held-out rows; no held-out question appears in train."""
    rows = demo_rows(train + val, seed, system, unstated=unstated)
    return rows[:train], rows[train:]


def write_rows(rows: list[dict], path: str | Path) -> Path:
    """Write rows as parquet (by suffix .parquet) or JSONL (.jsonl)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        raise ValueError(f"{path}: write .parquet or .jsonl")
    return path


def write_demo_data(
    out_dir: str | Path,
    train: int = 2000,
    val: int = 200,
    seed: int = 0,
    system: str | None = None,
    unstated: float = 0.0,
) -> dict[str, Path]:
    """train/val rows in parquet and JSONL under out_dir; returns {"train.parquet": path, ...}."""
    train_rows, val_rows = demo_split(train, val, seed, system, unstated)
    out = Path(out_dir)
    return {
        f"{split}.{ext}": write_rows(rows, out / f"{split}.{ext}")
        for split, rows in (("train", train_rows), ("val", val_rows))
        for ext in ("parquet", "jsonl")
    }


# ------------------------------------------------------------------------------------- answer checking
def extract_answer(text: str) -> int | None:
    """The number in the last "The answer is N" of a response, or None when there is none."""
    found = ANSWER_PATTERN.findall(text)
    return int(found[-1]) if found else None


def check_answer(response: str, answer: str | int) -> bool:
    """True when the response states the ground-truth answer in the demo format."""
    given = extract_answer(response)
    return given is not None and given == int(str(answer).strip())
