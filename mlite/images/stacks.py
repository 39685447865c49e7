"""Container stacks: the one source of truth for what goes into an mlite image.

A stack is one TOML file, `docker/stacks/<version>.toml`, that pins every component of the image: the CUDA
base image, the PyPI wheels (exact versions), the git dependencies (exact commits) and, per GPU
architecture, the compute capabilities each compiled component is built for. `invoke build` turns a stack
into docker build arguments and OCI labels (`mlite.images.build`), `mlite doctor` compares an environment
with it, and the resolver test resolves its Python layer against the package index. Earlier stacks stay
in the folder and stay buildable by name.

`validate` refuses pin sets that are known to break (each rule names the trap it guards against), so a
bad pins file fails here, in one line, instead of hours into a GPU build.

Config layer: no torch, no third-party imports.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlite.errors import MliteError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

# Where the stacks live: the repository's docker/stacks, or (inside an image, where mlite is installed
# without the repository) the folder the image points MLITE_STACKS_DIR at.
STACKS_ENV = "MLITE_STACKS_DIR"
STACK_ENV = "MLITE_STACK"  # which stack this environment claims to be (set by the image)
REPO_STACKS = Path(__file__).resolve().parents[2] / "docker" / "stacks"

ARCHES = ("sm90", "sm100")
# Compute capabilities each image must carry. B300/GB300 are 10.3: a DeepEP built without it fails at
# run time with "named symbol not found" / "no kernel image" on those machines.
REQUIRED_CAPABILITIES = {"sm90": ("9.0",), "sm100": ("10.0", "10.3")}

# PyPI wheels every stack pins (distribution name -> what it is for, shown by doctor).
REQUIRED_WHEELS = {
    "torch": "PyTorch (its CUDA build fixes the stack's CUDA)",
    "vllm": "rollout engine",
    "verl": "RL trainer framework",
    "megatron-core": "Megatron-Core",
    "transformers": "HF models and tokenizers",
    "ray": "actors for RL",
    "torchao": "FP8 training (torchao.float8, moe_training)",
    "transformer-engine": "fused kernels, FP8 (built in the image's build stage)",
    "flash-attn": "FlashAttention 2 (built in the image's build stage)",
    "nvidia-cudnn-frontend": "cuDNN frontend (DeepSeek sparse-attention indexer)",
    "nvidia-cutlass-dsl": "CUTLASS DSL (CuTe kernels of the DSA path)",
    "nvidia-nccl-cu13": "NCCL (forced over torch's pin)",
    "nvidia-cublas": "cuBLAS (forced over torch's pin: Transformer Engine's core links a newer API)",
    "nvidia-nvshmem-cu13": "NVSHMEM (the one copy DeepEP is built and run against)",
    "uv": "the resolver that installs the Python layer",
}
REQUIRED_GIT = {
    "apex": "NVIDIA apex",
    "deepep": "DeepSeek DeepEP",
    "gdrcopy": "GPUDirect RDMA copy library (DeepEP inter-node)",
}
# The wheels the image resolves together (its Python layer); the rest are compiled in the build stage
# or are the resolver itself.
RESOLVED_WHEELS = (
    "torch",
    "vllm",
    "verl",
    "megatron-core",
    "transformers",
    "ray",
    "torchao",
    "nvidia-cudnn-frontend",
    "nvidia-cutlass-dsl",
    "nvidia-nvshmem-cu13",
)
# Forced over what the resolved packages ask for (torch pins an older NCCL and cuBLAS).
OVERRIDE_WHEELS = ("nvidia-nccl-cu13", "nvidia-cublas")
WHEEL_EXTRAS = {"ray": "default"}  # verl needs ray[default]

# Distributions on PyPI that share a name with something else: installing them is always a mistake.
WRONG_PYPI = {
    "apex": "'apex' on PyPI is an unrelated old package; NVIDIA apex is built from git at a commit "
    "([git.apex] in the stack)",
    "deep-ep": "'deep-ep' on PyPI is not DeepSeek's DeepEP; DeepEP is built from git at a commit "
    "([git.deepep] in the stack)",
}
# Both ship flash_attn/cute/; when flash-attn 2's older copy wins, `import megatron.core` fails with
# "No module named 'cutlass.utils.ampere_helpers'".
FLASH_ATTN_CLASH = ("flash-attn", "flash-attn-4")
MIN_VERSIONS = {
    "nvidia-nccl-cu13": (
        "2.29.7",
        "NCCL communicator suspend/resume (frees GBs per rank between rollout and training)",
    ),
    # torch 2.11.0 pins cuBLAS 13.1.0.3 (cuda-toolkit 13.0.2); the prebuilt core of Transformer Engine 2.13
    # and newer (libtransformer_engine.so) needs cublasLtGroupedMatrixLayoutInit_internal, which cuBLAS
    # first exports in 13.2.0.9 (CUDA 13.1): with torch's, `import transformer_engine` fails on it (read
    # from the wheels' dynamic symbol tables; seen on an H200)
    "nvidia-cublas": (
        "13.2.0.9",
        "Transformer Engine's prebuilt core (cublasLtGroupedMatrixLayoutInit_internal)",
    ),
    "nvidia-cudnn-frontend": (
        "1.27.0",
        "the SM90 DSA indexer (DSA.indexer_forward_wrapper with q_causal_offsets)",
    ),
}
EXACT_VERSIONS = {"nvidia-cutlass-dsl": ("4.5.2", "DeepSeek-V4's fused DSA path on Hopper")}
EXACT_VERSION = re.compile(r"^\d+(\.\d+)*(\.post\d+)?$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
CAPABILITY = re.compile(r"^\d+\.\d+a?$")


@dataclass(frozen=True)
class GitPin:
    url: str
    commit: str


@dataclass(frozen=True)
class ArchPins:
    name: str  # sm90 / sm100
    torch_cuda_arch_list: str  # apex, DeepEP (torch C++/CUDA extensions): "9.0;9.0a"
    nvte_cuda_archs: str  # Transformer Engine (CMake form): "90"
    flash_attn_cuda_archs: str  # flash-attn 2's setup knows 80/90/100/120

    @property
    def capabilities(self) -> list[str]:
        return [cap for cap in self.torch_cuda_arch_list.split(";") if cap]


@dataclass(frozen=True)
class Stack:
    version: str
    path: Path
    python: str
    cuda: str  # e.g. 13.0.2, the base image's toolkit (= torch's CUDA build)
    base_image: str  # name:tag
    base_digest: str  # sha256:... or "" where none was recorded
    glibc: str  # the base image's, e.g. 2.39: wheels are resolved for manylinux_2_39
    exclude_newer: (
        str  # YYYY-MM-DD: the resolver sees the index as of that day, so dependencies of pins hold still
    )
    max_jobs: int
    nvte_build_threads_per_job: int
    wheels: dict[str, str]
    git: dict[str, GitPin]
    arches: dict[str, ArchPins]

    @property
    def cuda_tag(self) -> str:
        """cu130 for CUDA 13.0.x."""
        major, minor = self.cuda.split(".")[:2]
        return f"cu{major}{minor}"

    @property
    def torch_short(self) -> str:
        return ".".join(self.wheels["torch"].split(".")[:2])

    @property
    def python_platform(self) -> str:
        """The platform the image's wheels must fit (the resolver's target)."""
        return "x86_64-manylinux_" + self.glibc.replace(".", "_")

    @property
    def base_ref(self) -> str:
        return f"{self.base_image}@{self.base_digest}" if self.base_digest else self.base_image

    def arch(self, name: str) -> ArchPins:
        if name not in self.arches:
            raise MliteError(
                f"stack {self.version} has no arch '{name}'; choose one of: {', '.join(self.arches)}"
            )
        return self.arches[name]

    def requirement(self, name: str) -> str:
        extra = f"[{WHEEL_EXTRAS[name]}]" if name in WHEEL_EXTRAS else ""
        return f"{name}{extra}=={self.wheels[name]}"

    def python_requirements(self) -> list[str]:
        """The image's Python layer, as resolver requirements (exact pins)."""
        return [self.requirement(name) for name in RESOLVED_WHEELS]

    def python_overrides(self) -> list[str]:
        return [self.requirement(name) for name in OVERRIDE_WHEELS]


