"""Kernels agree with their pure-torch references: every attention backend present with the `torch` path
(forward and gradients), the `torch` path with a whole-stream masked softmax (no attention across sequence
boundaries), cached decoding attention with packed attention, grouped GEMM with a dense per-row
product, and the MoE routing and dispatch traced as one compiled graph."""

from __future__ import annotations

import math

import pytest
import torch

from mlite.errors import MliteError
from mlite.runtime.kernels import (
    available_attention_backends,
    cached_attention,
    grouped_gemm,
    grouped_gemm_loop,
    resolve_attention_backend,
    varlen_attention,
)
from mlite.runtime.kernels.segment_sum import segment_sum
from mlite.runtime.models.moe import expert_counts, local_dispatch, router_stats

LENS = [5, 11, 1, 7]
HEADS, KV_HEADS, DIM = 4, 2, 16


def packed_qkv(lens=LENS, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)

    def make(h):
        return torch.randn(t, h, DIM, generator=g).to(device, dtype).requires_grad_()

    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return make(HEADS), make(KV_HEADS), make(KV_HEADS), cu


def whole_stream_reference(q, k, v, lens):
    """One softmax over all T keys with a block-diagonal causal mask, in float64."""
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    idx = torch.arange(seq.numel())
    allowed = (seq[:, None] == seq[None, :]) & (idx[None, :] <= idx[:, None])
    q, k, v = (
        q.double(),
        k.double().repeat_interleave(HEADS // KV_HEADS, 1),
        v.double().repeat_interleave(HEADS // KV_HEADS, 1),
    )
    scores = torch.einsum("qhd,khd->hqk", q, k) / DIM**0.5
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def test_torch_path_equals_a_whole_stream_masked_softmax():
    q, k, v, cu = packed_qkv()
    out = varlen_attention(q, k, v, cu, max(LENS), backend="torch")
    torch.testing.assert_close(out.double(), whole_stream_reference(q, k, v, LENS), rtol=1e-5, atol=1e-6)
    # a changed token of sequence 0 changes nothing in the other sequences
    k2 = k.detach().clone()
    k2[2] += 10
    again = varlen_attention(q, k2, v, cu, max(LENS), backend="torch")
    assert torch.equal(again[LENS[0] :], out[LENS[0] :]) and not torch.equal(again[: LENS[0]], out[: LENS[0]])


@pytest.mark.parametrize("backend", available_attention_backends("cpu"))
def test_every_cpu_backend_agrees_with_the_torch_path(backend):
    assert "torch" in available_attention_backends("cpu") and "sdpa" in available_attention_backends("cpu")
    q, k, v, cu = packed_qkv()
    ref = varlen_attention(q, k, v, cu, max(LENS), backend="torch")
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    out = varlen_attention(q, k, v, cu, max(LENS), backend=backend)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_backend_resolution():
    assert resolve_attention_backend("auto", "cpu") == "sdpa"
    assert resolve_attention_backend("torch", "cpu") == "torch"
    with pytest.raises(
        MliteError, match="unknown attention backend 'flash'; choose auto or one of torch, sdpa"
    ):
        resolve_attention_backend("flash", "cpu")
    for gpu_only in ("varlen", "flash_attn", "te"):
        with pytest.raises(MliteError, match=f"'{gpu_only}' cannot run here: it runs on CUDA GPUs only"):
            resolve_attention_backend(gpu_only, "cpu")


def test_auto_order_is_what_the_module_docstring_says():
    from mlite.runtime.kernels import attention

    cuda = ", ".join(attention._AUTO_ORDER["cuda"])
    assert f"on CUDA {cuda}; on other devices sdpa" in " ".join(attention.__doc__.split())
    assert attention._AUTO_ORDER["cuda"][0] == "packed"
    assert resolve_attention_backend("auto", "meta") == "sdpa"


def test_cached_attention_matches_packed_attention():
    """Right-padded rows of different lengths in a cache (slot = position) give the packed results."""
    lens = [6, 3, 5]
    q, k, v, cu = packed_qkv(lens, seed=1)
    packed = varlen_attention(q, k, v, cu, max(lens), backend="torch").detach()
    width = max(lens)
    bq = torch.zeros(len(lens), width, HEADS, DIM)
    bk, bv = (
        torch.zeros(len(lens), width + 2, KV_HEADS, DIM),
        torch.zeros(len(lens), width + 2, KV_HEADS, DIM),
    )
    positions = torch.full((len(lens), width), -1)
    for b, (start, n) in enumerate(zip(cu[:-1].tolist(), lens)):
        bq[b, :n], bk[b, :n], bv[b, :n] = q[start : start + n], k[start : start + n], v[start : start + n]
        bk[b, n:] = 99.0  # stale slots past the row's positions must be invisible
        positions[b, :n] = torch.arange(n)
    out = cached_attention(bq, bk, bv, positions)
    for b, (start, n) in enumerate(zip(cu[:-1].tolist(), lens)):
        torch.testing.assert_close(out[b, :n], packed[start : start + n], rtol=1e-5, atol=1e-6)
    assert torch.isfinite(out).all()  # padding rows produce numbers, never NaN


def grouped_inputs(counts, n_in=24, n_out=40, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor(counts, device=device)
    x = torch.randn(int(counts.sum()), n_in, generator=g).to(device, dtype)
    w = torch.randn(len(counts), n_out, n_in, generator=g).to(device, dtype)
    return x, w, counts


def dense_reference(x, w, counts):
    expert_of_row = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts)
    return torch.einsum("mi,moi->mo", x.double(), w.double()[expert_of_row])


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 4, 0], [2, 2, 2, 2]])
def test_grouped_gemm_loop_equals_a_dense_reference(counts):
    x, w, c = grouped_inputs(counts)
    out = grouped_gemm_loop(x, w, c)
    torch.testing.assert_close(out.double(), dense_reference(x, w, c), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped_gemm(x, w, c), out, rtol=0, atol=0)  # CPU fp32 takes the loop
    assert out.shape == (sum(counts), 40)


