"""DeepSeek-V4: the native model against transformers 5.23's reference (tests/fixtures/dsv4, written by
scripts/dsv4_reference.py; tests/test_dsv4_reference.py regenerates it), and what the reference lacks
against DeepSeek's published formulas: packed sequences, MTP, the indexer's training, the released
quantised format."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from mlite.config.arch import arch_from_hf_config
from mlite.config.catalog import count_params, preset_arch
from mlite.errors import MliteError
from mlite.runtime.ckpt import quant
from mlite.runtime.ckpt.hf import _tensors, iter_hf_weights, load_hf_weights, save_hf_checkpoint
from mlite.runtime.data.packed import IGNORE, PackedBatch
from mlite.runtime.models import build_model
from mlite.runtime.models.deepseek_v4 import (
    DeepseekV4,
    apply_rope,
    balanced_hash_table,
    batch_geometry,
    inv_freq,
    key_set_attention,
    normed_rope,
    rms_scale,
    rope_angles,
    shift_in_sequence,
)

FIXTURES = Path(__file__).parent / "fixtures" / "dsv4"
CASES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
ATOL = 1e-5


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def reference_model(case: str, **build) -> tuple[DeepseekV4, dict, list[torch.Tensor]]:
    folder = FIXTURES / case
    arch = arch_from_hf_config(json.loads((folder / "config.json").read_text()))
    model = build_model(arch, init=False, **build)
    load_hf_weights(model, folder)
    ref = load_file(folder / "reference.safetensors")
    seqs = [ref[f"input_ids.{i}"] for i in range(sum(k.startswith("input_ids.") for k in ref))]
    return model, ref, seqs


def packed(seqs) -> PackedBatch:
    return PackedBatch.from_sequences([s.tolist() for s in seqs])


def test_fixture_covers_every_layer_and_routing_kind():
    kinds, routes, yarn = set(), set(), False
    for case in CASES:
        cfg = json.loads((FIXTURES / case / "config.json").read_text())
        kinds |= set(cfg["layer_types"])
        routes |= set(cfg["mlp_layer_types"])
        yarn |= cfg["rope_parameters"]["compress"]["rope_type"] == "yarn"
        assert cfg["rope_parameters"]["main"]["rope_type"] == "default"  # YaRN on compressed layers only
    assert kinds == {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}
    assert routes == {"hash_moe", "moe"} and yarn
    assert sum(f.stat().st_size for f in FIXTURES.rglob("*") if f.is_file()) < 1_000_000


@pytest.mark.parametrize("case", CASES)
def test_packed_logits_loss_and_gradients_equal_transformers(case):
    """Three sequences packed into one stream: each one's logits equal transformers' run of it alone; the
    token-mean CE and every parameter's gradient equal the reference's within 1e-5 (fp32)."""
    model, ref, seqs = reference_model(case)
    batch = packed(seqs)
    logits = model.compute_logits(model(batch).hidden)
    start = 0
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(logits[start: start + len(seq)], ref[f"logits.{i}"], atol=ATOL, rtol=0)
        start += len(seq)
    targets = batch.labels != IGNORE
    ce = F.cross_entropy(logits, batch.labels, ignore_index=IGNORE, reduction="sum") / targets.sum()
    torch.testing.assert_close(ce, ref["ce_loss"], atol=ATOL, rtol=0)
    ce.backward()

    tensors, parameters, compared = _tensors(model), dict(model.named_parameters()), 0
    reference_grads = {model.canonical_hf_name(k.removeprefix("grad.")): v for k, v in ref.items()
                       if k.startswith("grad.")}
    for entry in model.hf_layout():
        tensor = tensors[entry.param]
        if entry.param not in parameters:  # the hash table and the correction bias are buffers
            continue
        grad = tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
        for name, piece in zip(entry.hf_names, entry.split(grad)):
            torch.testing.assert_close(piece, reference_grads.pop(name), atol=ATOL, rtol=0, msg=name)
            compared += 1
    assert not reference_grads, f"reference gradients with no native parameter: {sorted(reference_grads)[:3]}"
    assert compared > 100


@pytest.mark.parametrize("case", CASES)
def test_balance_loss_equals_transformers_aux_loss(case):
    model, ref, seqs = reference_model(case)
    coef = model.arch.moe.router_aux_loss_coef
    for i, seq in enumerate(seqs):
        aux = model(packed([seq])).aux_loss / coef
        torch.testing.assert_close(aux, ref[f"aux_loss.{i}"], atol=ATOL, rtol=0)


def test_indexer_is_frozen_by_default_like_the_reference():
    """Top-k selection has no gradient: the indexer's parameters get none (transformers' neither)."""
    model, _, seqs = reference_model(CASES[0])
    logits = model.compute_logits(model(packed(seqs)).hidden)
    logits.logsumexp(-1).sum().backward()
    indexer = [p for n, p in model.named_parameters() if ".indexer." in n]
    assert indexer and all(p.grad is None and not p.requires_grad for p in indexer)


def test_indexer_kl_loss_trains_it_towards_the_attention():
    """indexer_loss_weight > 0 adds KL(attention mass over the picked entries || the indexer's softmax over
    them) per CSA layer to aux_loss, on detached inputs (DeepSeek-V3.2): its gradient reaches the indexer
    only, and the attention output is unchanged."""
    trained, _, seqs = reference_model(CASES[0], indexer_loss_weight=1.0)
    frozen, _, _ = reference_model(CASES[0])
    batch = packed(seqs)
    terms = []

    def keep(module, args, out):
        terms.append(out[1])

    for layer in trained.layers.values():
        layer.attn.register_forward_hook(keep)
    out = trained(batch)
    reference = frozen(batch)
    kl = torch.stack(terms).sum()
    csa_layers = sum(block.attn.indexer is not None for block in trained.layers.values())
    assert kl > 0 and sum(t > 0 for t in terms) == csa_layers
    torch.testing.assert_close(out.aux_loss - reference.aux_loss, kl, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.hidden, reference.hidden, atol=0, rtol=0)
    kl.backward()
    grads = {n: p.grad for n, p in trained.named_parameters()}
    indexer = [n for n in grads if ".indexer." in n]
    assert indexer and all(grads[n] is not None and grads[n].abs().sum() > 0 for n in indexer)
    assert all(grads[n] is None or grads[n].abs().sum() == 0 for n in grads if ".indexer." not in n)


def test_mtp_predicts_token_t_plus_2_from_the_next_embedding():
    """DeepSeek-V3's MTP: at position t, block(e_proj(norm(embed(token t+1))) + h_proj(norm(h_t))) predicts
    token t+2 through the shared head. Computed here sequence by sequence on the truncated streams and
    compared with the model's loss on the packed batch (shifted within each sequence)."""
    arch = preset_arch("tiny-deepseek-v4")
    torch.manual_seed(0)
    model = build_model(arch, mtp_weight=1.0)
    seqs = [torch.randint(0, arch.vocab, (n,)) for n in (23, 40, 9)]
    batch = packed(seqs)
    streams = {}
    last = model.layers[str(arch.num_layers - 1)]
    def keep(module, args, out):
        streams["x"] = out[0]

    handle = last.register_forward_hook(keep)
    full = model(batch).aux_loss
    handle.remove()
    geo = batch_geometry(batch, arch.v4.sliding_window, model.ratios)
    next_embeds = model.embed(shift_in_sequence(batch.input_ids, batch, 0))
    hidden, _ = model.mtp(streams["x"], next_embeds, batch, geo, model.ropes(geo, torch.float32))
    ce = model.mtp_loss(hidden, batch, geo)

    mtp, total, count, start = model.mtp, 0.0, 0, 0
    for seq in seqs:
        n = len(seq)
        x = mtp.embed_proj(mtp.embed_norm(model.embed(seq[1:]))).unsqueeze(1) + mtp.hidden_proj(
            mtp.hidden_norm(streams["x"][start: start + n - 1]))
        alone = packed([seq[:-1]])
        geo = batch_geometry(alone, arch.v4.sliding_window, model.ratios)
        x, _, _ = mtp.block(x, alone, geo, model.ropes(geo, x.dtype))
        logits = model.compute_logits(mtp.norm(mtp.head(x)))
        total = total + F.cross_entropy(logits[:-1], seq[2:], reduction="sum")
        count, start = count + n - 2, start + n
    torch.testing.assert_close(ce, total / count, atol=1e-5, rtol=1e-5)
    # the job key weights it: aux_loss moves by (1 - 0.25) x the MTP loss between weights 1 and 0.25
    model.mtp_weight = 0.25
    torch.testing.assert_close(full - model(batch).aux_loss, 0.75 * ce, atol=1e-5, rtol=1e-5)


