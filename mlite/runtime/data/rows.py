"""The one row reader of every trainer: rows (dicts) of .jsonl / .json-lines and .parquet data files."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mlite.errors import MliteError


def read_rows(path: Path, malformed: Callable[[str], None], what: str = "data") -> Iterator[tuple[str, dict]]:
    """(where, row) of every row of one file. A row that is not a JSON object goes to `malformed(where and
    why)`, which counts it (SFT's data report) or raises (GRPO's prompts)."""
    if not path.is_file():
        raise MliteError(f"{what} file not found: {path}; fix data.train_files / data.val_files")
    if path.suffix == ".parquet":
        for i, row in enumerate(_parquet_rows(path, what)):
            yield f"{path} row {i}", row
    elif path.suffix in (".jsonl", ".json"):
        yield from _jsonl_rows(path, malformed)
    else:
        raise MliteError(f"{path}: {what} files must be .parquet or .jsonl")


def _parquet_rows(path: Path, what: str) -> list[dict]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except (pyarrow.ArrowException, OSError) as err:
        raise MliteError(f"{path}: not a readable parquet file ({str(err)[:200]}); rewrite it as parquet "
                         f"or give the {what} as .jsonl") from None


def _jsonl_rows(path: Path, malformed: Callable[[str], None]) -> Iterator[tuple[str, dict]]:
    with path.open("rb") as lines:
        for line_no, raw in enumerate(lines, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                # a wrong encoding is the whole file's: skipping such rows would drop every non-ASCII one
                raise MliteError(f"{path}:{line_no}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column "
                                 f"{err.start + 1}); convert the file to UTF-8") from None
            if not line.strip():
                continue
            try:
                row: Any = json.loads(line)
            except json.JSONDecodeError as err:
                malformed(f"{path}:{line_no}: not JSON ({err.msg})")
                continue
            if not isinstance(row, dict):
                malformed(f"{path}:{line_no}: not a JSON object")
                continue
            yield f"{path}:{line_no}", row
