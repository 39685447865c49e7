"""`mlite sft` under every sharded layout the runtime runs, against the one-process run.

Each layout is the real CLI under `torchrun --nproc-per-node 2` (gloo, CPU, fp32) on a tiny untied Qwen3
(dense) or Qwen3-MoE trained on the demo data: the loss and grad norm of every step equal the one-process
run within 1e-5 relative, with the same token counts. A checkpoint saved under tp2 continues on one
process; so does a tied Qwen3's under tp2 and tp2 x dp2. Every precision / recompute / offload / optimizer
key either changes the run (shown here) or is refused with one line naming it (exit 2). The GPU test runs
tp2 and fsdp2 dp2 in bf16 on NCCL.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_runs import (  # noqa: F401 - one_thread is an autouse fixture
    RTOL,
    assert_same_curve,
    failure,
    held_out,
    job_dict,
    layout_assets,
    mlite_cli,
    one_thread,
    records,
)

from mlite.config import job_from_dict
from mlite.runtime.ckpt.checkpoint import CheckpointManager
from mlite.trainers.grpo.algorithm import kl_estimate
from mlite.trainers.sft import train_sft


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Demo data, a tokenizer trained on it, and tiny dense, MoE and tied dense configs sized to the
    tokenizer."""
    return layout_assets(tmp_path_factory.mktemp("layout_assets"))


@pytest.fixture(scope="module")
def one_process(assets, tmp_path_factory):
    """The reference curve of each model: the same job on one process (in this process)."""
    runs = {}
    for model in ("dense", "moe"):
        out = tmp_path_factory.mktemp(f"one_{model}")
        train_sft(job_from_dict(job_dict(assets, model, out)), show_progress=False)
        runs[model] = records(out)
        runs[model, "val"] = held_out(out)
    return runs


LAYOUTS = [
    ("dense", ["parallel.pp=2"]),  # 1F1B for training, the forward-only schedule for evaluation
    ("dense", ["parallel.cp=2"]),
    ("dense", []),  # fsdp2 over dp2
    ("moe", ["parallel.ep=2"]),  # experts split over 2 ranks, dense parts fsdp2 over dp2
    ("moe", ["parallel.pp=2"]),  # the balance loss pooled over both stages, each back-propagating its terms
    # any stream length: the padding that fills the cp / sp split never reaches the router statistics
    ("moe", ["parallel.cp=2"]),
    ("moe", ["parallel.tp=2"]),
    # FSDP2 units of two layers, around the experts' own units under ep
    ("moe", ["parallel.ep=2", "parallel.fsdp_unit_layers=2"]),
    # a reduce-scatter after every micro-batch instead of one a step
    ("dense", ["parallel.fsdp_grad_accumulation=sharded"]),
    # the embedding kept sharded by vocabulary rows, its lookups exchanged: micro-batches of any length
    # (padded to one per index), the evaluation's forward-only passes; over the cp pair's zigzag shares; with
    # experts over ep (whose all-gather exchange pads the same way)
    ("dense", ["parallel.fsdp_embedding=rows"]),
    ("dense", ["parallel.cp=2", "parallel.fsdp_embedding=rows"]),
    ("moe", ["parallel.ep=2", "parallel.fsdp_embedding=rows"]),
    # the exchange's pair buffers sized by the pair count the host reads (`ep2` above: auto, which plans the
    # worst case here, nothing read on the host)
    ("moe", ["parallel.ep=2", "parallel.expert_buffers=exact"]),
]


@pytest.mark.parametrize("model,overrides", LAYOUTS,
                         ids=["pp2", "cp2", "fsdp2-dp2", "ep2", "moe-pp2", "moe-cp2", "moe-tp2",
                              "moe-ep2-units2", "fsdp2-dp2-sharded-grads", "fsdp2-dp2-embedding-rows",
                              "cp2-embedding-rows", "ep2-embedding-rows", "ep2-exact-buffers"])
