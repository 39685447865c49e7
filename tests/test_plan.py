"""Planner: the published layouts come out valid and fitting (or, where the trainers refuse them, sized with
the trainers' refusal), each invalid job is refused with its reason and fix, the memory items follow the
formulas in docs/PLANNER.md, and recommendations are valid, trained, fitting and sorted by cost."""

from __future__ import annotations

import re

import pytest

from mlite.config import load_job
from mlite.config.catalog import count_params, preset_arch
from mlite.errors import MliteError
from mlite.plan import check_layout, plan_job
from mlite.plan.memory import GIB, HEADROOM, gpu_overhead_gb, stage_params
from mlite.plan.policy import SYNC_BUCKET_BYTES
from mlite.plan.recommend import recommend
from mlite.plan.rules import split_chunks


def items(plan) -> dict[str, float]:
    return {i.name: i.gb for i in plan.memory.items}


def sized(preset: str, overrides: list[str] = ()):
    """The plan of a job whose layout is valid, whether or not the trainers run it (`plan.refused` says)."""
    return plan_job(load_job(preset, list(overrides)), size_refused=True)


# ------------------------------------------------------------------------------------ published layouts
NO_V3 = r"deepseek-v3 \(model_type 'deepseek_v3'\) has no native model yet"
DIST_OPT = r"offload[.]\* with optimizer[.]backend dist_opt: Megatron-Core's optimizer offload is not wired"


@pytest.mark.parametrize("preset, world, dp, edp, layers, refused", [
    ("deepseek_v3_sft", 96, 1, 1, [6] + [5] * 11, NO_V3),
    ("qwen3_235b_a22b_sft", 32, 1, 1, [11] + [12] * 6 + [11], None),
    ("qwen3_30b_a3b_sft", 8, 8, 1, [48], None),
    ("deepseek_v4_flash_sft", 128, 8, 4, [11, 11, 11, 10], None),
])
def test_published_layouts_are_valid_and_fit(preset, world, dp, edp, layers, refused):
    """Every published layout is valid and fits by design; the trainers run the Qwen3 ones (no native
    DeepSeek model yet), and for the others the planner's verdict is theirs."""
    plan = sized(preset)
    assert (plan.layout.world, plan.layout.dp, plan.layout.edp) == (world, dp, edp)
    assert [len(s) for s in plan.layout.stage_layers] == layers
    assert plan.memory.fits, plan.memory.as_dict()
    assert plan.memory.total_gb <= plan.memory.capacity_gb * HEADROOM
    if refused is None:
        assert plan.refused is None and plan_job(load_job(preset)).memory.fits
    else:
        assert re.match(refused, plan.refused), plan.refused
        with pytest.raises(MliteError, match=refused):
            plan_job(load_job(preset))  # the verdict: the trainers refuse it at start-up


@pytest.mark.parametrize("preset, overrides", [
    ("deepseek_v4_flash_grpo", ["rollout.engine=builtin", "rollout.tp=1"]),
    ("qwen3_30b_a3b_sft", ["job=grpo"]),
])
def test_grpo_at_scale_does_not_fit_the_builtin_rollouts_whole_model_replica(preset, overrides):
    """The built-in rollout on several ranks decodes with a plain fp32 replica of the whole model on every
    rank (Runtime.rollout_model): the training step of the GRPO templates fits, their rollout cannot, and the
    plan says why. One process decodes with the model itself: no replica."""
    plan = sized(preset, overrides)
    assert plan.layout.world > 1 and plan.memory.train_gb <= plan.memory.usable_gb
    rollout = {i.name: i.gb for i in plan.memory.rollout_items}
    assert rollout["rollout replica"] == pytest.approx(4 * count_params(plan.arch).total / GIB)
    assert not plan.memory.fits and plan.memory.rollout_gb > plan.memory.usable_gb
    assert any("replicates the whole model on every rank" in note for note in plan.memory.notes)
    one = sized("demo_grpo")
    assert one.memory.fits and "rollout replica" not in {i.name for i in one.memory.rollout_items}


def test_vllm_rollout_fits_where_its_share_holds_its_slab_of_the_weights():
    """GRPO at scale on vLLM over the ranks: the trainer's resident state plus vLLM's share of each GPU, no
    replica. vLLM's weights at rollout.tp must fit its share: beyond it vLLM cannot start, whatever the
    total says."""
    vllm = ["job=grpo", "rollout.engine=vllm"]
    ok = sized("qwen3_30b_a3b_sft", [*vllm, "rollout.tp=4", "rollout.gpu_memory_utilization=0.3"])
    rollout = {i.name: i.gb for i in ok.memory.rollout_items}
    assert ok.memory.fits and "rollout replica" not in rollout
    assert rollout["vLLM (weights + KV cache)"] == pytest.approx(0.3 * ok.memory.capacity_gb)
    (how,) = [i.note for i in ok.memory.rollout_items if i.name.startswith("vLLM")]
    weights = count_params(ok.arch).total * 2 / 4 / GIB  # bf16, a quarter per GPU
    assert f"2 engine(s) of rollout.tp=4, {weights:.1f} GB of weights per GPU" in how
    short = sized("qwen3_235b_a22b_sft", [*vllm, "rollout.tp=8", "rollout.gpu_memory_utilization=0.3"])
    assert short.memory.total_gb <= short.memory.usable_gb and not short.memory.fits
    assert any("vLLM needs" in note and "rollout.tp=8" in note for note in short.memory.notes)
    with pytest.raises(MliteError, match="rollout.tp=16 spans 2 nodes of 8 GPUs: vLLM's tensor-parallel"):
        sized("qwen3_235b_a22b_sft", [*vllm, "rollout.tp=16", "rollout.gpu_memory_utilization=0.4"])
    wider = sized("qwen3_235b_a22b_sft", [*vllm, "rollout.tp=16", "rollout.gpu_memory_utilization=0.4",
                                          "rollout.span_nodes=true"])  # asked for: sized, with a note
    assert wider.memory.fits
    assert any("rollout.tp=16 spans 2 nodes of 8 GPUs" in note for note in wider.memory.notes)
    assert not any("spans" in note for note in ok.memory.notes)


