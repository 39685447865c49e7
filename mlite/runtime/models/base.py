"""Pieces every model family shares: the base class with the seams the loss reads (`CausalLM`), the forward
output, the KV cache, RMSNorm, rotary embeddings and the description of how one native parameter is stored
in an HF checkpoint."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from mlite.errors import MliteError


@dataclass
class ModelOutput:
    hidden: torch.Tensor  # [T, H]: after the final norm on the last stage, the residual stream before it
    aux_loss: torch.Tensor  # scalar: MoE load-balancing loss times its coefficient (0 for dense models)
    # per MoE layer of this model (or pipeline chunk): the sums the balance loss pools; a pipeline pools
    # them across stages (mlite.runtime.parallel.pipeline)
    router_stats: list = field(default_factory=list)
    # losses of this model's (or chunk's) own layers, already in aux_loss, that need no pooling across
    # stages (DeepSeek-V4's indexer and MTP losses): a pipeline back-propagates them per stage
    own_loss: torch.Tensor | None = None


# FSDP2 finds a module's output tensors by pytree flattening, to unshard its parameters again before their
# backward; an unregistered dataclass hides them and the root's weights (final norm, embedding) would be
# read after being freed (an illegal memory access on GPUs).
torch.export.register_dataclass(ModelOutput)  # torch's public entry to its pytree registry


@dataclass(frozen=True)
class LossHead:
    """What the loss (mlite.runtime.loss) needs to know of a model's LM head, as the model declares it
    (`CausalLM.loss_head`), so the loss code knows no model family.

    `linear`: the module the model's `compute_logits` applies to the hidden states, and nothing more.
    `embedding`: this model's input embedding, None where it holds none (a later pipeline stage); a head
    whose weight is the embedding's is tied to it.
    `read_in_forward`: the model's own forward applies the head as well (DeepSeek-V4's multi-token
    prediction loss), so its weight is read again after the loss's own use."""

    linear: Callable[[torch.Tensor], torch.Tensor]
    embedding: nn.Module | None = None
    read_in_forward: bool = False


class CausalLM(nn.Module):
    """A model family's seams beyond its forward: `compute_logits` (hidden states -> logits) and
    `loss_head`, what the loss may know of the head behind it."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def loss_head(self) -> LossHead | None:
        """The head `compute_logits` applies; None where it applies no plain module (the loss then treats
        compute_logits as an opaque function)."""
        return None


def loss_head_of(compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> LossHead | None:
    """The head a model declares (`CausalLM.loss_head`) when `compute_logits` is that model's own
    `compute_logits` method, as the runtime hands it to the loss; None for any other callable."""
    model = getattr(compute_logits, "__self__", None)
    if isinstance(model, CausalLM) and compute_logits.__func__ is type(model).compute_logits:
        return model.loss_head()
    return None


@dataclass
class KVCache:
    """Keys and values per layer for decoding a padded batch; slot p of row b holds position p of
    sequence b."""

    k: dict[str, torch.Tensor]  # layer name -> [B, S, kv_heads, head_dim]
    v: dict[str, torch.Tensor]

    @property
    def max_len(self) -> int:
        return next(iter(self.k.values())).shape[1]


@dataclass
class HFTensors:
    """How one native parameter is stored in an HF checkpoint: under `hf_names`, cut by `split` (native ->
    HF tensors, in the order of `hf_names`) and put back by `join`."""

    param: str
    hf_names: list[str]
    split: Callable[[torch.Tensor], list[torch.Tensor]]
    join: Callable[[list[torch.Tensor]], torch.Tensor]


def same_tensor(name: str, param: str) -> HFTensors:
    return HFTensors(param, [name], split=lambda t: [t], join=lambda ts: ts[0])


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in fp32 and scaled in the input dtype (as transformers does), or with
    `fp32_weight` scaled in fp32 and cast once (DeepSeek-V4 keeps its norm weights in fp32)."""

    def __init__(self, dim: int, eps: float, fp32_weight: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fp32_weight = fp32_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.fp32_weight:
            return (self.weight.float() * normed).to(x.dtype)
        return self.weight * normed.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None, device=None) -> torch.Tensor:
    """[head_dim/2] rotary frequencies, with the default, linear or llama3 scaling."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    )
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
        return torch.where(medium, smoothed, scaled)
    raise MliteError(
        f"rope scaling '{kind}' is not supported by the native models; supported: default, linear, llama3"
    )


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """positions [...] -> cos, sin [..., head_dim], computed in fp32."""
    freqs = positions.float().unsqueeze(-1) * inv_freq.to(positions.device)
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d], cos/sin [T, d]: rotate the two halves of each head."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)
