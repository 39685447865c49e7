"""DeepSeek-V4 over packed token streams: attention with sliding-window, compressed-sparse (CSA) and heavily
compressed (HCA) key sets, manifold-constrained hyper-connections (mHC), hash- and bias-routed MoE and the
multi-token-prediction (MTP) block. Exact against transformers' `models/deepseek_v4` (tests compare with
a fixture it wrote), with every sequence of a packed batch computed as if it ran alone.

Reads top to bottom: rotary embeddings, the packed-batch geometry every layer shares, the attention core,
compressors and the indexer, attention, mHC, MoE, block, MTP, model, HF names.

Attention is memory-linear: each query attends over the keys it may see (its sliding window, by blocks
that share their keys, plus the compressed entries visible to it: all of them for HCA, the indexer's top-k
for CSA), so no T x T score matrix exists: O(T x (window + top-k)) memory, chunked over query blocks.

Parallel seams as in qwen3.py (the model imports no parallel code): `Block.set_runner` (recompute), the MoE
block's `set_parallel` and `Experts.set_local_view` (expert parallel), and `DeepseekV4.set_geometry`
(context parallel: a `Geometry` whose `exchange` extends a rank's rows by the boundary rows its keys need
and gathers the compressed entries of every rank).
"""

from __future__ import annotations

import bisect
import functools
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mlite.config.arch import V4_CSA as CSA
from mlite.config.arch import V4_DENSE_ENTRIES_PER_PICK, V4_KEY_SET_LOGITS, ModelArch
from mlite.runtime.data.packed import IGNORE, PackedBatch
from mlite.runtime.models.base import CausalLM, HFTensors, LossHead, ModelOutput, RMSNorm, same_tensor
from mlite.runtime.models.moe import (
    MoE,
    RouterStats,
    clamp_gate_up,
    load_balancing_loss,
    real_rows,
    router_stats,
)


# ---------------------------------------------------------------------------------------------- norms
# V4 keeps every norm weight in fp32 and scales in fp32: RMSNorm(..., fp32_weight=True) throughout
def rms_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / rms of each row of x, in fp32: [..., 1]."""
    return torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)


# ------------------------------------------------------------------------------------- rotary embeddings
def yarn_inv_freq(dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN frequencies (transformers' `_compute_yarn_parameters` with truncation). V4 applies no YaRN
    attention factor: its compressed layers use the frequencies alone."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    base_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    extrapolate = 1 - ramp
    return (1.0 / (factor * base_freqs)) * (1 - extrapolate) + (1.0 / base_freqs) * extrapolate


def inv_freq(dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Host constants of the architecture (on the CPU whatever device the model is built on, so a meta
    build has them too); `rope_angles` moves them to the positions' device."""
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "yarn":
        return yarn_inv_freq(dim, theta, scaling)
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)


