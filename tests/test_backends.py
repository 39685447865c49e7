"""The optimizer backends (mlite.runtime.backends): one object per optimizer.backend behind one interface.

CPU: the fsdp2 backend (one process, and FSDP2 over a one-rank mesh) moves its weights, gradients and Adam
state to fresh host tensors and back, in the middle of a step, and training goes on with the numbers of a
run that never moved them (bitwise): FSDP2's units train on the moved shards, not on stale copies. Nothing
outside the factory asks which backend a job runs.

GPU (`-m gpu`, one GPU): the same on the GPU, where the offload frees the device memory the weights,
gradients and Adam's moments held. dist_opt's offload: tests/test_dist_opt.py (`-m gpu`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from cli_runs import one_thread  # noqa: F401 (autouse: one intra-op thread)
from torch.distributed.tensor import DTensor

import mlite
from mlite.config import job_from_dict
from mlite.runtime.backends import BACKENDS, backend_type
from mlite.runtime.backends.fsdp2 import Fsdp2Backend
from mlite.runtime.data.packed import PackedBatch
from mlite.runtime.engine import Runtime
from mlite.runtime.loss import sft_loss


def make_job(one_rank: bool, device: str = "cpu"):
    return job_from_dict({
        "model": {"name": "tiny-qwen3"},
        "precision": {"compute": "fp32"},
        "optimizer": {"lr": 1e-2},
        "parallel": {"fsdp_one_rank": one_rank},
        "data": {"seq_len": 512},
        "trainer": {"device": device, "steps": 10, "seed": 7, "deterministic": device == "cuda"},
    })


def micro_batch(step: int, part: int) -> PackedBatch:
    g = torch.Generator().manual_seed(100 * step + part)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 13)]
    return PackedBatch.from_sequences(seqs, [[0] * 3 + [1] * (len(s) - 3) for s in seqs])


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def train(rt: Runtime, steps, offload_at: int | None = None) -> list[float]:
    """Steps of two micro-batches (two forward_backward calls); at step `offload_at`, between the two
    calls, everything goes to the host and comes back."""
    losses = []
    for step in steps:
        rt.zero_grad()
        targets = sum(micro_batch(step, part).num_target_tokens for part in (0, 1))
        (first,) = rt.forward_backward([micro_batch(step, 0)], sft_loss(targets), ends_step=False)
        if step == offload_at:
            moved_everything_to_the_host_and_back(rt)
        (second,) = rt.forward_backward([micro_batch(step, 1)], sft_loss(targets))
        rt.optimizer_step()
        rt.lr_scheduler_step()
        losses.append(float(first["loss"]) + float(second["loss"]))
    return losses


def moved_everything_to_the_host_and_back(rt: Runtime) -> None:
    params = list(rt.model.parameters())
    values = [local(p).detach().clone() for p in params]
    grads = [local(p.grad).clone() if p.grad is not None else None for p in params]
    moments = [(local(s["exp_avg"]).data_ptr(), s["step"]) for s in rt.optim.optimizer.state.values()]
    before = [local(p).data_ptr() for p in params]
    assert moments, "the test offloads after a step: Adam's state exists"

    on_device = torch.cuda.memory_allocated() if rt.device.type == "cuda" else None
    tensors = [t for p in params for t in (p, p.grad) if t is not None]
    tensors += [v for s in rt.optim.optimizer.state.values() for k, v in s.items() if k != "step"]
    held_bytes = sum(local(t).numel() * local(t).element_size() for t in tensors)
    del tensors  # no reference of the test's may keep the device memory
    moved = rt.offload_to_host()
    assert moved == held_bytes  # what the metrics report
    # fresh host tensors (a CPU run's host is its device, so each is a copy), the same parameter objects
    assert list(rt.model.parameters()) == params
    assert all(local(p).data_ptr() != ptr and local(p).device.type == "cpu" for p, ptr in zip(params, before))
    if on_device is not None:  # the weights, the gradients and both moments left the GPU
        held = sum(local(t).numel() * local(t).element_size() for p in params
                   for t in (p, p.grad, *[s for s in (rt.optim.optimizer.state.get(p) or {}).values()
                                          if isinstance(s, torch.Tensor) and s.dim() > 0]) if t is not None)
        assert on_device - torch.cuda.memory_allocated() >= held
    states = list(rt.optim.optimizer.state.values())
    assert all(local(s["exp_avg"]).data_ptr() != m and s["exp_avg"].device.type == "cpu"
               for s, (m, _) in zip(states, moments))
    assert all(s["step"] is step for s, (_, step) in zip(states, moments))  # the step count stays put
    for p, value, grad in zip(params, values, grads):
        assert torch.equal(local(p), value.cpu())
        assert (p.grad is None) == (grad is None) and (grad is None or torch.equal(local(p.grad), grad.cpu()))

    rt.reload_to_device()
    assert all(local(p).device == rt.device for p in params)
    assert all(torch.equal(local(p), value) for p, value in zip(params, values))


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("one_rank", [False, True], ids=["one-process", "fsdp2-one-rank"])
def test_fsdp2_offloads_to_the_host_and_back_and_trains_on_as_if_it_never_left(one_rank, device, monkeypatch):
    if device == "cuda":
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # trainer.deterministic's cuBLAS
    straight = Runtime(make_job(one_rank, device))
    assert isinstance(straight.optim, Fsdp2Backend)
    want = train(straight, range(4))
    want_weights = {n: local(p).detach().clone() for n, p in straight.model.named_parameters()}
    straight.close()

    rt = Runtime(make_job(one_rank, device))
    got = train(rt, range(4), offload_at=2)
    got_weights = {n: local(p).detach().clone() for n, p in rt.model.named_parameters()}
    if one_rank:  # the FSDP2 units really hold the parameters (the case where a stale shard would show)
        assert all(isinstance(p, DTensor) for p in rt.model.parameters())
    rt.close()
    assert got == want
    assert got_weights.keys() == want_weights.keys()
    for name, tensor in got_weights.items():
        assert torch.equal(tensor, want_weights[name]), name


def test_each_backend_is_named_once_and_only_the_factory_asks():
    """optimizer.backend becomes code in two tables: the runtime's classes (mlite.runtime.backends) and the
    torch-free layers' record of each (mlite.config.backends: what the schema, the rule book, the estimate
    and the bench read), over the schema's names. No other module compares a `.backend` with a backend's
    name."""
    from typing import get_args

    from mlite.config.backends import BACKENDS as TRAITS
    from mlite.config.schema import OptimizerConfig

    assert {name: cls.name for name, cls in BACKENDS.items()} == {"fsdp2": "fsdp2", "dist_opt": "dist_opt"}
    assert {name: t.name for name, t in TRAITS.items()} == {"fsdp2": "fsdp2", "dist_opt": "dist_opt"}
    assert set(get_args(OptimizerConfig.model_fields["backend"].annotation)) == set(BACKENDS)
    assert backend_type(make_job(False)) is Fsdp2Backend
    names = set(BACKENDS)
    root = Path(mlite.__file__).parent
    wrong = []
    tables = {root / "config" / "backends.py", root / "runtime" / "backends" / "__init__.py"}
    for path in sorted(set(root.rglob("*.py")) - tables):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            asks = any(isinstance(o, ast.Attribute) and o.attr == "backend" for o in operands)
            if asks and any(isinstance(o, ast.Constant) and o.value in names for o in operands):
                wrong.append(f"{path.relative_to(root.parent)}:{node.lineno} {ast.unparse(node)}")
    assert not wrong, ("ask the backend object (mlite.runtime.backends) or its record "
                       "(mlite.config.backends.backend_traits):\n" + "\n".join(wrong))
