"""The trainer's DeepSeek-V4 forward rounded where vLLM multiplies in block FP8 (rollout.match_fp8), so the
logprobs the trainer computes are those of the weights and activations the sampler used.

vLLM's block-FP8 linears take e4m3 weights with one float32 power-of-two scale per 128x128 block, the form
the weight sync sends (mlite.runtime.ckpt.sync.vllm_fp8_weight, over mlite.runtime.ckpt.quant's block
quantiser: the rounding here is that one, bit for bit), and quantise the activation dynamically per token
in 1x128 groups along the reduced dim: e4m3 with the scale amax / 448 rounded up to a power of two (its
ue8m0 form). vLLM 0.25's V4 path rounds every activation so on Hopper and Blackwell: the attention output's
quantiser before wo_a always (`fused_inv_rope_fp8_quant`), and `per_token_group_quant_fp8` before the
DeepGEMM linears and the FP8 experts wherever DeepGEMM's E8M0 scales are on (`is_deep_gemm_e8m0_used`:
VLLM_USE_DEEP_GEMM_E8M0, on by default; the rollout keeps it on under rollout.match_fp8).
A rounded product is dequant(q(x)) @ dequant(q(W)).T in the input's dtype; its gradients are the unrounded
product's.

Which layers (mlite.plan.policy.vllm_v4_fp8): "wo_a" and "online" the attention's o_a_proj (vLLM's wo_a);
"linears" also q_a_proj, kv_proj, q_b_proj, o_b_proj, the indexer's q_proj, the shared experts and the
routed experts (vLLM's wq_a, wkv, wq_b, wo_b, indexer.wq_b, shared_experts.w1/w2/w3, experts.*.w1/w2/w3).
The MTP block is left as it is: the rollout does not speculate.

How, leaving parameters, names and the state dict as they are (checkpoints, HF export, the sync and FSDP2
see the same tensors; done on the meta-built model, before parallelisation): a linear called as a module
changes class to a subclass whose forward rounds; the attention's grouped o_a product goes through its
`set_output_product` seam; the routed experts' two grouped GEMMs go through their `set_gemms` seam as
`matched_gemm`s.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from mlite.errors import MliteError
from mlite.runtime.ckpt.quant import FP8_MAX, fp8_blocks
from mlite.runtime.kernels.grouped_gemm import grouped_gemm

BLOCK = 128  # vLLM's weight_block_size [128, 128] and its activation groups (1x128)
ACT_EPS = 1e-10  # vLLM's per_token_group_quant_fp8 floor on a group's amax (an all-zero group stays zero)
MODES = ("wo_a", "online", "linears")


# ------------------------------------------------------------------------------------------- the rounding
def round_weight(w: torch.Tensor, parts: int = 1) -> torch.Tensor:
    """w [..., out, in] -> dequant(quant(w)) in w's dtype: e4m3 with a power-of-two scale per 128x128 block
    (the last ones partial), as quantize_fp8_blocks(w, (128, 128), float32) rounds it for vLLM. `parts`:
    the out dim stacks that many HF tensors, each with blocks of its own (the experts' gate_up: w1 and w3)."""
    if parts > 1:
        return torch.cat([round_weight(p) for p in w.chunk(parts, dim=-2)], dim=-2)
    # the sync's quantiser without its host-side finiteness check (a sync per call, a graph break)
    q, scales, _ = fp8_blocks(w.detach().to(torch.float32), (BLOCK, BLOCK))
    rows, cols = q.shape[-2:]
    per_value = scales.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)[..., :rows, :cols]
    return (q.to(torch.float32) * per_value).to(w.dtype)


