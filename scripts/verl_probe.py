"""Check the verl + vLLM bundle on a bare GPU machine: every module imports and a Ray cluster starts.

Probe the verl + vLLM stack on the bare GPU machine: after
`. scripts/gpu_env.sh; . scripts/gpu_vllm_env.sh; . scripts/gpu_verl_env.sh`,

    python3 scripts/verl_probe.py

imports every module that `verl.trainer.main_ppo model_engine=mlite actor_rollout_ref.rollout.name=vllm` loads
(the driver, the TaskRunner, the ActorRolloutRef workers, the vLLM server replicas, the agent loop) and prints
OK or FAIL (with the exception and where it was raised) per module, then starts a local Ray cluster the way
verl does (a runtime_env with env_vars), runs an actor inside a placement group and stops the cluster. One
device call tells what is missing. Exit status: the number of failures.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback

MODULES = [
    # what the machine, .whl/ and the bundles must provide
    "ray",
    "ray.util.collective",
    "ray.util.state",
    "ray.experimental.state.api",
    "hydra",
    "omegaconf",
    "antlr4",
    "tensordict",
    "torchdata.stateful_dataloader",
    "datasets",
    "codetiming",
    "transfer_queue",
    "uvicorn",
    "orjson",
    "watchfiles",
    "model_hosting_container_standards",
    # not in the machine's package list, but vLLM's offline path (which runs there) imports them
    "einops",
    "cpuinfo",
    "setuptools",
    # verl on the main_ppo + vLLM server rollout + agent loop path
    "verl",
    "verl.trainer.main_ppo",
    "verl.trainer.ppo.v1",
    "verl.trainer.ppo.v1.trainer_sync",
    "verl.workers.engine_workers",
    "verl.single_controller.ray",
    "verl.experimental.agent_loop",
    "verl.experimental.agent_loop.single_turn_agent_loop",
    "verl.experimental.agent_loop.tool_agent_loop",
    "verl.workers.rollout.replica",
    "verl.workers.rollout.llm_server",
    "verl.workers.rollout.router",
    "verl.workers.rollout.vllm_rollout",
    "verl.workers.rollout.vllm_rollout.vllm_rollout",
    "verl.workers.rollout.vllm_rollout.vllm_async_server",
    "verl.workers.rollout.vllm_rollout.utils",
    "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer",
    "verl.workers.rollout.vllm_rollout.delta_weight_transfer",
    "verl.utils.vllm",
    # vLLM's server path (verl's replicas run AsyncLLM behind vLLM's OpenAI app)
    "vllm",
    "vllm.entrypoints.cli.serve",
    "vllm.entrypoints.openai.api_server",
    "vllm.entrypoints.serve.instrumentator.metrics",  # imported only when build_app registers routes
    "vllm.entrypoints.serve.sagemaker.api_router",
    "vllm.entrypoints.openai.parser.harmony_utils",
    "vllm.v1.engine.async_llm",
    "vllm.v1.engine.core",
    # mlite's entry points
    "mlite.integrations.verl",
    "mlite.integrations.verl.main_ppo",
]
VERSIONS = ["ray", "verl", "vllm", "torch", "transformers", "hydra", "omegaconf", "tensordict", "datasets",
            "transfer_queue", "uvicorn", "fastapi"]


def where(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename]
    return " <- ".join(f"{f.filename}:{f.lineno}" for f in reversed(frames[-3:]))


def probe_imports() -> int:
    failures = 0
    for name in MODULES:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001  # a probe: report everything, SystemExit included
            failures += 1
            msg = str(exc).splitlines()[0] if str(exc) else ""
            print(f"FAIL {name}: {type(exc).__name__}: {msg}  [{where(exc)}]", flush=True)
        else:
            print(f"OK   {name}", flush=True)
    for name in VERSIONS:
        mod = sys.modules.get(name)
        if mod is not None:
            where_from = os.path.dirname(mod.__file__ or "")
            print(f"     {name} {getattr(mod, '__version__', '?')} from {where_from}")
    return failures


def probe_ray(num_cpus: int) -> int:
    try:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        missing = ray._private.utils.get_dashboard_dependency_error()
        mode = f"missing ({missing}): minimal mode" if missing else "all there"
        print(f"ray: dashboard dependencies: {mode}", flush=True)
        t0 = time.time()
        # as verl.trainer.main_ppo.run_ppo: a runtime_env with env_vars (goes through the runtime-env agent)
        # address="local": a new cluster even where a stale /tmp/ray/ray_current_cluster names another
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "true", "NCCL_DEBUG": "WARN"}})
        print(f"ray: init {time.time() - t0:.1f} s, resources {ray.cluster_resources()}", flush=True)

        @ray.remote(num_cpus=1)
        class Echo:
            def ping(self, x):
                import torch

                return x, os.environ.get("TOKENIZERS_PARALLELISM"), torch.__version__, os.getpid()

        pg = placement_group([{"CPU": 1}], strategy="PACK")
        ray.get(pg.ready(), timeout=120)
        in_pg = PlacementGroupSchedulingStrategy(placement_group=pg)
        actor = Echo.options(scheduling_strategy=in_pg).remote()
        print(f"ray: actor in a placement group: {ray.get(actor.ping.remote(42), timeout=120)}", flush=True)
        ray.kill(actor)
        remove_placement_group(pg)
        ray.shutdown()
        print(f"OK   ray cluster ({time.time() - t0:.1f} s)", flush=True)
        return 0
    except BaseException as exc:  # noqa: BLE001
        print(f"FAIL ray cluster: {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc()
        return 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-cpus", type=int, default=4)
    parser.add_argument("--no-ray", action="store_true", help="imports only")
    args = parser.parse_args()
    failures = probe_imports()
    if not args.no_ray:
        failures += probe_ray(args.num_cpus)
    print(f"verl_probe: {failures} failure(s)")
    return failures


if __name__ == "__main__":
    sys.exit(min(main(), 100))
