"""The planner: is a job valid, does it fit, and which layouts fit best. No torch here.

    plan = plan_job(load_job("qwen3_30b_a3b_sft"))
    plan.layout.dp, plan.memory.total_gb, plan.memory.fits

`plan_job` gives the trainers' verdict (`mlite.plan.rules.check_job`: one `MliteError` line, why and the fix,
for a job they refuse) and itemises memory per GPU and per node; `recommend` enumerates, filters and ranks
layouts. Every rule lives in `mlite.plan.rules`.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlite.config.arch import ModelArch
from mlite.config.catalog import ParamCounts, count_params, resolve_arch
from mlite.config.schema import JobConfig
from mlite.errors import MliteError
from mlite.plan.memory import MemoryEstimate, estimate_memory
from mlite.plan.rules import (
    Layout,
    check_job,
    check_layout,
    check_runtime,
    megatron_installed,
    planned_device_type,
    split_chunks,
)

__all__ = [
    "Layout",
    "MemoryEstimate",
    "Plan",
    "check_job",
    "check_layout",
    "check_runtime",
    "estimate_memory",
    "plan_job",
    "split_chunks",
]


@dataclass
class Plan:
    job: JobConfig
    arch: ModelArch
    params: ParamCounts
    layout: Layout
    memory: MemoryEstimate
    refused: str | None = None  # the trainers' refusal of a valid layout (plan_job(size_refused=True))


def plan_job(job: JobConfig, arch: ModelArch | None = None, *, size_refused: bool = False) -> Plan:
    """The trainers' verdict on the job as the planner sees it (world = cluster.world_size, the job's
    device), then its memory. Raises MliteError for a job they refuse; with `size_refused`, a job whose layout
    is valid but which the trainers refuse (e.g. optimizer.backend dist_opt) is still sized, the refusal in
    `refused`."""
    arch = arch or resolve_arch(job.model)
    world, device, megatron = job.cluster.world_size, planned_device_type(job), megatron_installed()
    refused = None
    if size_refused:
        layout = check_layout(job, arch, world)  # an invalid layout has nothing to size
        try:
            check_runtime(job, arch, world, device, megatron)
        except MliteError as err:
            refused = str(err)
    else:
        layout = check_job(job, arch, world, device, megatron)
    return Plan(job, arch, count_params(arch), layout, estimate_memory(job, arch, layout), refused)
