"""Bad input through the real CLI: one line on stderr that names the problem and the fix, exit status 2,
no traceback, nothing of the user's lost. Most cases stop in config validation or at data loading, before
any model is built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_runs import ONE_LAYER, sft_assets, write_model_config

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
OK_JOB = {"model": {"name": "tiny-qwen3"}, "data": {"seq_len": 512}}  # `mlite plan` exits 0 on it


def mlite(*args: str, env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlite", *args], cwd=ROOT, env=env or ENV,
                          capture_output=True, text=True, timeout=timeout, check=False)


def one_line_error(done: subprocess.CompletedProcess, *words: str) -> str:
    """The run exited 2 with exactly one non-empty stderr line, which holds each of `words`."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and len(lines) == 1, done.stderr[-3000:]
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def write_job(path: Path, job: dict) -> Path:
    path.write_text(yaml.safe_dump(job))
    return path


# ------------------------------------------------------------------------------------- the job file
def test_a_job_file_that_is_not_utf8_is_one_line(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_bytes(b"model:\n  name: tiny-qwen3\n# caf\xe9 au lait\n")
    line = one_line_error(mlite("plan", str(job)), str(job), "UTF-8", "line 3")
    assert len(line) < 400


def test_a_yaml_alias_bomb_is_refused_in_seconds(tmp_path):
    """Nine lists of nine, each of the one before: 415 bytes that expand to 9^9 strings."""
    levels = ["&a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for prev, name in zip("abcdefgh", "bcdefghi"):
        levels.append(f"&{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("model: {name: tiny-qwen3}\noptimizer:\n  lr: [" + ", ".join(levels) + "]\n")
    assert len(bomb.read_bytes()) < 600
    line = one_line_error(mlite("plan", str(bomb), timeout=30), str(bomb), "alias")
    assert len(line) < 400


def test_a_long_bad_value_is_shown_as_a_short_excerpt(tmp_path):
    job = write_job(tmp_path / "job.yaml", {**OK_JOB, "optimizer": {"lr": list(range(5000))}})
    line = one_line_error(mlite("plan", str(job)), "optimizer.lr")
    assert len(line) < 400


@pytest.mark.parametrize("override", ["optimizer.lr=.inf", "optimizer.eps=.inf", "optimizer.lr=.nan",
                                      "trainer.hang_timeout_s=.inf", "cluster.host_memory_gb=.inf"])
def test_non_finite_numbers_are_refused(tmp_path, override):
    job = write_job(tmp_path / "job.yaml", OK_JOB)
    key = override.partition("=")[0]
    one_line_error(mlite("plan", str(job), "--set", override), key, "finite")


def test_adam_betas_must_be_in_zero_one(tmp_path):
    job = write_job(tmp_path / "job.yaml", {**OK_JOB, "optimizer": {"betas": [2, 5]}})
    one_line_error(mlite("plan", str(job)), "optimizer.betas", "[0, 1)")


@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_output_dir_is_refused(tmp_path, value):
    job = write_job(tmp_path / "job.yaml", {**OK_JOB, "trainer": {"output_dir": value}})
    one_line_error(mlite("plan", str(job)), "trainer.output_dir", "empty")


# ------------------------------------------------------------------------------------------ overrides
@pytest.mark.parametrize("value", ["[unclosed", "{a: 1", "'open", '"open'])
def test_a_malformed_override_value_is_refused(tmp_path, value):
    job = write_job(tmp_path / "job.yaml", OK_JOB)
    one_line_error(mlite("plan", str(job), "--set", f"data.tokenizer={value}"), f"data.tokenizer={value}",
                   "YAML")


def test_plain_string_overrides_still_work(tmp_path):
    job = write_job(tmp_path / "job.yaml", OK_JOB)
    done = mlite("plan", str(job), "--json", "--set", "data.tokenizer=/a/b", "--set", "trainer.resume=auto",
                 "--set", "trainer.output_dir=runs/my run", "--set", "data.messages_key=it's")
    assert done.returncode == 0, done.stderr


def test_recommend_top_must_be_positive(tmp_path):
    job = write_job(tmp_path / "job.yaml", OK_JOB)
    one_line_error(mlite("plan", str(job), "--recommend", "--top", "0"), "--top", "at least 1")


# -------------------------------------------------------------------------------------- environment
@pytest.mark.parametrize("name", ["WORLD_SIZE", "RANK", "LOCAL_RANK"])
def test_a_launcher_variable_that_is_not_a_number_is_one_line(tmp_path, name):
    job = write_job(tmp_path / "job.yaml", {
        **OK_JOB, "cluster": {"gpu": "cpu", "gpus_per_node": 1}, "precision": {"compute": "fp32"},
        "trainer": {"device": "cpu", "output_dir": str(tmp_path / "run")}})
    done = mlite("sft", str(job), "--no-progress", env={**ENV, name: "abc"})
    one_line_error(done, f"{name}='abc'")
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------------------------- data
@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tokenizer trained on demo data and a tiny Qwen3 config sized to it."""
    return sft_assets(tmp_path_factory.mktemp("bad_inputs"), train=32, val=4, seed=3, rows=100, **ONE_LAYER)


def sft_on(assets: dict, tmp_path: Path, train: Path) -> subprocess.CompletedProcess:
    job = write_job(tmp_path / "job.yaml", {
        "job": "sft",
        "model": {"path": assets["model"], "load_weights": False},
        "cluster": {"gpu": "cpu", "gpus_per_node": 1},
        "precision": {"compute": "fp32"},
        "data": {"train_files": [str(train)], "tokenizer": assets["tokenizer"], "seq_len": 128,
                 "global_batch_size": 2, "max_tokens_per_micro_batch": 256},
        "trainer": {"steps": 1, "device": "cpu", "output_dir": str(tmp_path / "run"), "tensorboard": False},
    })
    return mlite("sft", str(job), "--no-progress")


def test_a_jsonl_file_that_is_not_utf8_names_the_file_and_line(assets, tmp_path):
    train = tmp_path / "train.jsonl"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    good = json.dumps({"messages": turns})
    train.write_bytes(good.encode() + b"\n" + good.replace("yo", "caf\xe9").encode("latin-1") + b"\n")
    one_line_error(sft_on(assets, tmp_path, train), f"{train}:2", "UTF-8")


def test_a_parquet_file_that_is_not_parquet_is_one_line(assets, tmp_path):
    train = tmp_path / "train.parquet"
    train.write_text('{"messages": []}\n')
    one_line_error(sft_on(assets, tmp_path, train), str(train), "parquet")


def test_an_empty_train_file_says_so(assets, tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("")
    one_line_error(sft_on(assets, tmp_path, train), "0 of 0 rows usable", "empty", str(train))


def test_rows_without_the_messages_key_say_which_keys_they_have(assets, tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": "1 + 1", "answer": "2"}) + "\n" for _ in range(5)))
    one_line_error(sft_on(assets, tmp_path, train), "0 of 5 rows usable", "5 malformed", "prompt, answer",
                   "data.messages_key")


def test_rows_with_bad_roles_say_which_role(assets, tmp_path):
    train = tmp_path / "train.jsonl"
    row = {"messages": [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    train.write_text("".join(json.dumps(row) + "\n" for _ in range(3)))
    one_line_error(sft_on(assets, tmp_path, train), "0 of 3 rows usable", "3 malformed", "'human'")


def test_token_ids_beyond_the_models_vocabulary_are_one_line(assets, tmp_path):
    """A model with fewer embedding rows than the tokenizer has tokens (here 32): refused at data loading,
    naming both sizes, before a step fails on an index."""
    small = write_model_config(tmp_path / "small", vocab_size=32, moe=False, tied=True)
    job = write_job(tmp_path / "job.yaml", {
        "job": "sft",
        "model": {"path": str(small), "load_weights": False},
        "cluster": {"gpu": "cpu", "gpus_per_node": 1},
        "precision": {"compute": "fp32"},
        "data": {"train_files": [assets["train"]], "tokenizer": assets["tokenizer"], "seq_len": 128},
        "trainer": {"steps": 1, "device": "cpu", "output_dir": str(tmp_path / "run"), "tensorboard": False},
    })
    line = one_line_error(mlite("sft", str(job), "--no-progress"), "data.train_files: token id",
                          "vocabulary of 32", "vocab_size is at least")
    assert len(line) < 400
    assert not (tmp_path / "run" / "checkpoints").exists()


# ------------------------------------------------------------------------------------------- export
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A run folder with one real training checkpoint of the tiny Qwen3 preset."""
    import torch

    from mlite.config import job_from_dict
    from mlite.runtime.ckpt.checkpoint import CheckpointManager
    from mlite.runtime.engine import Runtime

    torch.set_num_threads(1)
    rt = Runtime(job_from_dict({"model": {"name": "tiny-qwen3"}, "precision": {"compute": "fp32"},
                                "data": {"seq_len": 512}, "trainer": {"device": "cpu"}}))
    run = tmp_path_factory.mktemp("export") / "run"
    CheckpointManager(run, keep_last=1).save(1, lambda path: rt.save_checkpoint(path, {"step": 1}))
    return run


def test_export_onto_an_existing_file_keeps_the_file(checkpoint, tmp_path):
    out = tmp_path / "model.bin"
    out.write_text("keep me")
    one_line_error(mlite("export", str(checkpoint), "--out", str(out)), str(out), "not a directory")
    assert out.read_text() == "keep me"


def test_export_under_a_file_is_one_line(checkpoint, tmp_path):
    (tmp_path / "file").write_text("keep me")
    out = tmp_path / "file" / "hf"
    one_line_error(mlite("export", str(checkpoint), "--out", str(out)), str(out))
    assert (tmp_path / "file").read_text() == "keep me"


def test_export_into_a_read_only_folder_is_one_line(checkpoint, tmp_path):
    """A read-only filesystem (a tmpfs mounted ro): what even root cannot write. Mounting needs root, as
    CI has; a user without it gets the folder's mode bits instead, which bind a user."""
    folder = tmp_path / "ro"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)],
                             capture_output=True, check=False).returncode == 0
    if not mounted:
        assert os.geteuid() != 0, "root could not mount a tmpfs"
        folder.chmod(0o500)
    try:
        one_line_error(mlite("export", str(checkpoint), "--out", str(folder / "hf")), "writ")
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], check=False)
        folder.chmod(0o700)
