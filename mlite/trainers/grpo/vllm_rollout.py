"""vLLM as the rollout engine, colocated with the trainer on its GPU.

vLLM runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the new weights reach it as the
trainer's own tensors, with no copy through the host or another process. Its memory comes from vLLM's
sleep-mode pool: between rollouts it sleeps at level 2, which discards its weights and KV cache (the next
session re-sends the weights anyway; vLLM keeps its buffers, the rotary tables say, on the host), so
training has the GPU to itself. One session:

1. with the trainer offloaded (`rollout.offload_trainer`, the plan's choice under `auto`): its gradients,
   optimizer state and master shards to pinned host memory (`Runtime.offload_to_host`), as verl's hybrid
   engine does, so that vLLM's weights wake beside the trainer's weights alone;
2. wake the weights' memory, stream the weights into it (`Runtime.tp_group_weights` in the rollout
   dtype, per tensor in HF names: whole tensors on one process, the rank's slab on several), through
   vLLM's `reload_weights` (each model's own `load_weights`, fusing q/k/v and gate/up as its kernels want);
   offloaded, the trainer's weights follow the rest to the host now that vLLM holds its own;
3. wake the KV cache, generate from token ids (no tokenizer in vLLM: `skip_tokenizer_init`);
4. sleep again and give the memory back; offloaded, the trainer comes back (bit for bit).

On several ranks (torchrun), every rank runs one vLLM worker in its own process and vLLM's torchrun
launcher (`distributed_executor_backend="external_launcher"`) ties consecutive groups of `rollout.tp` ranks
into one engine, tensor-parallel over them; the world holds world / rollout.tp engines. Each rank feeds its
worker full-shaped HF tensors holding only the slab its tp rank reads (`Runtime.tp_group_weights`: the
parts of other ranks' pieces that overlap it come point to point; nobody gathers the model). Each request
belongs to one data-parallel rank (`Sampler.generate`'s owners): the engines that hold ranks of that dp
rank generate its requests between them (`EngineLayout`), every rank of an engine gets the engine's
completions, and where a dp rank's ranks sit in several engines they exchange its completions among
themselves only. A request's seed is the same whichever engine generates it, so the completions are those
of one engine generating them all.

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
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mlite.errors import MliteError
from mlite.plan.policy import rollout_expert_parallel, vllm_v4_fp8
from mlite.runtime.engine import device_used_gb
from mlite.runtime.state import rng_state, set_rng_state
from mlite.trainers.grpo.rollout import Completion, SamplingParams, request_seed
from mlite.trainers.grpo.vllm_adapter import (
    V4_TRANSFORMERS_ONLY,
    keep_attention_sinks,
    resend_attention_sinks,
    v4_fp8_at_sync_config,
    v4_online_fp8_engine_args,
)

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


# vLLM's switch for DeepGEMM's power-of-two (ue8m0) scales (vllm.utils.deep_gemm.is_deep_gemm_e8m0_used),
# which its per-token-group FP8 quantiser follows
E8M0_ENV = "VLLM_USE_DEEP_GEMM_E8M0"


def keep_e8m0_scales(match_fp8: bool) -> None:
    """Under rollout.match_fp8 the trainer rounds activations with power-of-two scales
    (mlite.runtime.fp8_match), as vLLM's quantiser does while DeepGEMM's E8M0 scales are on: keep them on
    (vLLM's default), and refuse a process that turned them off."""
    if not match_fp8:
        return
    if os.environ.get(E8M0_ENV, "1") == "0":
        raise MliteError(f"rollout.match_fp8 rounds activations with power-of-two scales, as vLLM's DeepGEMM "
                         f"E8M0 scales do, and {E8M0_ENV}=0 turns them off; unset it, or remove "
                         "rollout.match_fp8")
    os.environ[E8M0_ENV] = "1"


class VLLMRollout:
    name = "vllm"

    def __init__(self, job, runtime, model_dir: str | Path):
        keep_e8m0_scales(job.rollout.match_fp8)
        require_vllm()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weights pass as tensors
        from vllm import LLM

        from mlite.runtime.layout import COMPUTE_DTYPES

        r = job.rollout
        self.runtime = runtime
        self.offload = runtime.job.rollout.offload_trainer is True  # the plan's job: `auto` resolved
        self.dtype = COMPUTE_DTYPES[job.precision.compute]
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.world > 1 else 0
        self.tp = r.tp
        self.expert_parallel = rollout_expert_parallel(runtime.job, runtime.arch)  # whole experts per rank
        model_dir = Path(model_dir) / f"rank{self.rank}"  # each rank its own: no shared file system needed
        model_dir.mkdir(parents=True, exist_ok=True)
        # DeepSeek-V4: what vLLM keeps in float32 goes unrounded, wo_a (or every release-FP8 linear and the
        # experts) as FP8, or vLLM quantises wo_a itself; its KV cache is fp8 (FlashMLA's fp8_ds_mla)
        self.v4_fp8 = vllm_v4_fp8(runtime.job, runtime.arch)
        quantization = write_engine_config(model_dir / "config.json", runtime, self.dtype, self.v4_fp8)
        if self.v4_fp8 is not None:
            quantization["kv_cache_dtype"] = "fp8"
        dp_of = [runtime.dp_rank] * self.world  # the dp rank of every rank: which requests each one needs
        if self.world > 1:
            dist.all_gather_object(dp_of, runtime.dp_rank)
        self.layout = EngineLayout(tuple(dp_of), self.tp)
        # a dp rank whose ranks sit in several engines shares its completions over its ranks' group
        self.cell = None
        if any(len(self.layout.engines_of(d)) > 1 for d in set(dp_of)):
            self.cell, _ = dist.new_subgroups_by_enumeration(
                [[r for r, d in enumerate(dp_of) if d == dp] for dp in sorted(set(dp_of))])
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
            enable_expert_parallel=self.expert_parallel,
            **several,
            **quantization,
        )
        set_rng_state(streams)
        self.start_s = time.perf_counter() - started
        self.llm.sleep(level=2)
        self.stats: dict[str, float] = {}  # the last session's: sync seconds and bytes, generated tokens

    def load_weights(self) -> None:
        """The trainer's current weights into vLLM in the rollout dtype: every HF tensor full-shaped with
        this rank's slab filled (on one process: whole), moved between ranks one batch per bucket of
        tensors. Collective: vLLM's load_weights drains the stream on every rank, in one order. DeepSeek-V4:
        vLLM's float32 parameters in float32, its FP8 weights as FP8 (`vllm_v4_fp8`), and the attention
        sinks, which vLLM's reload drops, set again after it (mlite.trainers.grpo.vllm_adapter)."""
        sent = {"tensors": 0, "buckets": 0, "bytes": 0, "received_bytes": 0}
        started = time.perf_counter()
        weights = self.runtime.tp_group_weights(self.dtype, self.tp, sent, self.expert_parallel, self.v4_fp8)
        sinks: dict[str, torch.Tensor] = {}  # DeepSeek-V4's, set again after the reload (vllm_adapter)
        if self.v4_fp8 is not None:
            weights = keep_attention_sinks(weights, sinks)
        with torch.no_grad():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        resend_attention_sinks(self.llm, sinks)
        self.llm.reset_prefix_cache()  # cached prefixes hold the old weights' keys and values
        torch.cuda.synchronize()
        self.stats.update({"time/sync_s": time.perf_counter() - started,
                           "rollout/sync_tensors": float(sent["tensors"]),
                           "rollout/sync_buckets": float(sent["buckets"]),
                           "rollout/sync_gb": sent["bytes"] / 1e9,
                           "rollout/sync_received_gb": sent["received_bytes"] / 1e9})

    @contextmanager
    def session(self, seed: int) -> Iterator[VLLMSampler]:
        self.stats = {}
        moved, offload_s = 0, 0.0
        if self.offload:  # the optimizer's part first: the sync still reads the weights
            started = time.perf_counter()
            moved += self.runtime.offload_to_host(weights=False, grads=True, optimizer=True)
            offload_s += time.perf_counter() - started
        torch.cuda.empty_cache()  # the trainer's cached blocks back to the driver, for vLLM to take
        started = time.perf_counter()
        self.llm.wake_up(tags=["weights"])
        wake_s = time.perf_counter() - started
        self.load_weights()
        # the sync's peak: vLLM's weights and the trainer's
        self.stats["memory/sync_gb"] = device_used_gb(self.runtime.device)
        if self.offload:
            started = time.perf_counter()
            moved += self.runtime.offload_to_host(weights=True, grads=False, optimizer=False)
            offload_s += time.perf_counter() - started
        started = time.perf_counter()
        self.llm.wake_up(tags=["kv_cache"])
        self.stats["time/wake_s"] = wake_s + time.perf_counter() - started
        self.stats["memory/rollout_gb"] = device_used_gb(self.runtime.device)
        sampler = VLLMSampler(self.llm, seed, self.layout, self.rank, self.cell)
        try:
            yield sampler
        finally:
            self.llm.sleep(level=2)
            self.stats["rollout/generated_tokens"] = float(sampler.generated)
            if self.offload:
                started = time.perf_counter()
                self.runtime.reload_to_device()
                torch.cuda.synchronize()
                reload_s = time.perf_counter() - started
                self.stats.update({"time/offload_s": offload_s, "time/reload_s": reload_s,
                                   "offload/gb": moved / 1e9,
                                   "offload/gb_per_s": moved / 1e9 / max(offload_s, 1e-9),
                                   "offload/reload_gb_per_s": moved / 1e9 / max(reload_s, 1e-9)})

    def close(self) -> None:
        del self.llm
        torch.cuda.empty_cache()


