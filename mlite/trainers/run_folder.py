"""A run's output folder: checked, locked for one job at a time, and what a run writes into it.

Two jobs writing one folder would interleave their checkpoints and overwrite each other's metrics, and
both would exit 0. So a run holds an exclusive lock on `{output_dir}/.lock` from before its model is
built to its end:

- rank 0 takes it with `flock(2)` and writes who holds it (host, pid, Slurm job, since when) into the file;
  the kernel drops the lock when the process ends, however it ends (kill -9 included), so a lock never
  outlives its job and nothing has to be cleaned up;
- the verdict goes to every rank over the job's process group: a second job is refused on all its ranks
  at once, in one line naming the holder, before it builds its model;
- a Slurm requeue of the same job (same SLURM_JOB_ID) gets in: the old incarnation's processes are gone,
  and with them their lock. Where its lock outlives it for a while (a dead node's lock on a network
  filesystem, released when its lease ends), the new incarnation waits up to `REQUEUE_WAIT_S` and then
  goes on with a warning, as only its own earlier run holds the folder.

flock works across nodes on Lustre mounted with `flock` and on NFSv4 (where Linux maps it onto POSIX
locks); rank 0 alone takes it, so the job's other nodes need nothing of the filesystem.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from datetime import datetime, timezone
from pathlib import Path

import torch.distributed as dist

from mlite.errors import MliteError

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
REQUEUE_WAIT_S = 120.0
# what a run writes into its output folder (mlite.trainers.demo removes these, and only these, to start over)
RUN_ENTRIES = ("checkpoints", "metrics.jsonl", "metrics.jsonl.tmp", "metrics.superseded.jsonl", "tensorboard",
               "hang", "loss.png", "grpo.png", "vllm_model", LOCK_FILE)


def check_output_dir(path: str | Path) -> Path:
    """The output folder, created if missing; one line if it is a file or cannot be written."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise MliteError(f"trainer.output_dir {out} is a file, not a folder; "
                         "choose another trainer.output_dir")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise MliteError(f"cannot create trainer.output_dir {out} ({err.strerror}); "
                         "choose a folder you can write") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise MliteError(f"trainer.output_dir {out} is not writable by this user; "
                         "choose a folder you can write")
    return out


def _holder_text(holder: dict) -> str:
    if not holder:
        return "another process (it has not said which yet)"
    job = f", Slurm job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}{job}, since {holder.get('since')}"


class RunLock:
    """The exclusive lock of one output folder, for one job (see the module's docstring).

        lock = RunLock(output_dir)
        lock.acquire()      # every rank, once the process group is up (Runtime's on_placed)
        ...
        lock.release()      # or the process ends
    """

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock on rank 0 and tell every rank; MliteError (one line) on every rank if another job
        holds it."""
        error = None
        if not dist.is_initialized() or dist.get_rank() == 0:
            try:
                self._take()
            except MliteError as err:
                error = str(err)
        if dist.is_initialized() and dist.get_world_size() > 1:
            verdict = [error]
            dist.broadcast_object_list(verdict, src=0)
            error = verdict[0]
        if error:
            raise MliteError(error)

    def _take(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise MliteError(f"cannot create the run's lock file {self.path} ({err.strerror}); "
                             "choose a trainer.output_dir you can write") from None
        ours = os.environ.get("SLURM_JOB_ID", "")
        waited_until = time.monotonic() + REQUEUE_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise MliteError(f"cannot lock {self.path} ({err.strerror}); the filesystem may not "
                                     "support flock (Lustre: mount with -o flock)") from None
            holder = self.holder()
            if not (ours and holder.get("slurm_job") == ours):
                os.close(fd)
                raise MliteError(f"trainer.output_dir {self.path.parent} is in use by another run "
                                 f"({_holder_text(holder)}); wait for it to end, stop it, or choose another "
                                 "trainer.output_dir")
            if time.monotonic() > waited_until:  # our own earlier incarnation's lock (see the docstring)
                log.warning("the lock of %s is still held by an earlier run of this Slurm job (%s); "
                            "going on: a requeued job owns its folder", self.path.parent,
                            _holder_text(holder))
                break
            time.sleep(1.0)
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job": ours,
                  "since": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def holder(self) -> dict:
        """Who holds the lock, as its holder wrote it ({} when unknown)."""
        try:
            holder = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}
        return holder if isinstance(holder, dict) else {}

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (removing it would race a taker)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# ------------------------------------------------------------------------------------- the demo's folders
DEMO_MARK = ".mlite-demo"  # in every folder `mlite demo` made: what it may clear on its next run


def claim_for_demo(folder: str | Path, entries: tuple[str, ...]) -> Path:
    """Make `folder` the demo's to write: a new or empty folder is marked as the demo's; one the demo marked
    before loses the `entries` it wrote there (the demo starts over), and nothing else. Any other folder
    with something in it is refused in one line: the demo deletes only what it made."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise MliteError(f"{folder} is a file; the demo needs a folder: choose another --out or "
                         "trainer.output_dir")
    present = set(os.listdir(folder)) if folder.is_dir() else set()
    if present and DEMO_MARK not in present:
        raise MliteError(f"{folder} is not empty and was not made by `mlite demo`, which writes only into a "
                         "new or empty folder or one of its own; choose another --out or trainer.output_dir")
    for name in sorted(present & set(entries)):
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    check_output_dir(folder)
    (folder / DEMO_MARK).write_text("made by `mlite demo`, which clears what it wrote here on each run\n")
    return folder