def test_sft_cli_on_two_ranks_matches_one_process(assets, one_process, tmp_path, model, overrides):
    out = tmp_path / "run"
    done = mlite_cli(tmp_path, job_dict(assets, model, out), 2, *overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_curve(records(out), one_process[model])
    assert len(held_out(out)) == 2
    assert held_out(out) == pytest.approx(one_process[model, "val"], rel=RTOL)
    assert CheckpointManager(out).steps() == [4, 2]


def test_tp2_matches_one_process_and_its_checkpoint_resumes_on_one_process(assets, one_process, tmp_path):
    """Checkpoints name and shape every tensor as the whole model: tp2's step 2 continues on one process."""
    saved = tmp_path / "tp2"
    done = mlite_cli(tmp_path, job_dict(assets, "dense", saved), 2, "parallel.tp=2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_curve(records(saved), one_process["dense"])
    assert held_out(saved) == pytest.approx(one_process["dense", "val"], rel=RTOL)
    out = tmp_path / "one"
    resume = str(CheckpointManager(saved).path_for(2))
    train_sft(job_from_dict(job_dict(assets, "dense", out, trainer={"resume": resume})), show_progress=False)
    assert_same_curve(records(out), one_process["dense"][2:])


def test_embedding_rows_checkpoint_resumes_on_one_process(assets, one_process, tmp_path):
    """The embedding kept as row shards is saved whole, like every parameter: a dp2 run's step-2 checkpoint
    under parallel.fsdp_embedding rows continues on one process on the uninterrupted curve."""
    saved = tmp_path / "rows"
    done = mlite_cli(tmp_path, job_dict(assets, "dense", saved), 2, "parallel.fsdp_embedding=rows")
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "one"
    resume = str(CheckpointManager(saved).path_for(2))
    train_sft(job_from_dict(job_dict(assets, "dense", out, trainer={"resume": resume})), show_progress=False)
    assert_same_curve(records(out), one_process["dense"][2:])


@pytest.mark.parametrize("ranks", [2, 4], ids=["tp2", "tp2xdp2"])
def test_a_tied_lm_head_under_tp_matches_one_process_and_resumes_on_one_process(assets, tmp_path, ranks):
    """Qwen3's small models tie the LM head to the embedding. Under tp both split the [vocab, hidden]
    matrix by vocab rows, so it stays one parameter: its gradient holds both uses, FSDP2 shards it as one
    unit over dp, and the checkpoint names it once. The run equals the one-process run, and its step-2
    checkpoint continues there."""
    one = tmp_path / "one"
    train_sft(job_from_dict(job_dict(assets, "tied", one)), show_progress=False)
    saved = tmp_path / "tp2"
    done = mlite_cli(tmp_path, job_dict(assets, "tied", saved), ranks, "parallel.tp=2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_curve(records(saved), records(one))
    assert held_out(saved) == pytest.approx(held_out(one), rel=RTOL)
    resumed = tmp_path / "resumed"
    resume = str(CheckpointManager(saved).path_for(2))
    job = job_dict(assets, "tied", resumed, trainer={"resume": resume})
    train_sft(job_from_dict(job), show_progress=False)
    assert_same_curve(records(resumed), records(one)[2:])


# ------------------------------------------------------------------------------- keys with an effect
def test_grad_reduce_bf16_reduces_gradients_in_bf16(assets, one_process, tmp_path):
    """precision.grad_reduce: bf16 rounds the reduced gradients: the curve moves off the fp32 one by bf16
    rounding, no further."""
    out = tmp_path / "run"
    done = mlite_cli(tmp_path, job_dict(assets, "dense", out), 2, "precision.grad_reduce=bf16")
    assert done.returncode == 0, done.stderr[-3000:]
    got, want = records(out), one_process["dense"]
    assert [r["grad_norm"] for r in got] != pytest.approx([r["grad_norm"] for r in want], rel=1e-6)
    assert_same_curve(got, want, rtol=2e-2)


def test_recompute_keeps_the_numbers_and_saves_activations(assets, tmp_path):
    """recompute.* applies on one process too: same loss and gradients, fewer tensors kept for backward."""
    from mlite.runtime.data.sft import build_sft_data
    from mlite.runtime.engine import Runtime
    from mlite.runtime.loss import sft_loss

    def run(recompute):
        job = job_from_dict(job_dict(assets, "dense", tmp_path / "unused", recompute=recompute))
        rt = Runtime(job)
        micro_batches, targets = build_sft_data(job).next_step()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            outs = rt.forward_backward(micro_batches, sft_loss(targets))
        grads = [p.grad.clone() for p in rt.model.parameters()]
        return sum(o["loss"] for o in outs), grads, sum(saved)

    loss, grads, kept = run({"granularity": "none"})
    for recompute in ({"granularity": "selective"}, {"granularity": "full"}):
        loss_rc, grads_rc, kept_rc = run(recompute)
        assert loss_rc == loss and all(torch.equal(a, b) for a, b in zip(grads, grads_rc)), recompute
        assert kept_rc < kept, f"{recompute}: {kept_rc} saved elements, {kept} without recompute"


def _recompute_worker(rank, world, tmp_path, out):
    """Selective recompute under cp2: context parallel's attention core is recomputed too."""
    from mlite.runtime.engine import Runtime

    batches, result = rl_batches(), {}
    for granularity in ("none", "selective"):
        job = rl_job(Path(tmp_path), {"cp": 2}) | {"recompute": {"granularity": granularity}}
        rt = Runtime(job_from_dict(job))
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            outs = rt.forward_backward(batches, rl_loss, with_entropy=True)
        grads = [p.grad.full_tensor() for p in rt.model.parameters()]  # FSDP2 shards over dp_cp
        result[granularity] = (sum(o["loss"] for o in outs), grads, sum(saved))
    torch.save(result, f"{out}.{rank}")


def test_selective_recompute_holds_under_context_parallel(tmp_path):
    """recompute.granularity selective with cp=2: the same loss and gradients, fewer saved activations
    (context parallel once replaced the recomputed attention core, and recompute silently vanished)."""
    from parallel_harness import launch

    write_model(tmp_path)
    out = tmp_path / "recompute.pt"
    launch(2, _recompute_worker, str(tmp_path), str(out))
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")
        (loss, grads, kept), (loss_rc, grads_rc, kept_rc) = got["none"], got["selective"]
        assert loss_rc == loss and all(torch.equal(a, b) for a, b in zip(grads, grads_rc))
        assert kept_rc < kept, \
            f"rank {rank}: {kept_rc} saved elements with selective recompute, {kept} without"


# --------------------------------------------------------------------------- keys refused, one line
@pytest.mark.parametrize(
    "override,message",
    [
        ("optimizer.backend=dist_opt", "cpu (gloo) device is not supported by optimizer.backend 'dist_opt'"),
        ("precision.grad_reduce=bf16",
         "precision.grad_reduce: bf16 sets the dtype of the gradient reduction"),
        ("offload.optimizer=true", "offload.* moves GPU state to host memory, but this run is on the CPU"),
    ],
    ids=["dist_opt", "grad_reduce-one-process", "offload-on-cpu"],
)
def test_keys_that_cannot_apply_are_one_line_exit_2(assets, tmp_path, override, message):
    job = job_dict(assets, "dense", tmp_path / "run", trainer={"steps": 1})
    done = mlite_cli(tmp_path, job, 1, override)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith(f"mlite sft: error: {message}")
    assert "Traceback" not in done.stderr


def test_bf16_master_weights_on_cpu_are_refused(assets, tmp_path):
    from mlite.errors import MliteError
    from mlite.runtime.engine import Runtime

    job = job_dict(assets, "dense", tmp_path / "run", precision={"compute": "bf16", "master": "bf16"})
    with pytest.raises(MliteError,
                       match="precision.master: bf16 keeps parameters and Adam state in bf16 on GPUs"):
        Runtime(job_from_dict(job))


# ------------------------------------------------------------------------------------------- GPU
OFFLOAD = "offload.optimizer=true"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "model,overrides",
    [("dense", ["parallel.tp=2"]), ("dense", []), ("dense", [OFFLOAD]),
     # offload under each model-parallel axis alone (the Qwen3-235B template offloads under tp x pp x ep)
     ("dense", ["parallel.tp=2", OFFLOAD]), ("dense", ["parallel.pp=2", OFFLOAD]),
     ("moe", ["parallel.ep=2", OFFLOAD]),
     ("tied", ["parallel.tp=2"]),  # the tied LM head, one parameter under tp
     ("tied", []),  # ... and one FSDP2 unit with the embedding, kept gathered, freed after each evaluation
     ("dense", ["parallel.fsdp_embedding=rows"])],  # the embedding's rows exchanged on NCCL, cast to bf16
    ids=["tp2", "fsdp2-dp2", "fsdp2-dp2-offload", "tp2-offload", "pp2-offload", "moe-ep2-offload",
         "tied-tp2", "tied-fsdp2-dp2", "fsdp2-dp2-embedding-rows"],
)
def test_sft_on_two_gpus_in_bf16_matches_one_gpu(assets, tmp_path, model, overrides):
    if torch.cuda.device_count() < 2:
        pytest.fail(f"this test needs 2 GPUs, {torch.cuda.device_count()} visible")
    gpu = {"cluster": {"gpu": "h100", "gpus_per_node": 2}, "precision": {"compute": "bf16"},
           "trainer": {"device": "cuda"}}
    one = tmp_path / "one"
    done = mlite_cli(tmp_path, job_dict(assets, model, one, **gpu), 1)
    assert done.returncode == 0, failure(done)
    two = tmp_path / "two"
    done = mlite_cli(tmp_path, job_dict(assets, model, two, **gpu), 2, *overrides)
    assert done.returncode == 0, failure(done)
    assert_same_curve(records(two), records(one), rtol=2e-2)


@pytest.mark.gpu
def test_moe_ep2_with_its_experts_in_no_fsdp2_unit_on_two_gpus_matches_one_gpu(assets, tmp_path):
    """bf16 masters at ep2 on 2 GPUs: ep spans both ranks (edp 1), so the plan leaves the routed experts
    out of FSDP2 (policy.experts_outside_fsdp): plain ep DTensors, stepped, clipped and checkpointed like
    any parameter. The SFT curve is one GPU's within bf16 rounding."""
    from mlite.plan import plan_job
    from mlite.plan.world import World

    if torch.cuda.device_count() < 2:
        pytest.fail(f"this test needs 2 GPUs, {torch.cuda.device_count()} visible")
    gpu = {"cluster": {"gpu": "h100", "gpus_per_node": 2}, "precision": {"compute": "bf16", "master": "bf16"},
           "trainer": {"device": "cuda"}}
    two_job = job_dict(assets, "moe", tmp_path / "two", **gpu)
    two_job["parallel"] = {**two_job.get("parallel", {}), "ep": 2}
    assert plan_job(job_from_dict(two_job), world=World(2, "cuda", False)).experts_outside_fsdp
    done = mlite_cli(tmp_path, job_dict(assets, "moe", tmp_path / "one", **gpu), 1)
    assert done.returncode == 0, failure(done)
    done = mlite_cli(tmp_path, job_dict(assets, "moe", tmp_path / "two", **gpu), 2, "parallel.ep=2")
    assert done.returncode == 0, failure(done)
    assert_same_curve(records(tmp_path / "two"), records(tmp_path / "one"), rtol=2e-2)


@pytest.mark.gpu
def test_bf16_masters_reduce_in_bf16_on_two_gpus(assets, tmp_path):
    """precision.grad_reduce auto with bf16 masters reduces in bf16 (mlite.plan.policy.grad_reduce_dtype):
    - one micro-batch a step: each reduced element is one sum over the two ranks, rounded once to the
      bf16 gradient either way, so every step's loss and grad norm have the fp32 reduction's bits;
    - several: the micro-batches accumulate in bf16 (the fp32 reduction accumulates them in fp32), the
      explicit bf16 reduction's bits, within bf16 rounding of the fp32 curve."""
    if torch.cuda.device_count() < 2:
        pytest.fail(f"this test needs 2 GPUs, {torch.cuda.device_count()} visible")
    gpu = {"cluster": {"gpu": "h100", "gpus_per_node": 2}, "precision": {"compute": "bf16", "master": "bf16"},
           "trainer": {"device": "cuda"}}

    def curve(name: str, data: dict, reduce: str) -> list[tuple[float, float]]:
        out = tmp_path / name
        job = job_dict(assets, "dense", out, data=data, **gpu)
        done = mlite_cli(tmp_path, job, 2, f"precision.grad_reduce={reduce}")
        assert done.returncode == 0, failure(done)
        return [(r["loss"], r["grad_norm"]) for r in records(out)]

    one = {"global_batch_size": 2, "micro_batch_size": 1, "dynamic_batch": False,
           "max_tokens_per_micro_batch": None}
    auto = curve("one-auto", one, "auto")
    assert len(auto) >= 3 and auto == curve("one-fp32", one, "fp32")
    several = curve("several-auto", {}, "auto")
    assert several == curve("several-bf16", {}, "bf16")
    fp32 = curve("several-fp32", {}, "fp32")
    assert several != fp32
    flat = [v for pair in several for v in pair]
    assert flat == pytest.approx([v for pair in fp32 for v in pair], rel=2e-2)


@pytest.mark.gpu
def test_fsdp_one_rank_on_one_gpu_matches_the_plain_run_and_its_step_runs_the_kernel(assets, tmp_path):
    """parallel.fsdp_one_rank on one GPU: the multi-GPU path (FSDP2 DTensor shards) trains as the plain
    model does in bf16, and its update is TritonAdamW's kernel over the local shards (clipping and the
    non-finite skip inside it), not torch's foreach step."""
    from torch.distributed.tensor import DTensor

    from mlite.runtime.data.sft import build_sft_data
    from mlite.runtime.engine import Runtime
    from mlite.runtime.loss import sft_loss

    if not torch.cuda.is_available():
        pytest.fail("this test needs a CUDA GPU, none visible")
    gpu = {"cluster": {"gpu": "h100"}, "precision": {"compute": "bf16"}, "trainer": {"device": "cuda"}}
    job = job_dict(assets, "dense", tmp_path / "direct", **gpu)
    job["parallel"] = {"fsdp_one_rank": True}
    rt = Runtime(job_from_dict(job))
    micro_batches, targets = build_sft_data(job_from_dict(job)).next_step()
    rt.forward_backward(micro_batches, sft_loss(targets))
    assert all(isinstance(p, DTensor) for p in rt.model.parameters()) and rt.optim.fused
    assert rt.optim.optimizer._plan() is not None, "the kernel does not serve the shards"
    norm, skipped = rt.optimizer_step()
    assert not bool(skipped) and float(norm) > 0
    rt.close()

    one = tmp_path / "one"
    done = mlite_cli(tmp_path, job_dict(assets, "dense", one, **gpu), 1)
    assert done.returncode == 0, done.stderr[-3000:]
    sharded = tmp_path / "sharded"
    done = mlite_cli(tmp_path, job_dict(assets, "dense", sharded, **gpu), 1, "parallel.fsdp_one_rank=true")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_curve(records(sharded), records(one), rtol=2e-2)


@pytest.mark.gpu
def test_bf16_master_weights_on_gpu_keep_parameters_and_adam_state_in_bf16(assets, tmp_path):
    from mlite.runtime.data.sft import build_sft_data
    from mlite.runtime.engine import Runtime
    from mlite.runtime.loss import sft_loss

    if not torch.cuda.is_available():
        pytest.fail("this test needs a CUDA GPU, none visible")
    gpu = {"cluster": {"gpu": "h100"}, "trainer": {"device": "cuda"}}
    job = job_from_dict(job_dict(assets, "dense", tmp_path / "bf16",
                                 precision={"compute": "bf16", "master": "bf16"}, **gpu))
    rt = Runtime(job)
    micro_batches, targets = build_sft_data(job).next_step()
    rt.forward_backward(micro_batches, sft_loss(targets))
    rt.optimizer_step()
    assert rt.autocast_dtype is None and {p.dtype for p in rt.model.parameters()} == {torch.bfloat16}
    moments = [s["exp_avg"] for s in rt.optim.optimizer.state.values()]
    assert moments and {m.dtype for m in moments} == {torch.bfloat16}

    fp32 = train_sft(job_from_dict(job_dict(assets, "dense", tmp_path / "fp32", precision={"compute": "bf16"},
                                            **gpu)),
                     show_progress=False)
    bf16 = train_sft(job, show_progress=False)
    assert bf16.losses == pytest.approx(fp32.losses, rel=5e-2)


# ------------------------------------------------------------------ the RL contract under every layout
def write_model(tmp_path: Path, tied: bool = False) -> None:
    """tiny-qwen3 with 4 layers (pp2 x vpp2), untied unless `tied` (pipeline stages refuse a tied head)."""
    from mlite.config.catalog import PRESETS

    (tmp_path / "model").mkdir()
    config = {**PRESETS["tiny-qwen3"], "tie_word_embeddings": tied, "num_hidden_layers": 4}
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))


