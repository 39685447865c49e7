"""`mlite doctor`: is this environment the stack it should be?

Compares what is installed with a stack's pins (`docker/stacks/<version>.toml`) and checks what pins alone
cannot: every component imports, the GPUs are architectures the image was built for, the NCCL torch loads
is new enough, the cuDNN frontend has the SM90 DSA indexer, DeepEP is built from the pinned commit, no
impostor package from PyPI shadows apex or DeepEP, and no stale flash_attn/cute/ copy is left.

The stack is the one named (`--stack`), else the one the image says it is (`MLITE_STACK`), else the newest.
The image architecture is `--arch`, else the image's (`MLITE_IMAGE_ARCH`), else derived from the GPUs.
It is also the image's build self-check: no GPU there, which is a note, not a problem, unless `require_gpu`.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.metadata as metadata
import importlib.util
import inspect
import logging
import os
import platform
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from mlite.images.stacks import (
    MIN_VERSIONS,
    REQUIRED_CAPABILITIES,
    REQUIRED_WHEELS,
    STACK_ENV,
    WRONG_PYPI,
    Stack,
    load_stack,
    version_key,
)

ARCH_ENV = "MLITE_IMAGE_ARCH"
OK, MISSING, WRONG, NOTE = "ok", "missing", "wrong", "note"
# Wheels checked against their pins: every required one but `uv`, which is only the image's installer.
CHECKED_WHEELS = tuple(name for name in REQUIRED_WHEELS if name != "uv")
# What must import in a healthy image (module -> the distribution that provides it).
IMPORTS = {
    "torch": "torch",
    "transformer_engine.pytorch": "transformer-engine",
    "flash_attn": "flash-attn",
    "deep_ep": "deep-ep",
    "apex": "apex",
    "vllm": "vllm",
    "verl": "verl",
    "megatron.core": "megatron-core",
    "mlite": "mlite",
}


@dataclass(frozen=True)
class Check:
    status: str  # ok / missing / wrong / note
    name: str
    detail: str

    @property
    def is_problem(self) -> bool:
        return self.status in (MISSING, WRONG)


def installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def check_python(stack: Stack) -> Check:
    have = f"{sys.version_info.major}.{sys.version_info.minor}"
    status = OK if have == stack.python else WRONG
    return Check(status, "python", f"{platform.python_version()} (stack {stack.version} pins {stack.python})")


def check_wheels(stack: Stack) -> list[Check]:
    checks = []
    for name in CHECKED_WHEELS:
        pin, have = stack.wheels[name], installed_version(name)
        if have is None:
            checks.append(Check(MISSING, name, f"not installed (pin {pin})"))
        elif (
            have.split("+")[0] != pin
        ):  # torch reports 2.11.0+cu130: the local part is the build, not the version
            checks.append(Check(WRONG, name, f"{have} installed, pin {pin}"))
        else:
            checks.append(Check(OK, name, have))
    return checks


def check_git_builds(stack: Stack) -> list[Check]:
    """DeepEP carries its commit in its version (1.2.1+5e35592); apex and gdrcopy are checked for presence."""
    checks = []
    deepep = installed_version("deep-ep")
    commit = stack.git["deepep"].commit
    if deepep is None:
        checks.append(Check(MISSING, "deepep", f"not installed (build from git at {commit[:12]})"))
    elif "+" not in deepep or not commit.startswith(deepep.split("+")[1][:7]):
        checks.append(
            Check(
                WRONG,
                "deepep",
                f"{deepep} installed; not a build of the pinned commit {commit[:12]} "
                f"({WRONG_PYPI['deep-ep']})",
            )
        )
    else:
        checks.append(Check(OK, "deepep", f"{deepep} (commit {commit[:12]})"))
    apex = installed_version("apex")
    if apex is None:
        checks.append(
            Check(MISSING, "apex", f"not installed (build from git at {stack.git['apex'].commit[:12]})")
        )
    elif apex.startswith("0.9"):  # the PyPI impostor's releases are 0.9.x
        checks.append(Check(WRONG, "apex", f"{apex} installed: {WRONG_PYPI['apex']}"))
    else:
        checks.append(Check(OK, "apex", f"{apex} (NVIDIA apex)"))
    found = [
        p
        for p in ("/opt/gdrcopy/lib", "/usr/local/lib", "/usr/lib/x86_64-linux-gnu")
        if any(Path(p).glob("libgdrapi.so*"))
    ]
    checks.append(
        Check(OK, "gdrcopy", f"libgdrapi in {found[0]}")
        if found
        else Check(MISSING, "gdrcopy", "libgdrapi.so not found (DeepEP inter-node needs it)")
    )
    return checks


def check_imports() -> list[Check]:
    checks = []
    for module, dist in IMPORTS.items():
        if dist != "mlite" and installed_version(dist) is None:
            continue  # already reported as missing; an import would only repeat it
        try:
            with _quiet():
                importlib.import_module(module)
        except Exception as err:  # any failure to import is the finding
            last = (str(err).strip().splitlines() or [type(err).__name__])[-1]
            checks.append(Check(WRONG, f"import {module}", f"{type(err).__name__}: {last}"))
        else:
            checks.append(Check(OK, f"import {module}", "imports"))
    return checks


@contextlib.contextmanager
def _quiet():
    """Silence the warnings and log lines packages print on import, so the report stays readable."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(logging.NOTSET)