def write_engine_config(path: Path, runtime, dtype: torch.dtype, v4_fp8: str | None) -> dict:
    """The config.json vLLM builds its engine from, at `path`, and the LLM(...) quantization arguments.
    A quantized source's quantization_config (DeepSeek's fp8) goes: the sync sends the weights unquantized,
    so vLLM builds unquantized layers, except DeepSeek-V4's FP8 ones (`v4_fp8`, mlite.plan.policy
    .vllm_v4_fp8): "wo_a" or "linears" build them as block-FP8 linears the sync fills, "online" has vLLM
    quantise wo_a itself (mlite.trainers.grpo.vllm_adapter)."""
    from mlite.runtime.ckpt.hf import write_hf_config

    write_hf_config(path, runtime.arch, runtime.hf_config, dtype)
    config = json.loads(path.read_text())
    config.pop("quantization_config", None)
    if v4_fp8 is not None:  # vLLM reads DeepSeek's release form; the transformers form beside it is
        for key in V4_TRANSFORMERS_ONLY:  # refused by newer transformers' strict config check
            config.pop(key, None)
    if v4_fp8 in ("wo_a", "linears"):
        config = v4_fp8_at_sync_config(config, runtime.arch.num_layers, linears=v4_fp8 == "linears")
    path.write_text(json.dumps(config, indent=2) + "\n")
    return v4_online_fp8_engine_args() if v4_fp8 == "online" else {}


