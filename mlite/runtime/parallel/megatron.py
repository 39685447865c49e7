"""Megatron-Core behind one adapter (the `dist_opt` backend's home).

Megatron-Core keeps its process groups in module-level state (`megatron.core.parallel_state`); its
DistributedDataParallel and DistributedOptimizer read them from there. `init_parallel_state` creates them
from our `ParallelDims`, in the rank order our meshes use (`tp-cp-ep-dp-pp`), so a rank belongs to the
same tensor, context, pipeline, data and expert groups in both. Nothing else in mlite imports megatron.

Status: the parallel state runs on CPU with gloo and is tested against our meshes; wrapping the model in
Megatron-Core's DDP + DistributedOptimizer needs CUDA and is not written yet (docs/PARALLEL.md).
"""

from __future__ import annotations

import torch.distributed as dist

from mlite.errors import MliteError
from mlite.runtime.parallel.mesh import ParallelDims


def _parallel_state():
    try:
        from megatron.core import parallel_state
    except ImportError:
        raise MliteError(
            "optimizer.backend dist_opt needs megatron-core: pip install 'mlite[megatron]' "
            "(or use backend fsdp2)"
        ) from None
    return parallel_state


def init_parallel_state(dims: ParallelDims) -> None:
    """Megatron-Core's process groups for this layout (collective: every rank calls it once)."""
    ps = _parallel_state()
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


def destroy_parallel_state() -> None:
    _parallel_state().destroy_model_parallel()
