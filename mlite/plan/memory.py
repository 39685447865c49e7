"""Memory per GPU and per node for a checked layout, itemised so that each item can be set against a measured
peak (`mlite bench` prints this estimate next to `torch.cuda.max_memory_allocated`).

The formulas are written out in docs/PLANNER.md ("Memory model"); the constants below are the knobs a
calibration against measured peaks adjusts. Sizes are GiB (2**30 bytes), as `nvidia-smi` and torch report.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from mlite.config.arch import V4_CSA, V4_DENSE_ENTRIES_PER_PICK, V4_KEY_SET_LOGITS, ModelArch
from mlite.config.backends import backend_traits
from mlite.config.catalog import count_params, embedding_params, final_params, layer_params
from mlite.config.schema import JobConfig
from mlite.plan.policy import (
    SYNC_BUCKET_BYTES,
    expert_exchange,
    expert_pair_rows,
    experts_outside_fsdp,
    fp8_all_gather,
    fsdp_units,
    grad_reduce_dtype,
    rollout_expert_parallel,
    vllm_fp8_misfit,
    vllm_weight_bytes,
)
from mlite.plan.rules import Layout, fp8_converts, fp8_experts_on, planned_device_type

GIB = 2**30
HEADROOM = 0.90  # an estimate above this share of device (or host) memory does not fit
# One process's CUDA context and handles, workspaces and the caching allocator's slack: on H200s every bench
# case held 0.74-0.76 GB outside the allocator, and a dense case's reservation up to 0.9 GB above its
# allocated peak (docs/PERFORMANCE.md, "Planner calibration")
GPU_CONTEXT_GB = 1.5
# with peers (a world of several ranks): NCCL's communicators and buffers besides (fitted with the multi-GPU
# bench runs)
NCCL_BUFFERS_GB = 2.5
CPU_OVERHEAD_GB = 1.0  # torch + Python per process when the "GPU" is the host (gloo runs)
# per training process on the host: Python, CUDA host state, pinned buffers, data
HOST_OVERHEAD_PER_RANK_GB = 8.0
MOE_IMBALANCE = 1.0  # routed tokens a rank receives, relative to a perfectly balanced router
# Under ep > 1 the all-to-all's buffers change size with every layer and step (a rank receives what the router
# sends it), and the caching allocator keeps blocks of each size it has seen: about as much again as the
# routed token copies themselves. Fitted on the MoE bench case at ep2 and ep4 on H100s (docs/PERFORMANCE.md,
# "Planner calibration"), where the footprint held 3.3-3.4 GB more above its allocated peak than the dense
# case's and the allocated peak 1-3 GB more than the routed copies alone.
EP_EXCHANGE_SLACK = 1.0
# Without ep, the caching allocator still reserves about as much again as the routed token copies around
# them: on one H200 the reservation exceeded the allocated peak by 2.0 GB on the MoE bench case (2.3 GB of
# routed copies) and by 3.5 GB on the DeepSeek-V4 one (2.6 GB), against at most 0.9 GB on the dense cases
# (docs/PERFORMANCE.md, "Planner calibration")
ROUTED_BUFFER_SLACK = 1.0
LOGIT_CHUNK_TOKENS = 4096  # mlite.runtime.kernels.lm_head works on this many tokens' logits at a time
# per logit of a chunk beyond its compute-dtype copy: the compute-dtype d logits (fused path)
LOGIT_GRAD_BYTES = 2
# the chunked autograd path GRPO's update takes (it computes each token's entropy, for its metric and any
# entropy bonus): fp32 logits, log-softmax, its exp and their gradients, recomputed a chunk at a time.
# Measured on one H200 (2026-11-29, torch 2.11, Qwen3-1.7B and 8B shapes, 1,536-token micro-batches): 24.5-27
# bytes per logit above the fused path's
LOGIT_ENTROPY_EXTRA_BYTES = 26
FSDP_PREFETCH_LAYERS = 2  # FSDP2 holds the current layer and the prefetched next one unsharded
# parallel.fsdp_unit_layers `auto`: FSDP2's host work is per unit (1.4-1.6 ms on an H100 host), so a unit of
# one small layer leaves the host behind its GPU: dense 1.7B over dp4 took 199 ms a step with units of one
# layer (100 MB gathered), 137-172 ms with four (docs/PERFORMANCE.md). Units aim for this many gathered
# bytes, of at most AUTO_UNIT_MAX_LAYERS layers (the most measured), and fewer where the plan would not fit.
AUTO_UNIT_BYTES = 512 * 2**20
AUTO_UNIT_MAX_LAYERS = 4
# parallel.fsdp_reshard_after_forward `auto`: units stay gathered from forward to backward only where that
# estimate fits with the planner's calibration bound to spare (within 15% of measured peaks:
# tests/test_bench.py), since a run that no longer fits would only find out at its first step
KEEP_GATHERED_MARGIN = 1.15
# parallel.expert_buffers `auto`: worst-case pair buffers where they hold at most this many times a balanced
# router's pairs. Measured at 2 (ep2 with Qwen3's top-8 on 2 x H200: 97% of two GPUs against exact's 73%,
# docs/PERFORMANCE.md); above it the padding rows that every gather and sum of the exchange passes over grow
# with ep (4x at ep4, 8x at ep8), unmeasured, so there `exact` stays unless the job asks
AUTO_WORST_CASE_MAX_PAIRS = 2.0
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# precision.fp8: an FP8 element, and what one fp32 scale covers (blockwise: 1x128 activation tiles, 128x128
# weight blocks; the routed experts' grouped GEMM is rowwise under every recipe)
FP8_BYTES = 1
FP8_BLOCK = 128


# the rollout item that says vLLM's weights exceed its share of the GPU (no total makes that fit)
VLLM_SHORT = "vLLM weights beyond its share"
# of vLLM's share, what its forward's activations and sampler take at the profile run, beside the weights
# and the KV cache (about 1-2 GB at a few thousand batched tokens)
VLLM_WORKSPACE_GB = 2.0


@dataclass(frozen=True)
class MemoryItem:
    name: str
    gb: float
    note: str = ""


@dataclass
class MemoryEstimate:
    stage: int  # pipeline rank the items describe: the one with the largest total
    items: list[MemoryItem]  # per GPU, training step
    capacity_gb: float  # per GPU (on CPU: host memory per rank)
    host_items: list[MemoryItem]  # per node
    host_capacity_gb: float
    stage_totals_gb: list[float]  # per pipeline rank
    rollout_items: list[MemoryItem] = field(default_factory=list)  # per GPU, GRPO generation phase
    # per GPU, vLLM's weight sync: its weights woken beside what the trainer keeps while it streams them
    sync_items: list[MemoryItem] = field(default_factory=list)
    # whether the trainer waits on the host while vLLM generates (rollout.offload_trainer, `auto` resolved
    # here); None without a vLLM rollout
    offload_trainer: bool | None = None
    # whether a DeepSeek-V4 vLLM engine holds its linears and experts in FP8 (rollout.fp8_weights, `auto`
    # resolved here); None without a vLLM rollout
    rollout_fp8_weights: bool | None = None
    notes: list[str] = field(default_factory=list)
    # how FSDP2 accumulates a step of several micro-batches (parallel.fsdp_grad_accumulation, `auto`
    # resolved here); None where no FSDP2 shards are accumulated into (one micro-batch, dist_opt)
    fsdp_grad_accumulation: str | None = None
    # consecutive layers an FSDP2 unit gathers (parallel.fsdp_unit_layers, `auto` resolved here)
    fsdp_unit_layers: int = 1
    # whether FSDP2 frees a unit's gathered weights after its forward (parallel.fsdp_reshard_after_forward,
    # `auto` resolved here); True where there are no FSDP2 units
    fsdp_reshard_after_forward: bool = True
    # whether FSDP2 all-gathers the FP8 linears' weights in FP8 (precision.fp8_all_gather, `auto` resolved by
    # mlite.plan.policy.fp8_all_gather on this layout)
    fp8_all_gather: bool = False
    # how the all-gather expert exchange sizes its pair buffers (parallel.expert_buffers, `auto` resolved
    # here: `worst_case` or `exact`); `auto` where no all-gather exchange runs
    expert_buffers: str = "auto"

    @property
    def train_gb(self) -> float:
        return sum(i.gb for i in self.items)

    @property
    def rollout_gb(self) -> float:
        return sum(i.gb for i in self.rollout_items)

    @property
    def sync_gb(self) -> float:
        return sum(i.gb for i in self.sync_items)

    @property
    def total_gb(self) -> float:
        """Peak per GPU: the largest of the training step, the weight sync and the rollout phase."""
        return max(self.train_gb, self.rollout_gb, self.sync_gb)

    @property
    def usable_gb(self) -> float:
        return self.capacity_gb * HEADROOM

    @property
    def host_total_gb(self) -> float:
        return sum(i.gb for i in self.host_items)

    @property
    def fits(self) -> bool:
        # vLLM never grows past its share: weights beyond it fail its start, whatever else is free
        short = any(i.name == VLLM_SHORT for i in self.rollout_items)
        return (self.total_gb <= self.usable_gb and self.host_total_gb <= self.host_capacity_gb * HEADROOM
                and not short)

    def as_dict(self) -> dict:
        return {
            "stage": self.stage, "fits": self.fits, "total_gb": self.total_gb, "train_gb": self.train_gb,
            "rollout_gb": self.rollout_gb, "sync_gb": self.sync_gb, "offload_trainer": self.offload_trainer,
            "rollout_fp8_weights": self.rollout_fp8_weights,
            "capacity_gb": self.capacity_gb, "usable_gb": self.usable_gb,
            "host_total_gb": self.host_total_gb, "host_capacity_gb": self.host_capacity_gb,
            "items": [asdict(i) for i in self.items],
            "rollout_items": [asdict(i) for i in self.rollout_items],
            "sync_items": [asdict(i) for i in self.sync_items],
            "host_items": [asdict(i) for i in self.host_items], "stage_totals_gb": self.stage_totals_gb,
            "notes": self.notes, "fsdp_grad_accumulation": self.fsdp_grad_accumulation,
            "fsdp_unit_layers": self.fsdp_unit_layers,
            "fsdp_reshard_after_forward": self.fsdp_reshard_after_forward,
            "fp8_all_gather": self.fp8_all_gather, "expert_buffers": self.expert_buffers,
        }


# ------------------------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class StageParams:
    """Parameters one GPU of a pipeline stage holds, after tp and ep x etp split them."""

    dense: float  # sharded by fsdp2 / dist_opt over dp x cp
    experts: float  # sharded over edp
    largest_unit: float  # largest FSDP2 unit on this GPU (parallel.fsdp_unit_layers layers, embedding, head)
    # the decoder's linear weights (attention, dense / shared-expert MLP): what precision.fp8_all_gather
    # gathers in FP8 (the routed experts' weights gather in the compute dtype: torchao's grouped-GEMM
    # weights have no FP8 all-gather)
    linears: float = 0.0
    # the largest unit as FP8's all-gather gathers it, in compute-dtype (bf16) parameters: its linears count
    # half (1 byte of 2)
    largest_unit_fp8: float = 0.0


def stage_params(arch: ModelArch, layout: Layout, stage: int, unit_layers: int = 1,
                 experts_gathered: bool = True) -> StageParams:
    """This stage's parameters per GPU; `unit_layers`: consecutive layers FSDP2 gathers as one unit;
    `experts_gathered` False: the routed experts are in no unit (policy.experts_outside_fsdp)."""
    dense = experts = linears = 0.0
    per_layer, per_layer_fp8 = [], []
    for i in layout.stage_layers[stage]:
        d, e = _layer_params_per_gpu(arch, layout, i)
        lin = _layer_linears_per_gpu(arch, layout, i)
        dense, experts, linears = dense + d, experts + e, linears + lin
        gathered = d + (e if experts_gathered else 0.0)
        per_layer.append(gathered)
        per_layer_fp8.append(gathered - lin * (1 - FP8_BYTES / 2))
    largest, largest_fp8 = (max((sum(sizes[k : k + unit_layers]) for k in range(len(sizes))), default=0.0)
                            for sizes in (per_layer, per_layer_fp8))
    table = arch.vocab * arch.hidden / layout.tp  # vocab-parallel embedding / head
    if stage == 0:
        dense += table
        largest, largest_fp8 = max(largest, table), max(largest_fp8, table)
    if stage == layout.pp - 1:
        # tied: a copy with pp > 1
        head = embedding_params(arch) / layout.tp - table if layout.pp == 1 else table
        dense += head + final_params(arch)
        largest, largest_fp8 = max(largest, table), max(largest_fp8, table)
    return StageParams(dense, experts, largest, linears, largest_fp8)


def _layer_params_per_gpu(arch: ModelArch, layout: Layout, layer: int) -> tuple[float, float]:
    """(dense, expert) parameters of one layer that a GPU computes with, after the tp and ep x etp splits."""
    lp = layer_params(arch, layer)
    return (lp.attention + lp.mlp) / layout.tp + lp.replicated, lp.experts / (layout.ep * layout.etp)


def _layer_linears_per_gpu(arch: ModelArch, layout: Layout, layer: int) -> float:
    """The linear weights of one layer a GPU computes with (attention and dense / shared-expert MLP)."""
    lp = layer_params(arch, layer)
    return (lp.attention + lp.mlp) / layout.tp


# ------------------------------------------------------------------------------------------ activations
def layer_activation_bytes(arch: ModelArch, layer: int, act: int, granularity: str,
                           seq_len: int) -> tuple[float, float]:
    """Bytes per token one layer keeps for backward, before tp splits them: (attention + dense/shared MLP +
    residual streams, routed experts). `granularity` is none or selective (full is handled by the caller).
    Attention is assumed fused (flash-style): only its log-sum-exp per head is kept, never the score
    matrix; except DeepSeek-V4's key-set attention, which keeps each query's probabilities over its key
    set unless selective recompute rebuilds them."""
    h = arch.hidden
    selective = granularity == "selective"  # norms, activation functions and attention cores recomputed
    norms = h if selective else 2 * h  # norm inputs are kept; their outputs are recomputed under selective
    if arch.v4 is not None:
        v4, hd = arch.v4, arch.head_dim
        attn = norms + 2 * v4.q_lora_rank + arch.num_heads * hd * 2 + 2 * hd + v4.o_groups * v4.o_lora_rank
        attn += 2 * v4.hc_mult * h  # mHC: the residual copies entering each of the two sub-blocks
        ratio = v4.compress_ratios[layer]
        extra = 4 * arch.num_heads + (4 * v4.index_topk if ratio == V4_CSA else 0)
        if not selective:
            # the key set: the window's two blocks, plus the top-k picked (CSA) or every complete entry
            # (HCA); its probabilities kept once, in bf16, per query, head and key (measured on one H100:
            # 1.16 GB of the 4-layer, 4096-token bench case)
            entries = (min(v4.index_topk, seq_len // V4_CSA) if ratio == V4_CSA
                       else seq_len // ratio if ratio else 0)
            extra += arch.num_heads * (2 * v4.sliding_window + entries) * 2
    elif arch.mla is not None:
        m = arch.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        attn = norms + 2 * (m.q_lora_rank or 0) + 2 * m.kv_lora_rank + m.qk_rope_head_dim
        attn += arch.num_heads * (2 * qk + 2 * m.v_head_dim)  # q, k, v, attention output
        extra = 4 * arch.num_heads
    else:
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        attn = norms + 2 * q + 2 * kv  # q, k, v, attention output
        if not selective:
            # the norms' outputs, which the q/k/v projections and the MLP keep as their inputs, and under
            # qk-norm the q and k projections' outputs, the per-head norms' inputs. On one H200 (Qwen3-1.7B,
            # compiled blocks, 4k-16k tokens a micro-batch, docs/PERFORMANCE.md "Planner calibration") a layer
            # kept 72 KB a token; without these the count was 57 KB
            attn += 2 * h + ((q + kv) if arch.qk_norm else 0)
        extra = 4 * arch.num_heads  # fp32 log-sum-exp per head
    moe = arch.moe
    if moe is None or not moe.is_moe_layer(layer):
        mlp = 2 * arch.ffn + (0 if selective else arch.ffn)  # gate+up outputs, activation output
        return act * (attn + mlp) + extra, 0.0
    shared = 2 * moe.shared_expert_ffn + (0 if selective else moe.shared_expert_ffn)
    per_copy = 2 * h + 2 * moe.expert_ffn + (0 if selective else moe.expert_ffn)  # dispatched in/out + FFN
    routed = act * moe.top_k * MOE_IMBALANCE * per_copy
    return act * (attn + shared) + extra + 4 * moe.num_experts, routed  # + fp32 router logits


def v4_gather_bytes(arch: ModelArch, layers, seq_len: int, tokens: float, tp: int, act: int) -> float:
    """DeepSeek-V4's CSA core on long sequences (entries above V4_DENSE_ENTRIES_PER_PICK x top-k): each
    query gathers its picked entries, [queries, top-k, head_dim], one chunk of query blocks at a time
    (V4_KEY_SET_LOGITS logits a chunk), and the backward makes their gradient of the same size."""
    v4 = arch.v4
    if v4 is None or not any(v4.compress_ratios[i] == V4_CSA for i in layers):
        return 0.0
    entries = seq_len // V4_CSA
    picked = min(v4.index_topk, entries)
    if entries <= V4_DENSE_ENTRIES_PER_PICK * picked:
        return 0.0
    w, heads = v4.sliding_window, arch.num_heads / tp
    chunk = max(1, V4_KEY_SET_LOGITS // int(w * heads * (2 * w + picked))) * w
    return min(tokens, chunk) * picked * arch.head_dim * act * 2


def fp8_cast_bytes(job: JobConfig, arch: ModelArch, layout: Layout, layers, tokens: float) -> float:
    """precision.fp8: the FP8 operands of the largest GEMM the stage's layers run, which live while it runs:
    its input, its output gradient and its weight cast to FP8 with their fp32 scales, each in the two
    layouts the backward's GEMMs read. Nothing else changes in the activations: torchao (0.18:
    Float8Linear, the blockwise linear and the FP8 grouped GEMM alike) saves the bf16 input and weight for
    the backward and casts them again there, so what a layer keeps is what it keeps in bf16 (under
    model.compile the partitioner may keep the 1-byte casts instead: a saving not counted)."""
    recipe = job.precision.fp8
    if recipe == "none":
        return 0.0
    h, tp, heads, hd = arch.hidden, layout.tp, arch.num_heads, arch.head_dim
    # (in, out, tp's side) of the linears: the whole widths decide whether one runs in FP8 (the runtime
    # converts before tensor parallel splits), this GPU's share of them its operands' bytes
    shapes: list[tuple[float, float, str]] = []
    if arch.v4 is not None:
        v4, q = arch.v4, heads * hd
        lora = v4.o_groups * v4.o_lora_rank
        shapes += [(h, v4.q_lora_rank, ""), (v4.q_lora_rank, q, ""), (h, hd, ""),
                   (q // v4.o_groups, lora, ""), (lora, h, ""),
                   (v4.q_lora_rank, v4.index_n_heads * v4.index_head_dim, ""), (h, 2 * hd, "")]
    elif arch.mla is None:
        shapes += [(h, heads * hd, "out"), (h, arch.num_kv_heads * hd, "out"), (heads * hd, h, "in")]
    moe = arch.moe
    ffns = [arch.ffn] if moe is None or not all(moe.is_moe_layer(i) for i in layers) else []
    routed = moe is not None and any(moe.is_moe_layer(i) for i in layers)
    if routed and moe.shared_expert_ffn:
        ffns.append(moe.shared_expert_ffn)
    for ffn in ffns:
        shapes += [(h, ffn, "out"), (ffn, h, "in")]

    def share(width: float, split: bool) -> float:
        return width / tp if split else width

    linears = job.precision.fp8_linears
    largest = max((_fp8_gemm_bytes(tokens, share(n_in, side == "in"), share(n_out, side == "out"), recipe)
                   for n_in, n_out, side in shapes if fp8_converts(recipe, linears, n_in, n_out)),
                  default=0.0)
    if routed and fp8_experts_on(job, arch, layout):  # the grouped GEMMs (gate and up fused, then down)
        rows, local = tokens * moe.top_k * MOE_IMBALANCE, moe.num_experts / (layout.ep * layout.etp)
        for n_in, n_out in ((h, 2 * moe.expert_ffn), (moe.expert_ffn, h)):
            largest = max(largest, _fp8_gemm_bytes(rows, n_in, n_out, "rowwise", local))
    return largest


def _fp8_gemm_bytes(rows: float, n_in: float, n_out: float, recipe: str, weights: float = 1) -> float:
    """One FP8 GEMM's operands (`rows` x n_in input, rows x n_out output gradient, `weights` n_out x n_in
    weights), each in two layouts."""
    return 2 * (_fp8_operand(rows, n_in, recipe) + _fp8_operand(rows, n_out, recipe)
                + weights * _fp8_operand(n_out, n_in, recipe, weight=True))


def _fp8_operand(rows: float, cols: float, recipe: str, weight: bool = False) -> float:
    """rows x cols FP8 elements and their fp32 scales: one per tensor (tensorwise), per row (rowwise), per
    1x128 tile (blockwise activations) or 128x128 block (blockwise weights)."""
    blocks = math.ceil(cols / FP8_BLOCK)
    scales = {"tensorwise": 1, "rowwise": rows,
              "blockwise": math.ceil(rows / FP8_BLOCK) * blocks if weight else rows * blocks}[recipe]
    return rows * cols * FP8_BYTES + 4 * scales


def layer_input_bytes(arch: ModelArch, act: int) -> int:
    """What full recompute keeps per layer and token: the layer input (all mHC copies for V4)."""
    return act * arch.hidden * (arch.v4.hc_mult if arch.v4 is not None else 1)


def in_flight_micro_batches(layout: Layout, stage: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, in whole-stage units. 1F1B: pp - r
    (warm-up). Interleaved: Megatron's warm-up of (pp - r - 1) x 2 + (vpp - 1) x pp chunks, plus one."""
    if layout.pp == 1:
        return 1.0
    if layout.vpp == 1:
        return float(min(layout.pp - stage, layout.micro_batches))
    chunks = (layout.pp - stage - 1) * 2 + (layout.vpp - 1) * layout.pp + 1
    return min(chunks, layout.micro_batches * layout.vpp) / layout.vpp


