"""The `dist_opt` backend: Megatron-Core's DDP + DistributedOptimizer around our model.

CPU (no CUDA, megatron-core 0.16.1): what the adapter refuses before anything is built (model-parallel
degrees, precision and offload keys it cannot honour, a missing megatron-core, no GPU), each one line;
the TransformerConfig built from our arch; where the overlapped all-gather's hooks wait (stand-in bucket
groups: Megatron's need CUDA); torch's fused AdamW given the clip and the skip as tensors (the step's
protocol on the GPU).

GPU (`-m gpu`, 2 GPUs, NCCL, bf16 compute, megatron-core 0.16.1):
- dp2 with dist_opt: 3 AdamW steps (4 micro-batches each, gradient accumulation) give the loss and grad
  norm of the fsdp2 dp2 run (the parallel harness path, same launch) and of one GPU under autocast, within
  bf16 rounding (2e-2 relative); the LR set through `LRSchedule(backend.optimizer, ...)` reaches every
  inner AdamW group.
- deterministic mode: two dist_opt runs (fresh processes) give bitwise-identical losses, grad norms,
  bf16 weights and fp32 master shards, and both ranks hold the same weights after each all-gather; a third
  run with the overlaps off (every reduce-scatter and all-gather at the step) gives the same bits. With
  them on, every bucket group after the first step starts its reduce-scatter during the last
  micro-batch's backward, and each step leaves every all-gather for the next forward to wait on; the step
  makes no synchronizing CUDA call (torch's AdamW inside Megatron: clip and skip decided on the GPU).
- a non-finite gradient on one rank (its loss scaled by inf) skips that step on both ranks: weights, fp32
  shards, Adam's moments and step count stay as they were; the next step trains.
- `mlite sft` with optimizer.backend dist_opt under dp2, tp2, pp2, pp2 x vpp2 (dense) and pp2, ep2, tp2
  (MoE): the curve of one GPU within bf16 rounding; a run resumed from its step-2 checkpoint continues it
  bitwise (trainer.deterministic); under dp2, tp2 and ep2, two runs are bitwise identical, and so is a
  third with `optimizer.overlap_grad_reduce: false` and `optimizer.overlap_param_gather: false` (reduced
  and gathered at the step); the same checkpoint resumed by fsdp2 continues the curve within bf16
  rounding (the format is shared).

Run on a 2-GPU machine:  . scripts/gpu_env.sh && pytest -m gpu tests/test_dist_opt.py -q -p no:cacheprovider
"""

from __future__ import annotations

import builtins
import itertools
import json
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from cli_runs import assert_same_curve, failure, job_dict, layout_assets, mlite_cli, records
from parallel_harness import (
    CLIP,
    LR,
    MAX_STEPS,
    MICRO_BATCHES,
    build_layout,
    ce_loss,
    device,
    launch,
    make_batches,
    make_model,
    make_optimizer,
    reference,
    tiny_arch,
    total_targets,
    train,
)

from mlite.config import job_from_dict
from mlite.errors import MliteError
from mlite.runtime.backends.dist_opt import (
    arm_fused_step,
    build_dist_opt,
    check_dist_opt_job,
    fuse_torch_adam,
    megatron_transformer_config,
)
from mlite.runtime.ckpt.checkpoint import CheckpointManager
from mlite.runtime.optim import LRSchedule, clip_coef
from mlite.runtime.parallel.megatron import NEEDS_MEGATRON, destroy_parallel_state
from mlite.runtime.parallel.mesh import ParallelDims

STEPS = 3
BF16_RTOL = 2e-2


def dist_opt_job(overlap: bool = True, **sections):
    """The harness's optimizer (AdamW, lr 1e-3, betas (0.9, 0.999), weight decay 0.01, clip 1.0) as a job."""
    optimizer = {
        "backend": "dist_opt",
        "overlap_grad_reduce": overlap,
        "overlap_param_gather": overlap,
        "lr": LR,
        "weight_decay": 0.01,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "clip_grad": CLIP,
        "schedule": "constant",
    }
    return job_from_dict(
        {
            "model": {"name": "tiny-qwen3"},
            "precision": {"compute": "bf16"},
            "optimizer": optimizer,
            **sections,
        }
    )


