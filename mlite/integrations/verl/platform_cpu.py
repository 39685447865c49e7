"""A CPU platform for verl, which ships only accelerator platforms (cuda, npu, rocm).

Registered under the name `cpu` in verl's platform registry; verl selects it only when asked
(`VERL_PLATFORM=cpu`), so nothing changes for GPU runs. With it, verl's trainers run on gloo: the CPU
tests of the plug-in and small debugging runs on a laptop. Under Ray (main_ppo) each training rank takes
one "GPU" slot that the CPU run's Ray cluster declares (`+ray_kwargs.ray_init.num_gpus=N`).
"""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace

import torch
from verl.plugin.platform.platform_base import PlatformBase


def _cpu_device_module() -> SimpleNamespace:
    """What verl calls on `get_torch_device()`, answered for host memory (no device memory to report)."""

    def zero(*_, **__):
        return 0

    def nothing(*_, **__):
        return None

    return SimpleNamespace(
        is_available=lambda: True,
        get_device_name=lambda *_: "CPU",  # verl's FLOPs counter looks it up (no promised FLOPs: MFU is 0)
        device_count=lambda: 1,
        current_device=lambda: 0,
        set_device=nothing,
        synchronize=nothing,
        empty_cache=nothing,
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
        get_rng_state=torch.get_rng_state,
        set_rng_state=torch.set_rng_state,
        memory_allocated=zero,
        memory_reserved=zero,
        max_memory_allocated=zero,
        max_memory_reserved=zero,
        reset_peak_memory_stats=nothing,
        set_per_process_memory_fraction=nothing,
        mem_get_info=lambda *_: (0, 0),
    )


class PlatformCPU(PlatformBase):
    _module = _cpu_device_module()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self):
        return self._module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu"  # never auto-detected

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index=None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return (None, None)

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "MLITE_CPU_VISIBLE_DEVICES"

    def nvtx_range(self, msg: str):
        return contextlib.nullcontext()

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        # verl's resource pools count "GPU" (or "NPU") slots, one per training rank; on the CPU the Ray
        # cluster declares that many slots (`ray_init.num_gpus=N`) and nothing touches a device
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


def join_gloo() -> None:
    """Join the process group with plain gloo (rank and world from the environment: torchrun's, or Ray's
    worker group's RANK / WORLD_SIZE / MASTER_*). verl itself joins "cpu:gloo,cpu:gloo", which torch refuses
    ("Duplicate device type cpu"); once a group exists verl uses it."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")
