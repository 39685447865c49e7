"""Rank-local weight sync: every rank streams the pieces of the HF tensors it holds, and nothing else.

A rollout engine (vLLM, verl's checkpoint engines) wants the new weights every step, per tensor, in HF
names. Gathering each parameter whole (`iter_hf_weights`, `full_tensor`) makes every rank hold every tensor
in turn and has no answer for pipeline stages. Here no rank gathers anything: each rank maps its own
storage of every native tensor (`local_shard`: FSDP2's shards, TP's columns and rows, EP's experts, its
pipeline stage's layers) through the model's `hf_layout()` onto boxes of HF tensors, and sends each box
with where it sits in the full HF tensor (`WeightShard`). A stacked parameter becomes pieces of the
per-expert HF tensors its shard covers. Every element of the whole model is sent by exactly one rank of the
world: a piece held by several ranks (replicated over tp, held whole on every dp rank, a buffer every rank
keeps) is sent by the lowest rank holding it, decided once from one all-gather of what each rank holds
(`sync_plan`, cached per model). A consumer with its own tensor-parallel degree keeps the slab it needs
(`recut`, `tp_slab`, `vllm_split_dim`), or rebuilds whole tensors (`assemble`).

The split of a native tensor into HF tensors (`HFTensors.split`) must return views of it (the experts'
unbind and chunk do): taken on the meta device, a view's storage offset and strides say which box of the
native tensor each HF tensor is, without any values.
"""

from __future__ import annotations

import math
import re
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from mlite.errors import MliteError
from mlite.plan.policy import SYNC_BUCKET_BYTES
from mlite.runtime.adapters.pytorch import is_view_of

if TYPE_CHECKING:
    from mlite.config.arch import ModelArch

__all__ = ["WeightShard", "assemble", "consumer_slab", "export_hf", "gather_hf_weights", "lockstep_shards",
           "recut", "sync_plan", "tp_group_weights", "tp_slab", "vllm_split_dim", "weight_shards"]


@dataclass(frozen=True)
class WeightShard:
    """One piece of HF tensor `name` (whole shape `shape`): `tensor` is `full[slices]`, `slices` starting at
    `offsets`."""

    name: str
    tensor: torch.Tensor
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.tensor.shape))


@dataclass(frozen=True)
class _Piece:
    """How one piece is cut from a native tensor's local storage: `local[local]`, native dims reordered
    by `perm` (the HF tensor's dims first, then the dims the HF view indexes away, each of length 1) and
    reshaped to `size`."""

    param: str
    name: str
    local: tuple[slice, ...]
    perm: tuple[int, ...]
    offsets: tuple[int, ...]
    size: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def key(self) -> tuple:
        return self.name, self.offsets, self.size


@dataclass
class SyncPlan:
    """What this rank sends (`mine`), and the whole world's picture every rank shares: each HF tensor of the
    model (`tensors`: shape and native dtype) and its pieces with their senders (`pieces`), both in one
    order, the same on every rank."""

    mine: list[_Piece]
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]
    pieces: dict[str, list[tuple[int, tuple[int, ...], tuple[int, ...]]]]  # name -> (rank, offsets, size)
    holders: dict[tuple, frozenset[int]]  # each piece's key -> every rank holding it (the sender among them)
    held: dict[tuple, _Piece]  # what this rank holds, sender or not


# ------------------------------------------------------------------------------------------- the plan
def _modules(models: nn.Module | Iterable[nn.Module]) -> list[nn.Module]:
    return [models] if isinstance(models, nn.Module) else list(models)


def _named_tensors(models: list[nn.Module]) -> dict[str, torch.Tensor]:
    """What `hf_layout` names, over this rank's models (its pipeline chunks): parameters and buffers."""
    out: dict[str, torch.Tensor] = {}
    for model in models:
        out |= dict(model.named_parameters()) | dict(model.named_buffers())
    return out


