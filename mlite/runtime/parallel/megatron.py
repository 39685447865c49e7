"""Megatron-Core's parallel state from our layout (the first half of the `dist_opt` adapter).

Megatron-Core keeps its process groups in module-level state (`megatron.core.parallel_state`); its
DistributedDataParallel and DistributedOptimizer read them from there. `init_parallel_state` creates them
from our `ParallelDims`, in the rank order our meshes use (`tp-cp-ep-dp-pp`), so a rank belongs to the
same tensor, context, pipeline, data and expert groups in both. This module and `dist_opt.py` (the DDP +
DistributedOptimizer wrapper, CUDA only) are the only ones in mlite that import megatron.

The parallel state runs on CPU with gloo and is tested against our meshes (test_parallel_megatron.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mlite.errors import MliteError
from mlite.runtime.parallel.mesh import ParallelDims

# the one line for a run that asks for dist_opt where it cannot run (dist_opt.py adds the reason)
NEEDS_MEGATRON = (
    "optimizer.backend dist_opt needs megatron-core and CUDA GPUs: pip install 'mlite[megatron]', "
    "or use optimizer.backend fsdp2"
)


def _parallel_state():
    try:
        from megatron.core import parallel_state
    except ImportError as exc:
        raise MliteError(f"{NEEDS_MEGATRON} (import failed: {exc})") from None
    return parallel_state


def init_parallel_state(dims: ParallelDims) -> None:
    """Megatron-Core's process groups for this layout (collective: every rank calls it once). Already
    initialised for the same degrees (a second model in one process): kept; for other degrees: refused."""
    ps = _parallel_state()
    if ps.model_parallel_is_initialized():
        theirs = {
            "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "cp": ps.get_context_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(),
            "ep": ps.get_expert_model_parallel_world_size(),
        }
        ours = {"tp": dims.tp, "pp": dims.pp, "cp": dims.cp, "dp": dims.dp, "ep": dims.ep}
        if theirs != ours:
            raise MliteError(
                f"Megatron-Core's parallel state is already set up for {theirs}, this layout is {ours}; "
                "one process runs one layout (call destroy_parallel_state() first)"
            )
        return
    ps.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp if dims.vpp > 1 else None,
        context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.etp,
        order="tp-cp-ep-dp-pp",
    )


def parallel_state_groups() -> dict[str, list[int]]:
    """This rank's Megatron-Core groups under our mesh names, as global rank lists."""
    ps = _parallel_state()
    groups = {
        "tp": ps.get_tensor_model_parallel_group(),
        "pp": ps.get_pipeline_model_parallel_group(),
        "cp": ps.get_context_parallel_group(),
        "dp": ps.get_data_parallel_group(with_context_parallel=False),
        "dp_cp": ps.get_data_parallel_group(with_context_parallel=True),
        "ep": ps.get_expert_model_parallel_group(),
        "etp": ps.get_expert_tensor_parallel_group(),
        "edp": ps.get_expert_data_parallel_group(),
    }
    return {name: sorted(dist.get_process_group_ranks(group)) for name, group in groups.items()}


def use_sync_free_fallbacks() -> list[str]:
    """Where Megatron-Core found neither Transformer Engine nor Apex, its optimizer runs local fallbacks for
    two multi-tensor kernels, and one of them stalls the GPU: the grad norm reads each tensor's norm on the
    host (`torch.tensor` of a list of CUDA scalars), one device sync per tensor (202 a step on Qwen3-1.7B
    under dp4: docs/PERFORMANCE.md). Those two fallbacks are replaced by torch's foreach kernels, the same
    sums with no sync; the fused kernels are kept where Megatron found them. Returns what was replaced."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    replaced = []
    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
        replaced.append("clip_grads.l2_norm_impl")
    for module in (clip_grads, optimizer):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_scale
            replaced.append(f"{module.__name__.rsplit('.', 1)[-1]}.multi_tensor_scale_impl")
    return replaced


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """amp_C.multi_tensor_l2norm's contract (a [1] fp32 tensor on the device, None) over torch foreach."""
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """amp_C.multi_tensor_scale's contract (dst = src * scale, dtypes may differ) over torch foreach."""
    src, dst = tensor_lists
    if not src:
        return
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    elif scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def destroy_parallel_state() -> None:
    _parallel_state().destroy_model_parallel()
