"""mlite's built-in rollout as a verl rollout backend (`actor_rollout_ref.rollout.name=mlite`).

verl's PPO trainers generate through rollout *servers*: a `RolloutReplica` starts one server actor per
replica, verl's agent loops send it one `generate(prompt_ids, sampling_params)` request per sample, and
after each update the actor's engine pushes its weights through a `BaseRollout` adapter that lives in the
training process. vLLM, SGLang and TensorRT-LLM fill these three roles with HTTP servers; here they are:

- `MliteRolloutServer`: a Ray actor holding a plain copy of the model (`mlite.runtime.models`). Requests
  that arrive together are decoded together by `mlite.trainers.grpo.rollout.generate` (batched KV-cache
  sampling, the same code `mlite grpo` rolls out with), grouped by their sampling parameters.
- `MliteReplica`: starts that actor on the node of the replica's first training rank (hybrid engine only:
  rollout and training share the devices and take turns).
- `MliteServerAdapter`: in each training rank; walks the engine's HF-named weight stream (every rank, since
  sharded parameters are gathered collectively) and the replica's first rank sends it to the server.

A replica is one rank (rollout tensor/pipeline/data parallel 1): our sampler decodes a whole model.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import ray
import torch
from verl.utils.device import get_resource_name
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, TokenOutput

from mlite.runtime.ckpt.hf import load_hf_tensors
from mlite.trainers.grpo.rollout import SamplingParams, generate

NAME = "mlite"
BATCH_WINDOW_S = 0.05  # how long a request waits for the rest of its step's requests to batch with


def server_name(replica_rank: int) -> str:
    """The server's Ray actor name, unique per Ray job (a driver may run several trainers in turn)."""
    return f"mlite_rollout_{ray.get_runtime_context().get_job_id()}_{replica_rank}"


def check_rollout_layout(config) -> None:
    """The built-in sampler decodes a whole model in one process: one rank per replica."""
    sizes = {
        "tensor_model_parallel_size": config.tensor_model_parallel_size,
        "data_parallel_size": config.data_parallel_size,
        "pipeline_model_parallel_size": config.pipeline_model_parallel_size,
    }
    wrong = {k: v for k, v in sizes.items() if v != 1}
    if wrong:
        key, value = next(iter(wrong.items()))
        raise ValueError(
            f"actor_rollout_ref.rollout.{key}={value} with rollout.name=mlite: the built-in rollout "
            f"decodes a whole model per rank; set actor_rollout_ref.rollout.{key}=1 "
            "(or use rollout.name=vllm)"
        )


def stop_ids_of(model_config) -> tuple[int, ...]:
    """EOS and end-of-turn tokens (as `mlite grpo` stops), plus the generation config's EOS ids."""
    from mlite.trainers.grpo.trainer import stop_token_ids

    ids = set(stop_token_ids(model_config.tokenizer))
    eos = getattr(getattr(model_config, "generation_config", None), "eos_token_id", None)
    ids.update([eos] if isinstance(eos, int) else (eos or []))
    return tuple(sorted(ids))


