"""The native models match transformers' forward on tiny random checkpoints of every family made here.

Each family's checkpoint is written by transformers' save_pretrained and read by our HF loader. Checked:
logits of packed sequences against HF run on each sequence alone (1e-5 relative, fp32), the MoE aux loss
against HF's `aux_loss` x coefficient, gradients against HF's, packed = unpacked per-token loss, pipeline
stages composing to the whole model, and KV-cache decoding against the full forward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hf_tiny import FAMILIES, make_hf_model

from mlite.config.arch import arch_from_hf_config
from mlite.errors import MliteError
from mlite.runtime.ckpt.hf import load_hf_weights
from mlite.runtime.data.packed import IGNORE, PackedBatch
from mlite.runtime.models import build_model

MOE_FAMILIES = [f for f in FAMILIES if "moe" in f]
SEQ_LENS = (7, 12, 3)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (HF model, directory of its save_pretrained checkpoint)."""
    out = {}
    for family in FAMILIES:
        hf = make_hf_model(family)
        path = tmp_path_factory.mktemp(family)
        hf.save_pretrained(path)
        out[family] = (hf, path)
    return out


def native(path, backend="torch", **kwargs):
    from mlite.config.arch import load_hf_arch

    model = build_model(load_hf_arch(path), attention_backend=backend, **kwargs)
    load_hf_weights(model, path)
    return model


def random_sequences(lens=SEQ_LENS, vocab=96, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers_on_each_packed_sequence(checkpoints, family):
    hf, path = checkpoints[family]
    model = native(path)
    seqs = random_sequences()
    with torch.no_grad():
        logits = model.compute_logits(model(PackedBatch.from_sequences(seqs)).hidden)  # [T, V]
        for seq, ours in zip(seqs, torch.split(logits, SEQ_LENS)):
            theirs = hf(torch.tensor([seq])).logits[0]
            assert rel_err(ours, theirs) < 1e-5, family
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert logits.abs().max() > 0.5  # far from the trivial all-zero logits


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_aux_loss_matches_transformers(checkpoints, family):
    hf, path = checkpoints[family]
    model = native(path)
    seqs = random_sequences(lens=(9, 9, 9), seed=3)  # equal lengths: HF's batch needs no padding mask
    out = model(PackedBatch.from_sequences(seqs))
    theirs = hf(torch.tensor(seqs), output_router_logits=True).aux_loss * hf.config.router_aux_loss_coef
    assert abs(out.aux_loss.item() - theirs.item()) <= 1e-5 * abs(theirs.item())
    assert out.aux_loss.item() > 0


def test_dense_aux_loss_is_zero(checkpoints):
    out = native(checkpoints["qwen3"][1])(PackedBatch.from_sequences(random_sequences()))
    assert float(out.aux_loss) == 0.0


@pytest.mark.parametrize("family", ["qwen3_tied", "qwen2", "qwen3_moe"])
def test_gradients_match_transformers(checkpoints, family):
    hf, path = checkpoints[family]
    model = native(path)
    seq = random_sequences(lens=(11,), seed=5)[0]
    batch = PackedBatch.from_sequences([seq])
    out = model(batch)
    ce = F.cross_entropy(model.compute_logits(out.hidden), batch.labels, ignore_index=IGNORE)
    (ce + out.aux_loss).backward()
    hf.zero_grad()
    ids = torch.tensor([seq])
    hf_out = hf(ids, labels=ids, output_router_logits="moe" in family)
    hf_out.loss.backward()
    assert abs(float(ce + out.aux_loss) - float(hf_out.loss)) < 1e-5 * float(hf_out.loss)
    ours = dict(model.named_parameters())
    theirs = dict(hf.named_parameters())
    pairs = {
        "embed.weight": "model.embed_tokens.weight",
        "layers.0.attn.q_proj.weight": "model.layers.0.self_attn.q_proj.weight",
        "layers.1.attn.v_proj.weight": "model.layers.1.self_attn.v_proj.weight",
        "layers.0.mlp_norm.weight": "model.layers.0.post_attention_layernorm.weight",
        "norm.weight": "model.norm.weight",
    }
    if family == "qwen3_moe":  # HF keeps experts stacked in memory in the same [E, out, in] layout as ours
        pairs |= {
            "layers.1.mlp.experts.gate_up": "model.layers.1.mlp.experts.gate_up_proj",
            "layers.1.mlp.experts.down": "model.layers.1.mlp.experts.down_proj",
            "layers.1.mlp.router.weight": "model.layers.1.mlp.gate.weight",
        }
    for mine, hf_name in pairs.items():
        assert rel_err(ours[mine].grad, theirs[hf_name].grad) < 1e-5, mine


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_packed_and_unpacked_give_the_same_per_token_loss(checkpoints, family):
    model = native(checkpoints[family][1])
    seqs = random_sequences(seed=7)
    masks = [[int(t >= 2) for t in range(len(s))] for s in seqs]  # prompt tokens untrained
    packed = PackedBatch.from_sequences(seqs, masks)
    with torch.no_grad():
        logits = model.compute_logits(model(packed).hidden)
        packed_loss = F.cross_entropy(logits, packed.labels, ignore_index=IGNORE, reduction="none")
        alone = []
        for seq, mask in zip(seqs, masks):
            one = PackedBatch.from_sequences([seq], [mask])
            alone.append(
                F.cross_entropy(
                    model.compute_logits(model(one).hidden), one.labels, ignore_index=IGNORE, reduction="none"
                )
            )
    torch.testing.assert_close(packed_loss, torch.cat(alone), rtol=1e-6, atol=1e-6)
    assert (packed_loss > 0).sum() == packed.num_target_tokens


@pytest.mark.parametrize("family", ["qwen3_tied", "qwen3_moe"])
def test_pipeline_stages_compose_to_the_whole_model(checkpoints, family):
    path = checkpoints[family][1]
    whole, first, last = native(path), native(path, layers=[0]), native(path, layers=[1])
    assert first.norm is None and first.output is None and last.embed is None
    assert list(last.layers) == ["1"]  # global layer names survive the split
    batch = PackedBatch.from_sequences(random_sequences())
    with torch.no_grad():
        expected = whole(batch)
        mid = first(batch)
        got = last(batch, hidden=mid.hidden)
        torch.testing.assert_close(got.hidden, expected.hidden, rtol=0, atol=0)
        torch.testing.assert_close(
            last.compute_logits(got.hidden), whole.compute_logits(expected.hidden), rtol=0, atol=0
        )


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "qwen3_moe"])
def test_kv_cache_decoding_matches_the_full_forward(checkpoints, family):
    model = native(checkpoints[family][1])
    prompts = random_sequences(lens=(5, 2, 4), seed=11)
    continuation = random_sequences(lens=(3, 3, 3), seed=12)
    full = [p + c for p, c in zip(prompts, continuation)]
    with torch.no_grad():
        reference = torch.split(
            model.compute_logits(model(PackedBatch.from_sequences(full)).hidden), [len(s) for s in full]
        )
        width = max(map(len, prompts))
        ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])  # right-padded prefill
        pos = torch.tensor([list(range(len(p))) + [-1] * (width - len(p)) for p in prompts])
        cache = model.new_kv_cache(batch_size=3, max_len=16)
        logits = model.decode(ids, pos, cache)
        for b, p in enumerate(prompts):
            torch.testing.assert_close(logits[b, : len(p)], reference[b][: len(p)], rtol=1e-5, atol=1e-5)
        for step in range(3):
            ids = torch.tensor([[c[step]] for c in continuation])
            pos = torch.tensor([[len(p) + step] for p in prompts])
            logits = model.decode(ids, pos, cache)
            for b, p in enumerate(prompts):
                torch.testing.assert_close(logits[b, 0], reference[b][len(p) + step], rtol=1e-5, atol=1e-5)


