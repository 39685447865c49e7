"""The planner: is a job's parallel layout valid, does it fit, and which layouts fit best. No torch here.

    plan = plan_job(load_job("qwen3_30b_a3b_sft"))
    plan.layout.dp, plan.memory.total_gb, plan.memory.fits

`check_layout` raises `MliteError` (one line: why, and the fix) for an invalid layout; `estimate_memory`
itemises memory per GPU and per node; `recommend` enumerates, filters and ranks layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlite.config.arch import ModelArch
from mlite.config.catalog import ParamCounts, count_params, resolve_arch
from mlite.config.schema import JobConfig
from mlite.plan.layout import Layout, check_layout
from mlite.plan.memory import MemoryEstimate, estimate_memory

__all__ = ["Plan", "plan_job", "check_layout", "estimate_memory", "Layout", "MemoryEstimate"]


@dataclass
class Plan:
    job: JobConfig
    arch: ModelArch
    params: ParamCounts
    layout: Layout
    memory: MemoryEstimate


def plan_job(job: JobConfig, arch: ModelArch | None = None) -> Plan:
    """Check the layout (raises MliteError when invalid) and estimate memory."""
    arch = arch or resolve_arch(job.model)
    layout = check_layout(job, arch)
    return Plan(job, arch, count_params(arch), layout, estimate_memory(job, arch, layout))
