"""A small byte-level BPE tokenizer trained on the demo texts, saved as an HF tokenizer directory.

    train_demo_tokenizer("runs/demo/tokenizer", seed=0)      # seconds
    AutoTokenizer.from_pretrained("runs/demo/tokenizer")       # offline

Digits are split one by one before BPE (as Qwen does), so arithmetic sees every digit. The initial alphabet is
printable ASCII plus space, tab and newline in byte-level form, so any ASCII text round-trips even with a
vocabulary of 256 (the tiny presets' size). The chat template is Qwen's `<|im_start|>role ... <|im_end|>`
layout with the assistant's content and its `<|im_end|>` inside `{% generation %}`, so
`apply_chat_template(..., return_assistant_tokens_mask=True)` marks exactly what SFT trains on.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from mlite.errors import MliteError

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _ascii_alphabet() -> list[str]:
    """Printable ASCII, space, tab and newline as the byte-level pre-tokenizer spells them."""
    from tokenizers import pre_tokenizers

    byte_chars = pre_tokenizers.ByteLevel.alphabet()  # the 256 stand-ins, unordered
    spelled = {
        b: pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(chr(b))[0][0]
        for b in [9, 10, *range(32, 127)]
    }
    assert set(spelled.values()) <= set(byte_chars)
    return sorted(spelled.values())


def train_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 256):
    """Train byte-level BPE on `texts` and save an HF tokenizer dir; returns the loaded HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=_ascii_alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
    hf.save_pretrained(str(out_dir))
    return hf


def train_demo_tokenizer(out_dir: str | Path, seed: int = 0, vocab_size: int = 256, rows: int = 2000):
    """The demo's tokenizer: BPE over the chat-rendered text of `rows` demo rows drawn with `seed`."""
    from mlite.runtime.data.demo import demo_rows

    texts = [f"{m['role']}\n{m['content']}" for row in demo_rows(rows, seed) for m in row["messages"]]
    return train_tokenizer(texts, out_dir, vocab_size)


def load_tokenizer(path: str | Path):
    """The one tokenizer loader of every trainer: an HF tokenizer dir (data.tokenizer or model.path)."""
    from transformers import AutoTokenizer

    if not Path(path, "tokenizer.json").is_file() and not Path(path, "tokenizer_config.json").is_file():
        raise MliteError(f"no tokenizer in {path} (tokenizer.json missing); "
                         "set data.tokenizer to a tokenizer dir")
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as err:
        raise MliteError(f"cannot load the tokenizer from {path} ({type(err).__name__}: {err}); point "
                         "data.tokenizer at a dir with tokenizer.json") from None


def check_token_ids(ids: Iterable[list[int]], vocab: int, model: str, tokenizer, source: str,
                    key: str) -> None:
    """Refuse data whose token ids the model's embedding has no row for, in one line, before anything trains
    (the embedding would fail mid-step with an index error): a tokenizer larger than the model's
    vocabulary, such as the demo's 267-token tokenizer with a 256-row tiny preset."""
    top = max((max(row) for row in ids if row), default=-1)
    if top >= vocab:
        raise MliteError(
            f"{key}: token id {top} is outside {model}'s vocabulary of {vocab} (the tokenizer in {source} "
            f"has {len(tokenizer)} tokens); use a tokenizer that fits the model, or a model whose vocab_size "
            f"is at least {len(tokenizer)}"
        )
