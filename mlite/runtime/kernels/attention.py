"""Causal attention over a packed token stream, by backend.

Every backend computes the same thing: for each sequence of the stream (bounded by `cu_seqlens`), causal
softmax attention of its queries over its own keys, grouped-query heads repeated from the shapes.

    torch       per-sequence matmul + fp32 softmax; always present, the reference the others are tested
                against
    sdpa        per-sequence torch scaled_dot_product_attention (flash / cuDNN / math kernels, whichever
                torch picks)
    varlen      torch.nn.attention.varlen.varlen_attn: one call for the whole stream (CUDA, torch >= 2.10)
    cudnn       cuDNN's fused attention per sequence (CUDA): the fastest kernel for long sequences on Hopper
    packed      cudnn for a stream of one sequence or of long ones, varlen for several short ones (CUDA):
                auto's choice
    flash_attn  flash_attn_varlen_func from the flash-attn package (CUDA)
    te          Transformer Engine DotProductAttention in its packed `thd` format (CUDA)
    auto        the first present of: on CUDA packed, flash_attn, varlen, sdpa; on other devices sdpa

`cached_attention` serves decoding with a KV cache (queries at given positions over cached keys).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mlite.errors import MliteError
from mlite.plan.policy import per_sequence_attention

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


def _sequence_bounds(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    cu = cu_seqlens.tolist()
    return list(zip(cu[:-1], cu[1:]))


def torch_attention(q, k, v, cu_seqlens, max_seqlen, scale):
    """q [T, hq, d], k/v [T, hkv, d] -> [T, hq, d]. Written out in plain ops: the reference."""
    groups = q.shape[1] // k.shape[1]
    outs = []
    for start, end in _sequence_bounds(cu_seqlens):
        qs = q[start:end].transpose(0, 1)  # [hq, n, d]
        ks = k[start:end].repeat_interleave(groups, dim=1).transpose(0, 1)
        vs = v[start:end].repeat_interleave(groups, dim=1).transpose(0, 1)
        scores = (qs @ ks.transpose(1, 2)) * scale  # [hq, n, n]
        n = end - start
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        outs.append((probs @ vs).transpose(0, 1))
    return torch.cat(outs)


def sdpa_attention(q, k, v, cu_seqlens, max_seqlen, scale):
    outs = []
    for start, end in _sequence_bounds(cu_seqlens):
        out = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).unsqueeze(0),  # [1, hq, n, d]
            k[start:end].transpose(0, 1).unsqueeze(0),
            v[start:end].transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def varlen_torch_attention(q, k, v, cu_seqlens, max_seqlen, scale):
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    # torch 2.10 takes is_causal; later versions express causality as a (-1, 0) window
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    # fewer K/V heads than query heads (GQA) go in as they are: FA2's varlen kernel shares each K/V head
    # across its query group. torch 2.11's varlen_attn passes them through without a flag (on one H200 the
    # same output and K/V gradients as K/V repeated per query head, bit for bit); later versions ask for
    # enable_gqa. Repeating them cost a copy each way and kept 2 x (q - kv) heads per token for the backward.
    if "enable_gqa" in params:
        causal["enable_gqa"] = q.shape[1] != k.shape[1]
    elif "is_causal" in params and q.shape[1] != k.shape[1]:  # torch 2.10: not measured without the copies
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    cu = cu_seqlens.to(torch.int32)
    return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale, **causal)


_CUDNN_FIRST = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                SDPBackend.MATH]


def _cudnn_one_sequence(q, k, v, scale):
    """q [n, hq, d], k/v [n, hkv, d], one causal sequence -> [n, hq, d], on cuDNN's fused kernel. Through SDPA
    with the backend pinned, so torch.compile keeps it inside the layer's graph (no graph break per layer)."""
    # cuDNN takes fewer K/V heads than query heads (GQA) as they are: repeating K/V per query head first cost
    # a copy each way and kept the copies for the backward (MoE case: -0.6 ms a step, docs/PERFORMANCE.md).
    # cuDNN first; shapes it does not take (very short sequences, odd head sizes) fall through to the others
    with sdpa_kernel(_CUDNN_FIRST, set_priority=True):
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
            is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
        )
    return out[0].transpose(0, 1)


def cudnn_attention(q, k, v, cu_seqlens, max_seqlen, scale):
    """cuDNN's fused kernel per sequence (SDPA's own choice on H100 at 4k is the slower flash kernel: 206 vs
    255-300 TFLOP/s measured, see docs/PERFORMANCE.md). A stream of one sequence needs no host read of
    `cu_seqlens`, so the step stays free of host syncs."""
    if cu_seqlens.numel() == 2:
        return _cudnn_one_sequence(q, k, v, scale)
    return torch.cat([_cudnn_one_sequence(q[a:b], k[a:b], v[a:b], scale)
                      for a, b in _sequence_bounds(cu_seqlens)])


