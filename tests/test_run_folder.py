"""Nothing a run holds is lost: the demo deletes only what it made, resume and rotation follow the run's
lineage (a rollback, a corrupt newest checkpoint, all of them corrupt), one job at a time holds an output
folder (two real processes; a requeue of the same Slurm job gets in), the metrics file is never cut and
survives a torn last line, a full disk leaves nothing that blocks the next start, and non-finite numbers
stop a run in one line without a bad checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from cli_runs import ONE_LAYER, one_thread, sft_assets  # noqa: F401 (one_thread: autouse)

from mlite.config import job_from_dict
from mlite.errors import MliteError
from mlite.runtime.ckpt.checkpoint import CheckpointManager, verify_checkpoint
from mlite.trainers.metrics import SUPERSEDED_FILE, read_metrics
from mlite.trainers.sft import train_sft

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
EXACT = ("step", "loss", "grad_norm", "lr", "tokens", "target_tokens")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Demo data, a tokenizer trained on it and a one-layer Qwen3 sized to it: a step takes milliseconds."""
    return sft_assets(tmp_path_factory.mktemp("run_folder_assets"), train=64, val=8, seed=1, rows=200,
                      **ONE_LAYER)


def job_dict(assets, out: Path, **trainer) -> dict:
    return {
        "job": "sft",
        "model": {"path": assets["model"], "load_weights": False},
        "cluster": {"gpu": "cpu", "gpus_per_node": 1},
        "optimizer": {"lr": 1e-3},
        "precision": {"compute": "fp32"},
        "data": {"train_files": [assets["train"]], "tokenizer": assets["tokenizer"], "seq_len": 128,
                 "global_batch_size": 4, "max_tokens_per_micro_batch": 200},
        "trainer": {"steps": 10, "seed": 3, "output_dir": str(out), "save_every": 5, "keep_last": 2,
                    "device": "cpu", "tensorboard": False, **trainer},
    }


def sft(assets, out: Path, **trainer):
    return train_sft(job_from_dict(job_dict(assets, out, **trainer)), show_progress=False)


def exact(out: Path) -> list[dict]:
    return [{k: r[k] for k in EXACT} for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def corrupt(checkpoint: Path) -> None:
    shard = next((checkpoint / "tensors").glob("*.distcp"))
    os.truncate(shard, shard.stat().st_size - 1)


def cli(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlite", *args], cwd=ROOT, env=env or ENV,
                          capture_output=True, text=True, timeout=timeout, check=False)


def write_job(path: Path, job: dict) -> Path:
    path.write_text(yaml.safe_dump(job))
    return path


def one_line_exit_2(done: subprocess.CompletedProcess, command: str) -> str:
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"mlite {command}: error: "), done.stderr[-3000:]
    return last


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    """The uninterrupted 10-step run (checkpoints at 5 and 10)."""
    out = tmp_path_factory.mktemp("reference")
    sft(assets, out)
    return out


# ------------------------------------------------------------------------------------------- the demo
def test_the_demo_refuses_a_folder_it_did_not_make_and_deletes_nothing(tmp_path):
    mine = tmp_path / "X"
    mine.mkdir()
    (mine / "notes.md").write_text("mine")
    done = cli("demo", "--out", str(tmp_path / "D"), "--no-grpo", "--no-progress",
               "--set", f"trainer.output_dir={mine}", "--set", "trainer.steps=1")
    line = one_line_exit_2(done, "demo")
    assert f"{mine} is not empty and was not made by `mlite demo`" in line
    assert sorted(os.listdir(mine)) == ["notes.md"] and (mine / "notes.md").read_text() == "mine"

    home = tmp_path / "home"  # what `--out ~` or `--out .` is: a folder with the user's files in it
    (home / "project").mkdir(parents=True)
    (home / ".bashrc").write_text("export X=1\n")
    done = cli("demo", "--out", str(home), "--no-grpo", "--no-progress", "--set", "trainer.steps=1")
    assert f"{home} is not empty and was not made by `mlite demo`" in one_line_exit_2(done, "demo")
    assert sorted(os.listdir(home)) == [".bashrc", "project"]


def test_the_demo_starts_over_in_its_own_folder_and_keeps_what_others_put_there(tmp_path):
    out = tmp_path / "demo"
    args = ["demo", "--out", str(out), "--no-grpo", "--no-progress", "--set", "trainer.steps=1"]
    first = cli(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    (out / "notes.md").write_text("kept")
    (out / "sft" / "my_eval.txt").write_text("kept too")
    again = cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "notes.md").read_text() == "kept"
    assert (out / "sft" / "my_eval.txt").read_text() == "kept too"
    # started over: one step logged, not a resume of the first run
    assert [r["step"] for r in read_metrics(out / "sft" / "metrics.jsonl")] == [1]
    assert "resumed from" not in again.stderr


