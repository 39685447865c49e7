"""rollout.match_fp8: the trainer's DeepSeek-V4 products rounded as vLLM runs them in block FP8
(mlite.runtime.fp8_match): the rounding against the weight sync's quantiser and vLLM's activation groups,
straight-through gradients, and the conversion of a tiny DeepSeek-V4."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from mlite.config.arch import arch_from_hf_config
from mlite.errors import MliteError
from mlite.runtime import fp8_match
from mlite.runtime.ckpt import sync
from mlite.runtime.ckpt.hf import load_hf_weights
from mlite.runtime.ckpt.quant import FP8_MAX, dequantize
from mlite.runtime.data.packed import PackedBatch
from mlite.runtime.kernels.grouped_gemm import grouped_gemm
from mlite.runtime.models import build_model
from mlite.runtime.models.deepseek_v4 import Attention

TINY = Path(__file__).parent / "fixtures" / "dsv4" / "tiny"
SHAPES = [(128, 128), (256, 384), (130, 257), (3, 5), (300, 64)]
# the attention's o_a product goes through a seam of the model's (Attention.set_output_product)
needs_seam = pytest.mark.skipif(not hasattr(Attention, "set_output_product"),
                                reason="DeepSeek-V4's Attention has no set_output_product seam yet")


def sent_to_vllm(w: torch.Tensor, name: str = "layers.0.attn.wo_a.weight") -> torch.Tensor:
    """What vLLM multiplies with: the sync's FP8 weight and block scales, dequantised."""
    (_, q), (_, scale) = sync.vllm_fp8_weight(name, w)
    return dequantize(q, scale, block=(128, 128))


