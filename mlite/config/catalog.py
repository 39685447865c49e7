"""Model catalog: architecture presets by name, and parameter counts computed from an architecture.

Each preset is the public HF `config.json` of that model, trimmed to the keys that shape it, and goes through
the same parser as a local checkpoint (`arch_from_hf_config`): one way to read an architecture. The tiny
presets are for CPU tests and the demo.

Counts are exact for the modules transformers builds (tests compare them with `numel()` of the transformers
model built on the meta device). The published totals leave out the multi-token-prediction (MTP) layers,
so `ParamCounts.total` does too and `ParamCounts.mtp` reports them apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlite.config.arch import ModelArch, arch_from_hf_config, load_hf_arch
from mlite.config.schema import ModelConfig
from mlite.errors import MliteError

_QWEN3 = dict(model_type="qwen3", head_dim=128, vocab_size=151936, rope_theta=1000000.0,
              max_position_embeddings=40960, rms_norm_eps=1e-6, hidden_act="silu")
_QWEN3_MOE = dict(_QWEN3, model_type="qwen3_moe", norm_topk_prob=True, decoder_sparse_step=1,
                  mlp_only_layers=[])
_LLAMA31 = dict(model_type="llama", vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
                max_position_embeddings=131072, hidden_act="silu", tie_word_embeddings=False,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
_DEEPSEEK = dict(vocab_size=129280, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False,
                 norm_topk_prob=True, n_shared_experts=1, num_nextn_predict_layers=1)

PRESETS: dict[str, dict] = {
    # ----------------------------------------------------------------------- tiny models for CPU tests
    "tiny-qwen3": dict(_QWEN3, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=256,
                       tie_word_embeddings=True, max_position_embeddings=512),
    "tiny-qwen3-moe": dict(_QWEN3_MOE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, intermediate_size=128,
                           moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, vocab_size=256,
                           tie_word_embeddings=False, max_position_embeddings=512),
    # sliding, CSA, HCA (ratio 16 here, 128 in the released models), CSA; the first layer hash-routed
    "tiny-deepseek-v4": dict(_DEEPSEEK, model_type="deepseek_v4", hidden_size=64, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=1, head_dim=32, qk_rope_head_dim=8,
                             moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                             q_lora_rank=32, o_groups=2, o_lora_rank=16,
                             layer_types=["sliding_attention", "compressed_sparse_attention",
                                          "heavily_compressed_attention", "compressed_sparse_attention"],
                             compress_rates={"compressed_sparse_attention": 4,
                                             "heavily_compressed_attention": 16},
                             mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
                             index_n_heads=2, index_head_dim=16, index_topk=4,
                             sliding_window=16, hc_mult=4, hc_sinkhorn_iters=20, rope_theta=10000.0,
                             compress_rope_theta=160000.0, max_position_embeddings=512, vocab_size=256,
                             scoring_func="sqrtsoftplus", routed_scaling_factor=1.5,
                             router_aux_loss_coef=0.001),
    # the smallest DeepSeek-V4 vLLM 0.25.1 runs right (its kernels fix head 512, index head 128, index top-k
    # 512, widths in 128s, and a hidden size in 2048s: mlite.plan.policy.vllm_v4_width_misfit), in the
    # release form: sliding, CSA, HCA, CSA, the first layer hash-routed; the demo tokenizer's vocabulary.
    # For the V4 rollout on a GPU (docs/GRPO.md)
    "small-deepseek-v4": dict(_DEEPSEEK, model_type="deepseek_v4", hidden_size=2048, num_hidden_layers=4,
                              num_attention_heads=16, num_key_value_heads=1, head_dim=512,
                              qk_rope_head_dim=64, moe_intermediate_size=256, n_routed_experts=16,
                              num_experts_per_tok=2, q_lora_rank=256, o_groups=2, o_lora_rank=256,
                              compress_ratios=[0, 4, 128, 4], num_hash_layers=1, index_n_heads=64,
                              index_head_dim=128, index_topk=512, sliding_window=128, hc_mult=4,
                              hc_sinkhorn_iters=20, rope_theta=10000.0, compress_rope_theta=160000.0,
                              max_position_embeddings=4096, vocab_size=384, scoring_func="sqrtsoftplus",
                              routed_scaling_factor=1.5, router_aux_loss_coef=0.001),
    # ----------------------------------------------------------------------------------- dense Qwen3
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, intermediate_size=3072, tie_word_embeddings=True),
    "qwen3-1.7b": dict(_QWEN3, hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, intermediate_size=6144, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=12288, tie_word_embeddings=False),
    "qwen3-32b": dict(_QWEN3, hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, intermediate_size=25600, tie_word_embeddings=False),
    # ------------------------------------------------------------------------------------- Qwen3 MoE
    "qwen3-30b-a3b": dict(_QWEN3_MOE, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False),
    "qwen3-235b-a22b": dict(_QWEN3_MOE, hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
                            num_key_value_heads=4, intermediate_size=12288, moe_intermediate_size=1536,
                            num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False),
    # ------------------------------------------------------------------------------------ Llama-3.1
    "llama-3.1-8b": dict(_LLAMA31, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=14336),
    "llama-3.1-70b": dict(_LLAMA31, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                          num_key_value_heads=8, intermediate_size=28672),
    # -------------------------------------------------------------------------------------- DeepSeek
    "deepseek-v3": dict(_DEEPSEEK, model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=61,
                        num_attention_heads=128, num_key_value_heads=128, intermediate_size=18432,
                        moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8,
                        first_k_dense_replace=3, moe_layer_freq=1, q_lora_rank=1536, kv_lora_rank=512,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, aux_loss_alpha=0.001,
                        rope_theta=10000.0, max_position_embeddings=163840,
                        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    # Flash: layers 0-1 sliding window only, then CSA (ratio 4) and HCA (ratio 128) alternating.
    "deepseek-v4-flash": dict(_DEEPSEEK, model_type="deepseek_v4", hidden_size=4096, num_hidden_layers=43,
                              num_attention_heads=64, num_key_value_heads=1, head_dim=512,
                              moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=6,
                              q_lora_rank=1024, o_groups=8, o_lora_rank=1024, qk_rope_head_dim=64,
                              compress_ratios=[0, 0] + [4, 128] * 20 + [4], num_hash_layers=3,
                              index_n_heads=64, index_head_dim=128, index_topk=512, sliding_window=128,
                              hc_mult=4, hc_sinkhorn_iters=20, rope_theta=10000.0,
                              compress_rope_theta=160000.0, max_position_embeddings=1048576,
                              scoring_func="sqrtsoftplus",
                              routed_scaling_factor=1.5),
}

# CUDA compute capability of each GPU type of `cluster.gpu` (mlite.config.schema.GPU_TYPES, "cpu" aside), for
# the rules that need tensor-core generations (mlite.plan.rules.check_fp8): FP8 matmuls need 8.9 (Ada) or
# newer, torchao's blockwise FP8 linear and FP8 grouped GEMM 9.0 (Hopper) or newer.
GPU_COMPUTE_CAPABILITY: dict[str, tuple[int, int]] = {
    "h100": (9, 0), "h800": (9, 0), "h200": (9, 0), "h20": (9, 0),
    "b200": (10, 0), "gb200": (10, 0), "b300": (10, 3), "gb300": (10, 3),
    "a100": (8, 0),
}

# Published sizes (billions of parameters, total / active per token, MTP excluded) from the model cards.
PUBLISHED_SIZES: dict[str, tuple[float, float]] = {
    "qwen3-0.6b": (0.6, 0.6),
    "qwen3-1.7b": (1.7, 1.7),
    "qwen3-8b": (8.2, 8.2),
    "qwen3-32b": (32.8, 32.8),
    "qwen3-30b-a3b": (30.5, 3.3),
    "qwen3-235b-a22b": (235.0, 22.0),
    "llama-3.1-8b": (8.0, 8.0),
    "llama-3.1-70b": (70.6, 70.6),
    "deepseek-v3": (671.0, 37.0),
    "deepseek-v4-flash": (284.0, 13.0),
}


def list_models() -> list[str]:
    return sorted(PRESETS)


def preset_arch(name: str) -> ModelArch:
    if name not in PRESETS:
        raise MliteError(f"unknown model '{name}'; known models: {', '.join(list_models())} "
                         "(or set model.path to a local HF checkpoint)")
    return arch_from_hf_config(PRESETS[name], name=name)


def resolve_arch(model: ModelConfig) -> ModelArch:
    """The architecture a job's `model:` section names: a catalog preset or a local HF config.json."""
    return preset_arch(model.name) if model.name is not None else load_hf_arch(model.path)


