"""The rule book (mlite.plan.rules) is the one verdict: `mlite plan` refuses exactly what the trainers refuse
at start-up, with the same line; one stage splitter serves the planner and the pipeline; no rule imports
torch.

The trainers' start-up is taken two ways. Where it is cheap (one CPU process) it is a real run: `mlite sft` /
`mlite grpo` as a subprocess on the tiny model, exit 2, the planner's line, no traceback. Elsewhere it is
`Runtime(job)` in this process on the cluster the job names, faked only at the edges: torch sees GPUs when the
job is for GPUs, WORLD_SIZE is the job's world, and starting the process group (the first thing after the rule
book) stops the run there.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlite.cli import main
from mlite.config import list_presets, load_job
from mlite.config.catalog import resolve_arch
from mlite.errors import MliteError
from mlite.plan import policy, rules
from mlite.plan.rules import SUPPORT, check_dist_opt_adapter, check_layout, planned_device_type, split_chunks

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------- verdicts
def plan_verdict(capsys, preset: str, overrides: list[str]) -> str | None:
    """`mlite plan` in this process: None when it accepts the job (exit 0 or 3), else its one error line."""
    capsys.readouterr()
    rc = main(["plan", preset, *[arg for item in overrides for arg in ("--set", item)]])
    err = capsys.readouterr().err.strip().splitlines()
    if rc in (0, 3):
        return None
    assert rc == 2 and len(err) == 1 and err[0].startswith("mlite plan: error: "), (rc, err)
    return err[0].removeprefix("mlite plan: error: ")


class _Started(Exception):
    """Start-up passed the rule book and went on to start the process group."""


def startup_verdict(monkeypatch, preset: str, overrides: list[str]) -> str | None:
    """`Runtime(job)` on the cluster the job names: None when it gets past the rule book, else its line."""
    import torch
    import torch.distributed as dist

    from mlite.runtime.engine import Runtime

    job = load_job(preset, overrides)
    gpu = planned_device_type(job) == "cuda"
    with monkeypatch.context() as patch:
        patch.setenv("WORLD_SIZE", str(job.cluster.world_size))
        patch.setenv("LOCAL_RANK", "0")
        patch.setattr(torch.cuda, "is_available", lambda: gpu)
        patch.setattr(torch.cuda, "set_device", lambda *_: None)

        def start(*_args, **_kwargs):
            raise _Started

        patch.setattr(dist, "init_process_group", start)
        try:
            Runtime(job)  # one CPU process: nothing to start, the tiny model is built and that is all
        except _Started:
            return None
        except MliteError as err:
            return str(err)
    assert job.cluster.world_size == 1 and not gpu, "a multi-rank start-up went on without a process group"
    return None


def real_run(tmp_path, command: str, preset: str, overrides: list[str]) -> subprocess.CompletedProcess:
    sets = [arg for item in [*overrides, f"trainer.output_dir={tmp_path / 'run'}"] for arg in ("--set", item)]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return subprocess.run([sys.executable, "-m", "mlite", command, preset, *sets, "--no-progress"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300, check=False)


# one GPU process, bf16 (the demo presets run fp32 on the CPU)
ON_GPU = ["cluster.gpu=h100", "trainer.device=cuda", "precision.compute=bf16"]

# Bad jobs: (id, preset, overrides, the line's words, real run: None or the mlite command that starts it).
BAD_JOBS = [
    ("uneven-world", "demo_sft", ["parallel.tp=2"], "world size 1 is not a multiple of pp x cp x tp = 2",
     "sft"),
    ("ep-fold", "qwen3_30b_a3b_sft", ["parallel.ep=3"], "ep x etp must divide dp x cp x tp, the 8 ranks",
     None),
    ("ep-experts", "demo_sft", ["model.name=tiny-qwen3-moe", "cluster.gpus_per_node=6", "parallel.ep=6"],
     "8 routed experts, not divisible by ep=6", None),
    ("heads-tp", "qwen3_30b_a3b_sft", ["parallel.ep=1", "parallel.tp=8"], "4 KV heads, not divisible by tp=8",
     None),
    ("stages-vpp", "qwen3_30b_a3b_sft", ["parallel.pp=2", "parallel.vpp=5", "parallel.ep=4"],
     "48 layers do not split over pp=2 x vpp=5 = 10 chunks evenly", None),
    ("seq-cp", "qwen3_30b_a3b_sft", ["parallel.cp=2", "parallel.ep=4", "data.seq_len=4098"],
     "data.seq_len=4098 cannot be split evenly by context parallel zigzag", None),
    ("seq-sp", "qwen3_30b_a3b_sft", ["parallel.tp=2", "parallel.ep=4", "data.seq_len=4097"],
     "data.seq_len=4097 cannot be split evenly by sequence parallel (tp=2)", None),
    ("batch-dp", "demo_sft", ["cluster.gpus_per_node=2", "data.global_batch_size=3"],
     "data.global_batch_size=3 is not divisible by dp=2", None),
    ("dist_opt", "qwen3_235b_a22b_sft", ["optimizer.backend=dist_opt"],
     "offload.* with optimizer.backend dist_opt: Megatron-Core's optimizer offload is not wired", None),
    ("dist_opt-cpu", "demo_sft", ["optimizer.backend=dist_opt"],
     "cpu (gloo) device is not supported by optimizer.backend 'dist_opt'", "sft"),
    ("etp", "qwen3_30b_a3b_sft", ["parallel.ep=4", "parallel.etp=2"],
     "etp > 1 is not supported by optimizer.backend 'fsdp2'", None),
    ("master-bf16-cpu", "demo_sft", ["precision.compute=bf16", "precision.master=bf16"],
     "precision.master: bf16 keeps parameters and Adam state in bf16 on GPUs", "sft"),
    ("grad_reduce-world1", "demo_sft", ["precision.grad_reduce=bf16"],
     "precision.grad_reduce: bf16 sets the dtype of the gradient reduction", "sft"),
    ("offload-cpu", "demo_sft", ["offload.optimizer=true"],
     "offload.* moves GPU state to host memory, but this run is on the CPU", "sft"),
    ("offload-one-gpu", "qwen3_30b_a3b_sft",
     ["cluster.gpus_per_node=1", "parallel.ep=1", "precision.grad_reduce=fp32", "offload.optimizer=true"],
     "offload.* runs through FSDP2's CPUOffloadPolicy, which needs FSDP2; start several ranks", None),
    ("fsdp-one-rank-ranks", "demo_sft", ["cluster.gpus_per_node=2", "parallel.fsdp_one_rank=true"],
     "parallel.fsdp_one_rank applies to one process, and this job has 2 ranks", None),
    ("fsdp-one-rank-dist_opt", "qwen3_30b_a3b_sft",
     ["cluster.gpus_per_node=1", "parallel.ep=1", "parallel.fsdp_one_rank=true",
      "optimizer.backend=dist_opt"],
     "parallel.fsdp_one_rank shards with FSDP2, and optimizer.backend is dist_opt", None),
    ("fsdp-units-one-process", "demo_sft", ["parallel.fsdp_unit_layers=2"],
     "parallel.fsdp_unit_layers: 2 groups FSDP2's units, and one plain process has none", "sft"),
    ("fsdp-units-dist_opt", "qwen3_30b_a3b_sft",
     ["parallel.fsdp_unit_layers=2", "optimizer.backend=dist_opt"],
     "parallel.fsdp_unit_layers: 2 groups FSDP2's units, and optimizer.backend is dist_opt", None),
    ("fsdp-reshard-one-process", "demo_sft", ["parallel.fsdp_reshard_after_forward=false"],
     "parallel.fsdp_reshard_after_forward: false keeps FSDP2's units gathered from forward to backward, and "
     "one plain process has none", "sft"),
    ("fsdp-reshard-dist_opt", "qwen3_30b_a3b_sft",
     ["parallel.fsdp_reshard_after_forward=false", "optimizer.backend=dist_opt"],
     "parallel.fsdp_reshard_after_forward: false keeps FSDP2's units gathered from forward to backward, and "
     "optimizer.backend is dist_opt", None),
    ("fsdp-reshard-offload", "qwen3_235b_a22b_sft", ["parallel.fsdp_reshard_after_forward=false"],
     "parallel.fsdp_reshard_after_forward: false keeps every gathered layer on the GPU", None),
    ("fsdp-prefetch-dist_opt", "qwen3_30b_a3b_sft",
     ["parallel.fsdp_forward_prefetch=false", "optimizer.backend=dist_opt"],
     "parallel.fsdp_forward_prefetch: false sets how FSDP2 prefetches its units in the forward, and "
     "optimizer.backend is dist_opt", None),
    ("fsdp-grad-accumulation-one-process", "demo_sft", ["parallel.fsdp_grad_accumulation=sharded"],
     "parallel.fsdp_grad_accumulation: sharded chooses how FSDP2 accumulates gradients, and one plain "
     "process", "sft"),
    ("fsdp-grad-accumulation-dist_opt", "qwen3_30b_a3b_sft",
     ["parallel.fsdp_grad_accumulation=unsharded", "optimizer.backend=dist_opt"],
     "parallel.fsdp_grad_accumulation: unsharded chooses how FSDP2 accumulates gradients, and "
     "optimizer.backend is dist_opt", None),
    ("fsdp-embedding-one-process", "demo_sft", ["parallel.fsdp_embedding=rows"],
     "parallel.fsdp_embedding: rows keeps the embedding sharded by vocabulary rows, and one plain process "
     "has none", "sft"),
    ("fsdp-embedding-dist_opt", "qwen3_30b_a3b_sft",
     ["parallel.fsdp_embedding=rows", "optimizer.backend=dist_opt"],
     "parallel.fsdp_embedding: rows keeps the embedding sharded by vocabulary rows, and optimizer.backend is "
     "dist_opt", None),
    ("fsdp-embedding-tied", "qwen3_30b_a3b_sft",
     ["parallel.fsdp_embedding=rows", "model.name=qwen3-1.7b", "parallel.ep=1"],
     "qwen3-1.7b ties it to the LM head, which reads the whole matrix", None),
    ("fsdp-embedding-tp", "qwen3_30b_a3b_sft",
     ["parallel.fsdp_embedding=rows", "parallel.ep=1", "parallel.tp=2"],
     "tp=2 already splits it by vocabulary over tp", None),
    ("fsdp-embedding-offload", "qwen3_30b_a3b_sft",
     ["parallel.fsdp_embedding=rows", "offload.optimizer=true"],
     "offload.optimizer_fraction 1.0 moves everything to the host", None),
    ("expert-buffers-dense", "demo_sft", ["parallel.expert_buffers=worst_case"],
     "parallel.expert_buffers: worst_case sizes the expert exchange's buffers, and this model has no routed "
     "experts", "sft"),
    ("expert-buffers-ep1", "qwen3_30b_a3b_sft", ["parallel.ep=1", "parallel.expert_buffers=worst_case"],
     "parallel.expert_buffers: worst_case sizes the expert exchange's buffers, and parallel.ep is 1", None),
    ("expert-buffers-all-to-all", "demo_sft",
     ["model.name=tiny-qwen3-moe", "cluster.gpus_per_node=4", "parallel.ep=4",
      "parallel.expert_buffers=worst_case"],
     "ep=4 above top_k=2 exchanges pairs by all-to-all, whose split sizes are read on the host", None),
    ("overlap-fsdp2", "demo_sft", ["optimizer.overlap_grad_reduce=false"],
     "optimizer.overlap_grad_reduce: false turns off dist_opt's overlap, and optimizer.backend is fsdp2",
     "sft"),
    ("gather-overlap-fsdp2", "demo_sft", ["optimizer.overlap_param_gather=false"],
     "optimizer.overlap_param_gather: false turns off dist_opt's overlap, and optimizer.backend is fsdp2",
     "sft"),
    ("offload-grads-alone", "qwen3_30b_a3b_sft", ["offload.grads=true"],
     "offload.params / offload.grads: FSDP2 moves a unit's parameters", None),
    ("rollout-vllm", "demo_grpo", ["rollout.engine=vllm"],
     "rollout.engine vllm generates on CUDA GPUs and this job runs on the CPU",
     "grpo"),
    ("rollout-tp-world", "demo_grpo", ["cluster.gpu=h100", "trainer.device=cuda", "cluster.gpus_per_node=2",
                                       "rollout.engine=vllm", "rollout.tp=4"],
     "rollout.tp=4 does not divide the world size 2", None),
    ("fp8-weights-dense", "demo_grpo", ["cluster.gpu=h100", "trainer.device=cuda", "rollout.engine=vllm",
                                        "rollout.fp8_weights=true"],
     "rollout.fp8_weights: true sends DeepSeek-V4's linears and experts to vLLM in FP8, and this job trains "
     "tiny-qwen3", None),
    ("fp8-weights-blocks", "deepseek_v4_flash_grpo", ["rollout.fp8_weights=true", "rollout.tp=32",
                                                      "rollout.span_nodes=true"],
     "the shared experts' width 2048 is not a multiple of 128 x rollout.tp=32", None),
    ("fp8-cpu", "demo_sft", ["precision.compute=bf16", "precision.fp8=tensorwise"],
     "precision.fp8: tensorwise multiplies on the FP8 tensor cores of GPUs, and this run is on the CPU",
     "sft"),
    ("fp8-a100", "qwen3_30b_a3b_sft", ["cluster.gpu=a100", "precision.fp8=rowwise"],
     "precision.fp8: rowwise needs torchao's FP8 grouped GEMM (for qwen3-30b-a3b's routed experts), compute "
     "capability 9.0 or newer, and cluster.gpu a100 has 8.0", None),
    ("fp8-a100-dense", "demo_sft",
     [*ON_GPU, "model.name=qwen3-8b", "cluster.gpu=a100", "precision.fp8=tensorwise"],
     "precision.fp8: tensorwise needs FP8 tensor cores, compute capability 8.9 or newer, and cluster.gpu "
     "a100 has 8.0", None),
    ("fp8-blockwise-widths", "demo_sft", [*ON_GPU, "precision.fp8=blockwise"],
     "precision.fp8: blockwise needs every width of the linears it converts in multiples of 128 (the FP8 "
     "kernels' tiles), and tiny-qwen3's hidden size is 64; use precision.fp8: rowwise", None),
    ("fp8-tp", "qwen3_30b_a3b_sft", ["parallel.ep=1", "parallel.tp=2", "precision.fp8=tensorwise"],
     "precision.fp8: tensorwise with tp=2: torchao's FP8 linears need their own tensor-parallel plans", None),
    ("fp8-all-gather-dist_opt", "qwen3_30b_a3b_sft",
     ["optimizer.backend=dist_opt", "precision.fp8=tensorwise", "precision.fp8_all_gather=true"],
     "precision.fp8_all_gather: true has FSDP2 all-gather its units' linear weights in FP8, and "
     "optimizer.backend is dist_opt", None),
    ("fp8-all-gather-one-process", "demo_sft",
     [*ON_GPU, "precision.fp8=tensorwise", "precision.fp8_all_gather=true"],
     "precision.fp8_all_gather: true has FSDP2 all-gather its units' linear weights in FP8, and one plain "
     "process has no FSDP2 units", None),
    ("match-fp8-dense", "demo_grpo", ["cluster.gpu=h100", "trainer.device=cuda", "rollout.engine=vllm",
                                      "rollout.match_fp8=true"],
     "rollout.match_fp8: true rounds the trainer's forward through the linears that DeepSeek-V4's vLLM "
     "engine multiplies in FP8", None),
    ("match-fp8-and-fp8", "deepseek_v4_flash_grpo", ["rollout.match_fp8=true", "precision.fp8=rowwise"],
     "rollout.match_fp8 rounds the forward as vLLM does, and precision.fp8: rowwise multiplies in FP8 its "
     "own way; choose one", None),
    ("match-fp8-builtin", "demo_grpo", ["rollout.match_fp8=true"],
     "so that its log-probs are those of the model the sampler ran, and this job rolls out on the built-in "
     "engine; remove rollout.match_fp8", None),
    ("tied-pp", "demo_sft", ["cluster.gpus_per_node=2", "parallel.pp=2"],
     "tied embeddings (tie_word_embeddings) with pp=2 are not supported yet", None),
    ("no-native-model", "deepseek_v4_flash_sft", ["model.name=deepseek-v3", "parallel.pp=1",
                                                  "parallel.pp_first_stage_layers=null",
                                                  "parallel.pp_last_stage_layers=null"],
     "deepseek-v3 (model_type 'deepseek_v3') has no native model yet", None),
]


@pytest.mark.parametrize("preset", list_presets())
def test_every_preset_gets_one_verdict(preset, capsys, monkeypatch):
    assert plan_verdict(capsys, preset, []) == startup_verdict(monkeypatch, preset, [])


@pytest.mark.parametrize("name, preset, overrides, words, real", BAD_JOBS, ids=[row[0] for row in BAD_JOBS])
def test_bad_jobs_get_the_same_line_from_the_planner_and_the_trainers(name, preset, overrides, words, real,
                                                                      capsys, monkeypatch):
    planned = plan_verdict(capsys, preset, overrides)
    assert planned is not None and words in planned, planned
    assert startup_verdict(monkeypatch, preset, overrides) == planned


REAL = [row for row in BAD_JOBS if row[4] is not None]


@pytest.mark.parametrize("name, preset, overrides, words, command", REAL, ids=[row[0] for row in REAL])
def test_real_start_up_refuses_in_the_planners_line(name, preset, overrides, words, command, tmp_path,
                                                     capsys):
    """`mlite sft` / `mlite grpo` on one CPU process: exit 2, the line `mlite plan` gives, no traceback."""
    planned = plan_verdict(capsys, preset, overrides)
    done = real_run(tmp_path, command, preset, overrides)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"mlite {command}: error: {planned}"


# ------------------------------------------------------------------------------------- stage splitter
@pytest.mark.parametrize("pp, vpp, first, last", [
    (2, 1, None, None), (4, 1, None, None), (2, 2, None, None), (2, 3, None, None), (4, 2, None, None),
    (3, 4, None, None), (4, 1, 11, 13), (4, 1, 0, 16), (3, 1, None, 24),
])
def test_split_chunks_is_the_planners_stage_layers_and_the_pipelines_cut(pp, vpp, first, last):
    from mlite.runtime.parallel.pipeline import split_layers

    stages = {"pp_first_stage_layers": first, "pp_last_stage_layers": last}
    overrides = [f"parallel.pp={pp}", f"parallel.vpp={vpp}", "parallel.ep=1",
                 f"cluster.gpus_per_node={2 * pp}", "data.global_batch_size=96"]
    overrides += [f"parallel.{key}={'null' if value is None else value}" for key, value in stages.items()]
    job = load_job("qwen3_30b_a3b_sft", overrides)  # 48 layers, dp 2
    layout = check_layout(job, resolve_arch(job.model), job.cluster.world_size)
    chunks = split_chunks(48, pp, vpp, first, last)
    assert split_layers(48, pp, vpp, first, last) == chunks  # the runtime's pipeline cuts exactly these
    assert len(chunks) == pp * vpp and [i for c in chunks for i in c] == list(range(48))  # model order
    assert layout.chunk_layers == tuple(tuple(c) for c in chunks)
    for rank in range(pp):  # chunk c runs on pp rank c % pp (the runtime's `range(rank, pp * vpp, pp)`)
        mine = [i for c in range(rank, pp * vpp, pp) for i in chunks[c]]
        assert layout.stage_layers[rank] == tuple(mine)
    if vpp > 1:  # interleaved: pp x vpp chunks of one size, not pp stages
        assert {len(c) for c in chunks} == {48 // (pp * vpp)}


def test_split_chunks_refuses_what_neither_side_can_run():
    with pytest.raises(MliteError, match="do not split over pp=2 x vpp=3 = 6 chunks evenly"):
        split_chunks(8, 2, 3)
    with pytest.raises(MliteError, match="need vpp = 1"):
        split_chunks(8, 2, 2, 2, None)
    with pytest.raises(MliteError, match="at least one each"):
        split_chunks(4, 4, 1, 2, 2)


# ------------------------------------------------------------------------------------------ the matrix
def test_planner_md_prints_the_support_matrix():
    text = (ROOT / "docs" / "PLANNER.md").read_text()
    table = text.split("### Backend support matrix", 1)[1].split("\n\n")[2]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    yes = {True: "yes", False: "no"}
    expected = [[name, yes[s.fsdp2], yes[s.dist_opt], yes[s.adapter], s.why] for name, s in SUPPORT.items()]
    assert rows == expected


ADAPTER_FEATURES = {  # matrix row -> (job overrides, degrees) that use it on 2 data-parallel ranks
    "tp + sequence parallel": ([], {"tp": 2}),
    "pp (1F1B)": ([], {"pp": 2}),
    "vpp (interleaved 1F1B)": ([], {"pp": 2, "vpp": 2}),
    "cp (zigzag ring attention)": ([], {"cp": 2}),
    "ep": ([], {"ep": 2}),
    "etp > 1": ([], {"etp": 2}),
    "offload.params": (["offload.params=true", "optimizer.backend=fsdp2"], {}),
    "offload.grads": (["offload.grads=true"], {}),
    "offload.optimizer (+ fraction)": (["offload.optimizer=true"], {}),
    "precision.compute fp16": (["precision.compute=fp16"], {}),
    "precision.master bf16": (["precision.compute=bf16", "precision.master=bf16"], {}),
    "precision.optimizer_state fp8": (["precision.optimizer_state=fp8"], {}),
}


@pytest.mark.parametrize("feature", list(ADAPTER_FEATURES))
def test_the_adapter_column_is_what_the_dist_opt_adapter_refuses(feature):
    overrides, degrees = ADAPTER_FEATURES[feature]
    job = load_job("qwen3_30b_a3b_sft", ["precision.grad_reduce=fp32", *overrides])
    dims = type("Dims", (), {"tp": 1, "pp": 1, "vpp": 1, "cp": 1, "ep": 1, "etp": 1, **degrees})()
    if SUPPORT[feature].adapter:
        check_dist_opt_adapter(job, dims)
    else:
        with pytest.raises(MliteError):
            check_dist_opt_adapter(job, dims)


def test_the_trainers_run_fsdp2_and_dist_opt_where_its_adapter_has_run_on_gpus():
    assert rules.TRAINED_BACKENDS == ("fsdp2", "dist_opt")
    assert not SUPPORT["etp > 1"].fsdp2 and not SUPPORT["etp > 1"].adapter
    ran = {"tp + sequence parallel", "pp (1F1B)", "vpp (interleaved 1F1B)", "cp (zigzag ring attention)",
           "ep", "checkpoints (save, resume)"}
    assert {name for name, row in SUPPORT.items() if row.adapter} == ran


# ---------------------------------------------------------------------------------------- torch-free
def test_every_rule_runs_without_torch():
    """Every function of the rule book, of the runtime policy and of the world probe, run on every preset
    and every bad job, in a process where torch, megatron and transformers never get imported."""
    code = f"""
