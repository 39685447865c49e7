"""The verl plug-in loads through verl's own discovery, composes with verl's Hydra config, and is found in
verl's registries. Needs the `verl` extra (installed in CI)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mlite.integrations.verl import CONFIG_SEARCHPATH


def run_python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_import_verl_loads_our_plugin_through_the_entry_point():
    # a fresh process: only `import verl`, nothing of ours imported by hand; verl logs a failing plug-in
    # at debug level only, so assert on the registries themselves
    code = (
        "import json, sys, verl\n"
        "from verl.workers.engine.base import EngineRegistry\n"
        "from verl.plugin.platform.platform_manager import PlatformRegistry\n"
        "print(json.dumps({'loaded': 'mlite.integrations.verl.plugin' in sys.modules,\n"
        "  'backends': sorted(EngineRegistry._engines['language_model']),\n"
        "  'engine': EngineRegistry._engines['language_model']['mlite']['cpu'].__module__,\n"
        "  'platforms': list(PlatformRegistry.registered_names())}))\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr[-2000:]
    info = json.loads(result.stdout.strip().splitlines()[-1])
    assert info["loaded"] is True
    assert "mlite" in info["backends"] and "fsdp" in info["backends"]
    assert info["engine"] == "mlite.integrations.verl.engine"
    assert "cpu" in info["platforms"]


def test_cpu_platform_only_when_asked():
    code = "from verl.utils.device import get_device_name; print(get_device_name())"
    on_cpu = run_python(code, {"VERL_PLATFORM": "cpu"})
    assert on_cpu.stdout.strip().splitlines()[-1] == "cpu", on_cpu.stderr[-2000:]
    from mlite.integrations.verl.platform_cpu import PlatformCPU

    platform = PlatformCPU()
    assert platform.communication_backend_name() == "gloo"
    assert platform.device_module.max_memory_allocated() == 0


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return hydra_compose(
            "sft_trainer_engine", overrides=[f"hydra.searchpath=[{CONFIG_SEARCHPATH}]", *overrides]
        )


def test_hydra_composition_with_verl_sft_config():
    from verl.utils.config import omega_conf_to_dataclass

    from mlite.integrations.verl.config_schema import MliteEngineConfig

    cfg = compose(["engine=mlite", "engine.tensor_parallel_size=2", "engine.dtype=float32"])
    engine = omega_conf_to_dataclass(cfg.engine)
    assert isinstance(engine, MliteEngineConfig)
    assert (engine.strategy, engine.tensor_parallel_size, engine.dtype) == ("mlite", 2, "float32")
    assert cfg.optim.lr == pytest.approx(1e-3)  # verl's own sections stay as verl composes them
    default = compose([])
    assert default.engine.strategy == "fsdp"  # without engine=mlite nothing of ours is selected


def test_engine_and_optimizer_sections_map_onto_the_mlite_job():
    from verl.utils.config import omega_conf_to_dataclass

    from mlite.config import job_from_dict
    from mlite.integrations.verl.config_schema import to_job_dict

    cfg = compose(
        [
            "engine=mlite",
            "engine.tensor_parallel_size=2",
            "engine.dtype=float32",
            "engine.device=cpu",
            "engine.optimizer_offload=true",
            "optim.lr=3e-4",
            "optim.weight_decay=0.1",
            "optim.clip_grad=0.5",
            "optim.lr_warmup_steps_ratio=0.1",
            "optim.lr_scheduler_type=cosine",
            "optim.min_lr_ratio=0.1",
            "engine.gc_every=0",
        ]
    )
    engine, optim = omega_conf_to_dataclass(cfg.engine), omega_conf_to_dataclass(cfg.optim)
    job = job_from_dict(to_job_dict(engine, "/models/tiny", optim, total_steps=50))
    assert job.model.path == "/models/tiny" and job.parallel.tp == 2
    assert job.precision.compute == "fp32" and job.trainer.device == "cpu" and job.offload.optimizer
    assert (job.optimizer.lr, job.optimizer.weight_decay, job.optimizer.clip_grad) == (3e-4, 0.1, 0.5)
    assert (job.optimizer.warmup_steps, job.optimizer.schedule) == (5, "cosine")
    assert job.optimizer.min_lr == pytest.approx(3e-5)
    assert job.trainer.steps == 50 and job.trainer.gc_every == 0
