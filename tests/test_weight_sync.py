"""Rank-local weight sync (mlite.runtime.ckpt.sync): under tp2, ep2 (with dp2), pp2 and fsdp2 dp2, on tiny
dense and MoE Qwen3 models and DeepSeek-V4, every HF tensor of the model arrives exactly once over the two
ranks (each element once, the right shape, dtype and values: those of the same model on one process), each
rank sends only what it holds and talks to no one while it does, and a consumer with its own
tensor-parallel degree re-cuts the pieces into its shards.

All layouts run in one launch of two gloo ranks (one Runtime after another), so the file costs one spawn.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file

from mlite.config import job_from_dict
from mlite.config.catalog import PRESETS
from mlite.errors import MliteError
from mlite.runtime.ckpt import sync
from mlite.runtime.ckpt.hf import iter_hf_weights

DTYPE = torch.bfloat16  # the rollout's dtype: float tensors arrive in it, integer buffers as they are

MODELS = {  # untied dense (pipeline stages split embedding and head), tied dense, MoE, DeepSeek-V4
    "dense": {**PRESETS["tiny-qwen3"], "tie_word_embeddings": False},
    "tied": PRESETS["tiny-qwen3"],
    "moe": PRESETS["tiny-qwen3-moe"],
    "v4": PRESETS["tiny-deepseek-v4"],
}
LAYOUTS = {
    "dense-tp2": ("dense", {"tp": 2}),
    "dense-pp2": ("dense", {"pp": 2}),
    "tied-fsdp2-dp2": ("tied", {}),
    "moe-ep2-dp2": ("moe", {"ep": 2}),
    "moe-tp2": ("moe", {"tp": 2}),
    "moe-pp2": ("moe", {"pp": 2}),
    "v4-ep2-dp2": ("v4", {"ep": 2}),
}
EXPORTED = "moe-pp2"  # also written as an HF checkpoint by rank 0 (export_hf), pipeline stages and all


def job(root: Path, model: str, layout: dict) -> dict:
    extra = {"mtp_loss_weight": 0.3} if model == "v4" else {}  # with V4's multi-token-prediction block
    return {"model": {"path": str(root / model), "load_weights": False, **extra}, "parallel": layout,
            "data": {"seq_len": 64}, "cluster": {"gpu": "cpu"}, "precision": {"compute": "fp32"},
            "trainer": {"device": "cpu", "seed": 5}}


class _Strided(torch.nn.Module):
    """Shards with holes: an expert stack and a matrix cut by _StridedShard (how FSDP2 over a tensor-parallel
    dim lays them out), so a rank holds experts {0, 2} or {1, 3}, and every other pair of matrix columns."""

    def __init__(self, mesh=None):
        super().__init__()
        from torch.distributed.tensor import distribute_tensor
        from torch.distributed.tensor.placement_types import _StridedShard

        for name, value in _strided_values().items():
            if mesh is not None:
                dim = 0 if name == "gate_up" else 1
                value = distribute_tensor(value, mesh, [_StridedShard(dim, split_factor=2)])
            self.register_parameter(name, torch.nn.Parameter(value))

    def hf_layout(self):
        from mlite.runtime.models.base import HFTensors, same_tensor

        names = [f"experts.{e}.{p}.weight" for e in range(4) for p in ("gate_proj", "up_proj")]
        return [HFTensors("gate_up", names, split=lambda t: [h for x in t for h in x.chunk(2, dim=0)],
                          join=None),
                same_tensor("matrix.weight", "matrix")]


def _strided_values() -> dict[str, torch.Tensor]:
    return {"gate_up": torch.arange(4 * 6 * 3.0).view(4, 6, 3), "matrix": torch.arange(3 * 8.0).view(3, 8)}


def _no_communication():
    """While a rank streams its pieces (the plan made), nothing may gather or talk to another rank."""
    stack = ExitStack()

    def refuse(*_args, **_kwargs):
        raise AssertionError("weight_shards communicated while streaming")

    from torch.distributed.tensor import DTensor

    stack.enter_context(mock.patch.object(DTensor, "full_tensor", refuse))
    stack.enter_context(mock.patch.object(DTensor, "redistribute", refuse))
    for name in ("all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast", "all_reduce",
                 "send", "recv", "gather", "scatter", "reduce_scatter_tensor", "all_to_all_single"):
        stack.enter_context(mock.patch.object(torch.distributed, name, refuse))
    return stack


def _held_bytes(models) -> int:
    """What this rank stores of the model (its local shards), counted in the rollout dtype."""
    from torch.distributed.tensor import DTensor

    held = {}
    for m in models:
        for name, t in [*m.named_parameters(), *m.named_buffers()]:
            local = t.to_local() if isinstance(t, DTensor) else t
            size = DTYPE.itemsize if local.is_floating_point() else local.element_size()
            held[name] = local.numel() * size
    return sum(held.values())


def _worker(rank, world, root):
    from mlite.runtime.engine import Runtime

    root, result = Path(root), {}
    for label, (model, layout) in LAYOUTS.items():
        rt = Runtime(job_from_dict(job(root, model, layout)))
        models = rt.held_models()
        sync.sync_plan(models)  # the one collective: who sends what
        with _no_communication():
            shards = [(s.name, s.tensor.clone(), s.offsets, s.shape) for s in rt.weight_shards(DTYPE)]
        steps = [(name, shape, dtype, [(p.offsets, tuple(p.tensor.shape)) for p in pieces])
                 for name, shape, dtype, pieces in sync.lockstep_shards(models, DTYPE)]
        result[label] = {"shards": shards, "held": _held_bytes(models), "lockstep": steps}
        for consumer_tp in (1, 2):  # one engine per rank, or one engine over both ranks
            # the stream as the runtime sends it, then in buckets of one tensor each, counting the
            # point-to-point batches of each (the real calls, counted on their way through)
            batches: list[int] = []
            real = torch.distributed.batch_isend_irecv
            torch.distributed.batch_isend_irecv = lambda ops: batches.append(len(ops)) or real(ops)
            try:
                stats: dict = {}
                result[label][f"engine-tp{consumer_tp}"] = (
                    [(name, t.clone()) for name, t in rt.tp_group_weights(DTYPE, consumer_tp, stats)], stats,
                    list(batches))
                batches.clear()
                one: dict = {}
                stream = [(name, t.clone()) for name, t in sync.tp_group_weights(
                    models, DTYPE, consumer_tp, rt.arch.num_kv_heads, one, bucket_bytes=0)]
                result[label][f"engine-tp{consumer_tp}-per-tensor"] = (stream, one, list(batches))
            finally:
                torch.distributed.batch_isend_irecv = real
        if rt.arch.moe is not None:  # one engine over both ranks, expert parallel: whole experts per rank
            stats = {}
            result[label]["engine-ep2"] = ([(name, t.clone()) for name, t in rt.tp_group_weights(
                DTYPE, 2, stats, expert_parallel=True)], stats)
        if label == EXPORTED:
            sync.export_hf(models, rt.arch, root / "export", dtype=DTYPE)
    from torch.distributed.device_mesh import init_device_mesh

    strided = _Strided(init_device_mesh("cpu", (world,)))
    result["strided"] = {"shards": [(s.name, s.tensor, s.offsets, s.shape) for s in
                                    sync.weight_shards(strided, DTYPE)], "held": _held_bytes([strided])}
    torch.save(result, root / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Both ranks' pieces of every layout, and each model's HF tensors on one process: built whole on the
    host and initialised from the same seed (mlite.runtime.models.seeded_init), as every layout starts."""
    from parallel_harness import launch

    from mlite.config.arch import arch_from_hf_config
    from mlite.runtime.models import build_model, seeded_init

    root = tmp_path_factory.mktemp("sync")
    for name, config in MODELS.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
    reference = {}
    for name, config in MODELS.items():
        spec = job_from_dict(job(root, name, {}))
        model = build_model(arch_from_hf_config(config), "torch", init=False,
                            mtp_weight=spec.model.mtp_loss_weight,
                            indexer_loss_weight=spec.model.indexer_loss_weight)
        seeded_init(model, spec.trainer.seed)
        reference[name] = {k: v.clone() for k, v in iter_hf_weights(model)}
    launch(2, _worker, str(root))
    ranks = [torch.load(root / f"rank{r}.pt") for r in range(2)]
    return root, reference, ranks


