"""Loop pieces every trainer shares: preemption signals, resume resolution, step timing."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from mlite.errors import MliteError
from mlite.runtime.ckpt.checkpoint import CheckpointManager, resolve_checkpoint, verify_checkpoint

log = logging.getLogger(__name__)

# SIGTERM: Slurm's preemption / scancel / time limit (after --signal's grace); SIGUSR1: `#SBATCH
# --signal=B:USR1@120`, the usual "save now, you will be requeued" request.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Turns SIGTERM/SIGUSR1 into a flag the loop reads at the next step boundary (save, then exit cleanly).

    A handler only sets the flag: saving inside a signal handler could interrupt a half-done optimizer
    step. Use as a context manager; the previous handlers come back on exit."""

    def __init__(self, signals=STOP_SIGNALS):
        self.signals = signals
        self.received: str | None = None
        self._previous = {}

    def __enter__(self) -> StopRequest:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name

    def should_stop(self, device: torch.device | str = "cpu") -> bool:
        """True on every rank when any rank got a signal (ranks must stop at the same step to save together).
        `device`: where the collective's tensor lives (the runtime's device: NCCL needs CUDA tensors)."""
        flag = self.received is not None
        if dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([int(flag)], device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = bool(t.item())
            if flag and self.received is None:
                self.received = "a signal on another rank"
        return flag


def checkpoint_to_resume(resume: str, manager: CheckpointManager) -> Path | None:
    """trainer.resume: `auto` (newest good checkpoint in the output dir, if any), `never`, or a path."""
    if resume == "never":
        if manager.steps():
            raise MliteError(
                f"trainer.resume is never but {manager.root} holds checkpoints of an earlier run; "
                "choose a new trainer.output_dir, delete them, or set trainer.resume=auto "
                "to continue that run"
            )
        return None
    if resume == "auto":
        return manager.latest_good()
    path = resolve_checkpoint(resume)
    verify_checkpoint(path)
    return path


def first_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
