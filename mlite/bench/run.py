"""A case's sides measured into results. One GPU (`run_case`): the Runtime's step, then HF's (and
torchtitan's when asked), each built, timed and freed in turn. Several GPUs (`run_parallel_cases`, under
torchrun): every rank's one-GPU step at once (N x one GPU), then each case in its layout; scaling = parallel
tokens/s over N x one-GPU tokens/s.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Sequence

from mlite.bench.cases import (
    BenchCase,
    case_arch,
    case_job,
    case_plan,
    case_precision,
    case_seq_lens,
    random_sequences,
    replica_seed,
)
from mlite.bench.flops import flops_per_token, mfu
from mlite.bench.hf_side import hf_skip_reason, hf_step_fn
from mlite.bench.measure import Measured, Say, collective_bus_gbs, measure
from mlite.bench.mlite_side import launch_ranks, runtime_step_fn
from mlite.bench.report import BenchResult
from mlite.bench.titan_side import compile_settings_restored, mlite_fp8_choice, titan_step_fn, titan_version


def run_case(case: BenchCase, device: str, steps: int = 8, warmup: int = 3, sides=("mlite", "hf"),
             gpu: str = "cpu", peak_tflops: float = 1.0, overrides: Sequence[str] = (),
             say: Say | None = None) -> list[BenchResult]:
    """A one-GPU case: the Runtime's step, then (unless the case or `sides` leave them out) HF's and
    torchtitan's ("torchtitan": cases with `titan`). `overrides`: job keys for the Runtime's side
    (case_job). `say`: progress lines (measure)."""
    arch = case_arch(case)
    seq_lens = case_seq_lens(case)
    sequences = random_sequences(seq_lens, arch.vocab, seed=0)
    tokens = sum(seq_lens) * case.accum
    fpt = flops_per_token(arch, seq_lens)
    results = []
    for side in sides:
        if (side == "hf" and not case.baseline) or (side == "torchtitan" and not case.titan):
            continue
        if side == "hf" and (reason := hf_skip_reason(arch)):
            results.append(BenchResult(case=case.name, side=side, tokens_per_step=tokens, step_ms=0.0,
                                       tokens_per_s=0.0, flops_per_token=fpt, mfu=0.0, peak_gb=0.0,
                                       device=device, skipped=reason))
            continue
        progress = {"say": say, "label": f"{case.name} {side}"}
        if side == "mlite":
            m = measure(lambda: runtime_step_fn(case, sequences, device, overrides=overrides), device, steps,
                        warmup, **progress)
        elif side == "torchtitan":  # the same choice of FP8 linears as the mlite side's job
            linears, experts = mlite_fp8_choice(case, arch, device, overrides)
            with compile_settings_restored():
                m = measure(lambda: titan_step_fn(case, arch, sequences, device, case.accum, linears,
                                                  experts), device, steps, warmup, **progress)
        else:
            m = measure(lambda: hf_step_fn(arch, sequences, device, case.accum), device, steps, warmup,
                        **progress)
        tps = tokens / (m.timing.median_ms / 1e3)
        plan = case_plan(case, arch, gpu, overrides) if side == "mlite" else None
        results.append(BenchResult(
            case=case.name, side=side, tokens_per_step=tokens, step_ms=m.timing.median_ms, tokens_per_s=tps,
            flops_per_token=fpt, mfu=mfu(arch, seq_lens, tps, peak_tflops), peak_gb=m.peak_gb,
            estimate_gb=plan.memory.train_gb if plan is not None else None,
            device=device,
            extra={"seq_lens": seq_lens if len(seq_lens) < 64 else len(seq_lens),
                   "step_ms_all": m.timing.step_ms, "wall_ms_per_step": m.timing.wall_ms,
                   "gc_passes": m.timing.gc_passes,
                   "peak_allocated_gb": m.allocated_gb, "accum": case.accum,
                   "outside_allocator_gb": m.outside_allocator_gb,
                   **({"overrides": list(overrides)} if side == "mlite" and overrides else {}),
                   **({"choices": plan.choices()} if plan is not None else {}),
                   **({"torchtitan": titan_version(), "fp8": case.fp8} if side == "torchtitan" else {}),
                   **m.last},
        ))
    return results


def run_parallel_cases(cases: list[BenchCase], device: str, steps: int = 8, warmup: int = 3, gpu: str = "cpu",
                       peak_tflops: float = 1.0, overrides: Sequence[str] = (),
                       say: Say | None = None) -> list[BenchResult]:
    """Multi-GPU cases on the ranks of this torchrun launch, every rank returning the same results (rank 0
    reports them). First every rank runs each case's one-GPU step on its own GPU, all ranks at once and
    before the process group exists (a Runtime of one process: N x one GPU); then this starts the process
    group and runs each case in its layout. scaling = parallel tokens/s over the N x one-GPU tokens/s.
    Both are the Runtime's step as `case_job` sets it: compiled blocks on GPUs, eager on CPU. `overrides`
    (job keys other than the layout's, LAYOUT_KEYS) apply to both, parallel.* keys to the layout only.
    `say`: progress lines (measure)."""
    import torch.distributed as dist

    from mlite.runtime.layout import end_process_group

    world, rank = launch_ranks(cases)
    singles = {}
    for case in cases:
        seq_lens = case_seq_lens(case)
        sequences = random_sequences(seq_lens, case_arch(case).vocab, seed=rank)  # each rank its own data
        with one_process():
            make = functools.partial(runtime_step_fn, case, sequences, device, one_gpu=True,
                                     overrides=[o for o in overrides if not o.startswith("parallel.")])
            singles[case.name] = measure(make, device, steps, warmup, say=say, label=f"{case.name} one GPU")
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    try:
        results = []
        for case in cases:
            results += _parallel_case(case, singles[case.name], device, steps, warmup, gpu, peak_tflops,
                                      overrides, say)
    except BaseException:
        end_process_group(clean=False)
        raise
    end_process_group(clean=True)
    return results


@contextlib.contextmanager
def one_process():
    """The Runtime starts a process group when WORLD_SIZE > 1 (torchrun): hide it while a rank builds the
    one-GPU reference of a multi-rank case."""
    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = saved


def _parallel_case(case: BenchCase, single: Measured, device: str, steps: int, warmup: int, gpu: str,
                   peak_tflops: float, overrides: Sequence[str] = (), say: Say | None = None,
                   ) -> list[BenchResult]:
    import torch
    import torch.distributed as dist

    from mlite.runtime.parallel.mesh import ParallelDims

    def reduce(values: list[float], op) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=device)  # NCCL reduces on the GPU
        dist.all_reduce(t, op=op)
        return t.tolist()

    world = dist.get_world_size()
    arch = case_arch(case)
    seq_lens = case_seq_lens(case)
    fpt = flops_per_token(arch, seq_lens)
    single_tokens = sum(seq_lens) * case.accum
    (single_tps,) = reduce([single_tokens / (single.timing.median_ms / 1e3)], dist.ReduceOp.SUM)
    single_peak = reduce([single.peak_gb], dist.ReduceOp.MAX)[0]  # the fullest GPU is what must fit

    dims = ParallelDims.from_job(case_job(case, device), world)
    seed = replica_seed(case, device, dist.get_rank(), world)
    sequences = random_sequences(seq_lens, arch.vocab, seed=seed)
    bus = collective_bus_gbs(device)
    par = measure(lambda: runtime_step_fn(case, sequences, device, overrides=overrides), device, steps,
                  warmup, before_timing=dist.barrier, say=say, label=f"{case.name} x{world}")
    bus = {key: min(bus[key], after) for key, after in collective_bus_gbs(device).items()}  # before and after
    bus = dict(zip(bus, reduce(list(bus.values()), dist.ReduceOp.MIN)))  # the slowest rank's view
    slowest, par_peak, par_alloc, par_outside, par_gc_ms = reduce(
        [par.timing.median_ms, par.peak_gb, par.allocated_gb, par.outside_allocator_gb,
         sum(ms for _generation, ms in par.timing.gc_passes)], dist.ReduceOp.MAX)
    tokens = sum(seq_lens) * case.accum * dims.dp
    tps = tokens / (slowest / 1e3)
    plan = case_plan(case, arch, gpu, overrides)
    return [
        BenchResult(case=case.name, side=f"mlite x{world}", tokens_per_step=tokens, step_ms=slowest,
                    tokens_per_s=tps, flops_per_token=fpt, mfu=mfu(arch, seq_lens, tps / world, peak_tflops),
                    peak_gb=par_peak, estimate_gb=plan.memory.train_gb if plan is not None else None,
                    device=device,
                    extra={"scaling": tps / single_tps, "world": world, "peak_allocated_gb": par_alloc,
                           "outside_allocator_gb": par_outside, **bus,
                           "accum": case.accum, "step_ms_all": par.timing.step_ms,
                           "wall_ms_per_step": par.timing.wall_ms, "gc_passes": par.timing.gc_passes,
                           "gc_ms_slowest_rank": par_gc_ms,
                           **({"overrides": list(overrides)} if overrides else {}),
                           # what the planner resolved the case's `auto` keys to (mlite plan's choices)
                           **({"choices": plan.choices()} if plan is not None else {}), **par.last}),
        BenchResult(case=case.name, side=f"{world} x one GPU", tokens_per_step=single_tokens * world,
                    step_ms=single.timing.median_ms, tokens_per_s=single_tps, flops_per_token=fpt,
                    mfu=mfu(arch, seq_lens, single_tps / world, peak_tflops), peak_gb=single_peak,
                    device=device,
                    extra={"world": world, "step_ms_all": single.timing.step_ms,
                           "master": case_precision(case, device.startswith("cuda"), one_gpu=True)["master"],
                           "wall_ms_per_step": single.timing.wall_ms, "gc_passes": single.timing.gc_passes,
                           **single.last}),
    ]