def stacks_dir() -> Path:
    folder = Path(os.environ.get(STACKS_ENV) or REPO_STACKS)
    if not folder.is_dir():
        raise MliteError(
            f"no stacks folder at {folder}; run from the mlite repository or set {STACKS_ENV} "
            "to a folder of <version>.toml pins files"
        )
    return folder


def list_stacks() -> list[str]:
    """Stack versions, oldest first (versions are dates: 2026.08 < 2026.11)."""
    return sorted((p.stem for p in stacks_dir().glob("*.toml")), key=version_key)


def newest_stack() -> str:
    versions = list_stacks()
    if not versions:
        raise MliteError(f"no stacks in {stacks_dir()}; add docker/stacks/<version>.toml")
    return versions[-1]


def load_stack(version: str | None = None) -> Stack:
    """Read and validate one stack; None means the newest."""
    version = version or newest_stack()
    path = stacks_dir() / f"{version}.toml"
    if not path.is_file():
        raise MliteError(f"unknown stack '{version}'; available: {', '.join(list_stacks())}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise MliteError(f"{path}: not valid TOML ({err})") from None
    return parse_stack(data, path)


def parse_stack(data: dict[str, Any], path: Path) -> Stack:
    """Dict (from TOML) -> validated Stack. Every problem is one line naming the file and the key."""

    def need(section: dict, key: str, where: str) -> Any:
        if key not in section:
            raise MliteError(f"{path}: missing '{where}.{key}'")
        return section[key]

    def table(key: str) -> dict:
        value = need(data, key, "(top level)")
        if not isinstance(value, dict):
            raise MliteError(f"{path}: [{key}] must be a table")
        return value

    _only_keys(data, {"stack", "build", "wheels", "git", "arch"}, path, "(top level)")
    head, build, wheels, git, arch = (table(k) for k in ("stack", "build", "wheels", "git", "arch"))
    _only_keys(
        head,
        {"version", "python", "cuda", "base_image", "base_digest", "glibc", "exclude_newer"},
        path,
        "stack",
    )
    _only_keys(build, {"max_jobs", "nvte_build_threads_per_job"}, path, "build")
    version = str(need(head, "version", "stack"))
    if version != path.stem:
        raise MliteError(
            f"{path}: stack.version is '{version}' but the file is named {path.name}; "
            "make them equal (the file name is how a stack is chosen)"
        )
    stack = Stack(
        version=version,
        path=path,
        python=str(need(head, "python", "stack")),
        cuda=str(need(head, "cuda", "stack")),
        base_image=str(need(head, "base_image", "stack")),
        base_digest=str(head.get("base_digest", "")),
        glibc=str(need(head, "glibc", "stack")),
        exclude_newer=str(need(head, "exclude_newer", "stack")),
        max_jobs=int(need(build, "max_jobs", "build")),
        nvte_build_threads_per_job=int(need(build, "nvte_build_threads_per_job", "build")),
        wheels={str(k): str(v) for k, v in wheels.items()},
        git={name: _git_pin(name, pin, path) for name, pin in git.items()},
        arches={name: _arch_pins(name, pins, path) for name, pins in arch.items()},
    )
    validate(stack)
    return stack


def _only_keys(section: dict, allowed: set[str], path: Path, where: str) -> None:
    unknown = sorted(set(section) - allowed)
    if unknown:
        raise MliteError(f"{path}: unknown key '{where}.{unknown[0]}'; allowed: {', '.join(sorted(allowed))}")


def _git_pin(name: str, pin: Any, path: Path) -> GitPin:
    if not isinstance(pin, dict) or set(pin) != {"url", "commit"}:
        raise MliteError(f'{path}: git.{name} must be {{ url = "...", commit = "<40 hex>" }}')
    return GitPin(url=str(pin["url"]), commit=str(pin["commit"]))


def _arch_pins(name: str, pins: Any, path: Path) -> ArchPins:
    keys = {"torch_cuda_arch_list", "nvte_cuda_archs", "flash_attn_cuda_archs"}
    if not isinstance(pins, dict):
        raise MliteError(f"{path}: [arch.{name}] must be a table with {', '.join(sorted(keys))}")
    _only_keys(pins, keys, path, f"arch.{name}")
    missing = sorted(keys - set(pins))
    if missing:
        raise MliteError(f"{path}: missing 'arch.{name}.{missing[0]}'")
    return ArchPins(name=name, **{k: str(v) for k, v in pins.items()})


def validate(stack: Stack) -> None:
    """Refuse pin sets that float or that hit a known trap. One line per problem, the first one raised:
    the wheels' rules, then the git pins', the base image's and build's, the architectures'."""
    _validate_wheels(stack)
    _validate_git(stack)
    _validate_base_and_build(stack)
    _validate_arches(stack)


def _validate_wheels(stack: Stack) -> None:
    """Every required wheel pinned to one release, no impostor or clashing distribution, the known floors."""
    where = stack.path
    for name, message in WRONG_PYPI.items():
        if name in stack.wheels:
            raise MliteError(f"{where}: wheels.{name}: {message}; remove it from [wheels]")
    if all(name in stack.wheels for name in FLASH_ATTN_CLASH):
        raise MliteError(
            f"{where}: wheels pins both flash-attn and flash-attn-4; both ship flash_attn/cute/ and "
            "if flash-attn 2's copy wins, megatron.core fails to import "
            "('No module named cutlass.utils.ampere_helpers'); keep one of them"
        )
    _require_pinned(stack, "wheels", REQUIRED_WHEELS, "pin an exact version")
    for name, version in stack.wheels.items():
        if not EXACT_VERSION.match(version):
            raise MliteError(
                f"{where}: wheels.{name} = '{version}' is not an exact version; "
                "pin one release (e.g. 2.11.0), nothing floats"
            )
    for name, (minimum, why) in MIN_VERSIONS.items():
        if version_key(stack.wheels[name]) < version_key(minimum):
            raise MliteError(
                f"{where}: wheels.{name} = {stack.wheels[name]} is too old; >= {minimum} is needed for {why}"
            )
    for name, (exact, why) in EXACT_VERSIONS.items():
        if stack.wheels[name] != exact:
            raise MliteError(f"{where}: wheels.{name} = {stack.wheels[name]}; {why} needs exactly {exact}")


def _validate_git(stack: Stack) -> None:
    """Every required git dependency pinned at a full commit of an https clone URL."""
    where = stack.path
    _require_pinned(stack, "git", REQUIRED_GIT, "pin it at a commit")
    for name, pin in stack.git.items():
        if not COMMIT.match(pin.commit):
            raise MliteError(
                f"{where}: git.{name}.commit = '{pin.commit}' is not a full 40-hex commit; "
                "pin the commit, not a branch or tag"
            )
        if not pin.url.startswith("https://"):
            raise MliteError(f"{where}: git.{name}.url must be an https:// clone URL")


def _require_pinned(stack: Stack, section: str, required: dict[str, str], fix: str) -> None:
    """Every name of `required` (name -> what it is for) pinned in the stack's [wheels] or [git] section."""
    pinned = getattr(stack, section)
    for name, what in required.items():
        if name not in pinned:
            raise MliteError(f"{stack.path}: {section}.{name} is missing ({what}); {fix}")


def _validate_base_and_build(stack: Stack) -> None:
    """A base image at a fixed tag (and digest) of the stack's CUDA, a resolver date, sane build knobs."""
    where = stack.path
    if not stack.base_image.count(":") == 1 or stack.base_image.endswith(":latest"):
        raise MliteError(
            f"{where}: stack.base_image = '{stack.base_image}' needs a fixed tag (name:tag, not latest)"
        )
    if stack.base_digest and not re.match(r"^sha256:[0-9a-f]{64}$", stack.base_digest):
        raise MliteError(f"{where}: stack.base_digest must be sha256:<64 hex> or left out")
    if not re.match(r"^\d{4}-\d{2}-\d{2}$", stack.exclude_newer):
        raise MliteError(f"{where}: stack.exclude_newer = '{stack.exclude_newer}' must be a date, YYYY-MM-DD")
    if stack.cuda not in stack.base_image:
        raise MliteError(
            f"{where}: stack.cuda = {stack.cuda} but the base image is {stack.base_image}; "
            "they must name the same CUDA"
        )
    if stack.max_jobs < 1 or stack.nvte_build_threads_per_job < 1:
        raise MliteError(f"{where}: build.max_jobs and build.nvte_build_threads_per_job must be >= 1")


def _validate_arches(stack: Stack) -> None:
    """Every image arch present, with the capabilities its GPUs need and knobs of its architecture only."""
    where = stack.path
    for arch in ARCHES:
        if arch not in stack.arches:
            raise MliteError(f"{where}: [arch.{arch}] is missing; every stack builds {' and '.join(ARCHES)}")
    for name, arch in stack.arches.items():
        if name not in REQUIRED_CAPABILITIES:
            raise MliteError(f"{where}: unknown arch '{name}'; known: {', '.join(ARCHES)}")
        bad = [cap for cap in arch.capabilities if not CAPABILITY.match(cap)]
        if bad:
            raise MliteError(
                f"{where}: arch.{name}.torch_cuda_arch_list has '{bad[0]}'; write capabilities like 9.0 "
                "or 9.0a separated by ';'"
            )
        for cap in REQUIRED_CAPABILITIES[name]:
            if cap not in arch.capabilities:
                raise MliteError(
                    f"{where}: arch.{name}.torch_cuda_arch_list = '{arch.torch_cuda_arch_list}' lacks "
                    f"{cap}; {name} images need {', '.join(REQUIRED_CAPABILITIES[name])} (DeepEP "
                    "built without one fails at run time: 'named symbol not found')"
                )
        major = REQUIRED_CAPABILITIES[name][0].split(".")[0]
        for knob in ("nvte_cuda_archs", "flash_attn_cuda_archs"):
            archs = [a for a in getattr(arch, knob).split(";") if a]
            if not archs or any(not a.startswith(major) for a in archs):
                raise MliteError(
                    f"{where}: arch.{name}.{knob} = '{getattr(arch, knob)}' must list {name} "
                    f"architectures only (e.g. {major}0)"
                )


def version_key(version: str) -> tuple:
    return tuple(int(part) if part.isdigit() else 0 for part in re.split(r"[.\-]", version))
