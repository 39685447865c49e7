"""The `dist_opt` optimizer backend: Megatron-Core's DistributedDataParallel + DistributedOptimizer wrapped
around our own model, under the layouts the rule book gives it (dp x cp, tp + sp, pp, vpp, ep). CUDA only;
megatron is imported inside `build_dist_opt`, never at module import.

    backend = build_dist_opt(chunks, dims, job, mesh)   # collective; process group up, chunks on their GPU
    schedule = LRSchedule(backend.optimizer, job.optimizer, total_steps)   # the lr of every fp32 shard
    loss_fn(model(batch)).backward()                     # per micro-batch: grads land in fp32 main_grad
    grad_norm, skipped = backend.step()                  # reduce-scatter, clip, Adam, all-gather
    backend.zero_grad(); schedule.step()

How our model meets Megatron. Megatron's DDP wants plain parameters it can move into one contiguous param
buffer and gradients it can accumulate into a `main_grad` buffer. Our layouts keep DTensor parameters (TP
shards over `tp`, experts over `ep`), which the model's forward and the TP plans need. So each parameter of
ours gets a plain twin of its local shape (the "shadow"), and Megatron wraps the shadows:
- storage: Megatron copies each shadow into its bf16 param buffer; our parameter is then re-pointed at the
  same storage (a plain one through `.data`, a DTensor one as a new DTensor parameter over the buffer view,
  registered on the modules that hold it), so the all-gather after each step updates the model in place;
- gradients: a post-accumulate-grad hook on each of our parameters adds its local gradient into the
  twin's `main_grad` and frees it. A replicated DTensor's partial gradient (an RMSNorm weight under sequence
  parallel) is first reduced to its placement over `tp`; a MoE block's router (a plain parameter that sees
  this tp rank's tokens only) is summed over `tp` (FSDP2 shards it over dp_cp_tp for the same reason);
- Megatron's attributes on the twins: `allreduce=False` for expert weights (reduced over the expert
  data-parallel group, which spans tp, as our `edp` mesh does), `tensor_model_parallel` + `partition_dim`
  for TP shards (the grad norm counts each element once: replicas only on tp rank 0).
The reduction overlaps the backward (`optimizer.overlap_grad_reduce`, on by default): the runtime says
which backward is the step's last for each chunk (`set_gradient_sync`, as it tells FSDP2), and in that
backward a bucket's reduce-scatter starts as soon as its last gradient has landed, while the backward goes
on. The count of gradients a bucket receives in the last backward is learnt in the first step, whose
reductions all start at the step; one that receives fewer in a later step (a parameter without a
gradient) is reduced at the step too. Off, everything is reduced at the step. Both give the same bits:
the same buckets are summed in the same order.

What Megatron owns after wrapping: the bf16 compute weights (its param buffer); fp32 master weights and
Adam state exist only as this rank's shards in the DistributedOptimizer (1/(dp x cp) of each dense tensor,
1/edp of each expert tensor). The step: grad norm over all shards, clipping, AdamW on the shards, then an
all-gather of the updated weights into every rank's param buffer. Under `optimizer.overlap_param_gather`
(on by default) the step only starts the all-gathers, and the next forward waits for each bucket group in
a pre-forward hook of the first module that reads it, so the gathers run under the forward's compute;
anything else that reads the weights first calls `finish_param_gather` (the Runtime does).

Conventions mapped onto Megatron's switches:
- Our loss is each rank's share of the global loss (normalised by the step's global target count), so
  gradients are summed over ranks, never averaged: `calculate_per_token_loss=True` in the
  TransformerConfig makes Megatron's DDP scale by 1 and reduce with SUM.
- A step with a non-finite gradient is skipped (as LocalAdamW does), decided on the GPU where Megatron's
  inner optimizer is torch's AdamW (no Transformer Engine or Apex): the backend takes the grad norm over
  Megatron's groups as a device tensor and hands the clipping factor and the skip flag to torch's fused
  AdamW kernel (GradScaler's `grad_scale` / `found_inf` protocol), so the host queues the update and the
  all-gathers without waiting for the backward; Megatron's own step reads the found-inf flag and the norm
  on the host. With TE's or Apex's FusedAdam Megatron steps itself: a constant loss scale of 1.0 turns on
  its found-inf check (all ranks agree) without changing any gradient (x 1.0 is exact).
- No weight decay on 1-D parameters (norms, biases), as LocalAdamW: Megatron's standard param groups mark
  them `wd_mult=0`; the group's `weight_decay` is set from it once here.

Checkpoints: `checkpoint_state` / `load_checkpoint_state` speak the layout-independent format of
mlite.runtime.state (model tensors are the fp32 masters under the whole model's names and global shapes,
the optimizer state is torch AdamW's `exp_avg`/`exp_avg_sq`/`step` under the same names, and the buffers
no optimizer holds), so a dist_opt run resumes as fsdp2 and the other way round. Saving gathers each master
and moment over its data-parallel group into this rank's TP/EP-local shape (one tensor at a time on the
GPU, held on the GPU until DCP writes). Megatron's shards split each bucket's flat buffer, not each
parameter, so a rank may own none of a parameter: it still joins that parameter's reduction.

Host offload (`offload_to_host` / `reload_to_device`, mlite.runtime.backends.base): the bf16 weights and the
fp32 gradients are Megatron's contiguous buffers, which every parameter and bucket views, so their storage
is copied to the host and freed in place, every view kept (Megatron's own offload does the same); nothing
reads the weights until they are reloaded (`weights_current` refuses). The fp32 master shards and Adam's
moments move to the host as tensors of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from mlite.config.arch import ModelArch
from mlite.config.schema import JobConfig
from mlite.errors import MliteError
from mlite.plan import Plan
from mlite.plan.policy import grad_reduce_dtype
from mlite.plan.rules import check_dist_opt_adapter
from mlite.runtime.adapters.megatron_core import shard_slice
from mlite.runtime.backends.base import BackendBase, HeldModel, ParkedStorages
from mlite.runtime.optim import clip_coef
from mlite.runtime.parallel.megatron import (
    NEEDS_MEGATRON,
    foreach_l2_norm,
    init_parallel_state,
    use_sync_free_fallbacks,
)
from mlite.runtime.parallel.mesh import ParallelDims, ParallelMesh
from mlite.runtime.parallel.parallelize import COMPUTE_DTYPES, blocks, is_moe, parameter_holders


# ------------------------------------------------------------------------------ checks (CPU, no megatron)
def check_dist_opt_job(job: JobConfig, dims: ParallelDims) -> None:
    """What dist_opt refuses before anything is built: one line naming the key or degrees and the fix. The
    rules live in the rule book (`mlite.plan.rules.check_dist_opt_adapter`, the matrix's adapter column)."""
    check_dist_opt_adapter(job, dims)


def megatron_transformer_config(arch: ModelArch, dims: ParallelDims, compute: str):
    """The TransformerConfig Megatron's DDP and optimizer are built with. They read only the precision,
    the parallel sizes and `calculate_per_token_loss`; the shape fields describe our model for Megatron's
    logs. Of the MoE fields only the expert counts are given (Megatron refuses expert parallel without
    them); routing and experts are ours."""
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
        pipeline_dtype=COMPUTE_DTYPES[compute],  # required with pp > 1 (our runner sends its own dtype)
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.etp,
        # the expert counts only: Megatron checks them against ep (routing and experts are ours)
        num_moe_experts=arch.moe.num_experts if arch.moe else None,
        moe_router_topk=arch.moe.top_k if arch.moe else 2,
        moe_ffn_hidden_size=arch.moe.expert_ffn if arch.moe else None,
        add_bias_linear=False,  # describes Megatron's own layers, none of which exist here
        # our loss is already normalised by the global target count: sum gradients, do not average
        calculate_per_token_loss=True,
    )


