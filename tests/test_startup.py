"""Start-up at scale: no rank builds the whole model (mlite.runtime.layout.build_parallel_model).

- On the meta device, the real DeepSeek-V4-Flash GRPO layout (PP4 x EP8 x CP4, 128 ranks; a fake process
  group stands in for the 127 others) gives a first-, a middle- and a last-stage rank exactly the planner's
  parameters (mlite.plan.memory.stage_params), before and after FSDP2 shards them.
- On gloo ranks, a model whose experts dominate its parameters: each rank's peak host memory at start-up
  (random init, and loading an HF checkpoint) falls like 1 / (pp x ep), and every layout's initial weights
  are the one-process weights, shard for shard.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mlite.config import job_from_dict, load_job
from mlite.config.catalog import preset_arch
from mlite.plan import plan_job
from mlite.plan.memory import DTYPE_BYTES, GIB, stage_params
from mlite.runtime.layout import rank_chunks
from mlite.runtime.parallel.mesh import ParallelDims


# ------------------------------------------------------------------------- the 128-GPU layout, on meta
def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


@pytest.mark.parametrize("rank", [0, 77, 127], ids=["first-stage", "middle-stage", "last-stage"])
def test_dsv4_flash_ranks_hold_the_planners_share_on_the_meta_device(rank):
    """rank_chunks, the runtime's own code path, for one rank of PP4 x EP8 x CP4 (world 128, dp 8, edp 4):
    its pipeline stage's layers with its ep rank's 32 of 256 experts per layer, FSDP2-sharded over dp x cp
    (dense) and edp (experts), nothing allocated. What it computes with equals the planner's stage
    parameters exactly; the shards it keeps (master weights, fp32) equal the planner's per-rank share up to
    FSDP2's uneven split (less than one row of each tensor)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    job = load_job("deepseek_v4_flash_grpo")
    arch = preset_arch(job.model.name)
    plan = plan_job(job, size_refused=True)  # sized even while the trainers refuse a part of the layout
    lay = plan.layout
    assert (lay.world, lay.pp, lay.ep, lay.cp, lay.dp, lay.edp) == (128, 4, 8, 4, 8, 4)
    dist.init_process_group("fake", rank=rank, world_size=lay.world, store=FakeStore())
    try:
        mesh = ParallelDims.from_layout(lay).build("cpu")
        stage = mesh.rank_in("pp")
        chunks = rank_chunks(plan, mesh, torch.float32)
        params = {name: p for chunk in chunks.values() for name, p in chunk.named_parameters()}
    finally:
        dist.destroy_process_group()
    assert stage == rank // 32 and list(chunks) == [stage]
    held = sorted({int(name.split(".")[1]) for name in params if name.startswith("layers.")})
    assert held == list(lay.stage_layers[stage])
    assert ("embed.weight" in params) == (stage == 0) and ("output.weight" in params) == (stage == 3)
    assert all(p.to_local().is_meta for p in params.values())  # laid out, nothing allocated

    expected = stage_params(arch, lay, stage)
    dense = sum(p.numel() for name, p in params.items() if not _is_expert(name))  # global shapes (tp 1)
    experts = sum(p.numel() for name, p in params.items() if _is_expert(name)) // lay.ep
    assert (dense, experts) == (expected.dense, expected.experts)
    first_expert = params[f"layers.{held[0]}.mlp.experts.down"]
    assert first_expert.to_local().shape[0] == arch.moe.num_experts // lay.ep // lay.edp  # 8 experts
    local = sum(p.to_local().numel() for p in params.values())
    planned = expected.dense / (lay.dp * lay.cp) + expected.experts / lay.edp
    uneven = sum(p.numel() // p.shape[0] for p in params.values())  # one row of each tensor
    assert abs(local - planned) < uneven and abs(local - planned) < 1e-3 * planned
    master_bytes = local * DTYPE_BYTES[job.precision.master]
    assert abs(master_bytes - planned * DTYPE_BYTES[job.precision.master]) < uneven * 4
    if stage == plan.memory.stage:  # the stage `mlite plan` prints
        item = next(i for i in plan.memory.items if i.name == "master weights")
        assert master_bytes / GIB == pytest.approx(item.gb, rel=1e-3)


# ----------------------------------------------------------------------- a rank's share of a checkpoint
@pytest.mark.parametrize("quantised", [False, True], ids=["bf16-fp32", "fp8-fp4"])
def test_a_ranks_share_of_a_checkpoint_is_read_alone(tmp_path, quantised):
    """What load_hf_weights reads for one sharded parameter (its global indices per dim, as local_shard
    gives them: a dim-0 chunk, a column chunk, a strided set) equals the same entries of the whole tensor,
    for plain and released-format quantised checkpoints; of the per-expert tensors only those of the
    experts the rank holds are read."""
    from mlite.runtime.ckpt import quant
    from mlite.runtime.ckpt.hf import (
        _read_share,
        _SafetensorsCheckpoint,
        hf_config_from_arch,
        iter_hf_weights,
        load_hf_weights,
        save_hf_checkpoint,
    )
    from mlite.runtime.models import build_model

    arch = preset_arch("tiny-qwen3-moe")
    torch.manual_seed(0)
    source = build_model(arch, attention_backend="torch")
    if quantised:
        tensors = {name: t.clone() for name, t in iter_hf_weights(source)}
        fp8 = [n for n in tensors if ".self_attn." in n and n.endswith("_proj.weight")]
        fp4 = [n for n in tensors if ".mlp.experts." in n]
        out = quant.save_quantized_checkpoint(tensors, tmp_path / "ckpt", fp8, fp4, hf_config_from_arch(arch),
                                              (16, 16))
    else:
        out = save_hf_checkpoint(source, arch, tmp_path / "ckpt")
    whole = build_model(arch, attention_backend="torch", init=False)
    load_hf_weights(whole, out)
    params = dict(whole.named_parameters())
    ckpt = _SafetensorsCheckpoint(out)
    read: list[str] = []
    plain_tensor = ckpt.tensor
    ckpt.tensor = lambda name: read.append(name) or plain_tensor(name)
    for entry in whole.hf_layout():
        full = params[entry.param].detach()
        for cut in range(3):
            indices = [None] * full.dim()
            if cut == 0:  # FSDP2: a chunk of dim 0 (the experts of an ep x edp rank)
                indices[0] = torch.arange(full.shape[0]).chunk(4)[-1]
            elif full.dim() > 1 and cut == 1:  # TP row-wise: a chunk of the columns
                indices[1] = torch.arange(full.shape[1]).chunk(2)[1]
            elif cut == 2:  # strided rows
                indices[0] = torch.arange(1, full.shape[0], 3)
            want = full
            for dim, index in enumerate(indices):
                if index is not None:
                    want = want.index_select(dim, index)
            read.clear()
            got = _read_share(ckpt, entry, full.shape, indices)
            assert torch.equal(got.to(want.dtype), want), (entry.param, cut)
            if len(entry.hf_names) > 1 and indices[0] is not None:  # stacked experts
                held = set(indices[0].tolist())
                assert read and all(int(name.split(".")[5]) in held for name in read), (entry.param, read)


# ----------------------------------------------------------------------- peak host memory, gloo ranks
# Qwen3-MoE with 64 experts of 256: the experts are 99% of its 25M parameters (100 MB in fp32)
CONFIG = {"model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256,
          "moe_intermediate_size": 256, "num_experts": 64, "num_experts_per_tok": 2, "norm_topk_prob": True,
          "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.01,
          "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
          "max_position_embeddings": 256}
LAYOUTS = {"one": {}, "pp2": {"pp": 2}, "pp2-ep2": {"pp": 2, "ep": 2}}
MB = 2**20


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def _reset_peak() -> None:
    """Start the high-water mark again at the current resident size (Linux: clear_refs 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _job(folder: Path, layout: dict, model: str) -> dict:
    return {"model": {"path": str(folder / model), "load_weights": model == "hf"}, "parallel": layout,
            "data": {"seq_len": 256, "max_tokens_per_micro_batch": 256}, "cluster": {"gpu": "cpu"},
            "precision": {"compute": "fp32"}, "trainer": {"device": "cpu", "seed": 5}}


def _startup_worker(rank, world, folder, layout, out):
    """Start a Runtime three times: a tiny model first (imports, caches and the like that a run pays once),
    then the model with random weights and with HF weights, each time measuring this rank's peak resident
    memory above what it held before; then check its shards against the reference weights."""
    from mlite.runtime.engine import Runtime
    from mlite.runtime.parallel.parallelize import local_shard

    folder, result = Path(folder), {}
    for model in ("tiny", "config", "hf"):
        gc.collect()
        _reset_peak()
        base = _peak_rss()
        rt = Runtime(job_from_dict(_job(folder, layout, model)))
        result[model] = _peak_rss() - base
        params = {name: p.detach() for name, p in rt.model.named_parameters()}
        reference = folder / f"{model}.pt"
        if not reference.exists():  # the one-process run writes the reference of random init
            torch.save(params, reference)
        want = torch.load(reference, mmap=True)
        for name, param in params.items():
            local, indices = local_shard(param)
            full = want[name]
            for dim, index in enumerate(indices):
                if index is not None:
                    full = full.index_select(dim, index)
            assert torch.equal(local, full), (model, name)
        del rt, params, want
    torch.save(result, f"{out}.{rank}")


@pytest.fixture(scope="module")
def peaks(tmp_path_factory):
    """Per layout and rank: peak bytes at start-up ("config": random init, "hf": loading an HF checkpoint of
    other weights, seed 11, written by one process). Large allocations are mapped and unmapped one by one
    (a fixed malloc mmap threshold), so memory freed by one start-up does not hide the next one's."""
    from parallel_harness import launch

    from mlite.config.arch import arch_from_hf_config
    from mlite.runtime.ckpt.hf import save_hf_checkpoint
    from mlite.runtime.models import build_model, seeded_init

    folder = tmp_path_factory.mktemp("startup")
    tiny = {**CONFIG, "num_experts": 4, "moe_intermediate_size": 16}
    for name, config in (("config", CONFIG), ("tiny", tiny)):
        (folder / name).mkdir()
        (folder / name / "config.json").write_text(json.dumps(config))
    arch = arch_from_hf_config(CONFIG)
    model = build_model(arch, attention_backend="torch", device="meta")
    model.to_empty(device="cpu")
    seeded_init(model, 11)
    with torch.no_grad():  # norms too away from their initial ones: a load that re-initialised shows
        gen = torch.Generator().manual_seed(12)
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen), alpha=0.01)
    save_hf_checkpoint(model, arch, folder / "hf", config=CONFIG)
    torch.save({n: p.detach() for n, p in model.named_parameters()}, folder / "hf.pt")
    del model
    result = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))  # the spawned ranks inherit it
        for name, layout in LAYOUTS.items():
            world = max(1, layout.get("pp", 1) * layout.get("ep", 1))
            out = folder / f"{name}.pt"
            launch(world, _startup_worker, str(folder), layout, str(out))
            result[name] = [torch.load(f"{out}.{rank}") for rank in range(world)]
    return result


