"""The SFT trainer end to end on generated data: metrics files, exact resume (also after SIGKILL), saving on
SIGTERM/SIGUSR1, refusing a corrupt checkpoint, epochs, held-out evaluation; a GPU run in bf16."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from cli_runs import mlite_cli, one_thread, sft_assets  # noqa: F401 (one_thread: autouse)

from mlite.config import job_from_dict
from mlite.runtime.ckpt.checkpoint import CheckpointManager
from mlite.trainers.metrics import read_metrics
from mlite.trainers.sft import train_sft

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # as in-process (one_thread): same kernels, same bits
# what must be equal between an interrupted-and-resumed run and the uninterrupted one (not timings)
EXACT_KEYS = ("step", "loss", "grad_norm", "lr", "tokens", "target_tokens", "epoch", "skipped_steps")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Demo data, a tokenizer trained on it and a tiny Qwen3 config sized to the tokenizer."""
    return sft_assets(tmp_path_factory.mktemp("sft_assets"), train=320, val=48, seed=1, rows=400)


def job_dict(assets, out: Path, **trainer) -> dict:
    return {
        "job": "sft",
        "model": {"path": assets["model"], "load_weights": False},
        "cluster": {"gpu": "cpu", "gpus_per_node": 1},
        "optimizer": {"lr": 2e-3, "min_lr": 2e-4, "warmup_steps": 3, "weight_decay": 0.01},
        "precision": {"compute": "fp32"},
        "data": {"train_files": [assets["train"]], "tokenizer": assets["tokenizer"], "seq_len": 128,
                 "global_batch_size": 16, "max_tokens_per_micro_batch": 200},
        "trainer": {"steps": 30, "seed": 11, "output_dir": str(out), "save_every": 5, "keep_last": 2,
                    "log_every": 1, "device": "cpu", **trainer},
    }


def exact(records):
    return [{k: r[k] for k in EXACT_KEYS} for r in records if "loss" in r]


