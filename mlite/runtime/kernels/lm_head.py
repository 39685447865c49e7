"""Log-probabilities of the label tokens through the LM head, without keeping [T, vocab] logits.

The runtime's loss path (`mlite.runtime.loss.token_logprobs`) takes this kernel whenever the LM head is a
plain bias-free linear layer on this rank and no entropy is asked for; the trainers and `mlite bench` reach
it through `Runtime.forward_backward`.

With a 152k vocabulary the logits are the largest tensor of a step. `linear_logprobs` computes, chunk by
chunk of tokens, logits = hidden @ W^T in the compute dtype, their log-sum-exp in fp32 and the label's logit,
and keeps only [T] numbers. The backward pass recomputes each chunk's logits once and forms
d logits = g * (onehot(label) - softmax) directly in the compute dtype, then two matmuls: no fp32 copy of the
logits, no log_softmax tensor, no scatter into a zero [T, vocab] gradient. Entropy needs the full
distribution and stays on the plain autograd path in `mlite.runtime.loss`. A batch of a single chunk keeps its
logits from the forward pass (memory of one chunk, the same as the recompute would take) and skips the
recompute: one LM-head matmul less per step.
"""

from __future__ import annotations

import torch

CHUNK_TOKENS = 4096


def _lse_fp32(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits.float(), dim=-1)  # [t] fp32


def _softmax_grad_(logits: torch.Tensor, lse: torch.Tensor, g: torch.Tensor) -> None:
    # -g * softmax, written over the logits: the chunk's gradient takes no second [t, V] buffer (1 GB of a
    # 4096-token chunk at a 129k vocabulary)
    logits.copy_((-g[:, None] * torch.exp(logits.float() - lse[:, None])).to(logits.dtype))


_FUSED: dict = {}


def _fused(fn):
    """On CUDA, one generated kernel per elementwise/reduction pass over the [t, V] logits (a single read of
    the bf16 logits instead of fp32 copies); plain eager elsewhere (CPU tests, no compiler needed)."""
    def call(*args):
        if not args[0].is_cuda:
            return fn(*args)
        if fn not in _FUSED:
            # default dynamic: the token count changes from batch to batch in training; after the first new
            # count the kernel is recompiled once with t symbolic instead of once per count
            _FUSED[fn] = torch.compile(fn)
        return _FUSED[fn](*args)
    return call


def _chunk_stats(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor):
    logits = h @ weight.t()  # [t, V] in the compute dtype
    lse = _fused(_lse_fp32)(logits)
    target = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1).float()  # [t]
    return logits, lse, target


class LinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens):
        """hidden [T, H], weight [V, H], labels [T] (valid ids) -> log p(label) [T] fp32. The matmuls run in
        hidden's dtype (fp32 master weights meet bf16 activations as under autocast, in backward too)."""
        weight_dtype, weight = weight.dtype, weight.to(hidden.dtype)
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lses = torch.empty_like(out)
        logits = None
        for start in range(0, hidden.shape[0], chunk_tokens):
            end = start + chunk_tokens
            logits, lse, target = _chunk_stats(hidden[start:end], weight, labels[start:end])
            out[start:end] = target - lse
            lses[start:end] = lse
        # one chunk: keep its logits (compute dtype, the size of one chunk) instead of recomputing them
        ctx.kept_logits = logits if 0 < hidden.shape[0] <= chunk_tokens else None
        ctx.save_for_backward(hidden, weight, labels, lses)
        ctx.chunk_tokens, ctx.weight_dtype = chunk_tokens, weight_dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, labels, lses = ctx.saved_tensors
        chunks = range(0, hidden.shape[0], ctx.chunk_tokens)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None
        for start in chunks:
            end = start + ctx.chunk_tokens
            h, y, g = hidden[start:end], labels[start:end], grad_out[start:end].float()
            logits = ctx.kept_logits if ctx.kept_logits is not None else h @ weight.t()  # [t, V]
            ctx.kept_logits = None
            _fused(_softmax_grad_)(logits, lses[start:end], g)
            grad_logits = logits
            grad_logits.scatter_add_(-1, y[:, None], g[:, None].to(h.dtype))  # + g at the label: onehot
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_logits @ weight
            if ctx.needs_input_grad[1]:
                part = grad_logits.t() @ h  # [V, H]
                if len(chunks) == 1:
                    grad_weight = part
                else:  # several chunks: sum in fp32 (add_ converts the bf16 part as it adds: no fp32 copy)
                    grad_weight = part.float() if grad_weight is None else grad_weight.add_(part)
            # drop this chunk's logits and weight gradient before the next chunk's exist: one of each alive,
            # not two (a chunk's logits are 1.2 GB at Qwen3's vocabulary and 4,096 tokens, at the step's peak)
            logits = grad_logits = part = None
        if grad_weight is not None:
            grad_weight = grad_weight.to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    chunk_tokens: int = CHUNK_TOKENS) -> torch.Tensor:
    """log softmax(hidden @ weight^T)[label] per token, fp32 [T]. `labels` must be valid token ids."""
    return LinearLogprob.apply(hidden, weight, labels, chunk_tokens)
