"""engine=mlite built through verl's registry: forward/backward, log-probs and the optimizer step equal
calling the mlite runtime directly on the same data. Needs the `verl` extra (installed in CI)."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from grpo_helpers import tiny_hf_qwen3

from mlite.integrations.verl.platform_cpu import PlatformCPU


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen3 written by transformers (safetensors) with its tokenizer next to it."""
    return tiny_hf_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))


def verl_cpu():
    """verl has no CPU platform of its own: select ours through verl's platform registry API."""
    from verl.plugin.platform import platform_manager

    import mlite.integrations.verl  # noqa: F401  (registered by `import verl` through the entry point)

    if platform_manager._current_platform is None or platform_manager._current_platform.device_name != "cpu":
        platform_manager.set_platform(PlatformCPU())


def build_engine(model_dir, lr=1e-2, dtype="float32", device="cpu"):
    if device == "cpu":
        verl_cpu()
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    from mlite.integrations.verl.config_schema import MliteEngineConfig

    engine = EngineRegistry.new(
        model_type="language_model",
        backend="mlite",
        model_config=HFModelConfig(path=str(model_dir)),
        engine_config=MliteEngineConfig(device=device, dtype=dtype, seed=1),
        optimizer_config=FSDPOptimizerConfig(lr=lr, weight_decay=0.0, clip_grad=1.0, total_training_steps=4),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine


SEQS = [[3, 9, 14, 15, 20, 21, 22, 2], [3, 30, 31, 2], [3, 40, 41, 42, 43, 44, 2], [3, 50, 51, 52, 53, 2]]
PROMPT_LENS = [3, 2, 4, 2]  # loss only on what follows the prompt


def verl_batch(micro_batch_size=2):
    """What verl's SFT collator hands the engine: jagged tensors plus meta information."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import SFTTensorCollator

    samples = [
        {
            "input_ids": torch.tensor(s),
            "position_ids": torch.arange(len(s)),
            "loss_mask": torch.tensor([0] * p + [1] * (len(s) - p)),
        }
        for s, p in zip(SEQS, PROMPT_LENS)
    ]
    data = SFTTensorCollator(pad_mode="no_padding")(samples)
    meta = {
        "use_dynamic_bsz": False,
        "micro_batch_size_per_gpu": micro_batch_size,
        "temperature": 1.0,
        "pad_mode": "no_padding",
        "global_batch_size": len(SEQS),
    }
    return tu.get_tensordict(tensor_dict=data, non_tensor_dict=meta)


def mlite_batches(every_token: bool = False):
    from mlite.runtime.data.packed import PackedBatch

    masks = None if every_token else [[0] * p + [1] * (len(s) - p) for s, p in zip(SEQS, PROMPT_LENS)]
    return [PackedBatch.from_sequences(SEQS, masks)]


def flat_params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_engine_comes_from_verls_registry(model_dir):
    from mlite.integrations.verl.engine import MliteEngineWithLMHead

    engine = build_engine(model_dir)
    assert type(engine) is MliteEngineWithLMHead
    assert engine.get_data_parallel_size() == 1 and engine.is_mp_src_rank_with_outputs()
    names = dict(engine.get_per_tensor_param()[0])
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names


def test_log_probs_equal_the_runtime(model_dir):
    engine = build_engine(model_dir)
    with engine.eval_mode():
        output = engine.infer_batch(verl_batch())
    theirs = output["model_output"]["log_probs"]
    (ours,) = engine.runtime.forward_backward(mlite_batches(every_token=True), None, forward_only=True)
    # verl's layout: position t holds log p(token t+1); the last position of a sequence is not a prediction
    ends = torch.cumsum(torch.tensor([len(s) for s in SEQS]), 0).tolist()
    for lp, start, end in zip(theirs.unbind(), [0] + ends[:-1], ends, strict=True):
        torch.testing.assert_close(lp[:-1], ours["logprobs"][start : end - 1], rtol=1e-6, atol=1e-6)


def test_sft_train_step_equals_the_runtime(model_dir):
    from verl.workers.utils.losses import sft_loss

    from mlite.runtime.loss import sft_loss as mlite_sft_loss

    engine = build_engine(model_dir)
    with engine.train_mode():
        out = engine.train_batch(verl_batch(micro_batch_size=2), partial(sft_loss, config=None))

    reference = build_engine(model_dir).runtime  # the same runtime, driven directly
    targets = sum(len(s) - p for s, p in zip(SEQS, PROMPT_LENS))
    reference.zero_grad()
    (direct,) = reference.forward_backward(mlite_batches(), mlite_sft_loss(targets))
    grad_norm, skipped = reference.optimizer_step()

    assert len(out["loss"]) == 2  # two micro-batches, whose shares add up to the step's loss
    assert sum(out["loss"]) == pytest.approx(direct["loss"], rel=1e-5)
    assert out["metrics"]["grad_norm"] == pytest.approx(grad_norm, rel=1e-4) and not skipped
    initial = flat_params(build_engine(model_dir).runtime.model)
    ours, direct_update = flat_params(engine.runtime.model) - initial, flat_params(reference.model) - initial
    assert direct_update.norm() > 0
    # equal up to fp32 summation order (Adam turns 1e-9 gradient noise on near-zero entries into visible
    # steps)
    assert float((ours - direct_update).norm() / direct_update.norm()) < 1e-4


# -------------------------------------------------------------- LoRA keys: refused in one line
@pytest.mark.parametrize(
    "model_kwargs, key, instead",
    [
        ({"lora_rank": 8}, "model.lora_rank=8", "fsdp"),  # verl's FSDP engine's key
        ({"lora": {"rank": 4}}, "model.lora.rank=4", "megatron"),  # verl's Megatron engine's key
        ({"lora_adapter_path": "/adapters/a"}, "model.lora_adapter_path", "fsdp"),
    ],
)
def test_lora_is_refused_before_anything_is_built(model_dir, model_kwargs, key, instead):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    from mlite.errors import MliteError
    from mlite.integrations.verl.config_schema import MliteEngineConfig

    verl_cpu()
    with pytest.raises(MliteError) as err:  # at construction: no runtime, model or optimizer yet
        EngineRegistry.new(
            model_type="language_model",
            backend="mlite",
            model_config=HFModelConfig(path=str(model_dir), **model_kwargs),
            engine_config=MliteEngineConfig(device="cpu", dtype="float32"),
            optimizer_config=FSDPOptimizerConfig(lr=1e-3),
            checkpoint_config=CheckpointConfig(),
        )
    message = str(err.value)
    assert message.startswith(key) and "LoRA is not supported" in message
    assert f"actor_rollout_ref.{key.split('=')[0]}" in message and f"use the {instead} engine" in message
    assert "\n" not in message


def test_weight_stream_is_in_the_compute_dtype(model_dir):
    from mlite.integrations.verl.engine import weight_sync_dtype

    # on GPUs the runtime computes in engine.dtype (bf16 normally) and so do the rollouts it feeds
    assert weight_sync_dtype("bf16", "cuda") is torch.bfloat16
    assert weight_sync_dtype("fp16", "cuda") is torch.float16
    assert weight_sync_dtype("fp32", "cuda") is torch.float32
    # the CPU runtime computes in fp32 whatever engine.dtype says, and so does the rollout server on CPU
    assert weight_sync_dtype("bf16", "cpu") is torch.float32

    engine = build_engine(model_dir, dtype="bfloat16")  # verl's default engine.dtype, on CPU
    stream, peft_config = engine.get_per_tensor_param()
    assert peft_config is None  # verl's engines: None without a LoRA adapter
    weights = dict(stream)
    assert {t.dtype for t in weights.values()} == {torch.float32}
    masters = dict(engine.runtime.export_weights())
    assert weights.keys() == masters.keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, masters[name]), name


def test_model_output_only_when_asked_for(model_dir):
    """verl's FSDP engine drops `model_output` after a training micro-batch unless the batch carries
    `return_model_output=True` (verl's split-step workers set it); inference always returns it."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import sft_loss

    engine = build_engine(model_dir)
    with engine.eval_mode():
        inferred = engine.infer_batch(verl_batch())["model_output"]["log_probs"]
    loss = partial(sft_loss, config=None)
    with engine.train_mode():
        plain = engine.forward_backward_batch(verl_batch(), loss, forward_only=False)
        data = verl_batch()
        tu.assign_non_tensor(data, return_model_output=True)
        asked = engine.forward_backward_batch(data, loss, forward_only=False)
    assert plain["model_output"] == {} and len(plain["loss"]) == 2
    # the training forward ran on the weights inference saw (no optimizer step in between)
    for ours, reference in zip(asked["model_output"]["log_probs"].unbind(), inferred.unbind(), strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)
    assert asked["loss"] == pytest.approx(plain["loss"], rel=1e-6)


def test_module_and_optimizer_are_what_verl_steps(model_dir):
    """verl's split-step (Tinker) worker sets step-time optimizer params on `engine.optimizer`'s param
    groups before `optimizer_step`; other workers read and restore `engine.module`'s weights."""
    from verl.workers.engine_workers_tinker import _apply_optim_step_params
    from verl.workers.utils.losses import sft_loss

    engine = build_engine(model_dir)
    assert engine.module is engine.runtime.model and isinstance(engine.optimizer, torch.optim.Optimizer)
    before = flat_params(engine.module)
    with engine.train_mode():
        _apply_optim_step_params(engine.optimizer, {"lr": 0.0})
        frozen = engine.train_batch(verl_batch(), partial(sft_loss, config=None))
    assert frozen["metrics"]["grad_norm"] > 0 and torch.equal(flat_params(engine.module), before)
    with engine.train_mode():
        _apply_optim_step_params(engine.optimizer, {"lr": 1e-2})
        engine.train_batch(verl_batch(), partial(sft_loss, config=None))
    assert not torch.equal(flat_params(engine.module), before)


def test_offload_moves_what_verl_asks_for(model_dir):
    """`engine.to(device, model=, optimizer=)` (verl's offload around rollouts) moves what the flags name:
    the Adam moments with `optimizer`, never the step counts. A CPU machine has one device for parameters
    (torch refuses to swap a CPU parameter's data for a `meta` tensor), so the parameters' own move runs on
    GPUs only; here `meta` shows what moved, and a move to the runtime's device keeps every object."""
    from verl.workers.utils.losses import sft_loss

    engine = build_engine(model_dir)
    with engine.train_mode(zero_grad_on_exit=False):
        engine.train_batch(verl_batch(), partial(sft_loss, config=None))
    params = list(engine.module.parameters())
    state = engine.optimizer.state[params[0]]
    before = flat_params(engine.module)

    engine.to("cpu")  # the runtime's own device: the same parameters (the optimizer holds them), same values
    assert [id(p) for p in engine.module.parameters()] == [id(p) for p in params]
    assert torch.equal(flat_params(engine.module), before) and all(p.grad is not None for p in params)
    engine.to("meta", model=False, optimizer=True, grad=False)
    assert all(p.device.type == "cpu" and p.grad.device.type == "cpu" for p in params)
    assert state["exp_avg"].device.type == "meta" and state["exp_avg_sq"].shape == params[0].shape
    assert state["step"].device.type == "cpu"  # Adam's step count stays where the optimizer reads it


@pytest.mark.gpu
def test_offload_hooks_on_a_gpu_leave_it_and_come_back_bit_for_bit(model_dir, monkeypatch):
    """verl's offload around its rollouts, on a GPU: `to("cpu")` moves the weights, gradients and Adam state
    to pinned host memory (the GPU's allocated bytes fall by at least the weights and both moments), and
    `to("cuda")` brings them back. The next steps equal those of an engine that never moved, bit for bit."""
    from verl.workers.utils.losses import sft_loss

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, as trainer.deterministic

    def run(offload: bool):
        engine = build_engine(model_dir, dtype="bfloat16", device="cuda")
        norms, moved = [], None
        for step in range(3):
            with engine.train_mode(zero_grad_on_exit=False):
                out = engine.train_batch(verl_batch(), partial(sft_loss, config=None))
            norms.append(out["metrics"]["grad_norm"])
            if offload and step == 1:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                engine.to("cpu")
                moved = before - torch.cuda.memory_allocated()
                assert all(p.device.type == "cpu" for p in engine.module.parameters())
                engine.to("cuda")
                assert all(p.device.type == "cuda" for p in engine.module.parameters())
        weights = flat_params(engine.module).cpu()
        del engine
        torch.cuda.empty_cache()
        return norms, weights, moved

    want_norms, want_weights, _ = run(offload=False)
    norms, weights, moved = run(offload=True)
    assert moved >= 0.9 * 3 * 4 * weights.numel()  # the fp32 weights, exp_avg and exp_avg_sq left
    assert norms == want_norms and torch.equal(weights, want_weights)


def _ranks_before_and_after_initialize(rank, world, model_dir, reference, weights):
    """On each gloo rank: what the engine answers before `initialize` (from the layout's arithmetic) must
    be what the runtime's meshes answer after it; then log-probs must equal one process's, and the weight
    stream verl's rollout sync reads must give every rank every HF tensor whole, as one process has it
    (pipeline stages included)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry
    from verl.workers.utils.losses import sft_loss

    from mlite.errors import MliteError
    from mlite.integrations.verl.config_schema import MliteEngineConfig

    verl_cpu()
    for pp, tp, cp in [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)]:  # world 2: dp2, pp2, tp2, cp2
        engine = EngineRegistry.new(
            model_type="language_model",
            backend="mlite",
            model_config=HFModelConfig(path=str(model_dir)),
            engine_config=MliteEngineConfig(
                device="cpu", dtype="float32", seed=1, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                context_parallel_size=cp,
            ),
            optimizer_config=FSDPOptimizerConfig(lr=1e-3, total_training_steps=1),
            checkpoint_config=CheckpointConfig(),
        )
        before = (
            engine.get_data_parallel_rank(),
            engine.get_data_parallel_size(),
            engine.is_mp_src_rank_with_outputs(),
        )
        engine.initialize()
        after = (
            engine.get_data_parallel_rank(),
            engine.get_data_parallel_size(),
            engine.is_mp_src_rank_with_outputs(),
        )
        assert before == after, (pp, tp, cp, rank, before, after)
        # (dp rank, dp size, has the outputs): every dp rank; the last pp stage; tp rank 0; cp rank 0
        expected = {(1, 1, 1): (rank, 2, True), (2, 1, 1): (0, 1, rank == 1), (1, 2, 1): (0, 1, rank == 0),
                    (1, 1, 2): (0, 1, rank == 0)}[pp, tp, cp]
        assert after == expected, (pp, tp, cp, rank, after)
        with engine.eval_mode():
            log_probs = engine.infer_batch(verl_batch())["model_output"]["log_probs"]
        for ours, theirs in zip(log_probs.unbind(), reference, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        streamed = [(name, tensor.clone()) for name, tensor in engine.get_per_tensor_param()[0]]
        assert sorted(name for name, _ in streamed) == sorted(weights), (pp, tp, cp)
        for name, tensor in streamed:
            assert torch.equal(tensor, weights[name]), (pp, tp, cp, rank, name)
        if cp > 1:  # verl's loss needs whole sequences: training under cp is refused in one line
            with pytest.raises(MliteError, match="context_parallel_size=2: training through verl's loss"):
                with engine.train_mode():
                    engine.train_batch(verl_batch(), partial(sft_loss, config=None))
        engine.runtime.close()


@pytest.mark.slow
def test_ranks_before_initialize_are_the_runtimes(model_dir):
    from parallel_harness import launch

    engine = build_engine(model_dir)
    with engine.eval_mode():
        reference = list(engine.infer_batch(verl_batch())["model_output"]["log_probs"].unbind())
    weights = {name: tensor.clone() for name, tensor in engine.get_per_tensor_param()[0]}
    launch(2, _ranks_before_and_after_initialize, str(model_dir), reference, weights)


@pytest.mark.parametrize("world,tp", [(3, 1), (16, 1), (16, 2)])
def test_engine_jobs_pass_the_rule_book_on_any_data_parallel_degree(model_dir, world, tp):
    """verl batches the data itself: the engine's job carries a global batch every dp of the world divides,
    so the rule book never refuses a verl layout over mlite's own (unused) batch size."""
    from verl.workers.config import FSDPOptimizerConfig

    from mlite.config import job_from_dict
    from mlite.config.arch import arch_from_hf_config
    from mlite.integrations.verl.config_schema import MliteEngineConfig, to_job_dict
    from mlite.plan.rules import check_job

    job = job_from_dict(to_job_dict(MliteEngineConfig(device="cpu", dtype="float32", tensor_parallel_size=tp),
                                    str(model_dir), FSDPOptimizerConfig(lr=1e-3), 1, 256, world))
    config = json.loads((model_dir / "config.json").read_text())
    layout = check_job(job, arch_from_hf_config(config), world, "cpu", False)
    assert layout.dp == world // tp


# ------------------------------------------------------------ sharded weight sync, checkpoints
def _dense(name, local, spec) -> torch.Tensor:
    """An entry of get_per_tensor_param_shard placed into its HF tensor (positions translated by verl)."""
    from verl.workers.engine.spec import translate_flat_indices

    whole = torch.zeros(spec.full_shape, dtype=local.dtype).view(-1)
    whole[translate_flat_indices(torch.arange(local.numel()), spec.place)] = local
    return whole.view(spec.full_shape)


def test_sharded_export_is_the_full_export(model_dir):
    """get_per_tensor_param_shard: one entry per HF tensor, in HF names and coordinates, that verl's own
    placement math puts back into the tensor get_per_tensor_param streams (one process: every entry whole,
    a contributor)."""
    engine = build_engine(model_dir)
    full = dict(engine.get_per_tensor_param()[0])
    entries, peft = engine.get_per_tensor_param_shard()
    entries = list(entries)
    assert peft is None and [name for name, _, _ in entries] == list(full)
    for name, local, spec in entries:
        assert spec.contributes and spec.gather_group is None and spec.to_hf_chunk is None
        assert torch.equal(_dense(name, local, spec), full[name]), name


def test_delta_shards_carry_what_a_step_changed(model_dir):
    """verl's delta_sharded sync: seed (full export) and snapshots, one training step, then the HF deltas
    applied to the seed give the new weights."""
    from verl.workers.utils.losses import sft_loss

    engine = build_engine(model_dir)
    seed = {name: t.clone() for name, t in engine.get_per_tensor_param()[0]}
    engine.prime_delta_snapshots()
    with engine.train_mode():
        engine.train_batch(verl_batch(), partial(sft_loss, config=None))
    entries, _ = engine.get_per_tensor_param_delta_shard()
    changed = 0
    for slots, dtype, counts, idx, val, group in entries:
        ((name, shape),) = slots
        assert group is None and dtype == "float32" and counts.tolist() == [idx.numel()]
        seed[name].view(-1)[idx.long()] = val
        changed += idx.numel()
    assert changed > 0
    for name, tensor in engine.get_per_tensor_param()[0]:
        assert torch.equal(seed[name], tensor), name


def test_delta_entry_of_a_rank_with_several_pieces():
    """A rank that sends two boxes of one tensor (a strided shard) flattens both into one entry: each
    changed position lands in its own box."""
    from verl.workers.engine.spec import BlockPlacement, ShardSpec

    from mlite.integrations.verl.engine import hf_delta_entry

    blocks = (BlockPlacement((2, 3), (0, 1), (4, 5)), BlockPlacement((1, 2), (3, 0), (4, 5)))
    spec = ShardSpec(full_shape=(4, 5), place=blocks, contributes=True)
    lidx = torch.tensor([0, 5, 6, 7])  # the first box's corners, then both entries of the second
    slots, dtype, counts, gidx, val = hf_delta_entry("w", spec, blocks, lidx, torch.ones(4))
    assert slots == [("w", (4, 5))] and counts.tolist() == [4] and dtype == "float32"
    assert gidx.tolist() == [0 * 5 + 1, 1 * 5 + 3, 3 * 5 + 0, 3 * 5 + 1]


def test_checkpoints_rotate_and_write_an_hf_export(model_dir, tmp_path):
    """verl's checkpoint contract: max_ckpt_to_keep=2 keeps the newest two saves of the engine; save_contents
    with hf_model writes, next to the mlite checkpoint, an HF checkpoint (and tokenizer) transformers loads
    as the trained model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.trainer.config import CheckpointConfig

    engine = build_engine(model_dir)
    engine.checkpoint_config = CheckpointConfig(save_contents=["model", "optimizer", "extra", "hf_model"])
    saves = [tmp_path / f"global_step_{step}" / "actor" for step in (1, 2, 3)]
    for step, path in enumerate(saves, start=1):
        engine.save_checkpoint(str(path), global_step=step, max_ckpt_to_keep=2)
    assert [p.exists() for p in saves] == [False, True, True]
    assert (saves[-1] / "mlite" / "meta.json").is_file()
    exported = AutoModelForCausalLM.from_pretrained(saves[-1] / "huggingface")
    ours = dict(engine.get_per_tensor_param()[0])
    theirs = exported.state_dict()
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        assert torch.equal(theirs[name], tensor), name
    assert len(AutoTokenizer.from_pretrained(saves[-1] / "huggingface")) == len(engine.model_config.tokenizer)

    engine.checkpoint_config = CheckpointConfig(save_contents=["hf_model"])  # the export alone
    engine.save_checkpoint(str(tmp_path / "hf_only"), global_step=4, max_ckpt_to_keep=None)
    assert sorted(p.name for p in (tmp_path / "hf_only").iterdir()) == ["huggingface"]
    assert saves[1].exists()  # None keeps every save


def test_unknown_save_contents_are_refused():
    from types import SimpleNamespace

    from mlite.errors import MliteError
    from mlite.integrations.verl.engine import save_contents

    assert save_contents(None) == {"model", "optimizer", "extra"}
    with pytest.raises(MliteError, match="checkpoint.save_contents: 'hf' is not one of model, optimizer"):
        save_contents(SimpleNamespace(save_contents=["model", "hf"]))
