"""FP8 training (precision.fp8) through torchao: which linears the conversion swaps, the FP8 forward against
the full-precision one, the routed experts' FP8 grouped GEMM, and training steps through the Runtime with a
checkpoint that loads into a model without FP8.

On CPU everything runs under the adapter's test switch (MLITE_FP8_EMULATE=1: torchao's emulation of the
tensorwise and rowwise recipes, the experts' plain-torch emulation). The `gpu` tests run the real kernels.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from cli_runs import one_thread  # noqa: F401 (autouse: one intra-op thread)
from torch import nn

from mlite.config import job_from_dict
from mlite.config.catalog import preset_arch
from mlite.runtime.adapters.torchao import EMULATE_ENV, convert_to_fp8, fp8_linear_names
from mlite.runtime.data.packed import PackedBatch
from mlite.runtime.engine import Runtime
from mlite.runtime.kernels.grouped_gemm import fp8_round, grouped_gemm, grouped_gemm_loop, use_fp8_experts
from mlite.runtime.loss import sft_loss
from mlite.runtime.models import build_model

E4M3_MAX = 448.0


@pytest.fixture
def emulate(monkeypatch):
    monkeypatch.setenv(EMULATE_ENV, "1")


def to_fp8(model, recipe: str) -> list[str]:
    """What the runtime does at build (mlite.runtime.layout.rank_chunks): the linears, then the experts."""
    names = convert_to_fp8(model, recipe)
    use_fp8_experts(model)
    return names


ON_GPU = ["trainer.device=cuda", "cluster.gpu=h100"]  # a CLI run's keys for the real kernels on one GPU


def experts_fp8(experts) -> str | None:
    """The FP8 mode both of the experts' grouped GEMMs were set to (their `set_gemms` seam)."""
    modes = {getattr(g, "keywords", {}).get("fp8") for g in (experts.gate_up_gemm, experts.down_gemm)}
    assert len(modes) == 1, modes
    return modes.pop()


