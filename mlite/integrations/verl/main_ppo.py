"""verl's PPO/GRPO trainer (`verl.trainer.main_ppo`) with process-group setup that also works on CPU.

verl's training workers join the process group with "cpu:gloo,<device>:<backend>", which torch refuses when
the device is the CPU ("Duplicate device type cpu"; the same reason `sft_trainer.py` exists). This entry
point is verl's Hydra program (verl's config, verl's synchronous v1 trainer, verl's agent loops) with one
difference: its workers join plain gloo first, and verl then finds the group initialised. It swaps the worker
classes the way verl's own separate-async trainer does (`adapter.WorkerClassSwap`). On GPUs use verl's
module; both accept the same arguments:

    python -m mlite.integrations.verl.main_ppo hydra.searchpath=[pkg://mlite.integrations.verl.config] \
        model_engine=mlite actor_rollout_ref.rollout.name=mlite trainer.device=cpu \
        +ray_kwargs.ray_init.num_gpus=1 ...
"""

from __future__ import annotations

import os

import ray
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

from mlite.integrations.verl.adapter import WorkerClassSwap
from mlite.integrations.verl.platform_cpu import join_gloo


class CpuActorRolloutRefWorker(ActorRolloutRefWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)  # sets the rank environment; joins nothing yet
        join_gloo()


class CpuTrainingWorker(TrainingWorker):
    def __init__(self, *args, **kwargs):
        join_gloo()  # verl's __init__ joins first thing
        super().__init__(*args, **kwargs)


class CpuPPOTrainerSync(WorkerClassSwap, PPOTrainerSync):
    """verl's synchronous trainer whose workers join gloo."""

    def swap_worker_class(self, actor_class):
        cpu_class = CpuTrainingWorker if "TrainingWorker" in str(actor_class) else CpuActorRolloutRefWorker
        return ray.remote(cpu_class)


@ray.remote
class CpuTaskRunner:
    """verl's TaskRunnerV1 (verl/trainer/main_ppo.py) with the CPU trainer; the same steps in the same
    order."""

    def run(self, config) -> None:
        import transfer_queue as tq
        from omegaconf import OmegaConf
        from verl.trainer.ppo.v1 import AgentLoopManagerTQ
        from verl.utils.logging_utils import configure_verl_logging

        configure_verl_logging()
        if config.trainer.v1.trainer_mode != "sync":
            raise ValueError(
                f"trainer.v1.trainer_mode={config.trainer.v1.trainer_mode} on the CPU: this entry point runs "
                "verl's sync trainer only; set trainer.v1.trainer_mode=sync"
            )
        config.transfer_queue.enable = True
        OmegaConf.resolve(config)
        tq.init(config.transfer_queue)
        trainer = None
        succeeded = False
        try:
            trainer = CpuPPOTrainerSync(config=config)
            trainer.init()
            manager = AgentLoopManagerTQ.create(
                config=config,
                llm_client=trainer.get_llm_client(),
                teacher_client=trainer.get_teacher_client(),
                reward_loop_worker_handles=trainer.get_reward_handles(),
            )
            trainer.fit(manager)
            succeeded = True
        finally:
            try:
                tracking = getattr(trainer, "logger", None)
                if tracking is not None:
                    tracking.finish(exit_code=0 if succeeded else 1)
            finally:
                tq.close()


def main() -> None:
    os.environ.setdefault("VERL_PLATFORM", "cpu")  # only this entry point's purpose; GPUs use verl's module
    import hydra
    from verl.trainer.main_ppo import run_ppo
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    import mlite.integrations.verl  # noqa: F401  (registers engine=mlite, rollout=mlite, the cpu platform)

    @hydra.main(config_path="pkg://verl.trainer.config", config_name="ppo_trainer", version_base=None)
    def run(config) -> None:
        validate_config(
            config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config)
        )
        run_ppo(config, task_runner_class=CpuTaskRunner)

    run()


if __name__ == "__main__":
    main()
