"""verl's SFT trainer with process-group setup that also works on CPU.

`python -m verl.trainer.sft_trainer` joins the process group with the backend string
"cpu:gloo,<device>:<backend>", which torch refuses when the device is the CPU ("Duplicate device type
cpu"). This entry point is the same Hydra program (verl's config, verl's `SFTTrainer`) with one
difference: on the CPU platform it joins with plain gloo first (verl then finds the group initialised).
On GPUs use verl's own module; both accept the same arguments:

    torchrun -m mlite.integrations.verl.sft_trainer hydra.searchpath=[pkg://mlite.integrations.verl.config] \
        engine=mlite trainer.device=cpu ...
"""

from __future__ import annotations

import os

from mlite.integrations.verl.platform_cpu import join_gloo


def join_process_group() -> None:
    import torch.distributed as dist
    from verl.utils.device import get_device_name

    if dist.is_initialized():
        return
    if get_device_name() == "cpu":
        join_gloo()
    else:
        from verl.utils.distributed import initialize_global_process_group

        initialize_global_process_group()


def main() -> None:
    os.environ.setdefault("VERL_PLATFORM", "cpu")  # only this entry point's purpose; GPUs use verl's module
    import hydra
    from verl.trainer.sft_trainer import SFTTrainer
    from verl.utils.distributed import destroy_global_process_group

    import mlite.integrations.verl  # noqa: F401  (registers engine=mlite and the cpu platform)

    @hydra.main(config_path="pkg://verl.trainer.config", config_name="sft_trainer_engine", version_base=None)
    def run(config) -> None:
        join_process_group()
        SFTTrainer(config=config).fit()
        destroy_global_process_group()

    run()


if __name__ == "__main__":
    main()
