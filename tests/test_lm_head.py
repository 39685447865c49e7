"""The chunked LM-head log-prob kernel equals log_softmax over full logits, values and gradients, and the
runtime's loss path (token_logprobs, Runtime.forward_backward) takes it for a plain linear head."""

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
def test_gpu_backward_over_several_chunks_keeps_one_chunk_of_logits_alive():
    """The backward's peak above what exists before it: one chunk's logits, the fp32 weight-gradient sum,
    one chunk's bf16 weight gradient, the bf16 result and the hidden gradient, not a second chunk of logits
    or an fp32 copy of a chunk's weight gradient (each as large as the slack allowed here or larger)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    T, H, V, chunk = 8192, 1024, 32768, 2048
    hidden = torch.randn(T, H, generator=gen, device="cuda").bfloat16().requires_grad_()
    weight = (torch.randn(V, H, generator=gen, device="cuda") * 0.05).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (T,), generator=gen, device="cuda")
    loss = linear_logprobs(hidden, weight, labels, chunk_tokens=chunk).sum()
    loss.backward(retain_graph=True)  # the first backward compiles the fused kernels
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    expected = chunk * V * 2 + V * H * (4 + 2 + 2) + T * H * 2
    assert extra <= expected + chunk * V, (extra, expected)


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

    def rel(a, b):
        return float((a.float() - b).norm() / b.norm())

    assert rel(out, ref) < 1e-2 and rel(hidden.grad, h32.grad) < 2e-2 and rel(weight.grad, w32.grad) < 2e-2


def _both_paths(head, hidden, labels, **kw):
    """(log-probs, hidden grad, head weight grad) of the kernel path (the head itself) and of the autograd
    path (a lambda around it, which token_logprobs cannot see through)."""
    from mlite.runtime.loss import token_logprobs

    results = []
    for compute_logits in (head, lambda h: head(h)):
        logp, _ = token_logprobs(hidden, labels, compute_logits, **kw)
        logp.sum().backward()
        results.append((logp.detach(), hidden.grad.clone(), head.weight.grad.clone()))
        hidden.grad = head.weight.grad = None
    return results


def test_token_logprobs_kernel_path_equals_the_autograd_path():
    from mlite.runtime.data.packed import IGNORE

    gen = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(8, 31, bias=False).double()
    hidden = torch.randn(12, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 31, (12,), generator=gen)
    labels[[0, 5]] = IGNORE
    fused, plain = _both_paths(head, hidden, labels, temperature=0.7, chunk_tokens=5)
    for a, b in zip(fused, plain):  # both paths take log-softmax in fp32: equal to fp32 rounding
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-6)
    assert fused[0][0] == 0 and fused[0][5] == 0  # IGNORE positions give 0, as on the plain path


def test_token_logprobs_under_autocast_match_the_autograd_path():
    # fp32 master weights, bf16 compute (the runtime on one GPU with precision.master fp32): the kernel runs
    # its matmuls in the autocast dtype, as compute_logits does under autocast
    gen = torch.Generator().manual_seed(3)
    head = torch.nn.Linear(16, 40, bias=False)
    hidden = torch.randn(20, 16, generator=gen, requires_grad=True)
    labels = torch.randint(0, 40, (20,), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused, plain = _both_paths(head, hidden, labels, chunk_tokens=8)
    assert fused[0].dtype == torch.float32 and fused[1].dtype == fused[2].dtype == torch.float32
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-deepseek-v4"])
def test_linear_head_weight_sees_only_a_plain_bias_free_head(preset):
    from mlite.config.catalog import preset_arch
    from mlite.runtime.loss import linear_head_weight
    from mlite.runtime.models import build_model

    model = build_model(preset_arch(preset), attention_backend="torch")
    assert linear_head_weight(model.compute_logits) is model.output.weight  # what the runtime passes
    assert linear_head_weight(model.output) is model.output.weight
    assert linear_head_weight(lambda h: model.output(h)) is None  # opaque: the autograd path
    assert linear_head_weight(torch.nn.Linear(4, 9)) is None  # a bias
    hooked = torch.nn.Linear(4, 9, bias=False)
    hooked.register_forward_pre_hook(lambda module, args: None)  # FSDP2 gathers the weight in such hooks
    assert linear_head_weight(hooked) is None


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-deepseek-v4"])
def test_runtime_forward_backward_takes_the_kernel_and_equals_the_autograd_path(monkeypatch, preset):
    """What the trainers run: Runtime.forward_backward without entropy goes through the LM-head kernel; its
    log-probs and gradients equal those of the autograd path (taken when entropy is asked for)."""
    from mlite.config import job_from_dict
    from mlite.runtime import loss
    from mlite.runtime.data.packed import PackedBatch
    from mlite.runtime.engine import Runtime

    calls = []
    kernel = loss.linear_logprobs
    monkeypatch.setattr(loss, "linear_logprobs", lambda *a: calls.append(a[0].shape) or kernel(*a))
    rt = Runtime(job_from_dict({"model": {"name": preset}, "precision": {"compute": "fp32"},
                                "data": {"seq_len": 64},
                                "trainer": {"device": "cpu", "steps": 1, "seed": 3}}))
    gen = torch.Generator().manual_seed(0)
    batch = PackedBatch.from_sequences([torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 14)])
    runs = []
    for with_entropy in (False, True):
        rt.zero_grad()
        loss_fn = loss.sft_loss(batch.num_target_tokens)
        (out,) = rt.forward_backward([batch], loss_fn, with_entropy=with_entropy)
        # None: unused on these short sequences (V4's compressors need a complete window) or frozen
        grads = [None if p.grad is None else p.grad.clone() for p in rt.model.parameters()]
        runs.append((out["loss"], out["logprobs"], grads))
    assert calls == [(23, 64)]  # once, without entropy: the whole batch in one chunk
    (loss_k, logp_k, grads_k), (loss_a, logp_a, grads_a) = runs
    assert loss_k == pytest.approx(loss_a, rel=1e-5)
    torch.testing.assert_close(logp_k, logp_a, rtol=1e-5, atol=1e-5)
    assert [g is None for g in grads_k] == [g is None for g in grads_a]
    assert sum(g is not None for g in grads_k) > len(grads_k) // 2
    for a, b in zip(grads_k, grads_a):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


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
