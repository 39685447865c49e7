"""The job is resolved once: `Runtime(job)` plans it (mlite.plan.plan_job, from mlite.runtime.layout.place)
and builds everything from that plan. Its start-up enters the rule book once (`check_job`) and the memory
estimate once (`estimate_memory`), whatever the layout, and asks no runtime policy itself; the job it holds
is the plan's, with no `auto` left in the keys the plan resolves, and that job plans to the same plan again.

The counts are real calls of the real functions (a profile hook sees every Python call), on a real Runtime on
CPU: one process, FSDP2 over one rank, and two gloo ranks under dp2, ep2, tp2 and pp2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from collections import Counter

import pytest
from parallel_harness import launch

from mlite.config import job_from_dict, list_presets, load_job
from mlite.errors import MliteError
from mlite.plan import RESOLVABLE, Plan, plan_job

PLANNER = ("mlite.plan.rules", "mlite.plan.memory", "mlite.plan.policy")
# mlite.runtime.models.build_model asks the rule book which families it builds (check_model_built) on its
# own, once per chunk it builds: the models' own guard, not the job's path through start-up
MODELS_OWN = ("mlite.plan.rules", "check_model_built", "mlite.runtime.models")

TWO_RANKS = {"dp2": ("tiny-qwen3", {}), "ep2": ("tiny-qwen3-moe", {"ep": 2}),
             "tp2": ("tiny-qwen3-moe", {"tp": 2}), "pp2": ("tiny-qwen3-moe", {"pp": 2})}


def cpu_job(model: str, parallel: dict, ranks: int = 1):
    return job_from_dict({"model": {"name": model}, "precision": {"compute": "fp32"}, "parallel": parallel,
                          "data": {"seq_len": 512}, "cluster": {"gpu": "cpu", "gpus_per_node": ranks},
                          "trainer": {"device": "cpu", "seed": 7}})


@contextlib.contextmanager
def counted():
    """Count, while inside: the calls of the real `check_job` and `estimate_memory` (wrapped where plan_job
    looks them up; the wrapper counts and calls through), and every call into the rule book, the memory
    estimate and the runtime policy from outside the planner, by (module, function, caller module), and
    `plan_job`'s (a profile hook sees every Python call; this module's wrappers are looked through)."""
    import mlite.plan as plan_module

    calls: Counter = Counter()
    entries: Counter = Counter()
    reals = {name: getattr(plan_module, name) for name in ("check_job", "estimate_memory")}
    for name, real in reals.items():
        def wrapper(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        setattr(plan_module, name, wrapper)

    def watch(frame, event, arg):
        if event != "call":
            return
        module = frame.f_globals.get("__name__")
        back = frame.f_back
        while back is not None and back.f_globals.get("__name__") == __name__:
            back = back.f_back
        caller = back.f_globals.get("__name__", "") if back is not None else ""
        if module in PLANNER and not caller.startswith("mlite.plan"):
            entries["|".join((module, frame.f_code.co_name, caller))] += 1
        elif module == "mlite.plan" and frame.f_code.co_name == "plan_job":
            entries["|".join((module, "plan_job", caller))] += 1

    sys.setprofile(watch)
    try:
        yield calls, entries
    finally:
        sys.setprofile(None)
        for name, real in reals.items():
            setattr(plan_module, name, real)


def start_up(job) -> dict:
    """Runtime(job), counted (`counted`), and what the runtime holds of its plan."""
    from mlite.runtime.engine import Runtime

    with counted() as (calls, entries):
        rt = Runtime(job)
    try:
        plan = rt.placement.plan
        return {"calls": dict(calls), "entries": dict(entries), "same_job": rt.job is plan.job,
                "job": rt.job.model_dump(mode="json"), "resolved": list(plan.resolved),
                "fsdp_units": plan.fsdp_units, "replans_to_itself": _replans_to_itself(plan)}
    finally:
        rt.close()


def _replans_to_itself(plan: Plan) -> bool:
    again = plan_job(plan.job, plan.arch, world=plan.world)
    return again.resolved == () and dataclasses.replace(again, resolved=plan.resolved) == plan


def assert_planned_once(got: dict, fsdp: bool, gathers_experts: bool = False) -> None:
    assert got["calls"] == {"check_job": 1, "estimate_memory": 1}, got["calls"]
    counted_entries = Counter({tuple(key.split("|")): n for key, n in got["entries"].items()})
    # the one way in: plan_job from place(), which asks check_job and estimate_memory once each
    assert counted_entries.pop(("mlite.plan", "plan_job", "mlite.runtime.layout")) == 1, got["entries"]
    counted_entries.pop(MODELS_OWN, None)
    assert not counted_entries, f"the runtime asked the planner again: {dict(counted_entries)}"
    assert got["same_job"] and got["replans_to_itself"], got
    job, resolved = got["job"], set(got["resolved"])
    assert all(job[key.split(".")[0]][key.split(".")[1]] != "auto" for key in resolved), (resolved, job)
    if fsdp:  # FSDP2's units exist and a process group reduces: every key a plan resolves is resolved, the
        # expert exchange's buffers where the all-gather exchange runs
        expected = set(RESOLVABLE) - (set() if gathers_experts else {"parallel.expert_buffers"})
        assert resolved == expected, resolved
    else:  # one plain process: no FSDP2 units and no reduction, nothing of them to resolve
        assert resolved == set(), resolved


@pytest.mark.parametrize("model,parallel,fsdp", [
    ("tiny-qwen3", {}, False),
    ("tiny-qwen3-moe", {"fsdp_one_rank": True}, True),
], ids=["one-process", "fsdp-one-rank"])
def test_one_process_start_up_enters_the_rule_book_and_the_estimate_once(model, parallel, fsdp):
    assert_planned_once(start_up(cpu_job(model, parallel)), fsdp)


def _two_rank_worker(rank, world, out):
    results = {name: start_up(cpu_job(model, parallel, world))
               for name, (model, parallel) in TWO_RANKS.items()}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)


def test_two_rank_start_up_enters_the_rule_book_and_the_estimate_once(tmp_path):
    """dp2 (dense), ep2, tp2 and pp2 (MoE) on two gloo ranks: on every rank, one check_job, one
    estimate_memory, and the runtime's job is the plan's, FSDP2's keys and the reduction dtype resolved."""
    out = tmp_path / "counts"
    launch(2, _two_rank_worker, str(out))
    for rank in range(2):
        results = json.loads((tmp_path / f"counts.{rank}").read_text())
        assert set(results) == set(TWO_RANKS)
        for name, got in results.items():
            assert got["fsdp_units"], (rank, name)
            assert_planned_once(got, fsdp=True, gathers_experts=name == "ep2")


