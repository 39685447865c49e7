"""The parallel layout of a run: degrees, rank placement and every named process group, built once.

`ParallelDims` holds the degrees and checks them; `ParallelDims.build(device_type)` creates the device
meshes and their process groups. Everything else asks the returned `ParallelMesh` for a named sub-mesh
and never recomputes ranks by hand.

Rank placement follows Megatron's order, tensor parallel fastest: rank = ((pp_i * dp + dp_i) * cp + cp_i)
* tp + tp_i. The expert layout folds over the same dp x cp x tp ranks of each pipeline stage as
edp x ep x etp (etp fastest), so with tp = ep the expert groups are the tensor-parallel groups.

Named meshes and why each exists:
- `pp`    pipeline stages (point-to-point sends between neighbours).
- `dp`    data parallel replicas: each reads different micro-batches.
- `cp`    context parallel: one sequence split over ranks; attention exchanges K/V here.
- `tp`    tensor (+ sequence) parallel: weights split by column/row, activations by tokens.
- `dp_cp` dense parameters are sharded (FSDP2) and gradients reduced over it: every rank in it sees
          different tokens of the same weights. The loss is also averaged over it.
- `cp_tp` the ranks that share one micro-batch's tokens: MoE router statistics are summed over it.
- `dp_cp_tp` every rank of a pipeline stage: parameters used on token shards without TP sharding (a MoE
          router) are reduced over it.
- `ep`    expert parallel: experts split over ranks; tokens travel there by all-to-all.
- `etp`   expert tensor parallel (each expert's FFN split over ranks).
- `edp`   expert data parallel: expert weights are sharded and reduced over it (the dp_cp of experts).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, InitVar, dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mlite.errors import MliteError
from mlite.plan.rules import check_degrees, data_parallel_size
from mlite.runtime.adapters.pytorch import flatten_mesh, unflatten_mesh

if TYPE_CHECKING:
    from mlite.config.schema import JobConfig
    from mlite.plan.rules import Layout


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    etp: int = 1
    vpp: int = 1
    _: KW_ONLY
    planned: InitVar[bool] = False  # the degrees of a checked layout (`from_layout`): not checked again

    def __post_init__(self, planned: bool):
        # the degree rules live in the rule book, shared with the planner (one message for one problem)
        if not planned:
            check_degrees(self.world_size, self.pp, self.dp, self.cp, self.tp, self.ep, self.etp, self.vpp)

    @classmethod
    def from_layout(cls, layout: Layout) -> ParallelDims:
        """The degrees of the plan's layout, which the rule book has checked (mlite.plan.plan_job): the
        runtime's own, never checked twice."""
        lay = layout
        return cls(lay.world, lay.pp, lay.dp, lay.cp, lay.tp, lay.ep, lay.etp, lay.vpp, planned=True)

    @classmethod
    def from_job(cls, job: JobConfig, world_size: int) -> ParallelDims:
        par = job.parallel
        dp = data_parallel_size(world_size, par.pp, par.cp, par.tp)
        return cls(world_size, par.pp, dp, par.cp, par.tp, par.ep, par.etp, par.vpp)

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where global `rank` sits in the dense layout (Megatron order, tp fastest): its pp, dp, cp and tp
        indices. Pure arithmetic, no process group: callers may ask before the meshes exist."""
        if not 0 <= rank < self.world_size:
            raise MliteError(f"rank {rank} is outside a world of {self.world_size}")
        return {
            "pp": rank // (self.dp * self.cp * self.tp),
            "dp": rank // (self.cp * self.tp) % self.dp,
            "cp": rank // self.tp % self.cp,
            "tp": rank % self.tp,
        }

    @property
    def edp(self) -> int:
        return self.dp * self.cp * self.tp // (self.ep * self.etp)

    @property
    def dp_cp(self) -> int:
        return self.dp * self.cp

    def build(self, device_type: str = "cpu") -> ParallelMesh:
        """Create every mesh and process group (collective: all ranks call it, once)."""
        if not dist.is_initialized():
            raise MliteError("torch.distributed is not initialised; start the run with torchrun or srun")
        if dist.get_world_size() != self.world_size:
            raise MliteError(f"layout is for {self.world_size} ranks but {dist.get_world_size()} are running")
        # one flat mesh of all ranks, split two ways: dense (pp, dp, cp, tp) and expert (pp, edp, ep, etp).
        # Both come from the same root mesh, so FSDP2 and DTensor accept them together.
        world = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("world",))
        dense = unflatten_mesh(world, 0, (self.pp, self.dp, self.cp, self.tp), ("pp", "dp", "cp", "tp"))
        expert = unflatten_mesh(world, 0, (self.pp, self.edp, self.ep, self.etp), ("pp", "edp", "ep", "etp"))
        named = {name: dense[name] for name in ("pp", "dp", "cp", "tp")}
        named |= {name: expert[name] for name in ("ep", "etp", "edp")}
        for name in ("dp_cp", "cp_tp", "dp_cp_tp"):
            named[name] = flatten_mesh(dense[tuple(name.split("_"))], name)
        return ParallelMesh(self, dense, expert, named)


@dataclass
class ParallelMesh:
    dims: ParallelDims
    dense: DeviceMesh  # (pp, dp, cp, tp) + flattened dp_cp
    expert: DeviceMesh  # (pp, edp, ep, etp)
    named: dict[str, DeviceMesh]  # the 1-D meshes named in the module docstring

    def __getitem__(self, name: str) -> DeviceMesh:
        return self.named[name]

    def group(self, name: str) -> dist.ProcessGroup:
        return self[name].get_group()

    def rank_in(self, name: str) -> int:
        return self[name].get_local_rank()
