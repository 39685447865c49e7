"""Megatron-Core's names that mlite reaches past its public API, in one place. Checked against
megatron-core 0.16.1 (`MEGATRON_CHECKED`); the pinned images run 0.18.0 and 0.19.2, where running
tests/test_adapters.py in the image is the check. It fails naming this module when Megatron changes under it.

- The multi-tensor kernels Megatron's optimizer calls through module globals (`clip_grads.l2_norm_impl`,
  `clip_grads.multi_tensor_scale_impl`, `optimizer.multi_tensor_scale_impl`), bound at import to
  Transformer Engine's, Apex's or Megatron's local fallbacks. Megatron has no switch for them, so
  `use_sync_free_fallbacks` rebinds the fallbacks, process-wide: the globals are read at each call, by every
  optimizer of the process.
- `DistributedOptimizer._get_model_param_range_map`: the range of a parameter this data-parallel rank's
  shard holds (Megatron keeps no public getter): `shard_slice`.

megatron is imported inside the functions, never at module import (dist_opt imports it only when built).
"""

from __future__ import annotations

from typing import Any

import torch

MEGATRON_CHECKED = "0.16.1"


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


def shard_slice(optimizer: Any, param: torch.nn.Parameter) -> slice:
    """The elements of `param` (flattened) that this rank's shard of a DistributedOptimizer holds; only for
    a parameter of which it holds some (`param in optimizer.model_param_gbuf_map`)."""
    span = optimizer._get_model_param_range_map(param)["param"]
    return slice(span.start, span.end)
