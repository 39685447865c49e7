"""verl's training-engine interface on the mlite runtime (backend `mlite`, model type `language_model`).

verl hands the engine a TensorDict of unpadded sequences (jagged `input_ids`, `position_ids`, `loss_mask`,
...) and a loss function that reads `model_output["log_probs"]` (and `"entropy"`) as jagged tensors aligned
with the inputs: position t holds log p(token t+1). The engine converts each micro-batch to mlite's
`PackedBatch`, lets the runtime run the forward (and backward), and hands verl's loss the per-token tensors.
Everything else (optimizer, schedule, checkpoints, weight export, moving state to the host and back for
verl's offload) is the runtime's; what only verl needs of it (one micro-batch with verl's loss, verl's
device names mapped onto the runtime's offload) lives here, on the runtime's public methods.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.engine.base import BaseEngine, BaseEngineCtx
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

from mlite.config import job_from_dict
from mlite.errors import MliteError
from mlite.integrations.verl.config_schema import MliteEngineConfig, to_job_dict
from mlite.runtime.data.packed import IGNORE, PackedBatch
from mlite.runtime.layout import COMPUTE_DTYPES
from mlite.runtime.parallel.step import host_number

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


def refuse_lora(model_config) -> None:
    """LoRA keys would do nothing here: full weights would train, and verl's trainer, seeing LoRA, would
    take the reference log-probs from the actor with its adapter "disabled" (a KL of 0). verl's FSDP engine
    reads `lora_rank`, its Megatron engine `lora.rank`, both `lora_adapter_path`."""
    lora = getattr(model_config, "lora", None) or {}
    if (getattr(model_config, "lora_rank", 0) or 0) > 0:
        key, fix, engine = f"lora_rank={model_config.lora_rank}", "set model.lora_rank=0", "fsdp"
    elif (lora.get("rank", 0) or 0) > 0:
        key, fix, engine = f"lora.rank={lora['rank']}", "remove model.lora.rank", "megatron"
    elif getattr(model_config, "lora_adapter_path", None):
        key, fix, engine = "lora_adapter_path", "remove model.lora_adapter_path", "fsdp"
    else:
        return
    name = key.split("=")[0]
    raise MliteError(
        f"model.{key}: the mlite engine trains full weights only, LoRA is not supported yet; {fix} "
        f"(actor_rollout_ref.model.{name} under main_ppo) or use the {engine} engine"
    )


def weight_sync_dtype(compute: str, device_type: str) -> torch.dtype:
    """The dtype of the weight stream to the rollout: the one the runtime computes in (engine.dtype on
    GPUs, bf16 normally), which is the one the rollout generates in. rollout.name=mlite holds its copy in
    it, and vLLM casts its bf16 weights on load anyway, so a bf16 stream halves the transfer and the host
    copy. On CPU the runtime computes in fp32 whatever engine.dtype says, and so does the built-in rollout:
    a bf16 stream there would round the rollout's weights below the trainer's."""
    return COMPUTE_DTYPES[compute] if device_type == "cuda" else torch.float32


def move_state(runtime, device: str | torch.device, model: bool = True, optimizer: bool = True) -> None:
    """Move parameters (with their grads) and/or the optimizer state (not Adam's step counts) to `device`,
    e.g. to the host while the rollout generates: the runtime's own device reloads what an offload moved
    (`Runtime.reload_to_device`), any other is an offload onto it (`Runtime.offload_to_host`). verl names
    the accelerator by type ("cuda"): that is the runtime's own device, index included."""
    target = torch.device(device)
    if target.type == runtime.device.type and target.index in (None, runtime.device.index):
        runtime.reload_to_device(weights=model, grads=model, optimizer=optimizer)
    else:
        runtime.offload_to_host(weights=model, grads=model, optimizer=optimizer, host=target)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


SAVE_CONTENTS = ("model", "optimizer", "extra", "hf_model")


def save_contents(checkpoint_config) -> set[str]:
    """verl's checkpoint.save_contents (default model, optimizer, extra); a name verl's engines do not know
    is refused, as it would silently save nothing."""
    contents = getattr(checkpoint_config, "save_contents", None) or ["model", "optimizer", "extra"]
    unknown = sorted(set(contents) - set(SAVE_CONTENTS))
    if unknown:
        raise MliteError(f"checkpoint.save_contents: {unknown[0]!r} is not one of {', '.join(SAVE_CONTENTS)}")
    return set(contents)


def shard_export(runtime, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor, Any]]:
    """verl's shard-export contract (verl.workers.engine.spec) on mlite's rank-local weight sync
    (mlite.runtime.ckpt.sync): one entry per HF tensor of the whole model, in the same order on every rank
    (verl pairs its gathers per entry), holding this rank's pieces of it flattened into one tensor, their
    boxes in the HF tensor as the spec's explicit placement (a BlockPlacement, or a tuple of them when a
    rank sends several pieces of one tensor). A rank that sends none of a tensor yields an empty entry that
    does not contribute. Entries are in HF names and coordinates already, so no converter rides the spec;
    the gather group is the world, since any rank may hold a piece (pipeline stages, experts)."""
    from verl.workers.engine.spec import BlockPlacement, ShardSpec

    from mlite.runtime.ckpt.sync import lockstep_shards

    dist = torch.distributed
    group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
    runtime.weights_current()
    for name, shape, out_dtype, pieces in lockstep_shards(runtime.held_models(), dtype):
        if not pieces:
            yield name, torch.empty(0, dtype=out_dtype, device=runtime.device), ShardSpec(
                full_shape=shape, place=0, gather_group=group, contributes=False)
            continue
        blocks = tuple(BlockPlacement(tuple(p.tensor.shape), p.offsets, shape) for p in pieces)
        local = torch.cat([p.tensor.reshape(-1) for p in pieces])
        yield name, local, ShardSpec(full_shape=shape, place=blocks[0] if len(blocks) == 1 else blocks,
                                     gather_group=group, contributes=True)


