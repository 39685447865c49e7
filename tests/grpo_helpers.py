"""Shared by the GRPO tests: a real (tiny, character-level) HF tokenizer with a chat template, and jobs."""

from __future__ import annotations

import string
from pathlib import Path

from mlite.config import job_from_dict
from mlite.runtime.data.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS


def char_tokenizer(folder: Path):
    """One token per character (+ chat specials), saved and reloaded like any HF tokenizer, with the demo
    tokenizer's chat template (its assistant turns marked for the SFT loss)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    chars = sorted(set(string.ascii_letters + string.digits + string.punctuation + " \n"))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def tiny_hf_qwen3(folder: Path, tokenizer=None, **sizes) -> Path:
    """A tiny untied Qwen3 written by transformers (safetensors, seed 0) into `folder`, sized to `tokenizer`
    (a char tokenizer saved there when none is given); `sizes` override config keys (VLLM_SIZES: heads
    vLLM's kernels take)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = tokenizer or char_tokenizer(folder)
    torch.manual_seed(0)
    config = Qwen3Config(**{
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        **sizes,
    })
    Qwen3ForCausalLM(config).save_pretrained(folder)
    return folder


# vLLM's attention kernels take head_dim 32 and up
VLLM_SIZES = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 32}


def grpo_job_dict(output_dir: Path, **sections) -> dict:
    """A tiny GRPO job on the CPU (tiny-qwen3, fp32, 4 steps of 2 prompts x 4 responses, text_reward),
    writing to `output_dir`; `sections` update the job's sections key by key."""
    job = {
        "job": "grpo",
        "model": {"name": "tiny-qwen3", "attention_backend": "torch"},
        "cluster": {"gpus_per_node": 1, "gpu": "cpu", "host_memory_gb": 8},
        "precision": {"compute": "fp32"},
        "optimizer": {"lr": 1e-3, "schedule": "constant"},
        "data": {"seq_len": 64, "max_tokens_per_micro_batch": 64},
        "trainer": {"steps": 4, "device": "cpu", "output_dir": str(output_dir), "seed": 3},
        "rollout": {
            "n": 4,
            "prompts_per_step": 2,
            "max_prompt_length": 48,
            "max_response_length": 6,
            "temperature": 1.0,
        },
        "grpo": {"reward": "grpo_helpers:text_reward"},
    }
    for name, values in sections.items():
        job[name] = {**job.get(name, {}), **values}
    return job


def grpo_job(tmp_path: Path, **sections):
    """grpo_job_dict's job, writing to tmp_path/run, as a JobConfig."""
    return job_from_dict(grpo_job_dict(tmp_path / "run", **sections))


def text_reward(response: str, sample) -> float:
    """A dense reward for untrained tiny models: the visible length of the response, plus 1 when it contains
    the answer (random weights emit many ids outside the 99-token vocabulary, which decode to nothing)."""
    return len(response) / 10 + (1.0 if sample["answer"] in response else 0.0)


def digit_reward(response: str, sample) -> float:
    """The share of digits in the response, plus 1 when it contains the answer: an untrained char-level
    model emits a digit about one character in ten, so the responses of a group score differently and every
    step has advantages to train on."""
    digits = sum(c.isdigit() for c in response)
    return digits / max(len(response), 1) + (1.0 if sample["answer"] in response else 0.0)


def explodes_on_x(response: str, sample) -> float:
    if "x" in response:
        raise KeyError("no score for x")
    return text_reward(response, sample)