# ----------------------------------------------------------------------------------------------- stages
@dataclass
class _Ledger:
    """A stage's items per GPU in the order they are put, and the bytes moved to the host beside them."""

    items: list[MemoryItem] = field(default_factory=list)
    host: float = 0.0

    def put(self, name: str, nbytes: float, note: str, to_host: float = 0.0) -> None:
        self.host += nbytes * to_host
        self.items.append(MemoryItem(name, nbytes * (1 - to_host) / GIB, note))


def _stage_items(job: JobConfig, arch: ModelArch, layout: Layout, stage: int,
                 unsharded_grads: bool = False) -> tuple[list[MemoryItem], float, list[MemoryItem]]:
    """(training items per GPU, bytes offloaded to the host per GPU, resident state items for rollout):
    the model state, then the step's activations, then the framework. `unsharded_grads`: FSDP2 accumulates
    the step's micro-batches into whole gradients."""
    fsdp_units = backend_traits(job.optimizer.backend).fsdp_units
    plain_experts = fsdp_units and experts_outside_fsdp(job, layout, planned_device_type(job))
    sp = stage_params(arch, layout, stage, job.parallel.fsdp_unit_layers, experts_gathered=not plain_experts)
    ledger = _Ledger()
    if fsdp_units:
        _fsdp2_state(ledger, job, arch, layout, stage, sp, unsharded_grads, plain_experts)
    else:
        _dist_opt_state(ledger, job, layout, sp)
    resident = list(ledger.items)
    _activation_items(ledger, job, arch, layout, stage)
    if fsdp_units and layout.micro_batches == 1 and not job.offload.grads:
        _gradients_replace_activations(ledger.items, _shares(job, layout, sp)[2])
    cpu = job.cluster.gpu == "cpu"
    nccl = layout.world > 1
    ledger.put("framework overhead", (CPU_OVERHEAD_GB if cpu else gpu_overhead_gb(layout.world)) * GIB,
               "torch runtime" if cpu else "CUDA context, workspaces, allocator slack"
               + (", NCCL buffers" if nccl else ""))
    return ledger.items, ledger.host, resident


