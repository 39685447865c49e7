"""FP8 training through torchao: the one module that imports it (inside each function, never at mlite import).

`convert_to_fp8(model, recipe)` swaps the decoder's linears for torchao's FP8 ones and tells the routed
experts to run their grouped GEMM in FP8 (their `set_gemms` seam, mlite.runtime.models.moe.Experts):

- tensorwise / rowwise: `torchao.float8.convert_to_float8_training` with the recipe of that name (dynamic
  scaling, one scale per tensor / per row); under FSDP2 with `all_gather`, tensorwise weights are
  all-gathered in FP8 (`precompute_fp8_scales` then runs after each optimizer step);
- blockwise: torchao's `Float8BlockwiseLinear` (128x128 weight blocks, 1x128 activation tiles; SM90 only).

The routed experts take the rowwise grouped GEMM under every recipe (`scaled_grouped_mm_rowwise`): torchao's
FP8 grouped GEMM is rowwise. What stays in the compute dtype (`keeps_high_precision`): the embedding, the LM
head, the norms (none is a linear), the MoE router, DeepSeek-V4's indexer `weights_proj` (its scores pick
the top-k entries) and grouped `o_a_proj` (`HIGH_PRECISION_NAMES`), every linear whose widths are not
multiples of 16 (128 for blockwise), which the FP8 kernels cannot tile, and under precision.fp8_linears auto
those too small for FP8 to gain (mlite.plan.rules.fp8_linear_gains, torchao's own size rule). The swapped
modules keep their `weight` (and `bias`), so state-dict names, checkpoints and HF export are those of the
model without FP8.

Test switch: MLITE_FP8_EMULATE=1 (mlite.plan.policy.fp8_emulated) runs the same conversion with torchao's
CPU emulation (tensorwise, rowwise) and the experts' pure-torch emulation (mlite.runtime.kernels
.grouped_gemm), and the rule book then lets precision.fp8 run on the CPU, so the CPU suite trains FP8 jobs
end to end. Without it the rule book refuses precision.fp8 on the CPU.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from mlite.errors import MliteError
from mlite.plan.policy import FP8_EMULATE_ENV, fp8_emulated
from mlite.plan.rules import fp8_converts

EMULATE_ENV = FP8_EMULATE_ENV  # the test switch
RECIPES = ("tensorwise", "rowwise", "blockwise")
# linears kept in the compute dtype by name (the last part of their module name): the LM head, the MoE router,
# DeepSeek-V4's indexer weights (its scores pick entries), and its grouped output projection `o_a_proj`, whose
# weight the attention multiplies per group itself (its forward never runs: an FP8 module would not be used)
HIGH_PRECISION_NAMES = frozenset({"output", "lm_head", "router", "gate", "weights_proj", "o_a_proj"})


def emulating() -> bool:
    """The test switch (module docstring): FP8 numerics emulated on any device."""
    return fp8_emulated()


def tile(recipe: str) -> int:
    """The multiple every FP8 linear's widths must be: the kernels' tile."""
    return 128 if recipe == "blockwise" else 16


def keeps_high_precision(name: str, linear: nn.Linear, recipe: str, linears: str = "all") -> bool:
    """Whether the linear at module name `name` stays in the compute dtype under `recipe` and
    precision.fp8_linears `linears` (auto: also those too small to gain, mlite.plan.rules.fp8_converts)."""
    multiple = tile(recipe)
    return (name.rsplit(".", 1)[-1] in HIGH_PRECISION_NAMES
            or linear.in_features % multiple != 0 or linear.out_features % multiple != 0
            or (recipe == "blockwise" and linear.bias is not None)  # torchao's blockwise linear has none
            or not fp8_converts(recipe, linears, linear.in_features, linear.out_features))


def fp8_linear_names(model: nn.Module, recipe: str, linears: str = "all") -> list[str]:
    """The module names of the linears `convert_to_fp8` swaps (every nn.Linear not kept high precision)."""
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and not keeps_high_precision(name, module, recipe, linears)]


def _float8_config(recipe: str, all_gather: bool, emulate: bool):
    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate,
                               enable_fsdp_float8_all_gather=all_gather)


def convert_to_fp8(model: nn.Module, recipe: str, all_gather: bool = False,
                   linears: str = "all") -> list[str]:
    """Swap `model`'s linears (`fp8_linear_names`) for torchao's FP8 linears of `recipe`, in place (the
    routed experts: mlite.runtime.kernels.grouped_gemm.use_fp8_experts). Works on a meta-device model
    (before parallelize and materialise). `all_gather`: FSDP2 all-gathers tensorwise weights in FP8.
    `linears`: precision.fp8_linears. Returns the swapped names."""
    if recipe not in RECIPES:
        raise MliteError(f"precision.fp8: {recipe} is not one of {', '.join(RECIPES)}")
    emulate = emulating()
    if all_gather and recipe != "tensorwise":
        raise MliteError(f"precision.fp8_all_gather needs precision.fp8: tensorwise (got {recipe})")
    names = fp8_linear_names(model, recipe, linears)
    if recipe == "blockwise":
        if emulate:
            raise MliteError("precision.fp8: blockwise has no CPU emulation (torchao's blockwise linear "
                             "needs SM90); emulate tensorwise or rowwise")
        _swap(model, names, _blockwise_linear)
    else:
        from torchao.float8 import convert_to_float8_training

        chosen = set(names)
        convert_to_float8_training(model, config=_float8_config(recipe, all_gather, emulate),
                                   module_filter_fn=lambda module, fqn: fqn in chosen)
    return names


def _blockwise_linear(linear: nn.Linear) -> nn.Module:
    from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear

    return Float8BlockwiseLinear.from_float(linear)


def _swap(model: nn.Module, names: list[str], make) -> None:
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, make(getattr(parent, child)))


def precompute_fp8_scales(model: nn.Module) -> None:
    """After an optimizer step under FSDP2's FP8 all-gather: every FP8 weight's scale, in one reduction
    for all of them, so each unit's all-gather casts its shards to FP8 without a per-weight amax."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def scaled_grouped_mm_rowwise(a: torch.Tensor, b_t: torch.Tensor, offsets: torch.Tensor,
                              out_dtype: torch.dtype) -> torch.Tensor:
    """torchao's rowwise FP8 grouped GEMM: a [M, K] row-major, b_t [E, K, N] column-major per group,
    `offsets` [E] int32 cumulative group ends, each group a multiple of 16 rows (the caller pads: torchao's
    own padding asserts it is not yet supported). Differentiable; CUDA, SM90 and newer."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    return _to_fp8_rowwise_then_scaled_grouped_mm(a, b_t, offsets, out_dtype, torch.float8_e4m3fn,
                                                  pad_token_groups_for_grouped_mm=False)
