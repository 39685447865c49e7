"""SFT data: the assistant-only loss mask on real rendered templates, parquet == JSONL, every left-out row
counted and reported, clear errors for missing files and unusable templates, and the job-level dataset
(steps, exact target counts, resume)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hf_tiny import demo_tokenizer, demo_tokenizer_dir  # noqa: F401 (fixtures tokenizer, tokenizer_dir)

from mlite.config import load_job
from mlite.errors import MliteError
from mlite.runtime.data.demo import demo_rows, write_demo_data, write_rows
from mlite.runtime.data.packed import IGNORE
from mlite.runtime.data.sft import build_sft_data, check_assistant_mask, load_samples, render
from mlite.runtime.data.tokenizer import CHAT_TEMPLATE, IM_END


def masked_spans(tokenizer, sample) -> list[str]:
    spans, current = [], []
    for token, masked in zip(sample.input_ids + [None], sample.loss_mask + [0]):
        if masked:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    return spans


def test_only_assistant_content_and_its_end_token_are_trained(tokenizer):
    conversation = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": "12 + 30 = 42. The answer is 42."},
        {"role": "user", "content": "And 7 * 6?"},
        {"role": "assistant", "content": "7 * 6 = 42. The answer is 42."},
    ]
    sample = render(tokenizer, conversation)
    assert masked_spans(tokenizer, sample) == [
        conversation[2]["content"] + IM_END,
        conversation[4]["content"] + IM_END,
    ]
    unmasked = tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if not m])
    assert unmasked == (
        "<|im_start|>system\nYou add numbers.<|im_end|>\n<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n"
        "<|im_start|>assistant\n\n<|im_start|>user\nAnd 7 * 6?<|im_end|>\n<|im_start|>assistant\n\n"
    )
    for row in demo_rows(50, seed=3):  # and on every demo row
        assert masked_spans(tokenizer, render(tokenizer, row["messages"])) == [
            row["messages"][-1]["content"] + IM_END
        ]
    check_assistant_mask(tokenizer)


def test_templates_that_mask_the_wrong_tokens_are_refused(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    no_marks = CHAT_TEMPLATE.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
    whole_turn = CHAT_TEMPLATE.replace(
        "{{- '<|im_start|>assistant\\n' }}{%- generation %}",
        "{%- generation %}{{- '<|im_start|>assistant\\n' }}",
    )
    assert whole_turn != CHAT_TEMPLATE
    for template in (no_marks, whole_turn):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        tokenizer.chat_template = template
        with pytest.raises(MliteError, match="does not mark exactly the assistant turns.*generation"):
            check_assistant_mask(tokenizer, "my-tokenizer")


def test_parquet_and_jsonl_give_identical_samples(tokenizer, tmp_path):
    paths = write_demo_data(tmp_path, train=120, val=10, seed=4)
    from_parquet, report_parquet = load_samples([str(paths["train.parquet"])], tokenizer, seq_len=128)
    from_jsonl, report_jsonl = load_samples([str(paths["train.jsonl"])], tokenizer, seq_len=128)
    assert len(from_parquet) == 120 and from_parquet == from_jsonl
    assert report_parquet.as_dict() == report_jsonl.as_dict()
    assert report_parquet.target_tokens == sum(s.num_targets for s in from_parquet)


def test_left_out_rows_are_counted_and_reported(tokenizer, tmp_path):
    good = demo_rows(6, seed=5)
    long_row = {
        "messages": [
            {"role": "user", "content": "Count: " + " ".join(map(str, range(60)))},
            {"role": "assistant", "content": "Done."},
        ]
    }
    lines = [
        json.dumps(good[0]),
        "{not json",
        json.dumps({"conversation": good[1]["messages"]}),
        json.dumps({"messages": [{"role": "user", "content": "Hi"}]}),  # no assistant turn
        json.dumps({"messages": [{"role": "robot", "content": "beep"}, good[1]["messages"][1]]}),
        json.dumps(long_row),
        "",
        json.dumps(good[2]),
    ]
    (tmp_path / "mixed.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "empty.jsonl").write_text("")
    write_rows(good[3:], tmp_path / "good.parquet")
    pq.write_table(pa.table({"text": ["a", "b"]}), tmp_path / "other_column.parquet")
    files = [
        str(tmp_path / n) for n in ("mixed.jsonl", "empty.jsonl", "good.parquet", "other_column.parquet")
    ]

    samples, report = load_samples(files, tokenizer, seq_len=64)
    assert report.as_dict() == {
        "files": 4,
        "rows": 12,
        "used": 5,
        "too_long": 1,
        "no_assistant": 1,
        "malformed": 5,
        "first_malformed": f"{tmp_path}/mixed.jsonl:2: not JSON "
                           "(Expecting property name enclosed in double quotes)",
        "empty_files": [f"{tmp_path}/empty.jsonl"],
        "tokens": sum(len(s) for s in samples),
        "target_tokens": sum(s.num_targets for s in samples),
        "longest": max(len(s) for s in samples),
    }
    assert samples == [render(tokenizer, r["messages"]) for r in (good[0], good[2], *good[3:])]
    summary = report.summary("train")
    for part in (
        "12 rows in 4 files",
        "5 used",
        "1 longer than seq_len",
        "1 without an assistant turn",
        "5 malformed (first:",
        "mixed.jsonl:2",
        "1 empty files",
        "empty.jsonl",
    ):
        assert part in summary, part
    _, later = load_samples(files[2:], tokenizer, seq_len=64)  # a missing column names the file and the fix
    assert (
        later.malformed == 2
        and "other_column.parquet row 0: no column 'messages' (columns: text)" in later.first_malformed
    )
    _, roles = load_samples([str(tmp_path / "mixed.jsonl")], tokenizer, seq_len=1000)
    assert roles.too_long == 0 and roles.used == 3


def test_bad_role_example_names_the_row(tokenizer, tmp_path):
    write_rows([{"messages": [{"role": "robot", "content": "beep"}]}], tmp_path / "bad.parquet")
    _, report = load_samples([str(tmp_path / "bad.parquet")], tokenizer, seq_len=64)
    assert report.first_malformed == (
        f"{tmp_path}/bad.parquet row 0: message 0 has role 'robot', not one of system, user, assistant, tool"
    )


def test_a_missing_file_is_one_clear_error(tokenizer, tmp_path):
    with pytest.raises(MliteError, match=f"data file not found: {tmp_path}/nope.jsonl; fix data.train_files"):
        load_samples([str(tmp_path / "nope.jsonl")], tokenizer, seq_len=64)


def test_messages_key_is_configurable(tokenizer, tmp_path):
    rows = [{"conversation": r["messages"]} for r in demo_rows(5, seed=6)]
    write_rows(rows, tmp_path / "c.jsonl")
    samples, report = load_samples(
        [str(tmp_path / "c.jsonl")], tokenizer, seq_len=128, messages_key="conversation"
    )
    assert report.used == 5 and samples == [render(tokenizer, r["conversation"]) for r in rows]


def demo_job(tmp_path: Path, tokenizer_dir: Path, *overrides: str):
    paths = write_demo_data(tmp_path / "data", train=60, val=20, seed=7)
    return load_job(
        None,
        [
            "job=sft",
            "model.name=tiny-qwen3",
            f"data.train_files=[{paths['train.parquet']}]",
            f"data.val_files=[{paths['val.jsonl']}]",
            f"data.tokenizer={tokenizer_dir}",
            "data.seq_len=64",
            "data.global_batch_size=8",
            *overrides,
        ],
    )


def as_lists(step):
    micro_batches, targets = step
    return [(b.input_ids.tolist(), b.labels.tolist(), b.cu_seqlens.tolist()) for b in micro_batches], targets


def test_job_data_steps_and_resume(tokenizer_dir, tmp_path):
    job = demo_job(tmp_path, tokenizer_dir, "data.max_tokens_per_micro_batch=128")
    data = build_sft_data(job)
    assert data.report["train"]["used"] == 60 and data.report["val"]["used"] == 20
    assert "train: 60 rows in 1 files; 60 used" in data.summary() and "val: 20 rows" in data.summary()
    assert data.steps_per_epoch == 8  # 60 samples / 8 per step, the last step runs into epoch 2
    reference = [as_lists(data.next_step()) for _ in range(10)]
    for micro_batches, targets in reference:
        assert all(len(ids) <= 128 for ids, _, _ in micro_batches)
        assert targets == sum(sum(t != IGNORE for t in labels) for _, labels, _ in micro_batches)
        assert sum(len(cu) - 1 for _, _, cu in micro_batches) == 8
    assert data.epoch == 80 / 60

    first = build_sft_data(job)
    for _ in range(6):
        first.next_step()
    resumed = build_sft_data(job)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # the state survives JSON
    assert [as_lists(resumed.next_step()) for _ in range(4)] == reference[6:]

    val_steps = list(data.validation_steps())
    assert [sum(b.num_sequences for b in micro) for micro, _ in val_steps] == [8, 8, 4]
    assert sum(t for _, t in val_steps) == data.report["val"]["target_tokens"]


def test_job_data_split_over_dp_ranks(tokenizer_dir, tmp_path):
    job = demo_job(tmp_path, tokenizer_dir, "data.dynamic_batch=false", "data.micro_batch_size=2")
    ranks = [build_sft_data(job, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(3):
        (micro0, targets0), (micro1, targets1) = (r.next_step() for r in ranks)
        assert targets0 == targets1 == sum(b.num_target_tokens for b in micro0 + micro1)
        assert [b.num_sequences for b in micro0] == [b.num_sequences for b in micro1] == [2, 2]


def test_job_without_tokenizer_is_refused(tmp_path):
    job = load_job(None, ["job=sft", "model.name=tiny-qwen3", f"data.train_files=[{tmp_path}/x.jsonl]"])
    with pytest.raises(MliteError, match="no tokenizer: set data.tokenizer"):
        build_sft_data(job)
    job = load_job(
        None,
        [
            "job=sft",
            "model.name=tiny-qwen3",
            f"data.train_files=[{tmp_path}/x.jsonl]",
            f"data.tokenizer={tmp_path}",
        ],
    )
    with pytest.raises(MliteError, match=f"no tokenizer in {tmp_path}"):
        build_sft_data(job)


def test_shuffle_off_takes_rows_in_file_order(tokenizer, tokenizer_dir, tmp_path):
    job = demo_job(tmp_path, tokenizer_dir, "data.shuffle=false", "data.max_tokens_per_micro_batch=1024")
    shuffled = build_sft_data(demo_job(tmp_path, tokenizer_dir, "data.max_tokens_per_micro_batch=1024"))
    data = build_sft_data(job)
    rows = demo_rows(60, seed=7)  # write_demo_data's train split: the first 60 rows drawn with its seed
    want = sorted(render(tokenizer, r["messages"]).input_ids for r in rows[:8])
    (batch,), _ = data.next_step()
    assert sorted(seq.tolist() for seq in batch.split(batch.input_ids)) == want
    (other,), _ = shuffled.next_step()
    assert sorted(seq.tolist() for seq in other.split(other.input_ids)) != want