def test_deepseek_v3_does_not_fit_without_offload():
    plan = sized("deepseek_v3_sft", ["offload.optimizer=false", "offload.optimizer_fraction=null"])
    assert not plan.memory.fits
    # Adam 8 B vs bf16 2 B, dp=1
    assert items(plan)["optimizer state"] == pytest.approx(4 * items(plan)["weights"])


def test_offload_moves_optimizer_state_to_host_by_fraction():
    dist_opt = ["optimizer.backend=dist_opt"]  # its design: fp32 master + Adam state, all offloaded
    full = sized("qwen3_235b_a22b_sft", dist_opt)
    half = sized("qwen3_235b_a22b_sft", [*dist_opt, "offload.optimizer_fraction=0.5"])
    none = sized("qwen3_235b_a22b_sft", [*dist_opt, "offload.optimizer=false"])
    assert items(full)["optimizer state"] == 0
    assert items(half)["optimizer state"] == pytest.approx(items(none)["optimizer state"] / 2)
    host_full, host_half, host_none = (next(i.gb for i in p.memory.host_items if i.name == "offloaded state")
                                       for p in (full, half, none))
    assert host_none == 0 and host_half == pytest.approx(host_full / 2, rel=1e-6)
    # state of 8 ranks of the fullest stage: (fp32 master + Adam m, v) = 12 bytes per parameter on each
    sp = max((stage_params(full.arch, full.layout, s) for s in range(8)), key=lambda p: p.dense + p.experts)
    assert host_full == pytest.approx(8 * 12 * (sp.dense + sp.experts) / GIB, rel=1e-6)


def test_fsdp2_shards_state_over_dp_cp_and_edp():
    plan = sized("deepseek_v4_flash_sft")
    sp = stage_params(plan.arch, plan.layout, plan.memory.stage)
    expected = (sp.dense / 32 + sp.experts / 4) * 8 / GIB  # Adam m, v over dp x cp = 32 and edp = 4
    assert items(plan)["optimizer state"] == pytest.approx(expected)
    assert items(plan)["master weights"] == pytest.approx(expected / 2)


def test_fsdp_unit_layers_holds_that_many_layers_gathered():
    """parallel.fsdp_unit_layers: FSDP2 gathers (and reduces) units of n layers, so the planner holds n
    layers per unsharded unit: twice the gathered weights at n = 2 on a model of equal layers (each larger
    than the embedding, the other kind of unit, without ep)."""
    one = sized("qwen3_30b_a3b_sft", ["parallel.ep=1"])
    two = sized("qwen3_30b_a3b_sft", ["parallel.ep=1", "parallel.fsdp_unit_layers=2"])
    assert items(two)["gathered weights"] == pytest.approx(2 * items(one)["gathered weights"])
    assert items(two)["gradients"] > items(one)["gradients"]
    assert two.memory.train_gb > one.memory.train_gb and not two.refused


def test_fsdp_unit_layers_auto_groups_small_layers_and_keeps_large_ones_alone():
    """parallel.fsdp_unit_layers `auto` (the default): FSDP2's host work is per unit, so the planner groups
    layers until a unit gathers about AUTO_UNIT_BYTES (at most 4 layers), and halves that where the plan would
    not fit. Dense 1.7B layers (about 100 MB in bf16) go 4 a unit over dp4; a Qwen3-235B layer at tp4 x ep4
    (above 1 GB) stays alone; dist_opt and one plain process have no FSDP2 units (1); an explicit number is
    kept as given."""
    from mlite.plan.memory import AUTO_UNIT_MAX_LAYERS

    dense = ["model.name=qwen3-1.7b", "parallel.ep=1", "cluster.gpus_per_node=4", "cluster.gpu=h100"]
    small = sized("qwen3_30b_a3b_sft", dense)
    assert small.memory.fsdp_unit_layers == AUTO_UNIT_MAX_LAYERS == 4
    one = sized("qwen3_30b_a3b_sft", [*dense, "parallel.fsdp_unit_layers=1"])
    # the largest unit stays the embedding (311M parameters against 4 x 50M): grouping costs no memory here
    assert items(small)["gathered weights"] == items(one)["gathered weights"]
    assert sized("qwen3_235b_a22b_sft").memory.fsdp_unit_layers == 1
    # ep8: a layer's dense part plus 16 experts, about 190 MB, so two a unit
    assert sized("qwen3_30b_a3b_sft").memory.fsdp_unit_layers == 2
    for other, units in (("optimizer.backend=dist_opt", 1), ("cluster.gpus_per_node=1", 1),
                         ("parallel.fsdp_unit_layers=3", 3)):
        assert sized("qwen3_30b_a3b_sft", [*dense, other]).memory.fsdp_unit_layers == units, other
    # where grouped layers would not fit, fewer: tiny-qwen3's 2 layers outweigh its embedding, and a GPU
    # between the two plans' sizes takes units of one layer
    tiny = ["model.name=tiny-qwen3", "parallel.ep=1", "cluster.gpus_per_node=4", "cluster.gpu=h100",
            "data.seq_len=512", "data.global_batch_size=8"]
    grouped = sized("qwen3_30b_a3b_sft", tiny)  # both layers a unit: no more than a stage holds
    single = sized("qwen3_30b_a3b_sft", [*tiny, "parallel.fsdp_unit_layers=1"])
    assert grouped.memory.fsdp_unit_layers == 2 and grouped.memory.train_gb > single.memory.train_gb
    between = (grouped.memory.train_gb + single.memory.train_gb) / 2 / HEADROOM
    squeezed = sized("qwen3_30b_a3b_sft", [*tiny, f"cluster.gpu_memory_gb={between}"])
    assert squeezed.memory.fsdp_unit_layers == 1 and squeezed.memory.fits


