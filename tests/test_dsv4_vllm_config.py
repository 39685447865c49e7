"""DeepSeek-V4 on vLLM 0.25.1: the config.json mlite hands vLLM, and which layers get YaRN.

The config. vLLM's DeepSeek-V4 code reads its figures straight off the HF config, in DeepSeek's release
spelling (`qk_rope_head_dim`, `compress_ratios`, `num_hash_layers`, `topk_method`, `rope_scaling`, ...);
tests/fixtures/vllm_0_25_1_dsv4_config_fields.json lists every read of the model, attention, compressor,
indexer, MoE and rope code (NVIDIA path; the AMD and XPU models read the same set; MTP / DSpark drafting is
left out) with its file:line and whether vLLM has a default (vLLM paths here are under
vllm/models/deepseek_v4/ unless they name another folder). `hf_config_from_arch` writes that release form
beside transformers' own spelling, and `write_hf_config` (what the vLLM rollout calls with the runtime's
config dict) adds the release fields a preset's or transformers' dict lacks. Without `topk_method: noaux_tc`
vLLM creates no correction bias (nvidia/model.py:578-582), so the `ffn.gate.bias` mlite sends (mapped to
`e_score_correction_bias` at nvidia/model.py:1311) would have nowhere to land.

RoPE: the reference applies YaRN to the compressed (CSA/HCA) layers only. DeepSeek's inference/model.py
(`Attention.__init__`) gives a layer with `compress_ratio` 0 `original_seq_len = 0`, which turns YaRN off in
`precompute_freqs_cis`, and uses `compress_rope_theta` with YaRN otherwise; transformers' DeepseekV4Config
keeps `rope_parameters["main"]` (sliding layers) default and puts the YaRN in `["compress"]`
(models/deepseek_v4/configuration_deepseek_v4.py:294-321 in transformers 5.10.4;
modeling_deepseek_v4.py:771-773 picks "main" for sliding layers). The committed fixture
(tests/fixtures/dsv4/tiny-yarn, written by transformers 5.23) pins it: mlite's forward equals its logits only
with YaRN on the compressed layers, and not with YaRN on every layer or on none
(`test_the_reference_applies_yarn_to_the_compressed_layers_only`).

vLLM 0.25.1 applies YaRN to every layer and switches only theta: each attention layer builds its rotary
embedding with `compress_ratio = max(1, compress_ratios[layer])` (attention.py:187-190, 242-248);
common/rope.py:18-19 picks `compress_rope_theta` for ratio > 1 and `rope_theta` otherwise, and
common/rope.py:21-26 makes every layer "deepseek_yarn" whenever the config's rope type is not "default";
vllm/model_executor/layers/rotary_embedding/__init__.py:284-314 builds the same
DeepseekV4ScalingRotaryEmbedding (same factor, same beta) for both, whose `_compute_inv_freq`
(deepseek_scaling_rope.py:78-107) ramps the low frequencies down by `factor`. So the sliding-window layers
(Flash: layers 0 and 1, and the MTP layer) get YaRN at theta 10000 in vLLM: rope pairs 21-31 of 32 differ, by
at most 0.037 rad of phase across the 128-token window
(`test_vllm_deviation_on_the_sliding_layers_is_bounded`); the compressed layers match.

No config works around it while the compressed layers use YaRN. The only per-layer input to vLLM's rope is
theta; `factor`, `original_max_position_embeddings`, `beta_fast`, `beta_slow`, `extrapolation_factor` and
`attn_factor` are one dict for all layers (mscale is forced off, common/rope.py:27-28; `apply_yarn_scaling`
only picks a name that __init__.py:284-314 maps to the same class). A layer's frequencies are theta^(-2i/d) *
g_i with g piecewise linear in the pair i (constant, ramp, constant), and a geometric sequence meets such a g
in at most 6 pairs. So for Flash (32 rope pairs), matching the reference's 16 unramped pairs of the compressed
layers and the 32 plain pairs of the sliding ones forces both thetas to the reference's; then the sliding
layers need g = 1 everywhere while the compressed ones need a factor other than 1, hence
`extrapolation_factor` 1 and a ramp still 0 at pair 31 for theta 10000, and a ramp starting at pair 15 for
theta 160000. Both ramp starts are floor(X / ln theta) of one shared X = d ln(L / (2 pi beta_fast)) / 2, and
15 <= X / ln 160000 < 16 gives X / ln 10000 < 20.9, never 31
(`test_no_vllm_config_gives_both_layer_kinds_the_reference_rope`). The other choice, rope type "default",
builds a plain RotaryEmbedding whose cos/sin cache is in the model dtype
(vllm/model_executor/layers/rotary_embedding/base.py:59-61), which V4's fused inverse rope refuses in a bf16
rollout (common/ops/fused_inv_rope_fp8_quant.py:189: fp32 only), and it drops the compressed layers' YaRN
anyway. So mlite writes the release's YaRN: the compressed layers exact, the sliding ones off by the bound
above, as for DeepSeek's own checkpoint on vLLM. Where the architecture has no scaling there is a work-around,
which the writer takes: YaRN of factor 1 over max_position_embeddings, plain RoPE on every layer in vLLM's V4
embedding (`test_without_scaling_vllm_gets_plain_rope_on_every_layer`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cli_runs import one_thread  # noqa: F401 (autouse: one intra-op thread)
from safetensors.torch import load_file

from mlite.config.arch import arch_from_hf_config
from mlite.config.catalog import PRESETS, preset_arch
from mlite.runtime.ckpt.hf import hf_config_from_arch, load_hf_weights, write_hf_config
from mlite.runtime.data.packed import PackedBatch
from mlite.runtime.models import build_model

ROOT = Path(__file__).resolve().parent.parent
FIELDS = json.loads((ROOT / "tests" / "fixtures" / "vllm_0_25_1_dsv4_config_fields.json").read_text())
DSV4 = ROOT / "tests" / "fixtures" / "dsv4"
CASES = sorted(p.name for p in DSV4.iterdir() if p.is_dir())

# DeepSeek-V4-Flash's release config.json: its YaRN (DeepSeek's inference ModelArgs: original_seq_len 65536,
# rope_factor 16, beta_fast 32, beta_slow 1), and the figures the catalog's preset leaves to the defaults
RELEASE_YARN = {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                "type": "yarn"}
FLASH_RELEASE = {
    "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64,
    "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8,
    "o_lora_rank": 1024, "sliding_window": 128, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 2048, "norm_topk_prob": True,
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0, "num_hash_layers": 3, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "rope_theta": 10000, "compress_rope_theta": 160000, "rope_scaling": RELEASE_YARN,
    "num_nextn_predict_layers": 1, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
}


def fixture_arch(case: str):
    return arch_from_hf_config(json.loads((DSV4 / case / "config.json").read_text()))


def flash_with_release_yarn():
    return arch_from_hf_config({**PRESETS["deepseek-v4-flash"], "rope_scaling": RELEASE_YARN},
                               name="deepseek-v4-flash")


ARCHS = {
    "tiny-deepseek-v4": lambda: preset_arch("tiny-deepseek-v4"),
    "deepseek-v4-flash": lambda: preset_arch("deepseek-v4-flash"),
    "flash-release-yarn": flash_with_release_yarn,
    **{f"fixture-{case}": (lambda case=case: fixture_arch(case)) for case in CASES},
}


# ------------------------------------------------------------------------------------ rope, two ways
def release_inv_freq(dim: int, theta: float, yarn: dict | None) -> torch.Tensor:
    """DeepSeek's `precompute_freqs_cis` (inference/model.py): YaRN where the layer passes its original
    length."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if yarn is None:
        return freqs
    original, factor = yarn["original_max_position_embeddings"], yarn["factor"]

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.get("beta_fast", 32))), 0)
    high = min(math.ceil(correction_dim(yarn.get("beta_slow", 1))), dim - 1)
    smooth = 1 - ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    return freqs / factor * (1 - smooth) + freqs * smooth


