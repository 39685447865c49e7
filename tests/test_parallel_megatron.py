"""The dist_opt adapter's CPU part: Megatron-Core's parallel state, built from our layout with gloo, puts
every rank in the same tensor / context / pipeline / data / expert groups as our meshes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from parallel_harness import launch

from mlite.runtime.parallel.megatron import destroy_parallel_state, init_parallel_state, parallel_state_groups
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