class MliteRolloutServer:
    """One replica's generation server (wrapped by `ray.remote` in `MliteReplica`)."""

    def __init__(self, config, model_config, replica_rank: int, cuda_visible_devices: str | None = None):
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig

        from mlite.config.arch import arch_from_hf_config
        from mlite.runtime.ckpt.hf import load_hf_weights
        from mlite.runtime.models import build_model

        if cuda_visible_devices:  # the GPU of the replica's training rank (set before CUDA starts)
            os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        model_config = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.config = config
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        # like the runtime: fp32 on CPU, the rollout dtype on GPUs
        self.dtype = getattr(torch, config.dtype) if self.device.type == "cuda" else torch.float32
        path = model_config.local_path
        arch = arch_from_hf_config(json.loads((Path(path) / "config.json").read_text()))
        self.model = build_model(arch, dtype=torch.float32, device=self.device)
        load_hf_weights(self.model, path)
        self.model.to(self.dtype).eval()
        self.stop_ids = stop_ids_of(model_config)
        self.pad_id = model_config.tokenizer.pad_token_id or 0
        self.generator = torch.Generator(self.device).manual_seed(int(config.seed) + replica_rank)
        self._pending: list[tuple[list[int], SamplingParams, asyncio.Future]] = []
        self._batching: asyncio.Task | None = None
        self._model_lock = asyncio.Lock()  # no weight update or offload in the middle of a batch
        self.global_steps = 0  # the trainer step whose weights the model holds (verl tags samples with it)

    # ------------------------------------------------------------------------------------ generation
    def sampling_params(self, prompt_len: int, request: dict[str, Any]) -> SamplingParams:
        """verl's per-request sampling dict -> ours. The response budget defaults as verl's vLLM server's."""
        request = dict(request)
        if float(request.pop("repetition_penalty", 1.0)) != 1.0:
            raise ValueError("repetition_penalty is not supported by rollout.name=mlite; leave it at 1.0")
        if request.pop("logprobs", False):
            raise ValueError(
                "rollout.calculate_log_probs=true with rollout.name=mlite: the built-in rollout returns no "
                "log-probs; set actor_rollout_ref.rollout.calculate_log_probs=false"
            )
        budget = request.pop("max_tokens", None) or request.pop("max_new_tokens", None)
        if budget is None:
            budget = min(
                self.config.response_length,
                self.config.prompt_length + self.config.response_length - prompt_len,
            )
        top_k = int(request.get("top_k", -1) or -1)
        return SamplingParams(
            max_new_tokens=max(1, int(budget)),
            temperature=float(request.get("temperature", 1.0)),
            top_p=float(request.get("top_p", 1.0)),
            top_k=max(top_k, 0),  # verl's -1 (off) is our 0
            stop_token_ids=self.stop_ids,
        )

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data=None,
        video_data=None,
        **kwargs,
    ) -> TokenOutput:
        if image_data or video_data or kwargs.get("audio_data"):
            raise ValueError(
                "rollout.name=mlite generates text only; use rollout.name=vllm for multimodal data"
            )
        params = self.sampling_params(len(prompt_ids), sampling_params)
        future = asyncio.get_running_loop().create_future()
        self._pending.append((list(prompt_ids), params, future))
        if self._batching is None or self._batching.done():
            self._batching = asyncio.create_task(self._run_batches())
        response_ids, stopped = await future
        return TokenOutput(
            token_ids=response_ids,
            stop_reason="completed" if stopped else "length",
            extra_fields={"global_steps": self.global_steps},
        )

    async def _run_batches(self) -> None:
        while self._pending:
            await asyncio.sleep(BATCH_WINDOW_S)
            batch, self._pending = self._pending, []
            groups = defaultdict(list)  # one decode per distinct set of sampling parameters
            for item in batch:
                groups[item[1]].append(item)
            for params, items in groups.items():
                prompts = [prompt for prompt, _, _ in items]
                try:
                    async with self._model_lock:
                        done = await asyncio.to_thread(
                            generate, self.model, prompts, params, self.generator, self.pad_id
                        )
                except Exception as err:  # noqa: BLE001 - handed to every waiting request
                    for *_, future in items:
                        future.set_exception(err)
                    continue
                for (*_, future), completion in zip(items, done):
                    future.set_result((completion.response_ids, completion.stopped))

    # ----------------------------------------------------------------------------- weights & memory
    async def update_weights(self, tensors: dict[str, torch.Tensor], global_steps: int | None = None) -> None:
        async with self._model_lock:
            load_hf_tensors(self.model, tensors)
            if global_steps is not None:
                self.global_steps = int(global_steps)

    async def wake_up(self) -> None:
        async with self._model_lock:
            self.model.to(self.device)

    async def sleep(self) -> None:
        """Give the device memory back to training between rollouts (GPUs only; a no-op on the CPU)."""
        if self.device.type == "cuda":
            async with self._model_lock:
                self.model.to("cpu")
                torch.cuda.empty_cache()

    # no paged KV cache (each batch allocates its own) and no request queue to abort: nothing to do
    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        return None

    async def resume_generation(self) -> None:
        return None

    async def start_profile(self, **kwargs) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


class MliteReplica(RolloutReplica):
    """One `MliteRolloutServer` on the node (and device) of the replica's training rank."""

    async def launch_servers(self):
        check_rollout_layout(self.config)
        if self.rollout_mode != RolloutMode.HYBRID:
            raise ValueError(
                "rollout.name=mlite runs colocated with the actor (hybrid engine), "
                f"not in {self.rollout_mode.value} mode; set actor_rollout_ref.hybrid_engine=true and "
                "trainer.v1.trainer_mode=sync"
            )
        worker = self.workers[0]
        node_id, devices = await worker.__ray_call__.remote(
            lambda _: (
                ray.get_runtime_context().get_node_id(),
                ray.get_runtime_context().get_accelerator_ids().get(get_resource_name(), []),
            )
        )
        from verl.plugin.platform import get_platform

        server = (
            ray.remote(MliteRolloutServer)
            .options(
                scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                    node_id=node_id, soft=False
                ),
                # the server shares the rank's device (set below), so Ray must not hide it
                runtime_env={"env_vars": {var: "1" for var in get_platform().ray_noset_envvars()}},
                num_cpus=0,
                name=server_name(self.replica_rank),
                max_concurrency=self.max_concurrency,
            )
            .remote(
                config=self.config,
                model_config=self.model_config,
                replica_rank=self.replica_rank,
                cuda_visible_devices=",".join(map(str, devices)) if torch.cuda.is_available() else None,
            )
        )
        await server.__ray_ready__.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"mlite-rollout-{self.replica_rank}"  # the load balancer's key; no HTTP


class MliteServerAdapter(BaseRollout):
    """In every training rank: hands the engine's weights to the replica's server and wakes it."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        check_rollout_layout(self.config)
        rank = int(os.environ["RANK"])
        self.replica_rank = rank if replica_rank == -1 else replica_rank  # one rank per replica
        self._server = None

    def server(self):
        if self._server is None:  # created after the training engines, so looked up lazily
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]):
        if "weights" in tags:
            await self.server().wake_up.remote()

    async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs):
        if wire_format != "named_tensors":
            raise ValueError(
                f"rollout.name=mlite takes full named tensors, not {wire_format!r} weight updates"
            )
        # every rank walks the stream (sharded parameters are gathered collectively); copies go to the host
        # so the server can sit anywhere on the node
        tensors = {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights}
        await self.server().update_weights.remote(tensors, kwargs.get("global_steps"))

    async def release(self):
        await self.server().sleep.remote()
