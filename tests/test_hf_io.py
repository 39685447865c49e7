"""HF safetensors load and export: sharded and single files, dtype conversion, tied embeddings, a bitwise
round trip that transformers reads back, bounded-memory streaming, and one clear line for every bad input."""

from __future__ import annotations

import gc
import json
import weakref
from dataclasses import replace

import pytest
import torch
import transformers
from hf_tiny import make_hf_model, save_hf_model
from safetensors.torch import load_file, save_file

from mlite.config.arch import arch_from_hf_config, load_hf_arch
from mlite.errors import MliteError
from mlite.runtime.ckpt.hf import (
    hf_config_from_arch,
    iter_hf_weights,
    load_hf_tensors,
    load_hf_weights,
    save_hf_checkpoint,
)
from mlite.runtime.data.packed import PackedBatch
from mlite.runtime.models import build_model

SEQS = [[5, 9, 2, 77, 31, 8, 14], [1, 60, 3]]


def loaded(path, **kwargs):
    model = build_model(load_hf_arch(path), attention_backend="torch", **kwargs)
    load_hf_weights(model, path)
    return model


def logits_of(model):
    with torch.no_grad():
        return model.compute_logits(model(PackedBatch.from_sequences(SEQS)).hidden)


def all_tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out |= load_file(file)
    return out


def assert_same_parameters(a, b):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_sharded_index_loads_like_the_single_file(tmp_path, family):
    single = save_hf_model(family, tmp_path / "single")
    sharded = save_hf_model(family, tmp_path / "sharded", max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    assert_same_parameters(loaded(single), loaded(sharded))


def test_bf16_checkpoint_loads_into_fp32_and_fp32_into_bf16(tmp_path):
    hf = make_hf_model("qwen3").to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "bf16")
    stored = all_tensors(tmp_path / "bf16")
    assert stored["model.norm.weight"].dtype == torch.bfloat16
    model = loaded(tmp_path / "bf16")  # fp32 model
    assert model.norm.weight.dtype == torch.float32
    assert torch.equal(
        model.layers["1"].attn.k_proj.weight, stored["model.layers.1.self_attn.k_proj.weight"].float()
    )

    save_hf_model("qwen3", tmp_path / "fp32")
    model = build_model(load_hf_arch(tmp_path / "fp32"), attention_backend="torch")
    load_hf_weights(model, tmp_path / "fp32", dtype=torch.bfloat16)
    fp32 = all_tensors(tmp_path / "fp32")["model.embed_tokens.weight"]
    assert model.embed.weight.dtype == torch.bfloat16 and torch.equal(
        model.embed.weight, fp32.to(torch.bfloat16)
    )


@pytest.mark.parametrize("family", ["qwen3", "qwen3_tied", "qwen2", "qwen3_moe_mixed"])
def test_round_trip_is_bitwise_and_transformers_reads_the_export(tmp_path, family):
    src = save_hf_model(family, tmp_path / "src")
    model = loaded(src)
    out = save_hf_checkpoint(model, model.arch, tmp_path / "export", max_shard_bytes=16 * 1024)
    assert (out / "model.safetensors.index.json").is_file() and len(
        list(out.glob("model-*-of-*.safetensors"))
    ) > 1
    # the same tensors under the same names, bit for bit, as transformers wrote
    original, exported = all_tensors(src), all_tensors(out)
    assert exported.keys() == original.keys()
    for name in original:
        assert torch.equal(exported[name], original[name]), name
    assert_same_parameters(model, loaded(out))
    # transformers loads our export (and our config.json) and computes the logits we compute
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        for seq, ours in zip(SEQS, torch.split(logits_of(model), [len(s) for s in SEQS])):
            torch.testing.assert_close(hf(torch.tensor([seq])).logits[0], ours, rtol=1e-5, atol=1e-5)


def test_tied_export_stores_the_matrix_once(tmp_path):
    model = loaded(save_hf_model("qwen3_tied", tmp_path / "src"))
    names = [name for name, _ in iter_hf_weights(model)]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert len(names) == len(set(names))


def test_pipeline_stage_loads_only_its_tensors_and_a_tied_head_from_the_embedding(tmp_path):
    src = save_hf_model("qwen3_tied", tmp_path / "src")
    whole, last = loaded(src), loaded(src, layers=[1])
    assert last.embed is None and "layers.0.attn.q_proj.weight" not in dict(last.named_parameters())
    assert torch.equal(last.output.weight, whole.embed.weight)
    assert torch.equal(last.layers["1"].mlp.up_proj.weight, whole.layers["1"].mlp.up_proj.weight)