def check_flash_attn_cute() -> Check | None:
    """flash-attn 2's flash_attn/cute/ left on disk without flash-attn-4 breaks `import megatron.core`."""
    if installed_version("flash-attn") is None or installed_version("flash-attn-4") is not None:
        return None
    spec = importlib.util.find_spec("flash_attn")
    if spec is None or not spec.submodule_search_locations:
        return None
    cute = Path(spec.submodule_search_locations[0]) / "cute"
    if cute.is_dir():
        return Check(
            WRONG,
            "flash_attn/cute",
            f"{cute} is flash-attn 2's stale copy (imports "
            "cutlass.utils.ampere_helpers); delete it or install flash-attn-4",
        )
    return Check(OK, "flash_attn/cute", "no stale flash-attn 2 copy")


def check_cudnn_dsa(gpu_visible: bool) -> Check:
    """The Hopper DSA indexer: cudnn.DSA.indexer_forward_wrapper(..., q_causal_offsets=...)."""
    name = "cudnn DSA indexer"
    if installed_version("nvidia-cudnn-frontend") is None:
        return Check(MISSING, name, "nvidia-cudnn-frontend is not installed")
    try:
        import cudnn

        params = inspect.signature(cudnn.DSA.indexer_forward_wrapper).parameters
    except Exception as err:
        if gpu_visible:
            return Check(
                WRONG, name, f"cudnn.DSA.indexer_forward_wrapper unavailable: {type(err).__name__}: {err}"
            )
        params = _source_parameters(
            "cudnn", "deepseek_sparse_attention/indexer_forward/api.py", "indexer_forward_wrapper"
        )
        if params is None:
            return Check(WRONG, name, "this cuDNN frontend has no DSA indexer_forward_wrapper (need >= 1.27)")
    if "q_causal_offsets" not in params:
        return Check(WRONG, name, "DSA.indexer_forward_wrapper has no q_causal_offsets (need >= 1.27)")
    return Check(OK, name, "DSA.indexer_forward_wrapper(q_causal_offsets=...) present")


