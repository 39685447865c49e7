"""The torchtitan side: torchtitan's own Qwen3 (dense or MoE) built with the case's shapes, its float8
converters where the case has FP8, its per-block torch.compile, bf16 parameters, its fused AdamW, its chunked
cross-entropy and its step (grad-norm clipping, the MoE expert-bias update), timed as the HF side is.

The only module that imports torchtitan, always inside a function: torchtitan is not a dependency of mlite
(`mlite bench --titan` asks for it). What it builds is torchtitan's trainer without its process group and
FSDP wrapper (one device, as the other sides), and without activation checkpointing (as the HF side).
torchtitan's private names used here (its Qwen3 layer builders and one-device mesh handling) live here only.
"""

from __future__ import annotations

import contextlib

from mlite.bench.cases import BenchCase
from mlite.config.arch import ModelArch

TITAN_VERSION = "0.3.0"
# torchtitan's import path for its models and float8 converters, never torch itself (--no-deps): its other
# requirements (datasets, wandb, tensorboard, ...) serve its trainer's data and logging, not this path.
# triton: CUDA builds of torch bring it; a CPU build needs it for the import only.
TITAN_INSTALL = (f"pip install --no-deps torchtitan=={TITAN_VERSION} tyro==1.0.17 docstring-parser==0.18.0 "
                 "typeguard==4.6.1 spmd_types==0.2.3 triton")
_MODEL_TYPES = ("qwen3", "qwen3_moe")


def titan_missing() -> str:
    """Why torchtitan's side cannot be imported here, in one line with the install command ('' if it can)."""
    import importlib.metadata

    try:
        import torchtitan.components.quantization  # noqa: F401
        import torchtitan.models.qwen3  # noqa: F401
    except ImportError as e:
        try:
            version = importlib.metadata.version("torchtitan")
        except importlib.metadata.PackageNotFoundError:
            version = None
        if version is None or "No module named 'torchtitan'" in str(e):
            return f"--titan needs torchtitan ({e}); install it without touching torch: {TITAN_INSTALL}"
        import torch

        # installed, but it asks this torch for what it lacks (0.3.0 on torch 2.11: DataParallelMeshDims)
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


def titan_model_config(case: BenchCase, arch: ModelArch, device: str):
    """torchtitan's Qwen3Model.Config for the case, as its registry builds its flavors (qwen3_configs) with
    the case's shapes, then its float8 converters as its model_registry applies them. Flex attention on
    GPUs (its default, with document masks from per-sequence positions); on CPU, where flex attention has
    no backward, its SDPA module (causal over the packed stream)."""
    from mlite.errors import MliteError

    if reason := titan_unbuildable(arch):
        raise MliteError(f"bench case {case.name}: {reason}")
    from torchtitan.config import ParallelismConfig
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import Qwen3Model

    from mlite.runtime.adapters.torchtitan import qwen3_parts

    parts = qwen3_parts()

    rope = CosSinRoPE.Config(dim=arch.head_dim, max_seq_len=case.seq_len, theta=arch.rope_theta)
    shapes = dict(n_layers=arch.num_layers, dim=arch.hidden, n_heads=arch.num_heads,
                  n_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim, attn_backend="flex", rope=rope)
    if arch.moe is not None:
        layers = parts.build_moe_layers(**shapes, moe_hidden_dim=arch.moe.expert_ffn,
                                         num_experts=arch.moe.num_experts, top_k=arch.moe.top_k,
                                         moe_comm_backend="standard")
    else:
        layers = parts.build_layers(**shapes, hidden_dim=arch.ffn)
    if not device.startswith("cuda"):
        for layer in layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = Qwen3Model.Config(
        vocab_size=arch.vocab, dim=arch.hidden, norm=parts.norm(arch.hidden),
        enable_weight_tying=arch.tie_embeddings,
        # tied: the LM head's init draws the shared weight (the registry's tied flavors skip the embedding's)
        tok_embeddings=Embedding.Config(num_embeddings=arch.vocab, embedding_dim=arch.hidden,
                                        param_init=parts.embedding_skip_init if arch.tie_embeddings
                                        else parts.embedding_init),
        lm_head=Linear.Config(in_features=arch.hidden, out_features=arch.vocab, param_init=parts.linear_init),
        layers=layers,
    )
    config = _float8(case, arch, config, compiled=device.startswith("cuda"))

    class _OneDevice:  # update_from_config takes any object with a ParallelismConfig (no trainer)
        parallelism = ParallelismConfig()

    config.update_from_config(config=_OneDevice())
    return config


