"""GRPO under data parallel on gloo ranks with the built-in engine (a tiny untied Qwen3 written by
transformers): each data-parallel rank (with its tp and pp ranks) generates only the prompts it owns, whole
groups of `rollout.n`; every figure the step logs, and the held-out reward, are one process's for the same
prompts and seeds.
The engines' request layout (which vLLM engine generates which dp rank's requests) is checked here too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runs import RTOL, stable
from grpo_helpers import char_tokenizer, grpo_job, tiny_hf_qwen3
from parallel_harness import launch

from mlite.trainers.grpo.vllm_rollout import EngineLayout

ROWS = [{"prompt": f"say {d}", "answer": str(d)} for d in range(12)]
STEPS = 2
SECTIONS = {"rollout": {"n": 4, "prompts_per_step": 4, "max_response_length": 8, "val_n": 2,
                        "val_temperature": 0.7},
            "grpo": {"mini_batches": 1, "kl_coef": 0.05}}


def steps(tmp_path, tokenizer_dir, world: int, parallel: dict) -> dict:
    """On this rank: STEPS GRPO steps and a held-out evaluation; returns the logged figures and how many
    sequences this rank generated and owned."""
    from mlite.runtime.data.tokenizer import load_tokenizer
    from mlite.runtime.engine import Runtime
    from mlite.trainers.grpo.prompts import render_prompts
    from mlite.trainers.grpo.trainer import GRPOTrainer

    tokenizer = load_tokenizer(tokenizer_dir)
    model = {"name": None, "path": str(tokenizer_dir.parent / "model")}
    job = grpo_job(tmp_path, model=model, cluster={"gpus_per_node": world}, parallel=parallel, **SECTIONS)
    prompts, _ = render_prompts(ROWS, tokenizer, job.rollout.max_prompt_length)
    runtime = Runtime(job)
    trainer = GRPOTrainer(job, runtime, tokenizer, prompts[:8], val_prompts=prompts[8:])
    figures = []
    try:
        for step in range(STEPS):
            metrics, ro = trainer.train_step(step)
            figures.append(metrics)
            # its own prompts' whole groups only: every dp-th prompt of the step
            assert ro.index == [i for i in range(ro.size) if (i // job.rollout.n) % runtime.dp_size
                                == runtime.dp_rank]
            assert len(ro.completions) == len(ro.index) == ro.size // runtime.dp_size
        generated_in_steps = trainer.engine.generated
        figures.append(trainer.evaluate())
        return {"figures": figures, "generated": generated_in_steps, "dp": runtime.dp_rank,
                "dp_size": runtime.dp_size}
    finally:
        runtime.close()


def _worker(rank, world, tmp, tokenizer_dir, parallel, out):
    got = steps(Path(tmp), Path(tokenizer_dir), world, parallel)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(got, f)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one")
    tokenizer_dir = tmp / "tok"
    tiny_hf_qwen3(tmp / "model", char_tokenizer(tokenizer_dir))
    return tokenizer_dir, steps(tmp, tokenizer_dir, 1, {})


@pytest.mark.parametrize("world,parallel", [(2, {}), (4, {"tp": 2}), (4, {"pp": 2})],
                         ids=["dp2", "dp2-tp2", "pp2-dp2"])
def test_each_dp_rank_generates_its_own_prompts_and_every_figure_is_one_process(
        tmp_path, one_process, world, parallel):
    tokenizer_dir, want = one_process
    out = tmp_path / "got"
    launch(world, _worker, str(tmp_path), str(tokenizer_dir), parallel, str(out))
    ranks = [json.loads((tmp_path / f"got.{r}").read_text()) for r in range(world)]
    n, per_step = SECTIONS["rollout"]["n"], SECTIONS["rollout"]["prompts_per_step"]
    assert want["generated"] == STEPS * n * per_step  # one process: everything
    for got in ranks:  # its share, no more: every second prompt's group of each step
        assert got["dp_size"] == 2 and got["generated"] == STEPS * n * per_step // 2
    for got in ranks:  # every rank logs the step's figures, each the one process's
        assert_same_figures(got["figures"], want["figures"])


def assert_same_figures(got: list[dict], want: list[dict]) -> None:
    got, want = stable(got), stable(want)
    assert len(got) == len(want)
    for step, (ours, ref) in enumerate(zip(got, want)):
        assert sorted(ours) == sorted(ref), step
        for key, value in ref.items():
            assert ours[key] == pytest.approx(value, rel=RTOL, abs=1e-6), f"step {step}: {key}"


def test_requests_go_to_the_engines_of_their_dp_rank_in_turn():
    """vLLM engines are consecutive blocks of rollout.tp ranks. A dp rank's requests go, in turn, to the
    engines holding its ranks: one engine where they all sit in one (tp2 trainer, engines of 2), two where
    a pipeline puts its stages in two engines; requests every rank needs go to every engine in turn."""
    # 4 ranks, tp2 trainer: ranks 0, 1 are dp 0 and 2, 3 dp 1; engines of 2 ranks
    tp2 = EngineLayout((0, 0, 1, 1), 2)
    assert [tp2.engines_of(d) for d in (0, 1)] == [[0], [1]]
    assert tp2.assign([0, 1, 0, 1, 1]) == [0, 1, 0, 1, 1]
    # pp2 x dp2 on 4 ranks: stage 0 holds ranks 0 (dp 0) and 1 (dp 1), stage 1 ranks 2 (dp 0) and 3 (dp 1);
    # engines of 2 ranks hold one stage each, so each dp rank's requests alternate between them
    pp2 = EngineLayout((0, 1, 0, 1), 2)
    assert [pp2.engines_of(d) for d in (0, 1)] == [[0, 1], [0, 1]]
    assert pp2.assign([0, 0, 1, 0, 1]) == [0, 1, 0, 0, 1]
    # dp4 with engines of one rank: each rank's engine serves its own requests
    assert EngineLayout((0, 1, 2, 3), 1).assign([3, 1, 1]) == [3, 1, 1]
    assert EngineLayout((0, 0, 1, 1), 2).assign([None, None, None]) == [0, 1, 0]