def test_grouped_gemm_loop_under_autocast_returns_the_autocast_dtype():
    """fp32 rows and experts under bf16 autocast: every group's product is bf16, and so is the whole
    output, padding rows (here none: an empty tail) included, as autocast's matmul would return."""
    x, w, c = grouped_inputs([3, 0, 5, 1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = grouped_gemm_loop(x, w, c)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), dense_reference(x, w, c), rtol=2e-2, atol=1e-1)


def test_grouped_gemm_of_no_rows():
    x, w, c = grouped_inputs([0, 0, 0])
    assert grouped_gemm(x, w, c).shape == (0, 40)


def test_expert_counts_equal_bincount_with_and_without_weights():
    ids = torch.tensor([3, 0, 3, 3, 1, 0, 3])
    assert expert_counts(ids, 5).tolist() == torch.bincount(ids, minlength=5).tolist()
    real = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    assert expert_counts(ids, 5, real).tolist() == [1.0, 1.0, 0.0, 3.0, 0.0]


def _router_and_dispatch(hidden, router, experts_weight, real, top_k=2):
    """The MoE block's routing with the grouped-GEMM experts (the CUDA path's op, bf16 on CPU too)."""
    def experts(tokens, counts):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return torch._grouped_mm(tokens, experts_weight.transpose(-2, -1), offs=offsets)

    probs = (hidden.float() @ router.float().t()).softmax(-1)
    weights, expert_ids = probs.topk(top_k, dim=-1)
    out = local_dispatch(hidden, expert_ids, weights.to(hidden.dtype), experts, router.shape[0])
    return out, router_stats(probs, expert_ids, router.shape[0], real)


def test_moe_routing_dispatch_and_statistics_trace_as_one_graph():
    """No bincount, no boolean indexing, no .tolist(): router, permute, grouped GEMM, combine and the
    balance statistics are one torch.compile graph, with the token counts per expert left on the device
    (no host sync). A graph break here would put the dispatch back outside the compiled block."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 32, generator=g).bfloat16()
    router, weight = torch.randn(8, 32, generator=g), torch.randn(8, 16, 32, generator=g).bfloat16()
    real = torch.arange(64) < 50  # the last rows are padding: left out of the statistics
    explained = torch._dynamo.explain(_router_and_dispatch)(hidden, router, weight, real)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    out, stats = torch.compile(_router_and_dispatch, fullgraph=True, backend="eager")(
        hidden, router, weight, real)
    eager_out, eager_stats = _router_and_dispatch(hidden, router, weight, real)
    torch.testing.assert_close(out, eager_out, rtol=0, atol=0)
    _, ids = (hidden.float() @ router.t()).softmax(-1).topk(2, dim=-1)
    assert stats.counts.tolist() == torch.bincount(ids[real].reshape(-1), minlength=8).float().tolist()
    assert stats.rows.item() == 50 and eager_stats.counts.sum().item() == 100


def _runs_summed_one_by_one(rows: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The reference: each run added row by row in fp64."""
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    return torch.stack([rows[a:b].double().sum(0) if b > a else rows.new_zeros(rows.shape[1:]).double()
                        for a, b in zip(starts, starts[1:])])


