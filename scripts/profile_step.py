"""Profile a bench case's training step on GPUs: top kernels, host gap, graph breaks and host syncs.

Profile one mlite training step of a bench case on a GPU (the trainers' Runtime step, as `mlite bench`
times it, with model.compile) and say where the step's wall time goes:

- the top CUDA kernels by self time, and the top host-side ops by self CPU time;
- the host gap: the step's wall time minus the CUDA time of its kernels (the GPU idles while the host
  launches, syncs or runs eager Python);
- the graph breaks and recompilations torch.compile saw (each break is an eager region between graphs);
- every host sync of a step (`torch.cuda.set_sync_debug_mode`), counted by the mlite line that caused it;
- the host's own time for one step, by Runtime call, measured while the GPU is held back by a sleep kernel
  (so the host never waits for it): a host slower than the kernels is where a host gap comes from.

    python3 scripts/profile_step.py dense-1.7b-4k [moe-30b-a3b-6l-4k ...] [--rows 25] [--set KEY=VALUE]
    torchrun --standalone --nproc-per-node 4 scripts/profile_step.py dense-1.7b-4k-dp4   # a multi-GPU case
    torchrun ... scripts/profile_step.py dense-1.7b-4k-dp2 --keep-gathered   # no re-gather before backward

`--set` takes job keys as `mlite bench --set` does (an A/B of one key on the same case). A multi-GPU case
runs in its layout on every rank of the launch (`bench.case_step`); rank 0 reports, and its kernel time is
split into NCCL kernels (their own streams) and the rest: the compute stream idles for the step's wall time
minus the rest, waiting on collectives or the host.
"""

from __future__ import annotations

import argparse
import collections
import os
import time
import traceback
import warnings

import torch
import torch._dynamo.utils
import torch.distributed as dist

from mlite import bench


def sync_sites(step) -> collections.Counter:
    """Run one step with CUDA sync warnings on: {the innermost mlite frame of each sync: count}."""
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()
                  if "/mlite/" in f.filename and "profile_step" not in f.filename][-3:]
        where = " <- ".join(f"{f.filename.split('/mlite/')[-1]}:{f.lineno} {f.line}"
                            for f in reversed(frames))
        sites[where or f"{filename}:{lineno}"] += 1

    shown = warnings.showwarning
    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = shown
    torch.cuda.synchronize()  # outside the debug mode: this wait is the probe's, not the step's
    return sites


HOLD_CYCLES = 4_000_000_000  # ~2 s of an H100's clock: longer than any step's host work


