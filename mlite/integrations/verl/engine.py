"""verl's training-engine interface on the mlite runtime (backend `mlite`, model type `language_model`).

verl hands the engine a TensorDict of unpadded sequences (jagged `input_ids`, `position_ids`, `loss_mask`,
...) and a loss function that reads `model_output["log_probs"]` (and `"entropy"`) as jagged tensors aligned
with the inputs: position t holds log p(token t+1). The engine converts each micro-batch to mlite's
`PackedBatch`, lets the runtime run the forward (and backward), and hands verl's loss the per-token tensors.
Everything else (optimizer, schedule, checkpoints, weight export) is the runtime's.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.engine.base import BaseEngine, BaseEngineCtx
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

from mlite.config import job_from_dict
from mlite.integrations.verl.config_schema import MliteEngineConfig, to_job_dict
from mlite.runtime.data.packed import IGNORE, PackedBatch

logger = logging.getLogger(__name__)


def packed_from_jagged(micro_batch: TensorDict) -> PackedBatch:
    """verl's jagged micro-batch -> PackedBatch: same token stream, labels = next token within a sequence."""
    input_ids = micro_batch["input_ids"]
    offsets = input_ids.offsets()
    tokens = input_ids.values().long()
    positions = micro_batch["position_ids"].values().long()
    labels = torch.roll(tokens, shifts=-1)
    labels[offsets[1:] - 1] = IGNORE  # the last token of each sequence predicts nothing
    lens = offsets.diff()
    return PackedBatch(
        input_ids=tokens,
        position_ids=positions,
        cu_seqlens=offsets.to(torch.int32),
        labels=labels,
        max_seqlen=int(lens.max()),
    )


