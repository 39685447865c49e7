"""Tiny HF checkpoints made here with transformers (random weights, save_pretrained to safetensors), one per
family the native models cover, shared by tests/test_models.py and tests/test_hf_io.py; and the demo
tokenizer as the module fixtures `tokenizer_dir` and `tokenizer` (tests of the tokenizer and the SFT data)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
    initializer_range=0.1,  # larger than HF's 0.02 so logits and attention patterns are far from uniform
)
MOE = dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.01)

# name -> (config class, model class, config overrides)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "qwen3_tied": ("Qwen3Config", "Qwen3ForCausalLM", {"tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # q/k/v bias, no qk-norm
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            "rope_theta": 500000.0,
        },
    ),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", MOE | {"norm_topk_prob": True}),
    # unnormalised top-k weights and a dense layer among the MoE layers
    "qwen3_moe_mixed": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        MOE | {"norm_topk_prob": False, "mlp_only_layers": [0]},
    ),
}


def make_hf_model(family: str, seed: int = 0):
    config_cls, model_cls, overrides = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**(COMMON | overrides))
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # HF zero-initialises biases and sets norms to 1: randomise them so they are tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def save_hf_model(family: str, directory: Path, seed: int = 0, **save_kwargs) -> Path:
    model = make_hf_model(family, seed)
    model.save_pretrained(directory, **save_kwargs)
    return directory


@pytest.fixture(scope="module", name="tokenizer_dir")
def demo_tokenizer_dir(tmp_path_factory) -> Path:
    """Fixture `tokenizer_dir`: the demo tokenizer (seed 0) trained once per test module, which imports this
    function to use it."""
    from mlite.runtime.data.tokenizer import train_demo_tokenizer

    path = tmp_path_factory.mktemp("tok")
    train_demo_tokenizer(path, seed=0)
    return path


@pytest.fixture(scope="module", name="tokenizer")
def demo_tokenizer(tokenizer_dir: Path):
    """Fixture `tokenizer`: the demo tokenizer loaded with AutoTokenizer."""
    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
