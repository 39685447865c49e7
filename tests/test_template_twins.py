"""Every Qwen3 Slurm template trains: its layout, scaled down to degree 2 per axis, runs `mlite sft` and
`mlite grpo` on CPU and equals the one-process run, and its checkpoints continue under another layout.

A template's twin is read off the template itself: the knobs it exports (EP=8, TP=4, ...) become job keys
the way launchers/lib.sh turns them into overrides, every parallel degree above 1 becomes 2, and the
optimizer backend and recompute granularity are kept. Two keys do not apply on CPU: `offload.optimizer`
(the rule book refuses offload without GPUs; tests/test_runtime_layouts.py runs fsdp2 offload on 2 GPUs)
and the presets' `precision.grad_reduce: bf16` (the twin reduces in fp32 to compare within 1e-5;
test_runtime_layouts.py shows bf16 reduction moves the curve by bf16 rounding only).

    sft/grpo_qwen3_30b_8gpu     EP8, fsdp2, full recompute      -> ep2 x dp2 on 4 ranks (experts ep2 x edp2)
    grpo_qwen3_235b_32gpu       TP4 x PP8 x EP4, fsdp2, full    -> tp2 x pp2 x ep2 on 8 ranks (dp2)
                                recompute, optimizer offloaded

Each twin is the real CLI under `torchrun --standalone` (gloo, fp32) on a tiny untied Qwen3-MoE (hidden 64,
2 layers, 4 experts, top-2, balance loss on). For SFT and for GRPO (rollouts, rewards, advantages, old and
reference log-probs, PPO updates over two mini-batches with a KL term, held-out evaluation) every
figure the run logs per step, wall-clock ones aside, equals the one-process run within 1e-5 relative (1e-6
absolute for figures near 0 that are differences of log-probs: KL estimates, the group-centred pg loss). Then
the twin's run dir, cut back to its step-1 checkpoint as a preempted job leaves it, resumes with
trainer.resume=auto (the templates' RESUME=auto) under another layout and continues the one-process curve:
steps 2 and 3, the restored Adam moments and LR schedule included.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from cli_runs import (  # noqa: F401 - one_thread is an autouse fixture
    ROOT,
    assert_same_curve,
    assert_same_records,
    failure,
    job_dict,
    layout_assets,
    mlite_cli,
    one_thread,
    records,
    write_model_config,
)
from grpo_helpers import char_tokenizer

from mlite.config import job_from_dict
from mlite.runtime.ckpt.checkpoint import CheckpointManager
from mlite.trainers.grpo.trainer import train_grpo
from mlite.trainers.sft import train_sft

# the ranks of one twin at a time: 8 ranks on 2 cores are slow enough without a neighbour's 8
pytestmark = pytest.mark.xdist_group("template_twins")

STEPS = 3
TRAINER = {"steps": STEPS, "save_every": 1, "keep_last": STEPS, "eval_every": 0}
KEPT_AS_IS = ("optimizer.backend", "recompute.granularity", "trainer.resume")
GPU_ONLY = ("offload.optimizer",)  # refused on CPU by the rule book (check_offload)


# ------------------------------------------------------------------------------------- the twins
def template_keys(template: str) -> dict[str, str]:
    """The job keys a template's default knobs set: `export EP=${EP:-8}` in the template and
    `add parallel.ep "$EP"` in launchers/lib.sh give parallel.ep=8."""
    sbatch, lib = (ROOT / "slurm" / template).read_text(), (ROOT / "launchers" / "lib.sh").read_text()
    knobs = dict(re.findall(r"^export (\w+)=\$\{\1:-([^}]*)\}", sbatch, re.M))
    keys = dict(re.findall(r'^\s*add (\S+) "\$(\w+)"$', lib, re.M))
    by_knob = {knob: key for key, knob in keys.items()}
    return {by_knob[k]: v for k, v in knobs.items() if k in by_knob and v}


def twin_of(template: str) -> list[str]:
    """The template's layout at degree 2 per parallel axis, as `--set` overrides for a CPU run."""
    twin = []
    for key, value in sorted(template_keys(template).items()):
        if key.startswith("parallel.") and int(value) > 1:
            twin.append(f"{key}=2")
        elif key in KEPT_AS_IS:
            twin.append(f"{key}={value}")
        elif key not in GPU_ONLY:
            raise AssertionError(f"{template} sets {key}={value}: give its twin a CPU form of it")
    return twin


