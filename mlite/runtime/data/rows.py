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
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path} row {i}", row
    elif path.suffix in (".jsonl", ".json"):
        with path.open() as lines:
            for line_no, line in enumerate(lines, 1):
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
    else:
        raise MliteError(f"{path}: {what} files must be .parquet or .jsonl")
