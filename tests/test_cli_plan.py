"""`mlite plan` as users run it: a subprocess. Exit 0 when the layout fits, 2 with one line and no traceback
for bad input or a job the trainers refuse, 3 when valid but too big; JSON output; no torch imported;
`invoke plan` passes arguments on."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def mlite(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlite", "plan", *args], capture_output=True, text=True,
                          cwd=ROOT)


@pytest.mark.parametrize("preset", ["qwen3_30b_a3b_sft", "demo_sft", "demo_grpo", "deepseek_v4_flash_sft"])
def test_presets_the_trainers_run_fit(preset):
    result = mlite(preset, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["fits"] and report["memory"]["total_gb"] <= report["memory"]["usable_gb"]


def test_dsv4_grpo_fits_on_one_node_engines_with_fp8_rollout_weights():
    """DeepSeek-V4's GRPO preset rolls out on vLLM engines of 8 GPUs: bf16 weights (66 GB per GPU) would not
    fit vLLM's 40 GB share, so the planner sends the linears and experts in FP8 (rollout.fp8_weights: auto,
    about 33 GB per GPU) beside an fp8 KV cache. Forced to bf16 it does not fit, and the built-in engine's
    whole-model replica on every rank does not either (docs/PLANNER.md, "Known gap"): exit 3 with why."""
    fits = mlite("deepseek_v4_flash_grpo", "--json")
    assert fits.returncode == 0, fits.stderr
    report = json.loads(fits.stdout)
    assert report["runs"]["rollout_fp8_weights"] is True and report["fits"]
    engine = next(i for i in report["memory"]["rollout_items"] if i["name"].startswith("vLLM"))
    weights = float(re.search(r"([\d.]+) GB of weights per GPU", engine["note"]).group(1))
    assert 30 < weights < 36 and "fp8 KV cache for" in engine["note"]
    assert "FP8 rollout weights" in " ".join(mlite("deepseek_v4_flash_grpo").stdout.split())

    bf16 = mlite("deepseek_v4_flash_grpo", "--set", "rollout.fp8_weights=false")
    assert bf16.returncode == 3 and "more than its 39.8 GB share" in bf16.stdout
    assert "rollout.fp8_weights" in " ".join(bf16.stdout.split())  # the fix it names
    builtin = mlite("deepseek_v4_flash_grpo", "--set", "rollout.engine=builtin", "--set", "rollout.tp=1")
    assert builtin.returncode == 3, builtin.stderr
    assert builtin.stdout.rstrip().splitlines()[-1].startswith("DOES NOT FIT")
    assert "rollout replica" in builtin.stdout
    assert "replicates the whole model on every rank" in builtin.stdout


@pytest.mark.parametrize("preset, refusal", [
    ("deepseek_v3_sft", "deepseek-v3 (model_type 'deepseek_v3') has no native model yet"),
])
def test_published_presets_the_trainers_refuse_exit_2(preset, refusal):
    """Planned layouts (they fit by design, tests/test_plan.py), refused as the trainers refuse them."""
    result = mlite(preset, "--json")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mlite plan: error: {refusal}"), lines


def test_human_report_lists_layout_memory_host_and_verdict():
    result = mlite("qwen3_30b_a3b_sft")
    assert result.returncode == 0
    for text in ("tp1 pp1 cp1 dp8 ep8", "edp1", "optimizer state", "activations", "gradients",
                 "host memory per node", "FITS"):
        assert text in result.stdout, text
    assert "note:" not in result.stdout and "dist_opt" not in result.stdout


def test_an_offloaded_grpo_plan_prints_its_three_phases_and_the_host():
    """vLLM at half of each GPU beside Qwen3-30B's trainer: the plan offloads the trainer (`auto`) and prints
    the training step, the weight sync and the rollout, and the trainer's state in each node's host memory."""
    result = mlite("qwen3_30b_a3b_sft", "--set", "job=grpo", "--set", "rollout.engine=vllm", "--set",
                   "rollout.tp=4", "--set", "rollout.gpu_memory_utilization=0.5")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for text in ("total (training step)", "during the weight sync", "vLLM weights", "total (weight sync)",
                 "trainer: on the host", "total (rollout)", "trainer during rollout", "offload trainer",
                 "FITS"):
        assert text in out, text


@pytest.mark.parametrize("args, message", [
    (["qwen3_30b_a3b_sft", "--set", "parallel.tp=3"], "world size 8 is not a multiple of pp x cp x tp = 3"),
    (["qwen3_30b_a3b_sft", "--set", "parallel.bogus=1"], "unknown key 'parallel.bogus'"),
    (["qwen3_30b_a3b_sft", "--set", "parallel.tp=x"], "parallel.tp"),
    (["qwen3_30b_a3b_sft", "--set", "data.seq_len=4097", "--set", "parallel.tp=2", "--set", "parallel.ep=4"],
     "multiple of 2"),
    (["no_such_preset"], "unknown job preset 'no_such_preset'"),
    (["--bogus-flag"], "unrecognized arguments"),
    (["demo_sft", "--set", "model.name=gpt5"], "unknown model 'gpt5'"),
    (["qwen3_235b_a22b_sft", "--set", "optimizer.backend=dist_opt"],
     "offload.* with optimizer.backend dist_opt"),
    (["demo_grpo", "--set", "rollout.engine=vllm"], "rollout.engine vllm generates on CUDA GPUs"),
    (["qwen3_235b_a22b_sft", "--recommend", "--set", "optimizer.backend=dist_opt"],
     "offload.* with optimizer.backend dist_opt"),
])
def test_bad_input_is_one_line_exit_2(args, message):
    result = mlite(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.stderr


def test_valid_but_too_big_exits_3():
    result = mlite("qwen3_30b_a3b_sft", "--set", "recompute.granularity=none")
    assert result.returncode == 3
    assert "DOES NOT FIT" in result.stdout


def test_recommend_json_is_sorted_and_fits():
    fsdp2 = ("--set", "optimizer.backend=fsdp2")  # the trainers run fsdp2 only
    result = mlite("qwen3_235b_a22b_sft", *fsdp2, "--recommend", "--json", "--top", "4")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert len(rows) == 4
    assert [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    assert all(r["memory_gb"] <= 96 * 0.9 for r in rows)
    nothing = mlite("qwen3_235b_a22b_sft", "--recommend", *fsdp2, "--set", "cluster.nodes=1")
    assert nothing.returncode == 3 and "no layout fits" in nothing.stderr


def test_list_models():
    result = mlite("--list-models", "--json")
    models = {row["name"]: row for row in json.loads(result.stdout)}
    assert round(models["deepseek-v3"]["total"] / 1e9) == 671
    assert {"deepseek-v4-flash", "qwen3-30b-a3b", "llama-3.1-70b", "tiny-qwen3-moe"} <= set(models)


def test_plan_never_imports_torch():
    code = ("import sys; from mlite.cli import main\n"
            "rc = main(['plan', 'qwen3_30b_a3b_sft', '--recommend', '--json'])\n"
            "refused = main(['plan', 'qwen3_235b_a22b_sft', '--set', 'optimizer.backend=dist_opt'])\n"
            "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'megatron')]\n"
            "assert (rc, refused) == (0, 2) and not heavy, (rc, refused, heavy)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_invoke_plan_passes_arguments_and_exit_status():
    invoke = [sys.executable, "-m", "invoke"]
    ok = subprocess.run(invoke + ["plan", "--config", "qwen3_30b_a3b_sft", "--json"], capture_output=True,
                        text=True, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["layout"]["ep"] == 8
    bad = subprocess.run(invoke + ["plan", "--config", "qwen3_30b_a3b_sft", "--set", "parallel.tp=3"],
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "not a multiple of pp x cp x tp" in bad.stderr


def test_invoke_test_selects_the_cpu_suite():
    """`invoke test` is what CI runs: it must collect this suite with the GPU tests deselected (a quoting slip
    once turned `-m "not gpu"` into a path named `gpu` and collected nothing)."""
    result = subprocess.run([sys.executable, "-m", "invoke", "test", "--workers=1", "-k", "test_invoke_plan",
                             "--extra=--collect-only -q"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "tests/test_cli_plan.py::test_invoke_plan_passes_arguments_and_exit_status" in result.stdout
    assert "deselected" in result.stdout


def test_invoke_test_keeps_an_xdist_group_on_one_worker(tmp_path):
    """`invoke test` runs 2 workers with --dist loadgroup; the slurm tests share one local cluster and rely
    on xdist_group("slurm") to run on one worker (pytest 9 with xdist 3.8 silently dropped the groups and
    two workers started and stopped the cluster under each other)."""
    (tmp_path / "test_grouped.py").write_text(
        "import os, pytest\n"
        "pytestmark = [pytest.mark.xdist_group('together')]\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_where(i):\n"
        "    print('worker', os.environ['PYTEST_XDIST_WORKER'])\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "invoke", "test", "--workers=2",
         f"--extra={tmp_path} -p no:cacheprovider -s -v"],
        capture_output=True, text=True, cwd=ROOT, check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    workers = {line.split()[0] for line in result.stdout.splitlines() if "PASSED" in line}
    assert len(workers) == 1 and "6 passed" in result.stdout, result.stdout[-2000:]
    assert "slowest 25 durations" in result.stdout  # CI's log names the slowest tests


def test_invoke_demo_passes_the_demo_flags_through():
    """`invoke demo` forwards both jobs' overrides and --no-grpo to `mlite demo` (invoke --dry prints the
    command instead of running it)."""
    dry = subprocess.run(
        [sys.executable, "-m", "invoke", "--dry", "demo", "--no-grpo", "--grpo-set", "rollout.n=4",
         "--set", "trainer.steps=3", "--out", "/tmp/nowhere"],
        capture_output=True, text=True, cwd=ROOT, check=False,
    )
    assert dry.returncode == 0, dry.stderr
    line = next(x for x in dry.stdout.splitlines() if "-m mlite demo" in x)
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)  # invoke colours the echoed command
    assert line.split("-m mlite ", 1)[1].split() == [
        "demo", "--out", "/tmp/nowhere", "--device", "auto", "--set=trainer.steps=3",
        "--grpo-set=rollout.n=4", "--no-grpo",
    ]
