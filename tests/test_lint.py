"""ruff passes over the whole repository with the pyproject's settings: the configured line length (E501),
one typing style (UP: `X | None`, collections.abc, no quoted annotations), sorted imports (I) and pyflakes.
ruff comes from the `dev` extra; a missing one is a failure that names the fix, never a skip."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_the_lint_selection_keeps_line_length_and_typing_style():
    ruff = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    assert ruff["line-length"] == 110
    select = ruff["lint"]["select"]
    assert "E501" in select and "UP" in select, select


def test_ruff_passes_over_the_repository():
    assert importlib.util.find_spec("ruff"), "ruff is not installed; pip install -e '.[dev]'"
    # --no-cache: nothing written into the checkout (parallel workers, read-only copies)
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", str(ROOT)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
