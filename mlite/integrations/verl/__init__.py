"""mlite as a verl training engine (`engine=mlite`).

`import verl` imports `mlite.integrations.verl.plugin` (our `verl.plugins` entry point), which calls
`register`: it registers the
`mlite` backend for language models in verl's `EngineRegistry`, the built-in rollout as verl's `mlite`
rollout (`rollout.py`) and a `cpu` platform (selected only with `VERL_PLATFORM=cpu`). The Hydra config
ships in `mlite/integrations/verl/config`:

    python -m verl.trainer.sft_trainer hydra.searchpath=[pkg://mlite.integrations.verl.config] \
        engine=mlite ...
    python -m verl.trainer.main_ppo hydra.searchpath=[pkg://mlite.integrations.verl.config] \
        model_engine=mlite actor_rollout_ref.rollout.name=mlite ...

Nothing here patches verl: its registries are its extension points. The one table verl 0.9.1 offers no
register function for (the rollout classes) is written by `adapter.py`, with verl's other private names.
"""

from __future__ import annotations

CONFIG_SEARCHPATH = "pkg://mlite.integrations.verl.config"
BACKEND = "mlite"
_registered = False


def register() -> None:
    """Register the engine and the cpu platform with verl; idempotent."""
    global _registered
    if _registered:
        return
    from verl.plugin.platform.platform_manager import PlatformRegistry

    from mlite.integrations.verl.platform_cpu import PlatformCPU

    # the platform first: importing verl's engine modules already asks for the current platform
    PlatformRegistry.register(platform="cpu")(PlatformCPU)

    from verl.workers.engine.base import EngineRegistry

    from mlite.integrations.verl.engine import MliteEngineWithLMHead

    EngineRegistry.register(model_type="language_model", backend=BACKEND, device=["cuda", "cpu"])(
        MliteEngineWithLMHead
    )

    # the built-in rollout (rollout.name=mlite): the replica (server side) in verl's replica registry, the
    # adapter (training side) in verl's rollout-class table, a plain dict that has no register function
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from mlite.integrations.verl.adapter import register_rollout_class

    RolloutReplicaRegistry.register(BACKEND, _load_replica)
    register_rollout_class(BACKEND, "async", "mlite.integrations.verl.rollout.MliteServerAdapter")
    _registered = True


def _load_replica():
    from mlite.integrations.verl.rollout import MliteReplica

    return MliteReplica


def is_registered() -> bool:
    return _registered


# Importing this package registers (so `import mlite.integrations.verl.engine` before `import verl` works
# too): verl's plug-in discovery may run while one of our modules is half-imported, and it only logs
# a failure at debug level.
register()