def gpu_overhead_gb(world: int) -> float:
    """A training process's GPU memory outside its tensors: the context and the allocator's slack, and NCCL's
    buffers where it has peers."""
    return GPU_CONTEXT_GB + (NCCL_BUFFERS_GB if world > 1 else 0.0)


def _shares(job: JobConfig, layout: Layout, sp: StageParams) -> tuple[float, float, str]:
    """(parameters this GPU owns a shard of, parameters it computes with, the gradients' note where ranks
    reduce them)."""
    sharded = sp.dense / (layout.dp * layout.cp) + sp.experts / layout.edp
    full = sp.dense + sp.experts
    return sharded, full, f", reduced in {grad_reduce_dtype(job)}" if sharded < full else ""


def _dist_opt_state(ledger: _Ledger, job: JobConfig, layout: Layout, sp: StageParams) -> None:
    """Megatron-Core's DDP and distributed optimizer: whole weights and grad buffer, sharded masters and
    Adam state."""
    w, reduce = DTYPE_BYTES[job.precision.compute], grad_reduce_dtype(job)
    off = job.offload
    frac = off.optimizer_fraction if off.optimizer else 0.0
    sharded, full, _ = _shares(job, layout, sp)
    master = job.precision.master  # fp32: separate fp32 master copy; bf16: the parameters are the master
    mb = DTYPE_BYTES[master]
    ledger.put("weights", full * w, f"{job.precision.compute}, full copy of this stage after tp/ep split")
    ledger.put("gradients", full * (DTYPE_BYTES[reduce] if master == "fp32" else mb),
               f"{reduce if master == 'fp32' else master} grad buffer, not sharded (Megatron DDP)")
    if job.precision.compute != "fp32" and master == "fp32":
        ledger.put("master weights", sharded * 4,
                   f"fp32, sharded over dp x cp={layout.dp * layout.cp} / edp={layout.edp}", frac)
    ledger.put("optimizer state", sharded * 2 * mb, f"Adam m, v {master}, sharded; {frac:.0%} offloaded",
               frac)