import inspect, sys
from mlite.config import list_presets, load_job
from mlite.config.catalog import resolve_arch
from mlite.errors import MliteError
from mlite.plan import policy, rules, world
modules = (rules, policy, world)
called = set()
def watch(frame, event, arg):
    if event == "call" and frame.f_globals.get("__name__") in {{m.__name__ for m in modules}}:
        called.add((frame.f_globals["__name__"], frame.f_code.co_name))
sys.setprofile(watch)
jobs = [(name, []) for name in list_presets()] + {[(row[1], row[2]) for row in BAD_JOBS]!r}
jobs += [("qwen3_30b_a3b_sft", ["optimizer.backend=dist_opt", "parallel.ep=1", "parallel.pp=2"])]
for preset, overrides in jobs:
    job = load_job(preset, overrides)
    arch = resolve_arch(job.model)
    try:
        planned = world.planned_world(job)
        rules.check_job(job, arch, planned.size, planned.device_type, planned.megatron)
    except MliteError:
        pass
    policy.grad_reduce_dtype(job), policy.compute_dtype(job, "cpu")
    policy.process_group(job, 2), policy.fsdp_units(job, 2), policy.rollout_expert_parallel(job, arch)
    policy.vllm_v4_fp8(job, arch), policy.vllm_fp8_misfit(arch, 8, False), policy.vllm_v4_width_misfit(arch)
    policy.vllm_weight_bytes(arch, 2, True), policy.fp8_all_gather(job)
    policy.expert_pair_rows(2, 8, 2, 4)
    try:
        rules.check_dist_opt_adapter(job, job.parallel)
    except MliteError:
        pass
