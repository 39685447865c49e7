"""The demo tokenizer: deterministic files, loads offline with AutoTokenizer, fits the tiny presets' vocab,
round-trips text, splits digits, and its chat template renders Qwen's layout."""

from __future__ import annotations

import json
import os
import string
import subprocess
import sys

from hf_tiny import demo_tokenizer, demo_tokenizer_dir  # noqa: F401 (fixtures tokenizer, tokenizer_dir)

from mlite.runtime.data.demo import demo_rows
from mlite.runtime.data.tokenizer import ENDOFTEXT, IM_END, IM_START, train_demo_tokenizer


def test_same_seed_writes_the_same_files(tokenizer_dir, tmp_path):
    train_demo_tokenizer(tmp_path, seed=0)
    names = sorted(p.name for p in tokenizer_dir.iterdir())
    assert "tokenizer.json" in names and "tokenizer_config.json" in names
    assert names == sorted(p.name for p in tmp_path.iterdir())
    for name in names:
        assert (tokenizer_dir / name).read_bytes() == (tmp_path / name).read_bytes(), name


def test_loads_offline_in_a_fresh_process(tokenizer_dir):
    code = (
        "import sys; from transformers import AutoTokenizer;"
        "t = AutoTokenizer.from_pretrained(sys.argv[1]);"
        "print(len(t), t.eos_token, t.pad_token, t.apply_chat_template([{'role': 'user', 'content': 'hi'}],"
        " tokenize=False, add_generation_prompt=True)"
        " == '<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n')"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    out = subprocess.run(
        [sys.executable, "-c", code, str(tokenizer_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["256", IM_END, ENDOFTEXT, "True"]


def test_vocab_fits_the_tiny_presets_and_special_tokens_are_set(tokenizer, tokenizer_dir):
    assert len(tokenizer) == 256
    assert tokenizer.convert_tokens_to_ids([ENDOFTEXT, IM_START, IM_END]) == [0, 1, 2]
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (2, 0)
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["eos_token"] == IM_END and config["pad_token"] == ENDOFTEXT


def test_text_round_trips(tokenizer):
    texts = [m["content"] for row in demo_rows(200, seed=9) for m in row["messages"]]
    texts += [
        string.printable.replace("\r", "").replace("\x0b", "").replace("\x0c", ""),
        "  two  spaces\n\nlines\t",
    ]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    assert max(max(tokenizer.encode(t, add_special_tokens=False)) for t in texts) < 256


def test_digits_are_single_tokens_and_bpe_compresses(tokenizer):
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode("What is 372 + 48?", add_special_tokens=False))
    digits = [t.lstrip("Ġ") for t in tokens if any(c.isdigit() for c in t)]
    assert digits == ["3", "7", "2", "4", "8"]
    text = demo_rows(1, seed=0)[0]["messages"][-1]["content"]
    assert len(tokenizer.encode(text, add_special_tokens=False)) < 0.6 * len(text)  # merges learned


def test_chat_template_renders_qwen_layout(tokenizer):
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
    ]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
    )
