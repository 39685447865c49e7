"""Pipeline parallel: layers cut into stages, micro-batches flowing through them under a schedule.

Layout: pp ranks x vpp virtual chunks per rank = pp*vpp chunks in model order; chunk c lives on pp rank
c % pp (interleaved), so activations always go to the next pp rank (the last wraps to the first). The first
and last pipeline stages may hold a set number of layers (embedding and LM head make them heavier); the
rest are spread evenly.

Micro-batches are packed and of any length: every stage reads the same micro-batch (tokens, positions,
labels) from the loader, and each activation send is preceded by its shape, so nothing is padded.

Schedules are lists of actions per rank, (F|B, chunk, micro-batch), executed with asynchronous sends and
blocking receives. NCCL runs a pair of ranks' point-to-point messages on one stream per process group, in
order, and a large send holds that stream until its receive is posted: 1F1B's neighbours send to each other
(activations one way, gradients the other) before each receives, and over one group they would wait for
each other for ever. So each direction of a pair has its own group (`link_group`: messages to a higher rank
over the default group, to a lower one over a second group of every rank), each stream then carries one
direction in the order the peer receives it, and only the schedule's own dependencies remain. Any order
consistent with those runs without deadlock:
- `one_f_one_b` (vpp = 1) and its interleaved form (vpp > 1): warm-up forwards, then one forward and one
  backward alternating, then the remaining backwards.
- `forward_only`: every rank runs its forwards back to back; since sends do not wait, stage s works on
  micro-batch i while stage s+1 works on i-1, so all stages are busy (RL log-prob passes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mlite.errors import MliteError
from mlite.plan.rules import split_chunks


def split_layers(
    num_layers: int, pp: int, vpp: int = 1, first: int | None = None, last: int | None = None
) -> list[list[int]]:
    """Global layer indices of each of the pp*vpp chunks, in model order: the rule book's one splitter, so
    the planner's stage layers and the runtime's chunks are the same cut."""
    return split_chunks(num_layers, pp, vpp, first, last)


LAST_STAGE = ("norm", "output", "head", "mtp")  # what only the last stage holds (head, mtp: DeepSeek-V4)


def keep_chunk(model: nn.Module, layer_ids: Sequence[int], first: bool, last: bool) -> nn.Module:
    """Reduce a decoder to one chunk: its layers, the embedding only on the first, norm + head on the last."""
    for key in list(model.layers.keys()):
        if int(key) not in layer_ids:
            del model.layers[key]
    if not first:
        model.embed = None
    if not last:
        for name in LAST_STAGE:
            if hasattr(model, name):
                setattr(model, name, None)
    return model


MAX_DIMS = 3  # activation ranks a transfer header describes


@dataclass(frozen=True)
class Action:
    kind: str  # "F" or "B"
    chunk: int  # global chunk index (model order)
    micro_batch: int


def one_f_one_b(pp: int, vpp: int, rank: int, micro_batches: int) -> list[Action]:
    """1F1B for this pp rank; interleaved over its vpp chunks when vpp > 1 (micro-batches: multiple of pp)."""
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


def link_group(src: int, dst: int) -> int:
    """Which of the runner's two process groups carries a message from rank `src` to rank `dst`: 0 (the
    default group) towards a higher rank, 1 towards a lower one, so that no NCCL stream carries both
    directions of a pair (the module docstring; its deadlock proof: tests/test_parallel_units.py)."""
    return 0 if src < dst else 1


class PipelineRunner:
    """Runs a schedule over this rank's chunks of a decoder (mlite.runtime.models contract).

    `chunks`: {global chunk index: model chunk}; a chunk is called `chunk(batch, hidden=...)` and returns a
    ModelOutput. `loss_fn(last_chunk, hidden, batch) -> loss` runs on the last chunk only.

    A chunk's own losses (ModelOutput.own_loss: DeepSeek-V4's indexer and MTP losses) need no pooling: each
    chunk back-propagates its own, weighted like the balance loss, and they join the reported aux value.

    MoE balance loss: it pools the router statistics of *all* layers before its product (as transformers
    does), so no stage can compute it alone. It is linear in the router probabilities once the expert counts
    are fixed, so the counts (no gradient) travel forward with the activations, the totals travel back with
    the gradients, and each chunk backpropagates its own exact term; the terms add up to the whole loss.
    """

    def __init__(self, chunks: dict[int, nn.Module], num_chunks: int, pp_ranks: list[int],
                 device: torch.device):
        self.chunks, self.num_chunks, self.pp_ranks = chunks, num_chunks, pp_ranks
        self.pp = len(pp_ranks)
        first = next(iter(chunks.values()))
        self.moe = first.arch.moe
        # the run's device, not the parameters': offloaded shards live on the host, while NCCL sends need
        # device tensors (headers included)
        self.device = torch.device(device)
        self.num_stats = (self.moe.num_experts if self.moe else 0) + 1  # expert counts, then rows
        self._sends: list = []
        # the two directions' groups (link_group): None is the default group; every rank of the job builds
        # a runner, so every rank joins the second group's creation, as new_group requires
        self._links = (None, dist.new_group() if dist.is_initialized() else None)

    def _owner(self, chunk: int) -> int:
        return self.pp_ranks[chunk % self.pp]

    def _tag(self, chunk_from: int, micro_batch: int, grad: bool) -> int:
        # one tag per transfer: a pair of ranks carries forwards and backwards both ways, in any order
        return ((micro_batch * self.num_chunks + chunk_from) * 2 + grad) * 4

    def _send(self, tensor: torch.Tensor, stats: torch.Tensor, chunk_to: int, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        # shape first (any length; [T, hidden] or DeepSeek-V4's residual copies [T, n, hidden])
        header = torch.tensor([tensor.dim(), *tensor.shape] + [0] * (MAX_DIMS - tensor.dim()),
                              dtype=torch.long, device=self.device)
        dst = self._owner(chunk_to)
        group = self._links[link_group(dist.get_rank(), dst)]
        for offset, t in enumerate((header, tensor, stats.detach().double().contiguous())):
            self._sends.append((dist.isend(t, dst, group=group, tag=tag + offset), t))

    def _recv(self, chunk_from: int, tag: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        src = self._owner(chunk_from)
        group = self._links[link_group(src, dist.get_rank())]
        header = torch.empty(1 + MAX_DIMS, dtype=torch.long, device=self.device)
        dist.recv(header, src, group=group, tag=tag)
        dims = header.tolist()
        tensor = torch.empty(*dims[1: 1 + dims[0]], dtype=dtype, device=self.device)
        dist.recv(tensor, src, group=group, tag=tag + 1)
        stats = torch.empty(self.num_stats, dtype=torch.float64, device=self.device)
        dist.recv(stats, src, group=group, tag=tag + 2)
        return tensor, stats

    def _router_stats(self, stats: list):
        """(counts and rows [E+1] without gradient, probability sums [E] with it, shards) of a chunk's
        forward (its ModelOutput.router_stats, one entry per MoE layer)."""
        if not stats:
            return torch.zeros(self.num_stats, dtype=torch.float64, device=self.device), None, 1
        counts = torch.stack([s.counts for s in stats]).sum(0).double()
        rows = torch.stack([s.rows for s in stats]).sum().double()
        prob_sum = torch.stack([s.prob_sum for s in stats]).sum(0)
        return torch.cat([counts, rows[None]]), prob_sum, stats[0].shards

    def _balance_term(self, totals: torch.Tensor, prob_sum, shards: int) -> torch.Tensor | None:
        if prob_sum is None:
            return None
        from mlite.runtime.models.moe import RouterStats, load_balancing_loss

        counts, rows = totals[:-1].to(prob_sum.dtype), totals[-1].to(prob_sum.dtype)
        pooled = RouterStats(counts=counts, prob_sum=prob_sum, rows=rows, shards=shards)
        return load_balancing_loss([pooled], self.moe.num_experts, self.moe.router_aux_loss_coef)

    def run(
        self,
        actions: list[Action],
        batches: Sequence,
        loss_fn: Callable | None = None,
        before_backward: Callable[[int, bool], None] | None = None,
        dtype: torch.dtype = torch.float32,
        aux_weights: Sequence[float] | None = None,
    ) -> dict:
        """Execute. Returns this rank's summed loss (last chunk), its balance-loss terms per micro-batch
        (times its `aux_weights` entry: the trainers' average over micro-batches and ranks; default 1), and
        with no loss_fn the last chunk's hidden states per micro-batch (a forward-only pass)."""
        training = loss_fn is not None
        saved = {}  # (chunk, micro-batch) -> what its backward needs
        pending_backwards = {c: sum(a.kind == "B" and a.chunk == c for a in actions) for c in self.chunks}
        loss_sum, aux, results = torch.zeros((), device=self.device), {}, {}
        last = self.num_chunks - 1
        for action in actions:
            c, m = action.chunk, action.micro_batch
            if action.kind == "F":
                hidden, upstream = None, torch.zeros(self.num_stats, dtype=torch.float64, device=self.device)
                if c > 0:
                    hidden, upstream = self._recv(c - 1, self._tag(c - 1, m, False), dtype)
                    hidden.requires_grad_(training)
                with torch.set_grad_enabled(training):
                    chunk_out = self.chunks[c](batches[m], hidden=hidden)
                    out = chunk_out.hidden
                    mine, prob_sum, shards = self._router_stats(chunk_out.router_stats)
                    running = upstream + mine
                    if c != last:
                        self._send(out, running, c + 1, self._tag(c, m, False))
                    elif training:
                        out = loss_fn(self.chunks[c], out, batches[m])
                        loss_sum += out.detach()
                    else:
                        results[m] = out.detach()
                if training:
                    saved[(c, m)] = (hidden, out, running, prob_sum, shards, chunk_out.own_loss)
            else:
                pending_backwards[c] -= 1
                if before_backward is not None:
                    before_backward(c, pending_backwards[c] == 0)
                weight = 1.0 if aux_weights is None else aux_weights[m]
                self._backward(c, m, saved.pop((c, m)), dtype, weight, aux)
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        return {"loss": loss_sum, "aux": aux, "outputs": results}

    def _backward(self, c: int, m: int, saved: tuple, dtype: torch.dtype, aux_weight: float,
                  aux: dict) -> None:
        """One backward action: chunk `c`'s output gradient from the next chunk (on the last chunk, the loss
        itself), with the pooled router totals, its balance-loss term and own losses (times `aux_weight`,
        added into `aux[m]`), then its input's gradient and the totals to the previous chunk. `saved`: what
        the forward kept."""
        hidden, out, totals, prob_sum, shards, own = saved
        grad = None
        if c != self.num_chunks - 1:
            grad, totals = self._recv(c + 1, self._tag(c + 1, m, True), dtype)
        term = self._balance_term(totals, prob_sum, shards)
        if own is not None and own.requires_grad:  # this chunk's own losses (indexer, MTP)
            term = own if term is None else term + own
        tensors, grads = [out], [grad]
        if term is not None:
            term = term * aux_weight
            aux[m] = aux.get(m, 0.0) + term.detach()
            tensors, grads = [out, term], [grad, None]
        torch.autograd.backward(
            tensors, [g if g is not None else torch.ones_like(t) for t, g in zip(tensors, grads)]
        )
        if hidden is not None:
            self._send(hidden.grad, totals, c - 1, self._tag(c, m, True))


def stage_view(chunks: dict[int, nn.Module]) -> nn.Module:
    """One module over this rank's chunks with the whole model's parameter names (`layers.<i>...`, `embed`,
    `norm`, `output`, ...), for checkpoints: the names, like the global shapes, do not depend on pp or vpp."""
    view = nn.Module()
    view.layers = nn.ModuleDict()
    for chunk in chunks.values():
        view.layers.update(chunk.layers)
        for name in ("embed", *LAST_STAGE):
            if getattr(chunk, name, None) is not None:
                setattr(view, name, getattr(chunk, name))
    return view