rules.check_degrees(8, 2, 2, 1, 2, 2)
rules.check_fp8_capability(load_job("qwen3_30b_a3b_sft", ["precision.fp8=rowwise"]),
                           resolve_arch(load_job("qwen3_30b_a3b_sft").model), (9, 0), "H100")
policy.expert_exchange(8, 6)
# packed attention: the bench's five documents at 8k (1,638 a sequence) in one varlen call, at 12k (2,458) and
# one sequence per cuDNN call
assert [policy.per_sequence_attention(t, n) for t, n in ((8192, 5), (12288, 5), (2048, 1), (16384, 64))
        ] == [False, True, True, False]
assert [rules.fp8_token_multiple(r) for r in ("none", "rowwise", "blockwise")] == [1, 16, 128]
# torchao's size rule: Qwen3-1.7B's k_proj (2048 -> 1024) stays bf16 under tensorwise auto; its q_proj not
assert [rules.fp8_converts(r, mode, 2048, n) for r, mode, n in (
    ("tensorwise", "auto", 1024), ("tensorwise", "auto", 2048), ("tensorwise", "all", 1024),
    ("rowwise", "auto", 4096), ("rowwise", "auto", 6144), ("blockwise", "auto", 512), ("none", "all", 4096))
        ] == [False, True, True, False, True, True, False]
