"""Model architecture description shared by the planner (counts, memory) and the runtime (building models).

`ModelArch` is plain data (no torch). It is built from an HF `config.json` (`arch_from_hf_config`) or from a
catalog preset (`mlite.config.catalog`). The runtime's model code reads only these fields.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from mlite.errors import MliteError

# HF model_type -> our family. Families share model code: llama/qwen2/qwen3 are one dense decoder that
# differs only in flags (qk-norm, qkv bias, tied embeddings).
FAMILIES = {
    "qwen3": "dense",
    "qwen2": "dense",
    "llama": "dense",
    "mistral": "dense",
    "qwen3_moe": "moe",
    "qwen2_moe": "moe",
    "deepseek_v3": "deepseek",
    "deepseek_v4": "deepseek_v4",
}


@dataclass(frozen=True)
class MoEArch:
    num_experts: int  # routed experts
    top_k: int
    expert_ffn: int  # intermediate size of one routed expert
    shared_experts: int = 0
    shared_expert_ffn: int = 0  # total intermediate size of the shared expert(s)
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    router_aux_loss_coef: float = 0.001
    first_dense_layers: int = 0  # leading layers with a dense MLP (DeepSeek first_k_dense_replace)
    dense_layers: tuple[int, ...] = ()  # explicit dense-MLP layer indices (Qwen mlp_only_layers)
    layer_freq: int = 1  # every n-th layer is MoE (Qwen decoder_sparse_step)
    shared_expert_gate: bool = False  # qwen2_moe: sigmoid gate on the shared expert

    def is_moe_layer(self, layer: int) -> bool:
        if layer < self.first_dense_layers or layer in self.dense_layers:
            return False
        return (layer + 1) % self.layer_freq == 0


@dataclass(frozen=True)
class MLAArch:
    """DeepSeek multi-head latent attention dimensions."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


# DeepSeek-V4 per-layer attention kinds, keyed by the compression ratio HF configs use (`compress_ratios`).
V4_CSA = 4  # the ratio of compressed sparse attention (overlapping windows, the lightning indexer)
V4_ATTENTION_KINDS = {0: "sliding_attention", V4_CSA: "compressed_sparse_attention",
                      128: "heavily_compressed_attention"}
# The key-set attention's layout rules, read by the model and the planner alike: a CSA layer whose entries
# are at most this many times its top-k takes all of them, masked per query; above it, each query gathers
# its picked entries. Above V4_KEY_SET_LOGITS logits a layer's core runs in chunks of query blocks.
V4_DENSE_ENTRIES_PER_PICK = 4
V4_KEY_SET_LOGITS = 1 << 28


# V4 config keys that DeepSeekV4Arch and ModelArch.mtp_layers model, so no leftovers (`extra`): spelled
# differently by the release, transformers and a preset, they must not make one architecture read as two
_V4_MODELLED = frozenset({"compress_ratios", "compress_rates", "compress_rope_theta", "index_n_heads",
                          "index_head_dim", "index_topk", "sliding_window", "hc_mult", "hc_sinkhorn_iters",
                          "hc_eps", "num_nextn_predict_layers"})


@dataclass(frozen=True)
class DeepSeekV4Arch:
    """DeepSeek-V4 figures: one shared KV head, low-rank grouped output, CSA/HCA compressors, mHC residuals.

    CSA layers (ratio 4) compress KV 4:1 with overlapping windows and pick visible rows with a lightning
    indexer; HCA layers (ratio 128) compress 128:1 without an indexer; ratio-0 layers are sliding window only.
    """

    q_lora_rank: int
    o_groups: int  # heads are split into groups for the low-rank output projection
    o_lora_rank: int  # per-group rank of that projection
    qk_rope_head_dim: int
    compress_ratios: tuple[int, ...]  # per layer: 0 (sliding window), 4 (CSA) or 128 (HCA)
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    sliding_window: int
    hc_mult: int  # mHC: copies of the residual stream
    num_hash_layers: int  # leading MoE layers routed by token-id hash
    compress_rope_theta: float = 160000.0  # RoPE base of the compressed (CSA/HCA) layers
    compress_rope_scaling: dict | None = None  # YaRN, on the compressed layers' rope only (when given)
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0  # routed and shared experts clamp gate/up pre-activations


