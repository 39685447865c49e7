"""The GRPO stage of `mlite demo`: after SFT, reinforce correct arithmetic with the built-in rollout.

The SFT checkpoint is exported to an HF folder (what any GRPO job starts from), the demo's generated word
problems (rows carry prompt + answer) are the prompts, the demo's checker is the reward.
Held-out prompts are answered greedily before the first update and after the last: the summary prints both.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from mlite.config import load_job
from mlite.config.schema import JobConfig
from mlite.trainers.grpo.trainer import GRPOResult, train_grpo

PRESET = "demo_grpo"
# After the demo's SFT the model solves about a third of the word problems (all levels) when sampling, so
# most groups of 8 mix right and wrong answers: that is GRPO's signal. Bare arithmetic beyond one digit it
# almost never solves (all-wrong groups carry none), and the one-digit sums are nearly all in SFT's data.
KIND = "word"
HELD_OUT = 64  # held-out prompts answered greedily before and after (each costs a full generation)


def write_prompt_files(out: Path) -> dict[str, Path]:
    """The demo's generated rows (prompt + answer) of KIND, as GRPO prompt files under out/grpo_data."""
    import pyarrow.parquet as pq

    from mlite.runtime.data.demo import write_rows

    files = {}
    for split, limit in (("train", None), ("val", HELD_OUT)):
        rows = [r for r in pq.read_table(out / "data" / f"{split}.parquet").to_pylist() if r["kind"] == KIND]
        rows = [{k: r[k] for k in ("prompt", "answer", "kind", "level")} for r in rows][:limit]
        files[split] = write_rows(rows, out / "grpo_data" / f"{split}.jsonl")
    return files


def demo_grpo_job(
    out: Path, model_dir: Path, device: str = "auto", overrides: tuple[str, ...] = ()
) -> JobConfig:
    files = write_prompt_files(out)
    gpu = ["cluster.gpu=h100"] if device == "cuda" else []
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
    return "greedily" if r.val_temperature == 0 else f"{r.val_n} times each at temperature {r.val_temperature:g}"


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

    shutil.rmtree(out / "sft_hf", ignore_errors=True)  # the previous demo's export (export never overwrites)
    model_dir = export_checkpoint(sft.checkpoint, out / "sft_hf")
    job = demo_grpo_job(out, Path(model_dir), device, overrides)
    plan_job(job)
    if Path(job.trainer.output_dir).exists():  # like the SFT stage, the demo starts over each time
        shutil.rmtree(job.trainer.output_dir)
    if console is not None:
        r = job.rollout
        console.print(
            f"{label}: {job.trainer.steps} steps of {r.prompts_per_step} prompts x {r.n} responses "
            f"({KIND} problems), reward '{job.grpo.reward}', "
            f"{HELD_OUT} held-out prompts answered {held_out_sampling(job)} before and after"
        )
    return train_grpo(job, console=console, show_progress=show_progress and console is not None)