def _runs(index: torch.Tensor | None, size: int) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of each run of consecutive global indices a rank holds along
    one dim (a strided shard can hold several)."""
    if index is None:
        return [(0, 0, size)] if size else []
    idx = index.tolist()
    runs, start = [], 0
    for i in range(1, len(idx) + 1):
        if i == len(idx) or idx[i] != idx[i - 1] + 1:
            runs.append((start, idx[start], i - start))
            start = i
    return runs


def _hf_regions(entry, shape: torch.Size) -> list[tuple[str, list[int], list[int | None], tuple[int, ...]]]:
    """Each HF tensor of one native tensor as a box of it: (HF name, start per native dim, the native dim
    each HF dim runs along (None: a dim of length 1 the native tensor lacks), the HF shape)."""
    base = torch.empty(shape, device="meta")
    strides = base.stride()
    regions = []
    for name, view in zip(entry.hf_names, entry.split(base)):
        offset = view.storage_offset()
        starts = [(offset // s) % n if n else 0 for s, n in zip(strides, shape)]
        dims: list[int | None] = []
        for n, s in zip(view.shape, view.stride()):
            d = None if n == 1 else next((d for d in range(len(shape)) if d not in dims and shape[d] > 1
                                         and strides[d] == s), None)
            if n != 1 and (d is None or starts[d] + n > shape[d]):
                d = -1
            dims.append(d)
        is_view = is_view_of(view, base)
        if not is_view or -1 in dims or sum(a * s for a, s in zip(starts, strides)) != offset:
            raise MliteError(
                f"weight sync: {entry.param}'s split into {name} is not a view of it (a box of the native "
                "tensor), so a rank cannot tell which part of it its shard is; hf_layout splits must return "
                "views (index, unbind, chunk, narrow)"
            )
        regions.append((name, starts, dims, tuple(view.shape)))
    return regions


def _candidates(models: list[nn.Module]) -> list[_Piece]:
    """Every piece of an HF tensor this rank holds, sender or not, in its hf_layout order."""
    from mlite.runtime.parallel.parallelize import local_shard

    tensors = _named_tensors(models)
    pieces, seen = [], set()
    for model in models:
        for entry in model.hf_layout():
            tensor = tensors[entry.param]
            shape = tensor.shape
            _, indices = local_shard(tensor.detach())
            boxes = [[]]
            for d, index in enumerate(indices):
                boxes = [box + [run] for box in boxes for run in _runs(index, shape[d])]
            for name, starts, dims, hf_shape in _hf_regions(entry, shape):
                span = [(s, s + 1) for s in starts]
                for j, d in enumerate(dims):
                    if d is not None:
                        span[d] = (starts[d], starts[d] + hf_shape[j])
                dropped = [d for d in range(len(shape)) if d not in dims]
                perm = tuple(d for d in dims if d is not None) + tuple(dropped)
                for box in boxes:
                    cut = [(max(lo, g), min(hi, g + n)) for (lo, hi), (_, g, n) in zip(span, box)]
                    if any(a >= b for a, b in cut):
                        continue
                    piece = _Piece(
                        param=entry.param, name=name,
                        local=tuple(slice(local + a - g, local + b - g)
                                    for (a, b), (local, g, _) in zip(cut, box)),
                        perm=perm,
                        offsets=tuple(0 if d is None else cut[d][0] - starts[d] for d in dims),
                        size=tuple(1 if d is None else cut[d][1] - cut[d][0] for d in dims),
                        shape=hf_shape)
                    if piece.key not in seen:  # a tied copy held twice on one rank is sent once
                        seen.add(piece.key)
                        pieces.append(piece)
    return pieces


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def sync_plan(models: nn.Module | Iterable[nn.Module]) -> SyncPlan:
    """Who sends what (collective over the world on first use; cached per model, as the layout is fixed).

    Each rank lists the pieces it holds; one all-gather of the lists, and the lowest rank listing a piece
    sends it. The plan is checked whole: each HF tensor's sent pieces must add up to its size, once."""
    models = _modules(models)
    cached = _PLANS.get(models[0])
    if cached is not None and cached[0] == tuple(map(id, models)):
        return cached[1]
    candidates = _candidates(models)
    tensors = _named_tensors(models)
    table = [(p.name, p.offsets, p.size, p.shape, tensors[p.param].dtype) for p in candidates]
    world = dist.get_world_size() if dist.is_initialized() else 1
    me = dist.get_rank() if world > 1 else 0
    tables: list = [table]
    if world > 1:
        tables = [None] * world
        dist.all_gather_object(tables, table)
    owner: dict[tuple, int] = {}
    holders: dict[tuple, set[int]] = {}
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    pieces: dict[str, list] = {}
    for rank, listed in enumerate(tables):
        for name, offsets, size, shape, dtype in listed:
            if shapes.setdefault(name, (shape, dtype)) != (shape, dtype):
                raise MliteError(f"weight sync: ranks disagree on {name}'s shape or dtype "
                                 f"({shapes[name]} and {(shape, dtype)}); a runtime bug")
            holders.setdefault((name, offsets, size), set()).add(rank)
            if (name, offsets, size) not in owner:
                owner[name, offsets, size] = rank
                pieces.setdefault(name, []).append((rank, offsets, size))
    for name, (shape, _) in shapes.items():
        sent = sum(math.prod(size) for _, _, size in pieces[name])
        if sent != math.prod(shape):
            raise MliteError(f"weight sync: the ranks' pieces of {name} add up to {sent} elements, its shape "
                             f"{list(shape)} has {math.prod(shape)}; a runtime bug (overlapping shards)")
    plan = SyncPlan([p for p in candidates if owner[p.key] == me], shapes, pieces,
                    {key: frozenset(ranks) for key, ranks in holders.items()}, {p.key: p for p in candidates})
    _PLANS[models[0]] = (tuple(map(id, models)), plan)
    return plan