def _fsdp2_state(ledger: _Ledger, job: JobConfig, arch: ModelArch, layout: Layout, stage: int,
                 sp: StageParams, unsharded_grads: bool, plain_experts: bool = False) -> None:
    """FSDP2: sharded masters, the units gathered at a time, gradients (whole until the step's last backward
    where they accumulate unsharded) and sharded Adam state. `plain_experts`: the routed experts are in no
    unit (policy.experts_outside_fsdp), so never gathered: their master weights are what they compute with."""
    w, g = DTYPE_BYTES[job.precision.compute], DTYPE_BYTES[grad_reduce_dtype(job)]
    off = job.offload
    frac = off.optimizer_fraction if off.optimizer else 0.0
    sharded, full, reduced = _shares(job, layout, sp)
    master = job.precision.master  # fp32: separate fp32 master copy; bf16: the parameters are the master
    mb = DTYPE_BYTES[master]
    ledger.put("master weights", sharded * mb,
               f"{master} FSDP2 shards over dp x cp={layout.dp * layout.cp} / edp={layout.edp}",
               1.0 if off.params else 0.0)
    # precision.fp8_all_gather: the linears arrive in FP8 (1 byte; compute is bf16 under precision.fp8); their
    # one fp32 scale per weight tensor (some bytes a layer) is left out
    fp8 = fp8_all_gather(job)
    units = job.parallel.fsdp_unit_layers
    held = FSDP_PREFETCH_LAYERS * (sp.largest_unit_fp8 if fp8 else sp.largest_unit)
    # parallel.fsdp_embedding rows: the first stage's embedding is never gathered (its exchange moves
    # token rows, a few MB); nor are plain experts
    rows = job.parallel.fsdp_embedding == "rows" and stage == 0
    never_gathered = (arch.vocab * arch.hidden if rows else 0) + (sp.experts if plain_experts else 0.0)
    if job.parallel.fsdp_reshard_after_forward:
        gathered, how = held, f"{FSDP_PREFETCH_LAYERS} units of {units} layer(s) unsharded at a time"
    else:
        gathered = max(full - never_gathered - (sp.linears * (1 - FP8_BYTES / w) if fp8 else 0.0), held)
        how = (f"every unit of {units} layer(s) kept unsharded from its forward to its backward "
               "(parallel.fsdp_reshard_after_forward: false)")
    dtype = job.precision.compute + (", linears fp8 (precision.fp8_all_gather)" if fp8 else "")
    ledger.put("gathered weights", gathered * w if sharded < full or master != job.precision.compute
               else 0.0,  # one unsharded bf16 copy needs none
               f"{dtype}, {how}")
    # FSDP2 without gradient sync keeps each unit's gradient whole, in the reduce dtype, until the step's
    # last backward reduce-scatters it unit by unit into the shards (which exist only from then on)
    whole = (full * (g if master == "fp32" else mb)
             if unsharded_grads and sharded < full and layout.micro_batches > 1 else 0.0)
    accumulated = (f"whole until the step's last backward ({layout.micro_batches} micro-batches, "
                   "parallel.fsdp_grad_accumulation: unsharded)")
    if whole and not off.grads:
        ledger.put("gradients", max(whole, sharded * mb) + sp.largest_unit * w,
                   f"{accumulated}, then {master} shards{reduced}")
    else:
        ledger.put("gradients", sharded * mb + sp.largest_unit * w,
                   f"{master} shards + one unsharded unit being reduced{reduced}",
                   (sharded * mb / (sharded * mb + sp.largest_unit * w)) if off.grads else 0.0)
        if whole:  # the shards on the host, the whole gradients on the GPU
            ledger.put("gradients: accumulated whole", whole, accumulated)
    if job.precision.optimizer_state == "fp8":  # e4m3 moments and an fp32 scale per 128 of each
        ledger.put("optimizer state", sharded * 2 * (1 + 4 / 128), "Adam m, v e4m3 with block scales", frac)
    else:
        ledger.put("optimizer state", sharded * 2 * mb, f"Adam m, v {master}, sharded; {frac:.0%} offloaded",
                   frac)