def host_time(step, runtime) -> tuple[float, dict[str, float]] | None:
    """(ms, {Runtime call: ms}) the host takes to queue one step while the GPU is still busy with a sleep
    kernel queued just before it, so no wait on the GPU is counted; None if the host did wait (a host sync,
    or a launch queue so full that it blocked: CUDA queues about a thousand launches)."""
    phases: dict[str, float] = collections.defaultdict(float)
    calls = ("zero_grad", "forward_backward", "optimizer_step", "lr_scheduler_step")
    originals = {call: getattr(runtime, call) for call in calls}

    def timed(call, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[call] += (time.perf_counter() - t0) * 1e3
        return run

    for call, fn in originals.items():
        setattr(runtime, call, timed(call, fn))
    try:
        torch.cuda.synchronize()
        hold_start, hold_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        hold_start.record()
        torch.cuda._sleep(HOLD_CYCLES)
        hold_end.record()
        start = time.perf_counter()
        step()
        host_ms = (time.perf_counter() - start) * 1e3
        torch.cuda.synchronize()
        # the host finished before the sleep did: it never waited (a sync, or a launch queue so full that a
        # launch blocked, would have made it wait for the sleep to end)
        held = host_ms < hold_start.elapsed_time(hold_end)
    finally:
        for call in calls:
            delattr(runtime, call)  # back to the class's methods
    return (host_ms, dict(phases)) if held else None


WORLD, RANK = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
DEVICE = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"


def say(*args) -> None:
    if RANK == 0:
        print(*args, flush=True)


def profile(name: str, rows: int, overrides: list[str], keep_gathered: bool = False,
            trace: str | None = None) -> None:
    torch.cuda.set_device(DEVICE)
    step, runtime, _last = bench.case_step(name, device=DEVICE, overrides=overrides)
    if keep_gathered:  # an experiment, no job key: what the backward's re-gather of every unit costs
        from torch.distributed.fsdp import FSDPModule

        for module in runtime.model.modules():
            if isinstance(module, FSDPModule):
                module.set_reshard_after_forward(False, recurse=False)
        overrides = [*overrides, "(FSDP2 units kept gathered from forward to backward)"]
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    counters = torch._dynamo.utils.counters
    breaks = {reason: n for reason, n in counters["graph_break"].items()}
    graphs = counters["stats"].get("unique_graphs", 0)
    start = time.perf_counter()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / 3 * 1e3
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    if trace and (RANK == 0 or "{rank}" in trace):  # the two steps' timeline (chrome://tracing, or
        prof.export_chrome_trace(trace.format(rank=RANK))  # scripts/trace_gaps.py); {rank}: every rank's
    events = prof.key_averages()
    # the kernels themselves: not the ops around them, nor the GPU-side ranges of user annotations
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)]
    cuda_ms = sum(e.device_time for e in kernels) / 1e3 / 2
    nccl_ms = sum(e.device_time for e in kernels if "nccl" in e.name.lower()) / 1e3 / 2
    say(f"== {name} (Runtime step, model.compile{''.join(', ' + o for o in overrides)}; {WORLD} rank(s))")
    say(f"step {wall_ms:.1f} ms wall; CUDA kernels {cuda_ms:.1f} ms; host gap {wall_ms - cuda_ms:.1f} ms")
    if WORLD > 1:
        compute_ms = cuda_ms - nccl_ms
        say(f"rank 0: NCCL kernels {nccl_ms:.1f} ms (own streams); other kernels {compute_ms:.1f} ms; "
            f"the compute stream idles {wall_ms - compute_ms:.1f} ms of the step (collectives or host)")
    if hasattr(runtime.optim, "overlapped_buckets"):  # dist_opt
        optim = runtime.optim
        say(f"dist_opt: {optim.overlapped_buckets} of {len(optim.bucket_groups)} bucket groups started their "
            "reduce-scatter during the backward")
    say(f"compiled graphs {graphs}; graph breaks {sum(breaks.values())}")
    for reason, n in sorted(breaks.items(), key=lambda kv: -kv[1])[:10]:
        say(f"  {n:4d} x {reason[:200]}")
    host = [host_time(step, runtime) for _ in range(3)]
    if all(h is not None for h in host):
        ms, phases = min(host, key=lambda h: h[0])
        say(f"host time to queue one step (GPU held back): {ms:.1f} ms, against {cuda_ms:.1f} ms of "
            "kernels: " + ", ".join(f"{call} {t:.1f}" for call, t in phases.items()))
    else:
        say("host time: the host waited for the GPU while queueing a step (a sync or a full launch queue)")
    sites = sync_sites(step)
    say(f"host syncs in one step: {sum(sites.values())}")
    for where, n in sites.most_common(15):
        say(f"  {n:4d} x {where}")
    say(events.table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=70))
    say(events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=70))
    runtime.close()  # ends only a group it started: a launch's group stays (hold_launch_group)


parser = argparse.ArgumentParser()
parser.add_argument("cases", nargs="+")
parser.add_argument("--rows", type=int, default=25)
parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
parser.add_argument("--trace", help="write rank 0's timeline of the profiled steps here (Chrome trace JSON); "
                    "a path with {rank} in it: every rank's (their clocks are the host's: comparable)")
parser.add_argument("--keep-gathered", action="store_true",
                    help="FSDP2 units stay gathered from their forward to their backward (no re-gather)")
args = parser.parse_args()
bench.hold_launch_group(DEVICE)  # one process group for every case of the launch
for case_name in args.cases:
    trace = args.trace and (args.trace if len(args.cases) == 1
                            else args.trace.replace(".json", f"-{case_name}.json"))
    profile(case_name, args.rows, args.overrides, args.keep_gathered, trace)
    torch._dynamo.utils.counters.clear()
    torch.cuda.empty_cache()
if dist.is_initialized():
    dist.destroy_process_group()