def rope_angles(positions: torch.Tensor, freqs: torch.Tensor, dtype: torch.dtype):
    """positions [...] -> cos, sin [..., rope_dim / 2] (one angle per interleaved pair)."""
    angles = positions.float().unsqueeze(-1) * freqs.to(positions.device)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing rope channels of x [T, ..., d]; cos/sin [T, rope_dim / 2].

    Pairs are adjacent channels (2i, 2i+1); the leading channels carry no position. Computed in fp32."""
    rope_dim = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim,)
    cos = cos.repeat_interleave(2, dim=-1).view(shape)
    sin = sin.repeat_interleave(2, dim=-1).view(shape)
    plain, rope = x[..., :-rope_dim], x[..., -rope_dim:].float()
    rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([plain, (rope * cos + rotated * sin).to(x.dtype)], dim=-1)


class _NormedRope(torch.autograd.Function):
    """apply_rope(x * rms_scale(x)): a weightless RMS norm, then RoPE, keeping only the output and the
    row scales for the backward.

    Autograd would keep x for the norm beside the output the attention's score product keeps: two
    [T, heads, 512] tensors per layer. RoPE is a rotation, so its backward is the inverse rotation and the
    norm's input direction is recovered from the output; only the output (shared with the score product)
    and one fp32 scale per row stay."""

    @staticmethod
    def forward(ctx, x, cos, sin, eps: float):
        scale = rms_scale(x, eps)
        out = apply_rope(x * scale.to(x.dtype), cos, sin)
        ctx.save_for_backward(out, scale, cos, sin)
        return out

    @staticmethod
    def backward(ctx, grad):
        out, scale, cos, sin = ctx.saved_tensors
        normed = apply_rope(out, cos, -sin).float()  # the norm's output: the rotation undone
        grad = apply_rope(grad, cos, -sin).float()  # a rotation's transpose is its inverse
        # d(x * s(x)) / dx with s = 1 / rms(x): s * (g - y * mean(g * y)), y = x * s
        grad_x = scale * (grad - normed * (grad * normed).mean(-1, keepdim=True))
        return grad_x.to(out.dtype), None, None, None


def normed_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """The attention queries: weightless RMS norm per head, then RoPE (x [T, heads, d])."""
    return _NormedRope.apply(x, cos, sin, eps)


# ------------------------------------------------------------------------------ packed-batch geometry
@dataclass
class Windows:
    """The complete compression windows of every sequence for one ratio: entry c covers tokens
    rows[c] (ratio consecutive tokens of one sequence); windows restart at each sequence start."""

    ratio: int
    rows: torch.Tensor  # [C, ratio] token indices of each entry's window
    prev_rows: torch.Tensor  # [C, ratio] token indices of the previous window (CSA's overlap)
    has_prev: torch.Tensor  # [C] bool: the previous window belongs to the same sequence
    positions: torch.Tensor  # [C] position of the window's first token within its sequence
    visible: torch.Tensor  # [T, V] entry index each query may see (its sequence's first V entries)
    visible_mask: torch.Tensor  # [T, V] bool: entry complete before the query (causal)
    count: int  # entries of the whole micro-batch (under context parallel, rows are this rank's only)
    # per block of `window` tokens, how many leading entries any of its queries may see (from the host's
    # lengths; None when the host has none, or under context parallel)
    block_limits: tuple[int, ...] | None = None


@dataclass
class Geometry:
    """What every layer needs to know about a packed batch, computed once per forward.

    The sliding window is laid out by blocks of `window` tokens: a query in block b may see the keys of
    blocks b-1 and b (2 x window of them), those of its own window marked in `window_mask`. So every query
    of a block shares one key block, and attention is one batched matmul per block, without gathers."""

    window: int
    window_mask: torch.Tensor  # [T, 2 x window] bool: key j = (t // window - 1) * window + j is in t's window
    positions: torch.Tensor  # [T]
    compressed: dict[int, Windows]
    exchange: object = None  # context parallel (mlite.runtime.parallel.context); None: one rank's stream

    # Under context parallel, attention runs on this rank's rows extended by the boundary rows before each
    # of its chunks (`extend`, `local` drops them again), entries are computed by the rank holding their
    # window's last token and gathered (`gather`), and per-token sums take the whole micro-batch's counts.
    def extend(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.exchange is None else self.exchange.extend(x)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.exchange is None else self.exchange.local(x)

    def gather(self, entries: torch.Tensor, ratio: int) -> torch.Tensor:
        return entries if self.exchange is None else self.exchange.gather(entries, ratio)

    def total(self, count: torch.Tensor) -> torch.Tensor:
        return count if self.exchange is None else self.exchange.total(count)

    def next_token(self, values: torch.Tensor, batch: PackedBatch, fill: int) -> torch.Tensor:
        """values[t + 1] at t within each sequence, `fill` at its last token."""
        if self.exchange is None:
            return shift_in_sequence(values, batch, fill)
        return self.exchange.next_token(values, batch, fill)


def batch_geometry(batch: PackedBatch, sliding_window: int, ratios: Iterable[int]) -> Geometry:
    device = batch.input_ids.device
    t, w = batch.input_ids.shape[0], sliding_window
    lens = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).long().to(device)
    starts = batch.cu_seqlens[:-1].long().to(device)
    seq_of = torch.repeat_interleave(torch.arange(lens.numel(), device=device), lens, output_size=t)
    token = torch.arange(t, device=device)[:, None]
    key = (token // w - 1) * w + torch.arange(2 * w, device=device)  # [T, 2w] token index of each key
    window_mask = (key <= token) & (key > token - w) & (key >= starts[seq_of][:, None])
    longest = batch.max_seqlen or int(lens.max())
    compressed = {}
    for ratio in set(ratios):
        count = lens // ratio  # complete windows per sequence
        first = torch.cumsum(count, 0) - count  # entry index of each sequence's first window
        # the number of entries sizes tensors: from the host's lengths when it has them (no GPU read)
        total = sum(n // ratio for n in batch.host_lens) if batch.host_lens is not None else int(count.sum())
        entry_seq = torch.repeat_interleave(torch.arange(lens.numel(), device=device), count,
                                            output_size=total)
        index_in_seq = torch.arange(total, device=device) - first[entry_seq]
        rows = (starts[entry_seq] + index_in_seq * ratio)[:, None] + torch.arange(ratio, device=device)
        most = max(longest // ratio, 1)
        slots = torch.arange(most, device=device)
        visible = first[seq_of][:, None] + slots
        # query at position p sees entry w once its window is complete: w < (p + 1) // ratio
        visible_mask = slots < ((batch.position_ids + 1) // ratio)[:, None]
        limits = None if batch.host_lens is None else block_limits(batch.host_lens, ratio, w, t)
        compressed[ratio] = Windows(ratio, rows, (rows - ratio).clamp(min=0), index_in_seq > 0,
                                    index_in_seq * ratio, visible.clamp(max=max(total - 1, 0)), visible_mask,
                                    total, limits)
    return Geometry(w, window_mask, batch.position_ids, compressed)


def block_limits(lens: Iterable[int], ratio: int, window: int, tokens: int) -> tuple[int, ...]:
    """For each block of `window` tokens, the entries complete by its last token: entries run in token
    order, so the entries any of its queries may see are the first that many."""
    last = []  # the last token of each entry's window
    start = 0
    for n in lens:
        last.extend(range(start + ratio - 1, start + n - n % ratio, ratio))
        start += n
    return tuple(bisect.bisect_right(last, min((b + 1) * window, tokens) - 1)
                 for b in range(-(-tokens // window)))


# ------------------------------------------------------------------------------------ attention core
class _SinkSoftmax(torch.autograd.Function):
    """softmax over [logits ; one sink logit per head] in fp32, returning the logits' probabilities (the
    sink's own is dropped: it only dilutes the others) in `dtype`.

    The backward needs the probabilities alone: it keeps them in `dtype` (the tensor the output product
    keeps anyway) and one fp32 log-sum-exp per row for the sink's gradient. Autograd's softmax would also
    keep its fp32 result: 6 bytes per score instead of 2, the largest activation of the attention core.
    Rounding the kept probabilities to bf16 is what the output product already does with them."""

    @staticmethod
    def forward(ctx, logits, sinks, dtype: torch.dtype):
        sink = sinks.float().view(1, -1, 1)  # logits [N, heads, K] fp32; sinks [heads]
        top = torch.maximum(logits.amax(dim=-1, keepdim=True), sink)
        lse = top + (torch.exp(logits - top).sum(dim=-1, keepdim=True) + torch.exp(sink - top)).log()
        probs = torch.exp(logits - lse).to(dtype)
        ctx.save_for_backward(probs, lse, sinks)
        return probs

    @staticmethod
    def backward(ctx, grad):
        probs, lse, sinks = ctx.saved_tensors
        p, grad = probs.float(), grad.float()
        dot = (grad * p).sum(dim=-1, keepdim=True)  # the sink's own gradient is 0: its probability is unused
        grad_sinks = -(torch.exp(sinks.float().view(1, -1, 1) - lse) * dot).sum(dim=(0, 2))
        return p * (grad - dot), grad_sinks.to(sinks.dtype), None


# long for one kernel: padding, the per-block product, its runs and chunks share the block shapes
def key_set_attention(q, kv, window_mask, entries, entry_keys, entry_mask, sinks, scale: float,
                      budget: int = V4_KEY_SET_LOGITS, entry_limits: tuple[int, ...] | None = None,
                      entry_runs: int = 8) -> torch.Tensor:
    """Attention of each query over its key set: its sliding window of raw keys, plus compressed entries.

    q [T, H, D]; kv [T, D] (one shared K=V head); window_mask [T, 2W] (see `Geometry`); entries [C, D] or
    None; entry_keys [T, K] entries each query may see with entry_mask [T, K], or entry_keys None and
    entry_mask [T, C] over all entries (dense, when C is small); sinks [H]: a learned logit per head in the
    softmax denominator only. Returns [T, H, D]. Memory O(T x H x (2W + K)); above `budget` logits it runs
    in chunks of blocks, recomputed in backward.

    Dense entries join each block's window keys, so a block's scores and output are one batched matmul
    each. `entry_limits` (dense only; the host's count of leading entries any query of each W-token block
    may see, as `Windows.block_limits`) lets a run of blocks multiply only the entries visible to it: on one
    causal sequence that is half of them on average. Runs are used where the entries are at least the
    window's 2W keys."""
    t, h, d = q.shape
    w = window_mask.shape[1] // 2
    blocks = -(-t // w)
    pad = blocks * w - t

    def rows(x: torch.Tensor, fill=0) -> torch.Tensor:  # pad the token dim to whole blocks
        return F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad), value=fill) if pad else x

    q, window_mask = rows(q), rows(window_mask, False)
    kv_blocks = F.pad(kv, (0, 0, w, pad)).view(blocks + 1, w, d)  # an empty block before the first
    dense = entries is not None and entry_keys is None
    if entries is not None:
        entry_mask = rows(entry_mask, False)
        entry_keys = None if dense else rows(entry_keys)

    def part(q, kv_blocks, window_mask, entry_keys, entry_mask, entries):
        n = q.shape[0] // w
        keys = [kv_blocks[:-1], kv_blocks[1:]]  # [n, w, D] each: blocks b-1 and b
        if dense:  # every block multiplies the same entries, after its window keys
            keys.append(entries.expand(n, -1, -1))
            window_mask = torch.cat([window_mask, entry_mask], dim=1)
        keys = torch.cat(keys, dim=1)  # [n, K, D]
        width = keys.shape[1]
        scores = torch.bmm(q.reshape(n, w * h, d), keys.transpose(1, 2)).view(n * w, h, width)
        logits = [(scores.float() * scale).masked_fill(~window_mask[:, None, :], float("-inf"))]
        if entry_keys is not None:
            picked = entries[entry_keys]  # [t, K, D]
            scores = torch.einsum("thd,tkd->thk", q, picked)
            logits.append((scores.float() * scale).masked_fill(~entry_mask[:, None, :], float("-inf")))
        logits = logits[0] if len(logits) == 1 else torch.cat(logits, dim=-1)
        probs = _SinkSoftmax.apply(logits, sinks, q.dtype)
        out = torch.bmm(probs[..., :width].reshape(n, w * h, width), keys).view(n * w, h, d)
        if entry_keys is not None:
            out = out + torch.einsum("thk,tkd->thd", probs[..., width:], picked)
        return out

    # runs of blocks: (first, end, entries they multiply); with limits, `entry_runs` of growing width, where
    # the entries are a large share of the keys (measured: with 32 entries beside 256 window keys, four
    # smaller matmuls cost more than the skipped columns save)
    entry_count = 0 if entries is None else entry_mask.shape[1]
    runs = [(0, blocks, entry_count)]
    if dense and entry_limits is not None and entry_count >= 2 * w:
        step = -(-blocks // entry_runs)
        runs = [(b, min(b + step, blocks), entry_limits[min(b + step, blocks) - 1])
                for b in range(0, blocks, step)]
    chunked = False
    if sum((e - b) * w * h * (2 * w + k) for b, e, k in runs) > budget:  # chunks, each recomputed
        chunks = []
        for b, e, k in runs:
            per_chunk = max(1, budget // (w * h * (2 * w + k)))  # blocks
            chunks += [(c, min(c + per_chunk, e), k) for c in range(b, e, per_chunk)]
        runs, chunked = chunks, torch.is_grad_enabled()
    outs = []
    for b, e, k in runs:
        args = (q[b * w: e * w], kv_blocks[b: e + 1], window_mask[b * w: e * w],
                None if entry_keys is None else entry_keys[b * w: e * w],
                None if entry_mask is None else entry_mask[b * w: e * w, : k if dense else None],
                None if entries is None else entries[:k] if dense else entries)
        outs.append(checkpoint(part, *args, use_reentrant=False) if chunked else part(*args))
    return (outs[0] if len(outs) == 1 else torch.cat(outs))[:t]


# ------------------------------------------------------------------------ compressors and the indexer
class Compressor(nn.Module):
    """One compressed entry per complete window of `ratio` tokens: a softmax-gated sum of the window's
    projected rows (plus a learned bias per slot), normalised, with RoPE at the window's first position.

    CSA (`overlap`) projects two series per token: entry w mixes the previous window's first series with
    its own second series (2 x ratio slots), so neighbouring entries overlap."""

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float):
        super().__init__()
        width = 2 if overlap else 1
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        self.kv_proj = nn.Linear(hidden, width * dim, bias=False)
        self.gate_proj = nn.Linear(hidden, width * dim, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width * dim))
        self.norm = RMSNorm(dim, eps, fp32_weight=True)

    def forward(self, x: torch.Tensor, windows: Windows, cos, sin) -> torch.Tensor:
        """x [T, hidden] -> [C, dim] entries (C: the batch's complete windows); cos/sin at their positions."""
        kv_rows, gate_rows = self.kv_proj(x), self.gate_proj(x)  # [T, width * dim]
        kv = kv_rows[windows.rows]  # [C, ratio, width * dim]
        gate = gate_rows[windows.rows] + self.position_bias.float()
        if self.overlap:
            d = self.dim
            has_prev = windows.has_prev[:, None, None]
            prev_kv = kv_rows[windows.prev_rows][..., :d]
            prev_gate = gate_rows[windows.prev_rows][..., :d] + self.position_bias[:, :d].float()
            kv = torch.cat([torch.where(has_prev, prev_kv, 0.0), kv[..., d:]], dim=1)
            gate = torch.cat([torch.where(has_prev, prev_gate, float("-inf")), gate[..., d:]], dim=1)
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        return apply_rope(self.norm((kv * weights).sum(dim=1)), cos, sin)