def reference_activation(x: torch.Tensor, ue8m0: bool = True) -> torch.Tensor:
    """vLLM's per_token_group_quant_fp8 (group 128) and back, one group at a time: its Triton kernel's scale,
    amax / 448, then with use_ue8m0 exp2(ceil(log2(scale)))."""
    out = torch.empty_like(x)
    for start in range(0, x.shape[-1], 128):
        tile = x[..., start:start + 128]
        scale = tile.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / FP8_MAX
        if ue8m0:
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        q = (tile / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out[..., start:start + 128] = q.float() * scale
    return out


def operands(shape, tokens=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    x = torch.randn(tokens, shape[1], generator=g)
    return x, w


# ------------------------------------------------------------------------------------------- the rounding
@pytest.mark.parametrize("shape", SHAPES)
def test_rounded_weights_are_what_the_sync_sends_bit_for_bit(shape):
    _, w = operands(shape)
    w[0, 0] = 3.0  # one block far larger than the rest
    assert torch.equal(fp8_match.round_weight(w), sent_to_vllm(w))


def test_each_experts_weights_and_each_half_of_gate_up_are_blocked_apart():
    """[E, 2F, H] gate_up: the sync sends experts.{e}.w1 and .w3, each with its own blocks."""
    g = torch.Generator().manual_seed(1)
    gate_up = torch.randn(3, 2 * 130, 200, generator=g) * 0.02
    gate_up[1, 0, 0] = 5.0  # expert 1's w1 only
    expected = torch.stack([torch.cat([sent_to_vllm(half, f"layers.0.ffn.experts.{e}.w1.weight")
                                       for half in expert.chunk(2)]) for e, expert in enumerate(gate_up)])
    assert torch.equal(fp8_match.round_weight(gate_up, parts=2), expected)
    assert not torch.equal(fp8_match.round_weight(gate_up), expected)  # blocks across w1 | w3 differ


@pytest.mark.parametrize("shape", SHAPES)
def test_the_rounded_forward_equals_the_reference_and_actually_rounds(shape):
    x, w = operands(shape)
    y = fp8_match.fp8_linear(x, w)
    reference = reference_activation(x) @ sent_to_vllm(w).T
    torch.testing.assert_close(y, reference, atol=1e-6, rtol=0)
    assert (y - x @ w.T).abs().max() > 1e-4
    # a zero row stays zero (vLLM's floor on the group's amax)
    assert torch.equal(fp8_match.round_activation(torch.zeros(2, 130)), torch.zeros(2, 130))


def test_the_activation_scales_are_powers_of_two_as_vllms_e8m0_quantiser_makes_them():
    """vLLM's V4 path on Hopper quantises activations with ue8m0 scales (DeepGEMM E8M0, on by default; wo_a's
    quantiser always): the rounding is that one, bit for bit, and not the float32-scale one, which differs."""
    x, _ = operands((256, 384), tokens=64, seed=3)
    back = fp8_match.round_activation(x)
    assert torch.equal(back, reference_activation(x))
    assert not torch.equal(back, reference_activation(x, ue8m0=False))
    # each group's largest element lands at or below 448 x its scale, the scale a power of two
    tiles = back.reshape(64, 3, 128).abs().amax(-1)
    scale = torch.exp2(torch.ceil(torch.log2(x.reshape(64, 3, 128).abs().amax(-1) / FP8_MAX)))
    assert torch.equal(torch.log2(scale), torch.log2(scale).round())
    assert bool((tiles <= FP8_MAX * scale).all())


def test_the_rollout_keeps_vllms_e8m0_scales_on_and_refuses_a_process_that_turned_them_off(monkeypatch):
    from mlite.config import load_job
    from mlite.trainers.grpo.vllm_rollout import E8M0_ENV, VLLMRollout, keep_e8m0_scales

    job = load_job("deepseek_v4_flash_grpo", ["rollout.match_fp8=true"])
    monkeypatch.setenv(E8M0_ENV, "0")
    with pytest.raises(MliteError, match=f"{E8M0_ENV}=0 turns them off; unset it"):
        VLLMRollout(job, None, "unused")  # refused before vLLM is imported or anything is built
    monkeypatch.delenv(E8M0_ENV)
    keep_e8m0_scales(False)
    assert E8M0_ENV not in os.environ  # nothing set without rollout.match_fp8
    keep_e8m0_scales(True)
    assert os.environ[E8M0_ENV] == "1"


def test_the_activation_is_rounded_per_token_in_groups_of_128():
    x = torch.full((2, 300), 0.01)
    x[0, 5] = 100.0  # token 0's first group only
    back = fp8_match.round_activation(x)
    assert torch.equal(back[1], fp8_match.round_activation(x[1:])[0])
    assert torch.equal(back[0, 128:], back[1, 128:])
    assert not torch.equal(back[0, :128], back[1, :128])


def test_the_backward_is_straight_through():
    x, w = operands((130, 257), tokens=5)
    x, w = x.requires_grad_(), w.requires_grad_()
    dy = torch.randn(5, 130, generator=torch.Generator().manual_seed(2))
    fp8_match.fp8_linear(x, w).backward(dy)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    F.linear(x2, w2).backward(dy)
    torch.testing.assert_close(x.grad, x2.grad, atol=0, rtol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, atol=0, rtol=1e-6)


def test_the_grouped_o_a_product_rounds_the_2d_weight_and_each_groups_activation():
    g = torch.Generator().manual_seed(3)
    groups, out, inner = 2, 130, 200
    w2d = torch.randn(groups * out, inner, generator=g) * 0.02
    x = torch.randn(5, groups, inner, generator=g, requires_grad=True)
    w = w2d.view(groups, out, inner).requires_grad_()
    y = fp8_match.fp8_grouped_product(x, w)
    reference = torch.einsum("tgi,goi->tgo", reference_activation(x.detach()),
                             sent_to_vllm(w2d).view(groups, out, inner))
    torch.testing.assert_close(y, reference, atol=1e-6, rtol=0)
    dy = torch.randn_like(y)
    y.backward(dy)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.einsum("tgi,goi->tgo", x2, w2).backward(dy)
    torch.testing.assert_close(x.grad, x2.grad, atol=0, rtol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, atol=0, rtol=1e-6)


def test_the_experts_gemm_rounds_per_expert_and_keeps_the_unrounded_gradients():
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(3, 2 * 12, 140, generator=g) * 0.02).requires_grad_()
    counts = torch.tensor([2, 0, 4])
    x = torch.randn(6, 140, generator=g, requires_grad=True)
    y = fp8_match.matched_gemm(grouped_gemm, x, w, counts, parts=2)
    xr, wr = fp8_match.round_like_vllm_fp8(x, w, parts=2)
    torch.testing.assert_close(y, grouped_gemm(xr, wr, counts), atol=0, rtol=0)
    expected = torch.cat([reference_activation(x.detach()[:2]) @ fp8_match.round_weight(w.detach()[0], 2).T,
                          reference_activation(x.detach()[2:]) @ fp8_match.round_weight(w.detach()[2], 2).T])
    torch.testing.assert_close(y, expected, atol=1e-6, rtol=0)
    dy = torch.randn_like(y)
    y.backward(dy)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    grouped_gemm(x2, w2, counts).backward(dy)
    torch.testing.assert_close(x.grad, x2.grad, atol=0, rtol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, atol=0, rtol=1e-6)


# ------------------------------------------------------------------------------------------- the model
def tiny():
    arch = arch_from_hf_config(json.loads((TINY / "config.json").read_text()))
    model = build_model(arch, init=False)
    load_hf_weights(model, TINY)
    ref = load_file(TINY / "reference.safetensors")
    seqs = [ref[k].tolist() for k in sorted(k for k in ref if k.startswith("input_ids."))]
    return model, PackedBatch.from_sequences(seqs)


def logits(model, batch):
    with torch.no_grad():
        return model.compute_logits(model(batch).hidden)


def close_but_rounded(rounded: torch.Tensor, plain: torch.Tensor) -> None:
    """e4m3 keeps 3 mantissa bits: a rounded operand is within 2**-4 of its value, relatively, so one rounded
    product within about 2**-3 of the unrounded one. The logits' mean change stays within twice that (a
    quarter of their mean size; measured 0.18 with every linear rounded) though the 16-wide tiny model's
    dot products average no errors out and a rounded input can flip a token's routed experts or indexer
    picks (discrete: a few logits then move by their own size, so the maximum is no measure)."""
    diff = (rounded - plain).abs()
    assert 0 < diff.mean() <= 0.25 * plain.abs().mean(), (diff.mean(), plain.abs().mean())


def test_rounding_the_linears_changes_the_logits_a_little_and_nothing_in_the_state_dict():
    """The class swap of the release-FP8 linears (what "linears" does to them), without the o_a seam."""
    model, batch = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plain = logits(model, batch)
    for block in model.layers.values():
        for name in fp8_match._LINEARS:
            if name.startswith("attn.indexer.") and block.attn.indexer is None:
                continue
            block.get_submodule(name).__class__ = fp8_match.BlockFP8MatchedLinear
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], v) for k, v in before.items())
    close_but_rounded(logits(model, batch), plain)