def _float8(case: BenchCase, arch: ModelArch, config, compiled: bool):
    """torchtitan's float8 converters for the case's recipe. Linears: Float8LinearConverter with the case's
    recipe (its config lists the rowwise ones; it hands the name to torchao's Float8LinearConfig, which has
    tensorwise too), the LM head and the MoE router kept in bf16 as its own float8 flavors do (and as mlite
    does); MoE experts: Float8GroupedExpertsConverter (rowwise scaled grouped GEMMs, torchao moe_training)."""
    if case.fp8 == "none":
        return config
    from mlite.errors import MliteError

    if case.fp8 not in ("tensorwise", "rowwise"):
        raise MliteError(f"bench case {case.name}: torchtitan has no float8 recipe {case.fp8!r}")
    from torchtitan.components.quantization import Float8GroupedExpertsConverter, Float8LinearConverter
    from torchtitan.models.utils import validate_converter_order

    keep = ["lm_head", "router.gate"] if arch.moe is not None else ["lm_head"]
    converters = [Float8LinearConverter.Config(recipe_name=case.fp8, filter_fqns=keep,
                                               model_compile_enabled=compiled)]
    if arch.moe is not None:
        converters.append(Float8GroupedExpertsConverter.Config(model_compile_enabled=compiled))
    validate_converter_order(converters)
    for converter in converters:
        config = converter.build().convert(config)
    return config


def titan_model(case: BenchCase, arch: ModelArch, device: str = "meta", runs_on: str | None = None):
    """torchtitan's model for the case: built on the meta device, as its trainer builds it, in the case's
    dtype (bf16 parameters on GPUs: its training.dtype=bfloat16; fp32 on CPU); materialised and initialised
    with its own init on `device` unless that is meta. `runs_on`: the device the config is for (meta)."""
    import torch
    from torchtitan.tools.utils import set_default_dtype

    runs_on = runs_on or device
    dtype = torch.bfloat16 if runs_on.startswith("cuda") else torch.float32
    with torch.device("meta"), set_default_dtype(dtype):
        model = titan_model_config(case, arch, runs_on).build()
    model.verify_module_protocol()
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


def _one_device():
    """torchtitan's ParallelDims of one device. Every mesh it would build is of size 1, so none is needed
    (its trainer builds them on a process group; this side has none): the optional ones are absent."""
    from torchtitan.distributed import ParallelDims

    class OneDevice(ParallelDims):
        def get_optional_mesh(self, dims, *, include_singleton_axes: bool = False):
            return None

    return OneDevice(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)


def titan_step_fn(case: BenchCase, arch: ModelArch, sequences: list[list[int]], device: str,
                  accum: int = 1):
    """torchtitan's training step on the same packed tokens as the mlite side (one stream, per-sequence
    positions): per block torch.compile on GPUs (its apply_compile, the loss compiled too), bf16 parameters
    and AdamW state, its fused AdamW (foreach on CPU), its ChunkedLossWrapper over CrossEntropyLoss with the
    LM head outside the model's forward, the loss over the step's valid tokens, grad-norm clipping at 1.0
    and the MoE expert-bias hook, as its Trainer.train_step runs them. Returns (step, keep, last), as
    hf_step_fn."""
    import torch
    from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw, register_moe_load_balancing_hook
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.distributed.utils import clip_grad_norm_

    from mlite.runtime.adapters.torchtitan import skip_lm_head

    cuda = device.startswith("cuda")
    model = titan_model(case, arch, device="meta", runs_on=device)
    parallel_dims = _one_device()
    compile_config = CompileConfig(enable=cuda)
    if cuda:  # after float8 conversion, before materialising: its parallelize_qwen3's order
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = ChunkedLossWrapper.Config(
        loss_fn=CrossEntropyLoss.Config(global_vocab_size=arch.vocab)).build(compile_config=compile_config)
    loss_fn.set_lm_head(model.lm_head)
    skip_lm_head(model)
    opt_config = default_adamw(lr=1e-5)
    opt_config.implementation = "fused" if cuda else "foreach"
    optimizers = opt_config.build(model_parts=[model])
    register_moe_load_balancing_hook(optimizers, [model], parallel_dims)

    ids = torch.tensor([t for seq in sequences for t in seq])[None].to(device)
    positions = torch.cat([torch.arange(len(seq)) for seq in sequences])[None].to(device)
    labels = torch.cat([torch.tensor(seq[1:] + [IGNORE_INDEX]) for seq in sequences])[None].to(device)
    valid = (labels != IGNORE_INDEX).sum() * accum
    last: dict = {}

    def step() -> None:  # no host sync, as the other sides
        optimizers.zero_grad()
        losses = []
        for _ in range(accum):
            # the document masks, per micro-batch as its trainer builds them (post_dataloading_process)
            masks = model.get_attention_masks(positions=positions) if cuda else None
            pred = model(ids, positions=positions, attention_masks=masks)
            loss, _ = loss_fn(pred, labels, valid, positions=positions)
            loss.backward()
            losses.append(loss.detach())
        last["grad_norm"] = clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        optimizers.step()
        last["loss"] = sum(losses)

    return step, (model, optimizers), last