def write_job(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def start_sft(config: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mlite", "sft", str(config), "--no-progress"], cwd=ROOT,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_step(proc: subprocess.Popen, metrics: Path, step: int, timeout: float = 120) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        records = read_metrics(metrics) if metrics.is_file() else []
        if records and records[-1]["step"] >= step:
            return records[-1]["step"]
        assert proc.poll() is None, f"trainer exited early:\n{proc.communicate()[1][-3000:]}"
        time.sleep(0.01)
    proc.kill()
    raise AssertionError(f"step {step} not reached in {timeout} s")


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    """The uninterrupted 30-step run every resume is compared with."""
    out = tmp_path_factory.mktemp("reference")
    result = train_sft(job_from_dict(job_dict(assets, out)), show_progress=False)
    return result, exact(read_metrics(result.metrics_path))


def test_sft_writes_metrics_tensorboard_plot_and_checkpoints(reference):
    result, records = reference
    assert [r["step"] for r in records] == list(range(1, 31))
    losses = [r["loss"] for r in records]
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses  # it learns
    assert records[0]["lr"] == pytest.approx(2e-3 / 3) and records[-1]["lr"] == pytest.approx(2e-4)
    raw = read_metrics(result.metrics_path)[0]
    assert raw["tokens_per_s"] > 0 and raw["tokens"] >= raw["target_tokens"] > 0
    assert result.tokens_per_s > 0 and result.last_step == 30
    # every step's own time, the save steps' (every 5th, read at once after the step before) included:
    # timed from the reads, those took almost nothing and their tokens/s dominated the run's mean speed
    times = sorted(r["step_time_s"] for r in read_metrics(result.metrics_path) if "step_time_s" in r)
    assert len(times) == 30 and times[0] > 0.2 * times[len(times) // 2], times

    assert result.plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result.plot_path.stat().st_size > 5000
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(result.output_dir / "tensorboard")).Reload()
    scalars = events.Scalars("loss")
    assert [s.step for s in scalars] == list(range(1, 31))
    assert [s.value for s in scalars] == pytest.approx(losses, rel=1e-6)

    manager = CheckpointManager(result.output_dir, keep_last=2)
    assert manager.steps() == [30, 25] and result.checkpoint == manager.path_for(30)
    assert result.data_report["train"]["used"] == 320


def test_resume_from_a_given_checkpoint_equals_the_uninterrupted_run_bitwise(assets, reference, tmp_path):
    result, records = reference
    mid = CheckpointManager(result.output_dir).path_for(25)
    resumed = train_sft(job_from_dict(job_dict(assets, tmp_path / "run", resume=str(mid))),
                        show_progress=False)
    assert resumed.start_step == 25 and resumed.last_step == 30
    assert exact(read_metrics(resumed.metrics_path)) == records[25:]


def test_sigkill_mid_run_then_auto_resume_equals_uninterrupted(assets, reference, tmp_path):
    out = tmp_path / "killed"
    config = write_job(tmp_path / "job.yaml", job_dict(assets, out))
    proc = start_sft(config)
    killed_at = wait_for_step(proc, out / "metrics.jsonl", 12)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    saved = CheckpointManager(out).steps()
    assert saved and saved[0] <= killed_at < 30, (saved, killed_at)

    done = subprocess.run([sys.executable, "-m", "mlite", "sft", str(config), "--no-progress"], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {CheckpointManager(out).path_for(saved[0])} at step {saved[0]}" in done.stderr
    assert exact(read_metrics(out / "metrics.jsonl")) == reference[1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_preemption_signal_saves_at_the_next_step_and_exits_cleanly(assets, reference, tmp_path, sig):
    out = tmp_path / "preempted"
    config = write_job(tmp_path / "job.yaml", job_dict(assets, out, save_every=0))
    proc = start_sft(config)
    wait_for_step(proc, out / "metrics.jsonl", 3)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    last = read_metrics(out / "metrics.jsonl")[-1]["step"]
    assert 3 <= last < 30
    assert f"stopped by {sig.name} after step {last}/30" in stderr
    assert CheckpointManager(out).steps() == [last]  # save_every=0: the signal's checkpoint only
    assert not (out / "loss.png").exists()  # the run is not over

    resumed = train_sft(job_from_dict(job_dict(assets, out, save_every=0)), show_progress=False)
    assert resumed.start_step == last and resumed.last_step == 30
    assert exact(read_metrics(out / "metrics.jsonl")) == reference[1]


def test_a_corrupt_checkpoint_given_to_resume_is_one_line_exit_2(assets, reference, tmp_path):
    result, _ = reference
    bad = tmp_path / "bad"
    import shutil

    shutil.copytree(result.checkpoint, bad)
    shard = next((bad / "tensors").glob("*.distcp"))
    os.truncate(shard, shard.stat().st_size - 1)
    config = write_job(tmp_path / "job.yaml", job_dict(assets, tmp_path / "out", resume=str(bad)))
    done = subprocess.run([sys.executable, "-m", "mlite", "sft", str(config)], cwd=ROOT, env=ENV,
                          capture_output=True, check=False, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(f"mlite sft: error: checkpoint {bad} is corrupt")
    assert "Traceback" not in done.stderr


def test_auto_resume_falls_back_past_a_truncated_newest_checkpoint(assets, reference, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(reference[0].output_dir, out)  # checkpoints 25 and 30 of the finished reference run
    manager = CheckpointManager(out)
    shard = next((manager.path_for(30) / "tensors").glob("*.distcp"))
    os.truncate(shard, 100)
    resumed = train_sft(job_from_dict(job_dict(assets, out)), show_progress=False)
    assert resumed.start_step == 25 and resumed.last_step == 30
    assert exact(read_metrics(out / "metrics.jsonl")) == reference[1]
    assert manager.steps() == [30, 25]  # the broken 30 was replaced by a good one
    assert manager.latest_good() == manager.path_for(30)


def test_a_run_resumed_at_its_last_step_reports_the_runs_speed(assets, reference, tmp_path):
    """A finished run started again (resume=auto) trains nothing, and its summary still gives the run's
    tokens/s (from the metrics of the whole run), not "0 tokens/s"."""
    import shutil

    from mlite.trainers.loop import summary_lines

    out = tmp_path / "run"
    shutil.copytree(reference[0].output_dir, out)
    again = train_sft(job_from_dict(job_dict(assets, out)), show_progress=False)
    assert again.start_step == again.last_step == 30
    logged = [r["tokens_per_s"] for r in read_metrics(out / "metrics.jsonl") if "tokens_per_s" in r]
    assert again.tokens_per_s == pytest.approx(sum(logged) / len(logged)) and again.tokens_per_s > 0
    speed = [line for line in summary_lines(again, []) if line.startswith("speed")]
    assert speed == [f"speed       {again.tokens_per_s:,.0f} tokens/s"]
    assert not speed[0].startswith("speed       0 ")


def test_resume_never_refuses_to_mix_with_an_earlier_run(assets, reference, tmp_path):
    from mlite.errors import MliteError

    with pytest.raises(MliteError,
                       match="trainer.resume is never but .* holds checkpoints of an earlier run"):
        train_sft(job_from_dict(job_dict(assets, reference[0].output_dir, resume="never")),
                  show_progress=False)


def test_epochs_cap_the_steps_and_eval_logs_held_out_loss(assets, tmp_path):
    job = job_dict(assets, tmp_path / "run", steps=100, epochs=1, eval_every=10, tensorboard=False)
    job["data"]["val_files"] = [assets["val"]]
    result = train_sft(job_from_dict(job), show_progress=False)
    assert result.total_steps == result.last_step == 320 // 16
    evals = [r for r in read_metrics(result.metrics_path) if "val_loss" in r]
    assert [r["step"] for r in evals] == [10, 20]
    assert evals[1]["val_loss"] < evals[0]["val_loss"] < 6.0
    assert not (tmp_path / "run" / "tensorboard").exists()  # trainer.tensorboard: false


@pytest.mark.gpu
def test_sft_on_cuda_in_bf16_learns_and_resumes(assets, tmp_path):
    out = tmp_path / "gpu"
    job = job_dict(assets, out, steps=30, device="cuda")
    job["cluster"]["gpu"] = "h100"
    job["precision"]["compute"] = "bf16"
    full = train_sft(job_from_dict(job), show_progress=False)
    assert (full.stopped_by, full.last_step, full.total_steps) == (None, 30, 30)
    from mlite.runtime.engine import Runtime

    rt = Runtime(job_from_dict(job))
    assert rt.autocast_dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 and p.is_cuda for p in rt.model.parameters())  # fp32 master weights
    losses = full.losses
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses
    # each step timed by CUDA events around its own work (mlite.trainers.loop.StepClock), saves included
    times = sorted(r["step_time_s"] for r in read_metrics(full.metrics_path) if "step_time_s" in r)
    assert len(times) == 30 and times[0] > 0.2 * times[len(times) // 2], times

    mid = CheckpointManager(out).path_for(25)
    resumed = train_sft(job_from_dict({**job, "trainer": {**job["trainer"], "output_dir": str(tmp_path / "r"),
                                                             "resume": str(mid)}}), show_progress=False)
    assert resumed.start_step == 25
    tail = exact(read_metrics(resumed.metrics_path))
    ref = exact(read_metrics(full.metrics_path))[25:]
    # GPU kernels need not be bitwise reproducible: same steps, same lrs, losses within bf16 noise
    assert [r["step"] for r in tail] == [r["step"] for r in ref]
    assert [r["loss"] for r in tail] == pytest.approx([r["loss"] for r in ref], rel=2e-2)


def test_two_data_parallel_ranks_match_one_process(assets, reference, tmp_path):
    """torchrun with 2 gloo ranks: each trains on half of every global batch; the summed gradients make the
    same steps as the one-process reference (to float rounding: the sums run in another order)."""
    out = tmp_path / "dp2"
    done = mlite_cli(tmp_path, job_dict(assets, out), 2)
    assert done.returncode == 0, done.stderr[-3000:]
    records = exact(read_metrics(out / "metrics.jsonl"))
    assert [r["step"] for r in records] == list(range(1, 31))  # one writer (rank 0), every step
    for ours, ref in zip(records, reference[1]):
        assert ((ours["tokens"], ours["target_tokens"], ours["lr"])
                == (ref["tokens"], ref["target_tokens"], ref["lr"]))
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-4), ours["step"]
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3), ours["step"]
    assert CheckpointManager(out).steps() == [30, 25]


def test_a_one_process_checkpoint_resumes_on_two_ranks(assets, reference, tmp_path):
    """Checkpoints are layout-independent: step 25 of the one-process run continues data parallel."""
    mid = CheckpointManager(reference[0].output_dir).path_for(25)
    out = tmp_path / "dp2"
    done = mlite_cli(tmp_path, job_dict(assets, out, resume=str(mid)), 2)
    assert done.returncode == 0, done.stderr[-3000:]
    records = exact(read_metrics(out / "metrics.jsonl"))
    assert [r["step"] for r in records] == [26, 27, 28, 29, 30]
    for ours, ref in zip(records, reference[1][25:]):
        assert (ours["tokens"], ours["lr"]) == (ref["tokens"], ref["lr"])
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-5), ours["step"]


def test_fp8_optimizer_state_learns_like_master_state_and_resumes_bitwise(assets, reference, tmp_path):
    """precision.optimizer_state: fp8 through the trainer: the loss curve follows the master-state run's,
    and a resume from its step-25 checkpoint (moments saved decoded, encoded again on load; the stochastic
    rounding's stream a function of the step) equals its uninterrupted run bitwise."""
    data = job_dict(assets, tmp_path / "fp8")
    data["precision"]["optimizer_state"] = "fp8"
    full = train_sft(job_from_dict(data), show_progress=False)
    records = exact(read_metrics(full.metrics_path))
    master = [r["loss"] for r in reference[1]]
    losses = [r["loss"] for r in records]
    assert losses[0] == master[0]
    assert sum(losses[-5:]) / 5 == pytest.approx(sum(master[-5:]) / 5, rel=0.1)
    assert losses != master  # the state's rounding moved it

    mid = CheckpointManager(full.output_dir).path_for(25)
    resumed_data = job_dict(assets, tmp_path / "resumed", resume=str(mid))
    resumed_data["precision"]["optimizer_state"] = "fp8"
    resumed = train_sft(job_from_dict(resumed_data), show_progress=False)
    assert resumed.start_step == 25
    assert exact(read_metrics(resumed.metrics_path)) == records[25:]
