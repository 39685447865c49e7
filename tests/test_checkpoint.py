"""Training checkpoints: exact restore, atomic saves, keep-last-N, corrupt and truncated checkpoints."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from cli_runs import one_thread  # noqa: F401 (autouse: one intra-op thread)

from mlite.config import job_from_dict
from mlite.errors import MliteError
from mlite.runtime.ckpt import checkpoint as ckpt
from mlite.runtime.ckpt.checkpoint import CheckpointManager, resolve_checkpoint, verify_checkpoint
from mlite.runtime.data.packed import PackedBatch
from mlite.runtime.engine import Runtime
from mlite.runtime.loss import sft_loss


def make_job(model="tiny-qwen3"):
    return job_from_dict({
        "model": {"name": model},
        "precision": {"compute": "fp32"},
        "optimizer": {"lr": 3e-3, "warmup_steps": 2, "weight_decay": 0.01},
        "data": {"seq_len": 512},  # within the tiny model's positions: the rule book checks it
        "trainer": {"device": "cpu", "steps": 8, "seed": 3},
    })


def batch_for(step: int) -> PackedBatch:
    g = torch.Generator().manual_seed(step)
    return PackedBatch.from_sequences([torch.randint(0, 256, (n,), generator=g).tolist() for n in (11, 6, 9)])


def train_steps(rt: Runtime, steps) -> list[float]:
    losses = []
    for step in steps:
        rt.zero_grad()
        b = batch_for(step)
        (out,) = rt.forward_backward([b], sft_loss(b.num_target_tokens))
        rt.optimizer_step()
        rt.lr_scheduler_step()
        losses.append(out["loss"])
    return losses


def test_a_resumed_run_keeps_its_own_way_of_stepping(tmp_path):
    """A checkpoint written where the step ran one way (a GPU run's fused kernel, an offloaded run's foreach
    step on the host) resumes where it runs another: the saved groups' hyperparameters come back, the
    implementation flags stay the resuming run's (a GPU run resumed from an offloaded one kept the host's
    `fused: None` and its fused step's skip flag reached torch's foreach step, which refuses it)."""
    writer = Runtime(make_job())
    train_steps(writer, range(1))
    for group in writer.optim.optimizer.param_groups:
        group |= {"fused": True, "foreach": None}  # as a GPU run's groups are saved
    writer.save_checkpoint(tmp_path / "ck")

    reader = Runtime(make_job())
    own = [(g["fused"], g["foreach"]) for g in reader.optim.optimizer.param_groups]
    assert own == [(None, True)] * len(own)  # CPU: torch's foreach step
    reader.load_checkpoint(tmp_path / "ck")
    assert [(g["fused"], g["foreach"]) for g in reader.optim.optimizer.param_groups] == own
    assert [g["weight_decay"] for g in reader.optim.optimizer.param_groups] == [
        g["weight_decay"] for g in writer.optim.optimizer.param_groups]
    assert train_steps(reader, range(1, 2))[0] > 0  # and it steps


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_save_then_load_continues_bitwise(tmp_path, model):
    straight = Runtime(make_job(model))
    expected = train_steps(straight, range(6))

    first = Runtime(make_job(model))
    assert train_steps(first, range(3)) == expected[:3]
    torch.manual_seed(99)  # an RNG position that must come back
    first.save_checkpoint(tmp_path / "ck", extra_state={"step": 3, "note": "hi"})
    after_save = torch.rand(3)

    second = Runtime(make_job(model))
    assert second.load_checkpoint(tmp_path / "ck") == {"step": 3, "note": "hi"}
    torch.testing.assert_close(torch.rand(3), after_save, rtol=0, atol=0)  # RNG restored
    assert second.schedule.step_count == 3 and second.optim.optimizer.param_groups[0]["lr"] == second.lr
    assert train_steps(second, range(3, 6)) == expected[3:]  # bitwise: == on Python floats
    for (name, a), b in zip(straight.model.named_parameters(), second.model.parameters()):
        assert torch.equal(a, b), name
    sa, sb = straight.optim.optimizer.state_dict()["state"], second.optim.optimizer.state_dict()["state"]
    for key in sa:
        assert torch.equal(sa[key]["exp_avg_sq"], sb[key]["exp_avg_sq"])


def test_checkpoint_names_tensors_by_parameter_with_global_shapes(tmp_path):
    rt = Runtime(make_job())
    train_steps(rt, range(1))
    rt.save_checkpoint(tmp_path / "ck")
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(tmp_path / "ck" / ckpt.TENSORS)).read_metadata()
    shapes = {k: list(v.size) for k, v in metadata.state_dict_metadata.items() if hasattr(v, "size")}
    assert shapes["model.layers.0.attn.q_proj.weight"] == [64, 64]
    assert shapes["optimizer.state.layers.1.mlp.down_proj.weight.exp_avg"] == [64, 128]
    meta = json.loads((tmp_path / "ck" / ckpt.META).read_text())
    assert meta["hf_config"]["hidden_size"] == 64 and meta["job"]["model"]["name"] == "tiny-qwen3"


def save_runtime(rt, extra=None):
    return lambda path: rt.save_checkpoint(path, extra or {})


def test_keep_last_n_along_the_lineage(tmp_path):
    rt = Runtime(make_job())
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (2, 4, 6):
        manager.save(step, save_runtime(rt, {"step": step}))
    assert manager.steps() == [6, 4]
    assert sorted(p.name for p in manager.root.iterdir()) == ["lineage", "step_00000004", "step_00000006"]
    assert (manager.root / "lineage").read_text().split() == ["step_00000004", "step_00000006"]
    assert resolve_checkpoint(tmp_path) == manager.path_for(6)
    assert resolve_checkpoint(manager.root) == manager.path_for(6)


def test_a_crash_during_save_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    rt = Runtime(make_job())
    manager = CheckpointManager(tmp_path, keep_last=1)
    manager.save(2, save_runtime(rt, {"step": 2}))
    train_steps(rt, range(1))

    def crash(path, data):  # dies after the tensors are written, before the manifest
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "_write_json", crash)
    with pytest.raises(OSError, match="disk full"):
        manager.save(4, save_runtime(rt, {"step": 4}))
    monkeypatch.undo()

    assert not (manager.root / "step_00000004.partial").exists()  # the half-written save is removed
    assert manager.steps() == [2] and manager.latest_good() == manager.path_for(2)
    assert Runtime(make_job()).load_checkpoint(manager.latest_good()) == {"step": 2}
    manager.save(4, save_runtime(rt, {"step": 4}))  # the next save rotates
    assert sorted(p.name for p in manager.root.iterdir()) == ["lineage", "step_00000004"]


def test_a_save_named_on_the_lineage_that_died_before_its_rename_is_passed_over(tmp_path):
    rt = Runtime(make_job())
    manager = CheckpointManager(tmp_path, keep_last=3)
    manager.save(2, save_runtime(rt, {"step": 2}))
    manager.save(4, save_runtime(rt, {"step": 4}))
    (manager.root / "lineage").write_text("step_00000002\nstep_00000004\nstep_00000006\n")  # 6 never renamed
    assert manager.latest_good() == manager.path_for(4)


def distcp_file(path):
    return next((path / ckpt.TENSORS).glob("*.distcp"))


def test_truncated_and_altered_checkpoints_are_refused_with_one_line(tmp_path):
    rt = Runtime(make_job())
    rt.save_checkpoint(tmp_path / "a")
    verify_checkpoint(tmp_path / "a")
    data = distcp_file(tmp_path / "a")
    size = data.stat().st_size
    os.truncate(data, size // 2)
    with pytest.raises(MliteError, match=rf"corrupt: tensors/__0_0.distcp has {size // 2} bytes, "
                                         rf"the manifest says {size}") as err:
        Runtime(make_job()).load_checkpoint(tmp_path / "a")
    assert "\n" not in str(err.value)

    rt.save_checkpoint(tmp_path / "b")
    data = distcp_file(tmp_path / "b")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, one flipped byte
    data.write_bytes(bytes(raw))
    with pytest.raises(MliteError, match="does not match its sha256"):
        verify_checkpoint(tmp_path / "b")

    (tmp_path / "c").mkdir()
    with pytest.raises(MliteError, match="incomplete"):
        verify_checkpoint(tmp_path / "c")


def test_auto_resume_skips_a_corrupt_newest_checkpoint_with_a_warning(tmp_path, caplog):
    rt = Runtime(make_job())
    manager = CheckpointManager(tmp_path, keep_last=3)
    manager.save(2, save_runtime(rt, {"step": 2}))
    manager.save(4, save_runtime(rt, {"step": 4}))
    os.truncate(distcp_file(manager.path_for(4)), 10)
    with caplog.at_level(logging.WARNING):
        assert manager.latest_good() == manager.path_for(2)
    assert "skipping a bad checkpoint" in caplog.text and "step_00000004" in caplog.text


def test_resolve_checkpoint_explains_a_wrong_path(tmp_path):
    with pytest.raises(MliteError, match="not a checkpoint nor a run directory"):
        resolve_checkpoint(tmp_path / "nowhere")


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_export_loads_in_transformers_with_equal_logits(tmp_path, model):
    from transformers import AutoModelForCausalLM

    from mlite.cli import main

    rt = Runtime(make_job(model))
    train_steps(rt, range(2))  # trained weights, not the initialisation
    manager = CheckpointManager(tmp_path / "run", keep_last=1)
    manager.save(2, save_runtime(rt, {"step": 2}))

    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, 256, (1, 17), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        theirs = hf(tokens).logits[0]
        batch = PackedBatch.from_sequences([tokens[0].tolist()])
        ours = rt.model.compute_logits(rt.model(batch).hidden)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_export_of_a_missing_checkpoint_is_one_line_exit_2(tmp_path, capsys):
    from mlite.cli import main

    assert main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a checkpoint nor a run directory" in err


def test_a_skip_count_kept_on_the_device_is_saved_as_a_number(tmp_path):
    """On one GPU the fused optimizer counts skipped updates on the device (a 0-dim tensor, no host
    sync); a checkpoint reads it once and writes the number, and a resume gets it back."""
    rt = Runtime(make_job())
    train_steps(rt, range(1))
    rt.optim.skipped_steps = torch.tensor(2)  # as LocalAdamW's fused step leaves it
    rt.save_checkpoint(tmp_path / "ck")
    assert json.loads((tmp_path / "ck" / ckpt.META).read_text())["skipped_steps"] == 2
    again = Runtime(make_job())
    again.load_checkpoint(tmp_path / "ck")
    assert again.skipped_steps == 2
