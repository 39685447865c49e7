"""The bench cases: the CASES table, and what a case is as a model (its HF config and arch), as the job the
Runtime runs, as the job the planner sizes, and as the token batches it trains on.

No torch at import (random_sequences imports it when called).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from mlite.config.arch import ModelArch
from mlite.config.backends import backend_traits


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
    titan: bool = False  # torchtitan builds the model (its Qwen3): `mlite bench --titan` runs its side too
    # the parallel side's optimizer.backend; dist_opt keeps fp32 masters (Megatron's optimizer has no bf16
    # ones), and so does its one-GPU reference then, so that the comparison is the backend's cost
    backend: str = "fsdp2"
    # the one-GPU reference's master weights where the case's own do not fit one GPU (None: the case's)
    reference_master: str | None = None
    fp8: str = "none"  # precision.fp8 on GPUs (the CPU runs it refuses)
    note: str = ""
    config: dict = field(default_factory=dict)  # HF config keys set over the preset's (after num_layers)


_DSV4_4L = {"compress_ratios": [0, 4, 128, 4], "num_hash_layers": 1, "n_routed_experts": 32}

CASES: dict[str, BenchCase] = {
    c.name: c
    for c in [
        BenchCase("dense-1.7b-4k", "qwen3-1.7b", 4096, titan=True),
        BenchCase("dense-1.7b-4k-mixed", "qwen3-1.7b", 4096, packing="mixed", titan=True),
        BenchCase("moe-30b-a3b-6l-4k", "qwen3-30b-a3b", 4096, num_layers=6, titan=True),
        BenchCase("moe-30b-a3b-6l-4k-mixed", "qwen3-30b-a3b", 4096, packing="mixed", num_layers=6,
                  titan=True),
        # the optimizer step amortised over 4 micro-batches, as real training does
        BenchCase("dense-1.7b-4k-accum4", "qwen3-1.7b", 4096, accum=4, titan=True),
        BenchCase("moe-30b-a3b-6l-4k-accum4", "qwen3-30b-a3b", 4096, num_layers=6, accum=4, titan=True),
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
        # 32 routed experts top-6 + 1 shared; the layers of the HF anchor (bench.hf_side.HF_ANCHORS)
        BenchCase("dsv4-flash-4l-4k", "deepseek-v4-flash", 4096, num_layers=4, config=_DSV4_4L),
        BenchCase("dsv4-flash-4l-2k", "deepseek-v4-flash", 2048, num_layers=4, config=_DSV4_4L),
        # a 16k sequence on one H100, where transformers' eager attention (T x T scores per layer)
        # runs out of memory
        BenchCase("dsv4-flash-4l-16k", "deepseek-v4-flash", 16384, num_layers=4, config=_DSV4_4L,
                  baseline=False),
        # FP8 twins of the one-GPU cases (precision.fp8): `mlite bench CASE CASE-fp8` compares the two in one
        # launch; transformers' side is the bf16 case's, so the twins run no baseline of their own.
        # tensorwise linears (torchao 0.18's rowwise and blockwise linears measured slower than bf16 on an
        # H200, docs/PERFORMANCE.md), the routed experts rowwise where they gain (never at these shapes: an
        # A/B needs --set precision.fp8_linears=all); -blockwise: DeepSeek's
        BenchCase("dense-1.7b-4k-fp8", "qwen3-1.7b", 4096, baseline=False, fp8="tensorwise", titan=True),
        # 16k tokens a micro-batch (mixed documents packed, as SFT packs): each linear's GEMM 4x longer,
        # where FP8's casts cost less than its faster GEMM saves (scripts/fp8_linear_ab.py); bf16 twin
        BenchCase("dense-1.7b-16k-mixed", "qwen3-1.7b", 16384, packing="mixed", baseline=False, titan=True),
        # the same packing at 8k and 12k: where per-sequence attention starts to beat one varlen call
        # (model.attention_backend: auto), and the planner's activations per token between 4k and 16k
        BenchCase("dense-1.7b-8k-mixed", "qwen3-1.7b", 8192, packing="mixed", baseline=False),
        BenchCase("dense-1.7b-12k-mixed", "qwen3-1.7b", 12288, packing="mixed", baseline=False),
        BenchCase("dense-1.7b-16k-mixed-fp8", "qwen3-1.7b", 16384, packing="mixed", baseline=False,
                  fp8="tensorwise", titan=True),
        BenchCase("moe-30b-a3b-6l-4k-fp8", "qwen3-30b-a3b", 4096, num_layers=6, baseline=False,
                  fp8="tensorwise", titan=True),
        BenchCase("dsv4-flash-4l-4k-fp8", "deepseek-v4-flash", 4096, num_layers=4, config=_DSV4_4L,
                  baseline=False, fp8="tensorwise"),
        BenchCase("dsv4-flash-4l-4k-fp8-blockwise", "deepseek-v4-flash", 4096, num_layers=4, config=_DSV4_4L,
                  baseline=False, fp8="blockwise"),
        # FP8 over several GPUs: fsdp2 gathers the weights in bf16 (precision.fp8_all_gather auto; --set
        # precision.fp8_all_gather=true gathers the FP8 linears' in FP8); under ep the experts' grouped GEMMs
        # stay bf16 at 512 rows an expert (fp8_experts_gain), and --set precision.fp8_linears=all runs them
        # in rowwise FP8. Against their bf16 twins above
        BenchCase("dense-1.7b-4k-dp2-fp8", "qwen3-1.7b", 4096, gpus=2, dp=2, baseline=False,
                  fp8="tensorwise"),
        BenchCase("moe-30b-a3b-8l-4k-ep2-fp8", "qwen3-30b-a3b", 4096, num_layers=8, gpus=2, dp=2, ep=2,
                  baseline=False, fp8="tensorwise"),
        # the CPU suite's cases: exercise every code path in seconds (the multi-rank ones on gloo)
        BenchCase("tiny-cpu", "tiny-qwen3-moe", 128, packing="mixed", titan=True),
        BenchCase("tiny-cpu-dp2", "tiny-qwen3", 128, packing="mixed", gpus=2, dp=2, baseline=False),
        BenchCase("tiny-cpu-ep2", "tiny-qwen3-moe", 128, packing="mixed", gpus=2, dp=2, ep=2, baseline=False),
        # the DeepSeek-V4 cases' code path (sliding, CSA, HCA ratio 16, CSA; first layer hash-routed)
        BenchCase("tiny-dsv4", "tiny-deepseek-v4", 128, packing="mixed"),
    ]
}


# the keys a multi-GPU case's name fixes (its mesh): `mlite bench --set` takes any other key
LAYOUT_KEYS = ("parallel.tp", "parallel.pp", "parallel.vpp", "parallel.cp", "parallel.ep", "parallel.etp",
               "cluster.gpus_per_node", "cluster.nodes")


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
    under dist_opt, the case's FP8 matmuls; fp32 on CPU. `one_gpu`: a multi-rank case's one-GPU reference
    (its reference_master)."""
    if not cuda:
        return {"compute": "fp32", "master": "fp32"}
    fp8 = {"fp8": case.fp8} if case.fp8 != "none" else {}
    if one_gpu and case.reference_master:
        return {"compute": "bf16", "master": case.reference_master, **fp8}
    return {"compute": "bf16", "master": backend_traits(case.backend).master_dtype, **fp8}


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