def test_fsdp_reshard_after_forward_auto_keeps_units_gathered_only_with_memory_to_spare():
    """parallel.fsdp_reshard_after_forward `auto` (the default): FSDP2 units stay gathered from forward to
    backward (no all-gather in the backward) where the plan fits with the planner's 15% calibration bound to
    spare, at the memory of the stage's whole weights gathered. Dense 1.7B over dp4 keeps them; Qwen3-235B's
    template (offloaded) and DeepSeek-V4's reshard; dist_opt and one plain process have no units."""
    from mlite.plan.memory import KEEP_GATHERED_MARGIN

    dense = ["model.name=qwen3-1.7b", "parallel.ep=1", "cluster.gpus_per_node=4", "cluster.gpu=h100"]
    kept = sized("qwen3_30b_a3b_sft", dense)
    resharded = sized("qwen3_30b_a3b_sft", [*dense, "parallel.fsdp_reshard_after_forward=true"])
    assert kept.memory.fsdp_reshard_after_forward is False and resharded.memory.fsdp_reshard_after_forward
    assert kept.memory.as_dict()["fsdp_reshard_after_forward"] is False
    sp = stage_params(kept.arch, kept.layout, kept.memory.stage, kept.memory.fsdp_unit_layers)
    assert items(kept)["gathered weights"] == pytest.approx((sp.dense + sp.experts) * 2 / GIB)  # bf16, whole
    assert items(resharded)["gathered weights"] == pytest.approx(2 * sp.largest_unit * 2 / GIB)  # 2 units
    gained = items(kept)["gathered weights"] - items(resharded)["gathered weights"]
    assert kept.memory.train_gb - resharded.memory.train_gb == pytest.approx(gained) and gained > 1.0
    for template in ("qwen3_235b_a22b_sft", "deepseek_v4_flash_sft"):
        assert sized(template).memory.fsdp_reshard_after_forward is True, template
    # offload saves GPU memory: never spent on gathered weights, even where they would fit
    offloaded = sized("qwen3_30b_a3b_sft", [*dense, "offload.optimizer=true"])
    assert offloaded.memory.fits and offloaded.memory.fsdp_reshard_after_forward is True
    # a GPU on which the kept plan fits, but without the 15% to spare: resharded
    tight = [*dense, f"cluster.gpu_memory_gb={kept.memory.total_gb * 1.07 / HEADROOM}"]
    squeezed = sized("qwen3_30b_a3b_sft", [*tight, "parallel.fsdp_reshard_after_forward=false"])
    memory = squeezed.memory
    assert memory.fits and memory.total_gb * KEEP_GATHERED_MARGIN > memory.usable_gb
    assert sized("qwen3_30b_a3b_sft", tight).memory.fsdp_reshard_after_forward is True
    for other in ("optimizer.backend=dist_opt", "cluster.gpus_per_node=1"):
        assert sized("qwen3_30b_a3b_sft", [*dense, other]).memory.fsdp_reshard_after_forward is True, other


def test_fsdp2_accumulates_whole_gradients_only_where_they_fit():
    """Without gradient sync FSDP2 keeps each unit's gradient whole (reduce dtype) until the step's last
    backward. DeepSeek-V4's SFT template (16 micro-batches, experts over edp 4) would need 87 GB that way, so
    `auto` reduce-scatters after every micro-batch there, and the runtime reads the same plan; Qwen3-30B's
    (experts whole on each rank, edp 1) fits either way and keeps one reduce-scatter a step."""
    dsv4 = sized("deepseek_v4_flash_sft")
    whole = sized("deepseek_v4_flash_sft", ["parallel.fsdp_grad_accumulation=unsharded"])
    modes = (dsv4.memory.fsdp_grad_accumulation, whole.memory.fsdp_grad_accumulation)
    assert modes == ("sharded", "unsharded")
    assert dsv4.memory.fits and not whole.memory.fits
    sp = stage_params(whole.arch, whole.layout, whole.memory.stage)
    grads = (sp.dense + sp.experts) * 4 + sp.largest_unit * 2  # fp32 reduce; one bf16 unit being reduced
    assert items(whole)["gradients"] == pytest.approx(grads / GIB)
    assert items(whole)["gradients"] > 4 * items(dsv4)["gradients"]
    assert whole.memory.as_dict()["fsdp_grad_accumulation"] == "unsharded"

    qwen = sized("qwen3_30b_a3b_sft")  # 8 micro-batches a step
    assert qwen.memory.fsdp_grad_accumulation == "unsharded" and qwen.memory.fits
    sharded = sized("qwen3_30b_a3b_sft", ["parallel.fsdp_grad_accumulation=sharded"])
    # bf16 whole gradients (grad_reduce bf16) are smaller than the fp32 shards of the edp1 experts: the
    # peak is the shards either way
    assert items(qwen)["gradients"] == pytest.approx(items(sharded)["gradients"])
    one_micro_batch = sized("qwen3_30b_a3b_sft", ["data.global_batch_size=8"])
    assert one_micro_batch.layout.micro_batches == 1 and one_micro_batch.memory.fsdp_grad_accumulation is None
    dist_opt = sized("qwen3_30b_a3b_sft", ["optimizer.backend=dist_opt"])
    assert dist_opt.memory.fsdp_grad_accumulation is None  # its own whole gradient buffer


