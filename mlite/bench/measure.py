"""How either side's step is measured: the median step time after warm-up, the peak memory, the launch's
collective bandwidth.

Timing: median over steps after warm-up, measured with CUDA events on GPUs (perf_counter on CPU, where the
suite runs the tiny cases to cover this code), with the garbage collector's passes during the timed steps.
Memory: the allocator's peak reservation plus what the GPU holds outside it (the footprint the planner's
estimate is compared with), read after the timed steps; the allocator is emptied before and after a side.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Timing:
    step_ms: list[float] = field(default_factory=list)
    wall_ms: float = 0.0  # the timed steps' host wall time over their count, the final wait included
    # Python's garbage collections during the timed steps, [generation, ms] each (trainer.gc_every puts
    # them on the step's schedule; left to Python they land on any step, on each rank at its own time)
    gc_passes: list[list[float]] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms)


# a progress line (`measure`'s `say`): what a side is doing, so that a launch cut off by its time limit shows
# whether it was building, compiling in a warm-up step, or stuck
Say = Callable[[str], None]


def time_steps(step: Callable[[], None], warmup: int, steps: int, device: str, say: Say | None = None,
               label: str = "") -> Timing:
    """Median-friendly per-step times; CUDA events on GPUs (no host sync inside a step). With `say`, each
    warm-up step (where torch.compile compiles and Triton autotunes) reports its time, waited for."""
    for i in range(warmup):
        began = time.perf_counter()
        step()
        if say is not None:
            _wait(device)
            say(f"{label}: warm-up step {i + 1}/{warmup} in {time.perf_counter() - began:.1f} s")
    timing = Timing()
    with collector_passes(timing.gc_passes):
        _timed_steps(step, steps, device, timing)
    return timing


def _wait(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _timed_steps(step: Callable[[], None], steps: int, device: str, timing: Timing) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(steps)]
        began = time.perf_counter()
        for start, end in events:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize()
        timing.wall_ms = (time.perf_counter() - began) * 1e3 / steps
        timing.step_ms = [s.elapsed_time(e) for s, e in events]
    else:
        began = time.perf_counter()
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            timing.step_ms.append((time.perf_counter() - t0) * 1e3)
        timing.wall_ms = (time.perf_counter() - began) * 1e3 / steps


@contextlib.contextmanager
def collector_passes(passes: list[list[float]]):
    """Append [generation, ms] for each garbage collection while the block runs."""
    import gc

    began: list[float] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            began.append(time.perf_counter())
        elif began:
            passes.append([info["generation"], (time.perf_counter() - began.pop()) * 1e3])

    gc.callbacks.append(seen)
    try:
        yield passes
    finally:
        gc.callbacks.remove(seen)


@dataclass
class Measured:
    timing: Timing
    peak_gb: float
    allocated_gb: float
    last: dict
    outside_allocator_gb: float


def measure(make: Callable[[], tuple], device: str, steps: int, warmup: int,
            before_timing: Callable[[], None] | None = None, say: Say | None = None,
            label: str = "") -> Measured:
    """Build a side (`make() -> (step, keep, last)`), time its steps, read its peak memory, free it. `say`
    gets a progress line, headed `label`, as each phase ends."""
    free_memory(device)
    began = time.perf_counter()
    step, keep, last = make()
    if say is not None:
        say(f"{label}: built in {time.perf_counter() - began:.1f} s")
    if before_timing is not None:
        before_timing()
    timing = time_steps(step, warmup, steps, device, say, label)
    if say is not None:
        say(f"{label}: {steps} timed steps, median {timing.median_ms:.1f} ms")
    footprint, allocated, outside = _peak_gb(device)
    if hasattr(keep, "close"):  # a Runtime: Python's automatic garbage collection back on (trainer.gc_every)
        keep.close()
    del step, keep
    free_memory(device)
    return Measured(timing, footprint, allocated, {key: float(value) for key, value in last.items()}, outside)


def free_memory(device: str) -> None:
    """Collect what the last Runtime left (its hooks close reference cycles) and give the GPU's cached
    blocks back, so the next measurement starts from an empty allocator."""
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gb(device: str) -> tuple[float, float, float]:
    """(peak footprint: allocator's peak reservation + the memory outside it, peak allocated, the memory
    outside it) in GiB. The footprint is what must fit on the GPU, so it is what the planner's estimate is
    compared with; the part outside the allocator (CUDA context, handles, NCCL's buffers) tells the
    planner's overhead item apart from the allocator's slack."""
    import torch

    if not device.startswith("cuda"):
        return 0.0, 0.0, 0.0
    outside = _context_gb(device)
    return (torch.cuda.max_memory_reserved() / 2**30 + outside, torch.cuda.max_memory_allocated() / 2**30,
            outside)


def _context_gb(device: str) -> float:
    """GPU memory in use outside torch's caching allocator (CUDA context, cuBLAS/cuDNN handles)."""
    import torch

    from mlite.runtime.engine import device_used_gb

    if not device.startswith("cuda"):
        return 0.0
    return device_used_gb() - torch.cuda.memory_reserved() / 2**30


def collective_bus_gbs(device: str, mbytes: int = 128, repeats: int = 5) -> dict[str, float]:
    """The launch's measured collective bandwidth over the whole world (bus GB/s, as nccl-tests counts it:
    bytes x (N-1)/N per rank over the time): an all-gather and a reduce-scatter of `mbytes` MB of bf16,
    the size of one FSDP2 unit of the dense bench case. The same code on the same machine kind has stepped
    40% slower in one launch than in the next, so a scaling figure travels with its launch's bandwidth."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    numel = mbytes * 2**20 // 2 // world * world
    whole = torch.ones(numel, dtype=torch.bfloat16, device=device)
    shard = torch.ones(numel // world, dtype=torch.bfloat16, device=device)
    result = {}
    for name, run in (("all_gather", lambda: dist.all_gather_into_tensor(whole, shard)),
                      ("reduce_scatter", lambda: dist.reduce_scatter_tensor(shard, whole))):
        run()  # warm-up: the first call sets up the channels
        dist.barrier()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(repeats):
            run()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - began) / repeats
        result[f"{name}_bus_gbs"] = numel * 2 * (world - 1) / world / seconds / 1e9
    return result
