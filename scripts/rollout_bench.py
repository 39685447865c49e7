"""Measure rollout throughput: the built-in sampler against vLLM, on the same model and prompts.

Rollout throughput: the built-in sampler against vLLM (`rollout.engine: vllm`), on the same model, prompts
and sampling, through the engines the GRPO trainer uses. Random weights (a catalog preset), random prompt
tokens, no stop token (every response runs to --new tokens), temperature 1.

    . scripts/gpu_env.sh && . scripts/gpu_vllm_env.sh && python3 scripts/rollout_bench.py qwen3-1.7b

Under torchrun (several GPUs: FSDP2 over them, or --train-tp), vLLM runs over the ranks as in GRPO: world /
--tp engines that split the prompts; the built-in sampler is skipped there. Rank 0 prints.

    torchrun --nproc-per-node 2 scripts/rollout_bench.py qwen3-1.7b --tp 2

Prints one JSON line per engine: generated tokens/s, and for vLLM its start, the weight sync (seconds,
GB, GB/s) and the wake-up. The first vLLM session is a warm-up (its kernels and, without --eager, its
compiled graphs); the timed one is the second.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from mlite.config import job_from_dict
from mlite.runtime.engine import Runtime
from mlite.trainers.grpo.rollout import BuiltinRollout, SamplingParams
from mlite.trainers.grpo.vllm_rollout import VLLMRollout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="qwen3-1.7b", help="catalog preset")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new", type=int, default=512, help="tokens generated per prompt")
    parser.add_argument("--gpu-memory", type=float, default=0.4, help="rollout.gpu_memory_utilization")
    parser.add_argument("--eager", action="store_true", help="rollout.enforce_eager")
    parser.add_argument("--skip-builtin", action="store_true")
    parser.add_argument("--tp", type=int, default=1, help="rollout.tp: GPUs per vLLM engine (torchrun)")
    parser.add_argument("--train-tp", type=int, default=1, help="parallel.tp of the trainer (torchrun)")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    first = int(os.environ.get("RANK", "0")) == 0

    job = job_from_dict({
        "job": "grpo", "model": {"name": args.model}, "cluster": {"gpus_per_node": world, "gpu": "h100"},
        "parallel": {"tp": args.train_tp},
        "precision": {"compute": "bf16"}, "trainer": {"device": "cuda", "output_dir": tempfile.mkdtemp()},
        "data": {"seq_len": args.prompt_len + args.new},
        "rollout": {"engine": "vllm", "max_prompt_length": args.prompt_len, "max_response_length": args.new,
                    "gpu_memory_utilization": args.gpu_memory, "enforce_eager": args.eager, "tp": args.tp},
        "grpo": {"reward": "arithmetic"},
    })
    runtime = Runtime(job)
    vocab = runtime.arch.vocab
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (args.prompts, args.prompt_len), generator=generator).tolist()
    params = SamplingParams(max_new_tokens=args.new, temperature=1.0)
    shape = {"model": args.model, "prompts": args.prompts, "prompt_len": args.prompt_len, "new": args.new,
             "gpus": world, "rollout_tp": args.tp, "train_tp": args.train_tp}

    if not args.skip_builtin and world == 1:
        builtin = BuiltinRollout(runtime)
        with builtin.session(1) as sampler:
            sampler.generate(prompts[:8], SamplingParams(max_new_tokens=8, temperature=1.0))  # warm-up
            torch.cuda.synchronize()
            started = time.perf_counter()
            out = sampler.generate(prompts, params)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - started
        tokens = sum(len(c.response_ids) for c in out)
        print(json.dumps({"engine": "builtin", **shape, "tokens": tokens, "seconds": round(seconds, 3),
                          "tokens_per_s": round(tokens / seconds)}), flush=True)
        torch.cuda.empty_cache()

    engine = VLLMRollout(job, runtime, tempfile.mkdtemp())
    with engine.session(1) as sampler:
        sampler.generate(prompts[:8], SamplingParams(max_new_tokens=8, temperature=1.0))  # warm-up
    started = time.perf_counter()
    with engine.session(2) as sampler:
        awake = time.perf_counter()
        out = sampler.generate(prompts, params)
        done = time.perf_counter()
    tokens = sum(len(c.response_ids) for c in out)
    stats = engine.stats
    if first:
        print(json.dumps({
            "engine": "vllm", **shape, "enforce_eager": args.eager, "tokens": tokens,
            "seconds": round(done - awake, 3), "tokens_per_s": round(tokens / (done - awake)),
            "session_s": round(time.perf_counter() - started, 3), "start_s": round(engine.start_s, 1),
            "sync_s": round(stats["time/sync_s"], 3), "sync_gb": round(stats["rollout/sync_gb"], 3),
            "sync_received_gb": round(stats["rollout/sync_received_gb"], 3),
            "sync_gb_per_s": round(stats["rollout/sync_gb"] / stats["time/sync_s"], 1),
            "wake_s": round(stats["time/wake_s"], 3), "sync_tensors": int(stats["rollout/sync_tensors"]),
        }), flush=True)
    engine.close()


if __name__ == "__main__":
    main()
