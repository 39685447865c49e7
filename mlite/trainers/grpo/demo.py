"""The GRPO stage of `mlite demo`: after SFT, reinforce right, stated answers with the built-in rollout.

The SFT checkpoint is exported to an HF folder (what any GRPO job starts from), freshly generated word
problems are the prompts, the demo's checker is the reward (1 for "The answer is N." with the right N).
Held-out prompts are answered (sampled, as in training) before the first update, during the run and after
the last: the summary prints before -> after.
"""

from __future__ import annotations

from pathlib import Path

from mlite.config import load_job
from mlite.config.schema import JobConfig
from mlite.trainers.grpo.trainer import GRPOResult, train_grpo
from mlite.trainers.run_folder import RUN_ENTRIES, claim_for_demo

PRESET = "demo_grpo"
# One-digit word problems: after the demo's SFT the model works about half of them out right when sampling,
# and states the answer ("The answer is N.") about half the time, as its SFT data did (DEMO_UNSTATED in
# mlite/trainers/demo.py); so nearly every group of 8 mixes rewards 1 and 0 (GRPO's signal), bare
# arithmetic beyond one digit it almost never solves (all-wrong groups carry none). The prompts are new
# questions, none of them in SFT's data: on SFT's own questions GRPO mostly recalls memorised answers, and
# the held-out reward fell while the training reward rose (docs/GRPO.md).
KIND, LEVEL = "word", 1
HELD_OUT = 128  # held-out prompts, answered rollout.val_n times each before, during and after
TRAIN_PROMPTS = 1024  # more than a run's prompts (80 steps x 8): no prompt is trained on twice
PROMPT_SEED = 2  # the SFT data is drawn with seed 0; these questions exclude its questions anyway
DEMO_ENTRIES = ("sft_hf", "grpo_data")  # what this stage writes into the demo's folder, besides its run


def write_prompt_files(out: Path) -> dict[str, Path]:
    """New KIND/LEVEL questions (prompt + answer), none in SFT's data, as GRPO prompt files under
    out/grpo_data: HELD_OUT held-out rows and TRAIN_PROMPTS train rows."""
    import pyarrow.parquet as pq

    from mlite.runtime.data.demo import demo_rows, write_rows

    sft_questions = frozenset(
        row["prompt"]
        for split in ("train", "val")
        for row in pq.read_table(out / "data" / f"{split}.parquet").to_pylist()
    )
    rows = demo_rows(HELD_OUT + TRAIN_PROMPTS, PROMPT_SEED, exclude=sft_questions, kind=KIND, level=LEVEL)
    rows = [{k: r[k] for k in ("prompt", "answer", "kind", "level")} for r in rows]
    return {
        "val": write_rows(rows[:HELD_OUT], out / "grpo_data" / "val.jsonl"),
        "train": write_rows(rows[HELD_OUT:], out / "grpo_data" / "train.jsonl"),
    }


def demo_grpo_job(
    out: Path, model_dir: Path, device: str = "auto", overrides: tuple[str, ...] = ()
) -> JobConfig:
    files = write_prompt_files(out)
    gpu = ["cluster.gpu=h100", "precision.compute=bf16"] if device == "cuda" else []
    return load_job(
        PRESET,
        [
            f"model.path={model_dir}",
            "model.name=null",
            "model.load_weights=true",
            f"data.train_files=[{files['train']}]",
            f"data.val_files=[{files['val']}]",
            f"data.tokenizer={out / 'tokenizer'}",
            f"trainer.output_dir={out / 'grpo'}",
            f"trainer.device={device}",
            *gpu,
            *overrides,
        ],
    )


def held_out_sampling(job: JobConfig) -> str:
    r = job.rollout
    if r.val_temperature == 0:
        return "greedily"
    return f"{r.val_n} times each at temperature {r.val_temperature:g}"


def check_overrides(overrides: tuple[str, ...]) -> None:
    """Refuse unknown keys or bad values in the GRPO overrides (MliteError) before SFT spends minutes."""
    load_job(PRESET, list(overrides))


def grpo_stage(
    out: Path,
    sft,
    device: str,
    console,
    overrides: tuple[str, ...] = (),
    show_progress: bool = True,
    label: str = "grpo",
) -> GRPOResult:
    """(demo dir, SFT result, device, console) -> the GRPO run's result; `overrides` (key=value) change the
    `demo_grpo` job."""
    from mlite.plan import plan_job
    from mlite.runtime.engine import export_checkpoint

    # the demo's folder was cleared of its last run's files (claim_for_demo): export never overwrites
    model_dir = export_checkpoint(sft.checkpoint, out / "sft_hf")
    job = demo_grpo_job(out, Path(model_dir), device, overrides)
    plan_job(job)
    claim_for_demo(job.trainer.output_dir, RUN_ENTRIES)  # like the SFT stage, the demo starts over each time
    if console is not None:
        r = job.rollout
        console.print(
            f"{label}: {job.trainer.steps} steps of {r.prompts_per_step} prompts x {r.n} responses "
            f"(new level-{LEVEL} {KIND} problems), reward '{job.grpo.reward}', "
            f"{HELD_OUT} held-out prompts answered {held_out_sampling(job)} before and after"
        )
    return train_grpo(job, console=console, show_progress=show_progress and console is not None)
