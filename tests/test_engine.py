"""The runtime API against direct torch computations: loss and gradients, accumulation over micro-batches,
chunked log-probs and entropy, skipping non-finite steps, clipping and the LR schedules."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from cli_runs import one_thread  # noqa: F401 (autouse: one intra-op thread)
from torch.distributed.tensor import DTensor

from mlite.config import job_from_dict
from mlite.config.schema import OptimizerConfig
from mlite.runtime.data.packed import IGNORE, PackedBatch
from mlite.runtime.engine import Runtime
from mlite.runtime.loss import sft_loss, token_logprobs
from mlite.runtime.optim import lr_at


def make_job(**optimizer):
    return job_from_dict({
        "model": {"name": "tiny-qwen3"},
        "precision": {"compute": "fp32"},
        "optimizer": {"lr": 1e-3, **optimizer},
        "data": {"seq_len": 512},  # within the tiny model's positions: the rule book checks it
        "trainer": {"device": "cpu", "steps": 10, "seed": 7},
    })


def sequences(lengths, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def prompt_masks(seqs, prompt=3):  # first `prompt` tokens are not trained, as with a chat prompt
    return [[0] * prompt + [1] * (len(s) - prompt) for s in seqs]


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_forward_backward_equals_direct_cross_entropy():
    rt = Runtime(make_job())
    seqs = sequences([9, 14, 6])
    batch = PackedBatch.from_sequences(seqs, prompt_masks(seqs))
    (out,) = rt.forward_backward([batch], sft_loss(batch.num_target_tokens), with_entropy=True)
    ours = grads(rt.model)

    rt.zero_grad()
    logits = rt.model.compute_logits(rt.model(batch).hidden)  # [T, V]
    reference = F.cross_entropy(logits, batch.labels, ignore_index=IGNORE, reduction="mean")
    reference.backward()
    assert out["loss"] == pytest.approx(reference.item(), rel=1e-6)
    for name, g in grads(rt.model).items():
        torch.testing.assert_close(ours[name], g, rtol=1e-5, atol=1e-7, msg=name)

    logp = torch.log_softmax(logits.detach(), -1)
    trained = batch.labels != IGNORE
    expected = logp.gather(-1, batch.labels.clamp(min=0)[:, None])[:, 0] * trained
    torch.testing.assert_close(out["logprobs"], expected)
    torch.testing.assert_close(out["entropy"], -(logp.exp() * logp).sum(-1))
    assert out["metrics"]["target_tokens"] == int(trained.sum()) == sum(len(s) - 3 for s in seqs)


def test_chunked_logprobs_equal_whole_including_gradients():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(23, 16, requires_grad=True)
    labels = torch.randint(0, 50, (23,))
    labels[[0, 7, 22]] = IGNORE
    results = []
    for chunk in (4, 1000):
        hidden.grad = None
        lp, ent = token_logprobs(hidden, labels, head, temperature=0.7, with_entropy=True, chunk_tokens=chunk)
        (lp.sum() + 0.1 * ent.sum()).backward()
        results.append((lp.detach(), ent.detach(), hidden.grad.clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)
    assert results[0][0][[0, 7, 22]].eq(0).all()


def test_accumulating_micro_batches_equals_one_big_batch():
    seqs = sequences([9, 14, 6, 11, 5])
    masks = prompt_masks(seqs)
    whole = PackedBatch.from_sequences(seqs, masks)

    rt = Runtime(make_job())
    (big,) = rt.forward_backward([whole], sft_loss(whole.num_target_tokens))
    one_batch = grads(rt.model)

    rt.zero_grad()
    parts = [PackedBatch.from_sequences(seqs[:2], masks[:2]), PackedBatch.from_sequences(seqs[2:], masks[2:])]
    total = sum(p.num_target_tokens for p in parts)
    outs = rt.forward_backward(parts, sft_loss(total))
    assert sum(o["loss"] for o in outs) == pytest.approx(big["loss"], rel=1e-6)
    for name, g in grads(rt.model).items():
        torch.testing.assert_close(g, one_batch[name], rtol=1e-5, atol=1e-7, msg=name)


def test_forward_only_needs_no_loss_and_keeps_no_graph():
    rt = Runtime(make_job())
    batch = PackedBatch.from_sequences(sequences([8, 5]))
    (out,) = rt.forward_backward([batch], None, forward_only=True)
    assert out["loss"] is None and not out["logprobs"].requires_grad
    assert all(p.grad is None for p in rt.model.parameters())
    with pytest.raises(ValueError, match="needs a loss_fn"):
        rt.forward_backward([batch], None)


def test_non_finite_gradient_skips_the_update_and_is_counted():
    rt = Runtime(make_job())
    batch = PackedBatch.from_sequences(sequences([8, 5]))
    before = {n: p.detach().clone() for n, p in rt.model.named_parameters()}
    rt.forward_backward([batch], sft_loss(batch.num_target_tokens))
    next(rt.model.parameters()).grad[0, 0] = float("nan")
    norm, skipped = rt.optimizer_step()
    assert skipped and math.isnan(norm) and rt.skipped_steps == 1
    for n, p in rt.model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert all(p.grad is None for p in rt.model.parameters())  # the poisoned gradient is gone

    rt.forward_backward([batch], sft_loss(batch.num_target_tokens))
    norm, skipped = rt.optimizer_step()
    assert not skipped and math.isfinite(norm) and rt.skipped_steps == 1
    assert any(not torch.equal(p, before[n]) for n, p in rt.model.named_parameters())


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_grad_norm_is_reported_before_clipping_and_clipping_applies(clip):
    rt = Runtime(make_job(clip_grad=clip))
    batch = PackedBatch.from_sequences(sequences([12, 7]))
    rt.forward_backward([batch], sft_loss(batch.num_target_tokens))
    raw = torch.nn.utils.get_total_norm([p.grad for p in rt.model.parameters()]).item()
    norm, _ = rt.optimizer_step()
    assert norm == pytest.approx(raw, rel=1e-6)
    after = torch.nn.utils.get_total_norm([p.grad for p in rt.model.parameters()]).item()
    assert raw > 0.05  # the clip below really cuts
    assert after == pytest.approx(clip if clip else raw, rel=1e-5)


def test_lr_schedules():
    cfg = OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=4, schedule="cosine")
    total = 14  # warmup 0..3, decay over steps 4..13
    assert [lr_at(s, cfg, total) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, cfg, total) == 1.0
    assert lr_at(13, cfg, total) == pytest.approx(0.1)
    mid = 4 + 9 / 2  # cosine halfway is the mean of lr and min_lr
    assert lr_at(int(mid), cfg, total) > 0.55 > lr_at(int(mid) + 1, cfg, total)
    linear = cfg.model_copy(update={"schedule": "linear"})
    assert [round(lr_at(s, linear, total), 6) for s in (4, 7, 13, 20)] == [1.0, 0.7, 0.1, 0.1]
    constant = cfg.model_copy(update={"schedule": "constant"})
    assert {lr_at(s, constant, total) for s in range(4, 30)} == {1.0}


def test_runtime_schedule_drives_the_optimizer_lr():
    rt = Runtime(make_job(warmup_steps=2, schedule="linear", min_lr=0.0))
    seen = [rt.optim.optimizer.param_groups[0]["lr"]]
    for _ in range(3):
        seen.append(rt.lr_scheduler_step())
        assert rt.optim.optimizer.param_groups[0]["lr"] == seen[-1]
    assert seen == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3 * (1 - 1 / 7)])  # decay: steps 2..9


def test_weight_decay_spares_norms_and_biases():
    rt = Runtime(make_job(weight_decay=0.1))
    decay, no_decay = rt.optim.optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_without_gpu_is_one_clear_error():
    from mlite.errors import MliteError

    with pytest.raises(MliteError, match="no CUDA GPU is visible"):
        Runtime(job_from_dict({"model": {"name": "tiny-qwen3"}, "trainer": {"device": "cuda"}}))


def test_deterministic_key_turns_on_deterministic_algorithms():
    before = torch.are_deterministic_algorithms_enabled()
    try:
        Runtime(job_from_dict({"model": {"name": "tiny-qwen3"}, "data": {"seq_len": 512},
                                  "trainer": {"device": "cpu", "deterministic": True}}))
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(before)


def test_bf16_compute_is_fp32_on_cpu_and_weights_stay_fp32():
    rt = Runtime(job_from_dict({"model": {"name": "tiny-qwen3"}, "precision": {"compute": "bf16"},
                                "data": {"seq_len": 512}, "trainer": {"device": "cpu"}}))
    assert rt.autocast_dtype is None and all(p.dtype == torch.float32 for p in rt.model.parameters())


def test_compile_runs_each_block_through_torch_compile_with_the_same_numbers():
    """model.compile: the blocks' bodies become inductor graphs (dynamo captures them), and two steps give
    the eager run's losses and gradient norms (fp32; inductor's fused kernels round differently)."""
    import torch._dynamo.utils

    from mlite.runtime.data.packed import PackedBatch
    from mlite.runtime.loss import sft_loss

    def two_steps(compile_blocks: bool):
        rt = Runtime(job_from_dict({"model": {"name": "tiny-qwen3", "compile": compile_blocks},
                                    "data": {"seq_len": 512}, "precision": {"compute": "fp32"},
                                    "trainer": {"device": "cpu", "seed": 3}}))
        g, out = torch.Generator().manual_seed(0), []
        for lengths in ((9, 14), (11, 6, 4)):  # two packings: the compiled graph takes both
            batch = PackedBatch.from_sequences([torch.randint(0, 200, (n,), generator=g).tolist()
                                                for n in lengths])
            rt.zero_grad()
            (o,) = rt.forward_backward([batch], sft_loss(batch.num_target_tokens))
            out.append((o["loss"], rt.optimizer_step()[0]))
        return out

    eager = two_steps(False)
    captured = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = two_steps(True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > captured  # really compiled
    for (loss, norm), (loss_c, norm_c) in zip(eager, compiled):
        assert loss_c == pytest.approx(loss, rel=1e-5) and norm_c == pytest.approx(norm, rel=1e-4)


# --------------------------------------------------------------------------- the step without host syncs
class _Watched(torch.Tensor):
    """A 0-dim tensor that records when the host reads it."""

    def item(self):
        self.reads.append(("read", self.at))
        return super().item()


def test_the_loop_reads_a_steps_numbers_only_after_the_next_step_is_queued(tmp_path):
    """A step's loss and grad norm stay on the device until the following step has been queued (on a GPU
    the host never waits between steps); steps that evaluate or save are read at once. The logged values
    are each step's own, in order."""
    from mlite.trainers import loop
    from mlite.trainers.metrics import read_metrics

    job = job_from_dict({
        "model": {"name": "tiny-qwen3"}, "precision": {"compute": "fp32"}, "data": {"seq_len": 512},
        "trainer": {"device": "cpu", "steps": 6, "save_every": 3, "eval_every": 0,
                    "output_dir": str(tmp_path / "run")},
    })
    events = []

    class Trainer:
        name, plot_keys, plot_file, eval_at_start = "sft", ("loss",), "loss.png", False

        def steps_per_epoch(self):
            return 100

        def step(self, index):
            events.append(("step", index + 1))
            loss = torch.tensor(0.5 + index).as_subclass(_Watched)
            loss.at, loss.reads = index + 1, events
            return loop.StepResult({"loss": loss}, 10.0, ("loss", loss))

        def evaluate(self):
            return {}

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

        def summary_lines(self, result):
            return []

    loop.run(job, Runtime(job), Trainer(), show_progress=False)
    order = [e for i, e in enumerate(events) if i == 0 or e != events[i - 1]]  # a step is read once or twice
    assert order == [("step", 1), ("step", 2), ("read", 1), ("step", 3), ("read", 2), ("read", 3),  # saved
                     ("step", 4), ("step", 5), ("read", 4), ("step", 6), ("read", 5), ("read", 6)]
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert [(r["step"], r["loss"]) for r in records] == [(s, 0.5 + s - 1) for s in range(1, 7)]
    assert all(r["step_time_s"] > 0 and r["tokens_per_s"] > 0 for r in records)