@pytest.mark.parametrize("overrides,reduced", [
    ([], "fp32"),  # auto: fp32 masters keep fp32 gradients
    (["precision.master=bf16"], "bf16"),  # auto: bf16 masters, bf16 gradients, as Megatron reduces them
    (["precision.grad_reduce=bf16"], "bf16"),
    (["precision.master=bf16", "precision.grad_reduce=fp32"], "fp32"),
])
def test_gradients_are_reduced_in_the_masters_dtype_unless_asked(overrides, reduced):
    """precision.grad_reduce auto is the master weights' dtype: the plan says which."""
    from mlite.plan.policy import grad_reduce_dtype

    gpus = ["cluster.gpu=h100", "trainer.device=cuda", "precision.compute=bf16"]
    job = load_job("demo_sft", [*gpus, "cluster.gpus_per_node=8", *overrides])
    assert grad_reduce_dtype(job) == reduced
    note = {i.name: i.note for i in plan_job(job).memory.items}["gradients"]
    assert note.endswith(f"reduced in {reduced}"), note
    masters = [o for o in overrides if o.startswith("precision.master")]  # one rank refuses a bf16 reduction
    one_gpu = plan_job(load_job("demo_sft", [*gpus, *masters]))
    assert "reduced in" not in {i.name: i.note for i in one_gpu.memory.items}["gradients"]  # one rank


def test_activations_follow_recompute_sp_cp_and_pipeline():
    base = ["parallel.pp=1", "parallel.cp=1", "parallel.ep=1", "parallel.pp_first_stage_layers=null",
            "parallel.pp_last_stage_layers=null", "cluster.nodes=1", "cluster.gpus_per_node=1",
            "precision.grad_reduce=fp32"]  # one GPU: nothing to reduce across

    def job(*extra):
        return plan_job(load_job("qwen3_30b_a3b_sft", base + list(extra)))

    none, selective, full = (job(f"recompute.granularity={g}") for g in ("none", "selective", "full"))
    assert items(none)["activations"] > items(selective)["activations"] > items(full)["activations"]
    assert items(full)["activations"] == pytest.approx(48 * 4096 * 2048 * 2 / GIB)  # one bf16 input per layer
    assert items(none)["activations: routed experts"] > items(none)["activations"]  # top-8 token expansion
    longer = job("recompute.granularity=none", "data.seq_len=8192")
    assert items(longer)["activations"] == pytest.approx(2 * items(none)["activations"])
    assert items(none)["logits"] == pytest.approx(4096 * 151936 * (2 + 2) / GIB)  # bf16 logits + bf16 grad
    # one 4096-token chunk at a time; over several, the head's weight gradient summed in fp32 besides
    assert items(longer)["logits"] == pytest.approx(items(none)["logits"] + 151936 * 2048 * 4 / GIB)
    sp = plan_job(load_job("qwen3_30b_a3b_sft",
                           ["recompute.granularity=none", "parallel.tp=4", "parallel.ep=2"]))
    assert items(sp)["activations"] == pytest.approx(items(none)["activations"] / 4)


def test_first_pipeline_stage_holds_most_micro_batches():
    plan = sized("deepseek_v4_flash_sft")
    assert plan.memory.stage == 0
    assert "x 4 in flight" in next(i.note for i in plan.memory.items if i.name == "activations")


# ------------------------------------------------------------------------------------------- rejections
REJECTIONS = [  # the layout (check_layout)
    ("qwen3_30b_a3b_sft", ["parallel.tp=3"], r"world size 8 is not a multiple of pp x cp x tp = 3"),
    ("qwen3_30b_a3b_sft", ["cluster.nodes=32", "parallel.ep=256"],
     r"128 routed experts, not divisible by ep=256"),
    ("qwen3_30b_a3b_sft", ["parallel.ep=3"], r"ep x etp must divide dp x cp x tp, the 8 ranks .*: 3 does"),
    ("qwen3_30b_a3b_sft", ["parallel.ep=1", "parallel.tp=8"], r"4 KV heads, not divisible by tp=8"),
    ("deepseek_v4_flash_sft", ["parallel.tp=2", "parallel.cp=2"], r"tp=1 only"),
    ("deepseek_v4_flash_sft", ["parallel.pp_first_stage_layers=null", "parallel.pp_last_stage_layers=null"],
     r"43 layers do not split over pp=4 x vpp=1 = 4 chunks evenly; .*stage_layers=11 .*last_stage_layers=10"),
    ("deepseek_v4_flash_sft", ["parallel.pp_first_stage_layers=12"], r"do not split evenly"),
    ("deepseek_v4_flash_sft", ["parallel.vpp=2"], r"need vpp = 1"),
    ("deepseek_v4_flash_sft", ["data.seq_len=16000", "data.max_tokens_per_micro_batch=16384"],
     r"data.seq_len=16000 cannot be split evenly .* multiple of 1024"),
    ("qwen3_235b_a22b_sft", ["data.seq_len=4098"],
     r"sequence parallel \(tp=4\).* multiple of 4; use 4096 or 4100"),
    ("qwen3_235b_a22b_sft", ["parallel.ep=2", "parallel.etp=2", "optimizer.backend=fsdp2"],
     r"etp > 1 is not supported by optimizer.backend 'fsdp2' .*; set parallel.etp: 1 \(no trained backend"),
    ("qwen3_235b_a22b_sft", ["offload.grads=true", "optimizer.backend=dist_opt"],
     r"offload.grads is not supported by optimizer.backend 'dist_opt' .*; use optimizer.backend fsdp2"),
    ("demo_sft", ["optimizer.backend=dist_opt"], r"cpu \(gloo\) device is not supported by .*dist_opt"),
    ("demo_sft", ["parallel.ep=2", "cluster.gpus_per_node=2"], r"is dense \(no experts\)"),
    ("demo_sft", ["data.global_batch_size=3", "cluster.gpus_per_node=2"],
     r"global_batch_size=3 is not divisible by dp=2"),
    ("qwen3_30b_a3b_sft", ["parallel.pp=2", "parallel.ep=4", "parallel.vpp=2", "data.global_batch_size=4",
                           "data.dynamic_batch=false"], r"micro-batches per step \(1\) divisible by pp=2"),
    ("qwen3_30b_a3b_sft", ["parallel.pp=2", "parallel.vpp=5", "parallel.ep=4"],
     r"48 layers do not split over pp=2 x vpp=5 = 10 chunks evenly; choose pp x vpp dividing 48"),
    ("deepseek_v4_flash_sft", ["recompute.num_layers=12"], r"recompute.num_layers=12 exceeds"),
    ("qwen3_30b_a3b_sft", ["cluster.nodes=8", "parallel.pp=64", "parallel.ep=1"],
     r"pp=64 exceeds the model's 48 layers"),
    ("deepseek_v4_flash_grpo", ["rollout.max_response_length=20000"], r"exceeds data.seq_len=16384"),
    ("deepseek_v4_flash_grpo", ["rollout.engine=builtin", "rollout.tp=2"],
     r"rollout.tp > 1 needs rollout.engine: vllm"),
] + [  # what the trainers run (check_runtime): valid layouts they refuse
    ("qwen3_235b_a22b_sft", ["optimizer.backend=dist_opt"], DIST_OPT),
    ("demo_sft", ["cluster.gpus_per_node=2", "parallel.pp=2"],
     r"tied embeddings \(tie_word_embeddings\) with pp=2 are not supported yet"),
    ("demo_sft", ["precision.compute=bf16", "precision.master=bf16"], r"precision.master: bf16 keeps param"),
    ("demo_sft", ["precision.grad_reduce=bf16"], r"precision.grad_reduce: bf16 .* this run has one process"),
    ("demo_sft", ["offload.optimizer=true"], r"offload.\* moves GPU state to host memory, but this run is"),
    ("qwen3_30b_a3b_sft", ["cluster.gpus_per_node=1", "parallel.ep=1", "precision.grad_reduce=fp32",
                           "offload.optimizer=true"], r"offload.\* runs through FSDP2's CPUOffloadPolicy"),
    ("qwen3_30b_a3b_sft", ["offload.grads=true"], r"offload.params / offload.grads: FSDP2 moves a unit's"),
    ("demo_grpo", ["rollout.engine=vllm"], "rollout.engine vllm generates on CUDA GPUs"),
]


