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


# An activation of 4096 tokens x 1024 hidden in bf16 is 8 MB, beyond what NCCL's point-to-point buffers hold:
# a send then waits for its receive to be posted (the tiny layouts above fit the buffers and never wait)
BIG = {"hidden_size": 1024, "intermediate_size": 2048, "num_attention_heads": 8, "num_key_value_heads": 4,
       "head_dim": 128, "num_hidden_layers": 4, "max_position_embeddings": 4096, "tie_word_embeddings": False}


def _big_pipeline_worker(rank, world, layout, out, device="cuda", config=BIG, tokens=4096):
    import os

    from mlite.config import job_from_dict
    from mlite.config.catalog import PRESETS
    from mlite.runtime.data.packed import PackedBatch
    from mlite.runtime.engine import Runtime
    from mlite.runtime.loss import sft_loss

    os.environ["LOCAL_RANK"] = str(rank)  # the runtime's GPU
    job = job_from_dict({"model": {"name": "tiny-qwen3"}, "parallel": layout,
                         "cluster": {"gpu": "h100" if device == "cuda" else "cpu", "gpus_per_node": world},
                         "precision": {"compute": "bf16" if device == "cuda" else "fp32"},
                         "data": {"seq_len": tokens, "global_batch_size": 4},
                         "trainer": {"device": device, "seed": 3}})
    rt = Runtime(job, hf_config={**PRESETS["tiny-qwen3"], **config})
    g = torch.Generator().manual_seed(0)
    batches = [PackedBatch.from_sequences([torch.randint(0, 256, (tokens,), generator=g).tolist()])
               for _ in range(4)]  # the same micro-batches on every stage, as the loader gives them
    losses = []
    for _ in range(2):
        rt.zero_grad()
        outs = rt.forward_backward(batches, sft_loss(4 * (tokens - 1)))
        rt.optimizer_step()
        losses.append(sum(float(o["loss"]) for o in outs))
    rt.close()
    if rank == world - 1:  # the last stage holds the loss
        torch.save(losses, out)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [{"pp": 2}, {"pp": 2, "vpp": 2}], ids=["pp2", "pp2+vpp2"])
def test_pipeline_with_activations_beyond_nccls_buffers_finishes_and_matches_one_gpu(tmp_path, layout):
    """1F1B's neighbours send each other 8 MB activations and gradients before each receives: over one
    process group NCCL's in-order stream would hold both sends for ever (tests/test_parallel_units.py
    simulates it); each direction on its own group (`pipeline.link_group`), the run finishes and its two
    steps' losses match one GPU in bf16."""
    if torch.cuda.device_count() < 2:
        pytest.fail(f"this test needs 2 GPUs, {torch.cuda.device_count()} visible")
    out = tmp_path / "losses.pt"
    launch(2, _big_pipeline_worker, layout, str(out), backend="nccl")
    launch(1, _big_pipeline_worker, {}, f"{out}.one", backend="nccl")
    got, want = torch.load(out), torch.load(f"{out}.one")
    assert got == pytest.approx(want, rel=BF16_RTOL)
