"""Shared parts of the parallel parity tests: a tiny decoder in the runtime's model contract, the loss, the
single-process reference and a launcher for gloo ranks.

The decoder follows the contract `mlite.runtime.parallel.parallelize` is written against (the one the
runtime model code keeps): layers in a ModuleDict keyed by global index, heads reshaped with -1, attention
core swappable (`attn.core`), MoE experts stacked [E, ...] and called through `moe_dispatch_combine`.
It exists so the parallel layer is proven on its own; the same parity runs against
`mlite.runtime.models.build_model` once the family's parallelize plan lands there.
"""

from __future__ import annotations

import math
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from mlite.runtime.data.packed import IGNORE, PackedBatch
from mlite.runtime.parallel.context import masked_attention
from mlite.runtime.parallel.expert import load_balance_loss, moe_dispatch_combine

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, LAYERS = 32, 4, 2, 8, 64, 96, 4
EXPERTS, TOP_K, EXPERT_FFN = 4, 2, 16


def plain_attention(q, k, v, batch: PackedBatch):
    seq = batch.sequence_ids()
    idx = torch.arange(seq.numel())
    return masked_attention(q, k, v, (seq[:, None] == seq[None, :]) & (idx[None, :] <= idx[:, None]))


def rope(x, positions, theta=10000.0):  # x [T, h, d]
    d = x.shape[-1]
    freqs = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions.float()[:, None] * freqs[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.core = plain_attention  # context parallel swaps this

    def forward(self, x, batch):
        t = batch.position_ids.numel()
        q = rope(self.q_proj(x).view(t, -1, HEAD_DIM), batch.position_ids)  # -1: local heads under tp
        k = rope(self.k_proj(x).view(t, -1, HEAD_DIM), batch.position_ids)
        v = self.v_proj(x).view(t, -1, HEAD_DIM)
        return self.o_proj(self.core(q, k, v, batch).reshape(t, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.up_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x, batch):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    def __init__(self, num_experts):
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(num_experts, HIDDEN, 2 * EXPERT_FFN) / math.sqrt(HIDDEN))
        self.down = nn.Parameter(torch.randn(num_experts, EXPERT_FFN, HIDDEN) / math.sqrt(EXPERT_FFN))

    def forward(self, tokens, counts):  # tokens grouped by (local) expert, counts[e] rows each
        outs = []
        for e, rows in enumerate(torch.split(tokens, counts.tolist())):
            gate, up = (rows @ self.gate_up[e]).chunk(2, dim=-1)
            outs.append((F.silu(gate) * up) @ self.down[e])
        return torch.cat(outs)


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = Experts(EXPERTS)
        self.ep_group = None  # expert parallel sets these
        self.token_group = None  # ranks that share this micro-batch's tokens (cp x tp): router statistics

    def forward(self, x, batch):
        probs = F.softmax(self.router(x).float(), dim=-1)
        weights, ids = probs.topk(TOP_K, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = moe_dispatch_combine(x, ids, weights, self.experts, EXPERTS, self.ep_group)
        self.aux_loss = load_balance_loss(probs, ids, EXPERTS, self.token_group)
        return out


class Block(nn.Module):
    def __init__(self, moe: bool):
        super().__init__()
        self.attn_norm = nn.RMSNorm(HIDDEN, eps=1e-6)
        self.attn = Attention()
        self.mlp_norm = nn.RMSNorm(HIDDEN, eps=1e-6)
        self.mlp = MoE() if moe else MLP()

    def forward(self, x, batch):
        x = x + self.attn(self.attn_norm(x), batch)
        return x + self.mlp(self.mlp_norm(x), batch)


class Decoder(nn.Module):
    def __init__(self, moe: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleDict({str(i): Block(moe) for i in range(LAYERS)})
        self.norm = nn.RMSNorm(HIDDEN, eps=1e-6)
        self.output = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, batch: PackedBatch, hidden=None):  # -> hidden [T, HIDDEN], aux loss
        x = self.embed(batch.input_ids) if self.embed is not None else hidden  # pipeline stages after the first
        aux = torch.zeros(())
        for layer in self.layers.values():
            x = layer(x, batch)
            if isinstance(layer.mlp, MoE):
                aux = aux + layer.mlp.aux_loss
        return (self.norm(x) if self.norm is not None else x), aux


def make_model(moe: bool, seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(moe)


def make_batches(n: int, tokens: int = 48, seed: int = 1) -> list[PackedBatch]:
    """n packed micro-batches of `tokens` tokens each, 2-3 sequences of uneven lengths, some ignored labels."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for i in range(n):
        cuts = sorted(torch.randperm(tokens - 2, generator=g)[: 1 + i % 2].add(1).tolist())
        lens = [b - a for a, b in zip([0] + cuts, cuts + [tokens])]
        seqs = [torch.randint(0, VOCAB, (n_,), generator=g).tolist() for n_ in lens]
        masks = [[int(t >= 2) for t in range(len(s))] for s in seqs]  # the first tokens are the "prompt"
        batches.append(PackedBatch.from_sequences(seqs, masks))
    return batches


def total_targets(batches) -> int:
    return sum(b.num_target_tokens for b in batches)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, errors):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def launch(world: int, fn, *args):
    """Run fn(rank, world, *args) on `world` gloo ranks; re-raise the first rank's failure readably."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(_entry, args=(world, free_port(), fn, args, errors), nprocs=world, start_method="spawn")
    except Exception:
        rank, tb = errors.get() if not errors.empty() else (-1, "")
        raise AssertionError(f"rank {rank} failed:\n{tb}") from None


__all__ = ["IGNORE", "Decoder", "make_model", "make_batches", "launch", "total_targets", "plain_attention"]