def test_step_outputs_stay_tensors_until_read_and_equal_the_read_values():
    """forward_backward's loss and metrics and optimizer_step's norm and skip flag are 0-dim tensors (a
    GPU step queues its update without waiting for them); the token count is the host's."""
    rt = Runtime(make_job())
    batch = PackedBatch.from_sequences(sequences([8, 5]))
    (out,) = rt.forward_backward([batch], sft_loss(batch.num_target_tokens))
    norm, skipped = rt.optimizer_step()
    assert all(isinstance(x, torch.Tensor) and x.dim() == 0 for x in (out["loss"], norm, skipped))
    assert isinstance(out["num_tokens"], int) and out["num_tokens"] == 13
    assert not bool(skipped) and math.isfinite(float(norm)) and float(out["loss"]) > 0


def _sum_and_stop_worker(rank, world):
    import os
    import signal

    import torch.distributed as dist

    from mlite.trainers.common import StopRequest

    rt = Runtime(job_from_dict({
        "model": {"name": "tiny-qwen3"}, "precision": {"compute": "fp32"}, "data": {"seq_len": 512},
        "cluster": {"gpu": "cpu"}, "trainer": {"device": "cpu", "seed": 7},  # dp 2: the world
    }))
    assert rt.placement.loss_group is not None
    total = rt.global_sum(torch.tensor(float(rank + 1)))  # a step's loss: summed on the device, not read
    assert isinstance(total, torch.Tensor) and total.dim() == 0 and float(total) == 3.0
    assert rt.global_sum(rank + 1) == 3.0  # a host count comes back as a number
    with StopRequest() as stop:
        assert dist.get_backend(stop._group) == "gloo"  # over the host, on NCCL jobs too
        assert stop.should_stop() is False
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.should_stop() is True
        assert stop.received == ("SIGUSR1" if rank == 1 else "a signal on another rank")
    assert stop._group is None


