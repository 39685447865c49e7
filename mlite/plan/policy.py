"""Runtime policy: how an accepted job runs where the job leaves it to mlite. Not verdicts (those are the rule
book's, mlite.plan.rules): each function here picks a value, and the plan (`mlite.plan.plan_job`) resolves
the job with them once, so the runtime reads the choice from the plan instead of asking again. No torch here.

    grad_reduce_dtype(job)                       # precision.grad_reduce `auto`: the masters' dtype
    expert_exchange(ep, top_k)                   # all_gather or all_to_all under expert parallel
    expert_pair_rows(ep, tokens, top_k, local)   # parallel.expert_buffers worst_case: the pair buffers' rows
    equal_micro_batch_lengths(ep, top_k, rows)   # whether a step pads each micro-batch to one length
    process_group(job, world_size)               # whether the run starts a process group and meshes
    fsdp_units(job, world_size)                  # whether its parameters live in FSDP2 units
    experts_outside_fsdp(job, layout, device)    # whether a MoE layer's experts are left out of FSDP2
    compute_dtype(job, device_type)              # what the run computes in
    fp8_all_gather(job)                          # precision.fp8_all_gather `auto`: FP8 all-gathers or not
    rollout_expert_parallel(job, arch)           # whether vLLM engines split the experts whole
    vllm_v4_fp8(job, arch)                       # how a DeepSeek-V4 engine gets its FP8 weights
    vllm_fp8_misfit(arch, tp, expert_parallel)   # what an engine's FP8 blocks would cut, if anything
    vllm_weight_bytes(arch, dtype_bytes, fp8)    # the bytes of the weights a vLLM engine holds
    per_sequence_attention(tokens, sequences)    # packed attention: cuDNN per sequence or one varlen call
"""

from __future__ import annotations

import os

from mlite.config.arch import ModelArch
from mlite.config.backends import backend_traits
from mlite.config.catalog import count_params, layer_params
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


def expert_pair_rows(ep: int, tokens: int, top_k: int, local_experts: int) -> int:
    """parallel.expert_buffers worst_case: the most (token, expert) pairs one rank of the all-gather exchange
    can be sent, what its pair buffers hold: each of the ep x `tokens` gathered tokens picks top_k distinct
    experts, at most `local_experts` of them this rank's. Known from the shapes, so nothing is read on the
    host; at ep2 with Qwen3's top-8 it is twice the pairs a balanced router sends."""
    return ep * tokens * min(top_k, local_experts)


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


def vllm_v4_fp8(job: JobConfig, arch: ModelArch) -> str | None:
    """How a DeepSeek-V4 vLLM engine gets the FP8 weights it multiplies with (mlite.runtime.ckpt.sync
    .vllm_send_as): "linears" (rollout.fp8_weights: the sync sends every release-FP8 linear and the routed
    experts in FP8), "wo_a" (the sync sends wo_a in FP8: rollout.v4_fp8_at_sync), "online" (vLLM quantises
    wo_a itself); None for any other model or engine. Reads the plan's job (fp8_weights `auto` resolved)."""
    r = job.rollout
    if r is None or r.engine != "vllm" or arch.v4 is None:
        return None
    if r.fp8_weights is True:
        return "linears"
    return "wo_a" if r.v4_fp8_at_sync else "online"


FP8_EMULATE_ENV = "MLITE_FP8_EMULATE"


def fp8_emulated() -> bool:
    """The developers' switch (MLITE_FP8_EMULATE=1): precision.fp8 runs on any device with its numerics
    emulated in plain torch (torchao's `emulate`), so that the CPU suite trains FP8 jobs end to end, several
    processes included; never faster, and blockwise has no emulation."""
    return os.environ.get(FP8_EMULATE_ENV, "") == "1"


def vllm_v4_width_misfit(arch: ModelArch) -> str | None:
    """What of a DeepSeek-V4's widths vLLM 0.25.1 computes wrongly without an error, or None. Its fused mHC
    kernel for forwards of 16 tokens or fewer (every decode step once few requests are left, and short
    prompts) splits the hidden size over 8 blocks (under 8 tokens, hidden <= 4096) or 4, and each block's
    256 threads take whole 256-wide strides of its split: a split narrower than 256, or not a multiple of
    it, is skipped, and the layer's output is memory never written (vllm/model_executor/kernels/mhc/
    tilelang.py:411-415, tilelang_kernels.py:381-393). Measured: docs/GRPO.md."""
    if arch.v4 is None:
        return None
    need = 256 * (8 if arch.hidden <= 4096 else 4)
    if arch.hidden % need:
        return f"hidden size {arch.hidden} is not a multiple of {need}"
    return None


def vllm_fp8_misfit(arch: ModelArch, tp: int, expert_parallel: bool) -> str | None:
    """What an engine of `tp` GPUs would cut off FP8's 128-wide blocks (vLLM's block-FP8 linears need each
    rank's share of a split dimension in whole blocks), or None: DeepSeek-V4's attention is whole on every
    engine rank; the shared experts' width, and the routed experts' unless they go whole (expert parallel),
    are split by tp."""
    widths = {"the shared experts' width": arch.moe.shared_expert_ffn} if arch.moe else {}
    if arch.moe and not expert_parallel:
        widths["the routed experts' width"] = arch.moe.expert_ffn
    for what, width in widths.items():
        if width and width % (128 * tp):
            return f"{what} {width} is not a multiple of 128 x rollout.tp={tp}"
    return None