def rl_job(tmp_path: Path, layout: dict) -> dict:
    return {"model": {"path": str(tmp_path / "model"), "load_weights": False}, "parallel": layout,
            "data": {"seq_len": 256, "max_tokens_per_micro_batch": 256}, "cluster": {"gpu": "cpu"},
            "precision": {"compute": "fp32"}, "optimizer": {"lr": 1e-3},
            "trainer": {"device": "cpu", "seed": 3}}


def rl_batches():
    """Two micro-batches of odd lengths (padding under tp / cp) with per-token advantages in extras."""
    from mlite.runtime.data.packed import PackedBatch

    g = torch.Generator().manual_seed(0)
    batches = []
    for lengths in ((9, 14), (11, 6, 4)):
        seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
        advantages = [torch.randn(n, generator=g).tolist() for n in lengths]
        batches.append(PackedBatch.from_sequences(seqs, [[0, 0] + [1] * (n - 2) for n in lengths],
                                                  extras={"advantages": advantages}))
    return batches


def rl_loss(batch, logprobs, entropy, aux):
    """A policy-gradient-like loss reading extras, log-probs and entropy (gradients through both)."""
    trained = (batch.labels != -100).float()
    loss = -(batch.extras["advantages"] * logprobs).sum() / 40 - 0.05 * (entropy * trained).sum() / 40
    return loss, {}


