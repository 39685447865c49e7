"""Docker commands for mlite images: build, push, pull, shell. `tasks.py` calls these; they are tested here.

Every command is built as an argument list from a stack (`mlite.images.stacks`), printed exactly as it
runs, and run only when a Docker engine answers `docker info`. `dry_run` prints and needs no engine. A
missing engine is a user problem: one line, exit 2.

Config layer: no torch.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from mlite import __version__
from mlite.errors import MliteError
from mlite.images.stacks import Stack, load_stack

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = Path("docker") / "Dockerfile"
TARGETS = ("runtime", "dev")
IMAGE_ENV = "MLITE_IMAGE"  # repository the tags go to, e.g. ghcr.io/org/mlite
DEFAULT_IMAGE = "mlite"
LABEL_PREFIX = "org.mlite"
# `docker run` settings a training shell needs: all GPUs, the host's IPC namespace and a large /dev/shm
# (NCCL and data-loader workers share memory), no locked-memory limit (RDMA registration) and a 64 MiB
# stack (deep recursion in compiled kernels' host code).
SHELL_SHM_SIZE = "64g"
STACK_LIMIT_BYTES = 64 * 1024 * 1024


def image_tag(stack: Stack, arch: str, target: str = "runtime", image: str | None = None) -> str:
    """mlite:0.1.0-stack2026.11-cu130-torch2.11-sm90 (+ -dev for the dev target): what is inside."""
    stack.arch(arch)
    if target not in TARGETS:
        raise MliteError(f"unknown target '{target}'; choose one of: {', '.join(TARGETS)}")
    repository = image or os.environ.get(IMAGE_ENV) or DEFAULT_IMAGE
    suffix = "-dev" if target == "dev" else ""
    inside = f"{__version__}-stack{stack.version}-{stack.cuda_tag}-torch{stack.torch_short}-{arch}{suffix}"
    return f"{repository}:{inside}"


def arg_name(component: str, field: str) -> str:
    """megatron-core + VERSION -> MEGATRON_CORE_VERSION: the Dockerfile ARG that carries one pin."""
    return f"{component.upper().replace('-', '_')}_{field}"


def build_args(stack: Stack, arch: str) -> dict[str, str]:
    """Every pin of the stack (and the arch's lists) as the Dockerfile's ARGs."""
    pins = stack.arch(arch)
    args = {
        "BASE_IMAGE": stack.base_ref,
        "PYTHON_VERSION": stack.python,
        "STACK_VERSION": stack.version,
        "IMAGE_ARCH": arch,
        "TORCH_CUDA_ARCH_LIST": pins.torch_cuda_arch_list,
        "NVTE_CUDA_ARCHS": pins.nvte_cuda_archs,
        "FLASH_ATTN_CUDA_ARCHS": pins.flash_attn_cuda_archs,
        "MAX_JOBS": str(stack.max_jobs),
        "NVTE_BUILD_THREADS_PER_JOB": str(stack.nvte_build_threads_per_job),
        "MLITE_VERSION": __version__,
        "UV_EXCLUDE_NEWER": stack.exclude_newer,
    }
    for name, version in stack.wheels.items():
        args[arg_name(name, "VERSION")] = version
    for name, pin in stack.git.items():
        args[arg_name(name, "URL")] = pin.url
        args[arg_name(name, "COMMIT")] = pin.commit
    return args


def labels(stack: Stack, arch: str) -> dict[str, str]:
    """OCI labels: the standard ones plus one per pin, so `docker inspect` tells what an image holds."""
    pins = stack.arch(arch)
    out = {
        "org.opencontainers.image.title": "mlite",
        "org.opencontainers.image.version": __version__,
        "org.opencontainers.image.base.name": stack.base_image,
        f"{LABEL_PREFIX}.stack": stack.version,
        f"{LABEL_PREFIX}.arch": arch,
        f"{LABEL_PREFIX}.cuda": stack.cuda,
        f"{LABEL_PREFIX}.python": stack.python,
        f"{LABEL_PREFIX}.exclude_newer": stack.exclude_newer,
        f"{LABEL_PREFIX}.torch_cuda_arch_list": pins.torch_cuda_arch_list,
        f"{LABEL_PREFIX}.nvte_cuda_archs": pins.nvte_cuda_archs,
        f"{LABEL_PREFIX}.flash_attn_cuda_archs": pins.flash_attn_cuda_archs,
    }
    if stack.base_digest:
        out["org.opencontainers.image.base.digest"] = stack.base_digest
    for name, version in stack.wheels.items():
        out[f"{LABEL_PREFIX}.pin.{name}"] = version
    for name, pin in stack.git.items():
        out[f"{LABEL_PREFIX}.pin.{name}"] = f"{pin.url}@{pin.commit}"
    return out


def build_command(
    stack: Stack,
    arch: str,
    target: str = "runtime",
    push: bool = False,
    image: str | None = None,
    cache_ref: str | None = None,
) -> list[str]:
    """`docker buildx build` for one arch and target, with a build cache (registry ref, else local)."""
    tag = image_tag(stack, arch, target, image)
    if cache_ref:
        cache = [
            f"--cache-from=type=registry,ref={cache_ref}",
            f"--cache-to=type=registry,ref={cache_ref},mode=max",
        ]
    else:
        folder = (
            Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
            / "mlite-buildx"
            / f"{stack.version}-{arch}"
        )
        cache = [f"--cache-from=type=local,src={folder}", f"--cache-to=type=local,dest={folder},mode=max"]
    cmd = [
        "docker",
        "buildx",
        "build",
        "--file",
        str(DOCKERFILE),
        "--target",
        target,
        "--platform",
        "linux/amd64",
    ]
    for key, value in build_args(stack, arch).items():
        cmd += ["--build-arg", f"{key}={value}"]
    for key, value in labels(stack, arch).items():
        cmd += ["--label", f"{key}={value}"]
    cmd += cache + ["--tag", tag, "--push" if push else "--load", "."]
    return cmd


def registry_command(verb: str, tag: str) -> list[str]:
    """`docker push TAG` or `docker pull TAG`."""
    return ["docker", verb, tag]


def shell_command(tag: str, repo: Path = REPO, command: str = "bash", tty: bool = True) -> list[str]:
    """A shell (or `command`) on all GPUs with the repository mounted at /workspace; tty=False for CI."""
    return [
        "docker",
        "run",
        "--rm",
        *(["-it"] if tty else []),
        "--gpus",
        "all",
        "--ipc=host",
        f"--shm-size={SHELL_SHM_SIZE}",
        "--ulimit",
        "memlock=-1",
        "--ulimit",
        f"stack={STACK_LIMIT_BYTES}",
        "-v",
        f"{repo.resolve()}:/workspace",
        "-w",
        "/workspace",
        tag,
        *shlex.split(command),
    ]


def engine_problem() -> str | None:
    """None when a Docker engine answers; else why not (no client, or `docker info` fails)."""
    if shutil.which("docker") is None:
        return "the docker client is not installed"
    try:
        result = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True, timeout=20
        )
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer within 20 s"
    if result.returncode != 0 or not result.stdout.strip():
        reason = (result.stderr.strip().splitlines() or ["no server version"])[-1]
        return f"`docker info` failed ({reason})"
    return None


def execute(cmd: list[str], dry_run: bool = False) -> int:
    """Print the exact command and run it; dry_run only prints. Without an engine: MliteError (exit 2)."""
    problem = None if dry_run else engine_problem()
    if problem:
        raise MliteError(
            f"no Docker engine: {problem}; start the Docker daemon (or run on a machine with one), "
            "or add --dry-run to print the command only"
        )
    print(shlex.join(cmd), flush=True)
    return 0 if dry_run else subprocess.run(cmd, cwd=REPO).returncode


def build(
    arch: str,
    stack: str | None = None,
    target: str = "runtime",
    push: bool = False,
    dry_run: bool = False,
    image: str | None = None,
    cache_ref: str | None = None,
) -> int:
    return execute(build_command(load_stack(stack), arch, target, push, image, cache_ref), dry_run)


def transfer(
    verb: str,
    arch: str,
    stack: str | None = None,
    target: str = "runtime",
    dry_run: bool = False,
    image: str | None = None,
) -> int:
    """`docker push` or `docker pull` (the verb) of the image tagged for this arch, stack and target."""
    return execute(registry_command(verb, image_tag(load_stack(stack), arch, target, image)), dry_run)


def shell(
    arch: str,
    stack: str | None = None,
    target: str = "dev",
    dry_run: bool = False,
    image: str | None = None,
    command: str = "bash",
    tty: bool = True,
) -> int:
    tag = image_tag(load_stack(stack), arch, target, image)
    return execute(shell_command(tag, command=command, tty=tty), dry_run)


def main(action: str, **kwargs) -> int:
    """Run one action (build/push/pull/shell); a user error prints one line and returns 2."""
    actions = {
        "build": build,
        "push": functools.partial(transfer, "push"),
        "pull": functools.partial(transfer, "pull"),
        "shell": shell,
    }
    try:
        return actions[action](**kwargs)
    except MliteError as err:
        print(f"mlite {action}: error: {err}", file=sys.stderr)
        return 2


PYPI = "https://pypi.org/simple"


def resolve_command(
    stack: Stack, requirements: Path, overrides: Path, output: Path, uv: str = "uv"
) -> list[str]:
    """`uv pip compile` of the image's Python layer for the image's Python and platform, wheels only, with
    the image's NCCL override and index date. Reads no local pip/uv config (a machine's constraints or
    find-links must not change what the image resolves to)."""
    return [
        uv,
        "pip",
        "compile",
        "--no-config",
        "--index-url",
        PYPI,
        "--python-version",
        stack.python,
        "--python-platform",
        stack.python_platform,
        "--no-build",
        "--exclude-newer",
        stack.exclude_newer,
        "--override",
        str(overrides),
        "--no-header",
        "--no-annotate",
        str(requirements),
        "--output-file",
        str(output),
    ]