def _expected(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(DTYPE) if tensor.is_floating_point() else tensor


def _want(reference, label) -> dict[str, torch.Tensor]:
    if label == "strided":
        return dict(iter_hf_weights(_Strided()))
    return reference[LAYOUTS[label][0]]


@pytest.mark.parametrize("label", [*LAYOUTS, "strided"])
def test_every_hf_tensor_arrives_exactly_once(run, label):
    """The consumer: each piece has the right name, full shape, dtype and values; the pieces of the two
    ranks cover every element of every HF tensor exactly once; nothing extra arrives."""
    _, reference, ranks = run
    want = _want(reference, label)
    count = {name: torch.zeros(t.shape, dtype=torch.int32) for name, t in want.items()}
    for result in ranks:
        for name, piece, offsets, shape in result[label]["shards"]:
            assert name in want, f"{label}: {name} is not an HF tensor of the model"
            full = _expected(want[name])
            assert shape == tuple(full.shape) and piece.dtype == full.dtype, name
            where = tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))
            assert torch.equal(piece, full[where]), f"{label}: {name}{list(offsets)} has other values"
            count[name][where] += 1
    for name, c in count.items():
        assert bool((c == 1).all()), f"{label}: {name}: elements arrive {c.min()}..{c.max()} times"


@pytest.mark.parametrize("label", [*LAYOUTS, "strided"])
def test_each_rank_sends_only_its_share(run, label):
    """The bytes sent over the world add up to the model once; no rank sends more than it holds, and where
    the layout shards every tensor each rank sends less than the whole model."""
    _, reference, ranks = run
    want = [_expected(t) for t in _want(reference, label).values()]
    model = sum(t.numel() * t.element_size() for t in want)
    sent = [sum(p.numel() * p.element_size() for _, p, _, _ in r[label]["shards"]) for r in ranks]
    assert sum(sent) == model
    for rank, (bytes_, result) in enumerate(zip(sent, ranks)):
        held = result[label]["held"]
        assert 0 < bytes_ <= held, f"{label}: rank {rank} sends {bytes_} bytes, holds {held}"
        assert bytes_ < model


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_lockstep_order_is_the_same_on_every_rank(run, label):
    """verl's sharded sync pairs collectives per tensor: every rank lists every HF tensor of the whole
    model, in one order, with the pieces it sends of it (the same ones weight_shards yields)."""
    _, reference, ranks = run
    steps = [[(name, shape, dtype) for name, shape, dtype, _ in r[label]["lockstep"]] for r in ranks]
    assert steps[0] == steps[1]
    assert sorted(name for name, _, _ in steps[0]) == sorted(reference[LAYOUTS[label][0]])
    for result in ranks:
        listed = sorted((name, offsets, size) for name, _, _, pieces in result[label]["lockstep"]
                        for offsets, size in pieces)
        sent = result[label]["shards"]
        assert listed == sorted((name, offsets, tuple(p.shape)) for name, p, offsets, _ in sent)


