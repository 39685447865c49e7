"""Strict job config: unknown keys, wrong types and contradictions are one-line errors that name the key and
what is allowed; command-line overrides go through the same validation; every packaged preset loads."""

from __future__ import annotations

import pytest

from mlite.config import job_from_dict, list_presets, load_job
from mlite.errors import MliteError


def write(tmp_path, text: str):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def error_of(*args) -> str:
    with pytest.raises(MliteError) as err:
        load_job(*args)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_every_preset_loads():
    assert {"demo_sft", "deepseek_v3_sft", "qwen3_235b_a22b_sft", "qwen3_30b_a3b_sft",
            "deepseek_v4_flash_sft", "deepseek_v4_flash_grpo"} <= set(list_presets())
    for name in list_presets():
        assert load_job(name).model.name


def test_unknown_key_names_the_key_and_the_allowed_ones(tmp_path):
    msg = error_of(write(tmp_path, "model: {name: qwen3-8b}\nparallel: {tp: 2, tpp: 4}\n"))
    assert "unknown key 'parallel.tpp'" in msg and "tp, pp, vpp, cp, ep, etp" in msg
    msg = error_of(write(tmp_path, "model: {name: qwen3-8b}\ntrainer: {stepz: 4}\n"))
    assert "unknown key 'trainer.stepz'" in msg and "steps" in msg


def test_wrong_types_are_not_coerced(tmp_path):
    assert "parallel.tp" in error_of(write(tmp_path, "model: {name: qwen3-8b}\nparallel: {tp: '2'}\n"))
    assert "data.seq_len" in error_of(write(tmp_path, "model: {name: qwen3-8b}\ndata: {seq_len: 1.5}\n"))
    msg = error_of(write(tmp_path, "model: {name: qwen3-8b}\noptimizer: {backend: deepspeed}\n"))
    assert "optimizer.backend" in msg and "'fsdp2'" in msg and "'dist_opt'" in msg
    assert "cluster.gpu" in error_of(write(tmp_path, "model: {name: qwen3-8b}\ncluster: {gpu: v100}\n"))


@pytest.mark.parametrize("overrides, message", [
    (["parallel.sequence_parallel=false", "parallel.tp=2"], "sequence_parallel=False with tp=2"),
    (["parallel.vpp=2"], "vpp=2 needs pp > 1"),
    (["recompute.method=block"], "apply to granularity 'full' only"),
    (["offload.optimizer_fraction=0.5"], "needs offload.optimizer: true"),
    (["offload.params=true", "optimizer.backend=dist_opt"], "offload.params needs optimizer.backend: fsdp2"),
    (["data.max_tokens_per_micro_batch=64"], "below data.seq_len=128"),
    (["optimizer.min_lr=1.0"], "optimizer.min_lr=1.0 is above optimizer.lr=0.001"),
    (["rollout.n=4"], "rollout / grpo sections apply to job: grpo only"),
    (["trainer.device=cuda"], "trainer.device: cuda contradicts cluster.gpu: cpu"),
    (["model.path=/x"], "exactly one of model.name"),
    (["precision.fp8_linears=all"], "precision.fp8_linears: all chooses which linears run in FP8, and "
                                    "precision.fp8 is none"),
])
def test_contradictions_are_refused(overrides, message):
    assert message in error_of("demo_sft", overrides)


def test_exponent_numbers_without_a_dot_are_floats(tmp_path):
    """YAML 1.1 reads 1e-4 as a string; a job file and an override both take it as the number users mean."""
    job = load_job(write(tmp_path, "model: {name: qwen3-8b}\noptimizer: {lr: 1e-4, min_lr: 2E-6}\n"))
    assert (job.optimizer.lr, job.optimizer.min_lr) == (1e-4, 2e-6)
    assert load_job("demo_sft", ["optimizer.lr=3e-3", "optimizer.min_lr=3e-5"]).optimizer.min_lr == 3e-5
    assert "trainer.output_dir" in error_of("demo_sft", ["trainer.output_dir=1e5"])  # a number is not a path


def test_held_out_sampling_needs_a_temperature():
    msg = error_of("demo_grpo", ["rollout.val_n=4", "rollout.val_temperature=0"])
    assert "rollout.val_n=4 with rollout.val_temperature 0 repeats one greedy answer" in msg


def test_offloading_the_trainer_needs_vllm():
    """The built-in engine generates with the trainer's own weights: it cannot send them to the host."""
    msg = error_of("demo_grpo", ["rollout.offload_trainer=true"])
    assert "rollout.offload_trainer: true moves the trainer off the GPU" in msg
    assert "use rollout.engine vllm" in msg
    on_vllm = load_job("demo_grpo", ["rollout.engine=vllm", "rollout.offload_trainer=true"])
    assert on_vllm.rollout.offload_trainer is True
    assert load_job("demo_grpo", ["rollout.offload_trainer=false"]).rollout.offload_trainer is False


def test_overrides_are_parsed_and_validated_like_the_file():
    job = load_job("demo_sft", ["parallel.tp=1", "data.seq_len=256", "optimizer.betas=[0.9, 0.99]"])
    assert job.data.seq_len == 256 and job.optimizer.betas == (0.9, 0.99)
    assert "unknown key 'parallel.tq'" in error_of("demo_sft", ["parallel.tq=2"])
    assert "parallel.tp" in error_of("demo_sft", ["parallel.tp=two"])
    assert "is not key.sub=value" in error_of("demo_sft", ["parallel.tp"])
    assert "is a value, not a section" in error_of("demo_sft", ["job.x=1"])


def test_derived_defaults():
    job = load_job("deepseek_v4_flash_grpo")
    assert job.parallel.sequence_parallel is False and job.recompute.method == "uniform"
    assert job.recompute.num_layers == 1 and job.grpo is not None
    assert load_job("qwen3_235b_a22b_sft").offload.optimizer_fraction == 1.0
    assert load_job("qwen3_235b_a22b_sft").parallel.sequence_parallel is True


def test_missing_file_and_bad_yaml(tmp_path):
    assert "config file not found" in error_of(str(tmp_path / "nope.yaml"))
    assert "unknown job preset 'nope'" in error_of("nope")
    assert "not valid YAML" in error_of(write(tmp_path, "model: [unclosed\n"))


def test_every_key_is_documented():
    import typing
    from pathlib import Path

    from pydantic import BaseModel

    from mlite.config.schema import JobConfig

    def keys(model, prefix=""):
        for name, field in model.model_fields.items():
            sections = [a for a in (field.annotation, *typing.get_args(field.annotation))
                        if isinstance(a, type) and issubclass(a, BaseModel)]
            yield from keys(sections[0], f"{prefix}{name}.") if sections else [prefix + name]

    doc = (Path(__file__).resolve().parents[1] / "docs" / "CONFIG.md").read_text()
    missing = [k for k in keys(JobConfig) if f"`{k}`" not in doc]
    assert not missing, f"keys missing from docs/CONFIG.md: {missing}"


def test_one_path_for_a_list_key_is_a_one_element_list():
    # as in verl and Hydra: `--set data.train_files=x.jsonl` is ["x.jsonl"], not a type error
    job = load_job("demo_sft", ["data.train_files=x.jsonl", "data.val_files=[a.jsonl, b.parquet]"])
    assert job.data.train_files == ["x.jsonl"] and job.data.val_files == ["a.jsonl", "b.parquet"]
    assert job_from_dict({**job.model_dump(), "data": {**job.data.model_dump(), "train_files": "y.jsonl"}}
                         ).data.train_files == ["y.jsonl"]