# --------------------------------------------------------------------------------------------- CPU
def test_transformer_config_describes_our_arch_and_sums_gradients():
    arch = tiny_arch(moe=False)
    config = megatron_transformer_config(arch, ParallelDims(2, dp=2), "bf16")
    assert (config.num_layers, config.hidden_size, config.ffn_hidden_size) == (
        arch.num_layers,
        arch.hidden,
        arch.ffn,
    )
    assert (config.num_attention_heads, config.num_query_groups, config.kv_channels) == (
        arch.num_heads,
        arch.num_kv_heads,
        arch.head_dim,
    )
    assert config.normalization == "RMSNorm" and config.layernorm_epsilon == arch.rms_norm_eps
    assert config.bf16 and not config.fp16 and config.params_dtype == torch.bfloat16
    # our loss is normalised by the global target count: Megatron's DDP must sum, not average
    assert config.calculate_per_token_loss
    assert config.tensor_model_parallel_size == config.pipeline_model_parallel_size == 1

    fp32 = megatron_transformer_config(arch, ParallelDims(2, dp=2), "fp32")
    assert not fp32.bf16 and fp32.params_dtype == torch.float32


def test_model_parallel_layouts_pass_the_checks_and_etp_alone_is_refused():
    # each ran on GPUs (tests below): tp, pp, pp x vpp, ep (MoE under tp as well: the model check is apart)
    for world, layout in ((2, {"tp": 2}), (2, {"pp": 2}), (4, {"pp": 2, "tp": 2}), (2, {"pp": 2, "vpp": 2}),
                          (2, {"dp": 2, "ep": 2}), (4, {"tp": 2, "pp": 2, "ep": 2})):
        check_dist_opt_job(dist_opt_job(), ParallelDims(world, **layout))  # no error
    with pytest.raises(MliteError, match="parallel.etp=2 with optimizer.backend dist_opt"):
        check_dist_opt_job(dist_opt_job(), ParallelDims(4, tp=2, dp=2, etp=2))


def test_data_and_context_parallel_layouts_pass_the_checks():
    for layout in ({"dp": 2}, {"cp": 2}, {"dp": 2, "cp": 2}):
        world = 4 if len(layout) == 2 else 2
        check_dist_opt_job(dist_opt_job(), ParallelDims(world, **layout))  # no error


@pytest.mark.parametrize(
    "sections,key",
    [
        ({"precision": {"compute": "fp16"}}, "precision.compute fp16"),
        ({"precision": {"compute": "bf16", "master": "bf16"}}, "precision.master bf16"),
        ({"precision": {"compute": "fp32", "grad_reduce": "bf16"}}, "precision.grad_reduce bf16"),
        ({"offload": {"optimizer": True}}, "offload.*"),
    ],
    ids=["fp16", "bf16-master", "bf16-reduce-of-fp32-grads", "offload"],
)
def test_keys_dist_opt_cannot_honour_are_refused(sections, key):
    with pytest.raises(MliteError, match=key.replace(".", r"\.").replace("*", r"\*")):
        check_dist_opt_job(dist_opt_job(**sections), ParallelDims(2, dp=2))


def test_without_a_gpu_it_is_one_clear_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on GPU machines
    with pytest.raises(MliteError) as err:
        build_dist_opt(make_model(False), ParallelDims(1), dist_opt_job())
    assert str(err.value) == f"{NEEDS_MEGATRON} (no CUDA GPU is visible)"


