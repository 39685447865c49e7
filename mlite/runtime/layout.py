"""Where a run computes: its device, its process group and parallel meshes, and the model built and
parallelized on them. Every layout decision of the runtime lives here; every rule about which layouts and
keys a run accepts lives in the rule book (mlite.plan.rules), asked first, before anything is built.

One process is the layout with every degree 1 (`ParallelDims(world_size=1)`): no process group, no meshes.
Several ranks (torchrun or srun set WORLD_SIZE) get the meshes of `ParallelDims.build` and
`parallelize_model` (TP+SP, attention core with CP and recompute, EP, FSDP2 over dp_cp), or pipeline
chunks each parallelized like a whole model.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mlite.config.arch import ModelArch
from mlite.config.schema import JobConfig
from mlite.errors import MliteError
from mlite.plan.rules import check_job, megatron_installed
from mlite.runtime.parallel.mesh import ParallelDims, ParallelMesh
from mlite.runtime.parallel.parallelize import apply_recompute, parallelize_model
from mlite.runtime.parallel.pipeline import PipelineRunner, keep_chunk, split_layers, stage_view

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def pick_device(choice: str) -> torch.device:
    """trainer.device: auto (cuda when visible, else cpu), cpu or cuda (refused when no GPU is visible)."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise MliteError("trainer.device: cuda but no CUDA GPU is visible; "
                         "run on a GPU node or set trainer.device=cpu")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def hf_config_of(job: JobConfig) -> dict[str, Any]:
    """The HF config.json dict of the job's model (a catalog preset or a local checkpoint)."""
    if job.model.name is not None:
        from mlite.config.catalog import PRESETS, preset_arch

        preset_arch(job.model.name)  # the catalog's own error for an unknown name
        return {**PRESETS[job.model.name]}
    path = Path(job.model.path)
    config = path if path.name == "config.json" else path / "config.json"
    if not config.is_file():
        raise MliteError(f"model.path {job.model.path}: no config.json there; "
                         "point it at an HF checkpoint dir")
    return json.loads(config.read_text())


@dataclass
class Placement:
    """The run's device, degrees and meshes. `mesh` is None for one process."""

    device: torch.device
    dims: ParallelDims
    mesh: ParallelMesh | None
    owns_process_group: bool  # this runtime started the process group, and ends it in `close`

    @property
    def loss_group(self) -> dist.ProcessGroup | None:
        """Where a loss's token counts are summed: every rank that sees other tokens of the same weights."""
        return self.mesh.group("dp_cp") if self.mesh is not None else None

    def rank_in(self, name: str) -> int:
        return self.mesh.rank_in(name) if self.mesh is not None else 0

    @property
    def is_output_rank(self) -> bool:
        """The rank whose outputs (log-probs, metrics) are the step's: last pipeline stage, tp/cp rank 0."""
        return self.rank_in("pp") == self.dims.pp - 1 and self.rank_in("tp") == 0 and self.rank_in("cp") == 0

    def close(self) -> None:
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_process_group = False


def place(job: JobConfig, arch: ModelArch) -> Placement:
    """Ask the rule book, then start the process group (several ranks) and build the meshes."""
    device = pick_device(job.trainer.device)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    check_job(job, arch, world, device.type, megatron_installed())
    owns = not dist.is_initialized() and world > 1
    if owns:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    dims = ParallelDims.from_job(job, world)
    mesh = dims.build(device.type) if world > 1 else None
    return Placement(device, dims, mesh, owns)


def build_parallel_model(model: nn.Module, job: JobConfig, placement: Placement, arch: ModelArch):
    """The built model laid out on the placement: (model, pipeline runner or None, chunks or None). Under
    pipeline parallel, `model` becomes a view of this rank's chunks under the whole model's names."""
    if placement.dims.pp > 1:
        runner, chunks = _pipeline(model, job, placement, arch)
        return stage_view(chunks), runner, chunks
    rc = job.recompute
    if placement.mesh is not None:
        parallelize_model(model, placement.mesh, job, placement.device.type)
    else:
        apply_recompute(model, rc.granularity, rc.method, rc.num_layers, compile_blocks=job.model.compile)
    return model, None, None


def _pipeline(model: nn.Module, job: JobConfig, placement: Placement, arch: ModelArch):
    """This pp rank's chunks of the model (chunk c of pp*vpp lives on rank c % pp), each parallelized like a
    whole model, and the runner that moves activations between them."""
    dims, par, mesh = placement.dims, job.parallel, placement.mesh
    split = split_layers(arch.num_layers, dims.pp, dims.vpp, par.pp_first_stage_layers,
                         par.pp_last_stage_layers)
    pp_rank = mesh.rank_in("pp")
    chunks = {}
    for c in range(pp_rank, dims.pp * dims.vpp, dims.pp):
        chunk = keep_chunk(copy.deepcopy(model), split[c], c == 0, c == len(split) - 1)
        chunks[c] = parallelize_model(chunk, mesh, job, placement.device.type)
    runner = PipelineRunner(chunks, dims.pp * dims.vpp, dist.get_process_group_ranks(mesh.group("pp")))
    dtype = next(model.parameters()).dtype
    runner.activation_dtype = (COMPUTE_DTYPES[job.precision.compute] if placement.device.type == "cuda"
                               else dtype)
    return runner, chunks