# ------------------------------------------------------------------------------------------ lineage
def test_auto_resume_after_a_rollback_follows_the_new_lineage_not_the_abandoned_steps(assets, reference,
                                                                                          tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference, out)  # checkpoints 5 and 10
    manager = CheckpointManager(out)
    step5 = manager.path_for(5)
    rolled = sft(assets, out, resume=str(step5), steps=8, save_every=1, keep_last=3)
    assert rolled.start_step == 5 and rolled.checkpoint == manager.path_for(8)
    again = sft(assets, out, steps=8, keep_last=3)  # resume: auto
    assert again.start_step == 8, "auto-resume jumped to the abandoned step 10"
    assert manager.lineage()[-1] == manager.path_for(8).name
    verify_checkpoint(manager.path_for(10))  # the abandoned checkpoint is left as it was, not deleted


def test_keep_last_1_after_a_corrupt_newest_keeps_the_new_checkpoints(assets, reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    manager = CheckpointManager(out)
    corrupt(manager.path_for(10))
    result = sft(assets, out, steps=8, save_every=1, keep_last=1)
    assert result.start_step == 5 and result.checkpoint == manager.path_for(8)
    verify_checkpoint(result.checkpoint)  # the summary's checkpoint exists and is whole
    verify_checkpoint(manager.path_for(5))  # the one it resumed from is kept while it runs
    assert manager.lineage() == [manager.path_for(5).name, manager.path_for(8).name]
    assert not manager.path_for(6).exists() and not manager.path_for(7).exists()
    # under repeated preemption the job advances: the next start resumes from 8, and rotation moves on
    assert sft(assets, out, steps=9, save_every=1, keep_last=1).start_step == 8
    assert manager.lineage() == [manager.path_for(8).name, manager.path_for(9).name]
    assert not manager.path_for(5).exists()


def test_when_every_checkpoint_is_corrupt_the_run_refuses_and_keeps_its_metrics(assets, reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    manager = CheckpointManager(out)
    for step in (5, 10):
        corrupt(manager.path_for(step))
    before = (out / "metrics.jsonl").read_bytes()
    config = write_job(tmp_path / "job.yaml", job_dict(assets, out))
    line = one_line_exit_2(cli("sft", str(config), "--no-progress"), "sft")
    assert "every checkpoint of the run" in line and "trainer.resume=PATH" in line
    assert "new trainer.output_dir" in line
    assert (out / "metrics.jsonl").read_bytes() == before


def test_a_resume_moves_later_records_aside_and_repairs_a_torn_last_line(assets, reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    manager = CheckpointManager(out)
    corrupt(manager.path_for(10))  # resume from 5: records 6-10 are past it
    later = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][5:]
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 11, "loss": 2.3')  # the process died mid-write
    result = sft(assets, out)
    assert result.start_step == 5
    assert exact(out) == exact(reference)  # the file reads as the uninterrupted run
    superseded = (out / SUPERSEDED_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in superseded[:-1]] == [r["step"] for r in later]
    assert superseded[-1] == '{"step": 11, "loss": 2.3'


# ---------------------------------------------------------------------------------------------- lock
def start(config: Path, env: dict | None = None, ranks: int = 1) -> subprocess.Popen:
    launcher = (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
                if ranks > 1 else [])
    return subprocess.Popen([sys.executable, *launcher, "-m", "mlite", "sft", str(config), "--no-progress"],
                            cwd=ROOT, env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def wait_for_a_step(proc: subprocess.Popen, out: Path, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (out / "metrics.jsonl").is_file() and read_metrics(out / "metrics.jsonl"):
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    raise AssertionError("no step logged")


def kill(proc: subprocess.Popen, config: Path) -> None:
    """kill -9 the run: the launcher and every rank (torchrun's ranks are in sessions of their own)."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(config).encode() in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass  # gone already
    proc.wait(timeout=30)


def test_a_second_run_into_a_locked_folder_is_refused_naming_the_holder(assets, tmp_path):
    out = tmp_path / "run"
    config = write_job(tmp_path / "job.yaml", job_dict(assets, out, steps=100000, save_every=0))
    first = start(config, ranks=2)  # two gloo ranks: the job, not one process, holds the folder
    try:
        wait_for_a_step(first, out)
        holder = json.loads((out / ".lock").read_text())
        second = cli("sft", str(config), "--no-progress")
        line = one_line_exit_2(second, "sft")
        assert f"trainer.output_dir {out} is in use by another run (pid {holder['pid']} on" in line
        assert first.poll() is None  # the holder runs on, its files untouched
    finally:
        kill(first, config)
    # killed: the lock went with it, and a new run gets in at once
    after = cli("sft", str(config), "--no-progress", "--set", "trainer.steps=1")
    assert after.returncode == 0, after.stderr[-3000:]


def test_a_requeued_slurm_job_gets_its_folder_back(assets, tmp_path):
    out = tmp_path / "run"
    config = write_job(tmp_path / "job.yaml", job_dict(assets, out, steps=100000, save_every=20))
    env = {**ENV, "SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0"}
    first = start(config, env)
    wait_for_a_step(first, out)
    while not CheckpointManager(out).steps():
        time.sleep(0.05)
    kill(first, config)  # the node went down: no clean exit, the lock file stays behind
    assert json.loads((out / ".lock").read_text())["slurm_job"] == "4242"
    requeued = cli("sft", str(config), "--no-progress", "--set", "trainer.steps=25",
                   env={**env, "SLURM_RESTART_COUNT": "1"})
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    assert "resumed from" in requeued.stderr


# --------------------------------------------------------------------------------- the output folder
def test_an_output_folder_that_is_a_file_is_one_line(assets, tmp_path):
    path = tmp_path / "out"
    path.write_text("not a folder")
    config = write_job(tmp_path / "job.yaml", job_dict(assets, path))
    line = one_line_exit_2(cli("sft", str(config), "--no-progress"), "sft")
    assert f"trainer.output_dir {path} is a file" in line and path.read_text() == "not a folder"


@pytest.fixture
def small_disk(tmp_path):
    """A real filesystem of 160 KiB (tmpfs), remountable: what a full disk is. Needs root (CI has it)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(mount)],
                          capture_output=True, text=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip()}): the full-disk test needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_an_output_folder_that_cannot_be_written_is_one_line(assets, tmp_path, small_disk):
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)  # root writes anywhere else
    config = write_job(tmp_path / "job.yaml", job_dict(assets, small_disk / "run"))
    line = one_line_exit_2(cli("sft", str(config), "--no-progress"), "sft")
    assert f"cannot create trainer.output_dir {small_disk / 'run'}" in line