def test_meta_presets_count_what_the_planner_counts():
    for name in ("deepseek-v4-flash", "tiny-deepseek-v4"):
        arch = preset_arch(name)
        model = build_model(arch, device="meta", init=False, mtp_weight=1.0)
        main = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("mtp."))
        mtp = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
        counts = count_params(arch)
        assert (main, mtp) == (counts.total, counts.mtp), name
    flash = count_params(preset_arch("deepseek-v4-flash"))
    assert round(flash.total / 1e9, 1) == 284.3 and round(flash.active / 1e9, 1) == 13.8


def test_official_names_and_the_transformers_spelling_load_alike(tmp_path):
    """Export writes DeepSeek's release names; transformers' spelling of the same checkpoint (a `model.`
    prefix, `embed_tokens`, `attn.norm`) loads to the same weights; export -> load round-trips exactly."""
    model, _, seqs = reference_model(CASES[0])
    out = save_hf_checkpoint(model, model.arch, tmp_path / "export")
    names = set(load_file(out / "model.safetensors"))
    assert {"embed.weight", "head.weight", "hc_head_fn", "layers.0.attn.kv_norm.weight",
            "layers.0.ffn.gate.tid2eid", "layers.0.ffn.experts.0.w1.weight"} <= names
    fixture = load_file(FIXTURES / CASES[0] / "model.safetensors")
    stored = {model.canonical_hf_name(k): v for k, v in fixture.items()}
    assert names == set(stored)
    exported = load_file(out / "model.safetensors")
    for name, tensor in stored.items():
        assert torch.equal(exported[name], tensor), name
    again = build_model(model.arch, init=False)
    load_hf_weights(again, out)
    batch = packed(seqs)
    torch.testing.assert_close(again.compute_logits(again(batch).hidden),
                               model.compute_logits(model(batch).hidden), atol=0, rtol=0)
    config = json.loads((out / "config.json").read_text())
    assert arch_from_hf_config(config) == model.arch


