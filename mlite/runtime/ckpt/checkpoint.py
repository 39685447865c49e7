"""Training checkpoints: atomic, verified, rotated, and independent of the parallel layout.

One checkpoint is a directory:

    step_00000042/
      tensors/          torch.distributed.checkpoint (DCP): model and optimizer state under the model's
                        parameter names with global shapes, so a run can resume under another layout
      rank_00000.pt     per-rank state that is not a tensor of the model (RNG streams)
      meta.json         global state: step, schedule, data position, the job, extra state
      manifest.json     size and sha256 of every other file, written last

Atomic: everything is written into `step_00000042.partial/`, fsynced, and renamed into place only when
complete, so a crash mid-save never replaces a good checkpoint; the `latest` file is then replaced
atomically. A checkpoint whose files do not match its manifest is refused (and skipped by auto-resume).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from mlite.errors import MliteError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
META = "meta.json"
TENSORS = "tensors"
LATEST = "latest"
PARTIAL = ".partial"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _dcp_quiet():
    """DCP warns on every single-process save/load that it assumes one process: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
        os.fsync(f.fileno())  # the data is on disk before the manifest that vouches for it
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text(path: Path, text: str) -> None:
    """Write a small file atomically: a temp file, fsync, rename over the old one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_json(path: Path, data: Any) -> None:
    _write_text(path, json.dumps(data, indent=1, sort_keys=True))


# -------------------------------------------------------------------------------------- save / load
def save_checkpoint(path: str | Path, tensors: dict[str, Any], rank_state: dict[str, Any],
                    meta: dict[str, Any]) -> Path:
    """Write a checkpoint at `path` atomically. Collective: every rank calls it with its own shards.

    tensors: DCP state (nested dicts of tensors / DTensors); rank_state: this rank's torch-saveable state;
    meta: JSON-able global state (rank 0's copy is kept)."""
    path = Path(path)
    partial = path.with_name(path.name + PARTIAL)
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # the leftovers of a save that crashed
        partial.mkdir(parents=True)
    _barrier()
    with _dcp_quiet():
        dcp.save(tensors, checkpoint_id=str(partial / TENSORS), no_dist=not dist.is_initialized())
    torch.save(rank_state, partial / f"rank_{_rank():05d}.pt")
    _barrier()
    if _rank() == 0:
        _write_json(partial / META, meta)
        files = sorted(p for p in partial.rglob("*") if p.is_file())
        manifest = {str(p.relative_to(partial)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                    for p in files}
        _write_json(partial / MANIFEST, manifest)
        for folder in [partial / TENSORS, partial]:
            _fsync_dir(folder)
        if path.exists():  # re-saving the same step: the new copy is complete, the old one goes
            shutil.rmtree(path)
        os.replace(partial, path)
        _fsync_dir(path.parent)
    _barrier()
    return path


def verify_checkpoint(path: str | Path) -> None:
    """Raise MliteError (one line) unless every file listed in the manifest is there, whole and unchanged."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise MliteError(f"checkpoint {path} is incomplete (no {MANIFEST}): it was never finished; "
                         "delete it or resume from an earlier checkpoint")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except json.JSONDecodeError:
        raise MliteError(f"checkpoint {path} has a corrupt {MANIFEST}; "
                         "delete it or resume from an earlier one") from None
    for name, expected in manifest.items():
        file = path / name
        if not file.is_file():
            raise MliteError(f"checkpoint {path} is missing {name}; "
                             "delete it or resume from an earlier checkpoint")
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise MliteError(f"checkpoint {path} is corrupt: {name} has {size} bytes, the manifest says "
                             f"{expected['bytes']} (truncated copy?); "
                             "delete it or resume from an earlier one")
        if _sha256(file) != expected["sha256"]:
            raise MliteError(f"checkpoint {path} is corrupt: {name} does not match its sha256 in the "
                             "manifest; delete it or resume from an earlier checkpoint")


def read_meta(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / META).read_text())


def load_checkpoint(path: str | Path,
                    tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Verify, then load the tensors in place into `tensors` (same structure as saved, any layout).

    Returns (meta, this rank's state), the latter None when the checkpoint was written by fewer ranks."""
    path = Path(path)
    verify_checkpoint(path)
    try:
        with _dcp_quiet():
            dcp.load(tensors, checkpoint_id=str(path / TENSORS), no_dist=not dist.is_initialized())
    except (RuntimeError, ValueError, CheckpointException) as err:  # DCP names the first tensor it misses
        if isinstance(err, CheckpointException) and err.failures:  # the lowest rank's own error, not DCP's
            cause = err.failures[min(err.failures)][0]
            err = RuntimeError(f"{type(cause).__name__}: {cause}")
        text = str(err).strip()
        first = (text.splitlines()[0] if text else type(err).__name__)[:300]
        raise MliteError(f"checkpoint {path} does not match this job's model and optimizer ({first}); "
                         "resume it with the model and keys it was written with, or start fresh "
                         "(trainer.resume: never)") from None
    rank_file = path / f"rank_{_rank():05d}.pt"
    rank_state = torch.load(rank_file, weights_only=True) if rank_file.is_file() else None
    return read_meta(path), rank_state


# ------------------------------------------------------------------------------ a run's checkpoints
class CheckpointManager:
    """The checkpoints of one run: `{output_dir}/checkpoints/step_N`, a `latest` pointer, keep-last-N."""

    def __init__(self, output_dir: str | Path, keep_last: int = 2):
        self.root = Path(output_dir) / "checkpoints"
        self.keep_last = keep_last

    def path_for(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def steps(self) -> list[int]:
        """Steps of the finished checkpoints (renamed into place), newest first; not yet verified."""
        if not self.root.is_dir():
            return []
        found = [int(m.group(1)) for p in self.root.iterdir()
                 if p.is_dir() and (m := _STEP_DIR.match(p.name))]
        return sorted(found, reverse=True)

    def save(self, step: int, write: Callable[[Path], Path]) -> Path:
        """`write(path)` writes the checkpoint atomically (e.g. Runtime.save_checkpoint); then `latest`
        moves to it and checkpoints beyond the newest keep_last are deleted."""
        path = write(self.path_for(step))
        if _rank() == 0:
            _write_text(self.root / LATEST, path.name + "\n")
            for old in self.steps()[self.keep_last :]:
                shutil.rmtree(self.path_for(old), ignore_errors=True)
        _barrier()
        return path

    def latest_good(self) -> Path | None:
        """The newest checkpoint that verifies; broken ones are skipped with a warning."""
        for step in self.steps():
            path = self.path_for(step)
            try:
                verify_checkpoint(path)
                return path
            except MliteError as err:
                log.warning("skipping a bad checkpoint: %s", err)
        return None


def resolve_checkpoint(where: str | Path) -> Path:
    """A checkpoint directory, or a run's output dir / checkpoints dir (-> its newest good checkpoint)."""
    where = Path(where)
    if (where / MANIFEST).is_file() or (where / TENSORS).is_dir():
        return where
    for root in (where, where.parent):
        manager = CheckpointManager(root)
        if manager.steps():
            found = manager.latest_good()
            if found is None:
                raise MliteError(f"no good checkpoint under {where}: every one failed verification")
            return found
    if (where / "checkpoints").is_dir() or where.name == "checkpoints":
        raise MliteError(f"no checkpoint under {where} yet; train first (mlite sft)")
    raise MliteError(f"{where} is not a checkpoint nor a run directory with checkpoints/step_*; "
                     "check the path")
