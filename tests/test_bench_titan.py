"""torchtitan's side of `mlite bench --titan`: its own Qwen3 with the case's shapes, timed as the HF side.

torchtitan is not a dependency of mlite, and it imports triton, which a CPU build of torch lacks: the tests
that build its model run in the GPU suite (marked `gpu`; the wheels travel in `.whl/`, docs/PERFORMANCE.md),
and fail with the install command where it is missing, rather than skip. The dense model's step runs on the
CPU there; torchtitan 0.2.2's MoE routes its tokens with a Triton kernel and counts them with an integer
`histc`, neither of which the CPU has, so its MoE steps run on the GPU. The CLI's refusals and the cases'
flags are checked here on the CPU.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from mlite.bench.cases import CASES, BenchCase, case_arch

TINY_DENSE = BenchCase("tiny-cpu-dense", "tiny-qwen3", 128, packing="mixed", titan=True)  # tied embeddings
TINY_MOE = CASES["tiny-cpu"]


def needs_titan() -> None:
    from mlite.bench.titan_side import titan_missing

    if missing := titan_missing():
        pytest.fail(missing)


@pytest.mark.gpu
@pytest.mark.parametrize(("case", "device"), [(TINY_DENSE, "cpu"), (TINY_MOE, "cuda")], ids=lambda c: c.name
                         if isinstance(c, BenchCase) else c)
def test_titan_side_times_its_own_step_on_the_tiny_cases(case, device):
    import statistics

    from mlite.bench.run import run_case

    needs_titan()
    arch = case_arch(case)
    (result,) = run_case(case, device, steps=2, warmup=1, sides=("torchtitan",), peak_tflops=0.5)
    assert result.side == "torchtitan" and not result.skipped
    times = result.extra["step_ms_all"]
    assert len(times) == 2 and all(math.isfinite(ms) for ms in times)
    assert result.step_ms == statistics.median(times) > 0
    assert result.tokens_per_step == 128
    assert result.tokens_per_s == pytest.approx(128 / (result.step_ms / 1e3))
    assert result.mfu > 0 and result.estimate_gb is None
    # torchtitan's own loss (the mean over the step's tokens, not their sum) and grad norm: random weights
    # predict about uniformly over the 256 tokens, a little worse where the head is tied to the embedding
    # (its init leaves each token's own logit high)
    assert math.log(arch.vocab) - 0.5 < result.extra["loss"] < math.log(arch.vocab) + 3.0
    assert 0 < result.extra["grad_norm"] < math.inf
    assert result.extra["torchtitan"] and result.extra["fp8"] == "none"


@pytest.mark.gpu
def test_titan_side_runs_every_micro_batch_of_the_step():
    from mlite.bench.run import run_case

    needs_titan()
    (result,) = run_case(replace(TINY_MOE, accum=2), "cuda", steps=2, warmup=1, sides=("torchtitan",))
    assert result.tokens_per_step == 256 and result.extra["accum"] == 2
    # the loss over the step's valid tokens, summed over its micro-batches: one micro-batch's mean (random
    # logits of spread about 1 add about 0.5 to ln(vocab))
    assert abs(result.extra["loss"] - math.log(case_arch(TINY_MOE).vocab)) < 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-cpu-dense", "tiny-cpu", "dense-1.7b-4k", "moe-30b-a3b-6l-4k"])
def test_titan_builds_exactly_mlites_parameters_for_the_case(name):
    """torchtitan's model (as built for a GPU, on the meta device: no memory) against mlite's own for the
    same arch: every shape torchtitan takes from the case (widths, heads, experts, tied head) has to match."""
    from mlite.bench.titan_side import titan_model
    from mlite.runtime.models import build_model

    needs_titan()
    case = TINY_DENSE if name == TINY_DENSE.name else CASES[name]
    arch = case_arch(case)
    titan = titan_model(case, arch, device="meta", runs_on="cuda")
    mlite = build_model(arch, device="meta")
    assert sum(p.numel() for p in titan.parameters()) == sum(p.numel() for p in mlite.parameters())
    assert (titan.tok_embeddings.weight is titan.output.weight) == arch.tie_embeddings


@pytest.mark.parametrize("name,overrides,expected", [
    ("moe-30b-a3b-6l-4k-fp8", [], ("auto", False)),  # 256 rows an expert: the casts cost more
    ("moe-30b-a3b-6l-4k-fp8", ["precision.fp8_linears=all"], ("all", True)),
    ("dense-1.7b-4k-fp8", [], ("auto", False)),  # no routed experts
    ("moe-30b-a3b-6l-4k", [], ("auto", False)),  # no FP8
])
def test_torchtitans_side_runs_in_fp8_what_the_mlite_side_does(name, overrides, expected):
    """The torchtitan side copies the mlite side's FP8 choices from its job: fp8_linears, and whether the
    routed experts run in FP8, which is the plan's (what the Runtime asks when it builds the model)."""
    from mlite.bench.cases import case_job
    from mlite.bench.titan_side import mlite_fp8_choice
    from mlite.plan import plan_job

    case = CASES[name]
    arch = case_arch(case)
    assert mlite_fp8_choice(case, arch, "cuda", overrides) == expected
    assert plan_job(case_job(case, "cuda", overrides=overrides), arch).fp8_experts == expected[1]


