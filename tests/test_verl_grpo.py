"""verl's own PPO trainer (`verl.trainer.main_ppo`) with model_engine=mlite: Hydra composition with verl's
config, and a tiny GRPO run on CPU (a local Ray cluster, gloo) whose actor and reference policy are the mlite
engine and whose rollout is mlite's built-in sampler behind verl's rollout-replica interface. Needs the
`verl` extra (installed in CI)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from grpo_helpers import VLLM_SIZES, char_tokenizer, tiny_hf_qwen3

from mlite.integrations.verl import CONFIG_SEARCHPATH

ROOT = Path(__file__).resolve().parents[1]
STEPS = 2
PROMPTS = 2  # per step
GROUP = 4  # responses per prompt


def overrides(root: Path, out: Path, ranks: int = 1) -> list[str]:
    """main_ppo's command line on CPU; `ranks` training ranks (each also a rollout replica), splitting each
    batch."""
    return [*common_overrides(root, out, ranks),
            "actor_rollout_ref.actor.mlite.device=cpu",
            "actor_rollout_ref.actor.mlite.dtype=float32",
            "actor_rollout_ref.actor.mlite.attention_backend=torch",
            "actor_rollout_ref.rollout.name=mlite",
            "actor_rollout_ref.rollout.calculate_log_probs=false",  # the built-in rollout returns none
            "trainer.device=cpu",
            f"+ray_kwargs.ray_init.num_gpus={ranks}"]  # training-rank slots (platform_cpu.py)


def gpu_overrides(root: Path, out: Path) -> list[str]:
    """main_ppo's command line on one GPU: the mlite engine in bf16, verl's vLLM rollout (its server, with
    random weights until the first sync: load_format dummy) sharing the GPU, its log-probs returned."""
    return [*common_overrides(root, out, 1),
            "actor_rollout_ref.actor.mlite.device=cuda",
            "actor_rollout_ref.actor.mlite.dtype=bfloat16",
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
            "actor_rollout_ref.rollout.enforce_eager=true",
            "actor_rollout_ref.rollout.load_format=dummy",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
            "trainer.device=cuda"]


def common_overrides(root: Path, out: Path, ranks: int) -> list[str]:
    from mlite.integrations.verl import reward

    per_rank = PROMPTS * GROUP // ranks

    return [
        f"hydra.searchpath=[{CONFIG_SEARCHPATH}]",
        "model_engine=mlite",
        "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.model.path={root / 'model'}",
        f"data.train_files=[{root / 'train.parquet'}]",
        f"data.val_files=[{root / 'train.parquet'}]",
        f"data.train_batch_size={PROMPTS}",
        "data.max_prompt_length=32",
        "data.max_response_length=8",
        "data.dataloader_num_workers=0",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={per_rank}",
        "actor_rollout_ref.actor.use_dynamic_bsz=false",
        "actor_rollout_ref.actor.use_kl_loss=true",  # the reference policy runs on the mlite engine too
        "actor_rollout_ref.actor.kl_loss_coef=0.01",
        "actor_rollout_ref.actor.use_torch_compile=false",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={per_rank}",
        f"actor_rollout_ref.rollout.n={GROUP}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={per_rank}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "reward.num_workers=1",
        f"reward.custom_reward_function.path={reward.__file__}",
        f"trainer.n_gpus_per_node={ranks}",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={STEPS}",
        "trainer.logger=[console,file]",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        f"trainer.save_freq={STEPS}",
        f"trainer.default_local_dir={out / 'ckpt'}",
        "trainer.project_name=mlite",
        "trainer.experiment_name=verl_grpo",
        "ray_kwargs.ray_init.num_cpus=16",  # Ray's scheduling units, not cores: verl starts ~8 actors
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        # a Ray of its own: never join a cluster another test (the Slurm Ray job) has running on this machine
        "+ray_kwargs.ray_init.address=local",
    ]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return write_setup(tmp_path_factory.mktemp("verl_grpo"))


def write_setup(root: Path, **sizes) -> Path:
    """The tiny model (transformers' own files; `sizes`: its config keys) and the prompts' parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokenizer = char_tokenizer(root / "model")
    tiny_hf_qwen3(root / "model", tokenizer, **sizes)
    rows = [
        {
            "data_source": "grpo_helpers:text_reward",  # dense: an untrained model still gets signal
            "prompt": [{"role": "user", "content": f"{a}+{a}?"}],
            "reward_model": {"style": "rule", "ground_truth": str(2 * a)},
            "extra_info": {"index": a},
        }
        for a in range(PROMPTS * STEPS)
    ]
    pq.write_table(pa.Table.from_pylist(rows), root / "train.parquet")
    return root


def test_main_ppo_config_composes_with_the_mlite_actor_ref_and_rollout(setup, tmp_path):
    from hydra import compose, initialize_config_module
    from omegaconf import open_dict
    from verl.utils.config import omega_conf_to_dataclass

    from mlite.integrations.verl.config_schema import MliteActorConfig, MliteEngineConfig

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(
            "ppo_trainer",
            overrides=[*overrides(setup, tmp_path), "actor_rollout_ref.actor.mlite.tensor_parallel_size=2"],
        )
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor, MliteActorConfig) and isinstance(actor.engine, MliteEngineConfig)
    assert (actor.engine.tensor_parallel_size, actor.engine.device, actor.optim.lr) == (2, "cpu", 1e-2)
    # the reference follows the actor's layout and only runs forward; verl's worker renames its batch keys
    # before building it (engine_workers.ActorRolloutRefWorker.init_model), and so does this test
    ref_cfg = cfg.actor_rollout_ref.ref
    with open_dict(ref_cfg):
        ref_cfg.ppo_mini_batch_size = actor.ppo_mini_batch_size
        ref_cfg.ppo_micro_batch_size = ref_cfg.pop("log_prob_micro_batch_size", None)
        ref_cfg.ppo_micro_batch_size_per_gpu = ref_cfg.pop("log_prob_micro_batch_size_per_gpu", None)
        ref_cfg.use_dynamic_bsz = ref_cfg.pop("log_prob_use_dynamic_bsz", False)
        ref_cfg.ppo_max_token_len_per_gpu = ref_cfg.pop("log_prob_max_token_len_per_gpu", None)
    ref = omega_conf_to_dataclass(ref_cfg)
    assert isinstance(ref.engine, MliteEngineConfig)
    assert (ref.engine.tensor_parallel_size, ref.engine.forward_only, ref.engine.dtype) == (
        2,
        True,
        "float32",
    )
    assert cfg.actor_rollout_ref.rollout.name == "mlite" and cfg.critic.strategy == "fsdp"


