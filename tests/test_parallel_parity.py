"""Every parallel layout trains the tiny dense and MoE decoders to the single-process numbers.

Each test starts 2 or 4 gloo ranks, applies the layout (TP+SP, CP, EP, FSDP2 over dp x cp), trains 3
optimizer steps of 4 packed micro-batches (AdamW, clipping on) and compares the loss and the gradient norm
of every step with one process running the same micro-batches with gradient accumulation: within 1e-5
relative in fp32.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from mlite.runtime.data.packed import IGNORE
from mlite.runtime.parallel.context import split_for_context_parallel
from mlite.runtime.parallel.mesh import ParallelDims
from mlite.runtime.parallel.parallelize import (
    apply_context_parallel,
    apply_expert_parallel,
    apply_fsdp,
    apply_tensor_parallel,
    clip_grad_norm_,
    set_gradient_sync,
)
from parallel_harness import launch, make_batches, make_model, total_targets

STEPS, MICRO_BATCHES, AUX_COEF, LR, CLIP = 3, 4, 0.1, 1e-2, 1.0


def train(model, mesh=None) -> list[tuple[float, float]]:
    """(loss, grad norm) per step. Without a mesh: one process, all micro-batches accumulated."""
    dims = mesh.dims if mesh else ParallelDims(1)
    dp_rank = mesh.rank_in("dp") if mesh else 0
    cp_rank = mesh.rank_in("cp") if mesh else 0
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, foreach=False)
    batches = make_batches(STEPS * MICRO_BATCHES)
    history = []
    for step in range(STEPS):
        step_batches = batches[step * MICRO_BATCHES : (step + 1) * MICRO_BATCHES]
        targets = total_targets(step_batches)  # the loss is a mean over the step's target tokens
        mine = step_batches[dp_rank :: dims.dp]
        ce_total, aux_total = torch.zeros(()), torch.zeros(())
        for i, batch in enumerate(mine):
            if mesh:
                set_gradient_sync(model, i == len(mine) - 1)
            if dims.cp > 1:
                batch = split_for_context_parallel(batch, dims.cp, cp_rank)
            hidden, aux = model(batch)
            logits = model.output(hidden)
            with loss_parallel():  # vocab-parallel cross-entropy when the logits are split over tp
                ce = F.cross_entropy(logits, batch.labels, ignore_index=IGNORE, reduction="sum") / targets
                if isinstance(ce, DTensor):
                    ce = ce.to_local()  # replicated over tp: every tp rank holds the whole value
                (ce + AUX_COEF * aux).backward()
            ce_total += ce.detach()
            aux_total += aux.detach()
        if mesh:
            dist.all_reduce(ce_total, group=mesh["dp_cp"].get_group())
            dist.all_reduce(aux_total, group=mesh["dp_cp_tp"].get_group())  # cp x tp ranks hold shares
        norm = clip_grad_norm_(params, CLIP, mesh)
        opt.step()
        opt.zero_grad()
        history.append((float(ce_total + AUX_COEF * aux_total), float(norm)))
    return history


def _worker(rank, world, layout, moe, out):
    mesh = ParallelDims(world, **layout).build("cpu")
    model = make_model(moe)
    apply_tensor_parallel(model, mesh)
    apply_context_parallel(model, mesh)
    apply_expert_parallel(model, mesh)
    apply_fsdp(model, mesh)
    history = train(model, mesh)
    if rank == 0:
        torch.save(history, out)


_REFERENCE: dict[bool, list] = {}


def reference(moe: bool):
    if moe not in _REFERENCE:
        _REFERENCE[moe] = train(make_model(moe))
    return _REFERENCE[moe]


def check_parity(tmp_path, world, layout, moe):
    out = tmp_path / f"{'moe' if moe else 'dense'}.pt"
    launch(world, _worker, layout, moe, str(out))
    got, want = torch.load(out), reference(moe)
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want)):
        assert loss == pytest.approx(ref_loss, rel=1e-5), f"step {step} loss {loss} vs one process {ref_loss}"
        assert norm == pytest.approx(ref_norm, rel=1e-5), f"step {step} grad norm {norm} vs {ref_norm}"
    assert len(got) == STEPS


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize(
    "world,layout",
    [
        (2, dict(dp=2)),
        (2, dict(tp=2)),
        (2, dict(cp=2)),
        (4, dict(dp=2, tp=2)),
        (4, dict(cp=2, tp=2)),
    ],
    ids=["dp2", "tp2", "cp2", "tp2xdp2", "cp2xtp2"],
)
def test_layout_matches_one_process(tmp_path, world, layout, moe):
    check_parity(tmp_path, world, layout, moe)


@pytest.mark.parametrize(
    "world,layout", [(2, dict(dp=2, ep=2)), (4, dict(dp=4, ep=2)), (2, dict(tp=2, ep=2))], ids=["ep2", "ep2xdp2", "ep2xtp2"]
)
def test_expert_parallel_matches_one_process(tmp_path, world, layout):
    check_parity(tmp_path, world, layout, moe=True)
