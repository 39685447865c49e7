"""The rule book: every rule that decides whether mlite accepts a job, in one torch-free module that the
planner and the trainers' start-up both call, so that `mlite plan` and `mlite sft` / `mlite grpo` give one
verdict.

    layout = check_job(job, arch, world_size, device_type, has_megatron)   # THE verdict; raises MliteError
    layout = check_layout(job, arch, world_size)      # the layout alone: what the planner sizes
    check_runtime(job, arch, world_size, device_type, has_megatron)        # what the trainers run beyond it
    chunks = split_chunks(num_layers, pp, vpp, first, last)                # the one stage splitter

Every rule raises `MliteError` with one line: what is wrong and the fix. docs/PLANNER.md ("Validation",
"What the trainers run", "Backend support matrix") writes them out; `SUPPORT` is the matrix it prints.

Verdicts only: what the runtime does where the job leaves it open (the reduction dtype, the expert
exchange, padding) is policy (mlite.plan.policy), and whether megatron-core is installed is the caller's
probe (mlite.plan.world).

Who calls what, with which arguments:
- the planner (`mlite.plan.plan_job`) calls `check_job` once per plan, with the world it is given: for
  `mlite plan` and `mlite grpo` the job's cluster (`mlite.plan.world.planned_world`: world =
  cluster.world_size, device_type = `planned_device_type(job)`); for the trainers the world they run on;
- the trainers: `Runtime` plans the job first thing at start-up (mlite.runtime.layout.place), before any
  model is built, and builds everything from that plan without asking again;
- `ParallelDims` (mlite.runtime.parallel.mesh) checks degrees given by hand with `data_parallel_size` and
  `check_degrees` (the runtime's come from the plan's layout), the dist_opt adapter with
  `check_dist_opt_adapter`, the pipeline cuts with `split_chunks`;
- precision.fp8: the plan judges the job's cluster.gpu; `check_fp8_capability` is for the runtime's
  start-up, with the compute capability of the device it holds.

Rank folding (as in mlite.runtime.parallel.mesh): world = pp x dp x cp x tp, and on the dp x cp x tp ranks of
each pipeline stage the experts fold as edp x ep x etp.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Protocol

from mlite.config.arch import V4_CSA, ModelArch, MoEArch
from mlite.config.backends import backend_traits
from mlite.config.catalog import GPU_COMPUTE_CAPABILITY
from mlite.config.schema import JobConfig
from mlite.errors import MliteError
from mlite.plan.policy import (
    expert_exchange,
    fp8_emulated,
    rollout_expert_parallel,
    vllm_fp8_misfit,
    vllm_v4_width_misfit,
)

MATRIX = "docs/PLANNER.md, backend matrix"


# ------------------------------------------------------------------------------- backend support matrix
@dataclass(frozen=True)
class Support:
    """One row of the matrix. `fsdp2`: FSDP2 carries it and the trainers run it. `dist_opt`: Megatron-Core's
    distributed optimizer carries it by design (what the planner sizes). `adapter`: mlite's dist_opt adapter
    (mlite/runtime/backends/dist_opt.py) runs it today. `off`: how a job drops the feature."""

    fsdp2: bool
    dist_opt: bool
    adapter: bool
    why: str
    off: str


# feature -> support. docs/PLANNER.md prints the same table (tests/test_rules.py compares them).
SUPPORT: dict[str, Support] = {
    "cpu (gloo) device": Support(True, False, False, "Megatron-Core's distributed optimizer needs CUDA GPUs",
                                 "run on GPUs"),
    "tp + sequence parallel": Support(True, True, True, "", "set parallel.tp: 1"),
    "pp (1F1B)": Support(True, True, True, "", "set parallel.pp: 1"),
    "vpp (interleaved 1F1B)": Support(True, True, True, "", "set parallel.vpp: 1"),
    "cp (zigzag ring attention)": Support(True, True, True, "", "set parallel.cp: 1"),
    "ep": Support(True, True, True, "", "set parallel.ep: 1"),
    "etp > 1": Support(False, True, False, "FSDP2 shards experts over edp; it does not split an expert's FFN",
                       "set parallel.etp: 1"),
    "offload.params": Support(True, False, False, "Megatron's distributed optimizer keeps parameters on the "
                              "GPU", "set offload.params: false"),
    "offload.grads": Support(True, False, False, "Megatron DDP's contiguous grad buffer stays on the GPU",
                             "set offload.grads: false"),
    "offload.optimizer (+ fraction)": Support(True, True, False, "Megatron: a hybrid CPU/GPU optimizer with "
                                              "a fraction; not wired into the adapter",
                                              "set offload.optimizer: false"),
    "precision.compute fp16": Support(False, True, False, "fp16 needs a loss scaler; only Megatron's "
                                      "optimizer has one", "set precision.compute: bf16"),
    "precision.master bf16": Support(True, True, False, "fsdp2 on GPUs; Megatron needs Transformer "
                                     "Engine's precision-aware Adam", "set precision.master: fp32"),
    "precision.optimizer_state fp8": Support(True, False, False, "fsdp2, every layout; Megatron's "
                                             "optimizer keeps its own Adam state",
                                             "set precision.optimizer_state: master"),
    "checkpoints (save, resume)": Support(True, True, True, "", ""),
}
TRAINED_BACKENDS = ("fsdp2", "dist_opt")  # what the trainers' Runtime builds (dist_opt: its adapter column)
# what mlite.runtime.models builds (mlite.config.arch.FAMILIES)
TRAINED_FAMILIES = ("dense", "moe", "deepseek_v4")
# Model families whose attention mlite does not split by tensor parallel.
NO_TP_MODELS = {"deepseek_v4": "its one shared KV head and grouped low-rank output projection are not split"}


class Degrees(Protocol):
    """What the rules read of a layout: job.parallel, a `Layout` and `ParallelDims` all have these."""

    tp: int
    pp: int
    vpp: int
    cp: int
    ep: int
    etp: int


def planned_device_type(job: JobConfig) -> str:
    """The device the planner assumes: the job's, as the trainers would pick it on that cluster."""
    return "cpu" if job.cluster.gpu == "cpu" or job.trainer.device == "cpu" else "cuda"


def features_used(job: JobConfig, dims: Degrees, device_type: str) -> list[str]:
    """The matrix rows this job needs."""
    used = {
        "cpu (gloo) device": device_type != "cuda",
        "tp + sequence parallel": dims.tp > 1,
        "pp (1F1B)": dims.pp > 1 and dims.vpp == 1,
        "vpp (interleaved 1F1B)": dims.vpp > 1,
        "cp (zigzag ring attention)": dims.cp > 1,
        "ep": dims.ep > 1,
        "etp > 1": dims.etp > 1,
        "offload.params": job.offload.params,
        "offload.grads": job.offload.grads,
        "offload.optimizer (+ fraction)": job.offload.optimizer,
        "precision.compute fp16": job.precision.compute == "fp16",
        "precision.master bf16": job.precision.master == "bf16",
        "precision.optimizer_state fp8": job.precision.optimizer_state == "fp8",
        "checkpoints (save, resume)": True,
    }
    return [feature for feature, on in used.items() if on]