@dataclass(frozen=True)
class ModelArch:
    name: str
    model_type: str  # HF model_type
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int  # dense MLP intermediate size
    vocab: int
    tie_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    moe: MoEArch | None = None
    mla: MLAArch | None = None
    # family-specific figures not modelled above (kept for reference)
    extra: dict = field(default_factory=dict)
    v4: DeepSeekV4Arch | None = None  # DeepSeek-V4 attention, mHC and hash routing
    mtp_layers: int = 0  # multi-token-prediction layers in the checkpoint (DeepSeek num_nextn_predict_layers)

    @property
    def family(self) -> str:
        return FAMILIES[self.model_type]

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def arch_from_hf_config(cfg: dict[str, Any], name: str = "") -> ModelArch:
    """Read an HF config.json dict (dense Qwen3/Qwen2/Llama, Qwen3-MoE, DeepSeek-V3/V4)."""
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        raise MliteError(
            f"model_type '{model_type}' is not supported; supported: {', '.join(sorted(FAMILIES))}"
        )
    try:
        hidden = int(cfg["hidden_size"])
        rope = cfg.get("rope_parameters") or {}  # transformers >= 5 keeps rope_theta/scaling here
        heads = int(cfg["num_attention_heads"])
        moe = _moe_from_hf_config(cfg, model_type)
        mla = _mla_from_hf_config(cfg) if model_type == "deepseek_v3" else None
        v4 = _v4_from_hf_config(cfg) if model_type == "deepseek_v4" else None
        known = {f.name for f in fields(ModelArch)}
        return ModelArch(
            name=name or cfg.get("_name_or_path") or model_type,
            model_type=model_type,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            ffn=int(cfg.get("intermediate_size") or 0),
            vocab=int(cfg["vocab_size"]),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            attention_bias=bool(cfg.get("attention_bias", model_type in ("qwen2", "qwen2_moe"))),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta")
                             or (rope.get("main") or {}).get("rope_theta", 10000.0)),
            # V4's scaling applies to its compressed layers only (DeepSeekV4Arch.compress_rope_scaling)
            rope_scaling=None if v4 is not None else (
                cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            moe=moe,
            mla=mla,
            v4=v4,
            mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
            extra={k: v for k, v in cfg.items()
                   if k not in known and k.startswith(("compress", "index", "hc_", "num_nextn", "sliding"))
                   and not (v4 is not None and k in _V4_MODELLED)},
        )
    except KeyError as err:
        raise MliteError(f"HF config ({model_type}) lacks key {err}; is it a complete config.json?") from None


def _moe_from_hf_config(cfg: dict[str, Any], model_type: str) -> MoEArch | None:
    """The routed experts of an HF config, as each MoE family names them; None for a dense model. Its
    KeyErrors are `arch_from_hf_config`'s to report."""
    if model_type in ("qwen3_moe", "qwen2_moe"):
        return MoEArch(
            num_experts=int(cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]),
            top_k=int(cfg["num_experts_per_tok"]),
            expert_ffn=int(cfg["moe_intermediate_size"]),
            shared_experts=1 if cfg.get("shared_expert_intermediate_size") else 0,
            shared_expert_ffn=int(cfg.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", model_type == "qwen3_moe")),
            router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
            dense_layers=tuple(cfg.get("mlp_only_layers") or ()),
            layer_freq=int(cfg.get("decoder_sparse_step", 1)),
            shared_expert_gate=model_type == "qwen2_moe",
        )
    if model_type in ("deepseek_v3", "deepseek_v4"):
        return MoEArch(
            num_experts=int(cfg["n_routed_experts"]),
            top_k=int(cfg["num_experts_per_tok"]),
            expert_ffn=int(cfg["moe_intermediate_size"]),
            shared_experts=int(cfg.get("n_shared_experts", 1)),
            shared_expert_ffn=int(cfg.get("n_shared_experts", 1)) * int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            router_aux_loss_coef=float(cfg["router_aux_loss_coef"] if model_type == "deepseek_v4"
                                       and "router_aux_loss_coef" in cfg
                                       else cfg.get("aux_loss_alpha", 0.0001)),
            # V4 has no dense prefix (its first layers are hash-routed MoE), whatever
            # first_k_dense_replace says
            first_dense_layers=(0 if model_type == "deepseek_v4"
                                else int(cfg.get("first_k_dense_replace", 0))),
            layer_freq=int(cfg.get("moe_layer_freq", 1)),
        )
    return None


