"""Training checkpoints: atomic, verified, rotated, and independent of the parallel layout.

One checkpoint is a directory:

    step_00000042/
      tensors/          torch.distributed.checkpoint (DCP): model and optimizer state under the model's
                        parameter names with global shapes, so a run can resume under another layout
      rank_00000.pt     per-rank state that is not a tensor of the model (RNG streams)
      meta.json         global state: step, schedule, data position, the job, extra state
      manifest.json     size and sha256 of every other file, written last

Atomic: everything is written into `step_00000042.partial/`, fsynced, and renamed into place only when
complete, so a crash mid-save never replaces a good checkpoint. A run's checkpoints form its lineage
(`CheckpointManager`): what auto-resume follows and rotation prunes. A checkpoint whose files do not
match its manifest is refused (and skipped by auto-resume).

Verified once per job: rank 0 hashes the files and every rank gets its verdict, and a checkpoint this process
has verified is not read again while its files are unchanged. The manifest catches damage, not tampering
(whoever writes the files writes it too): loading builds only the format's own objects from the files' pickles
(`mlite.runtime.ckpt.safe_load`), so a crafted checkpoint is refused rather than run.
"""

from __future__ import annotations

import contextlib
import errno
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
from mlite.runtime.ckpt.safe_load import TrustedLoadPlanner, TrustedReader

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
META = "meta.json"
TENSORS = "tensors"
LINEAGE = "lineage"
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


# the checkpoints this process has hashed and found whole, with the stat of their files then: resolving a
# resume verifies a checkpoint and loading it verifies it again, and at scale each hash reads terabytes
_verified: dict[Path, tuple] = {}


def verify_checkpoint(path: str | Path) -> None:
    """Raise MliteError (one line) unless every file listed in the manifest is there, whole and unchanged.

    Collective once torch.distributed is initialised (every rank calls it, as every rank loads): rank 0 reads
    the files and the others get its verdict, so a start reads the checkpoint once, not once per rank. A
    checkpoint this process verified before is not read again while its files keep their size and
    modification time."""
    path = Path(path)
    verdict = None
    if _rank() == 0:
        try:
            _check_files(path)
        except MliteError as err:
            verdict = str(err)
        except OSError as err:
            verdict = f"checkpoint {path} cannot be read ({err}); check that it is readable and rerun"
        except Exception:  # a bug: still answer the ranks waiting for the verdict
            _share_verdict(f"checkpoint {path} could not be verified: rank 0 failed (see its log)")
            raise
    verdict = _share_verdict(verdict)
    if verdict is not None:
        raise MliteError(verdict)


def _share_verdict(verdict: str | None) -> str | None:
    """Rank 0's verdict on every rank (the default group: the ranks DCP loads over)."""
    if not dist.is_initialized():
        return verdict
    shared = [verdict]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def _check_files(path: Path) -> None:
    if not (path / MANIFEST).is_file():
        raise MliteError(f"checkpoint {path} is incomplete (no {MANIFEST}): it was never finished; "
                         "delete it or resume from an earlier checkpoint")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        expected = [(name, int(entry["bytes"]), str(entry["sha256"])) for name, entry in manifest.items()]
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, KeyError, TypeError, ValueError):
        raise MliteError(f"checkpoint {path} has a corrupt {MANIFEST}; "
                         "delete it or resume from an earlier one") from None
    # every size before any hash: a missing or truncated file costs a stat, not a read of the rest
    stamps = []
    for name, size, _ in expected:
        file = path / name
        if not file.is_file():
            raise MliteError(f"checkpoint {path} is missing {name}; "
                             "delete it or resume from an earlier checkpoint")
        stat = file.stat()
        if stat.st_size != size:
            raise MliteError(f"checkpoint {path} is corrupt: {name} has {stat.st_size} bytes, the manifest "
                             f"says {size} (truncated copy?); delete it or resume from an earlier one")
        stamps.append((name, stat.st_size, stat.st_mtime_ns))
    own = (path / MANIFEST).stat()  # a checkpoint saved again at the same path has a new manifest
    stamp = (own.st_ino, own.st_size, own.st_mtime_ns, tuple(stamps))
    key = path.resolve()
    if _verified.get(key) == stamp:
        return
    for name, _, digest in expected:
        if _sha256(path / name) != digest:
            raise MliteError(f"checkpoint {path} is corrupt: {name} does not match its sha256 in the "
                             "manifest; delete it or resume from an earlier checkpoint")
    _verified[key] = stamp  # the stat from before the reads: a file changed meanwhile is read again