def test_without_megatron_core_it_is_one_clear_line(monkeypatch):
    real_import = builtins.__import__

    def no_megatron(name, *args, **kwargs):
        if name.startswith("megatron"):
            raise ImportError(f"No module named '{name}'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_megatron)
    with pytest.raises(MliteError) as err:
        build_dist_opt(make_model(False), ParallelDims(1), dist_opt_job())
    assert str(err.value).startswith(NEEDS_MEGATRON + " (import failed: No module named 'megatron")
    assert "pip install 'mlite[megatron]'" in str(err.value)


def test_the_fused_step_clips_and_skips_as_the_host_would_without_reading_anything():
    """The step dist_opt takes on the device (torch's AdamW inside Megatron, fused): dividing each gradient
    by 1 / the clipping factor in the kernel gives the update of clipping first (torch's AdamW on scaled
    gradients), and a set found-inf flag drops the whole update: weights, both moments and the step count."""
    torch.manual_seed(0)
    fused = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    plain = [torch.nn.Parameter(p.detach().clone()) for p in fused]
    options = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.99)}
    fused_opt, plain_opt = torch.optim.AdamW(fused, **options), torch.optim.AdamW(plain, **options)
    fuse_torch_adam(fused_opt)
    for step in range(3):
        grads = [torch.randn_like(p) * 4 for p in fused]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        coef = clip_coef(norm, 1.0)
        assert coef < 1  # the clip bites
        for p, q, g in zip(fused, plain, grads, strict=True):
            p.grad, q.grad = g.clone(), g * coef
        arm_fused_step(fused_opt, 1.0 / coef, torch.zeros(()))
        fused_opt.step()
        plain_opt.step()
        for p, q in zip(fused, plain, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=f"step {step}")
    assert fused_opt.param_groups[0]["fused"] and float(fused_opt.state[fused[0]]["step"]) == 3
    before = {id(p): [p.detach().clone()] + [v.clone() for v in fused_opt.state[p].values()] for p in fused}
    for p in fused:
        p.grad = torch.full_like(p, float("nan"))
    arm_fused_step(fused_opt, torch.tensor(float("nan")), torch.ones(()))
    fused_opt.step()
    for p in fused:
        after = [p.detach()] + list(fused_opt.state[p].values())
        assert all(torch.equal(a, b) for a, b in zip(before[id(p)], after, strict=True))


class RecordingBucketGroup:
    """Stands in for Megatron's bucket group (its buffers need CUDA): records when its all-gather starts and
    when a forward hook waits for it, beside the layers' own forward calls."""

    def __init__(self, index: int, events: list):
        self.index, self.events = index, events

    def start_param_sync(self):
        self.events.append(("start", self.index))

    def finish_param_sync(self, skip_next_bucket_dispatch=False):
        assert skip_next_bucket_dispatch  # the backend dispatched every gather itself, in forward order
        self.events.append(("wait", self.index))


