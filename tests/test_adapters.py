"""The adapters over other libraries' private names (mlite.runtime.adapters.pytorch,
mlite.runtime.adapters.megatron_core, mlite.integrations.verl.adapter) still hold on the installed libraries.

Each adapter names the version it was checked against; these tests exercise every private name it uses, on
whatever version is installed, so a library that renames or changes one fails here, with a message naming the
adapter to update, not somewhere inside a training step.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn


def stale(adapter: str, library: str, checked: str, installed: str, what: str) -> str:
    return (f"{adapter} was checked against {library} {checked}; installed {installed}: {what}. "
            f"Update {adapter} (and its version) to the installed {library}.")


# ------------------------------------------------------------------------------------------------ torch
class TinyModel(nn.Module):
    """A body whose forward the root runs, and an LM head the loss applies outside it (as the runtime's)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4, bias=False)
        self.head = nn.Linear(4, 6, bias=False)

    def forward(self, x):
        return self.body(x)


def test_pytorch_adapter_private_names_still_behave(monkeypatch):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from mlite.runtime.adapters import pytorch as adapter

    def says(what: str) -> str:
        return stale("mlite/runtime/adapters/pytorch.py", "torch", adapter.TORCH_CHECKED,
                     torch.__version__, what)

    # FSDP2 pins offloaded shards; pinned memory needs an accelerator, which a CPU machine lacks
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *args, **kwargs: self)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model, reference = TinyModel(), TinyModel()
        reference.load_state_dict(model.state_dict())
        mesh = init_device_mesh("cpu", (1,))
        fully_shard(model.body, mesh=mesh, offload_policy=CPUOffloadPolicy(), reshard_after_forward=False)
        fully_shard(model.head, mesh=mesh)
        fully_shard(model, mesh=mesh)  # the root holds no parameters of its own

        assert [id(t) for t in adapter.offloaded_shards(model.body)] == [id(model.body.weight)], says(
            "an offloaded unit's sharded parameters are not read from its param group")
        assert adapter.offloaded_shards(model.head) == [] and adapter.offloaded_shards(model) == []
        assert (adapter.reshards_after_forward(model.body), adapter.reshards_after_forward(model.head),
                adapter.reshards_after_forward(model)) == (False, True, None), says(
            "a unit's reshard-after-forward is not read from its param group")
        model.head.set_reshard_after_forward(False, recurse=False)
        assert adapter.reshards_after_forward(model.head) is False, says(
            "the public setter is not what it reads")
        model.head.set_reshard_after_forward(True, recurse=False)

        # the loss's path: the head gathered by hand, its post-backward hook on the hidden states. The hook
        # must reduce the head's gradient and reshard it as soon as the hidden states' gradient is there:
        # before the body's backward reaches the inputs, not in FSDP2's end-of-backward callback
        x = torch.randn(3, 4, requires_grad=True)
        seen = []
        x.register_hook(lambda _grad: seen.append(
            (isinstance(model.head.weight, DTensor), model.head.weight.grad is not None)))
        hidden = model(x)
        model.head.unshard()
        assert not isinstance(model.head.weight, DTensor)
        hidden = adapter.reduce_in_backward(model.head, hidden)
        (hidden @ model.head.weight.t()).square().sum().backward()
        assert seen == [(True, True)], says(
            "the head's post-backward hook did not reduce and reshard in time")
        x_ref = x.detach().clone().requires_grad_()
        reference.head(reference.body(x_ref)).square().sum().backward()
        torch.testing.assert_close(model.head.weight.grad.full_tensor(), reference.head.weight.grad)
        torch.testing.assert_close(x.grad, x_ref.grad)
    finally:
        dist.destroy_process_group()

    # DTensor's strided shard (FSDP2 over tp or ep), whose split the adapter re-states for an index
    strided = _StridedShard(1, split_factor=2)
    assert (strided.dim, strided.split_factor) == (1, 2), says("_StridedShard's dim / split_factor changed")
    assert adapter.strided_index_placement(strided, 1) == _StridedShard(0, split_factor=2), says(
        "_StridedShard(dim, split_factor=...) changed")
    assert adapter.strided_index_placement(strided, 0) is None
    assert adapter.strided_index_placement(Shard(1), 1) is None

    # nn.Module's hook tables
    linear = nn.Linear(4, 4)
    assert not adapter.has_forward_hooks(linear)
    for register in (linear.register_forward_hook, linear.register_forward_pre_hook):
        handle = register(lambda *args: None)
        assert adapter.has_forward_hooks(linear), says(f"{register.__name__} is not seen")
        handle.remove()
    handle = linear.register_forward_hook(lambda *args: None, with_kwargs=True)
    assert adapter.has_forward_hooks(linear), says("a forward hook with kwargs is not seen")


