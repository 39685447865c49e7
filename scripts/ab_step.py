"""Compare job keys on one bench case in one launch, the variants taking turns (a paired A/B).

An A/B of job keys on one bench case, in one launch: the variants take turns, round after round, so the
launch-to-launch spread of these machines (the same 2-GPU case has measured 162-246 ms) does not decide
the comparison. Each variant is the bench's Runtime step (`bench.case_step`) with its `--set` keys; rank 0
prints every round's median step and each variant's best.

    torchrun --standalone --nproc-per-node 2 scripts/ab_step.py dense-1.7b-4k-dp2 \
        --variant "" --variant "parallel.fsdp_unit_layers=2" [--rounds 2] [--steps 5]

Rounds rebuild each variant's Runtime, a minute or more apart on a GPU, and some machines of a kind switch
between a fast and a slow mode over such times (rounds of the same code at 127 and at 160 ms in one launch:
docs/PERFORMANCE.md, 2026-11-28). `--interleave` builds every variant once and keeps them all (they must
fit in memory together), then takes turns in short blocks: per cycle, each variant runs one step after the
switch (not timed) and `--steps` timed steps. It reports each variant's median block, and each variant's
difference from the first one cycle by cycle (paired samples: a mode lasting a cycle slows both sides):

    torchrun ... scripts/ab_step.py dense-1.7b-4k-dp2 --interleave --rounds 12 --steps 3 --variant "" ...
"""

from __future__ import annotations

import argparse
import os
import statistics

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
    parser.add_argument("--interleave", action="store_true",
                        help="build every variant once and take turns in blocks of --steps steps, --rounds "
                             "cycles (paired samples)")
    args = parser.parse_args()
    if args.interleave and any("trainer.gc_every" in variant for variant in args.variant):
        # the collector's switch is the process's: variants built side by side would all run with it off
        parser.error("trainer.gc_every is process-wide and cannot be interleaved; A/B it in separate "
                     "launches (mlite bench CASE --set trainer.gc_every=0)")
    rank = int(os.environ.get("RANK", "0"))
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    bench.hold_launch_group(device)  # one process group for every variant
    if args.interleave:
        interleaved(args, device, rank)
    else:
        rebuilt_each_round(args, device, rank)
    if dist.is_initialized():
        dist.destroy_process_group()


def interleaved(args, device: str, rank: int) -> None:
    """Every variant built once; per cycle, one block of steps each, in turn (the module docstring)."""
    names = [variant or "(as the case is)" for variant in args.variant]
    steps, runtimes = [], []
    for variant in args.variant:
        step, runtime, _last = bench.case_step(args.case, device=device, overrides=variant.split())
        bench.time_steps(step, args.warmup, 1, device)  # compiles, and settles the allocator
        steps.append(step)
        runtimes.append(runtime)
    blocks: dict[str, list[float]] = {name: [] for name in names}
    for cycle in range(args.rounds):
        for name, step in zip(names, steps):
            # the first step after a switch queues behind an idle GPU: not timed
            blocks[name].append(bench.time_steps(step, 1, args.steps, device).median_ms)
        if rank == 0:
            print(f"cycle {cycle + 1}: " + ", ".join(f"{name} {blocks[name][-1]:.1f} ms" for name in names),
                  flush=True)
    for runtime in runtimes:
        runtime.close()  # the process group stays: this script started it
    # the runtimes' hooks close reference cycles: collect them now, while the process group they hold work
    # on still exists (left to the interpreter's exit, a rank aborted there once: "terminate called")
    steps.clear()
    runtimes.clear()
    bench.free_memory(device)
    if rank == 0:
        first = names[0]
        for name in names:
            print(f"median of {args.rounds} blocks: {statistics.median(blocks[name]):7.1f} ms  {name}")
        for name in names[1:]:
            diffs = [b - a for a, b in zip(blocks[first], blocks[name])]
            faster = sum(d < 0 for d in diffs)
            print(f"paired against {first}: {statistics.median(diffs):+.1f} ms median, faster in {faster} of "
                  f"{len(diffs)} cycles  {name}")


def rebuilt_each_round(args, device: str, rank: int) -> None:
    """Each round builds each variant's Runtime in turn, times it, and frees it."""
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


if __name__ == "__main__":
    main()
