"""One step's forward (and backward) over micro-batches, on any layout: what `Runtime.forward_backward` runs.

`loss_fn(batch, token_logprobs, entropy, aux_loss) -> (loss, metrics)` returns this micro-batch's share of
the step's loss (normalised by global counts, see mlite.runtime.loss.sft_loss), so summing the gradients
over micro-batches and data-parallel ranks gives the exact gradient of the step's loss. `aux_loss` is this
micro-batch's share of a MoE model's balance loss, weighted here, once for every trainer: the step's balance
loss is its mean over the micro-batches of every data-parallel rank, so each share is 1 / (micro-batches x
dp) of the micro-batch's value, or the caller's `aux_weights` (a trainer whose ranks hold different numbers
of real micro-batches gives 0 to the fillers that keep them in lockstep). The loss_fn adds it. Under pipeline
parallel the stages back-propagate their own terms of it (mlite.runtime.parallel.pipeline) and the loss_fn
receives 0.

Each rank computes its share of a micro-batch (mlite.runtime.parallel.step.local_share: padded for sequence
parallel, zigzag-split for context parallel); `whole_stream` turns the share's per-token outputs back into
the whole micro-batch's, so every rank returns the same outputs as one process would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from mlite.config.arch import ModelArch
from mlite.runtime.data.packed import PackedBatch
from mlite.runtime.loss import token_logprobs
from mlite.runtime.parallel.mesh import ParallelDims, ParallelMesh
from mlite.runtime.parallel.pipeline import forward_only as forward_only_schedule
from mlite.runtime.parallel.pipeline import one_f_one_b
from mlite.runtime.parallel.step import (
    broadcast_outputs,
    equal_lengths,
    gather_stream,
    local_share,
    real_token_count,
    real_token_mask,
    vocab_parallel_logprobs,
)

LossFn = Callable[..., tuple[torch.Tensor, dict]]


class Runtime(Protocol):
    """What a step reads of the runtime (mlite.runtime.engine.Runtime is the one)."""

    device: torch.device
    placement: Any  # .equal_lengths, .host_group (mlite.runtime.layout.Placement)
    mesh: ParallelMesh | None
    dims: ParallelDims
    arch: ModelArch
    model: nn.Module
    pipeline: Any  # mlite.runtime.parallel.pipeline.PipelineRunner, None without pipeline parallel
    chunks: dict[int, nn.Module] | None
    autocast_dtype: torch.dtype | None

    def set_gradient_sync(self, chunk: int, last: bool) -> None: ...

    def release_gathered(self) -> None: ...


def forward_backward(
    rt: Runtime,
    micro_batches: list[PackedBatch],
    loss_fn: LossFn | None,
    forward_only: bool = False,
    with_entropy: bool = False,
    temperature: float = 1.0,
    ends_step: bool = True,
    aux_weights: list[float] | None = None,
) -> list[dict[str, Any]]:
    """Per micro-batch: {"loss", "metrics", "logprobs" [T], "entropy" [T] or None, "num_tokens"}; log-probs
    of IGNORE labels are 0. With loss_fn None (forward_only), only the log-probs are computed. `ends_step`
    False: more micro-batches of this optimizer step follow in another call, so no gradient is reduced
    yet (the backends reduce in the step's last backward)."""
    if loss_fn is None and not forward_only:
        raise ValueError("forward_backward needs a loss_fn unless forward_only")
    fulls = [b.to(rt.device, non_blocking=True) for b in micro_batches]
    padded = fulls  # outputs are the micro-batches' own tokens (`fulls`); padding is computed, then dropped
    if rt.placement.equal_lengths:
        padded = equal_lengths(fulls, rt.placement.host_group)
    shares = [local_share(b, rt.mesh, rt.plan.context_chunk, rt.plan.token_multiple) for b in padded]
    if aux_weights is None:
        aux_weights = [1.0 / (len(fulls) * rt.dims.dp)] * len(fulls)
    with torch.set_grad_enabled(not forward_only), _autocast(rt), _vocab_parallel(rt):
        if rt.pipeline is not None:
            computed = _pipelined(rt, fulls, shares, loss_fn, forward_only, with_entropy, temperature,
                                  aux_weights, ends_step)
        else:
            computed = [_one(rt, full, share, loss_fn, forward_only, with_entropy, temperature, weight,
                             last=ends_step and i == len(fulls) - 1)
                        for i, (full, share, weight) in enumerate(zip(fulls, shares, aux_weights))]
    if forward_only:  # no backward frees what FSDP2 units kept gathered for one
        rt.release_gathered()
    outputs = []
    for full, share, (loss, metrics, logprobs, entropy) in zip(fulls, shares, computed):
        # loss and metrics stay 0-dim tensors (numbers after a pipeline's broadcast): reading one
        # (float()) waits for the GPU, so callers read them when they log, and the next step's work can be
        # queued before that (mlite.trainers.loop)
        outputs.append({
            "loss": loss,
            "metrics": {key: value.detach() if isinstance(value, torch.Tensor) else value
                        for key, value in metrics.items()},
            "logprobs": whole_stream(rt, logprobs, share, full),
            "entropy": whole_stream(rt, entropy, share, full) if entropy is not None else None,
            "num_tokens": real_token_count(share, full),
        })
    return outputs


def whole_stream(rt: Runtime, values: torch.Tensor, share: PackedBatch, full: PackedBatch) -> torch.Tensor:
    """Per-token values of this rank's share -> the whole micro-batch's [T]: gathered over cp, the
    sequence-parallel padding dropped."""
    if rt.dims.cp > 1:
        return gather_stream(values, share, full, rt.mesh.group("cp"))
    return values[: full.num_tokens]


def _one(rt, full, share, loss_fn, forward_only, with_entropy, temperature, aux_weight, last):
    if not forward_only:  # one gradient reduction per step, in the last backward
        rt.set_gradient_sync(0, last)
    out = rt.model(share)
    logprobs, entropy = _token_logprobs(rt, out.hidden, share.labels, temperature, with_entropy,
                                        real_token_mask(share, full), rt.model.compute_logits)
    aux = _aux_share(rt, out.aux_loss) * aux_weight
    loss, metrics = loss_fn(share, logprobs, entropy, aux) if loss_fn else (None, {})
    if not forward_only:
        loss.backward()
    # detached now: an entropy the loss did not use still holds its chunks' recomputed fp32 logits
    # (checkpoint keeps what no backward consumed), about 2 x tokens x vocab x 4 bytes a micro-batch
    return loss.detach() if loss is not None else None, metrics, logprobs.detach(), _detached(entropy)


def _detached(values: torch.Tensor | None) -> torch.Tensor | None:
    return values.detach() if values is not None else None


def _pipelined(rt, fulls, shares, loss_fn, forward_only, with_entropy, temperature, aux_weights, ends_step):
    """pp > 1: the 1F1B schedule (interleaved with vpp > 1) for training, the forward-only schedule
    otherwise. The last stage computes log-probs and the loss; its per-micro-batch outputs are then
    broadcast over `pp`, so every rank returns the same outputs as without a pipeline. A MoE model's
    balance loss is back-propagated by each stage for its own layers (weighted by `aux_weights`); its
    value, summed over the stages, joins each micro-batch's reported loss."""
    dims, chunks = rt.dims, rt.chunks
    last_chunk = dims.pp * dims.vpp - 1
    computed = {}  # micro-batch -> (loss, metrics, logprobs, entropy), on the last stage
    index = {id(b): m for m, b in enumerate(shares)}
    no_aux = torch.zeros((), device=rt.device)  # the stages back-propagate the balance loss themselves

    def last_stage(chunk, hidden, batch):
        m = index[id(batch)]
        logprobs, entropy = _token_logprobs(rt, hidden, batch.labels, temperature, with_entropy,
                                            real_token_mask(batch, fulls[m]), chunk.compute_logits)
        loss, metrics = loss_fn(batch, logprobs, entropy, no_aux) if loss_fn else (None, {})
        computed[m] = (loss, metrics, logprobs.detach(), _detached(entropy))
        return loss

    pp_rank = rt.mesh.rank_in("pp")
    if forward_only:
        actions = forward_only_schedule(dims.pp, dims.vpp, pp_rank, len(shares))
        result = rt.pipeline.run(actions, shares, dtype=rt.pipeline.activation_dtype)
        if last_chunk in chunks:
            for m, hidden in result["outputs"].items():
                last_stage(chunks[last_chunk], hidden, shares[m])
    else:
        for c in chunks:
            rt.set_gradient_sync(c, False)
        result = rt.pipeline.run(
            one_f_one_b(dims.pp, dims.vpp, pp_rank, len(shares)), shares, loss_fn=last_stage,
            before_backward=lambda c, last: rt.set_gradient_sync(c, ends_step and last),
            dtype=rt.pipeline.activation_dtype, aux_weights=aux_weights,
        )
    outputs = [broadcast_outputs(computed.get(m), share.num_tokens, with_entropy, rt.mesh, rt.device)
               for m, share in enumerate(shares)]
    if forward_only or rt.pipeline.moe is None:
        return outputs
    # each stage holds its layers' terms of every micro-batch's balance loss: their sum is the whole value
    aux = torch.zeros(len(shares), dtype=torch.float64, device=rt.device)
    for m, term in result["aux"].items():
        aux[m] = term.double()
    torch.distributed.all_reduce(aux, group=rt.mesh.group("pp"))
    aux = aux * rt.dims.tp  # as `_aux_share`: each cp x tp rank holds 1/(cp*tp) of the value
    return [(loss + aux[m].float(), *rest) for m, (loss, *rest) in enumerate(outputs)]


def _autocast(rt: Runtime):
    if rt.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(rt.device.type, dtype=rt.autocast_dtype)


def _vocab_parallel(rt: Runtime):
    """Under tp the LM head's logits are split by vocabulary: the loss and its backward run under
    loss_parallel (mlite.runtime.parallel.step.vocab_parallel_logprobs)."""
    if rt.dims.tp == 1:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def _token_logprobs(rt: Runtime, hidden, labels, temperature, with_entropy, real, compute_logits):
    """Log-probs (0 where IGNORE, padding included) and entropy (0 on padding) of a share's tokens."""
    if rt.dims.tp > 1:
        logprobs, entropy = vocab_parallel_logprobs(hidden, labels, compute_logits, temperature, with_entropy)
    else:
        logprobs, entropy = token_logprobs(hidden, labels, compute_logits, temperature, with_entropy)
    if entropy is not None and not bool(real.all()):
        entropy = entropy * real
    return logprobs, entropy


def _aux_share(rt: Runtime, aux_loss: torch.Tensor) -> torch.Tensor:
    """The MoE balance loss as the loss_fn sees it. Under cp x tp each rank holds 1/(cp*tp) of the
    micro-batch's value and back-propagates that share (the router statistics are summed over cp_tp).
    Its value is scaled by tp, gradient unchanged, so that, like the token losses (whole on every tp
    rank, split over cp), the returned losses sum over the loss group (dp_cp) to the step's loss."""
    if rt.dims.tp == 1:
        return aux_loss
    return aux_loss + (aux_loss * (rt.dims.tp - 1)).detach()
