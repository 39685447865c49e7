"""The chunked LM-head log-prob kernel equals log_softmax over full logits, values and gradients."""

from __future__ import annotations

import pytest
import torch

from mlite.runtime.kernels.lm_head import linear_logprobs


@pytest.mark.parametrize("chunk", [4, 7, 64])
def test_linear_logprobs_match_log_softmax_and_its_gradients(chunk):
    gen = torch.Generator().manual_seed(chunk)
    T, H, V = 19, 16, 53
    hidden = torch.randn(T, H, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (T,), generator=gen)
    upstream = torch.randn(T, generator=gen, dtype=torch.float64)

    ref = torch.log_softmax(hidden @ weight.t(), -1).gather(-1, labels[:, None]).squeeze(-1)
    (ref * upstream).sum().backward()
    ref_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    out = linear_logprobs(hidden, weight, labels, chunk_tokens=chunk)
    (out * upstream).sum().backward()
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)  # lse is kept in fp32
    torch.testing.assert_close(hidden.grad, ref_grads[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, ref_grads[1], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_linear_logprobs_bf16_on_cuda_match_fp32_reference():
    gen = torch.Generator(device="cuda").manual_seed(0)
    T, H, V = 1024, 256, 32000
    hidden = torch.randn(T, H, generator=gen, device="cuda").bfloat16().requires_grad_()
    weight = (torch.randn(V, H, generator=gen, device="cuda") * 0.05).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (T,), generator=gen, device="cuda")
    out = linear_logprobs(hidden, weight, labels, chunk_tokens=256)
    out.sum().backward()
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    ref = torch.log_softmax(h32 @ w32.t(), -1).gather(-1, labels[:, None]).squeeze(-1)
    ref.sum().backward()
    rel = lambda a, b: float((a.float() - b).norm() / b.norm())  # noqa: E731
    assert rel(out, ref) < 1e-2 and rel(hidden.grad, h32.grad) < 2e-2 and rel(weight.grad, w32.grad) < 2e-2


def test_token_logprobs_fused_path_equals_the_autograd_path():
    from mlite.runtime.data.packed import IGNORE
    from mlite.runtime.loss import token_logprobs

    gen = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(8, 31, bias=False).double()
    hidden = torch.randn(12, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 31, (12,), generator=gen)
    labels[[0, 5]] = IGNORE
    grads = []
    for weight in (None, head.weight):
        logp, _ = token_logprobs(hidden, labels, head, temperature=0.7, chunk_tokens=5, head_weight=weight)
        logp.sum().backward()
        grads.append((logp.detach(), hidden.grad.clone(), head.weight.grad.clone()))
        hidden.grad = head.weight.grad = None
    for plain, fused in zip(*grads):  # both paths take log-softmax in fp32: equal to fp32 rounding
        torch.testing.assert_close(fused.double(), plain.double(), rtol=1e-5, atol=1e-6)
    assert grads[1][0][0] == 0 and grads[1][0][5] == 0  # IGNORE positions give 0, as on the plain path


def test_fp32_master_weight_with_lower_precision_activations():
    # autocast-style: bf16 activations meet the fp32 master weight; gradients come back in each one's dtype
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(6, 8, generator=gen).bfloat16().requires_grad_()
    weight = torch.randn(11, 8, generator=gen, requires_grad=True)
    labels = torch.randint(0, 11, (6,), generator=gen)
    out = linear_logprobs(hidden, weight, labels)
    out.sum().backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32
    ref = torch.log_softmax(hidden.float() @ weight.detach().bfloat16().float().t(), -1)
    torch.testing.assert_close(out, ref.gather(-1, labels[:, None]).squeeze(-1), rtol=2e-2, atol=2e-2)
