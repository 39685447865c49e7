"""`mlite bench`: the trainers' training step next to the HF-transformers baseline, in one launch.

The mlite side is `mlite.runtime.engine.Runtime` driven as the SFT trainer drives it (mlite.trainers.sft):
per step zero_grad, forward_backward over the step's micro-batches with `sft_loss`, optimizer_step (grad
norm, clipping, AdamW) and lr_scheduler_step, on a job built from the case (model, layout, bf16 parameters
and optimizer state on GPUs). There is no step of the benchmark's own: what is timed is what training runs,
LM-head kernel (mlite.runtime.kernels.lm_head), attention backend and host syncs included. The HF side is
transformers' own model (SDPA attention, loss computed by the model, fused AdamW, bf16) on the same tokens.

We report tokens/s, MFU, peak memory, and the planner's memory estimate next to the measured peak.
Timing: median over steps after warm-up, measured with CUDA events on GPUs (perf_counter on CPU, where the
suite runs the tiny cases to cover this code).

MFU (as in ../shared/REFERENCE.md section 4, against the GPU's dense bf16 peak):
    flops/token = 6 * (matmul params of the active path + LM head) + 6 * layers * (heads * head_dim) * s_eff
where s_eff = sum(len_i^2) / sum(len_i) over the packed sequences (causal attention costs ~len^2 / 2 per
sequence, forward + backward = 3x, 2 FLOPs per multiply-add). Only the top-k routed experts count for MoE.
DeepSeek-V4 attends over gathered key sets, not the causal square: its count is `v4_flops_per_token`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mlite.config.arch import V4_CSA, ModelArch
from mlite.config.catalog import layer_params


# ---------------------------------------------------------------------------------------------- FLOPs
def matmul_params_per_token(arch: ModelArch) -> int:
    """Parameters every token multiplies through (the catalog's active count per layer) plus the LM head,
    which runs even when tied to the embedding. Norm weights ride along: under 0.1% of the total.
    DeepSeek-V4: the exact matmul count of `v4_matmul_params_per_token`."""
    if arch.v4 is not None:
        return v4_matmul_params_per_token(arch)
    return sum(layer_params(arch, i).active for i in range(arch.num_layers)) + arch.hidden * arch.vocab


def effective_seq_len(seq_lens: list[int]) -> float:
    return sum(n * n for n in seq_lens) / max(1, sum(seq_lens))


def flops_per_token(arch: ModelArch, seq_lens: list[int]) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward)."""
    if arch.v4 is not None:
        return 3 * v4_flops_per_token(arch, seq_lens)
    attention = 6 * arch.num_layers * arch.num_heads * arch.head_dim * effective_seq_len(seq_lens)
    return 6 * matmul_params_per_token(arch) + attention




def v4_matmul_params_per_token(arch: ModelArch) -> int:
    """DeepSeek-V4: the weights of every matmul one token runs through, per layer

        attention  h x q_lora + q_lora x heads x head_dim + h x head_dim          (q down, q up, shared K=V)
                   + heads x head_dim x o_lora + o_groups x o_lora x h           (grouped low-rank output)
          CSA/HCA  + 2 x h x width x head_dim                (compressor kv + gate; width 2 on CSA, else 1)
          CSA      + 2 x h x 2 x index_head_dim + q_lora x index_heads x index_head_dim + h x index_heads
                                                  (indexer compressor kv + gate, indexer q, head weights)
        MoE        3 x h x (shared_ffn + top_k x expert_ffn) + experts x h        (experts, router)
        mHC        2 x (2 + n) x n x (n x h)                  (fn matrices before attention and the MoE)

    plus the mHC head (n x n x h) and the LM head (h x vocab). Norms, sinks, biases and mHC bases/scales
    are not matmuls and are left out; the MTP block is not counted (the bench trains without it)."""
    v4, moe, h = arch.v4, arch.moe, arch.hidden
    heads, hd, n = arch.num_heads, arch.head_dim, v4.hc_mult
    total = 0
    for layer in range(arch.num_layers):
        ratio = v4.compress_ratios[layer]
        attn = h * v4.q_lora_rank + v4.q_lora_rank * heads * hd + h * hd
        attn += heads * hd * v4.o_lora_rank + v4.o_groups * v4.o_lora_rank * h
        if ratio:
            attn += 2 * h * (2 if ratio == V4_CSA else 1) * hd
        if ratio == V4_CSA:
            ihd, iheads = v4.index_head_dim, v4.index_n_heads
            attn += 2 * h * 2 * ihd + v4.q_lora_rank * iheads * ihd + h * iheads
        ffn = 3 * h * (moe.shared_expert_ffn + moe.top_k * moe.expert_ffn) + moe.num_experts * h
        mhc = 2 * (2 + n) * n * n * h
        total += attn + ffn + mhc
    return total + n * n * h + h * arch.vocab


def _mean_over_tokens(seq_lens: list[int], visible: Callable[[int], int]) -> float:
    """visible(p) averaged over every token of the packed batch, p its position in its sequence."""
    return sum(visible(p) for n in seq_lens for p in range(n)) / max(1, sum(seq_lens))


def v4_flops_per_token(arch: ModelArch, seq_lens: list[int]) -> float:
    """DeepSeek-V4 forward FLOPs per token (2 per multiply-add), exact for the packed `seq_lens`:

        2 x v4_matmul_params_per_token(arch)
        + sum over layers of 4 x heads x head_dim x K_layer            (attention core: scores and values)
        + sum over CSA layers of 2 x index_heads x index_head_dim x E  (the indexer scores every entry)

    K_layer is the number of keys a query at position p really sees, averaged over the batch's tokens:
    min(window, p + 1) sliding-window keys on every layer, plus on an HCA layer (ratio r) (p + 1) // r
    compressed entries, on a CSA layer (ratio 4) min(index_topk, (p + 1) // 4) of them (the indexer's
    pick); E = (p + 1) // 4, the CSA entries visible to the query, averaged the same way. Training is
    3 x this (`flops_per_token`)."""
    v4 = arch.v4
    window = _mean_over_tokens(seq_lens, lambda p: min(v4.sliding_window, p + 1))
    compressed = {}
    for ratio in set(v4.compress_ratios) - {0}:
        cap = v4.index_topk if ratio == V4_CSA else None
        compressed[ratio] = _mean_over_tokens(
            seq_lens, lambda p, r=ratio, c=cap: (p + 1) // r if c is None else min(c, (p + 1) // r))
    keys = sum(window + compressed.get(ratio, 0.0) for ratio in v4.compress_ratios)
    core = 4 * arch.num_heads * arch.head_dim * keys
    csa_layers = sum(1 for ratio in v4.compress_ratios if ratio == V4_CSA)
    indexer = 0.0
    if csa_layers:
        entries = _mean_over_tokens(seq_lens, lambda p: (p + 1) // V4_CSA)
        indexer = csa_layers * 2 * v4.index_n_heads * v4.index_head_dim * entries
    return 2 * v4_matmul_params_per_token(arch) + core + indexer


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
    num_layers: int | None = None  # truncate the model (MoE layers on one GPU)
    gpus: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1
    accum: int = 1  # micro-batches per optimizer step (gradient accumulation), on both sides
    baseline: bool = True  # also run HF transformers
    # the parallel side's optimizer.backend; dist_opt keeps fp32 masters (Megatron's optimizer has no bf16
    # ones), and so does its one-GPU reference then, so that the comparison is the backend's cost
    backend: str = "fsdp2"
    # the one-GPU reference's master weights where the case's own do not fit one GPU (None: the case's)
    reference_master: str | None = None
    note: str = ""
    config: dict = field(default_factory=dict)  # HF config keys set over the preset's (after num_layers)


_DSV4_4L = {"compress_ratios": [0, 4, 128, 4], "num_hash_layers": 1, "n_routed_experts": 32}

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
        # 4 micro-batches a step on each rank, as an SFT global batch gives them: one reduce-scatter a
        # step (FSDP2 accumulates whole gradients), an all-gather a micro-batch
        BenchCase("dense-1.7b-4k-dp2-accum4", "qwen3-1.7b", 4096, gpus=2, dp=2, accum=4, baseline=False),
        BenchCase("moe-30b-a3b-8l-4k-ep2", "qwen3-30b-a3b", 4096, num_layers=8, gpus=2, dp=2, ep=2,
                  baseline=False),
        BenchCase("moe-30b-a3b-8l-4k-ep4", "qwen3-30b-a3b", 4096, num_layers=8, gpus=4, dp=4, ep=4,
                  baseline=False),
        BenchCase("dense-1.7b-16k-cp4", "qwen3-1.7b", 16384, gpus=4, cp=4, baseline=False),
        # the same layouts under Megatron-Core's distributed optimizer (no per-unit host work: one
        # reduce-scatter and one all-gather a step)
        BenchCase("dense-1.7b-4k-dp2-dist-opt", "qwen3-1.7b", 4096, gpus=2, dp=2, baseline=False,
                  backend="dist_opt"),
        BenchCase("dense-1.7b-4k-dp4-dist-opt", "qwen3-1.7b", 4096, gpus=4, dp=4, baseline=False,
                  backend="dist_opt"),
        # 8 layers' 4.8B expert parameters with fp32 masters and Adam state (16 B each, 77 GB) do not fit
        # one H100: the reference keeps bf16 masters, the faster step, so the scaling figure is a floor
        BenchCase("moe-30b-a3b-8l-4k-ep4-dist-opt", "qwen3-30b-a3b", 4096, num_layers=8, gpus=4, dp=4, ep=4,
                  baseline=False, backend="dist_opt", reference_master="bf16"),
        # DeepSeek-V4-Flash widths on one GPU: 4 layers (sliding, CSA, HCA, CSA; the first hash-routed),
        # 32 routed experts top-6 + 1 shared; the layers of ../shared/REFERENCE.md section 4's HF anchor
        BenchCase("dsv4-flash-4l-4k", "deepseek-v4-flash", 4096, num_layers=4, config=_DSV4_4L),
        BenchCase("dsv4-flash-4l-2k", "deepseek-v4-flash", 2048, num_layers=4, config=_DSV4_4L),
        # issue 13: a 16k sequence on one H100, where transformers' eager attention (T x T scores per layer)
        # runs out of memory
        BenchCase("dsv4-flash-4l-16k", "deepseek-v4-flash", 16384, num_layers=4, config=_DSV4_4L,
                  baseline=False),
        # the CPU suite's cases: exercise every code path in seconds (the multi-rank ones on gloo)
        BenchCase("tiny-cpu", "tiny-qwen3-moe", 128, packing="mixed"),
        BenchCase("tiny-cpu-dp2", "tiny-qwen3", 128, packing="mixed", gpus=2, dp=2, baseline=False),
        BenchCase("tiny-cpu-ep2", "tiny-qwen3-moe", 128, packing="mixed", gpus=2, dp=2, ep=2, baseline=False),
        # the DeepSeek-V4 cases' code path (sliding, CSA, HCA ratio 16, CSA; first layer hash-routed)
        BenchCase("tiny-dsv4", "tiny-deepseek-v4", 128, packing="mixed"),
    ]
}

# What the HF side is compared with where this transformers cannot build the model (measured for this
# project, ../shared/REFERENCE.md section 4): model_type -> the reference figures.
HF_ANCHORS = {
    "deepseek_v4": "transformers 5.23 on one H100: 7,790 tokens/s, 8.5% MFU, 68.2 GB at 4096; "
                   "8,945 tokens/s, 9.7% at 2048",
}
HF_CLASSES = {"deepseek_v4": "DeepseekV4ForCausalLM"}  # model types that not every transformers has


# ---------------------------------------------------------------------------------------------- timing
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


def time_steps(step: Callable[[], None], warmup: int, steps: int, device: str) -> Timing:
    """Median-friendly per-step times; CUDA events on GPUs (no host sync inside a step)."""
    for _ in range(warmup):
        step()
    timing = Timing()
    with collector_passes(timing.gc_passes):
        _timed_steps(step, steps, device, timing)
    return timing


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


# ---------------------------------------------------------------------------------------------- report
@dataclass
class BenchResult:
    case: str
    side: str  # mlite | hf
    tokens_per_step: int  # tokens of one optimizer step, every micro-batch and data-parallel replica
    step_ms: float
    tokens_per_s: float
    flops_per_token: float  # the MFU formula's, for this case's sequence lengths
    mfu: float  # flops_per_token * tokens_per_s (per GPU) / the GPU's dense bf16 peak
    peak_gb: float
    estimate_gb: float | None = None
    device: str = ""
    extra: dict = field(default_factory=dict)
    skipped: str = ""  # why this side did not run (then no figure is measured), and what to compare with


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


def render_table(results: list[BenchResult]):
    from rich.table import Table

    table = Table(title="mlite bench (median step after warm-up)")
    for col in ("case", "side", "tokens/s", "MFU", "step ms", "peak GB", "plan GB", "plan err", "scaling"):
        table.add_column(col, justify="right" if col not in ("case", "side") else "left")
    notes = []
    for r in results:
        if r.skipped:
            table.add_row(r.case, r.side, "skipped", "", "", "", "", "", "")
            notes.append(f"{r.case} {r.side}: {r.skipped}")
            continue
        err = "" if not r.estimate_gb or not r.peak_gb else f"{(r.estimate_gb - r.peak_gb) / r.peak_gb:+.0%}"
        table.add_row(
            r.case, r.side, f"{r.tokens_per_s:,.0f}", f"{r.mfu:.1%}", f"{r.step_ms:.1f}", f"{r.peak_gb:.1f}",
            "" if r.estimate_gb is None else f"{r.estimate_gb:.1f}", err,
            f"{r.extra['scaling']:.0%}" if "scaling" in r.extra else "",
        )
    if notes:
        table.caption = "\n".join(notes)
    return table


# ---------------------------------------------------------------------------------------------- runners
def case_hf_config(case: BenchCase) -> dict:
    """The HF config.json of the case's model: the catalog preset, truncated to the case's layers. Multi-rank
    layouts take an untied LM head (same FLOPs: the head counts either way)."""
    from mlite.config.catalog import PRESETS, preset_arch

    preset_arch(case.model)  # the catalog's own error for an unknown name
    config = dict(PRESETS[case.model])
    if case.num_layers:
        config["num_hidden_layers"] = case.num_layers
    config.update(case.config)
    if case.gpus > 1:
        config["tie_word_embeddings"] = False
    return config


def case_arch(case: BenchCase) -> ModelArch:
    from mlite.config.arch import arch_from_hf_config

    return arch_from_hf_config(case_hf_config(case), name=case.model)


def case_precision(case: BenchCase, cuda: bool, one_gpu: bool = False) -> dict:
    """bf16 parameters and Adam state on GPUs (the precision of the HF baseline beside it), fp32 masters
    under dist_opt; fp32 on CPU. `one_gpu`: a multi-rank case's one-GPU reference (its reference_master)."""
    if not cuda:
        return {"compute": "fp32", "master": "fp32"}
    if one_gpu and case.reference_master:
        return {"compute": "bf16", "master": case.reference_master}
    return {"compute": "bf16", "master": "fp32" if case.backend == "dist_opt" else "bf16"}


# the keys a multi-GPU case's name fixes (its mesh): `mlite bench --set` takes any other key
LAYOUT_KEYS = ("parallel.tp", "parallel.pp", "parallel.vpp", "parallel.cp", "parallel.ep", "parallel.etp",
               "cluster.gpus_per_node", "cluster.nodes")


def case_job(case: BenchCase, device: str, one_gpu: bool = False, overrides: Sequence[str] = ()):
    """The job the Runtime runs for the case. `one_gpu`: the one-GPU reference of a multi-rank case;
    `overrides`: job keys as on the trainers' command line (`mlite bench --set model.compile=false`),
    for an A/B of one key on the same case."""
    from mlite.config import apply_overrides, job_from_dict

    cuda = device.startswith("cuda")
    gpus, ep, cp = (1, 1, 1) if one_gpu else (case.gpus, case.ep, case.cp)
    job = {
        "model": {"name": case.model, "compile": cuda},  # model.compile: the speed a GPU job asks for
        "cluster": {"nodes": 1, "gpus_per_node": gpus},
        "parallel": {"ep": ep, "cp": cp},
        "data": {"seq_len": case.seq_len, "micro_batch_size": 1,
                 "global_batch_size": (gpus // cp) * case.accum},
        "precision": case_precision(case, cuda, one_gpu),
        "optimizer": {"lr": 1e-5, "backend": "fsdp2" if one_gpu else case.backend},
        "trainer": {"device": "cuda" if cuda else "cpu"},
    }
    return job_from_dict(apply_overrides(job, overrides))


def case_seq_lens(case: BenchCase, seed: int = 0) -> list[int]:
    if case.packing == "full":
        return [case.seq_len]
    return mixed_lengths(case.seq_len, seed=seed, shortest=max(8, case.seq_len // 16))


def random_sequences(seq_lens: list[int], vocab: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in seq_lens]


def free_memory(device: str) -> None:
    """Collect what the last Runtime left (its hooks close reference cycles) and give the GPU's cached
    blocks back, so the next measurement starts from an empty allocator."""
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


def launch_device() -> str:
    """This torchrun rank's GPU (LOCAL_RANK; cuda:0 alone), made current, with the launch's process group
    held (`hold_launch_group`): where the GPU scripts that time one case start."""
    import torch

    device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    torch.cuda.set_device(device)
    hold_launch_group(device)
    return device


def launch_ranks(cases: list[BenchCase]) -> tuple[int, int]:
    """(world, rank) of this torchrun launch, refused in one line unless every multi-GPU case runs on it."""
    from mlite.errors import MliteError

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    for case in cases:
        if world != case.gpus:
            raise MliteError(f"bench case {case.name} runs on {case.gpus} ranks but this launch has {world}; "
                             f"run: torchrun --nproc-per-node {case.gpus} -m mlite bench {case.name}")
    return world, rank


def replica_seed(case: BenchCase, device: str, rank: int, world: int) -> int:
    """The seed of a rank's sequences in a multi-GPU case: replicas see different data, the ranks of one
    replica (cp) the same, so the seed is the rank's data-parallel coordinate."""
    from mlite.runtime.parallel.mesh import ParallelDims

    return ParallelDims.from_job(case_job(case, device), world).coordinates(rank)["dp"]


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


def _transformers_has(name: str) -> bool:
    import transformers

    return hasattr(transformers, name)


def hf_skip_reason(arch: ModelArch) -> str:
    """Why the HF side cannot run for `arch` with the installed transformers ('' when it can), with the
    measured reference to compare the mlite side with instead."""
    cls = HF_CLASSES.get(arch.model_type)
    if cls is None or _transformers_has(cls):
        return ""
    import transformers

    return (f"transformers {transformers.__version__} has no {arch.model_type}; "
            f"anchor: {HF_ANCHORS[arch.model_type]}")


def hf_step_fn(arch: ModelArch, sequences: list[list[int]], device: str, accum: int = 1):
    """The baseline: transformers' own model, SDPA attention, a right-padded batch (HF's usual way to train
    on sequences of mixed lengths), loss computed by the model, fused AdamW. DeepSeek-V4: eager attention
    (the only one transformers has for it), grouped_mm experts, and a balanced random hash table on the
    hash-routed layers (transformers initialises it to zeros: every token to expert 0), as the mlite side
    has."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from mlite.runtime.ckpt.hf import hf_config_from_arch

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    cfg = hf_config_from_arch(arch, dtype)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    kwargs = {"attn_implementation": "sdpa"}
    if arch.v4 is not None:
        kwargs = {"attn_implementation": "eager", "experts_implementation": "grouped_mm"}
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    if arch.v4 is not None:
        from mlite.runtime.models.deepseek_v4 import balanced_hash_table

        table = balanced_hash_table(arch.vocab, arch.moe.num_experts, arch.moe.top_k)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(getattr(module, "tid2eid", None), torch.Tensor):
                    module.tid2eid.copy_(table)
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

    return step, (model, opt), {}


@dataclass
class Measured:
    timing: Timing
    peak_gb: float
    allocated_gb: float
    last: dict
    outside_allocator_gb: float


def measure(make: Callable[[], tuple], device: str, steps: int, warmup: int,
            before_timing: Callable[[], None] | None = None) -> Measured:
    """Build a side (`make() -> (step, keep, last)`), time its steps, read its peak memory, free it."""
    free_memory(device)
    step, keep, last = make()
    if before_timing is not None:
        before_timing()
    timing = time_steps(step, warmup, steps, device)
    footprint, allocated, outside = _peak_gb(device)
    if hasattr(keep, "close"):  # a Runtime: Python's automatic garbage collection back on (trainer.gc_every)
        keep.close()
    del step, keep
    free_memory(device)
    return Measured(timing, footprint, allocated, {key: float(value) for key, value in last.items()}, outside)


def planner_estimate_gb(case: BenchCase, arch: ModelArch, gpu: str,
                        overrides: Sequence[str] = ()) -> float | None:
    """The planner's per-GPU peak for this case (its backend and precision, as benchmarked), with
    the run's `--set` keys (optimizer state, recompute) applied as they are to the Runtime's job."""
    from mlite.config import apply_overrides, job_from_dict
    from mlite.plan import plan_job

    if gpu not in ("h100", "h200", "b200", "b300", "a100", "h800", "h20"):
        return None
    job = job_from_dict(apply_overrides({
        "model": {"name": case.model},
        "cluster": {"nodes": 1, "gpus_per_node": case.gpus, "gpu": gpu},
        "parallel": {"ep": case.ep, "cp": case.cp},
        "optimizer": {"backend": case.backend},
        "precision": case_precision(case, cuda=True),
        "data": {"seq_len": case.seq_len, "micro_batch_size": 1, "global_batch_size": case.dp * case.accum,
                 "dynamic_batch": False},
    }, overrides))
    return plan_job(job, arch).memory.train_gb


def run_case(case: BenchCase, device: str, steps: int = 8, warmup: int = 3, sides=("mlite", "hf"),
             gpu: str = "cpu", peak_tflops: float = 1.0, overrides: Sequence[str] = ()) -> list[BenchResult]:
    """A one-GPU case: the Runtime's step, then (unless the case or `sides` leave it out) HF's.
    `overrides`: job keys for the Runtime's side (case_job)."""
    arch = case_arch(case)
    seq_lens = case_seq_lens(case)
    sequences = random_sequences(seq_lens, arch.vocab, seed=0)
    tokens = sum(seq_lens) * case.accum
    fpt = flops_per_token(arch, seq_lens)
    results = []
    for side in sides:
        if side == "hf" and not case.baseline:
            continue
        if side == "hf" and (reason := hf_skip_reason(arch)):
            results.append(BenchResult(case=case.name, side=side, tokens_per_step=tokens, step_ms=0.0,
                                       tokens_per_s=0.0, flops_per_token=fpt, mfu=0.0, peak_gb=0.0,
                                       device=device, skipped=reason))
            continue
        if side == "mlite":
            m = measure(lambda: runtime_step_fn(case, sequences, device, overrides=overrides), device, steps,
                        warmup)
        else:
            m = measure(lambda: hf_step_fn(arch, sequences, device, case.accum), device, steps, warmup)
        tps = tokens / (m.timing.median_ms / 1e3)
        results.append(BenchResult(
            case=case.name, side=side, tokens_per_step=tokens, step_ms=m.timing.median_ms, tokens_per_s=tps,
            flops_per_token=fpt, mfu=mfu(arch, seq_lens, tps, peak_tflops), peak_gb=m.peak_gb,
            estimate_gb=planner_estimate_gb(case, arch, gpu, overrides) if side == "mlite" else None,
            device=device,
            extra={"seq_lens": seq_lens if len(seq_lens) < 64 else len(seq_lens),
                   "step_ms_all": m.timing.step_ms, "wall_ms_per_step": m.timing.wall_ms,
                   "gc_passes": m.timing.gc_passes,
                   "peak_allocated_gb": m.allocated_gb, "accum": case.accum,
                   "outside_allocator_gb": m.outside_allocator_gb,
                   **({"overrides": list(overrides)} if side == "mlite" and overrides else {}), **m.last},
        ))
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


def run_parallel_cases(cases: list[BenchCase], device: str, steps: int = 8, warmup: int = 3, gpu: str = "cpu",
                       peak_tflops: float = 1.0, overrides: Sequence[str] = ()) -> list[BenchResult]:
    """Multi-GPU cases on the ranks of this torchrun launch, every rank returning the same results (rank 0
    reports them). First every rank runs each case's one-GPU step on its own GPU, all ranks at once and
    before the process group exists (a Runtime of one process: N x one GPU); then this starts the process
    group and runs each case in its layout. scaling = parallel tokens/s over the N x one-GPU tokens/s.
    Both are the Runtime's step as `case_job` sets it: compiled blocks on GPUs, eager on CPU. `overrides`
    (job keys other than the layout's, LAYOUT_KEYS) apply to both, parallel.* keys to the layout only."""
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
            singles[case.name] = measure(make, device, steps, warmup)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    try:
        results = []
        for case in cases:
            results += _parallel_case(case, singles[case.name], device, steps, warmup, gpu, peak_tflops,
                                      overrides)
    except BaseException:
        end_process_group(clean=False)
        raise
    end_process_group(clean=True)
    return results


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


def _parallel_case(case: BenchCase, single: Measured, device: str, steps: int, warmup: int, gpu: str,
                   peak_tflops: float, overrides: Sequence[str] = ()) -> list[BenchResult]:
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
                  warmup, before_timing=dist.barrier)
    bus = {key: min(bus[key], after) for key, after in collective_bus_gbs(device).items()}  # before and after
    bus = dict(zip(bus, reduce(list(bus.values()), dist.ReduceOp.MIN)))  # the slowest rank's view
    slowest, par_peak, par_alloc, par_outside, par_gc_ms = reduce(
        [par.timing.median_ms, par.peak_gb, par.allocated_gb, par.outside_allocator_gb,
         sum(ms for _generation, ms in par.timing.gc_passes)], dist.ReduceOp.MAX)
    tokens = sum(seq_lens) * case.accum * dims.dp
    tps = tokens / (slowest / 1e3)
    return [
        BenchResult(case=case.name, side=f"mlite x{world}", tokens_per_step=tokens, step_ms=slowest,
                    tokens_per_s=tps, flops_per_token=fpt, mfu=mfu(arch, seq_lens, tps / world, peak_tflops),
                    peak_gb=par_peak, estimate_gb=planner_estimate_gb(case, arch, gpu, overrides),
                    device=device,
                    extra={"scaling": tps / single_tps, "world": world, "peak_allocated_gb": par_alloc,
                           "outside_allocator_gb": par_outside, **bus,
                           "accum": case.accum, "step_ms_all": par.timing.step_ms,
                           "wall_ms_per_step": par.timing.wall_ms, "gc_passes": par.timing.gc_passes,
                           "gc_ms_slowest_rank": par_gc_ms,
                           **({"overrides": list(overrides)} if overrides else {}), **par.last}),
        BenchResult(case=case.name, side=f"{world} x one GPU", tokens_per_step=single_tokens * world,
                    step_ms=single.timing.median_ms, tokens_per_s=single_tps, flops_per_token=fpt,
                    mfu=mfu(arch, seq_lens, single_tps / world, peak_tflops), peak_gb=single_peak,
                    device=device,
                    extra={"world": world, "step_ms_all": single.timing.step_ms,
                           "master": case_precision(case, device.startswith("cuda"), one_gpu=True)["master"],
                           "wall_ms_per_step": single.timing.wall_ms, "gc_passes": single.timing.gc_passes,
                           **single.last}),
    ]


__all__ = [
    "CASES",
    "BenchCase",
    "BenchResult",
    "case_arch",
    "case_hf_config",
    "case_job",
    "effective_seq_len",
    "flops_per_token",
    "hf_skip_reason",
    "matmul_params_per_token",
    "mfu",
    "mixed_lengths",
    "render_table",
    "run_case",
    "run_parallel_cases",
    "runtime_step_fn",
    "time_steps",
    "v4_flops_per_token",
    "v4_matmul_params_per_token",
    "write_results",
]