# ---------------------------------------------------------------------------------- the planner alone
@pytest.mark.parametrize("preset", list_presets())
def test_a_planned_job_plans_to_the_same_plan(preset):
    """The job a plan resolves is one the rule book accepts in the same world, and planning it again changes
    nothing: the same layout, memory and choices, with nothing left to resolve."""
    try:
        plan = plan_job(load_job(preset))
    except MliteError:
        plan = plan_job(load_job(preset), size_refused=True)
    again = plan_job(plan.job, plan.arch, world=plan.world, size_refused=plan.refused is not None)
    assert again.resolved == () and again.job == plan.job
    assert dataclasses.replace(again, resolved=plan.resolved) == plan
    assert all(plan.job.model_dump()[k.split(".")[0]][k.split(".")[1]] != "auto" for k in plan.resolved)


def test_a_plan_is_frozen_and_prints_its_choices():
    plan = plan_job(load_job("qwen3_30b_a3b_sft"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.job = None  # type: ignore[misc]
    choices = plan.choices()
    assert choices["fsdp_unit_layers"] == plan.job.parallel.fsdp_unit_layers == plan.memory.fsdp_unit_layers
    assert choices["fsdp_grad_accumulation"] == plan.memory.fsdp_grad_accumulation == "unsharded"
    assert choices["expert_exchange"] == "all_gather" and choices["equal_micro_batch_lengths"]
    assert choices["context_chunk"] is None  # no context parallel
    assert choices["fp8"] is None and choices["fp8_all_gather"] is False  # no precision.fp8: nothing in FP8
    assert set(plan.resolved) == {"parallel.fsdp_unit_layers", "parallel.fsdp_reshard_after_forward",
                                  "parallel.fsdp_grad_accumulation", "precision.fp8_all_gather",
                                  "parallel.expert_buffers"}  # the template sets grad_reduce
    # ep8 with top-8: worst-case buffers would hold 8 x a balanced router's pairs (AUTO_WORST_CASE_MAX_PAIRS)
    assert choices["expert_buffers"] == plan.job.parallel.expert_buffers == "exact"


def test_a_planned_job_is_planned_anew_in_another_world():
    """A checkpoint keeps the run's job, its `auto`s resolved for two ranks (FSDP2 units of 2 layers, kept
    gathered); `mlite export` rebuilds it on one plain process, which has no FSDP2 units: the rule book
    refuses those values there, and `for_another_world` gives the keys back to that world's plan."""
    from mlite.plan import World, for_another_world

    job = cpu_job("tiny-qwen3-moe", {}, 2)
    planned = plan_job(job, world=World(2, "cpu", False)).job
    assert planned.parallel.fsdp_unit_layers == 2 and planned.parallel.fsdp_reshard_after_forward is False
    one = World(1, "cpu", False)
    with pytest.raises(MliteError, match="parallel.fsdp_unit_layers: 2 groups FSDP2's units"):
        plan_job(job_from_dict(planned.model_dump(mode="json")), world=one)
    again = plan_job(job_from_dict(for_another_world(planned.model_dump(mode="json"))), world=one)
    assert again.resolved == () and again.job.parallel.fsdp_unit_layers == "auto"


def test_a_context_parallel_plan_carries_the_chunk_multiple_its_runtime_pads_to():
    """DeepSeek-V4 at cp4: the plan holds the rows each context-parallel chunk is a multiple of (its sliding
    window and compression windows), which the runtime pads every share to; without cp it prints none."""
    from mlite.plan.report import runs_line

    plan = plan_job(load_job("deepseek_v4_flash_sft"), size_refused=True)
    v4 = plan.arch.v4
    assert plan.layout.cp == 4
    rows = max(v4.sliding_window, *v4.compress_ratios)
    assert plan.context_chunk == plan.choices()["context_chunk"] == rows
    assert f"cp chunks of {plan.context_chunk}-row multiples" in runs_line(plan)
    assert plan_job(load_job("qwen3_30b_a3b_sft")).context_chunk == 1