def planner_estimate_gb(case: BenchCase, arch: ModelArch, gpu: str,
                        overrides: Sequence[str] = ()) -> float | None:
    """The planner's per-GPU peak for this case (its backend and precision, as benchmarked), with
    the run's `--set` keys (optimizer state, recompute) applied as they are to the Runtime's job."""
    plan = case_plan(case, arch, gpu, overrides)
    return plan.memory.train_gb if plan is not None else None


def case_plan(case: BenchCase, arch: ModelArch, gpu: str, overrides: Sequence[str] = ()):
    """The planner's plan of this case on `gpu` (None off the GPUs it knows): its memory, and the choices it
    resolved for the `auto` keys, which the bench records beside each result."""
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
    return plan_job(job, arch)


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


def case_seq_lens(case: BenchCase, seed: int = 0) -> list[int]:
    if case.packing == "full":
        return [case.seq_len]
    return mixed_lengths(case.seq_len, seed=seed, shortest=max(8, case.seq_len // 16))


def random_sequences(seq_lens: list[int], vocab: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in seq_lens]


def replica_seed(case: BenchCase, device: str, rank: int, world: int) -> int:
    """The seed of a rank's sequences in a multi-GPU case: replicas see different data, the ranks of one
    replica (cp) the same, so the seed is the rank's data-parallel coordinate."""
    from mlite.runtime.parallel.mesh import ParallelDims

    return ParallelDims.from_job(case_job(case, device), world).coordinates(rank)["dp"]
