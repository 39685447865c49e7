"""Rollout engines, and the built-in one: batched sampling on our own model with its KV cache.

An engine is used through a session: `with engine.session(seed) as sampler: sampler.generate(...)`. The
session is where an engine makes the current weights its own and gives its memory back afterwards: the
built-in engine takes the runtime's rollout model (the model itself on one process); vLLM
(`mlite.trainers.grpo.vllm_rollout`) wakes, receives the weights and sleeps again. One seed per session
fixes every sample drawn in it: request i of a session draws on its own stream (the session's seed, the
requests before it, i), so what it draws does not depend on which rank generates it or beside what.

Under data parallel, each rank needs the completions of its own prompts only: `generate(prompts, params,
owners)` takes the call's whole list (every rank has it) and which data-parallel rank needs each request,
and returns this rank's, in order. The built-in engine generates exactly those.

The built-in sampler: prompts of different lengths are prefilled as one right-padded batch (cache slot p
holds position p of its row, so no shifting), then every row advances one token per step. A row finishes
at a stop token (kept in the response: the policy learns to stop) or at `max_new_tokens`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch

from mlite.trainers.grpo.sampling import sample


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class Completion:
    prompt_ids: list[int]
    response_ids: list[int]
    stopped: bool  # ended with a stop token (else cut at max_new_tokens)
    # the sampler's log-prob of each response token under logits / temperature (1 when greedy), which is
    # what the trainer's forward computes for the same token: their difference is the rollout mismatch
    logprobs: list[float] = field(default_factory=list)


@torch.no_grad()
def generate(
    model,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    pad_id: int = 0,
) -> list[Completion]:
    """Sample one response per prompt (repeat a prompt n times for a GRPO group); `generator`: one for the
    batch or one per prompt (`sample`)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt and no empty prompt")
    device = next(model.parameters()).device
    rows, longest = len(prompts), max(len(p) for p in prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    input_ids = torch.full((rows, longest), pad_id, dtype=torch.long, device=device)
    positions = torch.full((rows, longest), -1, dtype=torch.long, device=device)  # -1: padding
    for i, prompt in enumerate(prompts):
        input_ids[i, : len(prompt)] = torch.tensor(list(prompt), device=device)
        positions[i, : len(prompt)] = torch.arange(len(prompt), device=device)

    cache = model.new_kv_cache(rows, longest + params.max_new_tokens)
    # the prefill's logits at each row's last prompt token only: [B, longest, V] would not fit at scale
    next_logits = model.decode(input_ids, positions, cache, last_only=True)[:, 0]
    stop_ids = torch.tensor(params.stop_token_ids or [-1], device=device)
    responses = torch.full((rows, params.max_new_tokens), pad_id, dtype=torch.long, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    stopped = torch.zeros(rows, dtype=torch.bool, device=device)
    response_len = torch.zeros(rows, dtype=torch.long, device=device)
    logprobs = torch.zeros(rows, params.max_new_tokens, dtype=torch.float32, device=device)
    scale = params.temperature if params.temperature > 0 else 1.0
    for step in range(params.max_new_tokens):
        token = sample(next_logits, params.temperature, params.top_k, params.top_p, generator)
        token = torch.where(done, torch.full_like(token, pad_id), token)
        responses[:, step] = token
        scaled = torch.log_softmax(next_logits.float() / scale, -1)
        logprobs[:, step] = scaled.gather(-1, token[:, None]).squeeze(1)
        response_len += (~done).long()
        hit_stop = torch.isin(token, stop_ids) & ~done
        stopped |= hit_stop
        done |= hit_stop
        if bool(done.all()) or step == params.max_new_tokens - 1:
            break
        # finished rows keep decoding padding (their outputs are ignored): one batch shape, no NaN rows
        next_logits = model.decode(token[:, None], (lengths + step)[:, None], cache)[:, 0]

    return [
        Completion(
            list(map(int, prompts[i])),
            responses[i, : int(response_len[i])].tolist(),
            bool(stopped[i]),
            logprobs[i, : int(response_len[i])].tolist(),
        )
        for i in range(rows)
    ]


class Sampler(Protocol):
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 owners: Sequence[int] | None = None) -> list[Completion]:
        """The completions of the requests this rank's data-parallel rank owns (`owners[i]`: the dp rank of
        request i; None: every request), in order."""
        ...


class RolloutEngine(Protocol):
    name: str
    stats: dict[str, float]  # the last session's figures, logged with the step's metrics

    def session(self, seed: int) -> AbstractContextManager[Sampler]: ...

    def close(self) -> None: ...


def request_seed(session_seed: int, index: int) -> int:
    """The seed of a session's request `index` (counted over the session's calls), for every engine."""
    return session_seed * 1_000_003 + index


@dataclass
class ModelSampler:
    """`generate` on one model, each request on its own generator (`request_seed`), for the requests of
    this rank's data-parallel rank `dp_rank`."""

    model: torch.nn.Module
    seed: int
    dp_rank: int = 0
    requests: int = 0  # requests of earlier calls in this session
    generated: int = 0  # sequences generated here

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 owners: Sequence[int] | None = None) -> list[Completion]:
        first, self.requests = self.requests, self.requests + len(prompts)
        mine = [i for i in range(len(prompts)) if owners is None or owners[i] == self.dp_rank]
        if not mine:
            return []
        self.generated += len(mine)
        device = next(self.model.parameters()).device
        generators = [torch.Generator(device=device).manual_seed(request_seed(self.seed, first + i))
                      for i in mine]
        return generate(self.model, [prompts[i] for i in mine], params,
                        generators if params.temperature > 0 else None)


class BuiltinRollout:
    """Samples on the training model (`Runtime.rollout_model`) with the native KV cache: no extra memory
    for a second copy of the weights on one process, and any model the runtime builds."""

    name = "builtin"

    def __init__(self, runtime):
        self.runtime = runtime
        self.stats: dict[str, float] = {}  # nothing beyond the trainer's own timings
        self.generated = 0  # sequences this rank generated, over the run

    @contextmanager
    def session(self, seed: int) -> Iterator[Sampler]:
        self.runtime.eval()
        model = self.runtime.rollout_model()
        sampler = ModelSampler(model, seed, self.runtime.dp_rank)
        try:
            yield sampler
        finally:  # a parallelized model's replica is the whole model: training does not keep it
            self.generated += sampler.generated
            del model, sampler
            self.runtime.release_rollout_model()

    def close(self) -> None:
        pass
