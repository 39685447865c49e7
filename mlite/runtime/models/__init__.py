"""Native model code: one module per model family, all built from `mlite.config.arch.ModelArch`.

build_model(arch, attention_backend="auto", dtype=torch.float32, device="cpu") -> Transformer
model(batch: PackedBatch) -> ModelOutput(hidden [T, H], aux_loss)
model.compute_logits(hidden) -> [T, vocab]
model.decode(input_ids [B, t], positions [B, t], cache, last_only) -> logits [B, t or 1, vocab] (rollout)
model.hf_layout() -> native <-> HF names (mlite.runtime.ckpt.hf loads and exports with it)
seeded_init(model, seed, shard) -> the initial weights of a run, the same under every parallel layout
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from mlite.config.arch import ModelArch
from mlite.errors import MliteError
from mlite.plan.rules import check_model_built
from mlite.runtime.kernels import resolve_attention_backend
from mlite.runtime.models.base import KVCache, ModelOutput
from mlite.runtime.models.deepseek_v4 import DeepseekV4
from mlite.runtime.models.qwen3 import Transformer


def build_model(
    arch: ModelArch,
    attention_backend: str = "auto",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    layers: Iterable[int] | None = None,
    init: bool = True,
    mtp_weight: float = 0.0,
    indexer_loss_weight: float = 0.0,
    runs_on: str | None = None,
) -> Transformer | DeepseekV4:
    """A model for `arch` with freshly initialised weights (load real ones with mlite.runtime.ckpt.hf).

    `layers`: the global layer indices of this pipeline stage (all by default). `device="meta"` builds the
    structure without memory (names and shapes only); `to_empty` and `seeded_init` give it storage and
    values later, shard by shard (how the runtime starts at scale). `init=False` leaves the weights
    uninitialised; `init=True` draws them with the model's own `init_weights` from the global RNG.
    DeepSeek-V4 only: `mtp_weight` > 0 builds the multi-token-prediction block, its loss weighted so;
    `indexer_loss_weight` > 0 trains the CSA indexers with their KL loss. `runs_on`: the device type the
    model will compute on, when that is not `device` (a meta build materialised later): the attention
    backend is chosen for it."""
    check_model_built(arch)  # the rule book's list of the families built here
    device = torch.device(device)
    backend = resolve_attention_backend(
        attention_backend, runs_on or (device.type if device.type != "meta" else "cpu"))

    with device:
        if arch.v4 is not None:  # its attention has one torch path (gathered key sets); no backend choice
            model = DeepseekV4(arch, layers=layers, mtp_weight=mtp_weight)
            model.set_indexer_loss_weight(indexer_loss_weight)
        else:
            model = Transformer(arch, attention_backend=backend, layers=layers)
    if init and device.type != "meta":
        model.init_weights()
    return model.to(dtype)


# ------------------------------------------------------------------------------------ initial weights
BLOCK_ELEMENTS = 1 << 20  # one draw: whole dim-0 rows, about this many values (4 MB in fp32)
RANDOM_INITS = (nn.init.normal_, nn.init.uniform_, nn.init.trunc_normal_)  # shape-free: drawable by block
OTHER_RANDOM = {"normal_", "uniform_", "bernoulli_", "exponential_", "geometric_", "cauchy_", "log_normal_",
                "random_", "kaiming_normal_", "kaiming_uniform_", "xavier_normal_", "xavier_uniform_",
                "orthogonal_", "sparse_"}

# (this rank's storage of a tensor, the global indices it holds per dim or None for the whole dim)
ShardFn = Callable[[torch.Tensor], tuple[torch.Tensor, list[torch.Tensor | None]]]


def whole_tensor(tensor: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    return tensor, [None] * tensor.dim()


class _InitRecorder(TorchFunctionMode):
    """Runs a model's `init_weights` with its random draws recorded instead of made: `seeded_init` draws them
    again per tensor name. Deterministic writes (ones, zeros, a hash table's copy) run as they are, except on
    the tensors in `keep` (filled from a checkpoint); `written` remembers which tensors they reached, so a
    tensor no rule reaches is an error, not garbage."""

    def __init__(self, keep: set[int]):
        super().__init__()
        self.keep = keep
        self.rules: dict[int, tuple[Callable, tuple, dict]] = {}
        self.written: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in RANDOM_INITS:
            tensor = kwargs.pop("tensor") if "tensor" in kwargs else args[0]
            kwargs.pop("generator", None)
            self.rules[id(tensor)] = (func, tuple(args[1:] if args else ()), kwargs)
            return tensor
        name = getattr(func, "__name__", "")
        if name in OTHER_RANDOM:
            raise MliteError(
                f"init_weights draws with {name}, which depends on a tensor's shard; the runtime starts "
                "every layout from the same weights with nn.init.normal_ / uniform_ / trunc_normal_ only"
            )
        inplace = (name.endswith("_") and not name.endswith("__")) or name == "__setitem__"
        if inplace and args and isinstance(args[0], torch.Tensor):
            self.written.add(id(args[0]))
            self.rules.pop(id(args[0]), None)
            if id(args[0]) in self.keep:
                return args[0]
        return func(*args, **kwargs)


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@torch.no_grad()
def _draw(local: torch.Tensor, indices: list[torch.Tensor | None], shape: torch.Size, name: str, seed: int,
          rule: tuple[Callable, tuple, dict]) -> None:
    """Fill `local` (this rank's entries of a tensor of global `shape`) with its entries of the draw: the
    blocks of whole dim-0 rows that cover them, one at a time (at most one block in memory)."""
    func, args, kwargs = rule

    def block_values(block: int, size: tuple) -> torch.Tensor:
        values = torch.empty(size)
        gen = torch.Generator().manual_seed(_block_seed(seed, name, block))
        return func(values, *args, **kwargs, generator=gen)

    if len(shape) == 0:
        local.copy_(block_values(0, ()))
        return
    row = math.prod(shape[1:])
    per_block = max(1, BLOCK_ELEMENTS // max(row, 1))
    rows = indices[0] if indices[0] is not None else torch.arange(shape[0])
    blocks = rows // per_block
    for block in torch.unique(blocks).tolist():
        start, stop = block * per_block, min((block + 1) * per_block, shape[0])
        values = block_values(block, (stop - start, *shape[1:]))
        positions = torch.nonzero(blocks == block).flatten()
        wanted = rows[positions] - start
        first, count = int(positions[0]), len(positions)
        if int(positions[-1]) - first + 1 == count and int(wanted[-1]) - int(wanted[0]) + 1 == count:
            values, target = values.narrow(0, int(wanted[0]), count), local.narrow(0, first, count)
        else:  # a strided share: gather the rows
            values, target = values[wanted], None
        for dim, index in enumerate(indices[1:], start=1):
            if index is not None:
                values = values.index_select(dim, index)
        if target is not None:
            target.copy_(values)
        else:
            local.index_copy_(0, positions.to(local.device), values.to(local.device, local.dtype))


@torch.no_grad()
def seeded_init(model: nn.Module, seed: int, shard: ShardFn = whole_tensor, skip: Iterable[str] = ()) -> None:
    """Initialise `model` (materialised, possibly sharded) so that every tensor holds its share of the same
    global values under any parallel layout, and one process holds them all.

    The model's own `init_weights` says what each tensor starts as (its rules stay in the model); its random
    draws are made again here from a generator seeded by (seed, the tensor's global name, block), over whole
    dim-0 rows of the global shape, so a rank draws only the blocks that cover its share (`shard` says which
    entries it holds) and never the whole tensor. Draws are on the host, so every device starts from the
    same numbers too. The name is the tensor's checkpoint name where it is stored alone (so a tied LM head
    on a stage without the embedding draws as the embedding), else its parameter name (stacked experts).
    `skip`: tensors that are filled otherwise (loaded from a checkpoint)."""
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    skip = set(skip)
    recorder = _InitRecorder(keep={id(tensor) for name, tensor in tensors if name in skip})
    with recorder:
        model.init_weights()
    # a tensor's global name is its checkpoint name where it has one of its own: so a copy of another
    # tensor (a tied LM head on a stage without the embedding) draws what the tensor it copies draws
    global_names = {entry.param: entry.hf_names[0] for entry in model.hf_layout() if len(entry.hf_names) == 1}
    for name, tensor in tensors:
        if name in skip:
            continue
        rule = recorder.rules.get(id(tensor))
        if rule is None:
            if id(tensor) not in recorder.written:
                raise MliteError(f"{type(model).__name__}.init_weights leaves '{name}' uninitialised; "
                                 "give it a rule there")
            continue
        local, indices = shard(tensor)
        _draw(local, indices, tensor.shape, global_names.get(name, name), seed, rule)


__all__ = ["DeepseekV4", "KVCache", "ModelOutput", "Transformer", "build_model", "seeded_init"]