def rl_steps(tmp_path: Path, layout: dict) -> dict:
    from mlite.runtime.engine import Runtime

    rt = Runtime(job_from_dict(rl_job(tmp_path, layout)))
    everything = rl_batches()
    mine = list(range(rt.dp_rank, len(everything), rt.dp_size))  # each dp rank its own micro-batches
    batches, result = [everything[i] for i in mine], {"loss": [], "grad_norm": [], "mine": mine}
    reference = rt.snapshot_weights()  # GRPO's reference policy: this rank's shards of the initial weights
    # outputs compared before any update: Adam's first steps amplify float rounding in tiny gradients
    evaluated = rt.forward_backward(batches, None, forward_only=True, with_entropy=True, temperature=0.7)
    steps = []
    for _ in range(2):
        rt.zero_grad()
        steps.append(rt.forward_backward(batches, rl_loss, with_entropy=True))
        result["loss"].append(float(rt.global_sum(sum(o["loss"] for o in steps[-1]))))
        result["grad_norm"].append(float(rt.optimizer_step()[0]))
    result["logprobs"] = [o["logprobs"] for o in steps[0] + evaluated]
    result["entropy"] = [o["entropy"] for o in steps[0] + evaluated]
    # the KL term after two updates: the policy's log-probs against the reference's, both through the
    # runtime's own path (sharding, sequence split, vocab-parallel loss, pipeline)
    policy = rt.forward_backward(batches, None, forward_only=True, temperature=0.7)
    ref = rt.forward_with_weights(reference, batches, temperature=0.7)
    after = rt.forward_backward(batches, None, forward_only=True, temperature=0.7)  # weights swapped back
    result["ref_logprobs"] = [o["logprobs"] for o in ref]
    # `evaluated` took entropy too, so its log-probs came through the autograd head, `ref`'s through the
    # LM-head kernel (a sharded head is gathered for it): equal within float rounding, far inside what two
    # updates move
    result["ref_is_initial"] = all(torch.allclose(r["logprobs"], e["logprobs"], rtol=1e-5, atol=1e-6)
                                   for r, e in zip(ref, evaluated))
    result["swapped_back"] = all(torch.equal(a["logprobs"], p["logprobs"]) for a, p in zip(after, policy))
    result["kl"] = [float(kl_estimate(p["logprobs"], r["logprobs"], "k3").sum()) for p, r in zip(policy, ref)]
    return result


