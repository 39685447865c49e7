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