# ------------------------------------------------------------------------------------------- the backend
@dataclass
class Twin:
    """One parameter of ours and the plain parameter Megatron wraps in its place."""

    name: str  # the whole model's name (the same under every layout)
    param: nn.Parameter  # ours: plain, or a DTensor over tp / ep; its local storage is Megatron's buffer
    shadow: nn.Parameter  # Megatron's: plain, the local shape; `main_grad` is its fp32 gradient
    tp_sum: bool  # its local gradient is partial over tp (a MoE router under sequence parallel)
    chunk: int = 0  # the pipeline chunk it belongs to (0 without pipeline parallel)
    bucket_group: Any = None  # Megatron's bucket group whose reduce-scatter carries its gradient


class DistOptBackend(BackendBase):
    """The OptimizerBackend (mlite.runtime.backends.base) over Megatron-Core's DDP + DistributedOptimizer.

    `optimizer` is Megatron's optimizer. Its `param_groups` are the live groups of the inner torch AdamW
    over this rank's fp32 shards, so `LRSchedule(backend.optimizer, ...)` sets the lr exactly as for
    LocalAdamW: that is the way to set the lr per step. `held`: the model as the runtime holds it (default:
    the chunks alone, for a backend built outside a runtime)."""

    name = "dist_opt"

    def __init__(self, chunks: dict[int, nn.Module], ddps: list, optimizer, twins: list[Twin],
                 tp_group: dist.ProcessGroup | None, overlap: bool, overlap_gather: bool = False,
                 clip_grad: float = 0.0, on_device: bool = False, held: HeldModel | None = None):
        BackendBase.__init__(self, held or HeldModel.of_chunks(chunks))
        self._weights_parked, self._grads_parked = ParkedStorages(), ParkedStorages()
        self.chunks = chunks  # our modules; their parameters now live in Megatron's param buffers
        self.ddps = ddps  # megatron.core.distributed.DistributedDataParallel, one per chunk
        self.optimizer = optimizer  # megatron.core.optimizer ChainedOptimizer(DistributedOptimizer, ...)
        self.twins = twins
        self.params = [t.param for t in twins]
        self.tp_group = tp_group
        self.skipped_steps = 0
        self.overlap = overlap
        self.bucket_groups = [group for ddp in ddps
                              for group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups]
        self._last_backward = {chunk: True for chunk in chunks}  # the next backward is the step's last
        self._landed: dict[Any, int] = {}  # bucket group -> gradients landed in this step's last backward
        self._expected: dict[Any, int] = {}  # the same, learnt in the first step (the trigger count)
        self._started: list = []  # bucket groups whose reduce-scatter the backward started, in order
        self.overlapped_buckets = 0  # of the last step: how many bucket groups reduced during the backward
        self.overlap_gather = overlap_gather
        self._gathering: set = set()  # bucket groups whose all-gather of the new weights is in flight
        self._gather_order: list = []  # every bucket group, in the order the forward first reads them
        self.clip_grad = clip_grad
        # the step decided on the GPU (torch's fused AdamW inside Megatron's optimizer): no host read
        self.on_device = on_device
        for twin in twins:
            twin.param.register_post_accumulate_grad_hook(self._grad_hook(twin))
        if overlap_gather:
            for index, chunk in chunks.items():
                self._hook_param_gather(chunk, [t for t in twins if t.chunk == index])

    @classmethod
    def build(cls, plan: Plan, held: HeldModel, dims: ParallelDims) -> DistOptBackend:
        return build_dist_opt(held.chunks, dims, plan.job, held.mesh, held=held)

    @property
    def ddp_model(self):
        """The DDP of the first chunk (the whole model without pipeline parallel)."""
        return self.ddps[0]

    def set_gradient_sync(self, chunk: int, last: bool) -> None:
        """Whether the next backward through `chunk` is the step's last (the runtime says so before each,
        as it tells FSDP2): only then may a bucket's reduce-scatter start during the backward."""
        self._last_backward[chunk] = last

    def _grad_hook(self, twin: Twin):
        def to_main_grad(param: torch.Tensor) -> None:
            grad = param.grad
            if isinstance(grad, DTensor):
                if grad.placements != param.placements:  # a replica's partial gradient: reduce it over tp
                    grad = grad.redistribute(param.device_mesh, param.placements)
                grad = grad.to_local()
            if twin.tp_sum:  # in place: the gradient is dropped below
                dist.all_reduce(grad, group=self.tp_group)
            twin.shadow.main_grad.add_(grad)
            param.grad = None
            if self.overlap and self._last_backward[twin.chunk]:
                self._landed_in(twin.bucket_group)

        return to_main_grad

    def _landed_in(self, group) -> None:
        """One more gradient of the last backward in `group`'s buffer: start its reduce-scatter (async, on
        NCCL's stream) once all have landed. The launch order is the backward's, the same on every rank."""
        if group in self._started:
            raise MliteError(
                "dist_opt: a gradient landed in a bucket whose reduce-scatter had started; a backward ran "
                "after the one the runtime was told was the step's last (set optimizer.overlap_grad_reduce: "
                "false to reduce at the step)"
            )
        landed = self._landed[group] = self._landed.get(group, 0) + 1
        if landed == self._expected.get(group):
            group.start_grad_sync()
            self._started.append(group)

    def _hook_param_gather(self, chunk: nn.Module, twins: list[Twin]) -> None:
        """Under optimizer.overlap_param_gather the step only starts the all-gathers of the new weights; the
        next forward waits for each bucket group just before the first module that reads its weights: the
        chunk's own pre-forward for what comes before the layers (the embedding), each block's for its own,
        and the last layer's post-forward for what comes after them (final norm, LM head, MTP's extras).
        Block-level hooks stay outside the compiled block bodies, as FSDP2's do."""
        layers = blocks(chunk)
        in_block = {id(p): i for i, layer in enumerate(layers) for p in layer.parameters()}
        order = {id(p): i for i, p in enumerate(chunk.parameters())}
        first_block = min((order[i] for i in in_block), default=len(order))
        before, per_block, after = [], [[] for _ in layers], []
        for twin in twins:
            pid = id(twin.param)
            if pid in in_block:
                where = per_block[in_block[pid]]
            else:
                where = before if order[pid] < first_block else after
            if twin.bucket_group not in where:
                where.append(twin.bucket_group)
        for groups in (before, *per_block, after):
            self._gather_order += [g for g in groups if g not in self._gather_order]
        chunk.register_forward_pre_hook(lambda *_: self._await_gather(before))
        for layer, groups in zip(layers, per_block, strict=True):
            layer.register_forward_pre_hook(lambda *_, groups=groups: self._await_gather(groups))
        last_layer = list(chunk.layers.values())[-1]
        last_layer.register_forward_hook(lambda *_: self._await_gather(after))

    def _await_gather(self, groups) -> None:
        for group in groups:
            if group in self._gathering:
                group.finish_param_sync(skip_next_bucket_dispatch=True)  # waits on its NCCL work
                self._gathering.discard(group)

    @property
    def gathers_in_flight(self) -> int:
        """Bucket groups whose all-gather the last step started and no forward has waited for yet."""
        return len(self._gathering)

    def finish_param_gather(self) -> None:
        """Wait for every all-gather the last step started: before anything reads the weights outside a
        training forward (checkpoints, export, rollout sync; the Runtime calls it) and before the next
        step writes the param buffers."""
        self._await_gather(list(self._gathering))

    def weights_current(self) -> None:
        """The last step's weights, landed (`finish_param_gather`); refused while they are on the host."""
        if self._weights_parked.parked:
            raise MliteError("dist_opt: the weights are offloaded to the host; reload_to_device() first")
        self.finish_param_gather()

    def _start_param_gather(self) -> None:
        """Start every bucket group's all-gather of the updated weights, async on NCCL's stream, in the
        order the forward reads them (dense and expert buckets interleaved as the layers use them)."""
        for group in self._gather_order:
            group.start_param_sync()
            self._gathering.add(group)

    def step(self) -> tuple[torch.Tensor | float, torch.Tensor | bool]:
        """Reduce-scatter the gradients (wait for those the backward started), clip, update and all-gather
        the new weights (under overlap_param_gather: start the all-gathers, which the next forward's hooks
        wait for). Returns (grad norm before clipping, skipped); a non-finite gradient on any rank skips the
        update on all. Decided on the GPU (`on_device`) both are 0-dim tensors, read when logged; else
        floats from Megatron's step (the norm of a skipped step is then not computed: nan)."""
        self.finish_param_gather()  # the step writes the param buffers the all-gathers write into
        for group in self.bucket_groups:
            if group not in self._started:
                group.start_grad_sync()  # async under overlap; reduced right here without it
            if self.overlap:
                group.finish_grad_sync()  # waits for it
        self.overlapped_buckets = len(self._started)
        if self.overlap and not self._expected:  # the first step: learn each bucket's count
            self._expected = dict(self._landed)
        self._landed, self._started = {}, []
        if self.on_device:
            grad_norm, skipped = self._update_on_device()
            if self.overlap_gather:  # a skipped update gathers the unchanged weights: the same bits
                self._start_param_gather()
            self.skipped_steps = self.skipped_steps + skipped.long()
            return grad_norm, skipped
        updated, grad_norm, _ = self.optimizer.step()
        if updated and self.overlap_gather:
            self._start_param_gather()
        if not updated:
            self.skipped_steps += 1
            self.zero_grad()  # the skipped step's gradients must not leak into the next one
            return float("nan"), True
        return float(grad_norm), False

    def _update_on_device(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Megatron's step without its two host reads: the gradients into the fp32 shards (no grad scaler,
        so no found-inf read), the norm over Megatron's groups as a tensor, then each inner fused AdamW
        divides every gradient by 1 / the clipping factor as it reads it and drops the whole update where
        the norm is not finite (`arm_fused_step`); Megatron then copies the shards into the param buffer."""
        self.optimizer.prepare_grads()
        norm = self._grad_norm()
        skipped = ~torch.isfinite(norm)
        grad_scale = 1.0 / clip_coef(norm, self.clip_grad) if self.clip_grad > 0 else None
        for opt in self.optimizer.chained_optimizers:
            if opt.optimizer is not None:  # None: Megatron's stub (this rank holds none of its parameters)
                arm_fused_step(opt.optimizer, grad_scale, skipped.float())
        self.optimizer.step_with_ready_grads()
        return norm, skipped

    def _grad_norm(self) -> torch.Tensor:
        """The L2 norm Megatron's ChainedOptimizer takes (each optimizer's main gradients without tp
        duplicates, squared sums reduced over its grad-stats group, one reduction per group), left on the
        GPU."""
        local: dict[Any, torch.Tensor] = {}
        for opt in self.optimizer.chained_optimizers:
            grads = opt.get_main_grads_for_grad_norm()
            group = opt.get_grad_stats_parallel_group()
            squares = (foreach_l2_norm(0, None, [grads], False)[0] ** 2 if grads
                       else torch.zeros(1, device=torch.cuda.current_device()))
            local[group] = local[group] + squares if group in local else squares
        total = []
        for group, squares in local.items():
            dist.all_reduce(squares, group=group)
            total.append(squares)
        return torch.stack(total).sum().sqrt()

    def zero_grad(self) -> None:
        self._landed, self._started = {}, []
        for ddp in self.ddps:
            ddp.zero_grad_buffer()  # main_grad buffers and the buckets' per-step state
        self.optimizer.zero_grad()  # the fp32 shards' .grad views
        for param in self.params:
            param.grad = None

    @property
    def main_shards(self) -> list[torch.Tensor]:
        """This rank's fp32 master shards, in the optimizer's order (what the determinism test compares)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    # ------------------------------------------------------------------------------------ checkpoints
    def _owner(self, shadow: nn.Parameter):
        """The DistributedOptimizer (of the chain: dense, experts) whose buffers hold this shadow. A rank owns
        a shard of some parameters only (the shards split the flat buffer), so the buffers' whole index is
        asked, not the rank's shard map."""
        for opt in self.optimizer.chained_optimizers:
            if any(shadow in buffer.param_index_map for buffer in opt.buffers):
                return opt
        raise MliteError("dist_opt: a parameter is in no optimizer's buffer; a runtime bug")

    def _shard_state(self, shadow: nn.Parameter) -> tuple[Any, dict[str, torch.Tensor] | None, slice]:
        """(its optimizer, {param, exp_avg, exp_avg_sq, step} of this rank's shard, the shard's slice of the
        flattened local tensor); the state is None and the slice empty where this rank owns no element of
        it. Adam's state is created (zeros, step 0) where no step has run yet."""
        opt = self._owner(shadow)
        if shadow not in opt.model_param_gbuf_map:  # another rank of the data-parallel group owns all of it
            return opt, None, slice(0, 0)
        group_index, group_order = opt.model_param_group_index_map[shadow]
        main = opt.optimizer.param_groups[group_index]["params"][group_order]
        state = opt.optimizer.state[main]
        if not state:  # the fused kernel keeps Adam's step count on the device
            step = torch.zeros((), dtype=torch.float32, device=main.device if self.on_device else "cpu")
            state.update(step=step, exp_avg=torch.zeros_like(main),
                         exp_avg_sq=torch.zeros_like(main))
        return opt, {"param": main, **state}, shard_slice(opt, shadow)  # Megatron keeps no public getter

    def checkpoint_state(self) -> dict[str, Any]:
        """{"model", "optimizer"} in the layout-independent format (module docstring): each master
        and moment gathered over its data-parallel group into this rank's local shape, a DTensor over the
        parameter's own tp / ep mesh (DCP writes one copy of what several ranks hold). Collective: every
        rank of a data-parallel group reduces every parameter, whether it owns a shard of it or not."""
        self.finish_param_gather()
        model, state = {}, {}
        for twin in self.twins:
            opt, shard, span = self._shard_state(twin.shadow)
            # the master and both moments in one collective; Adam's step (the same on every owner) apart
            packed = torch.zeros(3, twin.shadow.numel(), dtype=torch.float32, device=twin.shadow.device)
            step = torch.zeros(1, dtype=torch.float32, device=twin.shadow.device)
            if shard is not None:
                for row, key in enumerate(("param", "exp_avg", "exp_avg_sq")):
                    packed[row, span] = shard[key].float()
                step.fill_(float(shard["step"]))
            dist.all_reduce(packed, group=opt.data_parallel_group)  # each element held by one rank: exact
            dist.all_reduce(step, op=dist.ReduceOp.MAX, group=opt.data_parallel_group)
            main, exp_avg, exp_avg_sq = (self._as_param(twin, packed[row]) for row in range(3))
            model[twin.name] = main
            state[twin.name] = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq,
                                "step": torch.tensor(float(step))}
        model |= self.outside_optimizer(model)
        groups = [{**self._group_options(decay), "params": [t.name for t in self.twins
                                                            if (t.param.ndim >= 2) == decay]}
                  for decay in (True, False)]
        optim = {"state": state, "param_groups": [g for g in groups if g["params"]]}
        return {"model": model, "optimizer": optim}

    def load_checkpoint_state(self, tensors: dict[str, Any], meta: dict | None = None) -> None:
        """Put what `checkpoint_template`'s tensors read back from a checkpoint into Megatron's shards
        (masters, moments, step: where this rank owns a shard; the masters alone without "optimizer") and its
        bf16 param buffer (the compute weights, rounded from the masters: every rank), and the counters of
        `meta` where given."""
        self._load_shards(tensors["model"], tensors.get("optimizer"))
        if meta is not None:
            self._restore_counters(meta)

    def _load_shards(self, model: dict[str, Any], optim: dict[str, Any] | None) -> None:
        self.finish_param_gather()  # the load writes the param buffers
        with torch.no_grad():
            for twin in self.twins:
                master = _local(model[twin.name])
                twin.shadow.data.copy_(master.view_as(twin.shadow))
                _, shard, span = self._shard_state(twin.shadow)
                if shard is None:
                    continue
                shard["param"].copy_(master.reshape(-1)[span])
                if optim is None:
                    continue
                saved = optim["state"][twin.name]
                for key in ("exp_avg", "exp_avg_sq"):
                    shard[key].copy_(_local(saved[key]).reshape(-1)[span])
                shard["step"].fill_(float(saved["step"]))

    def _as_param(self, twin: Twin, flat: torch.Tensor) -> torch.Tensor:
        local = flat.view(twin.shadow.shape)
        if not isinstance(twin.param, DTensor):
            return local
        return DTensor.from_local(local, twin.param.device_mesh, twin.param.placements, run_check=False,
                                  shape=twin.param.shape, stride=twin.param.stride())

    def _group_options(self, decay: bool) -> dict[str, Any]:
        """torch AdamW's group options, as LocalAdamW's groups save them (fused, as on GPUs)."""
        inner = self.optimizer.param_groups[0]
        wd = max(g["weight_decay"] for g in self.optimizer.param_groups) if decay else 0.0
        return {"weight_decay": wd, "lr": inner["lr"], "betas": inner["betas"], "eps": inner["eps"],
                "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                "differentiable": False, "fused": True, "decoupled_weight_decay": True}

    def checkpoint_template(self, weights_only: bool = False) -> dict[str, Any]:
        """Tensors of `checkpoint_state`'s names, shapes and placements for DCP to read into (the tensors
        outside the optimizer are the live ones: DCP reads into them in place); the model's alone with
        `weights_only`."""
        model, state = {}, {}
        for twin in self.twins:
            empty = [self._as_param(twin, torch.empty(twin.shadow.numel(), dtype=torch.float32,
                                                      device=twin.shadow.device)) for _ in range(3)]
            model[twin.name] = empty[0]
            state[twin.name] = {"exp_avg": empty[1], "exp_avg_sq": empty[2], "step": torch.tensor(0.0)}
        model |= self.outside_optimizer(model)
        return {"model": model} if weights_only else {"model": model, "optimizer": {"state": state}}

    def outside_optimizer(self, model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model state under the names fsdp2's checkpoints have that the twins' names miss: a tied
        matrix's second name (the same tensor as its first in `model`), persistent buffers (a MoE router's
        load-balancing bias, a hash-routing table) and frozen parameters (the live tensors)."""
        twin_names = {id(t.param): t.name for t in self.twins}
        found = {}
        for chunk in self.chunks.values():
            for name, tensor in chunk.state_dict(keep_vars=True).items():  # no copies
                if name in model:
                    continue
                found[name] = model[twin_names[id(tensor)]] if id(tensor) in twin_names else tensor.detach()
        return found

    # ------------------------------------------------------------------------------------------ the host
    def _settle(self) -> None:
        self.finish_param_gather()  # the all-gathers write into the buffers parked next

    def _offload_model(self, host: torch.device, weights: bool, grads: bool) -> int:
        """Megatron's param buffers (and any frozen parameter) and its grad buffers, parked on the host."""
        moved = 0
        if weights:
            params = [_local(p) for chunk in self.chunks.values() for p in chunk.parameters()]
            moved += self._weights_parked.park(params, host)
        if grads:
            moved += self._grads_parked.park([t.shadow.main_grad for t in self.twins], host)
        return moved

    def _reload_model(self, weights: bool, grads: bool) -> None:
        if weights:
            self._weights_parked.unpark()
        if grads:
            self._grads_parked.unpark()

    def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
        """The inner torch AdamWs of Megatron's chain (None: a stub, this rank holds none of its shards)."""
        return [opt.optimizer for opt in self.optimizer.chained_optimizers if opt.optimizer is not None]

    def _master_params(self) -> list[torch.Tensor]:
        return self.main_shards


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _shard_dim(param: torch.Tensor, mesh_name: str) -> int | None:
    """The dim a DTensor parameter is split on over the mesh dimension `mesh_name`, None where it is not."""
    if not isinstance(param, DTensor) or mesh_name not in (param.device_mesh.mesh_dim_names or ()):
        return None
    placement = param.placements[param.device_mesh.mesh_dim_names.index(mesh_name)]
    return placement.dim if placement.is_shard() else None


def fuse_torch_adam(optimizer: torch.optim.Optimizer) -> None:
    """Switch torch's Adam(W) to its fused kernel (same update and state; Adam's step count on the
    device), the one that takes `grad_scale` and `found_inf` tensors. Before its first step."""
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = True, False


def arm_fused_step(optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor | None,
                   found_inf: torch.Tensor) -> None:
    """The next step of a fused torch Adam(W) divides each gradient by `grad_scale` as it reads it and is
    dropped, step count included, where `found_inf` is 1: torch's own protocol for GradScaler (the
    optimizer's step reads these two attributes), so the decision stays on the device."""
    optimizer.grad_scale = grad_scale
    optimizer.found_inf = found_inf


def cast_parameters(module: nn.Module, dtype: torch.dtype) -> None:
    """The parameters in `dtype`, registered where the old ones were (a tied matrix stays one); buffers keep
    theirs, as under FSDP2's mixed precision (a router's fp32 load-balancing bias must not round to bf16)."""
    with torch.no_grad():
        for holders in parameter_holders(module).values():
            old = getattr(*holders[0])
            new = nn.Parameter(old.detach().to(dtype), requires_grad=old.requires_grad)
            for holder, name in holders:
                holder.register_parameter(name, new)


def build_dist_opt(
    chunks: dict[int, nn.Module] | nn.Module,
    dims: ParallelDims,
    job: JobConfig,
    mesh: ParallelMesh | None = None,
    held: HeldModel | None = None,
) -> DistOptBackend:
    """Wrap this rank's model (or its pipeline chunks, by chunk index), laid out without FSDP2 and on this
    rank's GPU, in Megatron-Core's DDP + DistributedOptimizer (collective: every rank calls it). `mesh`:
    the run's meshes (needed under tp: a router's gradient is summed over `tp`); `held`: the model as the
    runtime holds it."""
    check_dist_opt_job(job, dims)
    megatron = _megatron_modules()
    chunks = chunks if isinstance(chunks, dict) else {0: chunks}
    _check_runnable(chunks, dims)
    init_parallel_state(dims)
    use_sync_free_fallbacks()  # without TE or Apex, Megatron's own fallback syncs once per tensor a step
    opt = job.optimizer
    # torch's AdamW inside Megatron (no TE or Apex) can take the clip and the skip on the device
    on_device = megatron.optimizer.USING_PYTORCH_OPTIMIZER
    ddp_config = megatron.DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_dtype(job) == "fp32",
        # async reduce-scatters: the backend starts each bucket's in the step's last backward (its hooks, not
        # Megatron's: Megatron's would watch the shadows, which autograd never reaches)
        overlap_grad_reduce=opt.overlap_grad_reduce,
        # the step starts the all-gathers of the new weights and the next forward waits for each bucket
        # group where it first reads it (the backend's hooks on our modules: Megatron's watch the shadows)
        overlap_param_gather=opt.overlap_param_gather,
        use_distributed_optimizer=True,
        average_in_collective=False,  # SUM (with calculate_per_token_loss: no pre-scaling either)
    )
    tp_group = mesh.group("tp") if mesh is not None and dims.tp > 1 else None
    twins: list[Twin] = []
    ddps = []
    for index, (chunk_index, chunk) in enumerate(sorted(chunks.items())):
        cast_parameters(chunk, COMPUTE_DTYPES[job.precision.compute])  # the compute weights (masters: fp32)
        chunk_twins, shadows = _twins_of(chunk, chunk_index, tp_group, megatron)
        ddp = megatron.DistributedDataParallel(
            config=megatron_transformer_config(chunk.arch, dims, job.precision.compute),
            ddp_config=ddp_config, module=shadows, disable_bucketing=index > 0)
        ddp.broadcast_params()  # replicas start identical even if a rank's init drifted
        for twin in chunk_twins:
            twin.bucket_group = ddp.param_to_bucket_group[twin.shadow]
        _onto_megatron_buffers(chunk, chunk_twins)
        twins += chunk_twins
        ddps.append(ddp)
    optimizer = _megatron_optimizer(megatron, ddps, job, on_device)
    return DistOptBackend(chunks, ddps, optimizer, twins, tp_group, opt.overlap_grad_reduce,
                          opt.overlap_param_gather, clip_grad=opt.clip_grad, on_device=on_device, held=held)