def packed_cuda_attention(q, k, v, cu_seqlens, max_seqlen, scale):
    """One sequence: cuDNN; several packed sequences: cuDNN per sequence where they are long on average, else
    one varlen call (no host sync, no loop of small kernels): mlite.plan.policy.per_sequence_attention.
    fp32 (compute: fp32 without autocast, as the demo runs): the flash kernel behind varlen takes fp16/bf16
    only, so SDPA per sequence picks its fp32 kernel."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return sdpa_attention(q, k, v, cu_seqlens, max_seqlen, scale)
    sequences = cu_seqlens.numel() - 1  # a size: no read of the GPU
    if sequences == 1 or per_sequence_attention(q.shape[0], sequences):
        return cudnn_attention(q, k, v, cu_seqlens, max_seqlen, scale)
    return varlen_torch_attention(q, k, v, cu_seqlens, max_seqlen, scale)


def flash_attention(q, k, v, cu_seqlens, max_seqlen, scale):
    from flash_attn import flash_attn_varlen_func

    cu = cu_seqlens.to(torch.int32)
    return flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, softmax_scale=scale, causal=True)


@functools.cache
def _te_module(heads: int, kv_heads: int, head_dim: int, scale: float):
    from transformer_engine.pytorch import DotProductAttention

    return DotProductAttention(
        num_attention_heads=heads,
        kv_channels=head_dim,
        num_gqa_groups=kv_heads,
        attention_dropout=0.0,
        qkv_format="thd",
        attn_mask_type="padding_causal",
        softmax_scale=scale,
    )


def te_attention(q, k, v, cu_seqlens, max_seqlen, scale):
    cu = cu_seqlens.to(torch.int32)
    te = _te_module(q.shape[1], k.shape[1], q.shape[2], scale)
    out = te(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
    return out.view(q.shape)  # TE returns [T, hq * d]


ATTENTION_BACKENDS: dict[str, AttentionFn] = {
    "torch": torch_attention,
    "sdpa": sdpa_attention,
    "varlen": varlen_torch_attention,
    "cudnn": cudnn_attention,
    "packed": packed_cuda_attention,
    "flash_attn": flash_attention,
    "te": te_attention,
}
_AUTO_ORDER = {"cuda": ("packed", "flash_attn", "varlen", "sdpa"), "cpu": ("sdpa",)}


def _has_varlen_attn() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _missing_reason(name: str, device_type: str) -> str | None:
    """Why backend `name` cannot run on this device, or None when it can."""
    if name in ("torch", "sdpa"):
        return None
    if device_type != "cuda":
        return f"it runs on CUDA GPUs only (this model is on {device_type})"
    if name == "cudnn" and not torch.backends.cudnn.is_available():
        return "cuDNN is not available to torch"
    if name == "packed" and (not _has_varlen_attn() or not torch.backends.cudnn.is_available()):
        return "it needs both torch's varlen_attn (torch >= 2.10) and cuDNN"
    if name == "varlen" and not _has_varlen_attn():
        return (
            f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn (torch >= 2.10 has it)"
        )
    if name == "flash_attn" and importlib.util.find_spec("flash_attn") is None:
        return "the flash-attn package is not installed"
    if name == "te" and importlib.util.find_spec("transformer_engine") is None:
        return "Transformer Engine is not installed"
    return None


def available_attention_backends(device_type: str = "cpu") -> list[str]:
    return [name for name in ATTENTION_BACKENDS if _missing_reason(name, device_type) is None]


def resolve_attention_backend(name: str, device_type: str = "cpu") -> str:
    """The concrete backend for `name` ("auto" or a backend) on `device_type`; a clear error if it can't
    run."""
    if name == "auto":
        return next(
            n for n in _AUTO_ORDER.get(device_type, ("sdpa",)) if _missing_reason(n, device_type) is None
        )
    if name not in ATTENTION_BACKENDS:
        raise MliteError(
            f"unknown attention backend '{name}'; choose auto or one of {', '.join(ATTENTION_BACKENDS)}"
        )
    reason = _missing_reason(name, device_type)
    if reason:
        choices = ", ".join(available_attention_backends(device_type))
        raise MliteError(
            f"attention backend '{name}' cannot run here: {reason}; use auto or one of {choices}"
        )
    return name


def varlen_attention(
    q: torch.Tensor,  # [T, hq, d]
    k: torch.Tensor,  # [T, hkv, d]
    v: torch.Tensor,  # [T, hkv, d]
    cu_seqlens: torch.Tensor,  # [B+1] int32
    max_seqlen: int,
    backend: str = "torch",
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention within each packed sequence -> [T, hq, d]."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if q.is_cuda and torch.is_autocast_enabled("cuda"):
        # under autocast the norms and RoPE hand over fp32 q/k next to a bf16 v; the fused kernels take one
        # 16-bit dtype (SDPA would cast by itself, varlen/cuDNN/flash-attn do not)
        dtype = torch.get_autocast_dtype("cuda")
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return ATTENTION_BACKENDS[backend](q, k, v, cu_seqlens, int(max_seqlen), scale)


def cached_attention(
    q: torch.Tensor,  # [B, t, hq, d] new queries
    k: torch.Tensor,  # [B, S, hkv, d] cache slots 0..S-1 (slot = position)
    v: torch.Tensor,  # [B, S, hkv, d]
    positions: torch.Tensor,  # [B, t] position of each query; -1 marks padding
    scale: float | None = None,
) -> torch.Tensor:
    """Each query attends to its row's cache slots at or before its own position -> [B, t, hq, d]."""
    slots = torch.arange(k.shape[1], device=q.device)
    allowed = slots[None, None, :] <= positions[:, :, None]  # [B, t, S]
    allowed[..., 0] |= (
        positions < 0
    )  # padding queries see slot 0 (their output is unused), never an empty row
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=allowed.unsqueeze(1),
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)