def test_a_full_disk_is_one_line_and_the_next_start_goes_on(assets, tmp_path, small_disk):
    out = small_disk / "run"
    config = write_job(tmp_path / "job.yaml", job_dict(assets, out))
    line = one_line_exit_2(cli("sft", str(config), "--no-progress"), "sft")
    assert "no space left on the device writing checkpoint" in line
    assert not list((out / "checkpoints").glob("*.partial"))  # what the failed save held is freed
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)  # space made
    done = cli("sft", str(config), "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    assert CheckpointManager(out).steps() == [10, 5]


def test_a_stale_partial_checkpoint_is_cleaned_at_start(assets, reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    stale = out / "checkpoints" / "step_00000015.partial"
    (stale / "tensors").mkdir(parents=True)
    (stale / "tensors" / "__0_0.distcp").write_bytes(b"\0" * 4096)  # a killed save's leftovers
    sft(assets, out, steps=10)
    assert not stale.exists()


# --------------------------------------------------------------------------------- non-finite numbers
def test_non_finite_gradients_stop_the_run_in_one_line_and_no_bad_checkpoint_is_written(assets, tmp_path):
    out = tmp_path / "run"
    job = job_dict(assets, out, steps=40, save_every=0, max_skipped_steps=3)
    job["optimizer"]["lr"] = 1e30  # finite, and the first update sends the activations to inf
    line = one_line_exit_2(cli("sft", str(write_job(tmp_path / "job.yaml", job)), "--no-progress"), "sft")
    assert "3 steps in a row (2-4) had non-finite gradients" in line and "max_skipped_steps=3" in line
    assert CheckpointManager(out).steps() == []
    # strict JSON (no NaN or Infinity): a non-finite figure is null
    records = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl"))
               for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in records] == [0, 1, 2, 3]
    assert records[1]["grad_norm"] is None


def test_weights_that_are_not_finite_are_never_saved(assets, tmp_path):
    job = job_from_dict(job_dict(assets, tmp_path / "run", steps=2, save_every=1))
    from mlite.runtime.engine import Runtime
    from mlite.trainers import loop
    from mlite.trainers.sft import SFTTrainer

    runtime = Runtime(job)
    trainer = SFTTrainer(job, runtime)
    with torch.no_grad():
        next(runtime.model.parameters()).view(-1)[0] = float("nan")  # as a bad update would leave them
    with pytest.raises(MliteError, match="the weights hold NaN or inf after step 1, so no checkpoint"):
        loop.run(job, runtime, trainer, show_progress=False)
    assert CheckpointManager(tmp_path / "run").steps() == []
