"""The torchtitan side: torchtitan's own Qwen3 (dense or MoE) built with the case's shapes, its float8
converter where the case has FP8, its per-block torch.compile, bf16 parameters, its fused AdamW, its
cross-entropy and its step (grad-norm clipping, the MoE expert-bias update), timed as the HF side is.

torchtitan 0.2.2: the newest release that does not ask torch for
`torch.distributed.fsdp.DataParallelMeshDims`, which torch 2.11 (the image's and the GPU machines') lacks and
0.3.0 imports. Its float8 grouped GEMM converter asks torchao for a config 0.18 no longer has, so the
routed experts get torchao 0.18's own (`Float8TrainingOpConfig` through `quantize_` on the grouped experts),
as torchtitan 0.3.0's converter applies it.

The only module that imports torchtitan, always inside a function: torchtitan is not a dependency of mlite
(`mlite bench --titan` asks for it). What it builds is torchtitan's trainer without its process group and
FSDP wrapper (one device, as the other sides), and without activation checkpointing (as the HF side).
torchtitan's internals used here live in mlite.runtime.adapters.torchtitan.
"""

from __future__ import annotations

import contextlib

from mlite.bench.cases import BenchCase
from mlite.config.arch import ModelArch

TITAN_VERSION = "0.2.2"
# what torchtitan's import path for its models and float8 converter needs beyond the image, never torch itself
# (--no-deps): its config (tyro), and the data loaders its Qwen3 package imports (datasets, torchdata).
# triton: CUDA builds of torch bring it; a CPU build needs it for the import only.
TITAN_INSTALL = (f"pip install --no-deps torchtitan=={TITAN_VERSION} tyro==1.0.17 docstring-parser==0.18.0 "
                 "typeguard==4.6.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 torchdata==0.11.0 "
                 "triton")
EOS = 0  # the token that ends each packed sequence on this side: torchtitan's document masks split at it
_MODEL_TYPES = ("qwen3", "qwen3_moe")


def titan_missing() -> str:
    """Why torchtitan's side cannot be imported here, in one line with the install command ('' if it can)."""
    import importlib.metadata

    try:
        import torchtitan.components.quantization.float8  # noqa: F401
        import torchtitan.models.qwen3  # noqa: F401
    except ImportError as e:
        try:
            version = importlib.metadata.version("torchtitan")
        except importlib.metadata.PackageNotFoundError:
            version = None
        if version is None or "No module named 'torchtitan'" in str(e):
            return f"--titan needs torchtitan ({e}); install it without touching torch: {TITAN_INSTALL}"
        import torch

        # installed, but it asks this torch for what it lacks (e.g. 0.3.0 on torch 2.11: DataParallelMeshDims)
        return (f"--titan: torchtitan {version} does not import on torch {torch.__version__} ({e}); the side "
                f"is built for torchtitan {TITAN_VERSION}: run it where torch is one that release imports on")
    return ""


def titan_version() -> str:
    from importlib.metadata import version

    return version("torchtitan")


def titan_unbuildable(arch: ModelArch) -> str:
    """What of `arch` torchtitan's Qwen3 cannot express ('' when it builds the same model)."""
    if arch.model_type not in _MODEL_TYPES or arch.v4 is not None or arch.mla is not None:
        return f"torchtitan's Qwen3 does not build {arch.model_type}"
    moe = arch.moe
    misfits = {
        "no qk-norm": not arch.qk_norm, "attention bias": arch.attention_bias,
        "rope scaling": arch.rope_scaling is not None, "activation": arch.hidden_act != "silu",
        "shared experts": moe is not None and moe.shared_experts > 0,
        "dense layers among MoE": moe is not None and (moe.first_dense_layers > 0 or bool(moe.dense_layers)
                                                       or moe.layer_freq != 1),
        "unnormalised top-k": moe is not None and not moe.norm_topk_prob,
    }
    found = [name for name, misfit in misfits.items() if misfit]
    return f"torchtitan's Qwen3 has no {', '.join(found)}" if found else ""


