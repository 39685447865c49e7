"""Native model code: one module per model family, all built from `mlite.config.arch.ModelArch`.

build_model(arch, attention_backend="auto", dtype=torch.float32, device="cpu") -> Transformer
model(batch: PackedBatch) -> ModelOutput(hidden [T, H], aux_loss)
model.compute_logits(hidden) -> [T, vocab]
model.decode(input_ids [B, t], positions [B, t], cache) -> logits [B, t, vocab]   (rollout)
model.hf_layout() -> native <-> HF names (mlite.runtime.ckpt.hf loads and exports with it)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mlite.config.arch import ModelArch
from mlite.plan.rules import check_model_built
from mlite.runtime.kernels import resolve_attention_backend
from mlite.runtime.models.base import KVCache, ModelOutput
from mlite.runtime.models.deepseek_v4 import DeepseekV4
from mlite.runtime.models.qwen3 import Transformer


def build_model(
    arch: ModelArch,
    attention_backend: str = "auto",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    layers: Iterable[int] | None = None,
    init: bool = True,
    mtp_weight: float = 0.0,
    indexer_loss_weight: float = 0.0,
) -> Transformer | DeepseekV4:
    """A model for `arch` with freshly initialised weights (load real ones with mlite.runtime.ckpt.hf).

    `layers`: the global layer indices of this pipeline stage (all by default). `device="meta"` builds the
    structure without memory (names and shapes only). `init=False` leaves the weights uninitialised.
    DeepSeek-V4 only: `mtp_weight` > 0 builds the multi-token-prediction block, its loss weighted so;
    `indexer_loss_weight` > 0 trains the CSA indexers with their KL loss."""
    check_model_built(arch)  # the rule book's list of the families built here
    device = torch.device(device)
    backend = resolve_attention_backend(attention_backend, device.type if device.type != "meta" else "cpu")
    with device:
        if arch.v4 is not None:  # its attention has one torch path (gathered key sets); no backend choice
            model = DeepseekV4(arch, layers=layers, mtp_weight=mtp_weight)
            model.set_indexer_loss_weight(indexer_loss_weight)
        else:
            model = Transformer(arch, attention_backend=backend, layers=layers)
    if init and device.type != "meta":
        model.init_weights()
    return model.to(dtype)


__all__ = ["DeepseekV4", "KVCache", "ModelOutput", "Transformer", "build_model"]
