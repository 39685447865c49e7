"""Pipeline parallel: layers cut into stages, micro-batches flowing through them under a schedule.

Layout: pp ranks x vpp virtual chunks per rank = pp*vpp chunks in model order; chunk c lives on pp rank
c % pp (interleaved), so activations always go to the next pp rank (the last wraps to the first). The first
and last pipeline stages may hold a set number of layers (embedding and LM head make them heavier); the
rest are spread evenly.

Micro-batches are packed and of any length: every stage reads the same micro-batch (tokens, positions,
labels) from the loader, and each activation send is preceded by its shape, so nothing is padded.

Schedules are lists of actions per rank, (F|B, chunk, micro-batch), executed with asynchronous sends and
blocking receives. Any order consistent with the data dependencies runs without deadlock:
- `one_f_one_b` (vpp = 1) and its interleaved form (vpp > 1): warm-up forwards, then one forward and one
  backward alternating, then the remaining backwards.
- `forward_only`: every rank runs its forwards back to back; since sends do not wait, stage s works on
  micro-batch i while stage s+1 works on i-1, so all stages are busy (RL log-prob passes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from mlite.errors import MliteError


def split_layers(
    num_layers: int, pp: int, vpp: int = 1, first: Optional[int] = None, last: Optional[int] = None
) -> list[list[int]]:
    """Global layer indices of each of the pp*vpp chunks, in model order."""
    chunks = pp * vpp
    if chunks == 1:
        return [list(range(num_layers))]
    head = first if first is not None else None
    tail = last if last is not None else None
    fixed = (head or 0) + (tail or 0)
    middle_chunks = chunks - (head is not None) - (tail is not None)
    rest = num_layers - fixed
    if rest < 0 or (middle_chunks == 0 and rest != 0) or (middle_chunks and rest % middle_chunks):
        raise MliteError(
            f"{num_layers} layers do not split over pp={pp} x vpp={vpp} chunks with first={first}, last={last} "
            "stage layers; make the remaining layers divide evenly over the other chunks"
        )
    even = rest // middle_chunks if middle_chunks else 0
    sizes = [even] * chunks
    if head is not None:
        sizes[0] = head
    if tail is not None:
        sizes[-1] = tail
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def keep_chunk(model: nn.Module, layer_ids: Sequence[int], first: bool, last: bool) -> nn.Module:
    """Reduce a decoder to one chunk: its layers, the embedding only on the first, norm + head on the last."""
    for key in list(model.layers.keys()):
        if int(key) not in layer_ids:
            del model.layers[key]
    if not first:
        model.embed = None
    if not last:
        model.norm = None
        model.output = None
    return model


@dataclass(frozen=True)
class Action:
    kind: str  # "F" or "B"
    chunk: int  # global chunk index (model order)
    micro_batch: int


def one_f_one_b(pp: int, vpp: int, rank: int, micro_batches: int) -> list[Action]:
    """1F1B for this pp rank; interleaved over its vpp chunks when vpp > 1 (micro-batches a multiple of pp)."""
    if vpp > 1 and micro_batches % pp:
        raise MliteError(
            f"interleaved pipeline (vpp={vpp}) needs the micro-batches per step ({micro_batches}) to be a "
            f"multiple of pp={pp}; change the global batch or the micro-batch size"
        )
    total = micro_batches * vpp

    def forward(k):  # k-th forward of this rank: groups of pp micro-batches per chunk
        local = (k // pp) % vpp
        return Action("F", local * pp + rank, (k // (pp * vpp)) * pp + k % pp)

    def backward(k):  # same walk with the chunks reversed
        local = vpp - 1 - (k // pp) % vpp
        return Action("B", local * pp + rank, (k // (pp * vpp)) * pp + k % pp)

    if vpp == 1:
        warmup = min(pp - rank - 1, total)
    else:
        warmup = min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)
    actions = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [forward(warmup + k), backward(k)]
    actions += [backward(k) for k in range(total - warmup, total)]
    return actions


def forward_only(pp: int, vpp: int, rank: int, micro_batches: int) -> list[Action]:
    """The forwards of the same schedule: with sends not waiting, every stage stays busy."""
    return [a for a in one_f_one_b(pp, vpp, rank, micro_batches) if a.kind == "F"]


class PipelineRunner:
    """Runs a schedule over this rank's chunks.

    `chunks`: {global chunk index: module}; a chunk is called `chunk(batch, hidden=...)` and returns
    (hidden, aux_loss). `loss_fn(last_chunk, hidden, batch) -> loss` runs on the last chunk only.
    """

    def __init__(self, chunks: dict[int, nn.Module], num_chunks: int, pp_ranks: list[int], hidden_size: int):
        self.chunks, self.num_chunks, self.pp_ranks = chunks, num_chunks, pp_ranks
        self.pp = len(pp_ranks)
        self.hidden_size = hidden_size
        self.rank_in_pp = pp_ranks.index(dist.get_rank())
        self._sends: list = []

    def _owner(self, chunk: int) -> int:
        return self.pp_ranks[chunk % self.pp]

    def _tag(self, chunk_from: int, micro_batch: int, grad: bool) -> int:
        # one tag per transfer: a pair of ranks carries forwards and backwards both ways, in any order
        return ((micro_batch * self.num_chunks + chunk_from) * 2 + grad) * 2

    def _send(self, tensor: torch.Tensor, chunk_to: int, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        header = torch.tensor(tensor.shape, dtype=torch.long)  # the shape travels first: any length
        dst = self._owner(chunk_to)
        self._sends += [(dist.isend(header, dst, tag=tag), header), (dist.isend(tensor, dst, tag=tag + 1), tensor)]

    def _recv(self, chunk_from: int, tag: int, dtype: torch.dtype) -> torch.Tensor:
        src = self._owner(chunk_from)
        header = torch.empty(2, dtype=torch.long)
        dist.recv(header, src, tag=tag)
        tensor = torch.empty(*header.tolist(), dtype=dtype)
        dist.recv(tensor, src, tag=tag + 1)
        return tensor

    def run(
        self,
        actions: list[Action],
        batches: Sequence,
        loss_fn: Optional[Callable] = None,
        aux_coef: float = 0.0,
        before_backward: Optional[Callable[[int, bool], None]] = None,
        dtype: torch.dtype = torch.float32,
    ) -> dict:
        """Execute; returns summed loss and aux of this rank's chunks, and the last chunk's outputs."""
        inputs, outputs, pending_backwards = {}, {}, {}
        for action in actions:
            pending_backwards[action.chunk] = pending_backwards.get(action.chunk, 0) + (action.kind == "B")
        loss_sum, aux_sum, results = torch.zeros(()), torch.zeros(()), {}
        last = self.num_chunks - 1
        for action in actions:
            c, m = action.chunk, action.micro_batch
            if action.kind == "F":
                hidden = None
                if c > 0:
                    hidden = self._recv(c - 1, self._tag(c - 1, m, False), dtype).requires_grad_(loss_fn is not None)
                with torch.set_grad_enabled(loss_fn is not None):
                    out, aux = self.chunks[c](batches[m], hidden=hidden)
                    aux_sum += aux.detach()
                    if c == last:
                        if loss_fn is None:
                            results[m] = out.detach()
                        else:
                            loss = loss_fn(self.chunks[c], out, batches[m])
                            loss_sum += loss.detach()
                            out = loss + aux_coef * aux
                    else:
                        self._send(out, c + 1, self._tag(c, m, False))
                        out = (out, aux)
                if loss_fn is not None:
                    inputs[(c, m)], outputs[(c, m)] = hidden, out
            else:
                pending_backwards[c] -= 1
                if before_backward is not None:
                    before_backward(c, pending_backwards[c] == 0)
                hidden, out = inputs.pop((c, m)), outputs.pop((c, m))
                if c == last:
                    out.backward()
                else:
                    grad = self._recv(c + 1, self._tag(c + 1, m, True), dtype)
                    hidden_out, aux = out
                    if aux.requires_grad:  # MoE chunks: the router's balance loss flows back from here
                        torch.autograd.backward([hidden_out, aux], [grad, torch.full_like(aux, aux_coef)])
                    else:
                        hidden_out.backward(grad)
                if hidden is not None:
                    self._send(hidden.grad, c - 1, self._tag(c, m, True))
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        return {"loss": loss_sum, "aux": aux_sum, "outputs": results}