def _megatron_modules():
    """The pieces of Megatron-Core the build uses (imported here only: a CPU install never needs them)."""
    from types import SimpleNamespace

    try:
        from megatron.core import optimizer
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
    except ImportError as exc:
        raise MliteError(f"{NEEDS_MEGATRON} (import failed: {exc})") from None
    return SimpleNamespace(optimizer=optimizer, DistributedDataParallel=DistributedDataParallel,
                           DistributedDataParallelConfig=DistributedDataParallelConfig,
                           OptimizerConfig=OptimizerConfig, get_megatron_optimizer=get_megatron_optimizer,
                           set_tensor_model_parallel_attributes=set_tensor_model_parallel_attributes)


def _check_runnable(chunks: dict[int, nn.Module], dims: ParallelDims) -> None:
    """A GPU, the process group of the layout's world, and every parameter on this rank's GPU."""
    if not torch.cuda.is_available():
        raise MliteError(f"{NEEDS_MEGATRON} (no CUDA GPU is visible)")
    if not dist.is_initialized():
        raise MliteError(
            "optimizer.backend dist_opt: torch.distributed is not initialised; start with torchrun"
        )
    if dist.get_world_size() != dims.world_size:
        raise MliteError(f"layout is for {dims.world_size} ranks but {dist.get_world_size()} are running")
    off_gpu = sorted({str(_local(p).device) for c in chunks.values() for p in c.parameters()
                      if _local(p).device.type != "cuda"})
    if off_gpu:
        raise MliteError(
            "optimizer.backend dist_opt wraps a model on the GPU, "
            f"but parameters are on {', '.join(off_gpu)}; "
            "move the model to its rank's GPU first"
        )


