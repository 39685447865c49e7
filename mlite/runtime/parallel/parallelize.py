"""Apply a parallel layout to a decoder, in a fixed order: tensor (+sequence) parallel, the attention core
(context parallel and recompute), expert parallel, then FSDP2 sharding.

The decoder contract (the runtime's model code keeps it): `embed`, `layers` (ModuleDict keyed by global
layer index; entries may be absent on a pipeline stage), `norm`, `output` (any of these may be None on a
pipeline stage). A layer has `attn_norm`, `attn` (`q_proj`, `k_proj`, `v_proj`, `o_proj`; heads reshaped
with -1), `mlp_norm` and `mlp`, either dense (`gate_proj`, `up_proj`, `down_proj`) or MoE (`router`,
`experts` with stacked [E, ...] parameters). Beyond sharding parameters, this module changes how a model
computes only through the model's declared seams, never by assigning onto its modules:
`attn.set_core` (context parallel and selective recompute, composed in `apply_recompute`),
`layer.set_runner` (full recompute), `mlp.set_parallel` (expert parallel dispatch, router statistics
summed over cp x tp) and `mlp.experts.set_local_view` (this rank's slice of the stacked experts).

Gradient reduction: the loss each rank computes is its share of the global loss (its tokens' summed
cross-entropy over the global number of target tokens), so gradients are summed over ranks, never
averaged (FSDP2's divide factor is 1).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from mlite.errors import MliteError
from mlite.runtime.adapters.pytorch import (
    foreach_norm,
    offloaded_shards,
    reshards_after_forward,
    strided_index_placement,
)
from mlite.runtime.models.moe import local_dispatch, local_stats, whole
from mlite.runtime.parallel.context import context_geometry, context_parallel_attention
from mlite.runtime.parallel.expert import expert_parallel_dispatch, local_slice, token_group_stats
from mlite.runtime.parallel.mesh import ParallelMesh

# precision.compute -> torch dtype (the one map: layout, FSDP2, dist_opt, vLLM and verl read it)
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

if TYPE_CHECKING:
    from mlite.config.schema import JobConfig


def sequence_shard(values: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This tp rank's rows of per-token values under sequence parallel (Shard(0) of the padded share)."""
    return values.chunk(size)[rank]


def blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks a layout lays out: this stage's layers, and DeepSeek-V4's MTP block (a layer past
    the last, on the last stage) where the model has one."""
    extra = getattr(model, "mtp", None)
    return list(model.layers.values()) + ([extra.block] if extra is not None else [])


def is_moe(layer: nn.Module) -> bool:
    return hasattr(layer.mlp, "router")


def apply_tensor_parallel(model: nn.Module, mesh: ParallelMesh) -> None:
    """Megatron-style TP with sequence parallel over `tp`: the residual stream is split by tokens, column-
    parallel q/k/v/gate/up (all-gather in), row-parallel o/down (reduce-scatter out), vocab-parallel
    embedding and LM head (the loss runs under `loss_parallel`)."""
    tp = mesh["tp"]
    if tp.size() == 1:
        return
    tied = model.output is not None and model.embed is not None and model.output.weight is model.embed.weight
    if model.embed is not None:
        parallelize_module(
            model.embed, tp, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
        )
    if model.norm is not None:
        parallelize_module(model.norm, tp, SequenceParallel(sequence_dim=0))
    if model.output is not None:
        parallelize_module(
            model.output,
            tp,
            ColwiseParallel(input_layouts=Shard(0), output_layouts=Shard(-1), use_local_output=False),
        )
    if tied:  # both split the [vocab, hidden] matrix by vocab rows (Shard(0)): one parameter again
        model.tie_embeddings()
    for layer in model.layers.values():
        plan = {
            "attn_norm": SequenceParallel(sequence_dim=0),
            "attn.q_proj": ColwiseParallel(input_layouts=Shard(0)),
            "attn.k_proj": ColwiseParallel(input_layouts=Shard(0)),
            "attn.v_proj": ColwiseParallel(input_layouts=Shard(0)),
            "attn.o_proj": RowwiseParallel(output_layouts=Shard(0)),
            "mlp_norm": SequenceParallel(sequence_dim=0),
        }
        if layer.attn.q_norm is not None:  # per-head norms see this rank's heads: [T, heads, d], dim 1
            plan["attn.q_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
            plan["attn.k_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
        if is_moe(layer):
            # the MoE block works on this rank's tokens as plain tensors; its parameters are reduced over
            # the token-sharing ranks by FSDP (see apply_fsdp)
            plan["mlp"] = PrepareModuleInput(
                input_layouts=(Shard(0), None), desired_input_layouts=(Shard(0), None), use_local_output=True
            )
        else:
            plan |= {
                "mlp.gate_proj": ColwiseParallel(input_layouts=Shard(0)),
                "mlp.up_proj": ColwiseParallel(input_layouts=Shard(0)),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(0)),
            }
        parallelize_module(layer, tp, plan)


def apply_expert_parallel(model: nn.Module, mesh: ParallelMesh, exchange: str, bounded: bool = False) -> None:
    """Keep this ep rank's slice of the stacked experts; tokens reach them by `exchange`, the plan's choice
    (`all_gather` or `all_to_all`: mlite.plan.Plan.expert_exchange, by mlite.plan.policy.expert_exchange),
    its pair buffers `bounded` under parallel.expert_buffers worst_case.

    The stacked parameters become DTensors split on dim 0 over `ep`: their global shape stays [E, ...], so
    checkpoints name and shape them the same under any ep (resume ep2 -> ep1). The experts' own forward
    sees plain local tensors (mlite.runtime.parallel.expert). Router statistics are summed over the ranks
    that share one micro-batch's tokens (cp x tp)."""
    ep, cp, tp = mesh["ep"], mesh["cp"], mesh["tp"]
    reduce_stats = token_group_stats(mesh.group("cp_tp")) if cp.size() * tp.size() > 1 else local_stats
    # sequence parallel: the block's input is this tp rank's shard of the share's tokens
    token_rows = (functools.partial(sequence_shard, rank=mesh.rank_in("tp"), size=tp.size())
                  if tp.size() > 1 else whole)
    for layer in blocks(model):
        if not is_moe(layer):
            continue
        dispatch = local_dispatch
        if ep.size() > 1:
            dispatch = expert_parallel_dispatch(ep.get_group(), exchange, bounded)
            experts = layer.mlp.experts
            for name, param in list(experts.named_parameters(recurse=False)):
                # every rank slices its own experts (src_data_rank=None: no scatter), so this also lays out
                # a model still on the meta device, before any rank holds values
                experts.register_parameter(name, nn.Parameter(
                    distribute_tensor(param.detach(), ep, [Shard(0)], src_data_rank=None),
                    requires_grad=param.requires_grad))
            experts.set_local_view(local_slice)
        layer.mlp.set_parallel(dispatch, reduce_stats, token_rows)