# the experts' FP8 rule: Qwen3-30B-A3B at 4k tokens (256 rows an expert: 570 flops a cast element) and the
# V4 bench's 4 layers (768 rows: 1,600) lose on an H200; Qwen3-235B-A22B's experts gain from ~4,900 rows
assert [rules.fp8_experts_gain(h, i, r) for h, i, r in (
    (2048, 768, 256), (4096, 2048, 768), (4096, 1536, 4096), (4096, 1536, 8192))
        ] == [False, False, False, True]
moe_job = load_job("qwen3_30b_a3b_sft", ["precision.fp8=rowwise"])
moe_arch = resolve_arch(moe_job.model)
moe_layout = rules.check_layout(moe_job, moe_arch, 8)
# EP8, 4096 tokens a rank: 8 ranks' tokens x 8 copies over 128 experts
assert (moe_layout.ep, moe_layout.tokens_per_micro_batch) == (8, 4096)
assert rules.fp8_expert_rows(moe_layout, moe_arch.moe) == 2048
assert not rules.fp8_experts_on(moe_job, moe_arch, moe_layout)
every = load_job("qwen3_30b_a3b_sft", ["precision.fp8=rowwise", "precision.fp8_linears=all"])
assert rules.fp8_experts_on(every, moe_arch, moe_layout)
assert not rules.fp8_experts_on(load_job("qwen3_30b_a3b_sft"), moe_arch, moe_layout)
policy.equal_micro_batch_lengths(4, 8, embedding_rows=True)
# the routed experts leave FSDP2 where their ep spans a stage's ranks (edp 1), in the compute dtype, not
# offloaded: Qwen3-30B-A3B at EP8 on 8 GPUs with bf16 masters; not with fp32 masters on the GPU, nor at edp 2
bf16 = load_job("qwen3_30b_a3b_sft", ["precision.master=bf16"])
for job, world_size, device_type, want in ((bf16, 8, "cuda", True), (bf16, 16, "cuda", False),
                                           (moe_job, 8, "cuda", False), (moe_job, 8, "cpu", True)):
    layout = rules.check_layout(job, moe_arch, world_size)
    assert policy.experts_outside_fsdp(job, layout, device_type) == want
