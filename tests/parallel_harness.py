"""Shared parts of the parallel tests: the tiny models, packed micro-batches and a launcher for gloo ranks."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor.parallel import loss_parallel

from mlite.config import job_from_dict
from mlite.config.arch import ModelArch, arch_from_hf_config
from mlite.config.catalog import PRESETS
from mlite.config.schema import OptimizerConfig
from mlite.plan.policy import expert_exchange, experts_outside_fsdp
from mlite.plan.rules import context_chunk_multiple
from mlite.runtime.data.packed import PackedBatch
from mlite.runtime.models import build_model
from mlite.runtime.optim import LocalAdamW
from mlite.runtime.parallel.mesh import ParallelDims
from mlite.runtime.parallel.parallelize import grad_norm, parallelize_model, set_gradient_sync
from mlite.runtime.parallel.pipeline import PipelineRunner, keep_chunk, one_f_one_b, split_layers
from mlite.runtime.parallel.step import local_share, vocab_parallel_logprobs

# the catalog's tiny models, untied (a tied LM head is not split across stages yet) and 4 layers (pp2 x vpp2)
ARCH_OVERRIDES = dict(tie_word_embeddings=False, num_hidden_layers=4, router_aux_loss_coef=0.1)
LAYERS = ARCH_OVERRIDES["num_hidden_layers"]
VOCAB = 256


def tiny_arch(moe: bool) -> ModelArch:
    return arch_from_hf_config(dict(PRESETS["tiny-qwen3-moe" if moe else "tiny-qwen3"], **ARCH_OVERRIDES))


def device() -> torch.device:
    """cpu (gloo) by default; the GPU suite launches with backend nccl and each rank on its own GPU."""
    return torch.device(os.environ.get("MLITE_TEST_DEVICE", "cpu"))


def compute_dtype() -> torch.dtype:
    return torch.bfloat16 if os.environ.get("MLITE_TEST_COMPUTE") == "bf16" else torch.float32


def make_model(moe: bool, seed: int = 0):
    """The runtime's model (mlite.runtime.models), identical weights on every rank for one seed."""
    torch.manual_seed(seed)
    return build_model(tiny_arch(moe), attention_backend="torch").to(device())


def make_batches(n: int, tokens: int = 48, seed: int = 1) -> list[PackedBatch]:
    """n packed micro-batches of `tokens` tokens, 2-3 sequences of uneven lengths, some ignored labels."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for i in range(n):
        cuts = sorted(torch.randperm(tokens - 2, generator=g)[: 1 + i % 2].add(1).tolist())
        lens = [b - a for a, b in zip([0] + cuts, cuts + [tokens])]
        seqs = [torch.randint(0, VOCAB, (n_,), generator=g).tolist() for n_ in lens]
        masks = [[int(t >= 2) for t in range(len(s))] for s in seqs]  # the first tokens are the "prompt"
        batches.append(PackedBatch.from_sequences(seqs, masks))
    return batches


def total_targets(batches) -> int:
    return sum(b.num_target_tokens for b in batches)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, rendezvous, fn, args, errors, backend):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if backend == "nccl":
        os.environ.update(MLITE_TEST_DEVICE=f"cuda:{rank}")
        torch.cuda.set_device(rank)
    # rendezvous through a file, not a TCP port: a port picked free here can be taken by another test's
    # process before rank 0 binds it (two pytest workers, Ray, Slurm), and init then fails on every rank
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()  # every rank done with its collectives
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        dist.destroy_process_group()
        raise
    _exit_together(rendezvous, rank, world)


def _exit_together(rendezvous: str, rank: int, world: int, timeout_s: float = 120.0) -> None:
    """End a rank that succeeded without tearing torch.distributed down. Gloo's worker threads can still
    hold work when its group is destroyed or the interpreter finalises, and the process then aborts
    ("terminate called without an active exception", SIGABRT: twice in CI, once after a barrier). Each
    rank marks a file once out of the barrier and leaves only when every rank has, so no message is in
    flight; os._exit skips the C++ destructors that abort."""
    open(f"{rendezvous}.left.{rank}", "w").close()
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(f"{rendezvous}.left.{r}") for r in range(world)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: a peer never left the final barrier")
        time.sleep(0.01)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(world: int, fn, *args, backend: str = "gloo"):
    """Run fn(rank, world, *args) on `world` ranks; re-raise the first rank's failure readably."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as folder:
        rendezvous = os.path.join(folder, "rendezvous")
        try:
            mp.start_processes(
                _entry, args=(world, free_port(), rendezvous, fn, args, errors, backend), nprocs=world,
                start_method="spawn",
            )
        except Exception as err:
            rank, tb = errors.get() if not errors.empty() else (-1, str(err))  # -1: failed outside fn
            raise AssertionError(f"rank {rank} failed:\n{tb}") from None