@pytest.mark.parametrize("what", ["config", "hf"], ids=["random-init", "hf-weights"])
def test_start_up_memory_per_rank_falls_like_one_over_pp_times_ep(peaks, what):
    """Each rank's start-up peak is its share of the model: one process holds all 100 MB (twice that while
    it reads the checkpoint's pages), pp2 ranks about half, pp2 x ep2 ranks about a quarter. A rank that
    built the whole model first would peak above the one-process figure on every layout. The shards were
    checked against the one-process weights (and the checkpoint's) in the ranks."""
    whole = peaks["one"][0][what]
    assert whole > 95 * MB, f"one process peaked at {whole / MB:.0f} MB"
    for name, layout in LAYOUTS.items():
        share = whole / (layout.get("pp", 1) * layout.get("ep", 1))
        for rank, got in enumerate(peaks[name]):
            assert 0.7 * share < got[what] < 1.3 * share + 8 * MB, (
                f"{name} rank {rank}: {got[what] / MB:.1f} MB at start-up ({what}), "
                f"its share {share / MB:.1f} MB")


def test_host_offloaded_shards_are_allocated_on_the_host(monkeypatch):
    """offload.optimizer on a meta-built model: the shards of the units FSDP2 offloads (the first half of the
    layers at fraction 0.5) are allocated on the host and the others on the run's device (meta stands in for
    the GPU here). FSDP2 refuses offloaded shards anywhere else at its first forward: every offload run on
    2 and 4 H100s failed so before this."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from mlite.runtime.layout import to_empty_tied

    # FSDP2 pins offloaded shards; pinned memory needs an accelerator, which this machine lacks
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *args, **kwargs: self)
    job = job_from_dict({"model": {"name": "tiny-qwen3"}, "cluster": {"gpus_per_node": 2},
                         "data": {"seq_len": 512}, "offload": {"optimizer": True, "optimizer_fraction": 0.5}})
    arch = preset_arch(job.model.name)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        plan = plan_job(job, arch)
        (chunk,) = rank_chunks(plan, ParallelDims.from_layout(plan.layout).build("cpu")).values()
        to_empty_tied(chunk, torch.device("meta"))
    finally:
        dist.destroy_process_group()
    devices = {name: p.to_local().device.type for name, p in chunk.named_parameters()}
    half = arch.num_layers // 2
    assert half >= 1 and set(devices.values()) == {"cpu", "meta"}
    for name, device in devices.items():
        in_offloaded_layer = name.startswith("layers.") and int(name.split(".")[1]) < half
        assert device == ("cpu" if in_offloaded_layer else "meta"), name