# --------------------------------------------------------------------------------------------- Megatron
def test_megatron_core_adapter_private_names_still_behave():
    pytest.importorskip("megatron.core")
    import megatron.core
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range

    from mlite.runtime.adapters import megatron_core as adapter

    def says(what: str) -> str:
        return stale("mlite/runtime/adapters/megatron_core.py", "megatron-core", adapter.MEGATRON_CHECKED,
                     megatron.core.__version__, what)

    # the kernel globals use_sync_free_fallbacks rebinds: there, read by name at each call, and the
    # fallbacks it replaces keep amp_C's contract, which foreach_l2_norm / foreach_scale implement
    for module, name in ((clip_grads, "l2_norm_impl"), (clip_grads, "multi_tensor_scale_impl"),
                         (optimizer, "multi_tensor_scale_impl")):
        assert hasattr(module, name), says(f"{module.__name__}.{name} is gone")
    assert "l2_norm_impl" in clip_grads.get_grad_norm_fp32.__code__.co_names, says(
        "get_grad_norm_fp32 no longer reads clip_grads.l2_norm_impl")
    assert "multi_tensor_scale_impl" in clip_grads.clip_grad_by_total_norm_fp32.__code__.co_names, says(
        "clip_grad_by_total_norm_fp32 no longer reads clip_grads.multi_tensor_scale_impl")
    assert "multi_tensor_scale_impl" in optimizer._multi_tensor_copy_this_to_that.__code__.co_names, says(
        "_multi_tensor_copy_this_to_that no longer reads optimizer.multi_tensor_scale_impl")
    for theirs, ours in ((utils.local_multi_tensor_l2_norm, adapter.foreach_l2_norm),
                         (utils.local_multi_tensor_scale, adapter.foreach_scale)):
        assert list(inspect.signature(theirs).parameters) == list(inspect.signature(ours).parameters), says(
            f"{theirs.__name__}'s contract changed")

    # a shard's range: the private getter, over the public maps the optimizer builds
    param = nn.Parameter(torch.zeros(8))
    opt = DistributedOptimizer.__new__(DistributedOptimizer)  # only the two maps the getter reads
    opt.model_param_gbuf_map = {param: (0, torch.float32, 0)}
    opt.gbuf_ranges = [{torch.float32: [{"param_map": {param: {"param": Range(2, 5)}}}]}]
    assert adapter.shard_slice(opt, param) == slice(2, 5), says(
        "DistributedOptimizer._get_model_param_range_map(param)['param'] changed")


# ------------------------------------------------------------------------------------------------- verl
def test_verl_adapter_private_names_still_behave():
    pytest.importorskip("verl")
    import verl
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer
    from verl.workers.rollout import base, get_rollout_class

    from mlite.integrations.verl import adapter
    from mlite.integrations.verl.rollout import MliteServerAdapter

    def says(what: str) -> str:
        return stale("mlite/integrations/verl/adapter.py", "verl", adapter.VERL_CHECKED, verl.__version__,
                     what)

    # the rollout-class table: written by the adapter, read by verl's public getter
    assert isinstance(getattr(base, "_ROLLOUT_REGISTRY", None), dict), says("_ROLLOUT_REGISTRY is gone")
    adapter.register_rollout_class("mlite", "async", "mlite.integrations.verl.rollout.MliteServerAdapter")
    assert get_rollout_class("mlite", "async") is MliteServerAdapter, says(
        "get_rollout_class does not find what register_rollout_class wrote")

    # the trainer's set-up step WorkerClassSwap extends: still called by set-up, still fills the mapping
    assert "_init_resource_pool_mgr" in PPOTrainer._setup.__code__.co_names, says(
        "PPOTrainer._setup no longer calls _init_resource_pool_mgr")
    assert "role_worker_mapping" in PPOTrainer._init_resource_pool_mgr.__code__.co_names, says(
        "_init_resource_pool_mgr no longer fills role_worker_mapping")

    class Base:
        def _init_resource_pool_mgr(self):
            self.role_worker_mapping = {"actor": "verl's", "critic": "verl's"}

    class Swapped(adapter.WorkerClassSwap, Base):
        def swap_worker_class(self, actor_class):
            return f"ours over {actor_class}"

    trainer = Swapped()
    trainer._init_resource_pool_mgr()
    assert trainer.role_worker_mapping == {"actor": "ours over verl's", "critic": "ours over verl's"}