def titan_model_args(case: BenchCase, arch: ModelArch, device: str):
    """torchtitan's Qwen3ModelArgs for the case, as its qwen3_args flavors are written (the 30B-A3B flavor's
    router for MoE), with the case's shapes. Flex attention with document masks on GPUs (its block_causal
    masks, split at EOS); on CPU, where flex attention has no backward, SDPA (causal over the packed
    stream)."""
    from mlite.errors import MliteError

    if reason := titan_unbuildable(arch):
        raise MliteError(f"bench case {case.name}: {reason}")
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3 import Qwen3ModelArgs

    cuda = device.startswith("cuda")
    args = Qwen3ModelArgs(
        vocab_size=arch.vocab, max_seq_len=case.seq_len, head_dim=arch.head_dim, dim=arch.hidden,
        n_layers=arch.num_layers, n_heads=arch.num_heads, n_kv_heads=arch.num_kv_heads, qk_norm=True,
        hidden_dim=arch.ffn, norm_eps=arch.rms_norm_eps, rope_theta=arch.rope_theta,
        enable_weight_tying=arch.tie_embeddings, attn_type="flex" if cuda else "sdpa",
        attn_mask_type="block_causal" if cuda else "causal", eos_id=EOS)
    if arch.moe is not None:
        args.moe_enabled, args.moe_inter_dim = True, arch.moe.expert_ffn
        args.moe_args = MoEArgs(num_experts=arch.moe.num_experts, num_shared_experts=0, top_k=arch.moe.top_k,
                                score_func="softmax", route_norm=True, route_scale=1.0,
                                score_before_experts=False)
    return args


def titan_job_config(case: BenchCase, arch: ModelArch, compiled: bool, linears: str = "auto"):
    """The torchtitan JobConfig fields its converters and its compile read: compile of the model and the
    loss on GPUs; float8 linears with the case's recipe, the LM head (`output`) and the MoE router kept in
    bf16 as its float8 flavors do (and as mlite does). `linears`: the mlite side's precision.fp8_linears;
    auto gives torchtitan its `auto_filter_small_kn`, the same size rule from torchao that mlite applies."""
    from torchtitan.config import JobConfig

    job = JobConfig()
    job.compile.enable, job.compile.components = compiled, ["model", "loss"]
    if case.fp8 != "none":
        job.quantize.linear.float8.recipe_name = case.fp8
        kept = ["output", "router.gate"] if arch.moe is not None else ["output"]
        small = ["auto_filter_small_kn"] if linears == "auto" else []
        job.quantize.linear.float8.filter_fqns = [*kept, *small]
    return job


def mlite_fp8_choice(case: BenchCase, arch: ModelArch, device: str, overrides=()) -> tuple[str, bool]:
    """What the mlite side's job runs in FP8, for this side to run the same: its precision.fp8_linears, and
    whether its routed experts' grouped GEMMs run in FP8 (mlite.plan.rules.fp8_experts_on, on its layout)."""
    from mlite.bench.cases import case_job
    from mlite.plan.rules import check_layout, fp8_experts_on

    job = case_job(case, device, overrides=overrides)
    return job.precision.fp8_linears, fp8_experts_on(job, arch, check_layout(job, arch, case.gpus))


def _float8(case: BenchCase, arch: ModelArch, model, job, experts: bool) -> None:
    """torchtitan's float8 for the case's recipe, in place: its Float8LinearConverter (it hands the recipe
    name to torchao's Float8LinearConfig); the routed experts, where `experts`: torchao's rowwise FP8 grouped
    GEMM on the grouped experts, their token groups padded to 16 rows (module docstring)."""
    if case.fp8 == "none":
        return
    from mlite.errors import MliteError

    if case.fp8 not in ("tensorwise", "rowwise"):
        raise MliteError(f"bench case {case.name}: torchtitan has no float8 recipe {case.fp8!r}")
    from torchtitan.components.quantization.float8 import Float8LinearConverter

    from mlite.runtime.adapters.torchtitan import one_device_dims, pad_expert_groups
    from mlite.runtime.kernels.grouped_gemm import FP8_GROUP_ROWS

    Float8LinearConverter(job, one_device_dims()).convert(model)
    if arch.moe is not None and experts:
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
        from torchao.quantization.quant_api import quantize_
        from torchtitan.models.moe.moe import GroupedExperts

        pad_expert_groups(FP8_GROUP_ROWS)
        quantize_(model, config=Float8TrainingOpConfig(),
                  filter_fn=lambda module, _fqn: isinstance(module, GroupedExperts))


