"""vLLM as the rollout engine, colocated with the trainer on its GPU.

vLLM runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the new weights reach it as the
trainer's own tensors, with no copy through the host or another process. Its memory comes from vLLM's
sleep-mode pool: between rollouts it sleeps at level 2, which discards its weights and KV cache (the next
session re-sends the weights anyway; vLLM keeps its buffers, the rotary tables say, on the host), so
training has the GPU to itself. One session:

1. wake the weights' memory, stream the weights into it (`Runtime.tp_group_weights` in the rollout
   dtype, per tensor in HF names: whole tensors on one process, the rank's slab on several), through
   vLLM's `reload_weights` (each model's own `load_weights`, fusing q/k/v and gate/up as its kernels want);
2. wake the KV cache, generate from token ids (no tokenizer in vLLM: `skip_tokenizer_init`);
3. sleep again and give the memory back.

On several ranks (torchrun), every rank runs one vLLM worker in its own process and vLLM's torchrun
launcher (`distributed_executor_backend="external_launcher"`) ties consecutive groups of `rollout.tp` ranks
into one engine, tensor-parallel over them; the world holds world / rollout.tp engines. Each rank feeds its
worker full-shaped HF tensors holding only the slab its tp rank reads (`Runtime.tp_group_weights`: the
parts of other ranks' pieces that overlap it come point to point; nobody gathers the model). The engines
split each batch of requests (request i to engine i mod engines, its seed unchanged) and one all-gather
gives every rank all completions, the same as one engine generating them all.

The engine is built with `load_format="dummy"` from the runtime's config.json alone: it never reads a
checkpoint, the first session brings the weights. Sampled tokens come back with their log-probs under
logits / temperature (`logprobs_mode="processed_logprobs"`; with top-k / top-p off that is exactly what the
trainer's forward computes), which the trainer compares with its own (`rollout/logprob_diff_*`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from mlite.errors import MliteError
from mlite.runtime.state import rng_state, set_rng_state
from mlite.trainers.grpo.rollout import Completion, SamplingParams

log = logging.getLogger(__name__)


def require_vllm() -> None:
    """The start-up check, before any GPU work: vLLM must be importable where the job runs."""
    if importlib.util.find_spec("vllm") is None:
        from mlite.images.stacks import load_stack

        try:
            pin = load_stack().requirement("vllm")  # the image's (docker/stacks)
        except MliteError:  # no stacks folder where mlite is installed
            pin = "vllm"
        raise MliteError(
            f"rollout.engine vllm needs the vllm package, which is not installed here; install the image's "
            f"pin (pip install {pin}, or run in the mlite image), or use rollout.engine builtin"
        )


class VLLMRollout:
    name = "vllm"

    def __init__(self, job, runtime, model_dir: str | Path):
        require_vllm()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weights pass as tensors
        from vllm import LLM

        from mlite.runtime.ckpt.hf import write_hf_config
        from mlite.runtime.layout import COMPUTE_DTYPES

        r = job.rollout
        self.runtime = runtime
        self.dtype = COMPUTE_DTYPES[job.precision.compute]
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.world > 1 else 0
        self.tp = r.tp
        model_dir = Path(model_dir) / f"rank{self.rank}"  # each rank its own: no shared file system needed
        model_dir.mkdir(parents=True, exist_ok=True)
        write_hf_config(model_dir / "config.json", runtime.arch, runtime.hf_config, self.dtype)
        config = json.loads((model_dir / "config.json").read_text())
        if config.pop("quantization_config", None) is not None:  # a quantized source (DeepSeek's fp8): the
            # sync sends unquantized tensors in the rollout dtype, so vLLM must build unquantized layers
            (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        several = {}
        if self.world > 1:  # a worker per rank, engines of rollout.tp consecutive ranks (torchrun mode)
            several = {"distributed_executor_backend": "external_launcher", "disable_custom_all_reduce": True}
        started = time.perf_counter()
        streams = rng_state()  # in-process, LLM(seed=...) reseeds the process's generators: keep the run's
        self.llm = LLM(
            model=str(model_dir),
            runner="generate",
            skip_tokenizer_init=True,
            load_format="dummy",
            dtype=str(self.dtype).removeprefix("torch."),
            seed=job.trainer.seed,
            gpu_memory_utilization=r.gpu_memory_utilization,
            max_model_len=r.max_prompt_length + r.max_response_length,
            enable_sleep_mode=True,
            enforce_eager=r.enforce_eager,
            logprobs_mode="processed_logprobs",
            tensor_parallel_size=r.tp,
            **several,
        )
        set_rng_state(streams)
        self.start_s = time.perf_counter() - started
        self.llm.sleep(level=2)
        self.stats: dict[str, float] = {}  # the last session's: sync seconds and bytes, generated tokens

    def load_weights(self) -> None:
        """The trainer's current weights into vLLM, one HF tensor at a time in the rollout dtype, each
        full-shaped with this rank's slab filled (on one process: whole). Collective: vLLM's load_weights
        drains the stream on every rank, in one order."""
        sent = {"tensors": 0, "bytes": 0, "received_bytes": 0}
        started = time.perf_counter()
        weights = self.runtime.tp_group_weights(self.dtype, self.tp, sent)
        with torch.no_grad():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()  # cached prefixes hold the old weights' keys and values
        torch.cuda.synchronize()
        self.stats.update({"time/sync_s": time.perf_counter() - started,
                           "rollout/sync_tensors": float(sent["tensors"]),
                           "rollout/sync_gb": sent["bytes"] / 1e9,
                           "rollout/sync_received_gb": sent["received_bytes"] / 1e9})

    @contextmanager
    def session(self, seed: int) -> Iterator[VLLMSampler]:
        torch.cuda.empty_cache()  # the trainer's cached blocks back to the driver, for vLLM to take
        started = time.perf_counter()
        self.llm.wake_up(tags=["weights"])
        self.load_weights()
        self.llm.wake_up(tags=["kv_cache"])
        self.stats["time/wake_s"] = time.perf_counter() - started - self.stats["time/sync_s"]
        sampler = VLLMSampler(self.llm, seed, engines=self.world // self.tp, engine=self.rank // self.tp,
                              leader=self.rank % self.tp == 0)
        try:
            yield sampler
        finally:
            self.llm.sleep(level=2)
            self.stats["rollout/generated_tokens"] = float(sampler.generated)

    def close(self) -> None:
        del self.llm
        torch.cuda.empty_cache()


class VLLMSampler:
    """Requests from token ids, one per prompt, each with its own seed (the session's seed plus a running
    count), so a resumed run draws what the uninterrupted run drew. With several engines (`engines`, this
    rank's is `engine`), request i goes to engine i mod engines with the seed it would have had on one, and
    every rank gets all completions back."""

    def __init__(self, llm, seed: int, engines: int = 1, engine: int = 0, leader: bool = True):
        self.llm, self.seed, self.requests, self.generated = llm, seed, 0, 0
        self.engines, self.engine, self.leader = engines, engine, leader

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        from vllm import SamplingParams as VLLMParams

        first, self.requests = self.requests, self.requests + len(prompts)
        ours = [i for i in range(len(prompts)) if i % self.engines == self.engine]
        requests = []
        for i in ours:
            prompt = prompts[i]
            requests.append((
                {"prompt_token_ids": list(map(int, prompt))},
                VLLMParams(
                    n=1,
                    temperature=params.temperature,
                    top_p=params.top_p,
                    top_k=params.top_k,
                    max_tokens=params.max_new_tokens,
                    stop_token_ids=list(params.stop_token_ids),
                    ignore_eos=True,  # the stop tokens are exactly ours (EOS among them)
                    logprobs=0,  # the sampled token's log-prob only
                    seed=self.seed * 1_000_003 + first + i,
                    detokenize=False,
                ),
            ))
        outputs = []
        if requests:  # every rank of an engine has the same requests, so its ranks skip (or not) together
            outputs = self.llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
        completions = {}
        for i, output in zip(ours, outputs):
            out = output.outputs[0]
            ids = list(out.token_ids)
            logprobs = [float(step[token].logprob) for step, token in zip(out.logprobs or [], ids)]
            stopped = out.finish_reason == "stop"
            completions[i] = Completion(list(map(int, prompts[i])), ids, stopped, logprobs)
        if self.engines > 1:  # every rank gets every engine's completions, sent by the engine's first rank
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, completions if self.leader else {})
            completions = {i: c for part in everyone for i, c in part.items()}
        self.generated += sum(len(c.response_ids) for c in completions.values())
        return [completions[i] for i in range(len(prompts))]
