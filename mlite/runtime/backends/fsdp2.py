"""The `fsdp2` optimizer backend: `LocalAdamW` (mlite.runtime.optim) over this rank's parameters, whole on
one process or FSDP2's DTensor shards on several (the layout applied them: mlite.runtime.parallel), and what
the runtime asks of a backend beyond the step (mlite.runtime.backends.base).

- gradient sync: FSDP2 reduce-scatters in the step's last backward (`set_gradient_sync`), or after every
  micro-batch where the plan did not size whole gradients (`reduce_every_micro_batch`);
- `release_gathered`: units kept gathered from forward to backward free their weights after a pass without
  backward;
- checkpoints: torch's distributed state dicts of the model and the optimizer (DCP names them by FQN, in
  global shapes: any layout reads them);
- host offload: fresh host tensors for the weights and gradients (readable there), through nn.Module's own
  per-tensor move, which FSDP2 overrides to re-point its sharded parameters at the moved tensors. Shards
  FSDP2 keeps on the host (offload.optimizer) stay there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from mlite.config.schema import OptimizerConfig
from mlite.plan import Plan
from mlite.runtime.adapters.pytorch import apply_to_tensors
from mlite.runtime.backends.base import BackendBase, HeldModel, host_copy, nbytes
from mlite.runtime.optim import LocalAdamW
from mlite.runtime.parallel.mesh import ParallelDims
from mlite.runtime.parallel.parallelize import grad_norm, host_offloaded, reshard_units, set_gradient_sync

# torch optimizer group options that say how a step runs, not what it computes
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


class Fsdp2Backend(BackendBase, LocalAdamW):
    """LocalAdamW over the held model's parameters, and the backend's duties over FSDP2's units."""

    name = "fsdp2"

    def __init__(self, held: HeldModel, cfg: OptimizerConfig, state: str = "master", seed: int = 0,
                 reduce_every_micro_batch: bool = False, fp8_all_gather: bool = False):
        LocalAdamW.__init__(self, held.model.parameters(), cfg,
                            grad_norm_fn=grad_norm if held.mesh is not None else None, state=state, seed=seed)
        BackendBase.__init__(self, held)
        self.reduce_every_micro_batch = reduce_every_micro_batch
        self.fp8_all_gather = fp8_all_gather

    @classmethod
    def build(cls, plan: Plan, held: HeldModel, dims: ParallelDims) -> Fsdp2Backend:
        """A step of several micro-batches under FSDP2: gradients stay whole until the step's last backward
        only where the planner sized that (parallel.fsdp_grad_accumulation: it fits, or asked for); a caller
        that brings more micro-batches than the plan's (verl's) gets a reduce-scatter after each."""
        job = plan.job
        return cls(held, job.optimizer, state=job.precision.optimizer_state, seed=job.trainer.seed,
                   reduce_every_micro_batch=plan.fsdp_grad_accumulation != "unsharded",
                   fp8_all_gather=plan.fp8_all_gather)

    def step(self):
        """LocalAdamW's step; under FP8 all-gather, then the new weights' FP8 scales (torchao's precompute:
        one reduction for every weight instead of an amax per unit's all-gather)."""
        result = LocalAdamW.step(self)
        if self.fp8_all_gather:
            from mlite.runtime.adapters.torchao import precompute_fp8_scales

            for chunk in self.held.chunks.values():
                precompute_fp8_scales(chunk)
        return result

    # --------------------------------------------------------------------------------- the step
    def set_gradient_sync(self, chunk: int, last: bool) -> None:
        """FSDP2's units reduce in the backward this says is the step's last (one plain process reduces
        nothing)."""
        if self.held.mesh is not None:
            set_gradient_sync(self.held.chunks[chunk], last or self.reduce_every_micro_batch)

    def release_gathered(self) -> None:
        """After a pass without backward: FSDP2 units it left gathered free their weights (reshard_units)."""
        if self.held.mesh is not None:
            for chunk in self.held.chunks.values():
                reshard_units(chunk)

    # ------------------------------------------------------------------------------ checkpoints
    def checkpoint_state(self) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(self.held.model, self.optimizer)
        return {"model": model_state, "optimizer": optim_state}

    def checkpoint_template(self, weights_only: bool = False) -> dict[str, Any]:
        """The live state dicts: DCP reads into them in place."""
        if weights_only:
            return {"model": get_model_state_dict(self.held.model)}
        return self.checkpoint_state()

    def load_checkpoint_state(self, tensors: dict[str, Any], meta: dict | None = None) -> None:
        if "optimizer" not in tensors:
            set_model_state_dict(self.held.model, tensors["model"])
        else:
            # the saved groups' options replace the live ones; how the step runs (fused, foreach: chosen
            # by this run's devices and offload) is this run's, not the writer's
            groups = self.optimizer.param_groups
            implementation = [{k: g[k] for k in IMPLEMENTATION_KEYS if k in g} for g in groups]
            set_state_dict(self.held.model, self.optimizer, model_state_dict=tensors["model"],
                           optim_state_dict=tensors["optimizer"])
            for group, own in zip(self.optimizer.param_groups, implementation):
                group.update(own)
        if meta is not None:
            self._restore_counters(meta)

    # ---------------------------------------------------------------------------------- the host
    def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer]

    def _host_kept(self) -> set[int]:
        """FSDP2's host-offloaded shards (offload.optimizer): they and their state live on the host."""
        if self.held.mesh is None:
            return set()
        return set().union(*(host_offloaded(chunk) for chunk in self.held.chunks.values()))

    def _offload_model(self, host: torch.device, weights: bool, grads: bool) -> int:
        """What is on the run's device -> fresh tensors on `host` (fresh on a CPU run too)."""
        device, moved = self.held.device, []

        def offload(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.device != device:
                return tensor
            moved.append(nbytes(tensor))
            return host_copy(tensor, host)

        self._move_model(weights, grads, offload)
        return sum(moved)

    def _reload_model(self, weights: bool, grads: bool) -> None:
        device = self.held.device
        self._move_model(weights, grads, lambda t: t.to(device))

    def _move_model(self, weights: bool, grads: bool, move) -> None:
        """`move` the parameters and/or their gradients (never the buffers, nor shards FSDP2 keeps on the
        host), each parameter staying the same object: nn.Module's per-tensor move (what `module.to` runs),
        which FSDP2's units override to re-point their sharded parameters at the moved tensors."""
        kept = self._host_kept()
        params = {id(p): p for chunk in self.held.chunks.values() for p in chunk.parameters()}
        moving = {i for i in params if i not in kept} if weights else set()
        if grads:
            moving |= {id(p.grad) for i, p in params.items() if i not in kept and p.grad is not None}

        def move_one(tensor: torch.Tensor) -> torch.Tensor:
            if id(tensor) not in moving:
                return tensor
            moving.discard(id(tensor))  # once: a tied parameter is met in each module that holds it
            return move(tensor)

        for chunk in self.held.chunks.values():
            apply_to_tensors(chunk, move_one)