def test_export_under_pipeline_parallel_is_the_model(run):
    """export_hf: rank 0 writes the HF checkpoint from the pieces both stages send it."""
    root, reference, _ = run
    written = load_file(str(root / "export" / "model.safetensors"))
    want = reference[LAYOUTS[EXPORTED][0]]
    assert sorted(written) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(written[name], _expected(tensor)), name


@pytest.mark.parametrize("label", ["dense-tp2", "moe-tp2", "v4-ep2-dp2"])
@pytest.mark.parametrize("consumer_tp", [1, 2, 4])
def test_a_consumer_recuts_the_pieces_for_its_own_tensor_parallel_degree(run, label, consumer_tp):
    """vLLM at tp=N: each consumer rank takes, from the union of both producer ranks' pieces, its slab of
    each tensor along the tensor's split dim (columns of q/k/v/gate/up and the vocabulary, rows of o/down);
    what it holds whole it assembles."""
    _, reference, ranks = run
    pieces: dict[str, list] = {}
    for result in ranks:
        for name, piece, offsets, shape in result[label]["shards"]:
            pieces.setdefault(name, []).append(sync.WeightShard(name, piece, offsets, shape))
    split = 0
    for name, full in reference[LAYOUTS[label][0]].items():
        dim = sync.vllm_split_dim(name)
        if dim is None or full.shape[dim] % consumer_tp:
            assert torch.equal(sync.assemble(pieces[name]), _expected(full)), name
            continue
        split += 1
        for r in range(consumer_tp):
            got = sync.recut(pieces[name], dim, consumer_tp, r)
            assert torch.equal(got, _expected(full).chunk(consumer_tp, dim)[r]), (name, r)
    assert split > 0