def test_export_config_round_trips_through_the_arch_reader(tmp_path):
    for family in ("qwen3", "qwen2", "llama", "qwen3_moe_mixed"):
        arch = load_hf_arch(save_hf_model(family, tmp_path / family))
        again = arch_from_hf_config(hf_config_from_arch(arch), name=arch.name)
        assert replace(again, extra={}) == replace(arch, extra={}), family  # extra: reference-only leftovers


def test_export_in_bf16_and_copying_the_source_config(tmp_path):
    src = save_hf_model("qwen3", tmp_path / "src")
    model = loaded(src)
    out = save_hf_checkpoint(model, model.arch, tmp_path / "bf16", dtype=torch.bfloat16, config=src)
    tensors = all_tensors(out)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    generated = save_hf_checkpoint(model.to(torch.bfloat16), model.arch, tmp_path / "gen")
    assert json.loads((generated / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_catalog_presets_config_gets_its_model_class(tmp_path):
    """A run from a catalog preset carries a config dict without `architectures`; its export (and the vLLM
    engine's config.json, written the same way) names the model class, which vLLM and the Auto classes need;
    a config that names one keeps it."""
    from mlite.config.catalog import PRESETS, preset_arch

    arch = preset_arch("tiny-qwen3")
    config = dict(PRESETS["tiny-qwen3"])
    assert "architectures" not in config
    out = save_hf_checkpoint(build_model(arch), arch, tmp_path / "preset", config=config)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    kept = save_hf_checkpoint(build_model(arch), arch, tmp_path / "kept",
                              config={**config, "architectures": ["Custom"]})
    assert json.loads((kept / "config.json").read_text())["architectures"] == ["Custom"]


def test_export_holds_at_most_one_shard_of_tensors(tmp_path):
    """A stream of fresh 4 KiB tensors, shards of 16 KiB: never more than a shard's worth alive at once."""
    alive, most = weakref.WeakSet(), [0]

    def stream():
        for i in range(20):
            gc.collect()
            most[0] = max(most[0], len(alive))
            t = torch.full((1024,), float(i))  # 4 KiB
            alive.add(t)
            yield f"t{i:02d}", t

    out = save_hf_checkpoint(
        stream(),
        build_model(load_hf_arch(save_hf_model("qwen3", tmp_path / "s")), device="meta").arch,
        tmp_path / "out",
        max_shard_bytes=16 * 1024,
    )
    assert most[0] <= 5  # 4 tensors of the shard being filled + the one the generator still references
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) == 5
    assert all(len(load_file(s)) == 4 for s in shards)
    assert torch.equal(all_tensors(out)["t13"], torch.full((1024,), 13.0))


# ---------------------------------------------------------------------------------------------- bad input
@pytest.fixture
def checkpoint(tmp_path):
    return save_hf_model("qwen3_moe", tmp_path / "ckpt")


def rewrite(path, change):
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def expect_error(path, *fragments):
    model = build_model(load_hf_arch(path), attention_backend="torch")
    with pytest.raises(MliteError) as err:
        load_hf_weights(model, path)
    message = str(err.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_wrong_shape_names_the_tensor_and_both_shapes(checkpoint):
    name = "model.layers.1.self_attn.q_proj.weight"
    rewrite(checkpoint, lambda t: t.__setitem__(name, torch.zeros(16, 32)))
    expect_error(checkpoint, f"tensor '{name}' has shape [16, 32]", "expects [32, 32]", "config.json")


def test_wrong_expert_shape_names_the_per_expert_tensor(checkpoint):
    name = "model.layers.0.mlp.experts.3.up_proj.weight"
    rewrite(checkpoint, lambda t: t.__setitem__(name, torch.zeros(8, 32)))
    expect_error(checkpoint, f"tensor '{name}' has shape [8, 32]", "expects [16, 32]")


def test_in_memory_weight_stream_fills_another_model(checkpoint):
    """What a rollout replica does with a weight update: the HF-named stream of one model into another."""
    source = loaded(checkpoint)
    target = build_model(load_hf_arch(checkpoint), attention_backend="torch").to(torch.bfloat16)
    tensors = dict(iter_hf_weights(source))
    load_hf_tensors(target, tensors)
    for (name, a), b in zip(source.named_parameters(), target.parameters()):
        assert b.dtype == torch.bfloat16 and torch.equal(a.to(torch.bfloat16), b), name
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    tensors.pop(name)
    with pytest.raises(MliteError, match=f"tensor '{name}' is missing from the weight update"):
        load_hf_tensors(target, tensors)


def test_missing_tensor_is_named(checkpoint):
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    rewrite(checkpoint, lambda t: t.pop(name))
    expect_error(checkpoint, f"tensor '{name}' is missing", "incomplete")


def test_extra_tensor_is_named(checkpoint):
    rewrite(checkpoint, lambda t: t.__setitem__("model.layers.2.mlp.gate.weight", torch.zeros(4, 32)))
    expect_error(
        checkpoint, "tensor 'model.layers.2.mlp.gate.weight'", "is not a parameter of qwen3_moe with 2 layers"
    )


def test_corrupt_and_truncated_files_are_named(checkpoint):
    file = checkpoint / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])  # truncated
    expect_error(checkpoint, "model.safetensors is not a readable safetensors file")
    file.write_bytes(b"\x00garbage" * 10)
    expect_error(checkpoint, "model.safetensors is not a readable safetensors file")