def _activation_items(ledger: _Ledger, job: JobConfig, arch: ModelArch, layout: Layout, stage: int) -> None:
    """What the step's forward keeps for its backward on this stage (by recompute and the micro-batches in
    flight), the routed experts' copies, the recompute working set, DeepSeek-V4's key-set gather and the
    logits of the last stage."""
    act = DTYPE_BYTES[job.precision.compute]
    tokens = layout.tokens_per_micro_batch / layout.cp / layout.tp  # SP splits every token-wise activation
    layers = layout.stage_layers[stage]
    r = job.recompute
    per_layer = [layer_activation_bytes(arch, i, act, r.granularity, job.data.seq_len) for i in layers]
    worst = _worst_case_pairs(job, arch, layout)
    # the routed copies (and their share of a recompute group) in buffers sized for the most pairs
    base, routed, working = _kept_activations(arch, job, [(a, b * worst) for a, b in per_layer], act)
    flight = in_flight_micro_batches(layout, stage)
    note = f"{tokens:.0f} tokens/GPU/micro-batch x {flight:g} in flight, recompute {r.granularity}"
    ledger.put("activations", base * tokens * flight, note)
    if arch.moe is not None:
        ledger.put("activations: routed experts", routed * tokens * flight,
                   f"top-{arch.moe.top_k} token copies" + (
                       f", x{worst:g} in buffers for the most pairs a rank can be sent "
                       "(parallel.expert_buffers worst_case)" if worst > 1 else ""))
        if layout.ep > 1:
            exchange = expert_exchange(layout.ep, arch.moe.top_k).replace("_", "-")
            ledger.put("expert exchange buffers", EP_EXCHANGE_SLACK * routed / worst * tokens * flight,
                       f"ep={layout.ep} {exchange}: buffers of a new size every layer, kept by the allocator")
        else:
            rebuilt = 0.0
            if r.granularity == "full":  # the routed copies exist while a recompute group is rebuilt
                rebuilt = max(b for _, b in per_layer) * min(r.num_layers, len(per_layer))
            ledger.put("routed expert buffers", ROUTED_BUFFER_SLACK * max(routed, rebuilt) * tokens * flight,
                       "the allocator's blocks around the routed copies")
    if working:
        ledger.put("recompute working set", working * tokens, f"one group of {r.num_layers} layer(s) rebuilt")
    gather = v4_gather_bytes(arch, layers, job.data.seq_len, tokens, layout.tp, act)
    if gather:
        ledger.put("key-set gather", gather, "one chunk of CSA queries' picked entries and their gradient")
    casts = fp8_cast_bytes(job, arch, layout, layers, tokens)
    if casts:
        ledger.put("fp8 casts", casts,
                   f"precision.fp8 {job.precision.fp8}: the largest GEMM's FP8 input, output gradient and "
                   "weight with their scales, in both backward layouts; the saved inputs stay bf16")
    if stage == layout.pp - 1:
        # one chunk at a time
        logit_tokens = min(layout.tokens_per_micro_batch / layout.cp, LOGIT_CHUNK_TOKENS)
        entropy = job.job == "grpo"  # GRPO's update computes every token's entropy (mlite.trainers.grpo)
        per_logit = act + LOGIT_GRAD_BYTES + (LOGIT_ENTROPY_EXTRA_BYTES if entropy else 0)
        several = layout.tokens_per_micro_batch / layout.cp > LOGIT_CHUNK_TOKENS
        # over several chunks the head's weight gradient is summed in fp32, beside the logits
        head_sum = arch.vocab * arch.hidden / layout.tp * 4 if several else 0
        ledger.put("logits", logit_tokens * arch.vocab / layout.tp * per_logit + head_sum,
                   f"one chunk of {logit_tokens:.0f} tokens x vocab/tp: logits + their gradient"
                   + (", + fp32 log-softmax and entropy, recomputed" if entropy else "")
                   + (", + the head's weight gradient summed over the chunks in fp32" if several else ""))


