"""A run's state beyond one step: RNG streams, checkpoints, weight snapshots and HF export.

Checkpoints hold everything a bitwise-equal continuation needs (model, optimizer, schedule, RNG streams and
the trainer's `extra_state`) under names and global shapes that do not depend on the layout, so a run
resumes under another one (mlite.runtime.ckpt.checkpoint writes them atomically).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from mlite.errors import MliteError
from mlite.runtime.ckpt import checkpoint as ckpt

if TYPE_CHECKING:
    from mlite.runtime.engine import Runtime


# ------------------------------------------------------------------------------------------------ RNG
def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    state["numpy"] = {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos, "has_gauss": has_gauss,
                      "gauss": gauss}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np_state = state["numpy"]
    np.random.set_state(("MT19937", np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


# ---------------------------------------------------------------------------------------- checkpoints
# torch optimizer group options that say how a step runs, not what it computes
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def _state_tensors(rt: Runtime) -> dict[str, Any]:
    model_state, optim_state = get_state_dict(rt.model, rt.optim.optimizer)
    return {"model": model_state, "optimizer": optim_state}


def _megatron(rt: Runtime) -> bool:
    """optimizer.backend dist_opt: the masters and Adam state are Megatron's shards, which its backend
    reads and writes in the same names and global shapes (mlite.runtime.parallel.dist_opt)."""
    return rt.job.optimizer.backend == "dist_opt"


def save_checkpoint(rt: Runtime, path: str | Path, extra_state: dict | None = None) -> Path:
    """Atomically write model, optimizer, schedule, RNG streams and `extra_state` (JSON-able) to `path`."""
    meta = {
        "format": 1,
        "schedule": rt.schedule.state_dict(),
        "skipped_steps": int(rt.optim.skipped_steps),  # counted on the GPU by a fused step: read it here
        "world_size": rt.dims.world_size,
        "job": rt.job.model_dump(mode="json"),
        "hf_config": rt.hf_config,
        "extra": extra_state or {},
    }
    if _megatron(rt):
        model_state, optim_state = rt.optim.checkpoint_state()
        tensors = {"model": model_state, "optimizer": optim_state}
    else:
        tensors = _state_tensors(rt)
    return ckpt.save_checkpoint(path, tensors, {"rng": rng_state()}, meta)


def load_checkpoint(rt: Runtime, path: str | Path, weights_only: bool = False) -> dict:
    """Restore everything `save_checkpoint` wrote (refusing a corrupt checkpoint); returns extra_state.
    `weights_only`: the model alone (export), leaving optimizer, schedule and RNG as they are."""
    if _megatron(rt):
        model_state, optim_state = rt.optim.checkpoint_template()
        tensors = {"model": model_state} if weights_only else {"model": model_state, "optimizer": optim_state}
        meta, rank_state = ckpt.load_checkpoint(path, tensors)
        rt.optim.load_checkpoint_state(tensors["model"], tensors.get("optimizer"))
        if not weights_only:
            _restore_run_state(rt, meta, rank_state)
        return meta["extra"]
    if weights_only:
        tensors = {"model": get_model_state_dict(rt.model)}
        meta, _ = ckpt.load_checkpoint(path, tensors)
        set_model_state_dict(rt.model, tensors["model"])
        return meta["extra"]
    tensors = _state_tensors(rt)
    meta, rank_state = ckpt.load_checkpoint(path, tensors)
    # the saved groups' options replace the live ones; how the step runs (fused, foreach: chosen by this
    # run's devices and offload) is this run's, not the writer's
    groups = rt.optim.optimizer.param_groups
    implementation = [{k: g[k] for k in IMPLEMENTATION_KEYS if k in g} for g in groups]
    set_state_dict(rt.model, rt.optim.optimizer, model_state_dict=tensors["model"],
                   optim_state_dict=tensors["optimizer"])
    for group, own in zip(rt.optim.optimizer.param_groups, implementation):
        group.update(own)
    _restore_run_state(rt, meta, rank_state)
    return meta["extra"]


def _restore_run_state(rt: Runtime, meta: dict, rank_state: dict | None) -> None:
    rt.schedule.load_state_dict(meta["schedule"])
    rt.optim.skipped_steps = int(meta["skipped_steps"])
    if rank_state is not None:
        set_rng_state(rank_state["rng"])


# ------------------------------------------------------------------------------------ weight snapshots
def _local(param: torch.Tensor) -> torch.Tensor:
    """The storage this rank holds of a parameter (its shard under FSDP2, TP or EP)."""
    return param.detach().to_local() if isinstance(param, DTensor) else param.detach()


def snapshot_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of this rank's shards of every parameter: one more copy of what the rank holds, never the
    whole model (the GRPO reference policy is the snapshot of the initial weights)."""
    return {name: _local(p).clone() for name, p in model.named_parameters()}


@contextlib.contextmanager
def swapped_weights(model: torch.nn.Module, snapshot: dict[str, torch.Tensor]):
    """Run the model, on its own layout and forward path, with the snapshot's weights. The shards are
    swapped in place (one parameter's temporary at a time), so the sharded storage FSDP2, TP and the
    pipeline stages hold stays the same tensor, and swapped back on exit."""

    def swap():
        with torch.no_grad():
            for name, p in model.named_parameters():
                mine, theirs = _local(p), snapshot[name]
                held = mine.clone()
                mine.copy_(theirs)
                theirs.copy_(held)

    swap()
    try:
        yield
    finally:
        swap()