@pytest.mark.parametrize("preset, overrides, message", REJECTIONS, 
                         ids=[" ".join(r[1]) or r[0] for r in REJECTIONS])
def test_invalid_jobs_are_refused_with_the_fix(preset, overrides, message):
    job = load_job(preset, overrides)
    with pytest.raises(MliteError, match=message) as err:
        plan_job(job)
    assert "\n" not in str(err.value)


def test_split_chunks_explicit_and_even():
    def sizes(*args):
        return [len(c) for c in split_chunks(*args)]

    assert sizes(61, 12, 1, 6, 5) == [6] + [5] * 10 + [5]
    assert sizes(48, 4, 2, None, None) == [6] * 8  # pp x vpp chunks
    assert sizes(10, 2, 1, 10, 0) == [10, 0]  # a last stage with only the head
    assert split_chunks(6, 3, 1, 0, None) == [[], [0, 1, 2], [3, 4, 5]]  # an embedding-only first stage
    with pytest.raises(MliteError, match="pp_first_stage_layers=6 and parallel.pp_last_stage_layers=5"):
        split_chunks(61, 12, 1, None, None)


def test_interleaved_layers_are_dealt_round_robin():
    job = load_job("qwen3_30b_a3b_sft", ["parallel.pp=2", "parallel.vpp=2", "parallel.ep=4"])
    layout = check_layout(job, preset_arch("qwen3-30b-a3b"), 8)  # a valid layout (MoE + pp: not trained yet)
    assert layout.stage_layers[0] == tuple(range(12)) + tuple(range(24, 36))
    assert layout.stage_layers[1] == tuple(range(12, 24)) + tuple(range(36, 48))
    assert layout.chunk_layers == tuple(tuple(range(i, i + 12)) for i in range(0, 48, 12))


# ------------------------------------------------------------------------------------------ recommend
def test_recommendations_are_valid_trained_fitting_and_sorted():
    job = load_job("qwen3_30b_a3b_sft")
    candidates = recommend(job, top=8)
    assert len(candidates) == 8
    costs = [c.step_s for c in candidates]
    assert costs == sorted(costs)
    for cand in candidates:
        replanned = plan_job(cand.job)  # each is a job the trainers run (check_job) and that fits
        assert replanned.memory.fits and replanned.layout.describe() == cand.layout.describe()
        assert cand.cost["compute"] > 0


def test_recommend_refuses_a_job_the_trainers_refuse_whatever_the_layout():
    for preset, overrides, message in (("deepseek_v3_sft", [], NO_V3),
                                       ("qwen3_235b_a22b_sft", ["optimizer.backend=dist_opt"], DIST_OPT)):
        with pytest.raises(MliteError, match=message):
            recommend(load_job(preset, overrides))


def test_recommend_prefers_no_offload_and_needs_it_for_qwen3_235b():
    big = recommend(load_job("qwen3_235b_a22b_sft", ["optimizer.backend=fsdp2", "offload.optimizer=false",
                                                     "offload.optimizer_fraction=null"]))
    assert big and all(c.job.offload.optimizer for c in big)  # 32 GPUs cannot hold 235B's Adam state
    small = recommend(load_job("qwen3_30b_a3b_sft"))
    assert small and not any(c.job.offload.optimizer for c in small)


def test_recommend_finds_nothing_when_nothing_fits():
    assert recommend(load_job("qwen3_235b_a22b_sft", ["optimizer.backend=fsdp2", "cluster.nodes=1"])) == []


def test_dist_opt_jobs_its_adapter_does_not_run_are_refused_but_still_sized():
    """The planner sizes dist_opt layouts by Megatron-Core's design; where the trainers' dist_opt adapter
    does not run the job (the 235B template's optimizer offload here) the verdict is theirs (one line, the
    fsdp2 fix), and size_refused keeps the estimate for the report. A layout it runs (ep, pp) plans with
    no refusal."""
    with pytest.raises(MliteError, match=DIST_OPT) as err:
        plan_job(load_job("qwen3_235b_a22b_sft", ["optimizer.backend=dist_opt"]))
    assert "optimizer.backend fsdp2" in str(err.value)
    plan = sized("qwen3_235b_a22b_sft", ["optimizer.backend=dist_opt"])
    assert plan.refused == str(err.value) and plan.memory.fits
    assert plan_job(load_job("qwen3_30b_a3b_sft", ["optimizer.backend=dist_opt"])).refused is None  # ep8
    dense = plan_job(load_job("qwen3_30b_a3b_sft", ["optimizer.backend=dist_opt", "model.name=qwen3-8b",
                                                   "parallel.ep=1", "parallel.pp=2"]))
    assert dense.refused is None