def test_released_quantised_checkpoint_loads(tmp_path):
    """DeepSeek's release: FP8 e4m3 linear weights with 128x128 ue8m0 block scales, FP4 e2m1 routed experts
    with 1x32 scales, the compressor projections, norms, mHC and embeddings unquantised."""
    model, _, seqs = reference_model(CASES[0])
    tensors = dict(iter_hf_weights(model))
    fp4 = [n for n in tensors if ".ffn.experts." in n]
    fp8 = [n for n in tensors if n.endswith(".weight") and any(k in n for k in (
        ".wq_a.", ".wq_b.", ".wkv.", ".wo_a.", ".wo_b.", ".shared_experts.")) and ".compressor." not in n]
    config = json.loads((FIXTURES / CASES[0] / "config.json").read_text())
    quant.save_quantized_checkpoint(tensors, tmp_path / "release", fp8_names=fp8, fp4_names=fp4,
                                    config=config)
    loaded = build_model(model.arch, init=False)
    load_hf_weights(loaded, tmp_path / "release")
    written = load_file(tmp_path / "release" / "model.safetensors")
    back = dict(iter_hf_weights(loaded))
    for name in fp8 + fp4:  # exactly the dequantisation of what was written
        scale = written[name.removesuffix(".weight") + ".scale"]
        torch.testing.assert_close(back[name], quant.dequantize(written[name], scale), atol=0, rtol=0)
    assert any(written[n].dtype == torch.float8_e4m3fn for n in fp8)
    original = dict(iter_hf_weights(model))
    for name, tensor in back.items():
        if name in fp8 or name in fp4:  # within the formats' rounding of the block's scale
            bound = 0.5 if name in fp4 else 2**-3
            assert (tensor - original[name]).abs().max() <= bound * original[name].abs().max(), name
        else:  # everything else is stored as it is
            assert torch.equal(tensor, original[name]), name


def test_decode_equals_the_forward_logits():
    arch = preset_arch("tiny-deepseek-v4")
    torch.manual_seed(1)
    model = build_model(arch)
    seqs = [torch.randint(0, arch.vocab, (n,)) for n in (30, 19)]
    full = model.compute_logits(model(packed(seqs)).hidden)
    cache = model.new_kv_cache(2, 40)
    ids = torch.zeros(2, 30, dtype=torch.long)
    pos = torch.full((2, 30), -1)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], pos[i, : len(s)] = s, torch.arange(len(s))
    step = model.decode(ids, pos, cache)
    torch.testing.assert_close(step[0], full[:30], atol=1e-5, rtol=0)
    torch.testing.assert_close(step[1, :19], full[30:], atol=1e-5, rtol=0)


