"""The one batch format of the runtime: an unpadded packed batch.

All sequences of a micro-batch are concatenated into one token stream of length T. `cu_seqlens` marks the
boundaries (attention never crosses one), `position_ids` restart at 0 in each sequence, and `labels` holds
the *next* token for every position whose prediction is trained (IGNORE elsewhere, including the last token
of each sequence). Per-token RL tensors (advantages, old log-probs, ...) travel in `extras` so that context
parallel splits and pipeline sends move them with the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

IGNORE = -100
# extras key: 1.0 on the tokens appended to fill a parallel split (context / sequence parallel), 0.0 on the
# micro-batch's own; MoE routers leave them out of their balance statistics
PADDING = "padding"


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [T] int64
    position_ids: torch.Tensor  # [T] int64, 0.. within each sequence
    cu_seqlens: torch.Tensor  # [B+1] int32, cumulative sequence lengths, cu_seqlens[0] = 0
    labels: torch.Tensor  # [T] int64, next token or IGNORE
    max_seqlen: int = 0
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # per-token [T, ...] tensors
    # the lengths cu_seqlens marks, as the host knows them (None: read from cu_seqlens, which on a GPU is a
    # host sync); whatever changes cu_seqlens keeps them in step
    host_lens: tuple[int, ...] | None = None

    @classmethod
    def from_sequences(
        cls,
        sequences: Sequence[Sequence[int]],
        loss_masks: Sequence[Sequence[int | bool]] | None = None,
        extras: dict[str, Sequence[Sequence[float]]] | None = None,
    ) -> PackedBatch:
        """Pack token lists. `loss_masks[i][t]` says token t of sequence i is a training target."""
        if not sequences or any(len(s) == 0 for s in sequences):
            raise ValueError("from_sequences needs at least one sequence and no empty sequence")
        ids, pos, labels, lens = [], [], [], []
        for i, seq in enumerate(sequences):
            mask = loss_masks[i] if loss_masks is not None else [1] * len(seq)
            if len(mask) != len(seq):
                raise ValueError(f"sequence {i}: loss mask has {len(mask)} entries for {len(seq)} tokens")
            ids.extend(seq)
            pos.extend(range(len(seq)))
            # position t predicts token t+1; trained when token t+1 is a target
            labels.extend(seq[t + 1] if mask[t + 1] else IGNORE for t in range(len(seq) - 1))
            labels.append(IGNORE)
            lens.append(len(seq))
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
        packed_extras = {
            name: torch.tensor([v for row in rows for v in row], dtype=torch.float32)
            for name, rows in (extras or {}).items()
        }
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.long),
            position_ids=torch.tensor(pos, dtype=torch.long),
            cu_seqlens=cu,
            labels=torch.tensor(labels, dtype=torch.long),
            max_seqlen=max(lens),
            extras=packed_extras,
            host_lens=tuple(lens),
        )

    # ------------------------------------------------------------------ views
    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens.numel() - 1)

    @property
    def seq_lens(self) -> list[int]:
        if self.host_lens is not None:
            return list(self.host_lens)
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    @property
    def num_target_tokens(self) -> int:
        return int(self.target_count())

    def target_count(self) -> torch.Tensor:
        """The number of training targets as a 0-dim tensor on the batch's device (no host read)."""
        return (self.labels != IGNORE).sum()

    def split(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Cut a per-token [T, ...] tensor back into one tensor per sequence."""
        return list(torch.split(tensor, self.seq_lens))

    def padding_mask(self) -> torch.Tensor:
        """[T] bool: True on the tokens that fill a parallel split (extras[PADDING]), none otherwise."""
        padding = self.extras.get(PADDING)
        if padding is None:
            return torch.zeros(self.input_ids.shape[0], dtype=torch.bool, device=self.input_ids.device)
        return padding != 0

    def sequence_ids(self) -> torch.Tensor:
        """[T] index of the sequence each token belongs to."""
        lens = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        return torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens.long())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """The batch on `device`. non_blocking from the host to a GPU goes through pinned memory: the copy
        is queued behind the GPU's work instead of waiting for it to finish (a pageable copy is a host
        sync), so the next step's batch does not stall the host while the last step's update runs."""
        device = torch.device(device)
        pin = non_blocking and device.type == "cuda"

        def move(t: torch.Tensor) -> torch.Tensor:
            if pin and t.device.type == "cpu":
                t = t.pin_memory()
            return t.to(device, non_blocking=non_blocking)

        return replace(
            self,
            input_ids=move(self.input_ids),
            position_ids=move(self.position_ids),
            cu_seqlens=move(self.cu_seqlens),
            labels=move(self.labels),
            extras={k: move(v) for k, v in self.extras.items()},
        )