def hf_delta_entry(name: str, spec, place, lidx: torch.Tensor, lval: torch.Tensor):
    """verl's per-entry delta builder for `shard_export`'s entries: the changed positions of this rank's
    flattened pieces -> flat positions in HF tensor `name`, its only slot."""
    from verl.workers.engine.spec import translate_flat_indices

    gidx = lidx
    if lidx.numel() and not isinstance(place, int):
        gidx, start = torch.empty_like(lidx), 0
        for block in place if isinstance(place, tuple) else (place,):
            end = start + math.prod(block.local_shape)
            mine = (lidx >= start) & (lidx < end)
            gidx[mine] = translate_flat_indices(lidx[mine] - start, block)
            start = end
    counts = torch.tensor([gidx.numel()], dtype=torch.int64)
    return ([(name, tuple(spec.full_shape))], str(lval.dtype).removeprefix("torch."), counts,
            gidx.to(torch.int32), lval)


class MliteEngine(BaseEngine):
    def __init__(self, model_config, engine_config: MliteEngineConfig, optimizer_config, checkpoint_config):
        super().__init__()
        refuse_lora(model_config)  # before anything is built
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config
        self.runtime = None
        self.mode: str | None = None

    # ------------------------------------------------------------------------------------ lifecycle
    def job_dict(self) -> dict[str, Any]:
        total = (
            getattr(self.optimizer_config, "total_training_steps", None) if self.optimizer_config else None
        )
        # the longest sequence verl may hand us: the model's context (its data config is not ours to see)
        seq_len = getattr(self.model_config.hf_config, "max_position_embeddings", None)
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        return to_job_dict(
            self.engine_config, self.model_config.local_path, self.optimizer_config, total, seq_len, world
        )

    def initialize(self):
        from mlite.runtime.engine import Runtime

        self.runtime = Runtime(job_from_dict(self.job_dict()))

    # what verl's workers read of an engine besides its methods: the module trained (restored in place by
    # the separation workers) and the torch optimizer (step-time lr/betas of the split-step worker)
    @property
    def module(self) -> torch.nn.Module:
        return self._built().model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._built().optim.optimizer

    def _built(self):
        if self.runtime is None:  # as verl's engines: no such attribute before initialize()
            raise AttributeError(
                "the mlite engine builds its model and optimizer in initialize(); call it first"
            )
        return self.runtime

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
    # verl asks for ranks before `initialize` builds the runtime: until then they come from the layout
    # itself (`ParallelDims.coordinates`, the rank order the meshes are built in).
    def _coords(self) -> dict[str, int]:
        from mlite.runtime.parallel.mesh import ParallelDims

        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        dims = ParallelDims.from_job(job_from_dict(self.job_dict()), world)
        return {**dims.coordinates(rank), "dp_size": dims.dp, "pp_size": dims.pp}

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
        if not forward_only and self.runtime.dims.cp > 1:
            # verl's losses read whole sequences; a cp rank holds a zigzag share of each (log-probs come back
            # whole, but without the gradient link to the other ranks' shares)
            raise MliteError(
                f"context_parallel_size={self.runtime.dims.cp}: training through verl's loss under context "
                "parallel is not supported by the mlite engine yet (log-probs and inference are); set "
                "context_parallel_size=1 for the actor"
            )
        # global normalisers, as verl's own engines compute them
        batch_num_tokens = data["loss_mask"].sum().to(self.runtime.device)
        group = self.get_data_parallel_group()
        if group is not None:
            torch.distributed.all_reduce(batch_num_tokens, group=group)
        tu.assign_non_tensor(
            data, batch_num_tokens=batch_num_tokens.item(), dp_size=self.get_data_parallel_size()
        )
        micro_batches, indices = prepare_micro_batches(data=data, dp_group=group, same_micro_num_in_dp=True)
        # as verl's FSDP engine: a training step keeps the per-token outputs only when the caller asks (they
        # grow with the mini-batch); inference always returns them
        keep_output = forward_only or bool(tu.get_non_tensor_data(data, "return_model_output", False))
        # one optimizer step over the micro-batches: the gradients are reduced in the last one's backward
        outputs = [self._micro_step(mb, loss_function, forward_only, keep_output, i == len(micro_batches) - 1)
                   for i, mb in enumerate(micro_batches)]
        return postprocess_batch_func(output_lst=outputs, indices=indices, data=data)

    def _micro_step(
        self, micro_batch: TensorDict, loss_function: Callable | None, forward_only: bool, keep_output: bool,
        ends_step: bool,
    ) -> dict:
        """One micro-batch through the runtime with verl's loss, which reads jagged per-token tensors."""
        # verl hands the batch over on the host; its loss reads it beside our outputs (verl's FSDP engine
        # moves it the same way)
        micro_batch = micro_batch.to(self.runtime.device)
        batch = packed_from_jagged(micro_batch)
        offsets = micro_batch["input_ids"].offsets()
        temperature = float(tu.get_non_tensor_data(micro_batch, "temperature", 1.0) or 1.0)
        want_entropy = bool(tu.get_non_tensor_data(micro_batch, "calculate_entropy", False))

        def jagged(per_token: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
            # under tp the runtime pads the stream to a multiple of tp: those positions are no sequence's
            n = batch.num_tokens
            return {
                k: torch.nested.nested_tensor_from_jagged(v[:n], offsets)
                for k, v in per_token.items()
                if v is not None
            }

        def verl_loss(_share, logprobs, entropy, _aux_loss):
            model_output = jagged({"log_probs": logprobs, "entropy": entropy})
            return loss_function(
                model_output=model_output, data=micro_batch, dp_group=self.get_data_parallel_group()
            )

        (out,) = self.runtime.forward_backward(
            [batch],
            verl_loss if loss_function is not None else None,
            forward_only=forward_only,
            with_entropy=want_entropy,
            temperature=temperature,
            ends_step=ends_step,
        )
        loss = 0.0 if out["loss"] is None else float(out["loss"])  # verl reads numbers
        result = {"loss": loss, "metrics": {key: host_number(value) for key, value in out["metrics"].items()}}
        if keep_output:  # the runtime's whole-stream outputs: on every rank, whatever the layout
            result["model_output"] = jagged({"log_probs": out["logprobs"], "entropy": out["entropy"]})
        return result

    # ------------------------------------------------------------------------------- state & export
    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        super().to(device=device, model=model, optimizer=optimizer, grad=grad)
        move_state(self.runtime, device, model=model, optimizer=optimizer)

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        """verl's checkpoint contract. `local_path` (verl's `global_step_N/actor`) gets the mlite checkpoint
        under `mlite/` (model, optimizer, schedule and RNG together: it is written when save_contents names
        any of model, optimizer or extra) and, when save_contents names hf_model, an HF export under
        `huggingface/` with the tokenizer, written by rank 0 from the pieces every rank sends it (any layout,
        pipeline stages too). Then only the newest `max_ckpt_to_keep` of this engine's saves are kept: rank 0
        removes the older ones once the new one is complete, so a failed save never leaves fewer."""
        contents = save_contents(self.checkpoint_config)
        if contents & {"model", "optimizer", "extra"}:
            self.runtime.save_checkpoint(
                os.path.join(local_path, "mlite"), extra_state={"global_step": global_step}
            )
        if "hf_model" in contents:
            self._save_hf_model(os.path.join(local_path, "huggingface"))
        self._keep_newest(local_path, max_ckpt_to_keep)

    def _save_hf_model(self, path: str) -> None:
        from mlite.runtime.ckpt.sync import export_hf

        rt = self.runtime
        if _rank() == 0:
            shutil.rmtree(path, ignore_errors=True)  # a step saved again: its export is replaced
        config = None if rt.job.model.name is not None else rt.hf_config  # presets: from the arch
        rt.weights_current()
        out = export_hf(rt.held_models(), rt.arch, path, config=config)
        tokenizer = getattr(self.model_config, "tokenizer", None)
        if out is not None and tokenizer is not None:
            tokenizer.save_pretrained(str(out))

    def _keep_newest(self, local_path: str, keep: int | None) -> None:
        """verl's rotation (`max_ckpt_to_keep`; None or 0 keeps all): over the saves of this engine, in the
        order made; a path saved again counts as its newest save."""
        path = os.path.abspath(local_path)
        self._saved_paths = [p for p in getattr(self, "_saved_paths", []) if p != path] + [path]
        if not keep or keep <= 0:
            return
        old, self._saved_paths = self._saved_paths[:-keep], self._saved_paths[-keep:]
        if _rank() == 0:
            for stale in old:
                logger.info("max_ckpt_to_keep=%d: removing %s", keep, stale)
                shutil.rmtree(stale, ignore_errors=True)

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        self.runtime.load_checkpoint(os.path.join(local_path, "mlite"))

    def get_per_tensor_param(self, **kwargs) -> tuple[Iterator[tuple[str, torch.Tensor]], None]:
        """HF-named full tensors in the rollout's dtype (`weight_sync_dtype`), and no PEFT config (LoRA is
        refused at construction), as verl's engines return. Every rank gets every tensor whole, one at a
        time, from the ranks that hold its pieces (`Runtime.tp_group_weights` at tp 1: any layout,
        pipeline stages included; collective, every rank drains it)."""
        dtype = weight_sync_dtype(self.runtime.job.precision.compute, self.runtime.device.type)
        return self.runtime.tp_group_weights(dtype, 1), None

    def get_per_tensor_param_shard(self, **kwargs) -> tuple[Iterator[tuple[str, torch.Tensor, Any]], None]:
        """verl's sharded export: each rank's own pieces of every HF tensor, nothing gathered
        (`shard_export`), in the rollout's dtype."""
        dtype = weight_sync_dtype(self.runtime.job.precision.compute, self.runtime.device.type)
        return shard_export(self.runtime, dtype), None

    def get_per_tensor_param_delta_shard(self, **kwargs):
        """verl's delta sync (checkpoint engine `delta_sharded`): the changes of each rank's pieces since the
        last export, diffed against this rank's snapshot of them (primed by verl through
        `prime_delta_snapshots`), as HF positions (`hf_delta_entry`)."""
        from verl.workers.engine.utils import hf_delta_export

        self._delta_shard_snap = getattr(self, "_delta_shard_snap", {})
        gen, _ = self.get_per_tensor_param_shard()
        return hf_delta_export(gen, self._delta_shard_snap, hf_delta_entry), None


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
