"""The dist_opt adapter's CPU part: Megatron-Core's parallel state, built from our layout with gloo, puts
every rank in the same tensor / context / pipeline / data / expert groups as our meshes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from parallel_harness import launch

from mlite.runtime.parallel.megatron import (
    destroy_parallel_state,
    foreach_l2_norm,
    foreach_scale,
    init_parallel_state,
    parallel_state_groups,
    use_sync_free_fallbacks,
)
from mlite.runtime.parallel.mesh import ParallelDims

NAMES = ("tp", "pp", "cp", "dp", "dp_cp", "ep", "etp", "edp")


def _worker(rank, world, layouts, out):
    agreed = []
    for layout in layouts:
        dims = ParallelDims(world, **layout)
        mesh = dims.build("cpu")
        ours = {name: sorted(dist.get_process_group_ranks(mesh.group(name))) for name in NAMES}
        init_parallel_state(dims)
        theirs = parallel_state_groups()
        destroy_parallel_state()
        agreed.append((layout, ours, theirs))
    torch.save(agreed, f"{out}.{rank}")


def test_megatron_parallel_state_matches_our_meshes(tmp_path):
    layouts = [
        dict(tp=2, pp=2),
        dict(tp=2, cp=2),
        dict(dp=2, tp=2, ep=2),
        dict(dp=4, ep=2),
        dict(pp=2, dp=2, vpp=2),
    ]
    out = tmp_path / "groups"
    launch(4, _worker, layouts, str(out))
    for rank in range(4):
        for layout, ours, theirs in torch.load(f"{out}.{rank}"):
            for name in NAMES:
                assert ours[name] == theirs[name], (
                    f"rank {rank} {layout}: {name} ours {ours[name]}, megatron {theirs[name]}"
                )


def test_dist_opt_without_megatron_core_is_one_clear_line(monkeypatch):
    import builtins

    from mlite.errors import MliteError
    from mlite.runtime.parallel import megatron

    real_import = builtins.__import__

    def no_megatron(name, *args, **kwargs):
        if name.startswith("megatron"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_megatron)
    with pytest.raises(MliteError, match="pip install 'mlite\\[megatron\\]'"):
        megatron.init_parallel_state(ParallelDims(1))


def test_the_sync_free_fallbacks_replace_megatrons_and_compute_the_same(monkeypatch):
    """Without TE or Apex (this machine), Megatron's optimizer takes local fallbacks; the norm's syncs once
    per tensor. dist_opt swaps both for foreach versions: same values, and only where the fallbacks are."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    for module in (clip_grads, optimizer):  # restored after the test
        monkeypatch.setattr(module, "multi_tensor_scale_impl", module.multi_tensor_scale_impl)
    monkeypatch.setattr(clip_grads, "l2_norm_impl", clip_grads.l2_norm_impl)
    assert clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm  # no TE, no Apex here
    assert use_sync_free_fallbacks() == ["clip_grads.l2_norm_impl", "clip_grads.multi_tensor_scale_impl",
                                         "optimizer.multi_tensor_scale_impl"]
    assert clip_grads.l2_norm_impl is foreach_l2_norm and optimizer.multi_tensor_scale_impl is foreach_scale
    assert use_sync_free_fallbacks() == []  # only Megatron's own fallbacks are replaced

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=gen) for shape in ((3, 5), (7,), (2, 2, 4))]
    norm, per_tensor = foreach_l2_norm(2048 * 32, None, [grads], False)
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    torch.testing.assert_close(norm[0], torch.cat([g.flatten() for g in grads]).norm())
    # scale in place (clipping), copy between dtypes (masters to bf16 weights), copy with a factor
    for scale, dtype, same in ((0.25, torch.float32, True), (1.0, torch.bfloat16, False),
                               (0.5, torch.bfloat16, False)):
        ours = [g.clone() for g in grads]
        theirs = [g.clone() for g in grads]
        ours_dst = ours if same else [torch.empty_like(g, dtype=dtype) for g in grads]
        theirs_dst = theirs if same else [torch.empty_like(g, dtype=dtype) for g in grads]
        foreach_scale(0, None, [ours, ours_dst], scale)
        utils.local_multi_tensor_scale(0, None, [theirs, theirs_dst], scale)
        assert all(torch.equal(a, b) for a, b in zip(ours_dst, theirs_dst)), (scale, dtype)
