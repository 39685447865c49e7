"""ruff passes over the whole repository with the pyproject's settings: the configured line length (E501),
one typing style (UP: `X | None`, collections.abc, no quoted annotations), sorted imports (I) and pyflakes.
ruff comes from the `dev` extra; a missing one is a failure that names the fix, never a skip. And no function
of mlite runs past 60 lines without its reason written directly above it."""

from __future__ import annotations

import ast
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


LONG_FUNCTION = 60  # lines, def line to last line inclusive


def test_no_function_runs_past_60_lines_without_a_reason():
    """Long functions are split where the split names a concept; one that stays long says why in a comment
    on the line directly above its def (or above its first decorator)."""
    offenders = []
    for path in sorted((ROOT / "mlite").rglob("*.py")):
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source, filename=str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            length = node.end_lineno - node.lineno + 1
            if length <= LONG_FUNCTION:
                continue
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            above = lines[first - 2].strip() if first >= 2 else ""
            if not above.startswith("#") or above.lstrip("# ").startswith("-"):  # a reason, not a divider
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    assert not offenders, (
        f"functions over {LONG_FUNCTION} lines with no reason in a comment directly above them (split them, "
        "or say why not):\n" + "\n".join(offenders)
    )