rules.split_chunks(61, 12, 1, 6, 5)
try:
    rules.split_chunks(61, 12, 1, None, None)  # the hint: balanced first/last stage sizes
except MliteError:
    pass
sys.setprofile(None)
functions = {{(m.__name__, n) for m in modules for n, f in vars(m).items()
             if inspect.isfunction(f) and f.__module__ == m.__name__}}
assert functions <= called, sorted(functions - called)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "megatron", "transformers"))
assert not heavy, heavy
print(len(functions), "functions")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[0]) >= 20


def test_the_rule_book_imports_no_torch_at_module_level():
    tree = inspect.getsource(rules)
    assert "import torch" not in tree and "from torch" not in tree


def test_rollout_tp_must_split_like_vllm_does():
    """vLLM over rollout.tp ranks splits KV heads (or shares one among tp / kv ranks) and the MLP and expert
    intermediate sizes: a rollout.tp it cannot split that way is refused at start-up, in one line."""
    from dataclasses import replace

    from mlite.config import load_job
    from mlite.config.catalog import preset_arch
    from mlite.errors import MliteError
    from mlite.plan.rules import check_rollout

    job = load_job("demo_grpo", ["cluster.gpu=h100", "trainer.device=cuda", "cluster.gpus_per_node=4",
                                 "rollout.engine=vllm", "rollout.tp=4"])
    arch = preset_arch("tiny-qwen3")  # 4 heads, 2 KV heads (each shared by 2 of the 4 ranks), MLP 128
    check_rollout(job, arch, 4)
    with pytest.raises(MliteError, match=r"rollout.tp=4 and tiny-qwen3's 3 KV heads: vLLM needs one"):
        check_rollout(job, replace(arch, num_kv_heads=3), 4)
    with pytest.raises(MliteError, match=r"does not divide tiny-qwen3's MLP intermediate size 130"):
        check_rollout(job, replace(arch, ffn=130), 4)
    moe = preset_arch("tiny-qwen3-moe")
    with pytest.raises(MliteError, match=r"expert intermediate size 30 \(vLLM splits it"):
        check_rollout(job, replace(moe, moe=replace(moe.moe, expert_ffn=30)), 4)


