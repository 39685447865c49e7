"""engine=mlite built through verl's registry: forward/backward, log-probs and the optimizer step equal
calling the mlite runtime directly on the same data. Needs the `verl` extra (installed in CI)."""

from __future__ import annotations

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


def build_engine(model_dir, lr=1e-2):
    verl_cpu()
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    from mlite.integrations.verl.config_schema import MliteEngineConfig

    engine = EngineRegistry.new(
        model_type="language_model",
        backend="mlite",
        model_config=HFModelConfig(path=str(model_dir)),
        engine_config=MliteEngineConfig(device="cpu", dtype="float32", seed=1),
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
    # equal up to fp32 summation order (Adam turns 1e-9 gradient noise on near-zero entries into visible steps)
    assert float((ours - direct_update).norm() / direct_update.norm()) < 1e-4
