"""Dense decoder family (Qwen3, Qwen2, Llama, Mistral) and Qwen3-MoE, over packed token streams.

One model, flags from `ModelArch`: q/k RMSNorm per head (Qwen3), q/k/v bias (Qwen2), tied embeddings, MoE
MLPs on the layers `arch.moe.is_moe_layer` names. Reads top to bottom: attention, MLP, block, model, then
the mapping to HF parameter names.

Built for parallelism (see mlite.runtime.parallel.parallelize): `layers` is a ModuleDict keyed by global
layer index, so a pipeline stage keeps global names; `embed`, `norm` and `output` are None on stages that
do not hold them, and then forward takes / returns the residual stream. Heads are reshaped with -1 so
tensor-parallel shards need no model change. The model imports no parallel code: parallel code changes how
it computes only through its declared seams: `Attention.set_core` (context parallel, selective
recompute), `Block.set_runner` (full recompute), `MoE.set_parallel` (expert parallel dispatch, router
statistics over cp x tp) and `Experts.set_local_view` (this rank's slice of the stacked experts).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from mlite.config.arch import ModelArch
from mlite.errors import MliteError
from mlite.runtime.data.packed import PackedBatch
from mlite.runtime.kernels import cached_attention, varlen_attention
from mlite.runtime.models.base import (
    CausalLM,
    HFTensors,
    KVCache,
    LossHead,
    ModelOutput,
    RMSNorm,
    apply_rope,
    rope_cos_sin,
    rope_inv_freq,
    same_tensor,
)
from mlite.runtime.models.moe import MoE, RouterStats, load_balancing_loss

ACTIVATIONS = {"silu": F.silu, "gelu": functools.partial(F.gelu, approximate="tanh"), "relu": F.relu}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise MliteError(
            f"hidden_act '{name}' is not supported by the native models; supported: {', '.join(ACTIVATIONS)}"
        )
    return ACTIVATIONS[name]


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, backend: str):
        super().__init__()
        h, d = arch.hidden, arch.head_dim
        self.head_dim = d
        self.q_proj = nn.Linear(h, arch.num_heads * d, bias=arch.attention_bias)
        self.k_proj = nn.Linear(h, arch.num_kv_heads * d, bias=arch.attention_bias)
        self.v_proj = nn.Linear(h, arch.num_kv_heads * d, bias=arch.attention_bias)
        # Qwen2 puts a bias on q/k/v only; Llama and Qwen3 with attention_bias on all four projections
        self.o_proj = nn.Linear(
            arch.num_heads * d, h, bias=arch.attention_bias and arch.model_type != "qwen2"
        )
        self.q_norm = RMSNorm(d, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(d, arch.rms_norm_eps) if arch.qk_norm else None
        self.core = functools.partial(packed_attention, backend=backend)

    def set_core(self, core) -> None:
        """The seam: `core(q, k, v, batch) -> out` replaces packed attention (context parallel, recompute)."""
        self.core = core

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, H] -> q [T, heads, d], k/v [T, kv_heads, d] with rotary embeddings applied."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, -1, self.head_dim)  # -1: the local heads under tensor parallel
        k = self.k_proj(x).view(t, -1, self.head_dim)
        v = self.v_proj(x).view(t, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(
        self, x: torch.Tensor, batch: PackedBatch, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        q, k, v = self.qkv(x, cos, sin)
        out = self.core(q, k, v, batch)  # [T, heads, d]
        return self.o_proj(out.reshape(x.shape[0], -1))

    def decode(self, x, cos, sin, cache_k, cache_v, positions) -> torch.Tensor:
        """x [B, t, H]; writes this step's keys and values at their positions, attends over the cache."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x.reshape(b * t, -1), cos.reshape(b * t, -1), sin.reshape(b * t, -1))
        valid = positions >= 0
        rows = torch.arange(b, device=x.device)[:, None].expand(b, t)[valid]
        cache_k[rows, positions[valid]] = k.view(b, t, *k.shape[1:])[valid].to(cache_k.dtype)
        cache_v[rows, positions[valid]] = v.view(b, t, *v.shape[1:])[valid].to(cache_v.dtype)
        used = int(positions.max()) + 1
        out = cached_attention(
            q.view(b, t, *q.shape[1:]),
            cache_k[:, :used].to(q.dtype),
            cache_v[:, :used].to(q.dtype),
            positions,
        )
        return self.o_proj(out.reshape(b, t, -1))


def packed_attention(q, k, v, batch: PackedBatch, backend: str = "torch") -> torch.Tensor:
    return varlen_attention(q, k, v, batch.cu_seqlens, batch.max_seqlen or max(batch.seq_lens), backend)


