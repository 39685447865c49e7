"""The job config: one YAML file describes one run, validated strictly.

Why pydantic v2 rather than plain dataclasses: it gives us, for free and fast (the core is compiled),
strict type checks (no silent "8" -> 8 or 1.5 -> 1), `extra="forbid"` on every section so an unknown key is
an error, the full location of each error (`parallel.tp`), and the expected values of every `Literal`.
Cross-field contradictions live in `model_validator`s next to the fields they relate. The planner
(`mlite.plan`) checks what needs the model architecture (heads vs tp, experts vs ep, ...); this module
checks what the file alone can tell.

Every accepted key has an effect; a key that would do nothing in a given job is refused, not ignored.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mlite.config.backends import backend_traits


class Section(BaseModel):
    # allow_inf_nan=False: YAML's .inf and .nan pass `gt=0`-style bounds (or have none to pass) and would
    # train on, or wait, forever
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, allow_inf_nan=False)


# --------------------------------------------------------------------------------------------- model
class ModelConfig(Section):
    """Which architecture: a preset from the catalog (`mlite plan --list-models`) or a local HF checkpoint."""

    name: str | None = None  # catalog preset, e.g. "qwen3-30b-a3b"
    path: str | None = None  # local HF checkpoint dir or its config.json
    load_weights: bool | None = None  # default: True for model.path, False for a preset (random init)
    attention_backend: Literal["auto", "torch", "sdpa", "varlen", "cudnn", "packed", "flash_attn",
                               "te"] = "auto"
    compile: bool = False  # torch.compile each decoder block's body (inside FSDP's hooks, around recompute)
    # DeepSeek-V4: weight of the multi-token-prediction loss (0: no MTP block is built; DeepSeek-V3 trained
    # with 0.3 then 0.1), and of the CSA indexer's KL loss (0: the indexer stays frozen, as in RL recipes)
    mtp_loss_weight: float = Field(0.0, ge=0.0)
    indexer_loss_weight: float = Field(0.0, ge=0.0)

    @model_validator(mode="after")
    def _one_source(self):
        if (self.name is None) == (self.path is None):
            raise ValueError("give exactly one of model.name (a catalog preset) "
                             "or model.path (an HF checkpoint)")
        if self.name is not None and self.load_weights:
            raise ValueError("model.load_weights: true needs model.path (a preset has no weights)")
        if self.load_weights is None:
            object.__setattr__(self, "load_weights", self.path is not None)
        return self


# ------------------------------------------------------------------------------------------- cluster
GPU_MEMORY_GB = {  # usable HBM per GPU, as the driver reports it (GiB)
    "h100": 79.6,
    "h800": 79.6,
    "h200": 139.8,
    "h20": 95.6,
    "b200": 178.4,
    "b300": 268.0,
    "gb200": 184.0,
    "gb300": 277.0,
    "a100": 79.3,
    "cpu": 0.0,
}
GPU_TYPES = tuple(GPU_MEMORY_GB)
# Dense bf16 peak per GPU (TFLOP/s), for MFU and the planner's cost model; "cpu" is a nominal figure.
GPU_BF16_TFLOPS = {"h100": 989.0, "h800": 989.0, "h200": 989.0, "h20": 148.0, "b200": 2250.0, "b300": 2250.0,
                   "gb200": 2500.0, "gb300": 2500.0, "a100": 312.0, "cpu": 1.0}


class ClusterConfig(Section):
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(8, ge=1, le=72)
    gpu: Literal[GPU_TYPES] = "h100"  # type: ignore[valid-type]
    gpu_memory_gb: float | None = Field(None, gt=0)  # overrides the type's memory (e.g. 96 GB H20 / H800)
    host_memory_gb: float = Field(1800.0, gt=0)  # CPU RAM per node, for offloaded state

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def memory_per_gpu_gb(self) -> float:
        return self.gpu_memory_gb if self.gpu_memory_gb is not None else GPU_MEMORY_GB[self.gpu]


# ------------------------------------------------------------------------------------------ parallel
class ParallelConfig(Section):
    """Parallel layout. dp is derived: world = pp x dp x cp x tp; experts fold as
    ep x etp x edp = dp x cp x tp."""

    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    vpp: int = Field(1, ge=1)  # virtual (interleaved) stages per pipeline rank
    cp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    etp: int = Field(1, ge=1)
    sequence_parallel: bool | None = None  # None: on exactly when tp > 1
    pp_first_stage_layers: int | None = Field(None, ge=0)
    pp_last_stage_layers: int | None = Field(None, ge=0)
    # one process: shard with FSDP2 over a mesh of one rank instead of the plain model, so the multi-GPU
    # path (DTensor parameters, FSDP2's hooks, the sharded step) runs, and offload.* works, on one GPU
    fsdp_one_rank: bool = False
    # consecutive decoder layers FSDP2 gathers and reduces as one unit: FSDP2's host work per step grows
    # with its units (scripts/fsdp_host_probe.py), so small layers on fast GPUs gain from 2-4 a unit, at
    # the memory of that many layers held gathered (the planner counts it); 1 is torchtitan's layout.
    # `auto`: the planner's choice (mlite.plan.memory.estimate_memory): units of about AUTO_UNIT_BYTES of
    # gathered weights, at most 4 layers, fewer where the estimate would not fit
    fsdp_unit_layers: Literal["auto"] | Annotated[int, Field(ge=1)] = "auto"
    # whether FSDP2 frees each unit's gathered weights after its forward (true: ZeRO-3, gathered again
    # for the backward) or keeps them until the backward (false: one all-gather a step less, at the memory
    # of the whole local model gathered). `auto`: the planner's choice (mlite.plan.memory.estimate_memory):
    # false where that estimate fits with KEEP_GATHERED_MARGIN to spare and nothing is offloaded, else true
    fsdp_reshard_after_forward: Literal["auto"] | bool = "auto"
    # each FSDP2 layer unit's forward queues the next unit's all-gather (FSDP2's explicit forward prefetch)
    # instead of leaving it to when the host reaches that unit: a host behind its GPU (small layers, fast
    # GPUs) no longer delays the gathers. The plan holds two units gathered either way
    fsdp_forward_prefetch: bool = True
    # a step of several micro-batches under FSDP2: `unsharded` keeps each unit's gradient whole (in the
    # reduce dtype: the whole local model) until the step's last backward, one reduce-scatter a step;
    # `sharded` reduce-scatters after every micro-batch (memory of the shards only, more traffic); `auto`:
    # unsharded where the plan has several micro-batches a step and its estimate with it fits, else sharded
    fsdp_grad_accumulation: Literal["auto", "unsharded", "sharded"] = "auto"
    # the untied input embedding under FSDP2: `gathered` (FSDP2's unit: the whole [vocab, hidden] matrix
    # gathered at each step's start and its gradient reduce-scattered at the end); `rows` (kept sharded by
    # vocabulary rows over dp_cp: each lookup exchanges the ranks' token ids and their rows, 2 x ranks x
    # tokens x hidden elements a micro-batch, and each rank's gradient rows come out complete, nothing to
    # reduce; micro-batches are padded to one length on every rank for it)
    fsdp_embedding: Literal["gathered", "rows"] = "gathered"
    # the all-gather expert exchange's buffers of this rank's (token, expert) pairs: `exact` sizes them by
    # the pair count, which the host reads once a layer (it waits there for the router); `worst_case` sizes
    # them for the most pairs the rank can be sent (ep x tokens x min(top_k, its experts):
    # mlite.plan.policy.expert_pair_rows), so the exchange reads nothing on the host, at that buffer's
    # memory (the planner counts it); the GEMMs run the real pairs only, and the exchange compiles whole.
    # `auto`: worst_case where those buffers hold at most twice a balanced router's pairs (ep2 with top-k
    # routing) and the plan fits with them and the planner's error to spare, else exact
    # (mlite.plan.memory._auto_buffers); it stays `auto` where no all-gather exchange runs (no routed
    # experts, ep 1, ep above top_k)
    expert_buffers: Literal["auto", "exact", "worst_case"] = "auto"

    @model_validator(mode="after")
    def _consistent(self):
        if self.sequence_parallel is None:
            object.__setattr__(self, "sequence_parallel", self.tp > 1)
        elif self.sequence_parallel != (self.tp > 1):
            raise ValueError(
                f"sequence_parallel={self.sequence_parallel} with tp={self.tp}: mlite always runs sequence "
                "parallel when tp > 1 and never when tp = 1; remove parallel.sequence_parallel"
            )
        if self.vpp > 1 and self.pp == 1:
            raise ValueError(f"vpp={self.vpp} needs pp > 1; set parallel.pp or remove parallel.vpp")
        if self.pp == 1 and (self.pp_first_stage_layers is not None or self.pp_last_stage_layers is not None):
            raise ValueError("pp_first_stage_layers / pp_last_stage_layers need pp > 1")
        return self


# ----------------------------------------------------------------------------------------- optimizer
class OptimizerConfig(Section):
    backend: Literal["fsdp2", "dist_opt"] = "fsdp2"
    name: Literal["adamw"] = "adamw"
    lr: float = Field(1e-5, gt=0)
    min_lr: float = Field(0.0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    clip_grad: float = Field(1.0, ge=0)  # 0 disables clipping
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["cosine", "constant", "linear"] = "cosine"
    # dist_opt: start each gradient bucket's reduce-scatter while the step's last backward still runs (as
    # Megatron's overlap_grad_reduce); false reduces everything at the step. FSDP2 always overlaps.
    overlap_grad_reduce: bool = True
    # dist_opt: the step only starts the all-gathers of the new weights, and the next forward waits for each
    # bucket just before the first layer that reads it (Megatron's overlap_param_gather); false gathers
    # everything at the step. FSDP2 always prefetches its next unit.
    overlap_param_gather: bool = True

    @field_validator("betas", mode="before")
    @classmethod
    def _yaml_list(cls, value):  # YAML has lists, not tuples; strict mode would refuse [0.9, 0.95]
        return tuple(value) if isinstance(value, list) else value

    @field_validator("betas")
    @classmethod
    def _betas_in_unit_interval(cls, value):  # else the step divides by (1 - beta^t) <= 0
        if not all(0 <= beta < 1 for beta in value):
            raise ValueError(f"each beta must be in [0, 1) (got {list(value)}); e.g. [0.9, 0.95]")
        return value

    @model_validator(mode="after")
    def _lrs(self):
        if self.min_lr > self.lr:
            raise ValueError(f"optimizer.min_lr={self.min_lr} is above optimizer.lr={self.lr}")
        return self


# ---------------------------------------------------------------------------------- precision & memory
class PrecisionConfig(Section):
    compute: Literal["bf16", "fp16", "fp32"] = "bf16"  # dtype of matmuls and activations
    # fp32: fp32 master weights and Adam state beside bf16 compute weights (the safe default);
    # bf16: parameters, gradients and Adam state all in bf16 (half the state memory; what plain HF
    # training does)
    master: Literal["fp32", "bf16"] = "fp32"
    # dtype of the cross-rank gradient reduction; auto: the master weights' (bf16 gradients of bf16 masters
    # are reduced in bf16, as Megatron's default; fp32 masters in fp32). mlite.plan.policy.grad_reduce_dtype
    grad_reduce: Literal["auto", "fp32", "bf16"] = "auto"
    # Adam's two moments: master: in precision.master's dtype; fp8: float8 e4m3 with one power-of-two
    # scale per 128 elements, stochastically rounded (2 bytes per parameter instead of 4 or 8)
    optimizer_state: Literal["master", "fp8"] = "master"
    # FP8 matmuls in forward and backward (Hopper and newer), for every linear of the decoder layers and the
    # routed experts' grouped GEMM; the embedding, the LM head, the norms and the router stay in `compute`.
    # tensorwise / rowwise: torchao.float8's dynamic scaling, one scale per tensor / per row; blockwise:
    # DeepSeek's 128x128 weight blocks with 1x128 activation tiles (what vLLM's block-FP8 linears run)
    fp8: Literal["none", "tensorwise", "rowwise", "blockwise"] = "none"
    # which linears run in FP8. auto: those large enough to gain under the recipe (torchao's size rule,
    # mlite.plan.rules.fp8_linear_gains; blockwise: all, as DeepSeek's recipe), and the routed experts where
    # their FP8 GEMMs gain more than their casts cost (fp8_experts_gain); all: every one that tiles
    fp8_linears: Literal["auto", "all"] = "auto"
    # fsdp2, tensorwise: each unit's all-gather moves the weights in FP8 (half of bf16's bytes). `auto`: off,
    # measured slower on NVLink (mlite.plan.policy.fp8_all_gather)
    fp8_all_gather: Literal["auto"] | bool = "auto"

    @model_validator(mode="after")
    def _master(self):
        if self.master == "bf16" and self.compute != "bf16":
            raise ValueError(f"precision.master: bf16 needs precision.compute: bf16 (got {self.compute})")
        if self.fp8 != "none" and self.compute != "bf16":
            raise ValueError(f"precision.fp8: {self.fp8} runs beside bf16 compute; set precision.compute: "
                             f"bf16 (got {self.compute})")
        if self.fp8_linears != "auto" and self.fp8 == "none":
            raise ValueError(f"precision.fp8_linears: {self.fp8_linears} chooses which linears run in FP8, "
                             "and precision.fp8 is none; set precision.fp8 (tensorwise, rowwise or "
                             "blockwise), or remove precision.fp8_linears")
        if self.fp8_all_gather is True and self.fp8 != "tensorwise":
            raise ValueError("precision.fp8_all_gather: true needs precision.fp8: tensorwise (one scale per "
                             f"weight, which the gathered shards share); got precision.fp8: {self.fp8}")
        return self


class RecomputeConfig(Section):
    granularity: Literal["none", "selective", "full"] = "none"
    method: Literal["uniform", "block"] | None = None  # full only
    num_layers: int | None = Field(None, ge=1)  # full only: layers per chunk (uniform) or per stage (block)

    @model_validator(mode="after")
    def _full_only(self):
        if self.granularity == "full":
            if self.method is None:
                object.__setattr__(self, "method", "uniform")
            if self.num_layers is None:
                object.__setattr__(self, "num_layers", 1)
        elif self.method is not None or self.num_layers is not None:
            raise ValueError(
                f"recompute.method / recompute.num_layers apply to granularity 'full' only "
                f"(got granularity '{self.granularity}')"
            )
        return self


class OffloadConfig(Section):
    params: bool = False
    grads: bool = False
    optimizer: bool = False
    optimizer_fraction: float | None = Field(None, gt=0, le=1)  # share of optimizer state on the host

    @model_validator(mode="after")
    def _fraction(self):
        if self.optimizer_fraction is not None and not self.optimizer:
            raise ValueError("offload.optimizer_fraction needs offload.optimizer: true")
        if self.optimizer and self.optimizer_fraction is None:
            object.__setattr__(self, "optimizer_fraction", 1.0)
        return self


# ------------------------------------------------------------------------------------------------ data
class DataConfig(Section):
    train_files: list[str] = Field(default_factory=list)  # parquet or JSONL, messages format
    val_files: list[str] = Field(default_factory=list)
    tokenizer: str | None = None  # dir with tokenizer.json + chat template; default: the model path
    messages_key: str = "messages"
    seq_len: int = Field(4096, ge=8)  # longest sample (tokens); longer rows are counted and skipped
    micro_batch_size: int = Field(1, ge=1)  # sequences per micro-batch (used when dynamic_batch is off)
    global_batch_size: int = Field(8, ge=1)  # sequences per optimizer step, over all data-parallel ranks
    dynamic_batch: bool = True  # pack micro-batches to max_tokens_per_micro_batch, balanced by tokens
    max_tokens_per_micro_batch: int | None = Field(None, ge=8)
    shuffle: bool = True

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_path_is_a_list(cls, value):
        # `--set data.train_files=x.jsonl` (or `train_files: x.jsonl`) means [x.jsonl], as in verl and Hydra
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _batches(self):
        if self.dynamic_batch:
            if self.max_tokens_per_micro_batch is None:
                object.__setattr__(self, "max_tokens_per_micro_batch", self.seq_len * self.micro_batch_size)
            if self.max_tokens_per_micro_batch < self.seq_len:
                raise ValueError(
                    f"data.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} is below "
                    f"data.seq_len={self.seq_len}: the longest sample would never fit; raise it"
                )
        elif self.max_tokens_per_micro_batch is not None:
            raise ValueError("data.max_tokens_per_micro_batch needs data.dynamic_batch: true")
        if self.micro_batch_size > self.global_batch_size:
            raise ValueError(
                f"data.micro_batch_size={self.micro_batch_size} exceeds data.global_batch_size="
                f"{self.global_batch_size}"
            )
        return self


# --------------------------------------------------------------------------------------------- trainer
class TrainerConfig(Section):
    steps: int = Field(100, ge=1)  # optimizer steps
    epochs: int | None = Field(None, ge=1)  # if set, steps = min(steps, epochs x steps per epoch)
    seed: int = 1234
    output_dir: str = "runs/job"
    save_every: int = Field(0, ge=0)  # steps between checkpoints; 0: only at the end and on a signal
    keep_last: int = Field(2, ge=1)  # checkpoints kept along the run's lineage (ckpt.checkpoint)
    # a step whose gradients are not finite (a NaN or inf loss) is skipped and counted (skipped_steps); this
    # many in a row end the run in one line, as the weights or the data have gone bad
    max_skipped_steps: int = Field(5, ge=1)
    resume: str = "auto"  # auto | never | <checkpoint dir>
    log_every: int = Field(1, ge=1)
    eval_every: int = Field(0, ge=0)
    tensorboard: bool = True
    deterministic: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Python's garbage collector runs after every this many optimizer steps, at the same step on every rank,
    # not whenever allocations trigger it (a collecting rank stalls the others at the next collective);
    # 0: Python's own schedule (mlite.runtime.collection)
    gc_every: int = Field(50, ge=0)
    # a phase of the loop (a step, an evaluation, a save) that takes longer ends the job with every thread's
    # stack in <output_dir>/hang/ (mlite.trainers.watchdog); null: never. startup_timeout_s: the same for
    # each phase of the start-up (process group, model, weights, data) and the first step (it compiles)
    hang_timeout_s: float | None = Field(1800.0, gt=0)
    startup_timeout_s: float | None = Field(3600.0, gt=0)

    @field_validator("output_dir")
    @classmethod
    def _output_dir_named(cls, value):  # '' is the working directory: checkpoints among the user's files
        if not value.strip():
            raise ValueError(f"empty (got {value!r}); name the run's folder, e.g. runs/my_job")
        return value


# --------------------------------------------------------------------------------------- rollout (RL)
class RolloutConfig(Section):
    engine: Literal["builtin", "vllm"] = "builtin"
    n: int = Field(8, ge=1)  # responses per prompt (the GRPO group)
    prompts_per_step: int = Field(8, ge=1)
    max_prompt_length: int = Field(512, ge=1)
    max_response_length: int = Field(1024, ge=1)
    tp: int = Field(1, ge=1)  # rollout engine tensor parallel
    span_nodes: bool = False  # vLLM only: allow an engine (rollout.tp GPUs) larger than one node
    # vLLM only, MoE models: the engine's ranks split the routed experts whole (vLLM's expert parallel) rather
    # than each expert's matrices; `auto`: on for a MoE model on an engine of several GPUs
    expert_parallel: Literal["auto"] | bool = "auto"
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # 0: off
    gpu_memory_utilization: float = Field(0.5, gt=0, lt=1)  # vLLM only: its share of the GPU when awake
    enforce_eager: bool = False  # vLLM only: no torch.compile or CUDA graphs (faster start, slower decode)
    # the sampler's log-probs against the trainer's forward of the same tokens (rollout/logprob_diff_*):
    # a token whose |difference| exceeds mismatch_threshold counts in rollout/logprob_diff_frac
    mismatch_threshold: float = Field(0.1, gt=0)
    # tis: each token's policy-gradient term times min(pi_trainer / pi_sampler, importance_cap)
    importance_correction: Literal["none", "tis"] = "none"
    importance_cap: float = Field(2.0, gt=0)
    # a response with a token whose log-probs differ by more than this many nats (or on which one side gives
    # no finite log-prob) is left out of the update and counted in rollout/vetoed_frac: no two healthy
    # engines differ by that much, a broken decode does (docs/GRPO.md). None: every response trains
    mismatch_veto: float | None = Field(None, gt=0)
    # held-out prompts (data.val_files): val_n responses each at val_temperature (0: greedy), mean reward
    val_n: int = Field(1, ge=1)
    val_temperature: float = Field(0.0, ge=0)
    # vLLM only: the trainer's gradients, optimizer state and master weights wait in pinned host memory from
    # the weight sync on, its weights once vLLM has them, and all come back after the rollout. `auto`: where
    # the rollout needs the room (the planner's choice, mlite.plan.memory)
    offload_trainer: Literal["auto"] | bool = "auto"
    v4_fp8_at_sync: bool = True  # vLLM, DeepSeek-V4: the sync sends wo_a as FP8 (false: vLLM quantises it)
    # vLLM, DeepSeek-V4: the sync sends every linear DeepSeek's release keeps in FP8, and the routed experts,
    # as block-FP8 (128x128, float32 scales): the engine holds about half the bytes of bf16. `auto`: where
    # bf16 weights do not fit vLLM's share (the planner's choice, mlite.plan.memory)
    fp8_weights: Literal["auto"] | bool = "auto"
    # vLLM, DeepSeek-V4: the trainer's forward rounds the linears that the engine multiplies in FP8 the way
    # the engine does (weights in 128x128 blocks, activations in 1x128 tiles, e4m3 with float32 scales), so
    # its log-probs are those of the model the sampler ran; the gradient passes the rounding unchanged
    match_fp8: bool = False

    @model_validator(mode="after")
    def _val_sampling(self):
        if self.offload_trainer is True and self.engine == "builtin":
            raise ValueError(
                "rollout.offload_trainer: true moves the trainer off the GPU while vLLM generates, and the "
                "built-in engine generates with the trainer's own weights; use rollout.engine vllm, or "
                "remove rollout.offload_trainer"
            )
        if self.fp8_weights is True and not self.v4_fp8_at_sync:
            raise ValueError(
                "rollout.fp8_weights: true has the weight sync quantise the linears, and "
                "rollout.v4_fp8_at_sync: false has vLLM quantise them; remove one of the two"
            )
        if self.val_n > 1 and self.val_temperature == 0:
            raise ValueError(
                f"rollout.val_n={self.val_n} with rollout.val_temperature 0 repeats one greedy answer "
                f"{self.val_n} times; set rollout.val_temperature > 0 (e.g. the rollout's) or rollout.val_n 1"
            )
        return self


class GRPOConfig(Section):
    """GRPO / DAPO algorithm knobs."""

    reward: str = "arithmetic"  # arithmetic | gsm8k | <module>:<function>
    adv_std_norm: bool = True  # divide group-centred rewards by the group std
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.28, ge=0)
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k3"] = "k3"
    kl_in_reward: bool = False
    entropy_coef: float = Field(0.0, ge=0)
    ppo_epochs: int = Field(1, ge=1)
    mini_batches: int = Field(1, ge=1)


# ------------------------------------------------------------------------------------------------ job
class JobConfig(Section):
    job: Literal["sft", "grpo"] = "sft"
    model: ModelConfig
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    recompute: RecomputeConfig = Field(default_factory=RecomputeConfig)
    offload: OffloadConfig = Field(default_factory=OffloadConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    rollout: RolloutConfig | None = None
    grpo: GRPOConfig | None = None

    @model_validator(mode="after")
    def _job_sections(self):
        if self.job == "grpo":
            if self.rollout is None:
                object.__setattr__(self, "rollout", RolloutConfig())
            if self.grpo is None:
                object.__setattr__(self, "grpo", GRPOConfig())
        elif self.rollout is not None or self.grpo is not None:
            raise ValueError("rollout / grpo sections apply to job: grpo only (this job is sft)")
        if self.trainer.device == "cuda" and self.cluster.gpu == "cpu":
            raise ValueError("trainer.device: cuda contradicts cluster.gpu: cpu; set cluster.gpu to the "
                             "GPU type (h100, h200, ...) or trainer.device to cpu")
        backend = backend_traits(self.optimizer.backend)
        if self.offload.params and not backend.params_to_host:
            raise ValueError(
                f"offload.params needs optimizer.backend: fsdp2 ({backend.runs} "
                "keeps parameters on the GPU); switch the backend or turn params offload off"
            )
        return self
