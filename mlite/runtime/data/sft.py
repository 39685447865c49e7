"""SFT data: messages-format parquet/JSONL -> chat-template tokens with an assistant-only loss mask -> packed
micro-batches per optimizer step.

    data = build_sft_data(job, dp_rank, dp_size)
    micro_batches, global_targets = data.next_step()
    print(data.summary())            # what was read, used and left out, in one paragraph

Rows are rendered with the tokenizer's chat template and `return_assistant_tokens_mask`; the template must
mark assistant turns with `{% generation %}` (the demo tokenizer's does). `check_assistant_mask` renders a
probe conversation first and refuses a template whose mask is not exactly each assistant turn's content
plus its end token. Nothing is dropped silently: empty files, malformed rows (with the first example), rows
without an assistant turn and rows longer than `data.seq_len` are counted in `DataReport`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mlite.config.catalog import resolve_arch
from mlite.config.schema import DataConfig, JobConfig
from mlite.errors import MliteError
from mlite.runtime.data.packed import PackedBatch
from mlite.runtime.data.packing import Sample, StepBatcher
from mlite.runtime.data.rows import read_rows
from mlite.runtime.data.tokenizer import check_token_ids, load_tokenizer

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class DataReport:
    files: int = 0
    rows: int = 0
    used: int = 0
    too_long: int = 0  # longer than data.seq_len: skipped
    no_assistant: int = 0  # nothing to train on: skipped
    malformed: int = 0  # missing key, bad role, not a list of {role, content}: skipped
    first_malformed: str | None = None
    empty_files: list[str] = field(default_factory=list)
    tokens: int = 0  # of the used rows
    target_tokens: int = 0
    longest: int = 0  # tokens of the longest used row

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self, name: str = "data") -> str:
        text = (
            f"{name}: {self.rows} rows in {self.files} files; {self.used} used ({self.tokens} tokens, "
            f"{self.target_tokens} trained, longest {self.longest}); skipped {self.too_long} longer than "
            f"seq_len, {self.no_assistant} without an assistant turn, {self.malformed} malformed"
        )
        if self.first_malformed:
            text += f" (first: {self.first_malformed})"
        if self.empty_files:
            text += f"; {len(self.empty_files)} empty files: {', '.join(self.empty_files)}"
        return text + "."

    def why_none_used(self, seq_len: int) -> str:
        """What left every row out, with counts per reason and the fix: the error when none is usable."""
        reasons = [
            f"{self.malformed} malformed (first: {self.first_malformed})" if self.malformed else "",
            f"{self.no_assistant} without an assistant turn to train on" if self.no_assistant else "",
            f"{self.too_long} longer than data.seq_len={seq_len}; raise it" if self.too_long else "",
            f"empty: {', '.join(self.empty_files)}" if self.empty_files else "",
        ]
        files = f"{self.files} file" + ("s" if self.files != 1 else "")
        return f"{self.used} of {self.rows} rows usable in {files}: " + "; ".join(r for r in reasons if r)


# ---------------------------------------------------------------------------------------------- reading
def read_messages(path: Path, messages_key: str, report: DataReport) -> Iterator[tuple[str, Any]]:
    """(where, the `messages_key` value) of every row of one file; unreadable rows are counted as
    malformed."""
    before, malformed_before = report.rows, report.malformed

    def count(problem: str) -> None:
        report.rows += 1
        _malformed(report, problem)

    for where, row in read_rows(path, count):
        report.rows += 1
        if messages_key not in row:
            _malformed(report, f"{where}: no column '{messages_key}' (columns: {', '.join(row)}); "
                               "set data.messages_key")
            continue
        yield where, row[messages_key]
    report.files += 1
    if report.rows == before and report.malformed == malformed_before:
        report.empty_files.append(str(path))


def _malformed(report: DataReport, example: str, count: int = 1) -> None:
    report.malformed += count
    report.first_malformed = report.first_malformed or example


def _problem(messages: Any) -> str | None:
    """Why these messages cannot be rendered, or None."""
    if not isinstance(messages, (list, tuple)) or not messages:
        return f"messages is {type(messages).__name__}, not a non-empty list"
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            return f"message {i} is not a {{role, content}} object with text content"
        if message.get("role") not in ROLES:
            return f"message {i} has role {message.get('role')!r}, not one of {', '.join(ROLES)}"
    return None


# ------------------------------------------------------------------------------------------- rendering
def render(tokenizer, messages: Sequence[dict]) -> Sample:
    out = tokenizer.apply_chat_template(
        list(messages), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return Sample(list(out["input_ids"]), [int(m) for m in out["assistant_masks"]])


def check_assistant_mask(tokenizer, name: str = "the tokenizer") -> None:
    """Refuse a chat template whose assistant mask is not exactly each assistant content + its end token."""
    probe = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "2 + 3 = 5. The answer is 5."},
        {"role": "user", "content": "And 4 * 6?"},
        {"role": "assistant", "content": "4 * 6 = 24."},
    ]
    sample = render(tokenizer, probe)
    spans, current = [], []
    for token, masked in zip(sample.input_ids, sample.loss_mask):
        if masked:
            current.append(token)
        elif current:
            spans, current = spans + [current], []
    spans += [current] if current else []
    wanted = [m["content"] for m in probe if m["role"] == "assistant"]
    got = [tokenizer.decode(span) for span in spans]
    ends = ("", tokenizer.eos_token or "")
    if len(got) != len(wanted) or any(
        g[len(w) :] not in ends or not g.startswith(w) for g, w in zip(got, wanted)
    ):
        raise MliteError(
            f"the chat template of {name} does not mark exactly the assistant turns for the loss "
            f"(masked: {got!r}, wanted each of {wanted!r} + its end token); "
            "use a template with {% generation %} around the "
            "assistant content, e.g. the demo tokenizer's (mlite/runtime/data/tokenizer.py)"
        )


def load_samples(
    files: Sequence[str], tokenizer, seq_len: int, messages_key: str = "messages"
) -> tuple[list[Sample], DataReport]:
    """Tokenised samples of every usable row, in file order, and the report of what was left out."""
    report, samples = DataReport(), []
    for name in files:
        for where, messages in read_messages(Path(name), messages_key, report):
            problem = _problem(messages)
            if problem:
                _malformed(report, f"{where}: {problem}")
                continue
            if not any(m["role"] == "assistant" for m in messages):
                report.no_assistant += 1
                continue
            sample = render(tokenizer, messages)
            if len(sample) > seq_len:
                report.too_long += 1
                continue
            samples.append(sample)
            report.used += 1
            report.tokens += len(sample)
            report.target_tokens += sample.num_targets
            report.longest = max(report.longest, len(sample))
    return samples, report


# ------------------------------------------------------------------------------------------ the dataset
class SFTData:
    """Training batches per step (resumable), validation batches, and the reports of both sets."""

    def __init__(
        self,
        train: Sequence[Sample],
        val: Sequence[Sample],
        config: DataConfig,
        *,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        pad_id: int = 0,
        train_report: DataReport | None = None,
        val_report: DataReport | None = None,
    ):
        budget = (
            {"max_tokens": config.max_tokens_per_micro_batch}
            if config.dynamic_batch
            else {"micro_batch_size": config.micro_batch_size}
        )

        def batcher(samples: Sequence[Sample], shuffle: bool) -> StepBatcher:
            return StepBatcher(
                samples,
                config.global_batch_size,
                seed=seed,
                dp_rank=dp_rank,
                dp_size=dp_size,
                shuffle=shuffle,
                pad_id=pad_id,
                **budget,
            )

        self.train = batcher(train, config.shuffle)
        self.val = batcher(val, shuffle=False) if val else None
        self.train_report, self.val_report = train_report or DataReport(), val_report

    @property
    def steps_per_epoch(self) -> int:
        return self.train.sampler.steps_per_epoch

    @property
    def epoch(self) -> float:
        return self.train.sampler.epoch

    def next_step(self) -> tuple[list[PackedBatch], int]:
        return self.train.next_step()

    @property
    def step_tokens(self) -> int:
        """The tokens of the step `next_step` returned last, over every data-parallel rank."""
        return self.train.last_tokens

    def validation_steps(self) -> Iterator[tuple[list[PackedBatch], int]]:
        """The whole validation set once, in file order, one global batch at a time (the last may be
        short)."""
        if self.val is None:
            return
        n, size = len(self.val.samples), self.val.sampler.batch_size
        for start in range(0, n, size):
            yield self.val.batches_for(range(start, min(start + size, n)))

    @property
    def report(self) -> dict:
        return {
            "train": self.train_report.as_dict(),
            **({"val": self.val_report.as_dict()} if self.val_report else {}),
        }

    def summary(self) -> str:
        parts = [self.train_report.summary("train")] + (
            [self.val_report.summary("val")] if self.val_report else []
        )
        return " ".join(parts)

    def state_dict(self) -> dict:
        return self.train.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.train.load_state_dict(state)


def build_sft_data(job: JobConfig, dp_rank: int = 0, dp_size: int = 1) -> SFTData:
    """The job's SFT data for this data-parallel rank."""
    data = job.data
    if not data.train_files:
        raise MliteError("data.train_files is empty; give messages-format parquet or JSONL files")
    tokenizer_path = data.tokenizer or job.model.path
    if tokenizer_path is None:
        raise MliteError("no tokenizer: set data.tokenizer (model.name is a preset without one)")
    tokenizer = load_tokenizer(tokenizer_path)
    check_assistant_mask(tokenizer, tokenizer_path)
    arch = resolve_arch(job.model)
    train, train_report = load_samples(data.train_files, tokenizer, data.seq_len, data.messages_key)
    _refuse_unusable("data.train_files", train, train_report, data.seq_len)
    check_token_ids((s.input_ids for s in train), arch.vocab, arch.name, tokenizer, tokenizer_path,
                    "data.train_files")
    val, val_report = [], None
    if data.val_files:  # asked for: none usable is an error too, not a run without evaluation
        val, val_report = load_samples(data.val_files, tokenizer, data.seq_len, data.messages_key)
        _refuse_unusable("data.val_files", val, val_report, data.seq_len)
        check_token_ids((s.input_ids for s in val), arch.vocab, arch.name, tokenizer, tokenizer_path,
                        "data.val_files")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    return SFTData(
        train,
        val,
        data,
        seed=job.trainer.seed,
        dp_rank=dp_rank,
        dp_size=dp_size,
        pad_id=pad_id,
        train_report=train_report,
        val_report=val_report,
    )


def _refuse_unusable(key: str, samples: Sequence[Sample], report: DataReport, seq_len: int) -> None:
    if not samples:
        raise MliteError(f"no usable rows in {key}: {report.why_none_used(seq_len)}")