def _rl_worker(rank, world, tmp_path, layout, out):
    result = rl_steps(Path(tmp_path), layout)
    torch.save(result, f"{out}.{rank}")


@pytest.mark.parametrize(
    "layout,tied",
    [({"tp": 2}, False), ({"cp": 2}, False), ({"pp": 2}, False), ({"pp": 2, "vpp": 2}, False), ({}, True),
     ({"fsdp_embedding": "rows"}, False)],
    ids=["tp2", "cp2", "pp2", "pp2+vpp2", "fsdp2-dp2-tied", "fsdp2-dp2-embedding-rows"],
)
def test_rl_outputs_and_gradients_through_logprobs_and_entropy_match_one_process(tmp_path, layout, tied):
    """forward_backward's contract on 2 gloo ranks: the loss_fn's gradients through log-probs and entropy,
    extras split with their tokens, and every rank's returned whole-stream log-probs and entropy (training
    and forward-only with a temperature) equal one process. So do the GRPO reference policy's log-probs
    (the initial weights swapped in on the runtime's own path) and the KL term after two updates. The tied
    head under fsdp2 dp2 shares the embedding's unit, kept gathered: the reference's log-probs must not
    reuse the policy's matrix a forward-only pass left gathered."""
    from parallel_harness import launch

    write_model(tmp_path, tied)  # once, before any rank reads it
    want = rl_steps(tmp_path, {})
    out = tmp_path / "rl.pt"
    launch(2, _rl_worker, str(tmp_path), layout, str(out))
    n = len(want["mine"])
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")

        def picked(values):  # one process's per-micro-batch values (runs of n) at this rank's micro-batches
            return [values[start + i] for start in range(0, len(values), n) for i in got["mine"]]

        assert got["loss"] == pytest.approx(want["loss"], rel=RTOL), rank
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=RTOL), rank
        for name in ("logprobs", "entropy", "ref_logprobs"):
            assert len(got[name]) == len(picked(want[name])), (rank, name)
            for ours, ref in zip(got[name], picked(want[name])):
                torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5, msg=f"rank {rank} {name}")
        # the reference is the initial policy on every layout, and the live weights come back after it
        assert got["ref_is_initial"] and got["swapped_back"], rank
        assert got["kl"] == pytest.approx(picked(want["kl"]), rel=1e-4, abs=1e-7), rank
    assert all(kl > 0 for kl in want["kl"])  # two updates moved the policy: the KL term is not trivially 0


