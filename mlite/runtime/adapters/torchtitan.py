"""torchtitan's internals that `mlite bench --titan` relies on (mlite/bench/titan_side.py), in one place.
Checked against torchtitan 0.2.2 (`TITAN_CHECKED`); torchtitan is imported inside the functions only (it is
not a dependency of mlite). Its trainer compiles the Qwen3 blocks with the llama4 infra's `apply_compile`,
pads the experts' token groups through a module-level switch, and asks its ParallelDims for meshes that a
single device without a process group does not have."""

from __future__ import annotations

TITAN_CHECKED = "0.2.2"


def compile_blocks(model, compile_config) -> None:
    """torch.compile each transformer block as torchtitan's parallelize_qwen3 does (the llama4 infra's
    apply_compile: MoE blocks compiled around their experts' hooks; sets dynamo's capture_scalar_outputs)."""
    from torchtitan.models.llama4.infra.parallelize import apply_compile

    apply_compile(model, compile_config, ep_enabled=False)


def pad_expert_groups(multiple: int) -> None:
    """Each expert's token group padded to `multiple` rows, as torchtitan's FP8 grouped-GEMM converter sets it
    (the FP8 kernels need 16)."""
    from torchtitan.models.moe.utils import set_token_group_alignment_size_m

    set_token_group_alignment_size_m(multiple)


def one_device_dims():
    """torchtitan's ParallelDims of one device. Every mesh it would build is of size 1, so none is needed
    (its trainer builds them on a process group; this side has none): the optional ones are absent."""
    from torchtitan.distributed import ParallelDims

    class OneDevice(ParallelDims):
        def get_optional_mesh(self, *dims, **kwargs):
            return None

    return OneDevice(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
