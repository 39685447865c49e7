"""The Slurm templates' twins on NCCL: each template's layout at degree 2 on 4 GPUs, bf16 compute, against the
same job on one GPU (the CPU twins, tests/test_template_twins.py and tests/test_deepseek_v4_train.py, prove
the same layouts equal to one process in fp32 on gloo; this is NCCL, bf16 and the GPU kernels holding it).

    sft/grpo_qwen3_30b_8gpu     EP8, full recompute              -> ep2 x dp2 (experts ep2 x edp2)
    grpo_qwen3_235b_32gpu       TP4 x PP8 x EP4, full recompute, -> tp2 x pp2 x ep2 (ep over the tp ranks
                                optimizer offloaded                 of a stage), offload on: it runs on GPUs
    sft/grpo_dsv4_128gpu        PP4 x EP8 x CP4, full recompute  -> pp2 x ep2 (dp2 in each stage; cp2 needs
                                                                    8 GPUs)

SFT: every step's loss and grad norm within bf16 rounding (2e-2 relative) of one GPU; the twin's step-1
checkpoint continues on one GPU on the one-GPU curve. GRPO (the layouts' GRPO templates): 3 steps on NCCL
with finite figures and a gradient; its samples are drawn from bf16 logits, which differ between layouts
in the last bits, so a sampled token may differ and the figures are not compared step by step.

The same twins run under `optimizer.backend=dist_opt` too (the templates' `OPTIMIZER=dist_opt`; the 235B
one without its offload, which dist_opt refuses), against the same one-GPU fsdp2 run, and their checkpoints
resume on one GPU under fsdp2.

The twins at the templates' full set of axes need 8 GPUs (`eight_gpus` in their names): DeepSeek-V4 pp2 x ep2
x cp2 and Qwen3-235B tp2 x pp2 x ep2 (dp2), as on CPU.

Run on a 4-GPU machine: pytest -m gpu tests/test_template_twins_gpu.py -k "not eight_gpus"; on 8 GPUs, all.
A twin with more ranks than GPUs fails, it is never skipped.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
from cli_runs import assert_same_curve, failure, mlite_cli, records
from test_deepseek_v4_train import LOSSES, dp_job, sft_assets  # noqa: F401 - sft_assets is a fixture
from test_grpo_cli import workdir, write_job  # noqa: F401 - workdir is a fixture
from test_template_twins import (  # noqa: F401 - assets is a fixture
    QWEN3_30B,
    QWEN3_235B,
    STEPS,  # cut_back_to_step_1 keeps step 1 of these
    assets,
    cut_back_to_step_1,
    grpo_job,
    sft_job,
)

from mlite.runtime.ckpt.checkpoint import CheckpointManager

pytestmark = pytest.mark.gpu

BF16_RTOL = 2e-2
GPUS = 4
# the 235B twin's layout on 4 GPUs: each stage's two ranks are its tp pair and its ep pair; the template's
# optimizer offload (GPU-only, left out of the CPU twin) is on
QWEN3_235B_4GPU = [*QWEN3_235B, "offload.optimizer=true"]
DSV4_4GPU = ["parallel.pp=2", "parallel.ep=2", "recompute.granularity=full"]
DSV4_8GPU = [*DSV4_4GPU, "parallel.cp=2"]


def dist_opt(overrides: list[str]) -> list[str]:
    """The same twin under Megatron-Core's distributed optimizer (the templates' OPTIMIZER=dist_opt)."""
    return [o for o in overrides if not o.startswith("optimizer.backend=")] + ["optimizer.backend=dist_opt"]


def need_gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.fail(f"the twins need {n} GPUs, {torch.cuda.device_count()} visible")


def on_gpus(job: dict, ranks: int, out: Path) -> dict:
    """The job in bf16 on `ranks` GPUs of one node, writing to `out`."""
    return {**job, "cluster": {**job["cluster"], "gpu": "h100", "gpus_per_node": ranks},
            "precision": {**job.get("precision", {}), "compute": "bf16"},
            "trainer": {**job["trainer"], "device": "cuda", "output_dir": str(out)}}


def run(tmp_path: Path, job: dict, ranks: int, *overrides: str) -> None:
    done = mlite_cli(tmp_path, job, ranks, *overrides, timeout=600)
    if done.returncode != 0:
        message = failure(done)
        print(message, flush=True)  # in the log at once (-s), even if a time limit ends the session
        pytest.fail(message)


def worst(got: list[dict], want: list[dict]) -> float:
    """The largest relative deviation of loss and grad norm over the steps (printed: the figure to report)."""
    return max(abs(g[k] - w[k]) / abs(w[k]) for g, w in zip(got, want) for k in ("loss", "grad_norm"))


def twin_sft(tmp_path: Path, job: dict, overrides: list[str], gpus: int = GPUS) -> None:
    """One GPU, the twin on `gpus`, the twin's step-1 checkpoint resumed on one GPU: the same curve."""
    need_gpus(gpus)
    one, twin, resumed = tmp_path / "one", tmp_path / "twin", tmp_path / "resumed"
    run(tmp_path, on_gpus(job, 1, one), 1)
    run(tmp_path, on_gpus(job, gpus, twin), gpus, *overrides)
    want, got = records(one), records(twin)
    assert len(want) == STEPS
    print(f"twin {overrides}: worst relative deviation from one GPU {worst(got, want):.2e}")
    assert_same_curve(got, want, rtol=BF16_RTOL)

    cut_back_to_step_1(twin, resumed)
    run(tmp_path, on_gpus(job, 1, resumed), 1, "trainer.resume=auto")
    after = [r for r in records(resumed) if r["step"] > 1]
    print(f"resumed on one GPU: worst relative deviation {worst(after, want[1:]):.2e}")
    assert_same_curve(after, want[1:], rtol=BF16_RTOL)


