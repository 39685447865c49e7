"""Model catalog: every preset's parameter count equals transformers' own model (built on the meta device,
so no memory is used), and the published sizes come out within 2%."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from mlite.config.catalog import PRESETS, PUBLISHED_SIZES, count_params, preset_arch, resolve_arch
from mlite.config.schema import ModelConfig
from mlite.errors import MliteError


def hf_param_count(name: str) -> int:
    cfg = dict(PRESETS[name])
    hf_config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_count_equals_transformers_model(name):
    assert count_params(preset_arch(name)).total == hf_param_count(name)


@pytest.mark.parametrize("name", sorted(n for n in PUBLISHED_SIZES if n != "deepseek-v4-flash"))
def test_published_total_and_active_within_2_percent(name):
    total, active = PUBLISHED_SIZES[name]
    counts = count_params(preset_arch(name))
    assert counts.total / 1e9 == pytest.approx(total, rel=0.02)
    assert counts.active / 1e9 == pytest.approx(active, rel=0.02)


def test_deepseek_v4_flash_sizes():
    counts = count_params(preset_arch("deepseek-v4-flash"))
    assert counts.total / 1e9 == pytest.approx(284.0, rel=0.02)
    # The card's "13B active" sits between our counts without and with embeddings (docs/PLANNER.md).
    assert counts.non_embedding_active / 1e9 == pytest.approx(13.0, rel=0.02)
    assert 13.0 <= counts.active / 1e9 < 14.0
    assert counts.mtp / 1e9 == pytest.approx(6.6, rel=0.02)


def test_moe_counts_split_as_published():
    # DeepSeek-V3: 671B + 14B of MTP in the checkpoint, whose own embedding and head copies we share.
    v3 = count_params(preset_arch("deepseek-v3"))
    assert (v3.mtp + 2 * 129280 * 7168) / 1e9 == pytest.approx(13.5, rel=0.02)
    assert v3.non_embedding_total == v3.total - 2 * 129280 * 7168
    tied = count_params(preset_arch("qwen3-0.6b"))
    assert tied.embedding == 151936 * 1024  # tied: the head is the embedding


def test_v4_attention_kinds_follow_flash():
    arch = preset_arch("deepseek-v4-flash")
    ratios = arch.v4.compress_ratios
    assert ratios[:2] == (0, 0) and set(ratios[2::2]) == {4} and set(ratios[3::2]) == {128}
    assert arch.num_kv_heads == 1 and arch.head_dim == 512 and arch.v4.hc_mult == 4 and arch.mtp_layers == 1
    assert arch.moe.first_dense_layers == 0 and arch.moe.num_experts == 256 and arch.moe.top_k == 6


def test_local_hf_config_loads_like_the_preset(tmp_path):
    hf = AutoConfig.for_model("qwen3_moe",
                              **{k: v for k, v in PRESETS["qwen3-30b-a3b"].items() if k != "model_type"})
    hf.save_pretrained(tmp_path)  # a real config.json written by transformers
    arch = resolve_arch(ModelConfig(path=str(tmp_path)))
    assert count_params(arch) == count_params(preset_arch("qwen3-30b-a3b"))
    assert resolve_arch(ModelConfig(path=str(tmp_path / "config.json"))).moe.num_experts == 128


def test_transformers_v4_config_form_reads_the_same(tmp_path):
    cfg = {k: v for k, v in PRESETS["deepseek-v4-flash"].items() if k != "model_type"}
    hf = AutoConfig.for_model("deepseek_v4", **cfg)
    # transformers writes layer_types / compress_rates instead of compress_ratios
    hf.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "layer_types" in written
    assert count_params(resolve_arch(ModelConfig(path=str(tmp_path)))).total == count_params(
        preset_arch("deepseek-v4-flash")).total


def test_unknown_model_and_missing_config_are_one_line_errors(tmp_path):
    with pytest.raises(MliteError, match="unknown model 'qwen9'; known models: .*qwen3-8b"):
        resolve_arch(ModelConfig(name="qwen9"))
    with pytest.raises(MliteError, match="no HF config.json"):
        resolve_arch(ModelConfig(path=str(tmp_path / "nowhere")))
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(MliteError, match="model_type 'gpt2' is not supported"):
        resolve_arch(ModelConfig(path=str(tmp_path)))