# long for its docstring (one paragraph a knob); the code is one order, inner units before the root's
def apply_fsdp(
    model: nn.Module,
    mesh: ParallelMesh,
    compute_dtype: torch.dtype = torch.float32,
    offload_fraction: float = 0.0,
    reduce_dtype: torch.dtype = torch.float32,
    unit_layers: int = 1,
    reshard_after_forward: bool = True,
    forward_prefetch: bool = True,
    embedding_rows: bool = False,
    plain_experts: bool = False,
) -> None:
    """FSDP2: sharded parameters (the master copy, so the optimizer state is sharded too), gathered in
    `compute_dtype` for compute, gradients reduced in `reduce_dtype` (precision.grad_reduce). Dense
    parameters shard over dp_cp, experts over edp, a MoE block's router over all the ranks of a stage (each
    sees different tokens); without ep, etp or tp those are the layer's ranks, and a MoE block is one unit.
    A tied LM head and its embedding are one unit (one shared matrix).

    `offload_fraction`: the share of layers whose sharded parameters, gradients and therefore optimizer
    state (and step) live on the host (FSDP2's CPUOffloadPolicy per layer unit); 1.0 offloads everything.
    `unit_layers` (parallel.fsdp_unit_layers): consecutive layers gathered and reduced as one unit (never
    across the offload boundary): FSDP2's host work per step grows with its units.
    `reshard_after_forward` (parallel.fsdp_reshard_after_forward): False keeps every unit gathered from its
    forward to its backward, which then gathers nothing (one all-gather a step less, and its host work); a
    pass without backward reshards them itself (`reshard_units`).
    `forward_prefetch` (parallel.fsdp_forward_prefetch): each layer unit's forward queues the next unit's
    all-gather behind its own, so a host that runs behind its GPU does not also delay the gathers (the plan
    holds two units gathered either way).
    `embedding_rows` (parallel.fsdp_embedding rows): the embedding is no FSDP2 unit; it stays sharded by
    vocabulary rows over dp_cp (`shard_embedding_rows`).
    `plain_experts` (mlite.plan.policy.experts_outside_fsdp): the routed experts, already split over all of
    a stage's ranks by expert parallel, are in no unit: their parameters are every unit's ignored ones."""
    # cast_forward_inputs off: every unit's inputs already come in the compute dtype (the embedding's output,
    # RoPE's cos/sin cast to it, pipeline activations received in it, token ids), and the cast walks each
    # call's arguments, the PackedBatch included, rebuilding it per block: host time in every block's call
    # (docs/PERFORMANCE.md, "What the defaults rest on"), where a host behind its GPU sets the step
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype,
                                  cast_forward_inputs=False)
    layers = blocks(model)
    offloaded = round(offload_fraction * len(layers))

    # plain experts: their ep DTensors stay as they are, stepped and checkpointed like any parameter
    plain = ({p for layer in layers if is_moe(layer) for p in layer.mlp.experts.parameters()}
             if plain_experts else set())

    def shard(module, mesh_name, offload, **extra):
        if offload:
            extra["offload_policy"] = CPUOffloadPolicy()
        if plain:  # with the caller's own ignored parameters (the root unit's)
            extra["ignored_params"] = plain | (extra.get("ignored_params") or set())
        return fully_shard(
            module, mesh=mesh[mesh_name], mp_policy=policy, reshard_after_forward=reshard_after_forward,
            **extra
        )

    # experts over edp (ep, etp or tp > 1) and the router over dp_cp_tp (tp > 1) are units of their own
    # only where those meshes are not the layer's dp_cp: FSDP2's hooks on a unit inside a compiled block
    # break its graph (three breaks per MoE block, measured: docs/PERFORMANCE.md), and each unit adds its
    # host work and its collectives, so otherwise they belong to the layer's unit
    own_experts = mesh.dims.ep * mesh.dims.etp * mesh.dims.tp > 1
    own_router = mesh.dims.tp > 1
    groups = []
    for i, layer in enumerate(layers):
        if is_moe(layer) and own_experts and not plain_experts:
            groups.append(shard(layer.mlp.experts, "edp", i < offloaded))
        if is_moe(layer) and own_router:
            groups.append(shard(layer.mlp, "dp_cp_tp", i < offloaded))  # the router
    layer_units = []
    for start, end in unit_runs(len(layers), offloaded, unit_layers):
        unit = layers[start:end]
        if len(unit) == 1:
            layer_units.append(shard(unit[0], "dp_cp", start < offloaded))
        else:  # one unit over several modules: one state, reached from any of them
            layer_units.append(shard(unit, "dp_cp", start < offloaded)[0])
    groups += layer_units
    everything = offload_fraction >= 1.0
    tied = model.output is not None and model.embed is not None and model.output.weight is model.embed.weight
    following = layer_units[1:]
    if tied:  # one unit over both modules of the shared matrix: gathered for either one's forward
        groups.append(shard([model.embed, model.output], "dp_cp", everything)[0])  # one state for both
    elif model.output is not None:  # the LM head runs in the loss, outside the decoder's forward
        head = shard(model.output, "dp_cp", everything)
        groups.append(head)
        following.append(head)  # gathered behind the last layers', not at the loss, where nothing overlaps it
    if forward_prefetch:  # the next unit's all-gather queued with this one's, not when the host gets there
        for unit, next_unit in zip(layer_units, following):
            unit.set_modules_to_forward_prefetch([next_unit])
    ignored = None
    if embedding_rows and model.embed is not None:  # the rule book refused a tied one
        shard_embedding_rows(model.embed, mesh["dp_cp"], compute_dtype)
        ignored = {model.embed.weight}
    groups.append(shard(model, "dp_cp", everything, ignored_params=ignored))
    for module in groups:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no pre-multiplied sum


