"""The parallel layer's pure parts, without processes: layout checks, layer splits, schedules, zigzag split.

Schedules are checked by simulation: every rank runs its action list in order, one action per tick, an
action waiting until the actions it depends on have run (the forward of the previous chunk, the backward of
the next). A schedule that could deadlock stalls the simulation; forward-only passes must overlap stages.
"""

from __future__ import annotations

import pytest
import torch

from mlite.errors import MliteError
from mlite.runtime.data.packed import PackedBatch
from mlite.runtime.parallel.context import (
    SEQUENCE_ID,
    TOKEN_INDEX,
    split_for_context_parallel,
    zigzag_indices,
)
from mlite.runtime.parallel.mesh import ParallelDims
from mlite.runtime.parallel.pipeline import Action, forward_only, link_group, one_f_one_b, split_layers


# ----------------------------------------------------------------------------------------- layout
def test_dims_fold_experts_over_the_stage_ranks():
    dims = ParallelDims(8, pp=2, dp=2, tp=2, ep=2)
    assert (dims.edp, dims.dp_cp) == (2, 2)  # 4 ranks per stage = edp 2 x ep 2
    assert ParallelDims(8, dp=4, tp=2, ep=4).edp == 2


@pytest.mark.parametrize(
    "kwargs,words",
    [
        (dict(world_size=8, pp=2, dp=2, tp=3), "pp x dp x cp x tp must equal the world size"),
        (dict(world_size=4, dp=2, tp=2, ep=3), "ep x etp must divide dp x cp x tp"),
        (dict(world_size=4, dp=4, tp=0), "must be >= 1"),
    ],
)
def test_impossible_layouts_are_refused_with_every_degree_named(kwargs, words):
    with pytest.raises(MliteError, match=words) as err:
        ParallelDims(**kwargs)
    assert f"world={kwargs['world_size']}" in str(err.value) and "\n" not in str(err.value)


def test_from_job_derives_dp_and_refuses_a_world_it_cannot_split():
    from mlite.config import job_from_dict

    job = job_from_dict({"model": {"name": "tiny-qwen3"}, "parallel": {"tp": 2, "pp": 2}})
    assert ParallelDims.from_job(job, 8).dp == 2
    with pytest.raises(MliteError, match="world size 6 is not a multiple of pp x cp x tp = 4"):
        ParallelDims.from_job(job, 6)