def check_backend(job: JobConfig) -> None:
    """The matrix by design: what optimizer.backend carries (dist_opt: what Megatron-Core does, so the planner
    can size it; whether the trainers run it is `check_backend_trained`)."""
    backend = job.optimizer.backend
    for feature in features_used(job, job.parallel, planned_device_type(job)):
        row = SUPPORT[feature]
        if getattr(row, backend):
            continue
        trained = [b for b in TRAINED_BACKENDS if getattr(row, "adapter" if b == "dist_opt" else b)]
        fix = f"use optimizer.backend {trained[0]}" if trained else f"{row.off} (no trained backend has it)"
        raise MliteError(
            f"{feature} is not supported by optimizer.backend '{backend}' ({row.why}); {fix} ({MATRIX})"
        )


# ------------------------------------------------------------------------------------------- degrees
def _described(world_size: int, **degrees: int) -> str:
    return ", ".join(f"{k}={v}" for k, v in degrees.items()) + f", world={world_size}"


def data_parallel_size(world_size: int, pp: int, cp: int, tp: int) -> int:
    """dp = world / (pp x cp x tp), which must be whole."""
    per_replica = pp * cp * tp
    if world_size % per_replica:
        raise MliteError(
            f"world size {world_size} is not a multiple of pp x cp x tp = {per_replica} "
            f"({_described(world_size, pp=pp, cp=cp, tp=tp)}), so dp = world / (pp x cp x tp) is not "
            f"whole; pick degrees whose product divides {world_size}, or change the number of GPUs"
        )
    return world_size // per_replica


def check_degrees(
    world_size: int, pp: int, dp: int, cp: int, tp: int, ep: int = 1, etp: int = 1, vpp: int = 1
) -> int:
    """The degrees of one layout fit together; returns edp, the expert data-parallel size."""
    degrees = {"pp": pp, "dp": dp, "cp": cp, "tp": tp, "ep": ep, "etp": etp, "vpp": vpp}
    described = _described(world_size, **degrees)
    if any(v < 1 for v in degrees.values()):
        raise MliteError(f"parallel degrees must be >= 1 ({described})")
    if pp * dp * cp * tp != world_size:
        raise MliteError(f"pp x dp x cp x tp must equal the world size ({described}); fix the degrees")
    stage = dp * cp * tp
    if stage % (ep * etp):
        raise MliteError(
            f"ep x etp must divide dp x cp x tp, the {stage} ranks of one pipeline stage that experts fold "
            f"over: {ep * etp} does not ({described}); choose ep x etp dividing {stage}"
        )
    return stage // (ep * etp)