def test_a_model_without_the_o_a_seam_is_refused_and_so_is_an_unknown_mode():
    model, _ = tiny()
    with pytest.raises(MliteError, match="mode"):
        fp8_match.match_vllm_fp8(model, "everything")
    if not hasattr(Attention, "set_output_product"):
        with pytest.raises(MliteError, match="set_output_product"):
            fp8_match.match_vllm_fp8(model, "wo_a")


@needs_seam
@pytest.mark.parametrize("mode", ["wo_a", "online", "linears"])
def test_match_vllm_fp8_converts_the_modes_layers_only(mode):
    model, batch = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plain = logits(model, batch)
    converted = fp8_match.match_vllm_fp8(model, mode)
    expected = []
    for i, block in model.layers.items():
        expected.append(f"layers.{i}.attn.o_a_proj")
        if mode == "linears":
            expected += [f"layers.{i}.{n}" for n in fp8_match._LINEARS
                         if block.attn.indexer is not None or not n.startswith("attn.indexer.")]
            expected.append(f"layers.{i}.mlp.experts")
    assert converted == expected
    swapped = sorted(n for n, m in model.named_modules() if isinstance(m, fp8_match.BlockFP8MatchedLinear))
    assert swapped == sorted(n for n in expected if not n.endswith(("o_a_proj", "experts")))
    flagged = [n for n, m in model.named_modules()
               if getattr(getattr(m, "gate_up_gemm", None), "func", None) is fp8_match.matched_gemm]
    assert flagged == [n for n in expected if n.endswith("experts")]
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], v) for k, v in before.items())
    close_but_rounded(logits(model, batch), plain)
    assert fp8_match.match_vllm_fp8(model, mode) == converted  # idempotent


def test_a_job_with_match_fp8_builds_its_model_rounded():
    """rollout.match_fp8 reaches the model the runtime builds (mlite.runtime.layout.rank_chunks): every
    layer's o_a product rounds (wo_a goes in FP8 by default), and the other linears stay plain; with
    rollout.fp8_weights every release-FP8 linear and the experts round too."""
    from mlite.config import load_job
    from mlite.plan import plan_job
    from mlite.runtime.layout import rank_chunks

    base = ["model.name=small-deepseek-v4", "model.path=null", "rollout.engine=vllm", "trainer.device=cuda",
            "cluster.gpu=h100", "precision.compute=bf16"]
    for extra, linears in (([], False), (["rollout.fp8_weights=true"], True)):
        plan = plan_job(load_job("demo_grpo", [*base, *extra, "rollout.match_fp8=true"]))
        model = rank_chunks(plan, None, torch.float32, "cpu")[0]
        layers = list(model.layers.values())
        assert all(layer.attn.output_product is fp8_match.fp8_grouped_product for layer in layers)
        rounded = [n for n, m in model.named_modules() if isinstance(m, fp8_match.BlockFP8MatchedLinear)]
        assert bool(rounded) is linears and all(
            (getattr(layer.mlp.experts.gate_up_gemm, "func", None) is fp8_match.matched_gemm) is linears
            for layer in layers)
    plain = rank_chunks(plan_job(load_job("demo_grpo", base)), None, torch.float32, "cpu")[0]
    assert all(layer.attn.output_product is not fp8_match.fp8_grouped_product
               for layer in plain.layers.values())


@pytest.mark.gpu
@pytest.mark.vllm
def test_gpu_activation_rounding_is_vllms_per_token_group_quantiser_bit_for_bit():
    """vLLM's own quantiser on the GPU (its CUDA op or Triton kernel), with ue8m0 scales: the trainer's
    rounding of a bf16 activation is its dequantised output, bit for bit; its float32 scales differ."""
    from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8

    tokens, width = 257, 640
    g = torch.Generator(device="cuda").manual_seed(0)
    spread = torch.logspace(-3, 2, width, device="cuda")  # groups of very different magnitudes
    x = (torch.randn(tokens, width, device="cuda", generator=g) * spread).to(torch.bfloat16)

    def vllm_rounded(ue8m0):
        q, s = per_token_group_quant_fp8(x, 128, use_ue8m0=ue8m0)
        back = q.float().view(tokens, width // 128, 128) * s.float().view(tokens, width // 128, 1)
        return back.view(tokens, width).to(torch.bfloat16)

    mine = fp8_match.round_activation(x)
    assert torch.equal(mine, vllm_rounded(True))
    assert not torch.equal(mine, vllm_rounded(False))
