"""Megatron-Core's parallel state from our layout (the first half of the `dist_opt` adapter).

Megatron-Core keeps its process groups in module-level state (`megatron.core.parallel_state`); its
DistributedDataParallel and DistributedOptimizer read them from there. `init_parallel_state` creates them
from our `ParallelDims`, in the rank order our meshes use (`tp-cp-ep-dp-pp`), so a rank belongs to the
same tensor, context, pipeline, data and expert groups in both. This module, `backends/dist_opt.py` (the DDP +
DistributedOptimizer wrapper, CUDA only) and mlite.runtime.adapters.megatron_core (what Megatron offers no
public API for: its optimizer's kernel globals, a shard's range) are the only ones in mlite that import
megatron; only the adapter reads or rebinds Megatron's internals.

The parallel state runs on CPU with gloo and is tested against our meshes (test_parallel_megatron.py).
"""

from __future__ import annotations

import torch.distributed as dist

from mlite.errors import MliteError
from mlite.runtime.adapters.megatron_core import foreach_l2_norm, foreach_scale, use_sync_free_fallbacks
from mlite.runtime.parallel.mesh import ParallelDims

__all__ = [
    "NEEDS_MEGATRON", "destroy_parallel_state", "init_parallel_state", "parallel_state_groups",
    # Megatron's optimizer kernels, rebound where they are its syncing fallbacks (the adapter's side)
    "foreach_l2_norm", "foreach_scale", "use_sync_free_fallbacks",
]

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


def destroy_parallel_state() -> None:
    _parallel_state().destroy_model_parallel()
