"""Gradient scaling in place, the one piece the optimizer (mlite.runtime.optim) and the AdamW kernels'
fallback step (mlite.runtime.kernels.adamw) share: it lives here, below both, so neither imports the other
for it."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from mlite.runtime.adapters.pytorch import foreach_mul_


def scale_grads_(params: list[torch.nn.Parameter], coef: torch.Tensor) -> None:
    """Every gradient times `coef` in place (torch's clip_grads_with_norm_ with the factor given), scaling
    each gradient's local part: sharded layouts mix DTensors of several meshes (dense over dp_cp, experts
    over edp), which one foreach call cannot take."""
    grads = [p.grad for p in params if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    for device, group in by_device(local).items():
        foreach_mul_(group, coef.to(device))


def by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return groups