QWEN3_30B = ["optimizer.backend=fsdp2", "parallel.ep=2", "recompute.granularity=full", "trainer.resume=auto"]
QWEN3_235B = ["optimizer.backend=fsdp2", "parallel.ep=2", "parallel.pp=2", "parallel.tp=2",
              "recompute.granularity=full", "trainer.resume=auto"]


def test_the_twins_are_the_templates_at_degree_2():
    """The layouts below are read off the templates, so a template that changes its axes changes its twin.
    The 235B template also offloads the optimizer, which CPU runs refuse (GPU_ONLY)."""
    assert twin_of("sft_qwen3_30b_8gpu.sbatch") == twin_of("grpo_qwen3_30b_8gpu.sbatch") == QWEN3_30B
    assert twin_of("grpo_qwen3_235b_32gpu.sbatch") == QWEN3_235B
    assert template_keys("grpo_qwen3_235b_32gpu.sbatch")["offload.optimizer"] == "true"


# ------------------------------------------------------------------------------------- the jobs
@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The SFT assets of the layout tests (demo data, its tokenizer, the tiny MoE), and for GRPO a
    character tokenizer with a chat template, the same MoE sized to it, and prompt files."""
    root = tmp_path_factory.mktemp("twin_assets")
    found = layout_assets(root)
    tokenizer = char_tokenizer(root / "chartok")
    write_model_config(root / "moe_char", len(tokenizer), moe=True)
    rows = [f'{{"prompt": "say {d}", "answer": "{d}"}}\n' for d in range(10)]
    (root / "prompts.jsonl").write_text("".join(rows))
    (root / "val_prompts.jsonl").write_text("".join(rows[:4]))
    return found | {"chartok": str(root / "chartok")}


def sft_job(assets, out: Path) -> dict:
    """The layout tests' MoE SFT job (8 sequences per step, one per micro-batch), 3 steps, a checkpoint at
    each, the held-out loss at the end."""
    return job_dict(assets, "moe", out, trainer=TRAINER)


def grpo_job(assets, out: Path) -> dict:
    """2 prompts x 4 responses of up to 8 tokens per step, one sequence per micro-batch (the MoE balance loss
    pools per micro-batch), two mini-batches (the second update's ratios leave 1), KL to the initial policy
    in the loss, held-out greedy rewards before and after. No entropy bonus (the templates have none): on an
    untrained model's near-uniform softmax its gradient, p (log p + H), is float noise that Adam amplifies
    to ~5e-6 relative in the next step's grad norm, under any layout."""
    root = assets["root"]
    job = job_dict(assets, "moe_char", out, trainer=TRAINER,
                   data={"train_files": [str(root / "prompts.jsonl")],
                         "val_files": [str(root / "val_prompts.jsonl")],
                         "tokenizer": assets["chartok"], "seq_len": 64})
    return job | {
        "job": "grpo",
        "rollout": {"n": 4, "prompts_per_step": 2, "max_prompt_length": 48, "max_response_length": 8},
        "grpo": {"reward": "grpo_helpers:digit_reward", "mini_batches": 2, "kl_coef": 0.05},
    }


JOBS = {"sft": (sft_job, train_sft), "grpo": (grpo_job, train_grpo)}


def run_in_process(job: dict) -> None:
    """`mlite sft|grpo` on one process, in this process (no interpreter to start)."""
    JOBS[job["job"]][1](job_from_dict(job), show_progress=False)


@pytest.fixture(scope="module")
def one_process(assets, tmp_path_factory):
    """Each job's records on one process (in this process): the curve every twin and resume must follow."""
    runs = {}
    for kind, (make, _) in JOBS.items():
        out = tmp_path_factory.mktemp(f"one_{kind}") / "run"
        run_in_process(make(assets, out))
        runs[kind] = records(out, "step")
    return runs


def assert_follows(out: Path, kind: str, want: list[dict]) -> None:
    """The run's records are the one-process run's: every step, every figure (assert_same_records)."""
    got = records(out, "step")
    if kind == "sft":
        assert_same_curve(got, want)
    else:
        assert [r["step"] for r in got] == list(range(STEPS + 1))  # 0: held-out reward before training
    assert_same_records(got, want)


def assert_resumed(saved: Path, resumed: Path) -> None:
    """The resumed run kept the twin's step-1 record, wall clock included (a run started over would have
    rewritten it), and wrote the later checkpoints again."""
    def kept(out):
        return [r for r in records(out, "step") if r["step"] <= 1]

    assert kept(resumed) == kept(saved)
    assert CheckpointManager(resumed).steps() == [3, 2, 1]


def cut_back_to_step_1(saved: Path, resumed: Path) -> None:
    """The run dir as a job preempted after step 1 leaves it: later checkpoints never written."""
    shutil.copytree(saved, resumed)
    for step in range(2, STEPS + 1):
        shutil.rmtree(CheckpointManager(resumed).path_for(step))


# ------------------------------------------------------------------------------------- the runs
@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_qwen3_30b_twin_ep2_dp2_matches_one_process_and_resumes_on_one_process(
        assets, one_process, tmp_path, kind):
    """The 30B-A3B templates' twin (4 ranks: dense parts fsdp2 over dp4, experts over ep2 x edp2, full
    recompute) equals one process; its step-1 checkpoint continues on one process."""
    make, _ = JOBS[kind]
    saved = tmp_path / "twin"
    done = mlite_cli(tmp_path, make(assets, saved), 4, *QWEN3_30B)
    assert done.returncode == 0, failure(done)
    assert_follows(saved, kind, one_process[kind])
    assert CheckpointManager(saved).steps() == [3, 2, 1]

    resumed = tmp_path / "resumed"
    cut_back_to_step_1(saved, resumed)
    run_in_process(make(assets, resumed))  # trainer.resume: auto (the job's default, the templates' RESUME)
    assert_resumed(saved, resumed)
    assert_follows(resumed, kind, one_process[kind])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_qwen3_235b_twin_tp2_pp2_ep2_matches_one_process_and_resumes_on_dp2(
        assets, one_process, tmp_path, kind):
    """The 235B-A22B template's twin (8 ranks: tp2 + sequence parallel, two 1F1B pipeline stages, experts
    over ep2 x edp2 in each, fsdp2 over dp2, full recompute) equals one process. GRPO rolls out from the
    whole model gathered on every rank (each stage holds half of it). Its step-1 checkpoint continues under
    fsdp2 over dp2 (2 ranks, no tp, pp or ep)."""
    make, _ = JOBS[kind]
    saved = tmp_path / "twin"
    done = mlite_cli(tmp_path, make(assets, saved), 8, *QWEN3_235B, timeout=600)
    assert done.returncode == 0, failure(done)
    assert_follows(saved, kind, one_process[kind])
    assert CheckpointManager(saved).steps() == [3, 2, 1]

    resumed = tmp_path / "resumed"
    cut_back_to_step_1(saved, resumed)
    done = mlite_cli(tmp_path, make(assets, resumed), 2)
    assert done.returncode == 0, failure(done)
    assert_resumed(saved, resumed)
    assert_follows(resumed, kind, one_process[kind])


def test_grpo_under_context_parallel_matches_one_process(assets, one_process, tmp_path):
    """The generic grpo.sbatch runs whatever layout its config names; context parallel is the axis the Qwen3
    twins lack (the DeepSeek-V4 twin has it). Every cp rank holds the whole mini-batch in the trainer and its
    share of each micro-batch in the runtime, so the loss's global token and sequence counts, summed over
    the loss group, are divided by cp (counted cp times, they made the loss and gradients 1/cp of one
    process's), and the logged figures are summed over the shares."""
    out = tmp_path / "cp2"
    done = mlite_cli(tmp_path, grpo_job(assets, out), 2, "parallel.cp=2")
    assert done.returncode == 0, failure(done)
    assert_follows(out, "grpo", one_process["grpo"])
