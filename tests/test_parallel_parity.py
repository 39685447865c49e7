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
from mlite.runtime.parallel.pipeline import PipelineRunner, keep_chunk, one_f_one_b, split_layers
from parallel_harness import LAYERS, launch, make_batches, make_model, total_targets

STEPS, MICRO_BATCHES, LR, CLIP = 3, 4, 1e-3, 1.0


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
            out = model(batch)
            hidden, aux = out.hidden, out.aux_loss
            with loss_parallel():  # its backward too runs under the vocab-parallel loss
                ce = ce_loss(model, hidden, batch, targets)
                (ce + aux).backward()
            ce_total += ce.detach()
            aux_total += aux.detach()
        if mesh:
            dist.all_reduce(ce_total, group=mesh["dp_cp"].get_group())
            dist.all_reduce(aux_total, group=mesh["dp_cp_tp"].get_group())  # cp x tp ranks hold shares
        norm = clip_grad_norm_(params, CLIP, mesh)
        opt.step()
        opt.zero_grad()
        history.append((float(ce_total + aux_total), float(norm)))
    return history


def ce_loss(model, hidden, batch, targets):
    """Summed cross-entropy over the step's target count; call under loss_parallel() (vocab split over tp)."""
    logits = model.output(hidden)
    ce = F.cross_entropy(logits, batch.labels, ignore_index=IGNORE, reduction="sum") / targets
    return ce.to_local() if isinstance(ce, DTensor) else ce  # replicated over tp: each rank holds the whole


def train_pipeline(chunks: dict, mesh) -> list[tuple[float, float]]:
    """The same steps through the 1F1B (interleaved when vpp > 1) pipeline schedule."""
    dims = mesh.dims
    pp_ranks = dist.get_process_group_ranks(mesh.group("pp"))
    runner = PipelineRunner(chunks, dims.pp * dims.vpp, pp_ranks)
    params = [p for chunk in chunks.values() for p in chunk.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, foreach=False)
    batches = make_batches(STEPS * MICRO_BATCHES)
    history = []
    for step in range(STEPS):
        step_batches = batches[step * MICRO_BATCHES : (step + 1) * MICRO_BATCHES]
        targets = total_targets(step_batches)
        mine = step_batches[mesh.rank_in("dp") :: dims.dp]
        if dims.cp > 1:
            mine = [split_for_context_parallel(b, dims.cp, mesh.rank_in("cp")) for b in mine]
        for chunk in chunks.values():
            set_gradient_sync(chunk, False)
        actions = one_f_one_b(dims.pp, dims.vpp, mesh.rank_in("pp"), len(mine))
        with loss_parallel():
            result = runner.run(
                actions,
                mine,
                loss_fn=lambda chunk, hidden, batch: ce_loss(chunk, hidden, batch, targets),
                before_backward=lambda c, last: set_gradient_sync(chunks[c], last),
            )
        ce_total, aux_total = result["loss"], result["aux"]
        dist.all_reduce(ce_total, group=mesh.group("dp_cp"))
        dist.all_reduce(aux_total, group=mesh.group("dp_cp_tp"))
        both = torch.stack([ce_total, aux_total])
        dist.all_reduce(both, group=mesh.group("pp"))  # the loss lives on the last stage, aux on all
        norm = clip_grad_norm_(params, CLIP, mesh)
        opt.step()
        opt.zero_grad()
        history.append((float(both[0] + both[1]), float(norm)))
    return history


def parallelize(model, mesh):
    apply_tensor_parallel(model, mesh)
    apply_context_parallel(model, mesh)
    apply_expert_parallel(model, mesh)
    apply_fsdp(model, mesh)
    return model


def build_layout(moe: bool, mesh) -> dict:
    """This rank's model chunks for the layout: {chunk index: parallelized chunk}."""
    dims = mesh.dims
    split = split_layers(LAYERS, dims.pp, dims.vpp)
    mine = range(mesh.rank_in("pp"), dims.pp * dims.vpp, dims.pp)
    return {c: parallelize(keep_chunk(make_model(moe), split[c], c == 0, c == len(split) - 1), mesh) for c in mine}


def _worker(rank, world, layout, models, out):
    mesh = ParallelDims(world, **layout).build("cpu")
    results = {}
    for moe in models:  # one process group start for both models
        chunks = build_layout(moe, mesh)
        results[moe] = train(chunks[0], mesh) if mesh.dims.pp == 1 else train_pipeline(chunks, mesh)
    if rank == 0:
        torch.save(results, out)


_REFERENCE: dict[bool, list] = {}


def reference(moe: bool):
    if moe not in _REFERENCE:
        _REFERENCE[moe] = train(make_model(moe))
    return _REFERENCE[moe]


def check_parity(tmp_path, world, layout, models=(False, True)):
    out = tmp_path / "history.pt"
    launch(world, _worker, layout, models, str(out))
    results = torch.load(out)
    for moe in models:
        got, want, name = results[moe], reference(moe), "moe" if moe else "dense"
        assert len(got) == STEPS
        for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want)):
            assert loss == pytest.approx(ref_loss, rel=1e-5), f"{name} step {step}: loss {loss}, one process {ref_loss}"
            assert norm == pytest.approx(ref_norm, rel=1e-5), f"{name} step {step}: grad norm {norm}, one process {ref_norm}"


@pytest.mark.parametrize(
    "world,layout",
    [
        (2, dict(dp=2)),
        (2, dict(tp=2)),
        (2, dict(cp=2)),
        (4, dict(dp=2, tp=2)),
        (4, dict(cp=2, tp=2)),
        (2, dict(pp=2)),
        (2, dict(pp=2, vpp=2)),
        (4, dict(pp=2, tp=2)),
    ],
    ids=["dp2", "tp2", "cp2", "tp2xdp2", "cp2xtp2", "pp2", "pp2+vpp2", "pp2xtp2"],
)
def test_dense_and_moe_match_one_process(tmp_path, world, layout):
    check_parity(tmp_path, world, layout)


@pytest.mark.parametrize(
    "world,layout", [(2, dict(dp=2, ep=2)), (4, dict(dp=4, ep=2)), (2, dict(tp=2, ep=2))], ids=["ep2", "ep2xdp2", "ep2xtp2"]
)
def test_expert_parallel_matches_one_process(tmp_path, world, layout):
    check_parity(tmp_path, world, layout, models=(True,))
