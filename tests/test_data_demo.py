"""The demo tasks: deterministic by seed, right answers (checked by recomputing them), a checker that
accepts them and rejects wrong ones, disjoint train/held-out, files in verl's messages format, and word
problems whose solutions stop after the working (`unstated`, the demo's SFT data)."""

from __future__ import annotations

import json
import operator
import re

import pyarrow.parquet as pq
import pytest

from mlite.runtime.data.demo import check_answer, demo_rows, demo_split, extract_answer, write_demo_data

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}
EQUATION = re.compile(r"(-?\d+) ([-+*/]) (\d+) = (-?\d+)")


def test_same_seed_same_rows_other_seed_other_rows():
    assert demo_rows(50, seed=3) == demo_rows(50, seed=3)
    assert demo_rows(50, seed=3) != demo_rows(50, seed=4)


def test_every_answer_is_right():
    rows = demo_rows(1000, seed=0)
    kinds = {(r["kind"], r["level"]) for r in rows}
    assert kinds == {(k, level) for k in ("arithmetic", "word") for level in (1, 2, 3)}
    assert {
        m for r in rows for m in re.findall(r" ([-+*/]) ", r["prompt"]) if r["kind"] == "arithmetic"
    } == set(OPS)
    for row in rows:
        user, assistant = (m["content"] for m in row["messages"])
        assert user == row["prompt"]
        a, op, b, result = EQUATION.search(assistant).groups()
        assert OPS[op](int(a), int(b)) == int(result) == int(row["answer"])
        if op == "/":
            assert int(a) % int(b) == 0, "division tasks are exact"
        if row["kind"] == "arithmetic":
            assert row["prompt"] == f"What is {a} {op} {b}?"
        else:  # the numbers of the equation are the ones in the story
            assert {a, b} <= set(re.findall(r"\d+", row["prompt"]))


def test_checker_accepts_generated_answers_and_rejects_wrong_ones():
    for row in demo_rows(300, seed=1):
        solution, answer = row["messages"][-1]["content"], row["answer"]
        assert extract_answer(solution) == int(answer)
        assert check_answer(solution, answer) and check_answer(solution, int(answer))
        assert not check_answer(solution, int(answer) + 1)
        assert not check_answer(
            solution.replace(f"The answer is {answer}", f"The answer is {int(answer) + 1}"), answer
        )
        assert not check_answer(solution.replace("The answer is", "Maybe"), answer)


@pytest.mark.parametrize(
    "text,want",
    [
        ("The answer is -12.", -12),
        ("The answer is 3. No wait, The answer is 4.", 4),  # the last statement counts
        ("12 + 30 = 42", None),  # a bare number is no answer in the demo format
        ("", None),
    ],
)
def test_extract_answer(text, want):
    assert extract_answer(text) == want


def test_unstated_word_problems_stop_after_the_working():
    plain, mixed = demo_rows(1500, seed=0), demo_rows(1500, seed=0, unstated=0.5)
    assert [(r["prompt"], r["answer"]) for r in mixed] == [(r["prompt"], r["answer"]) for r in plain]
    unstated = [m for m in mixed if extract_answer(m["messages"][-1]["content"]) is None]
    words = [m for m in mixed if m["kind"] == "word"]
    assert {m["kind"] for m in unstated} == {"word"} and 0.4 < len(unstated) / len(words) < 0.6
    for row, before in zip(mixed, plain):
        solution, full = row["messages"][-1]["content"], before["messages"][-1]["content"]
        if row in unstated:
            assert full == f"{solution} The answer is {row['answer']}."  # the working is the same
            assert EQUATION.search(solution).group(4) == row["answer"]
            assert not check_answer(solution, row["answer"])
        else:
            assert solution == full
    train, val = demo_split(40, 10, seed=5, unstated=0.5)
    assert train + val == demo_rows(50, seed=5, unstated=0.5)


def test_held_out_questions_are_not_in_train():
    train, val = demo_split(500, 100, seed=2)
    assert len(train) == 500 and len(val) == 100
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    assert len({r["prompt"] for r in train}) == 500


def test_system_prompt_is_the_first_message():
    row = demo_rows(1, seed=0, system="Answer briefly.")[0]
    assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant"]
    assert row["messages"][0]["content"] == "Answer briefly."


def test_files_hold_the_rows_in_messages_format(tmp_path):
    paths = write_demo_data(tmp_path, train=40, val=10, seed=5)
    assert sorted(paths) == ["train.jsonl", "train.parquet", "val.jsonl", "val.parquet"]
    train, val = demo_split(40, 10, seed=5)
    for split, rows in (("train", train), ("val", val)):
        table = pq.read_table(paths[f"{split}.parquet"])
        assert (
            str(table.schema.field("messages").type) == "list<element: struct<role: string, content: string>>"
        )
        from_parquet = table.to_pylist()
        from_jsonl = [json.loads(line) for line in paths[f"{split}.jsonl"].read_text().splitlines()]
        assert from_jsonl == rows
        assert from_parquet == rows
