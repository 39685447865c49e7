"""Context parallel: one packed micro-batch split over cp ranks, attention still exact.

Split (zigzag): the packed token stream (all sequences of the micro-batch, T tokens) is cut into 2 x cp
equal chunks and rank r keeps chunks r and 2cp-1-r. Under a causal mask, early chunks are cheap and late
ones dear, so every rank gets one of each and the work is balanced. Sequence boundaries may fall anywhere
inside a chunk: each token keeps its position id (RoPE), its sequence id and its index in the stream, and
attention masks by those, never by chunk.

Attention: K and V are all-gathered over cp (their gradients are reduce-scattered back by autograd), and
each local query attends to the keys of its own sequence at or before its own stream index. The result is
exactly the single-rank attention; all-gather rather than a ring keeps it simple and is what upstream uses
for short-context post-training.

DeepSeek-V4 attends over a sliding window and compressed entries, never over the whole stream, so it
gathers no raw K/V: each chunk receives the boundary rows before it from its neighbour, and the compressed
entries (and indexer keys) are gathered instead (`context_geometry`, the model's `set_geometry` seam).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mlite.errors import MliteError
from mlite.runtime.data.packed import PackedBatch

TOKEN_INDEX = "cp_token_index"  # extras key: index of each local token in the full stream
SEQUENCE_ID = "cp_sequence_id"  # extras key: which sequence of the micro-batch the token belongs to


def zigzag_indices(num_tokens: int, cp: int, rank: int) -> torch.Tensor:
    """Stream indices kept by `rank`: chunks rank and 2cp-1-rank of 2cp equal chunks."""
    if num_tokens % (2 * cp):
        raise MliteError(
            f"context parallel cp={cp} splits a micro-batch into {2 * cp} equal chunks but it has "
            f"{num_tokens} tokens; pad each micro-batch to a multiple of {2 * cp} tokens"
        )
    chunk = num_tokens // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
    return torch.cat([first, second])


def split_for_context_parallel(batch: PackedBatch, cp: int, rank: int) -> PackedBatch:
    """This rank's share of a packed micro-batch: its tokens, their positions, labels and extras."""
    keep = zigzag_indices(batch.num_tokens, cp, rank).to(batch.input_ids.device)
    extras = {name: t[keep] for name, t in batch.extras.items()}
    extras[TOKEN_INDEX] = keep
    extras[SEQUENCE_ID] = batch.sequence_ids()[keep]
    return replace(
        batch,
        input_ids=batch.input_ids[keep],
        position_ids=batch.position_ids[keep],
        labels=batch.labels[keep],
        extras=extras,
    )


def context_parallel_attention(
    q: torch.Tensor,  # [t, heads, d] local queries
    k: torch.Tensor,  # [t, kv_heads, d]
    v: torch.Tensor,  # [t, kv_heads, d]
    batch: PackedBatch,  # the local share made by split_for_context_parallel
    group: dist.ProcessGroup,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact causal attention of local queries over the keys of the whole stream -> [t, heads, d]."""
    token_index, sequence_id = batch.extras[TOKEN_INDEX], batch.extras[SEQUENCE_ID]
    all_k = GatherTokens.apply(k, group)
    all_v = GatherTokens.apply(v, group)
    with torch.no_grad():
        key_index = _gather_ints(token_index, group)
        key_sequence = _gather_ints(sequence_id, group)
    allowed = (sequence_id[:, None] == key_sequence[None, :]) & (key_index[None, :] <= token_index[:, None])
    return masked_attention(q, all_k, all_v, allowed, scale)


def masked_attention(q, k, v, allowed, scale=None) -> torch.Tensor:
    """softmax(q k^T) v with a boolean [tq, tk] mask; KV heads repeated for grouped-query attention."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed, scale=scale
    )
    return out.transpose(0, 1)