def reference_layer_freqs(cfg: dict, layer: int) -> torch.Tensor:
    """The release semantics: the compressed layers' theta with YaRN, the sliding layers' plain."""
    if cfg["compress_ratios"][layer] > 0:
        return release_inv_freq(cfg["qk_rope_head_dim"], cfg["compress_rope_theta"], cfg["rope_scaling"])
    return release_inv_freq(cfg["qk_rope_head_dim"], cfg["rope_theta"], None)


def vllm_rope(cfg: dict, layer: int) -> SimpleNamespace:
    """vLLM 0.25.1's rotary embedding for `layer` of a config.json, as its source builds it."""
    # transformers_utils/configs/deepseek_v4.py:22; the legacy `type` key (transformers_utils/config.py:464)
    rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {"rope_type": "default"})
    if "rope_type" not in rope and "type" in rope:
        rope["rope_type"] = rope["type"]
    layers = cfg["num_hidden_layers"]
    ratio = max(1, cfg["compress_ratios"][layer]) if layer < layers else 1  # attention.py:187-190
    theta = cfg["compress_rope_theta"] if ratio > 1 else cfg.get("rope_theta", 10000.0)  # rope.py:18-19
    dim = cfg["qk_rope_head_dim"]  # rope.py:30
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if rope["rope_type"] == "default":  # rope.py:21: no V4 embedding (rotary_embedding/__init__.py:101-143)
        return SimpleNamespace(cls="RotaryEmbedding", inv_freq=1.0 / pos_freqs, theta=theta)
    # rope.py:21-29 -> rotary_embedding/__init__.py:284-314 -> deepseek_scaling_rope.py:78-107
    factor, original = rope["factor"], rope["original_max_position_embeddings"]
    beta_fast, beta_slow = rope.get("beta_fast", 32), rope.get("beta_slow", 1)

    def correction_dim(rotations):  # rotary_embedding/common.py:34-59
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
    mask = (1 - ramp) * rope.get("extrapolation_factor", 1)
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - mask) + 1.0 / pos_freqs * mask
    # mscale and mscale_all_dim are forced to 0 (rope.py:27-28): the cos/sin magnitude is attn_factor
    return SimpleNamespace(cls="DeepseekV4ScalingRotaryEmbedding", inv_freq=inv_freq, theta=theta,
                           magnitude=rope.get("attn_factor", 1), positions=int(original * factor))