def round_activation(x: torch.Tensor) -> torch.Tensor:
    """x [..., in] -> dequant(quant(x)) in x's dtype: per 1x128 group of the last dim (the last partial), e4m3
    with the scale max(amax, 1e-10) / 448 rounded up to a power of two, as vLLM's per_token_group_quant_fp8
    with use_ue8m0 (the module docstring)."""
    v = x.detach().to(torch.float32)
    cols = v.shape[-1]
    groups = -(-cols // BLOCK)
    tiles = F.pad(v, (0, groups * BLOCK - cols)).reshape(*v.shape[:-1], groups, BLOCK)
    scale = tiles.abs().amax(dim=-1, keepdim=True).clamp(min=ACT_EPS) / FP8_MAX
    scale = torch.exp2(torch.ceil(torch.log2(scale)))  # ue8m0: rounded up to a power of two
    q = (tiles / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    back = (q.to(torch.float32) * scale).reshape(*v.shape[:-1], groups * BLOCK)[..., :cols]
    return back.to(x.dtype)


# the rounding is the sampler's, the gradient is the trainer's: the backward differentiates the unrounded
# product (straight through the rounding, whose own derivative is zero almost everywhere)
class _RoundedLinear(torch.autograd.Function):
    """x [..., in] @ W [out, in].T with both rounded; gradients as F.linear(x, W)'s."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return F.linear(round_activation(x), round_weight(w))

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = dy @ w if ctx.needs_input_grad[0] else None
        rows = dy.reshape(-1, dy.shape[-1]).t()
        dw = rows @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        return dx, dw


class _RoundedGroupedProduct(torch.autograd.Function):
    """x [T, g, in] times w [g, out, in] per group -> [T, g, out]: the attention's grouped o_a product, the
    weight rounded as its 2-D [g * out, in] HF tensor (wo_a) and x per 1x128 within each group, as vLLM's
    fp8_einsum takes them; gradients as the unrounded einsum's."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        rounded = round_weight(w.reshape(-1, w.shape[-1])).view(w.shape)
        return torch.einsum("tgi,goi->tgo", round_activation(x), rounded)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = torch.einsum("tgo,goi->tgi", dy, w) if ctx.needs_input_grad[0] else None
        dw = torch.einsum("tgo,tgi->goi", dy, x) if ctx.needs_input_grad[1] else None
        return dx, dw


class _RoundedGemm(torch.autograd.Function):
    """gemm(x, w, *rest) with x and w rounded; the gradients the unrounded gemm's, taken by running it again
    in the backward (any bilinear gemm: the grouped GEMM has no weight-gradient form of its own here)."""

    @staticmethod
    def forward(ctx, gemm, parts, x, w, *rest):
        ctx.gemm, ctx.rest = gemm, rest
        ctx.save_for_backward(x, w)
        return gemm(round_activation(x), round_weight(w, parts), *rest)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        with torch.enable_grad():
            x_, w_ = x.detach().requires_grad_(), w.detach().requires_grad_()
            dx, dw = torch.autograd.grad(ctx.gemm(x_, w_, *ctx.rest), (x_, w_), dy)
        return (None, None, dx, dw) + (None,) * len(ctx.rest)


def fp8_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) rounded as vLLM's block-FP8 linear computes it; unrounded gradients."""
    return _RoundedLinear.apply(x, w)


def fp8_grouped_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """einsum('tgi,goi->tgo', x, w) rounded as vLLM's fp8_einsum computes wo_a; unrounded gradients."""
    return _RoundedGroupedProduct.apply(x, w)


def matched_gemm(gemm: Callable[..., torch.Tensor], x: torch.Tensor, w: torch.Tensor, *rest,
                 parts: int = 1) -> torch.Tensor:
    """gemm(x, w, *rest) (e.g. grouped_gemm(tokens, w [E, out, in], counts)) with x rounded per 1x128 and w
    per expert in 128x128 blocks (`parts`: 2 for the experts' fused gate_up, w1 and w3 blocked apart);
    gradients as the unrounded gemm's."""
    return _RoundedGemm.apply(gemm, parts, x, w, *rest)


def round_like_vllm_fp8(x: torch.Tensor, w: torch.Tensor, parts: int = 1
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x rounded per 1x128 along its last dim, w [..., out, in] rounded per 128x128 block of each leading
    index: each expert its own blocks), each straight through on its own: a product of the pair runs
    vLLM's forward, but its gradient then multiplies by the other operand's rounded values (`matched_gemm`
    gives the unrounded product's gradients exactly)."""
    xr = x + (round_activation(x) - x).detach()
    wr = w + (round_weight(w, parts) - w).detach()
    return xr, wr


# ------------------------------------------------------------------------------------------- the model
class BlockFP8MatchedLinear(nn.Linear):
    """An nn.Linear whose product is rounded like vLLM's block-FP8 linear; the same parameters and names
    (made by changing a built nn.Linear's class, so FSDP2 wraps it as it wraps any nn.Linear)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_linear(x, self.weight)
        return y if self.bias is None else y + self.bias


# native names under a decoder layer: the o_a product (the attention's seam), the linears DeepSeek's release
# keeps in FP8 (mlite.runtime.models.deepseek_v4's release-name table: wq_a, wkv, wq_b, wo_b, indexer.wq_b,
# shared_experts.w1/w3/w2) and the routed experts (experts.*.w1/w3/w2, stacked)
_WO_A = "attn.o_a_proj"
_LINEARS = ("attn.q_a_proj", "attn.kv_proj", "attn.q_b_proj", "attn.o_b_proj", "attn.indexer.q_proj",
            "mlp.shared.gate_proj", "mlp.shared.up_proj", "mlp.shared.down_proj")
_EXPERTS = "mlp.experts"


def _layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict) or not hasattr(model, "set_geometry"):
        raise MliteError(f"rollout.match_fp8 rounds DeepSeek-V4's linears as vLLM does; "
                         f"{type(model).__name__} is not DeepSeek-V4: set rollout.match_fp8: false")
    return [(f"layers.{i}", block) for i, block in layers.items()]


def match_vllm_fp8(model: nn.Module, mode: str) -> list[str]:
    """Round `model`'s (a DeepSeek-V4 chunk, built, not yet parallelised) products where vLLM runs FP8 under
    `mode` (mlite.plan.policy.vllm_v4_fp8: "wo_a", "online", "linears"); returns the converted modules'
    names. Parameters and state dict unchanged; idempotent."""
    if mode not in MODES:
        raise MliteError(f"match_vllm_fp8: mode {mode!r} is none of {', '.join(MODES)}")
    converted = []
    for prefix, block in _layers(model):
        attn = block.get_submodule("attn")
        if not hasattr(attn, "set_output_product"):
            raise MliteError("rollout.match_fp8: this DeepSeek-V4 attention multiplies o_a_proj's weight "
                             "without the set_output_product seam, so its FP8 product cannot be rounded")
        attn.set_output_product(fp8_grouped_product)
        converted.append(f"{prefix}.{_WO_A}")
        if mode != "linears":
            continue
        for name in _LINEARS:
            try:
                linear = block.get_submodule(name)
            except AttributeError:  # a layer without an indexer
                continue
            if type(linear) not in (nn.Linear, BlockFP8MatchedLinear):
                raise MliteError(f"match_vllm_fp8: {prefix}.{name} is a {type(linear).__name__}, not a plain "
                                 "nn.Linear; convert before parallelising")
            linear.__class__ = BlockFP8MatchedLinear
            converted.append(f"{prefix}.{name}")
        block.get_submodule(_EXPERTS).set_gemms(partial(matched_gemm, grouped_gemm, parts=2),
                                                partial(matched_gemm, grouped_gemm))
        converted.append(f"{prefix}.{_EXPERTS}")
    return converted
