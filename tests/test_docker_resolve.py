"""The image's Python layer resolves: uv, the image's own installer, resolves each stack's pinned wheels for
the image's Python (3.12) and platform (manylinux x86_64 of the base image's glibc), wheels only, against
PyPI as of the stack's date, and must pick exactly the pinned versions. It talks to the package index, so
it is marked `network` (CI runs it).

uv reads wheel metadata with HTTP range requests where the index serves no separate metadata files, so
the run stays at metadata size (no multi-GB torch/vLLM wheel is downloaded); it takes about 15 s.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlite.images.build import resolve_command
from mlite.images.stacks import OVERRIDE_WHEELS, RESOLVED_WHEELS, list_stacks, load_stack

# What a resolver run must land on exactly: the wheels it resolves and the ones it forces (the rest of the
# layer follows from these).
MUST_MATCH = (*RESOLVED_WHEELS, *OVERRIDE_WHEELS)


def uv_binary() -> str:
    found = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    assert found, "uv is not installed; pip install -e '.[dev]'"
    return found


def isolated_env(tmp_path: Path) -> dict[str, str]:
    """No pip or uv settings of this machine (it caps torch and adds local find-links) reach the resolver."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "PIP_"))}
    env.update(
        PIP_CONFIG_FILE=os.devnull, UV_CACHE_DIR=str(tmp_path / "uv-cache"), UV_PYTHON_DOWNLOADS="never"
    )
    return env


def resolved_versions(lock: str) -> dict[str, str]:
    pins = {}
    for line in lock.splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==(\S+)", line)
        if match:
            pins[match.group(1).lower().replace("_", "-")] = match.group(2)
    return pins


def test_resolve_command_is_isolated_and_wheel_only(tmp_path):
    stack = load_stack("2026.11")
    cmd = resolve_command(stack, tmp_path / "r.txt", tmp_path / "o.txt", tmp_path / "out.txt", uv="uv")
    assert cmd[:3] == ["uv", "pip", "compile"] and "--no-config" in cmd and "--no-build" in cmd
    assert cmd[cmd.index("--index-url") + 1] == "https://pypi.org/simple"
    assert cmd[cmd.index("--python-version") + 1] == "3.12"
    assert cmd[cmd.index("--python-platform") + 1] == "x86_64-manylinux_2_39"
    assert cmd[cmd.index("--exclude-newer") + 1] == stack.exclude_newer


@pytest.mark.network
@pytest.mark.parametrize("version", list_stacks())
def test_python_layer_resolves_to_exactly_the_pins(version, tmp_path):
    stack = load_stack(version)
    requirements, overrides, output = (
        tmp_path / "requirements.txt",
        tmp_path / "overrides.txt",
        tmp_path / "lock.txt",
    )
    requirements.write_text("\n".join(stack.python_requirements()) + "\n")
    overrides.write_text("\n".join(stack.python_overrides()) + "\n")
    started = time.monotonic()
    result = subprocess.run(
        resolve_command(stack, requirements, overrides, output, uv=uv_binary()),
        capture_output=True,
        text=True,
        timeout=300,
        env=isolated_env(tmp_path),
    )
    seconds = time.monotonic() - started
    assert result.returncode == 0, f"stack {version} does not resolve:\n{result.stderr[-4000:]}"
    resolved = resolved_versions(output.read_text())
    wrong = {
        name: (resolved.get(name), stack.wheels[name])
        for name in MUST_MATCH
        if resolved.get(name) != stack.wheels[name]
    }
    assert not wrong, f"stack {version}: resolved (got, pin): {wrong}"
    assert len(resolved) > 100  # the whole layer, not just the top
    assert "apex" not in resolved and "deep-ep" not in resolved  # no PyPI impostor pulled in by a dependency
    print(f"stack {version}: {len(resolved)} packages resolved in {seconds:.1f} s")