# ------------------------------------------------------------------------------------ parameter counts
@dataclass(frozen=True)
class LayerParams:
    """Parameters of one decoder layer, grouped by how parallelism shards them."""

    attention: int  # projections: split by tp
    mlp: int  # dense MLP or shared experts: split by tp
    experts: int  # all routed experts: split by ep x etp
    active_experts: int  # routed-expert parameters one token runs through (top_k of them)
    replicated: int  # norms, router, mHC mixing: a full copy on every rank

    @property
    def total(self) -> int:
        return self.attention + self.mlp + self.experts + self.replicated

    @property
    def active(self) -> int:
        return self.attention + self.mlp + self.active_experts + self.replicated


@dataclass(frozen=True)
class ParamCounts:
    total: int  # every parameter of the model (MTP layers excluded, as in the published sizes)
    active: int  # parameters one token runs through: top-k routed experts only
    embedding: int  # input embedding + untied output head
    mtp: int  # multi-token-prediction layers, counted apart

    @property
    def non_embedding_total(self) -> int:
        return self.total - self.embedding

    @property
    def non_embedding_active(self) -> int:
        return self.active - self.embedding

    def as_dict(self) -> dict[str, int]:
        return {"total": self.total, "active": self.active, "embedding": self.embedding, "mtp": self.mtp,
                "non_embedding_total": self.non_embedding_total,
                "non_embedding_active": self.non_embedding_active}