class GatherTokens(torch.autograd.Function):
    """All-gather along tokens (equal shares); backward sums each share's gradient back to its owner.

    torch.distributed.nn's all_gather backward addresses group members by their global rank, which breaks on
    sub-groups with gloo; this one reduce-scatters on NCCL and all-reduces then slices elsewhere."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        group, size = ctx.group, dist.get_world_size(ctx.group)
        grad = grad.contiguous()
        if dist.get_backend(group) == "nccl":
            out = grad.new_empty(grad.shape[0] // size, *grad.shape[1:])
            dist.reduce_scatter_tensor(out, grad, group=group)
            return out, None
        dist.all_reduce(grad, group=group)
        return grad.chunk(size)[dist.get_rank(group)].clone(), None


def _gather_ints(t: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


# ------------------------------------------------------------------------------ DeepSeek-V4 under cp
def _window_mask(seq: torch.Tensor, segment: int, window: int) -> torch.Tensor:
    """The sliding-window mask over a rank's extended rows (two segments of `segment` rows; `seq`: each
    row's sequence, -1 in the zero halo): each row sees the `window` rows up to itself within its run (its
    sequence's rows in one segment), over the keys of its window-sized block and the one before
    ([rows, 2 window])."""
    device = seq.device
    rows = torch.arange(2 * segment, device=device)
    run = seq * 2 + rows // segment  # a sequence's rows within one segment; the zero halo is its own run
    new_run = torch.ones_like(run, dtype=torch.bool)
    new_run[1:] = run[1:] != run[:-1]
    run_start = torch.cummax(torch.where(new_run, rows, 0), 0).values
    key = (rows[:, None] // window - 1) * window + torch.arange(2 * window, device=device)
    return (key <= rows[:, None]) & (key > rows[:, None] - window) & (key >= run_start[:, None])


def _compressed_entries(lens: torch.Tensor, starts: torch.Tensor, ratio: int, chunk: int, cp: int):
    """The micro-batch's compressed entries at `ratio` (one per whole window of a sequence, in (sequence,
    window) order), the same on every rank: (each sequence's first entry, each entry's index in its
    sequence, its window's first stream index, the chunk holding the window's last token and that chunk's
    rank, which computes the entry)."""
    device = lens.device
    count = lens // ratio
    first = torch.cumsum(count, 0) - count
    entries = int(count.sum())
    entry_seq = torch.repeat_interleave(torch.arange(lens.numel(), device=device), count,
                                        output_size=entries)
    index_in_seq = torch.arange(entries, device=device) - first[entry_seq]
    window_start = starts[entry_seq] + index_in_seq * ratio
    owner_chunk = (window_start + ratio - 1) // chunk  # the chunk holding the window's last token
    owner = torch.where(owner_chunk < cp, owner_chunk, 2 * cp - 1 - owner_chunk)
    return first, index_in_seq, window_start, owner_chunk, owner


def context_geometry(batch: PackedBatch, window: int, ratios, halo: int, group: dist.ProcessGroup):
    """DeepSeek-V4's `Geometry` of this rank's zigzag share (its chunks a = rank and b = 2cp-1-rank).

    Attention runs on the rank's rows extended by the `halo` rows before each chunk (the sliding window's
    keys and the compression windows that end in the chunk but start before it): rows [halo a ; chunk a ;
    halo b ; chunk b], one contiguous run of the stream per chunk. A compressed entry is computed by the rank
    holding its window's last token, and the entries of all ranks are gathered into the micro-batch's order
    (sequence, window), so queries see exactly the entries they see on one rank. Chunk 0 has no rows before
    it: its halo is zeros belonging to no sequence. Needs chunks of at least `halo` rows (the rule book pads
    streams to multiples of 2 cp x halo)."""
    from mlite.runtime.models.deepseek_v4 import Geometry, Windows

    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    device = batch.input_ids.device
    ends = batch.cu_seqlens.long().to(device)
    lens, starts, total = ends[1:] - ends[:-1], ends[:-1], int(ends[-1])
    chunk = total // (2 * cp)
    if chunk < halo or chunk * 2 * cp != total:
        raise MliteError(f"DeepSeek-V4 under cp={cp}: a chunk of {chunk} rows is shorter than the {halo} "
                         f"boundary rows it needs; pad streams to a multiple of {2 * cp * halo} tokens")
    segment = chunk + halo
    mine = (rank, 2 * cp - 1 - rank)
    first_row = [c * chunk - halo for c in mine]  # stream index of each segment's first row
    stream = torch.cat([torch.arange(s, s + segment, device=device) for s in first_row])  # [E]
    valid = stream >= 0
    seq_of = torch.repeat_interleave(torch.arange(lens.numel(), device=device), lens, output_size=total)
    seq = torch.where(valid, seq_of[stream.clamp(min=0)], -1)
    positions = torch.where(valid, stream - starts[seq.clamp(min=0)], 0)
    window_mask = _window_mask(seq, segment, window)

    compressed, layouts = {}, {}
    longest = batch.max_seqlen or int(lens.max())
    for ratio in set(ratios):
        first, index_in_seq, window_start, owner_chunk, owner = _compressed_entries(
            lens, starts, ratio, chunk, cp)
        entries = index_in_seq.numel()
        slots = max(int(torch.bincount(owner, minlength=cp).max()) if entries else 0, 1)
        slot = (F.one_hot(owner, cp).cumsum(0) - 1).gather(1, owner[:, None]).squeeze(1)
        layouts[ratio] = (slots, owner * slots + slot)
        own = owner == rank
        seg = (owner_chunk[own] != mine[0]).long()  # 0: chunk a's segment, 1: chunk b's
        base = seg * segment - torch.tensor(first_row, device=device)[seg]  # stream index -> row here
        win_rows = (window_start[own] + base)[:, None] + torch.arange(ratio, device=device)
        prev_rows = torch.maximum(win_rows - ratio, (seg * segment)[:, None])  # CSA: within the halo
        most = max(longest // ratio, 1)
        visible_slots = torch.arange(most, device=device)
        visible = first[seq.clamp(min=0)][:, None] + visible_slots
        visible_mask = (visible_slots < ((positions + 1) // ratio)[:, None]) & valid[:, None]
        compressed[ratio] = Windows(ratio, win_rows, prev_rows, index_in_seq[own] > 0,
                                    index_in_seq[own] * ratio, visible.clamp(max=max(entries - 1, 0)),
                                    visible_mask, entries)
    local = torch.cat([torch.arange(halo, segment, device=device),
                       torch.arange(segment + halo, 2 * segment, device=device)])
    exchange = BoundaryExchange(group, rank, cp, chunk, halo, local, layouts, batch.extras[TOKEN_INDEX])
    return Geometry(window, window_mask, positions, compressed, exchange)


class BoundaryExchange:
    """The collectives of DeepSeek-V4 attention under context parallel (see `context_geometry`): boundary
    rows from the neighbouring chunks, compressed entries (and indexer keys) from every rank; never the raw
    K/V of the whole stream."""

    def __init__(self, group, rank: int, cp: int, chunk: int, halo: int, local: torch.Tensor, layouts: dict,
                 token_index: torch.Tensor):
        self.group, self.rank, self.cp, self.chunk, self.halo = group, rank, cp, chunk, halo
        self.local_rows, self.layouts, self.token_index = local, layouts, token_index

    def _tail(self, c: int) -> int:  # where chunk c's last rows sit among the gathered tails
        return 2 * c if c < self.cp else 2 * (2 * self.cp - 1 - c) + 1

    def extend(self, x: torch.Tensor) -> torch.Tensor:
        """[2 chunk, ...] this rank's rows -> [2 (halo + chunk), ...] with the rows before each chunk."""
        c, h = self.chunk, self.halo
        tails = GatherTokens.apply(torch.stack([x[c - h: c], x[2 * c - h:]]), self.group)  # [2cp, h, ...]
        a, b = self.rank, 2 * self.cp - 1 - self.rank
        halo_a = x.new_zeros(h, *x.shape[1:]) if a == 0 else tails[self._tail(a - 1)]
        return torch.cat([halo_a, x[:c], tails[self._tail(b - 1)], x[c:]])

    def local(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.local_rows]

    def gather(self, entries: torch.Tensor, ratio: int) -> torch.Tensor:
        """This rank's entries [n, D] -> the micro-batch's [C, D], in (sequence, window) order."""
        slots, index = self.layouts[ratio]
        padded = F.pad(entries, (0, 0, 0, slots - entries.shape[0]))
        return GatherTokens.apply(padded, self.group)[index]

    def total(self, count: torch.Tensor) -> torch.Tensor:
        count = count.detach().clone()
        dist.all_reduce(count, group=self.group)
        return count

    def next_token(self, values: torch.Tensor, batch: PackedBatch, fill: int) -> torch.Tensor:
        from mlite.runtime.models.deepseek_v4 import shift_in_sequence

        stream = values.new_empty(int(batch.cu_seqlens[-1]))
        stream[_gather_ints(self.token_index, self.group)] = _gather_ints(values, self.group)
        return shift_in_sequence(stream, batch, fill)[self.token_index]