def test_balanced_hash_table_for_a_run_from_scratch():
    table = balanced_hash_table(vocab=256, experts=8, top_k=2, seed=3)
    assert table.shape == (256, 2) and bool((table[:, 0] != table[:, 1]).all())
    assert torch.bincount(table.flatten(), minlength=8).tolist() == [64] * 8


def test_bad_v4_configs_are_refused_in_one_line():
    cfg = json.loads((FIXTURES / CASES[0] / "config.json").read_text())
    with pytest.raises(MliteError, match="scoring_func 'softmax'"):
        arch_from_hf_config({**cfg, "scoring_func": "softmax"})
    with pytest.raises(MliteError, match="is missing from"):
        model = build_model(arch_from_hf_config(cfg), init=False, mtp_weight=1.0)
        load_hf_weights(model, FIXTURES / CASES[0])  # transformers' checkpoints carry no MTP block


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_cuda_fp32_matches_the_reference(case):
    """On a GPU, fp32 equals transformers' reference as on the CPU (1e-4: other kernels)."""
    model, ref, seqs = reference_model(case)
    expected = torch.cat([ref[f"logits.{i}"] for i in range(len(seqs))]).cuda()
    model = model.cuda()
    with torch.no_grad():
        logits = model.compute_logits(model(packed(seqs).to("cuda")).hidden)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.gpu
def test_cuda_bf16_stays_within_bf16_tolerance_of_fp32():
    """bf16 weights and activations on the GPU (fp32 islands: norms, mHC, router, sinks, compressor gates,
    softmax) against the fp32 CPU run of the same model: logits and the whole gradient within bf16
    tolerance. The indexer sees every entry here: its top-k picks of near-tied random-init scores flip
    under bf16 rounding (a different key set, not an error), so the tolerance is set on the arithmetic."""
    arch = preset_arch("tiny-deepseek-v4")
    arch = dataclasses.replace(arch, v4=dataclasses.replace(arch.v4, index_topk=1024))
    torch.manual_seed(0)
    model = build_model(arch)
    seqs = [torch.randint(0, arch.vocab, (n,)) for n in (300, 130, 61)]
    expected = model.compute_logits(model(packed(seqs)).hidden)
    expected.logsumexp(-1).mean().backward()
    want = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    fast = build_model(arch, device="cuda", dtype=torch.bfloat16)
    fast.load_state_dict(model.state_dict())
    logits = fast.compute_logits(fast(packed(seqs).to("cuda")).hidden).float()
    error = (logits.cpu() - expected.detach()).norm() / expected.norm()
    assert error < 0.03, f"relative logits error {error:.4f}"  # 0.011-0.013 on the CPU in bf16
    logits.logsumexp(-1).mean().backward()
    got = torch.cat([p.grad.float().flatten().cpu() for p in fast.parameters() if p.grad is not None])
    assert (got - want).norm() / want.norm() < 0.03  # 0.009 on the CPU in bf16


@pytest.mark.gpu
def test_cuda_compiled_blocks_are_as_exact_as_the_eager_torch_path_in_bf16():
    """The GPU fast path, as `mlite bench` and the trainers run it (`model.compile`: each block's body
    through inductor, which fuses the key-set attention's masking and sink softmax, RoPE, the norms and
    mHC into generated Triton kernels around the block products), against the eager torch path on the
    same bf16 weights and batch. Both are measured against fp32 on those weights: the compiled path's
    logits and gradient are as close to it as eager bf16's (two bf16 runs differ from each other by about
    their own rounding, 1.2% in the logits)."""
    from mlite.runtime.parallel.parallelize import apply_recompute

    arch = preset_arch("tiny-deepseek-v4")  # every entry seen: no top-k flips between the paths
    arch = dataclasses.replace(arch, v4=dataclasses.replace(arch.v4, index_topk=1024))
    torch.manual_seed(0)
    eager = build_model(arch, device="cuda", dtype=torch.bfloat16)
    fast = build_model(arch, device="cuda", dtype=torch.bfloat16)
    exact = build_model(arch, device="cuda", dtype=torch.float32)
    fast.load_state_dict(eager.state_dict())
    exact.load_state_dict(eager.state_dict())  # the bf16 weights, in fp32
    apply_recompute(fast, "none", compile_blocks=True)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    batch = packed([torch.randint(0, arch.vocab, (n,)) for n in (300, 130, 61)]).to("cuda")
    results = []
    for model in (exact, eager, fast):
        logits = model.compute_logits(model(batch).hidden).float()
        logits.logsumexp(-1).mean().backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        results.append((logits.detach(), grads))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # really compiled
    (logits, grads), *runs = results
    (eager_logits_error, eager_grad_error), (fast_logits_error, fast_grad_error) = (
        (float((got - logits).norm() / logits.norm()), float((got_grads - grads).norm() / grads.norm()))
        for got, got_grads in runs)
    assert eager_logits_error < 0.03 and eager_grad_error < 0.03
    assert fast_logits_error < 1.5 * eager_logits_error, (fast_logits_error, eager_logits_error)
    assert fast_grad_error < 1.5 * eager_grad_error, (fast_grad_error, eager_grad_error)