@pytest.mark.parametrize(
    "ep,top_k,exchange",
    [(2, 2, "all_gather"), (4, 8, "all_gather"), (8, 8, "all_gather"), (4, 6, "all_gather"),
     (8, 6, "all_to_all"), (4, 2, "all_to_all"), (16, 8, "all_to_all")],
)
def test_the_expert_exchange_sends_the_fewer_rows_a_token(ep, top_k, exchange):
    """All-gather: ep - 1 rows a token leave the rank; per-pair all-to-all: top_k x (ep - 1) / ep. The
    gather wins ties (fixed sizes, the host read overlapped): Qwen3 top-8 at ep4 and ep8, DeepSeek-V4 top-6
    at ep4; V4 at ep8 sends pair by pair."""
    assert policy.expert_exchange(ep, top_k) == exchange
    gathered, paired = ep - 1, top_k * (ep - 1) / ep
    assert (gathered <= paired) == (exchange == "all_gather")


# ------------------------------------------------------------------------------------------------ FP8
def test_every_gpu_type_has_a_compute_capability():
    from mlite.config.catalog import GPU_COMPUTE_CAPABILITY
    from mlite.config.schema import GPU_TYPES

    assert set(GPU_COMPUTE_CAPABILITY) == set(GPU_TYPES) - {"cpu"}
    pre_hopper = {gpu for gpu, cc in GPU_COMPUTE_CAPABILITY.items() if cc < rules.FP8_HOPPER}
    assert pre_hopper == {"a100"}


