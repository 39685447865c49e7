"""Check a job's parallel layout against its model and cluster; derive what follows (dp, edp, stage layers).

Everything here raises `MliteError` with one line: what is wrong and what would fix it. The rules are those
written in docs/PLANNER.md ("Validation" and "Backend support matrix"); `SUPPORT` below is that matrix.

Rank folding (as in mlite.runtime.parallel.mesh): world = pp x dp x cp x tp, and on the dp x cp x tp ranks of
each pipeline stage the experts fold as edp x ep x etp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mlite.config.arch import ModelArch
from mlite.config.schema import JobConfig
from mlite.errors import MliteError

# Backend support matrix: feature -> backends that run it. docs/PLANNER.md prints the same table.
SUPPORT: dict[str, tuple[str, ...]] = {
    "cpu (gloo) device": ("fsdp2",),
    "tp + sequence parallel": ("fsdp2", "dist_opt"),
    "pp (1F1B)": ("fsdp2", "dist_opt"),
    "vpp (interleaved 1F1B)": ("fsdp2", "dist_opt"),
    "cp (zigzag ring attention)": ("fsdp2", "dist_opt"),
    "ep": ("fsdp2", "dist_opt"),
    "etp > 1": ("dist_opt",),
    "offload.params": ("fsdp2",),
    "offload.grads": ("fsdp2",),
    "offload.optimizer (+ fraction)": ("fsdp2", "dist_opt"),
    "precision.compute fp16": ("dist_opt",),
}


def runtime_notes(job: JobConfig) -> list[str]:
    """What the plan sizes but the bundled trainers do not run yet. SUPPORT is what each backend's design
    carries and the memory model sizes it; the runtime refuses the rest in one line at start-up."""
    if job.optimizer.backend != "dist_opt":
        return []
    p, o = job.parallel, job.offload
    beyond = [f"{k}={v}" for k, v in (("tp", p.tp), ("pp", p.pp), ("vpp", p.vpp), ("ep", p.ep), ("etp", p.etp))
              if v > 1]
    beyond += [f"offload.{k}" for k in ("params", "grads", "optimizer") if getattr(o, k)]
    beyond += ["precision.compute fp16"] if job.precision.compute == "fp16" else []
    adapter = "dp x cp only" + (f" (not this job's {', '.join(beyond)})" if beyond else "")
    return [f"optimizer.backend dist_opt is planned, not trained, by mlite so far: its Megatron-Core adapter "
            f"runs {adapter} and has no checkpoints, so the trainers refuse it at start-up; to train this "
            "layout with mlite set optimizer.backend fsdp2 (docs/PARALLEL.md)"]


# Model families whose attention mlite does not split by tensor parallel.
NO_TP_MODELS = {"deepseek_v4": "its one shared KV head and grouped low-rank output projection are not split by tp"}


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
    stage_layers: tuple[tuple[int, ...], ...]  # per pipeline rank: layer indices it holds (all its chunks)
    micro_batches: int  # micro-batches per optimizer step per data-parallel rank (worst case: long samples)
    tokens_per_micro_batch: int  # before cp splits it
    split: int  # every sequence length must be a multiple of this (SP x CP chunks)

    def describe(self) -> str:
        text = f"tp{self.tp} pp{self.pp} cp{self.cp} dp{self.dp} ep{self.ep}"
        if self.vpp > 1:
            text += f" vpp{self.vpp}"
        if self.etp > 1:
            text += f" etp{self.etp}"
        return text


def _needs(feature: str, backend: str) -> None:
    allowed = SUPPORT[feature]
    if backend not in allowed:
        raise MliteError(
            f"{feature} is not supported by optimizer.backend '{backend}' (supported by: {', '.join(allowed)}); "
            f"switch optimizer.backend to {allowed[0]} or drop {feature} (docs/PLANNER.md, backend matrix)"
        )


def check_backend(job: JobConfig) -> None:
    p, backend = job.parallel, job.optimizer.backend
    used = {
        "cpu (gloo) device": job.cluster.gpu == "cpu" or job.trainer.device == "cpu",
        "tp + sequence parallel": p.tp > 1,
        "pp (1F1B)": p.pp > 1 and p.vpp == 1,
        "vpp (interleaved 1F1B)": p.vpp > 1,
        "cp (zigzag ring attention)": p.cp > 1,
        "ep": p.ep > 1,
        "etp > 1": p.etp > 1,
        "offload.params": job.offload.params,
        "offload.grads": job.offload.grads,
        "offload.optimizer (+ fraction)": job.offload.optimizer,
        "precision.compute fp16": job.precision.compute == "fp16",
    }
    for feature, on in used.items():
        if on:
            _needs(feature, backend)


def split_stages(layers: int, pp: int, vpp: int, first: int | None, last: int | None) -> list[int]:
    """Layers per pipeline rank. Without explicit first/last stage counts the layers split evenly over
    pp x vpp chunks; with them, the middle stages share the rest evenly."""
    if pp > layers:
        raise MliteError(f"parallel.pp={pp} exceeds the model's {layers} layers; use at most {layers} stages")
    if first is None and last is None:
        if layers % (pp * vpp):
            hint = suggest_first_last(layers, pp) if vpp == 1 else f"choose pp x vpp dividing {layers}"
            raise MliteError(f"the model's {layers} layers do not split evenly over pp x vpp = {pp * vpp} "
                             f"chunks; {hint}")
        return [layers // pp] * pp
    if vpp > 1:
        raise MliteError("pp_first_stage_layers / pp_last_stage_layers need vpp = 1 (interleaved stages are "
                         "split evenly); remove parallel.vpp or the explicit stage sizes")
    fixed = (first or 0) + (last or 0)
    middle_stages = pp - (first is not None) - (last is not None)
    rest = layers - fixed
    if rest < 0 or (middle_stages == 0 and rest != 0):
        raise MliteError(f"pp_first_stage_layers + pp_last_stage_layers = {fixed} does not fit the model's "
                         f"{layers} layers over pp={pp}; {suggest_first_last(layers, pp)}")
    if middle_stages and (rest % middle_stages or rest // middle_stages == 0):
        raise MliteError(f"after the explicit first/last stages, {rest} layers do not split evenly (and at least "
                         f"one each) over the other {middle_stages} stages; {suggest_first_last(layers, pp)}")
    each = rest // middle_stages if middle_stages else 0
    sizes = [each] * pp
    if first is not None:
        sizes[0] = first
    if last is not None:
        sizes[-1] = last
    return sizes


def balanced_first_last(layers: int, pp: int) -> tuple[int, int]:
    """Stage sizes for layers that pp does not divide: middle stages of ceil(L/pp) layers (fewer if that would
    leave first and last nothing), the rest shared by first and last, the last (which holds the head) no larger."""
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


def check_layout(job: JobConfig, arch: ModelArch) -> Layout:
    p, c = job.parallel, job.cluster
    world = c.world_size
    degrees = f"tp={p.tp} pp={p.pp} cp={p.cp} ep={p.ep} etp={p.etp}, world={world}"
    if world % (p.pp * p.cp * p.tp):
        raise MliteError(
            f"world size {world} ({c.nodes} nodes x {c.gpus_per_node} GPUs) is not divisible by pp x cp x tp = "
            f"{p.pp * p.cp * p.tp}, so dp = world / (pp x cp x tp) is not whole ({degrees}); pick degrees whose "
            f"product divides {world}"
        )
    dp = world // (p.pp * p.cp * p.tp)
    stage_ranks = dp * p.cp * p.tp
    if stage_ranks % (p.ep * p.etp):
        raise MliteError(
            f"ep x etp = {p.ep * p.etp} must divide dp x cp x tp = {stage_ranks}, the ranks of one pipeline "
            f"stage that experts fold over ({degrees}); choose ep x etp dividing {stage_ranks}"
        )
    edp = stage_ranks // (p.ep * p.etp)

    check_backend(job)
    _check_model_split(job, arch)
    sizes = split_stages(arch.num_layers, p.pp, p.vpp, p.pp_first_stage_layers, p.pp_last_stage_layers)
    stage_layers = _assign_layers(sizes, p.pp, p.vpp)
    split = _check_sequence_split(job, arch)
    micro_batches, tokens = _check_batches(job, arch, dp)
    _check_recompute(job, sizes, p.vpp)
    _check_rollout(job, arch)
    return Layout(world=world, tp=p.tp, pp=p.pp, vpp=p.vpp, cp=p.cp, dp=dp, ep=p.ep, etp=p.etp, edp=edp,
                  sequence_parallel=bool(p.sequence_parallel), stage_layers=stage_layers,
                  micro_batches=micro_batches, tokens_per_micro_batch=tokens, split=split)


def _assign_layers(sizes: list[int], pp: int, vpp: int) -> tuple[tuple[int, ...], ...]:
    """Layer indices per pipeline rank; with vpp the model is cut into pp x vpp chunks dealt round-robin."""
    if vpp == 1:
        starts = [sum(sizes[:r]) for r in range(pp)]
        return tuple(tuple(range(starts[r], starts[r] + sizes[r])) for r in range(pp))
    chunk = sum(sizes) // (pp * vpp)
    return tuple(tuple(i for v in range(vpp) for i in range((v * pp + r) * chunk, (v * pp + r + 1) * chunk))
                 for r in range(pp))


def _check_model_split(job: JobConfig, arch: ModelArch) -> None:
    p = job.parallel
    if p.tp > 1 and arch.model_type in NO_TP_MODELS:
        raise MliteError(f"{arch.name} runs with tp=1 only: {NO_TP_MODELS[arch.model_type]}; set parallel.tp=1 "
                         "and scale with ep, cp, pp and dp")
    if arch.num_heads % p.tp:
        raise MliteError(f"{arch.name} has {arch.num_heads} attention heads, not divisible by tp={p.tp}; "
                         f"use a tp dividing {arch.num_heads}")
    if arch.mla is None and arch.num_kv_heads % p.tp:
        raise MliteError(f"{arch.name} has {arch.num_kv_heads} KV heads, not divisible by tp={p.tp}; "
                         f"use a tp dividing {arch.num_kv_heads}")
    if arch.ffn and arch.ffn % p.tp:
        raise MliteError(f"{arch.name}'s MLP width {arch.ffn} is not divisible by tp={p.tp}; use another tp")
    if arch.moe is None:
        if p.ep > 1 or p.etp > 1:
            raise MliteError(f"{arch.name} is dense (no experts): parallel.ep and parallel.etp must be 1")
        return
    if arch.moe.num_experts % p.ep:
        raise MliteError(f"{arch.name} has {arch.moe.num_experts} routed experts, not divisible by ep={p.ep}; "
                         f"use an ep dividing {arch.moe.num_experts}")
    if arch.moe.expert_ffn % p.etp:
        raise MliteError(f"{arch.name}'s expert width {arch.moe.expert_ffn} is not divisible by etp={p.etp}")
    if arch.moe.shared_expert_ffn % p.tp:
        raise MliteError(f"{arch.name}'s shared expert width {arch.moe.shared_expert_ffn} is not divisible by "
                         f"tp={p.tp}")


def _check_sequence_split(job: JobConfig, arch: ModelArch) -> int:
    """Sequence parallel splits every packed micro-batch over tp ranks; context parallel cuts its token stream
    into 2 x cp chunks (zigzag: rank i takes chunks i and 2cp-1-i, balancing causal work). Lengths must split
    evenly: an uneven split is refused here rather than failing inside a collective later."""
    p, d = job.parallel, job.data
    split = p.tp if p.sequence_parallel else 1
    why = [f"sequence parallel (tp={p.tp})"] if split > 1 else []
    if p.cp > 1:
        chunk = 1
        if arch.v4 is not None:  # a compressed row must not straddle two ranks' chunks
            chunk = max(arch.v4.compress_ratios)
            why.append(f"DeepSeek-V4 compression blocks of {chunk} tokens per chunk")
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
            raise MliteError(f"{key}={value} cannot be split evenly by {' and '.join(why)}: it must be a multiple "
                             f"of {split}; use {lower or upper} or {upper}")
    return split


def _check_batches(job: JobConfig, arch: ModelArch, dp: int) -> tuple[int, int]:
    d, p = job.data, job.parallel
    if d.global_batch_size % dp:
        raise MliteError(f"data.global_batch_size={d.global_batch_size} is not divisible by dp={dp} data-parallel "
                         f"ranks; use a multiple of {dp}")
    per_rank = d.global_batch_size // dp
    if d.dynamic_batch:
        tokens = d.max_tokens_per_micro_batch
        micro = max(1, math.ceil(per_rank * d.seq_len / tokens))  # worst case: every sample is seq_len long
    else:
        if per_rank % d.micro_batch_size:
            raise MliteError(f"data.global_batch_size={d.global_batch_size} is not divisible by dp x "
                             f"micro_batch_size = {dp * d.micro_batch_size}; use a multiple of it")
        tokens = d.micro_batch_size * d.seq_len
        micro = per_rank // d.micro_batch_size
    if p.vpp > 1 and micro % p.pp:
        raise MliteError(f"interleaved pipeline (vpp={p.vpp}) needs micro-batches per step ({micro}) divisible by "
                         f"pp={p.pp}; raise data.global_batch_size to a multiple of {dp * p.pp} x the micro-batch")
    if d.seq_len > arch.max_position_embeddings:
        raise MliteError(f"data.seq_len={d.seq_len} exceeds {arch.name}'s max_position_embeddings="
                         f"{arch.max_position_embeddings}; lower data.seq_len")
    return micro, tokens


def _check_recompute(job: JobConfig, stage_sizes: list[int], vpp: int) -> None:
    r = job.recompute
    if r.granularity != "full":
        return
    per_chunk = min(size for size in stage_sizes if size) // vpp  # a stage may hold 0 layers (head only)
    if r.num_layers > max(1, per_chunk):
        raise MliteError(f"recompute.num_layers={r.num_layers} exceeds the {per_chunk} layers of a pipeline chunk; "
                         f"use at most {max(1, per_chunk)}")


def _check_rollout(job: JobConfig, arch: ModelArch) -> None:
    if job.rollout is None:
        return
    r = job.rollout
    if job.cluster.world_size % r.tp:
        raise MliteError(f"rollout.tp={r.tp} does not divide the world size {job.cluster.world_size}")
    if r.tp > 1 and r.engine == "builtin":
        raise MliteError("rollout.tp > 1 needs rollout.engine: vllm (the builtin engine generates on the training "
                         "layout); set rollout.tp=1 or switch the engine")
    if arch.num_heads % r.tp:
        raise MliteError(f"rollout.tp={r.tp} does not divide {arch.name}'s {arch.num_heads} attention heads")
    needed = r.max_prompt_length + r.max_response_length
    if needed > job.data.seq_len:
        raise MliteError(f"rollout.max_prompt_length + max_response_length = {needed} exceeds data.seq_len="
                         f"{job.data.seq_len}, the longest sequence training accepts; raise data.seq_len to {needed}")
