"""Container stacks: the pins files load, every Dockerfile value comes from them, bad pin sets are refused.

Each refusal below is a trap users have hit: the test writes a real pins file with
the mistake and checks that loading it fails with one line naming the key and the fix.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from mlite.errors import MliteError
from mlite.images.build import DOCKERFILE, REPO, arg_name, build_args
from mlite.images.stacks import (
    ARCHES,
    RESOLVED_WHEELS,
    WHEEL_EXTRAS,
    list_stacks,
    load_stack,
    newest_stack,
    parse_stack,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DOCKER = REPO / "docker"
BUILD_FILES = [REPO / DOCKERFILE, *sorted(DOCKER.glob("*.sh"))]


def code_lines(path: Path) -> list[str]:
    """The file without comment lines and trailing comments (the parser directive is a comment too)."""
    return [
        line.split(" #")[0] for line in path.read_text().splitlines() if not line.lstrip().startswith("#")
    ]


def test_every_stack_loads_and_is_buildable_by_name():
    versions = list_stacks()
    assert versions == sorted(versions) and len(versions) >= 2, (
        "keep an earlier stack buildable next to the newest"
    )
    assert newest_stack() == versions[-1] == "2026.11"
    for version in versions:
        stack = load_stack(version)
        assert stack.version == version
        for arch in ARCHES:
            args = build_args(stack, arch)
            assert args["STACK_VERSION"] == version and args["IMAGE_ARCH"] == arch
            assert all(value for value in args.values()), f"{version}/{arch}: an empty build arg"


def test_arch_lists_cover_hopper_and_every_blackwell():
    for version in list_stacks():
        stack = load_stack(version)
        sm90, sm100 = stack.arch("sm90"), stack.arch("sm100")
        assert "9.0" in sm90.capabilities and not any(c.startswith("10") for c in sm90.capabilities)
        assert {"10.0", "10.3"} <= set(sm100.capabilities), "B300/GB300 (10.3) need their own code"
        assert (
            build_args(stack, "sm90")["TORCH_CUDA_ARCH_LIST"]
            != build_args(stack, "sm100")["TORCH_CUDA_ARCH_LIST"]
        )
        assert sm90.nvte_cuda_archs.startswith("9") and sm100.nvte_cuda_archs.startswith("10")


def test_newest_stack_meets_the_deepseek_v4_hopper_contract():
    stack = load_stack("2026.11")
    assert stack.wheels["nvidia-cutlass-dsl"] == "4.5.2"
    assert tuple(map(int, stack.wheels["nvidia-cudnn-frontend"].split("."))) >= (1, 27, 0)
    assert tuple(map(int, stack.wheels["nvidia-nccl-cu13"].split("."))) >= (2, 29, 7)
    assert stack.cuda_tag == "cu130" and stack.torch_short == "2.11"
    assert stack.python_overrides() == ["nvidia-nccl-cu13==2.30.7", "nvidia-cublas==13.2.0.9"]


def test_no_version_or_commit_literal_in_the_build_files():
    """Every version-looking string in the Dockerfile and its scripts comes from the pins (as an ARG)."""
    stray = []
    for path in BUILD_FILES:
        for number, line in enumerate(code_lines(path), 1):
            for literal in re.findall(r"\b\d+\.\d+(?:\.\d+)*\b|\b[0-9a-f]{40}\b|@sha256:", line):
                stray.append(f"{path.name}:{number}: {literal}")
    assert not stray, "version literals outside the pins file:\n" + "\n".join(stray)


def test_dockerfile_args_are_exactly_the_stack_build_args():
    text = (REPO / DOCKERFILE).read_text()
    declared = set(re.findall(r"^ARG (\w+)$", text, re.M))
    assert not re.search(r"^ARG \w+=", text, re.M), "an ARG with a default bypasses the pins file"
    for version in list_stacks():
        for arch in ARCHES:
            given = set(build_args(load_stack(version), arch))
            assert declared - given == set(), f"ARGs nobody feeds: {declared - given}"
            assert given - declared == set(), f"pins the Dockerfile never uses: {given - declared}"


def test_dockerfile_installs_exactly_the_resolved_python_layer():
    """The runtime stage installs the same requirements the resolver test resolves, from the same ARGs."""
    text = (REPO / DOCKERFILE).read_text()
    for name in RESOLVED_WHEELS:
        extra = f"[{WHEEL_EXTRAS[name]}]" if name in WHEEL_EXTRAS else ""
        assert f'"{name}{extra}==${{{arg_name(name, "VERSION")}}}"' in text, name
    assert "nvidia-nccl-cu13==${NVIDIA_NCCL_CU13_VERSION}" in text and "--override" in text
    assert "nvidia-cublas==${NVIDIA_CUBLAS_VERSION}" in text
    assert re.search(r"^FROM \$\{BASE_IMAGE\} AS base$", text, re.M)
    stages = re.findall(r"^FROM \S+ AS (\S+)$", text, re.M)
    assert stages[0] == "base" and stages[-2:] == ["runtime", "dev"] and "build" in stages
    assert text.count("RUN mlite-self-check") == 2, "runtime and dev both check themselves at the end"


# ------------------------------------------------------------------------------------ refused pin sets
def newest_data() -> dict:
    return tomllib.loads((DOCKER / "stacks" / f"{newest_stack()}.toml").read_text())


def refused(tmp_path: Path, mutate) -> str:
    data = newest_data()
    mutate(data)
    with pytest.raises(MliteError) as err:
        parse_stack(data, tmp_path / f"{data['stack']['version']}.toml")
    message = str(err.value)
    assert "\n" not in message
    return message


def test_apex_from_pypi_is_refused(tmp_path):
    message = refused(tmp_path, lambda d: d["wheels"].update(apex="0.9.10"))
    assert "wheels.apex" in message and "unrelated" in message and "git" in message


def test_deepep_from_pypi_is_refused(tmp_path):
    message = refused(tmp_path, lambda d: d["wheels"].update({"deep-ep": "1.0.0"}))
    assert "wheels.deep-ep" in message and "not DeepSeek's DeepEP" in message


def test_flash_attn_2_next_to_flash_attn_4_is_refused(tmp_path):
    message = refused(tmp_path, lambda d: d["wheels"].update({"flash-attn-4": "4.0.0"}))
    assert "flash_attn/cute" in message and "ampere_helpers" in message


def test_sm100_without_10_3_is_refused(tmp_path):
    message = refused(tmp_path, lambda d: d["arch"]["sm100"].update(torch_cuda_arch_list="10.0"))
    assert "arch.sm100.torch_cuda_arch_list" in message and "10.3" in message


def test_sm90_without_9_0_is_refused(tmp_path):
    message = refused(tmp_path, lambda d: d["arch"]["sm90"].update(torch_cuda_arch_list="8.0"))
    assert "lacks 9.0" in message


def test_old_nccl_old_cudnn_frontend_and_other_cutlass_are_refused(tmp_path):
    assert ">= 2.29.7" in refused(tmp_path, lambda d: d["wheels"].update({"nvidia-nccl-cu13": "2.28.9"}))
    assert "q_causal_offsets" in refused(
        tmp_path, lambda d: d["wheels"].update({"nvidia-cudnn-frontend": "1.26.0"})
    )
    assert "exactly 4.5.2" in refused(tmp_path, lambda d: d["wheels"].update({"nvidia-cutlass-dsl": "4.8.1"}))
    # torch's own cuBLAS (13.1.0.3) lacks the API Transformer Engine's prebuilt core links
    assert "cublasLtGroupedMatrixLayoutInit_internal" in refused(
        tmp_path, lambda d: d["wheels"].update({"nvidia-cublas": "13.1.0.3"})
    )


def test_floating_pins_are_refused(tmp_path):
    assert "not an exact version" in refused(tmp_path, lambda d: d["wheels"].update(vllm=">=0.25"))
    assert "40-hex" in refused(tmp_path, lambda d: d["git"]["deepep"].update(commit="main"))
    assert "fixed tag" in refused(tmp_path, lambda d: d["stack"].update(base_image="nvidia/cuda:latest"))
    assert "wheels.megatron-core is missing" in refused(tmp_path, lambda d: d["wheels"].pop("megatron-core"))
    assert "git.gdrcopy is missing" in refused(tmp_path, lambda d: d["git"].pop("gdrcopy"))


def test_unknown_keys_and_misnamed_files_are_refused(tmp_path):
    assert "unknown key 'build.jobs'" in refused(tmp_path, lambda d: d["build"].update(jobs=4))
    data = newest_data()
    with pytest.raises(MliteError, match="file is named other.toml"):
        parse_stack(data, tmp_path / "other.toml")


def test_unknown_stack_is_one_clear_line(monkeypatch, tmp_path):
    with pytest.raises(MliteError, match=r"unknown stack '1999.01'; available: 2026.08, 2026.11"):
        load_stack("1999.01")
    monkeypatch.setenv("MLITE_STACKS_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(MliteError, match="MLITE_STACKS_DIR"):
        load_stack()


def test_build_context_holds_exactly_what_the_dockerfile_copies():
    text = (REPO / DOCKERFILE).read_text()
    allowed = [
        line[1:].rstrip("/")
        for line in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    sources = [src for line in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M) for src in line.split()]
    assert sources, "the Dockerfile copies nothing from the context?"
    for source in sources:
        assert (REPO / source).exists(), source
        assert any(source == a or source.startswith(a + "/") for a in allowed), (
            f"{source} is ignored by the context"
        )
