"""Optimizer, learning-rate schedule and gradient clipping, owned by the runtime (models never build them).

    optim = LocalAdamW(model.parameters(), job.optimizer, grad_norm_fn)   # what Runtime builds
    schedule = LRSchedule(optim.optimizer, job.optimizer, total_steps)    # lr: a pure function of the step
    grad_norm, skipped = optim.step()        # norm, skip on a non-finite norm, clip, update (0-dim
                                             # tensors: reading them waits for the step)

`LocalAdamW` serves every layout the runtime runs: one process, and FSDP2, whose parameters are DTensor
shards (then `grad_norm_fn` is mlite.runtime.parallel.parallelize.grad_norm, summed over every mesh once).
The runtime's fsdp2 backend (mlite.runtime.backends.fsdp2) is this optimizer plus what a backend owns
beyond the step (mlite.runtime.backends.base.OptimizerBackend).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from mlite.config.schema import OptimizerConfig
from mlite.runtime.kernels.grads import scale_grads_

__all__ = ["LRSchedule", "LocalAdamW", "clip_coef", "lr_at", "scale_grads_"]


# --------------------------------------------------------------------------------------- schedule
def lr_at(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup to cfg.lr over warmup_steps steps
    (the first step already trains, at lr / warmup_steps), then constant, linear or cosine decay to min_lr
    at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    decay_steps = max(total_steps - cfg.warmup_steps - 1, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    if cfg.schedule == "linear":
        return cfg.lr - (cfg.lr - cfg.min_lr) * progress
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LRSchedule:
    """Sets the optimizer's lr for the next step; its whole state is the step counter."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int):
        self.optimizer, self.cfg, self.total_steps = optimizer, cfg, total_steps
        self.step_count = 0
        self._apply()

    @property
    def lr(self) -> float:
        return lr_at(self.step_count, self.cfg, self.total_steps)

    def step(self, steps: int = 1) -> float:
        """Advance to the next optimizer step; returns its lr."""
        self.step_count += steps
        self._apply()
        return self.lr

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    def state_dict(self) -> dict:
        return {"step_count": self.step_count, "total_steps": self.total_steps}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step_count"])
        self._apply()


# ------------------------------------------------------------------------------------- the optimizer
class LocalAdamW:
    """AdamW over the runtime's parameters, whole on one process or FSDP2 shards (DTensors) on several.

    The parameters are the master weights, in precision.master's dtype (fp32, or bf16 on GPUs); bf16
    compute happens under autocast or in FSDP2's parameter cast, so there is no separate master copy to keep
    in sync. `grad_norm_fn` lets a layout that shards or replicates parameters reduce the norm over its
    groups (default: the local norm). Parameters on GPUs, plain (one GPU) or FSDP2's DTensor shards, take
    TritonAdamW: torch's fused AdamW with one Triton launch per group for the whole update, each rank over
    its local shards; CPU runs (and host-offloaded shards) take foreach. On GPUs clipping happens inside the
    kernel (`grad_coef`), with the numerics of clipping first, and a non-finite norm skips the update there,
    so the host never waits; elsewhere the gradients are scaled in place before the step. The norm on one
    GPU is TritonAdamW's own (`grad_norm`: fp32 throughout, over the step's tables)."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        cfg: OptimizerConfig,
        grad_norm_fn: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
        state: str = "master",
        seed: int = 0,
    ):
        self.params = [p for p in params if p.requires_grad]
        self.cfg = cfg
        decay = [p for p in self.params if p.ndim >= 2]  # no weight decay on norms and biases
        no_decay = [p for p in self.params if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        # fused: on MoE layers the optimizer step moves more bytes than anything else (docs/PERFORMANCE.md).
        # TritonAdamW is torch's fused AdamW (same numerics and state) with a kernel that streams closer to
        # the bandwidth floor (mlite.runtime.kernels.adamw; torch's own step where Triton is missing)
        fused = bool(self.params) and all(p.is_cuda for p in self.params)
        groups = [g for g in groups if g["params"]]
        options = {"lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps}
        self.fused = fused
        if state == "fp8":
            # precision.optimizer_state fp8: e4m3 moments with block scales (mlite.runtime.kernels.adamw),
            # its kernel on GPUs, its pure-torch reference elsewhere; clipping and the skip as fused below
            from mlite.runtime.kernels.adamw import Fp8StateAdamW

            self.optimizer = Fp8StateAdamW(groups, fused=True, seed=seed, **options)
        elif fused:
            from mlite.runtime.kernels.adamw import TritonAdamW  # imports triton: only on a GPU run

            self.optimizer = TritonAdamW(groups, fused=True, **options)
        else:
            self.optimizer = torch.optim.AdamW(groups, foreach=True, **options)
        self.grad_norm_fn = grad_norm_fn or _local_grad_norm
        self.skipped_steps = 0

    @torch.no_grad()  # host time: DTensor shards' to_local() outside autograd, every step
    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = None
        if grads and self.fused and self.grad_norm_fn is _local_grad_norm:
            norm = self.optimizer.grad_norm()  # one GPU: the step's kernel tables, one fp32 launch per group
        if norm is None:
            norm = self.grad_norm_fn(grads) if grads else torch.zeros(())
        coef = clip_coef(norm, self.cfg.clip_grad) if self.cfg.clip_grad > 0 else None
        # an inf/nan gradient would poison the Adam moments for good: such a step's update is dropped
        skipped = ~torch.isfinite(norm)
        if self.fused:
            # decided on the GPU: TritonAdamW reads the flag (and scales each gradient by the clipping
            # factor as it reads it), so the update is queued behind the backward with no host sync
            self.optimizer.step(grad_coef=coef, found_inf=skipped.float())
            self.skipped_steps = self.skipped_steps + skipped.long()
            return norm, skipped
        if skipped:  # foreach steps (CPU, host-offloaded shards) decide on the host
            self.skipped_steps += 1
            self.zero_grad()
            return norm, skipped
        if coef is not None:
            scale_grads_(self.params, coef)
        self.optimizer.step()
        return norm, skipped

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


def clip_coef(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch's clip_grads_with_norm_ factor: min(1, max_norm / (norm + 1e-6)), left on the device."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def _local_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False, foreach=True)
