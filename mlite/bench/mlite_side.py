"""The mlite side: `mlite.runtime.engine.Runtime` driven as the SFT trainer drives it (mlite.trainers.sft).

Per step zero_grad, forward_backward over the step's micro-batches with `sft_loss`, optimizer_step (grad
norm, clipping, AdamW) and lr_scheduler_step, on a job built from the case (model, layout, bf16 parameters
and optimizer state on GPUs). There is no step of the benchmark's own: what is timed is what training runs,
LM-head kernel (mlite.runtime.kernels.lm_head), attention backend and host syncs included.

Also the torchrun launch the multi-GPU cases and the GPU scripts run in (scripts/profile_step.py and
scripts/ab_step.py take `case_step` and `hold_launch_group` from here).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from mlite.bench.cases import (
    CASES,
    BenchCase,
    case_arch,
    case_hf_config,
    case_job,
    case_seq_lens,
    random_sequences,
    replica_seed,
)


def runtime_step_fn(case: BenchCase, sequences: list[list[int]], device: str, one_gpu: bool = False,
                    overrides: Sequence[str] = ()):
    """One optimizer step of the SFT trainer on the Runtime: case.accum micro-batches of `sequences` on every
    data-parallel replica. Returns (step, runtime, last) where `last` holds the last step's loss and grad
    norm as the trainer would log them (this rank's loss)."""
    from mlite.runtime.data.packed import PackedBatch
    from mlite.runtime.engine import Runtime
    from mlite.runtime.loss import sft_loss

    rt = Runtime(case_job(case, device, one_gpu, overrides), hf_config=case_hf_config(case))
    rt.train()
    batch = PackedBatch.from_sequences(sequences)  # on the host, as the data loader hands it over
    micro_batches = [batch] * case.accum
    # the step's loss is the mean NLL over every replica's targets (the same lengths on every replica)
    loss_fn = sft_loss(batch.num_target_tokens * case.accum * rt.dp_size)
    last: dict[str, Any] = {}

    def step() -> None:  # no host sync: the trainer loop too reads a step's numbers once the next is queued
        rt.zero_grad()
        outs = rt.forward_backward(micro_batches, loss_fn)
        last["grad_norm"], _ = rt.optimizer_step()
        rt.lr_scheduler_step()
        last["loss"] = sum(o["loss"] for o in outs)

    return step, rt, last


def case_step(name: str, device: str = "cuda", overrides: Sequence[str] = ()):
    """runtime_step_fn for the case named `name` on its random sequences, as `mlite bench` times it
    (scripts/profile_step.py and the probes take it from here): a one-GPU case on `device` (seed 0); a
    multi-GPU case in its layout on the ranks of this torchrun launch (the Runtime starts the process group),
    each data-parallel replica on its own sequences, as the bench's parallel side."""
    case = CASES[name]
    seed = 0
    if case.gpus > 1:
        world, rank = launch_ranks([case])
        seed = replica_seed(case, device, rank, world)
    sequences = random_sequences(case_seq_lens(case), case_arch(case).vocab, seed=seed)
    return runtime_step_fn(case, sequences, device, overrides=overrides)


def hold_launch_group(device: str) -> None:
    """Start this torchrun launch's process group once, so that several Runtimes in turn use it and none
    ends it (a Runtime ends only a group it started). Under torchrun a group destroyed and started again
    reads the first group's NCCL id from the launcher's store and fails: scripts that build one Runtime
    after another (profile_step.py, ab_step.py) call this first, and `dist.destroy_process_group()` last."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")


def launch_ranks(cases: list[BenchCase]) -> tuple[int, int]:
    """(world, rank) of this torchrun launch, refused in one line unless every multi-GPU case runs on it."""
    from mlite.errors import MliteError

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    for case in cases:
        if world != case.gpus:
            raise MliteError(f"bench case {case.name} runs on {case.gpus} ranks but this launch has {world}; "
                             f"run: torchrun --nproc-per-node {case.gpus} -m mlite bench {case.name}")
    return world, rank
