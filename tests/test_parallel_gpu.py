"""The parallel layouts on GPUs: NCCL, bf16 compute (FSDP2 casts fp32 master weights), against one GPU.

Run on a machine with 4 GPUs:  pytest -m gpu tests/test_parallel_gpu.py -q   (or invoke test --gpu); on 2 GPUs
select the 2-rank layouts with -k (a layout with more ranks than GPUs fails, it is never skipped).
Tolerance: bf16 rounding (2e-2 relative on the step loss and gradient norm), the same three steps as the CPU
parity suite. NCCL matches point-to-point messages by order, not tag: test_parallel_units proves every
schedule receives in the order it sends on each pair of ranks.
"""

from __future__ import annotations

import pytest
import torch
from parallel_harness import build_layout, launch, make_optimizer, reference, train

from mlite.runtime.parallel.mesh import ParallelDims

STEPS = 3
BF16_RTOL = 2e-2


def _worker(rank, world, layout, models, out):
    layout = dict(layout)
    job_sections = layout.pop("job", None)
    mesh = ParallelDims(world, **layout).build("cuda")
    results = {}
    for moe in models:
        chunks = build_layout(moe, mesh, job_sections)
        layer_params = [p for c in chunks.values() for p in c.layers.parameters()]
        on_host = sum(p.numel() for p in layer_params if p.device.type == "cpu")
        results[("host share", moe)] = on_host / sum(p.numel() for p in layer_params)
        results[moe] = train(chunks, mesh, make_optimizer(chunks), range(STEPS))
    if rank == 0:
        torch.save(results, out)


@pytest.fixture
def bf16_on_gpu(monkeypatch):
    monkeypatch.setenv("MLITE_TEST_COMPUTE", "bf16")  # read by the spawned ranks and the reference
    monkeypatch.setenv("MLITE_TEST_DEVICE", "cuda:0")  # the one-GPU reference; each rank picks its own


@pytest.mark.gpu
@pytest.mark.parametrize(
    "world,layout,models",
    [
        (2, dict(dp=2), (False, True)),
        (2, dict(tp=2), (False, True)),
        (2, dict(cp=2), (False, True)),
        (2, dict(dp=2, ep=2), (True,)),
        (2, dict(pp=2), (False, True)),
        (2, dict(pp=2, vpp=2), (False, True)),
        (4, dict(dp=2, tp=2), (False, True)),
        (4, dict(cp=2, tp=2), (False, True)),
        (4, dict(pp=2, tp=2), (False, True)),
        (4, dict(dp=4, ep=2), (True,)),
        (4, dict(dp=4, ep=4), (True,)),  # top-2 over ep4: the per-pair all-to-all (ep2: the all-gather)
    ],
    ids=["dp2", "tp2", "cp2", "ep2", "pp2", "pp2+vpp2", "tp2xdp2", "cp2xtp2", "pp2xtp2", "ep2xdp2", "ep4"],
)
def test_layout_matches_one_gpu_in_bf16(tmp_path, bf16_on_gpu, world, layout, models):
    results = run_and_compare(tmp_path, world, layout, models)
    for moe in models:
        assert results[("host share", moe)] == 0.0


@pytest.mark.gpu
def test_optimizer_offload_fraction_keeps_that_share_of_layers_on_the_host(tmp_path, bf16_on_gpu):
    # 4 layers, fraction 0.5: the first 2 layer units keep parameters, gradients and Adam state on the host
    job = {"offload": {"optimizer": True, "optimizer_fraction": 0.5}}
    results = run_and_compare(tmp_path, 2, dict(dp=2, job=job), (False, True))
    for moe in (False, True):
        assert results[("host share", moe)] == pytest.approx(0.5)


def run_and_compare(tmp_path, world, layout, models):
    if torch.cuda.device_count() < world:
        pytest.fail(f"layout {layout} needs {world} GPUs, {torch.cuda.device_count()} visible")
    out = tmp_path / "history.pt"
    launch(world, _worker, layout, models, str(out), backend="nccl")
    results = torch.load(out)
    for moe in models:
        want = reference(moe)[:STEPS]
        for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(results[moe], want)):
            assert loss == pytest.approx(ref_loss, rel=BF16_RTOL), (
                f"moe={moe} step {step}: {loss} vs {ref_loss}"
            )
            assert norm == pytest.approx(ref_norm, rel=BF16_RTOL), (
                f"moe={moe} step {step}: {norm} vs {ref_norm}"
            )
    return results