def test_fp8_needs_the_tensor_cores_of_its_recipe_and_model():
    """Dense tensorwise / rowwise run from sm89 (Ada); blockwise, and any MoE model (torchao's FP8 grouped
    GEMM for its routed experts), from sm90. The runtime asks the same rule with its device."""
    from mlite.config.catalog import preset_arch

    dense, moe = preset_arch("qwen3-8b"), preset_arch("qwen3-30b-a3b")
    for recipe, arch, need, below in [("tensorwise", dense, "8.9", (8, 6)), ("rowwise", dense, "8.9", (8, 6)),
                                      ("blockwise", dense, "9.0", (8, 9)), ("rowwise", moe, "9.0", (8, 9))]:
        job = load_job("qwen3_30b_a3b_sft", [f"precision.fp8={recipe}"])
        rules.check_fp8_capability(job, arch, tuple(int(n) for n in need.split(".")), "the GPU")
        with pytest.raises(MliteError, match=rf"capability {need} or newer, and the GPU has {below[0]}\."):
            rules.check_fp8_capability(job, arch, below, "the GPU")
    rules.check_fp8_capability(load_job("qwen3_30b_a3b_sft"), moe, (7, 0), "V100")  # no precision.fp8


def test_fp8_names_the_width_its_kernels_cannot_tile():
    """Widths of the converted linears in 16s (blockwise: 128s); the routed experts' grouped GEMM is rowwise
    under every recipe (16s); the embedding, head, norms and router do not count."""
    from dataclasses import replace

    from mlite.config.catalog import preset_arch
    from mlite.plan.rules import check_fp8

    job = load_job("demo_sft", [*ON_GPU, "precision.fp8=rowwise"])
    dense = preset_arch("tiny-qwen3")
    check_fp8(job, dense, 1, "cuda")
    check_fp8(job, replace(dense, vocab=257), 1, "cuda")  # the embedding and head stay bf16
    with pytest.raises(MliteError, match=r"tiny-qwen3's MLP width \(intermediate_size\) is 136; set "
                                         r"precision.fp8: none$"):
        check_fp8(job, replace(dense, ffn=136), 1, "cuda")
    with pytest.raises(MliteError, match=r"KV width \(kv_heads x head_dim\) is 24"):
        check_fp8(job, replace(dense, num_kv_heads=2, head_dim=12, num_heads=4), 1, "cuda")
    moe = preset_arch("tiny-qwen3-moe")
    with pytest.raises(MliteError, match=r"routed expert width \(moe_intermediate_size\) is 40"):
        check_fp8(job, replace(moe, moe=replace(moe.moe, expert_ffn=40)), 1, "cuda")
    blockwise = load_job("demo_sft", [*ON_GPU, "precision.fp8=blockwise"])
    with pytest.raises(MliteError, match=r"of 128 .* hidden size is 64; use precision.fp8: rowwise"):
        check_fp8(blockwise, moe, 1, "cuda")
    wide = replace(moe, hidden=128, num_heads=8, head_dim=16, num_kv_heads=8)
    check_fp8(blockwise, wide, 1, "cuda")  # experts of 32: 16s suffice for their rowwise grouped GEMM
    for preset in ("qwen3-8b", "qwen3-30b-a3b", "qwen3-235b-a22b", "llama-3.1-70b", "deepseek-v4-flash"):
        check_fp8(blockwise, preset_arch(preset), 8, "cuda")  # the published models tile in 128s