def test_torch_adapter_mesh_and_checkpoint_traversal_still_behave():
    """DeviceMesh's unflatten/flatten and DCP's nested-state traversal, as the runtime uses them."""
    from torch.distributed.device_mesh import init_device_mesh

    from mlite.runtime.adapters import pytorch as adapter

    def says(what: str) -> str:
        return stale("mlite/runtime/adapters/pytorch.py", "torch", adapter.TORCH_CHECKED,
                     torch.__version__, what)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        world = init_device_mesh("cpu", (1,), mesh_dim_names=("world",))
        dense = adapter.unflatten_mesh(world, 0, (1, 1, 1), ("dp", "cp", "tp"))
        assert dense.mesh_dim_names == ("dp", "cp", "tp"), says("DeviceMesh._unflatten")
        flat = adapter.flatten_mesh(dense["dp", "cp"], "dp_cp")
        assert flat.mesh_dim_names == ("dp_cp",) and flat.size() == 1, says("DeviceMesh._flatten")
    finally:
        dist.destroy_process_group()
    state = {"optimizer": {"param_groups": [{"lr": 0.0}]}}
    adapter.set_state_element(state, ("optimizer", "param_groups", 0, "lr"), 0.5)
    assert state["optimizer"]["param_groups"][0]["lr"] == 0.5, says("checkpoint._traverse.set_element")


def test_pytorch_adapter_tensor_walk_views_and_multi_tensor_kernels_still_behave():
    """nn.Module's per-tensor walk, a view's base, the grouped matmul and the foreach kernels, against plain
    torch on the same numbers."""
    from mlite.runtime.adapters import pytorch as adapter

    def says(what: str) -> str:
        return stale("mlite/runtime/adapters/pytorch.py", "torch", adapter.TORCH_CHECKED,
                     torch.__version__, what)

    model = nn.Linear(3, 2)
    weight = model.weight
    weight.grad = torch.ones_like(weight)
    adapter.apply_to_tensors(model, lambda t: t.double())
    assert model.weight is weight and weight.dtype == torch.float64, says("nn.Module._apply")
    assert weight.grad.dtype == torch.float64 and model.bias.dtype == torch.float64, says("nn.Module._apply")

    base = torch.empty(4, 6, device="meta")
    assert adapter.is_view_of(base, base) and adapter.is_view_of(base[1:3], base), says("Tensor._base")
    assert adapter.is_view_of(base.t(), base), says("Tensor._base")
    assert adapter.is_view_of(base.unbind(0)[2], base), says("Tensor._base")
    assert not adapter.is_view_of(base.clone(), base), says("Tensor._base")
    assert not adapter.is_view_of(base + 0, base), says("Tensor._base")

    from torchao.float8.float8_training_tensor import LinearMMConfig, hp_tensor_and_scale_to_float8
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    data = torch.randn(4, 6)
    wrapper = WeightWithDynamicFloat8CastTensor(data, LinearMMConfig(), torch.float8_e4m3fn)
    assert adapter.wrapped_data(wrapper) is data, says("__tensor_flatten__ of a wrapper subclass")
    assert adapter.wrapped_data(data) is None and adapter.wrapped_data(nn.Parameter(data)) is None
    fp8 = hp_tensor_and_scale_to_float8(data, torch.tensor(1.0), torch.float8_e4m3fn)
    assert adapter.wrapped_data(fp8) is None  # its data is FP8, its values the float32 ones

    torch.manual_seed(0)
    x, w = torch.randn(5, 8, dtype=torch.bfloat16), torch.randn(3, 8, 16, dtype=torch.bfloat16)
    offsets = torch.tensor([2, 2, 5], dtype=torch.int32)  # groups of 2, 0 and 3 rows
    try:
        grouped = adapter.grouped_mm(x, w, offsets)
    except RuntimeError as error:  # a build whose CPU path lacks the kernel: the runtime falls back to a loop
        assert "grouped" in str(error).lower() or "cuda" in str(error).lower(), says("torch._grouped_mm")
    else:
        expected = torch.cat([x[:2] @ w[0], x[2:2] @ w[1], x[2:] @ w[2]])
        torch.testing.assert_close(grouped.float(), expected.float(), atol=0.1, rtol=0.02,
                                   msg=says("torch._grouped_mm"))

    tensors = [torch.full((2,), 3.0), torch.full((3,), -4.0)]
    adapter.foreach_mul_(tensors, torch.tensor(0.5))
    assert [t.tolist() for t in tensors] == [[1.5, 1.5], [-2.0, -2.0, -2.0]], says("torch._foreach_mul_")
    adapter.foreach_add_(tensors, 1)
    adapter.foreach_sub_(tensors, [torch.tensor(0.5), torch.tensor(1.0)])
    assert [t.tolist() for t in tensors] == [[2.0, 2.0], [-2.0, -2.0, -2.0]], says("torch._foreach_add_")
    norms = adapter.foreach_norm(tensors, 2, dtype=torch.float32)
    expected_norms = [round(8**0.5, 5), round(12**0.5, 5)]
    assert [round(n.item(), 5) for n in norms] == expected_norms, says("torch._foreach_norm")