# ------------------------------------------------------------------------------------- pipeline split
def split_chunks(
    num_layers: int, pp: int, vpp: int = 1, first: int | None = None, last: int | None = None
) -> list[list[int]]:
    """Global layer ids of each of the pp x vpp pipeline chunks, in model order; chunk c runs on pp rank
    c % pp (dealt round-robin when vpp > 1). Without explicit sizes the layers split evenly over the
    chunks. With `first` / `last` (pp_first/last_stage_layers, vpp = 1 only; 0 makes an embedding-only or
    head-only stage) the other stages share the rest evenly, at least one layer each."""
    if pp > num_layers:
        raise MliteError(
            f"parallel.pp={pp} exceeds the model's {num_layers} layers; use at most {num_layers} stages"
        )
    chunks = pp * vpp
    if first is None and last is None:
        if num_layers % chunks:
            hint = (
                suggest_first_last(num_layers, pp) if vpp == 1 else f"choose pp x vpp dividing {num_layers}"
            )
            raise MliteError(
                f"the model's {num_layers} layers do not split over pp={pp} x vpp={vpp} = {chunks} "
                f"chunks evenly; {hint}"
            )
        sizes = [num_layers // chunks] * chunks
    else:
        if vpp > 1:  # interleaved chunks are all the same size (Megatron's rule too)
            raise MliteError(
                "pp_first_stage_layers / pp_last_stage_layers need vpp = 1 (interleaved chunks are "
                "split evenly); remove parallel.vpp or the explicit stage sizes"
            )
        fixed = (first or 0) + (last or 0)
        middle = pp - (first is not None) - (last is not None)
        rest = num_layers - fixed
        if rest < 0 or (middle == 0 and rest != 0):
            raise MliteError(
                f"pp_first_stage_layers + pp_last_stage_layers = {fixed} does not fit the model's "
                f"{num_layers} layers over pp={pp}; {suggest_first_last(num_layers, pp)}"
            )
        if middle and (rest % middle or rest // middle == 0):
            raise MliteError(
                f"after the explicit first/last stages, {rest} layers do not split evenly (and at "
                f"least one each) over the other {middle} stages; {suggest_first_last(num_layers, pp)}"
            )
        sizes = [rest // middle if middle else 0] * pp
        if first is not None:
            sizes[0] = first
        if last is not None:
            sizes[-1] = last
    bounds = [0, *itertools.accumulate(sizes)]
    return [list(range(a, b)) for a, b in itertools.pairwise(bounds)]


def balanced_first_last(layers: int, pp: int) -> tuple[int, int]:
    """Stage sizes for layers that pp does not divide: middle stages of ceil(L/pp) layers (fewer if that
    would leave first and last nothing), the rest shared by first and last, the last (which holds the head)
    no larger."""
    if pp == 2:
        return layers - layers // 2, layers // 2
    middle = math.ceil(layers / pp)
    while layers - (pp - 2) * middle < 2 and middle > 1:
        middle -= 1
    rest = layers - (pp - 2) * middle
    return rest - rest // 2, rest // 2


def suggest_first_last(layers: int, pp: int) -> str:
    if pp == 1:
        return "use pp=1"
    first, last = balanced_first_last(layers, pp)
    return f"e.g. set parallel.pp_first_stage_layers={first} and parallel.pp_last_stage_layers={last}"


# ---------------------------------------------------------------------------------------- the layout
@dataclass(frozen=True)
class Layout:
    """Degrees of a checked layout plus what they imply."""

    world: int
    tp: int
    pp: int
    vpp: int
    cp: int
    dp: int
    ep: int
    etp: int
    edp: int
    sequence_parallel: bool
    stage_layers: tuple[tuple[int, ...], ...]  # per pipeline rank: layer ids it holds (all its chunks)
    micro_batches: int  # micro-batches per optimizer step per data-parallel rank (worst case: long samples)
    tokens_per_micro_batch: int  # before cp splits it
    split: int  # every sequence length must be a multiple of this (SP x CP chunks)
    chunk_layers: tuple[tuple[int, ...], ...] = ()  # per pipeline chunk (pp x vpp, model order): split_chunks

    def describe(self) -> str:
        text = f"tp{self.tp} pp{self.pp} cp{self.cp} dp{self.dp} ep{self.ep}"
        if self.vpp > 1:
            text += f" vpp{self.vpp}"
        if self.etp > 1:
            text += f" etp{self.etp}"
        return text


def check_layout(job: JobConfig, arch: ModelArch, world_size: int) -> Layout:
    """The parallel layout on `world_size` ranks against the model: what the planner sizes (a dist_opt layout
    by Megatron-Core's design). Whether the trainers run it is `check_runtime`; both: `check_job`."""
    p = job.parallel
    dp = data_parallel_size(world_size, p.pp, p.cp, p.tp)
    edp = check_degrees(world_size, p.pp, dp, p.cp, p.tp, p.ep, p.etp, p.vpp)
    check_backend(job)
    check_model_split(job, arch)
    chunks = split_chunks(arch.num_layers, p.pp, p.vpp, p.pp_first_stage_layers, p.pp_last_stage_layers)
    split = check_sequence_split(job, arch)
    micro_batches, tokens = check_batches(job, arch, dp)
    check_recompute(job, chunks)
    check_rollout(job, arch, world_size)
    stage_layers = tuple(tuple(i for chunk in chunks[r :: p.pp] for i in chunk) for r in range(p.pp))
    return Layout(world=world_size, tp=p.tp, pp=p.pp, vpp=p.vpp, cp=p.cp, dp=dp, ep=p.ep, etp=p.etp, edp=edp,
                  sequence_parallel=bool(p.sequence_parallel), stage_layers=stage_layers,
                  micro_batches=micro_batches, tokens_per_micro_batch=tokens, split=split,
                  chunk_layers=tuple(tuple(c) for c in chunks))


def check_model_split(job: JobConfig, arch: ModelArch) -> None:
    """Heads, KV heads and MLP widths split by tp, experts by ep, expert width by etp."""
    p = job.parallel
    if p.tp > 1 and arch.model_type in NO_TP_MODELS:
        raise MliteError(
            f"{arch.name} runs with tp=1 only: {NO_TP_MODELS[arch.model_type]}; set parallel.tp=1 "
            "and scale with ep, cp, pp and dp"
        )
    if arch.num_heads % p.tp:
        raise MliteError(
            f"{arch.name} has {arch.num_heads} attention heads, not divisible by tp={p.tp}; "
            f"use a tp dividing {arch.num_heads}"
        )
    # KV heads are not replicated across tp; MLA's latent KV is not split at all
    if arch.mla is None and arch.num_kv_heads % p.tp:
        raise MliteError(
            f"{arch.name} has {arch.num_kv_heads} KV heads, not divisible by tp={p.tp} (KV heads are "
            f"not replicated across tp); use a tp dividing {arch.num_kv_heads}"
        )
    if arch.ffn and arch.ffn % p.tp:
        raise MliteError(f"{arch.name}'s MLP width {arch.ffn} is not divisible by tp={p.tp}; use another tp")
    if arch.moe is None:
        if p.ep > 1 or p.etp > 1:
            raise MliteError(f"{arch.name} is dense (no experts): parallel.ep and parallel.etp must be 1")
        return
    if arch.moe.num_experts % p.ep:
        raise MliteError(
            f"{arch.name} has {arch.moe.num_experts} routed experts, not divisible by ep={p.ep}; "
            f"use an ep dividing {arch.moe.num_experts}"
        )
    if arch.moe.expert_ffn % p.etp:
        raise MliteError(
            f"{arch.name}'s expert width {arch.moe.expert_ffn} is not divisible by etp={p.etp}; "
            "use another etp"
        )
    if arch.moe.shared_expert_ffn % p.tp:
        raise MliteError(
            f"{arch.name}'s shared expert width {arch.moe.shared_expert_ffn} is not divisible by "
            f"tp={p.tp}; use another tp"
        )


def check_sequence_split(job: JobConfig, arch: ModelArch) -> int:
    """Sequence parallel splits every packed micro-batch over tp ranks; context parallel cuts its token stream
    into 2 x cp chunks (zigzag: rank i takes chunks i and 2cp-1-i, balancing causal work). Lengths must split
    evenly: an uneven split is refused here rather than failing inside a collective later. Returns the
    multiple every length must be."""
    p, d = job.parallel, job.data
    split = p.tp if p.sequence_parallel else 1
    why = [f"sequence parallel (tp={p.tp})"] if split > 1 else []
    if p.cp > 1:
        chunk = context_chunk_multiple(arch)
        if chunk > 1:
            why.append(f"DeepSeek-V4's {chunk} boundary rows per chunk")
        split = math.lcm(split, 2 * p.cp * chunk)
        why.append(f"context parallel zigzag (2 x cp={p.cp} chunks)")
    if split == 1:
        return 1
    lengths = {"data.seq_len": d.seq_len}
    if d.dynamic_batch:
        lengths["data.max_tokens_per_micro_batch"] = d.max_tokens_per_micro_batch
    for key, value in lengths.items():
        if value % split:
            lower, upper = value // split * split, (value // split + 1) * split
            raise MliteError(
                f"{key}={value} cannot be split evenly by {' and '.join(why)}: it must be a multiple "
                f"of {split}; use {lower or upper} or {upper}"
            )
    return split


def context_chunk_multiple(arch: ModelArch) -> int:
    """What every context-parallel chunk's length must be a multiple of. DeepSeek-V4: the rows a chunk needs
    from the one before it (its sliding window, its longest compression window, CSA's two overlapping
    windows), so a chunk of at least that many rows gets them all from its neighbour. 1 otherwise."""
    v4 = arch.v4
    if v4 is None:
        return 1
    return max(v4.sliding_window, *v4.compress_ratios, 2 * V4_CSA)


def check_batches(job: JobConfig, arch: ModelArch, dp: int) -> tuple[int, int]:
    """Batches over dp ranks and micro-batches; returns (micro-batches per step, tokens per micro-batch)."""
    d, p = job.data, job.parallel
    if d.global_batch_size % dp:
        raise MliteError(
            f"data.global_batch_size={d.global_batch_size} is not divisible by dp={dp} data-parallel "
            f"ranks; use a multiple of {dp}"
        )
    per_rank = d.global_batch_size // dp
    if d.dynamic_batch:
        tokens = d.max_tokens_per_micro_batch
        micro = max(1, math.ceil(per_rank * d.seq_len / tokens))  # worst case: every sample is seq_len long
    else:
        if per_rank % d.micro_batch_size:
            raise MliteError(
                f"data.global_batch_size={d.global_batch_size} is not divisible by dp x "
                f"micro_batch_size = {dp * d.micro_batch_size}; use a multiple of it"
            )
        tokens = d.micro_batch_size * d.seq_len
        micro = per_rank // d.micro_batch_size
    if p.vpp > 1 and micro % p.pp:  # Megatron's interleaved-schedule rule
        raise MliteError(
            f"interleaved pipeline (vpp={p.vpp}) needs micro-batches per step ({micro}) divisible by "
            f"pp={p.pp}; raise data.global_batch_size to a multiple of {dp * p.pp} x the micro-batch"
        )
    if d.seq_len > arch.max_position_embeddings:
        raise MliteError(
            f"data.seq_len={d.seq_len} exceeds {arch.name}'s max_position_embeddings="
            f"{arch.max_position_embeddings}; lower data.seq_len"
        )
    return micro, tokens


def check_recompute(job: JobConfig, chunks: list[list[int]]) -> None:
    """Full recompute groups layers within one pipeline chunk."""
    r = job.recompute
    if r.granularity != "full":
        return
    per_chunk = min(len(c) for c in chunks if c)  # a stage may hold 0 layers (embedding or head only)
    if r.num_layers > max(1, per_chunk):
        raise MliteError(
            f"recompute.num_layers={r.num_layers} exceeds the {per_chunk} layers of a pipeline chunk; "
            f"use at most {max(1, per_chunk)}"
        )


def check_rollout_fp8(job: JobConfig, arch: ModelArch) -> None:
    """rollout.fp8_weights: true sends DeepSeek-V4's release-FP8 linears and experts to vLLM in FP8, so it
    needs a V4 model on vLLM, and engine ranks whose shares of the split widths are whole 128-wide blocks."""
    r = job.rollout
    if r.fp8_weights is not True:
        return
    if r.engine != "vllm" or arch.v4 is None:
        what = "rolls out on the built-in engine" if r.engine != "vllm" else f"trains {arch.name}"
        raise MliteError(
            f"rollout.fp8_weights: true sends DeepSeek-V4's linears and experts to vLLM in FP8, and this job "
            f"{what}; remove rollout.fp8_weights"
        )
    misfit = vllm_fp8_misfit(arch, r.tp, rollout_expert_parallel(job, arch))
    if misfit:
        raise MliteError(f"rollout.fp8_weights: true, but {misfit}: vLLM's FP8 blocks would be cut; choose a "
                         "rollout.tp that divides it in 128-wide blocks, or remove rollout.fp8_weights")


def check_rollout_v4_widths(job: JobConfig, arch: ModelArch) -> None:
    """A DeepSeek-V4 on vLLM: widths its kernels compute right (mlite.plan.policy.vllm_v4_width_misfit)."""
    misfit = vllm_v4_width_misfit(arch) if job.rollout.engine == "vllm" else None
    if misfit:
        raise MliteError(
            f"rollout.engine vllm with {arch.name}: its {misfit}, and vLLM 0.25.1's mHC kernel for forwards "
            "of 16 tokens or fewer skips such widths without an error, so decoding returns garbage once few "
            "requests are left; use a multiple of 2048 up to 4096 (V4-Flash: 4096), of 1024 above"
        )


def check_rollout(job: JobConfig, arch: ModelArch, world_size: int) -> None:
    """GRPO's rollout shape against the layout, by design (which engine runs: check_rollout_engine)."""
    if job.rollout is None:
        return
    r = job.rollout
    if world_size % r.tp:
        raise MliteError(
            f"rollout.tp={r.tp} does not divide the world size {world_size}; use a divisor of it"
        )
    if r.tp > 1 and r.engine == "builtin":
        raise MliteError(
            "rollout.tp > 1 needs rollout.engine: vllm (the builtin engine generates on the training "
            "layout); set rollout.tp=1"
        )
    if r.expert_parallel is True and (r.engine != "vllm" or arch.moe is None):
        what = "rolls out on the built-in engine" if r.engine != "vllm" else f"trains {arch.name}, dense"
        raise MliteError(
            f"rollout.expert_parallel: true splits a MoE model's experts over a vLLM engine's ranks, and "
            f"this job {what}; remove rollout.expert_parallel"
        )
    check_rollout_fp8(job, arch)
    check_rollout_v4_widths(job, arch)
    per_node = job.cluster.gpus_per_node
    if r.tp > per_node and not r.span_nodes:
        raise MliteError(
            f"rollout.tp={r.tp} spans {math.ceil(r.tp / per_node)} nodes of {per_node} GPUs: vLLM's "
            "tensor-parallel all-reduces would cross the network at every decoded token; use rollout.tp <= "
            f"{per_node} (rollout.offload_trainer makes room for the weights), or set rollout.span_nodes: "
            "true"
        )
    if arch.num_heads % r.tp:
        raise MliteError(
            f"rollout.tp={r.tp} does not divide {arch.name}'s {arch.num_heads} attention heads; "
            "use a divisor of them"
        )
    kv = arch.num_kv_heads
    if r.tp > 1 and arch.mla is None and (kv % r.tp if kv >= r.tp else r.tp % kv):
        # vLLM splits KV heads over its ranks, or gives each rank one KV head shared by tp / kv ranks
        raise MliteError(
            f"rollout.tp={r.tp} and {arch.name}'s {kv} KV heads: vLLM needs one to divide the other; "
            "use a divisor or a multiple of the KV heads"
        )
    ffns = {"MLP intermediate size": arch.ffn}
    if arch.moe is not None:
        ffns["expert intermediate size"] = arch.moe.expert_ffn
    for what, size in ffns.items():
        if r.tp > 1 and size and size % r.tp:
            raise MliteError(
                f"rollout.tp={r.tp} does not divide {arch.name}'s {what} {size} (vLLM splits it over its "
                "ranks); use a divisor of it"
            )
    needed = r.max_prompt_length + r.max_response_length
    if needed > job.data.seq_len:
        raise MliteError(
            f"rollout.max_prompt_length + max_response_length = {needed} exceeds data.seq_len="
            f"{job.data.seq_len}, the longest sequence training accepts; raise data.seq_len to {needed}"
        )


# --------------------------------------------------------------------------------- what the trainers run
def check_runtime(
    job: JobConfig, arch: ModelArch, world_size: int, device_type: str, has_megatron: bool
) -> None:
    """What the trainers refuse at start-up beyond `check_layout`: keys the run cannot honour on this device
    and world, then layouts this model cannot run with yet."""
    check_runtime_keys(job, arch, world_size, device_type, has_megatron)
    check_model_layout(job, arch)


def check_runtime_keys(
    job: JobConfig, arch: ModelArch, world_size: int, device_type: str, has_megatron: bool
) -> None:
    """The refusals no choice of parallel degrees changes (`recommend` asks these once, before its search)."""
    check_model_built(arch)
    check_model_losses(job, arch)
    check_fsdp_one_rank(job, world_size)
    check_fsdp_units(job, world_size)
    check_fsdp_embedding(job, arch)
    check_expert_buffers(job, arch)
    check_overlaps(job)
    check_fp8(job, arch, world_size, device_type)
    check_backend_trained(job, device_type, has_megatron)
    check_precision(job, world_size, device_type)
    check_offload(job, world_size, device_type)
    check_rollout_engine(job, world_size, device_type)


def check_job(
    job: JobConfig, arch: ModelArch, world_size: int, device_type: str, has_megatron: bool
) -> Layout:
    """THE verdict: the layout, then what the trainers run. The planner calls it once per plan
    (`mlite.plan.plan_job`), for `mlite plan` and for the trainers' start-up alike, before any model is
    built."""
    layout = check_layout(job, arch, world_size)
    check_runtime(job, arch, world_size, device_type, has_megatron)
    return layout


def check_model_built(arch: ModelArch) -> None:
    """The model families mlite.runtime.models builds (its build_model asks this too)."""
    native = "qwen3, qwen2, llama, mistral, qwen3_moe, deepseek_v4"
    if arch.family not in TRAINED_FAMILIES:
        raise MliteError(
            f"{arch.name or arch.model_type} (model_type '{arch.model_type}') has no native model yet, "
            f"so the trainers cannot build it; train a model_type they build: {native}"
        )
    if arch.moe is not None and arch.moe.shared_experts and arch.v4 is None:  # qwen2_moe
        raise MliteError(
            f"{arch.name or arch.model_type} (model_type '{arch.model_type}'): shared experts are not in the "
            f"native MoE block yet, so the trainers cannot build it; train a model_type they build: {native}"
        )


def check_model_losses(job: JobConfig, arch: ModelArch) -> None:
    """The model's own extra losses exist in this architecture."""
    m = job.model
    if m.mtp_loss_weight > 0 and (arch.v4 is None or not arch.mtp_layers):
        raise MliteError(
            f"model.mtp_loss_weight={m.mtp_loss_weight}: {arch.name} has no multi-token-prediction layer "
            "(DeepSeek-V4 with num_nextn_predict_layers >= 1 has); set model.mtp_loss_weight=0"
        )
    if m.indexer_loss_weight > 0 and (arch.v4 is None or 4 not in arch.v4.compress_ratios):
        raise MliteError(
            f"model.indexer_loss_weight={m.indexer_loss_weight}: {arch.name} has no lightning indexer "
            "(DeepSeek-V4's compressed sparse attention layers have); set model.indexer_loss_weight=0"
        )


def check_model_layout(job: JobConfig, arch: ModelArch) -> None:
    """Degrees the runtime cannot run with this model yet (the degrees themselves are fine)."""
    p = job.parallel
    if arch.tie_embeddings and p.pp > 1:  # one weight in the first and the last stage
        raise MliteError(
            f"tied embeddings (tie_word_embeddings) with pp={p.pp} are not supported yet; use pp=1 (data, "
            "tensor, context and expert parallel work) or a model with an untied LM head"
        )
    check_fp8_layout(job)


def _adapter_gaps(job: JobConfig, dims: Degrees) -> list[tuple[str, str]]:
    """What mlite's dist_opt adapter does not run in this job: (short name, its one-line refusal), in the
    order the adapter refuses them. The matrix's `adapter` column says the same per feature."""
    gaps: list[tuple[str, str]] = []
    if dims.etp > 1:
        line = (
            f"parallel.etp={dims.etp} with optimizer.backend dist_opt: mlite does not split an expert's FFN "
            "over tensor-parallel ranks; set parallel.etp: 1"
        )
        gaps.append((f"etp={dims.etp}", line))
    precision = job.precision
    if precision.compute == "fp16":
        line = (
            "precision.compute fp16 with optimizer.backend dist_opt needs the runtime to scale the loss by "
            "Megatron's dynamic loss scale, which it does not yet; use precision.compute bf16"
        )
        gaps.append(("precision.compute fp16", line))
    if precision.master != "fp32":
        line = (
            f"precision.master {precision.master}: Megatron-Core's distributed optimizer keeps fp32 master "
            "shards (bf16 masters need Transformer Engine's precision-aware Adam); set precision.master fp32 "
            "or use optimizer.backend fsdp2"
        )
        gaps.append((f"precision.master {precision.master}", line))
    if precision.grad_reduce == "bf16" and precision.compute == "fp32":
        line = (
            f"precision.grad_reduce {precision.grad_reduce} with precision.compute fp32: gradients are "
            "fp32 and are reduced in fp32 anyway; remove precision.grad_reduce or compute in bf16"
        )
        gaps.append((f"precision.grad_reduce {precision.grad_reduce}", line))
    if precision.optimizer_state == "fp8":
        line = (
            "precision.optimizer_state fp8 with optimizer.backend dist_opt: Megatron's distributed "
            "optimizer keeps its own fp32 Adam state; set precision.optimizer_state: master or use "
            "optimizer.backend fsdp2"
        )
        gaps.append(("precision.optimizer_state fp8", line))
    offload = [f"offload.{k}" for k in ("params", "grads", "optimizer") if getattr(job.offload, k)]
    if offload:
        line = (
            "offload.* with optimizer.backend dist_opt: Megatron-Core's optimizer offload is not wired in "
            "mlite yet; remove offload or use optimizer.backend fsdp2"
        )
        gaps.append((", ".join(offload), line))
    return gaps


def check_dist_opt_adapter(job: JobConfig, dims: Degrees) -> None:
    """What mlite's dist_opt adapter refuses before anything is built (build_dist_opt calls it)."""
    gaps = _adapter_gaps(job, dims)
    if gaps:
        raise MliteError(gaps[0][1])


def check_backend_trained(job: JobConfig, device_type: str, has_megatron: bool) -> None:
    """dist_opt trains where Megatron-Core's DDP can run (CUDA GPUs, megatron-core installed) and only with
    what its adapter carries (the matrix's adapter column); fsdp2 everywhere."""
    if not backend_traits(job.optimizer.backend).needs_cuda_and_megatron:
        return
    check_dist_opt_adapter(job, job.parallel)
    lacks = {"CUDA GPUs": device_type != "cuda", "megatron-core": not has_megatron}
    needs = [what for what, missing in lacks.items() if missing]
    if needs:
        raise MliteError(
            f"optimizer.backend dist_opt runs Megatron-Core's distributed optimizer, which needs "
            f"{' and '.join(needs)}, and this run lacks them; pip install 'mlite[megatron]' on a GPU "
            f"machine, or use optimizer.backend fsdp2 ({MATRIX})"
        )


def check_precision(job: JobConfig, world_size: int, device_type: str) -> None:
    precision = job.precision
    if precision.master == "bf16" and device_type != "cuda":
        raise MliteError(
            "precision.master: bf16 keeps parameters and Adam state in bf16 on GPUs, but this run "
            "computes in fp32 on the CPU; set precision.master: fp32 (or run on GPUs)"
        )
    offload = [f"offload.{k}" for k in ("params", "grads", "optimizer") if getattr(job.offload, k)]
    if precision.optimizer_state == "fp8" and offload:
        raise MliteError(
            f"precision.optimizer_state: fp8 keeps the Adam state on the GPU, and {', '.join(offload)} moves "
            "it to the host, where the step is torch's own; set precision.optimizer_state: master, or "
            "remove offload"
        )
    if precision.grad_reduce == "bf16" and world_size == 1 and not job.parallel.fsdp_one_rank:
        raise MliteError(
            f"precision.grad_reduce: {precision.grad_reduce} sets the dtype of the gradient reduction "
            "across ranks, and this run has one process; remove it, start several ranks (torchrun), or "
            "shard one rank with FSDP2 (parallel.fsdp_one_rank: true)"
        )


# ------------------------------------------------------------------------------------------------ FP8
FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada, Hopper and newer
FP8_HOPPER = (9, 0)  # torchao's blockwise FP8 linear and its FP8 grouped GEMM (the routed experts)
FP8_TILE = 16  # torch._scaled_mm tiles every width of an FP8 GEMM in multiples of this
FP8_BLOCK = 128  # blockwise: 128x128 weight blocks, 1x128 activation tiles


def fp8_token_multiple(recipe: str) -> int:
    """What every micro-batch share's token count must be a multiple of under precision.fp8: the weight
    gradient (grad_out^T @ x) contracts over the tokens, an FP8 GEMM's inner width, so the runtime pads each
    share with one ignored sequence to the recipe's tile (`local_share`). 1 without FP8."""
    if recipe == "none":
        return 1
    return FP8_BLOCK if recipe == "blockwise" else FP8_TILE


def fp8_linear_gains(recipe: str, n_in: float, n_out: float) -> bool:
    """Whether an n_in -> n_out linear is large enough for `recipe`'s FP8 GEMMs to beat bf16 with their
    casts (precision.fp8_linears: auto converts only these). torchao's own size rule, fitted on its H100
    tables (torchao 0.18, `torchao/float8/float8_linear_utils.py`: `_auto_filter_for_tensorwise` and
    `_rowwise`; torchtitan applies it as `auto_filter_small_kn`): tensorwise loses where K <= 4096 and
    N <= 1024; rowwise where N <= 2048, K <= 1024, or N <= 4096 and K <= 2048 (K the input width, N the
    output). On one H200 it keeps Qwen3-1.7B's k_proj and v_proj (2048 -> 1024) in bf16, which took the
    FP8 step from 97.8 to 90.9 ms (docs/PERFORMANCE.md). Blockwise converts every linear, as DeepSeek's
    recipe and vLLM's block-FP8 linears do."""
    if recipe == "tensorwise":
        return not (n_in <= 4096 and n_out <= 1024)
    if recipe == "rowwise":
        return not (n_out <= 2048 or n_in <= 1024 or (n_out <= 4096 and n_in <= 2048))
    return True


# The routed experts' FP8 grouped GEMM gains where its flops per element its casts pass over reach this
# (fp8_experts_gain): the break-even of GEMMs at twice bf16's dense peak (989 TFLOP/s on an H200) against
# casts at the ~1.7 ps an element that torchao 0.18's Triton cast kernels took on an H200 (17 ms for
# Qwen3-30B-A3B's 9.8e9 cast elements a step, 15 ms for the 4-layer DeepSeek-V4's 9.3e9;
# docs/PERFORMANCE.md "FP8 experts").
FP8_EXPERTS_FLOPS_PER_CAST = 3400


def fp8_experts_gain(hidden: float, expert_ffn: float, rows_per_expert: float) -> bool:
    """Whether the routed experts' rowwise FP8 grouped GEMMs (torchao's, mlite.runtime.kernels.grouped_gemm)
    beat bf16 with their casts, for experts of `hidden` x `expert_ffn` that each get `rows_per_expert` rows
    a micro-batch (`fp8_expert_rows`). Per expert, the three GEMMs of gate/up and of down (forward, input
    gradient, weight gradient) run 18 r H I flops; the casts pass over every operand in each layout those
    GEMMs read: 2 r (2H + 3I) activation and 6 H I weight elements. The weights' share does not shrink with
    the rows, so few rows an expert (many experts, short micro-batches) lose: on one H200 Qwen3-30B-A3B at
    4k tokens (r 256: 570 flops an element) took 27.5 ms of FP8 GEMMs and casts against 12.8 ms in bf16,
    and DeepSeek-V4's 4-layer bench model (32 experts, r 768: 1,600) 31.7 against 23.8 ms."""
    r, h, i = rows_per_expert, hidden, expert_ffn
    flops, cast = 18 * r * h * i, 2 * r * (2 * h + 3 * i) + 6 * h * i
    return flops >= FP8_EXPERTS_FLOPS_PER_CAST * cast


def fp8_expert_rows(layout: Layout, moe: MoEArch) -> float:
    """Rows one routed expert's grouped GEMM gets a micro-batch, on average: this rank's share of the
    micro-batch's tokens (split by cp, and by tp's sequence parallel), top_k copies of each, gathered from the
    ep x etp ranks that hold the expert."""
    tokens = layout.tokens_per_micro_batch / (layout.cp * layout.tp)
    return tokens * moe.top_k * layout.ep * layout.etp / moe.num_experts


def fp8_experts_on(job: JobConfig, arch: ModelArch, layout: Layout) -> bool:
    """Whether the routed experts' grouped GEMMs run in FP8 (rowwise under every precision.fp8 recipe):
    precision.fp8_linears all: yes; auto: where `fp8_experts_gain` on this layout's rows. The runtime
    (mlite.runtime.layout), the planner's FP8 operands and the bench's torchtitan side ask it alike."""
    if job.precision.fp8 == "none" or arch.moe is None:
        return False
    return job.precision.fp8_linears == "all" or fp8_experts_gain(
        arch.hidden, arch.moe.expert_ffn, fp8_expert_rows(layout, arch.moe))


def fp8_converts(recipe: str, linears: str, n_in: float, n_out: float) -> bool:
    """Whether precision.fp8 `recipe` runs an n_in -> n_out linear (one that tiles, not kept by name) in
    FP8, under precision.fp8_linears `linears`: all: every one; auto: those `fp8_linear_gains` picks. The
    runtime's conversion (mlite.runtime.adapters.torchao) and the planner's FP8 operands ask it alike."""
    if recipe == "none":
        return False
    return linears == "all" or fp8_linear_gains(recipe, n_in, n_out)


def check_fp8(job: JobConfig, arch: ModelArch, world_size: int, device_type: str) -> None:
    """precision.fp8 (FP8 matmuls through torchao, mlite.runtime.adapters.torchao) and its FSDP2 all-gather
    on this device and world, for this model; and rollout.match_fp8. The cluster's GPU type stands for the
    device here (a device in hand: `check_fp8_capability`). Under tensor parallel: `check_fp8_layout`, per
    layout."""
    check_match_fp8(job, arch)
    precision = job.precision
    recipe = precision.fp8
    if recipe == "none":
        return
    if device_type != "cuda" and not fp8_emulated():
        raise MliteError(
            f"precision.fp8: {recipe} multiplies on the FP8 tensor cores of GPUs, and this run is on the "
            "CPU; set precision.fp8: none, or run on GPUs"
        )
    capability = GPU_COMPUTE_CAPABILITY.get(job.cluster.gpu)
    if capability is not None:
        check_fp8_capability(job, arch, capability, f"cluster.gpu {job.cluster.gpu}")
    for what, width, tile in fp8_widths(arch, recipe):
        if width % tile:
            rowwise = all(w % t == 0 for _, w, t in fp8_widths(arch, "rowwise"))
            fix = ("use precision.fp8: rowwise (multiples of 16), or none" if rowwise
                   else "set precision.fp8: none")
            raise MliteError(
                f"precision.fp8: {recipe} needs every width of the linears it converts in multiples of "
                f"{tile} (the FP8 kernels' tiles), and {arch.name}'s {what} is {width}; {fix}"
            )
    if precision.fp8_all_gather is True:
        does = "precision.fp8_all_gather: true has FSDP2 all-gather its units' linear weights in FP8"
        if not backend_traits(job.optimizer.backend).fsdp_units:
            raise MliteError(
                f"{does}, and optimizer.backend is {job.optimizer.backend} (Megatron's distributed optimizer "
                "gathers its own bf16 buffers); use optimizer.backend fsdp2, or remove "
                "precision.fp8_all_gather"
            )
        if world_size == 1 and not job.parallel.fsdp_one_rank:
            raise MliteError(
                f"{does}, and one plain process has no FSDP2 units; start several ranks (torchrun), set "
                "parallel.fsdp_one_rank: true, or remove precision.fp8_all_gather"
            )


def fp8_min_capability(job: JobConfig, arch: ModelArch) -> tuple[tuple[int, int], str]:
    """The compute capability precision.fp8 needs with this model, and what needs it."""
    if job.precision.fp8 == "blockwise":
        return FP8_HOPPER, "torchao's blockwise FP8 linear"
    if arch.moe is not None:  # the routed experts' grouped GEMM takes torchao's rowwise FP8 one
        return FP8_HOPPER, f"torchao's FP8 grouped GEMM (for {arch.name}'s routed experts)"
    return FP8_CAPABILITY, "FP8 tensor cores"


def check_fp8_capability(job: JobConfig, arch: ModelArch, capability: tuple[int, int], gpu: str) -> None:
    """precision.fp8 on a GPU of this compute capability (`gpu` names it in the line: the job's
    cluster.gpu for the planner, the device itself at the runtime's start-up)."""
    if job.precision.fp8 == "none":
        return
    need, what = fp8_min_capability(job, arch)
    if tuple(capability) < need:
        raise MliteError(
            f"precision.fp8: {job.precision.fp8} needs {what}, compute capability {need[0]}.{need[1]} or "
            f"newer, and {gpu} has {capability[0]}.{capability[1]}; set precision.fp8: none, or run on GPUs "
            "that have it (H100 and newer)"
        )


def fp8_widths(arch: ModelArch, recipe: str) -> list[tuple[str, int, int]]:
    """(what, width, the multiple it must be) for every width of the linears precision.fp8 converts: the
    decoder's projections and dense / shared-expert MLPs in the recipe's tile (16; blockwise 128), the
    routed experts in 16 (their grouped GEMM is rowwise under every recipe). The embedding, the LM head,
    the norms and the router stay in the compute dtype, so their widths do not count. MLA (DeepSeek-V3)
    has no native model, which check_model_built refuses first."""
    tile = FP8_BLOCK if recipe == "blockwise" else FP8_TILE
    widths = [("hidden size", arch.hidden)]
    if arch.v4 is not None:
        v4, query = arch.v4, arch.num_heads * arch.head_dim
        widths += [("q_lora_rank", v4.q_lora_rank), ("query width (heads x head_dim)", query),
                   ("KV width (head_dim)", arch.head_dim),
                   ("output group width (heads x head_dim / o_groups)", query // v4.o_groups),
                   ("output rank (o_groups x o_lora_rank)", v4.o_groups * v4.o_lora_rank),
                   ("indexer width (index_n_heads x index_head_dim)", v4.index_n_heads * v4.index_head_dim)]
    elif arch.mla is None:
        widths += [("attention width (heads x head_dim)", arch.num_heads * arch.head_dim),
                   ("KV width (kv_heads x head_dim)", arch.num_kv_heads * arch.head_dim)]
    moe = arch.moe
    if moe is None or not all(moe.is_moe_layer(i) for i in range(arch.num_layers)):
        widths.append(("MLP width (intermediate_size)", arch.ffn))
    if moe is not None and moe.shared_expert_ffn:
        widths.append(("shared expert width", moe.shared_expert_ffn))
    checked = [(what, width, tile) for what, width in widths]
    if moe is not None:
        checked.append(("routed expert width (moe_intermediate_size)", moe.expert_ffn, FP8_TILE))
    return checked


def check_fp8_layout(job: JobConfig) -> None:
    """precision.fp8 under tensor parallel: torchao's FP8 linears need its own tensor-parallel plans
    (Float8ColwiseParallel / Float8RowwiseParallel), which mlite's tensor parallel does not use."""
    p = job.parallel
    if job.precision.fp8 != "none" and p.tp > 1:
        raise MliteError(
            f"precision.fp8: {job.precision.fp8} with tp={p.tp}: torchao's FP8 linears need their own "
            "tensor-parallel plans, which mlite's tensor parallel does not use; set parallel.tp: 1 (scale "
            "with dp, cp, pp and ep), or precision.fp8: none"
        )


def check_match_fp8(job: JobConfig, arch: ModelArch) -> None:
    """rollout.match_fp8: the trainer rounds what DeepSeek-V4's vLLM engine multiplies in FP8."""
    r = job.rollout
    if r is None or not r.match_fp8:
        return
    if r.engine != "vllm" or arch.v4 is None:
        what = "rolls out on the built-in engine" if r.engine != "vllm" else f"trains {arch.name}"
        raise MliteError(
            "rollout.match_fp8: true rounds the trainer's forward through the linears that DeepSeek-V4's "
            "vLLM engine multiplies in FP8 (128x128 weight blocks, 1x128 activation tiles), so that its "
            f"log-probs are those of the model the sampler ran, and this job {what}; remove rollout.match_fp8"
        )
    if job.precision.fp8 != "none":
        raise MliteError(
            f"rollout.match_fp8 rounds the forward as vLLM does, and precision.fp8: {job.precision.fp8} "
            "multiplies in FP8 its own way; choose one (remove rollout.match_fp8 or set precision.fp8: none)"
        )


def check_fsdp_one_rank(job: JobConfig, world_size: int) -> None:
    """parallel.fsdp_one_rank: FSDP2 over a one-rank mesh, for one process only."""
    if not job.parallel.fsdp_one_rank:
        return
    if world_size > 1:
        raise MliteError(
            f"parallel.fsdp_one_rank applies to one process, and this job has {world_size} ranks (which "
            "shard with FSDP2 already); remove parallel.fsdp_one_rank"
        )
    if not backend_traits(job.optimizer.backend).fsdp_units:
        raise MliteError(
            f"parallel.fsdp_one_rank shards with FSDP2, and optimizer.backend is {job.optimizer.backend}; "
            "use optimizer.backend fsdp2, or remove parallel.fsdp_one_rank"
        )


def check_fsdp_units(job: JobConfig, world_size: int) -> None:
    """parallel.fsdp_unit_layers, fsdp_reshard_after_forward, fsdp_forward_prefetch and
    fsdp_grad_accumulation shape FSDP2's units, so each needs them (FSDP2 over several ranks, or
    fsdp_one_rank) wherever it is set away from its default; `auto` resolves to what holds without them
    (mlite.plan.memory)."""
    par = job.parallel
    keys = [("fsdp_unit_layers", par.fsdp_unit_layers, "groups FSDP2's units", (1, "auto")),
            ("fsdp_reshard_after_forward", par.fsdp_reshard_after_forward,
             "keeps FSDP2's units gathered from forward to backward", (True, "auto")),
            ("fsdp_forward_prefetch", par.fsdp_forward_prefetch,
             "sets how FSDP2 prefetches its units in the forward", (True,)),
            ("fsdp_grad_accumulation", par.fsdp_grad_accumulation,
             "chooses how FSDP2 accumulates gradients", ("auto",)),
            ("fsdp_embedding", par.fsdp_embedding, "keeps the embedding sharded by vocabulary rows",
             ("gathered",))]
    for key, value, does, defaults in keys:
        if value in defaults:
            continue
        shown = str(value).lower() if isinstance(value, bool) else value
        if not backend_traits(job.optimizer.backend).fsdp_units:
            raise MliteError(
                f"parallel.{key}: {shown} {does}, and optimizer.backend is {job.optimizer.backend} (Megatron "
                f"DDP has none); use optimizer.backend fsdp2, or remove parallel.{key}"
            )
        if world_size == 1 and not par.fsdp_one_rank:
            raise MliteError(
                f"parallel.{key}: {shown} {does}, and one plain process has none; start several ranks "
                f"(torchrun), set parallel.fsdp_one_rank: true, or remove parallel.{key}"
            )
    off = job.offload
    if par.fsdp_reshard_after_forward is False and (off.params or off.grads or off.optimizer):
        raise MliteError(
            "parallel.fsdp_reshard_after_forward: false keeps every gathered layer on the GPU, the memory "
            "offload.* is there to save; remove one of them"
        )


def check_fsdp_embedding(job: JobConfig, arch: ModelArch) -> None:
    """parallel.fsdp_embedding rows: the model's embedding kept sharded by vocabulary rows over dp_cp
    (mlite.runtime.parallel.parallelize.shard_embedding_rows); FSDP2 itself is `check_fsdp_units`' rule."""
    par, off = job.parallel, job.offload
    if par.fsdp_embedding != "rows":
        return
    if arch.tie_embeddings:
        raise MliteError(
            f"parallel.fsdp_embedding: rows keeps the embedding sharded by rows, and {arch.name} ties it to "
            "the LM head, which reads the whole matrix; use parallel.fsdp_embedding: gathered"
        )
    if par.tp > 1:
        raise MliteError(
            f"parallel.fsdp_embedding: rows shards the embedding over the data ranks, and tp={par.tp} "
            "already splits it by vocabulary over tp; use parallel.fsdp_embedding: gathered"
        )
    if off.optimizer and off.optimizer_fraction >= 1.0:
        raise MliteError(
            "parallel.fsdp_embedding: rows keeps the embedding's shard and its optimizer state on the GPU, "
            "and offload.optimizer_fraction 1.0 moves everything to the host; use parallel.fsdp_embedding: "
            "gathered, or a lower fraction"
        )


def check_expert_buffers(job: JobConfig, arch: ModelArch) -> None:
    """parallel.expert_buffers worst_case sizes the all-gather exchange's pair buffers: it needs that
    exchange, so a MoE model under ep > 1 with ep <= top_k (policy.expert_exchange)."""
    if job.parallel.expert_buffers != "worst_case":
        return
    ep = job.parallel.ep
    if arch.moe is None or ep == 1:
        raise MliteError("parallel.expert_buffers: worst_case sizes the expert exchange's buffers, and "
                         f"{'this model has no routed experts' if arch.moe is None else 'parallel.ep is 1'}; "
                         "remove it, or set parallel.ep above 1 on a MoE model")
    if expert_exchange(ep, arch.moe.top_k) != "all_gather":
        raise MliteError(f"parallel.expert_buffers: worst_case sizes the all-gather exchange's buffers, and "
                         f"ep={ep} above top_k={arch.moe.top_k} exchanges pairs by all-to-all, whose split "
                         f"sizes are read on the host; set parallel.ep to {arch.moe.top_k} or less, or "
                         "parallel.expert_buffers: exact")


def check_overlaps(job: JobConfig) -> None:
    """optimizer.overlap_grad_reduce and overlap_param_gather switch dist_opt's overlaps; FSDP2
    reduce-scatters each unit as its backward ends and prefetches the next unit's all-gather, always."""
    for key, what in (("overlap_grad_reduce", "reduce-scatter always overlaps the backward"),
                      ("overlap_param_gather", "all-gather always overlaps the forward")):
        if not getattr(job.optimizer, key) and not backend_traits(job.optimizer.backend).switchable_overlaps:
            raise MliteError(
                f"optimizer.{key}: false turns off dist_opt's overlap, and optimizer.backend is "
                f"{job.optimizer.backend}, whose {what}; remove optimizer.{key}, or use optimizer.backend "
                "dist_opt"
            )


def check_offload(job: JobConfig, world_size: int, device_type: str) -> None:
    offload = job.offload
    if not (offload.params or offload.grads or offload.optimizer):
        return
    if device_type != "cuda":
        raise MliteError(
            "offload.* moves GPU state to host memory, but this run is on the CPU; remove offload"
        )
    if world_size == 1 and not job.parallel.fsdp_one_rank:
        raise MliteError(
            "offload.* runs through FSDP2's CPUOffloadPolicy, which needs FSDP2; start several ranks "
            "with torchrun, set parallel.fsdp_one_rank: true on one GPU, or remove offload"
        )
    everything = offload.params and offload.grads and offload.optimizer and offload.optimizer_fraction == 1.0
    if (offload.params or offload.grads) and not everything:
        raise MliteError(
            "offload.params / offload.grads: FSDP2 moves a unit's parameters, gradients and optimizer "
            "state to the host together; set all three (optimizer_fraction 1.0), or offload.optimizer "
            "alone with a fraction (those layers' parameters and gradients move with their optimizer state)"
        )


def check_rollout_engine(job: JobConfig, world_size: int, device_type: str) -> None:
    """Where the vLLM rollout runs: colocated on the job's GPUs, world / rollout.tp engines of rollout.tp
    ranks each (check_rollout: rollout.tp divides the world and splits the model as vLLM does). Whether
    vLLM is installed is the trainers' start-up check (`mlite.trainers.grpo.vllm_rollout.require_vllm`):
    the planner may run where the job will not."""
    if job.rollout is None or job.rollout.engine != "vllm":
        return
    if device_type != "cuda":
        raise MliteError(
            "rollout.engine vllm generates on CUDA GPUs and this job runs on the CPU; use rollout.engine "
            "builtin, or run on GPUs"
        )
