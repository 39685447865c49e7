"""The Slurm templates on a real two-node Slurm cluster (Debian's slurmctld + slurmd n1, n2 on this machine),
submitted with the real sbatch, CPU profile: the demo's tiny model and data, one gloo rank per node, the
current venv (CONTAINER=none).

- a 2-node SFT job trains with both nodes, checkpoints, and matches the one-process run step by step;
- a job signalled for preemption checkpoints, requeues itself and continues with the same losses;
- a job whose second node dies mid-run fails within a minute, naming that node;
- a 2-node Ray cluster comes up (both nodes seen) and runs mlite's GRPO through it;
- the DeepSeek-V4 GRPO template itself (slurm/grpo_dsv4_128gpu.sbatch), its knobs selecting a tiny DeepSeek-V4
  and a two-rank layout, trains, and a preempted run checkpoints, requeues and continues with the losses of
  the uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_fixtures import job_state, local_cluster, submit, wait_for

TESTS = Path(__file__).parent

pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm")]


@pytest.fixture(scope="session")
def slurm_cluster():
    yield from local_cluster()


STEPS = 24


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo's generated data, tokenizer and tiny model config (what `mlite demo` trains on)."""
    out = tmp_path_factory.mktemp("slurm_demo")
    done = subprocess.run(
        [sys.executable, "-m", "mlite", "demo", "--out", str(out), "--prepare-only", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return out


def sft_knobs(demo: Path, output_root: Path, steps: int = STEPS) -> dict[str, str]:
    return {
        "CONFIG": "demo_sft",
        "MODEL_PATH": str(demo / "model"),
        "TOKENIZER": str(demo / "tokenizer"),
        "TRAIN_FILES": str(demo / "data" / "train.parquet"),
        "VAL_FILES": str(demo / "data" / "val.parquet"),
        "EXTRA_OVERRIDES": "model.load_weights=false trainer.log_every=1",
        "DEVICE": "cpu",
        "GPUS_PER_NODE": "1",
        "STEPS": str(steps),
        "OUTPUT_ROOT": str(output_root),
    }


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run_dir) if "loss" in r}


def batch_log(folder: Path, job_id: str) -> str:
    path = folder / f"batch-{job_id}.out"
    return path.read_text() if path.is_file() else "(no batch log yet)"


def submit_to(folder: Path, template: str, knobs: dict[str, str], name: str) -> str:
    """sbatch on both nodes; the batch log goes to folder/batch-JOBID.out."""
    return submit(template, knobs, "--nodes=2", f"--job-name={name}", f"--output={folder}/batch-%j.out")


@pytest.fixture(scope="module")
def sft_run(slurm_cluster, demo, tmp_path_factory):
    """One uninterrupted 2-node SFT job: the reference for the tests below."""
    out = tmp_path_factory.mktemp("slurm_sft")
    job = submit_to(out, "sft", sft_knobs(demo, out), "t-sft")
    state = wait_for(job, timeout=300)
    return job, state, out / f"t-sft-{job}", batch_log(out, job)