@pytest.mark.parametrize("label", list(LAYOUTS))
@pytest.mark.parametrize("consumer_tp", [1, 2])
def test_a_tensor_parallel_engine_over_the_ranks_gets_its_slabs(run, label, consumer_tp):
    """vLLM over the training ranks (each rank tensor-parallel rank r % tp of an engine): every rank sees
    every HF tensor in one order, full-shaped, its slab equal to the model's and the rest NaN; it got from
    other ranks only what its slab needs and it does not hold."""
    _, reference, ranks = run
    want = reference[LAYOUTS[label][0]]
    arch_kv = MODELS[LAYOUTS[label][0]].get("num_key_value_heads")
    streams = [r[label][f"engine-tp{consumer_tp}"][:2] for r in ranks]
    assert [n for n, _ in streams[0][0]] == [n for n, _ in streams[1][0]]
    assert sorted(n for n, _ in streams[0][0]) == sorted(want)
    cut = 0
    for rank, (stream, stats) in enumerate(streams):
        kept = 0
        for name, got in stream:
            full = _expected(want[name])
            assert got.shape == full.shape and got.dtype == full.dtype, name
            slab = sync.consumer_slab(name, tuple(full.shape), consumer_tp, rank % consumer_tp, arch_kv)
            inside = [slice(None)] * full.dim()
            if slab is not None:
                dim, lo, hi = slab
                inside[dim] = slice(lo, hi)
                outside = torch.ones(full.shape, dtype=torch.bool)
                outside[tuple(inside)] = False
                assert bool(got[outside].isnan().all()), f"{label}: {name}: values outside rank {rank}'s slab"
                cut += 1
            assert torch.equal(got[tuple(inside)], full[tuple(inside)]), f"{label}: {name} on rank {rank}"
            kept += got[tuple(inside)].numel() * got.element_size()
        assert stats["tensors"] == len(want) and stats["bytes"] == kept
        # what came over the wire is at most the slabs less what the rank holds itself
        assert stats["received_bytes"] <= kept
    assert (cut > 0) == (consumer_tp > 1)
    if label == "dense-tp2" and consumer_tp == 2:
        # the engine's tensor-parallel slabs are the training tp shards, norms are on both: nothing travels
        assert [stats["received_bytes"] for _, stats in streams] == [0, 0]


@pytest.mark.parametrize("label", list(LAYOUTS))
@pytest.mark.parametrize("consumer_tp", [1, 2])
def test_the_stream_moves_in_buckets_with_one_batch_each(run, label, consumer_tp):
    """The sync sends its point-to-point parts in one batch per bucket of tensors (SYNC_BUCKET_BYTES: one
    bucket for a tiny model), not one per tensor, and yields exactly what one tensor at a time yields."""
    _, _, ranks = run
    for rank in ranks:
        bucketed, stats, batches = rank[label][f"engine-tp{consumer_tp}"]
        per_tensor, one, one_batches = rank[label][f"engine-tp{consumer_tp}-per-tensor"]
        assert [n for n, _ in bucketed] == [n for n, _ in per_tensor]
        for (name, a), (_, b) in zip(bucketed, per_tensor):
            assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), name  # NaN too
        assert stats["buckets"] == 1 and one["buckets"] == one["tensors"] == stats["tensors"]
        assert {k: v for k, v in one.items() if k != "buckets"} == {
            k: v for k, v in stats.items() if k != "buckets"}
        # the same point-to-point parts, in one batch instead of one per tensor that moves any
        assert sum(batches) == sum(one_batches) and len(batches) == (1 if one_batches else 0)
        if label != "dense-tp2" or consumer_tp != 2:  # there nothing travels (the slabs are the tp shards)
            assert len(one_batches) > 1