# ------------------------------------------------------------------------------------------- producing
def _cut(piece: _Piece, tensor: torch.Tensor, dtype: torch.dtype | None) -> WeightShard:
    local = tensor.detach()
    local = local.to_local() if isinstance(local, DTensor) else local
    part = local[piece.local].permute(piece.perm).reshape(piece.size)
    if dtype is not None and part.is_floating_point():
        part = part.to(dtype)
    return WeightShard(piece.name, part, piece.offsets, piece.shape)


def weight_shards(models: nn.Module | Iterable[nn.Module], dtype: torch.dtype | None = None
                  ) -> Iterator[WeightShard]:
    """This rank's share of the model's HF tensors, one piece at a time: only what it holds and is the
    sender of, cut from its local storage (views unless `dtype` converts; integer buffers keep theirs).
    Over the world, every element of every HF tensor arrives exactly once. `models`: the rank's model, or
    its pipeline chunks (each with `hf_layout`). Collective on first use (`sync_plan`), local after."""
    models = _modules(models)
    plan = sync_plan(models)
    tensors = _named_tensors(models)
    for piece in plan.mine:
        yield _cut(piece, tensors[piece.param], dtype)


def _out_dtype(native: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and native.is_floating_point else native


def lockstep_shards(models: nn.Module | Iterable[nn.Module], dtype: torch.dtype | None = None
                    ) -> Iterator[tuple[str, tuple[int, ...], torch.dtype, list[WeightShard]]]:
    """Every HF tensor of the whole model, in the same order on every rank: (name, shape, dtype, this rank's
    pieces of it, often none). For consumers that pair collectives per tensor (verl's sharded sync)."""
    models = _modules(models)
    plan = sync_plan(models)
    tensors = _named_tensors(models)
    mine: dict[str, list[_Piece]] = {}
    for piece in plan.mine:
        mine.setdefault(piece.name, []).append(piece)
    for name, (shape, native) in plan.tensors.items():
        yield name, shape, _out_dtype(native, dtype), [_cut(p, tensors[p.param], dtype)
                                                       for p in mine.get(name, [])]


def gather_hf_weights(models: nn.Module | Iterable[nn.Module], dtype: torch.dtype | None = None,
                      dst: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Whole HF tensors, one at a time, on rank `dst` only (an HF export written by one rank, under any
    layout, pipeline stages included): each piece travels from its sender to `dst`. Every rank must drain
    the iterator (the others yield nothing); `dst` holds one whole tensor at a time."""
    models = _modules(models)
    plan = sync_plan(models)
    tensors = _named_tensors(models)
    me = dist.get_rank() if dist.is_initialized() and dist.get_world_size() > 1 else 0
    locals_ = [t.to_local() if isinstance(t, DTensor) else t for t in tensors.values()]
    device = locals_[0].device if locals_ else torch.device("cpu")
    for name, (shape, native) in plan.tensors.items():
        out_dtype = _out_dtype(native, dtype)
        whole = torch.empty(shape, dtype=out_dtype, device=device) if me == dst else None
        for rank, offsets, size in plan.pieces[name]:
            where = tuple(slice(o, o + n) for o, n in zip(offsets, size))
            if rank == me:
                held = plan.held[name, offsets, size]
                piece = _cut(held, tensors[held.param], dtype).tensor
                if me == dst:
                    whole[where] = piece
                else:
                    dist.send(piece.contiguous(), dst)
            elif me == dst:
                buffer = torch.empty(size, dtype=out_dtype, device=device)
                dist.recv(buffer, rank)
                whole[where] = buffer
        if me == dst:
            yield name, whole


def _overlap(offsets, size, slab) -> tuple[slice, ...] | None:
    """The part of a piece (a box of the whole tensor) inside a consumer's slab, in whole-tensor
    coordinates; None if they do not meet."""
    box = [slice(o, o + n) for o, n in zip(offsets, size)]
    if slab is not None:
        dim, lo, hi = slab
        a, b = max(lo, offsets[dim]), min(hi, offsets[dim] + size[dim])
        if a >= b:
            return None
        box[dim] = slice(a, b)
    return tuple(box)


def _slab_transfers(plan: SyncPlan, tensors: dict[str, torch.Tensor], name: str, slabs: list, me: int,
                    world: int, whole: torch.Tensor, dtype: torch.dtype | None
                    ) -> tuple[list, list[tuple[tuple[slice, ...], torch.Tensor]]]:
    """This rank's part in filling every rank's slab of HF tensor `name` (`slabs`, by rank): what it holds
    of its own slab it copies into `whole` at once; it returns the sends of its pieces' parts to other
    ranks' slabs and the receives of other ranks' parts of its own, as (point-to-point ops, (where in
    `whole`, receive buffer) pairs)."""
    device, out_dtype = whole.device, whole.dtype
    ops, received = [], []
    for sender, offsets, size in plan.pieces[name]:
        holders = plan.holders[name, offsets, size]
        piece = None  # this rank's copy, cut when first needed
        for rank in range(world):
            where = _overlap(offsets, size, slabs[rank])
            if where is None or me not in (sender, rank) or (rank in holders and rank != me):
                continue  # a rank that holds the piece itself (replicated over tp or dp) copies it
            inside = tuple(slice(w.start - o, w.stop - o) for w, o in zip(where, offsets))
            if me in holders and piece is None:
                held = plan.held[name, offsets, size]
                piece = _cut(held, tensors[held.param], dtype).tensor.to(device)
            if rank == me and me in holders:
                whole[where] = piece[inside]
            elif sender == me:
                ops.append(dist.P2POp(dist.isend, piece[inside].contiguous(), rank))
            else:
                buffer = torch.empty([w.stop - w.start for w in where], dtype=out_dtype, device=device)
                ops.append(dist.P2POp(dist.irecv, buffer, sender))
                received.append((where, buffer))
    return ops, received


def tp_group_weights(models: nn.Module | Iterable[nn.Module], dtype: torch.dtype | None, tp_size: int,
                     kv_heads: int | None = None, stats: dict | None = None,
                     device: torch.device | None = None, bucket_bytes: int = SYNC_BUCKET_BYTES,
                     num_experts: int | None = None, v4_fp8: str | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor of the whole model, in one order on every rank, for a consumer run by consecutive
    groups of `tp_size` ranks (vLLM's torchrun launcher: rank r is tensor-parallel rank r % tp_size of its
    engine), which cuts its shard from a whole-shaped tensor itself.

    Each yielded tensor has the full shape, but only this rank's slab (`consumer_slab`) holds the weights:
    the rest is NaN (floats), so a consumer that read outside its slab would show it at once. Each rank
    receives only the parts of other ranks' pieces that overlap its slab and copies what it holds itself,
    point to point, one batch per bucket of consecutive tensors (`bucket_bytes` of whole-shaped tensors; the
    same buckets on every rank); no rank holds more than one bucket at a time. Collective: every rank must
    drain the iterator. `stats` (optional) counts tensors, buckets, the slab bytes the consumer gets and the
    bytes that came from other ranks. `device`: where the tensors are built and travel (the compute device:
    parameters offloaded to the host move there a piece at a time); default, the parameters'.
    `num_experts`: the consumer runs expert parallel (`consumer_slab`): each rank gets whole experts, its
    engine rank's, and nothing of the others'. `v4_fp8` (DeepSeek-V4 on vLLM; None otherwise): what vLLM
    keeps in float32 arrives in float32, and what the mode names arrives as FP8 and its scales
    (`vllm_send_as`)."""
    models = _modules(models)
    plan = sync_plan(models)
    tensors = _named_tensors(models)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    world, me = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    if device is None:
        locals_ = [t.to_local() if isinstance(t, DTensor) else t for t in tensors.values()]
        device = locals_[0].device if locals_ else torch.device("cpu")
    stats = {} if stats is None else stats
    for key in ("tensors", "buckets", "bytes", "received_bytes"):
        stats.setdefault(key, 0)
    for bucket in _buckets(plan, dtype, bucket_bytes):
        ops, received, filled = [], [], []
        for name, shape, out_dtype in bucket:
            send_as = vllm_send_as(name, v4_fp8)
            cut, out_dtype = _wire_dtypes(send_as, dtype, out_dtype)
            slabs = [consumer_slab(name, shape, tp_size, rank % tp_size, kv_heads, num_experts)
                     for rank in range(world)]
            fill = float("nan") if out_dtype.is_floating_point else 0
            whole = torch.full(shape, fill, dtype=out_dtype, device=device)
            sends_and_receives, into = _slab_transfers(plan, tensors, name, slabs, me, world, whole, cut)
            ops += sends_and_receives
            received += [(whole, where, buffer) for where, buffer in into]
            filled.append((name, whole, slabs[me], send_as))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for whole, where, buffer in received:
            whole[where] = buffer
            stats["received_bytes"] += buffer.numel() * buffer.element_size()
        stats["buckets"] += 1
        del ops, received
        while filled:
            name, whole, slab, send_as = filled.pop(0)
            for sent_name, tensor, kept in _as_sent(name, whole, slab, send_as):
                stats["tensors"] += 1
                stats["bytes"] += kept * tensor.element_size()
                yield sent_name, tensor
            del whole, tensor


def _buckets(plan: SyncPlan, dtype: torch.dtype | None, bucket_bytes: int
             ) -> Iterator[list[tuple[str, torch.Size, torch.dtype]]]:
    """The plan's HF tensors in order, as runs of about `bucket_bytes` of whole-shaped tensors (a larger
    tensor alone); the same on every rank, since every rank has the same plan."""
    bucket, size = [], 0
    for name, (shape, native) in plan.tensors.items():
        out_dtype = _out_dtype(native, dtype)
        nbytes = math.prod(shape) * out_dtype.itemsize
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, shape, out_dtype))
        size += nbytes
    if bucket:
        yield bucket