def test_embedding_rows_leave_the_embedding_out_of_the_gathered_weights():
    """parallel.fsdp_embedding rows: the embedding is never gathered, so the plan's gathered weights (units
    kept gathered from forward to backward: the whole stage in bf16) lose exactly the [vocab, hidden] matrix
    in bf16; the rest of the estimate is unchanged."""
    dense = ["model.name=qwen3-8b", "parallel.ep=1", "cluster.gpus_per_node=4", "cluster.gpu=h200",
             "parallel.fsdp_reshard_after_forward=false"]
    gathered = sized("qwen3_30b_a3b_sft", dense)
    rows = sized("qwen3_30b_a3b_sft", [*dense, "parallel.fsdp_embedding=rows"])
    assert not gathered.refused and not rows.refused
    matrix = rows.arch.vocab * rows.arch.hidden * 2 / GIB
    assert items(gathered)["gathered weights"] - items(rows)["gathered weights"] == pytest.approx(matrix)
    assert {k: v for k, v in items(rows).items() if k != "gathered weights"} == \
        {k: v for k, v in items(gathered).items() if k != "gathered weights"}
    assert gathered.memory.train_gb - rows.memory.train_gb == pytest.approx(matrix) and matrix > 0.5


def test_the_trainer_waits_on_the_host_where_vllm_needs_the_room():
    """rollout.offload_trainer `auto`: Qwen3-30B-A3B on 8 GPUs with vLLM taking half of each GPU cannot keep
    its resident Adam state and masters beside vLLM (the same job with the offload off does not fit); the
    plan turns it on, sizes the weight sync (vLLM's weights beside the trainer's, which it reads) and the
    generation (vLLM alone), and counts the trainer's state in each node's host memory. With vLLM at 0.3,
    both fit together and nothing moves."""
    vllm = ["job=grpo", "rollout.engine=vllm", "rollout.tp=4"]
    tight = sized("qwen3_30b_a3b_sft", [*vllm, "rollout.gpu_memory_utilization=0.5"])
    kept = sized("qwen3_30b_a3b_sft", [*vllm, "rollout.gpu_memory_utilization=0.5",
                                       "rollout.offload_trainer=false"])
    roomy = sized("qwen3_30b_a3b_sft", [*vllm, "rollout.gpu_memory_utilization=0.3"])
    assert not kept.memory.fits and kept.memory.rollout_gb > kept.memory.usable_gb
    m = tight.memory
    assert m.fits and m.offload_trainer is True and tight.job.rollout.offload_trainer is True
    assert "rollout.offload_trainer" in tight.resolved and tight.choices()["offload_trainer"] is True
    resident = {i.name: i.gb for i in kept.memory.rollout_items if i.name.startswith("trainer: ")}
    assert set(resident) == {"trainer: master weights", "trainer: optimizer state"}
    assert m.rollout_gb == pytest.approx(0.5 * m.capacity_gb)  # generation: vLLM alone on the GPU
    weights = count_params(tight.arch).total * 2 / 4 / GIB  # vLLM's bf16 slab at rollout.tp=4
    assert {i.name: i.gb for i in m.sync_items} == pytest.approx(
        {"trainer: master weights": resident["trainer: master weights"], "vLLM weights": weights,
         "sync bucket": SYNC_BUCKET_BYTES / GIB, "framework overhead": gpu_overhead_gb(8)})
    host = {i.name: i.gb for i in m.host_items}
    assert host["trainer during rollout"] == pytest.approx(sum(resident.values()) * 8)  # 8 GPUs a node
    assert roomy.memory.fits and roomy.memory.offload_trainer is False and roomy.memory.sync_items == []
    assert "trainer during rollout" not in {i.name for i in roomy.memory.host_items}
    assert sized("demo_grpo").memory.offload_trainer is None  # the built-in engine: no vLLM, nothing moves


def test_moe_engines_split_whole_experts_over_their_ranks_by_default():
    """rollout.expert_parallel `auto`: a MoE model on vLLM engines of several GPUs runs vLLM's expert
    parallel (each rank whole experts); a dense model, one-GPU engines and the built-in engine do not, and
    asking for it there is refused in one line."""
    from mlite.config.catalog import preset_arch
    from mlite.plan.policy import rollout_expert_parallel

    moe, dense = preset_arch("qwen3-30b-a3b"), preset_arch("qwen3-8b")
    vllm = ["job=grpo", "rollout.engine=vllm"]
    assert rollout_expert_parallel(load_job("qwen3_30b_a3b_sft", [*vllm, "rollout.tp=4"]), moe)
    assert not rollout_expert_parallel(load_job("qwen3_30b_a3b_sft", [*vllm, "rollout.tp=1"]), moe)
    assert not rollout_expert_parallel(
        load_job("qwen3_30b_a3b_sft", [*vllm, "rollout.tp=4", "rollout.expert_parallel=false"]), moe)
    assert not rollout_expert_parallel(load_job("qwen3_30b_a3b_sft", ["job=grpo"]), moe)  # built-in
    assert not rollout_expert_parallel(load_job("qwen3_30b_a3b_sft", [*vllm, "rollout.tp=4"]), dense)
    with pytest.raises(MliteError, match="rollout.expert_parallel: true splits a MoE model's experts"):
        sized("qwen3_30b_a3b_sft", [*vllm, "rollout.tp=4", "rollout.expert_parallel=true",
                                    "model.name=qwen3-8b", "parallel.ep=1"])