# ------------------------------------------------------------------------------- the fields fixture
def test_the_fields_fixture_names_each_read_and_its_default():
    """Each entry names vLLM's file and line and holds that line's text (taken from the 0.25.1 wheel), which
    reads the field; an optional read says its default."""
    for field, entry in FIELDS.items():
        path, line = entry["read_at"].rsplit(":", 1)
        assert path.startswith("vllm/") and path.endswith(".py") and int(line) > 0, field
        assert isinstance(entry["required"], bool), field
        assert entry["required"] or "default" in entry, f"{field}: optional reads say their default"
        assert field.split(".")[-1] in entry["text"], f"{field}: {entry['read_at']} reads `{entry['text']}`"


@pytest.mark.gpu
@pytest.mark.vllm
def test_the_fields_fixture_is_the_installed_vllms_source():
    """Where vLLM is installed (the device machine, scripts/gpu_vllm_env.sh): every fixture line is still the
    installed source's, so a vLLM upgrade that moves a read fails here, naming it."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    assert spec is not None, "vllm is not installed: source scripts/gpu_vllm_env.sh (or deselect -m vllm)"
    assert importlib.metadata.version("vllm") == "0.25.1", "the fixture was read from vLLM 0.25.1"
    root = Path(spec.origin).parent.parent
    for field, entry in FIELDS.items():
        path, line = entry["read_at"].rsplit(":", 1)
        text = (root / path).read_text().splitlines()[int(line) - 1].strip()
        assert text == entry["text"], f"{field}: {entry['read_at']} is now `{text}`"


def top_level(required: bool) -> list[str]:
    return [f for f, e in FIELDS.items() if "." not in f and e["required"] is required]


def expected_vllm_view(arch) -> dict:
    """What each field vLLM reads must say for `arch`, from the architecture alone."""
    v4, moe = arch.v4, arch.moe
    return {
        "hidden_size": arch.hidden, "num_attention_heads": arch.num_heads, "q_lora_rank": v4.q_lora_rank,
        "o_lora_rank": v4.o_lora_rank, "head_dim": arch.head_dim, "qk_rope_head_dim": v4.qk_rope_head_dim,
        "o_groups": v4.o_groups, "sliding_window": v4.sliding_window, "num_hidden_layers": arch.num_layers,
        "rms_norm_eps": arch.rms_norm_eps, "max_position_embeddings": arch.max_position_embeddings,
        "index_topk": v4.index_topk, "index_n_heads": v4.index_n_heads, "index_head_dim": v4.index_head_dim,
        "rope_theta": arch.rope_theta, "compress_rope_theta": v4.compress_rope_theta,
        "routed_scaling_factor": v4.routed_scaling_factor, "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k, "moe_intermediate_size": moe.expert_ffn,
        "swiglu_limit": v4.swiglu_limit, "norm_topk_prob": moe.norm_topk_prob, "scoring_func": "sqrtsoftplus",
        "num_hash_layers": v4.num_hash_layers, "vocab_size": arch.vocab, "topk_method": "noaux_tc",
        "n_shared_experts": moe.shared_experts, "hidden_act": arch.hidden_act, "hc_mult": v4.hc_mult,
        "hc_sinkhorn_iters": v4.hc_sinkhorn_iters, "hc_eps": v4.hc_eps,
        # unquantised weights: the expert dtype only renames quantisation scales (nvidia/model.py:1282-1316);
        # expert groups only label EPLB's bookkeeping
        "expert_dtype": "fp4", "n_group": 1,
    }


def check_vllm_reads(cfg: dict, arch) -> None:
    """Every field vLLM requires is there, and every field it reads (or defaults) says what `arch` does."""
    missing = [f for f in top_level(True) if cfg.get(f) is None]
    assert not missing, f"vLLM reads {missing} directly; the config lacks them"
    rope = cfg["rope_scaling"]
    for field in (f for f, e in FIELDS.items() if f.startswith("rope_scaling.") and e["required"]):
        key = field.removeprefix("rope_scaling.")
        assert key in rope or (key == "rope_type" and "type" in rope), f"rope_scaling lacks {key}"
    want = expected_vllm_view(arch)
    assert set(want) == {f for f in FIELDS if "." not in f} - {"compress_ratios", "rope_scaling"}
    for field, value in want.items():
        seen = cfg[field] if FIELDS[field]["required"] else cfg.get(field, FIELDS[field]["default"])
        assert seen == value, f"{field}: vLLM sees {seen!r}, the architecture says {value!r}"
    # vLLM indexes compress_ratios by layer (attention.py:188)
    assert cfg["compress_ratios"][:arch.num_layers] == list(arch.v4.compress_ratios)


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_the_written_config_has_what_vllm_reads(name):
    arch = ARCHS[name]()
    cfg = hf_config_from_arch(arch)
    check_vllm_reads(cfg, arch)
    assert cfg["compress_ratios"] == [*arch.v4.compress_ratios, *[0] * arch.mtp_layers]  # the release's MTP 0


@pytest.mark.parametrize("source", ["tiny-deepseek-v4", "deepseek-v4-flash", *CASES])
def test_the_rollouts_config_from_a_preset_or_transformers_dict_has_what_vllm_reads(source, tmp_path):
    """vllm_rollout writes `write_hf_config(dest, arch, runtime.hf_config, dtype)`: the preset's dict or the
    checkpoint's config.json. A transformers-form one (the fixture's: nested rope_parameters, no
    rope_scaling) would break vLLM's rope path outright; the written one keeps every source key."""
    if source in PRESETS:
        cfg = dict(PRESETS[source])
    else:
        cfg = json.loads((DSV4 / source / "config.json").read_text())
    arch = arch_from_hf_config(cfg, name=source)
    write_hf_config(tmp_path / "config.json", arch, cfg, torch.bfloat16)
    written = json.loads((tmp_path / "config.json").read_text())
    check_vllm_reads(written, arch)
    given = {k: v for k, v in cfg.items() if v is not None}
    assert {k: written[k] for k in given} == given
    assert arch_from_hf_config(written, name=source) == arch
    if "rope_parameters" in cfg:
        with pytest.raises(KeyError, match="rope_type"):
            vllm_rope({**written, "rope_scaling": None}, 0)
    assert vllm_rope(written, 0).cls == "DeepseekV4ScalingRotaryEmbedding"