@pytest.mark.parametrize("label", [label for label, (model, _) in LAYOUTS.items() if model in ("moe", "v4")])
def test_an_expert_parallel_engine_gets_whole_experts_on_the_rank_that_holds_them(run, label):
    """vLLM's expert parallel over an engine of 2 ranks: each routed expert's tensors arrive whole on the
    rank vLLM places it on (linear placement) and nowhere else (NaN there, nothing sent for it); the other
    tensors are cut as for tensor parallel."""
    _, reference, ranks = run
    model = LAYOUTS[label][0]
    want = reference[model]
    experts = MODELS[model].get("num_experts") or MODELS[model].get("n_routed_experts")
    arch_kv = MODELS[model].get("num_key_value_heads")
    whole_experts = 0
    for rank, got in enumerate(r[label]["engine-ep2"][0] for r in ranks):
        assert sorted(n for n, _ in got) == sorted(want)
        mine = sync.expert_parallel_experts(experts, 2, rank)
        for name, tensor in got:
            full = _expected(want[name])
            expert = re.search(r"(?:^|\.)experts\.(\d+)\.", name)
            if expert is None:  # cut as for tensor parallel
                slab = sync.consumer_slab(name, tuple(full.shape), 2, rank, arch_kv)
                inside = [slice(None)] * full.dim()
                if slab is not None:
                    inside[slab[0]] = slice(slab[1], slab[2])
                assert torch.equal(tensor[tuple(inside)], full[tuple(inside)]), (name, rank)
            elif int(expert.group(1)) in mine:
                assert torch.equal(tensor, full), (name, rank)
                whole_experts += 1
            else:
                assert bool(tensor.isnan().all()), (name, rank)
    assert whole_experts == sum(1 for name in want if re.search(r"(?:^|\.)experts\.\d+\.", name))