def test_sharded_checkpoint_with_a_lost_shard_or_bad_index(tmp_path):
    path = save_hf_model("qwen3", tmp_path / "ckpt", max_shard_size="20KB")
    index = path / "model.safetensors.index.json"
    lost = sorted(path.glob("model-*.safetensors"))[1]
    lost.unlink()
    expect_error(path, f"lists shard {lost.name}, which is missing")
    index.write_text("{not json")
    expect_error(path, "is not a valid safetensors index")


def test_missing_checkpoint_and_occupied_export_directory(tmp_path, checkpoint):
    model = build_model(load_hf_arch(checkpoint), attention_backend="torch")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MliteError, match="no model.safetensors or model.safetensors.index.json in"):
        load_hf_weights(model, tmp_path / "empty")
    with pytest.raises(MliteError, match="exists and is not empty"):
        save_hf_checkpoint(model, model.arch, checkpoint)
    with pytest.raises(MliteError, match="tensor 'x' appears twice"):
        save_hf_checkpoint(iter([("x", torch.zeros(1)), ("x", torch.zeros(1))]), model.arch, tmp_path / "dup")
    assert not (tmp_path / "dup").exists()  # a failed export leaves nothing behind


def _export_fsdp_sharded(rank, world, src, out_file):
    from torch.distributed.fsdp import fully_shard

    model = loaded(src)
    reference = {name: t.clone() for name, t in iter_hf_weights(model)}
    for layer in model.layers.values():
        fully_shard(layer)
    fully_shard(model)
    assert any(type(p).__name__ == "DTensor" for p in model.parameters())
    streamed = dict(iter_hf_weights(model))
    assert streamed.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(streamed[name], tensor), name
    if rank == 0:
        torch.save(len(streamed), out_file)


def test_weight_stream_gathers_fsdp_shards_on_every_rank(tmp_path):
    """The runtime exports FSDP2-sharded models through the same stream: 2 gloo ranks, full tensors out."""
    from parallel_harness import launch

    src = save_hf_model("qwen3_moe", tmp_path / "src")
    launch(2, _export_fsdp_sharded, src, tmp_path / "count.pt")
    assert torch.load(tmp_path / "count.pt") == len(all_tensors(src))


def _stream_expert_slice(rank, world, src):
    from torch.distributed.tensor import DTensor

    from mlite.plan.policy import expert_exchange
    from mlite.runtime.parallel.mesh import ParallelDims
    from mlite.runtime.parallel.parallelize import apply_expert_parallel

    model = loaded(src)
    exchange = expert_exchange(world, model.arch.moe.top_k)  # the plan's choice, as the runtime passes it
    apply_expert_parallel(model, ParallelDims(world, dp=world, ep=world).build("cpu"), exchange)
    experts = model.layers["1"].mlp.experts
    assert isinstance(experts.down, DTensor) and experts.down.to_local().shape[0] == 4 // world  # 2 of 4 held
    streamed = dict(iter_hf_weights(model))
    on_disk = all_tensors(src)
    assert streamed.keys() == on_disk.keys()  # experts 0..3 under their global names, on every rank
    for name, tensor in streamed.items():
        assert torch.equal(tensor, on_disk[name]), name


def test_expert_parallel_stream_gathers_every_expert_under_its_global_name(tmp_path):
    """ep=2 over 4 experts: rank r holds experts 2r, 2r+1; the stream gathers all four, each under its
    global index, identical to the source file (an export from any ep writes the same checkpoint)."""
    from parallel_harness import launch

    launch(2, _stream_expert_slice, save_hf_model("qwen3_moe", tmp_path / "src"))
