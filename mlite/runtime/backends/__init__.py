"""The optimizer backends, one object per run behind one interface (`OptimizerBackend`, base.py):

- `fsdp2` (fsdp2.py): LocalAdamW over the model's parameters, whole on one process or FSDP2's shards;
- `dist_opt` (dist_opt.py): Megatron-Core's DDP + DistributedOptimizer around the model (CUDA).

This module is the one place in the runtime that turns optimizer.backend into code: `backend_type` names
the class, `build_backend` builds the runtime's backend from the plan. Nothing else in the runtime asks
which backend a job runs; what the layout needs to know of it before a backend exists (a process group on
one rank, FSDP2 units or none) is the plan's torch-free verdict (mlite.plan: `Plan.process_group`,
`Plan.fsdp_units`).
"""

from __future__ import annotations

from mlite.config.schema import JobConfig
from mlite.plan import Plan
from mlite.runtime.backends.base import BackendBase, HeldModel, OptimizerBackend
from mlite.runtime.backends.dist_opt import DistOptBackend
from mlite.runtime.backends.fsdp2 import Fsdp2Backend
from mlite.runtime.parallel.mesh import ParallelDims

__all__ = ["BACKENDS", "BackendBase", "HeldModel", "OptimizerBackend", "backend_type", "build_backend"]

BACKENDS: dict[str, type[Fsdp2Backend] | type[DistOptBackend]] = {
    Fsdp2Backend.name: Fsdp2Backend,
    DistOptBackend.name: DistOptBackend,
}


def backend_type(job: JobConfig) -> type[Fsdp2Backend] | type[DistOptBackend]:
    """The class of the job's optimizer.backend (the schema admits only these names)."""
    return BACKENDS[job.optimizer.backend]


def build_backend(plan: Plan, held: HeldModel, dims: ParallelDims) -> OptimizerBackend:
    """The plan's backend over the model this rank holds, on the plan's degrees `dims` (collective for
    dist_opt: every rank calls it)."""
    return backend_type(plan.job).build(plan, held, dims)
