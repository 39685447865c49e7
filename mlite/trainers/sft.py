"""Supervised fine-tuning: the loop over optimizer steps, on the runtime.

    result = train_sft(job)

Each step takes this rank's micro-batches of packed sequences and the global number of target tokens,
accumulates gradients (loss = summed token NLL / global target tokens, exact over micro-batches and
ranks), clips, steps AdamW and the LR schedule, logs (JSONL, TensorBoard, progress with loss, tokens/s and
ETA) and checkpoints. Checkpoints hold everything a bitwise-equal continuation needs: model, optimizer,
schedule, data position, RNG streams, step. `trainer.resume: auto` continues from the newest good one;
SIGTERM/SIGUSR1 save at the next step boundary and return (Slurm preemption and requeue).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from mlite.config.schema import JobConfig
from mlite.errors import MliteError
from mlite.runtime.ckpt.checkpoint import CheckpointManager
from mlite.runtime.data.sft import build_sft_data
from mlite.runtime.engine import Runtime
from mlite.runtime.loss import sft_loss
from mlite.trainers.common import StopRequest, checkpoint_to_resume, first_rank
from mlite.trainers.metrics import PLOT_FILE, MetricsWriter, ProgressDisplay, plot_metrics, read_metrics

log = logging.getLogger(__name__)


@dataclass
class SFTResult:
    output_dir: Path
    start_step: int  # 0, or the step resumed from
    last_step: int  # the last finished optimizer step
    total_steps: int
    checkpoint: Path | None  # the checkpoint written last (None if none was written)
    metrics_path: Path
    plot_path: Path | None
    stopped_by: str | None = None  # the signal that ended the run early
    tokens_per_s: float = 0.0  # mean over this process's steps
    data_report: dict = field(default_factory=dict)
    is_output_rank: bool = True  # the rank that wrote metrics and prints the summary

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in read_metrics(self.metrics_path) if "loss" in r]


def train_sft(job: JobConfig, console=None, show_progress: bool = True) -> SFTResult:
    """Train (or continue training) the job; returns where everything went."""
    if job.job != "sft":
        raise MliteError(f"this job is '{job.job}'; run it with `mlite {job.job}`")
    out = Path(job.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    trainer = job.trainer

    runtime = Runtime(job)
    data = build_sft_data(job, runtime.dp_rank, runtime.dp_size)
    if first_rank() and console is not None:
        console.print(data.summary(), highlight=False)
    total_steps = trainer.steps if trainer.epochs is None else min(trainer.steps, trainer.epochs * data.steps_per_epoch)
    runtime.set_total_steps(total_steps)
    manager = CheckpointManager(out, trainer.keep_last)

    start = 0
    resume_from = checkpoint_to_resume(trainer.resume, manager)
    if resume_from is not None:
        extra = runtime.load_checkpoint(resume_from)
        start = int(extra["step"])
        data.load_state_dict(extra["data"])
        log.info("resumed from %s at step %d", resume_from, start)

    writer = MetricsWriter(out, trainer.tensorboard, resume_step=start, enabled=first_rank())
    progress = ProgressDisplay(total_steps, start, "sft", enabled=show_progress and first_rank(), console=console)
    last_saved: Path | None = resume_from  # a finished run rerun with resume=auto writes nothing new
    step, stopped_by, busy_s, tokens_seen = start, None, 0.0, 0

    def save(at: int) -> Path:
        extra = {"step": at, "data": data.state_dict()}
        return manager.save(at, lambda path: runtime.save_checkpoint(path, extra))

    runtime.train()
    with StopRequest() as stop:
        while step < total_steps:
            began = time.perf_counter()
            micro_batches, global_targets = data.next_step()
            runtime.zero_grad()
            aux_weight = 1.0 / (len(micro_batches) * runtime.dp_size)
            outs = runtime.forward_backward(micro_batches, sft_loss(global_targets, aux_weight))
            grad_norm, skipped = runtime.optimizer_step()
            lr = runtime.lr  # the lr this step used
            runtime.lr_scheduler_step()
            step += 1
            elapsed = time.perf_counter() - began
            tokens = runtime.global_sum(sum(o["num_tokens"] for o in outs))
            busy_s, tokens_seen = busy_s + elapsed, tokens_seen + tokens
            loss = runtime.global_sum(sum(o["loss"] for o in outs))
            if step % trainer.log_every == 0 or step == total_steps:
                record = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "skipped_steps": runtime.skipped_steps,
                          "tokens": int(tokens), "target_tokens": int(global_targets), "tokens_per_s": tokens / elapsed,
                          "step_time_s": elapsed, "epoch": data.epoch}
                writer.log(step, record)
                progress.update(step, loss, tokens / elapsed, "(skipped: non-finite grads)" if skipped else "")
            if trainer.eval_every and step % trainer.eval_every == 0:
                writer.log(step, evaluate(runtime, data))
            stopped = stop.should_stop(runtime.device)
            if stopped or step == total_steps or (trainer.save_every and step % trainer.save_every == 0):
                last_saved = save(step)
            if stopped:
                stopped_by = stop.received
                break
    progress.close()
    writer.close()
    plot = plot_metrics(writer.path, out / PLOT_FILE, ("loss", "val_loss"), f"SFT {out}") if first_rank() and stopped_by is None else None
    result = SFTResult(out, start, step, total_steps, last_saved, writer.path, plot, stopped_by,
                       tokens_seen / busy_s if busy_s else 0.0, data.report, is_output_rank=first_rank())
    runtime.close()
    return result


def evaluate(runtime: Runtime, data) -> dict:
    """Mean token NLL over the validation set (forward only)."""
    nll, targets = 0.0, 0
    runtime.eval()
    for micro_batches, _ in data.validation_steps():
        for out in runtime.forward_backward(micro_batches, None, forward_only=True):
            nll -= float(out["logprobs"].sum())
        targets += sum(b.num_target_tokens for b in micro_batches)
    runtime.train()
    nll, targets = runtime.global_sum(nll), runtime.global_sum(targets)
    return {"val_loss": nll / targets if targets else float("nan")}


def print_summary(result: SFTResult, console) -> None:
    """A few lines for the terminal: how the loss moved, speed, where the files are."""
    records = [r for r in read_metrics(result.metrics_path) if "loss" in r]
    if result.stopped_by:
        console.print(f"[yellow]stopped by {result.stopped_by} after step {result.last_step}/{result.total_steps}; "
                      f"checkpoint saved, rerun the same command (trainer.resume=auto) to continue[/yellow]")
    if records:
        first, last = records[0], records[-1]
        console.print(f"loss {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} (step {last['step']}), "
                      f"{result.tokens_per_s:,.0f} tokens/s", highlight=False)
    evals = [r for r in read_metrics(result.metrics_path) if "val_loss" in r]
    if evals:
        console.print(f"held-out loss {evals[-1]['val_loss']:.4f} (step {evals[-1]['step']})", highlight=False)
    console.print(f"checkpoint  {result.checkpoint}\nmetrics     {result.metrics_path}", highlight=False)
    if result.plot_path:
        console.print(f"loss curve  {result.plot_path}", highlight=False)