@dataclass(frozen=True)
class EngineLayout:
    """Which engine generates each request. Engine e is ranks e*tp .. e*tp + tp - 1; `dp_of[r]` is rank r's
    data-parallel rank. A request owned by dp rank d goes to one of the engines holding ranks of d, in
    turn; a request every rank needs (owner None) to any engine, in turn."""

    dp_of: tuple[int, ...]
    tp: int

    def engines_of(self, dp: int | None) -> list[int]:
        """The engines holding ranks of data-parallel rank `dp` (None: all engines)."""
        ranks = [r for r, d in enumerate(self.dp_of) if dp is None or d == dp]
        return sorted({r // self.tp for r in ranks})

    def assign(self, owners: Sequence[int | None]) -> list[int]:
        """The engine of each request."""
        turns: dict[int | None, int] = {}
        engines = []
        for owner in owners:
            choices = self.engines_of(owner)
            turn = turns.get(owner, 0)
            turns[owner] = turn + 1
            engines.append(choices[turn % len(choices)])
        return engines


class VLLMSampler:
    """Requests from token ids, one per prompt, each with its own seed (the session's seed plus a running
    count, `request_seed`), so a resumed run draws what the uninterrupted run drew, on any engine. This
    rank's engine generates the requests `layout` gives it, and this rank returns those its dp rank owns."""

    def __init__(self, llm, seed: int, layout: EngineLayout | None = None, rank: int = 0, cell=None):
        self.llm, self.seed, self.requests, self.generated = llm, seed, 0, 0
        self.layout, self.rank, self.cell = layout or EngineLayout((0,), 1), rank, cell

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 owners: Sequence[int | None] | None = None) -> list[Completion]:
        first, self.requests = self.requests, self.requests + len(prompts)
        engine, dp = self.rank // self.layout.tp, self.layout.dp_of[self.rank]
        # every rank needs every request (owners None), or its dp rank's
        mine = None if owners is None else dp
        owners = [None] * len(prompts) if owners is None else list(owners)
        ours = [i for i, e in enumerate(self.layout.assign(owners)) if e == engine]
        completions = self._generate(prompts, params, ours, first)
        wanted = [i for i, owner in enumerate(owners) if owner == mine]
        if len(self.layout.engines_of(mine)) > 1:  # other engines generate some of them: exchange
            group = self.cell if mine is not None else None  # the dp rank's ranks, or the world
            parts: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(parts, {i: c for i, c in completions.items() if owners[i] == mine},
                                   group=group)
            completions = {i: c for part in parts for i, c in part.items()}
        self.generated += sum(len(completions[i].response_ids) for i in wanted)
        return [completions[i] for i in wanted]

    def _generate(self, prompts, params: SamplingParams, ours: list[int],
                  first: int) -> dict[int, Completion]:
        """The requests `ours` on this rank's engine (every rank of an engine has the same, so its ranks
        skip together)."""
        from vllm import SamplingParams as VLLMParams

        if not ours:
            return {}
        requests = [VLLMParams(n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                               max_tokens=params.max_new_tokens, stop_token_ids=list(params.stop_token_ids),
                               ignore_eos=True,  # the stop tokens are exactly ours (EOS among them)
                               logprobs=0,  # the sampled token's log-prob only
                               seed=request_seed(self.seed, first + i), detokenize=False) for i in ours]
        inputs = [{"prompt_token_ids": list(map(int, prompts[i]))} for i in ours]
        outputs = self.llm.generate(inputs, requests, use_tqdm=False)
        completions = {}
        for i, output in zip(ours, outputs):
            out = output.outputs[0]
            ids = list(out.token_ids)
            logprobs = [float(step[token].logprob) for step, token in zip(out.logprobs or [], ids)]
            stopped = out.finish_reason == "stop"
            completions[i] = Completion(list(map(int, prompts[i])), ids, stopped, logprobs)
        return completions
