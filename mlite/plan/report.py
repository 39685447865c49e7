"""Render a plan or a recommendation: rich tables for people, plain dicts for `--json`."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from mlite.config.catalog import PRESETS, count_params, preset_arch
from mlite.plan import Plan
from mlite.plan.memory import MemoryItem
from mlite.plan.recommend import Candidate


def plan_dict(plan: Plan) -> dict[str, Any]:
    lay = plan.layout
    return {
        "model": plan.arch.name,
        "params": plan.params.as_dict(),
        "layout": {"world": lay.world, "tp": lay.tp, "pp": lay.pp, "vpp": lay.vpp, "cp": lay.cp, "dp": lay.dp,
                   "ep": lay.ep, "etp": lay.etp, "edp": lay.edp, "sequence_parallel": lay.sequence_parallel,
                   "stage_layers": [len(s) for s in lay.stage_layers], "micro_batches": lay.micro_batches,
                   "tokens_per_micro_batch": lay.tokens_per_micro_batch, "sequence_split": lay.split},
        "memory": plan.memory.as_dict(),
        "runs": plan.choices(),  # what the run does where the job leaves it to mlite (`auto` resolved)
        "fits": plan.memory.fits,
        "refused": plan.refused,  # the trainers' one-line refusal (plan_job(size_refused=True)), else None
    }


def render_plan(console: Console, plan: Plan) -> None:
    lay, mem, pc = plan.layout, plan.memory, plan.params
    c = plan.job.cluster
    console.print(f"[bold]{plan.arch.name}[/]: {pc.total / 1e9:.1f}B parameters, "
                  f"{pc.active / 1e9:.1f}B active ({pc.non_embedding_total / 1e9:.1f}B / "
                  f"{pc.non_embedding_active / 1e9:.1f}B without embeddings)")
    console.print(f"cluster: {c.nodes} x {c.gpus_per_node} {c.gpu} ({mem.capacity_gb:.1f} GB each), "
                  f"host {c.host_memory_gb:g} GB per node")
    console.print(f"layout: {lay.describe()}  edp{lay.edp}  SP {'on' if lay.sequence_parallel else 'off'}  "
                  f"stages {[len(s) for s in lay.stage_layers]} layers  "
                  f"{lay.micro_batches} micro-batches/step "
                  f"of {lay.tokens_per_micro_batch} tokens  {plan.job.optimizer.backend}")
    console.print(f"runs: {runs_line(plan)}", highlight=False)
    console.print(memory_table(f"memory per GPU (pipeline stage {mem.stage}, the fullest)", mem.items, 2,
                               total=("total (training step)", mem.train_gb)))
    if mem.sync_items:  # the trainer offloaded: the weight sync is a phase of its own
        console.print(memory_table("memory per GPU during the weight sync (GRPO, trainer offloaded)",
                                   mem.sync_items, 2, total=("total (weight sync)", mem.sync_gb)))
    if mem.rollout_items:
        console.print(memory_table("memory per GPU during rollout (GRPO)", mem.rollout_items, 2,
                                   total=("total (rollout)", mem.rollout_gb)))
    console.print(memory_table("host memory per node", mem.host_items, 1))
    for note in mem.notes:
        console.print(f"note: {note}")
    verdict = "[green]FITS[/]" if mem.fits else "[red]DOES NOT FIT[/]"
    if plan.refused is not None:  # sized by design, but the trainers refuse it: that is the verdict
        console.print(f"[red]REFUSED[/] by the trainers: {plan.refused}", highlight=False)
        verdict = "planned memory (would fit)" if mem.fits else "planned memory (would not fit)"
    console.print(f"{verdict}: {mem.total_gb:.1f} GB of {mem.usable_gb:.1f} GB usable per GPU "
                  f"({mem.capacity_gb:.1f} GB x headroom); host {mem.host_total_gb:.0f} of "
                  f"{mem.host_capacity_gb:.0f} GB per node")


def memory_table(title: str, items: list[MemoryItem], decimals: int,
                 total: tuple[str, float] | None = None) -> Table:
    """One memory table of the plan: a row per item (name, GB to `decimals` places, how it is counted),
    then the total in bold when one is given."""
    table = Table(title=title)
    table.add_column("item")
    table.add_column("GB", justify="right")
    table.add_column("how")
    for item in items:
        table.add_row(item.name, f"{item.gb:.{decimals}f}", item.note)
    if total is not None:
        label, gb = total
        table.add_row(f"[bold]{label}[/]", f"[bold]{gb:.{decimals}f}[/]", "")
    return table


def runs_line(plan: Plan) -> str:
    """The plan's choices where the job leaves them to mlite, in one line."""
    c = plan.choices()
    parts = [f"{c['device']} {c['compute_dtype']}"]
    if c["fp8"] is not None:  # precision.fp8: the recipe, and whether FSDP2 gathers the linears in FP8
        experts = {None: "", True: ", experts fp8", False: ", experts bf16"}[c["fp8_experts"]]
        parts.append(f"fp8 {c['fp8']} matmuls{experts}" + (", fp8 all-gather" if c["fp8_all_gather"] else ""))
    if c["grad_reduce"] is not None:
        parts.append(f"grad reduce {c['grad_reduce']}")
    if plan.fsdp_units:
        kept = "resharded" if c["fsdp_reshard_after_forward"] else "kept gathered"
        parts.append(f"FSDP2 {c['fsdp_unit_layers']}-layer units {kept}, "
                     f"{c['fsdp_grad_accumulation']} accumulation")
    if c["expert_exchange"] is not None:
        equal = ", equal lengths" if c["equal_micro_batch_lengths"] else ""
        worst = ", worst-case buffers" if plan.job.parallel.expert_buffers == "worst_case" else ""
        parts.append(f"ep {c['expert_exchange'].replace('_', '-')}{equal}{worst}")
    elif c["equal_micro_batch_lengths"]:
        parts.append("equal micro-batch lengths")
    if c["context_chunk"] is not None:
        parts.append(f"cp chunks of {c['context_chunk']}-row multiples")
    if c["offload_trainer"]:
        parts.append("offload trainer during rollout")
    if c["rollout_fp8_weights"]:
        parts.append("FP8 rollout weights")
    r = c["recompute"]
    recompute = r["granularity"] if r["granularity"] != "full" else f"full ({r['method']}, {r['num_layers']})"
    parts.append(f"recompute {recompute}")
    return "  ".join(parts)