def test_ranks_sum_a_loss_on_the_device_and_agree_on_a_stop_over_the_host():
    """Two data-parallel ranks: a tensor summed over the loss group stays a 0-dim tensor (the SFT step's
    loss, read by the loop after the next step is queued); a signal on one rank stops both at the same
    step, through the stop request's own gloo group rather than a device all-reduce read back."""
    from parallel_harness import launch

    launch(2, _sum_and_stop_worker)


def three_sft_steps(rt: Runtime, forward_only_between: bool = False) -> list[tuple[float, ...]]:
    """(loss, grad norm[, a forward-only pass's log-prob sum]) of three SFT updates on one packed batch."""
    batch = PackedBatch.from_sequences(sequences([30, 17]))
    numbers = []
    for _ in range(3):
        rt.zero_grad()
        (out,) = rt.forward_backward([batch], sft_loss(batch.num_target_tokens))
        norm, _ = rt.optimizer_step()
        row: tuple[float, ...] = (float(out["loss"]), float(norm))
        # a forward-only pass between updates: a gathered FSDP2 head must not serve stale weights
        if forward_only_between:
            (after,) = rt.forward_backward([batch], None, forward_only=True)
            row += (float(after["logprobs"].sum()),)
        numbers.append(row)
    return numbers


def test_fsdp_one_rank_runs_the_sharded_path_on_one_process_with_the_plain_numbers():
    """parallel.fsdp_one_rank: one process shards with FSDP2 over a one-rank mesh (DTensor parameters, the
    sharded step and its grad norm over the mesh, the FSDP2 head gathered for the LM-head kernel) and trains
    as the plain model does, within float rounding; closing the runtime ends the process group it started."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from mlite.runtime.loss import linear_head_weight, release_head

    def run(one_rank: bool, grad_reduce: str = "fp32"):
        job = job_from_dict({
            "model": {"name": "tiny-qwen3-moe"}, "precision": {"compute": "fp32", "grad_reduce": grad_reduce},
            "data": {"seq_len": 512},
            "parallel": {"fsdp_one_rank": one_rank}, "optimizer": {"lr": 1e-3, "clip_grad": 1.0},
            "trainer": {"device": "cpu", "seed": 7},
        })
        rt = Runtime(job)
        sharded = all(isinstance(p, DTensor) for p in rt.model.parameters())
        assert dist.is_initialized() == one_rank and (rt.mesh is not None) == one_rank
        numbers = three_sft_steps(rt, forward_only_between=True)
        if one_rank:  # the (untied) head went through the LM-head kernel, gathered, and was resharded after
            assert linear_head_weight(rt.model.compute_logits) is not None
            release_head(rt.model.compute_logits)
            assert isinstance(rt.model.output.weight, DTensor)
        rt.close()
        assert not dist.is_initialized()
        return sharded, numbers

    plain_sharded, plain = run(False)
    sharded, numbers = run(True)
    assert sharded and not plain_sharded
    torch.testing.assert_close(numbers, plain, rtol=1e-5, atol=0)
    # precision.grad_reduce applies to the one-rank reduction too: bf16 rounds the gradients
    _, rounded = run(True, "bf16")
    torch.testing.assert_close(rounded, plain, rtol=2e-2, atol=0)
    assert rounded[1:] != plain[1:]


@pytest.mark.parametrize("mode", ["unsharded", "sharded"])
def test_fsdp_grad_accumulation_reduces_at_the_steps_end_or_after_every_micro_batch(mode):
    """parallel.fsdp_grad_accumulation on FSDP2 (one process over a one-rank mesh): `unsharded` keeps the
    gradients whole until the step's last backward, so no sharded gradient exists after an earlier call
    (`forward_backward(ends_step=False)`); `sharded` reduce-scatters after every micro-batch. Both give the
    plain model's accumulated gradients."""
    from torch.distributed.tensor import DTensor

    seqs = sequences([9, 14, 6, 11, 5])
    masks = prompt_masks(seqs)
    parts = [PackedBatch.from_sequences(seqs[:2], masks[:2]), PackedBatch.from_sequences(seqs[2:], masks[2:])]
    loss = sft_loss(sum(p.num_target_tokens for p in parts))
    plain = Runtime(make_job())
    plain.forward_backward(parts, loss)
    want = grads(plain.model)

    job = make_job()
    job.parallel = job.parallel.model_copy(update={"fsdp_one_rank": True, "fsdp_grad_accumulation": mode})
    rt = Runtime(job)
    assert rt.reduce_every_micro_batch == (mode == "sharded")
    rt.forward_backward(parts[:1], loss, ends_step=False)
    reduced = [n for n, p in rt.model.named_parameters() if p.grad is not None]
    assert reduced == ([n for n, _ in rt.model.named_parameters()] if mode == "sharded" else [])
    rt.forward_backward(parts[1:], loss)  # the step's last backward
    got = {n: g.full_tensor() if isinstance(g, DTensor) else g for n, g in grads(rt.model).items()}
    rt.close()
    assert got.keys() == want.keys()
    for name, g in got.items():
        torch.testing.assert_close(g, want[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_moe_block_is_one_fsdp2_unit_where_its_experts_share_the_layers_ranks():
    """Without ep, etp or tp the experts and the router live on the layer's ranks, so a MoE block is one
    FSDP2 unit: the compiled block then has no graph break at FSDP2's hooks (which a unit inside it would
    add, three per block), and it trains as before."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.distributed.fsdp import FSDPModule

    from mlite.runtime.parallel.parallelize import blocks

    torch._dynamo.reset()
    counters.clear()
    rt = Runtime(job_from_dict({
        "model": {"name": "tiny-qwen3-moe", "compile": True}, "precision": {"compute": "fp32"},
        "data": {"seq_len": 512}, "parallel": {"fsdp_one_rank": True},
        "trainer": {"device": "cpu", "seed": 7},
    }))
    try:
        layers = blocks(rt.model)
        assert all(isinstance(layer, FSDPModule) for layer in layers)
        assert not any(isinstance(layer.mlp, FSDPModule) or isinstance(layer.mlp.experts, FSDPModule)
                       for layer in layers)
        batch = PackedBatch.from_sequences(sequences([30, 17]))
        (out,) = rt.forward_backward([batch], sft_loss(batch.num_target_tokens))
        rt.optimizer_step()
        assert math.isfinite(float(out["loss"]))
        hooks = [reason for reason in counters["graph_break"] if "marked as skipped" in reason]
        assert not hooks, hooks
    finally:
        rt.close()
        torch._dynamo.reset()


def test_fsdp_unit_layers_gathers_consecutive_layers_as_one_unit_with_the_same_numbers():
    """parallel.fsdp_unit_layers: 2 makes each pair of consecutive layers one FSDP2 unit (one state, one
    all-gather and one reduce-scatter for both: FSDP2's host work per step grows with its units), and the
    run's numbers are those of one layer a unit. `auto` (the default) lays out the units the planner chose:
    tiny layers, so every layer of the model in one unit."""
    from torch.distributed.fsdp import FSDPModule

    from mlite.plan.memory import AUTO_UNIT_MAX_LAYERS
    from mlite.runtime.parallel.parallelize import blocks

    def run(unit_layers: int | str):
        job = job_from_dict({
            "model": {"name": "tiny-qwen3-moe"}, "precision": {"compute": "fp32"}, "data": {"seq_len": 512},
            "parallel": {"fsdp_one_rank": True, "fsdp_unit_layers": unit_layers},
            "optimizer": {"lr": 1e-3, "clip_grad": 1.0}, "trainer": {"device": "cpu", "seed": 7},
        })
        rt = Runtime(job)
        if unit_layers == "auto":
            units = rt.job.parallel.fsdp_unit_layers  # the plan's choice, in the one job the runtime holds
            assert units == min(rt.arch.num_layers, AUTO_UNIT_MAX_LAYERS)
        try:
            layers = blocks(rt.model)
            assert len(layers) >= 2 and all(isinstance(layer, FSDPModule) for layer in layers)
            states = [layer._get_fsdp_state() for layer in layers]  # FSDP2 has no public unit getter
            units = len({id(state) for state in states})
            return len(layers), units, three_sft_steps(rt)
        finally:
            rt.close()

    layers, one_each, single = run(1)
    _, paired, grouped = run(2)
    _, planned, auto = run("auto")
    assert one_each == layers and paired == -(-layers // 2)
    assert layers <= AUTO_UNIT_MAX_LAYERS and planned == 1  # all of its layers one unit
    torch.testing.assert_close(grouped, single, rtol=1e-6, atol=0)
    torch.testing.assert_close(auto, single, rtol=1e-6, atol=0)


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-qwen3"], ids=["own-head-unit", "tied-head"])
def test_fsdp_reshard_after_forward_false_keeps_units_gathered_to_the_backward_with_the_same_numbers(model):
    """parallel.fsdp_reshard_after_forward: false leaves each FSDP2 unit's gathered weights registered after
    its forward (true puts the shards back), a pass without backward frees them (else the next update would
    leave them stale), and training gives the numbers of resharding, bitwise. `auto` (the default) keeps
    them gathered here: a tiny model fits with memory to spare. A tied head shares the embedding's unit and
    runs after the model's forward, which FSDP2 leaves open after a pass without backward: it is freed too."""
    from torch.distributed.tensor import DTensor

    from mlite.runtime.parallel.parallelize import blocks

    def run(reshard: bool | str):
        job = job_from_dict({
            "model": {"name": model}, "precision": {"compute": "fp32"}, "data": {"seq_len": 512},
            # units of one layer: a unit of several reshards after its last layer's forward only
            "parallel": {"fsdp_one_rank": True, "fsdp_unit_layers": 1, "fsdp_reshard_after_forward": reshard},
            "optimizer": {"lr": 1e-3, "clip_grad": 1.0}, "trainer": {"device": "cpu", "seed": 7},
        })
        rt = Runtime(job)
        try:
            sharded_after_forward = []  # per layer forward: are its parameters the shards again?
            for layer in blocks(rt.model):  # registered after FSDP2's own hook, so it runs after it
                layer.register_forward_hook(lambda module, args, out: sharded_after_forward.append(
                    all(isinstance(p, DTensor) for p in module.parameters())))
            numbers = three_sft_steps(rt, forward_only_between=True)
            released = all(isinstance(p, DTensor) for p in rt.model.parameters())
            planned = rt.job.parallel.fsdp_reshard_after_forward  # the plan's choice
            return planned, set(sharded_after_forward), released, numbers
        finally:
            rt.close()

    planned, after_forward, released, resharded = run(True)
    assert planned is True and after_forward == {True} and released
    planned, after_forward, released, kept = run(False)
    assert planned is False and after_forward == {False} and released  # the forward-only pass freed them
    assert run("auto")[:2] == (False, {False})
    torch.testing.assert_close(kept, resharded, rtol=0, atol=0)


def test_fsdp_units_hand_each_block_the_steps_own_inputs():
    """FSDP2's units do not cast their forward inputs (they come in the compute dtype): each block gets the
    step's PackedBatch itself, not a copy rebuilt per block (host time in every block's call)."""
    from mlite.runtime.data.packed import PackedBatch
    from mlite.runtime.loss import sft_loss
    from mlite.runtime.parallel.parallelize import blocks

    job = job_from_dict({
        "model": {"name": "tiny-qwen3"}, "precision": {"compute": "fp32"}, "data": {"seq_len": 512},
        "parallel": {"fsdp_one_rank": True}, "trainer": {"device": "cpu", "seed": 7},
    })
    rt = Runtime(job)
    try:
        seen = []
        for layer in blocks(rt.model):
            layer.register_forward_pre_hook(lambda module, args: seen.append(args[1]))
        batch = PackedBatch.from_sequences([[5, 6, 7, 8, 9], [10, 11, 12]],
                                           extras={"weight": [[0.5] * 5, [2.0] * 3]})
        rt.forward_backward([batch], sft_loss(batch.num_target_tokens))
        assert len(seen) == len(blocks(rt.model)) >= 2
        assert {id(b) for b in seen} == {id(seen[0])}  # one PackedBatch object for every block
        assert seen[0].extras["weight"].dtype == torch.float32
    finally:
        rt.close()


def test_fsdp_forward_prefetch_gathers_the_next_unit_before_the_host_reaches_it_with_the_same_numbers():
    """parallel.fsdp_forward_prefetch (on by default): a layer unit's forward queues the next unit's
    all-gather (FSDP2's explicit prefetch, which its profiler ranges name), so a host behind its GPU does not
    also delay the gathers, and the last one queues the untied LM head's, which the loss would otherwise
    gather with nothing to overlap it; off, each unit is gathered when its own forward starts. The numbers
    are the same, bitwise."""
    from torch.profiler import ProfilerActivity, profile

    def run(prefetch: bool):
        job = job_from_dict({
            "model": {"name": "tiny-qwen3-moe"}, "precision": {"compute": "fp32"}, "data": {"seq_len": 512},
            "parallel": {"fsdp_one_rank": True, "fsdp_unit_layers": 1, "fsdp_reshard_after_forward": True,
                         "fsdp_forward_prefetch": prefetch},
            "optimizer": {"lr": 1e-3, "clip_grad": 1.0}, "trainer": {"device": "cpu", "seed": 7},
        })
        rt = Runtime(job)
        try:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                numbers = three_sft_steps(rt)
            prefetched = {e.name.rsplit(" ", 1)[-1] for e in prof.events()
                          if e.name.startswith("FSDP::forward_prefetch for ")}
            return prefetched, rt.arch.num_layers, numbers
        finally:
            rt.close()

    prefetched, layers, with_prefetch = run(True)
    none, _, without = run(False)
    assert prefetched == {*(f"layers.{i}" for i in range(1, layers)), "output"} and none == set()
    torch.testing.assert_close(with_prefetch, without, rtol=0, atol=0)


def test_an_untied_fsdp_head_reduces_its_gradient_before_the_backward_reaches_the_embedding():
    """The LM-head kernel reads an untied FSDP2 head's gathered weight outside the head's forward, so FSDP2's
    hooks never see it used; left to them, its gradient is reduced in FSDP2's end-of-backward callback, where
    nothing overlaps the reduce-scatter. The loss passes the hidden states through the head unit's
    post-backward hook instead: the sharded gradient is there once the kernel's backward has run, before the
    layers' backward ends. The steps train as before: `test_fsdp_one_rank_runs_the_sharded_path_on_one_...`
    compares them with the plain model."""
    job = job_from_dict({
        "model": {"name": "tiny-qwen3-moe"}, "precision": {"compute": "fp32"}, "data": {"seq_len": 512},
        "parallel": {"fsdp_one_rank": True}, "trainer": {"device": "cpu", "seed": 7},
    })
    rt = Runtime(job)
    try:
        assert not rt.arch.tie_embeddings
        head_grad_at_the_embedding = []

        def watch(module, args, output):
            output.register_hook(lambda grad: head_grad_at_the_embedding.append(rt.model.output.weight.grad))

        rt.model.embed.register_forward_hook(watch)
        batch = PackedBatch.from_sequences(sequences([30, 17]))
        for _ in range(2):  # each step's gradient is a new one (zero_grad frees the last)
            rt.zero_grad()
            rt.forward_backward([batch], sft_loss(batch.num_target_tokens))
        assert len(head_grad_at_the_embedding) == 2
        assert all(isinstance(g, DTensor) and g.to_local().abs().sum() > 0
                   for g in head_grad_at_the_embedding)
    finally:
        rt.close()


def test_fsdp_units_are_runs_of_layers_cut_at_the_offload_boundary():
    from mlite.runtime.parallel.parallelize import unit_runs

    assert unit_runs(6, 0, 1) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6)]
    assert unit_runs(6, 0, 4) == [(0, 4), (4, 6)]
    # three offloaded layers: no unit holds both an offloaded layer and a resident one
    assert unit_runs(6, 3, 2) == [(0, 2), (2, 3), (3, 5), (5, 6)]
    assert unit_runs(4, 4, 3) == [(0, 3), (3, 4)]


@pytest.mark.parametrize("every", [1, 0], ids=["every-step", "python"])
def test_gc_every_puts_the_garbage_collector_on_the_step_schedule(every):
    """trainer.gc_every N: Python's automatic collector is off while the Runtime lives, and the optimizer
    step collects the young generations every Nth step, everything every tenth time; close() turns the
    automatic collector back on. 0 leaves Python's own schedule, and the steps collect nothing themselves."""
    import gc

    job = make_job()
    job = job.model_copy(update={"trainer": job.trainer.model_copy(update={"gc_every": every})})
    rt = Runtime(job)
    assert gc.isenabled() == (every == 0)
    batch = PackedBatch.from_sequences(sequences([12, 7]))
    passes = []

    def seen(phase, info):
        if phase == "start":
            passes.append(info["generation"])

    by_step = []
    thresholds = gc.get_threshold()
    gc.set_threshold(10**9)  # no automatic pass in these steps: any pass seen is a step's own
    try:
        for _ in range(10):
            rt.zero_grad()
            rt.forward_backward([batch], sft_loss(batch.num_target_tokens))
            gc.callbacks.append(seen)
            try:
                rt.optimizer_step()
            finally:
                gc.callbacks.remove(seen)
            by_step.append(list(passes))
            passes.clear()
    finally:
        gc.set_threshold(*thresholds)
    assert by_step == ([[1]] * 9 + [[2]] if every else [[]] * 10)
    rt.close()
    assert gc.isenabled()
