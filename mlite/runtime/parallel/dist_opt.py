"""The `dist_opt` optimizer backend: Megatron-Core's DistributedDataParallel + DistributedOptimizer wrapped
around our own model (CUDA only; megatron is imported inside `build_dist_opt`, never at module import).

    backend = build_dist_opt(model, dims, job)         # collective; torch.distributed up, model on its GPU
    schedule = LRSchedule(backend.optimizer, job.optimizer, total_steps)   # the lr of every fp32 shard
    for i, batch in enumerate(micro_batches):          # forward through `model` (or backend.ddp_model)
        with backend.no_sync() if i < len(micro_batches) - 1 else nullcontext():
            loss_fn(model(batch)).backward()           # grads land in Megatron's fp32 main_grad buffer
    grad_norm, skipped = backend.step()                # finish the reduce-scatter, clip, Adam, all-gather
    backend.zero_grad(); schedule.step()

What Megatron owns after wrapping:
- The parameters: cast to the compute dtype first (bf16), then moved by Megatron's DDP into one
  contiguous param buffer (the compute weights; no autocast is needed). fp32 master weights and Adam state
  exist only as this rank's shards inside the DistributedOptimizer (1/(dp x cp) of each).
- The gradients: each parameter's backward hook adds `param.grad` into an fp32 `main_grad` buffer
  (`grad_reduce_in_fp32`) and frees it; after the last micro-batch each bucket is reduce-scattered over
  dp x cp while the backward goes on (`overlap_grad_reduce`). `no_sync()` holds the reduction back for
  the other micro-batches (gradient accumulation: one reduce-scatter per step).
- The step: grad norm over all shards, clipping, AdamW on the shards, then an all-gather of the updated
  weights into every rank's param buffer.

Conventions mapped onto Megatron's switches:
- Our loss is each rank's share of the global loss (normalised by the step's global target count), so
  gradients are summed over ranks, never averaged: `calculate_per_token_loss=True` in the
  TransformerConfig makes Megatron's DDP scale by 1 and reduce with SUM.
- A step with a non-finite gradient is skipped (as LocalAdamW does): a constant loss scale of 1.0 turns on
  Megatron's found-inf check (all ranks agree) without changing any gradient (x 1.0 is exact).
- No weight decay on 1-D parameters (norms, biases), as LocalAdamW: Megatron's standard param groups mark
  them `wd_mult=0`; the group's `weight_decay` is set from it once here (Megatron's own LR scheduler would
  do it every step; ours only sets lr).
- Parameter attributes Megatron reads: `allreduce` (False = expert parameter, reduced over the expert
  data-parallel group), `shared` (skipped in the grad norm), `tensor_model_parallel` (TP shards). With
  ep = tp = 1 and a tied embedding listed once by `named_parameters`, the defaults (absent) are right, so
  our plain nn.Parameters are wrapped as they are.

Layouts: data parallel over dp x cp only (context parallel attention is the model's own, applied before
wrapping); tp, pp, ep and etp > 1 are refused. Checkpoints through DCP are not wired for this backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from mlite.errors import MliteError
from mlite.plan.rules import check_dist_opt_adapter
from mlite.runtime.parallel.megatron import NEEDS_MEGATRON, init_parallel_state
from mlite.runtime.parallel.mesh import ParallelDims

if TYPE_CHECKING:
    from mlite.config.arch import ModelArch
    from mlite.config.schema import JobConfig

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# ------------------------------------------------------------------------------ checks (CPU, no megatron)
def check_dist_opt_job(job: JobConfig, dims: ParallelDims) -> None:
    """What dist_opt refuses before anything is built: one line naming the key or degrees and the fix. The
    rules live in the rule book (`mlite.plan.rules.check_dist_opt_adapter`, the matrix's adapter column)."""
    check_dist_opt_adapter(job, dims)


def megatron_transformer_config(arch: ModelArch, dims: ParallelDims, compute: str):
    """The TransformerConfig Megatron's DDP and optimizer are built with. They read only the precision,
    the parallel sizes and `calculate_per_token_loss`; the shape fields describe our model for Megatron's
    logs. MoE fields are left out on purpose: routing and experts are ours, and Megatron's MoE settings
    bring checks (router, dispatcher, grouped GEMM) for modules that do not exist here."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,  # our MLP is act(gate(x)) * up(x)
        bf16=compute == "bf16",
        params_dtype=COMPUTE_DTYPES[compute],  # what the wrapped parameters are
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep,
        # our loss is already normalised by the global target count: sum gradients, do not average
        calculate_per_token_loss=True,
    )


# ------------------------------------------------------------------------------------------- the backend
class DistOptBackend:
    """The OptimizerBackend (mlite.runtime.optim) over Megatron-Core's DDP + DistributedOptimizer.

    `optimizer` is Megatron's optimizer. Its `param_groups` are the live groups of the inner torch AdamW
    over this rank's fp32 shards, so `LRSchedule(backend.optimizer, ...)` sets the lr exactly as for
    LocalAdamW: that is the way to set the lr per step. It is not a torch.optim.Optimizer: DCP checkpoints
    of this backend (Megatron's `sharded_state_dict`) are not wired yet."""

    def __init__(self, model: nn.Module, ddp_model, optimizer):
        self.model = model  # our module; its parameters now live in Megatron's param buffer
        self.ddp_model = ddp_model  # megatron.core.distributed.DistributedDataParallel around it
        self.optimizer = optimizer  # megatron.core.optimizer ChainedOptimizer(DistributedOptimizer)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.skipped_steps = 0

    def no_sync(self):
        """Context for every micro-batch but the last: gradients accumulate locally, no reduce-scatter."""
        return self.ddp_model.no_sync()

    def step(self) -> tuple[float, bool]:
        """Finish the gradient reduce-scatter, clip, update and all-gather the new weights. Returns (grad
        norm before clipping, skipped); a non-finite gradient on any rank skips the update on all (its norm
        is then not computed: nan)."""
        self.ddp_model.finish_grad_sync()
        updated, grad_norm, _ = self.optimizer.step()
        if not updated:
            self.skipped_steps += 1
            self.zero_grad()  # the skipped step's gradients must not leak into the next one
            return float("nan"), True
        return float(grad_norm), False

    def zero_grad(self) -> None:
        self.ddp_model.zero_grad_buffer()  # main_grad buffers and the buckets' per-step state
        self.optimizer.zero_grad()  # the fp32 shards' .grad views

    @property
    def main_shards(self) -> list[torch.Tensor]:
        """This rank's fp32 master shards, in the optimizer's order (what the determinism test compares)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]


def build_dist_opt(
    model: nn.Module, dims: ParallelDims, job: JobConfig, bucket_size: int | None = None
) -> DistOptBackend:
    """Wrap `model` (our decoder, mlite.runtime.models.Transformer, on this rank's GPU) in
    Megatron-Core's DDP + DistributedOptimizer (collective: every rank calls it). `bucket_size`: parameters
    per reduce-scatter bucket (Megatron's default, max(40M, 1M x dp), when None)."""
    check_dist_opt_job(job, dims)
    try:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    except ImportError as exc:
        raise MliteError(f"{NEEDS_MEGATRON} (import failed: {exc})") from None
    if not torch.cuda.is_available():
        raise MliteError(f"{NEEDS_MEGATRON} (no CUDA GPU is visible)")
    if not dist.is_initialized():
        raise MliteError(
            "optimizer.backend dist_opt: torch.distributed is not initialised; start with torchrun"
        )
    if dist.get_world_size() != dims.world_size:
        raise MliteError(f"layout is for {dims.world_size} ranks but {dist.get_world_size()} are running")
    off_gpu = sorted({str(p.device) for p in model.parameters() if p.device.type != "cuda"})
    if off_gpu:
        raise MliteError(
            "optimizer.backend dist_opt wraps a model on the GPU, "
            f"but parameters are on {', '.join(off_gpu)}; "
            "move the model to its rank's GPU first"
        )

    init_parallel_state(dims)
    compute, opt = job.precision.compute, job.optimizer
    model.to(COMPUTE_DTYPES[compute])  # the compute weights; fp32 masters are built from them below
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=job.precision.grad_reduce == "fp32",
        overlap_grad_reduce=True,
        use_distributed_optimizer=True,
        bucket_size=bucket_size,
        average_in_collective=False,  # SUM (with calculate_per_token_loss: no pre-scaling either)
    )
    config = megatron_transformer_config(model.arch, dims, compute)
    ddp_model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    ddp_model.broadcast_params()  # replicas start identical even if a rank's init drifted
    optimizer_config = OptimizerConfig(
        optimizer="adam",  # decoupled weight decay (AdamW) by default
        lr=opt.lr,
        min_lr=opt.min_lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.betas[0],
        adam_beta2=opt.betas[1],
        adam_eps=opt.eps,
        clip_grad=opt.clip_grad,
        bf16=compute == "bf16",
        params_dtype=torch.float32,  # master shards
        use_distributed_optimizer=True,
        loss_scale=1.0,  # turns on the found-inf check and skip; scaling by 1.0 changes nothing
    )
    # gloo groups serve Megatron's own checkpoint format only, which mlite does not use
    optimizer = get_megatron_optimizer(optimizer_config, [ddp_model], use_gloo_process_groups=False)
    for group in optimizer.param_groups:
        group["weight_decay"] = opt.weight_decay * group.get("wd_mult", 1.0)
    return DistOptBackend(model, ddp_model, optimizer)
