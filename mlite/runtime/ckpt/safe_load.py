"""Loading a checkpoint builds only the checkpoint format's own objects: it never runs code from the files.

torch.distributed.checkpoint (DCP) keeps two kinds of pickle besides the tensors: `tensors/.metadata` (what
is stored where) and each non-tensor item (an optimizer's options, counters), and torch reads both with the
full `pickle` (FileSystemReader.read_metadata; DefaultLoadPlanner.load_bytes with weights_only=False). A
pickle can call any importable function, so a checkpoint from elsewhere could run a command on `mlite export`
or a resume, and its sha256 manifest does not help: whoever writes the files writes the manifest.

`TrustedReader` unpickles the metadata with an allow-list of the classes DCP writes there, and checks that it
names data files inside `tensors/` only; `TrustedLoadPlanner` reads the non-tensor items with torch's
weights_only unpickler, as DCP already reads the tensors and mlite the per-rank `rank_*.pt`. Anything else
is refused with one line (`UntrustedCheckpoint`, an MliteError) before any of it is built.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from mlite.errors import MliteError
from mlite.runtime.adapters.pytorch import set_state_element

_METADATA_CLASSES = ("Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata",
                     "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                     "_MEM_FORMAT_ENCODING")
# (module, name) exactly as pickle asks for them: a dotted name under an allowed class (`PosixPath.touch`) is
# another object and is refused
ALLOWED = frozenset(
    [("torch.distributed.checkpoint.metadata", name) for name in _METADATA_CLASSES]
    + [("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
       ("torch", "Size"),
       ("torch.serialization", "_get_layout"),  # how torch.layout pickles: a lookup by name
       ("collections", "OrderedDict"),
       ("builtins", "set"),
       ("builtins", "frozenset")]
    # StorageMeta.checkpoint_id: the path the checkpoint was saved to (pathlib._local from Python 3.13)
    + [(module, name) for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "PurePosixPath")]
)
# torch.float32, torch.strided, ...: plain values that name themselves
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class UntrustedCheckpoint(MliteError):
    """A checkpoint holds something its format never does: it was not written by mlite, or was altered."""

    def __init__(self, checkpoint: str | Path, where: str, what: str):
        super().__init__(
            f"checkpoint {checkpoint} holds a forbidden object ({what}) in {where}; loading it could run "
            "code, so it was not loaded: it was not written by mlite (or was altered since); regenerate it, "
            "or load only checkpoints you trust")

    def __reduce__(self):  # DCP passes a rank's error to the others pickled: the line is what counts
        return MliteError, (str(self),)


class _Forbidden(Exception):
    pass


class _FormatUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                           _TORCH_VALUES)):
            return super().find_class(module, name)
        raise _Forbidden(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Forbidden("a persistent id")


def _plain_name(name: Any) -> bool:
    """A file directly in tensors/: DCP names its data files `__0_0.distcp`."""
    if not isinstance(name, str) or name in ("", ".", ".."):
        return False
    return len(PurePosixPath(name).parts) == 1 and len(PureWindowsPath(name).parts) == 1


class TrustedReader(FileSystemReader):
    """DCP's file reader, unpickling the metadata with the format's classes only (read once, then kept)."""

    def __init__(self, path: str | Path, checkpoint: str | Path):
        super().__init__(str(path))
        self.checkpoint = checkpoint
        self._metadata: dict[Any, Metadata] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id:
            self._metadata.clear()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank not in self._metadata:
            self._metadata[rank] = self._load_metadata(rank)
        metadata = self._metadata[rank]
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as FileSystemReader does
        return metadata

    def _load_metadata(self, rank: int | None) -> Metadata:
        path = Path(self._get_metadata_path(rank))
        where = f"{Path(self.path).name}/{path.name}"
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = _FormatUnpickler(stream).load()
            except _Forbidden as err:
                raise UntrustedCheckpoint(self.checkpoint, where, str(err)) from None
            except Exception as err:  # noqa: BLE001 - whatever a malformed pickle makes the allowed classes raise
                raise MliteError(f"checkpoint {self.checkpoint} has an unreadable {where} "
                                 f"({type(err).__name__}: {err}); regenerate it, or resume from an earlier "
                                 "checkpoint") from None
        if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
            what = f"a {type(metadata).__name__}, not DCP metadata"
            raise UntrustedCheckpoint(self.checkpoint, where, what)
        for info in metadata.storage_data.values():
            name = getattr(info, "relative_path", None)
            if not _plain_name(name):
                raise MliteError(f"checkpoint {self.checkpoint}: {where} points at {name!r}, outside "
                                 f"{Path(self.path).name}/; it was not written by mlite (or was altered "
                                 "since); regenerate it")
        return metadata


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


class TrustedLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor items with torch's weights_only unpickler."""

    def __init__(self, checkpoint: str | Path, **kwargs: Any):
        super().__init__(**kwargs)
        self.checkpoint = checkpoint

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            item = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:  # torch's text: "... unsupported GLOBAL posix.system ..."
            found = _GLOBAL.search(str(err))
            what = found.group(1) if found else "outside torch's weights-only types"
            raise UntrustedCheckpoint(self.checkpoint, f"its non-tensor item {fqn}", what) from None
        # what DefaultLoadPlanner.load_bytes does with the item once read
        if self.flatten_state_dict:
            set_state_element(self.original_state_dict, self.mappings[fqn], item)
        else:
            self.state_dict[fqn] = item
