"""`mlite bench`: training-step throughput of mlite next to the HF-transformers baseline, in one launch.

For each case both sides train the same architecture (random weights, bf16, fused AdamW, the same batch)
and we report tokens/s, MFU, peak memory, and the planner's memory estimate next to the measured peak.
Timing: median over steps after warm-up, measured with CUDA events on GPUs (perf_counter on CPU, where the
suite runs a tiny case to cover this code).

MFU (as in ../shared/REFERENCE.md section 4, against the GPU's dense bf16 peak):
    flops/token = 6 * (matmul params of the active path + LM head) + 6 * layers * (heads * head_dim) * s_eff
where s_eff = sum(len_i^2) / sum(len_i) over the packed sequences (causal attention costs ~len^2 / 2 per
sequence, forward + backward = 3x, 2 FLOPs per multiply-add). Only the top-k routed experts count for MoE.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

from mlite.config.arch import ModelArch
from mlite.config.catalog import layer_params


# ---------------------------------------------------------------------------------------------- FLOPs
def matmul_params_per_token(arch: ModelArch) -> int:
    """Parameters every token multiplies through (the catalog's active count per layer) plus the LM head,
    which runs even when tied to the embedding. Norm weights ride along: under 0.1% of the total."""
    return sum(layer_params(arch, i).active for i in range(arch.num_layers)) + arch.hidden * arch.vocab


def effective_seq_len(seq_lens: list[int]) -> float:
    return sum(n * n for n in seq_lens) / max(1, sum(seq_lens))


def flops_per_token(arch: ModelArch, seq_lens: list[int]) -> float:
    attention = 6 * arch.num_layers * arch.num_heads * arch.head_dim * effective_seq_len(seq_lens)
    return 6 * matmul_params_per_token(arch) + attention


def mfu(arch: ModelArch, seq_lens: list[int], tokens_per_s: float, peak_tflops: float) -> float:
    return flops_per_token(arch, seq_lens) * tokens_per_s / (peak_tflops * 1e12)


# --------------------------------------------------------------------------------------------- batches
def mixed_lengths(total_tokens: int, seed: int = 0, shortest: int = 256) -> list[int]:
    """Sequence lengths of a realistic packed SFT batch: log-uniform between `shortest` and total/2."""
    import random

    rng = random.Random(seed)
    lens, left = [], total_tokens
    while left > 0:
        n = int(math.exp(rng.uniform(math.log(shortest), math.log(max(shortest + 1, total_tokens // 2)))))
        n = min(n, left)
        lens.append(n)
        left -= n
    return lens


# ------------------------------------------------------------------------------------------------ cases
@dataclass
class BenchCase:
    name: str
    model: str  # catalog preset
    seq_len: int  # tokens per micro-batch (one packed stream)
    packing: str = "full"  # full: one sequence of seq_len; mixed: several sequences of mixed lengths
    num_layers: Optional[int] = None  # truncate the model (MoE layers on one GPU)
    gpus: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1
    accum: int = 1  # micro-batches per optimizer step (gradient accumulation), on both sides
    baseline: bool = True  # also run HF transformers
    note: str = ""


CASES: dict[str, BenchCase] = {
    c.name: c
    for c in [
        BenchCase("dense-1.7b-4k", "qwen3-1.7b", 4096),
        BenchCase("dense-1.7b-4k-mixed", "qwen3-1.7b", 4096, packing="mixed"),
        BenchCase("moe-30b-a3b-6l-4k", "qwen3-30b-a3b", 4096, num_layers=6),
        BenchCase("moe-30b-a3b-6l-4k-mixed", "qwen3-30b-a3b", 4096, packing="mixed", num_layers=6),
        # the optimizer step amortised over 4 micro-batches, as real training does
        BenchCase("dense-1.7b-4k-accum4", "qwen3-1.7b", 4096, accum=4),
        BenchCase("moe-30b-a3b-6l-4k-accum4", "qwen3-30b-a3b", 4096, num_layers=6, accum=4),
        # several GPUs (torchrun --nproc-per-node GPUS -m mlite bench CASE): fsdp2 over dp, experts over ep;
        # the reference is every rank running the one-GPU step at the same time ("N x one GPU")
        BenchCase("dense-1.7b-4k-dp2", "qwen3-1.7b", 4096, gpus=2, dp=2, baseline=False),
        BenchCase("dense-1.7b-4k-dp4", "qwen3-1.7b", 4096, gpus=4, dp=4, baseline=False),
        BenchCase("moe-30b-a3b-8l-4k-ep2", "qwen3-30b-a3b", 4096, num_layers=8, gpus=2, dp=2, ep=2, baseline=False),
        BenchCase("moe-30b-a3b-8l-4k-ep4", "qwen3-30b-a3b", 4096, num_layers=8, gpus=4, dp=4, ep=4, baseline=False),
        BenchCase("dense-1.7b-16k-cp4", "qwen3-1.7b", 16384, gpus=4, cp=4, baseline=False),
        # the CPU suite's cases: exercise every code path in seconds (the multi-rank ones on gloo)
        BenchCase("tiny-cpu", "tiny-qwen3-moe", 128, packing="mixed"),
        BenchCase("tiny-cpu-dp2", "tiny-qwen3", 128, packing="mixed", gpus=2, dp=2, baseline=False),
        BenchCase("tiny-cpu-ep2", "tiny-qwen3-moe", 128, packing="mixed", gpus=2, dp=2, ep=2, baseline=False),
    ]
}


# ---------------------------------------------------------------------------------------------- timing
@dataclass
class Timing:
    step_ms: list[float] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms)


def time_steps(step: Callable[[], None], warmup: int, steps: int, device: str) -> Timing:
    """Median-friendly per-step times; CUDA events on GPUs (no host sync inside a step)."""
    import torch

    for _ in range(warmup):
        step()
    timing = Timing()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        for start, end in events:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize()
        timing.step_ms = [s.elapsed_time(e) for s, e in events]
    else:
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            timing.step_ms.append((time.perf_counter() - t0) * 1e3)
    return timing


# ---------------------------------------------------------------------------------------------- report
@dataclass
class BenchResult:
    case: str
    side: str  # mlite | hf
    tokens_per_step: int
    step_ms: float
    tokens_per_s: float
    mfu: float
    peak_gb: float
    estimate_gb: Optional[float] = None
    device: str = ""
    extra: dict = field(default_factory=dict)


def detect_gpu(device: str) -> tuple[str, float]:
    """(gpu type as the config names it, dense bf16 peak TFLOP/s) of the device."""
    from mlite.config.schema import GPU_BF16_TFLOPS

    if not device.startswith("cuda"):
        return "cpu", GPU_BF16_TFLOPS["cpu"]
    import torch

    name = torch.cuda.get_device_name().lower()
    gpu = next((g for g in GPU_BF16_TFLOPS if g != "cpu" and g in name.replace(" ", "")), "h100")
    return gpu, GPU_BF16_TFLOPS[gpu]


def environment(device: str) -> dict:
    import datetime
    import platform

    import torch

    import mlite

    env = {"date": datetime.date.today().isoformat(), "mlite": mlite.__version__, "torch": torch.__version__,
           "python": platform.python_version(), "device": device}
    if device.startswith("cuda"):
        env |= {"gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def write_results(results: list[BenchResult], out: Path, meta: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": [asdict(r) for r in results]}, indent=2))


def render_table(results: list[BenchResult]) -> "object":
    from rich.table import Table

    table = Table(title="mlite bench (median step after warm-up)")
    for col in ("case", "side", "tokens/s", "MFU", "step ms", "peak GB", "plan GB", "plan err", "scaling"):
        table.add_column(col, justify="right" if col not in ("case", "side") else "left")
    for r in results:
        err = "" if not r.estimate_gb or not r.peak_gb else f"{(r.estimate_gb - r.peak_gb) / r.peak_gb:+.0%}"
        table.add_row(
            r.case, r.side, f"{r.tokens_per_s:,.0f}", f"{r.mfu:.1%}", f"{r.step_ms:.1f}", f"{r.peak_gb:.1f}",
            "" if r.estimate_gb is None else f"{r.estimate_gb:.1f}", err,
            f"{r.extra['scaling']:.0%}" if "scaling" in r.extra else "",
        )
    return table


# ---------------------------------------------------------------------------------------------- runners
def case_arch(case: BenchCase) -> ModelArch:
    from mlite.config.catalog import preset_arch

    arch = preset_arch(case.model)
    if case.num_layers:
        arch = replace(arch, num_layers=case.num_layers)
    if case.gpus > 1:  # multi-rank layouts take an untied LM head (same FLOPs: the head counts either way)
        arch = replace(arch, tie_embeddings=False)
    return arch


def case_seq_lens(case: BenchCase, seed: int = 0) -> list[int]:
    return [case.seq_len] if case.packing == "full" else mixed_lengths(case.seq_len, seed=seed, shortest=max(8, case.seq_len // 16))


def random_sequences(seq_lens: list[int], vocab: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in seq_lens]


def _free(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _context_gb(device: str) -> float:
    """GPU memory in use outside torch's caching allocator (CUDA context, cuBLAS/cuDNN handles)."""
    import torch

    if not device.startswith("cuda"):
        return 0.0
    free, total = torch.cuda.mem_get_info()
    return (total - free - torch.cuda.memory_reserved()) / 2**30


def _peak_gb(device: str) -> tuple[float, float]:
    """(peak footprint: allocator's peak reservation + CUDA context, peak allocated) in GiB. The footprint is
    what must fit on the GPU, so it is what the planner's estimate is compared with."""
    import torch

    if not device.startswith("cuda"):
        return 0.0, 0.0
    return (torch.cuda.max_memory_reserved() / 2**30 + _context_gb(device),
            torch.cuda.max_memory_allocated() / 2**30)


def mlite_step_fn(arch: ModelArch, sequences: list[list[int]], device: str, compile_blocks: bool, accum: int = 1):
    """One mlite training step: packed forward, chunked LM-head loss (no [T, V] logits kept), backward,
    fused AdamW. bf16 parameters and optimizer state, as the HF baseline (same precision on both sides)."""
    import torch

    from mlite.runtime.data.packed import PackedBatch
    from mlite.runtime.loss import token_logprobs
    from mlite.runtime.models import build_model

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = build_model(arch, attention_backend="auto", dtype=dtype, device=device)
    if compile_blocks:
        for block in model.layers.values():
            block.compile(dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.startswith("cuda"))
    batch = PackedBatch.from_sequences(sequences).to(device)
    targets = batch.num_target_tokens

    def step() -> None:
        for _ in range(accum):
            out = model(batch)
            logp, _ = token_logprobs(out.hidden, batch.labels, model.compute_logits, head_weight=model.output.weight)
            loss = (-logp.sum() / targets + out.aux_loss) / accum
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, (model, opt)


def hf_step_fn(arch: ModelArch, sequences: list[list[int]], device: str, accum: int = 1):
    """The baseline: transformers' own model, SDPA attention, a right-padded batch (HF's usual way to train
    on sequences of mixed lengths), loss computed by the model, fused AdamW."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from mlite.runtime.ckpt.hf import hf_config_from_arch

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    cfg = hf_config_from_arch(arch, dtype)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.startswith("cuda"))
    longest = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)

    def step() -> None:
        for _ in range(accum):
            out = model(input_ids=ids, attention_mask=mask, labels=labels)
            (out.loss / accum).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, (model, opt)


def parallel_step_fn(case: BenchCase, arch: ModelArch, sequences: list[list[int]], device: str):
    """One training step of this rank of a torchrun launch in the case's layout: the runtime's
    parallelize_model (FSDP2 over dp x cp, experts over ep, zigzag context parallel), bf16 parameters and
    fused AdamW as on one GPU, gradients reduced in fp32 once per step. Blocks run eagerly (FSDP2's hooks
    are not compiled here): compare with the eager one-GPU reference of the same launch."""
    import torch
    import torch.distributed as dist

    from mlite.config import job_from_dict
    from mlite.runtime.data.packed import PackedBatch
    from mlite.runtime.loss import token_logprobs
    from mlite.runtime.models import build_model
    from mlite.runtime.parallel.context import split_for_context_parallel
    from mlite.runtime.parallel.mesh import ParallelDims
    from mlite.runtime.parallel.parallelize import parallelize_model, set_gradient_sync

    job = job_from_dict({"model": {"name": case.model},
                         "cluster": {"nodes": 1, "gpus_per_node": case.gpus},
                         "data": {"seq_len": case.seq_len},
                         "parallel": {"ep": case.ep, "cp": case.cp},
                         "precision": {"compute": "bf16", "master": "bf16"}})
    dims = ParallelDims.from_job(job, dist.get_world_size())
    mesh = dims.build(torch.device(device).type)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = parallelize_model(build_model(arch, attention_backend="auto", dtype=dtype, device=device), mesh, job,
                              torch.device(device).type)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.startswith("cuda"))
    batch = PackedBatch.from_sequences(sequences).to(device)
    targets = batch.num_target_tokens * dims.dp  # the step's loss is a mean over every replica's tokens
    if dims.cp > 1:
        batch = split_for_context_parallel(batch, dims.cp, mesh.rank_in("cp"))

    def step() -> None:
        for i in range(case.accum):
            set_gradient_sync(model, i == case.accum - 1)  # one reduce-scatter per optimizer step
            out = model(batch)
            logp, _ = token_logprobs(out.hidden, batch.labels, model.compute_logits)
            loss = (-logp.sum() / targets + out.aux_loss) / case.accum
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, (model, opt, mesh)


def run_parallel_case(case: BenchCase, device: str, steps: int = 8, warmup: int = 3, gpu: str = "cpu",
                      peak_tflops: float = 1.0) -> list[BenchResult]:
    """A multi-GPU case on the ranks of this torchrun launch. First every rank runs the one-GPU step of the
    same model on its own (N x one GPU, eager), then the parallel step; scaling = parallel tokens/s over
    the N x one-GPU tokens/s. Every rank returns the same results (rank 0 reports them)."""
    import torch
    import torch.distributed as dist

    from mlite.errors import MliteError

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != case.gpus:
        raise MliteError(f"bench case {case.name} runs on {case.gpus} ranks but this launch has {world}; "
                         f"run: torchrun --nproc-per-node {case.gpus} -m mlite bench {case.name}")
    arch = case_arch(case)
    seq_lens = case_seq_lens(case)
    sequences = random_sequences(seq_lens, arch.vocab, seed=dist.get_rank())  # each replica its own data

    def measure(make_step):
        _free(device)
        step, keep = make_step()
        dist.barrier()
        timing = time_steps(step, warmup, steps, device)
        peak = torch.tensor(_peak_gb(device), dtype=torch.float64, device=device)  # NCCL reduces on the GPU
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # the fullest GPU is what must fit
        del step, keep
        return timing, peak.tolist()

    single, single_peak = measure(lambda: mlite_step_fn(arch, sequences, device, False, case.accum))
    single_tps = torch.tensor(sum(seq_lens) * case.accum / (single.median_ms / 1e3), dtype=torch.float64,
                              device=device)
    dist.all_reduce(single_tps)  # N x one GPU, measured side by side
    par, par_peak = measure(lambda: parallel_step_fn(case, arch, sequences, device))
    slowest = torch.tensor(par.median_ms, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    replicas = world // case.cp  # dp replicas; each one's tokens are split over cp ranks
    tokens = sum(seq_lens) * case.accum * replicas
    tps = tokens / (float(slowest) / 1e3)
    _free(device)
    return [
        BenchResult(case=case.name, side=f"mlite x{world}", tokens_per_step=tokens, step_ms=float(slowest),
                    tokens_per_s=tps, mfu=mfu(arch, seq_lens, tps / world, peak_tflops), peak_gb=par_peak[0],
                    estimate_gb=planner_estimate_gb(case, arch, gpu), device=device,
                    extra={"scaling": tps / float(single_tps), "world": world, "peak_allocated_gb": par_peak[1],
                           "accum": case.accum, "step_ms_all": par.step_ms}),
        BenchResult(case=case.name, side=f"{world} x one GPU", tokens_per_step=sum(seq_lens) * case.accum * world,
                    step_ms=single.median_ms, tokens_per_s=float(single_tps),
                    mfu=mfu(arch, seq_lens, float(single_tps) / world, peak_tflops), peak_gb=single_peak[0],
                    device=device, extra={"world": world, "step_ms_all": single.step_ms}),
    ]


def planner_estimate_gb(case: BenchCase, arch: ModelArch, gpu: str) -> Optional[float]:
    """The planner's per-GPU peak for this case (bf16 params and optimizer state, as benchmarked)."""
    from mlite.config import job_from_dict
    from mlite.plan import plan_job

    if gpu not in ("h100", "h200", "b200", "b300", "a100", "h800", "h20"):
        return None
    job = job_from_dict({
        "model": {"name": case.model},
        "cluster": {"nodes": 1, "gpus_per_node": case.gpus, "gpu": gpu},
        "parallel": {"ep": case.ep, "cp": case.cp},
        "optimizer": {"backend": "fsdp2"},
        "precision": {"compute": "bf16", "master": "bf16"},
        "data": {"seq_len": case.seq_len, "micro_batch_size": 1, "global_batch_size": case.dp * case.accum,
                 "dynamic_batch": False},
    })
    return plan_job(job, arch).memory.train_gb


def run_case(case: BenchCase, device: str, steps: int = 8, warmup: int = 3, sides=("mlite", "hf"),
             compile_blocks: bool = True, gpu: str = "cpu", peak_tflops: float = 1.0) -> list[BenchResult]:
    arch = case_arch(case)
    seq_lens = case_seq_lens(case)
    sequences = random_sequences(seq_lens, arch.vocab, seed=0)
    tokens = sum(seq_lens) * case.accum
    results = []
    for side in sides:
        if side == "hf" and not case.baseline:
            continue
        _free(device)
        step, keep = (mlite_step_fn(arch, sequences, device, compile_blocks and device.startswith("cuda"), case.accum)
                      if side == "mlite" else hf_step_fn(arch, sequences, device, case.accum))
        timing = time_steps(step, warmup, steps, device)
        tps = tokens / (timing.median_ms / 1e3)
        footprint, allocated = _peak_gb(device)
        results.append(BenchResult(
            case=case.name, side=side, tokens_per_step=tokens, step_ms=timing.median_ms, tokens_per_s=tps,
            mfu=mfu(arch, seq_lens, tps, peak_tflops), peak_gb=footprint,
            estimate_gb=planner_estimate_gb(case, arch, gpu) if side == "mlite" else None, device=device,
            extra={"seq_lens": seq_lens if len(seq_lens) < 64 else len(seq_lens), "step_ms_all": timing.step_ms,
                   "peak_allocated_gb": allocated, "accum": case.accum},
        ))
        del step, keep
    _free(device)
    return results


__all__ = [
    "BenchCase", "BenchResult", "CASES", "flops_per_token", "matmul_params_per_token", "mfu", "mixed_lengths",
    "effective_seq_len", "time_steps", "write_results", "render_table", "run_case", "run_parallel_case", "case_arch",
]