def shard_embedding_rows(embed: nn.Embedding, mesh, compute_dtype: torch.dtype) -> None:
    """parallel.fsdp_embedding rows: the embedding's [vocab, hidden] matrix stays sharded by vocabulary rows
    over `mesh` (dp_cp) and is never gathered. Tensor parallel's vocab-parallel embedding, over ranks whose
    tokens differ: each lookup all-gathers the ranks' token ids (the micro-batches have one length on every
    rank: policy.equal_micro_batch_lengths), looks up the rows this rank holds (zeros elsewhere) and
    reduce-scatters the [ranks x tokens, hidden] result back to each rank's own tokens. The backward
    all-gathers the output gradients, and every token's lands in its row: DTensor forms the whole [vocab,
    hidden] sum on each rank (it has no row-sharded rule for this backward) and a hook keeps this rank's
    rows, complete, with nothing left to reduce. Per micro-batch that moves ranks x tokens
    x hidden elements each way, against FSDP2's whole matrix gathered and reduced each step (Qwen3-1.7B at
    4096 tokens on 2 ranks: 67 MB in fp32 against 622 MB in bf16). The output is cast to the compute dtype,
    as FSDP2's gathered weight would give it."""
    parallelize_module(embed, mesh, RowwiseParallel(input_layouts=Shard(0), output_layouts=Shard(0)))
    embed.register_forward_hook(lambda _module, _args, out: out.to(compute_dtype))
    hooked: list[torch.Tensor] = []  # the weight whose gradient hook is in place

    def keep_gradient_rows(module: nn.Embedding, _args) -> None:
        # DTensor has no vocabulary-sharded rule for the lookup's backward: the weight's gradient comes out
        # replicated, every rank holding the whole [vocab, hidden] sum, which the fused optimizer step
        # cannot take (torch's foreach step instead, a host sync per tensor: +43 ms on the dp2 bench step).
        # The hook keeps the rows this rank holds (a local slice, no communication). Placed at the first
        # lookup, not here: materialising the meta weight swaps in another tensor, and a hook stays with
        # the one it was put on
        weight = module.weight
        if not hooked or hooked[0] is not weight:
            weight.register_hook(lambda grad: grad.redistribute(weight.device_mesh, weight.placements))
            hooked[:] = [weight]

    embed.register_forward_pre_hook(keep_gradient_rows)


def unit_runs(num_layers: int, offloaded: int, unit_layers: int) -> list[tuple[int, int]]:
    """The [start, end) layer ranges FSDP2 shards as units: runs of `unit_layers` consecutive layers, the
    first `offloaded` layers apart from the rest (a unit is offloaded whole or not at all)."""
    starts = sorted({*range(0, offloaded, unit_layers), *range(offloaded, num_layers, unit_layers)})
    return list(zip(starts, [*starts[1:], num_layers]))