def test_flash_is_written_in_the_release_form():
    """The catalog's Flash preset with the release's YaRN writes DeepSeek-V4-Flash's release values for every
    field vLLM reads. The preset itself lacks that YaRN (so mlite trains it with plain RoPE everywhere), and
    its config says so in the form vLLM needs: YaRN of factor 1."""
    cfg = hf_config_from_arch(ARCHS["flash-release-yarn"]())
    assert {k: cfg[k] for k in FLASH_RELEASE} == FLASH_RELEASE
    assert set(top_level(True)) <= set(FLASH_RELEASE)
    preset = hf_config_from_arch(preset_arch("deepseek-v4-flash"))
    assert {k: preset[k] for k in FLASH_RELEASE if k != "rope_scaling"} == {
        k: v for k, v in FLASH_RELEASE.items() if k != "rope_scaling"}
    assert preset["rope_scaling"] == {"type": "yarn", "factor": 1.0, "beta_fast": 32, "beta_slow": 1,
                                      "original_max_position_embeddings": 1048576}


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_the_written_config_reads_back_as_the_same_architecture(name):
    arch = ARCHS[name]()
    assert arch_from_hf_config(hf_config_from_arch(arch), name=arch.name) == arch


@pytest.mark.parametrize("name", ["tiny-deepseek-v4", *(f"fixture-{case}" for case in CASES)])
def test_topk_method_gives_every_bias_routed_layer_its_correction_bias(name):
    """vLLM's MoE (nvidia/model.py:563-582): a hash table below num_hash_layers, else a correction bias only
    when topk_method is noaux_tc; `ffn.gate.bias` loads into it (nvidia/model.py:1311). Exactly the layers
    whose `ffn.gate.bias` mlite sends."""
    arch = ARCHS[name]()
    cfg = SimpleNamespace(**hf_config_from_arch(arch))
    model = build_model(arch, attention_backend="torch", device="meta", init=False)
    sent = {n for entry in model.hf_layout() for n in entry.hf_names}
    for layer in range(arch.num_layers):
        hashed = layer < cfg.num_hash_layers
        bias = not hashed and getattr(cfg, "topk_method", None) == "noaux_tc"
        assert (f"layers.{layer}.ffn.gate.tid2eid" in sent, f"layers.{layer}.ffn.gate.bias" in sent) == (
            hashed, bias), layer
    assert any(f"layers.{layer}.ffn.gate.bias" in sent for layer in range(arch.num_layers))


