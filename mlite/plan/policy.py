"""Runtime policy: how an accepted job runs where the job leaves it to mlite. Not verdicts (those are the rule
book's, mlite.plan.rules): each function here picks a value, and the plan (`mlite.plan.plan_job`) resolves
the job with them once, so the runtime reads the choice from the plan instead of asking again. No torch here.

    grad_reduce_dtype(job)                       # precision.grad_reduce `auto`: the masters' dtype
    expert_exchange(ep, top_k)                   # all_gather or all_to_all under expert parallel
    equal_micro_batch_lengths(ep, top_k, rows)   # whether a step pads each micro-batch to one length
    process_group(job, world_size)               # whether the run starts a process group and meshes
    fsdp_units(job, world_size)                  # whether its parameters live in FSDP2 units
    compute_dtype(job, device_type)              # what the run computes in
"""

from __future__ import annotations

from mlite.config.arch import ModelArch
from mlite.config.backends import backend_traits
from mlite.config.schema import JobConfig


def grad_reduce_dtype(job: JobConfig) -> str:
    """The dtype gradients are reduced in across ranks (FSDP2's reduce_dtype, Megatron DDP's
    grad_reduce_in_fp32), and what the planner sizes their buffers by. `auto` takes the master weights'
    dtype. fp32 masters keep fp32 gradients, reduced in fp32. bf16 masters keep bf16 gradients, as on one
    GPU, and the bf16 reduction halves the bytes (Megatron's default, grad_reduce_in_fp32 off):
    - a step of one micro-batch: each reduced element is rounded once to the bf16 gradient either way, so
      over two ranks it has the fp32 reduction's bits;
    - several micro-batches: they accumulate in bf16, as one GPU's bf16 gradients do (an fp32 reduction
      would accumulate them in fp32);
    - over more ranks, a ring rounds each partial sum."""
    if job.precision.grad_reduce != "auto":
        return job.precision.grad_reduce
    return "bf16" if job.precision.master == "bf16" else "fp32"


def expert_exchange(ep: int, top_k: int) -> str:
    """How routed tokens reach their experts' ranks under expert parallel (ep > 1), by what crosses the
    links per token: `all_gather` sends every token to every other rank of the ep group (ep - 1 rows) and
    each rank picks its own experts' pairs; `all_to_all` sends one row per routed (token, expert) pair,
    top_k x (ep - 1) / ep of them off the rank. The all-gather moves no more whenever ep <= top_k (ep4
    with Qwen3's top-8: 3 rows against 6), and its blocks are of equal size (the step pads every rank's
    micro-batch to one length, `equal_micro_batch_lengths`; the local pair count is read on the host after
    the small routing gather, once a layer; the all-to-all reads its split sizes after an exchange of
    counts). Otherwise (DeepSeek-V4's top-6 at ep8: 7 rows against 5.25) the per-pair all-to-all moves
    less."""
    return "all_gather" if ep <= top_k else "all_to_all"


def equal_micro_batch_lengths(ep: int, top_k: int | None, embedding_rows: bool = False) -> bool:
    """Whether a step pads each micro-batch to the longest of its index on any rank first
    (mlite.runtime.parallel.step.equal_lengths): where the all-gather exchange runs, whose blocks are of one
    size on every rank, and where the embedding exchanges rows (parallel.fsdp_embedding rows: one all-gather
    of every rank's token ids). The padding is one ignored sequence, as for sequence parallel; the lengths
    are exchanged over the host once per call (`Placement.host_group`), where the exchange read the group's
    longest in every layer before."""
    return embedding_rows or (ep > 1 and top_k is not None and expert_exchange(ep, top_k) == "all_gather")


# the rollout weight sync moves tensors in buckets of about this many bytes of whole-shaped tensors
# (mlite.runtime.ckpt.sync.tp_group_weights): one point-to-point batch per bucket, not per tensor (a batch
# costs about 10-35 ms whatever its size on 2 x H200, and a DeepSeek-V4 has some 34,000 HF tensors), and no
# rank holds more than one bucket (or one larger tensor) at a time: what the planner's sync phase counts
SYNC_BUCKET_BYTES = 256 * 2**20


def rollout_expert_parallel(job: JobConfig, arch: ModelArch) -> bool:
    """Whether the vLLM engines split a MoE model's routed experts whole over their ranks
    (rollout.expert_parallel; `auto`: a MoE model on engines of several GPUs)."""
    r = job.rollout
    if r is None or r.engine != "vllm" or arch.moe is None or r.tp == 1:
        return False
    return r.expert_parallel if isinstance(r.expert_parallel, bool) else True


def process_group(job: JobConfig, world_size: int) -> bool:
    """Whether the run has a process group and meshes: several ranks, FSDP2 over a mesh of one
    (parallel.fsdp_one_rank), or Megatron's DDP, which needs a group even on one rank."""
    one_rank_group = backend_traits(job.optimizer.backend).group_on_one_rank
    return world_size > 1 or job.parallel.fsdp_one_rank or one_rank_group


def fsdp_units(job: JobConfig, world_size: int) -> bool:
    """Whether this job's parameters live in FSDP2 units (several ranks, or one under fsdp_one_rank)."""
    return backend_traits(job.optimizer.backend).fsdp_units and (world_size > 1 or job.parallel.fsdp_one_rank)


def compute_dtype(job: JobConfig, device_type: str) -> str:
    """What the run computes in: precision.compute on GPUs; the CPU computes in fp32."""
    return job.precision.compute if device_type == "cuda" else "fp32"
