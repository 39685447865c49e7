"""Invoke tasks: thin wrappers over the `mlite` CLI and the test runner. Logic lives in the package.

    invoke --list          every task
    invoke demo            tiny SFT (+GRPO) run on CPU with generated data
    invoke test            the CPU test suite (what CI runs); --gpu for the GPU suite
"""

from __future__ import annotations

import shlex
import sys

from invoke import task

PY = shlex.quote(sys.executable)


def _mlite(c, *args: str) -> None:
    """Run `mlite ARGS` in this interpreter; its exit status (2 for user errors) becomes ours."""
    cmd = " ".join([PY, "-m", "mlite", *map(shlex.quote, args)])
    result = c.run(cmd, warn=True, pty=False)
    if result.exited:
        sys.exit(result.exited)


def _overrides(set_: list[str] | None) -> list[str]:
    return [f"--set={item}" for item in (set_ or [])]


@task(
    help={
        "gpu": "run the GPU suite (tests marked gpu; fails if no GPU is visible)",
        "k": "pytest -k expression",
        "workers": "parallel pytest workers (default 2)",
        "extra": "extra pytest arguments, quoted",
    }
)
def test(c, gpu=False, k="", workers=2, extra=""):
    """Run the test suite (CPU by default: what CI runs)."""
    args = [PY, "-m", "pytest", "-m", "gpu" if gpu else "not gpu"]
    if workers > 1:
        args += ["-n", str(workers), "--dist", "loadgroup"]
    if k:
        args += ["-k", shlex.quote(k)]
    if extra:
        args += [extra]
    result = c.run(" ".join(args), warn=True, pty=False)
    sys.exit(result.exited)


@task(
    help={
        "config": "job YAML file or packaged preset name",
        "set_": "override key.sub=value (repeatable)",
        "recommend": "enumerate and rank valid layouts instead of checking one",
        "json": "machine-readable output",
    },
    iterable=["set_"],
)
def plan(c, config="", set_=None, recommend=False, json=False):
    """Validate a parallel layout and estimate memory per GPU and per node (no GPU needed)."""
    args = ["plan"] + ([config] if config else []) + _overrides(set_)
    args += ["--recommend"] if recommend else []
    args += ["--json"] if json else []
    _mlite(c, *args)
