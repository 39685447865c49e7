"""A/B of job keys on one bench case, in one launch: the variants take turns, round after round, so the
launch-to-launch spread of these machines (the same 2-GPU case has measured 162-246 ms) does not decide
the comparison. Each variant is the bench's Runtime step (`bench.case_step`) with its `--set` keys; rank 0
prints every round's median step and each variant's best.

    torchrun --standalone --nproc-per-node 2 scripts/ab_step.py dense-1.7b-4k-dp2 \
        --variant "" --variant "parallel.fsdp_unit_layers=2" [--rounds 2] [--steps 5]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch._dynamo
import torch.distributed as dist

from mlite import bench


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case")
    parser.add_argument("--variant", action="append", required=True,
                        help="space-separated KEY=VALUE job keys ('' for the case as it is)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    bench.hold_launch_group(device)  # one process group for every variant
    best: dict[str, float] = {}
    for round_ in range(args.rounds):
        for variant in args.variant:
            overrides = variant.split()
            step, runtime, _last = bench.case_step(args.case, device=device, overrides=overrides)
            timing = bench.time_steps(step, args.warmup, args.steps, device)
            runtime.close()  # the process group stays: this script started it
            del step, runtime, _last
            torch._dynamo.reset()  # each variant compiles its own blocks (the FX graph cache keeps it quick)
            # the runtime's hooks close reference cycles (a dist_opt backend and the modules it hooks): only
            # the collector frees its GPU buffers before the next variant builds its own
            bench.free_memory(device)
            name = variant or "(as the case is)"
            best[name] = min(best.get(name, float("inf")), timing.median_ms)
            if rank == 0:
                print(f"round {round_ + 1} {name}: median {timing.median_ms:.1f} ms "
                      f"({', '.join(f'{t:.0f}' for t in timing.step_ms)}); wall {timing.wall_ms:.1f} ms/step",
                      flush=True)
    if rank == 0:
        for name, ms in best.items():
            print(f"best of {args.rounds}: {ms:7.1f} ms  {name}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