def _worst_case_pairs(job: JobConfig, arch: ModelArch, layout: Layout) -> float:
    """How many times a balanced router's top_k pairs a token the expert exchange's pair buffers hold: 1, or
    under parallel.expert_buffers worst_case the most pairs a rank can be sent (policy.expert_pair_rows)."""
    if arch.moe is None or layout.ep == 1 or job.parallel.expert_buffers != "worst_case":
        return 1.0
    return _worst_case_share(arch, layout)


def _worst_case_share(arch: ModelArch, layout: Layout) -> float:
    """The most pairs a rank can be sent (policy.expert_pair_rows) over a balanced router's top_k, a token."""
    k = arch.moe.top_k
    return expert_pair_rows(layout.ep, 1, k, arch.moe.num_experts // layout.ep) / k


def _kept_activations(arch: ModelArch, job: JobConfig, per_layer: list[tuple[float, float]],
                      act: int) -> tuple[float, float, float]:
    """Bytes per token the stage keeps under recompute: (kept, kept of the routed experts, the largest group
    rebuilt at once). `per_layer`: each layer's (attention + dense, routed) bytes per token."""
    r = job.recompute
    if r.granularity != "full" or not per_layer:
        return sum(a for a, _ in per_layer), sum(b for _, b in per_layer), 0.0
    n = min(r.num_layers, len(per_layer))
    keep = layer_input_bytes(arch, act)
    if r.method == "uniform":  # groups of n layers, each keeping only its input
        groups = [per_layer[k : k + n] for k in range(0, len(per_layer), n)]
        return keep * len(groups), 0.0, max(sum(a + b for a, b in grp) for grp in groups)
    # block: the first n layers of the stage recompute, the others keep everything
    return (keep * n + sum(a for a, _ in per_layer[n:]), sum(b for _, b in per_layer[n:]),
            max(a + b for a, b in per_layer[:n]))


def _gradients_replace_activations(items: list[MemoryItem], reduced: str) -> None:
    """One micro-batch per step under FSDP2: gradients do not exist during the forward (freed after each
    optimizer step) and appear during the backward as the activations they replace are freed."""
    grads = next(i for i in items if i.name == "gradients")
    acts = sum(i.gb for i in items if i.name.startswith("activations") or i.name == "logits")
    items[items.index(grads)] = MemoryItem("gradients", max(0.0, grads.gb - acts),
                                           "freed between steps; replace activations during the backward"
                                           + reduced)


@dataclass
class RolloutPhases:
    """A GRPO step's phases beside training, per GPU: generation, and vLLM's weight sync; and what the
    trainer moves to the host for them."""

    rollout: list[MemoryItem]
    sync: list[MemoryItem] = field(default_factory=list)
    offload_trainer: bool | None = None  # vLLM only: the trainer waits on the host while it generates
    host_gb: float = 0.0  # per GPU, the trainer's state on the host during the rollout
    fp8_weights: bool | None = None  # vLLM only: the engine holds DeepSeek-V4's linears and experts in FP8


def _rollout_phases(job: JobConfig, arch: ModelArch, layout: Layout, stage: int, resident: list[MemoryItem],
                    capacity_gb: float, notes: list[str]) -> RolloutPhases:
    """GRPO generation on the same GPUs: the trainer's resident state (or, offloaded, none of it) plus the
    engine's memory."""
    r = job.rollout
    # gradients are freed after each optimizer step; gathered weights are counted below for the engine
    trainer = [MemoryItem(f"trainer: {i.name}", i.gb, "resident during rollout") for i in resident
               if i.name not in ("gathered weights", "gradients") and i.gb > 0]
    if r.engine == "vllm":
        return _vllm_phases(job, arch, layout, trainer, capacity_gb, notes)
    items = list(trainer)
    act = DTYPE_BYTES[job.precision.compute]
    sequences = math.ceil(r.prompts_per_step * r.n / layout.dp)
    length = r.max_prompt_length + r.max_response_length
    kv = sum(_kv_bytes_per_sequence(arch, i, length, act) for i in layout.stage_layers[stage]) / layout.tp
    if layout.world > 1 or job.parallel.fsdp_one_rank:
        # the built-in engine decodes with a plain replica of the whole model on every rank, gathered from
        # the shards and stages once per rollout (Runtime.rollout_model), fp32 as the masters
        replica = count_params(arch).total * 4 / GIB
        items.append(MemoryItem("rollout replica", replica,
                                "the whole model in fp32 on every rank (Runtime.rollout_model)"))
        if replica > capacity_gb * HEADROOM:
            notes.append(f"the built-in rollout replicates the whole model on every rank ({replica:.0f} GB): "
                         "a GPU cannot hold it; roll out on vLLM over the ranks (rollout.engine: vllm, "
                         "rollout.tp: GPUs per engine), each rank holding its slab")
    items.append(MemoryItem("KV cache", sequences * kv / GIB, f"{sequences} sequences x {length} tokens"))
    cpu = job.cluster.gpu == "cpu"
    items.append(MemoryItem("framework overhead", CPU_OVERHEAD_GB if cpu else gpu_overhead_gb(layout.world),
                            ""))
    return RolloutPhases(items)


def _vllm_phases(job: JobConfig, arch: ModelArch, layout: Layout, trainer: list[MemoryItem],
                 capacity_gb: float, notes: list[str]) -> RolloutPhases:
    """vLLM beside the trainer. Generation: vLLM's share of the GPU, plus the trainer's resident state unless
    it waits on the host (rollout.offload_trainer; `auto`: where the two do not fit together). The weight
    sync before it: vLLM's weights woken beside the trainer's weights, which the sync reads (offloaded, the
    rest of the trainer is on the host by then)."""
    r = job.rollout
    share = r.gpu_memory_utilization * capacity_gb
    dtype_bytes = DTYPE_BYTES[job.precision.compute]
    fp8 = r.fp8_weights
    if fp8 == "auto":  # DeepSeek-V4 only: FP8 where the engine's weights in the rollout dtype do not fit
        bf16_gb = vllm_weight_bytes(arch, dtype_bytes, False) / r.tp / GIB
        fp8 = (arch.v4 is not None and bf16_gb > share * HEADROOM
               and vllm_fp8_misfit(arch, r.tp, rollout_expert_parallel(job, arch)) is None)
    weights_gb = vllm_weight_bytes(arch, dtype_bytes, fp8) / r.tp / GIB
    engines = layout.world // r.tp
    kind = "FP8 linears and experts, " if fp8 else ""
    vllm = MemoryItem("vLLM (weights + KV cache)", share,
                      f"rollout.gpu_memory_utilization x {capacity_gb:.0f} GB; {engines} engine(s) of "
                      f"rollout.tp={r.tp}, {weights_gb:.1f} GB of weights per GPU ({kind}"
                      f"{_vllm_kv_room(job, arch, share - weights_gb)})")
    resident_gb = sum(i.gb for i in trainer)
    offload = r.offload_trainer
    if offload == "auto":
        offload = resident_gb + share > capacity_gb * HEADROOM
    per_node = job.cluster.gpus_per_node
    if r.tp > per_node:
        notes.append(f"rollout.tp={r.tp} spans {r.tp // per_node} nodes of {per_node} GPUs: vLLM's "
                     "tensor-parallel all-reduces cross the network at every decode step")
    extra = []
    if weights_gb > share * HEADROOM:
        v4_fix = ", or set rollout.fp8_weights: true" if arch.v4 is not None and not fp8 else ""
        notes.append(f"vLLM needs {weights_gb:.1f} GB per GPU for weights at rollout.tp={r.tp}, "
                     f"more than its {share:.1f} GB share: raise rollout.tp or "
                     f"rollout.gpu_memory_utilization{v4_fix}")
        extra = [MemoryItem(VLLM_SHORT, weights_gb - share * HEADROOM, "does not fit: vLLM fails to start")]
    if not offload:
        return RolloutPhases(trainer + [vllm] + extra, offload_trainer=False, fp8_weights=fp8)
    read = [i for i in trainer if i.name in ("trainer: weights", "trainer: master weights")][:1]
    sync = [MemoryItem(i.name, i.gb, "read by the weight sync") for i in read]
    held = "FP8 linears and experts" if fp8 else "rollout dtype"
    sync.append(MemoryItem("vLLM weights", weights_gb, f"{held}, 1/rollout.tp={r.tp} of the model"))
    sync.append(MemoryItem("sync bucket", SYNC_BUCKET_BYTES / GIB, "whole-shaped tensors in flight"))
    cpu = job.cluster.gpu == "cpu"
    sync.append(MemoryItem("framework overhead", CPU_OVERHEAD_GB if cpu else gpu_overhead_gb(layout.world),
                           "CUDA context, vLLM's own buffers, workspaces"))
    host = MemoryItem("trainer: on the host", 0.0, f"{resident_gb:.1f} GB per GPU in pinned host memory")
    return RolloutPhases([host, vllm] + extra, sync, offload_trainer=True, host_gb=resident_gb,
                         fp8_weights=fp8)


def _vllm_kv_room(job: JobConfig, arch: ModelArch, room_gb: float) -> str:
    """What vLLM's share holds beside the weights, in sequences of the longest length: its KV cache in fp8
    for DeepSeek-V4 (its only sm90 attention, FlashMLA, reads fp8_ds_mla), else the rollout dtype. Every
    engine rank holds V4's one shared KV head of every layer."""
    r = job.rollout
    length = r.max_prompt_length + r.max_response_length
    v4 = arch.v4 is not None
    kv_bytes = sum(_kv_bytes_per_sequence(arch, i, length, 1 if v4 else DTYPE_BYTES[job.precision.compute])
                   for i in range(arch.num_layers))
    per_gpu = kv_bytes if v4 or arch.mla is not None else kv_bytes / r.tp
    sequences = max(0.0, room_gb - VLLM_WORKSPACE_GB) * GIB / per_gpu
    return f"{'fp8 ' if v4 else ''}KV cache for {sequences:.0f} sequences of {length} tokens"


def _kv_bytes_per_sequence(arch: ModelArch, layer: int, length: int, act: int) -> float:
    if arch.v4 is not None:
        v4 = arch.v4
        ratio = v4.compress_ratios[layer]
        rows = min(length, v4.sliding_window) + (length / ratio if ratio else 0)
        return act * (rows * arch.head_dim + (length / 4 * v4.index_head_dim if ratio == 4 else 0))
    if arch.mla is not None:
        return act * length * (arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim)
    return act * length * 2 * arch.num_kv_heads * arch.head_dim


# ------------------------------------------------------------------------------------------------ entry
def estimate_memory(job: JobConfig, arch: ModelArch, layout: Layout) -> MemoryEstimate:
    """Itemised memory of the fullest pipeline rank, and host memory per node. `auto` keys are resolved here,
    in this order (`_resolving`): parallel.fsdp_unit_layers (`_auto_units`), then parallel.expert_buffers
    (`_auto_buffers`: worst_case where its buffers are at most AUTO_WORST_CASE_MAX_PAIRS a balanced
    router's and that fits with KEEP_GATHERED_MARGIN to spare), then
    parallel.fsdp_reshard_after_forward (`_auto_reshard`: kept gathered where that fits with
    KEEP_GATHERED_MARGIN to spare and nothing is offloaded), then how a step of several micro-batches under
    FSDP2 accumulates its gradients (parallel.fsdp_grad_accumulation: `unsharded` where that estimate fits,
    else `sharded`). The estimate says what it chose (`fsdp_unit_layers`, `expert_buffers`,
    `fsdp_reshard_after_forward`, `fsdp_grad_accumulation`); the plan (mlite.plan.plan_job) writes that
    into the job the runtime is built from, so this runs once per plan."""
    return _resolving(job, arch, layout)


def _resolving(job: JobConfig, arch: ModelArch, layout: Layout) -> MemoryEstimate:
    """`estimate_memory`, resolving one `auto` at a time: each choice sizes the job with that key set."""
    if job.parallel.fsdp_unit_layers == "auto":
        return _auto_units(job, arch, layout)
    if job.parallel.expert_buffers == "auto" and _gathers_experts(arch, layout):
        return _auto_buffers(job, arch, layout)
    if job.parallel.fsdp_reshard_after_forward == "auto":
        return _auto_reshard(job, arch, layout)
    mode = job.parallel.fsdp_grad_accumulation
    if not fsdp_units(job, layout.world) or layout.micro_batches == 1:  # nothing accumulates
        return _estimate(job, arch, layout, None)
    if mode != "sharded":
        whole = _estimate(job, arch, layout, "unsharded")
        if mode == "unsharded" or whole.fits:
            return whole
    return _estimate(job, arch, layout, "sharded")


def _with_parallel(job: JobConfig, **keys) -> JobConfig:
    return job.model_copy(update={"parallel": job.parallel.model_copy(update=keys)})


def _auto_units(job: JobConfig, arch: ModelArch, layout: Layout) -> MemoryEstimate:
    """parallel.fsdp_unit_layers `auto`: 1 without FSDP2 units (one plain process, dist_opt); else the most
    layers, up to AUTO_UNIT_MAX_LAYERS, whose gathered weights stay within AUTO_UNIT_BYTES, halved until
    the estimate fits."""
    units = 1
    if fsdp_units(job, layout.world):
        # a layer as gathered, in compute-dtype parameters: FP8's all-gather moves its linears in fewer bytes
        w = DTYPE_BYTES[job.precision.compute]
        cut = 1 - FP8_BYTES / w if fp8_all_gather(job) else 0.0
        layer = max(sum(_layer_params_per_gpu(arch, layout, i))
                    - cut * _layer_linears_per_gpu(arch, layout, i) for i in range(arch.num_layers))
        fitting = AUTO_UNIT_BYTES // (layer * w)
        most = max(len(layers) for layers in layout.stage_layers)  # no unit beyond a stage's layers
        units = int(min(AUTO_UNIT_MAX_LAYERS, most, max(1, fitting)))
    while True:
        estimate = _resolving(_with_parallel(job, fsdp_unit_layers=units), arch, layout)
        if estimate.fits or units == 1:
            return estimate
        units //= 2


def _gathers_experts(arch: ModelArch, layout: Layout) -> bool:
    """Whether the routed tokens cross the ep ranks by the all-gather exchange (policy.expert_exchange), the
    one whose pair buffers parallel.expert_buffers sizes."""
    moe = arch.moe
    return moe is not None and layout.ep > 1 and expert_exchange(layout.ep, moe.top_k) == "all_gather"


def _auto_buffers(job: JobConfig, arch: ModelArch, layout: Layout) -> MemoryEstimate:
    """parallel.expert_buffers `auto`: worst_case where its buffers hold at most AUTO_WORST_CASE_MAX_PAIRS
    times a balanced router's pairs and the estimate fits with its error to spare (KEEP_GATHERED_MARGIN),
    else exact. Nothing is read on the host, so the exchange compiles whole and no rank waits on its own
    host every layer. Chosen before keeping units gathered, whose gain is smaller."""
    if _worst_case_share(arch, layout) <= AUTO_WORST_CASE_MAX_PAIRS:
        worst = _resolving(_with_parallel(job, expert_buffers="worst_case"), arch, layout)
        if worst.fits and worst.total_gb * KEEP_GATHERED_MARGIN <= worst.usable_gb:
            return worst
    return _resolving(_with_parallel(job, expert_buffers="exact"), arch, layout)


def _auto_reshard(job: JobConfig, arch: ModelArch, layout: Layout) -> MemoryEstimate:
    """parallel.fsdp_reshard_after_forward `auto`: kept gathered where that fits with the estimate's error to
    spare: it saves the backward's all-gather and FSDP2's host work for it, and costs the whole stage's
    weights gathered (never under offload, which is there to save GPU memory)."""
    off = job.offload
    if fsdp_units(job, layout.world) and not (off.params or off.grads or off.optimizer):
        kept = _resolving(_with_parallel(job, fsdp_reshard_after_forward=False), arch, layout)
        if kept.fits and kept.total_gb * KEEP_GATHERED_MARGIN <= kept.usable_gb:
            return kept
    return _resolving(_with_parallel(job, fsdp_reshard_after_forward=True), arch, layout)


def _estimate(job: JobConfig, arch: ModelArch, layout: Layout, accumulation: str | None) -> MemoryEstimate:
    c = job.cluster
    cpu = c.gpu == "cpu"
    capacity = c.host_memory_gb / c.gpus_per_node if cpu else c.memory_per_gpu_gb
    stages = [_stage_items(job, arch, layout, s, accumulation == "unsharded") for s in range(layout.pp)]
    totals = [sum(i.gb for i in items) for items, _, _ in stages]
    worst = max(range(layout.pp), key=lambda s: totals[s])
    items, _, resident = stages[worst]
    notes: list[str] = []
    cast = any(item.name == "fp8 casts" for stage_items, _, _ in stages for item in stage_items)
    if job.precision.fp8 != "none" and not cast:  # precision.fp8_linears auto found nothing that gains
        notes.append(f"precision.fp8 {job.precision.fp8}: no linear or routed expert of this model is large "
                     "enough for FP8 to gain at these widths and rows (precision.fp8_linears auto), so all "
                     "of it computes in bf16; set precision.fp8_linears: all to force FP8, or "
                     "precision.fp8: none")
    phases = (_rollout_phases(job, arch, layout, worst, resident, capacity, notes) if job.job == "grpo"
              else RolloutPhases([]))
    # Ranks are placed pipeline-outermost, so a node's GPUs usually share a stage: count the largest offload.
    offloaded = max(host for _, host, _ in stages) / GIB
    host_items = [
        MemoryItem("offloaded state", offloaded * c.gpus_per_node,
                   f"{offloaded:.1f} GB x {c.gpus_per_node} ranks")]
    if phases.offload_trainer:
        host_items.append(MemoryItem("trainer during rollout", phases.host_gb * c.gpus_per_node,
                                     f"{phases.host_gb:.1f} GB x {c.gpus_per_node} ranks, pinned"))
    if cpu:  # the ranks' "device" memory is host memory: their totals (overhead included) land here
        host_items.append(MemoryItem("ranks' working memory", max(totals) * c.gpus_per_node,
                                     "gloo ranks on the host"))
    else:
        host_items.append(MemoryItem("process overhead", HOST_OVERHEAD_PER_RANK_GB * c.gpus_per_node,
                                     f"{HOST_OVERHEAD_PER_RANK_GB:g} GB x {c.gpus_per_node} ranks"))
    return MemoryEstimate(stage=worst, items=items, capacity_gb=capacity, host_items=host_items,
                          host_capacity_gb=c.host_memory_gb, stage_totals_gb=totals,
                          rollout_items=phases.rollout, sync_items=phases.sync,
                          offload_trainer=phases.offload_trainer, rollout_fp8_weights=phases.fp8_weights,
                          notes=notes,
                          fsdp_grad_accumulation=accumulation,
                          fsdp_unit_layers=job.parallel.fsdp_unit_layers,
                          fsdp_reshard_after_forward=job.parallel.fsdp_reshard_after_forward,
                          fp8_all_gather=fp8_all_gather(job), expert_buffers=job.parallel.expert_buffers)