def tiny(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(preset_arch(name), attention_backend="torch")


def sequences(lengths, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def swapped(model: nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"}


# --------------------------------------------------------------------------------------- the conversion
def test_qwen3_dense_swaps_every_decoder_linear_and_keeps_head_and_embedding(emulate):
    model = tiny("tiny-qwen3")
    names = to_fp8(model, "tensorwise")
    expected = {f"layers.{i}.{p}" for i in range(2) for p in
                ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert set(names) == swapped(model) == expected
    assert type(model.output) is nn.Linear and type(model.embed) is nn.Embedding
    assert all(type(m).__name__ == "RMSNorm" for n, m in model.named_modules() if n.endswith("norm"))


def test_qwen3_moe_keeps_the_router_and_runs_the_experts_in_fp8(emulate):
    model = tiny("tiny-qwen3-moe")
    to_fp8(model, "rowwise")
    assert swapped(model) == {f"layers.{i}.attn.{p}" for i in range(2)
                              for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    for i in range(2):
        moe = model.layers[str(i)].mlp
        assert type(moe.router) is nn.Linear
        assert experts_fp8(moe.experts) == "emulate"  # the seam the grouped GEMMs go through
    assert type(model.output) is nn.Linear


def test_deepseek_v4_keeps_router_indexer_weights_hyper_connections_and_grouped_output(emulate):
    model = tiny("tiny-deepseek-v4")
    names = set(to_fp8(model, "rowwise"))
    assert names == swapped(model)
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    kept = linears - names
    # by name: LM head, routers, indexer weights, the grouped output projection (its weight is read directly)
    assert {n.rsplit(".", 1)[-1] for n in kept} == {"output", "router", "weights_proj", "o_a_proj"}
    assert {f"layers.{i}.attn.{p}" for i in range(4) for p in ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj")
            } <= names
    assert {"layers.1.attn.indexer.q_proj", "layers.1.mlp.shared.down_proj"} <= names
    # hyper-connections and norms are parameters of their own modules, never linears
    assert not any(n.endswith(("_hc", ".head")) for n in names)
    assert all(experts_fp8(model.layers[str(i)].mlp.experts) == "emulate" for i in range(4))


def test_widths_not_multiples_of_the_tile_stay_high_precision():
    model = nn.Module()
    model.fits, model.narrow_out, model.narrow_in = nn.Linear(32, 48), nn.Linear(32, 40), nn.Linear(24, 32)
    model.block, model.block_narrow = nn.Linear(128, 256, bias=False), nn.Linear(128, 64, bias=False)
    assert fp8_linear_names(model, "tensorwise") == ["fits", "block", "block_narrow"]
    assert fp8_linear_names(model, "blockwise") == ["block"]


def test_fp8_linears_auto_keeps_the_linears_too_small_to_gain(emulate):
    """precision.fp8_linears auto: torchao's size rule (mlite.plan.rules.fp8_linear_gains) keeps Qwen3-1.7B's
    k_proj and v_proj (2048 -> 1024) in bf16 under tensorwise; under rowwise (N <= 2048 loses) only the
    MLP's gate and up projections (2048 -> 6144) run in FP8; blockwise and `all` convert every linear that
    tiles. The job's key reaches the Runtime's conversion: the tiny model's linears are all below the rule,
    so auto swaps none, all every one."""
    arch = preset_arch("qwen3-1.7b")
    model = build_model(replace(arch, num_layers=1), "sdpa", dtype=torch.bfloat16, device="meta")
    every = set(fp8_linear_names(model, "tensorwise"))
    tensorwise = set(fp8_linear_names(model, "tensorwise", "auto"))
    assert every - tensorwise == {"layers.0.attn.k_proj", "layers.0.attn.v_proj"}
    assert set(fp8_linear_names(model, "rowwise", "auto")) == {"layers.0.mlp.gate_proj",
                                                               "layers.0.mlp.up_proj"}
    blockwise = set(fp8_linear_names(model, "blockwise", "auto"))
    assert blockwise == set(fp8_linear_names(model, "blockwise")) == every
    auto = fp8_job("tiny-qwen3", "tensorwise")
    auto = auto.model_copy(update={"precision": auto.precision.model_copy(update={"fp8_linears": "auto"})})
    assert not swapped(Runtime(auto).model)
    assert swapped(Runtime(fp8_job("tiny-qwen3", "tensorwise")).model)


def test_fp8_linears_auto_keeps_routed_experts_bf16_where_their_casts_cost_more(emulate):
    """The routed experts' grouped GEMMs follow precision.fp8_linears too: auto runs them in FP8 only where
    mlite.plan.rules.fp8_experts_gain says the GEMMs gain more than their casts cost (never at the tiny
    model's 16 rows an expert); all always. The key reaches the Runtime's experts (their set_gemms seam)."""
    def experts_of(job):
        model = Runtime(job).model
        return {experts_fp8(m) for m in model.modules() if type(m).__name__ == "Experts"}

    every = fp8_job("tiny-qwen3-moe", "rowwise")
    auto = every.model_copy(update={"precision": every.precision.model_copy(update={"fp8_linears": "auto"})})
    assert experts_of(every) == {"emulate"}
    assert experts_of(auto) == {None}


def test_state_dict_names_are_unchanged(emulate):
    model = tiny("tiny-qwen3-moe")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    to_fp8(model, "rowwise")
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)


# ------------------------------------------------------------------------------------- the numerics
# e4m3 keeps 3 mantissa bits: an operand's relative rounding is at most 2^-4 (6%), about 2.6% rms; a product
# of two rounded operands is off by about sqrt(2) x 2.6% = 3.7% (measured: 3.5-4% for one linear). Through
# the tiny models' 2 layers (7 FP8 linears each, residual stream and norms between) the logits are off by
# 4-5% (Qwen3, dense and MoE, both recipes, two seeds): twice one linear's error bounds it. DeepSeek-V4's 4
# layers chain two low-rank projections per query and flip some top-k choices (routing, indexer): 7%.
FP8_LINEAR_REL = 0.05  # one FP8 linear (GPU tests)
FP8_LOGIT_REL = {"tiny-qwen3": 0.075, "tiny-qwen3-moe": 0.075, "tiny-deepseek-v4": 0.10}
QUANTISED = 0.005  # far above bf16's own rounding of the same model (0.4% per operand at most)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("name,recipe", [("tiny-qwen3", "tensorwise"), ("tiny-qwen3", "rowwise"),
                                         ("tiny-qwen3-moe", "rowwise"), ("tiny-deepseek-v4", "tensorwise")])
def test_fp8_forward_is_close_to_full_precision_and_differs_from_it(emulate, name, recipe):
    reference = tiny(name)
    model = copy.deepcopy(reference)
    to_fp8(model, recipe)
    batch = PackedBatch.from_sequences(sequences([40, 24, 56]))
    with torch.no_grad():
        want = reference.compute_logits(reference(batch).hidden)
        got = model.compute_logits(model(batch).hidden)
    error = relative_error(got, want)
    assert QUANTISED < error < FP8_LOGIT_REL[name], error  # quantised (not bit-equal), yet close


def reference_fp8_grouped(x, w, counts):
    """Per expert: each row of x and of w (along `in`) to e4m3 with a power-of-two scale, back, multiplied."""
    def round_rows(t):
        amax = t.abs().amax(-1, keepdim=True).clamp(min=1e-12)
        scale = 2.0 ** torch.floor(torch.log2(E4M3_MAX / amax))
        return (t * scale).to(torch.float8_e4m3fn).to(torch.float32) / scale

    rows = torch.split(x, counts.tolist())
    return torch.cat([round_rows(r) @ round_rows(w[e]).t() for e, r in enumerate(rows)])


def test_emulated_fp8_grouped_gemm_equals_per_expert_reference_and_trains():
    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 17, 3])  # an expert without tokens, groups not multiples of 16
    x = torch.randn(int(counts.sum()), 32, requires_grad=True)
    w = (torch.randn(4, 48, 32) / 6).requires_grad_()
    out = grouped_gemm(x, w, counts, fp8="emulate")
    torch.testing.assert_close(out, reference_fp8_grouped(x.detach(), w.detach(), counts), rtol=0, atol=1e-6)
    assert not torch.equal(out, grouped_gemm_loop(x, w, counts))  # it does quantise

    grad = torch.randn_like(out)
    out.backward(grad)
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    grouped_gemm_loop(x_ref, w_ref, counts).backward(grad)
    assert relative_error(x.grad, x_ref.grad) < FP8_LINEAR_REL
    assert relative_error(w.grad, w_ref.grad) < FP8_LINEAR_REL
    assert relative_error(x.grad, x_ref.grad) > QUANTISED  # the gradient GEMMs quantise too
    assert torch.count_nonzero(w.grad[1]) == 0 and torch.count_nonzero(w.grad[2]) > 0


