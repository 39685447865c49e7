"""verl's own SFT trainer (torchrun, gloo, CPU) with engine=mlite trains a tiny transformers-written model
with the same per-step losses as the mlite runtime driven directly on the same tokens. Needs the `verl`
extra (installed in CI)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from grpo_helpers import char_tokenizer, tiny_hf_qwen3

from mlite.integrations.verl import CONFIG_SEARCHPATH

ROWS = 8
STEPS = 3  # one step per epoch: the batch is the whole data set, so shuffling cannot change a loss


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("verl_sft")
    tokenizer = char_tokenizer(root / "model")
    tiny_hf_qwen3(root / "model", tokenizer)
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"{a} + {b}?"},
                {"role": "assistant", "content": f"The answer is {a + b}."},
            ]
        }
        for a, b in zip(range(ROWS), range(3, 3 + ROWS))
    ]
    pq.write_table(pa.Table.from_pylist(rows), root / "train.parquet")
    return root


OVERRIDES = [
    f"hydra.searchpath=[{CONFIG_SEARCHPATH}]",
    "engine=mlite",
    "engine.device=cpu",
    "engine.dtype=float32",
    f"data.train_batch_size={ROWS}",
    "data.micro_batch_size_per_gpu=4",
    "data.use_dynamic_bsz=false",
    "data.max_length=64",
    "data.num_workers=0",
    "optim.lr=1e-2",
    "optim.weight_decay=0.0",
    "optim.lr_scheduler_type=constant",
    f"trainer.total_epochs={STEPS}",
    "trainer.logger=console",
    "trainer.device=cpu",
    "trainer.save_freq=-1",
    "trainer.test_freq=-1",
]


def test_verl_sft_trainer_with_mlite_engine_matches_the_runtime(setup, tmp_path):
    args = [
        f"model.path={setup / 'model'}",
        f"data.train_files=[{setup / 'train.parquet'}]",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        f"hydra.run.dir={tmp_path / 'hydra'}",
        *OVERRIDES,
    ]
    env = {**os.environ, "VERL_PLATFORM": "cpu", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "1",
            "--master-port",
            "29731",
            "-m",
            "mlite.integrations.verl.sft_trainer",
            *args,
        ],
        capture_output=True,
        check=False,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    verl_losses = [float(x) for x in re.findall(r"train/loss:([0-9.]+)", result.stdout)]
    assert len(verl_losses) == STEPS, result.stdout[-3000:]
    assert (tmp_path / "ckpt" / f"global_step_{STEPS}").is_dir()  # saved through the runtime's checkpoints

    assert verl_losses == pytest.approx(runtime_losses(setup), rel=1e-4)
    assert verl_losses[-1] < verl_losses[0]


def runtime_losses(setup: Path) -> list[float]:
    """The same job on the mlite runtime directly: verl's tokenised samples, one full-batch step each."""
    from hydra import compose, initialize_config_module
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset

    from mlite.config import job_from_dict
    from mlite.integrations.verl.config_schema import to_job_dict
    from mlite.runtime.data.packed import PackedBatch
    from mlite.runtime.engine import Runtime
    from mlite.runtime.loss import sft_loss

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose("sft_trainer_engine", overrides=[f"model.path={setup / 'model'}", *OVERRIDES])
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(setup / "model")
    dataset = MultiTurnSFTDataset(
        parquet_files=[str(setup / "train.parquet")], tokenizer=tokenizer, config=cfg.data
    )
    samples = [dataset[i] for i in range(len(dataset))]
    seqs = [s["input_ids"].tolist() for s in samples]
    masks = [s["loss_mask"].tolist() for s in samples]
    micro = [PackedBatch.from_sequences(seqs[i : i + 4], masks[i : i + 4]) for i in range(0, len(seqs), 4)]
    targets = sum(b.num_target_tokens for b in micro)

    engine, optim = omega_conf_to_dataclass(cfg.engine), omega_conf_to_dataclass(cfg.optim)
    seq_len = AutoConfig.from_pretrained(setup / "model").max_position_embeddings  # as the engine passes it
    runtime = Runtime(job_from_dict(to_job_dict(engine, str(setup / "model"), optim, STEPS, seq_len)))
    losses = []
    for _ in range(STEPS):
        runtime.zero_grad()
        outs = runtime.forward_backward(micro, sft_loss(targets))
        runtime.optimizer_step()
        runtime.lr_scheduler_step()
        losses.append(float(sum(o["loss"] for o in outs)))
    return losses