def _twins_of(chunk: nn.Module, chunk_index: int, tp_group: dist.ProcessGroup | None, megatron
              ) -> tuple[list[Twin], nn.Module]:
    """One plain twin per trainable parameter of the chunk, with Megatron's attributes, and the module that
    registers them (what Megatron's DDP wraps)."""
    moe = [layer.mlp for layer in blocks(chunk) if is_moe(layer)]
    experts = {id(p) for mlp in moe for p in mlp.experts.parameters()}
    routers = {id(p) for mlp in moe for p in mlp.parameters()} - experts if tp_group else set()
    shadows = nn.Module()
    twins = []
    for i, (name, param) in enumerate(chunk.named_parameters()):
        if not param.requires_grad:
            continue
        shadow = nn.Parameter(_local(param).detach())
        shadow.allreduce = id(param) not in experts  # False: reduced over the expert data-parallel group
        tp_dim = _shard_dim(param, "tp")
        if tp_dim is not None:
            megatron.set_tensor_model_parallel_attributes(shadow, True, tp_dim, 1)
        shadows.register_parameter(f"p{i}", shadow)
        tp_sum = id(param) in routers and not isinstance(param, DTensor)
        twins.append(Twin(name, param, shadow, tp_sum, chunk=chunk_index))
    return twins, shadows