def render_candidates(console: Console, candidates: list[Candidate], title: str) -> None:
    table = Table(title=title)
    for name in ("#", "layout", "edp", "stages (first/last)", "recompute", "offload opt", "GB/GPU", "host GB",
                 "step s (est.)", "largest costs"):
        table.add_column(name, justify="right" if name in ("#", "edp", "GB/GPU", "host GB", "step s (est.)")
                         else "left")
    for rank, cand in enumerate(candidates, 1):
        p = cand.job.parallel
        stages = (f"{p.pp_first_stage_layers}/{p.pp_last_stage_layers}"
                  if p.pp_first_stage_layers is not None else "even")
        costs = sorted(cand.cost.items(), key=lambda kv: -kv[1])[:3]
        table.add_row(str(rank), cand.layout.describe(), str(cand.layout.edp), stages,
                      cand.job.recompute.granularity,
                      "yes" if cand.job.offload.optimizer else "no", f"{cand.memory.total_gb:.1f}",
                      f"{cand.memory.host_total_gb:.0f}", f"{cand.step_s:.2f}",
                      ", ".join(f"{k} {v:.2f}" for k, v in costs))
    console.print(table)


def models_table() -> tuple[Table, list[dict[str, Any]]]:
    table = Table(title="model catalog (model.name)")
    rows = []
    for column in ("name", "type", "layers", "hidden", "heads/kv", "experts", "total B", "active B"):
        table.add_column(column, justify="left" if column in ("name", "type") else "right")
    for name in sorted(PRESETS):
        arch = preset_arch(name)
        pc = count_params(arch)
        experts = f"{arch.moe.num_experts} top-{arch.moe.top_k}" if arch.moe else "-"
        table.add_row(name, arch.model_type, str(arch.num_layers), str(arch.hidden),
                      f"{arch.num_heads}/{arch.num_kv_heads}", experts, f"{pc.total / 1e9:.2f}",
                      f"{pc.active / 1e9:.2f}")
        rows.append({"name": name, "model_type": arch.model_type, **pc.as_dict()})
    return table, rows
