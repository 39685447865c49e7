"""From a list of tokenised samples to each rank's packed micro-batches, step by step.

Per optimizer step:
1. `GlobalBatchSampler` takes the next `global_batch_size` sample indices from a stream of epochs, each epoch
   a seeded permutation. Steps run across epoch boundaries, so every sample is used exactly once per epoch
   and no step is short. Its state is one integer (samples consumed), so a resumed run, even with another
   number of data-parallel ranks, sees the same global batches from step k on.
2. `plan_step` splits those sequences over the dp ranks, balanced by tokens (greedy longest-first), then
   each rank's share into micro-batches: packed up to `max_tokens` each (dynamic batching) or exactly
   `micro_batch_size` sequences each. Every rank gets the same number of micro-batches (pipeline parallel
   steps them in lockstep): the count is the largest any rank needs, and the others spread their sequences
   over that many. Every rank computes the whole plan, so no communication is needed.
3. `StepBatcher` turns this rank's part of the plan into `PackedBatch`es and returns them with the global
   number of target tokens (the exact normaliser for a token-mean loss over all micro-batches and ranks).
A micro-batch left without a sequence (a rank with fewer sequences than the common count) becomes one pad
token with no target: it adds nothing to the loss and keeps the ranks in lockstep.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from mlite.errors import MliteError
from mlite.runtime.data.packed import PackedBatch

Plan = list[list[list[int]]]  # [dp rank][micro-batch][positions in the step's sequence list]


@dataclass
class Sample:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token is a training target

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_targets(self) -> int:
        return sum(self.loss_mask[1:])  # the first token is never predicted


# --------------------------------------------------------------------------------------------- planning
def balanced_bins(
    lengths: Sequence[int],
    items: Sequence[int],
    n_bins: int,
    max_tokens: int | None = None,
    max_count: int | None = None,
) -> list[list[int]] | None:
    """Greedy longest-first: each item (longest first) goes to the bin with the fewest tokens that still has
    room. Returns bins of items in ascending order, or None when some item fits nowhere."""
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    tokens = [0] * n_bins
    for item in sorted(items, key=lambda i: (-lengths[i], i)):
        open_bins = [
            b
            for b in range(n_bins)
            if (max_count is None or len(bins[b]) < max_count)
            and (max_tokens is None or tokens[b] + lengths[item] <= max_tokens)
        ]
        if not open_bins:
            return None
        best = min(open_bins, key=lambda b: (tokens[b], b))
        bins[best].append(item)
        tokens[best] += lengths[item]
    return [sorted(b) for b in bins]


def _fewest_micro_batches(
    lengths: Sequence[int], items: list[int], max_tokens: int | None, micro_batch_size: int | None
) -> int:
    if max_tokens is None:
        return math.ceil(len(items) / micro_batch_size)
    n = max(1, math.ceil(sum(lengths[i] for i in items) / max_tokens))
    while balanced_bins(lengths, items, n, max_tokens=max_tokens) is None:
        n += 1
    return n


def plan_step(
    lengths: Sequence[int], dp_size: int, max_tokens: int | None = None, micro_batch_size: int | None = None
) -> Plan:
    """Split sequences of these lengths over dp ranks and micro-batches (see the module docstring).

    Give `max_tokens` (dynamic batching: ranks balanced by tokens, micro-batches packed to the budget) or
    `micro_batch_size` (ranks get equal counts, up to one apart, balanced by tokens; micro-batches hold that
    many sequences)."""
    if (max_tokens is None) == (micro_batch_size is None):
        raise ValueError("plan_step needs exactly one of max_tokens and micro_batch_size")
    if max_tokens is not None and any(n > max_tokens for n in lengths):
        raise ValueError(f"a sequence of {max(lengths)} tokens exceeds max_tokens={max_tokens}")
    items = list(range(len(lengths)))
    rank_cap = None if max_tokens is not None else math.ceil(len(items) / dp_size)
    ranks = balanced_bins(lengths, items, dp_size, max_count=rank_cap)
    assert ranks is not None  # no token budget at this level: everything fits
    count = (
        max(_fewest_micro_batches(lengths, r, max_tokens, micro_batch_size) for r in ranks if r)
        if items
        else 1
    )
    while True:  # longest-first into more bins almost never fails where fewer fit; if it does, add one
        plan = [balanced_bins(lengths, r, count, max_tokens, micro_batch_size) for r in ranks]
        if all(p is not None for p in plan):
            return plan
        count += 1


def imbalance(lengths: Sequence[int], plan: Plan) -> float:
    """Most tokens on one rank over the mean per rank (1.0 is perfect balance)."""
    per_rank = [sum(lengths[i] for micro in rank for i in micro) for rank in plan]
    mean = sum(per_rank) / len(per_rank)
    return max(per_rank) / mean if mean else 1.0


# --------------------------------------------------------------------------------------------- sampling
class GlobalBatchSampler:
    """Indices of each step's global batch: a stream of seeded epoch permutations, `batch_size` at a time."""

    def __init__(self, num_samples: int, batch_size: int, seed: int, shuffle: bool = True):
        if num_samples == 0:
            raise MliteError("no training samples to batch; give data.train_files with usable rows")
        self.num_samples, self.batch_size, self.seed, self.shuffle = num_samples, batch_size, seed, shuffle
        self.consumed = 0  # samples taken so far, over all epochs
        self._order: tuple[int, list[int]] = (-1, [])

    def order(self, epoch: int) -> list[int]:
        if self._order[0] != epoch:
            order = list(range(self.num_samples))
            if self.shuffle:
                random.Random(f"mlite-data:{self.seed}:{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    @property
    def epoch(self) -> float:
        return self.consumed / self.num_samples

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.num_samples / self.batch_size)

    def next_indices(self) -> list[int]:
        out = []
        while len(out) < self.batch_size:
            epoch, at = divmod(self.consumed, self.num_samples)
            take = min(self.batch_size - len(out), self.num_samples - at)
            out += self.order(epoch)[at : at + take]
            self.consumed += take
        return out

    def state_dict(self) -> dict:
        return {
            "consumed": self.consumed,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("num_samples", "seed", "shuffle", "batch_size"):
            if state[key] != getattr(self, key):
                raise MliteError(
                    f"the checkpoint's data position was taken with {key}={state[key]}, this run has "
                    f"{getattr(self, key)}; resume with the same data and data settings, "
                    "or trainer.resume=never"
                )
        self.consumed = int(state["consumed"])


# --------------------------------------------------------------------------------------------- batching
class StepBatcher:
    """This rank's micro-batches for each optimizer step (see the module docstring)."""

    def __init__(
        self,
        samples: Sequence[Sample],
        global_batch_size: int,
        *,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        max_tokens: int | None = None,
        micro_batch_size: int | None = None,
        shuffle: bool = True,
        pad_id: int = 0,
    ):
        if micro_batch_size is not None and global_batch_size % (dp_size * micro_batch_size):
            raise MliteError(
                f"data.global_batch_size={global_batch_size} is not a multiple of data-parallel size "
                f"{dp_size} x data.micro_batch_size={micro_batch_size}; change one of them, "
                "or set data.dynamic_batch: true"
            )
        self.samples, self.dp_rank, self.dp_size = samples, dp_rank, dp_size
        self.max_tokens, self.micro_batch_size, self.pad_id = max_tokens, micro_batch_size, pad_id
        self.sampler = GlobalBatchSampler(len(samples), global_batch_size, seed, shuffle)
        self.last_imbalance = 1.0  # of the step returned last; for metrics
        self.last_tokens = 0  # every rank's tokens in the step returned last (the plan knows them all)

    def batches_for(self, indices: Sequence[int]) -> tuple[list[PackedBatch], int]:
        """Plan these samples over the ranks; this rank's micro-batches and the global target-token count."""
        chosen = [self.samples[i] for i in indices]
        lengths = [len(s) for s in chosen]
        plan = plan_step(lengths, self.dp_size, self.max_tokens, self.micro_batch_size)
        self.last_imbalance = imbalance(lengths, plan)
        self.last_tokens = sum(lengths)
        micro_batches = [self._pack([chosen[i] for i in micro]) for micro in plan[self.dp_rank]]
        return micro_batches, sum(s.num_targets for s in chosen)

    def _pack(self, samples: list[Sample]) -> PackedBatch:
        if not samples:
            return PackedBatch.from_sequences([[self.pad_id]], [[0]])
        return PackedBatch.from_sequences([s.input_ids for s in samples], [s.loss_mask for s in samples])

    def next_step(self) -> tuple[list[PackedBatch], int]:
        return self.batches_for(self.sampler.next_indices())

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
