"""Every parallel layout trains the tiny dense and MoE decoders to the single-process numbers.

Each test starts 2 or 4 gloo ranks, applies the layout (TP+SP, CP, EP, FSDP2 over dp x cp), trains 3
optimizer steps of 4 packed micro-batches (AdamW, clipping on) and compares the loss and the gradient norm
of every step with one process running the same micro-batches with gradient accumulation: within 1e-5
relative in fp32.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from parallel_harness import build_layout, launch, make_batches, make_model, make_optimizer, reference, train
from torch.distributed.fsdp import FSDPModule

from mlite.runtime.data.packed import IGNORE, PADDING, PackedBatch
from mlite.runtime.parallel.mesh import ParallelDims
from mlite.runtime.parallel.parallelize import blocks, is_moe

STEPS = 3


def _worker(rank, world, layout, models, out):
    layout = dict(layout)
    job_sections = layout.pop("job", None)  # recompute / offload sections of the job file
    mesh = ParallelDims(world, **layout).build("cpu")
    results = {}
    for moe in models:  # one process group start for both models
        chunks = build_layout(moe, mesh, job_sections)
        results[moe] = train(chunks, mesh, make_optimizer(chunks), range(STEPS))
        if moe:  # which parts of a MoE block are FSDP2 units of their own: (router's block, experts)
            results["units"] = {(isinstance(layer.mlp, FSDPModule), isinstance(layer.mlp.experts, FSDPModule))
                                for chunk in chunks.values() for layer in blocks(chunk) if is_moe(layer)}
    if rank == 0:
        torch.save(results, out)


def check_parity(tmp_path, world, layout, models=(False, True)):
    out = tmp_path / "history.pt"
    launch(world, _worker, layout, models, str(out))
    results = torch.load(out)
    if True in models:
        # the experts are a unit where their edp mesh is not the layer's dp_cp (ep, etp or tp > 1) and spans
        # several ranks (over one, they stay plain ep parameters: fp32 masters and compute on the CPU), the
        # router where its dp_cp_tp is not (tp > 1): each unit adds host work, collectives and graph breaks
        dims = ParallelDims(world, **{k: v for k, v in layout.items() if k != "job"})
        experts_unit = dims.ep * dims.tp > 1 and dims.edp > 1
        assert results["units"] == {(dims.tp > 1, experts_unit)}, (layout, results["units"])
    for moe in models:
        got, want, name = results[moe], reference(moe)[:STEPS], "moe" if moe else "dense"
        assert len(got) == STEPS
        for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want)):
            assert loss == pytest.approx(ref_loss, rel=1e-5), (
                f"{name} step {step}: loss {loss}, one process {ref_loss}"
            )
            assert norm == pytest.approx(ref_norm, rel=1e-5), (
                f"{name} step {step}: grad norm {norm}, one process {ref_norm}"
            )


@pytest.mark.parametrize(
    "world,layout",
    [
        (2, dict(dp=2)),
        (2, dict(tp=2)),
        (2, dict(cp=2)),
        (4, dict(dp=2, tp=2)),
        (4, dict(cp=2, tp=2)),
        (2, dict(pp=2)),
        (2, dict(pp=2, vpp=2)),
        (4, dict(pp=2, tp=2)),
        (2, dict(tp=2, job={"recompute": {"granularity": "full", "method": "uniform", "num_layers": 1}})),
    ],
    ids=["dp2", "tp2", "cp2", "tp2xdp2", "cp2xtp2", "pp2", "pp2+vpp2", "pp2xtp2", "tp2+full-recompute"],
)
def test_dense_and_moe_match_one_process(tmp_path, world, layout):
    check_parity(tmp_path, world, layout)


@pytest.mark.parametrize(
    "world,layout",
    [(2, dict(dp=2, ep=2)), (4, dict(dp=4, ep=2)), (2, dict(tp=2, ep=2)), (4, dict(dp=4, ep=4))],
    ids=["ep2", "ep2xdp2", "ep2xtp2", "ep4"],  # top-2: ep2 gathers the tokens, ep4 sends them pair by pair
)
def test_expert_parallel_matches_one_process(tmp_path, world, layout):
    check_parity(tmp_path, world, layout, models=(True,))


def unwritten_padding(experts):
    """`experts` whose output rows past sum(counts) are NaN: rows a GEMM never wrote."""

    def run(tokens, counts):
        out = experts(tokens, counts)
        padding = torch.arange(out.shape[0]) >= counts.sum()
        return torch.where(padding.unsqueeze(-1), torch.full_like(out, float("nan")), out)

    return run


def _exchange_worker(rank, world, out):
    import torch.distributed as dist
    import torch.nn.functional as F

    from mlite.runtime.models.moe import Experts, local_dispatch
    from mlite.runtime.parallel.expert import expert_parallel_dispatch

    experts_n, k, hidden = 12, 3, 16
    local = experts_n // world
    torch.manual_seed(0)  # the same experts on every rank
    experts = Experts(experts_n, hidden, 12, F.silu).double()
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    routings = {  # [tokens, k] distinct expert ids a token, from this many of the last experts
        "random": experts_n,  # a token's choices on one rank or spread over several
        "one rank": local,  # every pair on the last rank: the others run no pair at all
    }
    # the all-gather takes one length from every rank (the step pads to it: mlite.runtime.parallel.step.
    # equal_lengths); the all-to-all takes any (packed micro-batches differ in length)
    # all_gather bounded: its pair buffers sized for the most pairs (parallel.expert_buffers worst_case),
    # the experts' output rows past the real pairs not finite, as torch's grouped matmul leaves them unwritten
    rows = {"equal rows": (13, ("one process", "all_gather", "all_to_all", "all_gather bounded")),
            "unequal rows": (10 + 3 * rank, ("one process", "all_to_all"))}
    results = {}
    for (name, choices), (rows_name, (tokens, exchanges)) in itertools.product(routings.items(),
                                                                               rows.items()):
        g = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64, requires_grad=True)
        ids = torch.stack([experts_n - 1 - torch.randperm(choices, generator=g)[:k] for _ in range(tokens)])
        w = torch.rand(tokens, k, generator=g, dtype=torch.float64, requires_grad=True)
        got = {}
        for exchange in exchanges:
            experts.zero_grad()
            if exchange == "one process":  # this rank's tokens through every expert, no exchange
                experts.set_local_view(lambda weight: weight)
                y = local_dispatch(x, ids, w, experts, experts_n)
            else:
                experts.set_local_view(lambda weight: weight[rank * local : (rank + 1) * local])
                bounded = exchange == "all_gather bounded"
                dispatch = expert_parallel_dispatch(dist.group.WORLD, exchange.split()[0], bounded)
                y = dispatch(x, ids, w, unwritten_padding(experts) if bounded else experts, experts_n)
            (y * torch.linspace(-1, 1, hidden, dtype=torch.float64)).square().sum().backward()
            grads = [p.grad.clone() for p in experts.parameters()]
            for grad in grads:  # every rank's tokens' share of the experts' gradients
                dist.all_reduce(grad)
            got[exchange] = [y.detach().clone(), x.grad.clone(), w.grad.clone(), *grads]
            x.grad, w.grad = None, None
        results[f"{name}, {rows_name}"] = got
    torch.save(results, f"{out}.{rank}")


@pytest.mark.parametrize("world", [2, 4])
def test_both_expert_exchanges_give_the_one_process_outputs_and_gradients(tmp_path, world):
    """The all-gather and the all-to-all exchange, forced on the same routing, give every rank the output,
    and the gradients of its tokens, router weights and experts, that running its tokens through all experts
    gives (fp64, summed over ranks for the experts), including a routing whose pairs all land on one rank
    (which fills the all-gather's worst-case pair buffers, and leaves the others' all padding); the
    all-to-all also with a different number of tokens on every rank."""
    out = tmp_path / "exchange"
    launch(world, _exchange_worker, str(out))
    for rank in range(world):
        for name, got in torch.load(f"{out}.{rank}").items():
            want = got["one process"]
            assert len(got) == (2 if name.endswith("unequal rows") else 4), name
            for exchange in set(got) - {"one process"}:
                names = ("output", "tokens", "weights", "gate_up", "down")
                for what, a, b in zip(names, got[exchange], want, strict=True):
                    assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), (rank, name, exchange, what)
                    assert b.abs().sum() > 0 or what in ("gate_up", "down")


def _compiled_bounded_exchange_worker(rank, world, out):
    import torch.distributed as dist

    from mlite.runtime.parallel.expert import expert_parallel_dispatch

    experts_n, k, hidden, tokens = 8, 4, 16, 13  # top-4 at ep2: the all-gather exchange
    local = experts_n // world
    weight = torch.randn(local, hidden, hidden, generator=torch.Generator().manual_seed(7 + rank),
                         dtype=torch.float64, requires_grad=True)

    def by_row(rows, counts):  # each row through its expert's matrix, padding through the last: no host read
        expert = torch.bucketize(torch.arange(rows.shape[0]), torch.cumsum(counts, 0), right=True)
        return torch.einsum("mi,moi->mo", rows, weight[expert.clamp(max=local - 1)])

    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.rand(tokens, experts_n, generator=g).topk(k).indices
    w = torch.rand(tokens, k, generator=g, dtype=torch.float64, requires_grad=True)
    dispatch = expert_parallel_dispatch(dist.group.WORLD, "all_gather", bounded=True)

    def exchange(x, ids, w):
        return dispatch(x, ids, w, by_row, experts_n)

    got = []
    for run in (exchange, torch.compile(exchange, fullgraph=True)):  # fullgraph: a graph break raises
        y = run(x, ids, w)
        y.square().sum().backward()
        got.append([y.detach().clone(), x.grad, w.grad, weight.grad])
        x.grad, w.grad, weight.grad = None, None, None
    torch.save(got, f"{out}.{rank}")


def test_the_bounded_exchange_compiles_whole_and_matches_eager(tmp_path):
    """parallel.expert_buffers worst_case: with nothing read on the host, the all-gather exchange's
    collectives are traceable, so torch.compile takes the whole exchange as one graph (fullgraph=True
    raises at a break), forward and backward, and gives eager's output and gradients (fp64, gloo)."""
    out = tmp_path / "compiled"
    launch(2, _compiled_bounded_exchange_worker, str(out))
    for rank in range(2):
        eager, compiled = torch.load(f"{out}.{rank}")
        for what, a, b in zip(("output", "tokens", "weights", "experts"), compiled, eager, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=f"rank {rank} {what}")
            assert b.abs().sum() > 0, (rank, what)


