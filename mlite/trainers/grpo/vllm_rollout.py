"""Rollout on vLLM, colocated with training (rollout.engine: vllm).

Design: one vLLM engine per rank group of `rollout.tp` GPUs, in the training processes themselves
(`LLM(..., enable_sleep_mode=True)`, external launcher). Each GRPO step: wake the engine (weights and KV
cache back on the GPU), push the weights from `Runtime.export_weights()` (a stream of HF-named tensors:
`model.load_weights(stream)`, each rank sending only the tensors it owns once the runtime shards), generate,
then `sleep(level=1)` so the memory goes back to training. Only the import check runs where vLLM is not
installed: a job that asks for it is refused with one line before any model is built.
"""

from __future__ import annotations

import importlib.util

from mlite.errors import MliteError


def require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise MliteError(
            "rollout.engine: vllm but vLLM is not installed here; use rollout.engine: builtin, or run in the "
            "mlite GPU image (which has vLLM)"
        )


class VLLMRollout:
    """Colocated vLLM generation with weights synced from the runtime after each update."""

    def __init__(self, model_path: str, tp: int, gpu_memory_utilization: float, seed: int):
        require_vllm()
        from vllm import LLM

        self.llm = LLM(
            model=model_path,
            tensor_parallel_size=tp,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=True,
            seed=seed,
            distributed_executor_backend="external_launcher",
        )
        self.llm.sleep(level=1)

    def sync_weights(self, weights) -> None:
        """Push HF-named tensors (a stream from Runtime.export_weights) into the sleeping-then-woken
        engine."""
        self.llm.wake_up()
        model = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        model.load_weights(weights)

    def generate(
        self,
        prompt_ids: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        stop_token_ids: tuple[int, ...],
    ) -> list[list[int]]:
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(
            max_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k if top_k > 0 else -1,
            stop_token_ids=list(stop_token_ids),
        )
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False
        )
        self.llm.sleep(level=1)  # give the KV cache and weights' memory back to training
        return [list(o.outputs[0].token_ids) for o in outputs]