def test_only_the_cases_torchtitan_builds_have_its_side():
    from mlite.bench.titan_side import titan_unbuildable

    titan = [c for c in CASES.values() if c.titan]
    assert {c.name for c in titan} >= {"dense-1.7b-4k", "moe-30b-a3b-6l-4k", "dense-1.7b-4k-fp8",
                                       "moe-30b-a3b-6l-4k-fp8"}
    assert all(c.gpus == 1 and not titan_unbuildable(case_arch(c)) for c in titan)
    assert not CASES["dsv4-flash-4l-4k"].titan and not CASES["dsv4-flash-4l-4k-fp8"].titan
    assert "deepseek_v4" in titan_unbuildable(case_arch(CASES["dsv4-flash-4l-4k"]))


def refused_titan_bench(tmp_path) -> str:
    """`mlite bench tiny-cpu --titan` with tmp_path first on PYTHONPATH (where a test puts a shadow
    torchtitan): the one line it refuses with, after checking it built nothing."""
    import os
    import subprocess
    import sys

    path = [str(tmp_path), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)))
    proc = subprocess.run([sys.executable, "-m", "mlite", "bench", "tiny-cpu", "--titan", "--device", "cpu",
                           "--out", str(tmp_path / "r.json")], capture_output=True, text=True, env=env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert not (tmp_path / "r.json").exists()  # refused before anything was built
    return proc.stderr


def test_cli_titan_without_torchtitan_says_how_to_install_it_in_one_line(tmp_path):
    """A shadow package on PYTHONPATH makes `import torchtitan` fail as on a machine without it."""
    shadow = tmp_path / "torchtitan"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'torchtitan'\")\n")
    line = refused_titan_bench(tmp_path)
    assert "--titan needs torchtitan" in line and "pip install --no-deps torchtitan==" in line


def test_cli_titan_names_a_torchtitan_that_does_not_import_on_this_torch(tmp_path):
    """A torchtitan that asks this torch for a name it lacks (0.3.0 on torch 2.11, the device's and the
    image's) fails inside its own import: the refusal says that, in one line, rather than to install what is
    installed."""
    shadow = tmp_path / "torchtitan"  # installed (its metadata); its import asks torch for a name it lacks
    (shadow / "components").mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    (shadow / "components" / "__init__.py").write_text("")
    (shadow / "components" / "quantization").mkdir()
    (shadow / "components" / "quantization" / "__init__.py").write_text("")
    float8 = shadow / "components" / "quantization" / "float8.py"
    float8.write_text("from torch.distributed.fsdp import NoSuchMeshDims\n")
    meta = tmp_path / "torchtitan-9.9.9.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: torchtitan\nVersion: 9.9.9\n")
    line = refused_titan_bench(tmp_path)
    assert "torchtitan 9.9.9 does not import on torch" in line and "NoSuchMeshDims" in line


def test_cli_titan_refuses_multi_gpu_cases_in_one_line():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "mlite", "bench", "tiny-cpu-dp2", "--titan"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "one-GPU cases" in proc.stderr


def _small_gpu_case(name: str, fp8: str) -> BenchCase:
    # two layers of the bench models at 2048: the float8 code path without the full case's compile time
    return replace(CASES[name], name=f"{name}-2l", num_layers=2, seq_len=2048, fp8=fp8, titan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("name,fp8,linears", [("dense-1.7b-4k", "tensorwise", "auto"),
                                              ("moe-30b-a3b-6l-4k", "rowwise", "all"),
                                              ("dense-1.7b-4k", "none", "auto")])
def test_titan_float8_side_runs_on_a_gpu(name, fp8, linears):
    """torchtitan's float8 side runs what the mlite side's job runs in FP8. The MoE case sets fp8_linears
    all: at these widths and rows torchao's size rule and mlite's experts rule keep everything in bf16."""
    from mlite.bench.run import run_case
    from mlite.bench.titan_side import mlite_fp8_choice, titan_job_config, titan_model

    needs_titan()
    case = _small_gpu_case(name, fp8)
    arch = case_arch(case)
    overrides = [f"precision.fp8_linears={linears}"] if fp8 != "none" else []
    chosen, experts = mlite_fp8_choice(case, arch, "cuda", overrides)
    assert chosen == linears and experts == (arch.moe is not None and fp8 != "none")
    job = titan_job_config(case, arch, compiled=True, linears=chosen)
    model = titan_model(case, arch, device="meta", runs_on="cuda", job=job, experts=experts)
    kinds = {type(m).__name__ for m in model.modules()}
    assert ("Float8Linear" in kinds) == (fp8 != "none")
    assert type(model.output).__name__ == "Linear"  # the head stays in bf16, as mlite's
    if arch.moe is not None:  # torchao 0.18's FP8 grouped GEMM on the experts' weights
        grouped = [m for m in model.modules() if type(m).__name__ == "GroupedExperts"]
        assert grouped and all(type(m.w1).__name__ == "Float8TrainingWeightWrapperTensor" for m in grouped)
    (result,) = run_case(case, "cuda", steps=2, warmup=2, sides=("torchtitan",), peak_tflops=989,
                         overrides=overrides)
    assert result.step_ms > 0 and math.isfinite(result.extra["loss"]) and result.peak_gb > 0
    assert abs(result.extra["loss"] - math.log(arch.vocab)) < 1.0


def test_the_compile_switches_torchtitan_sets_are_put_back_for_the_sides_after_it():
    import torch._dynamo.config as dynamo_config

    from mlite.bench.titan_side import compile_settings_restored

    before = dynamo_config.capture_scalar_outputs
    with compile_settings_restored():
        dynamo_config.capture_scalar_outputs = not before  # as torchtitan's apply_compile sets it
    assert dynamo_config.capture_scalar_outputs == before
