"""Where a run computes: its device, its process group and parallel meshes, and the model built and
parallelized on them. Every layout decision of the runtime lives here; every rule about which layouts and
keys a run accepts lives in the rule book (mlite.plan.rules), and every choice a job leaves to mlite in the
planner (mlite.plan): `place` plans the job once, first, for the world it runs on, and everything else is
built from that plan (`Placement.plan`), never asking either again.

One process is the layout with every degree 1 (`ParallelDims(world_size=1)`): no process group, no meshes.
Several ranks (torchrun or srun set WORLD_SIZE) get the meshes of `ParallelDims.build` and
`parallelize_model` (TP+SP, attention core with CP and recompute, EP, FSDP2 over dp_cp), or pipeline
chunks each parallelized like a whole model.

Start-up at scale: a model is built on the meta device, one chunk per pipeline stage it holds, laid out
there, and only then does each rank allocate and fill its own shards (`build_parallel_model`), so a rank's
start-up memory is its share of the model, never the whole of it.
"""

from __future__ import annotations

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
from mlite.plan import Plan, World, megatron_installed, plan_job
from mlite.plan.policy import vllm_v4_fp8
from mlite.plan.rules import Layout
from mlite.runtime.adapters.pytorch import apply_to_tensors
from mlite.runtime.kernels.grouped_gemm import use_fp8_experts
from mlite.runtime.models import build_model, seeded_init
from mlite.runtime.parallel.mesh import ParallelDims, ParallelMesh
from mlite.runtime.parallel.parallelize import (
    COMPUTE_DTYPES,
    apply_recompute,
    host_offloaded,
    local_shard,
    parallelize_model,
    parameter_holders,
)
from mlite.runtime.parallel.pipeline import PipelineRunner, stage_view


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
    """The run's plan, device, degrees and meshes. `mesh` is None for one process."""

    device: torch.device
    dims: ParallelDims
    mesh: ParallelMesh | None
    owns_process_group: bool  # this runtime started the process group, and ends it in `close`
    plan: Plan  # the job planned for this world: its layout, memory and resolved job (mlite.plan.plan_job)
    # where each step's micro-batches are padded to one length on every rank (`equal_lengths`), the lengths
    # are exchanged over `host_group`: gloo on the host, so the exchange never waits for the GPU (an object
    # all-gather over NCCL reads its result on the host, after the GPU's queued work); None: the default
    # group, itself gloo on the CPU
    host_group: dist.ProcessGroup | None = None

    @property
    def layout(self) -> Layout:
        """The rule book's verdict for this world."""
        return self.plan.layout

    @property
    def equal_lengths(self) -> bool:
        """Each step's micro-batches padded to one length on every rank (policy.equal_micro_batch_lengths)."""
        return self.plan.equal_micro_batch_lengths

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

    def close(self, clean: bool = True) -> None:
        if self.owns_process_group and dist.is_initialized():
            end_process_group(clean)
            self.owns_process_group = False


def end_process_group(clean: bool) -> None:
    """Destroy every process group. After a clean run, first free what still holds collective work (the
    garbage collector) and wait for every rank (a barrier): a rank that tears its gloo pairs down while a
    peer still finishes its last collective, or whose work objects outlive the group into interpreter
    shutdown, dies with SIGABRT after its results are printed. After an error there is no barrier: the
    other ranks may never reach it."""
    import gc

    if clean:
        gc.collect()
        dist.barrier()
    dist.destroy_process_group()


def place(job: JobConfig, arch: ModelArch) -> Placement:
    """Plan the job for the world this process runs in (the one time the rule book and the memory estimate
    are asked), then start the process group (several ranks) and build the meshes the plan lays out."""
    device = pick_device(job.trainer.device)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    plan = plan_job(job, arch, world=World(world, device.type, megatron_installed()))
    # one rank: FSDP2 over a mesh of one (rule book), or Megatron's DDP, which needs a process group
    sharded = plan.process_group
    owns = not dist.is_initialized() and sharded
    if owns:
        backend = "nccl" if device.type == "cuda" else "gloo"
        if world > 1:
            dist.init_process_group(backend)
        else:  # no launcher's rendezvous to join: a store in this process
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    dims = ParallelDims.from_layout(plan.layout)
    mesh = dims.build(device.type) if sharded else None
    equal = plan.equal_micro_batch_lengths
    host_group = dist.new_group(backend="gloo") if equal and device.type == "cuda" else None
    return Placement(device, dims, mesh, owns, plan, host_group)