def test_local_cluster_runs_one_task_on_each_node(slurm_cluster, tmp_path):
    out = tmp_path / "hello.out"
    done = subprocess.run(
        [
            "sbatch",
            "--wait",
            "--nodes=2",
            f"--output={out}",
            "--wrap",
            "srun --ntasks-per-node=1 bash -c 'echo $SLURMD_NODENAME $SLURM_NODEID'",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(out.read_text().split("\n")[:2]) == ["n1 0", "n2 1"]


def test_two_node_sft_trains_and_checkpoints_with_both_nodes(sft_run):
    job, state, run_dir, log = sft_run
    assert state["JobState"] == "COMPLETED", log[-3000:]
    logs = run_dir / "logs" / f"job-{job}-restart-0"
    for node, rank in (("n1", 0), ("n2", 1)):
        assert (logs / f"node-{node}.exit").read_text().split()[0] == "0"
        text = (logs / f"node-{node}.log").read_text()
        assert f"{node} node rank {rank} of 2" in text
        assert f"--nnodes 2 --node-rank {rank}" in (logs / f"command.node{rank}.sh").read_text()
    assert (logs / "plan.txt").read_text().rstrip().splitlines()[-1].startswith("FITS")
    final = run_dir / "checkpoints" / f"step_{STEPS:08d}"
    # one world of two ranks, one per node: each rank saved its own state into the same checkpoint
    assert sorted(p.name for p in final.glob("rank_*.pt")) == ["rank_00000.pt", "rank_00001.pt"]
    loss = losses(run_dir)
    assert sorted(loss) == list(range(1, STEPS + 1))
    assert loss[STEPS] < loss[1] - 0.5, loss
    assert "finished on all 2 nodes" in log


def test_two_nodes_match_the_one_process_run(sft_run, demo, tmp_path):
    """Data parallel over two nodes is the same training as one process with the whole batch."""
    _, state, run_dir, _ = sft_run
    assert state["JobState"] == "COMPLETED"
    knobs = sft_knobs(demo, tmp_path)
    sets = [
        "model.name=null",
        f"model.path={knobs['MODEL_PATH']}",
        f"data.tokenizer={knobs['TOKENIZER']}",
        f"data.train_files=[{knobs['TRAIN_FILES']}]",
        f"data.val_files=[{knobs['VAL_FILES']}]",
        "model.load_weights=false",
        "trainer.log_every=1",
        "trainer.device=cpu",
        f"trainer.steps={STEPS}",
        f"trainer.output_dir={tmp_path / 'one'}",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "mlite", "sft", "demo_sft", "--no-progress", *[f"--set={s}" for s in sets]],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = losses(tmp_path / "one"), losses(run_dir)
    assert sorted(one) == sorted(two)
    for step in one:
        assert math.isclose(one[step], two[step], rel_tol=1e-4), (step, one[step], two[step])


def preempt(tmp_path: Path, job: str, run_dir: Path, started, steps: int, timeout: int) -> int:
    """Once `started()` (training is under way), do what Slurm does at the templates' --signal=B:USR1@600
    (SIGUSR1 to the batch shell), and wait for the requeued job to complete its `steps`. Returns the step
    the preemption checkpointed."""
    deadline = time.monotonic() + 180
    while not started():
        assert time.monotonic() < deadline and job_state(job).get("JobState") in ("PENDING", "RUNNING"), (
            batch_log(tmp_path, job)[-3000:]
        )
        time.sleep(0.2)
    signalled = subprocess.run(
        ["scancel", "--signal=USR1", "--batch", job], capture_output=True, text=True, check=False
    )
    assert signalled.returncode == 0, signalled.stderr
    state = wait_for(job, timeout=timeout)  # a requeued job goes back to PENDING, never to a final state
    log = batch_log(tmp_path, job)
    assert state["JobState"] == "COMPLETED" and int(state.get("Restarts", 0)) == 1, log[-3000:]
    assert "SIGUSR1: preemption notice" in log and f"requeueing job {job}" in log
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert saved[-1] == f"step_{steps:08d}" and len(saved) >= 2  # the preemption's checkpoint, then the end
    return int(saved[-2].split("_")[1])


def test_preempted_job_checkpoints_requeues_and_continues_with_the_same_losses(sft_run, demo, tmp_path):
    _, state0, reference, _ = sft_run
    assert state0["JobState"] == "COMPLETED"
    job = submit_to(tmp_path, "sft", sft_knobs(demo, tmp_path), "t-preempt")
    run_dir = tmp_path / f"t-preempt-{job}"
    stopped_at = preempt(tmp_path, job, run_dir, lambda: len(losses(run_dir)) >= 3, STEPS, timeout=400)
    first = run_dir / "logs" / f"job-{job}-restart-0"
    second = run_dir / "logs" / f"job-{job}-restart-1"
    assert 3 <= stopped_at < STEPS
    assert "SIGUSR1" in (first / "node-n1.log").read_text()
    assert f"step_{stopped_at:08d}" in (second / "node-n1.log").read_text()  # resumed from it
    resumed, full = losses(run_dir), losses(reference)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in full:
        assert math.isclose(resumed[step], full[step], rel_tol=1e-6), (step, resumed[step], full[step])


def descendants(pid: int) -> list[int]:
    children = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False
    ).stdout
    found = []
    for child in map(int, children.split()):
        found += [child, *descendants(child)]
    return found


def test_job_whose_second_node_dies_fails_within_a_minute_naming_it(slurm_cluster, demo, tmp_path):
    job = submit_to(tmp_path, "sft", sft_knobs(demo, tmp_path, steps=100000), "t-nodedeath")
    run_dir = tmp_path / f"t-nodedeath-{job}"
    deadline = time.monotonic() + 180
    while len(losses(run_dir)) < 2:
        assert time.monotonic() < deadline and job_state(job).get("JobState") in ("PENDING", "RUNNING"), (
            batch_log(tmp_path, job)[-3000:]
        )
        time.sleep(0.2)
    # node n2 vanishes: its step daemon and every process under it are killed at once
    node_sh = int(next(run_dir.glob("logs/*/node-n2.pid")).read_text())
    stepd = int(
        subprocess.run(
            ["ps", "-o", "ppid=", "-p", str(node_sh)], capture_output=True, text=True, check=False
        ).stdout
    )
    assert "slurmstepd" in Path(f"/proc/{stepd}/cmdline").read_text()
    killed_at = time.monotonic()
    for pid in [stepd, *descendants(stepd)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    state = wait_for(job, timeout=120)
    took = time.monotonic() - killed_at
    log = batch_log(tmp_path, job)
    assert state["JobState"] == "FAILED", log[-3000:]
    assert took < 60, f"the job took {took:.0f}s to fail"
    assert "error: launchers/sft.sh failed first on node n2 (died" in log
    assert "n2: no exit status (the node or its processes died" in log  # the per-node table


def test_ray_cluster_over_two_nodes_runs_mlite_grpo(slurm_cluster, demo, tmp_path):
    knobs = {
        **sft_knobs(demo, tmp_path, steps=2),
        "RAY": "1",
        "LAUNCHER": "ray",
        "TRAINER": "mlite",
        "EXTRA_OVERRIDES": "model.load_weights=false trainer.log_every=1 job=grpo rollout.n=4 "
        "rollout.prompts_per_step=2 rollout.max_prompt_length=48 rollout.max_response_length=8 "
        "grpo.reward=arithmetic",
        "RAY_READY_TIMEOUT_S": "120",
    }
    job = submit_to(tmp_path, "grpo", knobs, "t-ray")
    state = wait_for(job, timeout=400)
    log = batch_log(tmp_path, job)
    assert state["JobState"] == "COMPLETED", log[-4000:]
    assert "Ray ready: 2/2 nodes" in log  # `ray status` listed both nodes before the driver started
    # every node and the driver authenticated with the job's own token (RAY_AUTH_MODE=token), gone at the end
    assert "Ray: token authentication; this job's token is" in log
    run_dir = tmp_path / f"t-ray-{job}"
    assert not list(run_dir.glob("ray-auth-*")), "the token outlived the job's Ray daemons"
    logs = run_dir / "logs" / f"job-{job}-restart-0"
    command = logs / "command.node0.sh"
    assert "export RAY_AUTH_MODE=token" in command.read_text()
    assert stat.S_IMODE(command.stat().st_mode) == 0o600
    node_logs = sorted(p.name for p in logs.glob("ray-node*.log"))
    assert (
        len(node_logs) == 2
        and node_logs[0].startswith("ray-node0-")
        and node_logs[1].startswith("ray-node1-")
    )
    final = run_dir / "checkpoints" / "step_00000002"
    assert sorted(p.name for p in final.glob("rank_*.pt")) == ["rank_00000.pt", "rank_00001.pt"]  # one world
    assert [r["step"] for r in metrics(run_dir) if "reward/mean" in r] == [1, 2]


# ------------------------------------------------------------------------ the DeepSeek-V4 template, tiny
# slurm/grpo_dsv4_128gpu.sbatch as written (its job preset deepseek_v4_flash_grpo, FSDP2, full recompute,
# torchrun on every node), its knobs selecting the catalog's tiny-deepseek-v4 and a layout over the two nodes,
# one gloo rank each. The layout is this one constant: data and expert parallel (EP=2), what DeepSeek-V4's
# GRPO runs under when this was written; {"PP": "2", "EP": "1", "CP": "1"} puts a pipeline over the two nodes
# once GRPO's built-in rollout decodes under pp (it needs the whole model: a pipeline stage has no KV cache).
DSV4_LAYOUT = {"PP": "1", "EP": "2", "CP": "1"}
DSV4_STEPS = 4
DSV4_LOSSES = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl", "reward/mean")
VOLATILE = ("time/", "tokens_per_s", "step_time_s")  # wall-clock figures differ between runs


@pytest.fixture(scope="module")
def dsv4_assets(tmp_path_factory):
    """Prompts (prompt + answer rows) and a 256-token tokenizer: the tiny preset's vocabulary."""
    from mlite.runtime.data.demo import write_demo_data
    from mlite.runtime.data.tokenizer import train_demo_tokenizer

    root = tmp_path_factory.mktemp("slurm_dsv4")
    files = write_demo_data(root / "data", train=32, val=4, seed=1)
    train_demo_tokenizer(root / "tokenizer", seed=1, vocab_size=256, rows=200)
    return files["train.jsonl"], root / "tokenizer"


def dsv4_grpo_knobs(assets, output_root: Path, steps: int = DSV4_STEPS) -> dict[str, str]:
    prompts, tokenizer = assets
    return {
        "MODEL_NAME": "tiny-deepseek-v4",
        **DSV4_LAYOUT,
        # the template's 11+11+11+10 stage split is V4-Flash's 43 layers; the tiny model's 4 split evenly
        "PP_FIRST_STAGE_LAYERS": "null",
        "PP_LAST_STAGE_LAYERS": "null",
        "GPUS_PER_NODE": "1",
        "DEVICE": "cpu",
        "GPU": "cpu",
        "PRECISION": "fp32",
        "TRAIN_FILES": str(prompts),
        "TOKENIZER": str(tokenizer),
        "SEQ_LEN": "64",
        "ROLLOUT_N": "4",
        "PROMPTS_PER_STEP": "2",
        "ROLLOUT_ENGINE": "builtin",  # on the CPU: the template's vLLM engines need GPUs
        "ROLLOUT_TP": "1",
        "MAX_PROMPT_LEN": "48",
        "MAX_RESPONSE_LEN": "8",
        # a dense reward for an untrained model (the visible length of the response): advantages are not 0
        "REWARD": "grpo_helpers:text_reward",
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        "LR": "1e-3",
        "STEPS": str(steps),
        "OUTPUT_ROOT": str(output_root),
    }


def grpo_records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in metrics(run_dir) if "reward/mean" in r}


@pytest.fixture(scope="module")
def dsv4_grpo_run(slurm_cluster, dsv4_assets, tmp_path_factory):
    """One uninterrupted 2-node job of the DeepSeek-V4 GRPO template: the reference for the preempted one."""
    out = tmp_path_factory.mktemp("slurm_dsv4_grpo")
    job = submit_to(out, "grpo_dsv4_128gpu", dsv4_grpo_knobs(dsv4_assets, out), "t-dsv4")
    state = wait_for(job, timeout=300)
    return job, state, out / f"t-dsv4-{job}", batch_log(out, job)


def test_dsv4_grpo_template_trains_a_tiny_deepseek_v4_on_both_nodes(dsv4_grpo_run):
    job, state, run_dir, log = dsv4_grpo_run
    assert state["JobState"] == "COMPLETED", log[-3000:]
    logs = run_dir / "logs" / f"job-{job}-restart-0"
    assert (logs / "plan.txt").read_text().rstrip().splitlines()[-1].startswith("FITS")
    for node, rank in (("n1", 0), ("n2", 1)):
        assert (logs / f"node-{node}.exit").read_text().split()[0] == "0"
        command = (logs / f"command.node{rank}.sh").read_text()
        for part in (f"--nnodes 2 --node-rank {rank}", "-m mlite grpo deepseek_v4_flash_grpo",
                     "--set model.name=tiny-deepseek-v4", "--set optimizer.backend=fsdp2",
                     "--set recompute.granularity=full", *(f"--set parallel.{k.lower()}={v}"
                                                           for k, v in DSV4_LAYOUT.items())):
            assert part in command, (part, command)
    final = run_dir / "checkpoints" / f"step_{DSV4_STEPS:08d}"
    assert sorted(p.name for p in final.glob("rank_*.pt")) == ["rank_00000.pt", "rank_00001.pt"]
    records = grpo_records(run_dir)
    assert sorted(records) == list(range(1, DSV4_STEPS + 1))
    for record in records.values():
        assert all(math.isfinite(record[key]) for key in DSV4_LOSSES), record
        assert record["actor/grad_norm"] > 0 and record["reward/std"] > 0, record  # advantages are not 0
    assert "finished on all 2 nodes" in log


def test_dsv4_grpo_template_preempted_checkpoints_requeues_and_continues_with_the_same_losses(
    dsv4_grpo_run, dsv4_assets, tmp_path
):
    _, state0, reference, _ = dsv4_grpo_run
    assert state0["JobState"] == "COMPLETED"
    job = submit_to(tmp_path, "grpo_dsv4_128gpu", dsv4_grpo_knobs(dsv4_assets, tmp_path), "t-dsv4-preempt")
    run_dir = tmp_path / f"t-dsv4-preempt-{job}"
    stopped_at = preempt(tmp_path, job, run_dir, lambda: bool(grpo_records(run_dir)), DSV4_STEPS, timeout=300)
    assert 1 <= stopped_at < DSV4_STEPS
    checkpoint = run_dir / "checkpoints" / f"step_{stopped_at:08d}"
    assert sorted(p.name for p in checkpoint.glob("rank_*.pt")) == ["rank_00000.pt", "rank_00001.pt"]
    first = run_dir / "logs" / f"job-{job}-restart-0"
    second = run_dir / "logs" / f"job-{job}-restart-1"
    for node in ("n1", "n2"):  # every rank got the notice and every rank resumed from the checkpoint
        assert f"{node} got SIGUSR1" in (first / f"node-{node}.log").read_text()
        assert f"resumed from {checkpoint} at step {stopped_at}" in (second / f"node-{node}.log").read_text()
    resumed, full = grpo_records(run_dir), grpo_records(reference)
    assert sorted(resumed) == sorted(full) == list(range(1, DSV4_STEPS + 1))
    for step, want in full.items():
        compared = {key for key in want if not key.startswith(VOLATILE)}
        assert compared >= set(DSV4_LOSSES) and set(resumed[step]) >= compared
        for key in sorted(compared):  # 1e-6 absolute: fp32 rounding of token means that are 0 on policy
            got = resumed[step][key]
            assert math.isclose(got, want[key], rel_tol=1e-5, abs_tol=1e-6), (step, key, got, want[key])