def test_expert_parallel_placement_is_vllms_linear_one():
    """vLLM 0.25.1's default placement (determine_expert_map, "linear"): consecutive experts, the first
    num_experts % ranks ranks one more."""
    placed = [list(sync.expert_parallel_experts(8, 4, r)) for r in range(4)]
    assert placed == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [list(sync.expert_parallel_experts(10, 4, r)) for r in range(4)] == [
        [0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    name = "model.layers.3.mlp.experts.5.down_proj.weight"
    assert sync.consumer_slab(name, (64, 32), 2, 1, None, num_experts=8) is None  # expert 5 is rank 1's
    assert sync.consumer_slab(name, (64, 32), 2, 0, None, num_experts=8) == (0, 0, 0)  # nothing for rank 0
    shared = "layers.3.ffn.shared_experts.w2.weight"  # not a routed expert: cut as tensor parallel
    assert sync.consumer_slab(shared, (64, 32), 2, 0, None, num_experts=8) == sync.consumer_slab(
        shared, (64, 32), 2, 0, None)


def test_split_dims_and_padded_slabs():
    attn = "model.layers.0.self_attn"
    assert [sync.vllm_split_dim(f"{attn}.{p}.weight") for p in ("q_proj", "o_proj")] == [0, 1]
    assert sync.vllm_split_dim("model.layers.0.mlp.experts.3.down_proj.weight") == 1
    assert sync.vllm_split_dim("layers.1.ffn.experts.0.w3.weight") == 0
    assert sync.vllm_split_dim("model.layers.0.self_attn.o_proj.bias") is None  # added once, after the sum
    assert sync.vllm_split_dim("model.layers.0.mlp.gate.weight") is None  # the router: whole on each rank
    assert sync.vllm_split_dim("model.norm.weight") is None
    # vLLM pads the vocabulary to a multiple of 64 before splitting it: the last slab is short
    slabs = [sync.tp_slab(250, 4, r, pad_to=64) for r in range(4)]
    assert slabs == [(0, 64), (64, 128), (128, 192), (192, 250)]
    with pytest.raises(MliteError, match="does not split evenly 3 ways"):
        sync.tp_slab(64, 3, 0)


def test_consumer_slabs_follow_vllms_cuts():
    """What each rank of a vLLM engine at tp 4 reads: q columns by rank, KV heads shared where there are
    fewer than the ranks (2 heads of 8: ranks 0-1 read head 0, ranks 2-3 head 1), o rows, the padded
    vocabulary, norms whole; one rank per engine reads everything."""
    attn, head_dim = "model.layers.0.self_attn", 8
    q = [sync.consumer_slab(f"{attn}.q_proj.weight", (64, 32), 4, r, kv_heads=2) for r in range(4)]
    assert q == [(0, 0, 16), (0, 16, 32), (0, 32, 48), (0, 48, 64)]
    k = [sync.consumer_slab(f"{attn}.k_proj.weight", (2 * head_dim, 32), 4, r, kv_heads=2) for r in range(4)]
    assert k == [(0, 0, 8), (0, 0, 8), (0, 8, 16), (0, 8, 16)]
    v = [sync.consumer_slab(f"{attn}.v_proj.weight", (4 * head_dim, 32), 4, r, kv_heads=4) for r in range(4)]
    assert v == [(0, 0, 8), (0, 8, 16), (0, 16, 24), (0, 24, 32)]
    assert sync.consumer_slab(f"{attn}.o_proj.weight", (32, 64), 4, 3) == (1, 48, 64)
    assert sync.consumer_slab("lm_head.weight", (250, 32), 4, 3) == (0, 192, 250)
    assert sync.consumer_slab("model.norm.weight", (32,), 4, 1) is None
    assert sync.consumer_slab(f"{attn}.q_proj.weight", (64, 32), 1, 0) is None


def test_recut_refuses_a_missing_or_doubled_element():
    full = torch.arange(24.0).view(4, 6)
    top = sync.WeightShard("w", full[:2], (0, 0), (4, 6))
    bottom = sync.WeightShard("w", full[2:], (2, 0), (4, 6))
    assert torch.equal(sync.recut([bottom, top], 1, 2, 1), full[:, 3:])
    with pytest.raises(MliteError, match="6 elements of rank 1's shard are missing"):
        sync.recut([top], 1, 2, 1)
    with pytest.raises(MliteError, match="arrived twice"):
        sync.recut([top, top, bottom])


def test_one_process_sends_every_tensor_whole():
    """Without a process group the one rank sends each HF tensor whole: what export_weights streams."""
    from mlite.runtime.engine import Runtime

    rt = Runtime(job_from_dict({"model": {"name": "tiny-qwen3-moe"}, "data": {"seq_len": 64},
                                "cluster": {"gpu": "cpu"}, "trainer": {"device": "cpu"}}))
    whole = dict(rt.export_weights(DTYPE))
    shards = list(rt.weight_shards(DTYPE))
    assert [s.name for s in shards] == list(whole)
    for s in shards:
        assert s.offsets == (0,) * len(s.shape) and torch.equal(s.tensor, whole[s.name]), s.name
    # what a one-GPU vLLM engine loads: the same tensors, whole, in the same order
    stats: dict = {}
    streamed = list(rt.tp_group_weights(DTYPE, 1, stats))
    assert [name for name, _ in streamed] == list(whole)
    assert all(torch.equal(tensor, whole[name]) for name, tensor in streamed)
    assert stats == {"tensors": len(whole), "received_bytes": 0, "buckets": 1,
                     "bytes": sum(t.numel() * t.element_size() for t in whole.values())}