# ---------------------------------------------------------------------------------------- rollout replica
def _named_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers (DeepSeek-V4's hash tables and routing biases) by whole-model name."""
    return {**dict(model.named_buffers()), **dict(model.named_parameters())}


def rollout_model(rt: Runtime) -> torch.nn.Module:
    """The model the native sampler decodes with (Runtime.rollout_model). One process decodes with the
    model itself. A parallelized model holds DTensor shards behind FSDP hooks that expect the whole model's
    forward, while decode calls the embedding and layers itself and each rank stops at its own step, so
    gathering per call would pair collectives unevenly. Instead the current weights (and buffers) are
    gathered once per rollout into a plain replica on every rank: each tensor's shards over its stage's
    meshes, then, under pipeline parallel, broadcast over `pp` from the stage that holds it, in the
    replica's order on every rank. The replica costs one unsharded copy of the model per rank."""
    if rt.mesh is None:
        return rt.model
    from mlite.runtime.models import build_model
    from mlite.runtime.parallel.parallelize import full_tensor

    if rt._rollout_replica is None:  # storage only: every tensor is overwritten below
        rt._rollout_replica = build_model(rt.arch, rt.job.model.attention_backend, dtype=torch.float32,
                                          device=rt.device, init=False)
    held = _named_state(rt.model)  # under pp: this stage's tensors, named as in the whole model
    group, owners = None, {}
    if rt.pipeline is not None:
        group = rt.mesh.group("pp")
        ranks = dist.get_process_group_ranks(group)
        stages: list[dict | None] = [None] * len(ranks)
        dist.all_gather_object(stages, {name: t.dtype for name, t in held.items()}, group=group)
        owners = {name: (ranks[i], dtype) for i, stage in enumerate(stages) for name, dtype in stage.items()}
    with torch.no_grad():
        for name, target in _named_state(rt._rollout_replica).items():
            if name not in (owners if group is not None else held):
                raise MliteError(f"rollout replica: no rank holds {name} of the model; a runtime bug")
            if name in held:
                tensor = full_tensor(held[name].detach()).to(rt.device)
            else:
                tensor = torch.empty(target.shape, dtype=owners[name][1], device=rt.device)
            if group is not None:
                dist.broadcast(tensor, src=owners[name][0], group=group)
            target.data = tensor
    return rt._rollout_replica.eval()


# --------------------------------------------------------------------------------------------- export
def export_weights(rt: Runtime, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors one at a time (never the whole state at once)."""
    from mlite.runtime.ckpt.hf import iter_hf_weights

    if rt.pipeline is not None:
        raise MliteError(
            f"exporting weights from a running pp={rt.dims.pp} job: each rank holds only its stages; "
            "export the saved checkpoint instead (mlite export), or run rollouts with parallel.pp: 1"
        )
    for name, tensor in iter_hf_weights(rt.model):
        yield name, (tensor.to(dtype) if dtype is not None else tensor)


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """A training checkpoint (or a run dir: its newest good one) -> an HF checkpoint transformers loads.

    The model is rebuilt on the CPU from the job and config.json stored in the checkpoint, so neither the
    original weights nor a GPU are needed; tensors stream to the shards one at a time."""
    from mlite.config import job_from_dict
    from mlite.runtime.ckpt.hf import save_hf_checkpoint
    from mlite.runtime.engine import Runtime

    path = ckpt.resolve_checkpoint(checkpoint)
    ckpt.verify_checkpoint(path)
    meta = ckpt.read_meta(path)
    job_dict = meta["job"]
    job_dict["trainer"]["device"] = "cpu"
    job_dict["optimizer"]["backend"] = "fsdp2"  # the format is the same for both; dist_opt needs GPUs
    runtime = Runtime(job_from_dict(job_dict), hf_config=meta["hf_config"])
    runtime.load_checkpoint(path, weights_only=True)
    config = None if runtime.job.model.name is not None else meta["hf_config"]  # presets: from the arch
    return save_hf_checkpoint(runtime.export_weights(dtype), runtime.arch, out_dir, config=config,
                              dtype=dtype)


# ----------------------------------------------------------------------------------- rollout weight sync
def held_models(rt: Runtime) -> list[torch.nn.Module]:
    """This rank's models that know their HF names (`hf_layout`): its pipeline chunks, or the model."""
    return list(rt.chunks.values()) if rt.chunks else [rt.model]


def weight_shards(rt: Runtime, dtype: torch.dtype | None = None):
    """This rank's pieces of the HF tensors, for rollout weight sync under any layout: no rank gathers
    (mlite.runtime.ckpt.sync.weight_shards)."""
    from mlite.runtime.ckpt.sync import weight_shards as shards

    return shards(held_models(rt), dtype)


def tp_group_weights(rt: Runtime, dtype: torch.dtype | None, tp_size: int, stats: dict | None = None):
    """Every HF tensor whole-shaped on every rank, holding the slab that rank's tensor-parallel rollout
    engine reads (mlite.runtime.ckpt.sync.tp_group_weights)."""
    from mlite.runtime.ckpt.sync import tp_group_weights as stream

    return stream(held_models(rt), dtype, tp_size, rt.arch.num_kv_heads, stats, rt.device)