def export_hf(models: nn.Module | Iterable[nn.Module], arch: ModelArch, out_dir: str | Path,
              config: dict | None = None, dtype: torch.dtype | None = None, dst: int = 0) -> Path | None:
    """An HF checkpoint of the model as the ranks hold it, written by rank `dst` (collective: every rank
    calls it). Returns the directory on `dst`, None elsewhere."""
    from mlite.runtime.ckpt.hf import save_hf_checkpoint

    stream = gather_hf_weights(models, dtype, dst)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    me = dist.get_rank() if distributed else 0
    out = None
    if me == dst:
        out = save_hf_checkpoint(stream, arch, out_dir, config=config, dtype=dtype)
    else:
        for _ in stream:
            pass
    if distributed:
        dist.barrier()  # the export is in place before any rank goes on
    return out


# ------------------------------------------------------------------------------------------- consuming
def tp_slab(size: int, tp_size: int, tp_rank: int, pad_to: int = 1) -> tuple[int, int]:
    """[start, stop) of consumer rank `tp_rank`'s slab of a dim of `size` split `tp_size` ways. `pad_to`:
    the dim is padded to a multiple of it first, as vLLM pads the vocabulary (to 64), so the last slabs
    can be shorter or empty; without padding the split must be even."""
    padded = -(-size // pad_to) * pad_to
    if padded % tp_size:
        raise MliteError(f"a dim of {size} (padded to {padded}) does not split evenly {tp_size} ways")
    per = padded // tp_size
    return min(tp_rank * per, size), min((tp_rank + 1) * per, size)


# the vocabulary (embedding and LM head), which vLLM pads to a multiple of 64 before splitting it
_VOCAB = {"embed_tokens", "lm_head", "embed", "head"}
_KV = {"k_proj", "v_proj"}


_EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.")  # a routed expert's HF tensor (not shared_experts.)


def expert_parallel_experts(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """The routed experts engine rank `ep_rank` holds whole under vLLM's expert parallel (its default,
    linear placement: consecutive experts, the first num_experts % ep_size ranks one more)."""
    base, extra = divmod(num_experts, ep_size)
    start = ep_rank * base + min(ep_rank, extra)
    return range(start, start + base + (ep_rank < extra))


def consumer_slab(name: str, shape: Sequence[int], tp_size: int, tp_rank: int, kv_heads: int | None = None,
                  num_experts: int | None = None) -> tuple[int, int, int] | None:
    """(dim, start, stop): the slab of HF tensor `name` that rank `tp_rank` of a vLLM-style consumer at
    `tp_size` reads, or None where it reads the tensor whole. With fewer KV heads than ranks vLLM gives each
    rank one KV head, shared by tp_size / kv_heads ranks. `num_experts`: the engine runs expert parallel over
    its ranks (vLLM's `enable_expert_parallel`): a routed expert's tensors go whole to the rank that holds the
    expert and to no other (an empty slab), while the rest is cut as without it."""
    expert = _EXPERT.search(name) if num_experts is not None and tp_size > 1 else None
    if expert is not None:
        held = int(expert.group(1)) in expert_parallel_experts(num_experts, tp_size, tp_rank)
        return None if held else (0, 0, 0)
    dim = vllm_split_dim(name)
    if dim is None or tp_size == 1:
        return None
    leaf = name.rpartition(".")[0].rpartition(".")[2]
    ways, rank = tp_size, tp_rank
    if leaf in _KV and kv_heads is not None and kv_heads < tp_size:
        ways, rank = kv_heads, tp_rank * kv_heads // tp_size
    lo, hi = tp_slab(shape[dim], ways, rank, pad_to=64 if leaf in _VOCAB else 1)
    return dim, lo, hi


def recut(pieces: Iterable[WeightShard], dim: int | None = None, tp_size: int = 1, tp_rank: int = 0,
          pad_to: int = 1) -> torch.Tensor:
    """Consumer rank `tp_rank`'s shard of one HF tensor, cut along `dim` (None: the whole tensor) from the
    union of its pieces, whichever ranks sent them: each piece contributes its overlap with the slab.
    Refused unless every element of the slab arrives exactly once. With fewer KV heads than ranks (vLLM
    then replicates them), pass tp_size=kv_heads and tp_rank=rank * kv_heads // tp."""
    pieces = list(pieces)
    if not pieces:
        raise MliteError("recut: no pieces")
    name, shape = pieces[0].name, pieces[0].shape
    lo, hi = (0, 0) if dim is None else tp_slab(shape[dim], tp_size, tp_rank, pad_to)
    size = list(shape)
    if dim is not None:
        size[dim] = hi - lo
    out = torch.empty(size, dtype=pieces[0].tensor.dtype, device=pieces[0].tensor.device)
    seen = torch.zeros(size, dtype=torch.bool, device=out.device)
    for piece in pieces:
        if piece.name != name or piece.shape != shape:
            raise MliteError(f"recut: a piece of {piece.name} {list(piece.shape)} among {name} {list(shape)}")
        where, part = list(piece.slices), piece.tensor
        if dim is not None:
            start = piece.offsets[dim]
            a, b = max(lo, start), min(hi, start + part.shape[dim])
            if a >= b:
                continue
            part = part.narrow(dim, a - start, b - a)
            where[dim] = slice(a - lo, b - lo)
        if seen[tuple(where)].any():
            raise MliteError(f"recut: {name}: an element arrived twice")
        out[tuple(where)] = part
        seen[tuple(where)] = True
    if not bool(seen.all()):
        missing = int((~seen).sum())
        raise MliteError(f"recut: {name}: {missing} elements of rank {tp_rank}'s shard are missing")
    return out


def assemble(pieces: Iterable[WeightShard]) -> torch.Tensor:
    """The whole HF tensor from the union of its pieces (each element exactly once)."""
    return recut(pieces)


# the HF module names a vLLM-style tensor-parallel consumer splits by output (column) or input (row);
# w1/w3/w2: DeepSeek's experts and shared experts, embed/head: DeepSeek-V4's vocabulary
_COLUMN = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head",
           "w1", "w3", "embed", "head"}
_ROW = {"o_proj", "down_proj", "w2"}


def vllm_split_dim(name: str) -> int | None:
    """The dim a tensor-parallel consumer cuts HF tensor `name` along: 0 for column-parallel layers (q, k,
    v, gate, up, the vocabulary of embedding and LM head; their biases too), 1 for row-parallel weights
    (o, down); None for what each consumer rank holds whole (norms, routers, row-parallel biases, anything
    else, DeepSeek-V4's attention included)."""
    module, _, kind = name.rpartition(".")
    leaf = module.rpartition(".")[2]
    if leaf in _COLUMN:
        return 0
    if leaf in _ROW and kind == "weight":
        return 1
    return None


# DeepSeek-V4 on vLLM 0.25.1 (paths under vllm/models/deepseek_v4/). The parameters it creates in float32,
# by mlite's HF names (DeepSeek's release names, which vLLM maps itself): the mHC mixers of every layer,
# hc_{attn,ffn}_{fn,base,scale} (nvidia/model.py:823-861), and of the head, hc_head_{fn,base,scale}
# (nvidia/model.py:1004-1022); the attention sinks attn_sink (attention.py:198-201); the compressors' position
# embeddings ape, the attention's and the indexer's (compressor.py:216-224); the router's correction bias
# ffn.gate.bias, vLLM's e_score_correction_bias (nvidia/model.py:579-582, renamed at :1311).
_VLLM_V4_FP32 = re.compile(r"(?:^|\.)(?:hc_(?:attn|ffn|head)_(?:fn|base|scale)|attn\.attn_sink"
                           r"|compressor\.ape|ffn\.gate\.bias)$")
# the weight it multiplies in FP8 whatever the checkpoint: the output projection's first half, through
# DeepGEMM's fp8_einsum with (wo_a.weight, wo_a.weight_scale_inv) (nvidia/ops/o_proj.py:63-67)
_VLLM_V4_FP8 = re.compile(r"(?:^|\.)attn\.wo_a\.weight$")
# the linears DeepSeek's release keeps in FP8 (the attention's projections, the indexer's query, the shared
# experts), and the routed experts in its fp8-expert form (`expert_dtype: fp8`): what vLLM builds as
# block-FP8 under a quantization_config that ignores nothing; the compressors, the indexer's weights_proj
# and the router are built without one
_VLLM_V4_FP8_LINEARS = re.compile(r"(?:^|\.)(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
                                  r"|ffn\.(?:shared_experts|experts\.\d+)\.w[123])\.weight$")
VLLM_FP8_BLOCK = (128, 128)  # its blocks (the fp8_einsum recipe's, nvidia/ops/o_proj.py:13-25)


def vllm_keeps_fp32(name: str) -> bool:
    """Whether DeepSeek-V4's HF tensor `name` is a parameter vLLM 0.25.1 holds in float32."""
    return _VLLM_V4_FP32.search(name) is not None


def vllm_wants_fp8(name: str, v4_fp8: str = "wo_a") -> bool:
    """Whether DeepSeek-V4's HF tensor `name` reaches vLLM 0.25.1 in FP8 (128x128 block scales) under
    `v4_fp8` (mlite.plan.policy.vllm_v4_fp8): wo_a, which it always multiplies in FP8, and under "linears"
    every release-FP8 linear and routed expert too."""
    if v4_fp8 == "linears":
        return _VLLM_V4_FP8_LINEARS.search(name) is not None
    return _VLLM_V4_FP8.search(name) is not None


def vllm_send_as(name: str, v4_fp8: str | None) -> str:
    """How HF tensor `name` travels to a vLLM engine: "fp32" (a DeepSeek-V4 parameter vLLM keeps in float32:
    sent unrounded), "fp8" (float8_e4m3fn with its float32 128x128 block scales: wo_a under `v4_fp8` "wo_a",
    every release-FP8 linear and routed expert under "linears") or "rollout" (the rollout dtype; wo_a too
    under "online", where vLLM quantises it). `v4_fp8` None: the model is not DeepSeek-V4, and everything
    goes in the rollout dtype. The one rule; no torch."""
    if v4_fp8 is None:
        return "rollout"
    if vllm_keeps_fp32(name):
        return "fp32"
    return "fp8" if v4_fp8 != "online" and vllm_wants_fp8(name, v4_fp8) else "rollout"


def vllm_fp8_weight(name: str, whole: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The sync-side quantiser: whole weight `name` [out, in] -> [(name, float8_e4m3fn weight), (its `.scale`:
    float32 [ceil(out/128), ceil(in/128)], one power of two per 128x128 block, the multiplier)], what vLLM's
    block-FP8 linear loads (`X.scale` -> `X.weight_scale_inv`, nvidia/model.py:1290-1297; the parameters:
    vllm/model_executor/layers/quantization/fp8.py:352-379, utils/fp8_utils.py:1246-1295)."""
    from mlite.runtime.ckpt.quant import quantize_fp8_blocks, scale_name

    weight, scale = quantize_fp8_blocks(whole, VLLM_FP8_BLOCK, scale_dtype=torch.float32)
    return [(name, weight), (scale_name(name), scale)]


def _wire_dtypes(send_as: str, dtype: torch.dtype | None, out_dtype: torch.dtype
                 ) -> tuple[torch.dtype | None, torch.dtype]:
    """(the dtype pieces are cut in, the dtype of the whole tensor they fill) for a tensor sent `send_as`:
    float32 for the float32 ones and for a weight quantised after it is whole (from the unrounded values)."""
    return (dtype, out_dtype) if send_as == "rollout" else (torch.float32, torch.float32)


def _as_sent(name: str, whole: torch.Tensor, slab: tuple[int, int, int] | None, send_as: str
             ) -> list[tuple[str, torch.Tensor, int]]:
    """What the consumer gets of one filled tensor: (name, tensor, the elements of its slab), one of them, or
    the FP8 weight and its scales. A slab sent in FP8 must lie on 128-wide block boundaries; the blocks
    outside it go as zeros (the consumer cuts the weight and its scales alike; an empty slab: an expert that
    another engine rank holds)."""
    kept = whole.numel() if slab is None else whole[tuple(
        slice(slab[1], slab[2]) if d == slab[0] else slice(None) for d in range(whole.dim()))].numel()
    if send_as != "fp8":
        return [(name, whole, kept)]
    if slab is not None:
        dim, lo, hi = slab
        block = VLLM_FP8_BLOCK[dim]
        if hi > lo and (lo % block or (hi % block and hi != whole.shape[dim])):
            raise MliteError(f"weight sync: {name}'s slab [{lo}, {hi}) on dim {dim} does not lie on FP8's "
                             f"{block}-wide blocks; choose a rollout.tp that cuts it on block boundaries, "
                             "or set rollout.fp8_weights: false")
        whole = torch.nan_to_num(whole, nan=0.0)  # outside the slab: never read, sent as zeros
    (weight_name, weight), (scale_name, scale) = vllm_fp8_weight(name, whole)
    return [(weight_name, weight, kept), (scale_name, scale, scale.numel())]