def twin_grpo(tmp_path: Path, job: dict, overrides: list[str]) -> None:
    need_gpus(GPUS)
    out = tmp_path / "twin"
    run(tmp_path, on_gpus(job, GPUS, out), GPUS, *overrides)
    rows = records(out, "step")
    assert [r["step"] for r in rows] == list(range(STEPS + 1))  # 0: the held-out reward before training
    for r in rows[1:]:
        assert r["actor/grad_norm"] > 0 and all(math.isfinite(v) for v in r.values() if isinstance(v, float))
    assert CheckpointManager(out).steps()[0] == STEPS


@pytest.mark.parametrize("template,overrides", [
    ("qwen3-30b", QWEN3_30B), ("qwen3-235b", QWEN3_235B_4GPU),
    ("qwen3-235b-no-offload", QWEN3_235B),  # the CPU twin's keys: tells the layout from the offload
    ("qwen3-30b-dist_opt", dist_opt(QWEN3_30B)),
    ("qwen3-235b-dist_opt", dist_opt(QWEN3_235B)),  # dist_opt refuses offload: the layout alone
])
def test_qwen3_twin_sft_on_four_gpus_matches_one_gpu_and_resumes_there(assets, tmp_path, template, overrides):  # noqa: F811,E501
    job = sft_job(assets, tmp_path / "unused")
    job["trainer"] |= {"steps": STEPS, "save_every": 1, "keep_last": STEPS, "eval_every": 0}
    twin_sft(tmp_path, job, overrides)


@pytest.mark.parametrize("overrides", [QWEN3_235B_4GPU, dist_opt(QWEN3_235B)], ids=["fsdp2", "dist_opt"])
def test_qwen3_235b_twin_grpo_on_four_gpus(assets, tmp_path, overrides):  # noqa: F811
    twin_grpo(tmp_path, grpo_job(assets, tmp_path / "unused"), overrides)


@pytest.mark.parametrize("overrides", [DSV4_4GPU, dist_opt(DSV4_4GPU)], ids=["fsdp2", "dist_opt"])
def test_dsv4_twin_sft_on_four_gpus_matches_one_gpu_and_resumes_there(sft_assets, tmp_path, overrides):  # noqa: F811,E501
    root, files = sft_assets
    job = dp_job(root, files, tmp_path / "unused")
    job["model"] |= LOSSES
    job["trainer"] |= {"steps": STEPS, "save_every": 1, "keep_last": STEPS}
    twin_sft(tmp_path, job, overrides)


@pytest.mark.parametrize("overrides", [DSV4_4GPU, dist_opt(DSV4_4GPU)], ids=["fsdp2", "dist_opt"])
def test_dsv4_twin_grpo_on_four_gpus(workdir, tmp_path, overrides):  # noqa: F811
    job = yaml.safe_load(write_job(workdir, tmp_path / "unused", model={"name": "tiny-deepseek-v4", **LOSSES},
                                   trainer={"steps": STEPS, "save_every": 1}).read_text())
    job["optimizer"] |= {"clip_grad": 1.0}
    job["cluster"]["host_memory_gb"] = 64  # the planner splits a node's host memory over its ranks
    twin_grpo(tmp_path, job, overrides)


def test_qwen3_235b_twin_sft_on_eight_gpus_matches_one_gpu_and_resumes_there(assets, tmp_path):  # noqa: F811
    job = sft_job(assets, tmp_path / "unused")
    job["trainer"] |= {"steps": STEPS, "save_every": 1, "keep_last": STEPS, "eval_every": 0}
    twin_sft(tmp_path, job, QWEN3_235B_4GPU, gpus=8)  # the same keys: on 8 ranks each stage has dp2


def test_dsv4_twin_sft_on_eight_gpus_matches_one_gpu_and_resumes_there(sft_assets, tmp_path):  # noqa: F811
    root, files = sft_assets
    job = dp_job(root, files, tmp_path / "unused")
    job["model"] |= LOSSES
    job["trainer"] |= {"steps": STEPS, "save_every": 1, "keep_last": STEPS}
    twin_sft(tmp_path, job, DSV4_8GPU, gpus=8)