@pytest.mark.gpu
def test_cuda_indexer_scores_bf16_on_tensor_cores_equal_the_fp32_matmul():
    """On a GPU the indexer multiplies bf16 queries and entries on the tensor cores with an fp32 result, and
    weights, relus and sums the dots over heads in one compiled reduction: the products of bf16 values are
    exact in fp32, so the scores equal the CPU's fp32 matmul and batched product of the same values up to
    the order of the sums, for every entry at once and for per-query candidate keys."""
    from mlite.runtime.models.deepseek_v4 import Indexer, index_scores

    arch = preset_arch("tiny-deepseek-v4")
    indexer = Indexer(arch)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(300, indexer.heads, indexer.dim, generator=gen).bfloat16()
    keys = torch.randn(77, indexer.dim, generator=gen).bfloat16()
    weights = torch.randn(300, indexer.heads, generator=gen).bfloat16()
    candidates = torch.randint(0, 77, (300, 9), generator=gen)
    for keys_of in (lambda k: k, lambda k: k[candidates]):  # every entry; each query's own candidates
        fast = index_scores(q.cuda(), keys_of(keys).cuda(), weights.cuda())
        exact = index_scores(q.float(), keys_of(keys).float(), weights)  # the CPU's fp32 path
        assert fast.dtype == exact.dtype == torch.float32
        torch.testing.assert_close(fast.cpu(), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_cuda_mhc_product_of_bf16_values_equals_the_fp32_path():
    """The mHC maps' logits, rms_norm(streams) @ fn^T: on a GPU with bf16 streams and weights the product
    runs on the tensor cores with an fp32 result and the norm's row scale after it. It equals the CPU's
    fp32 path on the same values within fp32 rounding, and its gradients within bf16 rounding."""
    from mlite.runtime.models.deepseek_v4 import normed_product

    gen = torch.Generator().manual_seed(0)
    streams = torch.randn(300, 4, 256, generator=gen).bfloat16()
    fn = (torch.randn(24, 4 * 256, generator=gen) * 0.05).bfloat16()
    grad = torch.randn(300, 24, generator=gen)
    results = []
    # eager and compiled on the GPU, then the CPU's fp32
    for device, dtype, fn_ in (("cuda", torch.bfloat16, normed_product),
                               ("cuda", torch.bfloat16, torch.compile(normed_product)),
                               ("cpu", torch.float32, normed_product)):
        x, w = (t.to(device, dtype).requires_grad_() for t in (streams, fn))
        kept = _saved_tensors(fn_, x, w, 1e-6)
        # the streams as they came, no fp32 copy (compiled: whatever the partition chose to keep)
        assert [k.untyped_storage().data_ptr() for k in kept if k.numel() >= x.numel()] == [x.data_ptr()]
        out = fn_(x, w, 1e-6)
        out.backward(grad.to(device))
        results.append([out.detach().cpu(), x.grad.float().cpu(), w.grad.float().cpu()])
    exact, exact_dx, exact_dw = results[-1]
    for fast, fast_dx, fast_dw in results[:-1]:
        assert fast.dtype == exact.dtype == torch.float32
        torch.testing.assert_close(fast, exact, rtol=1e-5, atol=1e-5)
        for got, want in ((fast_dx, exact_dx), (fast_dw, exact_dw)):
            assert float((got - want).abs().max() / want.abs().max()) < 1e-2


def test_key_set_attention_layouts_agree_with_dense_attention():
    """The ways the core lays out a query's key set (all entries masked, alone or in runs of blocks each
    multiplying only the entries visible to it; per-query gathered entries; chunks of blocks recomputed in
    backward) equal plain masked softmax attention with a sink column."""
    torch.manual_seed(0)
    t, h, d, w, c = 37, 3, 8, 4, 9
    q, kv, entries = torch.randn(t, h, d), torch.randn(t, d), torch.randn(c, d)
    sinks = torch.randn(h)
    lens = [20, 17]
    batch = PackedBatch.from_sequences([list(range(n)) for n in lens])
    geo = batch_geometry(batch, w, [])
    picked = torch.stack([torch.randperm(c)[:5] for _ in range(t)])  # distinct, as top-k picks are
    # later queries see more entries, as causal visibility has it
    picked_mask = (torch.rand(t, 5) > 0.3) & (picked < torch.arange(t)[:, None] // 3 - 1)
    dense_mask = torch.zeros(t, c + 1, dtype=torch.bool).scatter_(
        1, torch.where(picked_mask, picked, c), True)[:, :-1]
    # per block of w tokens, the entries its queries may see: one past the last set column
    last_seen = torch.where(dense_mask, torch.arange(1, c + 1), 0).amax(1)
    limits = tuple(int(last_seen[b: b + w].max()) for b in range(0, t, w))
    assert limits[0] < limits[-1]  # runs of different widths
    # reference: a dense [T, T + C] key matrix
    pos, seq = batch.position_ids, torch.repeat_interleave(torch.arange(2), torch.tensor(lens))
    window = (seq[:, None] == seq[None]) & (pos[:, None] - pos[None] >= 0) & (pos[:, None] - pos[None] < w)
    keys = torch.cat([kv, entries])
    mask = torch.cat([window, dense_mask], dim=1)
    logits = torch.einsum("thd,kd->thk", q, keys) * 0.5
    sink_column = sinks.view(1, h, 1).expand(t, h, 1)
    logits = torch.cat([logits.masked_fill(~mask[:, None], float("-inf")), sink_column], -1)
    expected = torch.einsum("thk,kd->thd", logits.softmax(-1)[..., :-1], keys)

    for entry_keys, entry_mask, budget, entry_limits in (
            (None, dense_mask, 1 << 28, None), (None, dense_mask, 1 << 28, limits),
            (None, dense_mask, 1, limits),
            (picked, picked_mask, 1 << 28, None), (picked, picked_mask, 2 * w * h * 13, None),
            (None, dense_mask, 1, None)):
        ours = [x.clone().requires_grad_() for x in (q, kv, entries, sinks)]
        out = key_set_attention(ours[0], ours[1], geo.window_mask, ours[2], entry_keys, entry_mask, ours[3],
                                0.5, budget, entry_limits)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        weights = torch.randn_like(out)  # a loss whose gradient differs per output element
        (out * weights).sum().backward()
        ref = [x.clone().requires_grad_() for x in (q, kv, entries, sinks)]
        keys = torch.cat([ref[1], ref[2]])
        scores = (torch.einsum("thd,kd->thk", ref[0], keys) * 0.5).masked_fill(~mask[:, None], float("-inf"))
        logits = torch.cat([scores, ref[3].view(1, h, 1).expand(t, h, 1)], -1)
        (torch.einsum("thk,kd->thd", logits.softmax(-1)[..., :-1], keys) * weights).sum().backward()
        for a, b in zip(ours, ref):  # queries, keys, entries and the sinks
            torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)


def test_compiled_blocks_under_full_recompute_take_the_forwards_graphs():
    """model.compile with full recompute (the Runtime's composition, `apply_recompute`): each layer's
    recompute in the backward must run the graphs its forward ran. Layers of different kinds (here a
    sliding layer, then a CSA layer, the first hash-routed) share the blocks' code; the indexer's top-k is
    an opaque op, so no graph break splits a block and no layer runs another kind's compiled entry. Two
    steps (the first compiles) give the eager model's gradients, with inductor's real kernels."""
    from mlite.runtime.parallel.parallelize import apply_recompute

    arch = preset_arch("tiny-deepseek-v4")
    arch = dataclasses.replace(arch, num_layers=2, v4=dataclasses.replace(arch.v4, compress_ratios=(0, 4),
                                                                        num_hash_layers=1))
    torch.manual_seed(0)
    eager, fast = build_model(arch), build_model(arch)
    fast.load_state_dict(eager.state_dict())
    apply_recompute(fast, "full", "uniform", 1, compile_blocks=True)
    gen = torch.Generator().manual_seed(0)
    for lengths in ((150, 90), (150, 90)):  # the first step compiles inside the checkpointed forward
        batch = packed([torch.randint(0, arch.vocab, (n,), generator=gen) for n in lengths])
        grads = []
        for model in (eager, fast):
            model.zero_grad()
            model.compute_logits(model(batch).hidden).logsumexp(-1).mean().backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)


