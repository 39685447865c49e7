"""The runtime: what trainers (SFT, GRPO) and the verl plug-in drive. It owns the model, the device and
precision, the parallel layout, the optimizer and the LR schedule; models only declare parameters.

    rt = Runtime(job)
    outs = rt.forward_backward(micro_batches, loss_fn)       # per micro-batch: loss, metrics, log-probs
    grad_norm, skipped = rt.optimizer_step()                  # clip; skip (and count) a non-finite norm
    rt.lr_scheduler_step(); rt.zero_grad()
    rt.save_checkpoint(dir, extra_state) / rt.load_checkpoint(dir) -> extra_state
    for hf_name, tensor in rt.export_weights(): ...           # a stream, for export and rollout weight sync

`loss_fn(batch, token_logprobs, entropy, aux_loss) -> (loss, metrics)` returns this micro-batch's share of
the step's loss (normalised by global counts, see mlite.runtime.loss.sft_loss), so summing the gradients
over micro-batches and data-parallel ranks gives the exact gradient of the step's loss.

Precision: parameters and optimizer state are fp32 (the master weights) unless `precision.master: bf16`
(GPUs only: parameters, gradients and Adam state in bf16). On a GPU, `precision.compute: bf16` runs the
forward and backward in bf16 (autocast on one process, FSDP2's parameter cast on several). On CPU compute
is fp32. `precision.grad_reduce` is the dtype of the cross-rank gradient reduction.

Layout: every decision about devices, meshes and groups lives in `_setup_layout`; one process is the
layout with every degree 1 (`ParallelDims(world_size=1)`). Several ranks get the meshes of
`ParallelDims.build` and `parallelize_model` (TP+SP, recompute, CP, EP, FSDP2 over dp_cp); the loss is
reduced over the `dp_cp` group. What each rank computes of a micro-batch and how log-probs come back under
TP and CP: `forward_backward` and mlite.runtime.parallel.step.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import logging
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from mlite.config.arch import ModelArch, arch_from_hf_config
from mlite.config.schema import JobConfig
from mlite.errors import MliteError
from mlite.runtime.ckpt import checkpoint as ckpt
from mlite.runtime.data.packed import PackedBatch
from mlite.runtime.loss import token_logprobs
from mlite.runtime.models import build_model
from mlite.runtime.optim import LocalAdamW, LRSchedule
from mlite.runtime.parallel.mesh import ParallelDims
from mlite.runtime.parallel.parallelize import (
    apply_recompute,
    full_tensor,
    grad_norm,
    parallelize_model,
    set_gradient_sync,
)
from mlite.runtime.parallel.pipeline import PipelineRunner, keep_chunk, one_f_one_b, split_layers, stage_view
from mlite.runtime.parallel.pipeline import forward_only as forward_only_schedule
from mlite.runtime.parallel.step import (
    broadcast_outputs,
    gather_stream,
    local_share,
    real_token_mask,
    vocab_parallel_logprobs,
)

log = logging.getLogger(__name__)
LossFn = Callable[..., tuple[torch.Tensor, dict]]
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def pick_device(choice: str) -> torch.device:
    """trainer.device: auto (cuda when visible, else cpu), cpu or cuda (refused when no GPU is visible)."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise MliteError("trainer.device: cuda but no CUDA GPU is visible; run on a GPU node or set trainer.device=cpu")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def hf_config_of(job: JobConfig) -> dict[str, Any]:
    """The HF config.json dict of the job's model (a catalog preset or a local checkpoint)."""
    if job.model.name is not None:
        from mlite.config.catalog import PRESETS, preset_arch

        preset_arch(job.model.name)  # the catalog's own error for an unknown name
        return {**PRESETS[job.model.name]}
    path = Path(job.model.path)
    config = path if path.name == "config.json" else path / "config.json"
    if not config.is_file():
        raise MliteError(f"model.path {job.model.path}: no config.json there; point it at an HF checkpoint dir")
    return json.loads(config.read_text())


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    state["numpy"] = {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos, "has_gauss": has_gauss, "gauss": gauss}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np_state = state["numpy"]
    np.random.set_state(("MT19937", np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


class Runtime:
    def __init__(self, job: JobConfig, total_steps: int | None = None, hf_config: dict | None = None):
        """Build the model (random init from trainer.seed, or HF weights when model.load_weights), the
        optimizer and the schedule. `hf_config` overrides the model's config.json (export uses the copy in a
        checkpoint); `total_steps` is the schedule's length (default trainer.steps)."""
        self.job = job
        self.device = pick_device(job.trainer.device)
        compute = job.precision.compute if self.device.type == "cuda" else "fp32"
        if compute != job.precision.compute:
            log.info("precision.compute %s applies on GPUs; this CPU run computes in fp32", job.precision.compute)
        if job.trainer.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=False)
        self.hf_config = hf_config if hf_config is not None else hf_config_of(job)
        self.arch: ModelArch = arch_from_hf_config(self.hf_config, name=job.model.name or "")
        self._setup_layout()
        # bf16 master weights compute in bf16 without autocast; FSDP2 casts for compute on several ranks
        master = torch.bfloat16 if job.precision.master == "bf16" else torch.float32
        use_autocast = compute != "fp32" and self.mesh is None and master == torch.float32
        self.autocast_dtype = COMPUTE_DTYPES[compute] if use_autocast else None

        seed_everything(job.trainer.seed)  # same initial weights on every rank and every run
        self.model = build_model(self.arch, job.model.attention_backend, dtype=torch.float32, device=self.device)
        if job.model.load_weights and hf_config is None:
            from mlite.runtime.ckpt.hf import load_hf_weights

            load_hf_weights(self.model, job.model.path, torch.float32)
        self.model.to(master)
        self.pipeline = None
        self._rollout_replica = None  # built on the first rollout_model() of a parallelized model
        if self.dims.pp > 1:
            self.pipeline, self.chunks = self._build_pipeline(master)
            self.model = stage_view(self.chunks)  # this rank's parameters under the whole model's names
        elif self.mesh is not None:
            parallelize_model(self.model, self.mesh, job, self.device.type)
        else:
            rc = job.recompute
            apply_recompute(self.model, rc.granularity, rc.method, rc.num_layers)
        self.optim = LocalAdamW(self.model.parameters(), job.optimizer,
                                grad_norm_fn=grad_norm if self.mesh is not None else None)
        self.schedule = LRSchedule(self.optim.optimizer, job.optimizer, total_steps or job.trainer.steps)

    # ------------------------------------------------------------------------------------- layout
    def _setup_layout(self) -> None:
        """Degrees, meshes and groups. One process: all degrees 1, no process group. Several ranks (torchrun
        or srun set WORLD_SIZE): the process group is started here and the meshes of `ParallelDims.build`
        are made; the model is parallelized after it is built (`__init__`)."""
        self.owns_process_group = not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1
        if self.owns_process_group:
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.dims = ParallelDims.from_job(self.job, world)
        refuse_inapplicable_keys(self.job, self.dims, self.device.type)
        self.mesh, self.loss_group = None, None  # loss group: where the loss's token counts are summed
        if world == 1:
            return
        if self.dims.pp > 1 and self.arch.moe is not None:
            raise MliteError(
                f"parallel.pp={self.dims.pp} with a MoE model: the runtime does not weight the pipelined balance "
                "loss yet; set parallel.pp: 1 and use ep, tp, cp or data parallel for MoE models"
            )
        self.mesh = self.dims.build(self.device.type)
        self.loss_group = self.mesh.group("dp_cp")

    def _build_pipeline(self, dtype: torch.dtype):
        """This pp rank's chunks of the model (chunk c of pp*vpp lives on rank c % pp), each parallelized
        like a whole model, and the runner that moves activations between them."""
        dims, par = self.dims, self.job.parallel
        split = split_layers(self.arch.num_layers, dims.pp, dims.vpp, par.pp_first_stage_layers,
                             par.pp_last_stage_layers)
        pp_rank = self.mesh.rank_in("pp")
        chunks = {}
        for c in range(pp_rank, dims.pp * dims.vpp, dims.pp):
            chunk = keep_chunk(copy.deepcopy(self.model), split[c], c == 0, c == len(split) - 1)
            chunks[c] = parallelize_model(chunk, self.mesh, self.job, self.device.type)
        runner = PipelineRunner(chunks, dims.pp * dims.vpp, dist.get_process_group_ranks(self.mesh.group("pp")))
        runner.activation_dtype = COMPUTE_DTYPES[self.job.precision.compute] if self.device.type == "cuda" else dtype
        return runner, chunks

    @property
    def dp_rank(self) -> int:
        return self.mesh.rank_in("dp") if self.mesh is not None else 0

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def dp_group(self):
        return self.mesh.group("dp") if self.mesh is not None else None

    @property
    def is_output_rank(self) -> bool:
        """The rank whose outputs (log-probs, metrics) are the step's: last pipeline stage, tp/cp rank 0."""
        if self.mesh is None:
            return True
        return (self.mesh.rank_in("pp") == self.dims.pp - 1 and self.mesh.rank_in("tp") == 0
                and self.mesh.rank_in("cp") == 0)

    def global_sum(self, value: float) -> float:
        """Sum a count (e.g. target tokens) over the loss group: the normaliser of an exact global mean."""
        if self.loss_group is None:
            return value
        t = torch.tensor(float(value), dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.loss_group)
        return t.item()

    # ---------------------------------------------------------------------------------- training
    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def forward_backward(
        self,
        micro_batches: list[PackedBatch],
        loss_fn: LossFn | None,
        forward_only: bool = False,
        with_entropy: bool = False,
        temperature: float = 1.0,
    ) -> list[dict[str, Any]]:
        """Run each micro-batch forward (and backward unless forward_only); gradients accumulate.

        Per micro-batch: {"loss", "metrics", "logprobs" [T], "entropy" [T] or None, "num_tokens"}; log-probs
        of IGNORE labels are 0. With loss_fn None (forward_only), only the log-probs are computed."""
        if loss_fn is None and not forward_only:
            raise ValueError("forward_backward needs a loss_fn unless forward_only")
        if self.pipeline is not None:
            return self._forward_backward_pipeline(micro_batches, loss_fn, forward_only, with_entropy, temperature)
        outputs = []
        for i, full in enumerate(micro_batches):
            full = full.to(self.device)
            if self.mesh is not None and not forward_only:  # one gradient reduction per step, on the last
                set_gradient_sync(self.model, i == len(micro_batches) - 1)
            batch = local_share(full, self.mesh)
            real = real_token_mask(batch, full)
            with torch.set_grad_enabled(not forward_only), self._autocast(), self._vocab_parallel():
                out = self.model(batch)
                logprobs, entropy = self._token_logprobs(out.hidden, batch.labels, temperature, with_entropy,
                                                         real=real)
                loss, metrics = (
                    loss_fn(batch, logprobs, entropy, self._aux_share(out.aux_loss)) if loss_fn else (None, {})
                )
                if not forward_only:
                    loss.backward()
            if self.dims.cp > 1:  # the trainer gets the whole stream on every cp rank
                group = self.mesh.group("cp")
                logprobs = gather_stream(logprobs, batch, full, group)
                entropy = gather_stream(entropy, batch, full, group) if entropy is not None else None
            elif batch.num_tokens != full.num_tokens:  # sequence-parallel padding
                logprobs = logprobs[: full.num_tokens]
                entropy = entropy[: full.num_tokens] if entropy is not None else None
            outputs.append({
                "loss": float(loss.detach()) if loss is not None else None,
                "metrics": metrics,
                "logprobs": logprobs.detach(),
                "entropy": entropy.detach() if entropy is not None else None,
                "num_tokens": int(real.sum()),
            })
        return outputs

    def _forward_backward_pipeline(self, micro_batches, loss_fn, forward_only, with_entropy, temperature):
        """pp > 1: the 1F1B schedule (interleaved with vpp > 1) for training, the forward-only schedule
        otherwise. The last stage computes log-probs and the loss; its per-micro-batch outputs are then
        broadcast over `pp`, so every rank returns the same outputs as without a pipeline."""
        dims, chunks = self.dims, self.chunks
        fulls = [b.to(self.device) for b in micro_batches]
        shares = [local_share(b, self.mesh) for b in fulls]
        last_chunk = dims.pp * dims.vpp - 1
        computed = {}  # micro-batch -> (loss, metrics, logprobs, entropy), on the last stage
        index = {id(b): m for m, b in enumerate(shares)}
        no_aux = torch.zeros((), device=self.device)  # refused for MoE: dense models have no balance loss

        def last_stage(chunk, hidden, batch):
            m = index[id(batch)]
            logprobs, entropy = self._token_logprobs(hidden, batch.labels, temperature, with_entropy,
                                                     real_token_mask(batch, fulls[m]), chunk.compute_logits)
            loss, metrics = loss_fn(batch, logprobs, entropy, no_aux) if loss_fn else (None, {})
            computed[m] = (loss, metrics, logprobs.detach(), entropy)
            return loss

        pp_rank = self.mesh.rank_in("pp")
        with self._autocast(), self._vocab_parallel():
            if forward_only:
                with torch.no_grad():
                    actions = forward_only_schedule(dims.pp, dims.vpp, pp_rank, len(shares))
                    result = self.pipeline.run(actions, shares, dtype=self.pipeline.activation_dtype)
                    if last_chunk in chunks:
                        for m, hidden in result["outputs"].items():
                            last_stage(chunks[last_chunk], hidden, shares[m])
            else:
                for chunk in chunks.values():
                    set_gradient_sync(chunk, False)
                self.pipeline.run(
                    one_f_one_b(dims.pp, dims.vpp, pp_rank, len(shares)), shares, loss_fn=last_stage,
                    before_backward=lambda c, last: set_gradient_sync(chunks[c], last),
                    dtype=self.pipeline.activation_dtype,
                )
        outputs = []
        for m, (full, share) in enumerate(zip(fulls, shares)):
            loss, metrics, logprobs, entropy = broadcast_outputs(
                computed.get(m), share.num_tokens, with_entropy, self.mesh, self.device
            )
            if dims.cp > 1:
                group = self.mesh.group("cp")
                logprobs = gather_stream(logprobs, share, full, group)
                entropy = gather_stream(entropy, share, full, group) if entropy is not None else None
            elif share.num_tokens != full.num_tokens:
                logprobs = logprobs[: full.num_tokens]
                entropy = entropy[: full.num_tokens] if entropy is not None else None
            outputs.append({"loss": loss, "metrics": metrics, "logprobs": logprobs, "entropy": entropy,
                            "num_tokens": int(real_token_mask(share, full).sum())})
        return outputs

    def _vocab_parallel(self):
        """Under tp the LM head's logits are split by vocabulary: the loss and its backward run under
        loss_parallel (mlite.runtime.parallel.step.vocab_parallel_logprobs)."""
        if self.dims.tp == 1:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def _token_logprobs(self, hidden, labels, temperature, with_entropy, real, compute_logits=None):
        """Log-probs (0 where IGNORE, padding included) and entropy (0 on padding) of a share's tokens."""
        compute_logits = compute_logits or self.model.compute_logits
        if self.dims.tp > 1:
            logprobs, entropy = vocab_parallel_logprobs(hidden, labels, compute_logits, temperature, with_entropy)
        else:
            logprobs, entropy = token_logprobs(hidden, labels, compute_logits, temperature, with_entropy)
        if entropy is not None and not bool(real.all()):
            entropy = entropy * real
        return logprobs, entropy

    def _aux_share(self, aux_loss: torch.Tensor) -> torch.Tensor:
        """The MoE balance loss as the loss_fn sees it. Under cp x tp each rank holds 1/(cp*tp) of the
        micro-batch's value and back-propagates that share (the router statistics are summed over cp_tp).
        Its value is scaled by tp, gradient unchanged, so that, like the token losses (whole on every tp
        rank, split over cp), the returned losses sum over the loss group (dp_cp) to the step's loss."""
        if self.dims.tp == 1:
            return aux_loss
        return aux_loss + (aux_loss * (self.dims.tp - 1)).detach()

    def forward_backward_logprobs(
        self, batch: PackedBatch, loss_fn: Callable, forward_only: bool = False, temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> tuple[float, dict]:
        """One micro-batch with a loss of (token_logprobs, entropy) only: the verl plug-in's call."""
        (out,) = self.forward_backward(
            [batch], lambda b, lp, ent, aux: loss_fn(lp, ent), forward_only, with_entropy, temperature
        )
        return out["loss"], out["metrics"]

    def zero_grad(self) -> None:
        self.optim.zero_grad()

    def optimizer_step(self) -> tuple[float, bool]:
        """Clip and update. Returns (grad norm before clipping, skipped); a non-finite norm skips the update.
        Several ranks: FSDP2 has reduced the gradients; the norm is taken over every mesh (`grad_norm`)."""
        return self.optim.step()

    def close(self) -> None:
        """End the process group if this runtime started it (a no-op for one process)."""
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_process_group = False

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
    def skipped_steps(self) -> int:
        return self.optim.skipped_steps

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()

    def rollout_model(self) -> torch.nn.Module:
        """The model the native sampler decodes with (mlite.trainers.grpo.rollout). A parallelized model
        holds DTensor shards behind FSDP hooks that expect the whole model's forward, while decode calls
        the embedding and layers itself and each rank stops at its own step, so gathering per call would
        pair collectives unevenly. Instead the current weights are gathered once per rollout into a plain
        replica: one collective per parameter, the same on every rank. The replica costs one unsharded
        copy of the model per rank: large models roll out with vLLM (rollout.engine=vllm). Pipeline stages
        hold part of the model, and decode refuses them."""
        if self.mesh is None or self.pipeline is not None:
            return self.model
        if self._rollout_replica is None:
            self._rollout_replica = build_model(
                self.arch, self.job.model.attention_backend, dtype=torch.float32, device=self.device
            )
        replica = dict(self._rollout_replica.named_parameters())
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                replica[name].data = full_tensor(param.detach()).to(self.device)
        return self._rollout_replica.eval()

    def to(self, device: str | torch.device, model: bool = True, optimizer: bool = True) -> None:
        """Move parameters (and their grads) and/or optimizer state, e.g. to the CPU while vLLM generates."""
        device = torch.device(device) if str(device) != "cuda" else self.device
        if model:
            for p in self.model.parameters():
                p.data = p.data.to(device)
                if p.grad is not None:
                    p.grad = p.grad.to(device)
        if optimizer:
            for state in self.optim.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and key != "step":
                        state[key] = value.to(device)

    # ------------------------------------------------------------------------------ checkpoints
    def _state_tensors(self) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(self.model, self.optim.optimizer)
        return {"model": model_state, "optimizer": optim_state}

    def save_checkpoint(self, path: str | Path, extra_state: dict | None = None) -> Path:
        """Atomically write model, optimizer, schedule, RNG streams and `extra_state` (JSON-able) to `path`."""
        meta = {
            "format": 1,
            "schedule": self.schedule.state_dict(),
            "skipped_steps": self.optim.skipped_steps,
            "world_size": self.dims.world_size,
            "job": self.job.model_dump(mode="json"),
            "hf_config": self.hf_config,
            "extra": extra_state or {},
        }
        return ckpt.save_checkpoint(path, self._state_tensors(), {"rng": rng_state()}, meta)

    def load_checkpoint(self, path: str | Path, weights_only: bool = False) -> dict:
        """Restore everything `save_checkpoint` wrote (refusing a corrupt checkpoint); returns extra_state.
        `weights_only`: the model alone (export), leaving optimizer, schedule and RNG as they are."""
        if weights_only:
            tensors = {"model": get_model_state_dict(self.model)}
            meta, _ = ckpt.load_checkpoint(path, tensors)
            set_model_state_dict(self.model, tensors["model"])
            return meta["extra"]
        tensors = self._state_tensors()
        meta, rank_state = ckpt.load_checkpoint(path, tensors)
        set_state_dict(self.model, self.optim.optimizer, model_state_dict=tensors["model"],
                       optim_state_dict=tensors["optimizer"])
        self.schedule.load_state_dict(meta["schedule"])
        self.optim.skipped_steps = int(meta["skipped_steps"])
        if rank_state is not None:
            set_rng_state(rank_state["rng"])
        return meta["extra"]

    # ------------------------------------------------------------------------------------ export
    def export_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named tensors one at a time (never the whole state at once)."""
        from mlite.runtime.ckpt.hf import iter_hf_weights

        if self.pipeline is not None:
            raise MliteError(
                f"exporting weights from a running pp={self.dims.pp} job: each rank holds only its stages; "
                "export the saved checkpoint instead (mlite export), or run rollouts with parallel.pp: 1"
            )

        for name, tensor in iter_hf_weights(self.model):
            yield name, (tensor.to(dtype) if dtype is not None else tensor)


def refuse_inapplicable_keys(job: JobConfig, dims: ParallelDims, device_type: str) -> None:
    """Keys that would do nothing in this run are refused, one line naming the key and the fix."""
    if job.optimizer.backend == "dist_opt":
        from mlite.runtime.parallel.megatron import NEEDS_MEGATRON

        if device_type != "cuda" or importlib.util.find_spec("megatron.core") is None:
            raise MliteError(NEEDS_MEGATRON)
        raise MliteError(
            "optimizer.backend dist_opt: the Megatron-Core adapter (mlite.runtime.parallel.dist_opt) has no "
            "checkpoints through DCP yet, so the runtime does not run it; use optimizer.backend fsdp2"
        )
    precision = job.precision
    if precision.master == "bf16" and device_type != "cuda":
        raise MliteError(
            "precision.master: bf16 keeps parameters and Adam state in bf16 on GPUs, but this run computes in "
            "fp32 on the CPU; set precision.master: fp32 (or run on GPUs)"
        )
    if precision.grad_reduce != "fp32" and dims.world_size == 1:
        raise MliteError(
            f"precision.grad_reduce: {precision.grad_reduce} sets the dtype of the gradient reduction across "
            "ranks, and this run has one process; remove it or start several ranks (torchrun)"
        )
    offload = job.offload
    if offload.params or offload.grads or offload.optimizer:
        if device_type != "cuda":
            raise MliteError("offload.* moves GPU state to host memory, but this run is on the CPU; remove offload")
        if dims.world_size == 1:
            raise MliteError(
                "offload.* runs through FSDP2's CPUOffloadPolicy, which needs several ranks; start them with "
                "torchrun, or remove offload"
            )
        if (offload.params or offload.grads) and not (
            offload.params and offload.grads and offload.optimizer and offload.optimizer_fraction == 1.0
        ):
            raise MliteError(
                "offload.params / offload.grads: FSDP2 moves a unit's parameters, gradients and optimizer state "
                "to the host together; set all three (optimizer_fraction 1.0), or offload.optimizer alone with a "
                "fraction (those layers' parameters and gradients move with their optimizer state)"
            )


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """A training checkpoint (or a run dir: its newest good one) -> an HF checkpoint transformers loads.

    The model is rebuilt on the CPU from the job and config.json stored in the checkpoint, so neither the
    original weights nor a GPU are needed; tensors stream to the shards one at a time."""
    from mlite.config import job_from_dict
    from mlite.runtime.ckpt.hf import save_hf_checkpoint

    path = ckpt.resolve_checkpoint(checkpoint)
    ckpt.verify_checkpoint(path)
    meta = ckpt.read_meta(path)
    job_dict = meta["job"]
    job_dict["trainer"]["device"] = "cpu"
    runtime = Runtime(job_from_dict(job_dict), hf_config=meta["hf_config"])
    runtime.load_checkpoint(path, weights_only=True)
    config = None if runtime.job.model.name is not None else meta["hf_config"]  # presets: written from the arch
    return save_hf_checkpoint(runtime.export_weights(dtype), runtime.arch, out_dir, config=config, dtype=dtype)