def _mla_from_hf_config(cfg: dict[str, Any]) -> MLAArch:
    """DeepSeek-V3's multi-head latent attention: the low-rank q and kv projections and the head split."""
    return MLAArch(
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
    )


def _v4_from_hf_config(cfg: dict[str, Any]) -> DeepSeekV4Arch:
    """Read V4 attention kinds from either form HF configs use: `compress_ratios` (per layer 0/4/128, the
    released checkpoints, which also list the MTP layer) or `layer_types` + `compress_rates`
    (transformers)."""
    layers = int(cfg["num_hidden_layers"])
    if cfg.get("compress_ratios") is not None:
        ratios = tuple(int(r) for r in cfg["compress_ratios"][:layers])
    else:
        rates = {kind: ratio for ratio, kind in V4_ATTENTION_KINDS.items()}
        rates.update(cfg.get("compress_rates") or {})
        # transformers' default when a config names neither: two HCA layers, then CSA/HCA alternating
        kinds = cfg.get("layer_types") or (
            ["heavily_compressed_attention"] * min(layers, 2)
            + ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
               for i in range(layers - 2)]
        )
        ratios = tuple(int(rates[k]) for k in kinds[:layers])
    if len(ratios) != layers:
        raise MliteError(f"DeepSeek-V4 config lists {len(ratios)} attention kinds for {layers} layers")
    hash_layers = cfg.get("num_hash_layers")
    if hash_layers is None:
        hash_layers = sum(1 for k in cfg.get("mlp_layer_types") or ["hash_moe"] * 3 if k == "hash_moe")
    head_dim = int(cfg.get("head_dim") or 512)
    rope_dim = cfg.get("qk_rope_head_dim") or int(head_dim * float(cfg.get("partial_rotary_factor") or 0.125))
    if cfg.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
        raise MliteError(f"DeepSeek-V4 scoring_func '{cfg['scoring_func']}' is not supported; the native "
                         "model routes with sqrtsoftplus, as the released models do")
    rope = cfg.get("rope_parameters") or {}
    compress_rope = rope.get("compress") if isinstance(rope.get("compress"), dict) else {}
    scaling = cfg.get("rope_scaling") or (
        compress_rope if compress_rope.get("rope_type", "default") != "default" else None)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) != "yarn":
        raise MliteError("DeepSeek-V4 rope scaling must be yarn (or absent); got "
                         f"{scaling.get('rope_type', scaling.get('type'))}")
    if scaling is not None and scaling.get("factor") == 1:
        scaling = None  # YaRN of factor 1 is plain RoPE: how a config for vLLM says "no scaling"
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
    return DeepSeekV4Arch(
        compress_rope_theta=float(cfg.get("compress_rope_theta")
                                  or compress_rope.get("rope_theta", 160000.0)),
        compress_rope_scaling=scaling,
        hc_sinkhorn_iters=int(cfg.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(cfg.get("hc_eps", 1e-6)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.5)),
        swiglu_limit=float(cfg.get("swiglu_limit", 10.0)),
        q_lora_rank=int(cfg["q_lora_rank"]),
        o_groups=int(cfg["o_groups"]),
        o_lora_rank=int(cfg["o_lora_rank"]),
        qk_rope_head_dim=int(rope_dim),
        compress_ratios=ratios,
        index_n_heads=int(cfg["index_n_heads"]),
        index_head_dim=int(cfg["index_head_dim"]),
        index_topk=int(cfg.get("index_topk", 512)),
        sliding_window=int(cfg.get("sliding_window", 128)),
        hc_mult=int(cfg.get("hc_mult", 4)),
        num_hash_layers=int(hash_layers),
    )


def load_hf_arch(path: str | Path) -> ModelArch:
    """Architecture of a local HF checkpoint (its directory or its config.json)."""
    p = Path(path)
    cfg_file = p / "config.json" if p.is_dir() else p
    if not cfg_file.is_file():
        raise MliteError(f"no HF config.json at {path}; pass a checkpoint directory or a config.json file")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as err:
        raise MliteError(f"{cfg_file} is not valid JSON ({err.msg} at line {err.lineno})") from None
    return arch_from_hf_config(cfg, name=p.name if p.is_dir() else p.parent.name)
