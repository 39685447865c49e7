"""What loading a checkpoint trusts: no code from its pickles, and its files hashed once per job.

A crafted checkpoint is written the way an attacker would: a pickle that calls a function, placed where DCP
unpickles (`tensors/.metadata`, or a non-tensor item in a .distcp file), and a manifest rewritten to match.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_checkpoint import distcp_file, make_job, one_thread, save_runtime, train_steps  # noqa: F401

from mlite.errors import MliteError
from mlite.runtime.ckpt import checkpoint as ckpt
from mlite.runtime.ckpt.checkpoint import CheckpointManager
from mlite.runtime.engine import Runtime

ROOT = Path(__file__).resolve().parents[1]


class RunsCommand:
    """Unpickling this runs a shell command, as a crafted checkpoint's pickle would."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def rewrite_manifest(path: Path) -> None:
    """What whoever writes a checkpoint can do: make the manifest vouch for the files as they are now."""
    manifest = {}
    for name in json.loads((path / ckpt.MANIFEST).read_text()):
        data = (path / name).read_bytes()
        manifest[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))


def write_checkpoint(path: Path) -> Path:
    rt = Runtime(make_job())
    train_steps(rt, range(1))
    return rt.save_checkpoint(path, extra_state={"step": 1})


def plant_metadata(path: Path, payload: bytes) -> None:
    (path / ckpt.TENSORS / ".metadata").write_bytes(payload)
    rewrite_manifest(path)
    ckpt.verify_checkpoint(path)  # the manifest no longer tells