def read_meta(path: str | Path) -> dict[str, Any]:
    """The checkpoint's meta.json: JSON, so reading it runs nothing from the file."""
    try:
        meta = json.loads((Path(path) / META).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise MliteError(f"checkpoint {path} has an unreadable {META} ({type(err).__name__}); "
                         "delete it or resume from an earlier checkpoint") from None
    if not isinstance(meta, dict):
        raise MliteError(f"checkpoint {path} has a corrupt {META} (not an object); "
                         "delete it or resume from an earlier checkpoint")
    return meta


def load_checkpoint(path: str | Path,
                    tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Verify, then load the tensors in place into `tensors` (same structure as saved, any layout).

    Returns (meta, this rank's state), the latter None when the checkpoint was written by fewer ranks.
    Nothing in the files runs code (`safe_load`): a crafted checkpoint is refused in one line."""
    path = Path(path)
    verify_checkpoint(path)  # a checkpoint the resume's resolution verified is not read again
    reader = TrustedReader(path / TENSORS, path)
    try:
        reader.read_metadata()  # here a refusal is one line; inside DCP it would be logged with a traceback
    except OSError as err:
        raise MliteError(f"checkpoint {path} cannot be read ({err}); delete it or resume from an earlier "
                         "checkpoint") from None
    try:
        with _dcp_quiet():
            dcp.load(tensors, storage_reader=reader, planner=TrustedLoadPlanner(path),
                     no_dist=not dist.is_initialized())
    except (RuntimeError, ValueError, CheckpointException) as err:  # DCP names the first tensor it misses
        if isinstance(err, CheckpointException) and err.failures:  # the lowest rank's own error, not DCP's
            causes = [err.failures[rank][0] for rank in sorted(err.failures)]
            refused = next((cause for cause in causes if isinstance(cause, MliteError)), None)
            if refused is not None:  # an item the trusted planner refused
                raise MliteError(str(refused)) from None
            cause = causes[0]
            err = RuntimeError(f"{type(cause).__name__}: {cause}")
        text = str(err).strip()
        first = (text.splitlines()[0] if text else type(err).__name__)[:300]
        raise MliteError(f"checkpoint {path} does not match this job's model and optimizer ({first}); "
                         "resume it with the model and keys it was written with, or start fresh "
                         "(trainer.resume: never)") from None
    rank_file = path / f"rank_{_rank():05d}.pt"
    rank_state = torch.load(rank_file, weights_only=True) if rank_file.is_file() else None
    return read_meta(path), rank_state


def _disk_full(err: BaseException, folder: Path) -> bool:
    """Whether a failed write ran out of space: ENOSPC somewhere in the error's chain (DCP wraps it), or a
    device left with (almost) nothing free (torch.save's writer reports only that a write failed)."""
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC or "No space left" in str(e):
            return True
        todo += [e.__cause__, e.__context__]
        if isinstance(e, CheckpointException):
            todo += [exc for exc, _ in e.failures.values()]
    try:
        return shutil.disk_usage(folder).free < (1 << 20)
    except OSError:
        return False


# ------------------------------------------------------------------------------ a run's checkpoints
class CheckpointManager:
    """The checkpoints of one run: `{output_dir}/checkpoints/step_N`, rotated keep-last-N along the run's
    lineage.

    The lineage (`checkpoints/lineage`, one checkpoint name a line, oldest first) is the chain of checkpoints
    the run's history goes through: each save appends its name (before the checkpoint is renamed into place,
    so a save that died in between is still found), and a resume cuts it at the checkpoint it resumed from.
    Auto-resume takes the newest entry that verifies; a checkpoint outside the lineage (the steps abandoned
    by a rollback to an earlier checkpoint, a corrupt one skipped on resume) is never resumed from nor
    rotated away: it stays for inspection. Rotation deletes only lineage entries beyond the newest
    `keep_last`, and never the checkpoint this process resumed from nor the newest good one."""

    def __init__(self, output_dir: str | Path, keep_last: int = 2):
        self.root = Path(output_dir) / "checkpoints"
        self.keep_last = keep_last
        self.resumed_from: Path | None = None  # kept by rotation while this process runs

    def path_for(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def steps(self) -> list[int]:
        """Steps of the finished checkpoints (renamed into place), newest first; not yet verified."""
        if not self.root.is_dir():
            return []
        found = [int(m.group(1)) for p in self.root.iterdir()
                 if p.is_dir() and (m := _STEP_DIR.match(p.name))]
        return sorted(found, reverse=True)

    def lineage(self) -> list[str]:
        """The run's checkpoint names, oldest first. A folder from before lineages were kept: its
        checkpoints by step."""
        file = self.root / LINEAGE
        if not file.is_file():
            return [self.path_for(step).name for step in reversed(self.steps())]
        return [name for name in file.read_text().split() if _STEP_DIR.match(name)]

    def _write_lineage(self, names: list[str]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        _write_text(self.root / LINEAGE, "".join(f"{name}\n" for name in names))

    def clean_partials(self) -> list[Path]:
        """Remove the `.partial` folders of saves that died (a crash or a full disk): they are this run's
        own and hold nothing a resume can use. Call at start, before any save. Returns what went."""
        if _rank() != 0 or not self.root.is_dir():
            return []
        stale = [p for p in self.root.iterdir()
                 if p.is_dir() and p.name.endswith(PARTIAL) and _STEP_DIR.match(p.name[: -len(PARTIAL)])]
        for path in stale:
            shutil.rmtree(path)
            log.info("removed %s, the leftover of a save that did not finish", path)
        return stale

    def resume_from(self, path: Path) -> None:
        """The run continues from `path`: the lineage is cut there (a checkpoint of another folder starts a
        new one), and rotation keeps `path` while this process runs."""
        path = self.resumed_from = Path(path)
        names = self.lineage()
        if not self._own(path):
            kept = []
        else:  # an entry of the lineage, or a checkpoint of this folder a rollback had left behind
            kept = names[: names.index(path.name) + 1] if path.name in names else [path.name]
        if _rank() == 0 and self.root.is_dir() and (kept != names or not (self.root / LINEAGE).is_file()):
            self._write_lineage(kept)
        _barrier()

    def _own(self, path: Path) -> bool:
        return self.root.is_dir() and path.parent.resolve() == self.root.resolve()

    def save(self, step: int, write: Callable[[Path], Path]) -> Path:
        """`write(path)` writes the checkpoint atomically (e.g. Runtime.save_checkpoint), with its name on
        the lineage first; then the lineage's entries beyond the newest keep_last are deleted."""
        path = self.path_for(step)
        if _rank() == 0:
            names = [name for name in self.lineage() if name != path.name]
            self._write_lineage([*names, path.name])
        _barrier()
        try:
            write(path)
        except (Exception, CheckpointException) as err:
            # what a failed save left is of no use to a resume; on a full disk it holds the space the next
            # save needs, so it goes now (and a start cleans any a killed process left: clean_partials)
            if _rank() == 0:
                shutil.rmtree(path.with_name(path.name + PARTIAL), ignore_errors=True)
            if _disk_full(err, self.root):
                raise MliteError(f"no space left on the device writing checkpoint {path}; free space under "
                                 f"{self.root} (or lower trainer.keep_last) and rerun: the run resumes from "
                                 f"{self.resumed_from or 'the start'} or the last checkpoint it saved"
                                 ) from None
            raise
        if _rank() == 0:
            self._rotate(path)
        _barrier()
        return path

    def _rotate(self, newest: Path) -> None:
        names = self.lineage()
        keep = set(names[-self.keep_last :]) | {newest.name}
        if self.resumed_from is not None and self._own(self.resumed_from):
            keep.add(self.resumed_from.name)
        for name in names:
            if name not in keep:
                shutil.rmtree(self.root / name, ignore_errors=True)
        self._write_lineage([name for name in names if name in keep])

    def latest_good(self) -> Path | None:
        """The newest checkpoint of the lineage that verifies; broken ones are skipped with a warning. None
        when the run has no checkpoint; MliteError (one line) when it has some and none verifies."""
        names = self.lineage()
        problems = []
        for name in reversed(names):
            path = self.root / name
            if not path.is_dir():  # a save that died before its rename: its name was written first
                continue
            try:
                verify_checkpoint(path)
                return path
            except MliteError as err:
                log.warning("skipping a bad checkpoint: %s", err)
                problems.append(str(err))
        if problems:
            raise MliteError(
                f"every checkpoint of the run in {self.root} failed verification ({len(problems)}; "
                f"the newest: {problems[0]}); resume from a checkpoint you trust with "
                "trainer.resume=PATH, or start fresh in a new trainer.output_dir")
        return None


def resolve_checkpoint(where: str | Path) -> Path:
    """A checkpoint directory, or a run's output dir / checkpoints dir (-> its newest good checkpoint)."""
    where = Path(where)
    if (where / MANIFEST).is_file() or (where / TENSORS).is_dir():
        return where
    for root in (where, where.parent):
        manager = CheckpointManager(root)
        if manager.steps() and (found := manager.latest_good()) is not None:
            return found
    if (where / "checkpoints").is_dir() or where.name == "checkpoints":
        raise MliteError(f"no checkpoint under {where} yet; train first (mlite sft)")
    raise MliteError(f"{where} is not a checkpoint nor a run directory with checkpoints/step_*; "
                     "check the path")
