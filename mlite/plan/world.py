"""The world a job is planned for: how many ranks, on which device, with which libraries. The caller says;
the planner never probes it itself.

    World(size, device_type, megatron)   # what the runtime passes: its world, its device, megatron-core
    planned_world(job)                   # what `mlite plan` assumes: the job's cluster, its device
    megatron_installed()                 # the environment probe both callers use
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from dataclasses import dataclass

from mlite.config.schema import JobConfig
from mlite.plan.rules import planned_device_type


@dataclass(frozen=True)
class World:
    size: int  # ranks
    device_type: str  # "cuda" or "cpu"
    megatron: bool  # megatron-core importable (optimizer.backend dist_opt needs it)


def planned_world(job: JobConfig) -> World:
    """The world the planner assumes: cluster.world_size ranks on the job's device, megatron-core as installed
    here."""
    return World(job.cluster.world_size, planned_device_type(job), megatron_installed())


def megatron_installed() -> bool:
    """Whether megatron-core is importable, without importing it (not even its namespace package, which
    `importlib.util.find_spec("megatron.core")` would put in sys.modules)."""
    if "megatron" in sys.modules:
        return importlib.util.find_spec("megatron.core") is not None
    top = importlib.machinery.PathFinder.find_spec("megatron")
    if top is None or not top.submodule_search_locations:
        return False
    core = importlib.machinery.PathFinder.find_spec("megatron.core", list(top.submodule_search_locations))
    return core is not None