class MLP(nn.Module):
    """SwiGLU: down(act(gate(x)) * up(x))."""

    def __init__(self, hidden: int, ffn: int, act):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor, batch=None) -> tuple[torch.Tensor, None]:  # the MoE block's call
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x)), None


class Block(nn.Module):
    def __init__(self, arch: ModelArch, layer: int, backend: str):
        super().__init__()
        act = activation(arch.hidden_act)
        self.attn_norm = RMSNorm(arch.hidden, arch.rms_norm_eps)
        self.attn = Attention(arch, backend)
        self.mlp_norm = RMSNorm(arch.hidden, arch.rms_norm_eps)
        if arch.moe is not None and arch.moe.is_moe_layer(layer):
            m = arch.moe
            self.mlp = MoE(arch.hidden, m.num_experts, m.top_k, m.expert_ffn, m.norm_topk_prob, act)
        else:
            self.mlp = MLP(arch.hidden, arch.ffn, act)
        self.runner = None

    def set_runner(self, runner) -> None:
        """The seam: `runner(body, x, batch, cos, sin)` runs the block's body another way (recompute)."""
        self.runner = runner

    def forward(self, x, batch: PackedBatch, cos, sin) -> tuple[torch.Tensor, RouterStats | None]:
        """x [T, H] -> (x, this block's router statistics, None for a dense MLP)."""
        if self.runner is not None:
            return self.runner(self.body, x, batch, cos, sin)
        return self.body(x, batch, cos, sin)

    def body(self, x, batch: PackedBatch, cos, sin) -> tuple[torch.Tensor, RouterStats | None]:
        x = x + self.attn(self.attn_norm(x), batch, cos, sin)
        out, stats = self.mlp(self.mlp_norm(x), batch)
        return x + out, stats

    def decode(self, x, cos, sin, cache_k, cache_v, positions) -> torch.Tensor:  # x [B, t, H]
        x = x + self.attn.decode(self.attn_norm(x), cos, sin, cache_k, cache_v, positions)
        h = self.mlp_norm(x)
        out, _ = self.mlp(h.reshape(-1, h.shape[-1]))
        return x + out.view_as(x)