# ------------------------------------------------------------------ training, the same under every layout
# The pieces of a step the runtime uses too (mlite.runtime.parallel.step: each rank's share of a micro-batch,
# log-probs from vocab-parallel logits); the loop itself stays here so that chunks and schedules can be
# driven directly (mlite.runtime.engine.Runtime runs the same step from a job: tests/test_runtime_layouts).
MAX_STEPS, MICRO_BATCHES, LR, CLIP = 4, 4, 1e-3, 1.0


def _train_one_stage(model, mesh, opt: LocalAdamW, steps) -> list[tuple[float, float]]:
    """(loss, grad norm) per step. Without a mesh: one process, all micro-batches accumulated."""
    dims = mesh.dims if mesh else ParallelDims(1)
    dp_rank = mesh.rank_in("dp") if mesh else 0
    batches = [b.to(device()) for b in make_batches(MAX_STEPS * MICRO_BATCHES)]
    history = []
    for step in steps:
        step_batches = batches[step * MICRO_BATCHES : (step + 1) * MICRO_BATCHES]
        targets = total_targets(step_batches)  # the loss is a mean over the step's target tokens
        mine = step_batches[dp_rank :: dims.dp]
        ce_total, aux_total = torch.zeros((), device=device()), torch.zeros((), device=device())
        for i, batch in enumerate(mine):
            if mesh:
                set_gradient_sync(model, i == len(mine) - 1)
            batch = local_share(batch, mesh)
            with _reference_autocast(mesh):
                out = model(batch)
            hidden, aux = out.hidden, out.aux_loss
            with loss_parallel():  # its backward too runs under the vocab-parallel loss
                ce = ce_loss(model, hidden, batch, targets)
                (ce + aux).backward()
            ce_total += ce.detach()
            aux_total += aux.detach()
        if mesh:
            dist.all_reduce(ce_total, group=mesh["dp_cp"].get_group())
            dist.all_reduce(aux_total, group=mesh["dp_cp_tp"].get_group())  # cp x tp ranks hold shares
        norm, _ = opt.step()  # grad norm over every rank, clip, update: Runtime.optimizer_step
        opt.zero_grad()
        history.append((float(ce_total + aux_total), float(norm)))  # the step leaves the norm on the device
    return history


def _reference_autocast(mesh):
    """bf16 runs: FSDP2 casts the parameters for compute; one process gets the same from autocast."""
    if mesh is None and compute_dtype() != torch.float32:
        return torch.autocast(device().type, dtype=compute_dtype())
    return contextlib.nullcontext()


def ce_loss(model, hidden, batch, targets):
    """Summed cross-entropy over the step's target count; call under loss_parallel() (vocab split over tp).
    Replicated over tp: each rank holds the whole."""
    logprobs, _ = vocab_parallel_logprobs(hidden, batch.labels, model.output)
    return -logprobs.sum() / targets


def _train_pipeline(chunks: dict, mesh, opt: LocalAdamW, steps) -> list[tuple[float, float]]:
    """The same steps through the 1F1B (interleaved when vpp > 1) pipeline schedule."""
    dims = mesh.dims
    pp_ranks = dist.get_process_group_ranks(mesh.group("pp"))
    runner = PipelineRunner(chunks, dims.pp * dims.vpp, pp_ranks, device())
    batches = [b.to(device()) for b in make_batches(MAX_STEPS * MICRO_BATCHES)]
    history = []
    for step in steps:
        step_batches = batches[step * MICRO_BATCHES : (step + 1) * MICRO_BATCHES]
        targets = total_targets(step_batches)
        mine = [local_share(b, mesh) for b in step_batches[mesh.rank_in("dp") :: dims.dp]]
        for chunk in chunks.values():
            set_gradient_sync(chunk, False)
        actions = one_f_one_b(dims.pp, dims.vpp, mesh.rank_in("pp"), len(mine))
        with loss_parallel():
            result = runner.run(
                actions,
                mine,
                loss_fn=lambda chunk, hidden, batch: ce_loss(chunk, hidden, batch, targets),
                before_backward=lambda c, last: set_gradient_sync(chunks[c], last),
                dtype=compute_dtype(),  # what travels between stages
            )
        ce_total = result["loss"]
        aux_total = sum(result["aux"].values(), torch.zeros((), device=device()))  # this stage's terms
        dist.all_reduce(ce_total, group=mesh.group("dp_cp"))
        dist.all_reduce(aux_total, group=mesh.group("dp_cp_tp"))
        both = torch.stack([ce_total, aux_total])
        dist.all_reduce(both, group=mesh.group("pp"))  # the loss lives on the last stage, aux on all
        norm, _ = opt.step()
        opt.zero_grad()
        history.append((float(both[0] + both[1]), float(norm)))
    return history


