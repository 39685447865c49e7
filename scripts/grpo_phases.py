"""Measure a GRPO step's phases on one GPU with vLLM (training, weight sync, generation) against the planner.

GRPO steps on a catalog preset (random weights) with vLLM rolling out beside the trainer, the trainer
waiting on the host while vLLM generates (`rollout.offload_trainer`, the plan's choice under `auto`): for
each phase, the GPU memory in use (the planner's `train`, `sync` and `rollout` figures beside it), the
offload and reload time and GB/s, and the step's time by part (rollout with its sync, log-probs, update).
Prompts are random token ids, answered to --new tokens; the reward is the response's length, so the step
is a real one whatever the model says.

    . scripts/gpu_env.sh && . scripts/gpu_vllm_env.sh && python3 scripts/grpo_phases.py qwen3-8b

Under torchrun the same job runs data parallel over the launch's GPUs (fsdp2, one vLLM engine of rollout.tp 1
a rank, each rank rolling out only its own prompts), so the same command at 1 and N GPUs gives the scaling:

    torchrun --standalone --nproc-per-node 2 scripts/grpo_phases.py qwen3-1.7b --prompts 32

Prints (rank 0) one JSON object: the plan's figures, then per step the measured ones (the first step
includes vLLM's warm-up; later steps are the steady state).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from mlite.config import job_from_dict
from mlite.plan import plan_job
from mlite.runtime.engine import Runtime
from mlite.trainers.grpo.prompts import Prompt
from mlite.trainers.grpo.trainer import GRPOTrainer
from mlite.trainers.grpo.vllm_rollout import VLLMRollout


class TokenIds:
    """The trainer's tokenizer interface over bare token ids: responses "decode" to their length in
    characters, which the reward below reads."""

    eos_token_id = None
    unk_token_id = None

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "x" * len(ids)

    def convert_tokens_to_ids(self, token) -> None:
        return None


def length_reward(response: str, sample) -> float:
    return len(response) / 100.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="qwen3-8b", help="catalog preset")
    parser.add_argument("--gpu", default="h200", help="cluster.gpu: the planner's capacity")
    parser.add_argument("--gpu-memory", type=float, default=0.6, help="rollout.gpu_memory_utilization")
    parser.add_argument("--offload", default="auto", help="rollout.offload_trainer: auto, true or false")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16, help="rollout.prompts_per_step")
    parser.add_argument("--n", type=int, default=4, help="rollout.n")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new", type=int, default=256, help="rollout.max_response_length")
    parser.add_argument("--master", default="bf16", help="precision.master")
    args = parser.parse_args()
    offload = {"true": True, "false": False}.get(args.offload, args.offload)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    lead = int(os.environ.get("RANK", "0")) == 0
    out = Path(tempfile.mkdtemp())
    job = job_from_dict({
        "job": "grpo", "model": {"name": args.model},
        "cluster": {"gpus_per_node": world, "gpu": args.gpu},
        "precision": {"compute": "bf16", "master": args.master},
        "optimizer": {"lr": 1e-6, "schedule": "constant"},
        "trainer": {"device": "cuda", "output_dir": str(out / "run"), "steps": args.steps},
        "data": {"seq_len": args.prompt_len + args.new,
                 "max_tokens_per_micro_batch": 4 * (args.prompt_len + args.new)},
        "rollout": {"engine": "vllm", "n": args.n, "prompts_per_step": args.prompts,
                    "max_prompt_length": args.prompt_len, "max_response_length": args.new,
                    "gpu_memory_utilization": args.gpu_memory, "enforce_eager": True,
                    "offload_trainer": offload},
        "grpo": {"reward": f"{Path(__file__).stem}:length_reward"},
    })
    plan = plan_job(job)
    m = plan.memory
    report = {"model": args.model, "gpus": world, "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__,
              "plan": {"offload_trainer": m.offload_trainer, "train_gb": m.train_gb, "sync_gb": m.sync_gb,
                       "rollout_gb": m.rollout_gb, "usable_gb": m.usable_gb, "fits": m.fits,
                       "host_gb": m.host_total_gb},
              "steps": []}
    runtime = Runtime(job)
    engine = VLLMRollout(job, runtime, out / "vllm")
    g = torch.Generator().manual_seed(0)
    vocab = runtime.arch.vocab
    prompts = [Prompt(torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist(), {"answer": ""})
               for _ in range(4 * args.prompts)]
    trainer = GRPOTrainer(job, runtime, TokenIds(), prompts, engine=engine)
    keys = ("memory/train_gb", "memory/sync_gb", "memory/rollout_gb", "time/rollout_s", "time/sync_s",
            "time/logprobs_s", "time/update_s", "time/offload_s", "time/reload_s", "offload/gb",
            "offload/gb_per_s", "offload/reload_gb_per_s", "rollout/generated_tokens",
            "time/rollout_tokens_per_s")
    for step in range(args.steps):
        started = time.perf_counter()
        metrics, _ = trainer.train_step(step)
        report["steps"].append({"time/step_s": round(time.perf_counter() - started, 3),
                                **{k: round(metrics[k], 3) for k in keys if k in metrics}})
        if lead:
            print(json.dumps(report["steps"][-1]), flush=True)
    engine.close()
    if lead:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
