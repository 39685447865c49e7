"""verl's private names that the plug-in needs, in one place. Checked against verl 0.9.1 (`VERL_CHECKED`; the
August image pins 0.9.0); tests/test_adapters.py fails naming this module when verl changes under it.

- `verl.workers.rollout.base._ROLLOUT_REGISTRY`: the (rollout name, mode) -> class path table that verl's
  public `get_rollout_class` reads. verl 0.9.1 has no function to add to it (its engine, platform and
  replica registries have one each, and the plug-in uses those), so `register_rollout_class` writes it.
- `PPOTrainer._init_resource_pool_mgr`: the step of verl's trainer set-up that fills `role_worker_mapping`
  (role -> Ray worker class). verl's own separate-async trainer overrides it to swap its worker classes;
  `WorkerClassSwap` does the same for a trainer whose workers must differ (the CPU one: main_ppo.py).
"""

from __future__ import annotations

VERL_CHECKED = "0.9.1"


def register_rollout_class(name: str, mode: str, class_path: str) -> None:
    """`get_rollout_class(name, mode)` returns the class at `class_path` ("package.module.Class"), imported
    when first asked for."""
    from verl.workers.rollout import base

    base._ROLLOUT_REGISTRY[(name, mode)] = class_path


class WorkerClassSwap:
    """Mixin before verl's PPOTrainer subclass: every Ray worker class verl maps a role to passes through
    `swap_worker_class` (the actor class as verl built it, `ray.remote(...)` of its worker) at set-up."""

    def swap_worker_class(self, actor_class):
        raise NotImplementedError

    def _init_resource_pool_mgr(self):
        super()._init_resource_pool_mgr()
        for role, actor_class in list(self.role_worker_mapping.items()):
            self.role_worker_mapping[role] = self.swap_worker_class(actor_class)