class Transformer(CausalLM):
    def __init__(
        self,
        arch: ModelArch,
        attention_backend: str = "torch",
        layers: Iterable[int] | None = None,
    ):
        """`layers`: the global layer indices this model holds (all by default). The stage holding layer 0
        has the embedding; the one holding the last layer has the final norm and the LM head."""
        super().__init__()
        self.arch = arch
        held = sorted(range(arch.num_layers) if layers is None else layers)
        first, last = 0 in held, arch.num_layers - 1 in held
        self.embed = nn.Embedding(arch.vocab, arch.hidden) if first else None
        self.layers = nn.ModuleDict({str(i): Block(arch, i, attention_backend) for i in held})
        self.norm = RMSNorm(arch.hidden, arch.rms_norm_eps) if last else None
        self.output = nn.Linear(arch.hidden, arch.vocab, bias=False) if last else None
        self.tie_embeddings()
        self.inv_freq_args = (arch.head_dim, arch.rope_theta, arch.rope_scaling)
        rope_inv_freq(*self.inv_freq_args)  # refuse an unsupported rope scaling at build time

    def tie_embeddings(self) -> None:
        """A tied LM head (tie_word_embeddings) reads the embedding's matrix: one parameter. The seam for
        parallel code that registers the embedding's weight anew (tensor parallel's vocab split)."""
        if self.arch.tie_embeddings and self.embed is not None and self.output is not None:
            self.output.weight = self.embed.weight

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(positions, rope_inv_freq(*self.inv_freq_args, device=positions.device), dtype)

    def forward(self, batch: PackedBatch, hidden: torch.Tensor | None = None) -> ModelOutput:
        """Packed batch -> hidden [T, H]. Without an embedding (a later pipeline stage) `hidden` is the
        input."""
        x = self.embed(batch.input_ids) if self.embed is not None else hidden  # [T, H]
        if x is None:
            raise ValueError("this pipeline stage has no embedding: pass the previous stage's hidden states")
        cos, sin = self.rope(batch.position_ids, x.dtype)  # [T, head_dim]
        stats = []
        for layer in self.layers.values():
            x, layer_stats = layer(x, batch, cos, sin)
            if layer_stats is not None:
                stats.append(layer_stats)
        if self.norm is not None:
            x = self.norm(x)
        aux = torch.zeros((), device=x.device, dtype=torch.float32)
        if stats:  # pooled over this stage's MoE layers (all of them without pipeline parallel), as HF does
            aux = load_balancing_loss(stats, self.arch.moe.num_experts, self.arch.moe.router_aux_loss_coef)
        return ModelOutput(hidden=x, aux_loss=aux, router_stats=stats)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, vocab]."""
        return self.output(hidden)

    def loss_head(self) -> LossHead | None:
        return None if self.output is None else LossHead(self.output, self.embed)

    # ------------------------------------------------------------------ inference with a KV cache
    def new_kv_cache(self, batch_size: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
        ref = next(self.parameters())
        shape = (batch_size, max_len, self.arch.num_kv_heads, self.arch.head_dim)

        def make() -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype or ref.dtype, device=ref.device)

        return KVCache(k={n: make() for n in self.layers}, v={n: make() for n in self.layers})

    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
               last_only: bool = False) -> torch.Tensor:
        """input_ids, positions [B, t] (position -1 marks padding) -> logits [B, t, vocab], or with
        `last_only` [B, 1, vocab] at each row's last real position (a prefill needs no other).

        Prefill a right-padded batch of prompts with t = longest prompt, then call with t = 1 and each row's
        next position. Slot p of the cache holds position p, so rows of different lengths need no shifting."""
        if self.embed is None or self.output is None:
            raise ValueError("decode needs the whole model (embedding and LM head) on one stage")
        if int(positions.max()) >= cache.max_len:
            raise ValueError(
                f"position {int(positions.max())} is beyond the KV cache ({cache.max_len} slots)"
            )
        x = self.embed(input_ids)  # [B, t, H]
        cos, sin = self.rope(positions.clamp(min=0), x.dtype)  # [B, t, head_dim]
        for name, layer in self.layers.items():
            x = layer.decode(x, cos, sin, cache.k[name], cache.v[name], positions)
        if last_only:
            last = ((positions >= 0).sum(dim=1) - 1).clamp(min=0)  # right-padded rows
            x = x[torch.arange(x.shape[0], device=x.device), last][:, None]
        return self.compute_logits(self.norm(x))

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Normal(0, std) matrices and embeddings, zero biases, unit norms (transformers' initialisation)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, MoE):
                nn.init.normal_(module.experts.gate_up, std=std)
                nn.init.normal_(module.experts.down, std=std)

    def hf_layout(self) -> list[HFTensors]:
        """Native parameter <-> HF checkpoint names (transformers' on-disk names, per-expert for MoE)."""
        layout = []
        for name, _ in self.named_parameters():  # a tied LM head is listed once, as the embedding
            layout.append(_hf_tensors(name, self))
        if self.arch.tie_embeddings and self.embed is None and self.output is not None:
            # a last pipeline stage without the embedding keeps its own copy of the tied matrix
            layout = [
                same_tensor("model.embed_tokens.weight", "output.weight") if t.param == "output.weight" else t
                for t in layout
            ]
        return layout


_TOP_LEVEL = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_IN_LAYER = {
    "attn_norm.": "input_layernorm.",
    "mlp_norm.": "post_attention_layernorm.",
    "attn.": "self_attn.",
    "mlp.router.": "mlp.gate.",
}


def _hf_tensors(name: str, model: Transformer) -> HFTensors:
    if name in _TOP_LEVEL:
        return same_tensor(_TOP_LEVEL[name], name)
    _, index, rest = name.split(".", 2)  # layers.{i}.{rest}
    prefix = f"model.layers.{index}."
    if rest.startswith("mlp.experts."):
        ids = range(model.layers[index].mlp.experts.down.shape[0])  # global shape, also under ep (DTensor)
        if rest == "mlp.experts.gate_up":  # [E, 2F, H] <-> gate_proj [F, H] and up_proj [F, H] per expert
            names = [f"{prefix}mlp.experts.{e}.{p}.weight" for e in ids for p in ("gate_proj", "up_proj")]
            return HFTensors(
                name,
                names,
                split=lambda t: [half for expert in t for half in expert.chunk(2, dim=0)],
                join=lambda ts: torch.stack([torch.cat(ts[i : i + 2]) for i in range(0, len(ts), 2)]),
            )
        names = [f"{prefix}mlp.experts.{e}.down_proj.weight" for e in ids]  # [E, H, F] <-> down_proj [H, F]
        return HFTensors(name, names, split=lambda t: list(t.unbind(0)), join=lambda ts: torch.stack(ts))
    for ours, theirs in _IN_LAYER.items():
        if rest.startswith(ours):
            rest = theirs + rest[len(ours) :]
            break
    return same_tensor(prefix + rest, name)