def plant_item(path: Path, fqn: str, payload) -> None:
    """Store `payload` (torch.save'd, as DCP stores non-tensor items) as the item `fqn` of the checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = distcp_file(path)
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(buffer.getvalue())
    metadata = FileSystemReader(str(path / ckpt.TENSORS)).read_metadata()  # this test's own, genuine file
    metadata.state_dict_metadata[fqn] = BytesStorageMetadata()
    metadata.storage_data[MetadataIndex(fqn)] = _StorageInfo(data.name, offset, len(buffer.getvalue()))
    plant_metadata(path, pickle.dumps(metadata))


def mlite_export(checkpoint: Path, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "mlite", "export", str(checkpoint), "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def assert_refused_in_one_line(result: subprocess.CompletedProcess, forbidden: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert "forbidden object" in result.stderr and forbidden in result.stderr, result.stderr
    assert "regenerate" in result.stderr


# ------------------------------------------------------------------------------------- no code is run
def test_export_refuses_metadata_that_would_run_a_command(tmp_path):
    path = write_checkpoint(tmp_path / "ck")
    marker = tmp_path / "PWNED"
    plant_metadata(path, pickle.dumps(RunsCommand(f"touch {marker}")))

    result = mlite_export(path, tmp_path / "hf")
    assert not marker.exists(), "loading the checkpoint ran its command"
    assert_refused_in_one_line(result, f"{os.system.__module__}.system")
    assert str(path) in result.stderr and "tensors/.metadata" in result.stderr


def test_export_refuses_a_non_tensor_item_that_would_run_a_command(tmp_path):
    """DCP reads non-tensor items with torch.load; a model tensor relabelled as one reaches export too."""
    path = write_checkpoint(tmp_path / "ck")
    marker = tmp_path / "PWNED"
    plant_item(path, "model.embed.weight", RunsCommand(f"touch {marker}"))

    result = mlite_export(path, tmp_path / "hf")
    assert not marker.exists(), "loading the checkpoint ran its command"
    assert_refused_in_one_line(result, f"{os.system.__module__}.system")
    assert "model.embed.weight" in result.stderr


def test_resume_refuses_an_optimizer_option_that_would_run_a_command(tmp_path):
    path = write_checkpoint(tmp_path / "ck")
    marker = tmp_path / "PWNED"
    plant_item(path, "optimizer.param_groups.0.lr", RunsCommand(f"touch {marker}"))

    with pytest.raises(MliteError, match=r"forbidden object .*system") as err:
        Runtime(make_job()).load_checkpoint(path)
    assert not marker.exists()
    assert str(path) in str(err.value) and "optimizer.param_groups.0.lr" in str(err.value)


def test_a_function_reached_through_an_allowed_class_is_refused(tmp_path):
    """pickle resolves dotted names (protocol 4): `pathlib PosixPath.touch` is a method, not the class the
    format pickles (`pathlib PosixPath`, a StorageMeta's checkpoint_id)."""
    path = write_checkpoint(tmp_path / "ck")
    marker = str(tmp_path / "PWNED").encode()

    def text(s: bytes) -> bytes:  # BINUNICODE
        return b"X" + struct.pack("<I", len(s)) + s

    payload = (b"\x80\x04"  # PosixPath.touch(PosixPath(marker)), by hand: pickle itself writes `Path.touch`
               + text(b"pathlib") + text(b"PosixPath.touch") + b"\x93"  # STACK_GLOBAL
               + text(b"pathlib") + text(b"PosixPath") + b"\x93" + text(marker) + b"\x85R"  # TUPLE1 REDUCE
               + b"\x85R.")
    plant_metadata(path, payload)

    with pytest.raises(MliteError, match=r"forbidden object \(pathlib\.PosixPath\.touch\)"):
        Runtime(make_job()).load_checkpoint(path)
    assert not os.path.exists(marker)


def test_metadata_may_only_point_inside_the_checkpoint(tmp_path):
    """A data file named `../..` would read any file on the machine into the model."""
    from torch.distributed.checkpoint import FileSystemReader

    path = write_checkpoint(tmp_path / "ck")
    metadata = FileSystemReader(str(path / ckpt.TENSORS)).read_metadata()
    for info in metadata.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    plant_metadata(path, pickle.dumps(metadata))

    with pytest.raises(MliteError, match=r"outside .*tensors.*regenerate"):
        Runtime(make_job()).load_checkpoint(path)


def test_every_object_a_real_checkpoint_holds_is_admitted(tmp_path):
    """The allow-list covers what DCP writes: dtypes, shapes, chunks, paths, and non-tensor items of the
    types optimizers keep (numbers, tuples, None, flags, names)."""
    state = {"model": {"w": torch.randn(3, 4), "h": torch.ones(2, dtype=torch.bfloat16),
                       "i": torch.arange(5), "f8": torch.zeros(4, dtype=torch.float8_e4m3fn)},
             "extra": {"lr": 0.5, "betas": (0.9, 0.95), "none": None, "on": True, "names": ["a", "b"],
                       "n": 7}}
    ckpt.save_checkpoint(tmp_path / "ck", state, {"rng": torch.get_rng_state()}, {"step": 1})
    into = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()},
            "extra": {k: 0 for k in state["extra"]}}
    meta, rank_state = ckpt.load_checkpoint(tmp_path / "ck", into)
    assert meta == {"step": 1} and torch.equal(rank_state["rng"], torch.get_rng_state())
    for k, v in state["model"].items():
        assert into["model"][k].dtype == v.dtype and torch.equal(into["model"][k].float(), v.float()), k
    assert into["extra"] == state["extra"]

    # and a training run's checkpoint (DCP's own reader agrees on what it holds)
    from torch.distributed.checkpoint import FileSystemReader

    from mlite.runtime.ckpt.safe_load import TrustedReader

    for model in ("tiny-qwen3", "tiny-qwen3-moe"):
        rt = Runtime(make_job(model))
        train_steps(rt, range(1))
        path = rt.save_checkpoint(tmp_path / model)
        ours = TrustedReader(path / ckpt.TENSORS, path).read_metadata()
        theirs = FileSystemReader(str(path / ckpt.TENSORS)).read_metadata()
        assert ours.state_dict_metadata == theirs.state_dict_metadata
        assert ours.storage_data == theirs.storage_data and ours.planner_data == theirs.planner_data
        assert Runtime(make_job(model)).load_checkpoint(path) == {}


# ------------------------------------------------------------------------------- hashed once per job
def count_hashes(monkeypatch) -> Counter:
    counts: Counter = Counter()
    real = ckpt._sha256

    def counting(path, *args, **kwargs):
        counts[Path(path).resolve()] += 1
        return real(path, *args, **kwargs)

    monkeypatch.setattr(ckpt, "_sha256", counting)
    return counts


