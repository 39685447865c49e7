"""Shared parts of the parallel tests: the tiny models, packed micro-batches and a launcher for gloo ranks."""

from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mlite.config.arch import ModelArch, arch_from_hf_config
from mlite.config.catalog import PRESETS
from mlite.runtime.data.packed import PackedBatch
from mlite.runtime.models import build_model

# the catalog's tiny models, untied (a tied LM head is not split across stages yet) and 4 layers (pp2 x vpp2)
ARCH_OVERRIDES = dict(tie_word_embeddings=False, num_hidden_layers=4, router_aux_loss_coef=0.1)
LAYERS = ARCH_OVERRIDES["num_hidden_layers"]
VOCAB = 256


def tiny_arch(moe: bool) -> ModelArch:
    return arch_from_hf_config(dict(PRESETS["tiny-qwen3-moe" if moe else "tiny-qwen3"], **ARCH_OVERRIDES))


def make_model(moe: bool, seed: int = 0):
    """The runtime's model (mlite.runtime.models), identical weights on every rank for one seed."""
    torch.manual_seed(seed)
    return build_model(tiny_arch(moe), attention_backend="torch")


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