def _onto_megatron_buffers(chunk: nn.Module, twins: list[Twin]) -> None:
    """Our parameters onto Megatron's param buffer (their twins' storage): the all-gather updates them."""
    holders = parameter_holders(chunk)
    for twin in twins:
        if isinstance(twin.param, DTensor):
            param = nn.Parameter(DTensor.from_local(
                twin.shadow.data, twin.param.device_mesh, twin.param.placements, run_check=False,
                shape=twin.param.shape, stride=twin.param.stride()))
            for module, attr in holders[id(twin.param)]:
                module.register_parameter(attr, param)
            twin.param = param
        else:
            twin.param.data = twin.shadow.data


def _megatron_optimizer(megatron, ddps: list, job: JobConfig, on_device: bool):
    """Megatron's DistributedOptimizer chain over the DDPs' buffers: AdamW on fp32 master shards."""
    opt, compute = job.optimizer, job.precision.compute
    optimizer_config = megatron.OptimizerConfig(
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
        # Megatron's own step: a loss scale of 1.0 turns on its found-inf check and skip (x 1.0 changes
        # nothing); stepped on the device the backend decides the skip itself
        loss_scale=None if on_device else 1.0,
    )
    # gloo groups serve Megatron's own checkpoint format only, which mlite does not use
    optimizer = megatron.get_megatron_optimizer(optimizer_config, ddps, use_gloo_process_groups=False)
    for group in optimizer.param_groups:
        group["weight_decay"] = opt.weight_decay * group.get("wd_mult", 1.0)
    if on_device:
        for chained in optimizer.chained_optimizers:
            if chained.optimizer is not None:  # None: a stub (this rank holds none of its parameters)
                fuse_torch_adam(chained.optimizer)
    return optimizer