def test_rollout_layout_other_than_one_rank_per_replica_is_refused():
    from types import SimpleNamespace

    from mlite.integrations.verl.rollout import check_rollout_layout

    check_rollout_layout(
        SimpleNamespace(tensor_model_parallel_size=1, data_parallel_size=1, pipeline_model_parallel_size=1)
    )
    with pytest.raises(ValueError, match=r"rollout.tensor_model_parallel_size=2 .* set actor_rollout_ref"):
        check_rollout_layout(
            SimpleNamespace(
                tensor_model_parallel_size=2, data_parallel_size=1, pipeline_model_parallel_size=1
            )
        )


def run_main_ppo(module: str, args: list[str], tmp_path: Path, **env) -> tuple[list[dict], str]:
    """verl's PPO trainer in its own process; its per-step metrics (verl's file logger) and its log, after
    checking what every GRPO step of the tiny run must show."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
        "VERL_FILE_LOGGER_PATH": str(tmp_path / "metrics.jsonl"),
        "RAY_DEDUP_LOGS": "0",
        **env,
    }
    result = subprocess.run(
        [sys.executable, "-m", module, *args, f"hydra.run.dir={tmp_path / 'hydra'}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=tmp_path,
        check=False,
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]

    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1)), log[-3000:]
    for s in steps:
        data = s["data"]
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/score/mean"):
            assert key in data and math.isfinite(data[key]), (key, data)
        assert 0 < data["response_length/mean"] <= 8
        assert data["actor/grad_norm"] > 0  # rewards differ within the groups: GRPO has a signal
    assert steps[0]["data"]["actor/kl_loss"] == 0  # before any update the actor is the reference
    assert steps[1]["data"]["actor/kl_loss"] > 0  # step 1's update moved the actor away from it
    assert re.search(rf"step:{STEPS}\b", log)
    return steps, log


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_main_ppo_grpo_on_cpu_with_the_mlite_actor_and_rollout(setup, tmp_path, ranks):
    """One training rank, or two (gloo: FSDP2 over dp2 in the mlite engine, two rollout replicas, verl's
    batches split between them)."""
    from safetensors.torch import load_file

    run_main_ppo("mlite.integrations.verl.main_ppo", overrides(setup, tmp_path, ranks), tmp_path,
                 VERL_PLATFORM="cpu")

    # the actor's checkpoint went through the runtime; exported, its weights differ from the initial model
    from mlite.runtime.engine import export_checkpoint

    saved = tmp_path / "ckpt" / f"global_step_{STEPS}" / "actor" / "mlite"
    assert sorted(p.name for p in saved.glob("rank_*.pt")) == [f"rank_{r:05d}.pt" for r in range(ranks)]
    exported = export_checkpoint(saved, tmp_path / "export")
    initial = load_file(setup / "model" / "model.safetensors")
    trained = {}
    for shard in sorted(Path(exported).glob("*.safetensors")):
        trained.update(load_file(shard))
    assert set(trained) == set(initial)
    moved = [name for name in initial if not torch.equal(initial[name], trained[name])]
    assert len(moved) >= len(initial) // 2, moved


@pytest.mark.gpu
@pytest.mark.vllm
def test_main_ppo_grpo_on_one_gpu_with_the_mlite_actor_and_vllm_rollout(tmp_path):
    """verl's own `verl.trainer.main_ppo` on one GPU: the mlite engine trains in bf16 and feeds verl's
    checkpoint engine (`get_per_tensor_param`), verl's vLLM server rolls out on the same GPU and starts
    from random weights (load_format dummy). Its log-probs of its own samples match the actor's forward
    every step, which only the synced, current weights give."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vllm is not installed: on the device machine source scripts/gpu_vllm_env.sh and "
                    "scripts/gpu_verl_env.sh after scripts/gpu_env.sh (or deselect with -m 'not vllm')")
    root = write_setup(tmp_path, **VLLM_SIZES)
    steps, log = run_main_ppo("verl.trainer.main_ppo", gpu_overrides(root, tmp_path / "run"), tmp_path)
    for s in steps:
        data = s["data"]
        shown = {k: round(v, 5) for k, v in sorted(data.items())
                 if k.startswith(("training/rollout", "actor/", "critic/score"))}
        print(f"step {s['step']}: {json.dumps(shown)}")
        assert data["training/rollout_probs_diff_valid"] == 1, data
        assert data["training/rollout_probs_diff_mean"] < 0.01, data  # dummy weights: far larger
        assert data["training/rollout_probs_diff_max"] < 0.5, data