def titan_model(case: BenchCase, arch: ModelArch, device: str = "meta", runs_on: str | None = None,
                job=None, experts: bool | None = None):
    """torchtitan's model for the case, converted to float8 where the case has FP8: built on the meta device,
    as its trainer builds it, in the case's dtype (bf16 parameters on GPUs: its training.dtype=bfloat16; fp32
    on CPU); materialised and initialised with its own init on `device` unless that is meta. `runs_on`: the
    device the model is for (meta); `job`: the step's titan_job_config, when the caller has it; `experts`:
    whether the routed experts run in FP8 (default: as the mlite side's job, `mlite_fp8_choice`)."""
    import torch
    from torchtitan.models.qwen3 import Qwen3Model
    from torchtitan.tools.utils import set_default_dtype

    runs_on = runs_on or device
    cuda = runs_on.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    with torch.device("meta"), set_default_dtype(dtype):
        model = Qwen3Model(titan_model_args(case, arch, runs_on))
    if experts is None:
        experts = mlite_fp8_choice(case, arch, runs_on)[1]
    _float8(case, arch, model, job or titan_job_config(case, arch, compiled=cuda), experts)
    if device != "meta":
        model.to_empty(device=device)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
    return model


@contextlib.contextmanager
def compile_settings_restored():
    """Put back the process-wide compile switches torchtitan sets while its side is built and compiled
    (dynamo's capture_scalar_outputs, inductor's emulate_precision_casts under rowwise float8), so that the
    sides after it in the launch compile as they would without it."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    saved = [(config, config.get_config_copy()) for config in (dynamo_config, inductor_config)]
    try:
        yield
    finally:
        for config, before in saved:
            after = config.get_config_copy()
            for key, value in before.items():
                if after.get(key) is not value and after.get(key) != value:
                    setattr(config, key, value)


def titan_step_fn(case: BenchCase, arch: ModelArch, sequences: list[list[int]], device: str,
                  accum: int = 1, linears: str = "auto", experts: bool | None = None):
    """torchtitan's training step on the same packed tokens as the mlite side (one stream, per-sequence
    positions, each sequence ending in EOS where its document masks split it): per block torch.compile on
    GPUs (its apply_compile, the loss compiled too), bf16 parameters and AdamW state, its fused AdamW
    (foreach on CPU), its cross-entropy summed over the step's valid tokens and divided by their count,
    grad-norm clipping at 1.0 and the MoE expert-bias hook, as its Trainer.train_step runs them. `linears`:
    titan_job_config's; `experts`: titan_model's. Returns (step, keep, last), as hf_step_fn."""
    import torch
    from torchtitan.components.loss import IGNORE_INDEX, build_cross_entropy_loss
    from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing
    from torchtitan.distributed.utils import clip_grad_norm_

    from mlite.runtime.adapters.torchtitan import compile_blocks, one_device_dims

    cuda = device.startswith("cuda")
    job = titan_job_config(case, arch, compiled=cuda, linears=linears)
    model = titan_model(case, arch, device="meta", runs_on=device, job=job, experts=experts)
    parallel_dims = one_device_dims()
    if cuda:  # after float8 conversion, before materialising: its parallelize_qwen3's order
        compile_blocks(model, job.compile)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = build_cross_entropy_loss(job)
    job.optimizer.lr, job.optimizer.implementation = 1e-5, "fused" if cuda else "foreach"
    optimizers = build_optimizers_with_moe_load_balancing([model], job.optimizer, parallel_dims)

    # the same tokens, each sequence's last one EOS (and no other): its document masks end each there
    tokens = [[(t if t != EOS else EOS + 1) for t in seq[:-1]] + [EOS] for seq in sequences]
    ids = torch.tensor([t for seq in tokens for t in seq])[None].to(device)
    positions = torch.cat([torch.arange(len(seq)) for seq in tokens])[None].to(device)
    labels = torch.cat([torch.tensor(seq[1:] + [IGNORE_INDEX]) for seq in tokens])[None].to(device)
    valid = (labels != IGNORE_INDEX).sum() * accum

    class _Tokenizer:  # what its get_attention_masks reads of the tokenizer
        eos_id = EOS

    last: dict = {}

    def step() -> None:  # no host sync, as the other sides
        optimizers.zero_grad()
        losses = []
        for _ in range(accum):
            # the document masks, per micro-batch as its trainer builds them (post_dataloading_process)
            masks = model.get_attention_masks(input_batch=ids, tokenizer=_Tokenizer) if cuda else None
            pred = model(ids, attention_masks=masks, positions=positions)
            loss = loss_fn(pred, labels) / valid
            del pred
            loss.backward()
            losses.append(loss.detach())
        last["grad_norm"] = clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        optimizers.step()
        last["loss"] = sum(losses)

    return step, (model, optimizers), last
