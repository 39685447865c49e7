"""The `engine=mlite` config section as verl sees it (a verl `EngineConfig` dataclass).

Each field maps onto one key of mlite's own job config (`to_job_dict`), so a layout means the same thing
under verl and under `mlite sft` / `mlite grpo`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl.workers.config import ActorConfig
from verl.workers.config.engine import EngineConfig


@dataclass
class MliteEngineConfig(EngineConfig):
    strategy: str = "mlite"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_parallel_size: int = 1
    attention_backend: str = "auto"
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "bfloat16"  # compute dtype: bfloat16 | float16 | float32 (master weights stay fp32)
    seed: int = 42
    gc_every: int = 50  # trainer.gc_every: Python's garbage collector every this many steps; 0: Python's own

    def __post_init__(self):
        super().__post_init__()
        if self.strategy != "mlite":
            raise ValueError(f"MliteEngineConfig.strategy must be 'mlite' (got {self.strategy!r})")


@dataclass
class MliteActorConfig(ActorConfig):
    """The actor (and reference) section of main_ppo with model_engine=mlite: verl's actor fields plus the
    `mlite:` engine section, which verl's engine workers read as `.engine`."""

    strategy: str = "mlite"
    mlite: MliteEngineConfig = field(default_factory=MliteEngineConfig)

    def __post_init__(self):
        super().__post_init__()
        self.engine = self.mlite


_COMPUTE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "bf16": "bf16", "fp32": "fp32"}


def to_job_dict(
    engine: MliteEngineConfig,
    model_path: str,
    optim: Any,
    total_steps: int | None = None,
    seq_len: int | None = None,
    world_size: int = 1,
) -> dict[str, Any]:
    """verl's engine + optimizer config -> mlite job dict (validated by `mlite.config.job_from_dict`).

    verl batches the data itself, so the job's `data` section only bounds what verl may hand the engine:
    `seq_len`, the longest sequence (the engine passes the model's max_position_embeddings), and a global
    batch of one sequence per rank, which every data-parallel degree of the world divides (the rule book
    checks it; verl's own batch sizes are verl's)."""
    if engine.dtype not in _COMPUTE:
        raise ValueError(f"engine.dtype {engine.dtype!r}: use one of {', '.join(_COMPUTE)}")
    warmup = optim.lr_warmup_steps if (optim.lr_warmup_steps or -1) >= 0 else 0
    if warmup == 0 and optim.lr_warmup_steps_ratio and total_steps:
        warmup = int(optim.lr_warmup_steps_ratio * total_steps)
    schedule = getattr(optim, "lr_scheduler_type", "constant")
    min_ratio = getattr(optim, "min_lr_ratio", None) or 0.0
    job = {
        "job": "sft",
        "model": {"path": model_path, "attention_backend": engine.attention_backend},
        "parallel": {
            "tp": engine.tensor_parallel_size,
            "pp": engine.pipeline_parallel_size,
            "cp": engine.context_parallel_size,
            "ep": engine.expert_parallel_size,
        },
        "optimizer": {
            "lr": float(optim.lr),
            "min_lr": float(optim.lr) * float(min_ratio),
            "weight_decay": float(optim.weight_decay),
            "betas": tuple(float(b) for b in optim.betas),
            "clip_grad": float(optim.clip_grad),
            "warmup_steps": int(warmup),
            "schedule": schedule,
        },
        "precision": {"compute": _COMPUTE[engine.dtype]},
        "offload": {"params": bool(engine.param_offload), "optimizer": bool(engine.optimizer_offload)},
        "trainer": {
            "seed": int(engine.seed),
            "device": engine.device,
            "steps": max(int(total_steps or 1), 1),
            "gc_every": int(engine.gc_every),
        },
    }
    job["data"] = {"global_batch_size": int(world_size)}
    if seq_len is not None:
        job["data"]["seq_len"] = int(seq_len)
    return job