def parameter_holders(module: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(parameter) -> every (module, name) that registers it (a tied matrix has two)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for name, param in sub.named_parameters(recurse=False, remove_duplicate=False):
            holders.setdefault(id(param), []).append((sub, name))
    return holders


def host_offloaded(model: nn.Module) -> set[int]:
    """The ids of the parameters FSDP2 keeps on the host (units sharded with CPUOffloadPolicy by
    `apply_fsdp`). A meta-built model must materialise these on the host: FSDP2 refuses offloaded shards
    anywhere else at its first forward."""
    ids: set[int] = set()
    for unit in model.modules():
        if isinstance(unit, FSDPModule):  # FSDP2 has no public getter for a unit's policy
            ids.update(id(shard) for shard in offloaded_shards(unit))
    return ids


def parallelize_model(model: nn.Module, mesh: ParallelMesh, job: JobConfig, device_type: str,
                      exchange: str | None = None, fsdp_units: bool = True,
                      context_chunk: int = 1, plain_experts: bool = False) -> nn.Module:
    """The whole layout for the runtime, in its fixed order: TP+SP, attention core (CP + recompute), EP,
    FSDP2 where `fsdp_units` (the plan's: not under optimizer.backend dist_opt, whose backend,
    mlite.runtime.backends.dist_opt, wraps the result in Megatron's DDP). Built
    from the plan (mlite.plan.plan_job has accepted the layout before any of this runs): `job` is the plan's
    job, its `auto`s resolved (FSDP2's units, the reduction dtype), `exchange` its expert exchange (None
    without expert parallel), `context_chunk` the multiple of its context-parallel chunks and
    `plain_experts` whether the routed experts stay out of FSDP2 (policy.experts_outside_fsdp)."""
    apply_tensor_parallel(model, mesh)
    rc = job.recompute
    cp_group = mesh.group("cp") if mesh.dims.cp > 1 else None
    if cp_group is not None and hasattr(model, "set_geometry"):  # DeepSeek-V4: boundary rows, not all K/V
        apply_v4_context_parallel(model, cp_group, context_chunk)
        cp_group = None
    apply_recompute(model, rc.granularity, rc.method, rc.num_layers, cp_group,
                    compile_blocks=job.model.compile)
    apply_expert_parallel(model, mesh, exchange, bounded=job.parallel.expert_buffers == "worst_case")
    if not fsdp_units:  # the backend shards the optimizer and reduces the gradients itself (dist_opt)
        return model
    par = job.parallel
    apply_fsdp(
        model,
        mesh,
        # CPU: fp32
        compute_dtype=COMPUTE_DTYPES[job.precision.compute] if device_type == "cuda" else torch.float32,
        offload_fraction=job.offload.optimizer_fraction if job.offload.optimizer else 0.0,
        reduce_dtype=COMPUTE_DTYPES[job.precision.grad_reduce],
        unit_layers=par.fsdp_unit_layers,
        reshard_after_forward=par.fsdp_reshard_after_forward,
        forward_prefetch=par.fsdp_forward_prefetch,
        embedding_rows=par.fsdp_embedding == "rows",
        plain_experts=plain_experts,
    )
    return model


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Off for all but the last micro-batch of a step: gradients accumulate unsharded-locally and FSDP2
    reduce-scatters once per optimizer step instead of once per micro-batch."""
    for module in model.modules():
        if hasattr(module, "set_requires_gradient_sync"):
            module.set_requires_gradient_sync(enabled, recurse=False)


def reshard_units(model: nn.Module) -> None:
    """Free every FSDP2 unit's gathered weights: after a pass without backward, units kept gathered from
    forward to backward (parallel.fsdp_reshard_after_forward false) would hold them, stale after the next
    update, and the memory the plan gives the next step. Units already sharded cost nothing.

    A unit that keeps its weights gathered ignores `reshard()` while FSDP2 counts its forward as open, and
    a tied embedding's unit stays open after a pass without backward: its head runs outside the model's
    forward, after FSDP2 closed the unit at the root's. So each is asked as a unit that reshards after
    forward, then set back (FSDP2's `set_reshard_after_forward`)."""
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        reshards = reshards_after_forward(module)  # FSDP2 has no public getter for it
        if reshards is not None:
            module.set_reshard_after_forward(True, recurse=False)
            module.reshard()
            module.set_reshard_after_forward(reshards, recurse=False)


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of gradients sharded and replicated over any meshes, summed over every rank once."""
    # offloaded shards live on the host while their mesh is on the accelerator: sum where the mesh is
    # (NCCL reduces CUDA tensors only)
    kinds = {g.device_mesh.device_type if isinstance(g, DTensor) else g.device.type for g in grads}
    device = torch.device("cuda", torch.cuda.current_device()) if "cuda" in kinds else torch.device("cpu")
    # each tensor's fp32 norm in one foreach launch per (device, dtype, copies), their squares summed in
    # fp64: a per-tensor fp64 copy of every gradient cost 20 ms a step on 1.7B parameters
    groups: dict[tuple, list[torch.Tensor]] = {}
    replicas: dict[tuple, int] = {}  # per (mesh, placements): a mesh's shape costs host time per call
    for grad in grads:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        copies = 1
        if isinstance(grad, DTensor):
            key = (id(grad.device_mesh), grad.placements)
            if key not in replicas:
                sizes = zip(grad.device_mesh.shape, grad.placements)
                replicas[key] = math.prod(size for size, placement in sizes if placement.is_replicate())
            copies = replicas[key]
        groups.setdefault((local.device, local.dtype, copies), []).append(local)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for (_device, _dtype, copies), locals_ in groups.items():
        norms = foreach_norm(locals_, 2, dtype=torch.float32)
        total += (torch.stack(norms).double().square().sum() / copies).to(device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(total)
    return total.sqrt().float()


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a parameter, gathered over its mesh when it is a DTensor. Offloaded shards
    live on the host while their mesh's collectives run on the accelerator (NCCL gathers CUDA tensors
    only), so they travel to the mesh's device first; the result is on the mesh's device."""
    if not isinstance(param, DTensor):
        return param
    mesh_type = param.device_mesh.device_type
    if param.to_local().device.type != mesh_type:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if mesh_type == "cuda"
            else torch.device(mesh_type)
        )
        param = DTensor.from_local(
            param.to_local().to(device),
            param.device_mesh,
            param.placements,
            shape=param.shape,
            stride=param.stride(),
        )
    return param.full_tensor()


def apply_v4_context_parallel(model: nn.Module, cp_group: dist.ProcessGroup, context_chunk: int) -> None:
    """DeepSeek-V4 under cp: its geometry becomes this rank's zigzag share with the boundary rows before each
    chunk (`context_chunk` of them: the plan's), and the compressed entries of every rank
    (mlite.runtime.parallel.context.context_geometry)."""
    if context_chunk <= 1:
        raise ValueError("DeepSeek-V4 under context parallel needs the plan's context_chunk (boundary rows)")
    model.set_geometry(functools.partial(context_geometry, window=model.arch.v4.sliding_window,
                                         ratios=model.ratios, halo=context_chunk, group=cp_group))


def local_shard(tensor: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """(the storage this rank holds of `tensor`, the global indices it holds along each dim: None where it
    holds the whole dim). Initialisation and checkpoint loading fill exactly these entries of the global
    tensor, so a rank draws or reads only its own share. The indices come from DTensor's own split of each
    dim (an arange laid out like the tensor, split locally without communication), so any nesting of
    placements (FSDP2 over TP or EP gives strided shards) is covered."""
    if not isinstance(tensor, DTensor):
        return tensor, [None] * tensor.dim()
    indices: list[torch.Tensor | None] = []
    for dim, size in enumerate(tensor.shape):
        placements = []
        for p in tensor.placements:
            if (strided := strided_index_placement(p, dim)) is not None:
                placements.append(strided)
            elif p.is_shard(dim):
                placements.append(Shard(0))
            else:
                placements.append(Replicate())
        if all(isinstance(p, Replicate) for p in placements):
            indices.append(None)
            continue
        index = torch.arange(size, device=tensor.device_mesh.device_type)
        indices.append(distribute_tensor(index, tensor.device_mesh, placements, src_data_rank=None)
                       .to_local().cpu())
    return tensor.to_local(), indices


def apply_recompute(
    model: nn.Module,
    granularity: str,
    method: str | None = None,
    num_layers: int | None = None,
    cp_group: dist.ProcessGroup | None = None,
    compile_blocks: bool = False,
) -> None:
    """Each layer's attention core, activation recompute and compilation, composed in this one place
    (applied before FSDP, so the recompute runs on the unsharded weights):

    - the core is the model's packed attention, or under context parallel (`cp_group`) the exact attention
      of this rank's zigzag share over the whole stream;
    - `selective`: that core (scores, softmax) is recomputed; projections keep their inputs;
    - `full` + `uniform`: every layer is recomputed from its input (num_layers must be 1: grouping several
      layers into one region would need the model's layer loop, which stays the model's);
    - `full` + `block`: the first `num_layers` layers of this stage (pipeline chunk) are recomputed, the
      rest keep their activations (the Megatron meaning: spend memory where the stage has it);
    - `compile_blocks` (model.compile): each block's body goes through torch.compile, inside the layer's
      own call (FSDP2's hooks stay outside the graph) and inside a full recompute's checkpoint.
    """
    layers = blocks(model)
    for layer in layers:
        core = functools.partial(context_parallel_attention, group=cp_group) if cp_group is not None else None
        if granularity == "selective":
            core = functools.partial(_checkpointed, core or layer.attn.core)
        if core is not None:
            layer.attn.set_core(core)
    recomputed = []
    if granularity == "full":
        if method == "uniform" and (num_layers or 1) != 1:
            raise MliteError(
                f"recompute.method uniform with num_layers={num_layers}: mlite recomputes layer by layer; "
                "set recompute.num_layers: 1, or use method: block to recompute the first N layers "
                "of each stage"
            )
        recomputed = layers if method == "uniform" else layers[: num_layers or 1]
    for layer in layers:
        runner = functools.partial(_compiled, torch.compile(layer.body)) if compile_blocks else None
        if any(layer is r for r in recomputed):
            runner = functools.partial(_checkpointed_runner, runner) if runner else _checkpointed
        if runner is not None:
            layer.set_runner(runner)


def _checkpointed(fn, *args, **kwargs):
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)


def _compiled(compiled_body, body, *args):
    return compiled_body(*args)  # `body`, the layer's own, is what `compiled_body` was compiled from


def _checkpointed_runner(runner, body, *args):
    return _checkpointed(functools.partial(runner, body), *args)
