"""What the runtime asks of an optimizer backend (`OptimizerBackend`), and the duties both backends share.

A backend is one object per run, built by `mlite.runtime.backends.build_backend` from optimizer.backend: the
optimizer over this rank's parameters, and everything that depends on how the backend holds them.

    backend.set_gradient_sync(chunk, last)        # before each backward: is it the chunk's last of the step
    grad_norm, skipped = backend.step(); backend.zero_grad()
    backend.release_gathered()                     # after a pass without backward
    backend.weights_current()                      # before anything reads the weights outside a forward
    tensors = backend.checkpoint_state()           # {"model", "optimizer"}: names and shapes of no layout
    backend.load_checkpoint_state(read, meta)      # what DCP read into backend.checkpoint_template(...)
    backend.rollout_model(); backend.weight_shards(dtype); backend.tp_group_weights(dtype, tp_size)
    backend.offload_to_host(); ...; backend.reload_to_device()   # weights, gradients, optimizer state

`BackendBase` holds what does not depend on the backend: the model as this rank holds it (`HeldModel`), the
rollout replica and the weight streams over it, and the moves of the optimizer state between the device
and the host. Each backend adds how its own weights and gradients travel.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from mlite.config.arch import ModelArch
from mlite.errors import MliteError
from mlite.runtime.parallel.mesh import ParallelMesh


# ------------------------------------------------------------------------------------------ the interface
class OptimizerBackend(Protocol):
    """What the runtime asks of an optimizer backend (mlite.runtime.backends: fsdp2, dist_opt)."""

    optimizer: torch.optim.Optimizer  # its param_groups set the lr (LRSchedule)
    params: list[torch.nn.Parameter]  # what it updates
    skipped_steps: int | torch.Tensor  # updates dropped for non-finite gradients (a 0-dim tensor on the GPU)
    reduce_every_micro_batch: bool  # gradients reduced after every micro-batch, not at the step's last
    held: HeldModel  # the model as this rank holds it

    # ---- the step
    def step(self) -> tuple[torch.Tensor | float, torch.Tensor | bool]:
        """Clip, then update unless the grad norm is non-finite. Returns (grad norm before clipping,
        skipped), as 0-dim tensors where the backend decides on the device: float() and bool() read them
        (a host sync), so read them when the numbers are logged, not in the step."""

    def zero_grad(self) -> None: ...

    def set_gradient_sync(self, chunk: int, last: bool) -> None:
        """Whether the next backward through pipeline chunk `chunk` (0 without a pipeline) is the step's
        last: only then are the gradients reduced (unless `reduce_every_micro_batch`)."""

    # ---- the weights
    def release_gathered(self) -> None:
        """After a pass without backward: free the whole weights it left gathered."""

    def weights_current(self) -> None:
        """Wait for the weights of the last step to land: whatever reads the weights outside a training
        forward calls this first."""

    # ---- checkpoints (the format of mlite.runtime.state: the same names and global shapes under any layout)
    def checkpoint_state(self) -> dict[str, Any]:
        """{"model": ..., "optimizer": ...}: the tensors a checkpoint holds (collective)."""

    def checkpoint_template(self, weights_only: bool = False) -> dict[str, Any]:
        """Tensors of `checkpoint_state`'s names, shapes and placements for a checkpoint to be read into
        (the model's alone with `weights_only`)."""

    def load_checkpoint_state(self, tensors: dict[str, Any], meta: dict | None = None) -> None:
        """Put what was read into `checkpoint_template`'s tensors into the model (and the optimizer, where
        `tensors` holds its state), and the counters of the checkpoint's `meta` where given."""

    def checkpoint_counters(self) -> dict[str, int]:
        """The numbers a checkpoint's meta keeps of the backend (the skipped-step count)."""

    # ---- rollouts
    def held_models(self) -> list[nn.Module]: ...

    def rollout_model(self) -> nn.Module: ...

    def release_rollout_model(self) -> None: ...

    def weight_shards(self, dtype: torch.dtype | None = None) -> Iterator[Any]: ...

    def tp_group_weights(self, dtype: torch.dtype | None, tp_size: int, stats: dict | None = None,
                         expert_parallel: bool = False, v4_fp8: str | None = None
                         ) -> Iterator[tuple[str, torch.Tensor]]: ...

    # ---- the host
    def offload_to_host(self, weights: bool = True, grads: bool = True, optimizer: bool = True,
                        host: torch.device | str = "cpu") -> int: ...

    def reload_to_device(self, weights: bool = True, grads: bool = True, optimizer: bool = True) -> None: ...


@dataclass(frozen=True)
class HeldModel:
    """This rank's model as a backend sees it."""

    model: nn.Module  # this rank's model; under pipeline parallel a view of its chunks under the whole names
    chunks: dict[int, nn.Module]  # by pipeline chunk index; {0: model} without pipeline parallel
    mesh: ParallelMesh | None = None  # None: one process
    pipeline: Any = None  # the pipeline runner (mlite.runtime.parallel.pipeline), None without pp
    arch: ModelArch | None = None  # what the rollout replica is built from
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    attention_backend: str = "auto"

    @classmethod
    def of_chunks(cls, chunks: dict[int, nn.Module]) -> HeldModel:
        """A backend built on its own (tests, benchmarks): its chunks, on their parameters' device."""
        from mlite.runtime.parallel.pipeline import stage_view

        first = next(iter(chunks.values()))
        param = next(first.parameters(), None)
        device = _local(param).device if param is not None else torch.device("cpu")
        model = first if len(chunks) == 1 else stage_view(chunks)
        return cls(model, chunks, arch=getattr(first, "arch", None), device=device)


# ------------------------------------------------------------------------------------- shared duties
class BackendBase:
    """The duties of every backend over the model it holds: the rollout replica and the weight streams
    (what a rollout reads), and the optimizer state's moves between the device and the host. A subclass
    says how its weights and gradients travel (`_offload_model` / `_reload_model`) and which torch
    optimizers and master weights it holds apart from the model (`_torch_optimizers`, `_master_params`)."""

    reduce_every_micro_batch = False
    held: HeldModel

    def __init__(self, held: HeldModel):
        self.held = held
        self._rollout_replica: nn.Module | None = None  # built for a rollout session, dropped after it

    # ---------------------------------------------------------------------------------- the weights
    def release_gathered(self) -> None:
        """Nothing is left gathered (a backend that keeps weights gathered overrides this)."""

    def weights_current(self) -> None:
        """The weights are current once the step returns (a backend that gathers them later overrides)."""

    def held_models(self) -> list[nn.Module]:
        """This rank's models that know their HF names (`hf_layout`): its pipeline chunks, or the model."""
        return list(self.held.chunks.values())

    # ------------------------------------------------------------------------------------ rollouts
    def release_rollout_model(self) -> None:
        """Drop the rollout replica (after each rollout session: training does not hold it)."""
        self._rollout_replica = None

    def rollout_model(self) -> nn.Module:
        """The model the native sampler decodes with (Runtime.rollout_model). One process decodes with the
        model itself. A parallelized model holds DTensor shards behind FSDP hooks that expect the whole
        model's forward, while decode calls the embedding and layers itself and each rank stops at its own
        step, so gathering per call would pair collectives unevenly. Instead the current weights (and
        buffers) are gathered once per rollout into a plain replica on every rank: each tensor's shards over
        its stage's meshes, then, under pipeline parallel, broadcast over `pp` from the stage that holds it,
        in the replica's order on every rank. The replica costs one unsharded copy of the model per rank."""
        self.weights_current()
        held = self.held
        if held.mesh is None:
            return held.model
        from mlite.runtime.models import build_model

        if self._rollout_replica is None:  # storage only: every tensor is overwritten below
            self._rollout_replica = build_model(held.arch, held.attention_backend, dtype=torch.float32,
                                                device=held.device, init=False)
        self._fill_replica(self._rollout_replica)
        return self._rollout_replica.eval()

    def _fill_replica(self, replica: nn.Module) -> None:
        """Every tensor of `replica` from the ranks that hold it (`rollout_model`)."""
        from mlite.runtime.parallel.parallelize import full_tensor

        held = self.held
        mine = _named_state(held.model)  # under pp: this stage's tensors, named as in the whole model
        group, owners = None, {}
        if held.pipeline is not None:
            group = held.mesh.group("pp")
            ranks = dist.get_process_group_ranks(group)
            stages: list[dict | None] = [None] * len(ranks)
            dist.all_gather_object(stages, {name: t.dtype for name, t in mine.items()}, group=group)
            owners = {name: (ranks[i], dtype) for i, stage in enumerate(stages)
                      for name, dtype in stage.items()}
        with torch.no_grad():
            for name, target in _named_state(replica).items():
                if name not in (owners if group is not None else mine):
                    raise MliteError(f"rollout replica: no rank holds {name} of the model; a runtime bug")
                if name in mine:
                    tensor = full_tensor(mine[name].detach()).to(held.device)
                else:
                    tensor = torch.empty(target.shape, dtype=owners[name][1], device=held.device)
                if group is not None:
                    dist.broadcast(tensor, src=owners[name][0], group=group)
                target.data = tensor

    def weight_shards(self, dtype: torch.dtype | None = None) -> Iterator[Any]:
        """This rank's pieces of the HF tensors, for rollout weight sync under any layout: no rank gathers
        (mlite.runtime.ckpt.sync.weight_shards)."""
        from mlite.runtime.ckpt.sync import weight_shards

        self.weights_current()
        return weight_shards(self.held_models(), dtype)

    def tp_group_weights(self, dtype: torch.dtype | None, tp_size: int, stats: dict | None = None,
                         expert_parallel: bool = False, v4_fp8: str | None = None
                         ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every HF tensor whole-shaped on every rank, holding the slab that rank's tensor-parallel rollout
        engine reads (mlite.runtime.ckpt.sync.tp_group_weights); with `expert_parallel`, whole experts of
        its engine rank; `v4_fp8` (DeepSeek-V4 for vLLM): its fp32 tensors unrounded and what the mode
        names in FP8 with block scales."""
        from mlite.runtime.ckpt.sync import tp_group_weights

        self.weights_current()
        moe = self.held.arch.moe
        experts = moe.num_experts if expert_parallel and moe is not None else None
        return tp_group_weights(self.held_models(), dtype, tp_size, self.held.arch.num_kv_heads, stats,
                                self.held.device, num_experts=experts, v4_fp8=v4_fp8)

    # ----------------------------------------------------------------------------------- the counters
    def checkpoint_counters(self) -> dict[str, int]:
        """The skipped-step count, read here once (a fused step counts it on the GPU)."""
        return {"skipped_steps": int(self.skipped_steps)}

    def _restore_counters(self, meta: dict) -> None:
        self.skipped_steps = int(meta["skipped_steps"])

    # --------------------------------------------------------------------------------------- the host
    def offload_to_host(self, weights: bool = True, grads: bool = True, optimizer: bool = True,
                        host: torch.device | str = "cpu") -> int:
        """Move this rank's weights, gradients and optimizer state (each where asked; Adam's step counts
        stay where the step reads them) off the run's device onto `host`, e.g. while a rollout engine
        needs the GPU; `reload_to_device` brings them back, and training goes on as if they had stayed.
        What already lives on the host (shards FSDP2 keeps there) stays. Each backend moves its weights and
        gradients its own way (fsdp2: fresh host tensors, readable there; dist_opt: Megatron's buffers,
        not to be read until reloaded); from a GPU, into pinned memory (`host_copy`). Returns the bytes
        moved; when it returns, they are on the host and the device memory is back with the driver."""
        host = torch.device(host)
        self._settle()
        moved = 0
        if weights or grads:
            moved += self._offload_model(host, weights, grads)
        if optimizer:
            moved += self._offload_optimizer(host)
        if self.held.device.type == "cuda":
            torch.cuda.synchronize()  # the copies into pinned memory are asynchronous
            torch.cuda.empty_cache()  # to the driver: a rollout engine allocates outside torch's cache
        return moved

    def reload_to_device(self, weights: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Bring back what `offload_to_host` moved (the same flags); what is already home stays as it is."""
        if weights or grads:
            self._reload_model(weights, grads)
        if optimizer:
            self._reload_optimizer()

    def _settle(self) -> None:
        """Before an offload: nothing gathered, nothing in flight into the weights."""
        self.release_gathered()
        self.weights_current()

    def _offload_model(self, host: torch.device, weights: bool, grads: bool) -> int:
        """Move the model's weights and/or gradients to `host`; returns the bytes moved."""
        raise NotImplementedError

    def _reload_model(self, weights: bool, grads: bool) -> None:
        raise NotImplementedError

    def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers whose state (Adam's moments) this backend keeps."""
        raise NotImplementedError

    def _master_params(self) -> list[torch.Tensor]:
        """Parameters the optimizer updates apart from the model's weights (dist_opt's fp32 shards)."""
        return []

    def _host_kept(self) -> set[int]:
        """ids of the parameters that live on the host by design (their state lives there too)."""
        return set()

    def _offload_optimizer(self, host: torch.device) -> int:
        """The master shards and the optimizer state on the run's device -> fresh tensors on `host`; returns
        the bytes moved."""
        device, moved = self.held.device, 0
        for param in self._master_params():
            if param.device == device:
                param.data = host_copy(param.data, host)
                moved += nbytes(param.data)
        for state in self._optimizer_states():
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor) and value.device == device:
                    state[key] = host_copy(value, host)
                    moved += nbytes(value)
        return moved

    def _reload_optimizer(self) -> None:
        """The optimizer state back where its parameter lives (the run's device, or the host for a shard
        kept there)."""
        device, kept = self.held.device, self._host_kept()
        for param in self._master_params():
            param.data = param.data.to(device)
        for opt in self._torch_optimizers():
            for param, state in opt.state.items():
                home = torch.device("cpu") if id(param) in kept else device
                for key, value in state.items():
                    if key != "step" and isinstance(value, torch.Tensor):
                        state[key] = value.to(home)

    def _optimizer_states(self) -> Iterator[dict]:
        for opt in self._torch_optimizers():
            yield from opt.state.values()


# -------------------------------------------------------------------------------------- storage parking
class ParkedStorages:
    """Storages copied to the host and freed on the device, every tensor and view over them kept as it is
    (Megatron's buffers are viewed by every parameter and bucket): `park` frees them, `unpark` gives them
    their bytes back. A parked tensor must not be read or written until it is unparked."""

    def __init__(self):
        self._parked: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    @property
    def parked(self) -> bool:
        return bool(self._parked)

    def park(self, tensors: list[torch.Tensor], host: torch.device) -> int:
        """Each storage under `tensors` once (those already parked are empty and skipped); returns the bytes
        parked."""
        storages = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() > 0 and tensor.device.type != "meta":
                storages.setdefault(storage.data_ptr(), storage)
        for storage in storages.values():
            if not storage.resizable():
                raise MliteError("offload_to_host: a storage cannot be freed in place; a runtime bug")
            raw = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            self._parked.append((storage, host_copy(raw, host)))
        moved = sum(storage.nbytes() for storage in storages.values())
        for storage in storages.values():
            storage.resize_(0)  # the stream-ordered allocator reuses it only after the copy above has read it
        return moved

    def unpark(self) -> None:
        for storage, saved in self._parked:
            storage.resize_(saved.numel())
            torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).copy_(saved)
        self._parked = []


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def nbytes(tensor: torch.Tensor) -> int:
    """The bytes this rank holds of `tensor` (its local shard for a DTensor)."""
    local = _local(tensor)
    return local.numel() * local.element_size()


def host_copy(tensor: torch.Tensor, host: torch.device) -> torch.Tensor:
    """A fresh copy of `tensor` (a DTensor's local shard, as a DTensor of the same layout) on `host`: from
    a GPU into pinned memory, copied asynchronously (the caller synchronises once for all of them, and the
    reload back is asynchronous too); on a CPU run, a plain copy."""
    if tensor.device.type != "cuda" or host.type != "cpu":
        return tensor.to(host, copy=True)
    if isinstance(tensor, DTensor):
        local = host_copy(tensor.to_local(), host)
        return DTensor.from_local(local, tensor.device_mesh, tensor.placements, run_check=False,
                                  shape=tensor.shape, stride=tensor.stride())
    pinned = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device=host,
                                 pin_memory=True)
    return pinned.copy_(tensor, non_blocking=True)


def _named_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers (DeepSeek-V4's hash tables and routing biases) by whole-model name."""
    return {**dict(model.named_buffers()), **dict(model.named_parameters())}
