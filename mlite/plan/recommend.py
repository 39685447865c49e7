"""Recommend layouts: enumerate the valid ones for a job's model, cluster, sequence length and optimizer
backend, keep those that fit (with `HEADROOM`), and rank them by an estimated step time.

Searched: tp (within a node), pp (uneven layer counts balanced as `balanced_first_last` says), cp, ep, and
for each layout the lightest recompute (none, selective, full) and offload (none, then the whole optimizer)
that fits. Everything else in the job (model, cluster, data, backend, precision) is kept. Only layouts the
trainers run are ranked (`check_job`); a job they refuse whatever the layout (a model they do not build,
dist_opt, ...) is refused up front with that rule's line.

Cost model (seconds per optimizer step, per GPU; docs/PLANNER.md writes it out): compute at an assumed MFU,
scaled up by recompute; the pipeline bubble; TP, CP, EP and data-parallel traffic over NVLink inside a node
and the network across nodes; offloaded optimizer state over PCIe and back. It is for ranking, not a forecast.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlite.config.arch import ModelArch
from mlite.config.catalog import count_params, resolve_arch
from mlite.config.schema import GPU_BF16_TFLOPS, JobConfig
from mlite.errors import MliteError
from mlite.plan.memory import DTYPE_BYTES, MemoryEstimate, estimate_memory, stage_params
from mlite.plan.policy import grad_reduce_dtype
from mlite.plan.rules import Layout, balanced_first_last, check_layout, check_model_layout, check_runtime_keys
from mlite.plan.world import planned_world

ASSUMED_MFU = 0.40  # share of the bf16 peak a well-tuned step reaches
NVLINK_GBPS = 300.0  # effective per-GPU collective bandwidth inside a node (GB/s)
NETWORK_GBPS = 40.0  # effective per-GPU bandwidth across nodes (400 Gb/s NICs)
PCIE_GBPS = 25.0  # host <-> GPU, per GPU
RECOMPUTE_FLOPS = {"none": 1.0, "selective": 1.05, "full": 4 / 3}  # full reruns the forward once more
MAX_PP = 32


@dataclass
class Candidate:
    job: JobConfig
    layout: Layout
    memory: MemoryEstimate
    cost: dict[str, float]  # seconds per step by term

    @property
    def step_s(self) -> float:
        return sum(self.cost.values())

    def as_dict(self) -> dict:
        p, r, o = self.job.parallel, self.job.recompute, self.job.offload
        return {
            "layout": self.layout.describe(), "tp": p.tp, "pp": p.pp, "cp": p.cp, "dp": self.layout.dp,
            "ep": p.ep,
            "edp": self.layout.edp, "pp_first_stage_layers": p.pp_first_stage_layers,
            "pp_last_stage_layers": p.pp_last_stage_layers, "recompute": r.granularity,
            "offload_optimizer": o.optimizer, "memory_gb": round(self.memory.total_gb, 2),
            "host_gb": round(self.memory.host_total_gb, 1), "step_s": round(self.step_s, 4),
            "cost_s": {k: round(v, 4) for k, v in self.cost.items()},
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _variants(job: JobConfig) -> list[tuple[str, bool]]:
    """(recompute, offload optimizer) from lightest to heaviest; the first that fits is kept."""
    offloads = [True] if job.offload.optimizer else [False, True]  # an offload the job asks for stays
    return [(g, o) for o in offloads for g in ("none", "selective", "full")]


def recommend(job: JobConfig, arch: ModelArch | None = None, top: int = 5) -> list[Candidate]:
    arch = arch or resolve_arch(job.model)
    c = job.cluster
    world, node = c.world_size, c.gpus_per_node
    planned = planned_world(job)
    trainer = (planned.size, planned.device_type, planned.megatron)  # where the trainers would run it
    check_runtime_keys(job, arch, *trainer)  # refused whatever the layout: say why rather than "nothing fits"
    experts = arch.moe.num_experts if arch.moe else 1
    found: list[Candidate] = []
    for tp in [d for d in _divisors(node) if d <= node]:
        for pp in [d for d in _divisors(world) if d <= min(MAX_PP, arch.num_layers)]:
            for cp in [d for d in _divisors(world // (tp * pp)) if d <= 32]:
                stage_ranks = world // pp
                for ep in [d for d in _divisors(experts) if stage_ranks % d == 0]:
                    candidate = _best_variant(job, arch, tp, pp, cp, ep, trainer)
                    if candidate is not None:
                        found.append(candidate)
    found.sort(key=lambda cand: (cand.step_s, cand.memory.total_gb))
    return found[:top]


def _best_variant(job: JobConfig, arch: ModelArch, tp: int, pp: int, cp: int, ep: int,
                  trainer: tuple[int, str, bool]) -> Candidate | None:
    first = last = None
    if arch.num_layers % pp:
        first, last = balanced_first_last(arch.num_layers, pp)
    for granularity, offload in _variants(job):
        data = job.model_dump()
        data["parallel"] = {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "pp_first_stage_layers": first,
                            "pp_last_stage_layers": last}
        data["recompute"] = {"granularity": granularity}
        data["offload"] = dict(job.offload.model_dump(), optimizer=offload,
                               optimizer_fraction=((job.offload.optimizer_fraction or 1.0)
                                                   if offload else None))
        try:
            variant = JobConfig.model_validate(data)
            layout = check_layout(variant, arch, trainer[0])
            check_model_layout(variant, arch)
        except (MliteError, ValueError):
            return None  # the layout is invalid or not run with this model: heavier variants will not fix it
        try:
            check_runtime_keys(variant, arch, *trainer)  # with check_model_layout above: check_runtime
        except MliteError:
            continue  # the trainers do not run this variant (e.g. offload on one rank); a heavier one may do
        memory = estimate_memory(variant, arch, layout)
        if memory.fits:
            return Candidate(variant, layout, memory, step_cost(variant, arch, layout, memory))
    return None


def step_cost(job: JobConfig, arch: ModelArch, layout: Layout, memory: MemoryEstimate) -> dict[str, float]:
    """Estimated seconds per optimizer step on one GPU, by term."""
    c, d = job.cluster, job.data
    node = c.gpus_per_node
    act = DTYPE_BYTES[job.precision.compute]
    tokens_step = d.global_batch_size * d.seq_len  # worst case: every sample seq_len long
    counts = count_params(arch)
    flops = 6 * (counts.active - arch.vocab * arch.hidden) * tokens_step  # input embedding is a lookup
    # causal attention
    flops += 6 * arch.num_layers * arch.num_heads * arch.head_dim * d.seq_len / 2 * tokens_step
    flops *= RECOMPUTE_FLOPS[job.recompute.granularity]
    compute = flops / layout.world / (GPU_BF16_TFLOPS[c.gpu] * 1e12 * ASSUMED_MFU)

    bubble = compute * (layout.pp - 1) / (layout.vpp * layout.micro_batches)

    def bw(group_span: int) -> float:  # GB/s for a group whose ranks span group_span consecutive ranks
        return (NVLINK_GBPS if group_span <= node else NETWORK_GBPS) * 1e9

    layers_here = max(len(s) for s in layout.stage_layers)
    moe_layers_here = max(sum(1 for i in s if arch.moe and arch.moe.is_moe_layer(i))
                          for s in layout.stage_layers)
    tokens_rank = tokens_step / (layout.dp * layout.cp)  # tokens each dp x cp rank processes per step
    passes = 3 if job.recompute.granularity == "full" else 2  # forward, backward (+ recomputed forward)
    tp_comm = 0.0
    if layout.tp > 1:  # SP: all-gather + reduce-scatter around attention and MLP, each pass
        volume = 2 * passes * layers_here * tokens_rank * arch.hidden * act * (layout.tp - 1) / layout.tp
        tp_comm = volume / bw(layout.tp)
    cp_comm = 0.0
    if layout.cp > 1:  # ring attention passes K and V around cp ranks each pass
        kv_width = 2 * (arch.num_kv_heads * arch.head_dim if arch.mla is None else arch.mla.kv_lora_rank)
        volume = passes * layers_here * tokens_rank / layout.tp * kv_width * act * (layout.cp - 1) / layout.cp
        cp_comm = volume / bw(layout.tp * layout.cp)
    ep_comm = 0.0
    if layout.ep > 1 and arch.moe:  # dispatch + combine all-to-all, each pass
        volume = 2 * passes * moe_layers_here * tokens_rank / layout.tp * arch.moe.top_k * arch.hidden * act
        ep_comm = volume * (layout.ep - 1) / layout.ep / bw(layout.ep * layout.etp)
    sp = max((stage_params(arch, layout, s) for s in range(layout.pp)), key=lambda p: p.dense + p.experts)
    grad_bytes = DTYPE_BYTES[grad_reduce_dtype(job)]
    # reduce-scatter gradients (once a step, or after every micro-batch where FSDP2 cannot hold them whole)
    # + all-gather parameters
    reduces = layout.micro_batches if memory.fsdp_grad_accumulation == "sharded" else 1
    dp_comm = 0.0
    if layout.dp * layout.cp > 1:
        dp_comm += (reduces + 1) * sp.dense * grad_bytes / bw(layout.tp * layout.cp * layout.dp)
    if layout.edp > 1:
        dp_comm += (reduces + 1) * sp.experts * grad_bytes / bw(layout.tp * layout.cp * layout.dp)
    offloaded = sum(i.gb for i in memory.host_items if i.name == "offloaded state") / c.gpus_per_node
    offload = 2 * offloaded * 2**30 / (PCIE_GBPS * 1e9)  # state out and back every step
    return {"compute": compute, "bubble": bubble, "tp_comm": tp_comm, "cp_comm": cp_comm, "ep_comm": ep_comm,
            "dp_comm": dp_comm, "offload": offload}