class MliteEngine(BaseEngine):
    def __init__(self, model_config, engine_config: MliteEngineConfig, optimizer_config, checkpoint_config):
        super().__init__()
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config
        self.runtime = None
        self.mode: Optional[str] = None

    # ------------------------------------------------------------------------------------ lifecycle
    def job_dict(self) -> dict[str, Any]:
        total = (
            getattr(self.optimizer_config, "total_training_steps", None) if self.optimizer_config else None
        )
        return to_job_dict(self.engine_config, self.model_config.local_path, self.optimizer_config, total)

    def initialize(self):
        from mlite.runtime.engine import Runtime

        self.runtime = Runtime(job_from_dict(self.job_dict()))

    @property
    def is_param_offload_enabled(self) -> bool:
        return bool(self.engine_config.param_offload)

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return bool(self.engine_config.optimizer_offload)

    def train_mode(self, **kwargs):
        return _ModeCtx(self, "train", **kwargs)

    def eval_mode(self, **kwargs):
        return _ModeCtx(self, "eval", **kwargs)

    # ------------------------------------------------------------------------------ parallel layout
    # verl asks for ranks before `initialize` builds the runtime: until then they come from the layout's
    # rank order, (pp, dp, cp, tp) row-major as mlite.runtime.parallel.mesh builds it.
    def _coords(self) -> dict[str, int]:
        from mlite.runtime.parallel.mesh import ParallelDims

        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        dims = ParallelDims.from_job(job_from_dict(self.job_dict()), world)
        return {
            "pp": rank // (dims.dp * dims.cp * dims.tp),
            "dp": rank // (dims.cp * dims.tp) % dims.dp,
            "cp": rank // dims.tp % dims.cp,
            "tp": rank % dims.tp,
            "dp_size": dims.dp,
            "pp_size": dims.pp,
        }

    def get_data_parallel_rank(self):
        return self.runtime.dp_rank if self.runtime is not None else self._coords()["dp"]

    def get_data_parallel_size(self):
        return self.runtime.dp_size if self.runtime is not None else self._coords()["dp_size"]

    def get_data_parallel_group(self):
        if self.runtime is None:
            return None
        if self.runtime.mesh is not None:
            return self.runtime.dp_group
        # one rank: verl's workers still gather per-rank metrics over a group when a process group exists
        # (main_ppo's workers always join one), and the whole one-rank world is the dp group
        return torch.distributed.group.WORLD if torch.distributed.is_initialized() else None

    def is_mp_src_rank_with_outputs(self):
        if self.runtime is not None:
            return self.runtime.is_output_rank
        at = self._coords()
        return at["pp"] == at["pp_size"] - 1 and at["tp"] == 0 and at["cp"] == 0

    # --------------------------------------------------------------------------------- train steps
    def optimizer_zero_grad(self):
        self.runtime.zero_grad()

    def optimizer_step(self):
        grad_norm, _skipped = self.runtime.optimizer_step()
        return float(grad_norm)

    def lr_scheduler_step(self):
        return self.runtime.lr_scheduler_step()

    def forward_backward_batch(self, data: TensorDict, loss_function: Callable, forward_only=False):
        # global normalisers, as verl's own engines compute them
        batch_num_tokens = data["loss_mask"].sum().to(self.runtime.device)
        group = self.get_data_parallel_group()
        if group is not None:
            torch.distributed.all_reduce(batch_num_tokens, group=group)
        tu.assign_non_tensor(
            data, batch_num_tokens=batch_num_tokens.item(), dp_size=self.get_data_parallel_size()
        )
        micro_batches, indices = prepare_micro_batches(data=data, dp_group=group, same_micro_num_in_dp=True)
        outputs = [self._micro_step(mb, loss_function, forward_only) for mb in micro_batches]
        return postprocess_batch_func(output_lst=outputs, indices=indices, data=data)

    def _micro_step(
        self, micro_batch: TensorDict, loss_function: Optional[Callable], forward_only: bool
    ) -> dict:
        batch = packed_from_jagged(micro_batch)
        offsets = micro_batch["input_ids"].offsets()
        temperature = float(tu.get_non_tensor_data(micro_batch, "temperature", 1.0) or 1.0)
        want_entropy = bool(tu.get_non_tensor_data(micro_batch, "calculate_entropy", False))
        captured: dict[str, Any] = {}

        def verl_loss(logprobs: torch.Tensor, entropy: Optional[torch.Tensor]):
            model_output = {"log_probs": torch.nested.nested_tensor_from_jagged(logprobs, offsets)}
            if entropy is not None:
                model_output["entropy"] = torch.nested.nested_tensor_from_jagged(entropy, offsets)
            captured["model_output"] = {k: v.detach() for k, v in model_output.items()}
            if loss_function is None:
                return logprobs.sum() * 0, {}
            loss, metrics = loss_function(
                model_output=model_output, data=micro_batch, dp_group=self.get_data_parallel_group()
            )
            return loss, metrics

        loss, metrics = self.runtime.forward_backward_logprobs(
            batch, verl_loss, forward_only=forward_only, temperature=temperature, with_entropy=want_entropy
        )
        return {"model_output": captured["model_output"], "loss": float(loss), "metrics": metrics}

    # ------------------------------------------------------------------------------- state & export
    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        super().to(device=device, model=model, optimizer=optimizer, grad=grad)
        self.runtime.to(device, model=model, optimizer=optimizer)

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        self.runtime.save_checkpoint(
            os.path.join(local_path, "mlite"), extra_state={"global_step": global_step}
        )

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        self.runtime.load_checkpoint(os.path.join(local_path, "mlite"))

    def get_per_tensor_param(self, **kwargs):
        return self.runtime.export_weights(), None


class MliteEngineWithLMHead(MliteEngine):
    """The language-model engine verl's trainers ask for (`model_type="language_model"`)."""


class _ModeCtx(BaseEngineCtx):
    def __enter__(self):
        super().__enter__()
        if self.mode == "train":
            self.engine.runtime.train()
        else:
            self.engine.runtime.eval()

    def __exit__(self, exc_type, exc_value, traceback):
        if self.mode == "train" and (self.zero_grad_on_exit or exc_type is not None):
            self.engine.optimizer_zero_grad()
        super().__exit__(exc_type, exc_value, traceback)