# ---------------------------------------------------------------------------------- layer splits
def test_layers_split_evenly_or_with_explicit_first_and_last_stages():
    assert split_layers(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_layers(8, 2, vpp=2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert split_layers(10, 4, first=1, last=3) == [[0], [1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert split_layers(6, 3, first=0) == [[], [0, 1, 2], [3, 4, 5]]
    with pytest.raises(MliteError, match="do not split over pp=3"):
        split_layers(8, 3)


# ------------------------------------------------------------------------------------ schedules
def simulate(pp: int, vpp: int, micro_batches: int, make=one_f_one_b) -> int:
    """Ticks until every rank has run its actions; fails on a stall (a deadlock on real ranks)."""
    plans = [list(make(pp, vpp, r, micro_batches)) for r in range(pp)]
    last = pp * vpp - 1
    done: set = set()
    tick = 0
    while any(plans):
        ready = []
        for plan in plans:
            if not plan:
                continue
            a = plan[0]
            if a.kind == "F":
                needs = [Action("F", a.chunk - 1, a.micro_batch)] if a.chunk > 0 else []
            else:
                needs = [Action("F", a.chunk, a.micro_batch)]
                needs += [Action("B", a.chunk + 1, a.micro_batch)] if a.chunk < last else []
            if all(n in done for n in needs):
                ready.append(plan)
        assert ready, f"pp={pp} vpp={vpp} m={micro_batches}: stalled at tick {tick} (deadlock)"
        done.update(plan.pop(0) for plan in ready)
        tick += 1
    return tick


@pytest.mark.parametrize(
    "pp,vpp,m", [(2, 1, 1), (2, 1, 4), (4, 1, 3), (4, 1, 8), (2, 2, 4), (4, 2, 8), (3, 3, 6)]
)
def test_one_f_one_b_runs_every_micro_batch_once_and_never_stalls(pp, vpp, m):
    for rank in range(pp):
        actions = one_f_one_b(pp, vpp, rank, m)
        mine = {c for c in range(pp * vpp) if c % pp == rank}
        assert sorted((a.chunk, a.micro_batch) for a in actions if a.kind == "F") == sorted(
            (c, b) for c in mine for b in range(m)
        )
        assert sorted((a.chunk, a.micro_batch) for a in actions if a.kind == "B") == sorted(
            (c, b) for c in mine for b in range(m)
        )
    simulate(pp, vpp, m)


def test_one_f_one_b_bounds_the_activations_kept_in_flight():
    # the first stage keeps at most pp forwards ahead of its backwards (not all micro-batches, as GPipe)
    actions = one_f_one_b(4, 1, 0, 16)
    in_flight = peak = 0
    for a in actions:
        in_flight += 1 if a.kind == "F" else -1
        peak = max(peak, in_flight)
    assert peak == 4


def test_forward_only_keeps_all_stages_busy():
    pp, m = 4, 8
    # pipelined: m + pp - 1 ticks; running the stages one after another would take pp * m
    assert simulate(pp, 1, m, forward_only) == m + pp - 1
    assert simulate(2, 2, 4, forward_only) == 2 * 4 + 2 - 1


@pytest.mark.parametrize("pp,vpp,m", [(2, 1, 4), (4, 1, 8), (2, 2, 4), (4, 2, 8), (3, 3, 6)])
@pytest.mark.parametrize("make", [one_f_one_b, forward_only], ids=["1f1b", "forward-only"])
def test_every_pair_of_ranks_receives_in_the_order_it_was_sent(pp, vpp, m, make):
    # NCCL matches point-to-point messages by order, not tag: the runner relies on this property there
    last = pp * vpp - 1
    sent: dict = {}
    received: dict = {}
    for rank in range(pp):
        for a in make(pp, vpp, rank, m):
            c, b = a.chunk, a.micro_batch
            if a.kind == "F":
                if c != last:
                    sent.setdefault((rank, (c + 1) % pp), []).append(("F", c, b))
                if c > 0:
                    received.setdefault(((c - 1) % pp, rank), []).append(("F", c - 1, b))
            else:
                if c > 0:
                    sent.setdefault((rank, (c - 1) % pp), []).append(("B", c, b))
                if c != last:
                    received.setdefault(((c + 1) % pp, rank), []).append(("B", c + 1, b))
    assert sent == received


def simulate_nccl(pp: int, vpp: int, micro_batches: int, make, group_of) -> bool:
    """Run the schedules' point-to-point traffic under NCCL's rules, worst case. Each rank has one stream
    per (peer, process group), whose posts run in order; a send completes only while the peer's receive of
    it is running (a large message: NCCL's buffers do not hold it), so a send at a stream's head holds the
    posts behind it. `group_of(src, dst)` picks a message's group. The host posts an action's receive and
    waits for it, computes, then posts its send and goes on. True when every message arrives; False on a
    deadlock."""
    last = pp * vpp - 1
    plans = [make(pp, vpp, rank, micro_batches) for rank in range(pp)]
    streams: dict = {}  # (rank, peer, group) -> posts in order: [direction, message, done]
    done_actions = [0] * pp
    waiting: list = [None] * pp

    def post(rank, peer, direction, message):
        op = [direction, message, False]
        src, dst = (rank, peer) if direction == "send" else (peer, rank)
        streams.setdefault((rank, peer, group_of(src, dst)), []).append(op)
        return op

    while True:
        moved = False
        for rank, plan in enumerate(plans):
            if waiting[rank] is not None and not waiting[rank][2] or done_actions[rank] == len(plan):
                continue
            action = plan[done_actions[rank]]
            c, m = action.chunk, action.micro_batch
            source = (c - 1 if c > 0 else None) if action.kind == "F" else (c + 1 if c < last else None)
            target = (c + 1 if c < last else None) if action.kind == "F" else (c - 1 if c > 0 else None)
            if source is not None and waiting[rank] is None:
                waiting[rank] = post(rank, source % pp, "recv", (action.kind, source, m))
                moved = True
                continue
            waiting[rank] = None
            if target is not None:
                post(rank, target % pp, "send", (action.kind, c, m))
            done_actions[rank] += 1
            moved = True
        for (rank, peer, group), posts in streams.items():
            theirs = streams.get((peer, rank, group), [])
            if posts and theirs and not posts[0][2] and posts[0][1] == theirs[0][1] and \
                    {posts[0][0], theirs[0][0]} == {"send", "recv"}:
                posts[0][2] = theirs[0][2] = moved = True
        for posts in streams.values():
            while posts and posts[0][2]:
                posts.pop(0)
        if not moved:
            return all(n == len(plan) for n, plan in zip(done_actions, plans)) and not any(streams.values())


@pytest.mark.parametrize("pp,vpp,m", [(2, 1, 1), (2, 1, 4), (4, 1, 3), (4, 1, 8), (2, 2, 4), (4, 2, 8),
                                      (3, 3, 6), (3, 1, 5)])
@pytest.mark.parametrize("make", [one_f_one_b, forward_only], ids=["1f1b", "forward-only"])
def test_the_schedules_run_on_nccls_in_order_streams_with_large_messages(pp, vpp, m, make):
    """Each direction of a pair of ranks on its own process group (`link_group`): every stream carries one
    direction in the order its peer receives, and the schedules finish under NCCL's rules (simulate_nccl).
    Over one group, 1F1B's neighbours, which send to each other before each receives, deadlock there for
    every schedule with a steady state (the GPU suite's tiny activations fitted NCCL's buffers and never
    showed it)."""
    assert simulate_nccl(pp, vpp, m, make, link_group)
    if make is one_f_one_b and m > 1:
        assert not simulate_nccl(pp, vpp, m, make, lambda src, dst: 0)


def test_interleaving_needs_whole_rounds_of_micro_batches():
    with pytest.raises(MliteError, match="multiple of pp=2"):
        one_f_one_b(2, 2, 0, 3)


# --------------------------------------------------------------------------------- context split
def test_zigzag_gives_each_rank_an_early_and_a_late_chunk():
    assert zigzag_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    with pytest.raises(MliteError, match="pad each micro-batch to a multiple of 4 tokens"):
        zigzag_indices(10, 2, 0)


def test_context_split_keeps_positions_labels_and_sequence_of_every_token():
    batch = PackedBatch.from_sequences([[1, 2, 3], [4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]])
    shares = [split_for_context_parallel(batch, 2, r) for r in range(2)]
    index = torch.cat([s.extras[TOKEN_INDEX] for s in shares])
    assert sorted(index.tolist()) == list(range(16))
    for s in shares:  # every field follows its token, including sequence boundaries inside a chunk
        keep = s.extras[TOKEN_INDEX]
        assert torch.equal(s.input_ids, batch.input_ids[keep])
        assert torch.equal(s.position_ids, batch.position_ids[keep])
        assert torch.equal(s.labels, batch.labels[keep])
        assert torch.equal(s.extras[SEQUENCE_ID], batch.sequence_ids()[keep])


# ------------------------------------------------------------------------------- model vs layout
@pytest.mark.parametrize(
    "preset,parallel,world,words",
    [
        ("tiny-qwen3", {"pp": 2}, 2, "tied embeddings \\(tie_word_embeddings\\) with pp=2"),
        ("tiny-qwen3-moe", {"tp": 4}, 4, "2 KV heads, not divisible by tp=4"),
        ("tiny-qwen3-moe", {"etp": 2}, 2, "etp"),
    ],
)
def test_what_the_layouts_cannot_do_yet_is_refused_before_any_group_exists(preset, parallel, world, words):
    """The runtime asks the rule book (mlite.plan.rules) before it starts a process group or builds a
    model."""
    from mlite.config import job_from_dict
    from mlite.config.catalog import preset_arch
    from mlite.plan.rules import check_job

    def job(name, degrees):
        return job_from_dict({"model": {"name": name}, "parallel": degrees, "data": {"seq_len": 512},
                              "cluster": {"gpu": "cpu"}, "trainer": {"device": "cpu"}})

    with pytest.raises(MliteError, match=words):
        check_job(job(preset, parallel), preset_arch(preset), world, "cpu", False)
    # good
    check_job(job("tiny-qwen3-moe", {"tp": 2, "ep": 2}), preset_arch("tiny-qwen3-moe"), 2, "cpu", False)
    check_job(job("tiny-qwen3", {}), preset_arch("tiny-qwen3"), 2, "cpu", False)  # tied: one FSDP2 unit
    check_job(job("tiny-qwen3", {"tp": 2}), preset_arch("tiny-qwen3"), 2, "cpu", False)  # tied: one DTensor


def test_expert_parallel_block_permutation_regroups_rows_by_expert_on_the_device():
    """Received rows come grouped (source rank, local expert); the permutation lists them grouped (local
    expert, source rank), each block's rows in order, empty blocks included, without reading the counts."""
    from mlite.runtime.parallel.expert import _block_permutation

    g = torch.Generator().manual_seed(0)
    for a, b in ((1, 1), (2, 3), (4, 8)):
        counts = torch.randint(0, 4, (a, b), generator=g)
        counts[0, 0] = 0
        starts = (torch.cumsum(counts.reshape(-1), 0) - counts.reshape(-1)).view(a, b).tolist()
        want = [starts[i][j] + k for j in range(b) for i in range(a) for k in range(int(counts[i, j]))]
        assert _block_permutation(counts, int(counts.sum())).tolist() == want