def _bounded_exchange_gpu_worker(rank, world, out):
    import torch.distributed as dist
    import torch.nn.functional as F

    from mlite.runtime.models.moe import Experts
    from mlite.runtime.parallel.expert import expert_parallel_dispatch

    experts_n, k, hidden, tokens = 16, 4, 256, 512  # top-4 at ep2: the all-gather exchange
    local = experts_n // world
    torch.manual_seed(0)
    experts = Experts(experts_n, hidden, 128, F.silu).cuda().bfloat16()
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.05)
    experts.set_local_view(lambda weight: weight[rank * local : (rank + 1) * local])
    g = torch.Generator(device="cuda").manual_seed(100 + rank)
    x = torch.randn(tokens, hidden, generator=g, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = torch.rand(tokens, experts_n, generator=g, device="cuda").topk(k).indices
    w = torch.rand(tokens, k, generator=g, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    got = {}
    for bounded in (False, True):
        experts.zero_grad()
        dispatch = expert_parallel_dispatch(dist.group.WORLD, "all_gather", bounded)
        torch.cuda.synchronize()
        if bounded:  # any host read of a device value now raises
            torch.cuda.set_sync_debug_mode("error")
        try:
            y = dispatch(x, ids, w, experts, experts_n)
            y.float().square().sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        got[bounded] = [y.detach().clone(), x.grad.clone(), w.grad.clone(),
                        *(p.grad.clone() for p in experts.parameters())]
        x.grad, w.grad = None, None
    torch.save({name: [t.cpu() for t in ts] for name, ts in got.items()}, f"{out}.{rank}")


@pytest.mark.gpu
def test_gpu_bounded_pair_buffers_read_nothing_on_the_host_and_match_the_counted_ones(tmp_path):
    """parallel.expert_buffers worst_case on 2 GPUs (NCCL, bf16, torch's grouped matmul, which leaves the
    padding rows unwritten): the all-gather exchange reads no device value on the host, forward and
    backward, and its output and gradients equal the exchange sized by the host-read pair count (bf16)."""
    if torch.cuda.device_count() < 2:
        pytest.fail(f"needs 2 GPUs, {torch.cuda.device_count()} visible")
    out = tmp_path / "bounded"
    launch(2, _bounded_exchange_gpu_worker, str(out), backend="nccl")
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")
        for what, a, b in zip(("output", "tokens", "weights", "gate_up", "down"), got[True], got[False],
                              strict=True):
            assert torch.isfinite(a).all(), (rank, what)
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=1e-3, msg=f"{rank} {what}")
            assert b.abs().sum() > 0, (rank, what)


def _equal_lengths_worker(rank, world, out):
    from mlite.runtime.parallel.step import equal_lengths, local_share

    # rank r: micro-batches of 5 + r and 9 - r tokens; a third call with one micro-batch more on rank 0
    mine = [PackedBatch.from_sequences([[1] * (5 + rank)]),
            PackedBatch.from_sequences([[2] * 3, [3] * (6 - rank)])]
    padded = equal_lengths(mine)
    mesh = ParallelDims(world, dp=world).build("cpu")
    shares = [local_share(b, mesh) for b in mine]  # pure dp: no padding
    try:
        equal_lengths(mine + mine[:1] if rank == 0 else mine)
        refusal = ""
    except RuntimeError as err:
        refusal = str(err)
    torch.save({"padded": padded, "shares": shares, "refusal": refusal}, f"{out}.{rank}")


@pytest.mark.parametrize("world", [2, 3])
def test_equal_lengths_pads_each_micro_batch_to_the_longest_of_its_index_on_any_rank(tmp_path, world):
    """What the all-gather expert exchange needs of a step (mlite.plan.policy.equal_micro_batch_lengths): the
    m-th micro-batch of every rank padded to the longest m-th micro-batch of any rank, by one ignored,
    marked sequence, the tokens of its own unchanged; unequal micro-batch counts refused on every rank.
    Every rank's share (`local_share`) carries the mark, zeros where it has no padding, so every rank's
    routers run the same code."""
    out = tmp_path / "lengths"
    launch(world, _equal_lengths_worker, str(out))
    longest = [5 + world - 1, 9]
    for rank in range(world):
        got = torch.load(f"{out}.{rank}", weights_only=False)
        own = [5 + rank, 9 - rank]
        for batch, n, total in zip(got["padded"], own, longest, strict=True):
            assert batch.num_tokens == total and sum(batch.host_lens) == total
            if total == n:  # the longest: its own tokens
                assert PADDING not in batch.extras
                continue
            assert batch.host_lens[-1] == total - n  # one padding sequence at the end
            assert torch.equal(batch.extras[PADDING], (torch.arange(total) >= n).float())
            assert (batch.labels[n:] == IGNORE).all() and batch.cu_seqlens[-1] == total
        for share, n in zip(got["shares"], own, strict=True):  # unpadded, marked as such
            assert torch.equal(share.extras[PADDING], torch.zeros(n))
        assert "micro-batches per step differ between ranks ([2, 3])" in got["refusal"]


def _forward_only_worker(rank, world, layout, out):
    from mlite.runtime.parallel.pipeline import PipelineRunner, forward_only

    mesh = ParallelDims(world, **layout).build("cpu")
    chunks = build_layout(False, mesh)
    dims = mesh.dims
    runner = PipelineRunner(
        chunks, dims.pp * dims.vpp, torch.distributed.get_process_group_ranks(mesh.group("pp")), "cpu"
    )
    batches = make_batches(4)
    with torch.no_grad():
        result = runner.run(forward_only(dims.pp, dims.vpp, mesh.rank_in("pp"), len(batches)), batches)
    if result["outputs"]:
        torch.save(result["outputs"], out)


@pytest.mark.parametrize("layout", [dict(pp=2), dict(pp=2, vpp=2)], ids=["pp2", "pp2+vpp2"])
def test_forward_only_pipeline_gives_the_one_process_hidden_states(tmp_path, layout):
    out = tmp_path / "hidden.pt"
    launch(2, _forward_only_worker, layout, str(out))
    got = torch.load(out)
    model = make_model(False)
    with torch.no_grad():
        for m, batch in enumerate(make_batches(4)):
            torch.testing.assert_close(got[m], model(batch).hidden, rtol=1e-5, atol=1e-6)