# ----------------------------------------------------------------------------------------- RoPE
def fixture_logits(model, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    model.device_freqs.clear()  # freqs are copied per device once; a test that swaps them starts afresh
    batch = PackedBatch.from_sequences([s.tolist() for s in seqs])
    logits = model.compute_logits(model(batch).hidden)
    return list(logits.split([len(s) for s in seqs]))


def test_the_reference_applies_yarn_to_the_compressed_layers_only():
    """transformers' own run (tests/fixtures/dsv4/tiny-yarn: YaRN factor 4 over 32 positions, sequences up
    to 45, one sliding layer) is matched by mlite's rope, whose per-layer frequencies are the release
    semantics'; YaRN on every layer (vLLM's choice) or on none moves the logits far off."""
    folder = DSV4 / "tiny-yarn"
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["rope_parameters"]["main"]["rope_type"] == "default"
    assert cfg["rope_parameters"]["compress"]["rope_type"] == "yarn"
    arch = arch_from_hf_config(cfg)
    model = build_model(arch, init=False)
    load_hf_weights(model, folder)
    release = hf_config_from_arch(arch)
    kinds = {model.layers[str(i)].attn.rope_kind for i in range(arch.num_layers)}
    assert kinds == {"main", "compress"}
    for layer in range(arch.num_layers):
        ours = model.freqs[model.layers[str(layer)].attn.rope_kind]
        torch.testing.assert_close(ours, reference_layer_freqs(release, layer), atol=0, rtol=1e-6)

    ref = load_file(folder / "reference.safetensors")
    seqs = [ref[f"input_ids.{i}"] for i in range(sum(k.startswith("input_ids.") for k in ref))]
    want = [ref[f"logits.{i}"] for i in range(len(seqs))]

    def off(freqs: dict) -> float:
        model.freqs = freqs
        with torch.no_grad():
            return max((g - w).abs().max().item() for g, w in zip(fixture_logits(model, seqs), want))

    dim, yarn = arch.v4.qk_rope_head_dim, arch.v4.compress_rope_scaling
    plain_main = release_inv_freq(dim, arch.rope_theta, None)
    yarn_compress = release_inv_freq(dim, arch.v4.compress_rope_theta, yarn)
    assert off({"main": plain_main, "compress": yarn_compress}) < 1e-4  # measured 6e-6
    yarn_main = release_inv_freq(dim, arch.rope_theta, yarn)
    assert off({"main": yarn_main, "compress": yarn_compress}) > 0.1  # 0.53
    plain_compress = release_inv_freq(dim, arch.v4.compress_rope_theta, None)
    assert off({"main": plain_main, "compress": plain_compress}) > 0.1  # 2.97


@pytest.mark.parametrize("name", ["flash-release-yarn", "fixture-tiny-yarn"])
def test_vllm_applies_yarn_to_every_layer(name):
    """With the release's YaRN, vLLM's compressed layers have the reference frequencies and its sliding
    layers do not (rope.py:18-26 switches theta, never the YaRN)."""
    cfg = hf_config_from_arch(ARCHS[name]())
    for layer in range(cfg["num_hidden_layers"]):
        rope, ref = vllm_rope(cfg, layer), reference_layer_freqs(cfg, layer)
        assert rope.cls == "DeepseekV4ScalingRotaryEmbedding" and rope.magnitude == 1
        if cfg["compress_ratios"][layer]:
            torch.testing.assert_close(rope.inv_freq, ref, atol=0, rtol=1e-6)
        else:
            assert rope.theta == cfg["rope_theta"]
            assert not torch.allclose(rope.inv_freq, ref, atol=0, rtol=1e-4)


def test_vllm_deviation_on_the_sliding_layers_is_bounded():
    """Flash: vLLM's sliding layers ramp rope pairs 21-31 of 32; within the 128-token window the phase of a
    query-key pair moves by at most 0.037 rad (relative positions 0-127 are all a sliding layer sees)."""
    cfg = hf_config_from_arch(ARCHS["flash-release-yarn"]())
    sliding = [i for i in range(cfg["num_hidden_layers"]) if cfg["compress_ratios"][i] == 0]
    assert sliding == [0, 1]
    diff = (vllm_rope(cfg, 0).inv_freq - reference_layer_freqs(cfg, 0)).abs()
    assert torch.nonzero(diff).flatten().tolist() == list(range(21, 32))
    phase = (cfg["sliding_window"] - 1) * diff.max().item()
    assert 0.03 < phase < 0.04, phase


def test_no_vllm_config_gives_both_layer_kinds_the_reference_rope():
    """The shared ramp: vLLM's compressed layers reproduce the reference only with the ramp starting at
    pair 15 for theta 160000; the sliding layers would need it to start at pair 31 or later for theta 10000;
    both starts are floor(X / ln theta) of one X = d ln(L / (2 pi beta_fast)) / 2."""
    cfg = hf_config_from_arch(ARCHS["flash-release-yarn"]())
    dim, half = cfg["qk_rope_head_dim"], cfg["qk_rope_head_dim"] // 2
    ref = reference_layer_freqs(cfg, 2) / release_inv_freq(dim, cfg["compress_rope_theta"], None)
    unramped = int((ref == 1).sum())  # pairs 0..15 keep their frequency in the reference
    assert unramped == 16 and ref[unramped] < 1 and ref[-1] == pytest.approx(1 / 16)
    low_compressed = unramped - 1  # the ramp is 0 at its start, so pair 15 starts it
    x_max = (low_compressed + 1) * math.log(cfg["compress_rope_theta"])  # X / ln 160000 < 16
    assert x_max / math.log(cfg["rope_theta"]) < 20.9 < half - 1
    # the release's own X sits in that interval: vLLM's compressed layers match, its sliding ones ramp at 20
    x = dim * math.log(65536 / (2 * math.pi * 32)) / 2
    assert math.floor(x / math.log(cfg["compress_rope_theta"])) == 15
    assert math.floor(x / math.log(cfg["rope_theta"])) == 20
    # rope type "default" instead: a plain RotaryEmbedding (no V4 embedding) and no YaRN anywhere
    assert vllm_rope({**cfg, "rope_scaling": {"rope_type": "default"}}, 2).cls == "RotaryEmbedding"


@pytest.mark.parametrize("name", ["tiny-deepseek-v4", "deepseek-v4-flash", "fixture-tiny"])
def test_without_scaling_vllm_gets_plain_rope_on_every_layer(name):
    """The work-around where the architecture has no YaRN: factor 1 over max_position_embeddings gives vLLM's
    V4 embedding with plain frequencies on every layer, as mlite computes them, for every position."""
    arch = ARCHS[name]()
    assert arch.v4.compress_rope_scaling is None
    cfg = hf_config_from_arch(arch)
    model = build_model(arch, attention_backend="torch", device="meta", init=False)
    for layer in range(arch.num_layers):
        rope = vllm_rope(cfg, layer)
        assert rope.cls == "DeepseekV4ScalingRotaryEmbedding" and rope.magnitude == 1
        assert rope.positions == arch.max_position_embeddings
        torch.testing.assert_close(rope.inv_freq, reference_layer_freqs(cfg, layer), atol=0, rtol=1e-6)
        ours = model.freqs[model.layers[str(layer)].attn.rope_kind]
        torch.testing.assert_close(rope.inv_freq, ours, atol=0, rtol=1e-6)


@pytest.mark.parametrize("name", ["tiny-deepseek-v4", "flash-release-yarn", "fixture-tiny-yarn"])
def test_transformers_reads_the_written_config_with_yarn_on_the_compressed_layers(name):
    """The release fields do not disturb transformers: its DeepseekV4Config keeps the written layer kinds
    and builds the same two ropes mlite uses."""
    import transformers
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as modeling
    arch = ARCHS[name]()
    written = hf_config_from_arch(arch)
    config = transformers.DeepseekV4Config(**written)
    assert config.rope_parameters["main"]["rope_type"] == "default"
    ratios = {"sliding_attention": 0, **config.compress_rates}
    assert [ratios[kind] for kind in config.layer_types] == list(arch.v4.compress_ratios)
    rotary = modeling.DeepseekV4RotaryEmbedding(config)
    model = build_model(arch, attention_backend="torch", device="meta", init=False)
    for kind in ("main", "compress"):
        torch.testing.assert_close(getattr(rotary, f"{kind}_inv_freq"), model.freqs[kind], atol=0, rtol=1e-6)
