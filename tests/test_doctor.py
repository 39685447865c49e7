"""`mlite doctor`: a clear report on this CPU machine (no GPU, packages missing by name), exit status by
--strict, and each image-specific check shown against real installed files (a dist-info and a package
folder on the path, as pip would leave them) for the good and the broken case."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlite.images import doctor
from mlite.images.build import REPO
from mlite.images.stacks import load_stack

STACK = load_stack("2026.11")


def mlite_doctor(*args: str, bare: bool = False, env: dict | None = None) -> subprocess.CompletedProcess:
    """`mlite doctor` in a subprocess; bare=True runs a Python without site-packages (nothing installed)."""
    python = [sys.executable, "-S"] if bare else [sys.executable]
    full_env = {**os.environ, **(env or {})}
    if bare:
        full_env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [*python, "-m", "mlite", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=full_env,
        cwd=REPO,
    )


def line_for(report: str, name: str) -> str:
    found = [line for line in report.splitlines() if re.match(rf"^\s+\w+\s+{re.escape(name)}\s", line)]
    assert len(found) == 1, f"no single line for {name} in:\n{report}"
    return found[0]


def status_of(report: str, name: str) -> str:
    return line_for(report, name).split()[0]


def test_report_on_this_cpu_machine_names_what_is_missing():
    result = mlite_doctor()
    report = result.stdout
    assert result.returncode == 0, result.stderr  # a report, not a failure, without --strict
    assert report.startswith("mlite doctor: stack 2026.11")
    assert status_of(report, "vllm") == "missing" and "pin 0.25.1" in line_for(report, "vllm")
    # the megatron extra (CI's install) brings a megatron-core that resolves for this CPU torch, not the pin
    from importlib.metadata import version

    assert (status_of(report, "megatron-core") == "wrong"
            and version("megatron-core") in line_for(report, "megatron-core"))
    assert status_of(report, "deepep") == "missing" and "5e3559296b20" in line_for(report, "deepep")
    assert status_of(report, "gpu") == "note" and "no CUDA GPU visible" in line_for(report, "gpu")
    assert status_of(report, "cudnn DSA indexer") == "missing"
    assert status_of(report, "import torch") == "ok"
    # torch here is the CPU build of another release: named as wrong, with both versions
    import torch

    assert status_of(report, "torch") == "wrong" and torch.__version__ in line_for(report, "torch")
    assert "NOT HEALTHY for stack 2026.11" in report and "vllm" in report.splitlines()[-1]
    assert "Traceback" not in result.stderr and "warn" not in result.stderr.lower()


def test_strict_fails_and_plain_reports_in_an_empty_environment():
    plain, strict = mlite_doctor(bare=True), mlite_doctor("--strict", bare=True)
    assert plain.returncode == 0 and strict.returncode == 1, plain.stderr + strict.stderr
    assert plain.stdout == strict.stdout
    assert status_of(plain.stdout, "torch") == "missing"
    assert "torch is not installed" in line_for(plain.stdout, "gpu")
    missing = re.search(r"(\d+) missing \(([^)]*)\)", plain.stdout.splitlines()[-1])
    assert missing and int(missing.group(1)) >= 15 and "torch" in missing.group(2).split(", ")


def test_require_gpu_makes_a_missing_gpu_a_problem():
    result = mlite_doctor("--require-gpu", "--strict", bare=True)
    assert result.returncode == 1 and status_of(result.stdout, "gpu") == "missing"


def test_stack_comes_from_the_flag_then_the_image_environment():
    from_env = mlite_doctor(bare=True, env={"MLITE_STACK": "2026.08"})
    assert from_env.stdout.startswith("mlite doctor: stack 2026.08")
    assert "pin 0.24.0" in line_for(from_env.stdout, "vllm")
    flagged = mlite_doctor("--stack", "2026.11", "--arch", "sm100", bare=True, env={"MLITE_STACK": "2026.08"})
    assert flagged.stdout.startswith("mlite doctor: stack 2026.11") and "image arch sm100" in flagged.stdout


def test_bad_input_is_one_line_exit_2():
    for args, expected in [
        (["--stack", "1999.01"], "unknown stack '1999.01'"),
        (["--arch", "sm80"], "invalid choice"),
    ]:
        result = mlite_doctor(*args, bare=True)
        assert result.returncode == 2 and expected in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_image_arch_of_each_gpu_generation():
    assert doctor.image_arch_for("9.0") == "sm90"
    assert doctor.image_arch_for("10.0") == doctor.image_arch_for("10.3") == "sm100"
    assert doctor.image_arch_for("8.0") is None


# --------------------------------------------------------------- installed files, good and broken
def install(site: Path, dist: str, version: str, files: dict[str, str] | None = None) -> None:
    """Leave what pip leaves: NAME-VERSION.dist-info/METADATA and the package files."""
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    for relative, text in (files or {}).items():
        path = site / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def site(tmp_path, monkeypatch):
    folder = tmp_path / "site-packages"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    for name in [m for m in sys.modules if m.split(".")[0] in ("cudnn", "flash_attn")]:
        monkeypatch.delitem(sys.modules, name)
    yield folder
    for name in [m for m in sys.modules if m.split(".")[0] in ("cudnn", "flash_attn")]:
        del sys.modules[name]


def git_check(name: str) -> doctor.Check:
    return next(c for c in doctor.check_git_builds(STACK) if c.name == name)


def test_deepep_from_pypi_is_wrong(site):
    install(site, "deep_ep", "1.0.0")
    check = git_check("deepep")
    assert check.status == "wrong" and "not DeepSeek's DeepEP" in check.detail


def test_deepep_built_from_the_pinned_commit_is_ok(site):
    install(site, "deep_ep", f"1.1.0+{STACK.git['deepep'].commit[:7]}")
    assert git_check("deepep").status == "ok"


def test_deepep_built_from_another_commit_is_wrong(site):
    install(site, "deep_ep", "1.1.0+0123abc")
    assert git_check("deepep").status == "wrong"


def test_apex_from_pypi_is_wrong(site):
    install(site, "apex", "0.9.10.dev0")
    assert git_check("apex").status == "wrong" and "unrelated" in git_check("apex").detail


def test_nvidia_apex_is_ok(site):
    install(site, "apex", "0.1")  # NVIDIA apex's setup.py version
    assert git_check("apex").status == "ok"


def test_stale_flash_attn_cute_copy_is_wrong_until_removed_or_flash_attn_4_owns_it(site):
    install(site, "flash_attn", "2.8.3", {"flash_attn/__init__.py": "", "flash_attn/cute/__init__.py": ""})
    check = doctor.check_flash_attn_cute()
    assert check.status == "wrong" and "ampere_helpers" in check.detail
    install(site, "flash_attn_4", "4.0.0b36")
    assert doctor.check_flash_attn_cute() is None  # flash-attn-4 owns flash_attn/cute/ then


def test_flash_attn_without_cute_copy_is_ok(site):
    install(site, "flash_attn", "2.8.3", {"flash_attn/__init__.py": ""})
    assert doctor.check_flash_attn_cute().status == "ok"


DSA_API = "cudnn/deepseek_sparse_attention/indexer_forward/api.py"


def test_cudnn_frontend_with_the_sm90_indexer_is_ok(site):
    install(
        site,
        "nvidia-cudnn-frontend",
        "1.27.0",
        {
            "cudnn/__init__.py": "",
            DSA_API: "def indexer_forward_wrapper(q, k, w, ratio=4, q_causal_offsets=None):\n    pass\n",
        },
    )
    check = doctor.check_cudnn_dsa(gpu_visible=False)
    assert check.status == "ok", check.detail


def test_cudnn_frontend_without_q_causal_offsets_is_wrong(site):
    install(
        site,
        "nvidia-cudnn-frontend",
        "1.26.0",
        {"cudnn/__init__.py": "", DSA_API: "def indexer_forward_wrapper(q, k, w, ratio=4):\n    pass\n"},
    )
    check = doctor.check_cudnn_dsa(gpu_visible=False)
    assert check.status == "wrong" and "q_causal_offsets" in check.detail


def test_cudnn_frontend_without_dsa_is_wrong(site):
    install(site, "nvidia-cudnn-frontend", "1.20.0", {"cudnn/__init__.py": ""})
    check = doctor.check_cudnn_dsa(gpu_visible=False)
    assert check.status == "wrong" and ">= 1.27" in check.detail


@pytest.mark.gpu
def test_doctor_on_a_gpu_machine_checks_arch_and_nccl():
    """On the GPU machine: the GPU's capability is matched against an image arch list and NCCL is loaded."""
    result = mlite_doctor("--require-gpu")
    report = result.stdout
    assert result.returncode == 0, result.stderr
    assert status_of(report, "gpu arch") == "ok", line_for(report, "gpu arch")
    nccl = line_for(report, "nccl")
    assert re.search(r"\b2\.\d+\.\d+ loaded", nccl), nccl  # a real version, ok or named as too old
    assert status_of(report, "import torch") == "ok"
    print(report)
