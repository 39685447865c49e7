"""The demo: from nothing but the install to a trained model, in a few minutes on 2 CPU cores.

    result = run_demo("runs/demo")          # `mlite demo` / `invoke demo`

Stages, each writing under the output folder:
1. data: arithmetic and word problems with checkable answers (train / held-out, parquet + JSONL; half the
   word problems' solutions stop after the working, `DEMO_UNSTATED`), and a byte-level BPE tokenizer
   trained on them (`data/`, `tokenizer/`);
2. model: a tiny Qwen3-shaped config sized to that tokenizer (`model/config.json`, random init);
3. sft: SFT on packed sequences with the `demo_sft` job preset (`sft/`: checkpoints, metrics.jsonl,
   tensorboard/, loss.png), then greedy answers to held-out questions;
4. grpo: GRPO from the SFT checkpoint with the built-in rollout and the arithmetic reward, with the
   `demo_grpo` preset (`grpo/`: checkpoint, metrics.jsonl, tensorboard/, grpo.png; see
   `mlite.trainers.grpo.demo`), held-out reward before and after;
then a short summary. Stages after SFT are `STAGES_AFTER_SFT`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from mlite.config import load_job
from mlite.config.schema import JobConfig
from mlite.errors import MliteError
from mlite.trainers.grpo import demo as grpo_demo
from mlite.trainers.run_folder import RUN_ENTRIES, claim_for_demo
from mlite.trainers.sft import SFTResult, train_sft

# Big enough to learn the answer format and the easy sums within the demo's budget, small enough for
# ~5k tokens/s on 2 CPU cores (about 1M parameters).
DEMO_MODEL = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 32, "intermediate_size": 384, "max_position_embeddings": 512}
DEMO_TRAIN_ROWS, DEMO_VAL_ROWS, DEMO_VOCAB = 4000, 200, 384
# The share of word problems whose SFT solution stops after the worked equation ("3 + 4 = 7 apples."), without
# the "The answer is 7." the reward reads, like a second data source that writes only its working. The SFT
# model copies the mix: sampling, it leaves many of its (often right) answers unstated, so the rewards of a
# group differ by a behaviour every prompt shares, and GRPO learns to state the answer within ~40 steps on
# every seed and CPU tried (held-out reward +0.24 to +0.30 in 80 steps, mostly from that, the rest more sums
# right). Without it the SFT model states every answer and GRPO can only learn arithmetic facts, slowly: a
# held-out gain of 0.04 to 0.13 that depended on the seed and the CPU (docs/GRPO.md, "The demo stage").
DEMO_UNSTATED = 0.5
# what the demo writes into its folder: data, tokenizer, model config and the stages' files (a stage's run
# folder is cleared of its run's files alone: claim_for_demo with RUN_ENTRIES)
DEMO_ENTRIES = ("data", "tokenizer", "model", *grpo_demo.DEMO_ENTRIES)


@dataclass
class DemoResult:
    output_dir: Path
    job: JobConfig
    sft: SFTResult
    seconds: float
    stages: dict = field(default_factory=dict)  # stage name -> its result, in order


def prepare_demo(out: Path, seed: int = 0, train_rows: int = DEMO_TRAIN_ROWS, val_rows: int = DEMO_VAL_ROWS,
                 unstated: float = DEMO_UNSTATED) -> dict[str, Path]:
    """Data, tokenizer and model config under `out`; returns their paths. Same files for the same seed."""
    from mlite.runtime.ckpt.hf import ARCHITECTURES
    from mlite.runtime.data.demo import write_demo_data
    from mlite.runtime.data.tokenizer import train_demo_tokenizer

    files = write_demo_data(out / "data", train=train_rows, val=val_rows, seed=seed, unstated=unstated)
    tokenizer = train_demo_tokenizer(out / "tokenizer", seed=seed, vocab_size=DEMO_VOCAB)
    config = {
        "architectures": [ARCHITECTURES["qwen3"]], "model_type": "qwen3", "vocab_size": len(tokenizer),
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
        "attention_bias": False, "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id, **DEMO_MODEL,
    }
    (out / "model").mkdir(parents=True, exist_ok=True)
    (out / "model" / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"train": files["train.parquet"], "val": files["val.parquet"], "tokenizer": out / "tokenizer",
            "model": out / "model"}


def demo_overrides(out: Path, paths: dict[str, Path], device: str = "auto") -> list[str]:
    """What turns the `demo_sft` preset into the demo's job: the generated files and the output folder."""
    # the preset describes the CPU run; on a GPU: a GPU cluster type and bf16 compute (fp32 master weights)
    gpu = ["cluster.gpu=h100", "precision.compute=bf16"] if device == "cuda" else []
    return [
        f"model.path={paths['model']}", "model.name=null", "model.load_weights=false",
        f"data.train_files=[{paths['train']}]", f"data.val_files=[{paths['val']}]",
        f"data.tokenizer={paths['tokenizer']}",
        f"trainer.output_dir={out / 'sft'}", f"trainer.device={device}", *gpu,
    ]


def demo_job(out: Path, paths: dict[str, Path], device: str = "auto",
             overrides: tuple[str, ...] = ()) -> JobConfig:
    """The `demo_sft` preset pointed at the generated files; `overrides` (key=value) come last."""
    return load_job("demo_sft", [*demo_overrides(out, paths, device), *overrides])


def describe_model(job: JobConfig) -> str:
    """The model the SFT stage trains, in one phrase: the generated Qwen3 config, or what overrides chose
    instead (`--set model.name=small-deepseek-v4`)."""
    from mlite.config.catalog import resolve_arch

    arch = resolve_arch(job.model)
    where = job.model.path if job.model.path else f"preset {job.model.name}"
    moe = f", {arch.moe.num_experts} experts" if arch.is_moe else ""
    return f"{arch.model_type}, hidden {arch.hidden}, {arch.num_layers} layers{moe} ({where})"