def test_fp8_round_keeps_representable_values_and_bounds_the_error():
    t = torch.tensor([[448.0, -0.5, 1.0, 3.25], [1e-3, 2e-3, -4e-3, 0.0]])
    torch.testing.assert_close(fp8_round(t[:1], -1), t[:1], rtol=0, atol=0)  # already e4m3 at scale 1
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of a normal value; below 2^-6 (subnormals) the step
    # is 2^-9, so the error is at most 2^-10, both in the row's scaled units
    scale = torch.exp2(torch.floor(torch.log2(448.0 / x.abs().amax(-1, keepdim=True))))
    bound = torch.maximum(x.abs() * 2**-4, 2**-10 / scale)
    assert ((fp8_round(x, -1) - x).abs() <= bound * (1 + 1e-6)).all()


# ------------------------------------------------------------------------------------- the runtime
def fp8_job(model="tiny-qwen3-moe", fp8="rowwise"):
    return job_from_dict({
        "model": {"name": model},
        # every linear in FP8: the tiny widths are all below torchao's size rule (fp8_linears auto)
        "precision": {"compute": "bf16", "fp8": fp8, **({"fp8_linears": "all"} if fp8 != "none" else {})},
        "optimizer": {"lr": 3e-3},
        "data": {"seq_len": 128},
        "trainer": {"device": "cpu", "steps": 6, "seed": 7},
    })