def _saved_tensors(fn, *args) -> list[torch.Tensor]:
    """What autograd keeps for the backward of fn(*args), one tensor per storage."""
    kept: dict[int, torch.Tensor] = {}

    def pack(x):
        kept.setdefault(x.untyped_storage().data_ptr(), x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn(*args)
    return list(kept.values())


def test_attention_core_keeps_one_bf16_copy_of_its_probabilities():
    """The core's largest activation is one probability per (query, head, key): it keeps them once, in the
    values' dtype (2 bytes), not also as fp32 softmax output beside a bf16 copy (6 bytes)."""
    torch.manual_seed(0)
    t, h, d, w, c = 64, 4, 16, 8, 12
    lens = [40, 24]
    geo = batch_geometry(PackedBatch.from_sequences([list(range(n)) for n in lens]), w, [])
    mask = torch.rand(t, c) > 0.5
    q, kv, entries = (torch.randn(*shape, dtype=torch.bfloat16, requires_grad=True)
                      for shape in ((t, h, d), (t, d), (c, d)))
    sinks = torch.zeros(h, requires_grad=True)
    kept = _saved_tensors(key_set_attention, q, kv, geo.window_mask, entries, None, mask, sinks, 0.5)
    scores = t * h * (2 * w + c)
    score_sized = [x for x in kept if x.numel() >= scores]
    assert [(x.dtype, x.numel()) for x in score_sized] == [(torch.bfloat16, scores)]
    # in fp32: one log-sum-exp per (query, head) and the sinks, nothing per score
    assert sum(x.numel() for x in kept if x.dtype == torch.float32) == t * h + h


def test_mhc_maps_keep_the_streams_as_they_came():
    """The mHC maps' logits, rms_norm(streams) @ fn^T in fp32, keep the streams for the backward in their
    own dtype (the same tensor the merge keeps), not an fp32 copy, and give autograd's gradients."""
    from mlite.runtime.models.deepseek_v4 import normed_product

    torch.manual_seed(0)
    streams, fn = torch.randn(50, 4, 32, dtype=torch.bfloat16), torch.randn(24, 128, dtype=torch.bfloat16)
    kept = _saved_tensors(normed_product, streams.requires_grad_(), fn.requires_grad_(), 1e-6)
    big = [k for k in kept if k.numel() >= streams.numel()]
    assert [(k.dtype, k.untyped_storage().data_ptr()) for k in big] == [(torch.bfloat16, streams.data_ptr())]
    x, w = streams.detach().float().requires_grad_(), fn.detach().float().requires_grad_()
    grad = torch.randn(50, 24)
    normed_product(x, w, 1e-6).backward(grad)
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    expected = F.linear(xr.flatten(1) * rms_scale(xr.flatten(1), 1e-6), wr)
    torch.testing.assert_close(normed_product(x, w, 1e-6), expected, atol=1e-5, rtol=1e-5)
    expected.backward(grad)
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad, wr.grad, atol=1e-5, rtol=1e-5)