class DemoStage(NamedTuple):
    """A stage that runs after SFT on its result."""

    name: str
    # (demo dir, SFT result, device, console, overrides, show_progress, label) -> result; prints one line
    # starting with `label` ("4/4 grpo") that says what it runs
    run: Callable
    check: Callable[[tuple[str, ...]], None]  # refuses bad overrides (MliteError) before SFT starts


STAGES_AFTER_SFT: list[DemoStage] = [DemoStage("grpo", grpo_demo.grpo_stage, grpo_demo.check_overrides)]


def run_demo(output_dir: str | Path = "runs/demo", device: str = "auto", overrides: tuple[str, ...] = (),
             console=None, train_rows: int = DEMO_TRAIN_ROWS, show_progress: bool = True,
             stage_overrides: dict[str, tuple[str, ...]] | None = None,
             skip: frozenset[str] = frozenset()) -> DemoResult:
    """`overrides` change the SFT job; `stage_overrides[name]` the job of a stage after SFT (e.g. "grpo");
    stages named in `skip` do not run."""
    began = time.perf_counter()
    out = Path(output_dir)
    say = console.print if console is not None else (lambda *a, **k: None)
    stage_overrides = stage_overrides or {}
    unknown = sorted((set(skip) | set(stage_overrides)) - {stage.name for stage in STAGES_AFTER_SFT})
    if unknown:
        raise MliteError(f"no demo stage named {', '.join(unknown)}; "
                         f"the stages after SFT are: {', '.join(stage.name for stage in STAGES_AFTER_SFT)}")
    after_sft = [stage for stage in STAGES_AFTER_SFT if stage.name not in skip]
    for stage in after_sft:
        stage.check(stage_overrides.get(stage.name, ()))
    total = 3 + len(after_sft)
    # the demo starts over each time: it clears what its previous run wrote, and refuses folders not its own
    claim_for_demo(out, DEMO_ENTRIES)
    say(f"[bold]mlite demo[/bold] -> {out}")
    say(f"1/{total} data: generating arithmetic and word problems, training a tokenizer")
    paths = prepare_demo(out, train_rows=train_rows)
    job = demo_job(out, paths, device, overrides)
    claim_for_demo(job.trainer.output_dir, RUN_ENTRIES)
    say(f"2/{total} model: {describe_model(job)}")
    say(f"3/{total} sft: {job.trainer.steps} steps of {job.data.global_batch_size} sequences")
    sft = train_sft(job, console=console, show_progress=show_progress)
    stages = {"sft": sft, "sft_eval": held_out_accuracy(job, sft.checkpoint, paths["val"])}
    for number, stage in enumerate(after_sft, start=4):
        stages[stage.name] = stage.run(out, sft, device, console, stage_overrides.get(stage.name, ()),
                                       show_progress, label=f"{number}/{total} {stage.name}")
    return DemoResult(out, job, sft, time.perf_counter() - began, stages)


def held_out_accuracy(job: JobConfig, checkpoint: Path, val_file: Path, questions: int = 64,
                      max_new_tokens: int = 48) -> dict:
    """Greedy answers of the trained model to held-out questions, checked against the ground truth; `stated`:
    how many end in "The answer is N." at all (the form the checker and the GRPO reward read)."""
    import pyarrow.parquet as pq

    from mlite.runtime.data.demo import check_answer, extract_answer
    from mlite.runtime.data.sft import load_tokenizer
    from mlite.runtime.engine import Runtime
    from mlite.trainers.grpo.rollout import SamplingParams, generate

    runtime = Runtime(job)
    runtime.load_checkpoint(checkpoint, weights_only=True)
    runtime.eval()
    tokenizer = load_tokenizer(job.data.tokenizer)
    rows = pq.read_table(val_file).to_pylist()[:questions]
    chats = [[{"role": "user", "content": r["prompt"]}] for r in rows]
    prompts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"] for chat in chats]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                            stop_token_ids=(tokenizer.eos_token_id,))
    completions = generate(runtime.rollout_model(), prompts, params, pad_id=tokenizer.pad_token_id or 0)
    answers = [tokenizer.decode(c.response_ids, skip_special_tokens=True).strip() for c in completions]
    correct = [check_answer(a, r["answer"]) for a, r in zip(answers, rows)]
    examples = [(r["prompt"], a, ok) for r, a, ok in zip(rows, answers, correct)][:3]
    stated = sum(extract_answer(a) is not None for a in answers)
    return {"correct": sum(correct), "stated": stated, "total": len(rows), "examples": examples}


def print_demo_summary(result: DemoResult, console) -> None:
    from mlite.trainers.loop import print_summary

    console.print(f"\n[bold]demo finished in {result.seconds:.0f} s[/bold] ({result.output_dir})")
    console.print("[bold]sft[/bold]")
    print_summary(result.sft, console)
    evaluation = result.stages.get("sft_eval")
    if evaluation:
        # stated: ends in "The answer is N." at all (what the checker reads); half the SFT word problems don't
        total = evaluation["total"]
        console.print(f"held-out questions answered right (greedy): {evaluation['correct']}/{total}, "
                      f"answer stated in {evaluation['stated']}/{total}", highlight=False)
        for question, answer, ok in evaluation["examples"]:
            console.print(f"  {'ok ' if ok else 'no '} Q: {question}\n      A: {answer}", highlight=False)
    grpo = result.stages.get("grpo")
    if grpo:
        console.print("[bold]grpo[/bold] (from the SFT checkpoint)")
        print_summary(grpo, console)
