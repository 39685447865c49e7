"""optimizer.overlap_step: the one-GPU update queued on a side stream, unit by unit, and the next forward
waiting for a unit only as it reaches it (mlite.runtime.optim.StepOverlap).

On CPU: the units cover every trained parameter once, in the order the forward meets them, and the hooks
fire before any parameter of their unit is read (checked on every aten op of a real forward and loss);
the rule book refuses the key where it cannot run. On GPU (tests/test_kernels.py): the overlapped step's
numbers equal the plain step's."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mlite.config import job_from_dict
from mlite.errors import MliteError
from mlite.runtime.data.packed import PackedBatch
from mlite.runtime.engine import Runtime, lm_heads
from mlite.runtime.loss import sft_loss
from mlite.runtime.optim import forward_units, hook_units
from mlite.runtime.parallel.parallelize import blocks

MODELS = {
    "dense-tied": {"name": "tiny-qwen3"},
    "moe": {"name": "tiny-qwen3-moe"},
    "dsv4-mtp": {"name": "tiny-deepseek-v4", "mtp_loss_weight": 0.3},
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def cpu_runtime(model: dict, **optimizer) -> Runtime:
    return Runtime(job_from_dict({
        "model": model, "precision": {"compute": "fp32"}, "optimizer": {"lr": 1e-3, **optimizer},
        "data": {"seq_len": 256}, "trainer": {"device": "cpu", "steps": 4, "seed": 3},
    }))


@pytest.mark.parametrize("model", MODELS.values(), ids=MODELS.keys())
def test_units_cover_every_trained_parameter_once_in_forward_order(model):
    rt = cpu_runtime(model)
    units = forward_units(rt.model, blocks(rt.model), rt.optim.params)
    in_units = [p for _, params in units for p in params]
    assert len(in_units) == len({id(p) for p in in_units}) == len(rt.optim.params)
    assert {id(p) for p in in_units} == {id(p) for p in rt.optim.params}
    modules = [module for module, _ in units]
    # the embedding first (it holds a tied LM head too), then the blocks in layer order, MTP's block last
    assert modules[0] is rt.model.embed
    order = [modules.index(b) for b in blocks(rt.model)]
    assert order == sorted(order) and len(order) == len(blocks(rt.model))
    if rt.arch.tie_embeddings:
        assert rt.model.output.weight is rt.model.embed.weight
        assert not any(m is rt.model.output for m in modules)
    # a block is one unit with all of its parameters (its body may be one compiled graph)
    first = blocks(rt.model)[0]
    trained = [p for p in first.parameters() if p.requires_grad]
    assert [p for m, ps in units if m is first for p in ps] == trained


class ParamReads(TorchDispatchMode):
    """Every aten op of the forward: the units whose parameters it reads (by storage), against the units
    the hooks have released so far. The side stream runs in order, so releasing unit k releases 0..k."""

    def __init__(self, units):
        super().__init__()
        self.unit_of_storage = {p.untyped_storage().data_ptr(): k
                                for k, (_, ps) in enumerate(units) for p in ps}
        self.released = -1
        self.early: list[tuple[str, int, int]] = []
        self.read: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_flatten((args, kwargs or {}))[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                k = self.unit_of_storage.get(t.untyped_storage().data_ptr())
                if k is not None:
                    self.read.add(k)
                    if k > self.released:
                        self.early.append((str(func), k, self.released))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("model", MODELS.values(), ids=MODELS.keys())
def test_every_parameter_is_read_only_after_its_units_hook(model):
    """The contract the side stream relies on: in a whole training forward (model, LM head, loss and its
    backward), no op reads a parameter before the pre-hook of its unit (or the model's forward end, after
    which everything is released) has fired. A unit's module that read another's later parameter, or a
    weight read outside its module's call, would show here as an early read."""
    rt = cpu_runtime(model)
    units = forward_units(rt.model, blocks(rt.model), rt.optim.params)
    reads = ParamReads(units)

    def release(k):
        reads.released = max(reads.released, k)

    # hooked as the Runtime hooks them: the LM head without a hook (its fused loss kernel needs that)
    handles = hook_units(rt.model, units, release, lambda: release(len(units) - 1), lm_heads(rt.model))
    batch = PackedBatch.from_sequences([list(range(3, 40)), list(range(5, 30))])
    try:
        with reads:
            rt.forward_backward([batch], sft_loss(batch.num_target_tokens))
    finally:
        for handle in handles:
            handle.remove()
    assert lm_heads(rt.model) and not rt.model.output._forward_pre_hooks  # the fused head kernel's condition
    assert reads.early == []
    assert reads.read == set(range(len(units)))  # every unit was read, so every unit was checked
    assert reads.released == len(units) - 1


def test_hooks_fire_per_unit_in_order_and_release_all_at_the_forwards_end():
    rt = cpu_runtime(MODELS["moe"])
    units = forward_units(rt.model, blocks(rt.model), rt.optim.params)
    events = []
    handles = hook_units(rt.model, units, events.append, lambda: events.append("end"))  # every unit hooked
    batch = PackedBatch.from_sequences([list(range(3, 40))])
    rt.forward_backward([batch], sft_loss(batch.num_target_tokens))
    for handle in handles:
        handle.remove()
    assert events.count("end") == 1
    during = events[: events.index("end")]
    # the forward meets the blocks and the modules around them in definition order; the LM head is
    # called by the loss after the forward's end, which released every unit already
    assert during == sorted(during) == [k for k, (m, _) in enumerate(units) if m is not rt.model.output]
    assert {units[k][0] for k in events[events.index("end") + 1:]} == {rt.model.output}


def test_a_cpu_run_does_not_overlap_and_its_settle_is_a_no_op():
    rt = cpu_runtime(MODELS["dense-tied"])
    assert rt.optim.overlapped is None
    rt.optim.settle()
    with pytest.raises(ValueError, match="fused one-GPU step"):
        rt.optim.overlap(rt.model, blocks(rt.model))


@pytest.mark.parametrize("device, world, backend, expected", [
    ("cpu", 1, "fsdp2", "this job runs on the CPU"),
    ("cuda", 2, "fsdp2", "with 2 ranks"),
    ("cuda", 1, "dist_opt", "set optimizer.backend: fsdp2"),
])
def test_overlap_step_true_is_refused_where_it_cannot_run(device, world, backend, expected):
    from mlite.config.arch import arch_from_hf_config
    from mlite.config.catalog import PRESETS
    from mlite.plan.rules import check_overlap_step

    job = job_from_dict({"model": {"name": "tiny-qwen3"}, "cluster": {"gpus_per_node": world},
                         "optimizer": {"overlap_step": True, "backend": backend}})
    arch_from_hf_config(PRESETS["tiny-qwen3"])
    with pytest.raises(MliteError, match=expected) as err:
        check_overlap_step(job, world, device)
    assert "\n" not in str(err.value) and "overlap_step" in str(err.value)
    for allowed in (False, None):  # off, or auto: never refused
        check_overlap_step(job_from_dict({"model": {"name": "tiny-qwen3"},
                                          "optimizer": {"overlap_step": allowed}}), world, device)


def test_overlap_step_true_on_a_cpu_job_stops_the_trainer_at_start_up():
    with pytest.raises(MliteError, match="optimizer.overlap_step: true"):
        cpu_runtime(MODELS["dense-tied"], overlap_step=True)
