"""Optimizer, learning-rate schedule and gradient clipping, owned by the runtime (models never build them).

    optim = LocalAdamW(model.parameters(), job.optimizer, grad_norm_fn)   # what Runtime builds
    schedule = LRSchedule(optim.optimizer, job.optimizer, total_steps)    # lr: a pure function of the step
    grad_norm, skipped = optim.step()        # norm, skip on a non-finite norm, clip, update (0-dim
                                             # tensors: reading them waits for the step)

`LocalAdamW` serves every layout the runtime runs: one process, and FSDP2, whose parameters are DTensor
shards (then `grad_norm_fn` is mlite.runtime.parallel.parallelize.grad_norm, summed over every mesh once).
`OptimizerBackend` is the interface it implements; the Megatron-Core adapter
(mlite.runtime.parallel.dist_opt) implements it too.

On one GPU the update is pure memory traffic (14 bytes per bf16 parameter), a fixed cost per step that
the matmuls cannot hide on the same stream. `StepOverlap` queues it on a side stream, unit by unit in the
order the forward meets them (`forward_units`: each decoder block whole, and each other module holding
parameters of its own), and the next forward waits for a unit's event only as it reaches that unit's
module (a forward pre-hook): block 0 computes while blocks 1.. are still being updated.

    optim.overlap(model, blocks(model))   # Runtime, one GPU; optim.settle() before reading the weights
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mlite.config.schema import OptimizerConfig


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


# ---------------------------------------------------------------------------------------- backends
class OptimizerBackend(Protocol):
    """What the runtime asks of an optimizer backend (one per parallel layout)."""

    optimizer: torch.optim.Optimizer  # the torch optimizer, for checkpoints (DCP names its state by FQN)
    params: list[torch.nn.Parameter]  # what it updates (replicated data parallel sums their grads first)
    skipped_steps: int | torch.Tensor  # a count, possibly a 0-dim tensor still on the device

    def step(self) -> tuple[torch.Tensor | float, torch.Tensor | bool]:
        """Clip, then update unless the grad norm is non-finite. Returns (grad norm before clipping,
        skipped), as 0-dim tensors where the backend decides on the device: float() and bool() read them
        (a host sync), so read them when the numbers are logged, not in the step."""

    def zero_grad(self) -> None: ...


class LocalAdamW:
    """AdamW over the runtime's parameters, whole on one process or FSDP2 shards (DTensors) on several.

    The parameters are the master weights, in precision.master's dtype (fp32, or bf16 on GPUs); bf16
    compute happens under autocast or in FSDP2's parameter cast, so there is no separate master copy to keep
    in sync. `grad_norm_fn` lets a layout that shards or replicates parameters reduce the norm over its
    groups (default: the local norm). Plain CUDA parameters (one GPU) take TritonAdamW, torch's fused AdamW
    with one Triton launch per group for the whole update; DTensor shards, which may span several meshes,
    and CPU runs take foreach. Clipping on one GPU happens inside TritonAdamW's kernel (`grad_coef`), with
    the numerics of clipping first; elsewhere the gradients are scaled in place before the step."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        cfg: OptimizerConfig,
        grad_norm_fn: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
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
        fused = bool(self.params) and all(p.is_cuda and not isinstance(p, DTensor) for p in self.params)
        groups = [g for g in groups if g["params"]]
        options = {"lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps}
        self.fused = fused
        if fused:
            from mlite.runtime.kernels.adamw import TritonAdamW  # imports triton: only on a GPU run

            self.optimizer = TritonAdamW(groups, fused=True, **options)
        else:
            self.optimizer = torch.optim.AdamW(groups, foreach=True, **options)
        self.grad_norm_fn = grad_norm_fn or _local_grad_norm
        self.skipped_steps = 0
        self.overlapped: StepOverlap | None = None  # set by `overlap`

    def overlap(self, model: nn.Module, blocks: list[nn.Module],
                unhooked: tuple[nn.Module, ...] = ()) -> None:
        """Run each fused step on a side stream, unit by unit, overlapped with the next forward
        (`StepOverlap`; `unhooked`: see `hook_units`). One GPU only: the caller (Runtime) asks the rule
        book first."""
        if not self.fused:
            raise ValueError("overlapping the update needs the fused one-GPU step (plain CUDA parameters)")
        self.overlapped = StepOverlap(model, blocks, self.optimizer, self.params, unhooked)

    def settle(self) -> None:
        """The current stream waits for the last queued update: call before reading or writing the weights
        or the optimizer state outside a forward (checkpoints, export, weight sync, snapshots)."""
        if self.overlapped is not None:
            self.overlapped.settle()

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = self.grad_norm_fn(grads) if grads else torch.zeros(())
        coef = clip_coef(norm, self.cfg.clip_grad) if self.cfg.clip_grad > 0 else None
        # an inf/nan gradient would poison the Adam moments for good: such a step's update is dropped
        skipped = ~torch.isfinite(norm)
        if self.fused:
            # decided on the GPU: TritonAdamW reads the flag (and scales each gradient by the clipping
            # factor as it reads it), so the update is queued behind the backward with no host sync
            if self.overlapped is not None:
                self.overlapped.step(coef, skipped.float())
            else:
                self.optimizer.step(grad_coef=coef, found_inf=skipped.float())
            self.skipped_steps = self.skipped_steps + skipped.long()
            return norm, skipped
        if skipped:  # foreach steps (CPU, DTensor shards) decide on the host
            self.skipped_steps += 1
            self.zero_grad()
            return norm, skipped
        if coef is not None:
            scale_grads_(self.params, coef)
        self.optimizer.step()
        return norm, skipped

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


# ------------------------------------------------------------------------------ overlapped update
def forward_units(model: nn.Module, blocks: list[nn.Module],
                  params: list[nn.Parameter]) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """The model's parameters (those in `params`) cut into units in the order the forward meets them:
    (module, its parameters) for each decoder block whole, and for each other module that holds
    parameters of its own, in definition order (the model files define modules in the order they run).
    A tied parameter belongs to its first holder (the embedding, before the LM head that shares it)."""
    wanted = {id(p) for p in params}
    block_ids = {id(b) for b in blocks}
    seen: set[int] = set()
    units: list[tuple[nn.Module, list[nn.Parameter]]] = []

    def take(candidates) -> list[nn.Parameter]:
        taken = []
        for p in candidates:
            if p is not None and id(p) in wanted and id(p) not in seen:
                seen.add(id(p))
                taken.append(p)
        return taken

    def visit(module: nn.Module) -> None:
        if id(module) in block_ids:  # a block is one unit: its body may be one compiled graph
            own = take(module.parameters())
            if own:
                units.append((module, own))
            return
        own = take(module._parameters.values())
        if own:
            units.append((module, own))
        for child in module.children():
            visit(child)

    visit(model)
    return units


def hook_units(model: nn.Module, units: list[tuple[nn.Module, list[nn.Parameter]]], before_unit,
               after_forward, unhooked: tuple[nn.Module, ...] = ()) -> list:
    """Forward pre-hooks: `before_unit(k)` as unit k's module is called; `after_forward()` when the model's
    forward returns (what is read after it). The hooks sit on the units' own modules, outside any compiled
    block body. A module in `unhooked` gets none: the LM head, whose fused loss kernel takes only a head
    without hooks (hooks there mean FSDP2 gathers); its unit is released by a later unit's hook (MTP's,
    which runs after the head's unit) or by the forward's end, before the loss reads it. Returns the
    handles."""
    handles = [module.register_forward_pre_hook(lambda _m, _a, k=k: before_unit(k))
               for k, (module, _) in enumerate(units) if not any(module is u for u in unhooked)]
    handles.append(model.register_forward_hook(lambda _m, _a, _o: after_forward()))
    return handles


class StepOverlap:
    """The fused update queued on a side stream, one unit after another in forward order, each unit's
    end marked by an event; the next forward's pre-hook for unit k makes the compute stream wait for event
    k only. The side stream runs in order, so event k also covers units 0..k. The numbers are the same as
    the plain step's: the same kernel reads the same gradients, norm, clipping factor and skip flag (the
    side stream first waits for the backward that made them).

    Each unit's gradients are freed right after its update is queued, recorded on the side stream, so
    their memory returns to the allocator as that unit's update ends, not when the whole step has."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], optimizer, params: list[nn.Parameter],
                 unhooked: tuple[nn.Module, ...] = ()):
        self.optimizer = optimizer
        self.device = params[0].device
        self.units = forward_units(model, blocks, params)
        self.stream = torch.cuda.Stream(self.device)
        # unit of each parameter: TritonAdamW cuts its launches by it and queues them in unit order
        optimizer.unit_of = {id(p): k for k, (_, unit) in enumerate(self.units) for p in unit}
        self.ready: list[torch.cuda.Event | None] = []  # per unit, until the forward has waited for it
        self.done: torch.cuda.Event | None = None
        self.handles = hook_units(model, self.units, self.wait, self.settle, unhooked)

    def step(self, grad_coef: torch.Tensor | None, found_inf: torch.Tensor) -> None:
        compute = torch.cuda.current_stream(self.device)
        self.settle()  # a step before the last one was waited for (no forward in between)
        self.stream.wait_stream(compute)  # the gradients, norm and flags of this step's backward
        ended: dict[int, torch.cuda.Event] = {}

        def after_unit(k: int) -> None:
            ended[k] = torch.cuda.Event()
            ended[k].record(self.stream)
            for p in self.units[k][1]:
                if p.grad is not None:  # its memory is reused once this unit's update is over
                    p.grad.record_stream(self.stream)
                    p.grad = None

        with torch.cuda.stream(self.stream):
            self.optimizer.step(grad_coef=grad_coef, found_inf=found_inf, after_unit=after_unit)
            self.done = torch.cuda.Event()
            self.done.record(self.stream)
        for t in (grad_coef, found_inf):
            if t is not None:
                t.record_stream(self.stream)
        for _, unit in self.units:  # gradients no unit freed (torch's own step served it)
            for p in unit:
                if p.grad is not None:
                    p.grad.record_stream(self.stream)
        # torch's step (no unit ended on its own): every unit waits for the whole of it; a unit with no
        # launch (no gradient) needs no more than the units before it
        self.ready = [self.done] * len(self.units) if not ended else \
            list(itertools.accumulate((ended.get(k) for k in range(len(self.units))),
                                      lambda before, own: own or before))

    def wait(self, k: int) -> None:
        """Forward pre-hook of unit k: the compute stream waits for its update (and every earlier one)."""
        if k < len(self.ready) and self.ready[k] is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready[k])
            for j in range(k + 1):
                self.ready[j] = None

    def settle(self) -> None:
        """The compute stream waits for the whole queued update."""
        if self.done is not None:
            torch.cuda.current_stream(self.device).wait_event(self.done)
            self.done = None
            self.ready = []


def clip_coef(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch's clip_grads_with_norm_ factor: min(1, max_norm / (norm + 1e-6)), left on the device."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def scale_grads_(params: list[torch.nn.Parameter], coef: torch.Tensor) -> None:
    """Every gradient times `coef` in place (torch's clip_grads_with_norm_ with the factor given), scaling
    each gradient's local part: sharded layouts mix DTensors of several meshes (dense over dp_cp, experts
    over edp), which one foreach call cannot take."""
    grads = [p.grad for p in params if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    for device, group in _by_device(local).items():
        torch._foreach_mul_(group, coef.to(device))


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return groups


def _local_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False, foreach=True)