# ------------------------------------------------------------------------------------------------ FP8
FP8_DENSE = ["model.name=qwen3-8b", "parallel.ep=1", "cluster.gpus_per_node=4", "cluster.gpu=h200",
             "parallel.fsdp_unit_layers=1", "parallel.fsdp_reshard_after_forward=true"]


def _fp8_gemm(rows: int, n_in: int, n_out: int, scales: int) -> float:
    """One FP8 GEMM's operands (input, output gradient, weight: 1 byte each) and `scales` fp32 scales, in
    two layouts, in GiB."""
    return 2 * (rows * (n_in + n_out) + n_out * n_in + 4 * scales) / GIB


def test_fp8_adds_one_gemms_casts_and_keeps_the_bf16_activations():
    """precision.fp8 without its all-gather: torchao keeps bf16/fp32 parameters and saves each linear's bf16
    input for the backward, so every item stays; the step adds the FP8 operands of the largest GEMM (Qwen3-8B:
    the MLP's 4096 x 12288) and their scales: one per tensor, per row, or per 1x128 tile / 128x128 block."""
    bf16 = sized("qwen3_30b_a3b_sft", FP8_DENSE)
    tokens = bf16.layout.tokens_per_micro_batch
    h, ffn = 4096, 12288
    scales = {"tensorwise": 3, "rowwise": tokens + tokens + ffn,
              "blockwise": tokens * h // 128 + tokens * ffn // 128 + (h // 128) * (ffn // 128)}
    for recipe, count in scales.items():
        fp8 = sized("qwen3_30b_a3b_sft",
                    [*FP8_DENSE, f"precision.fp8={recipe}", "precision.fp8_all_gather=false"])
        assert not fp8.refused and not fp8.memory.fp8_all_gather
        casts = items(fp8).pop("fp8 casts")
        assert casts == pytest.approx(_fp8_gemm(tokens, h, ffn, count)), recipe
        assert {k: v for k, v in items(fp8).items() if k != "fp8 casts"} == items(bf16)
        assert fp8.memory.train_gb - bf16.memory.train_gb == pytest.approx(casts)


def test_fp8_all_gather_gathers_the_linears_in_one_byte():
    """precision.fp8_all_gather: FSDP2 gathers the linear weights (attention and MLP) in FP8, 1 byte instead
    of bf16's 2; norms and the embedding stay bf16. Kept gathered, the stage's weights lose one byte per
    linear parameter; resharded, two units of 8 layers (larger than the embedding either way) lose it per
    layer they hold. Either way the estimate comes out below bf16's by that, less the FP8 casts."""
    from mlite.config.catalog import layer_params

    arch = preset_arch("qwen3-8b")
    linears = sum(p.attention + p.mlp for p in (layer_params(arch, i) for i in range(arch.num_layers)))
    per_layer = linears / arch.num_layers
    for keys, saved in ((["parallel.fsdp_reshard_after_forward=false"], linears),
                        (["parallel.fsdp_unit_layers=8"], 2 * 8 * per_layer)):
        bf16 = sized("qwen3_30b_a3b_sft", [*FP8_DENSE, *keys])
        fp8 = sized("qwen3_30b_a3b_sft", [*FP8_DENSE, *keys, "precision.fp8=tensorwise",
                                          "precision.fp8_all_gather=true"])
        assert fp8.memory.fp8_all_gather and not fp8.refused
        drop = items(bf16)["gathered weights"] - items(fp8)["gathered weights"]
        assert drop == pytest.approx(saved / GIB), keys
        casts = items(fp8)["fp8 casts"]
        assert bf16.memory.train_gb - fp8.memory.train_gb == pytest.approx(saved / GIB - casts)
        assert drop > casts


def test_the_plan_says_what_fp8_linears_auto_leaves_in_bf16():
    """precision.fp8_linears auto on Qwen3-30B-A3B (8 x H20, ep8, 4k tokens a rank): the routed experts get
    2,048 rows each, too few for their FP8 GEMMs to pay for their casts (rules.fp8_experts_gain), and under
    rowwise every attention linear is below torchao's size rule: `mlite plan` says experts bf16, counts no
    FP8 casts, and notes that nothing runs in FP8. `all` puts the experts (and the linears) in FP8."""
    from mlite.plan.report import runs_line

    auto = plan_job(load_job("qwen3_30b_a3b_sft", ["precision.fp8=rowwise"]))
    assert auto.fp8_experts is False and auto.choices()["fp8_experts"] is False
    assert "fp8 rowwise matmuls, experts bf16" in runs_line(auto)
    assert not any(item.name == "fp8 casts" for item in auto.memory.items)
    assert any("no linear or routed expert" in note and "precision.fp8_linears: all" in note
               for note in auto.memory.notes)
    every = plan_job(load_job("qwen3_30b_a3b_sft", ["precision.fp8=rowwise", "precision.fp8_linears=all"]))
    assert every.fp8_experts is True and "experts fp8" in runs_line(every)
    casts = next(item.gb for item in every.memory.items if item.name == "fp8 casts")
    assert casts > 0 and not every.memory.notes
    tensorwise = plan_job(load_job("qwen3_30b_a3b_sft", ["precision.fp8=tensorwise"]))  # q_proj, o_proj gain
    assert tensorwise.fp8_experts is False and not tensorwise.memory.notes
    assert plan_job(load_job("qwen3_30b_a3b_sft")).choices()["fp8_experts"] is None


def test_fp8_all_gather_auto_resolves_into_the_plan():
    """`auto`: off (the policy's docstring), and the plan's job holds that; `true` gathers in FP8 over
    several data-parallel ranks, halves the gathered weights' bytes, and `mlite plan` prints the recipe."""
    from mlite.plan.report import runs_line

    auto = plan_job(load_job("qwen3_30b_a3b_sft", [*FP8_DENSE, "precision.fp8=tensorwise"]))
    assert auto.job.precision.fp8_all_gather is False and "precision.fp8_all_gather" in auto.resolved
    assert "fp8 tensorwise matmuls  " in runs_line(auto)
    plan = plan_job(load_job("qwen3_30b_a3b_sft", [*FP8_DENSE, "precision.fp8=tensorwise",
                                                   "precision.fp8_all_gather=true"]))
    assert plan.job.precision.fp8_all_gather is True
    assert plan.choices()["fp8"] == "tensorwise" and plan.choices()["fp8_all_gather"] is True
    assert "fp8 tensorwise matmuls, fp8 all-gather" in runs_line(plan)
    kept = ["parallel.fsdp_reshard_after_forward=false"]  # every unit gathered: the linears' bytes halve
    bf16, fp8 = (items(plan_job(load_job("qwen3_30b_a3b_sft", [*FP8_DENSE, "precision.fp8=tensorwise", *kept,
                                                              *extra])))["gathered weights"]
                 for extra in ([], ["precision.fp8_all_gather=true"]))
    assert fp8 < 0.75 * bf16
    rowwise = plan_job(load_job("qwen3_30b_a3b_sft", [*FP8_DENSE, "precision.fp8=rowwise"]))
    assert rowwise.job.precision.fp8_all_gather is False and "fp8 rowwise matmuls  " in runs_line(rowwise)
    one = plan_job(load_job("qwen3_30b_a3b_sft", [*FP8_DENSE, "precision.fp8=tensorwise",
                                                  "cluster.gpus_per_node=1", "parallel.fsdp_unit_layers=auto",
                                                  "parallel.fsdp_reshard_after_forward=auto",
                                                  "precision.grad_reduce=auto"]))
    assert one.job.precision.fp8_all_gather == "auto" and not one.memory.fp8_all_gather  # no FSDP2 units


def test_expert_buffers_auto_is_worst_case_at_ep2_where_it_fits_with_the_margin():
    """parallel.expert_buffers auto on Qwen3-30B-A3B (top-8): worst_case at ep2, whose buffers hold twice a
    balanced router's pairs, where the plan fits with KEEP_GATHERED_MARGIN to spare (an H200); exact where
    it fits only without that spare (the template's GPU), and at ep4 (4x, above AUTO_WORST_CASE_MAX_PAIRS);
    `auto` kept where no all-gather exchange runs. The resolved plan is the explicit job's plan."""
    from mlite.plan.memory import AUTO_WORST_CASE_MAX_PAIRS, KEEP_GATHERED_MARGIN
    from mlite.plan.report import runs_line

    def plan(*extra):
        return plan_job(load_job("qwen3_30b_a3b_sft", ["parallel.ep=2", *extra]))

    roomy = plan("cluster.gpu=h200")
    assert roomy.job.parallel.expert_buffers == "worst_case" and "parallel.expert_buffers" in roomy.resolved
    assert roomy.choices()["expert_buffers"] == roomy.memory.expert_buffers == "worst_case"
    assert "worst-case buffers" in runs_line(roomy)
    assert roomy.memory.total_gb * KEEP_GATHERED_MARGIN <= roomy.memory.usable_gb
    explicit = plan("cluster.gpu=h200", "parallel.expert_buffers=worst_case")
    assert explicit.resolved == tuple(k for k in roomy.resolved if k != "parallel.expert_buffers")
    assert explicit.memory == roomy.memory
    # the template's GPU: worst_case would fit, but not with the planner's error to spare
    tight, tight_worst = plan(), plan("parallel.expert_buffers=worst_case")
    assert tight_worst.memory.fits
    assert tight_worst.memory.total_gb * KEEP_GATHERED_MARGIN > tight.memory.usable_gb
    assert tight.job.parallel.expert_buffers == "exact" and "parallel.expert_buffers" in tight.resolved
    assert tight.memory == plan("parallel.expert_buffers=exact").memory
    ep4 = plan("cluster.gpu=h200", "parallel.ep=4")
    assert 4 > AUTO_WORST_CASE_MAX_PAIRS and ep4.job.parallel.expert_buffers == "exact"
    for extra in (["parallel.ep=1"], ["parallel.ep=16", "cluster.nodes=2"]):  # no exchange; all-to-all
        none = plan("cluster.gpu=h200", *extra)
        assert none.job.parallel.expert_buffers == "auto" and "parallel.expert_buffers" not in none.resolved
        assert none.choices()["expert_buffers"] is None
    dense = plan_job(load_job("demo_sft"))
    assert dense.job.parallel.expert_buffers == "auto" and dense.choices()["expert_buffers"] is None


def test_worst_case_pair_buffers_count_the_most_pairs_a_rank_can_be_sent():
    """parallel.expert_buffers worst_case at ep2 on Qwen3-30B-A3B (64 experts a rank, top-8): the routed
    copies double (each gathered token may send all 8 pairs here), kept or rebuilt under full recompute;
    the exchange's allocator slack stays that of the counted buffers."""
    def routed(extra):
        plan = plan_job(load_job("qwen3_30b_a3b_sft", ["parallel.ep=2", *extra]))
        return items(plan)

    kept, worst = (routed(["recompute.granularity=selective", *extra])
                   for extra in (["parallel.expert_buffers=exact"], ["parallel.expert_buffers=worst_case"]))
    assert worst["activations: routed experts"] == pytest.approx(2 * kept["activations: routed experts"])
    assert worst["expert exchange buffers"] == pytest.approx(kept["expert exchange buffers"])
    from mlite.plan.report import runs_line

    worst_job = load_job("qwen3_30b_a3b_sft", ["parallel.ep=2", "parallel.expert_buffers=worst_case"])
    line = runs_line(plan_job(worst_job))
    assert "ep all-gather, equal lengths, worst-case buffers" in line
    full, full_worst = (routed(["recompute.granularity=full", *extra])
                        for extra in (["parallel.expert_buffers=exact"],
                                      ["parallel.expert_buffers=worst_case"]))
    assert full["recompute working set"] < full_worst["recompute working set"]