SEGMENT_LENGTHS = [2, 0, 3, 1, 0, 8, 1]  # empty runs (a gathered token with no local pair) give 0


def test_segment_sum_adds_each_run_and_repeats_the_gradient_over_it():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor(SEGMENT_LENGTHS)
    rows = torch.randn(int(lengths.sum()), 24, generator=g, dtype=torch.float64, requires_grad=True)
    out = segment_sum(rows, lengths)
    torch.testing.assert_close(out, _runs_summed_one_by_one(rows.detach(), SEGMENT_LENGTHS), rtol=0,
                               atol=1e-12)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out.backward(grad)
    # each row's gradient is its run's: run i's gradient repeated lengths[i] times
    torch.testing.assert_close(rows.grad, grad.repeat_interleave(lengths, dim=0), rtol=0, atol=0)
    # bf16 rows are added in fp32 and stored in bf16
    low = segment_sum(rows.detach().bfloat16(), lengths)
    assert low.dtype == torch.bfloat16
    want = _runs_summed_one_by_one(rows.detach().bfloat16(), SEGMENT_LENGTHS)
    torch.testing.assert_close(low.double(), want, rtol=1e-2, atol=1e-2)
    torch.library.opcheck(segment_sum, (rows.detach().requires_grad_(), lengths))


def test_segment_sum_compiles_inside_a_graph_by_its_shape():
    """An opaque op: a compiled region traces through it (no graph break), with the run count dynamic."""
    g = torch.Generator().manual_seed(0)

    def weighted_runs(rows, weights, lengths):
        return segment_sum(rows * weights, lengths).square().sum()

    lengths = torch.tensor(SEGMENT_LENGTHS)
    rows = torch.randn(int(lengths.sum()), 16, generator=g)
    weights = torch.rand(int(lengths.sum()), 1, generator=g)
    explained = torch._dynamo.explain(weighted_runs)(rows, weights, lengths)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    compiled = torch.compile(weighted_runs, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(rows, weights, lengths), weighted_runs(rows, weights, lengths))


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["sdpa", "varlen", "cudnn", "packed", "flash_attn", "te"])
def test_cuda_backends_agree_with_the_torch_path_in_bf16(backend):
    if backend not in available_attention_backends("cuda"):
        # flash-attn and TE are optional installs; what is present is in the report of this test run
        pytest.xfail(f"{backend} is not installed on this GPU machine")
    q, k, v, cu = packed_qkv(dtype=torch.bfloat16, device="cuda")
    ref = varlen_attention(q.float(), k.float(), v.float(), cu, max(LENS), backend="torch")
    out = varlen_attention(q, k, v, cu, max(LENS), backend=backend)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    out.float().square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.gpu