def test_layer_names_follow_the_parallel_contract(checkpoints):
    model = native(checkpoints["qwen3_moe_mixed"][1])
    layer0, layer1 = model.layers["0"], model.layers["1"]
    assert hasattr(layer0.mlp, "gate_proj") and not hasattr(layer0.mlp, "router")  # mlp_only_layers=[0]
    assert layer1.mlp.experts.gate_up.shape == (4, 2 * 16, 32) and layer1.mlp.experts.down.shape == (
        4,
        32,
        16,
    )
    tied = native(checkpoints["qwen3_tied"][1])
    assert tied.output.weight is tied.embed.weight


def test_bad_model_requests_are_one_line_errors(checkpoints):
    from mlite.config.arch import load_hf_arch

    arch = load_hf_arch(checkpoints["qwen3"][1])
    with pytest.raises(MliteError, match="unknown attention backend 'fast'"):
        build_model(arch, attention_backend="fast")
    with pytest.raises(MliteError, match="attention backend 'flash_attn' cannot run here"):
        build_model(arch, attention_backend="flash_attn")
    with pytest.raises(MliteError, match="rope scaling 'yarn' is not supported"):
        build_model(
            arch_from_hf_config(hf_config(arch) | {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
        )
    deepseek = arch_from_hf_config(
        {
            "model_type": "deepseek_v3",
            "hidden_size": 32,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "vocab_size": 96,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "kv_lora_rank": 8,
            "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 4,
            "v_head_dim": 8,
        }
    )
    with pytest.raises(MliteError, match="\\(model_type 'deepseek_v3'\\) has no native model yet"):
        build_model(deepseek)


def hf_config(arch):
    from mlite.runtime.ckpt.hf import hf_config_from_arch

    return hf_config_from_arch(arch)


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("backend", ["sdpa", "varlen", "auto"])
def test_bf16_logits_on_cuda_match_transformers(checkpoints, family, backend):
    path = checkpoints[family][1]
    hf = make_hf_model(family).to(
        "cuda", torch.bfloat16
    )  # a fresh copy: the fixture's model stays fp32 on CPU
    model = native(path, backend=backend, device="cuda", dtype=torch.bfloat16)
    seqs = random_sequences()
    with torch.no_grad():
        logits = model.compute_logits(model(PackedBatch.from_sequences(seqs).to("cuda")).hidden).float()
        for seq, ours in zip(seqs, torch.split(logits, SEQ_LENS)):
            theirs = hf(torch.tensor([seq], device="cuda")).logits[0].float()
            assert rel_err(ours, theirs) < 2e-2, (family, backend)
