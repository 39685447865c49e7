"""The planner: is a job valid, does it fit, how does it run, and which layouts fit best. No torch here.

    plan = plan_job(load_job("qwen3_30b_a3b_sft"))              # the job's own cluster (planned_world)
    plan = plan_job(job, arch, world=World(2, "cuda", False))   # the runtime: the world it runs on
    plan.layout.dp, plan.memory.total_gb, plan.memory.fits, plan.job.parallel.fsdp_unit_layers

`plan_job` gives the trainers' verdict (`mlite.plan.rules.check_job`: one `MliteError` line, why and the fix,
for a job they refuse), itemises memory per GPU and per node (`mlite.plan.memory`), and resolves every `auto`
the world gives a meaning to (`mlite.plan.policy`, and the memory estimate's choices): `Plan.job` is the job
with those filled in, the one job the runtime is built from. `recommend` enumerates, filters and ranks
layouts. Every rule lives in `mlite.plan.rules`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlite.config.arch import ModelArch
from mlite.config.catalog import ParamCounts, count_params, resolve_arch
from mlite.config.schema import JobConfig
from mlite.errors import MliteError
from mlite.plan import policy
from mlite.plan.memory import MemoryEstimate, estimate_memory
from mlite.plan.rules import (
    Layout,
    check_job,
    check_layout,
    check_runtime,
    context_chunk_multiple,
    fp8_experts_on,
    fp8_token_multiple,
    split_chunks,
)
from mlite.plan.world import World, megatron_installed, planned_world

__all__ = [
    "Layout",
    "MemoryEstimate",
    "Plan",
    "World",
    "check_job",
    "check_layout",
    "check_runtime",
    "estimate_memory",
    "for_another_world",
    "megatron_installed",
    "plan_job",
    "planned_world",
    "split_chunks",
]


@dataclass(frozen=True)
class Plan:
    """A job planned for a world: the verdict's layout, the memory estimate, and every choice the runtime
    makes where the job says `auto` or leaves it to mlite. The runtime is built from it
    (`mlite.runtime.layout.place`) and asks neither the rule book nor the estimate again."""

    job: JobConfig  # the job with the `auto`s of `resolved` filled in: the one job the runtime holds
    arch: ModelArch
    params: ParamCounts
    world: World
    layout: Layout  # the degrees, the stage split (`stage_layers`, `chunk_layers`), micro-batches
    memory: MemoryEstimate
    # dotted keys of `job` that said `auto` and now hold the plan's choice. Keys resolve where their subject
    # exists: FSDP2's unit keys (and precision.fp8_all_gather, how the units gather) where there are FSDP2
    # units, precision.grad_reduce where a process group reduces gradients, parallel.expert_buffers where
    # the all-gather expert exchange runs. Elsewhere a key keeps `auto`,
    # the one value the rule book accepts for a knob the run does not have, so that `plan_job(plan.job)`
    # is this plan again. (trainer.device `auto` is the world's device, `world.device_type`: the runtime
    # picks it before it plans.)
    resolved: tuple[str, ...]
    process_group: bool  # a process group and meshes (policy.process_group)
    fsdp_units: bool  # the parameters live in FSDP2 units (policy.fsdp_units)
    experts_outside_fsdp: bool  # the routed experts are in no FSDP2 unit (policy.experts_outside_fsdp)
    compute_dtype: str  # what the run computes in (policy.compute_dtype: fp32 on the CPU)
    grad_reduce: str  # the dtype gradients are reduced in across ranks (policy.grad_reduce_dtype)
    expert_exchange: str | None  # how routed tokens cross the ep ranks; None without expert parallel
    equal_micro_batch_lengths: bool  # each step pads its micro-batches to one length on every rank
    context_chunk: int  # every context-parallel chunk's length is a multiple of it (context_chunk_multiple)
    token_multiple: int  # every micro-batch share's length is a multiple of it (fp8_token_multiple)
    refused: str | None = None  # the trainers' refusal of a valid layout (plan_job(size_refused=True))

    @property
    def fsdp_grad_accumulation(self) -> str | None:
        """How FSDP2 accumulates a step's micro-batches: "unsharded" (one reduce-scatter a step, at the last
        backward) or "sharded" (after every micro-batch; also where the plan has one micro-batch a step, for a
        caller that brings more); None without FSDP2 units."""
        return self.job.parallel.fsdp_grad_accumulation if self.fsdp_units else None

    @property
    def fp8_experts(self) -> bool:
        """Whether the routed experts' grouped GEMMs run in FP8 (rules.fp8_experts_on on this layout, as the
        runtime and the memory estimate ask it); never without precision.fp8 or routed experts."""
        return fp8_experts_on(self.job, self.arch, self.layout)

    @property
    def fp8_all_gather(self) -> bool:
        """Whether FSDP2 gathers the FP8 linears' weights in FP8 (policy.fp8_all_gather on this layout, as
        the memory estimate counts them); never without FSDP2 units."""
        return self.fsdp_units and self.memory.fp8_all_gather

    def choices(self) -> dict[str, Any]:
        """What the run does where the job leaves it to mlite: `mlite plan` prints these."""
        p = self.job.parallel
        r = self.job.recompute
        return {
            "device": self.world.device_type, "compute_dtype": self.compute_dtype,
            "grad_reduce": self.grad_reduce if self.process_group else None,
            "fsdp_unit_layers": p.fsdp_unit_layers if self.fsdp_units else None,
            "fsdp_reshard_after_forward": p.fsdp_reshard_after_forward if self.fsdp_units else None,
            "fsdp_grad_accumulation": self.fsdp_grad_accumulation,
            "experts_outside_fsdp": self.experts_outside_fsdp if self.fsdp_units and self.arch.moe else None,
            "expert_exchange": self.expert_exchange,
            "expert_buffers": p.expert_buffers if self.expert_exchange == "all_gather" else None,
            "equal_micro_batch_lengths": self.equal_micro_batch_lengths,
            "context_chunk": self.context_chunk if self.layout.cp > 1 else None,
            "fp8": self.job.precision.fp8 if self.job.precision.fp8 != "none" else None,
            "fp8_all_gather": self.fp8_all_gather if self.fsdp_units else None,
            "fp8_experts": self.fp8_experts if self.job.precision.fp8 != "none" and self.arch.moe else None,
            "offload_trainer": self.memory.offload_trainer,
            "rollout_fp8_weights": self.memory.rollout_fp8_weights,
            "recompute": {"granularity": r.granularity, "method": r.method, "num_layers": r.num_layers},
            "resolved": list(self.resolved),
        }


def plan_job(job: JobConfig, arch: ModelArch | None = None, *, world: World | None = None,
             size_refused: bool = False) -> Plan:
    """The trainers' verdict on the job in `world` (default: the job's cluster, `planned_world`), its memory,
    and its `auto`s resolved. Raises MliteError for a job they refuse; with `size_refused`, a job whose layout
    is valid but which the trainers refuse (e.g. optimizer.backend dist_opt) is still sized, the refusal in
    `refused`."""
    arch = arch or resolve_arch(job.model)
    world = world or planned_world(job)
    refused = None
    if size_refused:
        layout = check_layout(job, arch, world.size)  # an invalid layout has nothing to size
        try:
            check_runtime(job, arch, world.size, world.device_type, world.megatron)
        except MliteError as err:
            refused = str(err)
    else:
        layout = check_job(job, arch, world.size, world.device_type, world.megatron)
    memory = estimate_memory(job, arch, layout)
    resolved_job, resolved = _resolve(job, world, memory)
    top_k = arch.moe.top_k if arch.moe is not None else None
    group = policy.process_group(job, world.size)
    rows = job.parallel.fsdp_embedding == "rows"
    fsdp_units = policy.fsdp_units(job, world.size)
    return Plan(
        job=resolved_job, arch=arch, params=count_params(arch), world=world, layout=layout, memory=memory,
        resolved=resolved, process_group=group, fsdp_units=fsdp_units,
        experts_outside_fsdp=fsdp_units and policy.experts_outside_fsdp(job, layout, world.device_type),
        compute_dtype=policy.compute_dtype(job, world.device_type), grad_reduce=policy.grad_reduce_dtype(job),
        expert_exchange=policy.expert_exchange(layout.ep, top_k) if layout.ep > 1 and top_k else None,
        equal_micro_batch_lengths=group and policy.equal_micro_batch_lengths(layout.ep, top_k, rows),
        context_chunk=context_chunk_multiple(arch),
        token_multiple=fp8_token_multiple(job.precision.fp8),
        refused=refused,
    )


# the keys a plan may resolve (`Plan.resolved`): FSDP2's units where they exist, the reduction dtype where a
# process group reduces, the expert exchange's buffers where the all-gather exchange runs
RESOLVABLE = ("parallel.fsdp_unit_layers", "parallel.fsdp_reshard_after_forward",
              "parallel.fsdp_grad_accumulation", "precision.fp8_all_gather", "precision.grad_reduce",
              "parallel.expert_buffers")


def for_another_world(job: dict[str, Any]) -> dict[str, Any]:
    """A planned job as a dict (a checkpoint's `job`: the plan's, its `auto`s resolved for the world it ran
    on) for another world: the keys a plan resolves back to `auto`, so that this world's plan resolves them
    anew (`mlite export` rebuilds a checkpoint's model on one CPU process, where FSDP2's units of the run's
    ranks would be refused)."""
    for key in RESOLVABLE:
        section, name = key.split(".")
        job.setdefault(section, {})[name] = "auto"
    return job


def _resolve(job: JobConfig, world: World, memory: MemoryEstimate) -> tuple[JobConfig, tuple[str, ...]]:
    """The job with its `auto`s filled in where the world gives them a meaning (`Plan.resolved`), and the
    dotted keys it filled."""
    choices: dict[str, Any] = {}
    if policy.process_group(job, world.size):
        choices["precision.grad_reduce"] = policy.grad_reduce_dtype(job)
    if policy.fsdp_units(job, world.size):
        choices["parallel.fsdp_unit_layers"] = memory.fsdp_unit_layers
        choices["parallel.fsdp_reshard_after_forward"] = memory.fsdp_reshard_after_forward
        # one micro-batch a step accumulates nothing (the estimate says None): a caller that brings more
        # micro-batches to a step (verl) gets a reduce-scatter after each
        choices["parallel.fsdp_grad_accumulation"] = memory.fsdp_grad_accumulation or "sharded"
        # off without precision.fp8 tensorwise or without ranks to gather from (mlite.plan.policy)
        choices["precision.fp8_all_gather"] = memory.fp8_all_gather
    if memory.expert_buffers != "auto":  # the all-gather expert exchange runs: how its buffers are sized
        choices["parallel.expert_buffers"] = memory.expert_buffers
    if memory.offload_trainer is not None:  # a vLLM rollout
        choices["rollout.offload_trainer"] = memory.offload_trainer
        choices["rollout.fp8_weights"] = memory.rollout_fp8_weights
    sections: dict[str, dict[str, Any]] = {}
    for key, value in choices.items():
        section, name = key.split(".")
        if getattr(getattr(job, section), name) == "auto":
            sections.setdefault(section, {})[name] = value
    if not sections:
        return job, ()
    update = {section: getattr(job, section).model_copy(update=keys) for section, keys in sections.items()}
    resolved = tuple(f"{section}.{name}" for section, keys in sections.items() for name in keys)
    return job.model_copy(update=update, deep=True), resolved