def train(chunks: dict, mesh, opt: LocalAdamW, steps: range) -> list[tuple[float, float]]:
    """(loss, grad norm) of each step in `steps`; mesh None: one process with gradient accumulation."""
    if mesh is None or mesh.dims.pp == 1:
        return _train_one_stage(chunks[0], mesh, opt, steps)
    return _train_pipeline(chunks, mesh, opt, steps)


def make_optimizer(chunks: dict, state: str = "master") -> LocalAdamW:
    """The runtime's optimizer, as Runtime builds it: AdamW (lr 1e-3, betas (0.9, 0.999), weight decay 0.01
    on matrices), its step clipping to CLIP by the grad norm over every rank (`grad_norm`) on several ranks,
    the local norm in one process. `.optimizer` is the torch optimizer, for checkpoints. `state`: as
    precision.optimizer_state."""
    cfg = OptimizerConfig(lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, clip_grad=CLIP)
    params = [p for c in chunks.values() for p in c.parameters()]
    # the harness's layouts run on several ranks, its one-process reference outside any process group
    return LocalAdamW(params, cfg, grad_norm_fn=grad_norm if dist.is_initialized() else None, state=state)


_REFERENCE: dict[bool, list] = {}


def reference(moe: bool) -> list[tuple[float, float]]:
    """The single-process run every layout must reproduce (MAX_STEPS steps, computed once per model)."""
    if moe not in _REFERENCE:
        chunks = {0: make_model(moe)}
        _REFERENCE[moe] = train(chunks, None, make_optimizer(chunks), range(MAX_STEPS))
    return _REFERENCE[moe]


def parallelize(model, mesh, job_sections=None):
    """The runtime's entry point, driven by a job file's sections (recompute, offload); precision from the
    suite (fp32 on CPU, bf16 on GPUs)."""
    sections = dict(job_sections or {})
    # what a plan resolves, given as the plan would (mlite.plan.plan_job): fp32 masters reduce in fp32;
    # FSDP2 units of one layer, resharded after their forward (torchtitan's), and the expert exchange's
    # buffers sized by the pair count (`exact`), unless a test's sections say otherwise; the expert exchange
    # policy picks for the mesh's ep and the model's top-k
    sections["precision"] = {"compute": "bf16" if compute_dtype() == torch.bfloat16 else "fp32",
                             "grad_reduce": "fp32"}
    sections.setdefault("parallel", {}).setdefault("fsdp_unit_layers", 1)
    sections["parallel"].setdefault("fsdp_reshard_after_forward", True)
    sections["parallel"].setdefault("expert_buffers", "exact")
    job = job_from_dict({"model": {"name": "tiny-qwen3-moe"}, **sections})
    moe = model.arch.moe
    exchange = expert_exchange(mesh.dims.ep, moe.top_k) if moe is not None and mesh.dims.ep > 1 else None
    return parallelize_model(model, mesh, job, device().type, exchange,
                             context_chunk=context_chunk_multiple(model.arch),
                             plain_experts=experts_outside_fsdp(job, mesh.dims, device().type))


def build_layout(moe: bool, mesh, job_sections=None) -> dict:
    """This rank's model chunks for the layout: {chunk index: parallelized chunk}."""
    if mesh is None:
        return {0: make_model(moe)}
    dims = mesh.dims
    split = split_layers(LAYERS, dims.pp, dims.vpp)
    mine = range(mesh.rank_in("pp"), dims.pp * dims.vpp, dims.pp)
    return {
        c: parallelize(keep_chunk(make_model(moe), split[c], c == 0, c == len(split) - 1), mesh, job_sections)
        for c in mine
    }
