"""torch's private names the runtime needs, in one place: FSDP2's per-unit state (a unit's offload policy,
whether it reshards after forward, its post-backward hook), DTensor's strided shard placement (what FSDP2
over tensor or expert parallel gives), nn.Module's forward-hook tables and per-tensor walk, a view's base,
DeviceMesh's flatten and unflatten, DCP's nested-state traversal, the grouped matmul, the multi-tensor
(`_foreach_*`) kernels, the inner tensor of a traceable wrapper subclass and the traceable all-to-all
(`_functional_collectives`).

Checked against torch 2.13.0 (`TORCH_CHECKED`); the pinned images run 2.11.0, where running
tests/test_adapters.py in the image is the check.
torch has no public form of any of these: FSDP2 offers setters only (`set_reshard_after_forward`,
`set_requires_gradient_sync`, ...) and no way to put its post-backward hook on a tensor its forward did not
see. tests/test_adapters.py exercises every function here on the installed torch and fails naming this module
when one stops behaving; update the functions here, never their callers.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

TORCH_CHECKED = "2.13.0"


def _param_group(unit: FSDPModule):
    """The unit's one FSDPParamGroup (None where it manages no parameters of its own)."""
    return unit._get_fsdp_state()._fsdp_param_group


def offloaded_shards(unit: FSDPModule) -> list[torch.Tensor]:
    """The sharded parameters of a unit sharded with CPUOffloadPolicy (kept on the host), else []."""
    group = _param_group(unit)
    if group is None or not isinstance(group.offload_policy, CPUOffloadPolicy):
        return []
    return [fsdp_param.sharded_param for fsdp_param in group.fsdp_params]


def reshards_after_forward(unit: FSDPModule) -> bool | None:
    """Whether the unit frees its gathered weights after its forward (FSDP2 turns it off for the root at
    its first forward); None where the unit manages no parameters."""
    group = _param_group(unit)
    return None if group is None else group._reshard_after_forward


def reduce_in_backward(unit: FSDPModule, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` through the unit's post-backward hook, as if its forward had taken it as input: once
    autograd has the gradient of `tensor`, the unit reduce-scatters its gradients and reshards."""
    (tensor,), _ = _param_group(unit)._register_post_backward_hook((tensor,), {})
    return tensor


def strided_index_placement(placement: Placement, dim: int) -> Placement | None:
    """Where `placement` is a strided shard of `dim`, the same split of a 1-D index (dim 0); None for any
    other placement. Ask this before `is_shard`: torch 2.11's strided shard is a Shard too."""
    if isinstance(placement, _StridedShard) and placement.dim == dim:
        return _StridedShard(0, split_factor=placement.split_factor)
    return None


def has_forward_hooks(module: nn.Module) -> bool:
    """Whether hooks of the module's own (forward or forward-pre) run around its forward."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


def unflatten_mesh(mesh, dim: int, sizes: tuple[int, ...], names: tuple[str, ...]):
    """`mesh` with dimension `dim` split into `sizes` named `names`: DeviceMesh's own unflatten, which keeps
    every sub-mesh a descendant of one root (FSDP2 and DTensor accept the dense and expert meshes together
    only then); torch has no public form of it."""
    return mesh._unflatten(dim, sizes, names)


def flatten_mesh(mesh, name: str):
    """The dimensions of `mesh` as one, named `name` (DeviceMesh's own flatten, as `unflatten_mesh`)."""
    return mesh._flatten(name)


def set_state_element(state: dict, path, value) -> None:
    """Put `value` at the flattened `path` of a nested state dict: what DCP's default load planner does for
    a non-tensor item (torch.distributed.checkpoint's own traversal; no public form)."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(state, path, value)


def apply_to_tensors(module: nn.Module, fn) -> nn.Module:
    """`fn` over every parameter, gradient and buffer of `module`, each parameter staying the same object:
    nn.Module's own walk, which `module.to` runs and FSDP2's units override to re-point their shards."""
    return module._apply(fn)


def is_view_of(view: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether `view` is `base` itself or a view made from it (works on meta tensors, which have no storage
    to compare)."""
    return view is base or view._base is base


_WRAPPED_DATA: dict[type, str] = {}  # wrapper subclass -> the name of its first inner tensor


def wrapped_data(t: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor a traceable wrapper subclass keeps its values in, where it has one of the wrapper's
    own shape, strides, dtype and device (torchao's weight that FSDP2 all-gathers in FP8 is such a wrapper
    around its bf16 data; an FP8 tensor, whose data has another dtype, is not): writing to it in place is
    writing to `t`. None for any other tensor, plain ones included."""
    if not is_traceable_wrapper_subclass(t):
        return None
    name = _WRAPPED_DATA.get(type(t))
    if name is None:  # once a class: torchao's __tensor_flatten__ reads a scale's truth value, a host sync
        names, _ = t.__tensor_flatten__()
        name = _WRAPPED_DATA[type(t)] = names[0] if names else ""
    inner = getattr(t, name, None) if name else None
    if type(inner) not in (torch.Tensor, nn.Parameter) or inner.shape != t.shape or \
            inner.stride() != t.stride() or inner.dtype != t.dtype or inner.device != t.device:
        return None
    return inner


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of `x` grouped by `offsets` (cumulative ends), each group times its own matrix of `w`
    (groups, k, n): torch's grouped GEMM, one kernel for every expert."""
    return torch._grouped_mm(x, w, offs=offsets)


def foreach_mul_(tensors: list[torch.Tensor], scalar) -> None:
    """Every tensor times `scalar` (a number or a one-element tensor), in place, in one launch."""
    torch._foreach_mul_(tensors, scalar)


def foreach_add_(tensors: list[torch.Tensor], other) -> None:
    """`other` (a number, or one tensor per entry) added to every tensor, in place, in one launch."""
    torch._foreach_add_(tensors, other)


def foreach_sub_(tensors: list[torch.Tensor], other) -> None:
    """`other` (a number, or one tensor per entry) subtracted from every tensor, in place, in one launch."""
    torch._foreach_sub_(tensors, other)


def foreach_norm(tensors: list[torch.Tensor], ord: float = 2, dtype=None) -> list[torch.Tensor]:
    """The `ord`-norm of every tensor (one 0-d tensor each, accumulated in `dtype`), in one launch."""
    return list(torch._foreach_norm(tensors, ord, dtype=dtype))


def all_to_all_equal(x: torch.Tensor, group) -> torch.Tensor:
    """Block r of `x`'s rows to rank r of `group`, equal blocks, with autograd (the backward is the reverse
    all-to-all), as a collective torch.compile traces into its graph (c10d's own calls break it): torch's
    functional all-to-all."""
    return funcol.all_to_all_single_autograd(x, None, None, group)