@functools.cache
def _compiled_weighted_relu_sum():
    return torch.compile(lambda dots, weights: (dots.relu() * weights.unsqueeze(-1)).sum(1), dynamic=True)


def _weighted_relu_sum(dots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """dots [t, heads, V], weights [t, heads] -> sum_h weights * relu(dots): [t, V], one fused kernel."""
    return _compiled_weighted_relu_sum()(dots, weights)


def index_scores(q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor) -> torch.Tensor:
    """The indexer's scores, sum_h w[t, h] * relu(q[t, h] . k) / sqrt(heads * dim): q [t, heads, dim],
    head_weights [t, heads], keys [t, V, dim] (each query's own candidates) -> [t, V]; or keys [C, dim]
    (every entry, the same for all queries) -> [t, C]."""
    heads, dim = q.shape[1], q.shape[2]
    if keys.dim() == 2 and q.is_cuda and q.dtype == keys.dtype == torch.bfloat16:
        # one matmul against every entry, on the tensor cores with an fp32 result: the products of bf16
        # values are exact in fp32, so these are the fp32 matmul's numbers up to the order of the sums
        dots = torch.mm(q.flatten(0, 1), keys.t(), out_dtype=torch.float32).view(*q.shape[:2], -1)
    elif keys.dim() == 2:  # one matmul against every entry: no per-query copy of the keys
        dots = torch.matmul(q.float(), keys.float().t())
    else:
        dots = torch.einsum("thd,tvd->thv", q.float(), keys.float())
    # sum_h w[t, h] * relu(dots[t, h]), both scales in w. The dots are [t, heads, V] fp32, the largest
    # tensor the indexer makes: on GPUs one compiled reduction reads them once (relu, weight and sum
    # fused); elsewhere one batched product over the relu'd dots
    weights = head_weights.float() * (heads**-0.5 * dim**-0.5)
    if dots.is_cuda:
        return _weighted_relu_sum(dots, weights)
    return torch.bmm(weights.unsqueeze(1), dots.relu_()).squeeze(1)


@torch.library.custom_op("mlite::v4_index_pick", mutates_args=())
def index_pick(q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor, visible: torch.Tensor,
               visible_mask: torch.Tensor, top_k: int, every_entry_ratio: int,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's top-k visible entries by index score: (picked [T, k] entry indices, picked_mask).

    An opaque op: the search over data-dependent candidate sets runs eagerly, chunked, while a compiled
    block traces through it by its output shapes alone (the fake below). A graph break here instead
    split the block's compiled graph at the attention call, and layers of other kinds then shared that
    split entry: the first step and a recompute took different graphs (full recompute failed)."""
    top_k = min(top_k, visible.shape[1])
    picked, picked_mask = [], []
    # where each query's candidates (the complete windows before it in its sequence) are a good share of
    # all entries, one matmul against every entry, then the candidates' columns, beats copying the keys
    # per query; a batch of many short sequences keeps the per-query copy (fewer products)
    every = visible.shape[1] * every_entry_ratio >= keys.shape[0]
    chunk = max(1, (1 << 26) // (q.shape[1] * (keys.shape[0] if every else visible.shape[1])))
    for start in range(0, q.shape[0], chunk):
        part = slice(start, start + chunk)
        if every:
            scores = index_scores(q[part], keys, head_weights[part]).gather(1, visible[part])
        else:
            scores = index_scores(q[part], keys[visible[part]], head_weights[part])
        scores = scores.masked_fill(~visible_mask[part], float("-inf"))
        # ties (relu makes exact zeros common) go to the earlier entry, whatever the candidate list's
        # length: a stable sort, not topk, whose choice among ties is the kernel's
        best = scores.sort(dim=-1, descending=True, stable=True)
        picked.append(visible[part].gather(1, best.indices[:, :top_k]))
        picked_mask.append(best.values[:, :top_k] > float("-inf"))
    if not picked:  # no query
        return visible.new_empty(0, top_k), visible_mask.new_empty(0, top_k)
    return torch.cat(picked), torch.cat(picked_mask)


@index_pick.register_fake
def _index_pick_shapes(q, keys, head_weights, visible, visible_mask, top_k, every_entry_ratio):
    top_k = min(top_k, visible.shape[1])
    return visible.new_empty(q.shape[0], top_k), visible_mask.new_empty(q.shape[0], top_k)


class Indexer(nn.Module):
    """The lightning indexer of CSA: scores compressed entries for each query,
    sum_h w[t, h] * relu(q[t, h] . k[c]), and keeps the top-k visible ones."""

    every_entry_ratio = 4  # score every entry at once where a query's candidates are >= 1/4 of them

    def __init__(self, arch: ModelArch):
        super().__init__()
        v4 = arch.v4
        self.heads, self.dim, self.top_k = v4.index_n_heads, v4.index_head_dim, v4.index_topk
        self.compressor = Compressor(arch.hidden, self.dim, CSA, overlap=True, eps=arch.rms_norm_eps)
        self.q_proj = nn.Linear(v4.q_lora_rank, self.heads * self.dim, bias=False)
        self.weights_proj = nn.Linear(arch.hidden, self.heads, bias=False)

    def forward(self, x, q_residual, geo: Geometry, entry_rope, query_rope):
        """-> (picked [T, k] entry indices, picked_mask [T, k], query/key tensors for the indexer loss).
        Everything compiles with the block; the top-k search is the opaque `index_pick`."""
        windows = geo.compressed[CSA]
        keys = geo.gather(self.compressor(x, windows, *entry_rope), CSA)  # [C, dim]
        q = apply_rope(self.q_proj(q_residual).view(x.shape[0], self.heads, self.dim), *query_rope)
        head_weights = self.weights_proj(x)
        # top-k is not differentiable: the indexer trains only through its own loss
        picked, picked_mask = index_pick(q.detach(), keys.detach(), head_weights.detach(), windows.visible,
                                         windows.visible_mask, self.top_k, self.every_entry_ratio)
        return picked, picked_mask, (q, keys, head_weights)


# ----------------------------------------------------------------------------------------- attention
def grouped_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The output projection's first half, one matrix per head group: x [T, groups, in], w [groups, out, in]
    -> [T, groups, out]."""
    return torch.einsum("tgi,goi->tgo", x, w)


class Attention(nn.Module):
    """One shared 512-wide K=V head; low-rank queries with a weightless per-head norm; partial interleaved
    RoPE (undone on the output, since values carry it too); a learned sink per head; a grouped low-rank
    output projection. Keys: the sliding window, plus compressed entries on CSA/HCA layers."""

    def __init__(self, arch: ModelArch, layer: int):
        super().__init__()
        v4, h, d = arch.v4, arch.hidden, arch.head_dim
        self.heads, self.head_dim, self.eps = arch.num_heads, d, arch.rms_norm_eps
        self.groups = v4.o_groups
        self.ratio = v4.compress_ratios[layer] if layer < len(v4.compress_ratios) else 0
        self.q_a_proj = nn.Linear(h, v4.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(v4.q_lora_rank, arch.rms_norm_eps, fp32_weight=True)
        self.q_b_proj = nn.Linear(v4.q_lora_rank, self.heads * d, bias=False)
        self.kv_proj = nn.Linear(h, d, bias=False)
        self.kv_norm = RMSNorm(d, arch.rms_norm_eps, fp32_weight=True)
        # per group: heads * d / groups -> o_lora_rank, stacked as one [groups * o_lora_rank, in] weight
        self.o_a_proj = nn.Linear(self.heads * d // v4.o_groups, v4.o_groups * v4.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(v4.o_groups * v4.o_lora_rank, h, bias=False)
        self.sinks = nn.Parameter(torch.zeros(self.heads))
        self.compressor = (Compressor(h, d, self.ratio, overlap=self.ratio == CSA, eps=arch.rms_norm_eps)
                           if self.ratio else None)
        self.indexer = Indexer(arch) if self.ratio == CSA else None
        self.indexer_loss_weight = 0.0  # > 0 trains the indexer towards the attention's own distribution
        self.core = key_set_attention
        self.output_product = grouped_product

    def set_core(self, core) -> None:
        """The seam: `core(q, kv, window_mask, entries, entry_keys, entry_mask, sinks, scale, entry_limits=)`
        replaces the key-set attention (recompute, a fused GPU kernel)."""
        self.core = core

    def set_output_product(self, product) -> None:
        """The seam: `product(x [T, groups, in], w [groups, o_lora_rank, in])` replaces the output
        projection's grouped first half (rounded as an inference engine rounds it, say)."""
        self.output_product = product

    @property
    def rope_kind(self) -> str:
        return "compress" if self.ratio else "main"  # sliding layers keep the plain rope

    def forward(self, x: torch.Tensor, geo: Geometry, ropes: dict, batch: PackedBatch,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> ([T, hidden], the indexer loss of this layer: 0 unless it is trained)."""
        x = geo.extend(x)  # under context parallel: with the boundary rows the keys need
        t = x.shape[0]
        cos, sin = ropes[self.rope_kind]
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_residual).view(t, -1, self.head_dim)
        q = normed_rope(q, cos, sin, self.eps)
        kv = apply_rope(self.kv_norm(self.kv_proj(x)), cos, sin)  # [T, d]: key and value at once
        entries = picked = picked_mask = scored = None
        indexer_loss = torch.zeros((), device=x.device)
        windows = geo.compressed.get(self.ratio)
        if self.compressor is not None and windows.count > 0:  # some window is complete
            entries = geo.gather(self.compressor(x, windows, *ropes["entries", self.ratio]), self.ratio)
            if self.indexer is not None:
                # detached, as DeepSeek-V3.2 trains it: the indexer's loss reaches the indexer only; a
                # frozen indexer builds no autograd graph at all
                with torch.set_grad_enabled(torch.is_grad_enabled() and self.indexer_loss_weight > 0):
                    picked, picked_mask, scored = self.indexer(
                        x.detach(), q_residual.detach(), geo, ropes["entries", self.ratio], (cos, sin))
            else:
                picked, picked_mask = windows.visible, windows.visible_mask
        entry_keys, entry_mask = picked, picked_mask
        if entries is not None and entries.shape[0] <= V4_DENSE_ENTRIES_PER_PICK * picked.shape[1]:
            # few entries: all of them, masked per query
            entry_keys, entry_mask = None, torch.zeros(t, entries.shape[0] + 1, dtype=torch.bool,
                                                       device=x.device).scatter_(
                1, torch.where(picked_mask, picked, entries.shape[0]), True)[:, :-1]
        scale = self.head_dim**-0.5
        limits = windows.block_limits if entry_keys is None and entries is not None else None
        out = self.core(q, kv, geo.window_mask, entries, entry_keys, entry_mask, self.sinks, scale,
                        entry_limits=limits)
        if scored is not None and self.indexer_loss_weight > 0:
            indexer_loss = self.indexer_loss_weight * self._indexer_loss(
                q, entries, picked, picked_mask, scored, geo, batch)
        out = geo.local(apply_rope(out, cos, -sin))  # undo the values' rotation at the query position
        t = out.shape[0]
        grouped = out.reshape(t, self.groups, -1)  # [T, groups, heads * d / groups]
        w = self.o_a_proj.weight.view(self.groups, -1, grouped.shape[-1])  # [groups, o_lora_rank, in]
        low_rank = self.output_product(grouped, w).reshape(t, -1)
        return self.o_b_proj(low_rank), indexer_loss

    def _indexer_loss(self, q, entries, picked, picked_mask, scored, geo, batch) -> torch.Tensor:
        """KL(attention || indexer) over the picked entries, as DeepSeek-V3.2 trains its indexer: the target
        is the attention's probability mass on each picked entry, summed over heads and renormalised
        (no gradient into the attention); the indexer's distribution is its softmax over the same entries."""
        index_q, index_keys, head_weights = scored
        with torch.no_grad():
            scores = torch.einsum("thd,tkd->thk", q, entries[picked]) * self.head_dim**-0.5
            probs = scores.masked_fill(~picked_mask[:, None, :], float("-inf")).float().softmax(-1)
            target = probs.nan_to_num(0.0).sum(1)
            target = target / target.sum(-1, keepdim=True).clamp(min=1e-20)
        logits = index_scores(index_q, index_keys[picked], head_weights)
        logits = logits.masked_fill(~picked_mask, float("-inf"))
        log_q = logits.log_softmax(-1).masked_fill(~picked_mask, 0.0)
        kl = geo.local((target * (target.clamp(min=1e-20).log() - log_q)).sum(-1))
        rows = geo.local(picked_mask.any(-1)) & ~batch.padding_mask()  # this rank's own queries
        return (kl * rows).sum() / geo.total(rows.sum()).clamp(min=1)


# ------------------------------------------------------------------------------------------------ mHC
def _product_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with an fp32 result. With bf16 `b` on a GPU, `a` is rounded to bf16 too and the product runs
    on the tensor cores (products of bf16 values are exact in fp32: the fp32 matmul's arithmetic, up to
    the order of the sums); elsewhere in fp32."""
    if b.is_cuda and b.dtype == torch.bfloat16:
        return torch.mm(a.to(b.dtype), b, out_dtype=torch.float32)
    return a.float() @ b.float()


class _NormedProduct(torch.autograd.Function):
    """rms_norm(x) @ w^T in fp32, x [M, K], w [N, K] (N small: the mHC maps' 24 logits per token).

    The norm's scale r is one number per row, so it applies after the product. The backward keeps x as
    it came (the residual streams, kept anyway), r and the small output. No fp32 copy of x: one made
    for a matmul in the backward is one the compiler's partition keeps from the forward, [tokens, 4 x
    hidden] in fp32 per call, two per layer; so the weight's gradient multiplies x as it is."""

    @staticmethod
    def forward(ctx, x, w, eps: float):
        scale = rms_scale(x, eps)  # [M, 1] fp32
        out = _product_fp32(x, w.t()) * scale
        ctx.save_for_backward(x, w, scale, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, w, scale, out = ctx.saved_tensors
        grad_product = grad * scale
        # out = (x @ w^T) r with r = (mean(x^2) + eps)^-1/2: dr/dx = -r^3 x / K, and x @ w^T = out / r
        grad_scale = (grad * out).sum(-1, keepdim=True) / scale
        grad_x = grad_product @ w.float() - (grad_scale * scale.pow(3) / x.shape[-1]) * x.float()
        return grad_x.to(x.dtype), _product_fp32(grad_product.t(), x).to(w.dtype), None


def normed_product(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(streams.flatten(1)) @ fn^T in fp32: the mHC maps' logits."""
    return _NormedProduct.apply(streams.flatten(1), fn, eps)


class HyperConnection(nn.Module):
    """mHC before a sub-block: from the n residual copies, a pre map (folds them into the sub-block's
    input), a post map (spreads its output back) and a Sinkhorn-normalised n x n mixing map. All fp32."""

    def __init__(self, hidden: int, copies: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        n = copies
        self.copies, self.iters, self.hc_eps, self.norm_eps = n, sinkhorn_iters, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams: torch.Tensor):
        """streams [T, n, hidden] -> (post [T, n], mix [T, n, n], the sub-block's input [T, hidden])."""
        n = self.copies
        pre, post, mix = normed_product(streams, self.fn, self.norm_eps).split([n, n, n * n], dim=-1)
        pre_b, post_b, mix_b = self.base.float().split([n, n, n * n])
        scale = self.scale.float()
        pre = torch.sigmoid(pre * scale[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post * scale[1] + post_b)
        mix = torch.softmax(mix.view(-1, n, n) * scale[2] + mix_b.view(n, n), dim=-1) + self.hc_eps
        mix = mix / (mix.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):  # Sinkhorn-Knopp: rows and columns sum to 1
            mix = mix / (mix.sum(dim=-1, keepdim=True) + self.hc_eps)
            mix = mix / (mix.sum(dim=-2, keepdim=True) + self.hc_eps)
        folded = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, mix, folded


def merge_streams(streams, post, mix, out) -> torch.Tensor:
    """New copy k = post[k] * out + sum_j mix[j, k] * copy j: the mixing map applies transposed.

    Written as broadcast products summed over the n copies, in fp32 with one rounding at the end, not as a
    [T] batch of n x n matmuls: compiled, forward and backward are each one fused pass over the streams
    (a batched matmul with n = 4 runs on tiny tiles, far below the memory bandwidth)."""
    mixed = (mix.float().unsqueeze(-1) * streams.float().unsqueeze(-2)).sum(dim=-3)  # [T, n(k), hidden]
    return (post.float().unsqueeze(-1) * out.float().unsqueeze(-2) + mixed).to(streams.dtype)


class HyperHead(nn.Module):
    """Folds the n residual copies back into one before the final norm (sigmoid weights, no mixing)."""

    def __init__(self, hidden: int, copies: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.fn = nn.Parameter(torch.empty(copies, copies * hidden))
        self.base = nn.Parameter(torch.zeros(copies))
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        pre = torch.sigmoid(normed_product(streams, self.fn, self.norm_eps) * self.scale.float()
                            + self.base.float())
        return ((pre + self.hc_eps).unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


# ------------------------------------------------------------------------------------------------ MoE
class SharedExpert(nn.Module):
    def __init__(self, hidden: int, ffn: int, limit: float):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = clamp_gate_up(self.gate_proj(x), self.up_proj(x), self.limit)
        return self.down_proj(F.silu(gate) * up)


class V4MoE(MoE):
    """Routed experts (top-k of sqrt(softplus) scores, chosen with a correction bias that does not weight
    them, or by the token-id hash table on the first layers), normalised and scaled, plus a shared expert.

    Router statistics for the balance loss follow transformers' V4 (softmax top-k of the learned router's
    logits, bias-routed layers only), so the aux loss matches its `aux_loss`."""

    def __init__(self, arch: ModelArch, layer: int):
        m, v4 = arch.moe, arch.v4
        super().__init__(arch.hidden, m.num_experts, m.top_k, m.expert_ffn, True, F.silu, v4.swiglu_limit)
        self.hashed = layer < v4.num_hash_layers
        self.scaling = v4.routed_scaling_factor
        if self.hashed:  # token id -> its experts, from the checkpoint (not derivable)
            self.register_buffer("tid2eid", torch.zeros(arch.vocab, m.top_k, dtype=torch.long))
        else:  # selects experts, never weights them; balanced by updates outside the gradient
            self.register_buffer("correction_bias", torch.zeros(m.num_experts))
        self.shared = SharedExpert(arch.hidden, m.shared_expert_ffn, v4.swiglu_limit)

    def forward(self, x: torch.Tensor, batch: PackedBatch) -> tuple[torch.Tensor, RouterStats | None]:
        logits = F.linear(x.float(), self.router.weight.float())  # [N, E] fp32
        scores = F.softplus(logits).sqrt()
        if self.hashed:
            expert_ids = self.tid2eid[batch.input_ids]
        else:
            biased = scores + self.correction_bias.float()
            expert_ids = biased.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, expert_ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling
        out = self.dispatch(x, expert_ids, weights.to(x.dtype), self.experts, self.num_experts)
        stats = None
        if not self.hashed:
            probs = logits.softmax(dim=-1)
            stats = self.reduce_stats(router_stats(probs, probs.topk(self.top_k, dim=-1).indices,
                                                   self.num_experts, real_rows(self, batch)))
        return out + self.shared(x), stats


# ---------------------------------------------------------------------------------------------- block
class Block(nn.Module):
    def __init__(self, arch: ModelArch, layer: int):
        super().__init__()
        v4 = arch.v4
        hc = (arch.hidden, v4.hc_mult, v4.hc_sinkhorn_iters, v4.hc_eps, arch.rms_norm_eps)
        self.attn_hc, self.mlp_hc = HyperConnection(*hc), HyperConnection(*hc)
        self.attn_norm = RMSNorm(arch.hidden, arch.rms_norm_eps, fp32_weight=True)
        self.attn = Attention(arch, layer)
        self.mlp_norm = RMSNorm(arch.hidden, arch.rms_norm_eps, fp32_weight=True)
        self.mlp = V4MoE(arch, layer)
        self.runner = None

    def set_runner(self, runner) -> None:
        """The seam: `runner(body, x, batch, geo, ropes)` runs the block's body another way (recompute)."""
        self.runner = runner

    def forward(self, x, batch: PackedBatch, geo: Geometry, ropes: dict):
        """x [T, n, hidden] -> (x, router statistics or None, indexer loss)."""
        if self.runner is not None:
            return self.runner(self.body, x, batch, geo, ropes)
        return self.body(x, batch, geo, ropes)

    def body(self, x, batch: PackedBatch, geo: Geometry, ropes: dict):
        post, mix, folded = self.attn_hc(x)
        out, indexer_loss = self.attn(self.attn_norm(folded), geo, ropes, batch)
        x = merge_streams(x, post, mix, out)
        post, mix, folded = self.mlp_hc(x)
        out, stats = self.mlp(self.mlp_norm(folded), batch)
        return merge_streams(x, post, mix, out), stats, indexer_loss


class MTP(nn.Module):
    """Multi-token prediction: at position t, one more block over [its hidden copies ; the embedding of
    token t+1] predicts token t+2 through the shared LM head (DeepSeek-V3 section 2.2)."""

    def __init__(self, arch: ModelArch):
        super().__init__()
        h, v4 = arch.hidden, arch.v4
        self.embed_norm = RMSNorm(h, arch.rms_norm_eps, fp32_weight=True)
        self.hidden_norm = RMSNorm(h, arch.rms_norm_eps, fp32_weight=True)
        self.embed_proj = nn.Linear(h, h, bias=False)
        self.hidden_proj = nn.Linear(h, h, bias=False)
        self.block = Block(arch, arch.num_layers)  # past the last layer: sliding window, bias-routed
        self.head = HyperHead(h, v4.hc_mult, v4.hc_eps, arch.rms_norm_eps)
        self.norm = RMSNorm(h, arch.rms_norm_eps, fp32_weight=True)

    def forward(self, streams, next_embeds, batch, geo, ropes):
        x = self.embed_proj(self.embed_norm(next_embeds)).unsqueeze(1) + self.hidden_proj(
            self.hidden_norm(streams))
        x, stats, _ = self.block(x, batch, geo, ropes)
        return self.norm(self.head(x)), stats


def shift_in_sequence(values: torch.Tensor, batch: PackedBatch, fill: int) -> torch.Tensor:
    """values[t + 1] at t, `fill` at the last token of each sequence."""
    shifted = torch.cat([values[1:], values.new_full((1,), fill)])
    last = batch.cu_seqlens[1:].long().to(values.device) - 1
    return shifted.index_fill(0, last, fill)


# ---------------------------------------------------------------------------------------------- model
class DeepseekV4(CausalLM):
    def __init__(self, arch: ModelArch, layers: Iterable[int] | None = None, mtp_weight: float = 0.0):
        """`layers`: the global layer indices of this pipeline stage (all by default). `mtp_weight` > 0
        builds the MTP block and adds its loss, times the weight, to `aux_loss`."""
        super().__init__()
        self.arch, v4 = arch, arch.v4
        held = sorted(range(arch.num_layers) if layers is None else layers)
        first, last = 0 in held, arch.num_layers - 1 in held
        self.embed = nn.Embedding(arch.vocab, arch.hidden) if first else None
        self.layers = nn.ModuleDict({str(i): Block(arch, i) for i in held})
        self.head = HyperHead(arch.hidden, v4.hc_mult, v4.hc_eps, arch.rms_norm_eps) if last else None
        self.norm = RMSNorm(arch.hidden, arch.rms_norm_eps, fp32_weight=True) if last else None
        self.output = nn.Linear(arch.hidden, arch.vocab, bias=False) if last else None
        self.mtp_weight = mtp_weight
        self.mtp = MTP(arch) if mtp_weight > 0 and last else None
        rope_dim = v4.qk_rope_head_dim
        self.freqs = {"main": inv_freq(rope_dim, arch.rope_theta, None),
                      "compress": inv_freq(rope_dim, v4.compress_rope_theta, v4.compress_rope_scaling)}
        self.device_freqs: dict[torch.device, dict[str, torch.Tensor]] = {}
        self.ratios = sorted({r for r in v4.compress_ratios if r})
        self.geometry_fn = None

    def geometry(self, batch: PackedBatch) -> Geometry:
        """What every layer needs to know about the batch (`set_geometry` replaces it)."""
        if self.geometry_fn is not None:
            return self.geometry_fn(batch)
        return batch_geometry(batch, self.arch.v4.sliding_window, self.ratios)

    def set_geometry(self, geometry_fn) -> None:
        """The seam: `geometry_fn(batch) -> Geometry` (context parallel: this rank's rows, the boundary rows
        before them and the entries of every rank)."""
        self.geometry_fn = geometry_fn

    def set_indexer_loss_weight(self, weight: float) -> None:
        """> 0 trains every CSA indexer with its KL loss; 0 freezes it (requires_grad off, so it carries no
        optimizer state), as in the RL recipes. Its top-k gives it no other gradient."""
        for layer in self.layers.values():
            layer.attn.indexer_loss_weight = weight
            if layer.attn.indexer is not None:
                layer.attn.indexer.requires_grad_(weight > 0)

    def ropes(self, geo: Geometry, dtype: torch.dtype) -> dict:
        device = geo.positions.device
        if device not in self.device_freqs:  # copied once: a host-to-GPU copy each step is a host sync
            self.device_freqs[device] = {kind: freqs.to(device) for kind, freqs in self.freqs.items()}
        freqs = self.device_freqs[device]
        ropes = {kind: rope_angles(geo.positions, kind_freqs, dtype) for kind, kind_freqs in freqs.items()}
        for ratio, windows in geo.compressed.items():
            ropes["entries", ratio] = rope_angles(windows.positions, freqs["compress"], dtype)
        return ropes

    def forward(self, batch: PackedBatch, hidden: torch.Tensor | None = None) -> ModelOutput:
        """Packed batch -> hidden [T, hidden] after the final norm (on the last stage; the residual copies
        [T, n, hidden] on earlier stages, and `hidden` is a later stage's input).

        Under a pipeline with MTP on, the MTP block (last stage) needs the embedding of each next token,
        and the embedding lives on the first stage: the stages carry it as one more copy, [T, n + 1,
        hidden], so its gradient flows back through the pipeline like the residual's (no second embedding
        table to keep in sync)."""
        carry = self.mtp_weight > 0 and (self.embed is None or self.head is None)
        next_embeds = None
        geo = self.geometry(batch)
        if self.embed is not None:
            embeds = self.embed(batch.input_ids)
            x = embeds.unsqueeze(1).expand(-1, self.arch.v4.hc_mult, -1).contiguous()
            if self.mtp_weight > 0:
                next_embeds = self.embed(geo.next_token(batch.input_ids, batch, 0))
        elif hidden is None:
            raise ValueError("this pipeline stage has no embedding: pass the previous stage's hidden states")
        elif carry:
            x, next_embeds = hidden[:, :-1], hidden[:, -1]
        else:
            x = hidden
        ropes = self.ropes(geo, x.dtype)
        stats, own = [], torch.zeros((), device=x.device, dtype=torch.float32)
        for layer in self.layers.values():
            x, layer_stats, indexer_loss = layer(x, batch, geo, ropes)
            own = own + indexer_loss
            if layer_stats is not None:
                stats.append(layer_stats)
        if self.mtp is not None:
            mtp_hidden, mtp_stats = self.mtp(x, next_embeds, batch, geo, ropes)
            own = own + self.mtp_weight * self.mtp_loss(mtp_hidden, batch, geo)
            stats.append(mtp_stats)
        if self.head is not None:
            x = self.norm(self.head(x))
        elif carry:
            x = torch.cat([x, next_embeds.unsqueeze(1)], dim=1)
        aux = own
        if stats:
            moe = self.arch.moe
            aux = aux + load_balancing_loss(stats, moe.num_experts, moe.router_aux_loss_coef)
        return ModelOutput(hidden=x, aux_loss=aux, router_stats=stats, own_loss=own)

    def mtp_loss(self, mtp_hidden: torch.Tensor, batch: PackedBatch, geo: Geometry) -> torch.Tensor:
        """Mean cross-entropy of predicting token t+2 at t, over this micro-batch's MTP targets (under
        context parallel, this rank's share of it)."""
        targets = geo.next_token(batch.labels, batch, IGNORE)
        logits = self.compute_logits(mtp_hidden).float()
        return F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum") / (
            geo.total((targets != IGNORE).sum()).clamp(min=1))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output(hidden)

    def loss_head(self) -> LossHead | None:
        """The MTP loss (`mtp_loss`) applies the head inside the forward too."""
        if self.output is None:
            return None
        return LossHead(self.output, self.embed, read_in_forward=self.mtp is not None)

    # ------------------------------------------------------------------ rollout (no compressed-KV cache)
    def new_kv_cache(self, batch_size: int, max_len: int, dtype: torch.dtype | None = None) -> TokenCache:
        return TokenCache(torch.zeros(batch_size, max_len, dtype=torch.long,
                                      device=next(self.parameters()).device))

    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: TokenCache,
               last_only: bool = False) -> torch.Tensor:
        """As the dense models' decode, by re-running each row's prefix: V4 has no incremental compressed
        KV cache here (rollout at scale is vLLM's job); exact and simple, O(length^2) per sequence."""
        b, t = input_ids.shape
        valid = positions >= 0
        rows = torch.arange(b, device=input_ids.device)[:, None].expand(b, t)
        cache.tokens[rows[valid], positions[valid]] = input_ids[valid]
        lengths = (positions.max(dim=1).values + 1).clamp(min=1)
        seqs = [cache.tokens[i, : int(lengths[i])].tolist() for i in range(b)]
        batch = PackedBatch.from_sequences(seqs)
        batch = PackedBatch(batch.input_ids.to(input_ids.device), batch.position_ids.to(input_ids.device),
                            batch.cu_seqlens.to(input_ids.device), batch.labels.to(input_ids.device),
                            batch.max_seqlen)
        logits = self.compute_logits(self(batch).hidden)  # [T, vocab]
        starts = batch.cu_seqlens[:-1].long()
        index = (starts[:, None] + positions.clamp(min=0)).clamp(max=logits.shape[0] - 1)
        if last_only:
            index = index.gather(1, ((positions >= 0).sum(dim=1, keepdim=True) - 1).clamp(min=0))
        return logits[index]  # [B, t or 1, vocab]

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def init_weights(self, std: float = 0.02, seed_hash: int = 0) -> None:
        """transformers' initialisation (normal matrices, unit norms and mHC scales, zero sinks, biases and
        mHC bases), and a balanced random hash table for a run from scratch (a real one comes from the
        checkpoint)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, (HyperConnection, HyperHead)):
                nn.init.normal_(module.fn, std=std)
                nn.init.zeros_(module.base)
                nn.init.ones_(module.scale)
            elif isinstance(module, Compressor):
                nn.init.zeros_(module.position_bias)
            elif isinstance(module, Attention):
                nn.init.zeros_(module.sinks)
            elif isinstance(module, V4MoE):
                nn.init.normal_(module.experts.gate_up, std=std)
                nn.init.normal_(module.experts.down, std=std)
                if module.hashed:
                    module.tid2eid.copy_(balanced_hash_table(self.arch.vocab, module.num_experts,
                                                             module.top_k, seed_hash))
                else:
                    module.correction_bias.zero_()

    @staticmethod
    def canonical_hf_name(name: str) -> str:
        """DeepSeek's release names for a checkpoint transformers wrote (it keeps a `model.` prefix, its
        own embedding and mHC-head names, and writes the attention's kv_norm as `attn.norm`)."""
        name = name.removeprefix("model.")
        name = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
                "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
                "hc_head.hc_scale": "hc_head_scale"}.get(name, name)
        return re.sub(r"^((?:layers\.\d+|mtp\.\d+)\.attn)\.norm\.weight$", r"\1.kv_norm.weight", name)

    def hf_layout(self) -> list[HFTensors]:
        """Native tensor <-> DeepSeek's official checkpoint names (what transformers 5.23 writes too),
        the hash tables and correction biases included (buffers)."""
        tensors = list(self.named_parameters()) + [(n, b) for n, b in self.named_buffers()
                                                   if n.endswith(("tid2eid", "correction_bias"))]
        return [_official(name, self) for name, _ in tensors]


@dataclass
class TokenCache:
    tokens: torch.Tensor  # [B, max_len] the tokens decoded so far

    @property
    def max_len(self) -> int:
        return self.tokens.shape[1]


def balanced_hash_table(vocab: int, experts: int, top_k: int, seed: int = 0) -> torch.Tensor:
    """[vocab, top_k] distinct experts per token, every expert used equally often (+-1): rows are cut from
    a stream of random permutations of the experts; where a row straddles two permutations, a repeated
    expert is swapped with a later one of the new permutation."""
    gen = torch.Generator().manual_seed(seed)
    stream: list[int] = []
    while len(stream) < vocab * top_k:
        perm = torch.randperm(experts, generator=gen).tolist()
        placed = len(stream) % top_k  # the current row's entries from the previous permutation
        row = set(stream[len(stream) - placed:]) if placed else set()
        for i in range(top_k - placed if placed else 0):
            if perm[i] in row:
                j = next(j for j in range(top_k - placed, experts) if perm[j] not in row)
                perm[i], perm[j] = perm[j], perm[i]
        stream.extend(perm)
    return torch.tensor(stream[: vocab * top_k]).view(vocab, top_k)


# ------------------------------------------------------------------------------------------- HF names
_TOP = {"embed.weight": "embed.weight", "output.weight": "head.weight", "norm.weight": "norm.weight",
        "head.fn": "hc_head_fn", "head.base": "hc_head_base", "head.scale": "hc_head_scale"}
_BLOCK = {  # native suffix inside a block -> official suffix
    "attn_hc.fn": "hc_attn_fn", "attn_hc.base": "hc_attn_base", "attn_hc.scale": "hc_attn_scale",
    "mlp_hc.fn": "hc_ffn_fn", "mlp_hc.base": "hc_ffn_base", "mlp_hc.scale": "hc_ffn_scale",
    "attn_norm.weight": "attn_norm.weight", "mlp_norm.weight": "ffn_norm.weight",
    "attn.q_a_proj.weight": "attn.wq_a.weight", "attn.q_a_norm.weight": "attn.q_norm.weight",
    "attn.q_b_proj.weight": "attn.wq_b.weight", "attn.kv_proj.weight": "attn.wkv.weight",
    "attn.kv_norm.weight": "attn.kv_norm.weight", "attn.o_a_proj.weight": "attn.wo_a.weight",
    "attn.o_b_proj.weight": "attn.wo_b.weight", "attn.sinks": "attn.attn_sink",
    "attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "attn.compressor.position_bias": "attn.compressor.ape",
    "attn.compressor.norm.weight": "attn.compressor.norm.weight",
    "attn.indexer.compressor.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "attn.indexer.compressor.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "attn.indexer.compressor.position_bias": "attn.indexer.compressor.ape",
    "attn.indexer.compressor.norm.weight": "attn.indexer.compressor.norm.weight",
    "attn.indexer.q_proj.weight": "attn.indexer.wq_b.weight",
    "attn.indexer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.router.weight": "ffn.gate.weight", "mlp.correction_bias": "ffn.gate.bias",
    "mlp.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared.down_proj.weight": "ffn.shared_experts.w2.weight",
}
_MTP = {"mtp.embed_norm.weight": "enorm.weight", "mtp.hidden_norm.weight": "hnorm.weight",
        "mtp.embed_proj.weight": "e_proj.weight", "mtp.hidden_proj.weight": "h_proj.weight",
        "mtp.head.fn": "hc_head_fn", "mtp.head.base": "hc_head_base", "mtp.head.scale": "hc_head_scale",
        "mtp.norm.weight": "norm.weight"}


def _official(name: str, model: DeepseekV4) -> HFTensors:
    if name in _TOP:
        return same_tensor(_TOP[name], name)
    if name in _MTP:
        return same_tensor("mtp.0." + _MTP[name], name)
    if name.startswith("mtp.block."):
        prefix, rest, block = "mtp.0.", name[len("mtp.block."):], model.mtp.block
    else:
        _, index, rest = name.split(".", 2)  # layers.{i}.{rest}
        prefix, block = f"layers.{index}.", model.layers[index]
    if rest.startswith("mlp.experts."):
        ids = range(block.mlp.experts.down.shape[0])  # the global shape, also under ep (DTensor)
        if rest == "mlp.experts.gate_up":  # [E, 2F, H] <-> w1 (gate) and w3 (up) per expert
            names = [f"{prefix}ffn.experts.{e}.{w}.weight" for e in ids for w in ("w1", "w3")]
            return HFTensors(
                name, names,
                split=lambda t: [half for expert in t for half in expert.chunk(2, dim=0)],
                join=lambda ts: torch.stack([torch.cat(ts[i: i + 2]) for i in range(0, len(ts), 2)]))
        names = [f"{prefix}ffn.experts.{e}.w2.weight" for e in ids]
        return HFTensors(name, names, split=lambda t: list(t.unbind(0)), join=lambda ts: torch.stack(ts))
    return same_tensor(prefix + _BLOCK[rest], name)