def test_query_norm_and_rope_keep_only_their_output():
    """The queries' weightless norm and RoPE keep their output alone (which the score product keeps
    anyway), not also their input, and give autograd's gradient."""
    torch.manual_seed(0)
    t, h, d, rope = 10, 3, 16, 8
    cos, sin = rope_angles(torch.arange(t), inv_freq(rope, 10000.0, None), torch.float32)
    x = torch.randn(t, h, d, requires_grad=True)
    kept = _saved_tensors(normed_rope, x, cos, sin, 1e-6)
    assert [x.numel() for x in kept if x.numel() >= t * h * d] == [t * h * d]
    weights = torch.randn(t, h, d)
    (normed_rope(x, cos, sin, 1e-6) * weights).sum().backward()
    xr = x.detach().clone().requires_grad_()
    expected = apply_rope(xr * rms_scale(xr, 1e-6), cos, sin)
    torch.testing.assert_close(normed_rope(x, cos, sin, 1e-6), expected, atol=0, rtol=0)
    (expected * weights).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-5)


def test_geometry_from_the_hosts_lengths_equals_the_one_read_from_the_batch():
    """batch_geometry sizes its entry tables from the host's copy of the lengths (no GPU read): the same
    windows as when it reads them from cu_seqlens."""
    from mlite.runtime.data.packed import PackedBatch
    from mlite.runtime.models.deepseek_v4 import batch_geometry

    batch = PackedBatch.from_sequences([list(range(37)), list(range(5)), list(range(130))])
    host = batch_geometry(batch, 16, [4, 16])
    read = batch_geometry(dataclasses.replace(batch, host_lens=None), 16, [4, 16])
    assert torch.equal(host.window_mask, read.window_mask)
    for ratio in (4, 16):
        a, b = host.compressed[ratio], read.compressed[ratio]
        assert a.count == b.count == 37 // ratio + 5 // ratio + 130 // ratio
        for name in ("rows", "prev_rows", "has_prev", "positions", "visible", "visible_mask"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (ratio, name)
        # each 16-token block's entry limit: one past the last entry any of its queries may see (tight)
        seen = torch.where(a.visible_mask, a.visible + 1, 0).amax(1)
        assert a.block_limits == tuple(int(seen[i: i + 16].max()) for i in range(0, seen.numel(), 16))
        assert b.block_limits is None  # without the host's lengths: every block multiplies every entry


def test_indexer_scores_every_entry_at_once_or_per_query_with_the_same_picks(monkeypatch):
    """The indexer scores its candidates one of two ways: one matmul against every entry, then each query's
    candidate columns (a long sequence: its candidates are most entries), or a per-query copy of the
    candidate keys (many short sequences: each query sees few of the batch's entries). Both give the
    same scores within fp32 rounding and the same picks; which way a batch takes follows its shape."""
    from mlite.runtime.models import deepseek_v4
    from mlite.runtime.models.deepseek_v4 import CSA, Indexer, index_scores

    model, _, seqs = reference_model(CASES[0])
    indexer = next(layer.attn.indexer for layer in model.layers.values() if layer.attn.indexer is not None)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(9, indexer.heads, indexer.dim, generator=gen)
    keys = torch.randn(6, indexer.dim, generator=gen)
    weights = torch.randn(9, indexer.heads, generator=gen)
    visible = torch.randint(0, 6, (9, 5), generator=gen)
    torch.testing.assert_close(index_scores(q, keys, weights).gather(1, visible),
                               index_scores(q, keys[visible], weights), atol=1e-6, rtol=1e-6)

    ways = []

    def spy(q, keys, head_weights):
        ways.append("every" if keys.dim() == 2 else "per-query")
        return index_scores(q, keys, head_weights)

    monkeypatch.setattr(deepseek_v4, "index_scores", spy)

    def pick(batch):
        ways.clear()
        geo = batch_geometry(batch, model.arch.v4.sliding_window, model.ratios)
        assert geo.compressed[CSA].count > 0
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(batch.num_tokens, model.arch.hidden, generator=gen)
        q_residual = torch.randn(batch.num_tokens, model.arch.v4.q_lora_rank, generator=gen)
        ropes = model.ropes(geo, torch.float32)
        picked, mask, _ = indexer(x, q_residual, geo, ropes["entries", CSA], ropes["compress"])
        return picked.masked_fill(~mask, -1), set(ways)

    long_seq = torch.cat(seqs)
    one, many = packed([long_seq]), packed([long_seq[i:i + 16] for i in range(0, len(long_seq) - 15, 16)])
    every_picks, every_ways = pick(one)
    assert every_ways == {"every"}
    assert pick(many)[1] == {"per-query"}
    monkeypatch.setattr(Indexer, "every_entry_ratio", 0)  # the per-query way for the same long sequence
    per_query_picks, per_query_ways = pick(one)
    assert per_query_ways == {"per-query"}
    assert torch.equal(every_picks, per_query_picks) and (every_picks >= 0).any()