def test_fp8_runs_with_the_layouts_the_runtime_has():
    """dist_opt multiplies in FP8 too (its weights stay bf16 / fp32); cp, pp and ep do; tp does not."""
    base = ["cluster.gpu=h100", "precision.fp8=tensorwise"]
    for overrides in (["optimizer.backend=dist_opt", "offload.optimizer=false", "precision.grad_reduce=fp32"],
                      ["parallel.ep=4", "parallel.cp=2"], ["parallel.ep=4", "parallel.pp=2"]):
        job = load_job("qwen3_30b_a3b_sft", [*base, *overrides])
        arch = resolve_arch(job.model)
        rules.check_layout(job, arch, 8)
        rules.check_runtime(job, arch, 8, "cuda", has_megatron=True)


@pytest.mark.parametrize("overrides, on", [
    (["precision.fp8=tensorwise"], False),  # auto: measured slower on NVLink (the policy's docstring)
    (["precision.fp8=rowwise"], False),
    ([], False),
    (["precision.fp8=tensorwise", "precision.fp8_all_gather=false"], False),
    (["precision.fp8=tensorwise", "precision.fp8_all_gather=true"], True),
])
def test_fp8_all_gather_is_on_only_where_asked_for(overrides, on):
    assert policy.fp8_all_gather(load_job("qwen3_30b_a3b_sft", overrides)) is on


def test_match_fp8_goes_with_deepseek_v4_on_vllm():
    job = load_job("deepseek_v4_flash_grpo", ["rollout.match_fp8=true"])
    rules.check_match_fp8(job, resolve_arch(job.model))
    assert plan_verdict_free(job) is None


def plan_verdict_free(job) -> str | None:
    """The rule book's verdict on a job on its own cluster, without the CLI."""
    from mlite.plan import plan_job

    try:
        plan_job(job)
    except MliteError as err:
        return str(err)
    return None


@pytest.mark.parametrize("hidden, fits", [(512, False), (1024, False), (2048, True), (4096, True),
                                          (6144, True), (7168, True), (4608, False)])
def test_vllm_v4_widths_that_its_small_batch_mhc_kernel_skips(hidden, fits):
    """vLLM 0.25.1's fused mHC kernel for <= 16 tokens splits the hidden size 8 ways (hidden <= 4096) or 4,
    each split in whole 256-wide strides: V4-Flash (4096) and V4-Pro (7168) fit, the old small V4 (512)
    did not, and its decode returned garbage for small batches (docs/GRPO.md). The rule book refuses such a
    model on vLLM in one line; the built-in engine runs it."""
    import dataclasses

    job = load_job("demo_grpo", ["model.name=small-deepseek-v4", "model.path=null", "rollout.engine=vllm",
                                 "trainer.device=cuda", "cluster.gpu=h100", "precision.compute=bf16"])
    arch = dataclasses.replace(resolve_arch(job.model), hidden=hidden)
    assert (policy.vllm_v4_width_misfit(arch) is None) is fits
    if fits:
        rules.check_rollout(job, arch, 8)
    else:
        with pytest.raises(MliteError, match=f"its hidden size {hidden} is not a multiple of .*mHC kernel "
                                             "for forwards of 16 tokens or fewer skips such widths"):
            rules.check_rollout(job, arch, 8)
    rules.check_rollout(load_job("demo_grpo", ["model.name=small-deepseek-v4", "model.path=null"]), arch, 8)
    assert policy.vllm_v4_width_misfit(resolve_arch(load_job("demo_grpo").model)) is None  # not V4


def test_expert_pair_rows_is_the_most_pairs_one_rank_can_be_sent():
    """parallel.expert_buffers worst_case: every gathered token's top_k distinct experts, at most all of this
    rank's: Qwen3-30B-A3B at ep2 (64 experts a rank) holds 8 pairs a gathered token, twice a balanced
    router's share; with 4 experts a rank a token sends it 4 at most."""
    assert policy.expert_pair_rows(2, 4096, 8, 64) == 2 * 4096 * 8
    assert policy.expert_pair_rows(4, 4096, 8, 4) == 4 * 4096 * 4
    assert policy.expert_pair_rows(2, 0, 8, 64) == 0
