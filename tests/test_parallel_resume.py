"""A checkpoint saved under one parallel layout resumes under another and continues the single-process curve.

The checkpoint (mlite.runtime.ckpt: DCP, parameter names and global shapes) holds the model and the AdamW
state. Two steps run under layout A, then a fresh set of processes under layout B loads it and runs two more;
the losses and gradient norms of those steps equal steps 3 and 4 of one uninterrupted process (1e-5
relative, fp32). Adam's moments make a wrongly resharded optimizer state show at once.
"""

from __future__ import annotations

import pytest
import torch
from parallel_harness import MAX_STEPS, build_layout, launch, make_optimizer, reference, train
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from mlite.runtime.ckpt.checkpoint import load_checkpoint, save_checkpoint
from mlite.runtime.parallel.mesh import ParallelDims
from mlite.runtime.parallel.pipeline import stage_view

SAVED_AFTER = 2


def _state(chunks, opt) -> dict:
    model_state, optim_state = get_state_dict(stage_view(chunks), opt.optimizer)
    return {"model": model_state, "optimizer": optim_state}


def _save_worker(rank, world, layout, moe, path):
    mesh = ParallelDims(world, **layout).build("cpu")
    chunks = build_layout(moe, mesh)
    opt = make_optimizer(chunks)
    train(chunks, mesh, opt, range(SAVED_AFTER))
    save_checkpoint(path, _state(chunks, opt), rank_state={}, meta={"layout": layout})


def _resume_worker(rank, world, layout, moe, path, out):
    mesh = ParallelDims(world, **layout).build("cpu")
    chunks = build_layout(moe, mesh)
    opt = make_optimizer(chunks)
    train(chunks, mesh, opt, range(1))  # give the optimizer state its shapes, then overwrite all of it
    tensors = _state(chunks, opt)
    load_checkpoint(path, tensors)
    set_state_dict(
        stage_view(chunks), opt.optimizer, model_state_dict=tensors["model"],
        optim_state_dict=tensors["optimizer"],
    )
    history = train(chunks, mesh, opt, range(SAVED_AFTER, MAX_STEPS))
    if rank == 0:
        torch.save(history, out)


@pytest.mark.parametrize(
    "moe,saved,resumed",
    [
        (False, (4, dict(pp=2, tp=2)), (4, dict(dp=4))),
        (True, (4, dict(dp=4, ep=2)), (2, dict(dp=2))),
    ],
    ids=["dense-pp2xtp2-to-dp4", "moe-ep2xdp2-to-ep1"],
)
def test_resume_under_another_layout_continues_the_curve(tmp_path, moe, saved, resumed):
    path = tmp_path / "step_00000002"
    launch(saved[0], _save_worker, saved[1], moe, str(path))
    out = tmp_path / "resumed.pt"
    launch(resumed[0], _resume_worker, resumed[1], moe, str(path), str(out))
    got, want = torch.load(out), reference(moe)[SAVED_AFTER:]
    assert len(got) == MAX_STEPS - SAVED_AFTER
    for i, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want)):
        step = SAVED_AFTER + i
        assert loss == pytest.approx(ref_loss, rel=1e-5), (
            f"step {step}: loss {loss}, uninterrupted {ref_loss}"
        )
        assert norm == pytest.approx(ref_norm, rel=1e-5), (
            f"step {step}: grad norm {norm}, uninterrupted {ref_norm}"
        )


def _fp8_save_worker(rank, world, layout, moe, path, out):
    """precision.optimizer_state fp8 on this layout: the uninterrupted run, saving after step 2."""
    mesh = ParallelDims(world, **layout).build("cpu")
    chunks = build_layout(moe, mesh)
    opt = make_optimizer(chunks, state="fp8")
    history = train(chunks, mesh, opt, range(SAVED_AFTER))
    save_checkpoint(path, _state(chunks, opt), rank_state={}, meta={"layout": layout})
    history += train(chunks, mesh, opt, range(SAVED_AFTER, MAX_STEPS))
    states = [s for s in opt.optimizer.state.values() if s]
    assert states and all(s["exp_avg"].dtype == torch.float8_e4m3fn for s in states)
    if rank == 0:
        torch.save(history, out)


def _fp8_resume_worker(rank, world, layout, moe, path, out):
    mesh = ParallelDims(world, **layout).build("cpu")
    chunks = build_layout(moe, mesh)
    opt = make_optimizer(chunks, state="fp8")
    train(chunks, mesh, opt, range(1))  # give the optimizer state its shapes, then overwrite all of it
    tensors = _state(chunks, opt)
    load_checkpoint(path, tensors)
    set_state_dict(stage_view(chunks), opt.optimizer, model_state_dict=tensors["model"],
                   optim_state_dict=tensors["optimizer"])
    history = train(chunks, mesh, opt, range(SAVED_AFTER, MAX_STEPS))
    if rank == 0:
        torch.save(history, out)


def test_fp8_optimizer_state_resumes_bitwise_on_its_layout_and_under_another_one(tmp_path):
    """fp8 Adam state over FSDP2 shards of two meshes (dense over dp, experts over edp): each rank keeps
    e4m3 state for its own shards; the checkpoint holds the decoded moments under AdamW's names and global
    shapes. On the same layout the resumed run equals the uninterrupted one bitwise (the rounding's random
    stream is a function of the step); on another layout it continues the one-process curve of AdamW with
    fp32 moments, within the fp8 state's rounding (a loss step moves the loss ~3e-3 here)."""
    saved, resumed = (4, dict(dp=4, ep=2)), (2, dict(dp=2))
    path, full = tmp_path / "step_00000002", tmp_path / "full.pt"
    launch(saved[0], _fp8_save_worker, saved[1], True, str(path), str(full))
    same = tmp_path / "same.pt"
    launch(saved[0], _fp8_resume_worker, saved[1], True, str(path), str(same))
    uninterrupted = torch.load(full)
    assert torch.load(same) == uninterrupted[SAVED_AFTER:]
    other = tmp_path / "other.pt"
    launch(resumed[0], _fp8_resume_worker, resumed[1], True, str(path), str(other))
    want = reference(True)  # one process, fp32 AdamW state
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(uninterrupted, want)):
        assert loss == pytest.approx(ref_loss, rel=1e-4), step  # measured: 2e-6 at step 4
        assert norm == pytest.approx(ref_norm, rel=5e-3), step  # measured: 5e-4
    for i, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(torch.load(other), want[SAVED_AFTER:])):
        assert loss == pytest.approx(ref_loss, rel=1e-4), SAVED_AFTER + i
        assert norm == pytest.approx(ref_norm, rel=5e-3), SAVED_AFTER + i
