"""What each optimizer backend is, as the torch-free layers need to know it: one record per
`optimizer.backend`, read by the job's validation, the rule book, the memory estimate and the plan's policy.
The runtime's objects for the same names are built by mlite.runtime.backends.build_backend; nothing else
branches on the backend's name.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BackendTraits:
    name: str
    runs: str  # what it runs, for messages
    # parameters live in FSDP2 units (sharded over dp_cp, gathered per unit); the parallel.fsdp_* keys shape
    # them. Otherwise Megatron's DDP buckets hold whole bf16 parameters and the optimizer shards fp32 masters
    fsdp_units: bool
    params_to_host: bool  # parameters can rest on the host between uses (offload.params)
    group_on_one_rank: bool  # needs a process group even for one process (Megatron's DDP)
    switchable_overlaps: bool  # optimizer.overlap_grad_reduce / overlap_param_gather switch its overlaps
    needs_cuda_and_megatron: bool  # trains only on CUDA GPUs with megatron-core installed
    master_dtype: str  # the masters its mlite bench cases keep: Megatron's optimizer keeps fp32 ones


BACKENDS: dict[str, BackendTraits] = {
    "fsdp2": BackendTraits(
        name="fsdp2", runs="torch's FSDP2 with mlite's AdamW", fsdp_units=True, params_to_host=True,
        group_on_one_rank=False, switchable_overlaps=False, needs_cuda_and_megatron=False,
        master_dtype="bf16",
    ),
    "dist_opt": BackendTraits(
        name="dist_opt", runs="Megatron-Core's DDP and distributed optimizer", fsdp_units=False,
        params_to_host=False, group_on_one_rank=True, switchable_overlaps=True, needs_cuda_and_megatron=True,
        master_dtype="fp32",
    ),
}


def backend_traits(name: str) -> BackendTraits:
    """The record of optimizer.backend `name` (the schema accepts only the names here)."""
    return BACKENDS[name]