def test_packed_backend_takes_fp32_on_cuda():
    """compute: fp32 on a GPU (the demo's preset) reaches auto's `packed` with fp32 q/k/v: no half-only
    kernel."""
    q, k, v, cu = packed_qkv(dtype=torch.float32, device="cuda")
    ref = varlen_attention(q, k, v, cu, max(LENS), backend="torch")
    torch.testing.assert_close(varlen_attention(q, k, v, cu, max(LENS), backend="packed"), ref,
                               rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_auto_picks_a_fused_backend_on_cuda():
    assert resolve_attention_backend("auto", "cuda") == "packed"


@pytest.mark.gpu
def test_packed_backend_on_one_long_sequence_agrees_with_the_torch_path():
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1024, h, 64, generator=gen, device="cuda", dtype=torch.bfloat16)
               for h in (8, 2, 2))
    cu = torch.tensor([0, 1024], dtype=torch.int32, device="cuda")
    ref = varlen_attention(q.float(), k.float(), v.float(), cu, 1024, backend="torch")
    torch.testing.assert_close(varlen_attention(q, k, v, cu, 1024, backend="packed").float(), ref,
                               rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(("lens", "runs"), [([3000, 2200, 1300], "cudnn"), ([1200, 700, 500], "varlen")],
                         ids=["long-cudnn-per-sequence", "short-one-varlen-call"])
def test_packed_backend_runs_long_sequences_one_by_one_and_short_ones_in_one_varlen_call(lens, runs):
    """policy.per_sequence_attention: sequences of 2,048 tokens or more on average run cuDNN one by one,
    shorter ones one varlen call, bit for bit; either way against the fp32 torch path. varlen takes GQA's
    fewer K/V heads as they are: its backward keeps no K/V copy per query head (q and the output only)."""
    from mlite.plan.policy import per_sequence_attention

    assert per_sequence_attention(sum(lens), len(lens)) == (runs == "cudnn")
    q, k, v, cu = packed_qkv(lens, dtype=torch.bfloat16, device="cuda")
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = varlen_attention(q, k, v, cu, max(lens), backend="packed")
    assert torch.equal(out, varlen_attention(q, k, v, cu, max(lens), backend=runs))
    if runs == "varlen":
        assert sum(size == sum(lens) * HEADS * DIM for size in saved) == 2, saved
    ref = varlen_attention(q.float(), k.float(), v.float(), cu, max(lens), backend="torch")
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, kv_heads", [(16, 8), (32, 4)], ids=["qwen3-1.7b", "qwen3-30b-a3b"])
def test_cudnn_takes_fewer_kv_heads_as_they_are(heads, kv_heads):
    """One long sequence (the bench cases' attention shapes) goes to cuDNN with its K/V heads as they are:
    the backward keeps no K/V copy per query head (only q and the output have the query heads' size), and
    the output and gradients agree with the fp32 torch path and with the same call on repeated K/V."""
    n, dim, groups = 4096, 128, heads // kv_heads
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(n, h, dim, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = varlen_attention(q, k, v, cu, n, backend="packed")
    assert sum(size == n * heads * dim for size in saved) == 2  # q and the output; K/V at kv_heads
    grads = torch.autograd.grad(out.float().square().mean(), (q, k, v))

    k_rep, v_rep = (t.detach().repeat_interleave(groups, 1).requires_grad_() for t in (k, v))
    out_rep = varlen_attention(q, k_rep, v_rep, cu, n, backend="packed")
    dq_rep, dk_rep, dv_rep = torch.autograd.grad(out_rep.float().square().mean(), (q, k_rep, v_rep))
    dk_rep, dv_rep = (g.float().unflatten(1, (kv_heads, groups)).sum(2) for g in (dk_rep, dv_rep))
    for got, want in zip((out, *grads), (out_rep, dq_rep, dk_rep, dv_rep), strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-3)

    ref = varlen_attention(q.float(), k.float(), v.float(), cu, n, backend="torch")
    ref_grads = torch.autograd.grad(ref.square().mean(), (q, k, v))
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    for got, want in zip(grads, ref_grads, strict=True):
        want = want.float()
        torch.testing.assert_close(got.float() / want.abs().max(), want / want.abs().max(), rtol=0, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("counts", [[128, 0, 64, 320], [16] * 8])
def test_torch_grouped_mm_equals_the_loop_in_bf16(counts):
    assert hasattr(torch, "_grouped_mm")
    x, w, c = grouped_inputs(counts, n_in=64, n_out=128, dtype=torch.bfloat16, device="cuda")
    out = grouped_gemm(x, w, c)
    torch.testing.assert_close(out.float(), dense_reference(x, w, c).float(), rtol=2e-2, atol=5e-1)
    torch.testing.assert_close(out, grouped_gemm_loop(x, w, c), rtol=2e-2, atol=5e-1)


@pytest.mark.gpu
def test_grouped_gemm_under_autocast_takes_the_grouped_kernel():
    """One process with fp32 master weights computes under autocast: fp32 experts and activations go to
    torch._grouped_mm in bf16, as autocast runs a matmul (compiled whole: the per-expert loop's host sync
    would break the graph), equal to the loop under autocast, with fp32 gradients for the fp32 weights."""
    x, w, c = grouped_inputs([128, 0, 64, 320], n_in=64, n_out=128, dtype=torch.float32, device="cuda")
    w.requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = torch.compile(grouped_gemm, fullgraph=True)(x, w, c)
        loop = grouped_gemm_loop(x, w, c)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, loop, rtol=2e-2, atol=5e-1)
    out.float().sum().backward()
    assert w.grad is not None and w.grad.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v4"])
def test_moe_block_compiles_to_one_graph_on_cuda(family):
    """The whole MoE block (router, permute, grouped GEMM, combine, statistics; V4: hash or bias routing
    and the shared expert) compiles with fullgraph=True, and equals eager in bf16, gradients included. Two
    compiled runs are bitwise equal: the permutations' gradients are gathers, with no atomics."""
    from mlite.config.catalog import preset_arch
    from mlite.runtime.data.packed import PackedBatch
    from mlite.runtime.models.deepseek_v4 import V4MoE
    from mlite.runtime.models.moe import MoE

    torch.manual_seed(0)
    if family == "deepseek_v4":
        arch = preset_arch("tiny-deepseek-v4")
        block = V4MoE(arch, layer=arch.v4.num_hash_layers)  # bias-routed
        hidden = arch.hidden
    else:
        block, hidden = MoE(256, 16, 4, 128, True, torch.nn.functional.silu), 256
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    block = block.to("cuda", torch.bfloat16)
    x = torch.randn(512, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    batch = PackedBatch.from_sequences([list(range(256)), list(range(255, -1, -1))]).to("cuda")
    compiled = torch.compile(block, fullgraph=True)
    outs = []
    for run in (compiled, compiled, block):
        x.grad = None
        block.zero_grad()
        out, stats = run(x, batch)
        (out.float().square().mean() + (stats.prob_sum.sum() if stats is not None else 0)).backward()
        outs.append((out.detach(), x.grad.clone(), block.router.weight.grad.clone(),
                     block.experts.gate_up.grad.clone()))
    for first, second in zip(outs[0], outs[1], strict=True):
        assert torch.equal(first, second)
    for got, want in zip(outs[0], outs[2], strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_the_runtime_on_a_gpu_computes_with_the_gpu_attention_backend():
    """The Runtime builds its model on the meta device and materialises it on the GPU: `auto` must resolve
    for the GPU (packed: cuDNN / varlen), not for the meta build's CPU fallback (per-sequence SDPA, a host
    sync and a graph break per layer: the dense bench lost 4 MFU points to that)."""
    from mlite.bench.cases import CASES, case_hf_config, case_job
    from mlite.runtime.engine import Runtime
    from mlite.runtime.parallel.parallelize import blocks

    case = CASES["tiny-cpu"]
    runtime = Runtime(case_job(case, "cuda"), hf_config=case_hf_config(case))
    backends = {layer.attn.core.keywords["backend"] for layer in blocks(runtime.model)}
    assert backends == {resolve_attention_backend("auto", "cuda")} == {"packed"}


@pytest.mark.gpu
@pytest.mark.parametrize("name, overrides", [("tiny-cpu", []), ("tiny-cpu-dp2", []),
                                             ("tiny-cpu", ["parallel.fsdp_one_rank=true"])],
                         ids=["moe", "dense", "moe-fsdp-one-rank"])
def test_the_runtimes_gpu_step_never_waits_for_the_gpu(name, overrides):
    """The trainers' step on one GPU (batch copy, compiled forward and backward, loss, grad norm, the
    non-finite check, clipping and the update) runs under CUDA's sync debug mode set to raise: the host
    queues it all and could queue the next step before it ends (the loop reads a step's numbers after the
    next one is queued). Its numbers, read afterwards, are finite."""
    from mlite.bench.cases import CASES, case_arch, case_seq_lens, random_sequences
    from mlite.bench.mlite_side import runtime_step_fn

    case = CASES[name]
    sequences = random_sequences(case_seq_lens(case), case_arch(case).vocab, seed=0)
    step, runtime, last = runtime_step_fn(case, sequences, "cuda", one_gpu=True, overrides=overrides)
    for _ in range(2):  # compile, build the optimizer's state and tables
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert math.isfinite(float(last["loss"])) and math.isfinite(float(last["grad_norm"]))
    runtime.close()  # fsdp_one_rank started a process group of one


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_segment_sum_on_cuda_is_the_torch_paths_sum_and_the_same_every_run(dtype):
    """The Triton kernel (CUDA) against the fp64 sum of each run and against torch.segment_reduce on the
    same rows; two runs bitwise equal. 2050 columns: the last column block is masked."""
    from mlite.runtime.kernels import segment_sum as kernel

    assert kernel.triton is not None, "Triton is part of torch's CUDA wheels: the kernel must be there"
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor(SEGMENT_LENGTHS * 300)
    rows = torch.randn(int(lengths.sum()), 2050, generator=g).to("cuda", dtype)
    got = segment_sum(rows, lengths.cuda())
    assert torch.equal(got, segment_sum(rows, lengths.cuda()))
    want = _runs_summed_one_by_one(rows.cpu(), lengths.tolist())
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.cpu().double(), want, rtol=tol, atol=tol)
    torch_path = torch.segment_reduce(rows.float(), "sum", lengths=lengths.cuda(), unsafe=True).to(dtype)
    torch.testing.assert_close(got, torch_path, rtol=tol, atol=tol)
