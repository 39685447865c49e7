"""Image commands: `invoke build/push/pull/shell` print complete, correct docker commands, and without a
Docker engine say so in one line and exit 2 (this machine has the docker client and no engine)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from mlite import __version__
from mlite.images.build import REPO, build_args, build_command, image_tag, labels, shell_command
from mlite.images.stacks import load_stack

INVOKE = [sys.executable, "-m", "invoke"]


def invoke(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*INVOKE, *args], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)


def flag_values(cmd: list[str], flag: str) -> dict[str, str]:
    values = [cmd[i + 1] for i, word in enumerate(cmd[:-1]) if word == flag]
    return dict(v.split("=", 1) for v in values)


def test_tags_say_what_is_inside():
    stack = load_stack("2026.11")
    assert image_tag(stack, "sm90") == f"mlite:{__version__}-stack2026.11-cu130-torch2.11-sm90"
    assert image_tag(stack, "sm100", "dev", image="ghcr.io/org/mlite") == (
        f"ghcr.io/org/mlite:{__version__}-stack2026.11-cu130-torch2.11-sm100-dev"
    )
    assert image_tag(load_stack("2026.08"), "sm90").startswith(f"mlite:{__version__}-stack2026.08-")


def test_build_command_carries_every_pin_as_arg_and_label():
    stack = load_stack("2026.11")
    cmd = build_command(stack, "sm100", "runtime", push=True, cache_ref="ghcr.io/org/mlite:buildcache-sm100")
    assert cmd[:3] == ["docker", "buildx", "build"] and cmd[-1] == "."
    assert flag_values(cmd, "--build-arg") == build_args(stack, "sm100")
    given_labels = flag_values(cmd, "--label")
    assert given_labels == labels(stack, "sm100")
    for name, version in stack.wheels.items():
        assert given_labels[f"org.mlite.pin.{name}"] == version
    for name, pin in stack.git.items():
        assert given_labels[f"org.mlite.pin.{name}"].endswith("@" + pin.commit)
    assert given_labels["org.mlite.torch_cuda_arch_list"] == "10.0;10.3"
    assert "--push" in cmd and "--load" not in cmd
    assert "--cache-from=type=registry,ref=ghcr.io/org/mlite:buildcache-sm100" in cmd
    assert cmd[cmd.index("--target") + 1] == "runtime" and cmd[cmd.index("--file") + 1] == "docker/Dockerfile"


def test_dry_runs_for_both_arches_print_complete_different_commands():
    sm90, sm100 = (
        invoke("build", "--arch", "sm90", "--dry-run"),
        invoke("build", "--arch", "sm100", "--dry-run"),
    )
    assert sm90.returncode == 0 and sm100.returncode == 0, sm90.stderr + sm100.stderr
    cmd90, cmd100 = shlex.split(sm90.stdout.strip()), shlex.split(sm100.stdout.strip())
    stack = load_stack()
    assert flag_values(cmd90, "--build-arg") == build_args(stack, "sm90")
    assert flag_values(cmd100, "--build-arg") == build_args(stack, "sm100")
    assert flag_values(cmd90, "--build-arg")["TORCH_CUDA_ARCH_LIST"] == "9.0;9.0a"
    assert flag_values(cmd100, "--build-arg")["TORCH_CUDA_ARCH_LIST"] == "10.0;10.3"
    assert cmd90[cmd90.index("--tag") + 1].endswith("-sm90") and cmd100[cmd100.index("--tag") + 1].endswith(
        "-sm100"
    )
    assert "--load" in cmd90 and any(w.startswith("--cache-to=type=local") for w in cmd90)
    dev = shlex.split(
        invoke("build", "--arch", "sm90", "--target", "dev", "--stack", "2026.08", "--dry-run").stdout
    )
    assert dev[dev.index("--target") + 1] == "dev" and dev[dev.index("--tag") + 1].endswith(
        "stack2026.08-cu130-torch2.11-sm90-dev"
    )


def test_shell_command_has_the_training_settings():
    cmd = shell_command("mlite:x", REPO)
    text = shlex.join(cmd)
    for part in (
        "--gpus all",
        "--ipc=host",
        "--shm-size=64g",
        "--ulimit memlock=-1",
        "--ulimit stack=67108864",
        f"-v {REPO}:/workspace",
        "-w /workspace",
        "-it",
    ):
        assert part in text, part
    assert cmd[-2:] == ["mlite:x", "bash"]
    assert "-it" not in shell_command("mlite:x", REPO, command="invoke test --gpu", tty=False)
    assert shell_command("mlite:x", REPO, command="invoke test --gpu")[-3:] == ["invoke", "test", "--gpu"]


def test_push_pull_shell_dry_runs_name_the_same_tag():
    tag = image_tag(load_stack(), "sm90", "dev")
    assert (
        invoke("push", "--arch", "sm90", "--target", "dev", "--dry-run").stdout.strip()
        == f"docker push {tag}"
    )
    assert (
        invoke("pull", "--arch", "sm90", "--target", "dev", "--dry-run").stdout.strip()
        == f"docker pull {tag}"
    )
    shell = invoke("shell", "--arch", "sm90", "--dry-run")
    assert shell.returncode == 0 and shlex.split(shell.stdout)[-2:] == [tag, "bash"]


@pytest.mark.parametrize(
    "task",
    [
        ["build", "--arch", "sm90"],
        ["push", "--arch", "sm100"],
        ["pull", "--arch", "sm90"],
        ["shell", "--arch", "sm90"],
    ],
)
def test_without_an_engine_each_task_says_so_in_one_line_and_exits_2(task, tmp_path):
    # the real docker client, pointed at a socket no daemon listens on (the same as this machine's default)
    result = invoke(*task, env={**os.environ, "DOCKER_HOST": f"unix://{tmp_path}/no-daemon.sock"})
    assert result.returncode == 2
    assert result.stdout == ""  # nothing half-started
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no Docker engine" in lines[0] and "--dry-run" in lines[0], result.stderr


def test_bad_arguments_are_one_line_exit_2():
    for args, expected in [
        (["build", "--arch", "sm80", "--dry-run"], "has no arch 'sm80'; choose one of: sm90, sm100"),
        (["build", "--arch", "sm90", "--stack", "1999.01", "--dry-run"], "unknown stack '1999.01'"),
        (["build", "--arch", "sm90", "--target", "debug", "--dry-run"], "unknown target 'debug'"),
    ]:
        result = invoke(*args)
        assert result.returncode == 2 and expected in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