def build_parallel_model(placement: Placement, dtype: torch.dtype = torch.float32,
                         weights: str | Path | None = None):
    """This rank's share of the model, laid out on the placement: (model, pipeline runner or None, chunks or
    None). Under pipeline parallel, `model` is a view of this rank's chunks under the whole model's names.

    No rank ever holds the whole model: the chunks are built and laid out on the meta device
    (`rank_chunks`), then each rank materialises only its own shards (`materialise`): random weights that
    are the same under every layout, or its slices of the HF checkpoint at `weights`. Built from the
    placement's plan: its job (the `auto`s resolved) and its model."""
    job = placement.plan.job
    chunks = rank_chunks(placement.plan, placement.mesh, dtype, placement.device.type)
    for chunk in chunks.values():
        materialise(chunk, placement.device, job.trainer.seed, weights)
    if placement.dims.pp == 1:
        return chunks[0], None, None
    mesh = placement.mesh
    runner = PipelineRunner(chunks, placement.dims.pp * placement.dims.vpp,
                            dist.get_process_group_ranks(mesh.group("pp")), placement.device)
    runner.activation_dtype = (COMPUTE_DTYPES[job.precision.compute] if placement.device.type == "cuda"
                               else dtype)
    return stage_view(chunks), runner, chunks


def rank_chunks(plan: Plan, mesh: ParallelMesh | None, dtype: torch.dtype = torch.float32,
                runs_on: str = "cpu") -> dict[int, nn.Module]:
    """This rank's pipeline chunks of the plan's model (chunk c of the plan's pp x vpp, `Layout.chunk_layers`,
    lives on pp rank c % pp; one chunk, the whole model, without pipeline parallel), each built on the meta
    device with only its own layers (the embedding on the chunk with layer 0, norm and head on the one with
    the last layer) and laid out like a whole model (TP, CP, recompute, EP, FSDP2 as the plan's job says:
    DTensor plans apply to meta modules). Nothing is allocated: what the rank holds is each parameter's
    local shard (`to_local()`), which `materialise` gives storage and values. `mesh` None: one process
    (recompute and compilation only). `runs_on`: the device type the chunks will compute on (their
    attention backend is chosen for it, not for the meta device)."""
    job, arch = plan.job, plan.arch
    model = job.model
    if job.precision.fp8 != "none" and runs_on == "cuda":  # the rule book saw cluster.gpu; this is the GPU
        from mlite.plan.rules import check_fp8_capability

        check_fp8_capability(job, arch, torch.cuda.get_device_capability(), torch.cuda.get_device_name())

    def build(layers):
        chunk = build_model(arch, model.attention_backend, dtype=dtype, device="meta", layers=layers,
                            mtp_weight=model.mtp_loss_weight, indexer_loss_weight=model.indexer_loss_weight,
                            runs_on=runs_on)
        # FP8 linears swap in before any layout wraps them (same parameter names: checkpoints unchanged)
        if job.precision.fp8 != "none":
            from mlite.runtime.adapters.torchao import convert_to_fp8

            convert_to_fp8(chunk, job.precision.fp8, all_gather=plan.fp8_all_gather,
                           linears=job.precision.fp8_linears)
            if plan.fp8_experts:  # else the routed experts' grouped GEMMs stay bf16
                use_fp8_experts(chunk)
        if job.rollout is not None and job.rollout.match_fp8:  # round what the rollout engine runs in FP8
            from mlite.runtime.fp8_match import match_vllm_fp8

            match_vllm_fp8(chunk, vllm_v4_fp8(job, arch))
        return chunk

    if mesh is None:
        whole = build(None)
        rc = job.recompute
        apply_recompute(whole, rc.granularity, rc.method, rc.num_layers, compile_blocks=model.compile)
        return {0: whole}
    chunks, pp = plan.layout.chunk_layers, plan.layout.pp
    device_type = mesh.dense.device_type
    return {c: parallelize_model(build(list(chunks[c])), mesh, job, device_type, plan.expert_exchange,
                                 plan.fsdp_units, plan.context_chunk, plan.experts_outside_fsdp)
            for c in range(mesh.rank_in("pp"), len(chunks), pp)}


def materialise(chunk: nn.Module, device: torch.device, seed: int, weights: str | Path | None = None) -> None:
    """Give a meta-built (and laid out) chunk storage on `device` for its own shards only, then values: its
    slices of the HF checkpoint `weights`, and for every tensor the checkpoint does not fill (none, for a
    complete one) the seeded initialisation (mlite.runtime.models.seeded_init: each tensor drawn from (seed,
    its global name), so every layout starts from the one-process weights)."""
    to_empty_tied(chunk, device)
    loaded: set[str] = set()
    if weights is not None:
        from mlite.runtime.ckpt.hf import load_hf_weights

        loaded = load_hf_weights(chunk, weights)
    seeded_init(chunk, seed, local_shard, skip=loaded)


def to_empty_tied(module: nn.Module, device: torch.device) -> None:
    """`module.to_empty(device)` with tied parameters kept tied: moving a plain meta parameter replaces it
    in each module that holds it, so a tied LM head would become a second, separate matrix. The shards of
    host-offloaded FSDP2 units (offload.optimizer) are allocated on the host, where FSDP2 keeps them."""
    holders = parameter_holders(module)
    on_host = host_offloaded(module)
    apply_to_tensors(module, lambda t: torch.empty_like(t, device="cpu" if id(t) in on_host else device))
    for (first, first_name), *others in (places for places in holders.values() if len(places) > 1):
        for sub, name in others:
            setattr(sub, name, getattr(first, first_name))
