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
from typing import Any, Protocol

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from mlite.config.schema import JobConfig
from mlite.errors import MliteError
from mlite.runtime.backends import OptimizerBackend
from mlite.runtime.ckpt import checkpoint as ckpt
from mlite.runtime.optim import LRSchedule
from mlite.runtime.parallel.mesh import ParallelDims


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
class CheckpointedRuntime(Protocol):
    """What the checkpoint and export functions read of the runtime (mlite.runtime.engine.Runtime)."""

    job: JobConfig
    hf_config: dict
    dims: ParallelDims
    model: torch.nn.Module
    pipeline: Any
    optim: OptimizerBackend
    schedule: LRSchedule


def save_checkpoint(rt: CheckpointedRuntime, path: str | Path, extra_state: dict | None = None) -> Path:
    """Atomically write model, optimizer, schedule, RNG streams and `extra_state` (JSON-able) to `path`: the
    tensors and counters in the backend's layout-independent form (mlite.runtime.backends)."""
    meta = {
        "format": 1,
        "schedule": rt.schedule.state_dict(),
        **rt.optim.checkpoint_counters(),  # skipped_steps, counted on the GPU by a fused step: read here
        "world_size": rt.dims.world_size,
        "job": rt.job.model_dump(mode="json"),
        "hf_config": rt.hf_config,
        "extra": extra_state or {},
    }
    return ckpt.save_checkpoint(path, rt.optim.checkpoint_state(), {"rng": rng_state()}, meta)


def load_checkpoint(rt: CheckpointedRuntime, path: str | Path, weights_only: bool = False) -> dict:
    """Restore everything `save_checkpoint` wrote (refusing a corrupt checkpoint); returns extra_state.
    `weights_only`: the model alone (export), leaving optimizer, schedule and RNG as they are."""
    tensors = rt.optim.checkpoint_template(weights_only)
    meta, rank_state = ckpt.load_checkpoint(path, tensors)
    rt.optim.load_checkpoint_state(tensors, None if weights_only else meta)
    if not weights_only:
        rt.schedule.load_state_dict(meta["schedule"])
        if rank_state is not None:
            set_rng_state(rank_state["rng"])
    return meta["extra"]


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


# --------------------------------------------------------------------------------------------- export
def export_weights(rt: CheckpointedRuntime, dtype: torch.dtype | None = None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors one at a time (never the whole state at once)."""
    from mlite.runtime.ckpt.hf import iter_hf_weights

    if rt.pipeline is not None:
        raise MliteError(
            f"exporting weights from a running pp={rt.dims.pp} job: each rank holds only its stages; "
            "export the saved checkpoint instead (mlite export), or run rollouts with parallel.pp: 1"
        )
    for name, tensor in iter_hf_weights(rt.model):
        yield name, (tensor.to(dtype) if dtype is not None else tensor)
