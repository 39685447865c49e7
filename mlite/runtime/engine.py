"""The runtime: what trainers (SFT, GRPO) and the verl plug-in drive. It owns the model, the device and
precision, the parallel layout, the optimizer and the LR schedule; models only declare parameters.

    rt = Runtime(job)
    outs = rt.forward_backward(micro_batches, loss_fn)       # per micro-batch: loss, metrics, log-probs
    grad_norm, skipped = rt.optimizer_step()                  # clip; skip (and count) a non-finite norm
    rt.lr_scheduler_step(); rt.zero_grad()
    rt.save_checkpoint(dir, extra_state) / rt.load_checkpoint(dir) -> extra_state
    for hf_name, tensor in rt.export_weights(): ...           # a stream, for export and rollout weight sync

Each concern lives in its own module, and this class only holds them together:
- mlite.runtime.layout: the rule book's verdict, device, process group, meshes, the parallelized model;
- mlite.runtime.forward: the step's forward and backward over micro-batches, on any layout;
- mlite.runtime.backends: the optimizer backend (optimizer.backend: fsdp2 or dist_opt), one object that owns
  the optimizer, gradient reduction, checkpoint state, rollout weights and host offload;
- mlite.runtime.state: RNG, checkpoints, weight snapshots (the GRPO reference policy) and export.

Precision: parameters and optimizer state are fp32 (the master weights) unless `precision.master: bf16`
(GPUs only: parameters, gradients and Adam state in bf16). On a GPU, `precision.compute: bf16` runs the
forward and backward in bf16 (autocast on one process, FSDP2's parameter cast on several). On CPU compute
is fp32. `precision.grad_reduce` is the dtype of the cross-rank gradient reduction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from mlite.config.arch import ModelArch, arch_from_hf_config
from mlite.config.schema import JobConfig
from mlite.runtime import forward, state
from mlite.runtime.backends import HeldModel, OptimizerBackend, build_backend
from mlite.runtime.ckpt import checkpoint as ckpt
from mlite.runtime.collection import StepCollection
from mlite.runtime.data.packed import PackedBatch
from mlite.runtime.layout import COMPUTE_DTYPES, build_parallel_model, hf_config_of, place
from mlite.runtime.optim import LRSchedule
from mlite.runtime.state import seed_everything

log = logging.getLogger(__name__)
__all__ = ["Runtime", "export_checkpoint"]


class Runtime:
    def __init__(self, job: JobConfig, total_steps: int | None = None, hf_config: dict | None = None,
                 on_placed: Callable[[], None] | None = None):
        """Plan the job for this world (the rule book's verdict, the memory estimate, every `auto` resolved:
        mlite.runtime.layout.place), then build this rank's share of the model from that plan, laid out
        (random init from trainer.seed, the same under every layout, or HF weights when model.load_weights),
        and build the optimizer and the schedule. `self.job` is the plan's job: the one job of the run, its
        `auto`s resolved. `hf_config` overrides the model's config.json (export uses the copy in a
        checkpoint); `total_steps` is the schedule's length (default trainer.steps). `on_placed` runs on
        every rank once the process group is up, before the model is built (the trainers lock their output
        folder there, so a refused job stops before its longest start-up phase)."""
        self.hf_config = hf_config if hf_config is not None else hf_config_of(job)
        self.arch: ModelArch = arch_from_hf_config(self.hf_config, name=job.model.name or "")
        self.placement = place(job, self.arch)
        self.plan = self.placement.plan
        self.job = job = self.plan.job  # the job as planned: what everything below is built from
        if on_placed is not None:
            try:
                on_placed()
            except BaseException:
                self.placement.close(clean=False)
                raise
        self.device, self.dims, self.mesh = self.placement.device, self.placement.dims, self.placement.mesh
        compute = self.plan.compute_dtype
        if compute != job.precision.compute:
            log.info("precision.compute %s applies on GPUs; this CPU run computes in fp32",
                     job.precision.compute)
        if job.trainer.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=False)
        # bf16 master weights compute in bf16 without autocast; FSDP2 casts for compute on several ranks
        master = torch.bfloat16 if job.precision.master == "bf16" else torch.float32
        use_autocast = compute != "fp32" and self.mesh is None and master == torch.float32
        self.autocast_dtype = COMPUTE_DTYPES[compute] if use_autocast else None

        seed_everything(job.trainer.seed)  # the run's other random streams (initial weights: seeded_init)
        # built on the meta device and laid out there; each rank then materialises only its own shards
        # (mlite.runtime.layout.build_parallel_model), so no rank ever holds the whole model
        weights = job.model.path if job.model.load_weights and hf_config is None else None
        self.model, self.pipeline, self.chunks = build_parallel_model(self.placement, master, weights)
        # the optimizer backend (mlite.runtime.backends): the optimizer, gradient reduction, checkpoint state,
        # rollout weights and host offload, each the way optimizer.backend holds the parameters
        held = HeldModel(self.model, self.chunks or {0: self.model}, self.mesh, self.pipeline, self.arch,
                         self.device, job.model.attention_backend)
        self.optim: OptimizerBackend = build_backend(self.plan, held, self.dims)
        self.schedule = LRSchedule(self.optim.optimizer, job.optimizer, total_steps or job.trainer.steps)
        self.collection = StepCollection(job.trainer.gc_every)  # the collector on the step's schedule

    # ------------------------------------------------------------------------------------- layout
    @property
    def dp_rank(self) -> int:
        return self.placement.rank_in("dp")

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def dp_group(self):
        return self.mesh.group("dp") if self.mesh is not None else None

    @property
    def is_output_rank(self) -> bool:
        """The rank whose outputs (log-probs, metrics) are the step's: last pipeline stage, tp/cp rank 0."""
        return self.placement.is_output_rank

    def global_sum(self, value: float | torch.Tensor) -> float | torch.Tensor:
        """Sum a count (e.g. target tokens) or a step's loss over the loss group. A number comes back as a
        number (read back from the device); a tensor as a 0-dim fp64 tensor on the device, not read, so
        the host can queue the next step before this one ends (the loop reads it when it logs)."""
        group = self.placement.loss_group
        if group is None:
            return value
        tensor = isinstance(value, torch.Tensor)
        t = (value.detach().to(self.device, torch.float64, copy=True) if tensor
             else torch.tensor(float(value), dtype=torch.float64, device=self.device))
        torch.distributed.all_reduce(t, group=group)
        return t if tensor else t.item()

    def dp_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """Numbers summed (op "sum") or maximised ("max") over the data-parallel ranks, in one collective;
        the ranks of one dp rank (tp, cp, pp) hold the same numbers, so each is counted once."""
        if self.dp_size == 1 or not values:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        reduce_op = torch.distributed.ReduceOp.MAX if op == "max" else torch.distributed.ReduceOp.SUM
        torch.distributed.all_reduce(t, op=reduce_op, group=self.dp_group)
        return t.tolist()

    def close(self, clean: bool = True) -> None:
        """End the process group if this runtime started it (a no-op for one process); `clean=False`
        after an error (no closing barrier). Python's automatic garbage collection comes back on."""
        self.collection.close()
        self.placement.close(clean)

    # ---------------------------------------------------------------------------------- training
    def forward_backward(
        self,
        micro_batches: list[PackedBatch],
        loss_fn: forward.LossFn | None,
        forward_only: bool = False,
        with_entropy: bool = False,
        temperature: float = 1.0,
        ends_step: bool = True,
        aux_weights: list[float] | None = None,
    ) -> list[dict[str, Any]]:
        """Run each micro-batch forward (and backward unless forward_only); gradients accumulate
        (mlite.runtime.forward.forward_backward). `ends_step` False: another call adds micro-batches to
        this optimizer step, so the gradients are not reduced yet. `aux_weights`: each micro-batch's
        weight in the step's MoE balance loss (default: the mean over micro-batches and dp ranks)."""
        return forward.forward_backward(self, micro_batches, loss_fn, forward_only, with_entropy, temperature,
                                        ends_step, aux_weights)

    def set_gradient_sync(self, chunk: int, last: bool) -> None:
        """Whether the next backward through pipeline chunk `chunk` (0 without a pipeline) is the step's last:
        only then do FSDP2's units and dist_opt's buckets reduce, as that backward produces the gradients."""
        self.optim.set_gradient_sync(chunk, last)

    @property
    def reduce_every_micro_batch(self) -> bool:
        """Whether the backend reduces the gradients after every micro-batch (FSDP2 where the plan did not
        size whole gradients), not in the step's last backward only."""
        return self.optim.reduce_every_micro_batch

    def release_gathered(self) -> None:
        """After a pass without backward: whole weights the backend left gathered are freed."""
        self.optim.release_gathered()

    def zero_grad(self) -> None:
        self.optim.zero_grad()

    def optimizer_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip and update. Returns (grad norm before clipping, skipped) as 0-dim tensors (float() / bool()
        read them, which waits for the step); a non-finite norm skips the update, decided on the GPU where
        one GPU holds the whole model. Several ranks: FSDP2 has reduced the gradients; the norm is taken
        over every mesh (`grad_norm`). Then the garbage collector's turn, if this step has one
        (trainer.gc_every), while the GPU works through the queued update."""
        result = self.optim.step()
        self.collection.step()
        return result

    def weights_finite(self) -> bool:
        """Whether every weight of every rank is finite (a collective: each rank checks its own shards and
        pipeline stages). The loop asks before each save, so a checkpoint never holds NaN or inf."""
        finite = torch.ones((), dtype=torch.float32, device=self.device)
        for param in self.model.parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            finite = finite * torch.isfinite(local.detach()).all()
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
        return bool(finite.item())

    def set_total_steps(self, total_steps: int) -> None:
        """The schedule's length, when the trainer knows it only after reading the data (trainer.epochs)."""
        self.schedule.total_steps = total_steps
        self.schedule.step(0)

    def lr_scheduler_step(self) -> float:
        return self.schedule.step()

    @property
    def lr(self) -> float:
        return self.schedule.lr

    @property
    def skipped_steps(self) -> int | torch.Tensor:
        """Updates dropped for non-finite gradients in this process (a 0-dim tensor where counted on the
        GPU: int() reads it)."""
        return self.optim.skipped_steps

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()

    def weights_current(self) -> None:
        """Wait for the weights of the last step to land (dist_opt starts their all-gathers at the step and
        the next training forward waits for them layer by layer): whatever reads the weights otherwise
        calls this first."""
        self.optim.weights_current()

    def snapshot_weights(self) -> dict[str, torch.Tensor]:
        """This rank's shards of the current weights (mlite.runtime.state.snapshot_weights)."""
        self.weights_current()
        return state.snapshot_weights(self.model)

    def forward_with_weights(self, snapshot: dict[str, torch.Tensor], micro_batches: list[PackedBatch],
                             temperature: float = 1.0) -> list[dict[str, Any]]:
        """Forward-only log-probs of the snapshot's weights through this runtime's own path (layout,
        sequence split, vocab-parallel loss, pipeline): the GRPO reference policy on any layout."""
        self.weights_current()  # the swap writes into the weights' storage
        with state.swapped_weights(self.model, snapshot):
            return self.forward_backward(micro_batches, None, forward_only=True, temperature=temperature)

    def release_rollout_model(self) -> None:
        """Drop the rollout replica (after each rollout session: training does not hold it)."""
        self.optim.release_rollout_model()

    def rollout_model(self) -> torch.nn.Module:
        """The model the native sampler decodes with (mlite.trainers.grpo.rollout): the model itself on one
        process, else a plain replica of the current weights and buffers gathered once per rollout, from
        every pipeline stage too (mlite.runtime.backends.base.BackendBase.rollout_model)."""
        return self.optim.rollout_model()

    def held_models(self) -> list[torch.nn.Module]:
        """This rank's models that know their HF names: its pipeline chunks, or the model."""
        return self.optim.held_models()

    def reset_memory_peak(self) -> None:
        """Start a new peak for `memory_peak_gb` (on a GPU; nothing on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def memory_peak_gb(self) -> float | None:
        """GiB in use on this process's GPU at the peak since `reset_memory_peak`: what is in use now
        (torch's cache, CUDA context, NCCL, a rollout engine's pool) plus how far torch's allocator reached
        above its reservation now. None on the CPU."""
        if self.device.type != "cuda":
            return None
        above = torch.cuda.max_memory_reserved(self.device) - torch.cuda.memory_reserved(self.device)
        return device_used_gb(self.device) + above / 2**30

    def offload_to_host(self, weights: bool = True, grads: bool = True, optimizer: bool = True,
                        host: torch.device | str = "cpu") -> int:
        """Move this rank's weights, gradients and optimizer state to the host (e.g. while a rollout engine
        needs the GPU); `reload_to_device` brings them back (mlite.runtime.backends.base). Returns the bytes
        moved."""
        return self.optim.offload_to_host(weights, grads, optimizer, host)

    def reload_to_device(self, weights: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        self.optim.reload_to_device(weights, grads, optimizer)

    # ------------------------------------------------------------------------------ state & export
    def save_checkpoint(self, path: str | Path, extra_state: dict | None = None) -> Path:
        self.weights_current()
        return state.save_checkpoint(self, path, extra_state)

    def load_checkpoint(self, path: str | Path, weights_only: bool = False) -> dict:
        return state.load_checkpoint(self, path, weights_only)

    def export_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        self.weights_current()
        return state.export_weights(self, dtype)

    def weight_shards(self, dtype: torch.dtype | None = None) -> Iterator[Any]:
        """This rank's pieces of the HF tensors (HF name, piece, offsets, full shape) in `dtype`, for rollout
        weight sync: only what it holds, each element sent by one rank of the world (the backend's)."""
        return self.optim.weight_shards(dtype)

    def tp_group_weights(self, dtype: torch.dtype | None, tp_size: int, stats: dict | None = None,
                         expert_parallel: bool = False, v4_fp8: str | None = None
                         ) -> Iterator[tuple[str, torch.Tensor]]:
        """For a rollout engine of `tp_size` consecutive ranks (collective, every rank drains it): each HF
        tensor in full shape, holding the slab this rank's engine reads (NaN elsewhere); with
        `expert_parallel`, the engine's experts whole on the rank that holds them; `v4_fp8`:
        DeepSeek-V4 in vLLM's dtypes (mlite.runtime.ckpt.sync.vllm_send_as)."""
        return self.optim.tp_group_weights(dtype, tp_size, stats, expert_parallel, v4_fp8)


def device_used_gb(device: torch.device | None = None) -> float:
    """GiB in use on a GPU (default: the current one) by anyone: torch's cache, CUDA contexts, NCCL, a rollout
    engine's pool."""
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / 2**30


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """A training checkpoint (or a run dir: its newest good one) -> an HF checkpoint transformers loads.

    The model is rebuilt on the CPU from the job and config.json stored in the checkpoint, so neither the
    original weights nor a GPU are needed; tensors stream to the shards one at a time."""
    from mlite.config import job_from_dict
    from mlite.plan import for_another_world
    from mlite.runtime.ckpt.hf import save_hf_checkpoint

    path = ckpt.resolve_checkpoint(checkpoint)
    ckpt.verify_checkpoint(path)
    meta = ckpt.read_meta(path)
    job_dict = meta["job"]
    job_dict["trainer"]["device"] = "cpu"
    job_dict["optimizer"]["backend"] = "fsdp2"  # the format is the same for both; dist_opt needs GPUs
    job_dict["precision"]["fp8"] = "none"  # FP8 matmuls leave the weights as they are; the CPU has none
    job_dict["precision"]["fp8_all_gather"] = "auto"
    job_dict = for_another_world(job_dict)  # the run's resolved `auto`s, planned again for this process
    runtime = Runtime(job_from_dict(job_dict), hf_config=meta["hf_config"])
    runtime.load_checkpoint(path, weights_only=True)
    config = None if runtime.job.model.name is not None else meta["hf_config"]  # presets: from the arch
    return save_hf_checkpoint(runtime.export_weights(dtype), runtime.arch, out_dir, config=config,
                              dtype=dtype)