ROLLOUT_PROMPTS = ([[5, 17, 33]], [[40, 2, 9, 77, 12], [8]])  # rank 0, rank 1: different work per rank


def rollouts(tmp_path: Path, layout: dict, ranks=(0, 1)) -> dict:
    """Greedy completions from Runtime.rollout_model(); each rank decodes its own prompts for its own
    number of steps (no collective may hide in decode), and a second rollout reuses the replica."""
    from mlite.runtime.engine import Runtime
    from mlite.trainers.grpo.rollout import SamplingParams, generate

    rt = Runtime(job_from_dict(rl_job(tmp_path, layout)))
    out = {}
    for rank in ranks:
        params = SamplingParams(max_new_tokens=3 + 6 * rank, temperature=0.0)
        first = generate(rt.rollout_model(), ROLLOUT_PROMPTS[rank], params)
        again = generate(rt.rollout_model(), ROLLOUT_PROMPTS[rank], params)
        out[rank] = ([c.response_ids for c in first], [c.response_ids for c in again])
    return out


def _rollout_worker(rank, world, tmp_path, layout, out):
    torch.save(rollouts(Path(tmp_path), layout, ranks=(rank,))[rank], f"{out}.{rank}")


@pytest.mark.parametrize("layout,tied", [({}, False), ({"tp": 2}, False), ({"ep": 1, "cp": 2}, False),
                                         ({"tp": 2}, True)], ids=["fsdp2-dp2", "tp2", "cp2", "tp2-tied"])
def test_native_rollout_on_two_ranks_decodes_like_one_process(tmp_path, layout, tied):
    """GRPO's native sampler on a sharded model (FSDP2 / TP DTensors, a tied head included): the gathered
    replica decodes the same greedy tokens as one process, though each rank stops after a different number
    of steps."""
    from parallel_harness import launch

    write_model(tmp_path, tied)
    want = rollouts(tmp_path, {})
    out = tmp_path / "rollout.pt"
    launch(2, _rollout_worker, str(tmp_path), layout, str(out))
    for rank in range(2):
        first, again = torch.load(f"{out}.{rank}")
        assert first == again == want[rank][0], rank
        assert [len(r) for r in first] == [3 + 6 * rank] * len(ROLLOUT_PROMPTS[rank])  # no stop token given