def _attention_params(arch: ModelArch, layer: int) -> tuple[int, int]:
    """(projection weights, norm/sink weights) of one attention block."""
    h = arch.hidden
    if arch.v4 is not None:
        v4, heads, hd = arch.v4, arch.num_heads, arch.head_dim
        proj = h * v4.q_lora_rank + v4.q_lora_rank * heads * hd + h * hd  # q down, q up, shared kv
        proj += heads * hd * v4.o_lora_rank + v4.o_groups * v4.o_lora_rank * h  # grouped low-rank output
        small = heads + v4.q_lora_rank + hd  # attention sinks, q and kv norms
        ratio = v4.compress_ratios[layer] if layer < len(v4.compress_ratios) else 0  # MTP: sliding window
        if ratio:
            width = 2 if ratio == 4 else 1  # CSA windows overlap: twice the compressed width
            proj += 2 * h * width * hd  # compressed kv + its gate
            small += ratio * width * hd + hd  # position bias, norm
            if ratio == 4:  # the lightning indexer picks which compressed rows each query sees
                ihd, iheads = v4.index_head_dim, v4.index_n_heads
                proj += 2 * h * width * ihd + v4.q_lora_rank * iheads * ihd + h * iheads
                small += ratio * width * ihd + ihd
        return proj, small
    if arch.mla is not None:
        m, heads = arch.mla, arch.num_heads
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = h * heads * qk if m.q_lora_rank is None else h * m.q_lora_rank + m.q_lora_rank * heads * qk
        proj = (q + h * (m.kv_lora_rank + m.qk_rope_head_dim)
                + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim))
        proj += heads * m.v_head_dim * h
        return proj, m.kv_lora_rank + (m.q_lora_rank or 0)
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    proj = h * (q + 2 * kv) + q * h
    if arch.attention_bias:
        proj += q + 2 * kv
    return proj, 2 * arch.head_dim if arch.qk_norm else 0


def layer_params(arch: ModelArch, layer: int) -> LayerParams:
    h = arch.hidden
    attention, replicated = _attention_params(arch, layer)
    replicated += 2 * h  # pre-attention and pre-MLP norms
    if arch.v4 is not None:  # mHC: a mixing map before each of the two sub-blocks
        n = arch.v4.hc_mult
        replicated += 2 * ((2 + n) * n * n * h + (2 + n) * n + 3)
    moe = arch.moe
    if moe is None or not moe.is_moe_layer(layer):
        return LayerParams(attention, 3 * h * arch.ffn, 0, 0, replicated)
    replicated += moe.num_experts * h  # router
    if moe.shared_expert_gate:
        replicated += h
    one_expert = 3 * h * moe.expert_ffn
    return LayerParams(attention, 3 * h * moe.shared_expert_ffn, moe.num_experts * one_expert,
                       moe.top_k * one_expert, replicated)


def embedding_params(arch: ModelArch) -> int:
    """Input embedding plus the output head when it is not tied to it."""
    return arch.vocab * arch.hidden * (1 if arch.tie_embeddings else 2)


def final_params(arch: ModelArch) -> int:
    """Final norm (and V4's mHC head that folds the residual copies back into one)."""
    extra = 0
    if arch.v4 is not None:
        n = arch.v4.hc_mult
        extra = n * n * arch.hidden + n + 1
    return arch.hidden + extra


def mtp_params(arch: ModelArch) -> int:
    """MTP layers: two norms, a 2h -> h projection, one full decoder layer (a MoE layer like the last one),
    and V4's own mHC head; embedding and output head are shared with the main model."""
    if not arch.mtp_layers:
        return 0
    h = arch.hidden
    # V4's MTP block sits past the last layer: sliding-window attention (no compressor), bias-routed MoE
    block = arch.num_layers if arch.v4 is not None else arch.num_layers - 1
    per_layer = 2 * h + 2 * h * h + layer_params(arch, block).total + h
    if arch.v4 is not None:
        per_layer += final_params(arch) - h
    return arch.mtp_layers * per_layer


def count_params(arch: ModelArch) -> ParamCounts:
    layers = [layer_params(arch, i) for i in range(arch.num_layers)]
    shared = embedding_params(arch) + final_params(arch)
    return ParamCounts(
        total=sum(p.total for p in layers) + shared,
        active=sum(p.active for p in layers) + shared,
        embedding=embedding_params(arch),
        mtp=mtp_params(arch),
    )
