"""`mlite sft` and `mlite grpo` train a tiny DeepSeek-V4 (catalog preset tiny-deepseek-v4) on CPU, with the
MTP and indexer losses on; every layout of the DeepSeek-V4 templates equals one process (the twin of
slurm/{sft,grpo}_dsv4_128gpu.sbatch: pp2 x ep2 x cp2 on 8 gloo ranks) and resumes under another layout;
keys the model lacks are refused in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_runs import assert_same_curve, assert_same_records, mlite_cli, records
from test_grpo_cli import mlite_grpo, workdir, write_job  # noqa: F401 - workdir is a fixture

from mlite.trainers.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sft_assets(tmp_path_factory):
    from mlite.runtime.data.demo import write_demo_data
    from mlite.runtime.data.tokenizer import train_demo_tokenizer

    root = tmp_path_factory.mktemp("dsv4_sft")
    files = write_demo_data(root / "data", train=96, val=16, seed=1)
    train_demo_tokenizer(root / "tokenizer", seed=1, vocab_size=256, rows=200)
    return root, files


def sft_job(root: Path, files, out: Path, **model) -> Path:
    job = {
        "job": "sft",
        "model": {"name": "tiny-deepseek-v4", **model},
        "cluster": {"gpu": "cpu", "gpus_per_node": 1},
        "optimizer": {"lr": 3e-3, "warmup_steps": 2},
        "precision": {"compute": "fp32"},
        "data": {"train_files": [str(files["train.jsonl"])], "tokenizer": str(root / "tokenizer"),
                 "seq_len": 128, "global_batch_size": 8, "max_tokens_per_micro_batch": 512},
        "trainer": {"steps": 12, "seed": 3, "output_dir": str(out), "log_every": 1, "device": "cpu"},
    }
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def mlite(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlite", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_sft_trains_tiny_deepseek_v4_with_mtp_and_indexer_losses(sft_assets, tmp_path):
    root, files = sft_assets
    out = tmp_path / "sft"
    done = mlite("sft", str(sft_job(root, files, out, mtp_loss_weight=0.3, indexer_loss_weight=0.1)),
                 "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3
    assert (out / "checkpoints").is_dir()


def test_grpo_trains_tiny_deepseek_v4(workdir, tmp_path):  # noqa: F811 - the fixture
    out = tmp_path / "grpo"
    done = mlite_grpo(write_job(workdir, out, model={"name": "tiny-deepseek-v4"}))
    assert done.returncode == 0, done.stderr[-3000:]
    records = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] > 0]  # step 0: the first eval
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["actor/grad_norm"] > 0 for r in records)


@pytest.mark.parametrize("override, line", [
    ({"model": {"name": "tiny-qwen3", "mtp_loss_weight": 0.3}}, "has no multi-token-prediction layer"),
    ({"model": {"name": "tiny-qwen3", "indexer_loss_weight": 0.1}}, "has no lightning indexer"),
])
def test_refusals_in_one_line(sft_assets, tmp_path, override, line):
    root, files = sft_assets
    path = sft_job(root, files, tmp_path / "bad")
    job = yaml.safe_load(path.read_text())
    for section, values in override.items():
        job[section] = {**job.get(section, {}), **values}
    job["cluster"]["gpus_per_node"] = 2 if "parallel" in override else 1
    path.write_text(yaml.safe_dump(job))
    done = mlite("plan", str(path))
    assert done.returncode == 2 and line in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def dp_job(root: Path, files, out: Path) -> dict:
    job = yaml.safe_load(sft_job(root, files, out).read_text())
    # one sequence per micro-batch: the balance loss pools router statistics per micro-batch, so the
    # micro-batches must be the same under every data-parallel degree for the numbers to be
    job["data"] |= {"dynamic_batch": False, "micro_batch_size": 1, "max_tokens_per_micro_batch": None,
                    "global_batch_size": 4}
    job["trainer"] |= {"steps": 4, "save_every": 2}
    job["optimizer"] |= {"clip_grad": 1.0}
    return job


def test_data_and_expert_parallel_match_one_process_and_resume_there(sft_assets, tmp_path):
    """DeepSeek-V4 under FSDP2 over 2 gloo ranks, and with its experts split over them (ep2: hash-routed
    and bias-routed layers dispatch across ranks): the same losses and grad norms as one process (1e-5);
    the dp2 step-2 checkpoint continues on one process with the same curve."""
    root, files = sft_assets
    runs = {}
    for ranks, ep in ((1, 1), (2, 1), (2, 2)):
        out = tmp_path / (f"dp{ranks}" if ep == 1 else f"ep{ep}")
        config = out.parent / f"{out.name}.yaml"
        job = dp_job(root, files, out)
        job["parallel"] = {"ep": ep}
        job["cluster"]["gpus_per_node"] = ranks
        config.write_text(yaml.safe_dump(job))
        launcher = (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
                    if ranks > 1 else [])
        done = subprocess.run([sys.executable, *launcher, "-m", "mlite", "sft", str(config), "--no-progress"],
                              cwd=ROOT, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
        runs[ranks, ep] = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    for layout in ((2, 1), (2, 2)):
        assert [r["step"] for r in runs[layout]] == [1, 2, 3, 4]
        for one, two in zip(runs[1, 1], runs[layout]):
            assert two["loss"] == pytest.approx(one["loss"], rel=1e-5), layout
            assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5), layout

    # resume the two-rank run's step 2 on one process: steps 3 and 4 as the uninterrupted run
    resumed = tmp_path / "resumed"
    job = dp_job(root, files, resumed)
    job["trainer"]["resume"] = str(tmp_path / "dp2" / "checkpoints" / "step_00000002")
    config = tmp_path / "resumed.yaml"
    config.write_text(yaml.safe_dump(job))
    done = mlite("sft", str(config), "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    after = [r for r in read_metrics(resumed / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in after] == [3, 4]
    for got, want in zip(after, runs[1, 1][2:]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)

    # a checkpoint that lacks what the job trains (the frozen indexer's optimizer state): one line, exit 2
    job = dp_job(root, files, tmp_path / "mismatch")
    job["model"]["indexer_loss_weight"] = 0.1
    job["trainer"]["resume"] = str(tmp_path / "dp2" / "checkpoints" / "step_00000002")
    config = tmp_path / "mismatch.yaml"
    config.write_text(yaml.safe_dump(job))
    done = mlite("sft", str(config), "--no-progress")
    assert done.returncode == 2 and "does not match this job's model and optimizer" in done.stderr
    assert "Traceback" not in done.stderr


# ------------------------------------------------------------------ the twin of the DeepSeek-V4 templates
# slurm/{sft,grpo}_dsv4_128gpu.sbatch run PP4 x EP8 x CP4 (FSDP2); the twin has the same axes at degree 2:
# the 4 mHC copies (and the MTP's next-token embeddings) travel between stages, experts (hash- and
# bias-routed) dispatch across ep ranks, each cp rank gets its neighbour's boundary rows and every rank's
# compressed entries, and MTP runs on the last stage under cp.
TWIN = {"pp": 2, "ep": 2, "cp": 2}
RESUMED = {"pp": 1, "ep": 1, "cp": 1}  # the twin's step-2 checkpoint continues under dp2
LOSSES = {"mtp_loss_weight": 0.3, "indexer_loss_weight": 0.1}


def run(job: dict, ranks: int, parallel: dict, tmp: Path, resume: Path | None = None):
    job = {**job, "parallel": parallel, "cluster": {**job["cluster"], "gpus_per_node": ranks},
           "trainer": {**job["trainer"], **({"resume": str(resume)} if resume else {})}}
    done = mlite_cli(tmp, job, ranks, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]


def twin_runs(job: dict, tmp_path: Path, key: str):
    """(one process, twin, twin's step 2 resumed under dp2) records of the same 3-step job."""
    results = []
    for name, ranks, parallel, resume in (
            ("one", 1, {}, None), ("twin", 8, TWIN, None),
            ("resumed", 2, RESUMED, tmp_path / "twin" / "checkpoints" / "step_00000002")):
        out = tmp_path / name
        run({**job, "trainer": {**job["trainer"], "output_dir": str(out)}}, ranks, parallel, tmp_path, resume)
        results.append(records(out, key))
    return results


@pytest.mark.slow
def test_sft_twin_of_the_dsv4_template_matches_one_process_and_resumes_under_dp(sft_assets, tmp_path):
    """SFT, MTP and indexer losses on: pp2 x ep2 x cp2 gives the one-process losses and grad norms for 3
    steps (1e-5), and its step-2 checkpoint continues under dp2 with the same step 3."""
    root, files = sft_assets
    job = dp_job(root, files, tmp_path / "unused")
    job["model"] |= LOSSES
    job["trainer"] |= {"steps": 3, "save_every": 2}
    one, twin, resumed = twin_runs(job, tmp_path, "loss")
    assert len(one) == 3
    assert_same_curve(twin, one)
    assert_same_curve(resumed, one[2:])


@pytest.mark.slow
def test_grpo_twin_of_the_dsv4_template_matches_one_process_and_resumes_under_dp(workdir, tmp_path):  # noqa: F811
    """GRPO, MTP and indexer losses on: pp2 x ep2 x cp2 gives every per-step figure of one process
    (rewards of the same samples, log-prob ratios, KL, entropy, grad norm) for 3 steps, and its step-2
    checkpoint continues under dp2."""
    job = yaml.safe_load(write_job(workdir, tmp_path / "unused", model={"name": "tiny-deepseek-v4", **LOSSES},
                                   trainer={"steps": 3, "save_every": 2}).read_text())
    job["optimizer"] |= {"clip_grad": 1.0}
    job["cluster"]["host_memory_gb"] = 64  # the planner splits a node's host memory over its 8 ranks
    # one response per micro-batch: the balance loss pools router statistics per micro-batch, and each dp
    # rank packs its own responses, so only single-response micro-batches are the one process's
    job["data"] |= {"dynamic_batch": False, "micro_batch_size": 1, "max_tokens_per_micro_batch": None}
    one, twin, resumed = twin_runs(job, tmp_path, "reward/mean")
    assert [r["step"] for r in one] == [1, 2, 3]
    assert_same_records(twin, one)
    assert_same_records(resumed, one[2:])
