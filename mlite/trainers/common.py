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
    step. Use as a context manager (on every rank at once: entering makes a process group); the previous
    handlers come back on exit.

    Ranks agree on the flag every step through a gloo group of their own, over the host: on an NCCL job a
    device all-reduce read back with .item() would make the host wait for the whole step's GPU work, so the
    next step could not be queued behind it."""

    def __init__(self, signals=STOP_SIGNALS):
        self.signals = signals
        self.received: str | None = None
        self._previous = {}
        self._group = None

    def __enter__(self) -> StopRequest:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        if dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None

    def _handle(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name

    def should_stop(self) -> bool:
        """True on every rank when any rank got a signal (ranks stop at the same step, to save together)."""
        flag = self.received is not None
        if self._group is not None:
            t = torch.tensor([int(flag)])
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
            flag = bool(t.item())
            if flag and self.received is None:
                self.received = "a signal on another rank"
        return flag


def checkpoint_to_resume(resume: str, manager: CheckpointManager) -> Path | None:
    """trainer.resume: `auto` (the newest good checkpoint of the run's lineage, if it has any), `never`, or
    a path. The lineage is cut at the checkpoint chosen (`CheckpointManager.resume_from`)."""
    if resume == "never":
        if manager.steps():
            raise MliteError(
                f"trainer.resume is never but {manager.root} holds checkpoints of an earlier run; "
                "choose a new trainer.output_dir, delete them, or set trainer.resume=auto "
                "to continue that run"
            )
        return None
    if resume == "auto":
        path = manager.latest_good()
    else:
        path = resolve_checkpoint(resume)
        verify_checkpoint(path)
    if path is not None:
        manager.resume_from(path)
    return path


def first_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