def test_no_module_outside_the_adapters_reads_a_private_name():
    """Outside the adapter modules, no code reads another object's private attribute (`x._y` where x is not
    self or cls: torch's, Megatron's, verl's or another mlite class's) or imports a private name. A new use
    goes into the library's adapter, with a check above."""
    import ast
    from pathlib import Path

    import mlite

    root = Path(mlite.__file__).parent
    allowed = {"os._exit"}  # the standard library's documented exit without clean-up
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.parent.name == "adapters" or path.name == "adapter.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            where = f"{path.relative_to(root.parent)}:{getattr(node, 'lineno', 0)}"
            private = isinstance(node, ast.Attribute) and node.attr[:1] == "_" and node.attr[:2] != "__"
            if private:
                own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                if not own and ast.unparse(node) not in allowed:
                    found.append(f"{where} {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or "", *(a.name for a in node.names)]
                if any(p.startswith("_") and not p.startswith("__") for n in names for p in n.split(".")):
                    found.append(f"{where} from {node.module} import {', '.join(a.name for a in node.names)}")
    assert not found, "private names outside the adapters:\n" + "\n".join(found)


def test_pytorch_adapter_traceable_all_to_all_still_behaves(tmp_path):
    """The functional all-to-all on a one-rank gloo group: the rows come back, the gradient goes through, and
    torch.compile takes it into one graph (fullgraph raises at a break). Two ranks: the expert exchange's
    tests (tests/test_parallel_parity.py)."""
    import torch.distributed as dist

    from mlite.runtime.adapters import pytorch as adapter

    def says(what: str) -> str:
        return stale("mlite/runtime/adapters/pytorch.py", "torch", adapter.TORCH_CHECKED,
                     torch.__version__, what)

    owned = not dist.is_initialized()  # an in-process run of this worker may have started its own
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        group = dist.new_group([0], backend="gloo")
        x = torch.randn(6, 4, requires_grad=True)
        y = adapter.all_to_all_equal(x, group)
        (y * 3).sum().backward()
        assert torch.equal(y, x) and torch.equal(x.grad, torch.full_like(x, 3.0)), says("all_to_all_single")
        compiled = torch.compile(lambda t: adapter.all_to_all_equal(t * 2, group) + 1, fullgraph=True)
        assert torch.equal(compiled(x.detach()), x.detach() * 2 + 1), says("all_to_all_single under compile")
    finally:
        if owned:
            dist.destroy_process_group()
