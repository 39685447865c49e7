"""`mlite grpo` end to end in a subprocess: planner first, metrics/plots/checkpoints, held-out eval,
resume equal to the uninterrupted run, one-line errors with exit 2."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_runs import stable, write_model_config
from grpo_helpers import char_tokenizer, grpo_job_dict

from mlite.trainers.metrics import read_metrics

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_cli")
    char_tokenizer(root / "tok")
    rows = [{"prompt": f"say {d}", "answer": str(d)} for d in range(10)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    return root


def write_job(workdir: Path, out: Path, **changes) -> Path:
    """grpo_helpers' tiny job on the workdir's prompts, with held-out eval and checkpoints every 2 steps, as
    the YAML file next to `out`; `changes` update its sections key by key."""
    job = grpo_job_dict(
        out,
        data={"train_files": [str(workdir / "train.jsonl")], "val_files": [str(workdir / "val.jsonl")],
              "tokenizer": str(workdir / "tok")},
        trainer={"save_every": 2, "keep_last": 3, "seed": 5},
        grpo={"mini_batches": 2},
    )
    for section, values in changes.items():
        job[section] = {**job.get(section, {}), **values}
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def mlite_grpo(config: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "mlite", "grpo", str(config), "--no-progress", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_run_writes_metrics_plots_checkpoints_and_resumes_exactly(workdir, tmp_path):
    out = tmp_path / "full"
    result = mlite_grpo(write_job(workdir, out))
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]  # 0: held-out eval before training
    for key in (
        "reward/mean",
        "reward/std",
        "response/length_mean",
        "actor/clip_frac",
        "actor/entropy",
        "actor/grad_norm",
        "actor/ppo_kl",
        "actor/pg_loss",
    ):
        assert all(key in r for r in records[1:]), key
    assert "eval/reward_mean" in records[0] and "eval/reward_mean" in records[-1]
    assert (out / "grpo.png").stat().st_size > 1000 and any((out / "tensorboard").iterdir())
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000004"]
    assert "held-out reward (greedy)" in result.stderr

    # the same run interrupted after step 2 (its later checkpoint and records never written) and resumed
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000004")
    result = mlite_grpo(write_job(workdir, resumed))
    assert result.returncode == 0, result.stderr[-3000:]
    assert stable(read_metrics(resumed / "metrics.jsonl")) == stable(records)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"grpo": {"reward": "no_such_module_q:fn"}}, "cannot import module 'no_such_module_q'"),
        ({"rollout": {"max_response_length": 60}}, "exceeds data.seq_len"),
        # vLLM generates on GPUs: on the CPU the rule book refuses it (on a GPU without vllm: require_vllm)
        ({"rollout": {"engine": "vllm"}}, "rollout.engine vllm generates on CUDA GPUs"),
        ({"data": {"train_files": ["/nonexistent/prompts.jsonl"]}}, "prompt file not found"),
    ],
)
def test_bad_jobs_fail_with_one_line_and_exit_2(workdir, tmp_path, changes, message):
    result = mlite_grpo(write_job(workdir, tmp_path / "bad", **changes))
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.stderr, result.stderr[-2000:]


def test_prompts_beyond_the_models_vocabulary_are_one_line_before_the_model_is_built(workdir, tmp_path):
    """A model whose vocabulary is smaller than the tokenizer's: the prompts' token ids are checked at
    start-up, so the run stops in one line naming both sizes, not with an index error in the embedding."""
    small = write_model_config(tmp_path / "small", vocab_size=32, moe=False, tied=True)
    result = mlite_grpo(write_job(workdir, tmp_path / "bad",
                                  model={"name": None, "path": str(small), "load_weights": False}))
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "data.train_files: token id" in lines[0] and "vocabulary of 32" in lines[0], lines[0]
    assert not (tmp_path / "bad" / "checkpoints").exists()


TWO_RANKS = """
import os
import sys
import torch.distributed as dist
from mlite.config import load_job
from mlite.trainers.grpo.trainer import train_grpo

result = train_grpo(load_job(sys.argv[1]), show_progress=False)
# one write per line: under PYTHONUNBUFFERED, print() writes the text and its newline separately, and the
# two ranks share one pipe
sys.stdout.write(f"rank {os.environ['RANK']}: group still up={dist.is_initialized()} "
                 f"summary lines={len(result.summary)} last step={result.last_step}/{result.total_steps}\\n")
sys.stdout.flush()
"""


def test_two_ranks_share_the_sft_loop_epochs_close_and_one_summary(workdir, tmp_path):
    """GRPO runs the one training loop: trainer.epochs caps the steps (10 prompts, 2 per step: 5 steps per
    epoch, though trainer.steps asks 100), the runtime ends the process group it started, and only the
    output rank has a summary to print."""
    config = write_job(workdir, tmp_path / "run", trainer={"steps": 100, "epochs": 1, "save_every": 0},
                       cluster={"gpus_per_node": 2})
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(script), str(config)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = r"rank \d: group still up=\w+ summary lines=\d+ last step=\d+/\d+"
    lines = sorted(re.findall(line, done.stdout))
    assert len(lines) == 2 and all("group still up=False" in line and "last step=5/5" in line
                                   for line in lines)
    assert "summary lines=0" not in lines[0] and "summary lines=0" in lines[1], lines  # rank 0 prints, 1 not
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")
            if "reward/mean" in r] == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")) == ["step_00000005"]


def test_sft_runs_the_planner_before_starting(workdir, tmp_path):
    """`mlite sft`, like `mlite grpo`, asks the planner first: a job that cannot fit stops in one line."""
    config = tmp_path / "sft.yaml"
    config.write_text(yaml.safe_dump({
        "job": "sft", "model": {"name": "tiny-qwen3"},
        "cluster": {"gpu": "h100", "gpus_per_node": 1, "gpu_memory_gb": 0.5},
        "data": {"train_files": [str(workdir / "train.jsonl")], "tokenizer": str(workdir / "tok"),
                 "seq_len": 64},
        "trainer": {"device": "cpu", "steps": 1, "output_dir": str(tmp_path / "sft")},
    }))
    done = subprocess.run([sys.executable, "-m", "mlite", "sft", str(config), "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        "mlite sft: error: the job needs 1.5 GB per GPU, over the usable 0.5 GB; "
        "see `mlite plan CONFIG --recommend`"]
    assert not (tmp_path / "sft").exists()  # stopped before any output