def vllm_weight_bytes(arch: ModelArch, dtype_bytes: int, fp8: bool) -> float:
    """The bytes of a whole vLLM engine's weights (MTP layers aside: the rollout does not speculate): every
    parameter in the rollout dtype, or with `fp8` (DeepSeek-V4's "linears") the attention projections, the
    shared and routed experts in one byte plus a float32 scale per 128x128 block (the compressors'
    projections, which stay in the rollout dtype, counted with the attention's: under 1% of the model)."""
    total = count_params(arch).total
    if not fp8:
        return total * dtype_bytes
    quantised = sum(p.attention + p.mlp + p.experts
                    for p in (layer_params(arch, i) for i in range(arch.num_layers)))
    return (total - quantised) * dtype_bytes + quantised * (1 + 4 / (128 * 128))


# Packed attention (model.attention_backend `packed`, auto's choice on a GPU) over a stream of several
# sequences runs one varlen call (torch's FA2) or cuDNN's fused kernel once per sequence. cuDNN's kernel is
# the faster on long sequences; each sequence costs it its own launches, and the boundaries a host read. On
# one H200 (Qwen3-1.7B, five documents packed; docs/PERFORMANCE.md, "Attention on long packed streams")
# varlen's step was 4% shorter at 1,638 tokens a sequence on average, cuDNN's 3% shorter at 2,458 and 6% at
# 3,277.
PER_SEQUENCE_ATTENTION_MEAN_TOKENS = 2048


def per_sequence_attention(tokens: int, sequences: int) -> bool:
    """Whether packed attention runs cuDNN once per sequence, not one varlen call over the stream: where the
    stream's `sequences` average PER_SEQUENCE_ATTENTION_MEAN_TOKENS of its `tokens` or more. Asked per
    micro-batch (the lengths are the data's), with sizes the runtime knows without reading the GPU."""
    return tokens >= PER_SEQUENCE_ATTENTION_MEAN_TOKENS * sequences


def process_group(job: JobConfig, world_size: int) -> bool:
    """Whether the run has a process group and meshes: several ranks, FSDP2 over a mesh of one
    (parallel.fsdp_one_rank), or Megatron's DDP, which needs a group even on one rank."""
    one_rank_group = backend_traits(job.optimizer.backend).group_on_one_rank
    return world_size > 1 or job.parallel.fsdp_one_rank or one_rank_group


def fsdp_units(job: JobConfig, world_size: int) -> bool:
    """Whether this job's parameters live in FSDP2 units (several ranks, or one under fsdp_one_rank)."""
    return backend_traits(job.optimizer.backend).fsdp_units and (world_size > 1 or job.parallel.fsdp_one_rank)


def experts_outside_fsdp(job: JobConfig, layout, device_type: str) -> bool:
    """Whether the routed experts stay plain expert-parallel parameters, in no FSDP2 unit. `layout`: the
    degrees (`ep`, `etp`, `tp`, `edp`) of the plan's Layout or the runtime's ParallelDims. Where expert
    parallel (or etp, or tp) gives the experts a mesh of their own that spans one rank (edp 1: the ep x etp
    ranks are all of a stage's), FSDP2 has nothing to gather or reduce: a unit of theirs would only add its
    host work and copies every pass, and its hooks would break every MoE block's compiled graph
    (docs/PERFORMANCE.md). Not where their master weights are not the compute dtype (FSDP2's unit casts
    them and frees the copy after the layer), nor where the optimizer is offloaded (FSDP2's
    CPUOffloadPolicy holds the offloaded shards)."""
    own_mesh = layout.ep * layout.etp * layout.tp > 1
    return (own_mesh and layout.edp == 1 and job.precision.master == compute_dtype(job, device_type)
            and not job.offload.optimizer)


def compute_dtype(job: JobConfig, device_type: str) -> str:
    """What the run computes in: precision.compute on GPUs; the CPU computes in fp32."""
    return job.precision.compute if device_type == "cuda" else "fp32"


def fp8_all_gather(job: JobConfig) -> bool:
    """Whether FSDP2 all-gathers its units' FP8 linear weights in FP8 (precision.fp8_all_gather; torchao's
    `enable_fsdp_float8_all_gather`, tensorwise only): half of bf16's bytes on the wire and in the gathered
    unit, at the cost of a cast of every weight on the host's side of each gather and one scale reduction
    over all weights after each optimizer step. `auto`: off. On 2 x H200 (NVLink) the gather in FP8 made
    the fsdp2 dp2 step slower in every launch (166.7 ms against 139.4-160.9 without it; bf16: 116.9 ms):
    the step is bound by the host, and the casts add host work, while the wire was never the bound
    (docs/PERFORMANCE.md). `true` trades that for the memory of the gathered units."""
    value = job.precision.fp8_all_gather
    return False if value == "auto" else value
