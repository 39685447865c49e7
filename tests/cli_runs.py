"""Shared by the tests that run the real CLI (`mlite sft|grpo`, under torchrun for several gloo ranks) and
compare a layout's run with the one-process run: tiny assets, job dicts, the launch, the metrics records
and the comparisons."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from mlite.trainers.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).parent
# one intra-op thread per rank; the tests folder importable by the ranks (GRPO rewards: grpo_helpers)
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
STEPS = 4
RTOL = 1e-5
VOLATILE = ("time/", "tokens_per_s", "step_time_s")  # wall-clock figures differ between runs

MODEL_COMMON = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "tie_word_embeddings": False, "max_position_embeddings": 256}
MOE = {"model_type": "qwen3_moe", "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 4,
       "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
       "router_aux_loss_coef": 0.1}
# one layer of half the width: a step takes milliseconds
ONE_LAYER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
             "num_key_value_heads": 1}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread in this process, as in the subprocesses (OMP_NUM_THREADS=1): the same kernels
    for the in-process one-process runs, and no spin-waiting on the two shared cores. A module imports it
    to use it (autouse)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def write_model_config(folder: Path, vocab_size: int, moe: bool, tied: bool = False, **sizes) -> Path:
    """A tiny Qwen3 (dense) or Qwen3-MoE config.json, untied unless `tied` (pipeline stages hold the
    embedding and the LM head apart: a tied matrix is refused under pp); `sizes` replace config keys
    (ONE_LAYER)."""
    config = {"vocab_size": vocab_size, **MODEL_COMMON, "tie_word_embeddings": tied,
              **(MOE if moe else {"model_type": "qwen3", "intermediate_size": 128}), **sizes}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def demo_assets(root: Path, train: int, val: int, seed: int, rows: int) -> tuple[dict[str, Path], int]:
    """Demo data under root/data and the demo tokenizer trained on `rows` of it under root/tokenizer: the
    data files (write_demo_data's) and the tokenizer's vocabulary size."""
    from mlite.runtime.data.demo import write_demo_data
    from mlite.runtime.data.tokenizer import train_demo_tokenizer

    files = write_demo_data(root / "data", train=train, val=val, seed=seed)
    tokenizer = train_demo_tokenizer(root / "tokenizer", seed=seed, vocab_size=256, rows=rows)
    return files, len(tokenizer)


def sft_assets(root: Path, train: int, val: int, seed: int, rows: int, **sizes) -> dict:
    """demo_assets and a tiny tied dense Qwen3 config sized to the tokenizer under root/model (`sizes`
    replace config keys: ONE_LAYER), as paths: train (JSONL), val (parquet), tokenizer, model, and root."""
    files, vocab_size = demo_assets(root, train, val, seed, rows)
    write_model_config(root / "model", vocab_size, moe=False, tied=True, **sizes)
    return {"train": str(files["train.jsonl"]), "val": str(files["val.parquet"]),
            "tokenizer": str(root / "tokenizer"), "model": str(root / "model"), "root": root}


def layout_assets(root: Path) -> dict:
    """Demo data, a tokenizer trained on it, and the tiny dense, MoE and tied dense configs sized to the
    tokenizer."""
    files, vocab_size = demo_assets(root, train=64, val=8, seed=2, rows=200)
    for name in ("dense", "moe", "tied"):
        write_model_config(root / name, vocab_size, moe=name == "moe", tied=name == "tied")
    return {"train": str(files["train.jsonl"]), "val": str(files["val.jsonl"]),
            "tokenizer": str(root / "tokenizer"), "root": root}


def job_dict(assets, model: str, out: Path, **sections) -> dict:
    """An SFT job of `model` (a folder under assets["root"]) on the demo data, fp32 on CPU, STEPS steps;
    `sections` update the job's sections key by key."""
    job = {
        "job": "sft",
        "model": {"path": str(assets["root"] / model), "load_weights": False},
        "cluster": {"gpu": "cpu", "gpus_per_node": 1},
        "optimizer": {"lr": 2e-3, "warmup_steps": 1, "clip_grad": 1.0},
        "precision": {"compute": "fp32"},
        "data": {"train_files": [assets["train"]], "val_files": [assets["val"]],
                 "tokenizer": assets["tokenizer"], "seq_len": 128,
                 "global_batch_size": 8, "max_tokens_per_micro_batch": 160},
        "trainer": {"steps": STEPS, "seed": 5, "output_dir": str(out), "save_every": 2, "log_every": 1,
                    "eval_every": 2, "device": "cpu", "tensorboard": False},
    }
    if model.startswith("moe"):
        # one sequence per micro-batch: the balance loss pools router statistics per micro-batch, so the
        # micro-batches must be the same under every data-parallel degree for the numbers to be
        job["data"] |= {"dynamic_batch": False, "micro_batch_size": 1, "max_tokens_per_micro_batch": None}
    for name, values in sections.items():
        job[name] = {**job.get(name, {}), **values}
    return job


def records(out: Path, key: str = "loss") -> list[dict]:
    """The run's step records (those with `key`: SFT's loss, GRPO's reward/mean)."""
    return [r for r in read_metrics(out / "metrics.jsonl") if key in r]


def held_out(out: Path) -> list[float]:
    """The held-out losses (forward-only passes: log-probs as the trainer receives them)."""
    return [r["val_loss"] for r in read_metrics(out / "metrics.jsonl") if "val_loss" in r]


def mlite_cli(tmp_path: Path, job: dict, ranks: int, *overrides: str, timeout: int = 300,
              env: dict | None = None) -> subprocess.CompletedProcess:
    """`mlite <job["job"]> job.yaml --no-progress --set ...` as a user runs it: on one process, or under
    `torchrun --standalone --nproc-per-node ranks` (gloo on CPU); `env`: variables added to the run's."""
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job))
    launcher = (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
                if ranks > 1 else [])
    sets = [arg for o in overrides for arg in ("--set", o)]
    return subprocess.run([sys.executable, *launcher, "-m", "mlite", job.get("job", "sft"), str(config),
                           "--no-progress", *sets],
                          cwd=ROOT, env={**ENV, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout, check=False)


def failure(done: subprocess.CompletedProcess, limit: int = 6000) -> str:
    """A failed run's stderr for an assertion message: the first traceback or fatal error (under torchrun,
    the rank that failed first; the others' errors follow it) and the end, within `limit` characters."""
    text = done.stderr
    if len(text) <= limit:
        return text
    first = min((i for i in (text.find("Traceback"), text.find("Fatal Python error")) if i >= 0), default=0)
    return text[first:first + limit // 2] + "\n[...]\n" + text[-limit // 2:]


def assert_same_curve(got: list[dict], want: list[dict], rtol: float = RTOL) -> None:
    """SFT: the same steps, token counts, and per-step loss and grad norm within `rtol`."""
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for ours, ref in zip(got, want):
        assert (ours["tokens"], ours["target_tokens"]) == (ref["tokens"], ref["target_tokens"]), ours["step"]
        assert ours["loss"] == pytest.approx(ref["loss"], rel=rtol), f"step {ours['step']}: loss"
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=rtol), \
            f"step {ours['step']}: grad norm"


def stable(rows: list[dict]) -> list[dict]:
    """Records without their wall-clock figures."""
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def assert_same_records(got: list[dict], want: list[dict], rtol: float = RTOL, atol: float = 1e-6) -> None:
    """Every figure of every step but the wall-clock ones: the same keys, each within `rtol`, or `atol` for
    figures near 0 that are differences of fp32 log-probs (KL estimates, a PPO KL before the first update,
    a pg loss of zero-mean advantages): a log-prob of about -5 carries about 5 x 1.2e-7 of rounding."""
    got, want = stable(got), stable(want)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for ours, ref in zip(got, want):
        assert sorted(ours) == sorted(ref), f"step {ref['step']}: other keys"
        for key, value in ref.items():
            assert ours[key] == pytest.approx(value, rel=rtol, abs=atol), f"step {ref['step']}: {key}"