def train(rt: Runtime, batch: PackedBatch, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        (out,) = rt.forward_backward([batch], sft_loss(batch.num_target_tokens))
        rt.optimizer_step()
        rt.zero_grad()
        losses.append(float(out["loss"]))
    return losses


@pytest.mark.parametrize("recipe,multiple", [("tensorwise", 16), ("none", 1)])
def test_every_fp8_linear_sees_whole_tiles_of_tokens(emulate, recipe, multiple):
    """The weight gradient contracts over the tokens, an FP8 GEMM's inner width, which torch._scaled_mm
    needs in multiples of 16 (a 662-token micro-batch failed the first SFT on an H200): under precision.fp8
    the runtime pads each share with one ignored sequence (rules.fp8_token_multiple); the loss and the
    log-probs are the micro-batch's own tokens'."""
    rt = Runtime(fp8_job("tiny-qwen3", recipe))
    assert rt.plan.token_multiple == multiple
    rows = []
    for m in rt.model.layers.modules():  # the decoder's linears (FP8 ones under the recipe)
        if isinstance(m, nn.Linear):
            m.register_forward_hook(lambda mod, args, out: rows.append(args[0].numel() // mod.in_features))
    batch = PackedBatch.from_sequences(sequences([40, 30, 53]))  # 123 tokens
    (out,) = rt.forward_backward([batch], sft_loss(batch.num_target_tokens))
    assert rows and set(rows) == {123 + -123 % multiple}, set(rows)
    assert out["logprobs"].shape == (123,) and out["num_tokens"] == 123
    assert torch.isfinite(out["loss"])


@pytest.mark.parametrize("model,recipe", [("tiny-qwen3", "tensorwise"), ("tiny-qwen3-moe", "rowwise")])
def test_runtime_fp8_steps_reduce_the_loss_and_the_checkpoint_loads_without_fp8(
        emulate, monkeypatch, tmp_path, model, recipe):
    rt = Runtime(fp8_job(model, recipe))
    assert swapped(rt.model)  # the runtime built its model through the conversion
    batch = PackedBatch.from_sequences(sequences([40, 30, 50]))
    losses = train(rt, batch, 6)
    assert losses[-1] < losses[0] - 0.3, losses
    rt.save_checkpoint(tmp_path / "ck")
    exported = dict(rt.export_weights())

    monkeypatch.delenv(EMULATE_ENV)
    plain = Runtime(fp8_job(model, "none"))
    assert not swapped(plain.model)
    assert list(plain.model.state_dict()) == list(rt.model.state_dict())
    plain.load_checkpoint(tmp_path / "ck")
    for (name, ours), (_, theirs) in zip(rt.model.state_dict().items(), plain.model.state_dict().items()):
        assert torch.equal(ours, theirs), name
    plain_exported = dict(plain.export_weights())
    assert list(plain_exported) == list(exported)  # HF export: the same names
    assert all(torch.equal(plain_exported[k], exported[k]) for k in exported)


@pytest.mark.parametrize("model,overrides,rtol,ranks", [
    # FSDP2 gathers FP8 weights; bf16 gradients summed over two ranks in another order: 1e-3 to 6e-3 apart
    ("dense", ["precision.fp8=tensorwise", "precision.fp8_all_gather=true"], 1e-2, 2),
    ("moe", ["precision.fp8=rowwise", "parallel.ep=2"], 1e-3, 2),  # FP8 experts split over two ranks (bf16)
    ("dense", ["precision.fp8=tensorwise", "parallel.pp=2"], 1e-2, 2),  # FP8 stages
    ("dense", ["precision.fp8=rowwise", "parallel.cp=2"], 1e-2, 2),  # a sequence's rows split over two ranks
    # FSDP2 at world 1 (parallel.fsdp_one_rank), its units gathered in FP8; and the same on one GPU
    ("dense", ["precision.fp8=tensorwise", "parallel.fsdp_one_rank=true", "precision.fp8_all_gather=true"],
     1e-2, 1),
    pytest.param("dense", ["precision.fp8=tensorwise", "parallel.fsdp_one_rank=true",
                           "precision.fp8_all_gather=true", *ON_GPU], 1e-2, 1, marks=pytest.mark.gpu,
                 id="gpu-fsdp2-world-1"),
])
def test_fp8_sft_on_two_ranks_matches_one_process(tmp_path, model, overrides, rtol, ranks):
    """An FP8 SFT run (emulated numerics, MLITE_FP8_EMULATE=1) on two gloo ranks (or FSDP2 over one) follows
    the one-process FP8 run: the scales are the whole tensor's or row's on every layout, so the rounding is
    too. The rule book lets the switch run FP8 on the CPU; the curve differs from the same run in bf16. On a
    GPU (ON_GPU) the real kernels run, without the switch."""
    from cli_runs import assert_same_curve, job_dict, layout_assets, mlite_cli, records

    assets = layout_assets(tmp_path / "assets")
    gpu = [o for o in overrides if o in ON_GPU]
    emulated = {} if gpu else {EMULATE_ENV: "1"}
    runs = {}
    every = ["precision.fp8_linears=all"]  # the tiny widths are all below torchao's size rule (auto)
    recipe = [o for o in overrides if o.startswith("precision.fp8=")]
    for name, ranks, extra in (("one", 1, recipe + every + gpu), ("two", ranks, overrides + every),
                               ("plain", 1, gpu)):
        out = tmp_path / name
        (tmp_path / name).mkdir()
        job = job_dict(assets, model, out, precision={"compute": "bf16"})  # FP8 runs beside bf16
        done = mlite_cli(tmp_path / name, job, ranks, *extra, env=emulated if name != "plain" else None)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = records(out)
    assert_same_curve(runs["two"], runs["one"], rtol=rtol)
    assert any(abs(a["loss"] - b["loss"]) > 1e-4 * abs(b["loss"]) for a, b in zip(runs["one"], runs["plain"]))


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_gpu_fp8_gathered_weights_are_stepped_by_the_adamw_kernel(monkeypatch):
    """FSDP2 (at world 1) with the FP8 all-gather: each FP8 linear's shard is torchao's wrapper around its
    bf16 data, and the optimizer step is still TritonAdamW's kernel over that data, not torch's foreach
    step (which read the device about 400 times a step: dense-1.7b-4k-dp2-fp8 took 221 ms against bf16's
    117), and finding the data reads nothing on the host. The wrapped weights move, and the run trains."""
    from torch.distributed.tensor import DTensor

    from mlite.runtime.adapters.pytorch import wrapped_data

    monkeypatch.delenv(EMULATE_ENV, raising=False)
    job = job_from_dict({
        "model": {"name": "tiny-qwen3"}, "cluster": {"gpu": "h100"},
        "precision": {"compute": "bf16", "fp8": "tensorwise", "fp8_linears": "all", "fp8_all_gather": True},
        "parallel": {"fsdp_one_rank": True}, "optimizer": {"lr": 3e-3}, "data": {"seq_len": 128},
        "trainer": {"device": "cuda", "steps": 6, "seed": 7},
    })
    rt = Runtime(job)
    wrapped = {name: p for name, p in rt.model.named_parameters()
               if isinstance(p, DTensor) and wrapped_data(p.to_local()) is not None}
    assert len(wrapped) == len(swapped(rt.model)), sorted(wrapped)
    before = {name: wrapped_data(p.to_local()).clone() for name, p in wrapped.items()}
    batch = PackedBatch.from_sequences(sequences([40, 30, 50]))
    (out,) = rt.forward_backward([batch], sft_loss(batch.num_target_tokens))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # unwrapping the weights reads nothing on the host
    try:
        assert rt.optim.fused and rt.optim.optimizer._plan() is not None, "torch's step, not the kernel"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    rt.optimizer_step()
    rt.zero_grad()
    assert all(not torch.equal(wrapped_data(p.to_local()), before[name]) for name, p in wrapped.items())
    losses = [float(out["loss"]), *train(rt, batch, 5)]
    assert losses[-1] < losses[0] - 0.3, losses
    rt.close()


def gpu_pair(recipe: str, hidden: int = 256):
    """A bf16 linear stack and its FP8 copy on the GPU."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(hidden, 2 * hidden, bias=False), nn.SiLU(),
                          nn.Linear(2 * hidden, hidden, bias=False)).cuda().bfloat16()
    fp8 = copy.deepcopy(model)
    assert len(to_fp8(fp8, recipe)) == 2
    return model, fp8


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_gpu_fp8_linears_match_bf16_within_fp8_tolerance(monkeypatch, recipe):
    monkeypatch.delenv(EMULATE_ENV, raising=False)
    model, fp8 = gpu_pair(recipe)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x8 = x.detach().clone().requires_grad_()
    want, got = model(x), fp8(x8)
    assert QUANTISED < relative_error(got, want) < 2 * FP8_LINEAR_REL  # two linears
    grad = torch.randn_like(want)
    want.backward(grad)
    got.backward(grad)
    assert relative_error(x8.grad, x.grad) < 2 * FP8_LINEAR_REL
    for (name, p), p8 in zip(model.named_parameters(), fp8.parameters()):
        assert relative_error(p8.grad, p.grad) < 2 * FP8_LINEAR_REL, name


def block_arch(name: str):
    """Real widths (hidden 2048, every FP8 tile whole, 128x128 blocks too), few layers: Qwen3-1.7B's
    dense block, Qwen3-30B-A3B's MoE block with 16 experts, and small-deepseek-v4 (DeepSeek-V4's attention,
    mHC, hash and learned routing)."""
    from dataclasses import replace

    if name == "dense":
        return replace(preset_arch("qwen3-1.7b"), num_layers=2, vocab=1024)
    if name == "moe":
        arch = preset_arch("qwen3-30b-a3b")
        return replace(arch, num_layers=2, vocab=1024, moe=replace(arch.moe, num_experts=16, top_k=4))
    return preset_arch("small-deepseek-v4")


# Bounds on FP8's relative error against bf16 on these random-init models: (the final hidden states, the
# median over the decoder weights' gradients). e4m3 rounds 16x coarser than bf16, and the error compounds
# through the layers and, in the backward, through attention and the routers' top-k picks. Measured with the
# CPU emulation of tensorwise and rowwise (same rounding): dense 0.148 / 0.198, MoE 0.115 / 0.264, V4
# 0.250 / 0.424; the bounds are 1.5x that. A wrong kernel (a transposed operand, a lost scale) is off by
# 100% or more.
FP8_BLOCK_REL = {"dense": (0.23, 0.30), "moe": (0.18, 0.40), "v4": (0.38, 0.64)}


def fp8_block_errors(name: str, recipe: str, device: str) -> tuple[float, dict[str, float]]:
    """Two copies of `name`'s blocks in bf16, one converted to `recipe`: the relative error of the final
    hidden states over a packed batch of three sequences, and of each decoder weight's gradient under the
    same random direction."""
    torch.manual_seed(0)
    arch = block_arch(name)
    reference = build_model(arch, dtype=torch.bfloat16, device=device,
                            attention_backend="torch" if device == "cpu" else "auto")
    model = copy.deepcopy(reference)
    assert to_fp8(model, recipe)
    batch = PackedBatch.from_sequences(sequences([120, 72, 64], vocab=arch.vocab)).to(device)
    want, got = reference(batch).hidden, model(batch).hidden
    direction = torch.randn_like(want)
    (want.float() * direction).sum().backward()
    (got.float() * direction).sum().backward()
    grads = {n: relative_error(p8.grad, p.grad)
             for (n, p), p8 in zip(reference.named_parameters(), model.parameters())
             if p.grad is not None and p.dim() >= 2 and ".layers." in f".{n}" and p.grad.norm() > 0}
    assert len(grads) >= 10
    return relative_error(got, want), grads


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("name", ["dense", "moe", "v4"])
def test_gpu_fp8_blocks_match_bf16_forward_and_backward(monkeypatch, name, recipe):
    """Each recipe on real-width dense, MoE and DeepSeek-V4 blocks: the output and the decoder weights'
    gradients within FP8_BLOCK_REL of bf16's, and not equal to them (the FP8 kernels ran)."""
    import statistics

    monkeypatch.delenv(EMULATE_ENV, raising=False)
    out, grads = fp8_block_errors(name, recipe, "cuda")
    out_bound, grad_bound = FP8_BLOCK_REL[name]
    assert QUANTISED < out < out_bound, out
    assert statistics.median(grads.values()) < grad_bound, grads


@pytest.mark.gpu
@pytest.mark.timeout(300)  # torchao's Triton kernels autotune on first use (100 s seen); one try died in it
def test_gpu_fp8_grouped_gemm_matches_bf16_and_its_emulation():
    torch.manual_seed(0)
    counts = torch.tensor([37, 0, 16, 130, 5], device="cuda")  # unaligned groups and an empty one
    x = torch.randn(int(counts.sum()), 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(5, 256, 128, device="cuda") / 11).bfloat16().requires_grad_()
    out = grouped_gemm(x, w, counts, fp8="rowwise")
    want = grouped_gemm(x, w, counts)
    emulated = grouped_gemm(x, w, counts, fp8="emulate")
    assert QUANTISED < relative_error(out, want) < FP8_LINEAR_REL
    assert relative_error(out, emulated) < 0.01  # the same rounding; bf16 output and fast accumulation
    grad = torch.randn_like(out)
    (gx, gw), (wx, ww) = (torch.autograd.grad(o, (x, w), grad) for o in (out, want))
    assert relative_error(gx, wx) < FP8_LINEAR_REL and relative_error(gw, ww) < FP8_LINEAR_REL
    assert torch.count_nonzero(gw[1]) == 0


@pytest.mark.gpu
def test_gpu_runtime_trains_moe_in_fp8(monkeypatch):
    monkeypatch.delenv(EMULATE_ENV, raising=False)
    job = job_from_dict({
        "model": {"name": "tiny-qwen3-moe"},
        "precision": {"compute": "bf16", "fp8": "rowwise", "fp8_linears": "all"},
        "optimizer": {"lr": 3e-3},
        "data": {"seq_len": 128},
        "trainer": {"device": "cuda", "steps": 6, "seed": 7},
    })
    rt = Runtime(job)
    assert swapped(rt.model) and experts_fp8(rt.model.layers["0"].mlp.experts) == "rowwise"
    losses = train(rt, PackedBatch.from_sequences(sequences([40, 30, 50])), 6)
    assert losses[-1] < losses[0] - 0.3, losses


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("first,then", [("none", "tensorwise"), ("tensorwise", "none")])
def test_a_checkpoint_resumes_across_the_fp8_switch(tmp_path, first, then, device):
    """A run preempted after step 2 resumes with precision.fp8 switched (bf16 -> FP8 and FP8 -> bf16;
    emulated numerics on the CPU, the kernels on a GPU): FP8 changes neither the parameters nor the
    optimizer state, so the checkpoint loads as it is; the resumed steps follow the uninterrupted run within
    FP8's rounding, and differ from it (the switch took effect)."""
    import shutil

    from cli_runs import STEPS, job_dict, layout_assets, mlite_cli, records

    from mlite.runtime.ckpt.checkpoint import CheckpointManager

    assets = layout_assets(tmp_path / "assets")
    emulated, gpu = ({}, ON_GPU) if device == "cuda" else ({EMULATE_ENV: "1"}, [])
    saved, resumed = tmp_path / "saved", tmp_path / "resumed"
    (tmp_path / "a").mkdir()
    job = job_dict(assets, "dense", saved, precision={"compute": "bf16"})
    def fp8(recipe: str) -> list[str]:  # every linear: the tiny widths are below torchao's size rule (auto)
        return [f"precision.fp8={recipe}", *(["precision.fp8_linears=all"] if recipe != "none" else [])]

    done = mlite_cli(tmp_path / "a", job, 1, *fp8(first), *gpu, env=emulated)
    assert done.returncode == 0, done.stderr[-3000:]
    shutil.copytree(saved, resumed)  # as a job preempted after step 2 leaves its folder
    for step in range(3, STEPS + 1):
        shutil.rmtree(CheckpointManager(resumed).path_for(step), ignore_errors=True)
    (tmp_path / "b").mkdir()
    job = job_dict(assets, "dense", resumed, precision={"compute": "bf16"})
    done = mlite_cli(tmp_path / "b", job, 1, *fp8(then), "trainer.resume=auto", *gpu,
                     env=emulated)
    assert done.returncode == 0, done.stderr[-3000:]
    want, got = records(saved), records(resumed)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    assert got[:2] == want[:2]  # kept as the preempted run wrote them
    for ours, ref in zip(got[2:], want[2:]):
        assert (ours["tokens"], ours["target_tokens"]) == (ref["tokens"], ref["target_tokens"])
        assert ours["loss"] == pytest.approx(ref["loss"], rel=5e-3) and ours["loss"] != ref["loss"]  # 3e-4


@pytest.mark.parametrize("linears", ["auto", "all"])
def test_an_fp8_run_says_at_start_up_when_auto_leaves_everything_in_bf16(tmp_path, linears):
    """`mlite sft` prints the plan's notes before it trains: on the tiny model every linear and routed expert
    is below what FP8 gains on (precision.fp8_linears auto), so the run says it computes in bf16 and how to
    force FP8; with `all` it says nothing of the kind. Both train (emulated numerics)."""
    from cli_runs import job_dict, layout_assets, mlite_cli, records

    assets = layout_assets(tmp_path / "assets")
    job = job_dict(assets, "moe", tmp_path / "out", precision={"compute": "bf16"})
    done = mlite_cli(tmp_path, job, 1, "precision.fp8=rowwise", f"precision.fp8_linears={linears}",
                     env={EMULATE_ENV: "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    said = "note: precision.fp8 rowwise: no linear or routed expert" in " ".join(done.stderr.split())
    assert said == (linears == "auto"), done.stderr[-2000:]
    assert records(tmp_path / "out")