# ------------------------------------------------------------------- compiled blocks under FSDP2 and EP
def _compiled_steps(rank, world, layout, model, compile_blocks, out):
    """Two steps of the Runtime (each rank the same packed batch; the loss normalised over every rank's
    targets), with what torch.compile captured in this process."""
    import torch._dynamo.utils as dynamo_utils

    from mlite.runtime.data.packed import PackedBatch
    from mlite.runtime.engine import Runtime
    from mlite.runtime.loss import sft_loss

    rt = Runtime(job_from_dict({"model": {"name": model, "compile": compile_blocks}, "parallel": layout,
                                "data": {"seq_len": 512}, "precision": {"compute": "fp32"},
                                "trainer": {"device": "cpu", "seed": 3}}))
    g, steps = torch.Generator().manual_seed(0), []
    for lengths in ((9, 14), (11, 6, 4)):
        sequences = [torch.randint(0, 200, (n,), generator=g).tolist() for n in lengths]
        batch = PackedBatch.from_sequences(sequences)
        rt.zero_grad()
        (o,) = rt.forward_backward([batch], sft_loss(rt.global_sum(batch.num_target_tokens)))
        steps.append((float(rt.global_sum(o["loss"])), float(rt.optimizer_step()[0])))
    torch.save({"steps": steps, "graphs": dynamo_utils.counters["stats"]["unique_graphs"],
                "breaks": sum(dynamo_utils.counters["graph_break"].values())}, f"{out}.{rank}")


@pytest.mark.parametrize("model,layout",
                         [("tiny-qwen3", {"fsdp_unit_layers": 1}), ("tiny-qwen3-moe", {"ep": 2})],
                         ids=["fsdp2-dp2", "ep2"])
def test_compiled_blocks_under_fsdp2_and_ep_match_one_eager_process(tmp_path, model, layout):
    """model.compile on 2 gloo ranks (FSDP2 over dp; experts over ep): the blocks are compiled on every
    rank and the losses and grad norms equal one eager process. FSDP2's hooks on units of one layer add no
    graph break to those of one compiled process (on CPU the attention core's per-sequence split breaks
    each block's graph; a GPU's packed attention does not). A unit of both layers (`auto`'s choice for
    these) compiled 2 graphs and broke once more on this CPU (a recompilation; the same numbers): compile
    time, not an eager fallback. Expert parallel does add some breaks: its exchange reads its pair count
    (or split sizes) on the host, once per exchange."""
    from parallel_harness import launch

    out = tmp_path / "steps.pt"
    launch(1, _compiled_steps, {}, model, False, f"{out}.eager")
    launch(1, _compiled_steps, {}, model, True, f"{out}.one")
    launch(2, _compiled_steps, layout, model, True, str(out))
    eager, one = torch.load(f"{out}.eager.0"), torch.load(f"{out}.one.0")
    assert eager["graphs"] == 0 and one["graphs"] > 0
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")
        assert got["graphs"] > 0, (rank, got)
        if "ep" not in layout:
            assert got["breaks"] == one["breaks"], (rank, got, one)
        for (loss, norm), (want_loss, want_norm) in zip(got["steps"], eager["steps"]):
            assert loss == pytest.approx(want_loss, rel=1e-5) and norm == pytest.approx(want_norm, rel=1e-4)