def test_a_resume_and_an_export_hash_each_file_once(tmp_path, monkeypatch):
    from mlite.runtime.engine import export_checkpoint
    from mlite.trainers.common import checkpoint_to_resume

    rt = Runtime(make_job())
    manager = CheckpointManager(tmp_path, keep_last=3)
    for step in (2, 4):
        manager.save(step, save_runtime(rt, {"step": step}))
    newest = manager.path_for(4)
    files = {(newest / name).resolve() for name in json.loads((newest / ckpt.MANIFEST).read_text())}

    counts = count_hashes(monkeypatch)
    found = checkpoint_to_resume("auto", manager)  # the trainer's own sequence: resolve, then load
    assert found == newest
    assert Runtime(make_job()).load_checkpoint(found) == {"step": 4}
    assert checkpoint_to_resume(str(newest), manager) == newest  # a path given to trainer.resume
    export_checkpoint(tmp_path, tmp_path / "hf")  # resolve, verify, read meta, load
    assert set(counts) == files and set(counts.values()) == {1}


def test_a_checkpoint_changed_after_it_was_verified_is_verified_again(tmp_path):
    path = write_checkpoint(tmp_path / "ck")
    ckpt.verify_checkpoint(path)
    data = distcp_file(path)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size; a new modification time (set, not left to the clock)
    stat = data.stat()
    data.write_bytes(bytes(raw))
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    with pytest.raises(MliteError, match="does not match its sha256"):
        ckpt.verify_checkpoint(path)

    # a checkpoint saved again at the same path is a new one
    rt = Runtime(make_job())
    rt.save_checkpoint(path, {"again": True})
    ckpt.verify_checkpoint(path)
    os.truncate(distcp_file(path), 10)
    with pytest.raises(MliteError, match="corrupt"):
        Runtime(make_job()).load_checkpoint(path)


def _two_ranks_resume(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist

    from mlite.trainers.common import checkpoint_to_resume

    root = Path(root)
    state = {"model": {"w": torch.arange(8.0)}, "step": 3}
    manager = CheckpointManager(root, keep_last=3)
    for step in (2, 4):
        manager.save(step, lambda p: ckpt.save_checkpoint(p, state, {"rank": rank}, {"step": step}))
    if rank == 0:
        os.truncate(distcp_file(manager.path_for(4)), 10)  # the newest is corrupt
    dist.barrier()

    counts: Counter = Counter()
    real = ckpt._sha256

    def counting(path, *args, **kwargs):
        counts[str(Path(path).relative_to(root))] += 1
        return real(path, *args, **kwargs)

    ckpt._sha256 = counting
    try:
        found = checkpoint_to_resume("auto", manager)  # every rank, as the trainer does
        into = {"model": {"w": torch.zeros(8)}, "step": 0}
        meta, rank_state = ckpt.load_checkpoint(found, into)
        with pytest.raises(MliteError) as err:
            checkpoint_to_resume(str(manager.path_for(4)), manager)  # the corrupt one, by its path
    finally:
        ckpt._sha256 = real
    assert found == manager.path_for(2) and meta == {"step": 2} and rank_state == {"rank": rank}
    assert torch.equal(into["model"]["w"], torch.arange(8.0)) and into["step"] == 3
    message = str(err.value)
    assert "\n" not in message and "step_00000004" in message and "corrupt" in message

    every = [None] * world
    dist.all_gather_object(every, (dict(counts), message))
    hashed, messages = [c for c, _ in every], {m for _, m in every}
    assert len(messages) == 1  # the same line on every rank
    assert hashed[1:] == [{}] * (world - 1), hashed  # only rank 0 reads the files
    good = json.loads((manager.path_for(2) / ckpt.MANIFEST).read_text())
    # step 2's files once each; none of step 4's: its truncated file shows in its size, before any read
    assert hashed[0] == {f"checkpoints/step_00000002/{name}": 1 for name in good}, hashed


def test_ranks_resume_with_one_hash_of_each_file(tmp_path):
    from parallel_harness import launch

    launch(2, _two_ranks_resume, str(tmp_path))