def _source_parameters(package: str, relative: str, function: str) -> list[str] | None:
    """A function's parameter names read from the installed source, for when importing needs a GPU driver."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / relative
    if not path.is_file():
        return None
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            return [a.arg for a in node.args.args + node.args.kwonlyargs]
    return None


def gpu_capabilities() -> tuple[list[str], str]:
    """Compute capabilities of the visible GPUs ("9.0"), and a note when there are none."""
    try:
        import torch
    except ImportError:
        return [], "torch is not installed"
    if not torch.cuda.is_available():
        return [], "no CUDA GPU visible (torch.cuda.is_available() is False)"
    caps = []
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        caps.append(f"{major}.{minor}")
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    return caps, f"{len(caps)} x {', '.join(names)}"


def image_arch_for(capability: str) -> str | None:
    return next(
        (
            arch
            for arch, caps in REQUIRED_CAPABILITIES.items()
            if caps[0].split(".")[0] == capability.split(".")[0]
        ),
        None,
    )


def check_gpus(stack: Stack, arch: str | None, require_gpu: bool) -> tuple[list[Check], bool]:
    caps, note = gpu_capabilities()
    if not caps:
        return [Check(MISSING if require_gpu else NOTE, "gpu", note)], False
    arch = arch or image_arch_for(caps[0])
    if arch is None or arch not in stack.arches:
        return [
            Check(
                WRONG,
                "gpu arch",
                f"{note}: compute capability {caps[0]} has no mlite image arch "
                f"(images: {', '.join(stack.arches)})",
            )
        ], True
    built = [c.rstrip("a") for c in stack.arch(arch).capabilities]
    unbuilt = sorted(set(c for c in caps if c not in built))
    if unbuilt:
        return [
            Check(
                WRONG,
                "gpu arch",
                f"{note}: capability {', '.join(unbuilt)} is not in the {arch} image's "
                f"arch list {stack.arch(arch).torch_cuda_arch_list}; use the image built "
                f"for {image_arch_for(unbuilt[0]) or 'this GPU'}",
            )
        ], True
    return [
        Check(
            OK,
            "gpu arch",
            f"{note}: capability {', '.join(sorted(set(caps)))} in the {arch} list "
            f"{stack.arch(arch).torch_cuda_arch_list}",
        )
    ], True


def check_nccl(stack: Stack, gpu_visible: bool) -> Check:
    """The NCCL torch actually loads: at least the suspend/resume release, and the stack's pin."""
    pin = stack.wheels["nvidia-nccl-cu13"]
    try:
        import torch
    except ImportError:
        return Check(MISSING, "nccl", "torch is not installed")
    if not gpu_visible:
        wheel = installed_version("nvidia-nccl-cu13")
        return Check(NOTE, "nccl", f"not loaded without a GPU (wheel: {wheel or 'not installed'}, pin {pin})")
    try:
        loaded = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as err:
        return Check(WRONG, "nccl", f"torch cannot load NCCL: {type(err).__name__}: {err}")
    minimum, why = MIN_VERSIONS["nvidia-nccl-cu13"]
    if version_key(loaded) < version_key(minimum):
        return Check(WRONG, "nccl", f"{loaded} loaded; >= {minimum} is needed for {why} (pin {pin})")
    if loaded != pin:
        return Check(WRONG, "nccl", f"{loaded} loaded, pin {pin}")
    return Check(OK, "nccl", f"{loaded} loaded by torch")


def diagnose(
    stack_version: str | None = None, arch: str | None = None, require_gpu: bool = False
) -> tuple[Stack, list[Check]]:
    stack = load_stack(stack_version or os.environ.get(STACK_ENV) or None)
    arch = arch or os.environ.get(ARCH_ENV) or None
    if arch is not None:
        stack.arch(arch)  # unknown arch: one clear line
    checks = [check_python(stack), *check_wheels(stack), *check_git_builds(stack)]
    gpu_checks, gpu_visible = check_gpus(stack, arch, require_gpu)
    checks += gpu_checks
    checks.append(check_nccl(stack, gpu_visible))
    checks.append(check_cudnn_dsa(gpu_visible))
    cute = check_flash_attn_cute()
    if cute is not None:
        checks.append(cute)
    checks += check_imports()
    return stack, checks


def report(stack: Stack, checks: list[Check], arch: str | None) -> str:
    where = f"stack {stack.version} ({stack.path})" + (f", image arch {arch}" if arch else "")
    lines = [f"mlite doctor: {where}"]
    width = max(len(c.name) for c in checks)
    for check in checks:
        lines.append(f"  {check.status:<8} {check.name:<{width}}  {check.detail}")
    problems = [c for c in checks if c.is_problem]
    if problems:
        missing = [c.name for c in problems if c.status == MISSING]
        wrong = [c.name for c in problems if c.status == WRONG]
        summary = []
        if missing:
            summary.append(f"{len(missing)} missing ({', '.join(missing)})")
        if wrong:
            summary.append(f"{len(wrong)} wrong ({', '.join(wrong)})")
        lines.append(f"NOT HEALTHY for stack {stack.version}: " + "; ".join(summary))
    else:
        lines.append(f"healthy: this environment matches stack {stack.version}")
    return "\n".join(lines)


def run(
    stack_version: str | None = None, arch: str | None = None, strict: bool = False, require_gpu: bool = False
) -> int:
    """Print the report; 1 when something is missing or wrong and `strict`, else 0."""
    stack, checks = diagnose(stack_version, arch, require_gpu)
    print(report(stack, checks, arch or os.environ.get(ARCH_ENV)))
    return 1 if strict and any(c.is_problem for c in checks) else 0