def _embedding_rows_worker(rank, world, out):
    """One step of each parallel.fsdp_embedding mode on this rank's own micro-batches (lengths differ from
    the other rank's): the loss, the embedding's whole gradient, how the weight is held."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    from mlite.config.catalog import PRESETS
    from mlite.runtime.data.packed import PackedBatch
    from mlite.runtime.engine import Runtime
    from mlite.runtime.loss import sft_loss

    hf_config = {**PRESETS["tiny-qwen3"], "tie_word_embeddings": False}
    g = torch.Generator().manual_seed(rank)
    lengths = [[30, 21], [17, 40]][rank]  # micro-batch i has another length on the other rank
    batches = [PackedBatch.from_sequences([torch.randint(0, 256, (n,), generator=g).tolist()])
               for n in lengths]
    targets = torch.tensor(sum(b.num_target_tokens for b in batches))
    dist.all_reduce(targets)
    found = {}
    for mode in ("gathered", "rows"):
        job = job_from_dict({"model": {"name": "tiny-qwen3"}, "precision": {"compute": "fp32"},
                             "data": {"seq_len": 64}, "parallel": {"fsdp_embedding": mode},
                             "trainer": {"device": "cpu", "seed": 7}})
        rt = Runtime(job, hf_config=hf_config)
        outs = rt.forward_backward(batches, sft_loss(int(targets)))
        weight = rt.model.embed.weight
        in_fsdp2 = any(fsdp_param.sharded_param is weight for module in rt.model.modules()
                       if isinstance(module, FSDPModule) and module._get_fsdp_state()._fsdp_param_group
                       for fsdp_param in module._get_fsdp_state()._fsdp_param_group.fsdp_params)
        found[mode] = {
            "loss": sum(float(o["loss"]) for o in outs),
            "logprobs": [o["logprobs"] for o in outs],
            "grad": weight.grad.full_tensor(),
            "rows here": tuple(weight.to_local().shape),
            "sharded by rows": isinstance(weight, DTensor) and weight.placements == (Shard(0),),
            # as the weight is: the fused optimizer step and the gradient norm take this rank's rows
            "gradient rows here": (weight.grad.placements, tuple(weight.grad.to_local().shape)),
            "an FSDP2 parameter": in_fsdp2,
            "equal lengths": rt.placement.equal_lengths,
        }
        rt.close()
    torch.save(found, f"{out}.{rank}")


def test_embedding_rows_keep_the_matrix_sharded_and_give_the_gathered_gradient(tmp_path):
    """parallel.fsdp_embedding rows (2 gloo ranks, micro-batches of other lengths on each): the embedding is
    no FSDP2 unit but a [vocab / 2, hidden] shard of rows on each rank, and one step's loss, log-probs and
    whole embedding gradient are FSDP2's gathered ones (the gradient rows come out complete, with no
    reduction, and stay a shard of rows like the weight); only rows pads the micro-batches to one length on
    both ranks."""
    from parallel_harness import launch
    from torch.distributed.tensor import Shard

    out = tmp_path / "found"
    launch(2, _embedding_rows_worker, str(out))
    for rank in range(2):
        found = torch.load(f"{out}.{rank}")
        gathered, rows = found["gathered"], found["rows"]
        assert rows["sharded by rows"] and not rows["an FSDP2 parameter"] and rows["rows here"] == (128, 64)
        assert rows["gradient rows here"] == ((Shard(0),), (128, 64))
        assert gathered["an FSDP2 parameter"] and not gathered["equal lengths"] and rows["equal lengths"]
        assert rows["loss"] == pytest.approx(gathered["loss"], rel=1e-6)
        for ours, theirs in zip(rows["logprobs"], gathered["logprobs"]):
            assert ours.shape == theirs.shape  # the padding is dropped again
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        assert gathered["grad"].abs().sum() > 0
        torch.testing.assert_close(rows["grad"], gathered["grad"], rtol=1e-5, atol=1e-7)


def _cyclic_garbage_worker(rank, world, model, parallel, out):
    """Three training steps with Python's collector off: the unreachable objects they leave, by type."""
    import gc

    from mlite.runtime.data.packed import PackedBatch
    from mlite.runtime.engine import Runtime
    from mlite.runtime.loss import sft_loss

    job = job_from_dict({"model": {"name": model}, "precision": {"compute": "fp32"}, "parallel": parallel,
                         "data": {"seq_len": 64, "global_batch_size": 4},
                         "trainer": {"device": "cpu", "seed": 7, "gc_every": 1000}})
    rt = Runtime(job)
    g = torch.Generator().manual_seed(rank)
    batches = [PackedBatch.from_sequences([torch.randint(0, 256, (n,), generator=g).tolist()])
               for n in (32, 24)]

    def step():
        rt.zero_grad()
        rt.forward_backward(batches, sft_loss(112))
        rt.optimizer_step()
        rt.lr_scheduler_step()

    step()  # the first step builds what lives on (optimizer state, caches)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # unreachable objects kept in gc.garbage instead of freed
    try:
        for _ in range(3):
            step()
        gc.collect()
        found = {"tensors": sum(isinstance(o, torch.Tensor) for o in gc.garbage), "objects": len(gc.garbage)}
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    rt.close()
    torch.save(found, f"{out}.{rank}")


@pytest.mark.parametrize("model,parallel", [("dense", {}), ("dense", {"tp": 2}), ("moe", {"ep": 2})],
                         ids=["fsdp2-dp2", "tp2", "moe-ep2"])
def test_a_training_step_leaves_no_tensor_in_a_reference_cycle(tmp_path, model, parallel):
    """trainer.gc_every turns Python's automatic collector off between its scheduled passes, so a tensor
    caught in a reference cycle would stay allocated (GPU memory) until the next one. On 2 gloo ranks, three
    steps of fsdp2 dp2, tp2 and MoE ep2 leave no tensor among their unreachable objects. (tp's DTensor
    dispatch does leave small closures in cycles, freed at the scheduled pass.) On GPUs the bench's
    allocated peak is the same with and without the schedule (docs/PERFORMANCE.md)."""
    from parallel_harness import launch

    out = tmp_path / "garbage"
    name = {"dense": "tiny-qwen3", "moe": "tiny-qwen3-moe"}[model]
    launch(2, _cyclic_garbage_worker, name, parallel, str(out))
    for rank in range(2):
        assert torch.load(f"{out}.{rank}")["tensors"] == 0