@pytest.mark.parametrize("per_bucket", [1, 3])
def test_the_next_forward_waits_for_each_gather_just_before_the_first_layer_that_reads_it(per_bucket):
    """optimizer.overlap_param_gather's hooks (CPU: the tiny model, buckets of one or three parameters laid
    out as Megatron lays them, from the last parameter to the first): the step starts every gather in forward
    order; the forward waits for each bucket group once, before the first module that reads any of its
    parameters (the embedding's before layer 0, the final norm's after the last layer); the waits leave
    nothing in flight, and finish_param_gather (what checkpoints and export call) waits for the rest."""
    from types import SimpleNamespace

    from mlite.runtime.backends.dist_opt import DistOptBackend, Twin
    from mlite.runtime.models import build_model

    model = build_model(tiny_arch(moe=False))
    events: list = []
    params = list(model.named_parameters())
    groups = [RecordingBucketGroup(i, events) for i in range(-(-len(params) // per_bucket))]
    bucket = {name: groups[k // per_bucket] for k, (name, _) in enumerate(reversed(params))}
    twins = [Twin(name, p, p, False, 0, bucket[name]) for name, p in params]
    ddp = SimpleNamespace(bucket_groups=groups, expert_parallel_bucket_groups=[])
    backend = DistOptBackend({0: model}, [ddp], None, twins, None, overlap=False, overlap_gather=True)
    for name, layer in model.layers.items():
        layer.register_forward_pre_hook(lambda *_, name=name: events.append(("layer", name)))
    model.norm.register_forward_pre_hook(lambda *_: events.append(("norm", None)))

    backend._start_param_gather()  # what step() does after an update
    assert events == [("start", g.index) for g in reversed(groups)]  # the embedding's bucket is the last
    assert backend.gathers_in_flight == len(groups)
    events.clear()
    model(make_batches(1)[0])
    # the wait for each group comes before the first layer holding one of its parameters
    first_reader = {}
    for name, _ in params:
        reader = ("layer", name.split(".")[1]) if name.startswith("layers.") else (
            ("layer", "0") if name.startswith("embed") else ("norm", None))
        first_reader.setdefault(bucket[name].index, []).append(events.index(reader))
    waits = {index: events.index(("wait", index)) for index in range(len(groups))}
    assert all(waits[i] < min(first_reader[i]) for i in waits), events
    assert sum(e[0] == "wait" for e in events) == len(groups)  # once each
    assert backend.gathers_in_flight == 0
    model(make_batches(1)[0])  # a second micro-batch: nothing left to wait for
    assert sum(e[0] == "wait" for e in events) == len(groups)

    backend._start_param_gather()
    events.clear()
    backend.finish_param_gather()
    assert sorted(index for kind, index in events if kind == "wait") == list(range(len(groups)))


# --------------------------------------------------------------------------------------------- GPU
def train_dist_opt(model, backend, schedule, rank, world, steps, poison: tuple[int, int] | None = None,
                   ) -> list[tuple[float, float]]:
    """The harness's training steps (its batches, loss and split of micro-batches over dp ranks) through
    the dist_opt backend: the last micro-batch's backward marked as the step's last (as the runtime does),
    then backend.step(). `backend.overlapped` collects, per step, how many bucket groups started their
    reduce-scatter during the backward. `poison` = (step, rank): that rank's loss at that step is scaled
    by inf, so its gradients are not finite and the step must be skipped on every rank."""
    batches = [b.to(device()) for b in make_batches(MAX_STEPS * MICRO_BATCHES)]
    history = []
    backend.overlapped, backend.in_flight, backend.host_syncs = [], [], []
    for step in steps:
        step_batches = batches[step * MICRO_BATCHES : (step + 1) * MICRO_BATCHES]
        targets = total_targets(step_batches)
        mine = step_batches[rank::world]
        ce_total, aux_total = torch.zeros((), device=device()), torch.zeros((), device=device())
        for i, batch in enumerate(mine):
            backend.set_gradient_sync(0, i == len(mine) - 1)
            out = model(batch)
            ce = ce_loss(model, out.hidden, batch, targets)
            scale = float("inf") if poison == (step, rank) else 1.0
            ((ce + out.aux_loss) * scale).backward()
            ce_total += ce.detach()
            aux_total += out.aux_loss.detach()
        dist.all_reduce(ce_total)
        dist.all_reduce(aux_total)
        with warnings.catch_warnings(record=True) as caught:  # what in the step makes the host wait
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                norm, skipped = backend.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # (torch also warns once that the debug mode is a prototype: not a sync)
        backend.host_syncs.append([str(w.message).splitlines()[0] for w in caught
                                   if "called a synchronizing" in str(w.message)])
        backend.overlapped.append(backend.overlapped_buckets)
        backend.in_flight.append(backend.gathers_in_flight)  # the step starts them, the next forward awaits
        poisoned = poison is not None and poison[0] == step
        assert bool(skipped) == poisoned, f"rank {rank} step {step}: skipped {bool(skipped)}, norm {norm}"
        backend.zero_grad()
        schedule.step()
        history.append((float(ce_total + aux_total), float(norm)))
    backend.finish_param_gather()  # the last step's weights, for whoever reads them next
    return history


def _parity_worker(rank, world, moe, out):
    dims = ParallelDims(world, dp=world)
    mesh = dims.build("cuda")
    chunks = build_layout(moe, mesh)
    fsdp2 = train(chunks, mesh, make_optimizer(chunks), range(STEPS))

    job = dist_opt_job()
    model = make_model(moe)
    backend = build_dist_opt(model, dims, job)
    schedule = LRSchedule(backend.optimizer, job.optimizer, total_steps=10)
    dist_opt = train_dist_opt(model, backend, schedule, rank, world, range(STEPS))

    # the lr path: a warmup schedule's first lr must land in every inner AdamW group on this rank
    LRSchedule(backend.optimizer, job.optimizer.model_copy(update={"warmup_steps": 4}), total_steps=10)
    inner_lrs = [g["lr"] for o in backend.optimizer.chained_optimizers for g in o.optimizer.param_groups]
    facts = {
        "overlaps": backend.ddp_model.ddp_config.overlap_grad_reduce,
        "bucket groups": len(backend.bucket_groups),
        "started in the backward, per step": backend.overlapped,
        "param dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "inner lrs": inner_lrs,
        "weight decays": sorted({g["weight_decay"] for g in backend.optimizer.param_groups}),
    }
    destroy_parallel_state()
    if rank == 0:
        torch.save({"fsdp2": fsdp2, "dist_opt": dist_opt, "facts": facts}, out)


def _determinism_worker(rank, world, out, overlap):
    torch.use_deterministic_algorithms(True)
    dims = ParallelDims(world, dp=world)
    job = dist_opt_job(overlap)
    model = make_model(False)
    backend = build_dist_opt(model, dims, job)
    schedule = LRSchedule(backend.optimizer, job.optimizer, total_steps=10)
    history = train_dist_opt(model, backend, schedule, rank, world, range(STEPS))
    torch.save(
        {
            "history": history,
            "params": {n: p.detach().cpu() for n, p in model.named_parameters()},
            "shards": [s.detach().cpu() for s in backend.main_shards],
            "overlapped": backend.overlapped,
            "in flight": backend.in_flight,
            "bucket groups": len(backend.bucket_groups),
            "decided on the device": backend.on_device,
            "host syncs": backend.host_syncs,
        },
        f"{out}.{rank}",
    )
    destroy_parallel_state()


def _skip_worker(rank, world, out):
    """Step 1's gradients are not finite on rank 1 only: every rank must drop that update whole."""
    dims = ParallelDims(world, dp=world)
    job = dist_opt_job()
    model = make_model(False)
    backend = build_dist_opt(model, dims, job)
    schedule = LRSchedule(backend.optimizer, job.optimizer, total_steps=10)

    def snapshot():
        backend.finish_param_gather()
        adam = {id(p): st for opt in backend.optimizer.chained_optimizers
                for p, st in opt.optimizer.state.items()}
        states = [adam.get(id(shard), {}) for shard in backend.main_shards]
        return {"params": [p.detach().clone() for p in model.parameters()],
                "shards": [s.detach().clone() for s in backend.main_shards],
                "moments": [v.clone() for st in states for k, v in sorted(st.items()) if k != "step"],
                "adam steps": sorted({float(st["step"]) for st in states if "step" in st})}

    history = train_dist_opt(model, backend, schedule, rank, world, range(1))
    after_first = snapshot()
    history += train_dist_opt(model, backend, schedule, rank, world, range(1, 2), poison=(1, 1))
    after_skip = snapshot()
    history += train_dist_opt(model, backend, schedule, rank, world, range(2, 3))
    after_third = snapshot()
    torch.save({"history": history, "first": after_first, "skip": after_skip, "third": after_third,
                "skipped steps": int(backend.skipped_steps), "decided on the device": backend.on_device},
               f"{out}.{rank}")
    destroy_parallel_state()


def need_gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.fail(f"this test needs {n} GPUs, {torch.cuda.device_count()} visible")


def table(runs: dict[str, list]) -> str:
    """Every run's (loss, grad norm) per step, printed on failure so one look says what differs."""
    lines = ["(loss, grad norm) per step", "step  " + "  ".join(f"{name:>34}" for name in runs)]
    for step in range(STEPS):
        cells = [
            f"{run[step][0]:16.9g} {run[step][1]:16.9g}" if step < len(run) else " " * 33
            for run in runs.values()
        ]
        lines.append(f"{step:>4}  " + "  ".join(f"{c:>34}" for c in cells))
    return "\n".join(lines)


@pytest.mark.gpu
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_dist_opt_dp2_matches_fsdp2_and_one_gpu_in_bf16(tmp_path, monkeypatch, moe):
    need_gpus(2)
    monkeypatch.setenv("MLITE_TEST_COMPUTE", "bf16")  # the fsdp2 ranks and the one-GPU reference
    monkeypatch.setenv("MLITE_TEST_DEVICE", "cuda:0")  # the one-GPU reference; each rank picks its own
    out = tmp_path / "runs.pt"
    launch(2, _parity_worker, moe, str(out), backend="nccl")
    result = torch.load(out)
    runs = {
        "one GPU": reference(moe)[:STEPS],
        "fsdp2 dp2": result["fsdp2"],
        "dist_opt dp2": result["dist_opt"],
    }
    facts = result["facts"]
    report = f"\n{table(runs)}\nfacts (rank 0): {facts}"

    # the first step learns each bucket's count and reduces at the step; then every bucket group starts
    # its reduce-scatter in the last micro-batch's backward
    assert facts["overlaps"], report
    assert facts["started in the backward, per step"] == [0] + [facts["bucket groups"]] * (STEPS - 1), report
    assert facts["param dtypes"] == ["torch.bfloat16"], report
    assert facts["inner lrs"] and all(lr == pytest.approx(LR / 4) for lr in facts["inner lrs"]), report
    assert facts["weight decays"] == [0.0, 0.01], report  # none on norms, 0.01 on matrices
    assert len(result["dist_opt"]) == STEPS, report
    for name in ("one GPU", "fsdp2 dp2"):
        for step, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(runs["dist_opt dp2"], runs[name])):
            if loss != pytest.approx(want_loss, rel=BF16_RTOL) or norm != pytest.approx(
                want_norm, rel=BF16_RTOL
            ):
                pytest.fail(f"moe={moe}: dist_opt differs from {name} at step {step}{report}")


@pytest.mark.gpu
def test_two_deterministic_dist_opt_runs_are_bitwise_identical(tmp_path, monkeypatch):
    need_gpus(2)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts in the spawned ranks
    monkeypatch.setenv("NCCL_ALGO", "Ring")  # one reduction order for every collective
    runs = []
    # a and b overlap the reduce-scatter with the backward and the all-gather with the next forward; c does
    # both at the step: the same sums, the same gathers, the same bits
    for name, overlap in (("a", True), ("b", True), ("c", False)):
        launch(2, _determinism_worker, str(tmp_path / name), overlap, backend="nccl")  # fresh processes
        runs.append([torch.load(tmp_path / f"{name}.{rank}") for rank in range(2)])
    first, _, at_step = runs
    report = "\n" + table({f"run {name} (rank 0)": run[0]["history"] for name, run in zip("abc", runs)})
    assert first[0]["overlapped"][1:] and all(first[0]["overlapped"][1:]), report  # it did overlap
    assert at_step[0]["overlapped"] == [0] * STEPS, report  # it did not
    # each step left every bucket group's all-gather to the next forward; without the overlap, none
    assert first[0]["in flight"] == [first[0]["bucket groups"]] * STEPS, report
    assert at_step[0]["in flight"] == [0] * STEPS, report
    # torch's AdamW inside Megatron (these machines have no TE or Apex): the step clips and skips on the GPU,
    # so the host queues it and the all-gathers without waiting for the backward, in every run
    for run in runs:
        assert run[0]["decided on the device"], report
        assert run[0]["host syncs"] == [[]] * STEPS, f"the step waited on the GPU: {run[0]['host syncs']}"

    for rank, second in itertools.product(range(2), runs[1:]):
        assert first[rank]["history"] == second[rank]["history"], f"rank {rank}: histories differ{report}"
        differing = [
            n for n, p in first[rank]["params"].items() if not torch.equal(p, second[rank]["params"][n])
        ]
        assert not differing, f"rank {rank}: weights differ between runs: {differing}{report}"
        shards = zip(first[rank]["shards"], second[rank]["shards"])
        assert len(first[rank]["shards"]) == len(second[rank]["shards"]), report
        assert all(torch.equal(a, b) for a, b in shards), f"rank {rank}: fp32 master shards differ{report}"
    # the all-gather after each step leaves both replicas with the same weights
    replicas = [n for n, p in first[0]["params"].items() if not torch.equal(p, first[1]["params"][n])]
    assert not replicas, f"ranks 0 and 1 hold different weights: {replicas}{report}"
    assert first[0]["history"] == first[1]["history"], report  # loss and norm are reduced over both ranks


@pytest.mark.gpu
def test_a_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    """Rank 1's loss is scaled by inf at step 1: the reduce-scatter spreads the non-finite gradients, the norm
    is not finite on both ranks, and both drop the update whole (weights, fp32 shards, Adam's moments and
    step count as after step 0); step 2 then trains as usual."""
    need_gpus(2)
    launch(2, _skip_worker, str(tmp_path / "skip"), backend="nccl")

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    for rank in range(2):
        run = torch.load(tmp_path / f"skip.{rank}")
        norms = [norm for _, norm in run["history"]]
        assert run["decided on the device"] and run["skipped steps"] == 1, run["skipped steps"]
        assert math.isfinite(norms[0]) and not math.isfinite(norms[1]) and math.isfinite(norms[2]), norms
        for key in ("params", "shards", "moments"):
            assert same(run["first"][key], run["skip"][key]), f"rank {rank}: the skipped step changed {key}"
            assert not same(run["skip"][key], run["third"][key]), f"rank {rank}: step 2 left {key} as is"
        assert run["first"]["adam steps"] == run["skip"]["adam steps"] == [1.0], run["skip"]["adam steps"]
        assert run["third"]["adam steps"] == [2.0], run["third"]["adam steps"]



def _offload_worker(rank, world, out, offload):
    """A step, then (with `offload`) everything to the host and back, then the remaining steps."""
    torch.use_deterministic_algorithms(True)
    dims = ParallelDims(world, dp=world)
    job = dist_opt_job()
    model = make_model(False)
    backend = build_dist_opt(model, dims, job)
    schedule = LRSchedule(backend.optimizer, job.optimizer, total_steps=10)
    history = train_dist_opt(model, backend, schedule, rank, world, range(1))
    facts = {}
    if offload:
        weights = [p.detach().clone() for p in model.parameters()]
        on_gpu = torch.cuda.memory_allocated()
        backend.offload_to_host()
        facts["freed"] = on_gpu - torch.cuda.memory_allocated()
        facts["buffers"] = sum(b.param_data.numel() * b.param_data.element_size()
                               + b.grad_data.numel() * b.grad_data.element_size()
                               for ddp in backend.ddps for b in ddp.buffers + ddp.expert_parallel_buffers)
        facts["masters on the host"] = all(s.device.type == "cpu" for s in backend.main_shards)
        try:
            backend.weights_current()
        except MliteError as err:
            facts["refused while offloaded"] = str(err)
        backend.reload_to_device()
        facts["weights back"] = all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    history += train_dist_opt(model, backend, schedule, rank, world, range(1, STEPS))
    torch.save({"history": history, "facts": facts,
                "params": {n: p.detach().cpu() for n, p in model.named_parameters()},
                "shards": [s.detach().cpu() for s in backend.main_shards]}, f"{out}.{rank}")
    destroy_parallel_state()


@pytest.mark.gpu
def test_dist_opt_offloads_to_the_host_and_back_and_trains_on_bitwise(tmp_path, monkeypatch):
    """offload_to_host frees Megatron's param and grad buffers on the GPU (every view of them kept) and
    moves the fp32 master shards and Adam's moments to the host; nothing reads the weights meanwhile
    (weights_current refuses); reload_to_device brings them back and the run goes on bitwise as one that
    never moved them (deterministic mode, one GPU)."""
    need_gpus(1)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts in the spawned rank
    runs = {}
    for offload in (False, True):
        launch(1, _offload_worker, str(tmp_path / f"offload-{offload}"), offload, backend="nccl")
        runs[offload] = torch.load(tmp_path / f"offload-{offload}.0")
    straight, moved = runs[False], runs[True]
    facts = moved["facts"]
    assert facts["freed"] >= facts["buffers"] > 0, facts
    assert facts["masters on the host"] and facts["weights back"], facts
    assert "reload_to_device() first" in facts["refused while offloaded"], facts
    assert moved["history"] == straight["history"], (moved["history"], straight["history"])
    assert all(torch.equal(moved["params"][n], p) for n, p in straight["params"].items())
    assert all(torch.equal(a, b) for a, b in zip(moved["shards"], straight["shards"], strict=True))


# ----------------------------------------------------------------------------- the trainers (mlite sft)
@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    assets = layout_assets(tmp_path_factory.mktemp("assets"))
    # a 4-layer dense model for pp2 x vpp2 (two chunks of one layer per stage)
    config = json.loads((assets["root"] / "dense" / "config.json").read_text())
    (assets["root"] / "dense4").mkdir()
    (assets["root"] / "dense4" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    return assets


def gpu_job(assets, model: str, out, **sections) -> dict:
    job = job_dict(assets, model, out, cluster={"gpu": "h100", "gpus_per_node": 2},
                   precision={"compute": "bf16"}, **sections)
    job["trainer"] |= {"device": "cuda", "deterministic": True}
    if model == "dense4":  # one sequence per micro-batch: 8 per step, a multiple of pp2 (vpp needs it)
        job["data"] |= {"dynamic_batch": False, "micro_batch_size": 1, "max_tokens_per_micro_batch": None}
    return job


def sft(tmp_path, job: dict, ranks: int, *overrides: str) -> list[dict]:
    done = mlite_cli(tmp_path, job, ranks, *overrides)
    assert done.returncode == 0, failure(done)
    return records(Path(job["trainer"]["output_dir"]))


def exact(rows: list[dict]) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"], r["tokens"]) for r in rows]


@pytest.fixture(scope="module")
def one_gpu(assets, tmp_path_factory):
    """The one-GPU fsdp2 run (the plain model under autocast) of each tiny model."""
    runs = {}

    def get(model):
        if model not in runs:
            out = tmp_path_factory.mktemp(f"one-{model}")
            runs[model] = sft(out, gpu_job(assets, model, out / "run"), 1)
        return runs[model]

    return get


DIST_OPT = "optimizer.backend=dist_opt"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "model,layout,twice,as_fsdp2",
    [("dense", [], True, True),  # dp2: the shards split the buffer, a rank may own none of a parameter
     ("dense", ["parallel.tp=2"], True, True),
     ("dense", ["parallel.pp=2"], False, False),
     ("dense4", ["parallel.pp=2", "parallel.vpp=2"], False, False),
     ("moe", ["parallel.pp=2"], False, False),
     ("moe", ["parallel.ep=2"], True, True),  # experts: edp1; the dense rest: dp2
     ("moe", ["parallel.tp=2"], False, True),  # the router's gradient summed over tp
     ("tied", ["parallel.tp=2"], True, True)],  # one [vocab, hidden] parameter, the embedding and the head
    ids=["dense-dp2", "dense-tp2", "dense-pp2", "dense-pp2-vpp2", "moe-pp2", "moe-ep2", "moe-tp2",
         "tied-tp2"],
)
def test_dist_opt_trains_a_layout_like_one_gpu_and_resumes(assets, one_gpu, tmp_path, model, layout, twice,
                                                           as_fsdp2):
    need_gpus(2)
    first = sft(tmp_path, gpu_job(assets, model, tmp_path / "a"), 2, DIST_OPT, *layout)
    assert_same_curve(first, one_gpu(model), rtol=BF16_RTOL)
    step2 = str(CheckpointManager(tmp_path / "a").path_for(2))
    resumed = sft(tmp_path, gpu_job(assets, model, tmp_path / "r"), 2, DIST_OPT, *layout,
                  f"trainer.resume={step2}")
    assert exact(resumed) == exact(first[2:]), "resumed from step 2, dist_opt left its own curve"
    if twice:
        again = sft(tmp_path, gpu_job(assets, model, tmp_path / "b"), 2, DIST_OPT, *layout)
        assert exact(again) == exact(first), "two deterministic dist_opt runs differ"
        # reduced at the step instead of during the backward: the same sums of the same buckets
        at_step = sft(tmp_path, gpu_job(assets, model, tmp_path / "c"), 2, DIST_OPT, *layout,
                      "optimizer.overlap_grad_reduce=false", "optimizer.overlap_param_gather=false")
        assert exact(at_step) == exact(first), "reducing and gathering at the step changed the curve"
    if as_fsdp2:  # the checkpoint's format is the layout's and the backend's: fsdp2 reads it
        crossed = sft(tmp_path, gpu_job(assets, model, tmp_path / "f"), 2, *layout, f"trainer.resume={step2}")
        assert_same_curve(crossed, first[2:], rtol=BF16_RTOL)
